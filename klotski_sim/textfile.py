"""Reading a text file a user hands us (a schedule, a trace log, a profile, a sweep spec): whatever
is wrong with the file itself — missing, unreadable, not UTF-8 text — is one line naming it."""

from __future__ import annotations

from pathlib import Path

from .errors import KlotskiError


def read_text(path: str | Path, what: str, error: type[KlotskiError] = KlotskiError) -> str:
    """The file's text; `what` says what it should have been ("schedule", "profile")."""
    path = Path(path)
    try:
        return path.read_text(encoding="utf-8")
    except OSError as err:
        raise error(f"{path}: cannot read {what} ({err.strerror or err})") from None
    except UnicodeDecodeError as err:
        raise error(f"{path}: cannot read {what}: not a text file (byte {err.start} is not UTF-8)") from None
