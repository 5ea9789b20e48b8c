"""Execute a *serving* Schedule (`klotski-sim serve`'s kept run) for real and measure it.

A serving Schedule has no fixed batches: each iteration computes its own mix of prefill chunks
and decode tokens, which `meta.iterations` lists per iteration as `[request, new_tokens, context,
prefill, samples]` (context: the request's cached tokens once the iteration's new tokens are in).
The runner here gives each op of that schedule its real effect, and the offline executor's
drivers (`executor._run_cpu`: a thread per stream, links emulated on the CPU; `executor._run_cuda`:
a CUDA stream per schedule stream) run and time them, so both runtimes schedule alike:

- `embed` embeds each request's new tokens (its prompt, drawn at random and kept, then the
  tokens it sampled); `attention` runs per request over its own KV cache, a buffer per request and
  layer that grows by the new tokens (causal within a prefill chunk); a request whose new tokens
  start at position 0 again was preempted: its cache is dropped and recomputed;
- `gate` routes for real (the model's router on the hidden states, no trace), and the fused `moe`
  computes every expert the routing activates, from the weights where the policy keeps them:
  resident, in the layer's block that `decompress` (the compressed GPU tier, decoded for real by
  `lossless.decode`) and the expert `copy` (pinned host memory) fill, in a whole layer a `load`
  brought (vLLM-O), or on the host CPU between two activation copies (KTransformers);
- `lm_head` samples (argmax) a token for each request that samples; `sync` is the host waiting.

Bytes moved are the schedule's: a copy moves exactly its op's bytes (a layer's experts are one
flat buffer: the compressed share decodes its first bytes, the copy brings the rest), a decompress
decodes its op's bytes (rounded up to a whole bf16 value), a whole-layer load the layer's tensors.
`runner.moved` records them per op. The iterations run back to back: an online run's idle time
waiting for arrivals has no op and is not reproduced.
"""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from klotski_sim.core.schedule import Op, Schedule, ScheduleError
from klotski_sim.core.timeline import Timeline
from klotski_sim.workload.model import ModelSpec

from . import kernels, lossless
from .executor import ExecOptions, ExecutionError, PinnedPool, check_emulation, measure_run, refuse_a_gpu_group
from .kernels import WeightStore

# what the serving runner executes, by op kind: compute categories, and what a transfer carries
SERVING_COMPUTE = ("embed", "attention", "gate", "dense_mlp", "moe", "combine", "lm_head", "decompress", "remap")
SERVING_TENSORS = ("expert", "activation", "")  # "" : a whole layer's weights (vLLM-O's `load`)
SERVING_RESOURCES = ("gpu", "gpu_decompress", "pcie_h2d", "pcie_d2h", "host", "cpu")
# compute ops over every new token of their iteration
_OVER_NEW_TOKENS = frozenset({"embed", "attention", "gate", "dense_mlp", "combine"})


@dataclass(frozen=True)
class Scheduled:
    """One request's share of one iteration (`meta.iterations`)."""

    request: int
    new_tokens: int
    context: int
    prefill: bool
    samples: bool

    @property
    def start(self) -> int:
        """Position of its first new token (0 again after a preemption: recomputed)."""
        return self.context - self.new_tokens


@dataclass(frozen=True)
class Composition:
    """What every iteration computes, by the `step` its ops carry."""

    by_step: Mapping[int, tuple[Scheduled, ...]]

    def tokens(self, step: int) -> int:
        return sum(s.new_tokens for s in self.by_step[step])

    def samples(self, step: int) -> int:
        return sum(s.samples for s in self.by_step[step])

    def mean_context(self, step: int) -> int:
        seqs = self.by_step[step]
        return sum(s.context for s in seqs) // max(1, len(seqs))

    def longest(self) -> dict[int, int]:
        """Each request's longest context: the capacity of its KV cache."""
        out: dict[int, int] = {}
        for seqs in self.by_step.values():
            for s in seqs:
                out[s.request] = max(out.get(s.request, 0), s.context)
        return out


def is_serving(schedule: Schedule) -> bool:
    return schedule.meta.get("mode") == "serving"


def read_composition(schedule: Schedule, where: str = "schedule") -> Composition:
    """`meta.iterations`, checked: one entry per iteration the ops run (their `step`s in order), five
    whole numbers per request, and each request's cache continuing where it ended (or starting again
    at 0: a preemption's recompute). Refused in one line naming the entry."""
    raw = schedule.meta.get("iterations")
    if not isinstance(raw, list) or not raw:
        raise ScheduleError(
            f"{where}: meta.iterations is missing or empty: a serving schedule lists what each iteration "
            f"computes ([request, new_tokens, context, prefill, samples] per request; `klotski-sim serve` "
            f"writes it for a kept run)"
        )
    steps = sorted({op.step for op in schedule.ops if op.step >= 0})
    if len(steps) != len(raw):
        raise ScheduleError(
            f"{where}: meta.iterations lists {len(raw)} iterations, the ops run {len(steps)} (their steps)"
        )
    cached: dict[int, int] = {}
    by_step: dict[int, tuple[Scheduled, ...]] = {}
    for k, (step, entries) in enumerate(zip(steps, raw)):
        at = f"{where}: meta.iterations[{k}]"
        if not isinstance(entries, list) or not entries:
            raise ScheduleError(f"{at}: expected a non-empty list of [request, new_tokens, context, prefill, samples]")
        seqs: list[Scheduled] = []
        for entry in entries:
            if (
                not isinstance(entry, list)
                or len(entry) != 5
                or not all(isinstance(v, int) and not isinstance(v, bool) for v in entry)
            ):
                raise ScheduleError(f"{at}: {entry!r:.60} is not [request, new_tokens, context, prefill, samples]")
            r, n, ctx, prefill, samples = entry
            if r < 0 or n < 1 or ctx < n or prefill not in (0, 1) or samples not in (0, 1):
                raise ScheduleError(
                    f"{at}: {entry!r}: needs request >= 0, new_tokens >= 1, context >= new_tokens, prefill and "
                    f"samples 0 or 1"
                )
            if any(s.request == r for s in seqs):
                raise ScheduleError(f"{at}: request {r} is listed twice")
            held = cached.get(r, 0)
            if ctx - n not in (held, 0):
                raise ScheduleError(
                    f"{at}: request {r} computes tokens {ctx - n}..{ctx - 1} but its cache holds {held} "
                    f"(a cache continues where it ended, or starts again at 0 after a preemption)"
                )
            cached[r] = ctx
            seqs.append(Scheduled(r, n, ctx, bool(prefill), bool(samples)))
        by_step[step] = tuple(seqs)
    return Composition(by_step)


def _is_load(op: Op) -> bool:
    """vLLM-O's whole-layer copy."""
    return op.kind == "transfer" and op.tensor == "" and op.layer >= 0


def _is_expert_copy(op: Op) -> bool:
    return op.kind == "transfer" and op.tensor == "expert" and op.layer >= 0


def check_serving(schedule: Schedule, spec: ModelSpec, where: str = "schedule") -> Composition:
    """Refuse, in one line naming the op and its field, a serving schedule the runner cannot run
    as the simulator timed it: another model's, an op it has no effect for, token counts that
    are not the iteration's. Returns the iterations' composition."""
    if not is_serving(schedule):
        raise ScheduleError(f"{where}: not a serving schedule (meta.mode {schedule.meta.get('mode')!r}, not 'serving')")
    model = schedule.meta.get("model")
    if model != spec.name:
        raise ScheduleError(f"{where}: the schedule was built for model {model!r}, not {spec.name!r}")
    if spec.mla:
        raise ScheduleError(f"{where}: model {spec.name!r} uses MLA attention; the serving runner computes GQA only")
    if spec.quantised:
        raise ScheduleError(f"{where}: model {spec.name!r} has quantised experts; the serving runner pages bf16 ones")
    comp = read_composition(schedule, where)
    streams = schedule.streams
    refuse_a_gpu_group(schedule)
    for stream in sorted({op.stream for op in schedule.ops}):
        resource = streams[stream]
        if resource not in SERVING_RESOURCES:
            raise ScheduleError(f"{where}: stream {stream!r} runs on {resource!r}, which the serving runner has not")
    for op in schedule.ops:
        problem = _op_problem(op, spec, comp, streams[op.stream])
        if problem:
            raise ScheduleError(f"{where}: op {op.id!r}: {problem}")
    return comp


def _op_problem(op: Op, spec: ModelSpec, comp: Composition, resource: str) -> str:
    """What of one op the serving runner cannot execute as timed (empty: nothing)."""
    if op.kind == "host":
        return ""
    if op.layer >= spec.num_layers:
        return f"layer {op.layer} outside the model's {spec.num_layers} layers"
    if op.kind == "transfer":
        if op.tensor not in SERVING_TENSORS:
            return f"tensor {op.tensor!r}: the serving runner copies expert, activation and whole-layer weights"
        if op.tensor == "activation":
            if op.step not in comp.by_step:
                return f"step {op.step}: not an iteration of meta.iterations"
            want = spec.hidden_bytes(comp.tokens(op.step))
            return "" if op.bytes == want else f"bytes {op.bytes:,}: the iteration's hidden states are {want:,}"
        if op.layer < 0:
            return "" if op.tensor == "expert" else "a whole-layer copy needs its layer"
        if _is_load(op):
            want = spec.layer_bytes(op.layer)
            return "" if op.bytes == want else f"bytes {op.bytes:,}: layer {op.layer}'s weights are {want:,}"
        most = spec.moe_layer_bytes(op.layer) if spec.is_moe(op.layer) else 0
        return "" if 0 < op.bytes <= most else f"bytes {op.bytes:,}: layer {op.layer}'s experts are {most:,}"
    if op.category not in SERVING_COMPUTE:
        return (
            f"category {op.category!r}: the serving runner executes {', '.join(SERVING_COMPUTE)} (compute) "
            f"and copies; not this"
        )
    if op.category == "remap":
        return ""
    if op.category in ("attention", "gate", "dense_mlp", "moe", "combine", "decompress") and op.layer < 0:
        return f"{op.category} ops need their layer (got layer {op.layer})"
    if op.category == "decompress":
        most = spec.moe_layer_bytes(op.layer) if spec.is_moe(op.layer) else 0
        return "" if 0 < op.bytes <= most else f"bytes {op.bytes:,}: layer {op.layer}'s experts are {most:,}"
    if op.step not in comp.by_step:
        return f"step {op.step}: not an iteration of meta.iterations"
    tokens = comp.tokens(op.step)
    if op.category in _OVER_NEW_TOKENS or op.category == "moe" and resource != "cpu":
        want, what = tokens, "the iteration's new tokens"
    elif op.category == "moe":
        want, what = tokens * spec.top_k, f"the iteration's new tokens x top_k {spec.top_k}"
    elif op.category == "lm_head":
        want, what = max(1, comp.samples(op.step)), "the requests that sample"
    else:
        return ""
    if op.tokens != want:
        return f"tokens {op.tokens}, but meta.iterations says {want} ({what}, step {op.step})"
    if op.category == "attention" and op.kv_len != comp.mean_context(op.step):
        return (
            f"kv_len {op.kv_len}, but meta.iterations' mean context at step {op.step} is {comp.mean_context(op.step)}"
        )
    return ""


# ---- weights as flat buffers: what a block, a copy and a load move ------------------------------------
@dataclass(frozen=True)
class Layout:
    """Tensors laid one after another in one flat buffer: key -> (offset in values, shapes)."""

    entries: tuple[tuple[tuple, int, tuple[tuple[int, ...], ...]], ...]
    values: int

    @staticmethod
    def of(parts: Sequence[tuple[tuple, tuple[torch.Tensor, ...]]]) -> "Layout":
        entries, at = [], 0
        for key, tensors in parts:
            entries.append((key, at, tuple(tuple(t.shape) for t in tensors)))
            at += sum(t.numel() for t in tensors)
        return Layout(tuple(entries), at)

    def views(self, flat: torch.Tensor) -> dict[tuple, tuple[torch.Tensor, ...]]:
        """key -> its tensors, as views of `flat` (values of the weights' dtype)."""
        out = {}
        for key, at, shapes in self.entries:
            tensors = []
            for shape in shapes:
                n = math.prod(shape)
                tensors.append(flat[at : at + n].view(shape))
                at += n
            out[key] = tuple(tensors)
        return out


def flatten(parts: Sequence[tuple[tuple, tuple[torch.Tensor, ...]]]) -> torch.Tensor:
    return torch.cat([t.reshape(-1) for _, tensors in parts for t in tensors])


def expert_parts(weights: WeightStore, spec: ModelSpec, layer: int) -> list[tuple[tuple, tuple[torch.Tensor, ...]]]:
    return [(("expert", layer, e), weights.get("expert", layer, e)) for e in range(spec.num_experts)]


def layer_parts(weights: WeightStore, spec: ModelSpec, layer: int) -> list[tuple[tuple, tuple[torch.Tensor, ...]]]:
    """A whole layer as vLLM-O copies it: attention, gate (router, shared experts), routed experts."""
    parts = [(("attention", layer), weights.get("attention", layer)), (("gate", layer), weights.get("gate", layer))]
    return parts + (expert_parts(weights, spec, layer) if spec.is_moe(layer) else [])


@dataclass(frozen=True)
class CompressedLayer:
    """A layer's routed experts in the compressed tier: each matrix compressed on its own, in the
    flat order of `expert_parts` (a prefix of the layer is whole matrices and part of one)."""

    matrices: tuple[lossless.Compressed, ...]
    starts: tuple[int, ...]  # value offset of each matrix in the flat layer

    @property
    def nbytes(self) -> int:
        return sum(c.nbytes for c in self.matrices)

    @property
    def raw_bytes(self) -> int:
        return sum(c.raw_bytes for c in self.matrices)


def compress_layer(weights: WeightStore, spec: ModelSpec, layer: int) -> CompressedLayer:
    matrices, starts, at = [], [], 0
    for _, tensors in expert_parts(weights, spec, layer):
        for t in tensors:
            matrices.append(lossless.encode(t))
            starts.append(at)
            at += t.numel()
    return CompressedLayer(tuple(matrices), tuple(starts))


def measured_share(images: Mapping[int, CompressedLayer]) -> float:
    """Compressed bytes / bf16 bytes over the layers' experts: what `fluxmoe.compressed_size` is."""
    stored = sum(c.nbytes for c in images.values())
    raw = sum(c.raw_bytes for c in images.values())
    return stored / raw if raw else 1.0


@dataclass(frozen=True)
class Prefix:
    """The first `values` values of a layer's experts in the compressed tier: whole matrices, then
    the start of one compressed on its own."""

    whole: tuple[tuple[lossless.Compressed, int], ...]  # (image, value offset)
    part: lossless.Compressed | None
    part_at: int
    values: int

    @property
    def nbytes(self) -> int:
        return sum(c.nbytes for c, _ in self.whole) + (self.part.nbytes if self.part else 0)

    def to(self, device: torch.device) -> "Prefix":
        return Prefix(
            tuple((c.to(device), at) for c, at in self.whole),
            self.part.to(device) if self.part else None,
            self.part_at,
            self.values,
        )


def prefix_of(layer: CompressedLayer, flat: torch.Tensor, values: int) -> Prefix:
    whole, part, part_at = [], None, 0
    for c, at in zip(layer.matrices, layer.starts):
        if at + c.count <= values:
            whole.append((c, at))
        elif at < values:
            part, part_at = lossless.encode(flat[at:values]), at
    return Prefix(tuple(whole), part, part_at, values)


# ---- what every run of one model's weights shares --------------------------------------------------------
class ServingStore:
    """What the runner makes of the weights once, and every run (and calibration) reuses: each paged
    layer's experts and each whole-layer copy's tensors as one flat host buffer (pinned once under
    CUDA), the layers' compressed images and the prefixes decompress ops decode, and on the CPU the
    reusable layer blocks, touched once (a fresh block is fresh pages, faulted in by the copy into it)."""

    def __init__(
        self, weights: WeightStore, spec: ModelSpec, images: Mapping[int, CompressedLayer] | None = None
    ) -> None:
        self.weights, self.spec = weights, spec
        self.images: dict[int, CompressedLayer] = dict(images or {})
        self.experts: dict[int, torch.Tensor] = {}  # layer -> its routed experts, flat, as bytes
        self.layers: dict[int, torch.Tensor] = {}  # layer -> attention, gate and experts, flat, as bytes
        self.prefixes: dict[tuple[int, int, str], Prefix] = {}
        self.free_blocks: dict[int, list[torch.Tensor]] = {}
        self.lock = threading.Lock()
        self.pinned = False

    def host_experts(self, layer: int) -> torch.Tensor:
        if layer not in self.experts:
            self.experts[layer] = flatten(expert_parts(self.weights, self.spec, layer)).view(torch.uint8)
        return self.experts[layer]

    def host_layer(self, layer: int) -> torch.Tensor:
        if layer not in self.layers:
            self.layers[layer] = flatten(layer_parts(self.weights, self.spec, layer)).view(torch.uint8)
        return self.layers[layer]

    def pin(self) -> None:
        """Pinned host buffers (what `_run_cuda` asks of `runner.weights` before a run)."""
        if not self.pinned:
            self.experts = {k: v.pin_memory() for k, v in self.experts.items()}
            self.layers = {k: v.pin_memory() for k, v in self.layers.items()}
            self.pinned = True

    @property
    def source(self) -> str:
        return self.weights.source

    def prefix(self, layer: int, values: int, device: torch.device) -> Prefix:
        key = (layer, values, str(device))
        if key not in self.prefixes:
            if layer not in self.images:
                self.images[layer] = compress_layer(self.weights, self.spec, layer)
            flat = self.host_experts(layer).view(torch.bfloat16)
            self.prefixes[key] = prefix_of(self.images[layer], flat, values).to(device)
        return self.prefixes[key]

    def blocks_for(self, values: int, dtype: torch.dtype, count: int = 2) -> None:
        """`count` CPU blocks of `values` values ready (the policies' two reusable layer blocks)."""
        with self.lock:
            have = self.free_blocks.setdefault(values, [])
            have += [torch.zeros(values, dtype=dtype) for _ in range(count - len(have))]

    def take_block(self, values: int, dtype: torch.dtype) -> torch.Tensor:
        with self.lock:
            free = self.free_blocks.get(values)
            if free:
                return free.pop()
        return torch.empty(values, dtype=dtype)

    def give_block(self, block: torch.Tensor) -> None:
        with self.lock:
            self.free_blocks.setdefault(block.numel(), []).append(block)


# ---- the runner ---------------------------------------------------------------------------------------
class ServingRunner:
    """The effect of each op of a serving schedule on real tensors (module docstring); the offline
    executor's CPU and CUDA drivers call `run(op)` from their stream threads."""

    def __init__(
        self,
        schedule: Schedule,
        spec: ModelSpec,
        weights: WeightStore,
        options: ExecOptions,
        store: ServingStore | None = None,
    ) -> None:
        self.comp = check_serving(schedule, spec)
        self.schedule, self.spec, self.opt = schedule, spec, options
        self.device = torch.device(options.device)
        self.dtype = next(iter(weights.resident.values())).dtype
        layers = max((op.layer for op in schedule.ops), default=-1) + 1
        if layers > weights.num_layers:
            raise ScheduleError(f"schedule uses {layers} layers but the weights hold {weights.num_layers}")
        if store is not None and store.weights is not weights:
            raise ExecutionError("the serving store was made of other weights")
        self.store = weights
        self.shared = store or ServingStore(weights, spec)
        self.weights = self.shared  # (executor._run_cuda pins `runner.weights`: the host buffers copies read)
        self.ops_by_id = {op.id: op for op in schedule.ops}
        self.on_cpu = {s for s, r in schedule.streams.items() if r == "cpu"}
        self.cuda = self.device.type == "cuda"
        dev = self.device
        # what _run_cuda reads of an OpRunner
        self.buffers: dict[str, Any] = {}
        self.staged_from_pool: dict[str, tuple[torch.Tensor, ...]] = {}
        self.pinned_pool = PinnedPool()
        self.disk_times: dict[str, tuple[float, float]] = {}
        self.issue_s: dict[int, float] = {}  # (as OpRunner's: what the CUDA issuing thread spent per op)
        self.t0 = time.perf_counter()
        self.lock = threading.Lock()
        self.in_use = self.peak = 0
        self.buffer_bytes: dict[str, int] = {}
        self.memory_trace: list[tuple[float, int]] = []
        self.resident = {k: v.to(dev) for k, v in weights.resident.items()}
        # the weights each policy keeps on the device for the whole run
        paged = {op.layer for op in schedule.ops if op.category == "decompress" or _is_expert_copy(op)}
        loaded = {op.layer for op in schedule.ops if _is_load(op)}
        cpu_experts = {op.layer for op in schedule.ops if op.category == "moe" and op.stream in self.on_cpu}
        self.layer_tensors: dict[tuple, tuple[torch.Tensor, ...]] = {}
        for j in range(layers):
            if j in loaded:
                continue
            for key, tensors in layer_parts(weights, spec, j):
                if key[0] == "expert" and (j in paged or j in cpu_experts):
                    continue
                self.layer_tensors[key] = tuple(t.to(dev) for t in tensors)
        # host copies: a paged layer's experts, a loaded layer's tensors, each one flat buffer
        self.expert_layout = {j: Layout.of(expert_parts(weights, spec, j)) for j in paged}
        self.layer_layout = {j: Layout.of(layer_parts(weights, spec, j)) for j in loaded}
        for op in schedule.ops:
            if _is_load(op) and self.shared.host_layer(op.layer).numel() != op.bytes:
                raise ScheduleError(
                    f"op {op.id!r}: bytes {op.bytes:,}, but layer {op.layer}'s tensors are "
                    f"{self.shared.host_layer(op.layer).numel():,} bytes"
                )
        for j in paged:
            self.shared.host_experts(j)
        # the compressed tier: each decompressed prefix, stored on the device
        decompressed = {(op.layer, -(-op.bytes // 2)) for op in schedule.ops if op.category == "decompress"}
        if decompressed and self.dtype != torch.bfloat16:
            raise ExecutionError(f"the lossless coder stores bf16 experts; these weights are {self.dtype}")
        self.prefixes = {key: self.shared.prefix(*key, dev) for key in sorted(decompressed)}
        self.compressed_bytes = sum(p.nbytes for p in self.prefixes.values())
        if self.prefixes and not self.cuda:  # (the decoder's work arrays made before the timed run)
            lossless.warm(max(c.count for p in self.prefixes.values() for c in (*(i for i, _ in p.whole), p.part) if c))
        if not self.cuda:  # the policies' two reusable layer blocks, touched before the run
            for j in paged:
                self.shared.blocks_for(self.shared.host_experts(j).numel() // 2, self.dtype)
            for j in loaded:
                self.shared.blocks_for(self.shared.host_layer(j).numel() // 2, self.dtype)
        self._alloc(
            "resident",
            sum(v.numel() * v.element_size() for v in self.resident.values())
            + sum(t.numel() * t.element_size() for v in self.layer_tensors.values() for t in v)
            + self.compressed_bytes,
        )
        # per request: its tokens (prompt drawn as needed, then the sampled ones) and per layer its KV cache
        self.capacity = self.comp.longest()
        self.tokens: dict[int, list[int]] = {}
        self.kv: dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor]] = {}
        self.filled: dict[tuple[int, int], int] = {}
        self.dropped: list[tuple[int, int, int]] = []  # (step, request, layer): a cache dropped for recompute
        self.attended: dict[tuple[int, int, int], int] = {}  # (step, layer, request) -> keys attended
        self.sampled: dict[int, dict[int, int]] = {}  # step -> request -> token
        self.active_experts: dict[str, int] = {}  # moe op -> experts it computed
        self.moved: dict[str, tuple[int, int]] = {}  # copy / decompress op -> (bytes written, bytes read)
        # one iteration's activations (the host waits for each iteration's end: one is in flight)
        self.x: torch.Tensor | None = None
        self.h: torch.Tensor | None = None
        self.z: torch.Tensor | None = None
        self.route: tuple[torch.Tensor, torch.Tensor] | None = None
        self.shared_out: torch.Tensor | None = None
        self.moe_out: torch.Tensor | None = None
        self.host_act: dict[str, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}
        self.cpu_out: dict[str, torch.Tensor] = {}
        self.up: dict[str, torch.Tensor] = {}
        self.blocks: dict[tuple[int, int], torch.Tensor] = {}  # (step, layer) -> the layer's flat block
        self.loaded: dict[tuple[int, int], dict[tuple, tuple[torch.Tensor, ...]]] = {}
        self.scratch = torch.empty(0, dtype=torch.uint8)

    # ---- memory --------------------------------------------------------------------------------------
    def _alloc(self, name: str, nbytes: int) -> None:
        with self.lock:
            self.buffer_bytes[name] = nbytes
            self.in_use += nbytes
            self.peak = max(self.peak, self.in_use)
            self.memory_trace.append((time.perf_counter() - self.t0, self.in_use))

    def _free(self, name: str) -> None:
        with self.lock:
            self.in_use -= self.buffer_bytes.pop(name, 0)
            self.memory_trace.append((time.perf_counter() - self.t0, self.in_use))

    def _block(self, step: int, layer: int, values: int) -> torch.Tensor:
        """The flat block a paged or loaded layer is materialised into (shared by its decompressed and
        copied parts); on the CPU one of the store's reused blocks."""
        with self.lock:
            block = self.blocks.get((step, layer))
            if block is None:
                block = self.blocks[(step, layer)] = (
                    torch.empty(values, dtype=self.dtype, device=self.device)
                    if self.cuda
                    else self.shared.take_block(values, self.dtype)
                )
            return block

    def release(self, op: Op) -> None:
        """Drop what a layer's last op read (its block, its loaded weights)."""
        self.loaded.pop((op.step, op.layer), None)
        with self.lock:
            block = self.blocks.pop((op.step, op.layer), None)
        if block is not None and not self.cuda:
            self.shared.give_block(block)

    # ---- dispatch ------------------------------------------------------------------------------------
    def run(self, op: Op) -> None:
        for name, size in op.alloc:
            self._alloc(name, size)
        if op.kind == "transfer":
            if op.tensor == "activation":
                self._activation(op)
            elif _is_load(op):
                self._load(op)
            elif _is_expert_copy(op):
                self._copy_experts(op)
            else:
                self._restore(op)
        elif op.kind == "compute":
            getattr(self, f"_{op.category}")(op)
        for name in op.free:
            self._free(name)

    # ---- copies and decompression --------------------------------------------------------------------
    def _copy_experts(self, op: Op) -> None:
        """The tail of the layer's experts from pinned host memory into its block: exactly op.bytes."""
        host = self.shared.host_experts(op.layer)
        block = self._block(op.step, op.layer, host.numel() // 2).view(torch.uint8)
        at = host.numel() - op.bytes
        block[at:].copy_(host[at:], non_blocking=self.cuda)
        self.buffers[op.id] = block
        self.moved[op.id] = (op.bytes, op.bytes)

    def _decompress(self, op: Op) -> None:
        """The layer's compressed share decoded into the start of its block (op.bytes, rounded up to
        whole bf16 values), on the device, from the images stored there."""
        values = -(-op.bytes // 2)
        prefix = self.prefixes[(op.layer, values)]
        block = self._block(op.step, op.layer, self.shared.host_experts(op.layer).numel() // 2)
        for image, at in prefix.whole:
            lossless.decode(image, block[at : at + image.count])
        if prefix.part is not None:
            lossless.decode(prefix.part, block[prefix.part_at : prefix.values])
        self.buffers[op.id] = block
        self.moved[op.id] = (2 * values, prefix.nbytes)

    def _load(self, op: Op) -> None:
        """vLLM-O: a whole layer copied into a block of its own (its tensors as views of it)."""
        host = self.shared.host_layer(op.layer)
        block = self._block(op.step, op.layer, host.numel() // 2).view(torch.uint8)
        block.copy_(host, non_blocking=self.cuda)
        self.loaded[(op.step, op.layer)] = self.layer_layout[op.layer].views(block.view(self.dtype))
        self.buffers[op.id] = block
        self.moved[op.id] = (op.bytes, op.bytes)

    def _restore(self, op: Op) -> None:
        """The adaptive planner's compressed images brought back over PCIe: op.bytes copied."""
        with self.lock:
            if self.scratch.numel() < op.bytes:
                self.scratch = torch.zeros(op.bytes, dtype=torch.uint8)
        into = torch.empty(op.bytes, dtype=torch.uint8, device=self.device)
        into.copy_(self.scratch[: op.bytes], non_blocking=self.cuda)
        self.buffers[op.id] = into
        self.moved[op.id] = (op.bytes, op.bytes)

    def _remap(self, op: Op) -> None:
        """A residency change's memory effect only (its alloc and free)."""

    # ---- compute -------------------------------------------------------------------------------------
    def _weights(self, op: Op, tensor: str, expert: int = -1) -> tuple[torch.Tensor, ...]:
        key = (tensor, op.layer) if expert < 0 else (tensor, op.layer, expert)
        loaded = self.loaded.get((op.step, op.layer))
        if loaded is not None:
            return loaded[key]
        try:
            return self.layer_tensors[key]
        except KeyError:
            raise ExecutionError(f"op {op.id!r}: no {tensor} weights of layer {op.layer} on the device") from None

    def _tokens(self, s: Scheduled) -> list[int]:
        """The request's known tokens up to `s.context`: its prompt drawn at random once (a recompute
        reads the same ones), then the tokens it sampled."""
        known = self.tokens.setdefault(s.request, [])
        if s.context > len(known):  # (only prompt tokens are not known yet: a request samples after them)
            rng = np.random.default_rng([self.opt.seed, s.request, len(known)])
            known.extend(rng.integers(0, self.spec.vocab_size, s.context - len(known)).tolist())
        return known

    def _embed(self, op: Op) -> None:
        ids = [t for s in self.comp.by_step[op.step] for t in self._tokens(s)[s.start : s.context]]
        self.x = kernels.embed(torch.tensor(ids, device=self.device), self.resident["embed"])
        self.h = self.moe_out = None

    def _combine_residual(self) -> torch.Tensor:
        """The layer input: the last attention's output plus the last MoE's (once)."""
        if self.moe_out is not None:
            assert self.h is not None
            self.x = self.h + self.moe_out
            self.moe_out = None
        assert self.x is not None
        return self.x

    def _attention(self, op: Op) -> None:
        x = self._combine_residual()
        spec, layer = self.spec, op.layer
        w = self._weights(op, "attention")
        qk = kernels.qk_norms(self.resident, spec, layer)
        outs, at = [], 0
        for s in self.comp.by_step[op.step]:
            key = (s.request, layer)
            held = self.filled.get(key, 0)
            if s.start == 0 and held:  # preempted: the cache is dropped and recomputed from the start
                self.kv.pop(key, None)
                self.dropped.append((op.step, s.request, layer))
            elif s.start != held:
                raise ExecutionError(f"op {op.id!r}: request {s.request} holds {held} cached tokens, not {s.start}")
            cache = self.kv.get(key)
            if cache is None:
                shape = (1, spec.num_kv_heads, self.capacity[s.request], spec.head_dim)
                cache = self.kv[key] = (
                    torch.empty(shape, dtype=self.dtype, device=self.device),
                    torch.empty(shape, dtype=self.dtype, device=self.device),
                )
            xi = x[at : at + s.new_tokens][None]
            at += s.new_tokens
            q, k, v = kernels.attention_qkv(
                xi, w, self.resident[f"norm1/{layer}"], s.start, spec, self.store.rope_theta, self.store.rms_eps, qk
            )
            cache[0][:, :, s.start : s.context] = k
            cache[1][:, :, s.start : s.context] = v
            keys, values = cache[0][:, :, : s.context], cache[1][:, :, : s.context]
            mask = (
                torch.ones(s.new_tokens, s.context, dtype=torch.bool, device=self.device).tril(s.start)
                if s.new_tokens > 1
                else None
            )
            out = F.scaled_dot_product_attention(
                q, keys, values, attn_mask=mask, enable_gqa=spec.num_heads != spec.num_kv_heads
            )
            outs.append(out.transpose(1, 2).reshape(s.new_tokens, spec.num_heads * spec.head_dim))
            self.filled[key] = s.context
            self.attended[(op.step, layer, s.request)] = keys.shape[2]
        self.h = x + F.linear(torch.cat(outs), w[3])

    def _gate(self, op: Op) -> None:
        assert self.h is not None
        router, *shared = self._weights(op, "gate")
        z, weights, ids, out = kernels.gate_step(
            self.h[None],
            self.resident[f"norm2/{op.layer}"],
            router,
            self.spec.top_k,
            self.store.rms_eps,
            None,
            tuple(shared),
            self.spec.norm_topk_prob,
        )
        self.z, self.route, self.shared_out = z, (ids, weights), out
        self.moe_out = out

    def _dense_mlp(self, op: Op) -> None:
        assert self.h is not None
        z = kernels.rms_norm(self.h, self.resident[f"norm2/{op.layer}"], self.store.rms_eps)
        self.moe_out = kernels.expert(z, self._weights(op, "gate"))
        self.release(op)

    def _experts_of(self, op: Op) -> dict[tuple, tuple[torch.Tensor, ...]] | None:
        """A paged layer's experts as views of its block (None: not paged)."""
        paged = any(self.ops_by_id[d].category == "decompress" or _is_expert_copy(self.ops_by_id[d]) for d in op.deps)
        if not paged:
            return None
        block = self.blocks.get((op.step, op.layer))
        if block is None:
            raise ExecutionError(f"op {op.id!r}: layer {op.layer}'s experts were not materialised")
        return self.expert_layout[op.layer].views(block)

    def _routed(self, z: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, expert: Any, out: torch.Tensor) -> int:
        """Every expert the routing activates over its tokens, added into `out`; returns how many."""
        ids_np = ids.cpu().numpy()
        active = np.unique(ids_np)
        for e in active.tolist():
            rows, slots = kernels.upload(np.stack(np.nonzero(ids_np == e)), z.device)
            kernels.expert_step(z, weights, rows, slots, expert(e), out)
        return len(active)

    def _moe(self, op: Op) -> None:
        if op.stream in self.on_cpu:
            return self._cpu_moe(op)
        assert self.z is not None and self.route is not None and self.shared_out is not None
        views = self._experts_of(op)
        ids, weights = self.route
        out = self.shared_out.clone()  # (the shared experts' output is the gate's: summed into a copy)
        if views is not None:
            count = self._routed(self.z, ids, weights, lambda e: views[("expert", op.layer, e)], out)
        else:
            count = self._routed(self.z, ids, weights, lambda e: self._weights(op, "expert", e), out)
        self.release(op)
        self.moe_out = out
        self.active_experts[op.id] = count

    def _activation(self, op: Op) -> None:
        """KTransformers: hidden states and routing down to host memory, the CPU experts' output up."""
        if op.dst == "cpu":
            assert self.z is not None and self.route is not None
            self.host_act[op.id] = (self.z.to("cpu", copy=True), self.route[1].to("cpu"), self.route[0].to("cpu"))
            return
        source = next((d for d in op.deps if d in self.cpu_out), None)
        if source is None:
            raise ExecutionError(f"op {op.id!r}: no CPU expert output to bring back (deps {list(op.deps)})")
        self.up[op.id] = self.cpu_out.pop(source).to(self.device, non_blocking=self.cuda)

    def _cpu_moe(self, op: Op) -> None:
        down = next((d for d in op.deps if d in self.host_act), None)
        if down is None:
            raise ExecutionError(f"op {op.id!r}: a CPU MoE needs its hidden states copied down first")
        z, weights, ids = self.host_act.pop(down)
        out = torch.zeros_like(z)
        host = self.store
        self.active_experts[op.id] = self._routed(z, ids, weights, lambda e: host.get("expert", op.layer, e), out)
        self.cpu_out[op.id] = out

    def _combine(self, op: Op) -> None:
        up = next((d for d in op.deps if d in self.up), None)
        if up is None:
            raise ExecutionError(f"op {op.id!r}: no CPU expert output came back")
        assert self.shared_out is not None
        self.moe_out = self.shared_out + self.up.pop(up)

    def _lm_head(self, op: Op) -> None:
        x = self._combine_residual()
        rows, who, at = [], [], 0
        for s in self.comp.by_step[op.step]:
            at += s.new_tokens
            if s.samples:
                rows.append(at - 1)
                who.append(s)
        if not rows:
            return
        logits = kernels.lm_head(x[rows], self.resident["final_norm"], self.resident["lm_head"], self.store.rms_eps)
        picked = logits.argmax(dim=-1).tolist()
        self.sampled[op.step] = {}
        for s, token in zip(who, picked):
            known = self.tokens.setdefault(s.request, [])
            if len(known) != s.context:
                raise ExecutionError(
                    f"op {op.id!r}: request {s.request} samples after {s.context} tokens but has {len(known)}"
                )
            known.append(int(token))
            self.sampled[op.step][s.request] = int(token)


def execute_serving(
    schedule: Schedule,
    spec: ModelSpec,
    weights: WeightStore,
    options: ExecOptions = ExecOptions(),
    store: ServingStore | None = None,
) -> tuple[Timeline, ServingRunner]:
    """Run every op of a serving `schedule` (module docstring) and return the measured Timeline
    and the runner (its state holds what ran: KV lengths, sampled tokens, bytes moved).
    `store`: what runs on these weights share (their flat host copies, compressed images, blocks): made
    once, it saves every later run from making them again."""
    check_emulation(schedule, options)
    runner = ServingRunner(schedule, spec, weights, options, store)
    timeline = measure_run(
        schedule,
        runner,  # type: ignore[arg-type]  # (it has what the drivers read of an OpRunner)
        options,
        weights,
        {"routing_forced": False, "compressed_tier_bytes": runner.compressed_bytes},
    )
    return timeline, runner
