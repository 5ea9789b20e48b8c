"""Text from users on a terminal: every string a command prints goes through here, so a name, a
path or a trace's metadata (`trace import --source`, a profile's `name:`, a file name) can never move
the cursor, retitle the window, ring the bell, clear the screen or reorder what is shown. Control
characters (C0 and C1, DEL) and Unicode's bidirectional overrides ("Trojan source", CVE-2021-42574)
are written as escapes; a report file says what was stored, escaped the same way where it is a text
for people (JSON escapes them itself)."""

from __future__ import annotations

from typing import Any

_CONTROLS = (*range(32), 127, *range(0x80, 0xA0))
_BIDI = (*range(0x202A, 0x202F), *range(0x2066, 0x206A), 0x200E, 0x200F, 0x061C)
_ESCAPES = {c: f"\\x{c:02x}" for c in _CONTROLS} | {c: f"\\u{c:04x}" for c in _BIDI} | {10: "\\n", 13: "\\r", 9: "\\t"}
_LINES = {c: e for c, e in _ESCAPES.items() if c not in (9, 10)}  # (a printed table keeps its newlines and tabs)


def one_line(text: str) -> str:
    """`text` as one line: every control character (a newline in a path or a name too) as an escape."""
    return text.translate(_ESCAPES)


def printable(text: str) -> str:
    """`text` as a terminal may show it: newlines and tabs kept, every other control character and
    bidirectional override as an escape."""
    return text.translate(_LINES)


class PrintableStream:
    """A text stream whose writes go through `printable` (a command's stdout and stderr)."""

    def __init__(self, stream: Any) -> None:
        self._stream = stream

    def write(self, text: str) -> int:
        self._stream.write(printable(text))
        return len(text)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._stream, name)
