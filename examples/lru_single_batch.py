"""Single-batch prefetch with an LRU expert cache of `slots` experts kept on the GPU across steps:
a complete klotski policy in one file (docs/own-schedule.md walks through it).

    klotski-sim simulate --policy-file examples/lru_single_batch.py --policy lru-single-batch
"""

from collections import OrderedDict
from dataclasses import dataclass

from klotski_sim.policies import OpEmitter, PolicyInput, PolicyTraits, register
from klotski_sim.policies.options import option
from klotski_sim.util.errors import UsageError


@dataclass(frozen=True)
class LruOptions:
    slots: int = option(8, "GPU slots of the expert cache, kept across layers and steps", minimum=1)


@register(
    "lru-single-batch",
    "single-batch with an LRU cache of `slots` experts kept across steps",
    options=LruOptions,
    traits=PolicyTraits(one_batch=True, manages_experts=True),
)
def build(inp: PolicyInput):
    em, m, counts, slots = OpEmitter(inp), inp.model, inp.routing.counts, inp.options["slots"]
    if slots > m.num_layers * m.num_experts:  # (more slots than experts: 2**70 was taken)
        raise UsageError(
            f"lru-single-batch: slots must be from 1 to {m.num_layers * m.num_experts} "
            f"(every expert of {m.name}), got {slots}"
        )
    cache: OrderedDict = OrderedDict()  # (layer, expert) -> (its load op, the last op that used it)
    hits = misses = 0
    op = None  # the latest compute op: the next layer's weights load once it has started (double buffering)
    for batch in range(inp.shape.num_batches):
        for step in range(inp.shape.num_steps):
            em.embed(f"b{batch}/s{step}/embed", step, batch)
            for layer in range(m.num_layers):
                at, resident = f"b{batch}/s{step}/L{layer}", em.is_resident(layer)
                attn_w = None if resident else em.fetch_attention(at, step, layer, [op])
                gate_w = None if resident else em.fetch_gate(at, step, layer, [op])
                em.attention(f"{at}/attn", step, layer, batch, [attn_w], free=(attn_w,) if attn_w else ())
                op = em.gate(f"{at}/gate", step, layer, batch, [gate_w], free=(gate_w,) if gate_w else ())
                for e in [int(x) for x in counts[step, layer, batch].nonzero()[0]]:
                    load = None
                    if not resident and (layer, e) in cache:  # a hit: the weights are still there
                        hits += 1
                        load, _ = cache.pop((layer, e))
                    elif not resident:  # a miss: load it, evicting the least recently used first
                        misses += 1
                        after, frees = [], ()
                        if len(cache) >= slots:
                            _, (old, last_use) = cache.popitem(last=False)
                            after, frees = [last_use], (old,)
                        load = em.fetch(
                            f"{at}/load_E{e}",
                            "experts",
                            m.expert_bytes(),
                            "moe_weights",
                            "h2d_experts",
                            after,
                            step=step,
                            layer=layer,
                            expert=e,
                            free=frees,
                        )
                    op = em.expert(
                        f"{at}/E{e}", step, layer, e, (batch,), int(counts[step, layer, batch, e]), [load, op]
                    )
                    if load:
                        cache[(layer, e)] = (load, op)
            last = em.lm_head(f"b{batch}/s{step}/lm_head", step, batch)
    em.b.compute("release_cache", "combine", [last], free=tuple(load for load, _ in cache.values()))
    return em.build(
        "lru-single-batch",
        cache={"slots": slots, "hits": hits, "misses": misses, "hit_rate": hits / max(1, hits + misses)},
    )
