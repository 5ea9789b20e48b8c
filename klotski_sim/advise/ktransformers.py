"""KTransformers running a GGUF MoE model: every routed expert on the CPU, attention (MLA for
DeepSeek), the KV cache, dense layers and shared experts on the GPU (its optimize rules,
`DeepSeek-V3-Chat.yaml`: experts `generate_device: "cpu"`; the tutorial: "we offload the expert
computation to the CPU and MLA/KVCache to GPU"), the shared experts computed on the GPU while the
CPU computes the routed ones (`KDeepseekV3MoE.forward`: `submit_for_one_decode`, then the shared
experts, then `sync_for_one_decode`). With two NUMA nodes and `USE_NUMA=1` it copies the experts
onto both nodes ("we copy the critical matrix on both nodes"), so each socket reads its own DRAM.

Decode, one sequence: the GPU reads its weights and the KV cache; per MoE block the CPU reads the
k used experts while the GPU runs the shared experts, one hand-over there and back; the block waits
for the slower. Prefill is not priced: its CPU kernels' rate (llamafile's, AMX's) has no component
measurement here.
"""

from __future__ import annotations

from klotski_sim.advise.llamacpp import (
    ATTENTION_NODES,
    DENSE_NODES,
    MOE_ROUTER_NODES,
    LlamaCppCosts,
    kv_bytes_per_cell,
)
from klotski_sim.hardware.host_cpu import HostCpu
from klotski_sim.hardware.profile import HardwareProfile
from klotski_sim.workload.gguf import GgufSizes
from klotski_sim.workload.model import ModelSpec

SHARED_NODES = 6  # a shared expert's gate, up, activation, down, its sigmoid gate's scale and add


def decode_parts(
    model: ModelSpec,
    sizes: GgufSizes,
    gpu: HardwareProfile,
    host: HostCpu,
    costs: LlamaCppCosts,
    depth: int,
    experts_per_token: int | None = None,
) -> dict[str, float]:
    """Seconds of one decode token at KV depth `depth`, by part (module docstring).
    `experts_per_token`: KTransformers' option to use fewer than the model's k (its "6 experts" runs)."""
    k = experts_per_token or model.top_k
    gpu_rate = gpu.gpu.memory_bandwidth * gpu.gpu.memory_efficiency
    gpu_bytes = float(sizes.output) + kv_bytes_per_cell(model, "BF16") * depth * model.num_layers
    waits = 0.0  # per MoE block: the routed experts on the CPU beyond the shared ones on the GPU
    nodes = 0
    for layer in range(model.num_layers):
        nodes += ATTENTION_NODES + (MOE_ROUTER_NODES + SHARED_NODES if model.is_moe(layer) else DENSE_NODES)
        if not model.is_moe(layer):
            gpu_bytes += sizes.block_rest[layer]
            continue
        shared = 3 * model.hidden_size * model.shared_ffn_size * model.num_shared_experts
        shared_bytes = sizes.block_rest[layer] * shared / max(1, _rest_params(model, layer))
        gpu_bytes += sizes.block_rest[layer] - shared_bytes
        routed = k * sizes.expert_bytes(layer) / host.read_bandwidth + 2 * costs.split_s + costs.cpu_node_s
        waits += max(routed, shared_bytes / gpu_rate)
    return {
        "gpu bytes": gpu_bytes / gpu_rate,
        "cpu experts (shared ones beside them)": waits,
        "gpu nodes": nodes * costs.gpu_node_s,
    }


def _rest_params(model: ModelSpec, layer: int) -> float:
    """A MoE block's parameters besides its routed experts (attention, router, shared experts)."""
    shared = 3 * model.hidden_size * model.shared_ffn_size * model.num_shared_experts
    return model.attention_params() + model.hidden_size * model.num_experts + shared
