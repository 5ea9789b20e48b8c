"""A command's output files, written all or none: each under a temporary name in the output folder,
renamed into place together once every one is whole.

A run stopped while it wrote (Ctrl-C, SIGTERM, a full disk, an error in the figure) left a half
written CSV or trace beside complete files of the earlier run into that folder: a mix that reads
as one run and is none (a CSV cut at a line's end reads back as a shorter run). Now the folder
holds, after a stop, exactly what it held before. Only SIGKILL, or a stop in the instant between
the renames, can leave a hidden temporary (`.tmp-<pid>-<name>`) or a mix.
"""

from __future__ import annotations

import os
from pathlib import Path
from types import TracebackType
from typing import Iterable


class OutputFiles:
    """Files of one command's output folder, written under temporary names (`path(name)`) and put
    in place by `commit`; left without a commit (an exception), the temporaries are removed.
    `stale` names earlier outputs of the same command that this run does not write (a figure
    skipped, a policy not compared): `commit` removes them, so the folder describes one run."""

    def __init__(self, folder: str | os.PathLike, stale: Iterable[str] = ()) -> None:
        self.folder = Path(folder)
        self._pending: dict[str, Path] = {}  # name -> its temporary file
        self._stale = list(stale)
        self.removed: list[str] = []  # (after commit) the stale names that were there and are gone

    def path(self, name: str) -> Path:
        """Where to write `name` now: a hidden temporary of the same suffix (a writer that picks its
        format by the suffix, as matplotlib and the gzip trace do, picks the same one)."""
        temporary = self.folder / f".tmp-{os.getpid()}-{name}"
        self._pending[name] = temporary
        return temporary

    def commit(self) -> list[str]:
        """Every written file into place (a rename each: atomic on one file system), then the stale
        ones removed; returns the names written, in the order they were asked for."""
        names = list(self._pending)
        for name, temporary in list(self._pending.items()):
            temporary.replace(self.folder / name)
            del self._pending[name]
        for name in self._stale:
            if name not in names and (self.folder / name).is_file():
                (self.folder / name).unlink()
                self.removed.append(name)
        return names

    def discard(self) -> None:
        """Remove the temporaries not yet committed (what a stopped run had written)."""
        for temporary in self._pending.values():
            try:
                temporary.unlink(missing_ok=True)
            except OSError:
                pass
        self._pending.clear()

    def __enter__(self) -> "OutputFiles":
        return self

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None,
                 traceback: TracebackType | None) -> None:
        self.discard()  # (after a commit: nothing left to discard)
