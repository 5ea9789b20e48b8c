"""vLLM-O: vLLM with whole-layer weight offload and prefetching, FluxMoE's second baseline
(SERVING.md "Baselines"): the earliest layers stay resident, the last `offload_layers` live in
pinned host memory and are copied whole into one of two reusable GPU layer blocks every iteration,
layer i+1's copy running while layer i computes (a block is overwritten only after the layer that
read it has finished: write-after-read; a layer starts only once its copy has landed:
read-after-write). vLLM's own `--cpu-offload-gb` offloads parameter by parameter from the first
layers up (vllm/model_executor/models/utils.py `maybe_offload_to_cpu`); the baseline described in the
paper offloads the last layers, which is modelled here.

`offload_layers=-1` (the default) offloads the fewest last layers that leave a KV cache holding the
longest request, as "as many as the budget requires" reads.
"""

from __future__ import annotations

from dataclasses import dataclass

from klotski_sim.policies.options import option
from klotski_sim.serving.batcher import ServingRefusal
from klotski_sim.serving.emit import IterationEmitter
from klotski_sim.serving.memory import Residency, plan_memory
from klotski_sim.serving.policies.base import ServingPolicy, serving_policy
from klotski_sim.util.units import memory_text


@dataclass(frozen=True)
class VllmOOptions:
    offload_layers: int = option(
        -1,
        "the last layers kept in host memory and copied in whole every iteration (-1: the fewest that leave "
        "the KV cache the longest request)",
        minimum=-1,
    )


@serving_policy
class VllmO(ServingPolicy):
    name = "vllm-o"
    description = "vLLM-O: the last layers in host memory, copied whole into two GPU blocks, one layer ahead"
    Options = VllmOOptions

    def _residency(self, count: int) -> Residency:
        m = self.model
        offloaded = tuple(range(m.num_layers - count, m.num_layers))
        host = sum(m.layer_bytes(j) for j in offloaded)
        block = max((m.layer_bytes(j) for j in offloaded), default=0)
        return Residency(
            gpu_weight_bytes=m.total_bytes() - host,
            buffer_bytes=min(2, count) * block,
            offloaded_layers=offloaded,
            host_weight_bytes=host,
        )

    def residency(self) -> Residency:
        m, s = self.model, self.setup
        count = self.options.get("offload_layers", -1)
        if count > m.num_layers:
            raise ServingRefusal(f"vllm-o: offload_layers {count} is more than {m.name}'s {m.num_layers} layers")
        if count < 0:
            longest = max(r.total_len for r in s.workload.requests)
            need = -(-longest // s.batching.block_size)
            for count in range(m.num_layers + 1):
                try:
                    plan = plan_memory(
                        m, self.profile, self._residency(count), s.batching, s.gpu_memory_utilization, ""
                    )
                except ServingRefusal:
                    continue
                if plan.num_blocks >= need:
                    break
            else:
                raise ServingRefusal(
                    f"vllm-o: even with all {m.num_layers} layers offloaded the KV cache does not hold the longest "
                    f"request ({longest:,} tokens, {need:,} blocks)"
                )
        residency = self._residency(count)
        if residency.host_weight_bytes > self.profile.host.memory_bytes:
            raise ServingRefusal(
                f"vllm-o: {count} offloaded layers need {memory_text(residency.host_weight_bytes)} of host memory; "
                f"{self.profile.name} has {memory_text(self.profile.host.memory_bytes)}"
            )
        self._offloaded = residency.offloaded_layers
        return residency

    def emission_state(self) -> tuple[()]:
        return ()  # (the placement is fixed for the run)

    def layer(self, em: IterationEmitter, layer: int, after: str) -> str:
        m = self.model
        if layer not in self._offloaded:
            attention = em.attention(layer, [after])
            gate = em.gate(layer, [attention])
            return em.moe(layer, [gate]) if m.is_moe(layer) else gate
        k = layer - self._offloaded[0]
        if k == 0:
            self._readers: list[str] = []  # per offloaded layer of this iteration: the op that frees its block
        nbytes = m.layer_bytes(layer)
        block = f"{em.at}/L{layer}/weights"
        load = em.b.transfer(
            f"{em.at}/L{layer}/load",
            "weights",
            "h2d_weights",
            nbytes,
            "cpu",
            "gpu",
            [self._readers[k - 2]] if k >= 2 else [],  # write-after-read: the block two layers back is free
            alloc=((block, nbytes),),
            step=em.it.index,
            layer=layer,
        )
        attention = em.attention(layer, [after, load])
        if m.is_moe(layer):
            gate = em.gate(layer, [attention])
            last = em.moe(layer, [gate], free=(block,))
        else:
            last = em.gate(layer, [attention], free=(block,))
        self._readers.append(last)
        return last
