"""Memory sizes, durations and counts as messages print them."""

from __future__ import annotations

import math

GIB = 2**30


def memory_text(nbytes: float) -> str:
    """A memory size for a message: GiB to two decimals, or MiB / KiB where that would print 0.00
    (a tiny model's or a small device's figures), and bytes below 10 (`1 byte`, not `0.00 KiB`)."""
    for unit, name in ((GIB, "GiB"), (2**20, "MiB"), (2**10, "KiB")):
        if abs(nbytes) >= unit / 100 or not nbytes:
            return f"{nbytes / unit:.2f} {name}"
    return f"{nbytes:g} bytes" if nbytes != 1 else "1 byte"


def counted(count: int, noun: str, plural: str | None = None) -> str:
    """`1 configuration`, `2 configurations`; `1 batch`, `2 batches` (`plural` where not noun + s)."""
    return f"{count} {noun if count == 1 else plural or noun + 's'}"


def flop_rate_text(flops_per_s: float) -> str:
    """A compute rate in TFLOP/s, or GFLOP/s where that would print 0.00 (a CPU's bf16 without
    native support: not `peak 0.00 TFLOP/s`)."""
    if flops_per_s >= 1e10:
        return f"{flops_per_s / 1e12:.2f} TFLOP/s"
    return f"{flops_per_s / 1e9:.2f} GFLOP/s"


DURATION_UNITS = (("s", 1.0), ("ms", 1e-3), ("us", 1e-6), ("ns", 1e-9))


def duration_unit(seconds: float, decimals: int = 3) -> str:
    """The unit a duration reads in: the largest of s, ms, us, ns in which it shows at least two
    significant digits to `decimals` (0.245 s, 0.017 s, 8.383 ms, 0.430 ms, 0.085 ms, 8.500 us);
    seconds for zero (and for what is not a number)."""
    if not seconds or not math.isfinite(seconds):
        return "s"
    return next((name for name, size in DURATION_UNITS if abs(seconds) >= size * 10.0 ** (1 - decimals)), "ns")


def duration_text(seconds: float, unit: str | None = None, decimals: int = 3) -> str:
    """A duration for a message, to `decimals` in `unit` (its own, `duration_unit`, when none is
    given): a nonzero duration that would show fewer than two significant digits there is printed in
    its own unit instead — a tiny run's 0.43 ms of bubbles, not `bubbles 0.000 s`."""
    sizes = dict(DURATION_UNITS)
    own = duration_unit(seconds, decimals)
    name = own if unit is None or sizes[unit] > sizes[own] else unit
    return f"{seconds / sizes[name]:.{decimals}f} {name}"


def span_text(seconds: float) -> str:
    """A long duration as an estimate or a progress line says it: 45 s, 3.2 min, 1.5 h."""
    if seconds < 60:
        return f"{seconds:.0f} s"
    if seconds < 3600:
        return f"{seconds / 60:.1f} min"
    return f"{seconds / 3600:.1f} h"
