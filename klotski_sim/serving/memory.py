"""GPU memory of a serving engine: what the weights leave to the paged KV cache.

As vLLM sizes it (vllm/v1/worker/gpu_worker.py `determine_available_memory`, vllm/v1/core/
kv_cache_utils.py `get_num_blocks`; docs/serving.md): the KV cache gets the GPU's memory times
`gpu_memory_utilization` less the peak of a profiling forward pass of `max_num_batched_tokens`
tokens (the resident weights plus that pass's activations), in blocks of `block_size` tokens, each
holding every layer's K and V. vLLM measures that peak; here the activations are estimated from the
shapes (`activation_bytes`), and a policy that materialises weights per iteration adds its reusable
weight blocks.
"""

from __future__ import annotations

from dataclasses import dataclass

from klotski_sim.hardware.profile import HardwareProfile
from klotski_sim.serving.batcher import BatchingConfig, ServingRefusal
from klotski_sim.util.units import memory_text
from klotski_sim.workload.model import ModelSpec

FP32_BYTES = 4  # vLLM's sampler computes logits in float32


@dataclass(frozen=True)
class Residency:
    """Where a serving policy keeps each layer's weights for the whole run."""

    gpu_weight_bytes: int  # weights on the GPU for the whole run (uncompressed or compressed)
    buffer_bytes: int = 0  # reusable blocks that weights are materialised into, at most in flight
    offloaded_layers: tuple[int, ...] = ()  # layers whose weights are brought in every iteration
    cpu_expert_layers: tuple[int, ...] = ()  # layers whose routed experts run on the host CPU
    host_weight_bytes: int = 0  # weights kept in (pinned) host memory
    notes: tuple[str, ...] = ()


@dataclass(frozen=True)
class MemoryPlan:
    """The GPU memory of one serving run, and the KV blocks it leaves."""

    capacity_bytes: int  # the GPU's memory
    budget_bytes: int  # capacity x gpu_memory_utilization
    weight_bytes: int
    buffer_bytes: int
    activation_bytes: int
    kv_bytes: int
    block_bytes: int  # one block: block_size tokens, every layer's K and V
    num_blocks: int
    block_size: int

    @property
    def kv_tokens(self) -> int:
        return self.num_blocks * self.block_size

    def describe(self) -> str:
        return (
            f"GPU {memory_text(self.capacity_bytes)} x utilisation = {memory_text(self.budget_bytes)}: weights "
            f"{memory_text(self.weight_bytes)}, weight blocks {memory_text(self.buffer_bytes)}, activations "
            f"{memory_text(self.activation_bytes)}, KV cache {memory_text(self.kv_bytes)} = {self.num_blocks:,} "
            f"blocks of {self.block_size} tokens ({self.kv_tokens:,} tokens)"
        )


def activation_bytes(model: ModelSpec, config: BatchingConfig) -> int:
    """The activations of a forward pass of `max_num_batched_tokens` tokens at their peak (one layer's
    at a time): the residual stream and its normalised copy, the attention's Q, K and V, the routed
    experts' fused gate/up output and their outputs before the combine (top-k per token), and the
    float32 logits of `max_num_seqs` sampled positions."""
    tokens, dtype = config.max_num_batched_tokens, model.dtype_bytes
    hidden = 2 * model.hidden_bytes(tokens)
    qkv = tokens * (model.q_dim + 2 * model.kv_dim) * dtype
    ffn = max(model.ffn_size, model.dense_ffn_size or 0, (model.shared_ffn_size or 0) * model.num_shared_experts)
    experts = tokens * model.top_k * (2 * ffn + model.hidden_size) * dtype
    logits = config.max_num_seqs * model.vocab_size * FP32_BYTES
    return int(hidden + qkv + experts + logits)


def plan_memory(
    model: ModelSpec,
    profile: HardwareProfile,
    residency: Residency,
    config: BatchingConfig,
    gpu_memory_utilization: float,
    policy: str,
) -> MemoryPlan:
    """The KV cache a policy's residency leaves; refused, with the numbers, when none is left or when
    one block would not fit."""
    capacity = int(profile.gpu.memory_bytes)
    budget = int(min(capacity * gpu_memory_utilization, profile.gpu.usable_bytes))
    act = activation_bytes(model, config)
    block = config.block_size * model.kv_bytes_per_token() * model.num_layers
    left = budget - residency.gpu_weight_bytes - residency.buffer_bytes - act
    blocks = max(0, left // block)
    plan = MemoryPlan(
        capacity,
        budget,
        residency.gpu_weight_bytes,
        residency.buffer_bytes,
        act,
        int(blocks * block),
        block,
        int(blocks),
        config.block_size,
    )
    if blocks < 1:
        raise ServingRefusal(
            f"{policy}: {model.name} leaves no KV cache on {profile.name}: {plan.describe()}; "
            f"{memory_text(-left) if left < 0 else memory_text(block - left)} more would hold one block"
        )
    return plan
