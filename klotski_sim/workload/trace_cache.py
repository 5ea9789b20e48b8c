"""An on-disk cache of synthetic routing traces, so that runs of the same workload in other
processes (sweep workers, repeated CLI runs) do not generate the same trace again.

A trace is stored under a hash of everything that determines it but its number of sequences — the
model's shape, the routing kind, the seed, the lengths, and the generator's code, its calibration
data and numpy's version (`generator_fingerprint`), so a changed generator never serves an old
trace — and that number (`<hash>-<sequences>.npz`): the generator
draws sequence i the same however many follow, so a trace of more sequences serves a run that needs
fewer (its first ones), and the workload keeps one file, its largest (an `optimize` over batch sizes,
n and expert dtypes, cold: 2 files, 19 MB, not 9 files, 69 MB; `_family`). Files are written atomically
(`npzfile.write_npz`: a per-process temp name, then a rename) and stored uncompressed, ids in a
byte up to 256 experts, so that a run maps the ids rather than reading them (`mapped.py`: a long
prompt's routing is not held whole).
`KLOTSKI_CACHE_DIR` sets the folder (default `~/.cache/klotski`); `off` disables it. A cache that
cannot be written is simply not used. A trace it does not keep (off, not writable, larger than its
cap) is drawn into a temporary file and mapped all the same when it is large (`_unnamed_trace`).

It also keeps an uncompressed copy of a recorded trace file's large arrays (`unpacked_array`:
ids or gate weights of at least disk_cache.MAPPED_ABOVE bytes), decompressed once and then mapped, keyed by
the file's path, size and modification time.

The cache is bounded: `KLOTSKI_CACHE_MAX_GB` (default 2) caps its traces; the least recently used
go first, and a trace larger than the cap is not kept (a sweep over seeds and prompt lengths draws
hundreds).
"""

from __future__ import annotations

import hashlib
import json
import os
import stat
import tempfile
from importlib import resources
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Iterator, Mapping

import numpy as np

from klotski_sim.files import disk_cache
from klotski_sim.files.mapped import map_stored_array
from klotski_sim.files.npzfile import NPZ_READ_ERRORS, Blocks, write_npz
from klotski_sim.util.errors import UsageError
from klotski_sim.workload.model import ModelSpec
from klotski_sim.workload.trace import Trace

if TYPE_CHECKING:
    from importlib.resources.abc import Traversable

    from klotski_sim.workload.trace_synth import TraceStream

# What a synthetic draw is made of beyond its workload: the generator's code, the routing code it
# picks top-k with, and the calibration data it is fitted to (klotski_sim/workload/data/*.json); with numpy's
# version, whose Generator does not promise the same draws from one release to the next.
GENERATOR_SOURCES = ("trace_synth.py", "routing.py")


def generator_fingerprint(package: Traversable | None = None) -> str:
    """A hash of everything but the workload that determines a synthetic draw (GENERATOR_SOURCES)."""
    package = package or resources.files("klotski_sim.workload")
    digest = hashlib.sha1(np.__version__.encode())
    data = sorted(
        (entry for entry in (package / "data").iterdir() if entry.name.endswith(".json")), key=lambda entry: entry.name
    )
    for entry in [*(package / name for name in GENERATOR_SOURCES), *data]:
        digest.update(f"\0{entry.name}\0".encode() + entry.read_bytes())
    return digest.hexdigest()[:12]


def cached_trace(
    model: ModelSpec,
    routing: str,
    seed: int,
    sequences: int,
    prompt_len: int,
    gen_len: int,
    make: Callable[[], Trace],
    stream: Callable[[], TraceStream] | None = None,
) -> Trace:
    """The synthetic trace for these inputs: from the cache when it is there, else made and stored.
    With `stream` (the same trace as `make`'s, drawn a chunk of sequences at a time) a trace that
    the cache can keep is written as it is drawn and then read back as a cached one is (its ids
    mapped): it is never held whole. A cached trace of more sequences of the same workload serves
    too, its first `sequences` (the generator draws sequence i the same however many follow:
    runs of other batch sizes or n share one file), and a larger one drawn replaces the smaller."""
    folder = disk_cache.cache_dir()
    if folder is None:
        trace = _unnamed_trace(stream()) if stream is not None else None
        return make() if trace is None else trace
    max_bytes = disk_cache.cache_max_bytes()
    family = _family(model, routing, seed, prompt_len, gen_len)
    path = _member(folder, family, sequences)
    for count, entry in _candidates(folder, family, sequences):
        cached = _read(entry)
        if cached is not None and _drawn_for(cached, model, count, prompt_len, gen_len):
            disk_cache.touch(entry)  # (used now: the last to be evicted)
            return _as_drawn_for(cached, model, sequences)
    trace = None
    if stream is not None:
        drawn = stream()
        if disk_cache.array_bytes(drawn.shape, drawn.dtype) <= max_bytes and disk_cache.store(
            path, _streamed_arrays(drawn), max_bytes
        ):
            trace = _read(path)
        if trace is None:  # (larger than the cache, or the cache not writable)
            trace = _unnamed_trace(drawn)
    if trace is None:
        trace = make()
        if trace.experts.nbytes <= max_bytes:
            disk_cache.store(
                path, _trace_arrays(trace.experts, trace.seq_offsets, trace.prompt_lens, trace.meta), max_bytes
            )
    if path.exists():  # the smaller traces of this workload: the first sequences of this one
        for entry in _members(folder, family):
            if _count(entry) < sequences:
                disk_cache.remove(entry)
    if trace.experts.nbytes > max_bytes and path.parent.is_dir():  # (not kept: the cap applied all the same)
        disk_cache.evict(path.parent, max_bytes)
    return trace


def _family(model: ModelSpec, routing: str, seed: int, prompt_len: int, gen_len: int) -> str:
    """What names the cached traces of one workload, whatever their number of sequences: a hash of
    everything else that determines them (`generator_fingerprint` too). Of the model, the
    generator reads its layers, experts and top-k alone (and writes its name into the meta, which a
    run served from another name's trace rewrites): Mixtral-8x7B and its int4 experts share one."""
    key = json.dumps(
        {
            "layers": model.num_layers,
            "experts": model.num_experts,
            "top_k": model.top_k,
            "routing": routing,
            "seed": seed,
            "prompt_len": prompt_len,
            "gen_len": gen_len,
            "code": generator_fingerprint(),
        },
        sort_keys=True,
    )
    return hashlib.sha1(key.encode()).hexdigest()[:20]


def _member(folder: Path, family: str, sequences: int) -> Path:
    return folder / "traces" / f"{family}-{sequences}.npz"


def _count(path: Path) -> int:
    """The number of sequences a member's name says it holds."""
    return int(path.stem.rsplit("-", 1)[1])


def _members(folder: Path, family: str) -> list[Path]:
    """The cached traces of one workload (of any number of sequences)."""
    return [p for p in (folder / "traces").glob(f"{family}-*.npz") if disk_cache.OWN_NAME.fullmatch(p.name)]


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
    return Trace(
        trace.experts[: int(trace.seq_offsets[sequences])],
        trace.seq_offsets[: sequences + 1].copy(),
        trace.prompt_lens[:sequences].copy(),
        meta,
    )


def _drawn_for(trace: Trace, model: ModelSpec, sequences: int, prompt_len: int, gen_len: int) -> bool:
    """Whether a cached trace has the shape its name says (and the generator's settings in its meta,
    which a smaller run served from it rewrites): a file replaced by another (valid) trace would fail
    every later run of its configuration, without naming the cache; it is drawn again instead."""
    return (
        (trace.num_sequences, trace.num_layers, trace.top_k, trace.num_experts)
        == (sequences, model.num_layers, model.top_k, model.num_experts)
        and bool((trace.lengths == prompt_len + gen_len).all())
        and bool((trace.prompt_lens == prompt_len).all())
        and isinstance(trace.meta.get("generator"), dict)
    )


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
    return _trace_arrays(
        Blocks(drawn.shape, drawn.dtype, drawn.blocks), drawn.seq_offsets, drawn.prompt_lens, drawn.meta
    )


def _unnamed_trace(drawn: TraceStream) -> Trace | None:
    """A trace of at least disk_cache.MAPPED_ABOVE bytes that the cache does not keep (off, not writable, or
    capped below its size) drawn into a file of a private temporary folder, mapped, and the folder
    removed at once: its routing is not held whole either (POSIX keeps a removed file's pages while
    they are mapped, and gives the space back when the run lets go of the trace). None for a smaller
    trace, on another platform, or where no temporary file can be written: the caller draws it into
    memory."""
    if os.name != "posix" or disk_cache.array_bytes(drawn.shape, drawn.dtype) < disk_cache.MAPPED_ABOVE:
        return None
    try:
        with tempfile.TemporaryDirectory(prefix="klotski-trace-") as folder:
            path = Path(folder) / "trace.npz"
            write_npz(path, _streamed_arrays(drawn), level=None)
            return _read(path)
    except (OSError, UsageError):
        return None


def _trace_arrays(
    experts: np.ndarray | Blocks, seq_offsets: np.ndarray, prompt_lens: np.ndarray, meta: Mapping[str, Any]
) -> dict[str, np.ndarray | Blocks]:
    """A cached trace's members, as `_read` reads them back."""
    return dict(
        experts=experts, seq_offsets=seq_offsets, prompt_lens=prompt_lens, meta=np.array(json.dumps(dict(meta)))
    )
