"""An on-disk cache of synthetic routing traces, so that runs of the same workload in other
processes (sweep workers, repeated CLI runs) do not generate the same trace again.

A trace is stored under a hash of everything that determines it but its number of sequences — the
model's shape, the routing kind, the seed, the lengths, and the generator's code, its calibration
data and numpy's version (`generator_fingerprint`), so a changed generator never serves an old
trace — and that number (`<hash>-<sequences>.npz`): the generator
draws sequence i the same however many follow, so a trace of more sequences serves a run that needs
fewer (its first ones), and the workload keeps one file, its largest (an `optimize` over batch sizes,
n and expert dtypes, cold: 9 files, 69 MB before, 2 files, 19 MB now; `_family`). Files are written atomically
(`npzfile.write_npz`: a per-process temp name, then a rename) and stored uncompressed, ids in a
byte up to 256 experts, so that a run maps the ids rather than reading them (`mapped.py`: a long
prompt's routing is not held whole).
`KLOTSKI_CACHE_DIR` sets the folder (default `~/.cache/klotski`); `off` disables it. A cache that
cannot be written is simply not used. A trace it does not keep (off, not writable, larger than its
cap) is drawn into a temporary file and mapped all the same when it is large (`_unnamed_trace`).

It also keeps an uncompressed copy of a recorded trace file's large arrays (`unpacked_array`:
ids or gate weights of at least MAPPED_ABOVE bytes), decompressed once and then mapped, keyed by
the file's path, size and modification time.

The cache is bounded: `KLOTSKI_CACHE_MAX_GB` (default 2) caps its traces; the least recently used
go first, and a trace larger than the cap is not kept (a sweep over seeds and prompt lengths left
709 traces, 14 GB, in a cache without a bound).
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import stat
import tempfile
import time
import zipfile
from importlib import resources
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any, Callable, Iterator, Mapping

import numpy as np

from .errors import UsageError
from .mapped import map_stored_array, read_npy_header
from .model import ModelSpec
from .npzfile import NPZ_READ_ERRORS, Blocks, write_npz
from .trace import Trace

if TYPE_CHECKING:
    from importlib.resources.abc import Traversable

    from .trace_synth import TraceStream

DEFAULT_MAX_GB = 2.0
MAX_CACHE_GB = 1e9  # (an exabyte: no disk holds more; a cap above it means "no cap")


def cache_dir() -> Path | None:
    setting = os.environ.get("KLOTSKI_CACHE_DIR", "").strip()  # (" off" made a folder named " off")
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
    if not 0 <= gib <= MAX_CACHE_GB:  # (NaN too; 1e308 GiB was an OverflowError in bytes)
        raise UsageError(f"KLOTSKI_CACHE_MAX_GB={setting!r}: must be a number of GiB from 0 to {MAX_CACHE_GB:.0e} "
                         f"(0 keeps no trace)")
    return int(gib * 2**30)


# What a synthetic draw is made of beyond its workload: the generator's code, the routing code it
# picks top-k with, and the calibration data it is fitted to (klotski_sim/data/*.json); with numpy's
# version, whose Generator does not promise the same draws from one release to the next. (The key held
# trace_synth.py alone: a cached trace outlived an upgrade of numpy, or a change of its top-k code.)
GENERATOR_SOURCES = ("trace_synth.py", "routing.py")


def generator_fingerprint(package: Traversable | None = None) -> str:
    """A hash of everything but the workload that determines a synthetic draw (GENERATOR_SOURCES)."""
    package = package or resources.files("klotski_sim")
    digest = hashlib.sha1(np.__version__.encode())
    data = sorted((entry for entry in (package / "data").iterdir() if entry.name.endswith(".json")),
                  key=lambda entry: entry.name)
    for entry in [*(package / name for name in GENERATOR_SOURCES), *data]:
        digest.update(f"\0{entry.name}\0".encode() + entry.read_bytes())
    return digest.hexdigest()[:12]


def cached_trace(model: ModelSpec, routing: str, seed: int, sequences: int, prompt_len: int, gen_len: int,
                 make: Callable[[], Trace], stream: Callable[[], TraceStream] | None = None) -> Trace:
    """The synthetic trace for these inputs: from the cache when it is there, else made and stored.
    With `stream` (the same trace as `make`'s, drawn a chunk of sequences at a time) a trace that
    the cache can keep is written as it is drawn and then read back as a cached one is (its ids
    mapped): it is never held whole. A cached trace of more sequences of the same workload serves
    too, its first `sequences` (the generator draws sequence i the same however many follow:
    runs of other batch sizes or n share one file), and a larger one drawn replaces the smaller."""
    folder = cache_dir()
    if folder is None:
        trace = _unnamed_trace(stream()) if stream is not None else None
        return make() if trace is None else trace
    max_bytes = cache_max_bytes()
    family = _family(model, routing, seed, prompt_len, gen_len)
    path = _member(folder, family, sequences)
    for count, entry in _candidates(folder, family, sequences):
        cached = _read(entry)
        if cached is not None and _drawn_for(cached, model, count, prompt_len, gen_len):
            _touch(entry)  # (used now: the last to be evicted)
            return _as_drawn_for(cached, model, sequences)
    trace = None
    if stream is not None:
        drawn = stream()
        if _nbytes(drawn.shape, drawn.dtype) <= max_bytes and _store(path, _streamed_arrays(drawn), max_bytes):
            trace = _read(path)
        if trace is None:  # (larger than the cache, or the cache not writable)
            trace = _unnamed_trace(drawn)
    if trace is None:
        trace = make()
        if trace.experts.nbytes <= max_bytes:
            _store(path, _trace_arrays(trace.experts, trace.seq_offsets, trace.prompt_lens, trace.meta), max_bytes)
    if path.exists():  # the smaller traces of this workload: the first sequences of this one
        for entry in _members(folder, family):
            if _count(entry) < sequences:
                _remove(entry)
    if trace.experts.nbytes > max_bytes and path.parent.is_dir():  # (not kept: the cap applied all the same)
        evict(path.parent, max_bytes)
    return trace


def _family(model: ModelSpec, routing: str, seed: int, prompt_len: int, gen_len: int) -> str:
    """What names the cached traces of one workload, whatever their number of sequences: a hash of
    everything else that determines them (`generator_fingerprint` too). Of the model, the
    generator reads its layers, experts and top-k alone (and writes its name into the meta, which a
    run served from another name's trace rewrites): Mixtral-8x7B and its int4 experts share one."""
    key = json.dumps({"layers": model.num_layers, "experts": model.num_experts, "top_k": model.top_k,
                      "routing": routing, "seed": seed, "prompt_len": prompt_len, "gen_len": gen_len,
                      "code": generator_fingerprint()}, sort_keys=True)
    return hashlib.sha1(key.encode()).hexdigest()[:20]


def _member(folder: Path, family: str, sequences: int) -> Path:
    return folder / "traces" / f"{family}-{sequences}.npz"


def _count(path: Path) -> int:
    """The number of sequences a member's name says it holds."""
    return int(path.stem.rsplit("-", 1)[1])


def _members(folder: Path, family: str) -> list[Path]:
    """The cached traces of one workload (of any number of sequences)."""
    return [p for p in (folder / "traces").glob(f"{family}-*.npz") if _OWN_NAME.fullmatch(p.name)]


def _candidates(folder: Path, family: str, sequences: int) -> Iterator[tuple[int, Path]]:
    """The cached traces that could serve `sequences` of this workload, with the sequences each holds:
    its own file, then (looked for only when that one does not serve) those holding more, fewest
    first."""
    yield sequences, _member(folder, family, sequences)
    yield from sorted(m for m in ((_count(p), p) for p in _members(folder, family)) if m[0] > sequences)


def _as_drawn_for(trace: Trace, model: ModelSpec, sequences: int) -> Trace:
    """A cached synthetic trace as the generator draws it for `model` and `sequences`: its first
    `sequences` (a view of the mapped file), its meta naming that model and that many."""
    if trace.num_sequences == sequences and trace.meta.get("model") == model.name:
        return trace
    meta = {**trace.meta, "model": model.name, "generator": {**trace.meta["generator"], "sequences": sequences}}
    return Trace(trace.experts[:int(trace.seq_offsets[sequences])], trace.seq_offsets[:sequences + 1].copy(),
                 trace.prompt_lens[:sequences].copy(), meta)


def _remove(path: Path) -> bool:
    """Delete a cache file; False where it could not be (another process removed it, or the folder
    is read-only now)."""
    try:
        path.unlink()
    except OSError:
        return False
    return True


def _entry(folder: Path, key: str) -> Path:
    """The cache's file for `key` (everything that determines its contents): named by its hash."""
    return folder / "traces" / f"{hashlib.sha1(key.encode()).hexdigest()[:20]}.npz"


def _nbytes(shape: tuple[int, ...], dtype: np.dtype) -> int:
    return int(np.prod(shape, dtype=np.int64)) * dtype.itemsize


def _drawn_for(trace: Trace, model: ModelSpec, sequences: int, prompt_len: int, gen_len: int) -> bool:
    """Whether a cached trace has the shape its name says (and the generator's settings in its meta,
    which a smaller run served from it rewrites): a file replaced by another (valid) trace failed
    every later run of its configuration, without naming the cache; it is drawn again."""
    return ((trace.num_sequences, trace.num_layers, trace.top_k, trace.num_experts)
            == (sequences, model.num_layers, model.top_k, model.num_experts)
            and bool((trace.lengths == prompt_len + gen_len).all()) and bool((trace.prompt_lens == prompt_len).all())
            and isinstance(trace.meta.get("generator"), dict))


def _touch(path: Path) -> None:
    """Mark a cached file used now (eviction goes by it); a cache of another user's, or read-only,
    or a file another process has just replaced by a larger one, is used all the same."""
    try:
        os.utime(path)
    except OSError:
        pass


def _read(path: Path) -> Trace | None:
    """The cached trace at `path`, its ids mapped where they can be; None when it is not there or
    cannot be used (a truncated or invalid file is made again; anything but a regular file, which
    could block a read or point elsewhere, is passed over)."""
    try:
        if not stat.S_ISREG(os.lstat(path).st_mode):
            return None
        experts = map_stored_array(path, "experts")  # (the largest part: its pages read as a run needs them)
        with np.load(path, allow_pickle=False) as z:
            meta = json.loads(str(z["meta"]))
            return Trace(z["experts"] if experts is None else experts, z["seq_offsets"], z["prompt_lens"], meta)
    except (*NPZ_READ_ERRORS, KeyError, TypeError, MemoryError):
        return None  # not there yet, or unreadable (a truncated file is a ValueError/BadZipFile; a damaged
        # header may ask for terabytes, damaged meta be of the wrong types)


def _streamed_arrays(drawn: TraceStream) -> dict[str, np.ndarray | Blocks]:
    """A trace being drawn as the members of its file, its ids written as they are drawn."""
    return _trace_arrays(Blocks(drawn.shape, drawn.dtype, drawn.blocks), drawn.seq_offsets, drawn.prompt_lens,
                         drawn.meta)


def _unnamed_trace(drawn: TraceStream) -> Trace | None:
    """A trace of at least MAPPED_ABOVE bytes that the cache does not keep (off, not writable, or
    capped below its size) drawn into a file of a private temporary folder, mapped, and the folder
    removed at once: its routing is not held whole either (POSIX keeps a removed file's pages while
    they are mapped, and gives the space back when the run lets go of the trace). None for a smaller
    trace, on another platform, or where no temporary file can be written: the caller draws it into
    memory."""
    if os.name != "posix" or _nbytes(drawn.shape, drawn.dtype) < MAPPED_ABOVE:
        return None
    try:
        with tempfile.TemporaryDirectory(prefix="klotski-trace-") as folder:
            path = Path(folder) / "trace.npz"
            write_npz(path, _streamed_arrays(drawn), level=None)
            return _read(path)
    except (OSError, UsageError):
        return None


def _trace_arrays(experts: np.ndarray | Blocks, seq_offsets: np.ndarray, prompt_lens: np.ndarray,
                  meta: Mapping[str, Any]) -> dict[str, np.ndarray | Blocks]:
    """A cached trace's members, as `_read` reads them back."""
    return dict(experts=experts, seq_offsets=seq_offsets, prompt_lens=prompt_lens,
                meta=np.array(json.dumps(dict(meta))))


def _store(path: Path, arrays: Mapping[str, np.ndarray | Blocks], max_bytes: int) -> bool:
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
    key = json.dumps({"unpacked": os.path.realpath(path), "size": info.st_size, "mtime_ns": info.st_mtime_ns,
                      "array": name, "format": 1}, sort_keys=True)
    copy = _entry(folder, key)
    mapped = map_stored_array(copy, "a")
    if mapped is not None:
        _touch(copy)  # (used now: the last to be evicted)
        return mapped
    with zipfile.ZipFile(path) as archive, archive.open(f"{name}.npy") as member:
        shape, fortran_order, dtype = read_npy_header(member)
        nbytes = _nbytes(shape, dtype)
        if fortran_order or dtype.hasobject or not shape or not MAPPED_ABOVE <= nbytes <= max_bytes:
            return None
        if not _store(copy, {"a": Blocks(shape, dtype, _rows(member, shape, dtype))}, max_bytes):
            return None
    return map_stored_array(copy, "a")


def _rows(member: IO[bytes], shape: tuple[int, ...], dtype: np.dtype) -> Iterator[np.ndarray]:
    """The rows of an npy array's data read from `member`, a block of about _UNPACKED_BLOCK bytes
    at a time; a member that ends early is an error, as in numpy's reading."""
    row_bytes = _nbytes(shape[1:], dtype)
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
_OWN_NAME = re.compile(r"[0-9a-f]{20}(-[0-9]+)?\.npz")
_OWN_TEMP = re.compile(r"\.[0-9a-f]{20}(-[0-9]+)?\.npz\.[0-9]+\.tmp")  # `write_npz`'s temporary name of one
STALE_TEMP_S = 3600.0  # older than this, such a file is a killed write's (a trace is written as it is
# drawn: 11-12 s for the default run's at a 16k-token prompt)


def evict(folder: Path, max_bytes: int, keep: Path | None = None) -> None:
    """Delete the least recently used traces in `folder` until they take at most `max_bytes`
    (never `keep`, the one just written). Only the cache's own files, by their hashed names, count
    and go: KLOTSKI_CACHE_DIR pointed at a project whose `traces/` held the user's own .npz files
    deleted them. Another process may evict the same file: that is fine. A temporary file of a
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
        if not _OWN_NAME.fullmatch(path.name):
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
        if path != keep and _remove(path):
            total -= size
