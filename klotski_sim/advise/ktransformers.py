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

from dataclasses import dataclass

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
        # (the block's shared experts' share of its non-routed bytes, by their share of its weights)
        shared_bytes = sizes.block_rest[layer] * model.shared_expert_bytes() / _rest_bytes(model, layer)
        gpu_bytes += sizes.block_rest[layer] - shared_bytes
        routed = k * sizes.expert_bytes(layer) / host.read_bandwidth + 2 * costs.split_s + costs.cpu_node_s
        waits += max(routed, shared_bytes / gpu_rate)
    return {
        "gpu bytes": gpu_bytes / gpu_rate,
        "cpu experts (shared ones beside them)": waits,
        "gpu nodes": nodes * costs.gpu_node_s,
    }


def _rest_bytes(model: ModelSpec, layer: int) -> float:
    """A MoE block's weights besides its routed experts in the model dtype: attention, router and
    shared experts (ModelSpec's accounting)."""
    return model.attention_bytes() + model.gate_bytes(layer)


@dataclass(frozen=True)
class KtOption:
    """KTransformers' one placement of a model: what each side holds, its generation speed, how to run it."""

    gpu_bytes: float
    host_bytes: float
    decode_s: float | None  # None where it does not fit
    refused: str
    command: str

    @property
    def generation_tok_s(self) -> float:
        return 1 / self.decode_s if self.decode_s else 0.0


def kt_option(
    model: ModelSpec,
    sizes: GgufSizes,
    gpu: HardwareProfile,
    host: HostCpu,
    costs: LlamaCppCosts,
    ctx: int,
    model_file: str,
    depth: int = 64,
    host_room: float | None = None,
) -> KtOption:
    """KTransformers' placement (module docstring) priced: the GPU holds everything but the routed
    experts, plus the KV cache of `ctx` tokens (its MLA latent in bf16); the host holds the routed
    experts, once per NUMA node with `USE_NUMA=1` (the tutorial: "copy the critical matrix on both
    nodes"). `--cpu_infer` is the tutorial's: one more than the cores it computes on (33 for one
    32-core socket, 65 for two)."""
    gpu_bytes = (
        sizes.total - sizes.token_embd - sum(sizes.experts) + kv_bytes_per_cell(model, "BF16") * ctx * model.num_layers
    )
    host_bytes = sum(sizes.experts) * host.numa + sizes.token_embd
    numa = "USE_NUMA=1 (build), " if host.numa > 1 else ""
    command = (
        f"{numa}python -m ktransformers.local_chat --gguf_path {model_file} --cpu_infer {host.cores + 1} "
        f"--max_new_tokens 1000"
    )
    room = host.ram_bytes if host_room is None else host_room
    refused = ""
    if gpu_bytes > gpu.gpu.usable_bytes:
        refused = (
            f"the GPU would hold {gpu_bytes / 2**30:.1f} GiB, more than its {gpu.gpu.usable_bytes / 2**30:.1f} GiB"
        )
    elif host_bytes > room:
        refused = f"the host would hold {host_bytes / 2**30:.1f} GiB of experts, more than its {room / 2**30:.1f} GiB"
    decode = None if refused else sum(decode_parts(model, sizes, gpu, host, costs, depth).values())
    return KtOption(gpu_bytes, host_bytes, decode, refused, command)
