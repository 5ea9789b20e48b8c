"""Single-batch prefetch ("simple pipeline", KLOTSKI.md Baselines).

One batch at a time. While layer j computes, the *entire* layer j+1 — attention, gate and every
expert of its MoE layer — is prefetched; the pipeline synchronises after every layer, so at
most two layers of weights are on the GPU. With `num_batches > 1` the batches run one after
another, each through its whole generation, so every policy does the same work.

With `moe_load=at-gate` the loop follows Klotski's public port
(`generation_loop_overlap_single_batch`): each sub-layer prefetches the next one — the gate
during attention, the whole MoE layer during the gate, the next attention during the MoE layer —
and with `sync` the host synchronises the device after every sub-layer.
"""

from __future__ import annotations

from typing import Sequence

from klotski_sim.core.schedule import Schedule
from klotski_sim.policies.base import OpEmitter, PolicyInput, PolicyTraits, register

# Klotski's port, `generation_loop_overlap_single_batch` and `MoE_computation` (docs/implementations.md)
AS_PUBLISHED = {
    "sync": "per-expert",
    "copy_memory_weights": "pinned",
    "copy_memory_kv": "pageable",
    "attention_impl": "eager",
    "moe_load": "at-gate",
}


@register(
    "single-batch",
    "one batch at a time; prefetch all of layer j+1 (whole MoE layer) while layer j computes",
    impl_options=tuple(AS_PUBLISHED),
    presets={"as-published": AS_PUBLISHED},
    traits=PolicyTraits(one_batch=True, speed_independent=True),
)
def build(inp: PolicyInput) -> Schedule:
    em = OpEmitter(inp)
    if em.impl.moe_load == "at-gate":
        return _build_per_sublayer(em)
    m, sh, counts = inp.model, inp.shape, inp.routing.counts
    sync = em.impl.sync_sublayers
    layer_done: list[str] = []  # per streamed layer, in order of use: the op that ends it

    for batch in range(sh.num_batches):
        for step in range(sh.num_steps):
            prefix = f"b{batch}/s{step}"
            em.embed(f"{prefix}/embed", step, batch)
            for layer in range(m.num_layers):
                at = f"{prefix}/L{layer}"
                # Double buffering: layer g's weights may load once layer g-2 is done with its buffers.
                after = [layer_done[-2]] if len(layer_done) >= 2 else []
                if em.is_resident(layer):
                    attn_w = gate_w = None
                    expert_w: list[str | None] = [None] * m.num_experts
                else:
                    attn_w, gate_w, loads = em.fetch_layer(at, step, layer, after)
                    expert_w = list(loads)
                em.attention(f"{at}/attn", step, layer, batch, [attn_w], free=_own(attn_w))
                if sync:
                    em.sync_device(f"{at}/attn")
                gate = em.gate(f"{at}/gate", step, layer, batch, [gate_w], free=_own(gate_w))
                if sync:
                    em.sync_device(f"{at}/gate")
                layer_done.append(_experts(em, at, step, layer, batch, counts[step, layer, batch], expert_w, gate))
                if sync:
                    em.sync_device(f"{at}/moe")
            em.lm_head(f"{prefix}/lm_head", step, batch)
    return em.build("single-batch")


def _build_per_sublayer(em: OpEmitter) -> Schedule:
    """Each sub-layer prefetches the next: gate during attention, the MoE layer during the gate,
    the next attention during the MoE layer (the port's loop over sub-layers)."""
    inp = em.inp
    m, sh, counts = inp.model, inp.shape, inp.routing.counts
    sync = em.impl.sync_sublayers
    order = [
        (batch, step, layer)
        for batch in range(sh.num_batches)
        for step in range(sh.num_steps)
        for layer in range(m.num_layers)
    ]
    attention_w = {0: None if em.is_resident(0) else em.fetch_attention("b0/s0/L0", 0, 0)}
    last_attention = prev_moe = None
    for g, (batch, step, layer) in enumerate(order):
        prefix = f"b{batch}/s{step}"
        at = f"{prefix}/L{layer}"
        if layer == 0:
            em.embed(f"{prefix}/embed", step, batch)
        resident = em.is_resident(layer)
        # attention sub-layer: the gate loads meanwhile (issued once the previous MoE layer is done)
        gate_w = None if resident else em.fetch_gate(at, step, layer, [prev_moe])
        attn_w = attention_w.pop(g)
        last_attention = em.attention(f"{at}/attn", step, layer, batch, [attn_w], free=_own(attn_w))
        if sync:
            em.sync_device(f"{at}/attn")
        # gate sub-layer: the whole MoE layer loads meanwhile (once the previous one is done)
        tokens = counts[step, layer, batch]
        expert_w: list[str | None] = [None] * m.num_experts
        if not resident:
            expert_w = list(em.fetch_moe_layer(at, step, layer, [prev_moe]))
        gate = em.gate(f"{at}/gate", step, layer, batch, [gate_w], free=_own(gate_w))
        if sync:
            em.sync_device(f"{at}/gate")
        # MoE sub-layer: the next attention loads meanwhile
        if g + 1 < len(order):
            nb, ns, nl = order[g + 1]
            attention_w[g + 1] = (
                None if em.is_resident(nl) else em.fetch_attention(f"b{nb}/s{ns}/L{nl}", ns, nl, [last_attention])
            )
        # one MoE layer in flight: the next one loads once this one is done
        prev_moe = _experts(em, at, step, layer, batch, tokens, expert_w, gate)
        if sync:
            em.sync_device(f"{at}/moe")
        if layer == m.num_layers - 1:
            em.lm_head(f"{prefix}/lm_head", step, batch)
    return em.build("single-batch")


def _experts(
    em: OpEmitter,
    at: str,
    step: int,
    layer: int,
    batch: int,
    tokens: Sequence[int],
    expert_w: list[str | None],
    after: str,
) -> str:
    """The batch's experts in id order (as `MoE_computation` walks them), each after a `.tolist()`
    wait with `sync=per-expert`; returns the last expert op. It is the layer's sync point: it waits
    for the whole layer's load and releases the experts nobody used."""
    active = [e for e in range(len(tokens)) if tokens[e] > 0]
    unused = tuple(w for e, w in enumerate(expert_w) if w is not None and tokens[e] == 0)
    ops = [
        (f"{at}/E{e}", e, em.batch_tuple[batch], int(tokens[e]), _own(expert_w[e]), _own(expert_w[e])) for e in active
    ]
    return em.expert_chain(step, layer, after, ops, last_also=unused)


def _own(buffer: str | None) -> tuple[str, ...]:
    return (buffer,) if buffer else ()
