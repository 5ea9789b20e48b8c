"""KTransformers running a GGUF MoE model: every routed expert on the CPU, attention (MLA for
DeepSeek), the KV cache, dense layers and shared experts on the GPU (its optimize rules,
`DeepSeek-V3-Chat.yaml`: experts `generate_device: "cpu"`; the tutorial: "we offload the expert
computation to the CPU and MLA/KVCache to GPU"), the shared experts computed on the GPU while the
CPU computes the routed ones (`KDeepseekV3MoE.forward`: `submit_for_one_decode`, then the shared
experts, then `sync_for_one_decode`). With two NUMA nodes and `USE_NUMA=1` it copies the experts
onto both nodes ("we copy the critical matrix on both nodes"), so each socket reads its own DRAM.

Decode, one sequence: the GPU reads its weights and the KV cache; per MoE block the CPU reads the
k used experts while the GPU runs the shared experts, one hand-over there and back; the block waits
for the slower. The CPU's MoE operator costs a fixed time per call besides its reads
(`OPERATOR_CALL_S`). Decode's experts run AVX-512 kernels, not AMX: a GGUF expert through
`llamafile_sgemm`, which hands Q4_K/Q6_K to Kawrakow's `iqk_mul_mat` (`operators/llamafile/moe.cpp`
`forward_one`; `third_party/llamafile/tinyblas_cpu_sgemm.inc`), and AMX only above 4 tokens an
expert (`operators/amx/moe.hpp`: `use_amx = qlen > 4 * expert_num / routed_expert_num`). Prefill is
not priced: its CPU kernels' rate (llamafile's, AMX's) has no component measurement here.
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
from klotski_sim.util.linefit import rate_and_fixed
from klotski_sim.workload.gguf import GgufSizes
from klotski_sim.workload.model import ModelSpec

SHARED_NODES = 6  # a shared expert's gate, up, activation, down, its sigmoid gate's scale and add

# KTransformers' own benchmark of its CPU MoE operator at one token (doc/en/operators/llamafile.md and
# its plot Combined_MoE_time_per_layer.png, commit 18c42e67; archive/csrc/ktransformers_ext/bench/
# bench_moe.py: qlen 1, CPUInfer(64), 6 of 160 experts of 5120 x 1536, Xeon Gold 6454S): time per
# layer by weight type, read off the plot (about +-20 us), with the script's bytes per weight.
# (type, bytes per weight, seconds a layer)
OPERATOR_BENCH = (
    ("fp32", 4.0, 2500e-6), ("fp16", 2.0, 1320e-6), ("bf16", 2.0, 1380e-6), ("q8_0", 1.0625, 755e-6),
    ("q6_k", 0.820312, 635e-6), ("q5_k_m", 0.731771, 575e-6), ("q4_k_m", 0.648437, 520e-6),
    ("q3_k_m", 0.515625, 445e-6), ("q2_k", 0.328125, 360e-6),
)  # fmt: skip
OPERATOR_BENCH_WEIGHTS = 6 * 3 * 5120 * 1536  # the benchmark's weights a layer: 6 experts, 3 matrices


def _operator_fit() -> tuple[float, float]:
    """(bytes/s, seconds a call) of the line through OPERATOR_BENCH's time against bytes read. Its
    nine types lie within 5% of it (240 GB/s and 0.149 ms): the operator streams its weights and
    pays a fixed time per call (task hand-out to 64 threads, the work-stealing join)."""
    return rate_and_fixed([b * OPERATOR_BENCH_WEIGHTS for _, b, _ in OPERATOR_BENCH], [t for *_, t in OPERATOR_BENCH])


# The fixed time of one MoE operator call at one token (its stream rate, 240 GB/s on a host the doc
# does not say is one socket or two, is left to the host's own read bandwidth).
OPERATOR_CALL_S = _operator_fit()[1]


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
        routed = k * sizes.expert_bytes(layer) / host.read_bandwidth + 2 * costs.split_s + OPERATOR_CALL_S
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
