"""A command's output files, written all or none: each under a temporary name in the output folder,
renamed into place together once every one is whole.

A run stopped while it wrote (Ctrl-C, SIGTERM, a full disk, an error in the figure) left a half
written CSV or trace beside complete files of the earlier run into that folder: a mix that reads
as one run and is none (a CSV cut at a line's end reads back as a shorter run). Now the folder
holds, after a stop, exactly what it held before, and two runs into one folder at once leave one
run's files, the later one's. Only SIGKILL can leave a hidden temporary (`.tmp-<pid>-<name>`), or
a mix when it comes in the instant between the renames.
"""

from __future__ import annotations

import os
import shutil
from contextlib import contextmanager
from pathlib import Path
from types import TracebackType
from typing import Iterable, Iterator

from .errors import UsageError
from .stopping import signals_deferred


def refuse_unwritable(folder: str | os.PathLike, names: Iterable[str], flag: str = "--out") -> None:
    """Refuse, before any work, an output folder where one of the files a command writes is a
    folder or another non-file (found at the end, after the whole run: pyarrow's `Expected file
    path, but ... is a directory`, with the files written before it left in place)."""
    for name in names:
        target = Path(folder) / name
        if target.exists() and not target.is_file():
            what = "a folder" if target.is_dir() else "not a regular file"
            raise UsageError(f"{flag} {folder}: {target} is {what}; cannot write {name} there")


@contextmanager
def _folder_locked(folder: Path) -> Iterator[None]:
    """An exclusive lock on the folder itself (flock on its descriptor: no lock file left behind),
    where the platform has one; other processes committing into it wait their turn."""
    try:
        import fcntl
    except ImportError:  # (Windows: commits unserialised)
        yield
        return
    descriptor = os.open(folder, os.O_RDONLY)
    try:
        fcntl.flock(descriptor, fcntl.LOCK_EX)
        yield
    finally:
        os.close(descriptor)  # (the lock goes with it)


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
        """Every written file into place (a rename each: atomic on one file system; a link's target
        replaced, the link kept, as the files were written before), then the stale ones removed;
        returns the names written, in the order they were asked for. A target that cannot take
        its file is refused before the first rename."""
        names = list(self._pending)
        refuse_unwritable(self.folder, names)
        # (two runs into one folder: one's set after the other's, never mixed; a stop meanwhile, after them)
        with signals_deferred(), _folder_locked(self.folder):
            for name, temporary in list(self._pending.items()):
                target = Path(os.path.realpath(self.folder / name))
                try:
                    temporary.replace(target)
                except OSError:  # (a link to another file system: copied there)
                    shutil.copyfile(temporary, target)
                    temporary.unlink()
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
        written = {str(temporary): name for name, temporary in self._pending.items()}
        self.discard()  # (after a commit: nothing left to discard)
        if isinstance(error, OSError) and str(error.filename) in written:  # (a full disk: said of the file the
            # user will look for, not of our temporary; any other OSError is not ours to word)
            reason = error.strerror or str(error) or type(error).__name__
            raise UsageError(f"{self.folder}: cannot write {written[str(error.filename)]} ({reason})") from None
