"""KTransformers: the routed experts on the host CPU, attention, the router and the shared experts on
the GPU (SERVING.md "Baselines"; kvcache-ai/ktransformers optimize_rules/DeepSeek-V3-Chat-serve.yaml
@1b4e50c2 puts `KExpertsCPU` on the experts). Per MoE layer the tokens' hidden states go down to
host memory, the CPU computes every active expert over the weights it holds (priced by the
profile's `cpu:` section), and the outputs come back and are combined on the GPU. The rule files
compute the experts on the GPU during prefill; that path is not modelled: every iteration, prefill
chunks included, computes its experts on the CPU."""

from __future__ import annotations

from klotski_sim.core.schedule import CPU_STREAMS, DEFAULT_STREAMS
from klotski_sim.serving.emit import IterationEmitter
from klotski_sim.serving.memory import Residency
from klotski_sim.serving.policies.base import ServingPolicy, serving_policy


@serving_policy
class KTransformers(ServingPolicy):
    name = "ktransformers"
    description = "KTransformers: routed experts on the host CPU; attention, router and shared experts on the GPU"
    needs_cpu = True

    def streams(self) -> dict[str, str]:
        return {**DEFAULT_STREAMS, **CPU_STREAMS}

    def residency(self) -> Residency:
        m = self.model
        moe_layers = tuple(j for j in range(m.num_layers) if m.is_moe(j))
        experts = sum(m.moe_layer_bytes(j) for j in moe_layers)
        return Residency(
            gpu_weight_bytes=m.total_bytes() - experts, cpu_expert_layers=moe_layers, host_weight_bytes=experts
        )

    def emission_state(self) -> tuple[()]:
        return ()  # (the placement is fixed for the run)

    def layer(self, em: IterationEmitter, layer: int, after: str) -> str:
        m, t = self.model, em.shape.tokens
        attention = em.attention(layer, [after])
        gate = em.gate(layer, [attention])
        if not m.is_moe(layer):
            return gate
        tags = dict(step=em.it.index, layer=layer, tokens=t, tensor="activation")
        down = em.b.transfer(
            f"{em.at}/L{layer}/act_down", "activation", "d2h_act", m.hidden_bytes(t), "gpu", "cpu", [gate], **tags
        )
        flops, nbytes, _ = em.moe_cost(layer, stored=True)
        experts = em.b.compute(
            f"{em.at}/L{layer}/moe",
            "moe",
            [down],
            stream="cpu_compute",
            flops=flops,
            bytes=nbytes,
            step=em.it.index,
            phase=em.phase,
            layer=layer,
            tokens=t * m.top_k,
        )
        up = em.b.transfer(
            f"{em.at}/L{layer}/act_up", "activation", "h2d_act", m.hidden_bytes(t), "cpu", "gpu", [experts], **tags
        )
        return em.b.compute(
            f"{em.at}/L{layer}/combine",
            "combine",
            [up, gate],
            bytes=3 * m.hidden_bytes(t),
            step=em.it.index,
            phase=em.phase,
            layer=layer,
            tokens=t,
        )
