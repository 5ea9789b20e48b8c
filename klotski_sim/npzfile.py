"""Writing the `.npz` files we hand users (routing traces, a run's routing): one zip of `.npy`
members, as `numpy.savez_compressed` writes it and `numpy.load` reads it, but at deflate level 1
and atomically (a temporary file renamed into place: an interrupted write never leaves half a file).

Why level 1: numpy's own level (zlib's default, 6) took 25.4 s to write the routing of a
16k-token prompt (the default Klotski run at prompt 16384, n = 8: 269 MB of int16 ids); at level
1 with the ids in a byte it takes 1.5 s, and the file is 6% smaller (60.6 against 64.3 MB;
`python experiments/bench_npz.py --prompt-len 16384`)."""

from __future__ import annotations

import os
import zipfile
from pathlib import Path
from typing import Mapping

import numpy as np

from .errors import UsageError

LEVEL = 1


def write_npz(path: str | Path, arrays: Mapping[str, np.ndarray], level: int | None = LEVEL) -> None:
    """Write `arrays` to `path` as an npz (no pickled objects), compressed at deflate `level`, or
    stored as they are with `level=None` (as `numpy.savez`: what is read back often, fast). The
    temporary file is this process's own: processes writing one path never share it."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    compression = zipfile.ZIP_STORED if level is None else zipfile.ZIP_DEFLATED
    try:
        with zipfile.ZipFile(tmp, "w", compression=compression, compresslevel=level) as archive:
            for name, array in arrays.items():
                with archive.open(name + ".npy", "w", force_zip64=True) as member:
                    np.lib.format.write_array(member, np.asanyarray(array), allow_pickle=False)
        tmp.replace(path)
    except OSError as err:  # (the file the user named, not our temporary one)
        raise UsageError(f"{path}: cannot write ({err.strerror or err})") from None
    finally:
        try:
            tmp.unlink(missing_ok=True)
        except OSError:
            pass
