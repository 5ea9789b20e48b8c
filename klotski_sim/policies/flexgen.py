"""FlexGen-style multi-batch (Sheng et al., ICML 2023; KLOTSKI.md "Baselines").

A block of n batches shares each loaded layer, in zig-zag order: for each step, for each layer
j, for each batch k — `load_weight(j+1)` (at k = 0), `load_cache(j, k+1)`, `compute(j, k)`,
`store_cache(j, k-1)`. MoE layers load whole (every expert); each batch computes the experts
its own tokens chose. KV loads and stores run on their own streams when the cache is on the CPU.

Two overlap models, option `overlap`:
- `code` (default, what FlexGen's implementation does): the next layer's weights are issued at
  k = 0 and `sync()` after the first batch is a device-wide synchronise, so those weights must
  land within the first batch's step or the block stalls.
- `model` (what FlexGen's cost model assumes): the next layer's load overlaps the whole block.

With `sync=per-sublayer` the host runs FlexGen's `sync()` (a device-wide synchronise) after every
(layer, batch) step, so it waits for every transfer issued so far — `overlap=code`'s stall then
comes from the host model itself.
"""

from __future__ import annotations

from dataclasses import dataclass

from klotski_sim.core.schedule import Schedule
from klotski_sim.policies.base import OpEmitter, PolicyInput, PolicyTraits, register
from klotski_sim.policies.options import option

OVERLAPS = ("code", "model")


@dataclass(frozen=True)
class FlexGenOptions:
    overlap: str = option(
        "code",
        "code: the next layer's weights must land within the block's first batch (FlexGen's sync); "
        "model: they overlap the whole block (its cost model)",
        choices=OVERLAPS,
    )


# an expert op as `OpEmitter.expert_chain` takes it: op id, expert, batches, tokens, deps, frees
_ExpertOp = tuple[str, int, tuple[int, ...], int, tuple[str, ...], tuple[str, ...]]


# FlexGen's flex_opt.py as Klotski ran it on Mixtral (docs/implementations.md): `sync()` after every
# compute step, weights pinned (--pin-weight defaults to True), the KV cache in unpinned memory
# (init_cache_one_gpu_batch), and the shared backend's eager GQA attention and per-expert loop with
# a `.tolist()` per expert (MoE_computation), each batch computing its own experts.
AS_PUBLISHED = {
    "sync": "per-expert",
    "copy_memory_weights": "pinned",
    "copy_memory_kv": "pageable",
    "attention_impl": "eager",
    "overlap": "code",
}


@register(
    "flexgen",
    "FlexGen zig-zag block of n batches, whole-layer loads; overlap=code|model",
    options=FlexGenOptions,
    impl_options=("sync", "copy_memory_weights", "copy_memory_kv", "attention_impl"),
    presets={"as-published": AS_PUBLISHED, "ideal": {"overlap": "model"}, "v0.1": {"overlap": "code"}},
    traits=PolicyTraits(speed_independent=True, holds_moe_layer=True),
)
def build(inp: PolicyInput) -> Schedule:
    overlap = inp.options["overlap"]
    em = OpEmitter(inp)
    m, sh, counts = inp.model, inp.shape, inp.routing.counts
    batches = range(sh.num_batches)
    order = [(step, layer) for step in range(sh.num_steps) for layer in range(m.num_layers)]

    def load_weight(g: int, after: list[str]) -> list[str] | None:
        """All of layer g (attention, gate, every expert), or None for a resident layer."""
        step, layer = order[g]
        if em.is_resident(layer):
            return None
        attention, gate, experts = em.fetch_layer(f"s{step}/L{layer}", step, layer, after)
        return [attention, gate, *experts]

    layer_done: list[str] = []
    loads = {0: load_weight(0, [])}
    for g, (step, layer) in enumerate(order):
        if layer == 0:
            for b in batches:
                em.embed(f"s{step}/b{b}/embed", step, b)
        current = loads.pop(g)
        # load_weight(j+1) at k = 0: its buffer is free once layer j-1 is done (double buffering)
        if g + 1 < len(order):
            loads[g + 1] = load_weight(g + 1, [layer_done[-1]] if layer_done else [])
        upcoming = loads.get(g + 1) or []
        attn_w, gate_w, expert_w = (current[0], current[1], current[2:]) if current else (None, None, [])
        at = f"s{step}/L{layer}"
        op = ""
        for k in batches:
            # FlexGen's code: sync() after batch 0 waits for the weights issued at k = 0
            sync = upcoming if overlap == "code" and k == 1 else []
            last_batch = k == batches[-1]
            em.attention(
                f"{at}/b{k}/attn", step, layer, k, [attn_w, *sync], free=(attn_w,) if attn_w and last_batch else ()
            )
            op = em.gate(f"{at}/b{k}/gate", step, layer, k, [gate_w], free=(gate_w,) if gate_w and last_batch else ())
            row = counts[step, layer, k].tolist()
            ops: list[_ExpertOp] = [
                (f"{at}/b{k}/E{e}", e, em.batch_tuple[k], tokens, (expert_w[e],) if expert_w else (), ())
                for e, tokens in enumerate(row)
                if tokens > 0
            ]
            if ops and last_batch:  # the layer's last expert op waits for, then releases, the whole MoE layer
                ops[-1] = ops[-1][:4] + (tuple(expert_w), tuple(expert_w))
            op = em.expert_chain(step, layer, op, ops)
            if em.impl.sync_sublayers:  # FlexGen's sync() after compute(j, k): device-wide
                em.sync_device(f"{at}/b{k}")
        layer_done.append(op)
        if layer == m.num_layers - 1:
            for b in batches:
                em.lm_head(f"s{step}/b{b}/lm_head", step, b)
    return em.build("flexgen", overlap=overlap)
