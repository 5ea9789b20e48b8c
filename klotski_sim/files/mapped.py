"""Arrays read from a file's pages rather than copied into memory, and passes over them that give
the pages back as they go.

Why: a long prompt's routing is the largest thing a run holds (a 16k-token prompt's ids: 134 MB),
yet a run only ever needs a bounded slice of it at once (counts per batch, a sequence's pair
counts, a chunk written to routing.npz). The trace cache stores its ids uncompressed, so they can
be mapped instead of read; each pass over them then `release`s what it has read, and the process
holds a chunk, not the whole routing. (Released pages are read again from the page cache if a
later pass needs them: correctness never depends on it.)
"""

from __future__ import annotations

import mmap
import struct
import zipfile
from pathlib import Path
from typing import IO, Iterator

import numpy as np

_LOCAL_HEADER = struct.Struct("<4s22xHH")  # a zip member's local header: signature, ..., name and extra lengths
_PAGE = mmap.PAGESIZE
# (where the platform has no madvise, e.g. Windows, a mapping is read as any and never released)
_DONTNEED = getattr(mmap, "MADV_DONTNEED", None) if hasattr(mmap.mmap, "madvise") else None


def map_stored_array(path: str | Path, name: str) -> np.ndarray | None:
    """The array `name` of the npz at `path`, mapped read-only, when the zip stores it uncompressed
    in C order (as the trace cache writes it); None when it cannot be mapped (the caller reads it
    as numpy does, with numpy's errors for a damaged file)."""
    try:
        with open(path, "rb") as file, zipfile.ZipFile(file) as archive:
            info = archive.getinfo(f"{name}.npy")
            if info.compress_type != zipfile.ZIP_STORED:
                return None
            file.seek(info.header_offset)
            signature, name_len, extra_len = _LOCAL_HEADER.unpack(file.read(_LOCAL_HEADER.size))
            if signature != b"PK\x03\x04":
                return None
            data = info.header_offset + _LOCAL_HEADER.size + name_len + extra_len
            file.seek(data)
            shape, fortran_order, dtype = read_npy_header(file)
            start = file.tell()
            count = int(np.prod(shape, dtype=np.int64))
            if fortran_order or dtype.hasobject or start - data + count * dtype.itemsize > info.file_size:
                return None
            if count == 0:  # (nothing to map; read-only as a mapped one is)
                empty = np.empty(shape, dtype=dtype)
                empty.flags.writeable = False
                return empty
            pages = mmap.mmap(file.fileno(), 0, access=mmap.ACCESS_READ)  # (kept open by the array)
        return np.frombuffer(pages, dtype=dtype, count=count, offset=start).reshape(shape)
    except Exception:  # noqa: BLE001 - whatever it is, numpy's reading of the file says it in the user's terms
        return None


def read_npy_header(file: IO[bytes]) -> tuple[tuple[int, ...], bool, np.dtype]:
    """The shape, Fortran order and dtype an `.npy` header at the file's position declares (the
    file left at the array's first byte), without reading the array."""
    version = np.lib.format.read_magic(file)
    read_header = np.lib.format.read_array_header_1_0 if version == (1, 0) else np.lib.format.read_array_header_2_0
    return read_header(file)


def is_mapped(array: np.ndarray) -> bool:
    """Whether `array` is (a view of) a mapped file, whose passes should `release` as they go."""
    return _mapping(array) is not None


def _mapping(array: np.ndarray) -> mmap.mmap | None:
    """The file mapping `array` is a view of, if any."""
    base: object = array  # (what an array views: another array, a buffer such as a memoryview, or None)
    while isinstance(base, np.ndarray):
        base = base.base
    if isinstance(base, memoryview):  # (how numpy holds the buffer it was given)
        base = base.obj
    return base if isinstance(base, mmap.mmap) else None


def release(view: np.ndarray) -> None:
    """Give back the pages of a mapped file that `view` spans (nothing for an array in memory): a
    pass calls it on each chunk once done with it."""
    pages = _mapping(view)
    if pages is None or view.size == 0 or pages.closed or _DONTNEED is None:
        return
    origin = np.frombuffer(pages, dtype=np.uint8, count=1).ctypes.data
    low = high = view.ctypes.data
    for size, stride in zip(view.shape, view.strides):
        reach = (size - 1) * stride
        low, high = (low + reach, high) if reach < 0 else (low, high + reach)
    start = (low - origin) // _PAGE * _PAGE
    end = min(len(pages), high + view.itemsize - origin)
    if end > start:
        pages.madvise(_DONTNEED, start, end - start)


def in_chunks(array: np.ndarray, rows: int) -> Iterator[np.ndarray]:
    """`array` a block of `rows` along its first axis at a time, each released once the loop has
    moved past it."""
    for low in range(0, len(array), max(1, rows)):
        part = array[low : low + rows]
        yield part
        release(part)
