"""Reading a file a user hands us (a schedule, a routing log, a profile, a sweep spec, an .npz):
whatever is wrong with the file itself — missing, unreadable, not a regular file, too large, not
UTF-8 text — is one line naming it, found before anything is read."""

from __future__ import annotations

import os
import stat
from pathlib import Path
from typing import Any

from klotski_sim.util.errors import KlotskiError

# A schedule.json or a routing log larger than this is refused before it is read: parsing JSON
# takes about ten times its size in memory (a default as-published schedule, 338k ops, is 62 MB).
MAX_JSON_BYTES = 2 << 30


def regular_file_size(
    path: str | Path, what: str, error: type[KlotskiError] = KlotskiError, max_bytes: int | None = None
) -> int:
    """The size of `path`, refused unless it is a regular file of at most `max_bytes`: a device
    (/dev/zero) would be read until memory runs out, a pipe would block. A missing file raises
    FileNotFoundError, for the caller to word."""
    status = os.stat(path)
    if stat.S_ISDIR(status.st_mode):
        raise error(f"{path}: is a directory, not a {what}")
    if not stat.S_ISREG(status.st_mode):
        raise error(f"{path}: not a regular file (a device or a pipe?), so not a {what}")
    size = status.st_size
    if max_bytes is not None and size > max_bytes:
        raise error(
            f"{path}: {size:,} bytes is too large for a {what} (at most {max_bytes:,}): refused before reading it"
        )
    return size


def read_text(
    path: str | Path, what: str, error: type[KlotskiError] = KlotskiError, max_bytes: int = MAX_JSON_BYTES
) -> str:
    """The file's text; `what` says what it should have been ("schedule", "profile"). A byte-order
    mark, which editors on Windows write, is dropped (JSON would refuse it where YAML reads past it)."""
    path = Path(path)
    try:
        regular_file_size(path, what, error, max_bytes)
        return path.read_text(encoding="utf-8-sig")
    except OSError as err:
        raise error(f"{path}: cannot read {what} ({err.strerror or err})") from None
    except UnicodeDecodeError as err:
        raise error(f"{path}: cannot read {what}: not a text file (byte {err.start} is not UTF-8)") from None


class DuplicateKeyError(ValueError):
    """A JSON object with a key given twice (a ValueError, as json's own errors are)."""


def unique_json_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    """A JSON object whose keys are each given once (`object_pairs_hook`; json keeps the last of a
    repeated one: a schedule's `"ops"` given twice, the second empty, would be a schedule of no ops)."""
    record = dict(pairs)
    if len(record) < len(pairs):
        twice = next(key for k, (key, _) in enumerate(pairs) if key in dict(pairs[:k]))
        raise DuplicateKeyError(f"key {twice!r} is given twice")
    return record
