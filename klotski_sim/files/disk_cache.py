"""The on-disk cache folder klotski keeps its large arrays in: synthetic traces (`trace_cache`) and
uncompressed, mapped copies of recorded trace files' arrays (`unpacked_array`).

`KLOTSKI_CACHE_DIR` sets the folder (default `~/.cache/klotski`); `off` disables it. A cache that
cannot be written is simply not used. `KLOTSKI_CACHE_MAX_GB` (default 2) caps it; the least
recently used files go first, and only the cache's own files (by their hashed names) are ever
deleted. Files are written atomically (`npzfile.write_npz`) and stored uncompressed so that they
can be mapped rather than read (`mapped.py`)."""

from __future__ import annotations

import hashlib
import json
import os
import re
import time
import zipfile
from pathlib import Path
from typing import IO, Iterator, Mapping

import numpy as np

from klotski_sim.files.mapped import map_stored_array, read_npy_header
from klotski_sim.files.npzfile import Blocks, write_npz
from klotski_sim.util.errors import UsageError

DEFAULT_MAX_GB = 2.0
MAX_CACHE_GB = 1e9  # (an exabyte: no disk holds more; a cap above it means "no cap")


def cache_dir() -> Path | None:
    setting = os.environ.get("KLOTSKI_CACHE_DIR", "").strip()  # (" off" is off, not a folder named " off")
    if setting.lower() == "off":
        return None
    return Path(setting) if setting else Path.home() / ".cache" / "klotski"


def cache_max_bytes() -> int:
    """The cap on the cache's traces, from `KLOTSKI_CACHE_MAX_GB` (GiB; default 2)."""
    setting = os.environ.get("KLOTSKI_CACHE_MAX_GB", "")
    try:
        gib = float(setting) if setting else DEFAULT_MAX_GB
    except ValueError:
        gib = float("nan")
    if not 0 <= gib <= MAX_CACHE_GB:  # (NaN too; 1e308 GiB overflows in bytes)
        raise UsageError(
            f"KLOTSKI_CACHE_MAX_GB={setting!r}: must be a number of GiB from 0 to {MAX_CACHE_GB:.0e} (0 keeps no trace)"
        )
    return int(gib * 2**30)


def remove(path: Path) -> bool:
    """Delete a cache file; False where it could not be (another process removed it, or the folder
    is read-only now)."""
    try:
        path.unlink()
    except OSError:
        return False
    return True


def entry_path(folder: Path, key: str) -> Path:
    """The cache's file for `key` (everything that determines its contents): named by its hash."""
    return folder / "traces" / f"{hashlib.sha1(key.encode()).hexdigest()[:20]}.npz"


def array_bytes(shape: tuple[int, ...], dtype: np.dtype) -> int:
    return int(np.prod(shape, dtype=np.int64)) * dtype.itemsize


def touch(path: Path) -> None:
    """Mark a cached file used now (eviction goes by it); a cache of another user's, or read-only,
    or a file another process has just replaced by a larger one, is used all the same."""
    try:
        os.utime(path)
    except OSError:
        pass


def store(path: Path, arrays: Mapping[str, np.ndarray | Blocks], max_bytes: int) -> bool:
    """Write `arrays` as the cache's file `path`, stored uncompressed (read back often, and mapped),
    and apply the cap; False where the cache cannot be written (it is then not used)."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        if path.is_symlink() or (path.exists() and not path.is_file() and not path.is_dir()):
            path.unlink()  # (a link's target would be written, a FIFO block: a name of the cache's is its own)
        write_npz(path, arrays, level=None)
        evict(path.parent, max_bytes, keep=path)
        return True
    except (OSError, UsageError):
        return False


# An array of routing at least this large is mapped from a file rather than held in memory: a
# recorded trace file's ids or gate weights, decompressed, are unpacked into the cache once and
# mapped from there (`unpacked_array`), and a synthetic trace the cache does not keep is drawn into
# a temporary file (`_unnamed_trace`); smaller ones are read, or drawn, into memory.
MAPPED_ABOVE = 32 << 20
_UNPACKED_BLOCK = 4 << 20  # bytes decompressed at a time into the unpacked copy


def unpacked_array(path: Path, name: str) -> np.ndarray | None:
    """Array `name` of the npz at `path` (a recorded trace, deflated) from an uncompressed copy in
    the cache, mapped: decompressed once, a block at a time, and then read by pages as a run needs
    them (a long prompt's trace is not held whole, and is not decompressed again). The copy is
    keyed by the file's real path, size and modification time, and evicted like a synthetic trace.
    None where the caller should read the array itself: the cache off, the array smaller than
    MAPPED_ABOVE or larger than the cache, in Fortran order, or the copy not writable. A damaged
    member raises as numpy's reading of it would (one of `npzfile.NPZ_READ_ERRORS`)."""
    folder = cache_dir()
    if folder is None:
        return None
    max_bytes = cache_max_bytes()  # (a bad KLOTSKI_CACHE_MAX_GB is refused here as for a synthetic run)
    info = path.stat()
    key = json.dumps(
        {
            "unpacked": os.path.realpath(path),
            "size": info.st_size,
            "mtime_ns": info.st_mtime_ns,
            "array": name,
            "format": 1,
        },
        sort_keys=True,
    )
    copy = entry_path(folder, key)
    mapped = map_stored_array(copy, "a")
    if mapped is not None:
        touch(copy)  # (used now: the last to be evicted)
        return mapped
    with zipfile.ZipFile(path) as archive, archive.open(f"{name}.npy") as member:
        shape, fortran_order, dtype = read_npy_header(member)
        nbytes = array_bytes(shape, dtype)
        if fortran_order or dtype.hasobject or not shape or not MAPPED_ABOVE <= nbytes <= max_bytes:
            return None
        if not store(copy, {"a": Blocks(shape, dtype, _rows(member, shape, dtype))}, max_bytes):
            return None
    return map_stored_array(copy, "a")


def _rows(member: IO[bytes], shape: tuple[int, ...], dtype: np.dtype) -> Iterator[np.ndarray]:
    """The rows of an npy array's data read from `member`, a block of about _UNPACKED_BLOCK bytes
    at a time; a member that ends early is an error, as in numpy's reading."""
    row_bytes = array_bytes(shape[1:], dtype)
    rows = max(1, _UNPACKED_BLOCK // max(1, row_bytes))
    left = shape[0]
    while left:
        count = min(rows, left)
        data = member.read(count * row_bytes)
        if len(data) < count * row_bytes:
            raise ValueError(f"EOF: reading array data, expected {count * row_bytes} bytes got {len(data)}")
        yield np.frombuffer(data, dtype=dtype).reshape((count,) + tuple(shape[1:]))
        left -= count


# what the cache names its files: a trace, by its workload's hash and its sequences (`_member`); an
# unpacked copy, by its key's hash (`_entry`)
OWN_NAME = re.compile(r"[0-9a-f]{20}(-[0-9]+)?\.npz")
_OWN_TEMP = re.compile(r"\.[0-9a-f]{20}(-[0-9]+)?\.npz\.[a-z0-9_]+\.tmp")  # `write_npz`'s temporary name of one
STALE_TEMP_S = 3600.0  # older than this, such a file is a killed write's (a trace is written as it is
# drawn: 11-12 s for the default run's at a 16k-token prompt)


def evict(folder: Path, max_bytes: int, keep: Path | None = None) -> None:
    """Delete the least recently used traces in `folder` until they take at most `max_bytes`
    (never `keep`, the one just written). Only the cache's own files, by their hashed names, count
    and go: KLOTSKI_CACHE_DIR may point at a folder of the user's own .npz files. Another process
    may evict the same file: that is fine. A temporary file of a
    write killed before its rename (`write_npz`'s name for one of them) goes once STALE_TEMP_S old."""
    now = time.time()
    for path in folder.glob(".*.tmp"):
        try:
            if _OWN_TEMP.fullmatch(path.name) and now - path.stat().st_mtime > STALE_TEMP_S:
                path.unlink()
        except OSError:
            continue
    entries = []
    for path in folder.glob("*.npz"):
        if not OWN_NAME.fullmatch(path.name):
            continue
        try:
            info = path.stat()
        except OSError:
            continue
        entries.append((info.st_mtime, path, info.st_size))
    total = sum(size for _, _, size in entries)
    for _, path, size in sorted(entries):
        if total <= max_bytes:
            break
        if path != keep and remove(path):
            total -= size
