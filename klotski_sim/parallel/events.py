"""Expert parallelism in the event engine: each rank's GPU, PCIe link, issuing thread and fabric port a
resource of its own (`gpu@1`, `pcie_h2d@1`, ...), the same plan `decode.plan_expert_parallel` makes.

Per decode step and layer, each rank k runs on its own streams:

- `compute@k`: its sequences' attention with the gate (and a dense layer's MLP or the shared experts);
  after the dispatch, one fused MoE kernel over the tokens of its experts held on its GPU, then each
  expert copied in from host memory, in the order the copies land;
- `alltoall@k`: the dispatch and the combine. Each is an all-to-all of every rank, so it starts
  when the last rank has joined (it depends on every rank's op before it) and lasts the pairwise
  exchange's time (`collectives.all_to_all_time`: the op's bytes are the rounds' largest messages);
- `h2d@k`: the copies of the used experts its GPU does not hold, into `decode.STAGING_SLOTS` GPU
  buffers (a copy waits for the expert before it in that slot to have computed). With `prefetch`,
  the rank copies, as early as a slot is free and its link has finished the copies before, the
  experts it computed at a layer in the step before and does not hold (most tokens first, as many
  as it has slots) — Klotski's hot-expert prefetch on each rank, layers ahead of the compute,
  predicted from the step before (a copy waits for that step's dispatch of the layer), never from
  the step itself; one that the dispatch then does not need is dropped (a `remap` op frees its slot).

What the analytic timing (`decode.simulate_decode`) sums as each layer's slowest rank, the engine
lets happen: a rank waits at a collective only for the ranks that are still working, a copy
overlaps the rank's attention and resident experts, and ranks run dense layers at their own pace.
Without offloading, on a profile without launch or signalling latencies, both give the same step
time (tests/test_parallel_events.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from klotski_sim.core.collectives import critical_bytes
from klotski_sim.core.cost import CostModel
from klotski_sim.core.engine import simulate
from klotski_sim.core.schedule import Op, Schedule
from klotski_sim.core.timeline import Timeline
from klotski_sim.hardware.profile import HardwareProfile, with_overrides
from klotski_sim.names import HOST_STREAM, ranked
from klotski_sim.parallel.decode import (
    STAGING_SLOTS,
    EpLayer,
    EpPlan,
    ParallelResult,
    ParallelSetup,
    Work,
    check_setup,
    ep_result,
    fused_moe,
    plan_expert_parallel,
    rank_attention,
    without_experts,
)
from klotski_sim.util.errors import UsageError
from klotski_sim.workload.model import ModelSpec
from klotski_sim.workload.routing import RoutingTable


@dataclass(frozen=True)
class EventRun:
    """An EP run in the event engine: its result row, its timeline (every rank's resources) and what
    its prefetch did."""

    result: ParallelResult
    timeline: Timeline
    prefetched: int  # expert copies started before the dispatch
    prefetch_used: int  # of those, the ones the dispatch needed
    bubble_s: tuple[float, ...]  # per rank: its GPU's idle time a decode step (between its first and last op)


def rank_streams(rank: int) -> dict[str, str]:
    """A rank's streams and the resources they run on (its own GPU, link, fabric port and thread)."""
    return {
        ranked("compute", rank): ranked("gpu", rank),
        ranked("h2d", rank): ranked("pcie_h2d", rank),
        ranked("alltoall", rank): ranked("fabric", rank),
        ranked(HOST_STREAM, rank): ranked("host", rank),
    }


class _RankBuilder:
    """The ops of one EP run, rank by rank, layer by layer."""

    def __init__(self, model: ModelSpec, plan: EpPlan, routing: RoutingTable, prefetch: bool) -> None:
        self.model, self.plan, self.prefetch = model, plan, prefetch
        self.shape = routing.shape
        self.G = plan.setup.gpus
        self.ops: list[Op] = []
        # per rank: the op that ends its previous layer (its next attention waits for it), and its
        # staging slots' last holders (the op that frees each slot), in the order they were taken
        self.layer_end: list[str | None] = [None] * self.G
        self.slots: list[list[str | None]] = [[None] * STAGING_SLOTS for _ in range(self.G)]
        self.next_slot = [0] * self.G
        self.prefetched = 0
        self.prefetch_used = 0

    def _compute(self, op_id: str, rank: int, work: Work, deps: list[str | None], step: int, layer: int, **tags) -> str:
        self.ops.append(
            Op(
                id=op_id,
                kind="compute",
                stream=ranked("compute", rank),
                category=work.category,
                deps=tuple(d for d in deps if d),
                flops=int(work.flops),
                bytes=int(work.io_bytes),
                step=step + 1,
                phase="decode",
                layer=layer,
                batches=(rank,),
                tokens=work.tokens,
                kv_len=work.kv_len,
                **tags,
            )
        )
        return op_id

    def _copy(
        self, at: str, rank: int, expert: int, deps: list[str | None], step: int, layer: int
    ) -> tuple[str, str, int]:
        """A copy of `expert` into the rank's next staging slot (round robin: the one taken longest
        ago; the copy waits for the op that frees it): its op id, buffer and slot."""
        slot = self.next_slot[rank]
        self.next_slot[rank] = (slot + 1) % STAGING_SLOTS
        holder = self.slots[rank][slot]
        buffer = ranked(f"{at}/e{expert}/slot{slot}", rank)
        op_id = f"{at}/e{expert}/h2d"
        nbytes = self.model.expert_bytes()
        self.ops.append(
            Op(
                id=op_id,
                kind="transfer",
                stream=ranked("h2d", rank),
                category="expert",
                deps=tuple(d for d in [*deps, holder] if d),
                bytes=nbytes,
                src="cpu",
                dst="gpu",
                step=step + 1,
                phase="decode",
                layer=layer,
                expert=expert,
                alloc=((buffer, nbytes),),
                tensor="expert",
            )
        )
        return op_id, buffer, slot

    def layer(self, step: int, layer: int, planned: EpLayer | None, before: EpLayer | None) -> None:
        """Every rank's ops of one layer of one decode step (`before`: the same layer a step earlier)."""
        model, G = self.model, self.G
        kv_len = self.shape.prompt_len + step + 1
        at = [f"s{step + 1}/L{layer}/r{k}" for k in range(G)]
        offload = self.plan.offload
        # prefetch: the experts each rank computed here a step ago and does not hold, hottest first
        early: list[dict[int, tuple[str, str, int]]] = [{} for _ in range(G)]
        if planned is not None and offload is not None and self.prefetch and before is not None:
            for k in range(G):
                used = before.assigned[:, k]
                hot = [e for e in np.argsort(-used, kind="stable") if used[e] > 0 and not self._on_gpu(planned, e, k)]
                for e in hot[:STAGING_SLOTS]:
                    # (not before that step's dispatch of this layer: when the rank learnt what it used)
                    seen = f"s{step}/L{layer}/r{k}/dispatch"
                    early[k][int(e)] = self._copy(f"{at[k]}/pre", k, int(e), [seen], step, layer)
                    self.prefetched += 1
        joined: list[str] = []
        for k, works in enumerate(rank_attention(model, self.plan.seqs_on, kv_len, layer)):
            last = self.layer_end[k]
            for work in works:
                last = self._compute(f"{at[k]}/{work.category}", k, work, [last], step, layer)
            joined.append(last or "")
            self.layer_end[k] = last
        if planned is None:  # a dense layer: no collective, each rank goes on at its own pace
            return
        sent = planned.sent
        there, back = critical_bytes(sent), critical_bytes(sent.T)
        dispatch = [self._collective(f"{at[k]}/dispatch", k, there, sent[k], joined, step, layer) for k in range(G)]
        ends: list[str] = []
        for k in range(G):
            tokens = planned.assigned[:, k]
            held = np.array([self._on_gpu(planned, e, k) for e in range(len(tokens))])
            resident = fused_moe(model, np.where(held, tokens, 0))
            last = dispatch[k]
            if resident is not None:
                last = self._compute(f"{at[k]}/moe", k, resident, [last], step, layer)
            # the copied experts: the prefetched ones the dispatch needs first (they are there or on their way)
            needed = [int(e) for e in np.flatnonzero(tokens) if not held[e]]
            early_used = [e for e in needed if e in early[k]]
            wasted = [e for e in early[k] if tokens[e] == 0]
            self.prefetch_used += len(early_used)
            for e in early_used:
                copy, buffer, slot = early[k][e]
                last = self.slots[k][slot] = self._expert(
                    f"{at[k]}/e{e}", k, e, tokens, [last, copy], buffer, step, layer
                )
            if wasted:  # the dispatch did not need them: their slots freed
                copies = [early[k][e] for e in wasted]
                remap = Op(
                    id=f"{at[k]}/drop",
                    kind="compute",
                    stream=ranked("compute", k),
                    category="remap",
                    deps=tuple([last, *(c for c, _, _ in copies)]),
                    step=step + 1,
                    phase="decode",
                    layer=layer,
                    free=tuple(b for _, b, _ in copies),
                )
                self.ops.append(remap)
                last = remap.id
                for _, _, slot in copies:
                    self.slots[k][slot] = last
            for e in needed:
                if e in early[k]:
                    continue
                copy, buffer, slot = self._copy(f"{at[k]}", k, e, [dispatch[k]], step, layer)
                last = self.slots[k][slot] = self._expert(
                    f"{at[k]}/e{e}", k, e, tokens, [last, copy], buffer, step, layer
                )
            ends.append(last)
        for k in range(G):
            self.layer_end[k] = self._collective(f"{at[k]}/combine", k, back, sent[:, k], ends, step, layer)

    def _on_gpu(self, planned: EpLayer, expert: int, rank: int) -> bool:
        offload = self.plan.offload
        if offload is None:
            return True
        return bool(offload.on_gpu[planned.layer][expert, rank]) or (
            rank in planned.placement.replicas[expert][1:]  # (a replica sits in a spare slot on the GPU)
        )

    def _expert(
        self,
        op_id: str,
        rank: int,
        expert: int,
        tokens: np.ndarray,
        deps: list[str | None],
        buffer: str,
        step: int,
        layer: int,
    ) -> str:
        one = np.zeros_like(tokens)
        one[expert] = tokens[expert]
        work = fused_moe(self.model, one)
        assert work is not None  # (an expert is copied only when it has tokens)
        op = self._compute(op_id, rank, work, deps, step, layer, expert=expert, free=(buffer,))
        return op

    def _collective(
        self, op_id: str, rank: int, critical: float, sends: np.ndarray, joined: list[str], step: int, layer: int
    ) -> str:
        """Rank `rank`'s part of an all-to-all: it starts when every rank has joined (`joined`)."""
        self.ops.append(
            Op(
                id=op_id,
                kind="compute",
                stream=ranked("alltoall", rank),
                category="alltoall",
                deps=tuple(j for j in joined if j),
                bytes=int(round(critical)),
                step=step + 1,
                phase="decode",
                layer=layer,
                tokens=int(round(float(sends.sum()) / self.model.hidden_bytes(1))),
            )
        )
        return op_id


def ep_schedule(
    model: ModelSpec, plan: EpPlan, routing: RoutingTable, prefetch: bool = False
) -> tuple[Schedule, _RankBuilder]:
    """The schedule of an EP plan's decode steps on its ranks' own resources (module docstring)."""
    builder = _RankBuilder(model, plan, routing, prefetch)
    at = {(p.step, p.layer): p for p in plan.layers}
    for step in range(routing.shape.gen_len - 1):
        for layer in range(model.num_layers):
            builder.layer(step, layer, at.get((step, layer)), at.get((step - 1, layer)))
    G = plan.setup.gpus
    streams: dict[str, str] = {}
    for k in range(G):
        streams.update(rank_streams(k))
    shape = routing.shape
    resident = _resident_bytes(model, plan, shape.prompt_len + shape.gen_len)
    schedule = Schedule(
        tuple(builder.ops),
        streams,
        preloaded=tuple((ranked("weights", k), int(resident[k])) for k in range(G)),
        meta={
            "policy": f"ep ({plan.setup.label})",
            "model": model.name,
            "batch_size": int(plan.seqs_on.max()),
            "num_batches": G,
            "prompt_len": shape.prompt_len,
            "gen_len": shape.gen_len,
            "generated_tokens": int(len(plan.home_rank) * (shape.gen_len - 1)),
            "ranks": G,
        },
    )
    return schedule, builder


def _resident_bytes(model: ModelSpec, plan: EpPlan, tokens: int) -> list[float]:
    """What each rank holds before the first op: non-expert weights, its sequences' whole KV cache,
    its experts on the GPU and its replica slots (the staging slots are the copies' own buffers)."""
    G = plan.setup.gpus
    expert = model.expert_bytes()
    out = []
    for k in range(G):
        fixed = without_experts(model, tokens, int(plan.seqs_on[k])) + plan.setup.spare_slots * expert * len(
            model.moe_layers
        )
        if plan.offload is None:  # (each layer's placement as the plan's first step has it)
            held = sum(int((p.placement.home() == k).sum()) for p in plan.layers if p.step == 0)
        else:
            held = sum(int(plan.offload.on_gpu[layer][:, k].sum()) for layer in model.moe_layers)
        out.append(fixed + held * expert)
    return out


def simulate_ep_events(
    model: ModelSpec,
    profile: HardwareProfile,
    routing: RoutingTable,
    setup: ParallelSetup,
    prefetch: bool = False,
) -> EventRun:
    """An EP setup's decode steps in the event engine (module docstring)."""
    check_setup(model, profile, routing, setup)
    if setup.parallelism != "ep":
        raise UsageError(f"{setup.label}: the event engine times expert parallelism (tp runs in simulate --gpus G)")
    plan = plan_expert_parallel(model, profile, routing, setup)
    schedule, builder = ep_schedule(model, plan, routing, prefetch)
    machine = profile
    if plan.offload is not None:  # each rank's link at its share of the host's memory bandwidth
        machine = with_overrides(profile, {"links.pcie_h2d.bandwidth": plan.offload.link_rate})
    timeline = simulate(schedule, machine, CostModel(machine))
    if timeline.status != "ok":
        oom = timeline.meta.get("oom") or {}
        raise UsageError(f"{setup.label}: out of GPU memory at {oom.get('op_id', '?')} ({oom.get('detail', '')})")
    steps = routing.shape.gen_len - 1
    makespan = timeline.makespan
    busy = [timeline.rank_view(k).busy_seconds().get("gpu", 0.0) for k in range(setup.gpus)]
    fabric = timeline.rank_view(0).busy_seconds().get("fabric", 0.0)
    streamed = sum(op.bytes for op in schedule.ops if op.kind == "transfer")
    result = ep_result(
        model,
        profile,
        plan,
        routing.shape.prompt_len + routing.shape.gen_len,
        step_s=makespan / steps,
        collective_s=fabric / steps,
        utilisation=tuple(b / makespan for b in busy),
        all_to_all_bytes=2 * sum(float(p.sent.sum()) for p in plan.layers) / steps,
        streamed_bytes=streamed / steps,
    )
    bubbles = tuple(timeline.rank_view(k).summary().bubble_s / steps for k in range(setup.gpus))
    return EventRun(result, timeline, builder.prefetched, builder.prefetch_used, bubbles)
