"""Single-batch prefetch ("simple pipeline", KLOTSKI.md Baselines).

One batch at a time. While layer j computes, the *entire* layer j+1 — attention, gate and every
expert of its MoE layer — is prefetched; the pipeline synchronises after every layer, so at
most two layers of weights are on the GPU. With `num_batches > 1` the batches run one after
another, each through its whole generation, so every policy does the same work.
"""

from __future__ import annotations

from ..schedule import Schedule
from .base import OpEmitter, PolicyInput, register


@register("single-batch", "one batch at a time; prefetch all of layer j+1 (whole MoE layer) while layer j computes")
def build(inp: PolicyInput) -> Schedule:
    em = OpEmitter(inp)
    m, sh, counts = inp.model, inp.shape, inp.routing.counts
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
                em.gate(f"{at}/gate", step, layer, batch, [gate_w], free=_own(gate_w))
                tokens = counts[step, layer, batch]
                active = [e for e in range(m.num_experts) if tokens[e] > 0]
                unused = tuple(w for e, w in enumerate(expert_w) if w is not None and tokens[e] == 0)
                op = ""
                for k, e in enumerate(active):
                    last = k == len(active) - 1
                    # The last expert op is the layer's sync point: it waits for the whole layer's
                    # load and releases the experts nobody used.
                    deps = [expert_w[e]] + (list(unused) if last else [])
                    op = em.expert(f"{at}/E{e}", step, layer, e, (batch,), int(tokens[e]), deps,
                                   free=_own(expert_w[e]) + (unused if last else ()))
                layer_done.append(op)
            em.lm_head(f"{prefix}/lm_head", step, batch)
    return em.build("single-batch")


def _own(buffer: str | None) -> tuple[str, ...]:
    return (buffer,) if buffer else ()
