"""A serving run: the scheduler decides each iteration from the state at its start, the policy emits
that iteration's ops, the engine times them, and the next decision sees their end.

Scheduling is decided *during* the run, so the iterations are simulated one at a time: each is a
small Schedule of its own ops (their dependencies on the iteration before are met by its start),
timed by the same engine (`run_engine`), and the iteration's end feeds the scheduler (tokens
sampled, requests finished, arrivals meanwhile). An iteration ends with the host waiting for every
op still in flight (the sampled tokens it needs for the next decision), so nothing of one iteration
overlaps the next: the whole run is also one plain Schedule — the ops of every iteration, each
iteration's first ops after the previous iteration's host wait — and, for an offline workload,
simulating that Schedule whole gives the same times (tests/test_serving.py checks it). Idle time
waiting for an online request to arrive has no op: the run's Timeline is assembled from the
iterations' times.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Mapping

import numpy as np

from klotski_sim.core.cost import CostModel
from klotski_sim.core.engine import run_engine
from klotski_sim.core.schedule import Schedule, ScheduleBuilder
from klotski_sim.core.timeline import Timeline
from klotski_sim.hardware.profile import HardwareProfile
from klotski_sim.names import ALLREDUCE_STREAM
from klotski_sim.serving.batcher import BatchingConfig, ContinuousBatcher, ServingRefusal
from klotski_sim.serving.emit import BatchShape, IterationEmitter, expert_pick_probability
from klotski_sim.serving.memory import MemoryPlan, Residency, plan_memory
from klotski_sim.serving.metrics import IterationRecord, RequestRecord, ServingMetrics
from klotski_sim.serving.policies import get_serving_policy
from klotski_sim.serving.policies.base import IterationSeen, ServingSetup, resolve_serving_options
from klotski_sim.serving.requests import Workload
from klotski_sim.serving.templates import CompiledIterations, IterationTemplates
from klotski_sim.workload.model import ModelSpec

GPU_MEMORY_UTILIZATION = 0.9  # vLLM's default (vllm/engine/arg_utils.py; docs/serving.md)


@dataclass(frozen=True)
class ServeSpec:
    """One serving configuration."""

    model: ModelSpec
    profile: HardwareProfile
    policy: str
    workload: Workload
    batching: BatchingConfig = BatchingConfig()
    gpu_memory_utilization: float = GPU_MEMORY_UTILIZATION
    options: Mapping[str, Any] = field(default_factory=dict)
    seed: int = 0  # routing popularity (which experts are hot in each layer)

    def __post_init__(self) -> None:
        u = self.gpu_memory_utilization
        if isinstance(u, bool) or not isinstance(u, (int, float)) or not 0 < u <= 1:
            raise ServingRefusal(f"--gpu-memory-utilization must be in (0, 1], got {u!r}")


@dataclass(frozen=True)
class ServeResult:
    spec: ServeSpec
    residency: Residency
    memory: MemoryPlan
    requests: tuple[RequestRecord, ...]
    iterations: tuple[IterationRecord, ...]
    metrics: ServingMetrics
    meta: Mapping[str, Any]  # what the run's Schedule says of itself (policy, options, decisions, ...)
    schedule: Schedule | None  # None: not kept (`serve(..., keep=False)`: metrics only)
    timeline: Timeline | None


def serve(spec: ServeSpec, cost: CostModel | None = None, keep: bool = True) -> ServeResult:
    """Serve `spec.workload` with `spec.policy` (module docstring). `keep=False` drops each
    iteration's ops once timed: the result has its metrics and iterations but no Schedule or Timeline,
    and the run holds memory for one iteration's ops, not every one's (sweeps, a plain `serve`)."""
    model, profile = spec.model, spec.profile
    options = resolve_serving_options(spec.policy, spec.options)
    setup = ServingSetup(model, profile, spec.batching, spec.workload, spec.gpu_memory_utilization, options)
    policy = get_serving_policy(spec.policy)(setup)
    residency = policy.residency()
    memory = plan_memory(model, profile, residency, spec.batching, spec.gpu_memory_utilization, spec.policy)
    batcher = ContinuousBatcher(spec.workload, spec.batching, memory.num_blocks)
    group = profile.tensor_parallel or 1
    builder = ScheduleBuilder({**policy.streams(), **({ALLREDUCE_STREAM: "fabric"} if group > 1 else {})})
    policy.preload(builder, residency)
    builder.preload("kv/pool", memory.kv_bytes)
    builder.preload("activations", memory.activation_bytes)
    cost = cost or CostModel(profile)
    templates = IterationTemplates(builder.streams, builder.preloaded)
    em = IterationEmitter(model, builder, expert_pick_probability(model, spec.seed), group)
    # a run that keeps its ops emits every iteration; one that does not times known shapes compiled
    compiled = CompiledIterations(cost, em, int(profile.gpu.usable_bytes))
    compiling = not keep and cost.override is None
    timed_compiled = num_ops = 0
    watched = policy.watches_iterations()

    start: list[float] = []
    end: list[float] = []
    ready: list[float] = []
    blocked: list[int] = []
    memory_trace: list[tuple[float, int]] = []
    iterations: list[IterationRecord] = []
    composition: list[list[list[int]]] = []  # per iteration: [request, new tokens, context, prefill, samples]
    peak = 0
    capacities: dict[str, int] = {}
    now = 0.0
    while not batcher.done:
        iteration = batcher.schedule(now)
        if not iteration.seqs:  # nothing can run until the next request arrives
            arrival = batcher.next_arrival_s()
            if arrival is None or arrival <= now:
                raise ServingRefusal(  # (the refusals in ContinuousBatcher make this unreachable)
                    f"{spec.policy}: iteration {iteration.index} at {now:.3f} s can schedule nothing "
                    f"({len(batcher.waiting)} waiting, {batcher.free_blocks} free KV blocks)"
                )
            now = arrival
            continue
        shape = BatchShape.of(iteration)
        prefix = f"it{iteration.index}/"
        key = None
        if compiling and (state := policy.emission_state()) is not None:
            key = (state, templates.live_version, shape.timing_key)
        hit = compiled.get(key)
        if hit is not None:  # a known shape: timed without emitting its ops
            a = compiled.attention_seconds(hit, shape)
            if hit.timing.peak_bound > compiled.capacity and hit.timing.peak_bytes(a) > compiled.capacity:
                hit = None  # (the engine decides, and says so if the plan undercounts)
        if hit is not None:
            timed_compiled += 1
            num_ops += len(hit.ids)
            makespan = hit.timing.makespan(a)
            durations = compiled.durations(hit, a, prefix) if watched else {}
        else:
            first = len(builder.ops)
            em.begin(iteration, shape)
            last = em.embed(policy.start_iteration(em))
            for layer in range(model.num_layers):
                last = policy.layer(em, layer, last)
                if group > 1:  # (the layer's MLP side, wherever it ran, reduced before the next layer reads it)
                    last = em.all_reduce(layer, last, "mlp")
            logits = em.lm_head([last])
            em.end([logits, *policy.finish_iteration(em)])
            ops = builder.ops[first:]
            num_ops += len(ops)
            template = templates.schedule(ops, prefix)
            op_durations = cost.durations(ops, builder.streams)
            ran = run_engine(template, profile, durations=op_durations)
            if ran.oom is not None:
                raise ServingRefusal(
                    f"{spec.policy}: iteration {iteration.index} ran out of GPU memory at op {ran.oom.op_id} "
                    f"({ran.oom.needed_bytes:,} bytes needed, {ran.oom.available_bytes:,} available): "
                    f"the memory plan undercounts ({memory.describe()})"
                )
            held = templates.live_version
            templates.ran(ops)
            if keep:
                composition.append(
                    [[q.request, q.new_tokens, q.context, int(q.prefill), int(q.samples)] for q in iteration.seqs]
                )
                start.extend(now + t for t in ran.start)
                end.extend(now + t for t in ran.end)
                ready.extend(now + t for t in ran.ready)
                blocked.extend(b + first if b >= 0 else -1 for b in ran.blocked_by)
                memory_trace.extend((now + t, b) for t, b in ran.memory_trace)
            else:
                del builder.ops[:]  # (the next iteration's dependencies on these are met by its start)
                if key is not None and held == templates.live_version:
                    compiled.add(key, template, op_durations, prefix)
            peak, capacities = max(peak, ran.peak_gpu_bytes), ran.capacities
            makespan = ran.makespan
            durations = dict(zip((op.id for op in ops), (e - b for b, e in zip(ran.start, ran.end)))) if watched else {}
        finish = now + makespan
        iterations.append(
            IterationRecord(
                iteration.index,
                now,
                finish,
                len(iteration.seqs),
                iteration.tokens,
                iteration.prefill_tokens,
                iteration.decode_seqs,
                iteration.blocks_used,
                iteration.waiting,
                len(iteration.preempted),
            )
        )
        batcher.finish(iteration, finish)
        if watched:
            seen = IterationSeen(
                durations,
                prefix,
                len(iteration.seqs),
                len(batcher.running) + len(batcher.waiting),
                min(batcher.free_blocks, batcher.num_blocks - batcher.min_blocks),
                memory.block_bytes,
            )
            change = policy.after_iteration(seen)
            if change:
                batcher.resize(batcher.num_blocks + change)
        now = finish

    records = tuple(
        RequestRecord(
            s.request.id,
            s.request.prompt_len,
            s.request.output_len,
            s.request.arrival_s,
            float(s.admitted_s if s.admitted_s is not None else np.nan),
            float(s.first_token_s if s.first_token_s is not None else np.nan),
            float(s.finished_s if s.finished_s is not None else np.nan),
            s.preemptions,
            s.request.warmup,
        )
        for s in batcher.seqs
    )
    metrics = ServingMetrics.of(records, iterations, memory.num_blocks)
    meta = {
        "mode": "serving",
        "policy": spec.policy,
        "model": model.name,
        "workload": spec.workload.describe(),
        "options": dict(options),
        "batching": {
            "max_num_seqs": spec.batching.max_num_seqs,
            "max_num_batched_tokens": spec.batching.max_num_batched_tokens,
            "block_size": spec.batching.block_size,
            "chunked_prefill": spec.batching.chunked_prefill,
        },
        "gpu_memory_utilization": spec.gpu_memory_utilization,
        "kv_blocks": memory.num_blocks,
        "kv_blocks_at_end": batcher.num_blocks,
        "decisions": list(policy.decisions),
        "num_iterations": len(iterations),
        "iterations_timed_compiled": timed_compiled,  # (the rest emitted and timed by the engine)
        "num_ops": num_ops,  # every iteration's ops, emitted or compiled
    }
    if not keep:
        return ServeResult(spec, residency, memory, records, tuple(iterations), metrics, meta, None, None)
    # what each iteration computed for each request: the runtime executes a kept run's Schedule from it
    # (attention over each request's own context), as the offline runs' RunShape tells it their batches
    schedule = builder.build({**meta, "iterations": composition})
    timeline = Timeline.from_schedule(
        schedule,
        start=start,
        end=end,
        ready=ready,
        blocked_by=blocked,
        peak_gpu_bytes=peak,
        memory_trace=memory_trace,
        capacities=capacities,
        extra_meta={"hardware": profile.name, "gpu_capacity_bytes": int(profile.gpu.usable_bytes)},
    )
    return ServeResult(spec, residency, memory, records, tuple(iterations), metrics, meta, schedule, timeline)
