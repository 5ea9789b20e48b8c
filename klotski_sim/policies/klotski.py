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

Per layer j of a group of n batches (`build_pipeline`, over the phases of `klotski_phases`):
attention(b) for every b -> gate(b) for every b (each followed by its on-demand loads) -> experts,
while the next layer's attention weights load during this MoE layer.
"""

from __future__ import annotations

from dataclasses import dataclass

from klotski_sim.core.schedule import Schedule
from klotski_sim.policies.base import PolicyInput, PolicyTraits, register
from klotski_sim.policies.impl import Impl
from klotski_sim.policies.klotski_phases import Decisions, Pipeline, Rung
from klotski_sim.policies.options import option
from klotski_sim.policies.prefetch import PREDICTORS

RUNGS: dict[str, Rung] = {
    "multi-batch": Rung(hot_prefetch=False, reorder=False),
    "hot-prefetch": Rung(hot_prefetch=True, reorder=False),
    "klotski": Rung(hot_prefetch=True, reorder=True),
    "klotski-oracle": Rung(hot_prefetch=True, reorder=True, oracle=True),
    "klotski-hybrid": Rung(hot_prefetch=True, reorder=True, cpu_cold=True),
}


@dataclass(frozen=True)
class PredictorOptions:
    """The rungs whose hot experts a learned predictor names."""

    predictor: str = option(
        "layer",
        "what names a layer's hot experts: layer (the paper: the previous layer's routing through the "
        "correlation table) or layer+token (spatio-temporal, as ST-MoE: that and the same layer's "
        "routing of the previous token, equally weighted)",
        choices=PREDICTORS,
    )


def build_pipeline(inp: PolicyInput, rung: Rung, name: str) -> Schedule:
    """Klotski's decode step for every step and layer; what the rung and the implementation preset
    change in a phase is decided once (`Decisions.of`), the phases are in `klotski_phases`."""
    loop = Pipeline(inp, Decisions.of(rung, Impl.from_options(inp.options)))
    for step in range(inp.shape.num_steps):
        loop.embed(step)
        for j in range(inp.model.num_layers):
            layer = loop.fetch_ahead(step, j)  # 1. the gate and hot experts load while the attention
            loop.attention(layer)  #    runs over the n batches, one after another;
            loop.gates(layer)  # 2. the gates, batch by batch, each issuing its cold loads;
            loop.fetch_next_attention(layer)  # 3. the next attention weights load while the MoE layer
            loop.gpu_experts(layer)  #    runs its hot experts first, then the cold ones
            loop.cpu_experts(layer)  #    (klotski-hybrid: and the CPU runs the cold ones it took)
            loop.end_moe(layer)  #    (as published: the host waits for the weight stream)
        loop.end_step(step)  # the correlation table learns the step's routing; logits
    return loop.build(name, rung)


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
    traits = PolicyTraits(
        buffering="whole-layer" if not rung.hot_prefetch else "expert-aware",
        needs_cpu=rung.cpu_cold,
        speed_independent=not rung.cpu_cold,
        probe_n=rung.cpu_cold,
    )
    register(
        name,
        description,
        options=PredictorOptions if rung.hot_prefetch and not rung.oracle else None,
        traits=traits,
        impl_options=options,
        presets={"as-published": {k: AS_PUBLISHED[k] for k in options}},
    )(lambda inp: build_pipeline(inp, rung, name))


_register("multi-batch", "+multi-batch: n batches share each whole-layer load (prefetched one layer ahead)")
_register(
    "hot-prefetch",
    "+hot-prefetch: gate + predicted hot experts during attention, cold experts on demand, expert-id order",
)
_register("klotski", "Klotski: hot-prefetch + reorder (hot experts first, cold in arrival order)")
_register("klotski-oracle", "Klotski with a perfect predictor: every used expert prefetched, most-used first")
_register(
    "klotski-hybrid",
    "Klotski + each cold expert on the CPU when it would finish there before the link "
    "(needs a profile with a cpu: section)",
)
