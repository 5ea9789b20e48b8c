"""What the commands share: their one-line error, `KEY=VALUE` flags, and the output folder made (and
removed again when empty, after an error) for a command's files."""

from __future__ import annotations

import json
import os
from contextvars import ContextVar
from pathlib import Path
from typing import Any, Sequence

from klotski_sim.util.errors import KlotskiError


class CliError(KlotskiError):
    """A user-facing error: printed as one line, exit status 2."""


def parse_overrides(items: Sequence[str], flag: str) -> dict[str, Any]:
    """`KEY=VALUE` pairs of `flag` (--set, --option); values are JSON when they parse as JSON."""
    out: dict[str, Any] = {}
    given: dict[str, str] = {}  # key -> the item as typed (`=1e9`, not `=1000000000.0`)
    for item in items:
        if "=" not in item:
            raise CliError(f"{flag}: expected KEY=VALUE, got {item!r}")
        key, value = item.split("=", 1)
        key = key.strip()
        if not key or not value.strip():  # (refused, not taken as the text "")
            raise CliError(f"{flag} {item}: expected KEY=VALUE with both given")
        if key in out:  # (else the last one silently wins)
            raise CliError(f"{flag} {key} is given twice ({given[key]} and {item.strip()})")
        given[key] = item.strip()
        try:
            out[key] = json.loads(value)
        except ValueError:  # (not JSON, or a number too long for an int: the text as it is)
            out[key] = value
    return out


# the folders the running command made for its output, resolved (`..` and links followed); set by `guarded`
made_folders: ContextVar[list[Path] | None] = ContextVar("made_folders", default=None)


def remove_empty_made_folders() -> None:
    """After an error or a stop: the output folders this command made and left empty, with the
    parents it made for them, deepest first (so that a refused run leaves no empty folder behind;
    `--out a/x/../y` makes `a`, `a/x` and `a/y`)."""
    made = made_folders.get() or []
    for folder in sorted(set(made), key=lambda folder: len(folder.parts), reverse=True):
        try:
            folder.rmdir()  # (only an empty one)
        except OSError:
            pass
    made.clear()


def output_folder(path: str | os.PathLike, flag: str = "--out") -> Path:
    """The folder a command writes to, made and checked before any work: a simulation is not run
    only to find that its results cannot be written."""
    if not str(path).strip():  # (Path("") is the current folder)
        raise CliError(f"{flag}: expected a folder, got an empty name")
    out = Path(path)
    if out.exists() and not out.is_dir():
        raise CliError(f"{flag} {out}: exists and is not a folder")
    made, missing = [], out  # (the folders this makes: `out` and its missing parents, as written)
    while not missing.exists() and missing.parent != missing:
        made.append(missing)
        missing = missing.parent
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise CliError(f"{flag} {out}: cannot create the folder ({err.strerror or err})") from None
    tracked = made_folders.get()
    if tracked is not None:
        tracked.extend(folder.resolve() for folder in made)  # (`x/..` is the folder above `x`: made once)
    probe = out / f".klotski-write-test-{os.getpid()}"
    try:
        probe.write_bytes(b"")
        probe.unlink()
    except OSError as err:
        raise CliError(f"{flag} {out}: cannot write there ({err.strerror or err})") from None
    return out
