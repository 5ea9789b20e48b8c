"""Klotski's expert-aware multi-batch pipeline (KLOTSKI.md, "Klotski decode step"), and the
rungs of its ablation ladder, each a named configuration of the same loop:

- `multi-batch`   (+multi-batch):  n batches share each loaded layer; the whole layer (attention,
                   gate, every expert) is prefetched one layer ahead; each expert runs once over
                   the tokens of all n batches, in expert-id order.
- `hot-prefetch`  (+hot-prefetch): during attention only the gate and the K predicted hot experts
                   load; after each batch's gate its missing (cold) experts load on demand; experts
                   still run in expert-id order.
- `klotski`       (+reorder = full Klotski): hot experts run first, then cold ones in the order
                   their loads were issued, so cold loads hide behind hot compute.
- `klotski-oracle`: a perfect predictor — every expert the group will use is prefetched during
                   attention, most-used first: the upper bound of what better prediction buys.
- `klotski-hybrid` (ours, beyond the paper): Klotski, but each cold expert a gate reveals goes to
                   whichever of the PCIe link and the host CPU would finish it first, counting what
                   each already has to do in this layer (list scheduling); a CPU expert runs over the
                   group's tokens once every gate has run, in parallel with the GPU's hot experts and
                   the remaining loads, and its output crosses PCIe back before the next layer. Its
                   token count is estimated from the gates run so far (later gates have not run
                   yet). Needs the profile's `cpu:` section.

Per layer j of a group of n batches:
attention(b) for every b -> gate(b) for every b (each followed by its on-demand loads) -> experts,
while the next layer's attention weights load during this MoE layer.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from klotski_sim.core.cost import CostModel
from klotski_sim.workload.model import ModelSpec
from klotski_sim.policies.prefetch import CorrelationTable, PrefetchStats
from klotski_sim.core.schedule import CPU_STREAMS, DEFAULT_STREAMS, Schedule, ScheduleBuilder
from klotski_sim.policies.base import OpEmitter, PolicyInput, cpu_expert_seconds, register


@dataclass(frozen=True)
class Rung:
    """Which of Klotski's ideas are on."""

    hot_prefetch: bool  # gate + hot experts during attention, the rest on demand
    reorder: bool  # hot experts first, then cold ones in arrival order
    oracle: bool = False  # perfect knowledge of the group's experts
    cpu_cold: bool = False  # cold experts may run on the host CPU instead of loading


RUNGS: dict[str, Rung] = {
    "multi-batch": Rung(hot_prefetch=False, reorder=False),
    "hot-prefetch": Rung(hot_prefetch=True, reorder=False),
    "klotski": Rung(hot_prefetch=True, reorder=True),
    "klotski-oracle": Rung(hot_prefetch=True, reorder=True, oracle=True),
    "klotski-hybrid": Rung(hot_prefetch=True, reorder=True, cpu_cold=True),
}


class ColdSplit:
    """Per layer, which cold experts run on the CPU: each goes to whichever side would finish it
    first given what that side already has in this layer (the link: the cold loads issued; the
    CPU: the experts given to it), priced by the cost model that will time the ops."""

    def __init__(self, model: ModelSpec, cost: CostModel) -> None:
        cost.profile.require_cpu("policy 'klotski-hybrid'")
        self.model, self.cost = model, cost
        self.load = cost.transfer_seconds("pcie_h2d", model.expert_bytes())
        self._on_cpu: dict[int, float] = {}
        self.link_busy = self.cpu_busy = 0.0

    def new_layer(self) -> None:
        self.link_busy = self.cpu_busy = 0.0

    def cpu_seconds(self, tokens: float) -> float:
        """An expert over `tokens` tokens on the CPU, its output back up included."""
        tok = max(1, int(round(tokens)))
        if tok not in self._on_cpu:
            self._on_cpu[tok] = cpu_expert_seconds(self.cost, self.model, tok)
        return self._on_cpu[tok]

    def to_cpu(self, tokens: float) -> bool:
        on_cpu, load = self.cpu_seconds(tokens), self.load
        if self.cpu_busy + on_cpu < self.link_busy + load:
            self.cpu_busy += on_cpu
            return True
        self.link_busy += load
        return False


def build_pipeline(inp: PolicyInput, rung: Rung, name: str) -> Schedule:
    split = ColdSplit(inp.model, CostModel(inp.profile)) if rung.cpu_cold else None
    em = OpEmitter(inp, ScheduleBuilder({**DEFAULT_STREAMS, **CPU_STREAMS}) if split else None)
    impl = em.impl
    m, sh, routing = inp.model, inp.shape, inp.routing
    counts = routing.counts  # [step, layer, batch, expert]
    L, E, K = m.num_layers, m.num_experts, m.top_k
    batches = tuple(range(sh.num_batches))
    table = CorrelationTable(L, E, K)
    if inp.warmup is not None and rung.hot_prefetch and not rung.oracle:
        table.warm_up(inp.warmup)  # the pre-run on sequences never evaluated
    stats = PrefetchStats()
    layer_done: list[str] = []  # last MoE op of each layer, in order of use
    next_attention: str | None = None  # attention weights fetched during the previous MoE layer
    # multi-batch loads its MoE layer whole; `at-gate`: when the gate sub-layer starts (after the
    # previous MoE layer), with attention weights fetched during the previous MoE layer
    moe_at_gate = not rung.hot_prefetch and impl.moe_load == "at-gate"
    sublayer_sync = impl.sync_sublayers
    cpu_out: list[str] = []  # the previous layer's CPU expert outputs, back on the GPU
    on_cpu_count = 0

    for step in range(sh.num_steps):
        for b in batches:
            em.embed(f"s{step}/b{b}/embed", step, b)
        for j in range(L):
            at = f"s{step}/L{j}"
            group_tokens = counts[step, j].sum(axis=0)  # tokens per expert over the n batches
            resident = em.is_resident(j)
            expert_w: dict[int, str] = {}
            load_order: list[int] = []  # experts in the order their loads were issued
            prev_moe = layer_done[-1] if layer_done else None
            prefetched: list[str] = []  # this layer's loads on the weight stream so far

            if resident:
                attn_w = gate_w = None
            elif not rung.hot_prefetch and not moe_at_gate:
                # +multi-batch: the whole layer, double-buffered (may load once layer g-2 is done)
                after = [layer_done[-2]] if len(layer_done) >= 2 else []
                attn_w, gate_w, loads = em.fetch_layer(at, step, j, after)
                expert_w = dict(enumerate(loads))
                load_order = list(range(E))
                prefetched = [gate_w, *loads]
            elif moe_at_gate:
                after = [layer_done[-2]] if len(layer_done) >= 2 else []
                attn_w = next_attention or em.fetch_attention(at, step, j, after)
                gate_w = em.fetch_gate(at, step, j, [prev_moe])
                prefetched = [gate_w]
            else:
                attn_w = next_attention or em.fetch_attention(at, step, j)
                # Hot experts are chosen from what is known once the previous layer's gates ran
                # (its expert counts over the group) and the table learned so far.
                if not m.is_moe(j):  # a dense layer: no experts to predict
                    hot = []
                elif rung.oracle:
                    hot = [int(e) for e in np.argsort(-group_tokens, kind="stable") if group_tokens[e] > 0]
                else:
                    prev_counts = counts[step, j - 1].sum(axis=0) if j > 0 else None
                    hot = table.predict(j, prev_counts, K)
                    stats.record(hot, group_tokens)
                # Gate and hot experts load during attention: issued as the previous MoE ends.
                gate_w = em.fetch_gate(at, step, j, [prev_moe], stream="h2d_experts")
                for e in hot:
                    expert_w[e] = em.fetch(f"{at}/load_hot_E{e}", "experts", m.expert_bytes(), "hot_expert",
                                           "h2d_experts", [prev_moe], step=step, layer=j, expert=e)
                    load_order.append(e)
                prefetched = [gate_w, *expert_w.values()]
            next_attention = None

            attn_ops = em.attentions(at, step, j, batches, [attn_w, *cpu_out], free_last=(attn_w,) if attn_w else ())
            if sublayer_sync:  # end of the attention sub-layer: the host waits for the weight stream
                em.sync(f"{at}/attn", prefetched or [attn_ops[-1]])
            if moe_at_gate and not resident:
                loads = em.fetch_moe_layer(at, step, j, [prev_moe])
                expert_w = dict(enumerate(loads))
                load_order = list(range(E))
                prefetched = loads
            last_gate = ""
            cpu_experts: list[int] = []
            gates: list[str] = []
            if split:
                split.new_layer()
            on_demand = rung.hot_prefetch and not resident
            if on_demand:  # per batch: the experts it selected, and tokens per expert over the gates run so far
                cold_orders = em.cold_orders(step, j)
                seen_by = np.cumsum(counts[step, j], axis=0)
            gate_ops = em.gate_ops([(f"{at}/b{b}/gate", b) for b in batches], step, j, [gate_w],
                                   free_last=(gate_w,) if gate_w else ())
            for b, gate_op in zip(batches, gate_ops):
                last_gate = em.b.append(gate_op)
                if on_demand:
                    if sublayer_sync:  # the routed ids are read on the host (`.tolist()`)
                        em.sync(last_gate, [last_gate])
                    # on-demand loads: what this batch selected that is neither hot nor requested
                    seen = seen_by[b]
                    for e in cold_orders[b]:
                        if e in expert_w or e in cpu_experts:  # (requested already: most of them)
                            continue
                        if split and split.to_cpu(seen[e] * len(batches) / (b + 1)):
                            cpu_experts.append(e)
                            continue
                        expert_w[e] = em.fetch(f"{at}/load_cold_E{e}", "experts", m.expert_bytes(), "cold_expert",
                                               "h2d_experts", [last_gate], step=step, layer=j, expert=e)
                        load_order.append(e)
                gates.append(last_gate)
            if sublayer_sync:  # end of the gate sub-layer
                em.sync(f"{at}/gates", prefetched or [last_gate])

            # The next layer's attention weights load during this MoE layer (after its cold loads).
            nxt_step, nxt_layer = (step, j + 1) if j + 1 < L else (step + 1, 0)
            if (rung.hot_prefetch or moe_at_gate) and nxt_step < sh.num_steps and not em.is_resident(nxt_layer):
                next_attention = em.fetch_attention(f"s{nxt_step}/L{nxt_layer}", nxt_step, nxt_layer,
                                                    [attn_ops[-1], last_gate])

            used = [e for e in range(E) if group_tokens[e] > 0 and e not in cpu_experts]
            if rung.reorder and not resident:
                order = [e for e in load_order if group_tokens[e] > 0]  # hot first, then cold by arrival
            else:
                order = used  # the natural loop of an MoE layer: expert-id order
            wasted = tuple(w for e, w in expert_w.items() if group_tokens[e] == 0)  # loaded, never used
            batch_rows = counts[step, j].tolist() if impl.per_batch_experts else []  # [batch][expert] tokens
            expert_ops = []  # (op id, expert, batches, tokens, deps, frees)
            for e in order:
                own = (expert_w[e],) if e in expert_w else ()
                if impl.per_batch_experts:  # one op per batch: the weights are read again for each
                    expert_ops += [(f"{at}/b{b}/E{e}", e, em.batch_tuple[b], batch_rows[b][e], own, ())
                                   for b in batches if batch_rows[b][e]]
                else:
                    expert_ops.append((f"{at}/E{e}", e, batches, int(group_tokens[e]), own, ()))
                expert_ops[-1] = expert_ops[-1][:5] + (own,)  # its last op frees its weights
            op = em.expert_chain(step, j, last_gate, expert_ops, last_also=wasted)
            layer_done.append(op)
            # CPU experts, issued after the GPU's (whose work is then in flight): the group's hidden states
            # go down once every gate has run, each expert runs over the group's tokens on the CPU, its
            # output comes back before the next layer
            cpu_out = []
            if cpu_experts:
                tokens_now = sh.batch_size * em.new_tokens(step) * len(batches)
                down = em.hidden_down(f"{at}/hidden_down", step, j, batches, tokens_now, gates)
                cpu_out = [em.cpu_expert(f"{at}/cpu_E{e}", step, j, e, batches, int(group_tokens[e]), down)
                           for e in cpu_experts]
                on_cpu_count += len(cpu_experts)
            if sublayer_sync:  # end of the MoE sub-layer: the next attention weights
                em.sync(f"{at}/moe", [next_attention] if next_attention else [op])
        if rung.hot_prefetch and not rung.oracle:  # online learning from the step's every MoE layer
            table.observe_tokens(routing.step_block(step))
        for b in batches:
            em.lm_head(f"s{step}/b{b}/lm_head", step, b, cpu_out)
        cpu_out = []
    extra = {"prefetch": stats.to_dict()} if rung.hot_prefetch and not rung.oracle else {}
    if split:
        extra["cpu_experts"] = on_cpu_count
    return em.build(name, rung={"hot_prefetch": rung.hot_prefetch, "reorder": rung.reorder,
                                "oracle": rung.oracle}, **extra)


# Klotski's public port (mindspore-lab/models, research/SYSU/Klotski), every choice cited in
# docs/implementations.md: mixtral_MoE computes each expert batch by batch after a `.tolist()` of
# its token rows; cold experts are requested in the order the gate's `.tolist()` meets them; the
# host synchronises on the weight stream after every sub-layer; without a predictor the MoE layer
# is loaded when the gate sub-layer starts; the KV cache lives in unpinned memory; attention is
# the eager GQA path (repeat_kv, matmul, fp32 softmax, matmul).
AS_PUBLISHED = {
    "expert_ops": "per-batch",
    "cold_order": "first-use",
    "sync": "per-expert",
    "copy_memory_weights": "pinned",
    "copy_memory_kv": "pageable",
    "attention_impl": "eager",
    "moe_load": "at-gate",
}
_COMMON = ("expert_ops", "sync", "copy_memory_weights", "copy_memory_kv", "attention_impl")


def _register(name: str, description: str) -> None:
    rung = RUNGS[name]
    options = _COMMON + (("cold_order",) if rung.hot_prefetch else ("moe_load",))
    register(name, description, buffering="whole-layer" if not rung.hot_prefetch else "expert-aware",
             impl_options=options, presets={"as-published": {k: AS_PUBLISHED[k] for k in options}},
             needs_cpu=rung.cpu_cold, speed_independent=not rung.cpu_cold, probe_n=rung.cpu_cold)(
        lambda inp: build_pipeline(inp, rung, name))


_register("multi-batch", "+multi-batch: n batches share each whole-layer load (prefetched one layer ahead)")
_register("hot-prefetch", "+hot-prefetch: gate + predicted hot experts during attention, cold experts on demand, "
                          "expert-id order")
_register("klotski", "Klotski: hot-prefetch + reorder (hot experts first, cold in arrival order)")
_register("klotski-oracle", "Klotski with a perfect predictor: every used expert prefetched, most-used first")
_register("klotski-hybrid", "Klotski + each cold expert on the CPU when it would finish there before the link "
                            "(needs a profile with a cpu: section)")
