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

Per layer j of a group of n batches:
attention(b) for every b -> gate(b) for every b (each followed by its on-demand loads) -> experts,
while the next layer's attention weights load during this MoE layer.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..prefetch import CorrelationTable, PrefetchStats
from ..schedule import Schedule
from .base import OpEmitter, PolicyInput, register


@dataclass(frozen=True)
class Rung:
    """Which of Klotski's ideas are on."""

    hot_prefetch: bool  # gate + hot experts during attention, the rest on demand
    reorder: bool  # hot experts first, then cold ones in arrival order
    oracle: bool = False  # perfect knowledge of the group's experts


RUNGS: dict[str, Rung] = {
    "multi-batch": Rung(hot_prefetch=False, reorder=False),
    "hot-prefetch": Rung(hot_prefetch=True, reorder=False),
    "klotski": Rung(hot_prefetch=True, reorder=True),
    "klotski-oracle": Rung(hot_prefetch=True, reorder=True, oracle=True),
}


def build_pipeline(inp: PolicyInput, rung: Rung, name: str) -> Schedule:
    em = OpEmitter(inp)
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

            if resident:
                attn_w = gate_w = None
            elif not rung.hot_prefetch:
                # +multi-batch: the whole layer, double-buffered (may load once layer g-2 is done)
                after = [layer_done[-2]] if len(layer_done) >= 2 else []
                attn_w, gate_w, loads = em.fetch_layer(at, step, j, after)
                expert_w = dict(enumerate(loads))
                load_order = list(range(E))
            else:
                attn_w = next_attention or em.fetch_attention(at, step, j)
                # Hot experts are chosen from what is known once the previous layer's gates ran
                # (its expert counts over the group) and the table learned so far.
                if rung.oracle:
                    hot = [int(e) for e in np.argsort(-group_tokens, kind="stable") if group_tokens[e] > 0]
                else:
                    prev_counts = counts[step, j - 1].sum(axis=0) if j > 0 else None
                    hot = table.predict(j, prev_counts, K)
                    stats.record(hot, group_tokens)
                # Gate and hot experts load during attention: issued as the previous MoE ends.
                gate_w = em.fetch(f"{at}/load_gate", "gate", m.gate_bytes(), "weights", "h2d_experts", [prev_moe],
                                  step=step, layer=j)
                for e in hot:
                    expert_w[e] = em.fetch(f"{at}/load_hot_E{e}", "experts", m.expert_bytes(), "hot_expert",
                                           "h2d_experts", [prev_moe], step=step, layer=j, expert=e)
                    load_order.append(e)
            next_attention = None

            attn_ops = [em.attention(f"{at}/b{b}/attn", step, j, b, [attn_w],
                                     free=(attn_w,) if attn_w and b == batches[-1] else ())
                        for b in batches]
            last_gate = ""
            for b in batches:
                last_gate = em.gate(f"{at}/b{b}/gate", step, j, b, [gate_w],
                                    free=(gate_w,) if gate_w and b == batches[-1] else ())
                if rung.hot_prefetch and not resident:
                    # on-demand loads: what this batch selected that is neither hot nor requested
                    for e in np.flatnonzero(counts[step, j, b]):
                        e = int(e)
                        if e not in expert_w:
                            expert_w[e] = em.fetch(f"{at}/load_cold_E{e}", "experts", m.expert_bytes(),
                                                   "cold_expert", "h2d_experts", [last_gate], step=step, layer=j,
                                                   expert=e)
                            load_order.append(e)

            # The next layer's attention weights load during this MoE layer (after its cold loads).
            nxt_step, nxt_layer = (step, j + 1) if j + 1 < L else (step + 1, 0)
            if rung.hot_prefetch and nxt_step < sh.num_steps and not em.is_resident(nxt_layer):
                next_attention = em.fetch_attention(f"s{nxt_step}/L{nxt_layer}", nxt_step, nxt_layer,
                                                    [attn_ops[-1], last_gate])

            used = [e for e in range(E) if group_tokens[e] > 0]
            if rung.reorder and not resident:
                order = [e for e in load_order if group_tokens[e] > 0]  # hot first, then cold by arrival
            else:
                order = used  # the natural loop of an MoE layer: expert-id order
            wasted = tuple(w for e, w in expert_w.items() if group_tokens[e] == 0)  # loaded, never used
            op = last_gate
            for k, e in enumerate(order):
                last = k == len(order) - 1
                own = (expert_w[e],) if e in expert_w else ()
                op = em.expert(f"{at}/E{e}", step, j, e, batches, int(group_tokens[e]),
                               list(own) + (list(wasted) if last else []), free=own + (wasted if last else ()))
            layer_done.append(op)
            if rung.hot_prefetch and not rung.oracle:  # online learning after the MoE layer
                pos = sh.step_positions(step)
                cur = routing.ids[:, :, pos, j, :]
                table.observe(j, cur, routing.ids[:, :, pos, j - 1, :] if j else None)
        for b in batches:
            em.lm_head(f"s{step}/b{b}/lm_head", step, b)
    extra = {"prefetch": stats.to_dict()} if rung.hot_prefetch and not rung.oracle else {}
    return em.build(name, rung={"hot_prefetch": rung.hot_prefetch, "reorder": rung.reorder,
                                "oracle": rung.oracle}, **extra)


def _register(name: str, description: str) -> None:
    rung = RUNGS[name]
    register(name, description, buffering="whole-layer" if not rung.hot_prefetch else "expert-aware")(
        lambda inp: build_pipeline(inp, rung, name))


_register("multi-batch", "+multi-batch: n batches share each whole-layer load (prefetched one layer ahead)")
_register("hot-prefetch", "+hot-prefetch: gate + predicted hot experts during attention, cold experts on demand, "
                          "expert-id order")
_register("klotski", "Klotski: hot-prefetch + reorder (hot experts first, cold in arrival order)")
_register("klotski-oracle", "Klotski with a perfect predictor: every used expert prefetched, most-used first")
