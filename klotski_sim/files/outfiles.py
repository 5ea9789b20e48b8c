"""A command's output files, written all or none: each under a temporary name in the output folder,
renamed into place together once every one is whole.

Every output goes through here, and so is safe on a shared machine (a lab server, a cluster scratch
folder): a temporary is created by `tempfile.mkstemp` (O_EXCL: never an existing file or a link
someone planted; an unpredictable name), and an output whose final name is a symbolic link is
refused unless the user asks for it (`--follow-symlinks`): else a link planted where a run will
write would have it overwrite the link's target, another user's file.

Written in place, a run stopped while it writes (Ctrl-C, SIGTERM, a full disk, an error in the
figure) would leave a half written CSV or trace beside complete files of an earlier run: a mix that
reads as one run and is none (a CSV cut at a line's end reads back as a shorter run). So the folder
holds, after a stop, exactly what it held before, and two runs into one folder at once leave one
run's files, the later one's. Only SIGKILL can leave a hidden temporary (`.tmp-<pid>-<name>`, or
`.old-<pid>-<name>` during the renames), or a mix when it comes in the instant between them.
"""

from __future__ import annotations

import errno
import os
import re
import secrets
import shutil
import tempfile
from contextlib import contextmanager
from pathlib import Path
from types import TracebackType
from typing import Callable, Iterable, Iterator

from klotski_sim.util.errors import UsageError
from klotski_sim.util.stopping import signals_deferred

_follow_symlinks = False  # (a process-wide choice: the CLIs set it from --follow-symlinks; forked workers inherit it)


def follow_symlinks(enabled: bool) -> None:
    """Whether an output whose final name is a symbolic link is written through it (`--follow-symlinks`)."""
    global _follow_symlinks
    _follow_symlinks = bool(enabled)


def refuse_link(path: str | os.PathLike, named: str) -> None:
    """Refuse to write through a symbolic link at `path` (its last component) unless asked to."""
    if not _follow_symlinks and os.path.islink(path):
        raise UsageError(
            f"{named}: is a symbolic link (to {os.readlink(os.fspath(path))}); outputs are not written through links "
            f"unless you ask for it with --follow-symlinks"
        )


_UMASK = os.umask(0)
os.umask(_UMASK)


def temporary_beside(folder: str | os.PathLike, prefix: str, suffix: str) -> Path:
    """A new empty file of our own in `folder` under an unpredictable name (`tempfile.mkstemp`:
    created exclusively, never a file or link already there), with the permissions a new file gets
    (mkstemp's own are 0600: the user's umask decides, as for a file written in place)."""
    descriptor, name = tempfile.mkstemp(dir=folder, prefix=prefix, suffix=suffix)
    try:
        os.fchmod(descriptor, 0o666 & ~_UMASK)
    finally:
        os.close(descriptor)
    return Path(name)


def refuse_unwritable(folder: str | os.PathLike, names: Iterable[str], flag: str = "--out") -> None:
    """Refuse, before any work, an output folder where one of the files a command writes is a
    folder or another non-file (else found at the end, after the whole run: pyarrow's `Expected
    file path, but ... is a directory`, with the files written before it left in place), or a
    symbolic link not asked to be followed."""
    for name in names:
        target = Path(folder) / name
        refuse_link(target, f"{flag} {folder}: {target}")
        if target.exists() and not target.is_file():
            what = "a folder" if target.is_dir() else "not a regular file"
            raise UsageError(f"{flag} {folder}: {target} is {what}; cannot write {name} there")


def failure_reason(error: OSError) -> str:
    """What went wrong, in the system's words ("No space left on device"), also where the writer
    named no errno (pyarrow: "Error writing bytes to file. Detail: [errno 28] No space left ...")."""
    if error.errno:
        return os.strerror(error.errno)
    found = re.search(r"\[errno (\d+)\]", str(error), re.IGNORECASE)
    return os.strerror(int(found.group(1))) if found else str(error) or type(error).__name__


def write_file(path: str | os.PathLike, write: Callable[[Path], object], flag: str = "") -> None:
    """One file written whole or not at all: `write(temporary)` writes a hidden temporary beside
    `path` (created exclusively under an unpredictable name), renamed onto it once whole (a link,
    with --follow-symlinks: its target replaced, the link kept; without, refused). Written in
    place, a full disk or a stop would leave a cut file that reads back as a shorter one (a
    calibrated profile without its last rows); this way `path` holds what it held before, no
    temporary is left, and the failure is one line naming `flag` and the file."""
    named = f"{flag} {path}" if flag else str(path)
    refuse_link(path, named)
    target = Path(os.path.realpath(path))
    if target.exists() and not target.is_file():  # (the rename would put a file where a pipe or a device was)
        raise UsageError(f"{named}: cannot write, it is not a regular file")
    temporary = None
    try:
        # (".tmp" last: a writer that picks its format by the name's suffix, as pandas' to_csv does its
        # compression, is told the format)
        with signals_deferred():  # (a stop while it is made would leave it behind with no name kept here)
            temporary = temporary_beside(target.parent, f".{target.name}.", ".tmp")
        if target.exists():
            shutil.copymode(target, temporary)  # (its permissions kept, as a write in place keeps them)
        write(temporary)
        temporary.replace(target)
    except OSError as err:  # (the file the user named, not our temporary one)
        raise UsageError(f"{named}: cannot write ({failure_reason(err)})") from None
    finally:
        try:
            if temporary is not None:
                temporary.unlink(missing_ok=True)
        except OSError:
            pass


def _move(temporary: Path, target: Path) -> None:
    """A file into its place: renamed, or copied where the target is on another file system (a link
    to elsewhere)."""
    try:
        temporary.replace(target)
    except OSError as err:
        if err.errno != errno.EXDEV:
            raise
        shutil.copyfile(temporary, target)
        temporary.unlink()


def _kept(target: Path) -> Path:
    """What `target` holds, kept under another name until the commit is done: a hard link (no copy),
    or a copy where the file system has none."""
    while True:  # (an unpredictable name, taken only where nothing is: a link fails on an existing name)
        earlier = target.with_name(f".old-{secrets.token_hex(8)}-{target.name}")
        try:
            os.link(target, earlier)
            return earlier
        except FileExistsError:
            continue
        except OSError:
            break
    os.close(os.open(earlier, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0), 0o600))
    try:
        shutil.copy2(target, earlier)
    except OSError:  # (a full disk: no half copy left behind; the commit is undone by its caller)
        earlier.unlink(missing_ok=True)
        raise
    return earlier


def _put_back(target: Path, earlier: Path | None) -> None:
    """Undo a commit's move into `target`: what it held before back (`earlier`), or nothing."""
    try:
        if earlier is not None:
            earlier.replace(target)
            earlier.unlink(missing_ok=True)  # (still there when the target was never replaced: renaming a
            # hard link onto another link of the same file does nothing)
        else:
            target.unlink(missing_ok=True)
    except OSError:  # (as much as can be undone is)
        pass


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
        temporary = self._pending.get(name)
        if temporary is None:  # (asked again: the same one)
            with signals_deferred():  # (named in `_pending` before a stop: discarded with the others)
                temporary = self._pending[name] = temporary_beside(self.folder, ".tmp-", f"-{name}")
        return temporary

    def commit(self) -> list[str]:
        """Every written file into place (a rename each: atomic on one file system; a link's target
        replaced, the link kept, as the files were written before), then the stale ones removed;
        returns the names written, in the order they were asked for. A target that is not a file
        is refused before the first rename; one that cannot be replaced (a link into a missing
        folder, a file another user owns in a sticky folder) undoes the renames before it, each
        earlier file put back from a hard link made just before its rename, and is said in one line."""
        names = list(self._pending)
        refuse_unwritable(self.folder, names)
        # (two runs into one folder: one's set after the other's, never mixed; a stop meanwhile, after them)
        with signals_deferred(), _folder_locked(self.folder):
            done: list[tuple[Path, Path | None]] = []  # (target, a link to what it held before, if anything)
            try:
                for name, temporary in self._pending.items():
                    target = Path(os.path.realpath(self.folder / name))
                    earlier = None
                    if target.exists():
                        earlier = _kept(target)
                        shutil.copymode(target, temporary)  # (its permissions kept, as a write in place keeps them)
                    done.append((target, earlier))
                    _move(temporary, target)
            except OSError as err:
                for target, earlier in reversed(done):
                    _put_back(target, earlier)
                raise self._not_written(name, err) from None
            for _, earlier in done:
                if earlier is not None:
                    earlier.unlink(missing_ok=True)
            self._pending.clear()
            for name in self._stale:
                stale = self.folder / name
                if name not in names and (stale.is_file() or stale.is_symlink()):  # (a link: itself, dangling too)
                    stale.unlink()
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

    def __exit__(
        self, kind: type[BaseException] | None, error: BaseException | None, traceback: TracebackType | None
    ) -> None:
        written = {str(temporary): name for name, temporary in self._pending.items()}
        self.discard()  # (after a commit: nothing left to discard)
        if not isinstance(error, OSError):
            return
        # a failed write said of the file the user will look for, not of our temporary, also where the
        # writer names no file (pyarrow's "[Errno 28] Error writing bytes to file. Detail: ...")
        name = written.get(str(error.filename)) or (  # (a writer names no file: the one asked for last,
            # being written: a command asks for its files one after another)
            list(written.values())[-1] if written and error.errno in (errno.ENOSPC, errno.EDQUOT, errno.EFBIG) else None
        )
        if name is not None:  # (any other OSError is not ours to word)
            raise self._not_written(name, error) from None

    def _not_written(self, name: str, error: OSError) -> UsageError:
        """One line for a file this folder did not take (its earlier files all in place)."""
        return UsageError(f"{self.folder}: cannot write {name} ({failure_reason(error)}); the folder is as it was")
