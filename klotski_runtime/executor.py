"""Execute a klotski Schedule for real and measure it into a Timeline.

The very Schedule the simulator ran (in memory, or the `schedule.json` that `klotski-sim simulate
--out` writes) is executed op by op:

- **CUDA**: one `torch.cuda.Stream` per schedule stream; cross-stream deps are CUDA events;
  transfers are `copy_(non_blocking=True)` from host tensors pinned once; disk-tier weights are
  read from real files; start/end of every op come from CUDA events.
- **CPU** (tests, GPU-less machines): each stream is a worker thread running its ops in order;
  deps are thread events; compute runs real torch CPU kernels; transfers are real copies from the
  host store into a device store; disk-tier reads are real file reads. Links can be *emulated*
  (each transfer sleeps up to `latency + bytes / bandwidth`, at the pageable rate for a copy the
  schedule marks pageable) — every output says so.

Host ops (`sync`, `copy_wait`) are the issuing thread blocked: on CUDA the issuing thread waits
for the events of what they wait for, so nothing after them is enqueued earlier; on the CPU the
host stream's thread waits for them, and everything issued after them depends on them.

GPU memory follows the schedule's memory effects: a transfer allocates its buffer, the op that
frees it drops it; the measured peak is reported next to the simulated one.
"""

from __future__ import annotations

import heapq
import tempfile
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Mapping

import numpy as np
import torch

from klotski_sim.core.collectives import all_to_all_time, best_all_reduce
from klotski_sim.core.cost import op_variant, variant_impl
from klotski_sim.core.schedule import TENSORS, Op, Schedule, ScheduleError, topological_order
from klotski_sim.core.timeline import Timeline
from klotski_sim.hardware.profile import FabricSpec
from klotski_sim.names import COMPUTE_CATEGORIES, base_resource, is_disk_read, kv_buffer, resource_rank
from klotski_sim.util.errors import KlotskiError
from klotski_sim.workload.model import ModelSpec
from klotski_sim.workload.routing import RoutingTable, RunShape

from . import kernels
from .kernels import WeightStore
from .ranks import Ranks, all_reduce, split_problem
from .threads import compute_threads, cpu_threads

RESOURCE_CAPACITY = {"gpu": 1, "pcie_h2d": 1, "pcie_d2h": 1, "nvme": 1, "host": 1}


def resource_units(schedule: Schedule, options: "ExecOptions") -> dict[str, int]:
    """Units of each resource the schedule uses: the options' (the engine's capacities, passed by
    validate), else one each."""
    given = dict(options.capacities or {})
    return {r: given.get(r, RESOURCE_CAPACITY.get(r, 1)) for r in sorted(set(schedule.streams.values()))}


class PinnedPool:
    """Reused pinned host buffers for staging disk reads before their H2D copy (pinning a fresh
    buffer per read costs more than the read). A buffer goes back to the pool with the event of the
    copy that reads it, and is handed out again only once that event has completed."""

    def __init__(self) -> None:
        self.free: dict[tuple, list[tuple[torch.Tensor, Any]]] = {}
        self.lock = threading.Lock()

    def take(self, like: torch.Tensor) -> torch.Tensor:
        key = (tuple(like.shape), like.dtype)
        with self.lock:
            for k, (buf, done) in enumerate(self.free.get(key, [])):
                if done is None or done.query():
                    del self.free[key][k]
                    return buf
        return torch.empty(like.shape, dtype=like.dtype).pin_memory()

    def give_back(self, buf: torch.Tensor, done: Any) -> None:
        with self.lock:
            self.free.setdefault((tuple(buf.shape), buf.dtype), []).append((buf, done))


class ResourceGate:
    """The units of one resource, shared by the threads of the streams mapped to it, served as the
    simulator serves them (klotski_sim.core.engine, rule 2): first ready first, ties by schedule order.
    Without it two copy streams on one link would copy at once, each at the full emulated rate."""

    def __init__(self, units: int) -> None:
        self.units = units
        self.waiting: list[tuple[float, int]] = []
        self.cond = threading.Condition()

    def acquire(self, ready: float, i: int, abort: threading.Event) -> bool:
        """Wait for a unit; False when the run was aborted meanwhile."""
        with self.cond:
            heapq.heappush(self.waiting, (ready, i))
            while not (self.units and self.waiting[0][1] == i):
                self.cond.wait(0.05)
                if abort.is_set():
                    return False
            heapq.heappop(self.waiting)
            self.units -= 1
            return True

    def release(self) -> None:
        with self.cond:
            self.units += 1
            self.cond.notify_all()


class ExecutionError(KlotskiError):
    """An op failed while executing; the message names it."""


@dataclass(frozen=True)
class ExecOptions:
    """How to execute. `emulate_links` maps a resource (`pcie_h2d`, `pcie_d2h`, `nvme`) to a
    target bandwidth in bytes/s (CPU only); `force_routing` replays the trace's experts."""

    device: str = "cpu"
    force_routing: bool = True
    emulate_links: Mapping[str, float] = field(default_factory=dict)
    # rate of pageable copies per link (None: a link that has none, as a profile's `nvme`)
    emulate_pageable: Mapping[str, float | None] = field(default_factory=dict)
    link_latency_s: float = 0.0
    seed: int = 0
    record_logits: bool = False
    timeout_s: float = 3600.0
    prompt: np.ndarray | None = None  # [batches, batch_size, prompt_len] token ids; random when None
    threads: int | None = None  # torch threads on a CPU device (the rest copy); beside a GPU: threads.compute_threads
    capacities: Mapping[str, int] | None = None  # units per resource (engine.resource_capacities); None: 1 each
    # the GPUs' fabric a tensor-parallel group's all-reduces are held to (CPU only; None: as fast as the sum)
    emulate_fabric: FabricSpec | None = None


def tensor_bytes(tensors: Any) -> int:
    if isinstance(tensors, torch.Tensor):
        return tensors.numel() * tensors.element_size()
    return sum(tensor_bytes(t) for t in tensors)


def _first_all_reduce(schedule: Schedule) -> Op | None:
    """The schedule's first op on the GPUs' fabric (a tensor-parallel group's all-reduce), if any."""
    return next((op for op in schedule.ops if schedule.streams.get(op.stream) == "fabric"), None)


def refuse_a_gpu_group(schedule: Schedule) -> None:
    """The serving runtime executes one GPU's schedules: a tensor-parallel group's (`--gpus G`, its
    all-reduces on the `fabric`) is refused in one line naming the op, before anything is loaded."""
    reduce = _first_all_reduce(schedule)
    if reduce is not None:
        raise ScheduleError(
            f"op {reduce.id!r}: an all-reduce of a tensor-parallel group of GPUs (simulate --gpus); the runtime "
            f"executes one GPU's schedules: simulate with --gpus 1 to execute one"
        )


def tensor_parallel_ranks(schedule: Schedule) -> int:
    """How many ranks share each op of the schedule (`simulate --gpus G`: its meta's tensor_parallel)."""
    group = schedule.meta.get("tensor_parallel")
    if group is None:
        return 1
    if isinstance(group, bool) or not isinstance(group, int) or not 2 <= group <= 1024:
        raise ScheduleError(
            f"meta tensor_parallel must be the group's GPU count (2 to 1024), got {group!r:.40}: "
            f"simulate the run again to execute it"
        )
    return group


def check_tensor_parallel(schedule: Schedule, spec: ModelSpec) -> None:
    """A tensor-parallel group's schedule runs on ranks emulated on the host (`ranks.py`): the model
    must split evenly, and its ops must be ones the ranks compute (the GPU side: CPU experts, CPU
    attention and the activations they move are simulated for a group, not executed). Refused in one
    line naming the op, before anything is loaded."""
    own = next((r for r in schedule.streams.values() if resource_rank(r) >= 0), None)
    if own is not None:  # (an expert-parallel schedule: each rank's own GPU, link and fabric port)
        raise ScheduleError(
            f"resource {own!r}: a schedule of ranks with resources of their own (expert parallelism, "
            f"klotski-sim parallel --timing events) runs from its plan on emulated ranks "
            f"(klotski_runtime.expert_parallel.execute_ep), not from a schedule file; this executor runs one GPU's "
            f"or a tensor-parallel group's (simulate --gpus G)"
        )
    group = tensor_parallel_ranks(schedule)
    if group == 1:
        reduce = _first_all_reduce(schedule)
        if reduce is not None:
            raise ScheduleError(
                f"op {reduce.id!r}: an all-reduce in a schedule whose meta names no tensor_parallel group"
            )
        return
    problem = split_problem(spec, group)
    if problem:
        raise ScheduleError(f"model {spec.name}: {problem}; its {group}-rank schedule cannot be executed")
    reduces = sum(op.category == "allreduce" for op in schedule.ops)
    needed = 2 * sum(len(op.batches) for op in schedule.ops if op.kind == "compute" and op.category == "attention")
    if reduces != needed:  # (each rank's partial sums would wait for a sum that never comes)
        raise ScheduleError(
            f"meta tensor_parallel {group}, but the schedule has {reduces} all-reduce ops where its layers need "
            f"{needed} (two a layer and batch): simulate it with --gpus {group} again"
        )
    for op in schedule.ops:
        on_cpu = op.kind == "compute" and schedule.streams.get(op.stream) == "cpu"
        if on_cpu or op.category in ("attn_qkv", "attn_out") or (op.kind == "transfer" and op.tensor == "activation"):
            raise ScheduleError(
                f"op {op.id!r}: the ranks of a tensor-parallel group execute the GPU side only; CPU experts and "
                f"CPU attention of a {group}-GPU group are simulated, not executed"
            )


# emulated copies over one link longer than this in all are a mistake (a rate off by orders of magnitude):
# the total counts, as many short copies take hours as surely as one long one
MAX_EMULATED_S = 3600.0


def check_compatible(
    schedule: Schedule, spec: ModelSpec, weights: WeightStore | None, routing: RoutingTable | None = None
) -> None:
    """A schedule runs only on the model it was built for, with weights for every layer it uses
    and the routing it was built from (same shape and experts), checked before anything runs
    (without `weights`: all but them, before they are made or read)."""
    model = schedule.meta.get("model")
    if model != spec.name:
        raise ScheduleError(f"schedule was built for model {model!r}, not {spec.name!r}")
    check_tensor_parallel(schedule, spec)
    if routing is not None:
        sh, meta = routing.shape, schedule.meta
        wanted = {
            "batch_size": sh.batch_size,
            "num_batches": sh.num_batches,
            "prompt_len": sh.prompt_len,
            "gen_len": sh.gen_len,
        }
        wrong = [f"{k} {meta.get(k)!r} vs {v}" for k, v in wanted.items() if meta.get(k) != v]
        if wrong:
            raise ScheduleError(
                f"the routing does not belong to this schedule (schedule vs routing: {'; '.join(wrong)})"
            )
        if routing.num_experts != spec.num_experts or routing.num_layers != spec.num_layers:
            raise ScheduleError(
                f"the routing has {routing.num_experts} experts x {routing.num_layers} layers, the "
                f"model {spec.num_experts} x {spec.num_layers}"
            )
        if routing.top_k != spec.top_k:
            raise ScheduleError(f"the routing chooses {routing.top_k} experts a token, model {spec.name} {spec.top_k}")
        if routing.dense_layers != spec.first_dense_layers:
            raise ScheduleError(
                f"the routing routes no tokens in its first {routing.dense_layers} layer(s), model "
                f"{spec.name} in its first {spec.first_dense_layers}"
            )
        if routing.moe_step != spec.moe_layer_step:
            raise ScheduleError(
                f"the routing routes every {routing.moe_step}th layer, model {spec.name} every "
                f"{spec.moe_layer_step}th (its moe_layer_step)"
            )
        if meta.get("routing") not in (None, routing.source):  # (same shape, other tokens: another seed, say)
            raise ScheduleError(
                f"the routing does not belong to this schedule: it is {routing.source!r:.120}, the "
                f"schedule was built from {meta.get('routing')!r:.120}"
            )
        streams = schedule.streams
        for op in schedule.ops:  # (each named by the field that is wrong: a handler would index with it)
            problem = (
                _outside_the_run(op, sh, spec)
                or _weights_of_another_size(op, spec)
                or _kv_of_another_size(op, spec, sh)
                or _work_of_another_run(op, sh, routing)
                or _unknown_to_the_runtime(op, spec, streams[op.stream])
            )
            if problem:
                raise ScheduleError(f"op {op.id!r}: {problem}")
        _check_each_computed_once(schedule, sh, routing)
        _check_tokens_claimed(schedule, sh)
    if weights is None:
        return
    layers = max((op.layer for op in schedule.ops), default=-1) + 1
    if layers > weights.num_layers:
        raise ScheduleError(
            f"schedule uses {layers} layers but the weights hold {weights.num_layers} "
            f"({weights.source}); build the schedule for fewer layers or load more"
        )


# compute ops that work on the tokens of given batches at a given step: without them a handler
# would index `batches[0]` (KeyError: -1) or another step's routing
_PER_BATCH = frozenset({"embed", "attention", "gate", "expert", "lm_head", "attn_qkv", "attn_out", "dense_mlp"})
_PER_LAYER_OPS = frozenset({"attention", "gate", "expert", "attn_qkv", "attn_out", "dense_mlp"})


def _outside_the_run(op: Op, shape: RunShape, spec: ModelSpec) -> str:
    """What of an op's tags the run does not have (empty: nothing): an expert op with `expert: -1`
    would otherwise run as the last expert, silently."""
    if any(b >= shape.num_batches for b in op.batches):
        return f"batches {list(op.batches)} outside the run's {shape.num_batches} batches"
    if op.step >= shape.num_steps:
        return f"step {op.step} outside the run's {shape.num_steps} steps"
    if op.layer >= spec.num_layers:
        return f"layer {op.layer} outside the model's {spec.num_layers} layers"
    is_expert = op.category == "expert" or op.tensor == "expert"
    if is_expert and not 0 <= op.expert < spec.num_experts or op.expert >= spec.num_experts:
        return f"expert {op.expert} outside the model's {spec.num_experts} experts"
    if op.kind == "compute" and op.category in _PER_BATCH and (not op.batches or op.step < 0):
        return f"{op.category} ops need their batches and step (got batches {list(op.batches)}, step {op.step})"
    if op.kind == "compute" and op.category in _PER_LAYER_OPS and op.layer < 0:  # (-1 would index the last layer)
        return f"{op.category} ops need their layer (got layer {op.layer})"
    if len(set(op.batches)) < len(op.batches):
        return f"batches {list(op.batches)} name a batch twice"
    return ""


# the compute categories an offline schedule's ops may have (`OpRunner.compute_ops`'s kernels): the
# contract's, less the serving executor's (a fused `moe`, `decompress`, `remap`) and expert parallelism's
# all-to-alls (simulated, not executed)
KERNEL_CATEGORIES = tuple(c for c in COMPUTE_CATEGORIES if c not in ("moe", "decompress", "remap", "alltoall"))


def _unknown_to_the_runtime(op: Op, spec: ModelSpec, resource: str) -> str:
    """What an op asks of the runtime that it has no kernel or tensor for (empty: nothing): a copy
    that does not say what it carries, and a compute op's variant that is not the model's (a GPU
    attention's fused or eager, with the model's kernel tags; the CPU's attention has none). Each
    would otherwise fail inside the run, naming neither the file nor the field."""
    if op.kind == "transfer" and not op.tensor:
        return f"a copy must say what it carries (tensor: {', '.join(TENSORS[1:-1])} or {TENSORS[-1]})"
    if op.kind != "compute":
        return ""
    if op.category not in KERNEL_CATEGORIES:  # (said of the op and its field: else a count of gates went wrong)
        return (
            f"category {op.category!r}: the runtime has no kernel for it (it computes {', '.join(KERNEL_CATEGORIES)})"
        )
    if op.category == "attention" and resource == "cpu":
        wanted: tuple[str, ...] = ("",)  # (the CPU's attention kernel has no variants)
    else:
        impls = ("fused", "eager") if op.category == "attention" else ("",)
        wanted = tuple(op_variant(spec, op.category, impl) for impl in impls)
    if op.variant in wanted:
        return ""
    return (
        f"variant {op.variant!r}: {spec.name}'s {op.category} on the {resource} runs as "
        f"{' or '.join(map(repr, wanted))}"
    )


def _weights_of_another_size(op: Op, spec: ModelSpec) -> str:
    """A weight copy whose bytes are not the model's tensor (empty: they are): an emulated link is
    timed from the op's bytes, so other bytes would time a copy the run does not make."""
    if op.kind != "transfer" or op.tensor not in ("attention", "gate", "expert"):
        return ""
    layer = max(op.layer, 0)
    want = (
        spec.attention_bytes()
        if op.tensor == "attention"
        else spec.gate_bytes(layer)
        if op.tensor == "gate"
        else spec.expert_bytes()
    )
    return (
        ""
        if op.bytes == want
        else (
            f"moves {op.bytes:,} bytes of {op.tensor} weights; {spec.name}'s "
            f"{op.tensor} {'of layer ' + str(layer) + ' ' if op.tensor == 'gate' else ''}"
            f"is {want:,} bytes"
        )
    )


def _kv_of_another_size(op: Op, spec: ModelSpec, shape: RunShape) -> str:
    """A KV cache copy whose bytes are not its batches' entries (empty: they are): a store carries the
    entries its step adds, a load those of the steps before; an emulated link is timed from the op's
    bytes, not from what it copies."""
    if op.kind != "transfer" or op.tensor != "kv" or op.step < 0 or not op.batches:
        return ""
    sequences, new = shape.batch_size * len(op.batches), shape.new_tokens(op.step)
    store = op.dst == "cpu"
    tokens = new if store else shape.kv_len(op.step) - new  # (a store's new entries, a load's cached ones)
    want = spec.kv_bytes(sequences, tokens)
    what = f"the {tokens} {'new' if store else 'cached'}"
    return (
        ""
        if op.bytes == want
        else (
            f"moves {op.bytes:,} bytes of KV cache; {what} tokens of its batches' "
            f"{sequences} sequences at step {op.step} are {want:,} bytes"
        )
    )


# compute ops over every new token of their batches (lm_head: over each sequence's last one)
_OVER_NEW_TOKENS = frozenset({"embed", "attention", "gate", "attn_qkv", "attn_out", "dense_mlp"})


def _work_of_another_run(op: Op, shape: RunShape, routing: RoutingTable) -> str:
    """What of a compute op's work (tokens, KV length, phase) differs from what the run gives it
    (empty: nothing). The simulator times an op by these fields and the runtime computes what the
    routing and shape say, so an expert edited to `tokens: 999` would be simulated as 999 tokens and
    measured as its few: a cross-check of two different runs."""
    if op.step >= 0 and (op.phase or op.kind == "compute" and op.batches) and op.phase != shape.phase(op.step):
        # (a copy's phase too, where it has one: a decode step's KV load tagged `prefill` would count in
        # both timelines' prefill)
        return f"phase {op.phase!r} at step {op.step} (step 0 is the prefill, later steps decode)"
    if op.kind != "compute" or op.step < 0 or not op.batches:
        return ""
    step, sequences = op.step, shape.batch_size * len(op.batches)
    if op.category == "expert":
        counts = routing.counts[step, op.layer]  # (one batch's count read alone: 135k expert ops at the default size)
        want = int(
            counts[op.batches[0], op.expert] if len(op.batches) == 1 else counts[list(op.batches), op.expert].sum()
        )
        what = f"the routing sends {want} of batches {list(op.batches)}'s tokens to expert {op.expert} there"
    elif op.category in _OVER_NEW_TOKENS:
        want = sequences * shape.new_tokens(step)
        what = f"its batches' sequences pass {want} new tokens"
    elif op.category == "lm_head":
        want, what = sequences, f"one per sequence of its batches: {sequences}"
    else:
        return ""
    if op.tokens != want:
        return f"tokens {op.tokens}, but {what} at step {step}, layer {op.layer}"
    if op.category == "attention" and op.kv_len != shape.kv_len(step):
        return f"kv_len {op.kv_len}, but its sequences hold {shape.kv_len(step)} tokens once step {step} has run"
    return ""


def _check_tokens_claimed(schedule: Schedule, shape: RunShape) -> None:
    """The tokens the schedule says it generates are the run's (else its measured throughput is a
    fiction)."""
    claimed = schedule.meta.get("generated_tokens")
    if claimed != shape.generated_tokens:
        raise ScheduleError(
            f"meta.generated_tokens {claimed!r}: the run makes {shape.generated_tokens} (batch_size "
            f"{shape.batch_size} x num_batches {shape.num_batches} x gen_len {shape.gen_len})"
        )


def _check_each_computed_once(schedule: Schedule, shape: RunShape, routing: RoutingTable) -> None:
    """Each batch's embedding and lm_head of each step, its attention and gate (or dense MLP) of each
    layer, and each expert the routing sends its tokens to, computed by exactly one op. Else a
    schedule missing an lm_head or an expert op is measured as a whole run (its logits a model's
    with that expert skipped), one without its gates fails inside an op, and a second lm_head runs
    twice."""
    computed: Counter[tuple[str, int, int, int]] = Counter()  # (what, step, layer, batch)
    experts = np.zeros(routing.counts.shape, dtype=np.int64)  # [step, layer, batch, expert]
    for op in schedule.ops:
        if op.kind != "compute":
            continue
        if op.category == "expert":
            for b in op.batches:
                experts[op.step, op.layer, b, op.expert] += 1
            continue
        what = _ONCE.get(op.category)
        if what:
            for b in op.batches:
                computed[(what, op.step, op.layer if what in _PER_LAYER else -1, b)] += 1
    missing = [
        (b, step)
        for step in range(shape.num_steps)
        for b in range(shape.num_batches)
        if not computed[("lm_head", step, -1, b)]
    ]
    if missing:  # (said first, and of them all: the run's tokens are what it measures)
        b, step = missing[0]
        raise ScheduleError(
            f"no lm_head op makes batch {b}'s tokens at step {step} ({len(missing)} of the run's "
            f"{shape.num_batches * shape.num_steps} batch-steps have none): not a whole run"
        )
    for what in _ONCE_ORDER:
        for step in range(shape.num_steps):
            for layer in range(routing.num_layers) if what in _PER_LAYER else (-1,):
                for b in range(shape.num_batches):
                    times = computed[(what, step, layer, b)]
                    if times != 1:
                        where = f"batch {b} at step {step}" + (f", layer {layer}" if layer >= 0 else "")
                        raise ScheduleError(f"{where}: {times} {what} ops (one computes it){_NOT_A_RUN}")
    twice = np.argwhere(experts > 1)
    if len(twice):
        step, layer, b, e = twice[0].tolist()
        raise ScheduleError(
            f"expert {e} of layer {layer} is computed for batch {b} at step {step} by "
            f"{experts[step, layer, b, e]} ops (each token once){_NOT_A_RUN}"
        )
    uncomputed = np.argwhere((experts == 0) & (routing.counts > 0))
    if len(uncomputed):
        step, layer, b, e = uncomputed[0].tolist()
        raise ScheduleError(
            f"no expert op computes expert {e} of layer {layer} for batch {b} at step {step} (the "
            f"routing sends it {routing.counts[step, layer, b, e]} token(s); {len(uncomputed)} such "
            f"in all){_NOT_A_RUN}"
        )


# what of each batch one op computes, by category: per step, or per step and layer
_ONCE = {
    "embed": "embed",
    "attention": "attention",
    "gate": "gate or dense MLP",
    "dense_mlp": "gate or dense MLP",
    "lm_head": "lm_head",
}
_ONCE_ORDER = ("embed", "attention", "gate or dense MLP", "lm_head")
_PER_LAYER = frozenset({"attention", "gate or dense MLP"})
_NOT_A_RUN = ": not the run the routing and shape describe"


class OpRunner:
    """The effect of each op on real tensors; the CPU and CUDA drivers share it."""

    def __init__(
        self,
        schedule: Schedule,
        spec: ModelSpec,
        weights: WeightStore,
        routing: RoutingTable,
        options: ExecOptions,
        disk_dir: Path | None = None,
    ) -> None:
        check_compatible(schedule, spec, weights, routing)
        self.schedule, self.spec, self.weights, self.routing, self.opt = schedule, spec, weights, routing, options
        self.shape: RunShape = routing.shape
        self.device = torch.device(options.device)
        self.dtype = next(iter(weights.resident.values())).dtype
        self.ops_by_id = {op.id: op for op in schedule.ops}
        placement = schedule.meta.get("placement", {})
        self.resident_layers = int(placement.get("resident_layers", 0))
        gen = torch.Generator().manual_seed(options.seed)
        sh = self.shape
        self.prompt = (
            torch.as_tensor(options.prompt)
            if options.prompt is not None
            else torch.randint(0, spec.vocab_size, (sh.num_batches, sh.batch_size, sh.prompt_len), generator=gen)
        )
        self.buffers: dict[str, Any] = {}  # the device store: buffer name -> tensors
        self.buffer_bytes: dict[str, int] = {}
        self.lock = threading.Lock()
        # Adds into one batch's MoE output (`moe_out`) are ordered after its gate and before the next
        # layer reads it, but not among themselves: a GPU expert on the compute stream and a CPU
        # expert's output arriving on the `h2d_act` stream may add at once (on CUDA each add is atomic).
        # On the CPU both are read-modify-writes from two threads, and a row added at once by both
        # keeps one of them: the lock keeps each add whole.
        self.output_lock = threading.Lock()
        self.in_use = 0
        self.peak = 0
        self.memory_trace: list[tuple[float, int]] = []
        self.t0 = time.perf_counter()
        self.host_kv: dict[tuple[int, int], list[tuple[torch.Tensor, torch.Tensor]]] = {}
        self.pending_store: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
        self.staging: dict[str, Any] = {}
        self.disk_dir = disk_dir
        self.pinned_pool = PinnedPool()
        self.staged_from_pool: dict[str, tuple[torch.Tensor, ...]] = {}  # H2D op -> pooled buffers it reads
        self.disk_times: dict[str, tuple[float, float]] = {}  # disk read -> host-clock start, end
        # CUDA: host seconds the issuing thread spent on each op it issued (op index -> seconds;
        # calibration costs `gpu.copy_issue_s` from it)
        self.issue_s: dict[int, float] = {}
        # per-batch activations
        self.x: dict[int, torch.Tensor] = {}
        self.h: dict[int, torch.Tensor] = {}
        self.z: dict[int, torch.Tensor] = {}
        self.route: dict[int, tuple[torch.Tensor, torch.Tensor, np.ndarray | None]] = {}  # ids, weights, forced ids
        self.moe_out: dict[int, torch.Tensor | None] = {}
        self.next_token: dict[int, torch.Tensor] = {}
        self.logits: dict[tuple[int, int], torch.Tensor] = {}
        self.expert_tokens: dict[str, int] = {}
        self.resident = {k: v.to(self.device) for k, v in weights.resident.items()}
        # weights on the GPU for the whole run: whole resident layers, and single tensors a policy
        # keeps there (meta `resident_weights`: [tensor, layer, expert] — Fiddler's attention, gates
        # and popular experts)
        pinned_there = {tuple(k[:2]) if k[2] < 0 else tuple(k) for k in schedule.meta.get("resident_weights", ())}

        def on_device(key: tuple, tensors: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
            moved = tuple(t.to(self.device) for t in tensors)  # resident experts are dequantised once
            return (
                kernels.dequantise_expert(moved, spec, self.dtype) if spec.quantised and key[0] == "expert" else moved
            )

        self.resident_layer_tensors = {
            key: on_device(key, v)
            for key, v in weights.tensors.items()
            if key[1] < self.resident_layers or key in pinned_there
        }
        # d2h_act op -> batch -> (hidden states, routing weights, routed ids unless forced), or a CPU
        # attention's (q, k, v)
        self.host_activations: dict[str, dict[int, tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]]] = {}
        self.cpu_results: dict[str, list[tuple[int, torch.Tensor, torch.Tensor]]] = {}  # CPU expert -> outputs
        self.activation_readers: dict[str, int] = {}  # d2h_act op -> CPU experts still to read it
        for o in schedule.ops:
            if schedule.streams[o.stream] == "cpu":
                for d in o.deps:
                    if self.ops_by_id[d].tensor == "activation":
                        self.activation_readers[d] = self.activation_readers.get(d, 0) + 1
        # what each compute op does, by category (a table, not a name lookup)
        self.compute_ops = {
            "embed": self._embed,
            "attention": self._attention,
            "gate": self._gate,
            "expert": self._expert,
            "lm_head": self._lm_head,
            "combine": lambda op: None,
            "dequant": self._dequant,
            "attn_qkv": self._attn_qkv,
            "attn_out": self._attn_out,
            "dense_mlp": self._dense_mlp,
        }
        self.pending_qkv: dict[str, tuple[torch.Tensor, ...]] = {}  # attn_qkv op -> this step's q, k, v
        self.attention_out: dict[str, torch.Tensor] = {}  # CPU attention / its h2d copy -> the heads' output
        self.on_cpu = {s for s, r in schedule.streams.items() if r == "cpu"}
        # a tensor-parallel group's ranks (`ranks.py`), their partial sums until the op's all-reduce
        group = tensor_parallel_ranks(schedule)
        if group > 1 and self.device.type != "cpu":
            raise ExecutionError(
                f"a {group}-GPU tensor-parallel schedule runs on the CPU runtime (--device cpu), its ranks emulated "
                f"as threads; the CUDA executor runs one GPU's (torch sees {torch.cuda.device_count()} CUDA "
                f"device(s) here; a group on {group} real GPUs is not executed yet)"
            )
        self.ranks = Ranks(spec, group) if group > 1 else None
        self.attention_partials: dict[int, list[torch.Tensor]] = {}  # batch -> each rank's attention output
        self.mlp_partials: dict[int, list[torch.Tensor]] = {}  # batch -> each rank's MoE or dense MLP output
        self.compute_ops["allreduce"] = self._all_reduce
        assert set(self.compute_ops) == set(KERNEL_CATEGORIES)  # (the check above names what runs here)
        self._alloc(
            "resident",
            tensor_bytes(list(self.resident.values()))
            + tensor_bytes([t for v in self.resident_layer_tensors.values() for t in v]),
        )

    # ---- memory accounting ----------------------------------------------------------------------
    def _alloc(self, name: str, nbytes: int) -> None:
        with self.lock:
            self.buffer_bytes[name] = nbytes
            self.in_use += nbytes
            self.peak = max(self.peak, self.in_use)
            self.memory_trace.append((time.perf_counter() - self.t0, self.in_use))

    def _free(self, name: str) -> None:
        with self.lock:
            self.buffers.pop(name, None)
            self.in_use -= self.buffer_bytes.pop(name, 0)
            self.memory_trace.append((time.perf_counter() - self.t0, self.in_use))

    def _store(self, name: str, tensors: Any) -> None:
        self.buffers[name] = tensors
        self._alloc(name, tensor_bytes(tensors))

    # ---- dispatch ---------------------------------------------------------------------------------
    def run(self, op: Op) -> None:
        """Carry out one op (a host op's waiting is the driver's business: nothing to do here)."""
        if op.kind == "transfer":
            if is_disk_read(op):
                self._disk_read(op)
            elif op.tensor == "kv":
                self._kv_transfer(op)
            elif op.tensor == "activation":
                self._activation_transfer(op)
            else:
                self._load_weights(op)
        elif op.kind == "compute" and op.stream in self.on_cpu:
            if op.category == "expert":
                self._cpu_expert(op)
            elif op.category == "attention":
                self._cpu_attention(op)
            else:
                raise ExecutionError(f"op {op.id!r}: the host CPU runs expert and attention ops, not {op.category!r}")
        elif op.kind == "compute":
            compute = self.compute_ops.get(op.category)
            if compute is None:
                raise ExecutionError(f"op {op.id!r}: no kernel for compute category {op.category!r}")
            compute(op)
        for name in op.free:
            self._free(name)

    def weights_for(self, op: Op, tensor: str, expert: int = -1) -> tuple[torch.Tensor, ...]:
        """The device copy of the weights an op computes with: the buffer its load filled (a
        dependency), or the resident copy of a resident layer."""
        for dep in op.deps:
            d = self.ops_by_id[dep]
            dequantised = d.category == "dequant" and tensor == "expert"
            if (
                (dequantised or d.kind == "transfer" and d.tensor == tensor and d.dst == "gpu")
                and d.layer == op.layer
                and (expert < 0 or d.expert == expert)
            ):
                try:
                    return self.buffers[dep]
                except KeyError:
                    raise ExecutionError(f"op {op.id!r}: buffer {dep!r} was freed before use") from None
        key = (tensor, op.layer) if expert < 0 else (tensor, op.layer, expert)
        if key in self.resident_layer_tensors:
            return self.resident_layer_tensors[key]
        raise ExecutionError(
            f"op {op.id!r}: no loaded {tensor} weights for layer {op.layer}"
            + (f" expert {expert}" if expert >= 0 else "")
        )

    # ---- transfers --------------------------------------------------------------------------------
    def _load_weights(self, op: Op) -> None:
        staged = [d for d in op.deps if is_disk_read(self.ops_by_id[d])]
        cuda = self.device.type == "cuda"
        host = (
            self.staging.pop(staged[0])
            if staged
            else self.weights.host(op.tensor, op.layer, op.expert, pinned=cuda and not op.pageable)
        )
        if staged and cuda:
            self.staged_from_pool[op.id] = host  # back to the pool once this copy has finished
        self._store(op.id, tuple(t.to(self.device, non_blocking=not op.pageable) if cuda else t.clone() for t in host))

    def _disk_read(self, op: Op) -> None:
        """A real file read into host memory (on CUDA: into reused pinned buffers), timed around the
        read itself on the host clock."""
        if self.disk_dir is None:
            raise ExecutionError(f"op {op.id!r}: the schedule reads from disk but no disk directory was set up")
        path = self.disk_dir / _disk_name(op.tensor, op.layer, op.expert)
        begin = time.perf_counter()
        tensors = torch.load(path, weights_only=True)
        if self.device.type == "cuda":
            tensors = tuple(self.pinned_pool.take(t).copy_(t) for t in tensors)
        self.disk_times[op.id] = (begin - self.t0, time.perf_counter() - self.t0)
        self.staging[op.id] = tensors

    def _kv_transfer(self, op: Op) -> None:
        """KV cache to and from host memory. Pinned (as a schedule's `pageable=False` says): the
        store copies into pinned host buffers and the load copies each stored chunk into a device
        buffer, both asynchronously on their streams (ordered on the GPU by the stores' events, no
        host wait); pageable: blocking copies, as the simulator models them."""
        key = (op.layer, op.batch)
        cuda = self.device.type == "cuda"
        if op.stream == "d2h_kv":  # store the new entries the attention produced
            attention = next((d for d in op.deps if self.ops_by_id[d].category == "attention"), None)
            if attention not in self.pending_store:  # (an edited schedule's: name what is missing)
                raise ExecutionError(
                    f"op {op.id!r}: a KV store needs among its deps the attention op whose new "
                    f"entries it stores, one that keeps them off the GPU (deps {list(op.deps)})"
                )
            k, v = self.pending_store.pop(attention)
            if cuda and not op.pageable:
                hk = torch.empty(k.shape, dtype=k.dtype, pin_memory=True).copy_(k, non_blocking=True)
                hv = torch.empty(v.shape, dtype=v.dtype, pin_memory=True).copy_(v, non_blocking=True)
            else:
                hk, hv = k.to("cpu"), v.to("cpu")
            self.host_kv.setdefault(key, []).append((hk, hv))
            return
        chunks = self.host_kv.get(key, [])
        if not chunks:
            raise ExecutionError(f"op {op.id!r}: no KV cache stored for layer {op.layer} batch {op.batch}")
        if cuda:
            tokens = sum(c[0].shape[2] for c in chunks)  # K and V (MLA: latent and RoPE key) may differ in width
            k = torch.empty(
                [*chunks[0][0].shape[:2], tokens, chunks[0][0].shape[3]], dtype=chunks[0][0].dtype, device=self.device
            )
            v = torch.empty(
                [*chunks[0][1].shape[:2], tokens, chunks[0][1].shape[3]], dtype=chunks[0][1].dtype, device=self.device
            )
            at = 0
            for ck, cv in chunks:
                width = ck.shape[2]
                k[:, :, at : at + width].copy_(ck, non_blocking=not op.pageable)
                v[:, :, at : at + width].copy_(cv, non_blocking=not op.pageable)
                at += width
        else:
            k = torch.cat([c[0] for c in chunks], dim=2)
            v = torch.cat([c[1] for c in chunks], dim=2)
        self._store(op.id, (k, v))

    def _activation_transfer(self, op: Op) -> None:
        """Hidden states down to host memory for CPU experts (`d2h_act`, with the routing weights
        and, unless forced, the routed ids: the CPU thread then never reads GPU memory), or a CPU
        expert's output back up (`h2d_act`), added into its batches' MoE output on arrival. On CUDA
        the copies are asynchronous through pooled pinned buffers (the CPU op waits for this op's
        event; the pool takes a buffer back once the copy that reads it has finished)."""
        cuda = self.device.type == "cuda"

        def down(t: torch.Tensor) -> torch.Tensor:
            if not cuda:
                return t.to("cpu", copy=True)
            return self.pinned_pool.take(t).copy_(t, non_blocking=not op.pageable)

        qkv = next((d for d in op.deps if d in self.pending_qkv), None)
        if op.dst == "cpu" and qkv is not None:  # attention on the CPU: this step's q, k, v go down
            q, k, v = self.pending_qkv.pop(qkv)
            self.host_activations[op.id] = {op.batch: (down(q), down(k), down(v))}
            return
        if op.dst == "cpu":
            self.host_activations[op.id] = {
                b: (
                    down(self.z[b]),
                    down(self.route[b][1]),
                    down(self.route[b][0]) if self.route[b][2] is None else None,
                )
                for b in op.batches
            }
            return
        attention = next((d for d in op.deps if d in self.attention_out), None)
        if attention is not None:  # the CPU attention's output comes back
            out = self.attention_out.pop(attention)
            self.attention_out[op.id] = out.to(self.device, non_blocking=cuda and out.is_pinned())
            if cuda:
                self.staged_from_pool[op.id] = (out,)
            return
        source = next((d for d in op.deps if d in self.cpu_results), None)
        if source is None:
            raise ExecutionError(f"op {op.id!r}: no CPU expert output to bring back (deps {list(op.deps)})")
        results = self.cpu_results.pop(source)
        for b, rows, y in results:
            moe_out = self.moe_out[b]
            assert moe_out is not None  # (the batch's gate op set its MoE output, which its experts add into)
            if cuda:  # used on this copy stream as well as the compute stream (atomic adds on both)
                moe_out.record_stream(torch.cuda.current_stream())
            rows, y = kernels.upload(rows, self.device), y.to(self.device, non_blocking=cuda)
            with self.output_lock:
                moe_out.index_add_(0, rows, y)
        if cuda:
            self.staged_from_pool[op.id] = tuple(y for _, _, y in results)

    def _cpu_expert(self, op: Op) -> None:
        """One expert on the host CPU, from its weights in host memory and what a `d2h_act` copy
        brought down; its output waits for the `h2d_act` copy that follows."""
        down = next((d for d in op.deps if d in self.host_activations), None)
        if down is None:
            raise ExecutionError(f"op {op.id!r}: a CPU expert needs its hidden states copied down first")
        host = self.host_activations[down]
        w = self.weights.host("expert", op.layer, op.expert)
        if self.spec.quantised:  # the CPU computes on the weights in the model dtype
            w = kernels.dequantise_expert(w, self.spec, self.dtype)
        results, tokens = [], 0
        for b in op.batches:
            hidden, scales, ids = host[b]
            routed = self.route[b][2]  # the forced ids, else the routed ones copied down
            if routed is None:
                assert ids is not None  # (`_activation_transfer` copies the routed ids down unless forced)
                routed = ids.numpy()
            rows_np, slots_np = np.nonzero(routed == op.expert)
            if not len(rows_np):
                continue
            rows, slots = torch.from_numpy(rows_np), torch.from_numpy(slots_np)
            y = kernels.expert(hidden[rows], w) * scales[rows, slots][:, None].to(hidden.dtype)
            if self.device.type == "cuda":
                y = self.pinned_pool.take(y).copy_(y)
            results.append((b, rows, y))
            tokens += len(rows_np)
        self.expert_tokens[op.id] = tokens
        self.cpu_results[op.id] = results
        self._release_activations(down)

    def _release_activations(self, down: str) -> None:
        """The last CPU expert reading a `d2h_act` copy hands its buffers back to the pool."""
        with self.lock:
            self.activation_readers[down] -= 1
            last = self.activation_readers[down] == 0
        if last:
            for tensors in self.host_activations.pop(down).values():
                for t in tensors:
                    if t is not None and self.device.type == "cuda":
                        self.pinned_pool.give_back(t, None)

    def _cpu_attention(self, op: Op) -> None:
        """A decode attention on the host CPU over this batch's KV cache in host memory (the
        prefill's stored chunk, then each decode step's k, v appended here)."""
        down = next((d for d in op.deps if d in self.host_activations), None)
        if down is None:
            raise ExecutionError(f"op {op.id!r}: a CPU attention needs its q, k, v copied down first")
        q, k, v = self.host_activations.pop(down)[op.batch]
        assert v is not None  # (the copy before a CPU attention holds its q, k and v: `_activation_transfer`)
        key = (op.layer, op.batch)
        past = self.host_kv.get(key, [])
        out = kernels.attention_core(q, k, v, [tuple(t.to("cpu") for t in c) for c in past], self.spec)
        self.host_kv.setdefault(key, []).append((k.clone(), v.clone()))
        self.attention_out[op.id] = self.pinned_pool.take(out).copy_(out) if self.device.type == "cuda" else out

    # ---- compute ----------------------------------------------------------------------------------
    def _attn_qkv(self, op: Op) -> None:
        """The GPU half before a CPU attention: norm, q/k/v, RoPE of this step's tokens."""
        b = op.batch
        self._combine(b)
        pos0 = self.shape.prompt_len + op.step - 1
        w = self.weights_for(op, "attention")
        self.pending_qkv[op.id] = kernels.attention_qkv(
            self.x[b],
            w,
            self.resident[f"norm1/{op.layer}"],
            pos0,
            self.spec,
            self.weights.rope_theta,
            self.weights.rms_eps,
            kernels.qk_norms(self.resident, self.spec, op.layer),
        )

    def _attn_out(self, op: Op) -> None:
        """The GPU half after: o over the heads' output the CPU sent back, plus the residual."""
        up = next((d for d in op.deps if d in self.attention_out), None)
        if up is None:
            raise ExecutionError(f"op {op.id!r}: no attention output came back from the CPU")
        wo = self.weights_for(op, "attention")[3]
        self.h[op.batch] = self.x[op.batch] + torch.nn.functional.linear(self.attention_out.pop(up), wo)

    def _dequant(self, op: Op) -> None:
        """A quantised expert's copy, dequantised on the device into a buffer of its own (the copy
        is freed by the op's `free`)."""
        load = next((d for d in op.deps if d in self.buffers and self.ops_by_id[d].kind == "transfer"), None)
        if load is None:
            raise ExecutionError(f"op {op.id!r}: no copied expert to dequantise")
        self._store(op.id, kernels.dequantise_expert(self.buffers[load], self.spec, self.dtype))

    def _combine(self, b: int) -> None:
        """Apply the previous MoE layer's output to the residual stream of batch b."""
        moe_out = self.moe_out.get(b)
        if moe_out is not None:
            self.x[b] = self.h[b] + moe_out.view_as(self.h[b])
            self.moe_out[b] = None

    def _embed(self, op: Op) -> None:
        b = op.batch
        if op.step > 0 and b not in self.next_token:  # (a schedule edited by hand, or one wired wrongly)
            raise ExecutionError(
                f"batch {b} has no token generated at step {op.step - 1} to embed: the schedule "
                f"must run that step's lm_head op of batch {b} before this op"
            )
        tokens = self.prompt[b] if op.step == 0 else self.next_token[b]
        self.x[b] = kernels.embed(kernels.upload(tokens, self.device), self.resident["embed"])
        self.moe_out[b] = None

    def _attention(self, op: Op) -> None:
        b, layer, sh = op.batch, op.layer, self.shape
        self._combine(b)
        pos0 = 0 if op.step == 0 else sh.prompt_len + op.step - 1
        loaded = [d for d in op.deps if self.ops_by_id[d].tensor == "kv"]
        if loaded:
            past = [self.buffers[loaded[0]]]
        else:
            names = [kv_buffer(layer, b, s) for s in range(op.step)]
            past = [self.buffers[name] for name in names if name in self.buffers]
        w = self.weights_for(op, "attention")
        impl = variant_impl(op.variant) or "fused"  # (without the model's tags: `fused+qk_norm`)
        norm, qk = self.resident[f"norm1/{layer}"], kernels.qk_norms(self.resident, self.spec, layer)
        theta, eps = self.weights.rope_theta, self.weights.rms_eps
        ranks = self.ranks
        if ranks is not None:  # each rank its heads; the batch's all-reduce adds their outputs to x

            def heads(r: int) -> tuple[torch.Tensor, tuple]:
                attention = ranks.attention(w, r)
                return kernels.attention(
                    self.x[b], attention, norm, ranks.kv(past, r), pos0, ranks.rank_spec, theta, eps, impl, qk, False
                )

            outs = ranks.each(heads)
            self.attention_partials[b] = [out for out, _ in outs]
            chunk = tuple(torch.cat([c[i] for _, c in outs], dim=1) for i in range(2))
        else:
            out, chunk = kernels.attention(self.x[b], w, norm, past, pos0, self.spec, theta, eps, impl, qk)
            self.h[b] = out
        for name, _ in op.alloc:  # this step's KV entries stay on the GPU
            self._store(name, chunk)
        if not op.alloc:
            self.pending_store[op.id] = chunk

    def _dense_mlp(self, op: Op) -> None:
        """A dense layer's MLP (DeepSeek's first layers), in the gate op's place: no routing, no experts."""
        b = op.batch
        z = kernels.rms_norm(self.h[b], self.resident[f"norm2/{op.layer}"], self.weights.rms_eps)
        z, w = z.reshape(-1, z.shape[-1]), self.weights_for(op, "gate")
        ranks = self.ranks
        if ranks is not None:
            self.mlp_partials[b] = ranks.each(lambda r: kernels.expert(z, ranks.ffn(w, r)))
        else:
            self.moe_out[b] = kernels.expert(z, w)

    def _gate(self, op: Op) -> None:
        b, layer = op.batch, op.layer
        router_w, *shared = self.weights_for(op, "gate")
        forced = (
            self.routing.step_ids(op.step, layer, b).reshape(-1, self.spec.top_k).astype(np.int64)
            if self.opt.force_routing
            else None
        )
        norm, k, eps, renormalise = (
            self.resident[f"norm2/{layer}"],
            self.spec.top_k,
            self.weights.rms_eps,
            self.spec.norm_topk_prob,
        )
        ranks = self.ranks
        if ranks is not None:  # every rank routes (the same), each computes its share of the shared experts
            steps = ranks.each(
                lambda r: kernels.gate_step(
                    self.h[b], norm, router_w, k, eps, forced, ranks.shared(tuple(shared), r), renormalise
                )
            )
            z, weights, ids, _ = steps[0]
            self.mlp_partials[b] = [out for *_, out in steps]
        else:
            z, weights, ids, out = kernels.gate_step(
                self.h[b], norm, router_w, k, eps, forced, tuple(shared), renormalise
            )
            self.moe_out[b] = out
        self.z[b] = z
        self.route[b] = (ids, weights, forced)

    def _expert(self, op: Op) -> None:
        """One expert over its tokens from every batch of the op, in one kernel call (as the
        schedule's FLOPs and the calibration assume), results added back batch by batch."""
        w = self.weights_for(op, "expert", op.expert)
        parts = []
        for b in op.batches:
            ids, weights, ids_np = self.route[b]
            if ids_np is not None:  # forced routing: token rows known on the host, no device sync
                rows, slots = kernels.upload(np.stack(np.nonzero(ids_np == op.expert)), self.device)
            else:
                rows, slots = torch.nonzero(ids == op.expert, as_tuple=True)
            if len(rows):
                parts.append((b, rows, slots))
        self.expert_tokens[op.id] = sum(len(r) for _, r, _ in parts)
        if not parts:
            return
        ranks = self.ranks
        if ranks is not None:  # each rank its share of the expert's width, into its own partial sums
            ranks.each(lambda r: self._expert_into(parts, ranks.ffn(w, r), lambda b: self.mlp_partials[b][r]))
        else:
            self._expert_into(parts, w, self._moe_out)

    def _moe_out(self, b: int) -> torch.Tensor:
        out = self.moe_out[b]
        assert out is not None  # (the batch's gate op set its MoE output, which its experts add into)
        return out

    def _expert_into(
        self,
        parts: list[tuple[int, torch.Tensor, torch.Tensor]],
        w: tuple[torch.Tensor, ...],
        out_of: Callable[[int], torch.Tensor],
    ) -> None:
        """An expert (`w`) over its rows of each batch, its gate-weighted output added into `out_of(batch)`."""
        if len(parts) == 1:
            b, rows, slots = parts[0]
            kernels.expert_step(self.z[b], self.route[b][1], rows, slots, w, out_of(b), self.output_lock)
            return
        x = torch.cat([self.z[b][rows] for b, rows, _ in parts])
        scale = torch.cat([self.route[b][1][rows, slots] for b, rows, slots in parts])
        y = kernels.expert(x, w) * scale[:, None].to(x.dtype)
        offset = 0
        with self.output_lock:
            for b, rows, _ in parts:
                out_of(b).index_add_(0, rows, y[offset : offset + len(rows)])
                offset += len(rows)

    def _all_reduce(self, op: Op) -> None:
        """A tensor-parallel layer's all-reduce of one batch: after attention the ranks' outputs added
        to the residual stream, after the MLP side the ranks' MoE or dense MLP outputs added up."""
        b = op.batches[0]
        if b in self.attention_partials and self.ops_by_id[op.deps[0]].category == "attention":
            self.h[b] = self.x[b] + all_reduce(self.attention_partials.pop(b))
        elif b in self.mlp_partials:
            self.moe_out[b] = all_reduce(self.mlp_partials.pop(b))
        else:
            raise ExecutionError(f"op {op.id!r}: no partial sums of batch {b} to all-reduce")

    def _lm_head(self, op: Op) -> None:
        b = op.batch
        self._combine(b)
        last = self.x[b].reshape(self.shape.batch_size, -1, self.spec.hidden_size)[:, -1:, :]
        logits = kernels.lm_head(last, self.resident["final_norm"], self.resident["lm_head"], self.weights.rms_eps)
        self.next_token[b] = logits.argmax(dim=-1)
        if self.opt.record_logits:
            self.logits[(op.step, b)] = logits[:, 0].detach().to("cpu")


def _disk_name(tensor: str, layer: int, expert: int) -> str:
    return f"{tensor}-L{layer}" + (f"-E{expert}" if expert >= 0 else "") + ".pt"


def prepare_disk(schedule: Schedule, weights: WeightStore, directory: Path) -> Path:
    """Write every disk-tier tensor the schedule reads to its own file (real files, real reads)."""
    directory.mkdir(parents=True, exist_ok=True)
    for op in schedule.ops:
        if is_disk_read(op):
            path = directory / _disk_name(op.tensor, op.layer, op.expert)
            if not path.exists():
                torch.save(tuple(t.contiguous() for t in weights.get(op.tensor, op.layer, op.expert)), path)
    return directory


def require_cuda(device: str) -> None:
    """A CUDA device asked for where torch sees none: one line (execute and calibrate), not a traceback."""
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise ExecutionError("CUDA was requested but torch sees no GPU (use --device cpu)")


def execute(
    schedule: Schedule,
    spec: ModelSpec,
    weights: WeightStore,
    routing: RoutingTable,
    options: ExecOptions = ExecOptions(),
) -> tuple[Timeline, OpRunner]:
    """Run every op of `schedule` and return the measured Timeline (and the runner, whose state
    holds logits and per-expert token counts for checks)."""
    check_emulation(schedule, options)
    with tempfile.TemporaryDirectory(prefix="klotski-disk-") as tmp:
        disk = prepare_disk(schedule, weights, Path(tmp)) if any(map(is_disk_read, schedule.ops)) else None
        runner = OpRunner(schedule, spec, weights, routing, options, disk)
        timeline = measure_run(
            schedule,
            runner,
            options,
            weights,
            {"weight_notes": weights.notes, "routing_forced": options.force_routing},
        )
    return timeline, runner


def emulated_rate(rates: Mapping[str, float | None], resource: str) -> float | None:
    """The emulated rate of `resource`: its own, or for a rank's link (`pcie_h2d@1`) its kind's."""
    return rates.get(resource, rates.get(base_resource(resource)))


def check_emulation(schedule: Schedule, options: ExecOptions) -> None:
    """Refuse, before anything runs, what emulated links cannot do: emulation off the CPU, copies
    that would sleep for hours, pageable copies over a link emulated without a pageable rate."""
    require_cuda(options.device)
    if options.emulate_links and not options.device == "cpu":
        raise ExecutionError("link emulation is for the CPU device only")
    copying: dict[str, list[float]] = {}  # emulated link -> [seconds, bytes] of the schedule's copies over it
    for op in schedule.ops:
        resource = schedule.streams[op.stream]
        rate = emulated_rate(options.emulate_pageable if op.pageable else options.emulate_links, resource)
        if op.kind == "transfer" and rate:
            total = copying.setdefault(resource, [0.0, 0])
            total[0] += op.bytes / rate
            total[1] += op.bytes
    for resource, (seconds, moved) in sorted(copying.items()):
        if seconds > MAX_EMULATED_S:  # (a lower bound of the run's time: ops of one link run one after another)
            rate = emulated_rate(options.emulate_links, resource) or emulated_rate(options.emulate_pageable, resource)
            raise ExecutionError(
                f"emulated {resource} at {rate:.3g} B/s: the schedule's "
                f"copies over it ({moved:,} bytes) would take {seconds / 3600:.1f} h, more than "
                f"{MAX_EMULATED_S / 3600:g} h: refused (check the emulated rate)"
            )
    pageable = {schedule.streams[op.stream] for op in schedule.ops if op.pageable}
    missing = sorted(r for r in pageable if r in options.emulate_links and r not in options.emulate_pageable)
    if missing:
        raise ExecutionError(
            f"the schedule copies from pageable memory over emulated {', '.join(missing)}: "
            f"give the emulated pageable rate too (emulate_pageable)"
        )


def measure_run(
    schedule: Schedule, runner: "OpRunner", options: ExecOptions, weights: WeightStore, meta: Mapping[str, Any]
) -> Timeline:
    """Run every op of `schedule` by `runner` on its device (a CUDA stream per stream, or a CPU
    thread per stream) and return the measured Timeline: what ran where, on which weights, over
    which links (emulated ones labelled so), with `meta` added."""
    ranks: Ranks | None = getattr(runner, "ranks", None)  # (a serving runner has none)
    if options.device.startswith("cuda"):
        start, end = _run_cuda(schedule, runner)
        peak = max(runner.peak, torch.cuda.max_memory_allocated())
    else:
        # quick_switch: the stream threads wait on each other
        with cpu_threads(compute_threads(options.device, options.threads), quick_switch=True):
            start, end = _run_cpu(schedule, runner, options)
        peak = runner.peak
    emulated = dict(options.emulate_links)
    device_name = torch.cuda.get_device_name() if options.device.startswith("cuda") else "cpu"
    planned_for = schedule.meta.get("hardware")
    return Timeline.from_schedule(
        schedule,
        start,
        end,
        status="ok",
        peak_gpu_bytes=peak,
        memory_trace=runner.memory_trace,
        capacities=resource_units(schedule, options),
        source="measured",
        extra_meta={
            "device": device_name,
            "hardware": device_name
            if device_name == "cpu" or planned_for is None
            else f"{device_name} (schedule for {planned_for})",
            "weights": weights.source,
            **meta,
            "dtype": str(runner.dtype),
            **(
                {
                    "tensor_parallel_ranks": ranks.count,
                    "emulated_fabric_bytes_per_s": options.emulate_fabric.bandwidth if options.emulate_fabric else None,
                }
                if ranks is not None
                else {}
            ),
            "emulated_links": (
                {
                    "bandwidth_bytes_per_s": emulated,
                    "latency_s": options.link_latency_s,
                    "pageable_bytes_per_s": dict(options.emulate_pageable),
                    "note": "EMULATED links: transfers sleep to the target rate",
                }
                if emulated
                else {}
            ),
        },
    )


_GIVE_UP_S = 10.0  # the most a stopped run waits for each stream's thread to finish its current op


def _run_cpu(schedule: Schedule, runner: OpRunner, options: ExecOptions) -> tuple[list[float], list[float]]:
    """One worker thread per stream; deps are thread events."""
    ops, index = schedule.ops, schedule.index
    n = len(ops)
    done = [threading.Event() for _ in range(n)]
    start, end = [float("nan")] * n, [float("nan")] * n
    abort = threading.Event()
    errors: list[BaseException] = []
    per_stream: dict[str, list[int]] = {}
    for i, op in enumerate(ops):
        per_stream.setdefault(op.stream, []).append(i)
    dep_index = [[index[d] for d in op.deps] if op.kind != "host" else [] for op in ops]
    resources = dict(schedule.streams)
    gates = {r: ResourceGate(units) for r, units in resource_units(schedule, options).items()}
    t0 = runner.t0
    ranks: Ranks | None = getattr(runner, "ranks", None)  # (a serving runner has none)

    def worker(indices: list[int]) -> None:
        try:
            for i in indices:
                if abort.is_set():
                    return
                for d in dep_index[i]:
                    while not done[d].wait(0.05):
                        if abort.is_set():
                            return
                op = ops[i]
                if op.kind == "host":  # the host thread is held from the moment it gets here
                    start[i] = time.perf_counter() - t0
                    for dep in op.deps:
                        while not done[index[dep]].wait(0.05):
                            if abort.is_set():
                                return
                    end[i] = time.perf_counter() - t0
                    done[i].set()
                    continue
                gate = gates[resources[op.stream]]
                if not gate.acquire(time.perf_counter(), i, abort):
                    return
                try:
                    begin = time.perf_counter()
                    start[i] = begin - t0
                    runner.run(op)
                    wire = 0.0  # the least the op lasts on an emulated link or fabric
                    if op.kind == "transfer":
                        rates = options.emulate_pageable if op.pageable else options.emulate_links
                        bw = emulated_rate(rates, resources[op.stream])
                        wire = options.link_latency_s + op.bytes / bw if bw else 0.0
                    elif op.category == "allreduce" and options.emulate_fabric is not None and ranks is not None:
                        # (NCCL's faster of ring and tree on the emulated fabric, as the simulator costs it)
                        wire, _ = best_all_reduce(op.bytes, ranks.count, options.emulate_fabric)
                    elif op.category == "alltoall" and options.emulate_fabric is not None:
                        # (an EP schedule's pairwise exchange: op.bytes are its rounds' largest messages)
                        wire = all_to_all_time(op.bytes, int(schedule.meta.get("ranks", 1)), options.emulate_fabric)
                    remaining = wire - (time.perf_counter() - begin)
                    if remaining > 0:
                        time.sleep(remaining)
                    end[i] = time.perf_counter() - t0
                finally:
                    gate.release()
                done[i].set()
        except BaseException as err:  # noqa: BLE001 - re-raised in the caller with the op named
            errors.append(
                err
                if isinstance(err, ExecutionError)
                # (ours name the op already)
                else ExecutionError(f"op {ops[i].id!r} failed: {type(err).__name__}: {err}")
            )
            abort.set()

    threads = [
        threading.Thread(target=worker, args=(idx,), name=f"stream-{s}", daemon=True) for s, idx in per_stream.items()
    ]
    runner.t0 = t0 = time.perf_counter()
    runner.memory_trace = [(0.0, runner.in_use)]
    for t in threads:
        t.start()
    deadline = time.perf_counter() + options.timeout_s
    try:
        for t in threads:
            t.join(max(0.0, deadline - time.perf_counter()))
    except BaseException:
        # a stop (Ctrl-C, SIGTERM) while the ops run: the threads give up after their current op
        # and are waited for, so that none is inside torch as the interpreter ends (that aborts:
        # "terminate called without an active exception", exit status 134)
        abort.set()
        for t in threads:
            t.join(_GIVE_UP_S)
        raise
    if any(t.is_alive() for t in threads):
        abort.set()
        raise ExecutionError(f"execution did not finish within {options.timeout_s:.0f} s")
    if errors:
        raise errors[0]
    return start, end


def _run_cuda(schedule: Schedule, runner: OpRunner) -> tuple[list[float], list[float]]:
    """One CUDA stream per schedule stream; cross-stream deps as events; CUDA-event timestamps."""
    ops, index = schedule.ops, schedule.index
    streams = {s: torch.cuda.Stream() for s in schedule.streams}
    begin = [torch.cuda.Event(enable_timing=True) for _ in ops]
    finish = [torch.cuda.Event(enable_timing=True) for _ in ops]
    runner.weights.pin()  # pinned once, reused by every copy
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    host_start: dict[int, float] = {}  # host ops are timed on the host clock, started with t0
    host_end: dict[int, float] = {}
    # disk reads run on a thread of their own, in stream order, as FlexGen's and Klotski's copy
    # threads do; the H2D copy that stages a read waits for it only when it is issued
    from concurrent.futures import ThreadPoolExecutor

    reader = ThreadPoolExecutor(max_workers=1, thread_name_prefix="disk_read")
    reads: dict[str, Any] = {}
    # host CPU compute (CPU experts) runs on a thread of its own, in stream order, timed on the host
    # clock; it waits for the GPU work it reads (the hidden states' copy) by that op's CUDA event
    cpu_worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="cpu_compute")

    def on_host_cpu(op: Op, waits: list[Any]) -> None:
        for w in waits:
            w.result() if hasattr(w, "result") else w.synchronize()
        host_start[index[op.id]] = time.perf_counter() - runner.t0
        runner.run(op)
        host_end[index[op.id]] = time.perf_counter() - runner.t0

    def read_from_disk(op: Op, waits: list[Any]) -> None:
        for w in waits:
            w.result()
        runner.run(op)

    t0 = torch.cuda.Event(enable_timing=True)
    t0.record()
    runner.t0 = time.perf_counter()
    issuing, since = -1, 0.0  # the op being issued and when its issue began (host clock)
    for i in topological_order(schedule):
        now = time.perf_counter()
        if issuing >= 0:
            runner.issue_s[issuing] = now - since
        op = ops[i]
        issuing, since = (-1 if op.kind == "host" else i), now
        if op.kind == "host":  # the issuing thread blocks: nothing after it is enqueued before it ends
            host_start[i] = time.perf_counter() - runner.t0
            for d in op.deps:
                if d in reads:
                    reads[d].result()
                else:
                    finish[index[d]].synchronize()
            host_end[i] = time.perf_counter() - runner.t0
            continue
        if op.stream in runner.on_cpu:
            waits = [reads[d] if d in reads else finish[index[d]] for d in op.deps]
            reads[op.id] = cpu_worker.submit(on_host_cpu, op, waits)
            continue
        if is_disk_read(op):
            waits = [reads[d] for d in op.deps if d in reads]
            reads[op.id] = reader.submit(read_from_disk, op, waits)
            continue
        for d in op.deps:  # a copy of staged weights needs the read done (a host wait, as in the systems)
            if d in reads:
                reads[d].result()
        stream = streams[op.stream]
        for d in op.deps:
            if ops[index[d]].stream != op.stream:
                stream.wait_event(finish[index[d]])
        with torch.cuda.stream(stream):
            begin[i].record(stream)
            for dep in op.deps:  # buffers made on other streams are now used on this one
                for t in _tensors(runner.buffers.get(dep)):
                    t.record_stream(stream)
            runner.run(op)
            finish[i].record(stream)
        pooled = runner.staged_from_pool.pop(op.id, None)
        if pooled:
            for buf in pooled:
                runner.pinned_pool.give_back(buf, finish[i])
    if issuing >= 0:
        runner.issue_s[issuing] = time.perf_counter() - since
    for future in reads.values():
        future.result()
    reader.shutdown()
    cpu_worker.shutdown()
    torch.cuda.synchronize()
    for op_id, (a, b) in runner.disk_times.items():  # timed around the read itself, on the host clock
        host_start[index[op_id]], host_end[index[op_id]] = a, b
    start = [host_start[i] if i in host_start else t0.elapsed_time(e) / 1e3 for i, e in enumerate(begin)]
    end = [host_end[i] if i in host_end else t0.elapsed_time(e) / 1e3 for i, e in enumerate(finish)]
    return start, end


def _tensors(value: Any) -> list[torch.Tensor]:
    if value is None:
        return []
    if isinstance(value, torch.Tensor):
        return [value]
    return [t for v in value for t in _tensors(v)]
