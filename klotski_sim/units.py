"""Memory sizes and counts as messages print them."""

from __future__ import annotations

GIB = 2**30


def memory_text(nbytes: float) -> str:
    """A memory size for a message: GiB to two decimals, or MiB / KiB where that would print 0.00
    (a tiny model's or a small device's figures), and bytes below 10 (`host.memory_bytes=1` was said
    to be `0.00 KiB`)."""
    for unit, name in ((GIB, "GiB"), (2**20, "MiB"), (2**10, "KiB")):
        if abs(nbytes) >= unit / 100 or not nbytes:
            return f"{nbytes / unit:.2f} {name}"
    return f"{nbytes:g} bytes" if nbytes != 1 else "1 byte"


def counted(count: int, noun: str, plural: str | None = None) -> str:
    """`1 configuration`, `2 configurations`; `1 batch`, `2 batches` (`plural` where not noun + s)."""
    return f"{count} {noun if count == 1 else plural or noun + 's'}"
