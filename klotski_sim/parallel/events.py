"""Expert parallelism in the event engine: each rank's GPU, PCIe links, issuing thread and fabric port
resources of its own (`gpu@1`, `pcie_h2d@1`, ...), timing the plan `decode.plan_expert_parallel` makes.

Per decode step and layer, each rank k runs on its own streams, its sequences in `micro_batches`
micro-batches in flight (1 by default; DeepSeek-V3's inference overlaps two so that one's
all-to-all runs under the other's compute, and Klotski keeps n batches in flight so that one copy
of an expert serves them all):

- `compute@k`: each micro-batch's attention with the gate (and a dense layer's MLP or the shared
  experts); after each micro-batch's dispatch, one fused MoE kernel over its tokens of the experts
  the rank holds; then each expert it does not hold, over every micro-batch in a row;
- `alltoall@k`: each micro-batch's dispatch and combine. Each is an all-to-all of every rank, so it
  starts when the last rank has joined (it depends on every rank's op before it) and lasts the
  pairwise exchange's time (`collectives.all_to_all_time`: the op's bytes are the rounds' largest
  messages);
- `h2d@k`: the copies of the used experts its GPU does not hold, into `decode.STAGING_SLOTS` GPU
  buffers (a copy starts once the dispatch that reveals the expert ended and the expert before it
  in that slot has computed). With `prefetch`, the rank copies, as early as a slot is free and its
  link has finished the copies before, the experts it computed at a layer in the step before and
  does not hold (most tokens first, as many as it has slots) — Klotski's hot-expert prefetch on
  each rank, layers ahead of the compute, predicted from the step before (a copy waits for that
  step's dispatch of the layer), never from the step itself; one that the dispatch then does not
  need is dropped (a `remap` op frees its slot).
- With `offloaded_experts="compressed"` (FluxMoE's compressed tier, per rank), a rank keeps on its
  GPU as many of the experts it lacks room for as fit losslessly compressed (`COMPRESSED_SHARE` of
  their size), the hottest uncompressed as far as memory allows, and decompresses a used one into a
  staging slot on its own decompression unit (`decompress@k`, at the profile's
  `gpu.decompress_bandwidth`) instead of copying it; what does not fit compressed is copied.
- With `offloaded_experts="cpu"`, nothing is copied: the rank sends the tokens of an expert it does
  not hold down its link (`d2h@k`), the host CPU computes the expert where it lies, and the results
  come back up (Fiddler's way, per rank). The host CPU is one resource that every rank shares
  (`cpu`, each op using all its cores), so ranks queue for it.

What the analytic timing (`decode.simulate_decode`) sums as each layer's slowest rank, the engine
lets happen: a rank waits at a collective only for the ranks that are still working, a copy
overlaps the rank's attention and resident experts, and ranks run dense layers at their own pace.
Without offloading, with one micro-batch, on a profile without launch or signalling latencies, both
give the same step time (tests/test_parallel_events.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from klotski_sim.core.collectives import critical_bytes
from klotski_sim.core.cost import COMPRESSED_SHARE, CostModel
from klotski_sim.core.engine import simulate
from klotski_sim.core.schedule import Op, Schedule
from klotski_sim.core.timeline import Summary, Timeline
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
    dispatch_bytes,
    ep_result,
    fused_moe,
    plan_expert_parallel,
    sequence_work,
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
    ranks: tuple[Summary, ...]  # each rank's one-GPU summary (`Timeline.rank_view`)
    steps: int  # decode steps timed
    schedule: Schedule  # what was timed (the runtime executes the same: klotski_runtime/expert_parallel.py)

    @property
    def bubble_s(self) -> tuple[float, ...]:
        """Per rank: its GPU's idle time a decode step (between its first and last op)."""
        return tuple(rank.bubble_s / self.steps for rank in self.ranks)


def rank_streams(rank: int) -> dict[str, str]:
    """A rank's streams and the resources they run on (its own GPU, link, fabric port and thread)."""
    return {
        ranked("compute", rank): ranked("gpu", rank),
        ranked("h2d", rank): ranked("pcie_h2d", rank),
        ranked("d2h", rank): ranked("pcie_d2h", rank),
        ranked("decompress", rank): ranked("gpu_decompress", rank),
        ranked("alltoall", rank): ranked("fabric", rank),
        ranked(HOST_STREAM, rank): ranked("host", rank),
        ranked("cpu_compute", rank): "cpu",  # (the host CPU, which every rank shares; issued by the rank's thread)
    }


@dataclass(frozen=True)
class EpEvents:
    """How each EP rank runs in the event engine, beyond the plan (module docstring)."""

    prefetch: bool = False  # copy in, layers ahead, the experts used a step before
    micro_batches: int = 1  # a rank's sequences in this many micro-batches in flight
    offloaded_experts: str = "copy"  # copy | compressed | cpu: a used expert a rank does not hold

    def check(self) -> None:
        if self.offloaded_experts not in OFFLOADED_EXPERTS:
            raise UsageError(f"offloaded experts {self.offloaded_experts!r}: one of {', '.join(OFFLOADED_EXPERTS)}")
        if self.prefetch and self.offloaded_experts == "cpu":
            raise UsageError("--prefetch copies experts in; with --offloaded-experts cpu nothing is copied")
        if not 1 <= self.micro_batches <= 64:
            raise UsageError(f"--micro-batches {self.micro_batches}: from 1 to 64")


OFFLOADED_EXPERTS = ("copy", "compressed", "cpu")


def held_on_ranks(plan: EpPlan, planned: EpLayer | None, num_experts: int) -> np.ndarray:
    """`[expert, rank]`: that rank's copy of the expert is on its GPU uncompressed, ready to compute
    (every expert, without offloading or in a dense layer)."""
    if planned is None or plan.offload is None:
        return np.ones((num_experts, plan.setup.gpus), dtype=bool)
    return plan.offload.held(planned.layer, planned.placement)


def collective_of(op_id: str) -> str:
    """Which exchange an `alltoall` op of `ep_schedule` is: `dispatch` or `combine` (its id's part)."""
    parts = op_id.split("/")
    return next((p for p in ("dispatch", "combine") if p in parts), "")


def micro_batch_of(op_id: str) -> int:
    """The micro-batch an op of `ep_schedule` belongs to: its id's `/m<index>` part (0 without one,
    as with a single micro-batch or a copy that serves them all)."""
    for part in op_id.split("/"):
        if part[:1] == "m" and part[1:].isdigit():
            return int(part[1:])
    return 0


class _RankBuilder:
    """The ops of one EP run, rank by rank, layer by layer."""

    def __init__(self, model: ModelSpec, plan: EpPlan, routing: RoutingTable, how: EpEvents) -> None:
        self.model, self.plan, self.how = model, plan, how
        self.shape = routing.shape
        self.G = G = plan.setup.gpus
        M = how.micro_batches
        self.ops: list[Op] = []
        # each rank's sequences in M micro-batches, in order (a rank with fewer than M has empty ones)
        self.part = np.zeros(len(plan.home_rank), dtype=np.int64)
        for k in range(G):
            for m, chunk in enumerate(np.array_split(np.flatnonzero(plan.home_rank == k), M)):
                self.part[chunk] = m
        self.seqs = np.array([np.bincount(self.part[plan.home_rank == k], minlength=M) for k in range(G)])
        # per rank and micro-batch: the op that ends its previous layer (its next attention waits for
        # it); per rank: its staging slots' last holders (the op that frees each slot)
        self.layer_end: list[list[str | None]] = [[None] * M for _ in range(G)]
        self.slots: list[list[str | None]] = [[None] * STAGING_SLOTS for _ in range(G)]
        self.next_slot = [0] * G
        self.prefetched = 0
        self.prefetch_used = 0

    def _compute(
        self,
        op_id: str,
        rank: int,
        work: Work,
        deps: list[str | None],
        step: int,
        layer: int,
        stream: str = "compute",
        **tags: Any,
    ) -> str:
        self.ops.append(
            Op(
                id=op_id,
                kind="compute",
                stream=ranked(stream, rank),
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

    def _transfer(
        self,
        op_id: str,
        stream: str,
        rank: int,
        nbytes: int,
        deps: list[str | None],
        step: int,
        layer: int,
        **tags: Any,
    ) -> str:
        up = stream == "h2d"
        self.ops.append(
            Op(
                id=op_id,
                kind="transfer",
                stream=ranked(stream, rank),
                category=str(tags.pop("category", "expert")),
                deps=tuple(d for d in deps if d),
                bytes=nbytes,
                src="cpu" if up else "gpu",
                dst="gpu" if up else "cpu",
                step=step + 1,
                phase="decode",
                layer=layer,
                **tags,
            )
        )
        return op_id

    def _copy(
        self, at: str, rank: int, expert: int, deps: list[str | None], step: int, layer: int
    ) -> tuple[str, str, int]:
        """`expert` into the rank's next staging slot (round robin: the one taken longest ago; it
        waits for the op that frees it), copied from host memory or decompressed from the rank's
        compressed tier: the op's id, its buffer and the slot."""
        slot = self.next_slot[rank]
        self.next_slot[rank] = (slot + 1) % STAGING_SLOTS
        buffer = ranked(f"{at}/e{expert}/slot{slot}", rank)
        nbytes = self.model.expert_bytes()
        offload = self.plan.offload
        if offload is not None and layer in offload.compressed and offload.compressed[layer][expert, rank]:
            op_id = f"{at}/e{expert}/decompress"
            self.ops.append(
                Op(
                    id=op_id,
                    kind="compute",
                    stream=ranked("decompress", rank),
                    category="decompress",
                    deps=tuple(d for d in [*deps, self.slots[rank][slot]] if d),
                    bytes=nbytes,  # (the decompressed output: what the profile's rate counts)
                    step=step + 1,
                    phase="decode",
                    layer=layer,
                    expert=expert,
                    alloc=((buffer, nbytes),),
                )
            )
            return op_id, buffer, slot
        op_id = self._transfer(
            f"{at}/e{expert}/h2d",
            "h2d",
            rank,
            nbytes,
            [*deps, self.slots[rank][slot]],
            step,
            layer,
            expert=expert,
            alloc=((buffer, nbytes),),
            tensor="expert",
        )
        return op_id, buffer, slot

    def _micro(self, planned: EpLayer, m: int) -> tuple[np.ndarray, np.ndarray]:
        """Micro-batch m's tokens of each expert on each rank (`assigned[e, r]`) and its dispatch bytes."""
        if self.how.micro_batches == 1:
            return planned.assigned, planned.sent
        mine = self.part == m
        ids, where = planned.ids[mine], planned.compute_rank[mine]
        assigned = np.zeros_like(planned.assigned)
        np.add.at(assigned, (ids.reshape(-1), where.reshape(-1)), 1)
        sent = dispatch_bytes(where, self.plan.home_rank[mine], self.G, self.model.hidden_bytes(1))
        return assigned, sent

    def layer(self, step: int, layer: int, planned: EpLayer | None, before: EpLayer | None) -> None:
        """Every rank's ops of one layer of one decode step (`before`: the same layer a step earlier)."""
        model, G, M = self.model, self.G, self.how.micro_batches
        kv_len = self.shape.prompt_len + step + 1
        at = [f"s{step + 1}/L{layer}/r{k}" for k in range(G)]
        mb = [f"/m{m}" if M > 1 else "" for m in range(M)]
        offload = self.plan.offload
        copying = planned is not None and offload is not None and self.how.offloaded_experts != "cpu"
        held_by = held_on_ranks(self.plan, planned, model.num_experts)
        # prefetch: the experts each rank computed here a step ago and does not hold, hottest first
        early: list[dict[int, tuple[str, str, int]]] = [{} for _ in range(G)]
        if copying and self.how.prefetch and before is not None and planned is not None:
            for k in range(G):
                used = before.assigned[:, k]
                hot = [e for e in np.argsort(-used, kind="stable") if used[e] > 0 and not held_by[e, k]]
                for e in hot[:STAGING_SLOTS]:
                    # (not before that step's dispatch of this layer: when the rank learnt what it used)
                    seen = f"s{step}/L{layer}/r{k}/dispatch{mb[M - 1]}"
                    early[k][int(e)] = self._copy(f"{at[k]}/pre", k, int(e), [seen], step, layer)
                    self.prefetched += 1
        joined: list[list[str]] = [[] for _ in range(M)]  # per micro-batch: each rank's op before the dispatch
        for k in range(G):
            for m in range(M):
                before_it = self.layer_end[k][m]
                for work in sequence_work(model, int(self.seqs[k, m]), kv_len, layer):
                    before_it = self._compute(f"{at[k]}/{work.category}{mb[m]}", k, work, [before_it], step, layer)
                joined[m].append(before_it or "")
                self.layer_end[k][m] = before_it
        if planned is None:  # a dense layer: no collective, each rank goes on at its own pace
            return
        micro = [self._micro(planned, m) for m in range(M)]
        # (what each micro-batch's exchange waits for, there and back: the same for every rank's part)
        there = [critical_bytes(sent) for _, sent in micro]
        back = [critical_bytes(sent.T) for _, sent in micro]
        dispatch = [
            [
                self._collective(f"{at[k]}/dispatch{mb[m]}", k, there[m], sent[k], joined[m], step, layer)
                for m, (_, sent) in enumerate(micro)
            ]
            for k in range(G)
        ]
        ends: list[list[str]] = [[] for _ in range(M)]  # per micro-batch: each rank's last op before the combine
        for k in range(G):
            tokens = [assigned[:, k] for assigned, _ in micro]
            held = held_by[:, k]
            last_of = list(dispatch[k])  # per micro-batch: its last op on this rank so far
            fused: list[str | None] = [None] * M  # per micro-batch: its resident experts' kernel
            last: str | None = None
            for m in range(M):  # the resident experts, one fused kernel a micro-batch
                resident = fused_moe(model, np.where(held, tokens[m], 0))
                if resident is not None:
                    last = last_of[m] = fused[m] = self._compute(
                        f"{at[k]}/moe{mb[m]}", k, resident, [dispatch[k][m]], step, layer
                    )
            # the experts it does not hold, each over every micro-batch in a row (Klotski's order:
            # one copy serves every batch in flight), in the order the dispatches revealed them
            users = {e: [m for m in range(M) if tokens[m][e]] for e in range(model.num_experts) if not held[e]}
            needed = sorted((e for e, ms in users.items() if ms), key=lambda e: (users[e][0], e))
            if self.how.offloaded_experts == "cpu":
                for e in needed:
                    for m in users[e]:
                        last_of[m] = self._cpu_expert(
                            f"{at[k]}/e{e}{mb[m]}", k, e, tokens[m], dispatch[k][m], step, layer
                        )
            else:
                last = self._copied(at[k], k, needed, users, tokens, early[k], dispatch[k], last_of, last, step, layer)
            for m in range(M):  # (CPU experts' results come back beside the fused kernel, not after it)
                ends[m].extend(dict.fromkeys(op for op in (fused[m], last_of[m]) if op))
        for k in range(G):
            for m, (_, sent) in enumerate(micro):
                self.layer_end[k][m] = self._collective(
                    f"{at[k]}/combine{mb[m]}", k, back[m], sent[:, k], ends[m], step, layer
                )

    def _copied(
        self,
        at: str,
        k: int,
        needed: list[int],
        users: dict[int, list[int]],
        tokens: list[np.ndarray],
        early: dict[int, tuple[str, str, int]],
        dispatch: list[str],
        last_of: list[str],
        last: str | None,
        step: int,
        layer: int,
    ) -> str | None:
        """Rank k's experts copied in and computed: the prefetched ones the dispatches need first
        (they are there or on their way), the unneeded ones dropped, then the rest as their
        dispatches reveal them. Updates `last_of`; returns the rank's last compute op."""
        M = len(tokens)
        mb = [f"/m{m}" if M > 1 else "" for m in range(M)]
        self.prefetch_used += sum(e in early for e in needed)
        wasted = [e for e in early if e not in needed]

        def compute(e: int, copy: str, buffer: str) -> str | None:
            nonlocal last
            for n, m in enumerate(users[e]):
                free = (buffer,) if n == len(users[e]) - 1 else ()
                last = last_of[m] = self._expert(
                    f"{at}/e{e}{mb[m]}", k, e, tokens[m], [last, copy, dispatch[m]], free, step, layer
                )
            return last

        for e in needed:
            if e in early:
                copy, buffer, slot = early[e]
                self.slots[k][slot] = compute(e, copy, buffer)
        if wasted:  # the dispatches did not need them: their slots freed
            copies = [early[e] for e in wasted]
            remap = Op(
                id=f"{at}/drop",
                kind="compute",
                stream=ranked("compute", k),
                category="remap",
                deps=tuple(d for d in [last, *(c for c, _, _ in copies)] if d),
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
            if e not in early:
                copy, buffer, slot = self._copy(at, k, e, [dispatch[users[e][0]]], step, layer)
                self.slots[k][slot] = compute(e, copy, buffer)
        return last

    def _cpu_expert(self, op_id: str, k: int, e: int, tokens: np.ndarray, dispatch: str, step: int, layer: int) -> str:
        """Expert e computed where it lies, on the host CPU the ranks share: the tokens' hidden
        states down the rank's link, the expert on the CPU, the results back up (Fiddler's way)."""
        one = np.zeros_like(tokens)
        one[e] = tokens[e]
        work = fused_moe(self.model, one)
        assert work is not None  # (an expert is computed only when it has tokens)
        acts = self.model.hidden_bytes(int(tokens[e]))
        moved = {"category": "activation", "tensor": "activation", "expert": e}
        down = self._transfer(f"{op_id}/d2h", "d2h", k, acts, [dispatch], step, layer, **moved)
        cpu = self._compute(
            f"{op_id}/cpu", k, work._replace(category="expert"), [down], step, layer, stream="cpu_compute", expert=e
        )
        return self._transfer(f"{op_id}/h2d", "h2d", k, acts, [cpu], step, layer, **moved)

    def _expert(
        self,
        op_id: str,
        rank: int,
        expert: int,
        tokens: np.ndarray,
        deps: list[str | None],
        free: tuple[str, ...],
        step: int,
        layer: int,
    ) -> str:
        one = np.zeros_like(tokens)
        one[expert] = tokens[expert]
        work = fused_moe(self.model, one)
        assert work is not None  # (an expert is copied only when it has tokens)
        return self._compute(op_id, rank, work, deps, step, layer, expert=expert, free=free)

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
    model: ModelSpec, plan: EpPlan, routing: RoutingTable, how: EpEvents = EpEvents()
) -> tuple[Schedule, _RankBuilder]:
    """The schedule of an EP plan's decode steps on its ranks' own resources (module docstring)."""
    how.check()
    builder = _RankBuilder(model, plan, routing, how)
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
        held: float  # (experts' worth of GPU memory)
        if plan.offload is None:  # (each layer's placement as the plan's first step has it)
            held = sum(int((p.placement.home() == k).sum()) for p in plan.layers if p.step == 0)
        else:
            held = sum(int(plan.offload.on_gpu[layer][:, k].sum()) for layer in model.moe_layers)
            held += COMPRESSED_SHARE * sum(int(tier[:, k].sum()) for tier in plan.offload.compressed.values())
        out.append(fixed + held * expert)
    return out


def simulate_ep_events(
    model: ModelSpec,
    profile: HardwareProfile,
    routing: RoutingTable,
    setup: ParallelSetup,
    how: EpEvents = EpEvents(),
) -> EventRun:
    """An EP setup's decode steps in the event engine (module docstring)."""
    check_setup(model, profile, routing, setup)
    how.check()
    if setup.parallelism != "ep":
        raise UsageError(f"{setup.label}: the event engine times expert parallelism (tp runs in simulate --gpus G)")
    if how.offloaded_experts == "cpu":
        profile.require_cpu("--offloaded-experts cpu")
    if how.offloaded_experts == "compressed" and profile.gpu.decompress_bandwidth is None:
        raise UsageError(
            f"--offloaded-experts compressed: hardware profile {profile.name!r} has no gpu.decompress_bandwidth "
            f"(give one with --set gpu.decompress_bandwidth=4e11: FluxMoE measured 396.5-435.4e9 B/s)"
        )
    if how.offloaded_experts == "compressed" and (model.quantised or model.dtype_bytes != 2):
        raise UsageError(
            f"--offloaded-experts compressed: {model.name}'s experts are not 16-bit floats, and the compressed "
            f"tier's size ({COMPRESSED_SHARE:.1%}) is FluxMoE's measurement on bf16 experts (their exponents compress)"
        )
    compressed = COMPRESSED_SHARE if how.offloaded_experts == "compressed" else None
    plan = plan_expert_parallel(model, profile, routing, setup, compressed)
    schedule, builder = ep_schedule(model, plan, routing, how)
    machine = profile
    if plan.offload is not None:  # each rank's link at its share of the host's memory bandwidth
        machine = with_overrides(profile, {"links.pcie_h2d.bandwidth": plan.offload.link_rate})
    timeline = simulate(schedule, machine, CostModel(machine))
    if timeline.status != "ok":
        oom = timeline.meta.get("oom") or {}
        raise UsageError(f"{setup.label}: out of GPU memory at {oom.get('op_id', '?')} ({oom.get('detail', '')})")
    steps = routing.shape.gen_len - 1
    makespan = timeline.makespan
    views = [timeline.rank_view(k) for k in range(setup.gpus)]  # (each a copy of its rank's rows: made once)
    busy = [view.busy_seconds().get("gpu", 0.0) for view in views]
    fabric = views[0].busy_seconds().get("fabric", 0.0)
    streamed = sum(op.bytes for op in schedule.ops if op.kind == "transfer" and op.tensor == "expert")
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
    ranks = tuple(view.summary() for view in views)
    return EventRun(result, timeline, builder.prefetched, builder.prefetch_used, ranks, steps, schedule)
