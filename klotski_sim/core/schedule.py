"""THE CONTRACT: a Schedule is a validated DAG of ops placed on named, in-order streams.

The simulator (engine.py) and the real runtime (klotski_runtime.executor) both execute the very
same Schedule, so it must carry everything either needs: what each op does (kind, category,
FLOPs, bytes, tiers), where it runs (stream -> resource), what it waits for (deps = CUDA events),
its tags (step, phase, layer, batches, expert, tokens) and its memory effects (GPU buffers
allocated when it starts, freed when it ends).

Stream order is list order: ops of one stream run in the order they appear in `Schedule.ops`.
"""

from __future__ import annotations

import gc
import heapq
import json
from collections import defaultdict
from contextlib import contextmanager
from dataclasses import dataclass, field
from functools import cached_property
from itertools import chain, repeat
from operator import attrgetter, itemgetter
from pathlib import Path
from typing import Any, Iterable, Iterator, Mapping, NamedTuple, Sequence

import numpy as np

from klotski_sim.files.textfile import DuplicateKeyError, read_text, unique_json_keys
from klotski_sim.names import (  # noqa: F401
    COLLECTIVE_CATEGORIES,
    COMPUTE_CATEGORIES,
    CPU_STREAMS,
    DEFAULT_STREAMS,
    HOST_STREAM,
    KINDS,
    LINK_DIRECTIONS,
    RANK_MARK,
    RESOURCES,
    TENSORS,
    TIERS,
    base_resource,
    resource_rank,
)
from klotski_sim.util.errors import KlotskiError

FORMAT = "klotski-schedule"
VERSION = 1


@contextmanager
def gc_paused() -> Iterator[None]:
    """Pause the cyclic garbage collector. Building, checking and simulating a schedule create
    hundreds of thousands of small objects and no reference cycles; the collector would only
    rescan them again and again (pausing it halves the engine's run time). What the pause leaves
    alive then moves to the oldest generation unscanned (`freeze` + `unfreeze`): a first look at a
    new schedule (every op a young object) would be a long scan for the few cycles that the next
    full collection still finds."""
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.freeze()
            gc.unfreeze()
            gc.enable()


# A worker process of ours (a sweep's, a comparison's) runs one configuration after another, each
# allocating a few hundred thousand objects and freeing them by reference counting (the engine
# breaks its own cycles). Collecting the young generation every 700k allocations instead of 700,
# the collector rarely scans them at all; cycles are still found, later. (experiments/bench_sweep.py:
# 199-211 distinct default-size configurations a minute on 2 workers, against 195-198.)
WORKER_GC_THRESHOLD = 700_000


def quiet_gc_in_worker() -> None:
    """A worker process's initializer: the young generation collected rarely (see above)."""
    gc.set_threshold(WORKER_GC_THRESHOLD, *gc.get_threshold()[1:])


class ScheduleError(KlotskiError):
    """A schedule that cannot run; the message names the offending op."""


class Op(NamedTuple):
    """One unit of work on one stream. `bytes` is the data moved (transfer) or the memory traffic
    the roofline charges (compute). `batches` lists the batches whose tokens the op touches.

    A `host` op is the host thread blocked: it begins when the host thread reaches it (its
    predecessor on the host stream has ended) and ends once its deps have ended plus its own
    latency (a `sync` waits for a GPU op; a `copy_wait` for a pageable copy). Ops issued after it
    depend on it, so a blocked host delays everything it would have issued next.
    `pageable` marks a transfer from unpinned host memory (slower, and it blocks the host);
    `variant` names how a compute op is implemented (`fused` or `eager` attention), then, joined by
    `+`, what the model adds to its kernels (`fused+qk_norm`; cost.KERNEL_TAGS).
    (A NamedTuple: immutable like a frozen dataclass, and cheap to create by the hundred thousand.)"""

    id: str
    kind: str
    stream: str
    category: str
    deps: tuple[str, ...] = ()
    flops: int = 0
    bytes: int = 0
    src: str = ""
    dst: str = ""
    step: int = -1
    phase: str = ""
    layer: int = -1
    batches: tuple[int, ...] = ()
    expert: int = -1
    tokens: int = 0
    kv_len: int = 0
    alloc: tuple[tuple[str, int], ...] = ()
    free: tuple[str, ...] = ()
    tensor: str = ""  # what a transfer carries: attention | gate | expert | kv
    pageable: bool = False  # a transfer from unpinned host memory
    variant: str = ""  # implementation of a compute op (attention: fused | eager) [+ the model's kernel tags]

    @property
    def batch(self) -> int:
        """The single batch this op belongs to, or -1 when it spans several (or none)."""
        return self.batches[0] if len(self.batches) == 1 else -1

    def to_dict(self) -> dict[str, Any]:
        """Compact JSON form: fields equal to their defaults are left out."""
        return {name: _json_lists(name, value) for name, value in _written_fields(self).items()}

    @staticmethod
    def from_dict(data: Mapping[str, Any]) -> "Op":
        """An op from its JSON form; every field's type is checked (a schedule.json is user input)."""
        if not isinstance(data, Mapping):
            raise ScheduleError(f"an op must be a JSON object, got {type(data).__name__}")
        op_id = data.get("id", "?")
        unknown = set(data) - set(Op._fields)
        if unknown:
            raise ScheduleError(f"op {op_id!r}: unknown field(s) {sorted(unknown)}")
        kwargs: dict[str, Any] = {}
        for name, value in data.items():
            kind = _FIELD_TYPES[name]
            if kind == "str":
                ok = isinstance(value, str)
            elif kind == "int":
                ok = isinstance(value, int) and not isinstance(value, bool) and abs(value) < MAX_BYTES
            elif kind == "bool":
                ok = isinstance(value, bool)
            elif kind == "strs":
                ok = isinstance(value, list) and all(isinstance(v, str) for v in value)
                value = tuple(value) if ok else value
            elif kind == "ints":
                ok = isinstance(value, list) and all(isinstance(v, int) and not isinstance(v, bool) for v in value)
                value = tuple(value) if ok else value
            else:  # alloc: [[name, bytes], ...]
                ok = isinstance(value, list) and all(
                    isinstance(a, list)
                    and len(a) == 2
                    and isinstance(a[0], str)
                    and isinstance(a[1], int)
                    and not isinstance(a[1], bool)
                    for a in value
                )
                value = tuple((a[0], a[1]) for a in value) if ok else value
            if not ok:
                raise ScheduleError(f"op {op_id!r}: field {name!r} must be {_TYPE_TEXT[kind]}, got {value!r:.60}")
            kwargs[name] = value
        missing = [name for name in ("id", "kind", "stream", "category") if name not in kwargs]
        if missing:
            raise ScheduleError(f"op {op_id!r}: missing field(s) {missing}")
        return Op(**kwargs)


_ALWAYS_WRITTEN = object()  # (the "default" of id, kind, stream and category: no value equals it)
_DEFAULTS = tuple(Op._field_defaults.get(name, _ALWAYS_WRITTEN) for name in Op._fields)


def _written_fields(op: Op) -> dict[str, Any]:
    """The fields of an op that its JSON form holds: those that differ from their defaults, in
    field order (tuples as they are: JSON writes them as arrays, as it writes lists)."""
    return {name: value for name, value, default in zip(Op._fields, op, _DEFAULTS) if value != default}


def _json_lists(name: str, value: Any) -> Any:
    """A field's value with its tuples as lists (alloc: a list of [name, bytes] lists)."""
    if name == "alloc":
        return [list(a) for a in value]
    return list(value) if isinstance(value, tuple) else value


_FIELD_TYPES = {
    "id": "str",
    "kind": "str",
    "stream": "str",
    "category": "str",
    "deps": "strs",
    "flops": "int",
    "bytes": "int",
    "src": "str",
    "dst": "str",
    "step": "int",
    "phase": "str",
    "layer": "int",
    "batches": "ints",
    "expert": "int",
    "tokens": "int",
    "kv_len": "int",
    "alloc": "alloc",
    "free": "strs",
    "tensor": "str",
    "pageable": "bool",
    "variant": "str",
}
_TYPE_TEXT = {
    "str": "a string",
    "int": "an integer",
    "bool": "true or false",
    "strs": "a list of strings",
    "ints": "a list of integers",
    "alloc": "a list of [name, bytes] pairs",
}


@dataclass(frozen=True)
class Schedule:
    """A validated DAG of ops. `streams` maps each stream to its resource; `preloaded` lists the
    GPU buffers resident before the first op (embeddings, resident layers); `meta` says what the
    schedule is of (policy, model, batch configuration, generated tokens)."""

    ops: tuple[Op, ...]
    streams: Mapping[str, str] = field(default_factory=lambda: dict(DEFAULT_STREAMS))
    preloaded: tuple[tuple[str, int], ...] = ()
    meta: Mapping[str, Any] = field(default_factory=dict)
    validate: bool = field(default=True, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "ops", tuple(self.ops))
        object.__setattr__(self, "preloaded", tuple((str(n), int(b)) for n, b in self.preloaded))
        if self.validate:
            with gc_paused():
                self.check()

    # ---- derived views ---------------------------------------------------------------------
    @cached_property
    def index(self) -> dict[str, int]:
        """op id -> position in `ops`."""
        return {op.id: i for i, op in enumerate(self.ops)}

    @cached_property
    def _columns(self) -> dict[str, list[Any]]:
        return {}

    def column(self, field_name: str) -> list[Any]:
        """One field of every op, in op order, kept once made: the check, the engine and the
        timeline read the same few (at 300k ops each pass over the ops costs tens of ms; each
        kept column ~8 bytes an op)."""
        values = self._columns.get(field_name)
        if values is None:
            values = self._columns[field_name] = list(map(attrgetter(field_name), self.ops))
        return values

    def kept_columns(self) -> Mapping[str, list[Any]]:
        """The columns `column` has kept so far: for a reader that must not keep the schedule (and
        its dependency graph, ~150 bytes an op) alive, as a timeline must not."""
        return self._columns

    def __len__(self) -> int:
        return len(self.ops)

    def op(self, op_id: str) -> Op:
        return self.ops[self.index[op_id]]

    @property
    def generated_tokens(self) -> int:
        return int(self.meta.get("generated_tokens", 0))

    # ---- validation ------------------------------------------------------------------------
    def check(self) -> None:
        """Reject what cannot run: duplicate ids, unknown streams/deps, bad sizes, deps that
        contradict stream order, and cycles. Every message names the op. (The dependency graph
        built on the way is kept: the engine and the runtime use it.)"""
        for stream, resource in self.streams.items():
            if base_resource(resource) not in RESOURCES or (RANK_MARK in resource and resource_rank(resource) < 0):
                raise ScheduleError(
                    f"stream {stream!r} maps to unknown resource {resource!r}; resources: {', '.join(RESOURCES)} "
                    f"(one rank's own: NAME{RANK_MARK}RANK, e.g. gpu{RANK_MARK}1)"
                )
        ops = self.ops
        # every op's fields checked, and the few that the rest of the check reads taken on the way
        # (while the op is at hand: at 300k ops a pass over them costs a cache miss per op), with
        # those a timeline's summary reads; an op is checked against what its resource is, whichever
        # rank's it is
        kinds_of = {stream: base_resource(resource) for stream, resource in self.streams.items()}
        taken = list(map(_check_op_fields, ops, repeat(kinds_of)))
        ids = list(map(itemgetter(0), taken))
        for k, name in enumerate(_TAKEN_COLUMNS, start=2):
            self._columns[name] = list(map(itemgetter(k), taken))
        deps = list(map(itemgetter(1), taken))
        del taken
        hashed = _hashed(ids)
        if not _surely_unique(hashed[0]):  # a duplicate id (or two ids of one hash): find the first, for the message
            seen: dict[str, int] = {}
            for i, op_id in enumerate(ids):
                if op_id in seen:
                    raise ScheduleError(f"duplicate op id {op_id!r} (positions {seen[op_id]} and {i})")
                seen[op_id] = i
        graph = dependency_arrays(ops, deps, ids, self.column("stream"), checked=False, hashed=hashed)  # (an unknown
        # dep: a ScheduleError naming the op)
        for name, size in self.preloaded:  # (10**30 preloaded bytes would overflow the timeline's memory trace)
            if not 0 <= size < MAX_BYTES:  # (an int: __post_init__ made it one)
                raise ScheduleError(
                    f"preloaded buffer {name!r} has size {size}: give a number of bytes from 0 to 2**62 - 1"
                )
        preloaded = [name for name, _ in self.preloaded]
        allocs = list(filter(None, self.column("alloc")))
        allocated = set(preloaded).union(map(itemgetter(0), chain.from_iterable(allocs)))
        if len(allocated) < len(preloaded) + sum(map(len, allocs)):  # a buffer allocated twice: name it
            allocated = set()
            for name in preloaded:
                if name in allocated:
                    raise ScheduleError(f"buffer {name!r} is preloaded twice")
                allocated.add(name)
            for op in ops:
                for name, _ in op.alloc:
                    if name in allocated:
                        raise ScheduleError(f"op {op.id!r} allocates buffer {name!r}, which is already allocated")
                    allocated.add(name)
        if any(RANK_MARK in resource for resource in self.streams.values()):  # GPU memory is per rank
            unranked = next((name for name in sorted(allocated) if resource_rank(name) < 0), None)
            if unranked is not None:
                raise ScheduleError(
                    f"buffer {unranked!r}: a schedule of several ranks keeps each GPU buffer on one rank's GPU, "
                    f"named NAME{RANK_MARK}RANK"
                )
        freed = list(chain.from_iterable(self.column("free")))
        if not allocated.issuperset(freed):
            for op in ops:
                for name in op.free:
                    if name not in allocated:
                        raise ScheduleError(f"op {op.id!r} frees buffer {name!r}, which no op allocates")
        if len(set(freed)) < len(freed):  # (else the runtime drops it twice silently, the engine stops at the second)
            freed_by: dict[str, str] = {}
            for op in ops:
                for name in op.free:
                    if name in freed_by:
                        raise ScheduleError(
                            f"op {op.id!r} frees buffer {name!r}, which op {freed_by[name]!r} "
                            f"frees too (a buffer is freed once)"
                        )
                    freed_by[name] = op.id
        self.__dict__["graph"] = graph  # (`index` is not kept: few users need it, and it costs ~50 bytes an op)
        if not graph.forward:
            return  # every dep is on an earlier op: list order is a topological order, no cycle
        for i, d in graph.forward:  # a dep on a later op of the same stream contradicts stream order
            op, dep = ops[i], ops[d]
            if d == i:
                raise ScheduleError(f"op {op.id!r} depends on itself")
            if dep.stream == op.stream:
                raise ScheduleError(
                    f"op {op.id!r} depends on {dep.id!r}, which comes later on the same in-order "
                    f"stream {op.stream!r}: the dependency contradicts stream order"
                )
        cycle = find_cycle(ops, graph)
        if cycle:
            raise ScheduleError("schedule has a cycle (deps + stream order): " + " -> ".join(cycle))

    @cached_property
    def graph(self) -> "Graph":
        """Successors and predecessor counts of every op (built once, by `check`)."""
        return dependency_arrays(self.ops, self.column("deps"), self.column("id"), self.column("stream"))

    # ---- serialisation ---------------------------------------------------------------------
    def _json_header(self) -> dict[str, Any]:
        return {
            "format": FORMAT,
            "version": VERSION,
            "meta": dict(self.meta),
            "streams": dict(self.streams),
            "preloaded": [list(b) for b in self.preloaded],
        }

    def to_json_dict(self) -> dict[str, Any]:
        return {**self._json_header(), "ops": [op.to_dict() for op in self.ops]}

    def json_pieces(self, ops_per_piece: int = 20_000) -> Iterator[str]:
        """The compact JSON text of `to_json_dict` (the same characters), in pieces of
        `ops_per_piece` ops: a default as-published schedule (338k ops, 62 MB of text) as one
        dict per op and one string takes 6.6 s and 210 MB more memory than its schedule."""
        compact = (",", ":")
        yield json.dumps(self._json_header(), separators=compact)[:-1] + ',"ops":['
        for lo in range(0, len(self.ops), ops_per_piece):
            text = json.dumps(list(map(_written_fields, self.ops[lo : lo + ops_per_piece])), separators=compact)
            yield text[1:-1] if lo == 0 else "," + text[1:-1]
        yield "]}"

    def save(self, path: str | Path) -> None:
        with gc_paused(), Path(path).open("w", encoding="utf-8") as f:  # (JSON's escapes keep the text ASCII)
            f.writelines(self.json_pieces())

    @staticmethod
    def from_json_dict(data: Any, where: str = "schedule") -> "Schedule":
        if not isinstance(data, dict) or data.get("format") != FORMAT:
            found = (
                f"format {data['format']!r}"
                if isinstance(data, dict) and "format" in data
                else "no format key"
                if isinstance(data, dict)
                else f"a JSON {type(data).__name__}"
            )
            raise ScheduleError(f"{where}: not a klotski schedule ({found}; expected format {FORMAT!r})")
        if data.get("version") != VERSION or isinstance(data.get("version"), bool):  # (true == 1)
            raise ScheduleError(f"{where}: schedule format version {data.get('version')!r}, expected {VERSION}")
        unknown = set(data) - {"format", "version", "meta", "streams", "preloaded", "ops"}
        if unknown:
            raise ScheduleError(f"{where}: unknown key(s) {sorted(unknown)}")
        for key, kind in (("ops", list), ("streams", dict), ("preloaded", list), ("meta", dict)):
            if key in data and not isinstance(data[key], kind):
                raise ScheduleError(f"{where}: {key!r} must be a JSON {'array' if kind is list else 'object'}")
        if "ops" not in data or "streams" not in data:
            raise ScheduleError(f"{where}: missing key {'ops' if 'ops' not in data else 'streams'!r}")
        if not all(isinstance(k, str) and isinstance(v, str) for k, v in data["streams"].items()):
            raise ScheduleError(f"{where}: streams must map stream names to resource names")
        preloaded = data.get("preloaded", [])
        if not all(
            isinstance(b, list)
            and len(b) == 2
            and isinstance(b[0], str)
            and isinstance(b[1], int)
            and not isinstance(b[1], bool)
            and b[1] >= 0
            for b in preloaded
        ):
            raise ScheduleError(f"{where}: preloaded must be a list of [name, bytes] pairs")
        _check_meta(data.get("meta", {}), where)
        try:
            ops = [Op.from_dict(o) for o in data["ops"]]
        except ScheduleError as err:
            raise ScheduleError(f"{where}: {err}") from None
        try:  # (the check's errors name the op, not the file)
            return Schedule(
                ops=tuple(ops),
                streams=dict(data["streams"]),
                preloaded=tuple(tuple(b) for b in preloaded),
                meta=dict(data.get("meta", {})),
            )
        except ScheduleError as err:
            raise ScheduleError(f"{where}: {err}") from None

    @staticmethod
    def load(path: str | Path) -> "Schedule":
        """A schedule from its JSON file, the collector paused while its hundreds of thousands of
        small objects are made (a default as-published schedule, 338k ops: 5.2 s with it, 3.2 s without)."""
        path = Path(path)
        with gc_paused():
            text = read_text(path, "schedule", ScheduleError)
            try:
                data = json.loads(text, object_pairs_hook=unique_json_keys)
            except DuplicateKeyError as err:
                raise ScheduleError(f"{path}: {err} in one JSON object (JSON would keep the last)") from None
            except ValueError as err:  # (JSONDecodeError, or a number too long for an int: 4300 digits)
                raise ScheduleError(f"{path}: not valid JSON, truncated or corrupt ({err})") from None
            except RecursionError:
                raise ScheduleError(f"{path}: not a klotski schedule (JSON nested too deeply)") from None
            return Schedule.from_json_dict(data, str(path))


_META_TEXT = ("policy", "model", "hardware", "routing", "impl")
_META_COUNTS = ("batch_size", "num_batches", "prompt_len", "gen_len", "generated_tokens")
_META_OBJECTS = ("placement", "options", "rung", "prefetch")


def _check_meta(meta: Mapping[str, Any], where: str) -> None:
    """The meta fields the tools read, where a schedule file gives them, of the types they are
    read as (meta is otherwise free: a hand-made schedule may say anything else there): a
    hand-edited `placement: null` or `generated_tokens: "x"` would fail deep in the runtime."""

    def refuse(key: str, expected: str) -> None:
        raise ScheduleError(f"{where}: meta.{key} must be {expected}, got {meta[key]!r:.60}")

    for key in _META_TEXT:
        if key in meta and not isinstance(meta[key], str) and not (key == "routing" and meta[key] is None):
            refuse(key, "a model preset's name" if key == "model" else "a string")

    def count(value: Any) -> bool:
        return isinstance(value, int) and not isinstance(value, bool) and value >= 0

    for key in _META_COUNTS:
        if key in meta and not count(meta[key]):
            refuse(key, "an integer >= 0")
    for key in _META_OBJECTS:
        if key in meta and not isinstance(meta[key], dict):
            refuse(key, "a JSON object")
    layers = meta.get("placement", {}).get("resident_layers", 0)
    if not count(layers):
        raise ScheduleError(f"{where}: meta.placement.resident_layers must be an integer >= 0, got {layers!r:.60}")
    pinned = meta.get("resident_weights", [])
    if not isinstance(pinned, list) or not all(
        isinstance(k, list)
        and len(k) == 3
        and isinstance(k[0], str)
        and all(isinstance(i, int) and not isinstance(i, bool) for i in k[1:])
        for k in pinned
    ):
        refuse("resident_weights", "a list of [tensor, layer, expert] triples")


MAX_BYTES = 1 << 62  # sizes, bytes and FLOPs below this (what a schedule file's integers are held to): 2**62 bytes
# is 4 EiB, and numpy's int64 arrays of them (the memory trace, the cost model) hold their sums


def check_foreign(schedule: "Schedule", where: str) -> None:
    """What the check trusts of the package's own builders but not of a schedule from outside it (a
    policy file's): its meta of the types the tools read, and every op's counts within `MAX_BYTES`
    (10**400 bytes would overflow the cost model: a traceback). A schedule file's are checked as it is
    read (`Op.from_dict`, `_check_meta`)."""
    _check_meta(schedule.meta, where)
    for op in schedule.ops:
        for name in ("flops", "bytes", "tokens", "kv_len"):
            value = getattr(op, name)
            if not isinstance(value, int) or isinstance(value, bool) or not 0 <= value < MAX_BYTES:
                raise ScheduleError(
                    f"{where}: op {op.id!r}: {name} must be an integer from 0 to 2**62 - 1, got {value!r:.60}"
                )


_TAKEN_COLUMNS = ("stream", "alloc", "free", "category", "step", "layer", "batches")  # after id and deps


def _check_op_fields(op: Op, streams: Mapping[str, str]) -> tuple[Any, ...]:
    """Reject an op whose fields cannot run; return its id, deps and `_TAKEN_COLUMNS` (what the rest
    of the schedule's check reads, and a timeline's summary)."""
    # (the fields unpacked once: a schedule's every op passes here, and attribute access costs more)
    (
        op_id,
        kind,
        stream,
        category,
        deps,
        flops,
        nbytes,
        src,
        dst,
        step,
        _,
        layer,
        batches,
        expert,
        tokens,
        kv_len,
        alloc,
        free,
        tensor,
        pageable,
        _,
    ) = op
    if not isinstance(op_id, str) or not op_id:
        raise ScheduleError(f"op id must be a non-empty string, got {op_id!r}")
    if kind not in KINDS:
        raise ScheduleError(f"op {op_id!r}: kind {kind!r} is not one of {KINDS}")
    resource = streams.get(stream)
    if resource is None:
        raise ScheduleError(f"op {op_id!r}: stream {stream!r} is not declared (streams: {', '.join(streams)})")
    if flops < 0 or nbytes < 0 or tokens < 0 or kv_len < 0:  # (one test on the common path)
        for name in ("flops", "bytes", "tokens", "kv_len"):
            if getattr(op, name) < 0:
                raise ScheduleError(f"op {op_id!r}: {name} must be >= 0, got {getattr(op, name)}")
    if step < -1 or layer < -1 or expert < -1:
        for name in ("step", "layer", "expert"):
            if getattr(op, name) < -1:
                raise ScheduleError(f"op {op_id!r}: {name} must be >= 0 (or -1: none), got {getattr(op, name)}")
    if batches and min(batches) < 0:
        raise ScheduleError(f"op {op_id!r}: batches must be >= 0, got {list(batches)}")
    if tensor not in TENSORS:
        raise ScheduleError(f"op {op_id!r}: tensor {tensor!r} is not one of {TENSORS[1:]}")
    if kind == "transfer":
        if nbytes <= 0:
            raise ScheduleError(f"op {op_id!r}: a transfer must move a positive number of bytes, got {nbytes}")
        if src not in TIERS or dst not in TIERS or src == dst:
            raise ScheduleError(
                f"op {op_id!r}: transfer needs distinct src/dst tiers from {TIERS}, got {src!r} -> {dst!r}"
            )
        if resource in ("gpu", "host", "cpu"):
            raise ScheduleError(f"op {op_id!r}: transfer placed on {resource} stream {stream!r}")
        if LINK_DIRECTIONS[resource] != (src, dst):
            there = LINK_DIRECTIONS[resource]
            raise ScheduleError(
                f"op {op_id!r}: a {src} -> {dst} copy placed on stream {stream!r}, which maps to "
                f"{resource}: that link carries {there[0]} -> {there[1]} copies"
            )
    elif kind == "host":
        if resource != "host":
            raise ScheduleError(f"op {op_id!r}: host op placed on {resource} stream {stream!r}")
        if alloc or free:
            raise ScheduleError(f"op {op_id!r}: a host op cannot allocate or free GPU buffers")
    elif resource not in ("gpu", "cpu", "gpu_decompress", "fabric"):
        raise ScheduleError(f"op {op_id!r}: compute op placed on {resource} stream {stream!r}")
    elif (resource == "fabric") != (category in COLLECTIVE_CATEGORIES):
        raise ScheduleError(
            f"op {op_id!r}: category {category!r} on {resource} stream {stream!r}: the fabric runs collectives "
            f"(category {' or '.join(COLLECTIVE_CATEGORIES)}) and nothing else runs them"
        )
    elif resource == "cpu" and alloc:
        raise ScheduleError(f"op {op_id!r}: a CPU compute op cannot allocate GPU buffers")
    if pageable and kind != "transfer":
        raise ScheduleError(f"op {op_id!r}: only a transfer can be pageable")
    for name, size in alloc:
        if type(size) is not int or not 0 <= size < MAX_BYTES:  # (a policy's NaN size: a traceback at the timeline)
            raise ScheduleError(
                f"op {op_id!r}: buffer {name!r} has size {size!r}: give a number of bytes from 0 to 2**62 - 1"
            )
    return op_id, deps, stream, alloc, free, category, step, layer, batches


class Graph(NamedTuple):
    """The dependency graph in compressed form: the successors of op i (its dependents and its
    stream successor, in schedule order) are `flat[ptr[i]:ptr[i + 1]]`; `indegree[i]` counts its
    predecessors; `forward` lists the (op, dep) index pairs whose dep is not before the op in list order."""

    ptr: list[int]
    flat: list[int]
    indegree: list[int]
    forward: list[tuple[int, int]]


def dependency_arrays(
    ops: Sequence[Op],
    deps: Sequence[tuple[str, ...]],
    ids: Sequence[str],
    streams: Sequence[str],
    checked: bool = True,
    hashed: tuple[np.ndarray, np.ndarray] | None = None,
) -> Graph:
    """The graph of `ops` (`deps`, `ids` and `streams`: the deps, the id and the stream of each, ids
    unique; `hashed`: the ids' `_hashed`, if made), built with numpy (the one graph the checker, the
    engine and the runtime use). With `checked=False` (the schedule's own check, which has not yet
    looked at the deps) a dep on an unknown op is a ScheduleError naming both."""
    n = len(ops)
    if n == 0:
        return Graph([0], [], [], [])
    dep_counts = np.fromiter(map(len, deps), dtype=np.int64, count=n)
    try:
        dep_src = dep_positions(ids, deps, int(dep_counts.sum()), hashed)
    except (KeyError, TypeError):
        if checked:
            raise
        text = next((op for op in ops if isinstance(op.deps, str)), None)
        if text is not None:  # (else a string's characters are taken for deps: "depends on unknown op 'b'")
            raise ScheduleError(f"op {text.id!r}: deps must be a tuple of op ids, got the string {text.deps!r:.60}")
        position = dict(zip(ids, range(n)))
        op, dep = next((op, d) for op in ops for d in op.deps if not isinstance(d, str) or d not in position)
        raise ScheduleError(f"op {op.id!r} depends on unknown op {dep!r}") from None
    dep_dst = np.repeat(np.arange(n, dtype=np.int64), dep_counts)
    later = np.flatnonzero(dep_src >= dep_dst)
    forward = list(zip(dep_dst[later].tolist(), dep_src[later].tolist()))
    # stream order: each op follows the previous op of its stream
    stream_hashes = np.fromiter(map(hash, streams), dtype=np.int64, count=n)
    if len(dep_src) > _PRUNED_ABOVE * n and not len(later):
        dep_src, dep_dst = _latest_per_stream(dep_src, dep_dst, stream_hashes, n)
    order = np.argsort(stream_hashes, kind="stable")  # by stream, list order within a stream
    same = stream_hashes[order[1:]] == stream_hashes[order[:-1]]
    stream_src, stream_dst = order[:-1][same], order[1:][same]
    src = np.concatenate([dep_src, stream_src])
    dst = np.concatenate([dep_dst, stream_dst])
    by_src = np.lexsort((dst, src))  # successors in schedule order (the engine breaks ties by it)
    ptr = np.zeros(n + 1, dtype=np.int64)
    np.cumsum(np.bincount(src, minlength=n), out=ptr[1:])
    indegree = np.bincount(dst, minlength=n)
    return Graph(ptr.tolist(), dst[by_src].tolist(), indegree.tolist(), forward)


def _hashed(ids: Sequence[str]) -> tuple[np.ndarray, np.ndarray]:
    """The ids' hashes sorted, and the order that sorts them (what `_surely_unique` and
    `dep_positions` both read: the check makes them once)."""
    hashes = np.fromiter(map(hash, ids), dtype=np.int64, count=len(ids))
    order = np.argsort(hashes)
    return hashes[order], order


def _surely_unique(by_hash: np.ndarray) -> bool:
    """True when no two ids are equal: their hashes (`_hashed`) all differ (False may also be two
    ids of one hash; the caller then compares them). A dict of the ids takes three times as long."""
    return not np.any(by_hash[1:] == by_hash[:-1])


def dep_positions(
    ids: Sequence[str], deps: Sequence[tuple[str, ...]], count: int, hashed: tuple[np.ndarray, np.ndarray] | None = None
) -> np.ndarray:
    """The position in `ids` (unique) of every dep, in order (`count` deps in all); KeyError for a
    dep that names no op. Each dep's hash is looked up among the ids' (`hashed`, made here if not
    given) with numpy, and the id found there checked equal to the dep; a dep without an equal id
    there (no such op, or two ids of one hash) goes through a dict. (At 338k ops and 500k deps a
    dict of the ids takes 1.3x as long.)"""
    n = len(ids)
    by_hash, order = hashed if hashed is not None else _hashed(ids)
    flat = list(chain.from_iterable(deps))
    wanted = np.fromiter(map(hash, flat), dtype=np.int64, count=count)
    # looked up in hash order, the deps walk the ids' hashes once (in dep order they miss the cache:
    # 1.5-2x the time)
    by_wanted = np.argsort(wanted)
    at = np.empty(count, dtype=np.int64)
    at[by_wanted] = np.searchsorted(by_hash, wanted[by_wanted])
    positions = order[np.minimum(at, n - 1)]
    found = np.fromiter(ids, dtype=object, count=n)[positions].tolist()
    if found != flat:
        others = [k for k, (op_id, dep) in enumerate(zip(found, flat)) if op_id != dep]
        position = dict(zip(ids, range(n)))
        positions[others] = np.fromiter(
            map(position.__getitem__, map(flat.__getitem__, others)), dtype=np.int64, count=len(others)
        )
    return positions


# Above this many deps per op (a hand-made schedule's disk read waiting for each of a layer's copies;
# the policies name the latest copy per stream themselves, policies/base.py `_stage`), an op's deps on
# one stream are kept in the graph as the latest of them alone (`_latest_per_stream`).
_PRUNED_ABOVE = 4


def _latest_per_stream(
    dep_src: np.ndarray, dep_dst: np.ndarray, stream_hashes: np.ndarray, n: int
) -> tuple[np.ndarray, np.ndarray]:
    """Of an op's deps on one stream, the latest in list order alone: streams are in order, so it
    ends last and its end implies the others' (its end is the latest, so ready time, signalling
    latency and the dep that made the op ready are the same), and Kahn's order is the same. The
    schedule's ops keep every dep they name; only the graph the engine and the runtime walk is
    smaller. (Every dep before its op in list order: the caller's condition.)"""
    _, stream_of = np.unique(stream_hashes, return_inverse=True)
    streams = int(stream_of.max()) + 1
    keys = np.sort((dep_dst * streams + stream_of[dep_src]) * n + dep_src)  # (dst, dep's stream, dep)
    group = keys // n
    last = np.append(group[1:] != group[:-1], True)  # the latest dep of each (op, stream)
    kept = keys[last]
    return kept % n, kept // n // streams


def topological_order(schedule: "Schedule") -> list[int]:
    """An issue order that respects deps and stream order, schedule order breaking ties (how the
    CUDA runtime enqueues ops, so that every event it waits on has been recorded)."""
    ptr, flat, indegree, _ = schedule.graph
    pending = list(indegree)
    ready = [i for i, p in enumerate(pending) if p == 0]
    heapq.heapify(ready)
    order = []
    while ready:
        i = heapq.heappop(ready)
        order.append(i)
        for s in flat[ptr[i] : ptr[i + 1]]:
            pending[s] -= 1
            if pending[s] == 0:
                heapq.heappush(ready, s)
    return order


def find_cycle(ops: Sequence[Op], graph: Graph) -> list[str]:
    """An op-id cycle in `graph` (deps plus stream order), or [] when there is none (Kahn's
    algorithm on integer indices)."""
    n = len(ops)
    succs = [graph.flat[graph.ptr[i] : graph.ptr[i + 1]] for i in range(n)]
    indegree = list(graph.indegree)
    queue = [i for i in range(n) if indegree[i] == 0]
    seen = 0
    while queue:
        i = queue.pop()
        seen += 1
        for s in succs[i]:
            indegree[s] -= 1
            if indegree[s] == 0:
                queue.append(s)
    if seen == n:
        return []
    # Walk predecessors among the stuck ops until one repeats: that is a cycle.
    stuck = {i for i in range(n) if indegree[i] > 0}
    preds: dict[int, list[int]] = defaultdict(list)
    for i in stuck:
        for s in succs[i]:
            preds[s].append(i)
    node = min(stuck)
    path: list[int] = []
    on_path: dict[int, int] = {}
    while node not in on_path:
        on_path[node] = len(path)
        path.append(node)
        node = next(p for p in preds[node] if p in stuck)
    cycle = path[on_path[node] :] + [node]
    return [ops[i].id for i in reversed(cycle)]


def clean_deps(deps: Iterable[str | None]) -> tuple[str, ...]:
    """Each dep once, in order, without the Nones that "no such op" leaves in a dep list."""
    if not deps:
        return ()
    if type(deps) is list and len(deps) == 1:  # the common case, without building a dict
        return () if deps[0] is None else (deps[0],)
    unique: dict[Any, None] = dict.fromkeys(deps)
    unique.pop(None, None)
    return tuple(unique)


_new_tuple = tuple.__new__
_AFTER_DEPS = tuple(Op._field_defaults[name] for name in Op._fields[5:])  # Op's defaults after id..deps


def compute_op(
    op_id: str,
    category: str,
    deps: tuple[str, ...],
    flops: int,
    nbytes: int,
    step: int,
    phase: str,
    layer: int,
    batches: tuple[int, ...],
    expert: int,
    tokens: int,
    kv_len: int,
    alloc: tuple[tuple[str, int], ...],
    free: tuple[str, ...],
    variant: str,
    stream: str = "compute",
) -> Op:
    """A compute op built positionally, in Op's field order (no src/dst/tensor/pageable): a
    policy loop makes tens of thousands, and keywords cost twice as much."""
    return _new_tuple(
        Op,
        (
            op_id,
            "compute",
            stream,
            category,
            deps,
            flops,
            nbytes,
            "",
            "",
            step,
            phase,
            layer,
            batches,
            expert,
            tokens,
            kv_len,
            alloc,
            free,
            "",
            False,
            variant,
        ),
    )


def transfer_op(
    op_id: str,
    category: str,
    stream: str,
    nbytes: int,
    src: str,
    dst: str,
    deps: tuple[str, ...],
    step: int,
    layer: int,
    expert: int,
    tensor: str,
    pageable: bool,
    alloc: tuple[tuple[str, int], ...],
    free: tuple[str, ...],
) -> Op:
    """A transfer op built positionally, in Op's field order (no phase, batches or tokens): the
    weight loads of a policy loop, as `compute_op` builds its compute ops."""
    return _new_tuple(
        Op,
        (
            op_id,
            "transfer",
            stream,
            category,
            deps,
            0,
            nbytes,
            src,
            dst,
            step,
            "",
            layer,
            (),
            expert,
            0,
            0,
            alloc,
            free,
            tensor,
            pageable,
            "",
        ),
    )


def host_op(op_id: str, category: str, deps: tuple[str, ...]) -> Op:
    """A host op built positionally (every field after its deps at its default), as `compute_op`."""
    return _new_tuple(Op, (op_id, "host", HOST_STREAM, category, deps) + _AFTER_DEPS)


class ScheduleBuilder:
    """Appends ops in issue order and hands back their ids; policies use it to read like the
    paper's loops (`b.transfer(...)`, `b.compute(...)`) without bookkeeping."""

    def __init__(self, streams: Mapping[str, str] | None = None) -> None:
        self.streams = dict(streams or DEFAULT_STREAMS)
        self.ops: list[Op] = []
        self.preloaded: list[tuple[str, int]] = []
        self._barrier: str | None = None  # the latest host op: ops issued after it wait for it
        self._past_barrier: set[str] = set()  # streams whose next op already waits for it
        self._last_on_stream: dict[str, str] = {}

    def add(
        self, op_id: str, kind: str, stream: str, category: str, deps: Iterable[str | None] = (), **tags: Any
    ) -> str:
        """Append an op (a duplicate id is reported by `build`, which validates the whole schedule)."""
        if not tags:  # (most host waits: every field after the deps at its default, without keywords)
            return self.append(_new_tuple(Op, (op_id, kind, stream, category, clean_deps(deps)) + _AFTER_DEPS))
        return self.append(Op(op_id, kind, stream, category, clean_deps(deps), **tags))

    def append(self, op: Op) -> str:
        """Append a ready-made op whose deps are clean (`clean_deps`): the policies' hot path builds
        its ops positionally (`compute_op`), which costs half of `add`'s keywords."""
        stream = op.stream
        if self._barrier is not None and stream not in self._past_barrier:
            # issued after the host was blocked: the first op of each stream waits for the host
            # (later ones follow it in stream order)
            self._past_barrier.add(stream)
            if self._barrier not in op.deps:  # (Op's deps are its fifth field; _replace costs 6x this)
                op = _new_tuple(Op, op[:4] + (op.deps + (self._barrier,),) + op[5:])
        self.ops.append(op)
        self._last_on_stream[stream] = op.id
        return op.id

    def append_after_syncs(self, pairs: Sequence[tuple[Op, Op]]) -> str:
        """Pairs of a host sync and the op it holds back, each op naming its sync among its deps:
        issued as `host_wait` then `append` would issue them (the host stream is always past its
        latest barrier, and each op names the barrier it is past), in one pass for the chains of
        as-published expert loops. Returns the last op's id."""
        ops = self.ops
        for sync, op in pairs:
            ops.append(sync)
            ops.append(op)
        sync, op = pairs[-1]
        self._barrier = sync.id
        self._past_barrier = {HOST_STREAM, op.stream}
        self._last_on_stream[HOST_STREAM] = sync.id
        self._last_on_stream[op.stream] = op.id
        return op.id

    def last_issued(self) -> list[str]:
        """The latest op of every stream but the host's: what a device-wide synchronise waits for."""
        return [op for stream, op in self._last_on_stream.items() if stream != HOST_STREAM]

    def host_wait(self, op_id: str, category: str, waits_for: Iterable[str | None], **tags: Any) -> str:
        """The host thread blocks until `waits_for` have ended (`sync`: a host synchronisation;
        `copy_wait`: a pageable copy). Every op added after this one waits for it."""
        op = self.add(op_id, "host", HOST_STREAM, category, waits_for, **tags)
        self._barrier = op
        self._past_barrier = {HOST_STREAM}
        return op

    def compute(
        self, op_id: str, category: str, deps: Iterable[str | None] = (), stream: str = "compute", **tags: Any
    ) -> str:
        return self.add(op_id, "compute", stream, category, deps, **tags)

    def transfer(
        self,
        op_id: str,
        category: str,
        stream: str,
        nbytes: int,
        src: str,
        dst: str,
        deps: Iterable[str | None] = (),
        **tags: Any,
    ) -> str:
        return self.add(op_id, "transfer", stream, category, deps, bytes=int(nbytes), src=src, dst=dst, **tags)

    def preload(self, name: str, nbytes: int) -> None:
        self.preloaded.append((name, int(nbytes)))

    def build(self, meta: Mapping[str, Any]) -> Schedule:
        return Schedule(ops=tuple(self.ops), streams=self.streams, preloaded=tuple(self.preloaded), meta=meta)
