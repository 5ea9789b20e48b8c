"""vLLM: every weight resident on the GPU; the paged KV cache gets what the weights and a forward
pass's activations leave of `gpu_memory_utilization` (FluxMoE's baseline: SERVING.md "Baselines").
A model whose weights do not leave one KV block is refused with the numbers, as vLLM refuses it."""

from __future__ import annotations

from klotski_sim.serving.emit import IterationEmitter
from klotski_sim.serving.memory import Residency
from klotski_sim.serving.policies.base import ServingPolicy, serving_policy


@serving_policy
class Vllm(ServingPolicy):
    name = "vllm"
    description = "vLLM: all weights resident; the KV cache gets the rest of the memory budget"

    def residency(self) -> Residency:
        return Residency(gpu_weight_bytes=self.model.total_bytes())

    def emission_state(self) -> tuple[()]:
        return ()  # (the placement is fixed for the run)

    def layer(self, em: IterationEmitter, layer: int, after: str) -> str:
        attention = em.attention(layer, [after])
        gate = em.gate(layer, [attention])
        return em.moe(layer, [gate]) if self.model.is_moe(layer) else gate
