"""Writing the `.npz` files we hand users (routing traces, a run's routing): one zip of `.npy`
members, as `numpy.savez_compressed` writes it and `numpy.load` reads it, but at deflate level 1
and atomically (a temporary file renamed into place: an interrupted write never leaves half a file).

Why level 1: numpy's own level (zlib's default, 6) takes 25.4 s to write the routing of a
16k-token prompt (the default Klotski run at prompt 16384, n = 8: 269 MB of int16 ids); at level
1 with the ids in a byte it takes 1.5 s, and the file is 6% smaller (60.6 against 64.3 MB;
`python experiments/bench_npz.py --prompt-len 16384`)."""

from __future__ import annotations

import zipfile
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Iterable, Iterator, Mapping

import numpy as np

from klotski_sim.files.mapped import in_chunks, is_mapped, read_npy_header
from klotski_sim.files.outfiles import write_file
from klotski_sim.files.textfile import regular_file_size
from klotski_sim.util.errors import KlotskiError

LEVEL = 1
_WRITTEN_BYTES = 4 << 20  # a mapped array is written at most this much at a time (numpy's buffer: 16 MB)
MAX_NPZ_BYTES = 8 << 30  # the decompressed arrays of one trace or routing file
# What reading a damaged .npz raises (by numpy, or by `check_npz`): its readers word it as such.
# (zlib.error: a deflated member whose data is damaged before its CRC is reached; RuntimeError and
# NotImplementedError: a member flagged encrypted, or compressed by a method zipfile does not read.)
NPZ_READ_ERRORS = (OSError, ValueError, EOFError, zipfile.BadZipFile, zlib.error, RuntimeError, NotImplementedError)


def check_npz(path: str | Path, what: str, error: type[KlotskiError]) -> None:
    """Refuse an .npz before numpy allocates for it: a regular file whose arrays, as their own
    headers declare them, are no larger than what its zip holds for each, and together at most
    MAX_NPZ_BYTES decompressed (a small file can declare terabytes: numpy would allocate them
    before finding the data missing). A damaged zip or header raises as numpy's reading would
    (NPZ_READ_ERRORS); a missing file, FileNotFoundError."""
    regular_file_size(path, what, error)
    with zipfile.ZipFile(path) as archive:
        infos = archive.infolist()
        declared = sum(info.file_size for info in infos)
        if declared > MAX_NPZ_BYTES:
            raise error(
                f"{path}: its arrays would take {declared / 2**30:.1f} GiB once decompressed "
                f"(at most {MAX_NPZ_BYTES / 2**30:.0f} GiB): refused before loading"
            )
        for info in infos:
            if not info.filename.endswith(".npy"):
                continue
            with archive.open(info) as member:
                shape, _, dtype = read_npy_header(member)
                header = member.tell()
            needed = int(np.prod(shape, dtype=object)) * dtype.itemsize
            if needed > info.file_size - header:
                raise error(
                    f"{path}: array {info.filename[:-4]!r} declares shape {shape} ({needed:,} bytes) but "
                    f"the file holds {max(0, info.file_size - header):,} bytes of it: truncated or corrupt"
                )


def write_npz(path: str | Path, arrays: Mapping[str, np.ndarray | Blocks], level: int | None = LEVEL) -> None:
    """Write `arrays` to `path` as an npz (no pickled objects), compressed at deflate `level`, or
    stored as they are with `level=None` (as `numpy.savez`: what is read back often, fast); an
    array given as `Blocks` is written as its blocks come. The temporary file is this process's
    own: processes writing one path never share it."""
    compression = zipfile.ZIP_STORED if level is None else zipfile.ZIP_DEFLATED

    def write(temporary: Path) -> None:
        with zipfile.ZipFile(temporary, "w", compression=compression, compresslevel=level) as archive:
            for name, array in arrays.items():
                with archive.open(name + ".npy", "w", force_zip64=True) as member:
                    _write_array(member, array if isinstance(array, Blocks) else np.asanyarray(array))

    write_file(path, write)


@dataclass(frozen=True)
class Blocks:
    """An array given as the consecutive blocks of its first axis, as they are made (a synthetic
    trace drawn into the cache a chunk of sequences at a time): written without being held whole."""

    shape: tuple[int, ...]
    dtype: np.dtype
    blocks: Iterable[np.ndarray]


def _write_array(member: IO[bytes], array: np.ndarray | Blocks) -> None:
    """`array` as `numpy.lib.format.write_array` writes it; a mapped one (a cached trace's ids, cut
    for a run) a block along its first axis at a time, each block's pages given back once written;
    `Blocks` block by block."""
    if isinstance(array, Blocks):
        _write_header(
            member,
            {
                "descr": np.lib.format.dtype_to_descr(np.dtype(array.dtype)),
                "fortran_order": False,
                "shape": tuple(array.shape),
            },
        )
        rows = 0
        for block in array.blocks:
            if block.dtype != array.dtype or block.shape[1:] != tuple(array.shape[1:]):
                raise ValueError(
                    f"a block of shape {block.shape} ({block.dtype}) in an array of {array.shape} ({array.dtype})"
                )
            member.write(np.ascontiguousarray(block).data)
            rows += len(block)
        if rows != array.shape[0]:
            raise ValueError(f"blocks of {rows} rows for an array of {array.shape[0]}")
        return
    if not is_mapped(array) or array.ndim == 0:
        np.lib.format.write_array(member, array, allow_pickle=False)
        return
    _write_header(member, np.lib.format.header_data_from_array_1_0(array))
    for part in _blocks(array, _WRITTEN_BYTES):
        member.write(part.data if part.flags.c_contiguous else part.tobytes("C"))


def _write_header(member: IO[bytes], header: dict) -> None:
    """The npy header `numpy.lib.format.write_array` writes for an array with `header`'s fields."""
    try:
        np.lib.format.write_array_header_1_0(member, header)
    except ValueError:  # (a header longer than format 1.0 holds: what write_array falls back to)
        np.lib.format.write_array_header_2_0(member, header)


def _blocks(array: np.ndarray, limit: int) -> Iterator[np.ndarray]:
    """`array` in C order as blocks of at most `limit` bytes where its rows allow (a row larger
    than that is cut the same way), each released once the loop has moved past it."""
    if array.nbytes <= limit or array.ndim == 1:
        yield array
    elif array[0].nbytes <= limit:
        yield from in_chunks(array, limit // array[0].nbytes)
    else:
        for row in array:
            yield from _blocks(row, limit)
