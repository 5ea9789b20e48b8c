"""ModelSpec: the shape of a Mixtral-style MoE model, turned into bytes and FLOPs per op.

Every policy asks the same questions ("how big is one expert?", "how many FLOPs is attention
for this batch at this KV length?"); answering them in one place keeps the simulator, the
planner and the runtime in agreement. Numbers for the presets come from the models' public
configs (see ../docs/KLOTSKI.md tables).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, replace

from klotski_sim.util.errors import UsageError
from klotski_sim.workload.hf_config import config_fields, is_config_path

# how q and k are normalised before RoPE: not at all, per head (Qwen3-MoE), over the whole projection (OLMoE)
QK_NORMS: tuple[str, ...] = ("", "head", "full")


def routes(layer: int, first_dense: int, moe_step: int) -> bool:
    """Whether `layer` has experts: none of the first `first_dense` (DeepSeek's first_k_dense_replace),
    then every `moe_step`-th (layers first_dense + step - 1, + 2 step - 1, ...: transformers'
    Llama4TextConfig.moe_layers from interleave_moe_layer_step)."""
    return layer >= first_dense and (layer - first_dense) % moe_step == moe_step - 1


@dataclass(frozen=True)
class ModelSpec:
    """Architecture of a decoder-only MoE transformer: `[embed, (attention, gate, moe) x L, lm_head]`."""

    name: str
    num_layers: int
    num_experts: int
    top_k: int
    hidden_size: int
    ffn_size: int  # intermediate size of one routed expert
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    dtype_bytes: int = 2  # bf16
    num_shared_experts: int = 0  # always-active experts (Qwen-MoE / DeepSeek style)
    shared_ffn_size: int = 0  # intermediate size of one shared expert
    hf_model_type: str = "mixtral"  # transformers' config.model_type this shape mirrors
    expert_bits: int = 0  # routed experts group-quantised to this many bits (0: stored in dtype_bytes)
    quant_group: int = 64  # weights per (scale, zero) pair
    quant_meta_bytes: int = 4  # bytes of one group's scale + zero (fp16 each; 8 for fp32)
    first_dense_layers: int = 0  # DeepSeek's first_k_dense_replace: these layers have a dense MLP, no experts
    dense_ffn_size: int = 0  # intermediate size of that dense MLP
    # Llama 4's interleave_moe_layer_step: after the first dense layers, only every moe_layer_step-th
    # layer has experts (`routes`); the others have the dense MLP
    moe_layer_step: int = 1
    # Multi-head latent attention (DeepSeek-V2/V3); kv_lora_rank > 0 turns it on
    kv_lora_rank: int = 0
    q_lora_rank: int = 0  # 0: queries are not compressed (V2-Lite)
    qk_rope_dim: int = 0
    qk_nope_dim: int = 0
    v_head_dim: int = 0
    # RMSNorm of q and k after their projections, before RoPE: "" none (Mixtral), "head" over each
    # head's head_dim (Qwen3-MoE's q_norm/k_norm), "full" over the whole q and k projections (OLMoE's)
    qk_norm: str = ""
    # whether the router renormalises its top-k softmax probabilities to sum to 1 (Mixtral does;
    # OLMoE and Qwen1.5-MoE weight the experts by the full softmax's probabilities)
    norm_topk_prob: bool = True
    # gpt-oss: biases on the attention projections, the router and every expert, and one attention
    # sink per head (vectors: counted in its GGUF file's bytes and parameters; the costs ignore them)
    biases: bool = False
    # gpt-oss: every other layer (the even ones) attends to the last `sliding_window` tokens only
    sliding_window: int = 0

    def __post_init__(self) -> None:
        for field_name in (
            "num_layers",
            "num_experts",
            "top_k",
            "hidden_size",
            "ffn_size",
            "num_heads",
            "num_kv_heads",
            "head_dim",
            "vocab_size",
            "dtype_bytes",
        ):
            value = getattr(self, field_name)
            if not isinstance(value, int) or value <= 0:
                raise UsageError(f"model {self.name!r}: {field_name} must be a positive integer, got {value!r}")
        if self.top_k > self.num_experts:
            raise UsageError(f"model {self.name!r}: top_k={self.top_k} > num_experts={self.num_experts}")
        if self.num_heads % self.num_kv_heads:
            raise UsageError(f"model {self.name!r}: num_heads must be a multiple of num_kv_heads")
        if self.num_shared_experts < 0 or self.shared_ffn_size < 0:
            raise UsageError(f"model {self.name!r}: shared expert sizes must be >= 0")
        if not isinstance(self.moe_layer_step, int) or self.moe_layer_step < 1:
            raise UsageError(
                f"model {self.name!r}: moe_layer_step must be a positive integer, got {self.moe_layer_step!r}"
            )
        if not 0 <= self.first_dense_layers or self.first_moe_layer >= self.num_layers:
            raise UsageError(
                f"model {self.name!r}: no layer has experts: the first would be layer {self.first_moe_layer} "
                f"({self.first_dense_layers} dense first, then every {self.moe_layer_step}th), of {self.num_layers} layers"
            )
        if (self.first_dense_layers or self.moe_layer_step > 1) and self.dense_ffn_size <= 0:
            raise UsageError(f"model {self.name!r}: dense layers need dense_ffn_size > 0")
        if self.mla and min(self.qk_rope_dim, self.qk_nope_dim, self.v_head_dim) <= 0:
            raise UsageError(f"model {self.name!r}: MLA needs qk_rope_dim, qk_nope_dim and v_head_dim > 0")
        if self.qk_norm not in QK_NORMS:
            raise UsageError(
                f"model {self.name!r}: qk_norm must be one of {', '.join(map(repr, QK_NORMS))} "
                f"(none, per head, over the whole projection), got {self.qk_norm!r}"
            )
        if self.qk_norm and self.mla:
            raise UsageError(f"model {self.name!r}: qk_norm is for q/k/v attention; MLA normalises its own latents")
        if not isinstance(self.norm_topk_prob, bool):
            raise UsageError(f"model {self.name!r}: norm_topk_prob must be true or false, got {self.norm_topk_prob!r}")

    # ---- which layers have experts -----------------------------------------------------------
    @property
    def mla(self) -> bool:
        return self.kv_lora_rank > 0

    def is_moe(self, layer: int = -1) -> bool:
        """Whether `layer` routes to experts (-1: a MoE layer, the one streaming is sized for)."""
        return layer < 0 or routes(layer, self.first_dense_layers, self.moe_layer_step)

    @property
    def moe_layers(self) -> tuple[int, ...]:
        """The layers with experts, in order."""
        return tuple(j for j in range(self.num_layers) if self.is_moe(j))

    @property
    def first_moe_layer(self) -> int:
        return self.first_dense_layers + self.moe_layer_step - 1

    @property
    def routed_experts(self) -> int:
        """Routed experts over every layer: what an expert cache or a placement can hold."""
        return len(self.moe_layers) * self.num_experts

    def experts_in(self, layer: int) -> int:
        return self.num_experts if self.is_moe(layer) else 0

    # ---- weights (bytes) -------------------------------------------------------------------
    @property
    def q_dim(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_dim(self) -> int:
        return self.num_kv_heads * self.head_dim

    def attention_params(self) -> int:
        """q, k, v, o projections (the RMSNorm vectors are counted in resident_bytes). MLA
        (DeepSeek-V2/V3 `MLA` module): q (through a rank-q_lora bottleneck when set), the joint
        KV down-projection to the latent plus the shared RoPE key, its up-projection to every
        head's K (no-RoPE part) and V, and o."""
        h = self.hidden_size
        if not self.mla:
            return h * self.q_dim + 2 * h * self.kv_dim + self.q_dim * h
        heads, qk = self.num_heads, self.qk_nope_dim + self.qk_rope_dim
        q = h * self.q_lora_rank + self.q_lora_rank * heads * qk if self.q_lora_rank else h * heads * qk
        kv = h * (self.kv_lora_rank + self.qk_rope_dim) + self.kv_lora_rank * heads * (
            self.qk_nope_dim + self.v_head_dim
        )
        return q + kv + heads * self.v_head_dim * h

    def attention_bytes(self) -> int:
        return self.attention_params() * self.dtype_bytes

    def shared_expert_bytes(self) -> int:
        return self.num_shared_experts * 3 * self.hidden_size * self.shared_ffn_size * self.dtype_bytes

    def dense_mlp_bytes(self) -> int:
        return 3 * self.hidden_size * self.dense_ffn_size * self.dtype_bytes

    def gate_bytes(self, layer: int = -1) -> int:
        """Router weights, plus the shared experts: the gate op also runs them, since they are
        always active and need no routing decision. In a dense layer the gate op is the dense MLP."""
        if not self.is_moe(layer):
            return self.dense_mlp_bytes()
        router = self.hidden_size * self.num_experts * self.dtype_bytes
        shared_gate = self.hidden_size * self.dtype_bytes if self.num_shared_experts else 0
        return router + shared_gate + self.shared_expert_bytes()

    def expert_params(self) -> int:
        """Weights of one routed SwiGLU expert: w1, w3 (h x f) and w2 (f x h)."""
        return 3 * self.hidden_size * self.ffn_size

    def expert_bytes(self) -> int:
        """One routed expert as stored and moved: its weights in the model dtype, or quantised —
        the packed codes (HQQ packs 3-bit codes ten to an int32: 3.2 bits each) plus one scale and
        one zero per group."""
        params = self.expert_params()
        if not self.expert_bits:
            return params * self.dtype_bytes
        packed_bits = PACKED_BITS[self.expert_bits]
        return math.ceil(params * packed_bits / 8) + math.ceil(params / self.quant_group) * self.quant_meta_bytes

    @property
    def quantised(self) -> bool:
        return bool(self.expert_bits)

    def expert_buffer_bytes(self) -> int:
        """GPU bytes one streamed expert holds once usable: dequantised into the model dtype when
        quantised (the packed copy is freed after dequantising)."""
        return self.expert_params() * self.dtype_bytes if self.expert_bits else self.expert_bytes()

    def resident_layer_bytes(self, layer: int = -1) -> int:
        """GPU bytes of a layer kept whole on the GPU: its experts dequantised once, when quantised."""
        return self.attention_bytes() + self.gate_bytes(layer) + self.experts_in(layer) * self.expert_buffer_bytes()

    def non_expert_bytes(self) -> int:
        """Every layer's attention and gate (a dense layer's MLP included): what stays put while
        experts move."""
        return sum(self.attention_bytes() + self.gate_bytes(j) for j in range(self.num_layers))

    def resident_layers_bytes(self, count: int) -> int:
        """GPU bytes of the first `count` layers kept whole."""
        return sum(self.resident_layer_bytes(j) for j in range(min(count, self.num_layers)))

    def moe_layer_buffer_bytes(self) -> int:
        """GPU bytes of a whole MoE layer in flight: every expert usable, plus one packed copy
        being dequantised when quantised."""
        return self.num_experts * self.expert_buffer_bytes() + (self.expert_bytes() if self.expert_bits else 0)

    def moe_layer_bytes(self, layer: int = -1) -> int:
        return self.experts_in(layer) * self.expert_bytes()

    def layer_bytes(self, layer: int = -1) -> int:
        """One layer's weights as stored (-1: a MoE layer)."""
        return self.attention_bytes() + self.gate_bytes(layer) + self.moe_layer_bytes(layer)

    def layers_bytes(self) -> int:
        """Every layer's weights as stored."""
        return sum(self.layer_bytes(j) for j in range(self.num_layers))

    def embedding_bytes(self) -> int:
        return self.vocab_size * self.hidden_size * self.dtype_bytes

    def qk_norm_widths(self) -> tuple[int, int]:
        """Lengths of one layer's q_norm and k_norm vectors: head_dim each (per head, shared by the
        heads), or as wide as the q and k projections; (0, 0) without q/k norm."""
        if self.qk_norm == "head":
            return self.head_dim, self.head_dim
        if self.qk_norm == "full":
            return self.q_dim, self.kv_dim
        return 0, 0

    def resident_bytes(self) -> int:
        """Kept on the GPU for the whole run: embedding, lm_head, final norm and the per-layer
        RMSNorm vectors, the q/k norms included (too small to be worth streaming)."""
        norms = (
            (2 * self.num_layers + 1) * self.hidden_size + self.num_layers * sum(self.qk_norm_widths())
        ) * self.dtype_bytes
        return 2 * self.embedding_bytes() + norms

    def total_bytes(self) -> int:
        return self.resident_bytes() + self.layers_bytes()

    # ---- per-token state (bytes) -----------------------------------------------------------
    def kv_bytes_per_token(self) -> int:
        """K and V of one token in one layer; with MLA the cached latent and the shared RoPE key
        (kv_lora_rank + qk_rope_dim values: DeepSeek-V3 inference/model.py caches these, the
        DeepSeek-V2 paper's (d_c + d_h^R) per layer)."""
        if self.mla:
            return (self.kv_lora_rank + self.qk_rope_dim) * self.dtype_bytes
        return 2 * self.kv_dim * self.dtype_bytes

    def kv_bytes(self, sequences: int, tokens: int) -> int:
        """KV cache of `sequences` sequences of `tokens` tokens, one layer."""
        return sequences * tokens * self.kv_bytes_per_token()

    def hidden_bytes(self, tokens: int) -> int:
        """Hidden states (activations) of `tokens` tokens."""
        return tokens * self.hidden_size * self.dtype_bytes

    # ---- FLOPs ------------------------------------------------------------------------------
    def attention_flops(self, sequences: int, new_tokens: int, kv_len: int, impl: str = "fused") -> int:
        """Attention over `sequences` sequences, each adding `new_tokens` to a cache that then holds
        `kv_len` tokens. Prefill (new_tokens == kv_len) is causal: a fused kernel skips the masked
        half (each query sees half on average); the eager path multiplies the whole square."""
        tokens = sequences * new_tokens
        projections = 2 * tokens * self.attention_params()
        causal = new_tokens == kv_len and new_tokens > 1 and impl == "fused"
        visible = (kv_len + 1) / 2 if causal else kv_len
        if self.mla:  # absorbed: scores over the latent + RoPE key, values from the latent
            scores = 2 * tokens * self.num_heads * visible * (2 * self.kv_lora_rank + self.qk_rope_dim)
        else:
            scores = 2 * 2 * tokens * self.num_heads * self.head_dim * visible  # QK^T and AV
        return int(projections + scores)

    def attention_io_bytes(self, sequences: int, new_tokens: int, kv_len: int, impl: str = "fused") -> int:
        """GPU memory traffic of attention. `fused`: weights once, the KV cache read once,
        activations in and out. `eager` (transformers' `eager_attention_forward` after
        `DynamicCache.update`): the cache is concatenated (read + written), `repeat_kv` reads it and
        writes num_heads/num_kv_heads copies, QK^T and AV read those copies, the scores
        [heads x new x kv_len] go through matmul, scale, mask, fp32 softmax and the cast back
        (24 bytes per score in bf16), and the output is transposed back (read + write)."""
        kv = self.kv_bytes(sequences, kv_len)
        hidden = self.hidden_bytes(sequences * new_tokens)
        if impl == "fused":
            return self.attention_bytes() + kv + 2 * hidden
        if impl != "eager":
            raise UsageError(f"attention impl must be 'fused' or 'eager', got {impl!r}")
        rep = self.num_heads // self.num_kv_heads
        concat = 2 * kv
        repeat = (1 + rep) * kv
        matmuls = rep * kv
        scores = sequences * self.num_heads * new_tokens * kv_len * (8 * self.dtype_bytes + 8)
        return self.attention_bytes() + concat + repeat + matmuls + scores + 4 * hidden

    def gate_flops(self, tokens: int, layer: int = -1) -> int:
        if not self.is_moe(layer):  # the dense MLP
            return 2 * tokens * 3 * self.hidden_size * self.dense_ffn_size
        shared = 2 * tokens * 3 * self.hidden_size * self.shared_ffn_size * self.num_shared_experts
        return 2 * tokens * self.hidden_size * self.num_experts + shared

    def gate_io_bytes(self, tokens: int, layer: int = -1) -> int:
        return self.gate_bytes(layer) + 2 * self.hidden_bytes(tokens)

    def expert_flops(self, tokens: int) -> int:
        return 2 * tokens * 3 * self.hidden_size * self.ffn_size

    def expert_io_bytes(self, tokens: int, stored: bool = False) -> int:
        """Memory traffic of one expert op: its weights in the model dtype (on the GPU a quantised
        expert is dequantised once, after its copy: `dequant_*`), or as stored (`stored=True`: a
        CPU kernel that computes on the packed codes, as llama.cpp's do), plus activations."""
        weights = self.expert_bytes() if stored else self.expert_params() * self.dtype_bytes
        return weights + 2 * self.hidden_bytes(tokens)

    def dequant_flops(self) -> int:
        """Dequantising one expert: a subtract and a multiply per weight ((W_q - zero) * scale)."""
        return 2 * self.expert_params()

    def dequant_io_bytes(self) -> int:
        """Dequantising one expert as HQQ's `dequantize` (and Klotski's port) runs it: read the codes,
        scales and zeros, write the weights in the model dtype."""
        return self.expert_bytes() + self.expert_params() * self.dtype_bytes

    def lm_head_flops(self, tokens: int) -> int:
        return 2 * tokens * self.hidden_size * self.vocab_size

    def lm_head_io_bytes(self, tokens: int) -> int:
        return self.embedding_bytes() + self.hidden_bytes(tokens)

    def to_dict(self) -> dict:
        return asdict(self)


PRESETS: dict[str, ModelSpec] = {
    m.name: m
    for m in (
        ModelSpec(
            "mixtral-8x7b",
            num_layers=32,
            num_experts=8,
            top_k=2,
            hidden_size=4096,
            ffn_size=14336,
            num_heads=32,
            num_kv_heads=8,
            head_dim=128,
            vocab_size=32000,
        ),
        ModelSpec(
            "mixtral-8x22b",
            num_layers=56,
            num_experts=8,
            top_k=2,
            hidden_size=6144,
            ffn_size=16384,
            num_heads=48,
            num_kv_heads=8,
            head_dim=128,
            vocab_size=32000,
        ),
        # Fine-grained: 64 experts, top-8 (allenai/OLMoE-1B-7B-0924 config); its q_norm and k_norm span
        # the whole q and k projections, and norm_topk_prob is false (top-8 softmax weights not renormalised).
        ModelSpec(
            "olmoe-1b-7b",
            num_layers=16,
            num_experts=64,
            top_k=8,
            hidden_size=2048,
            ffn_size=1024,
            num_heads=16,
            num_kv_heads=16,
            head_dim=128,
            vocab_size=50304,
            hf_model_type="olmoe",
            qk_norm="full",
            norm_topk_prob=False,
        ),
        # Fine-grained with a shared expert: 60 routed, top-4, one shared expert of width 5632
        # (Qwen/Qwen1.5-MoE-A2.7B config: no q/k norm, norm_topk_prob false).
        ModelSpec(
            "qwen1.5-moe-a2.7b",
            num_layers=24,
            num_experts=60,
            top_k=4,
            hidden_size=2048,
            ffn_size=1408,
            num_heads=16,
            num_kv_heads=16,
            head_dim=128,
            vocab_size=151936,
            num_shared_experts=1,
            shared_ffn_size=5632,
            hf_model_type="qwen2_moe",
            norm_topk_prob=False,
        ),
        # Qwen/Qwen3-30B-A3B config.json: 48 layers, all MoE (decoder_sparse_step 1, mlp_only_layers []),
        # 128 experts of width 768, top-8 (norm_topk_prob true), no shared expert, GQA 32/4 heads of 128
        # (head_dim 128, not hidden/heads = 64); q_norm and k_norm over each head's head_dim.
        ModelSpec(
            "qwen3-30b-a3b",
            num_layers=48,
            num_experts=128,
            top_k=8,
            hidden_size=2048,
            ffn_size=768,
            num_heads=32,
            num_kv_heads=4,
            head_dim=128,
            vocab_size=151936,
            hf_model_type="qwen3_moe",
            qk_norm="head",
            norm_topk_prob=True,
        ),
        # openai/gpt-oss-120b and -20b: transformers' GptOssConfig (huggingface/transformers 02b8f42b,
        # configuration_gpt_oss.py: its defaults are the 120b's) and a copy of the 20b's config.json:
        # 36 / 24 layers, 128 / 32 experts of width 2880, top-4, hidden 2880, 64 query and 8 KV heads of
        # 64, vocab 201088, biases and sinks (openai/gpt-oss 0568dfc9 gpt_oss/torch/model.py), untied
        # embeddings, and every other layer's attention a sliding window of 128 tokens.
        # OpenAI's README: 117B (5.1B active) and 21B (3.6B active); llama.cpp prints 116.83 B and 20.91 B.
        ModelSpec(
            "gpt-oss-120b",
            num_layers=36,
            num_experts=128,
            top_k=4,
            hidden_size=2880,
            ffn_size=2880,
            num_heads=64,
            num_kv_heads=8,
            head_dim=64,
            vocab_size=201088,
            hf_model_type="gpt_oss",
            biases=True,
            sliding_window=128,
        ),
        ModelSpec(
            "gpt-oss-20b",
            num_layers=24,
            num_experts=32,
            top_k=4,
            hidden_size=2880,
            ffn_size=2880,
            num_heads=64,
            num_kv_heads=8,
            head_dim=64,
            vocab_size=201088,
            hf_model_type="gpt_oss",
            biases=True,
            sliding_window=128,
        ),
        # Qwen/Qwen3-235B-A22B config.json (huggingface.co; the same numbers in vLLM's test fixtures): 94
        # layers, 128 experts of width 1536, top-8, normalised; hidden 4096, 64 query and 4 KV heads of 128,
        # q/k RMSNorm per head; vocab 151936. Model card: 235B total, 22B activated.
        ModelSpec(
            "qwen3-235b-a22b",
            num_layers=94,
            num_experts=128,
            top_k=8,
            hidden_size=4096,
            ffn_size=1536,
            num_heads=64,
            num_kv_heads=4,
            head_dim=128,
            vocab_size=151936,
            hf_model_type="qwen3_moe",
            qk_norm="head",
            norm_topk_prob=True,
        ),
        # meta-llama/Llama-4-Maverick-17B-128E-Instruct config.json, text_config (huggingface.co; the same
        # numbers in transformers' and vLLM's llama4 tests): 48 layers, experts in every second one
        # (interleave_moe_layer_step 2: layers 1, 3, ..., 47), 128 routed experts of width 8192, top-1,
        # and 1 shared expert of that width; the other 24 layers a dense MLP of width 16384
        # (intermediate_size_mlp); hidden 5120, 40 query and 8 KV heads of 128; vocab 202048, embeddings
        # not tied. Its router weighs the one expert by a sigmoid, not a renormalised softmax. Not
        # modelled: the chunked attention (8192-token chunks) of its RoPE layers (3 of 4): costed as full
        # attention, which is the same below 8k tokens; the q/k L2 norm (no weights); the vision encoder.
        # Meta's model card: 400B total, 17B active.
        ModelSpec(
            "llama-4-maverick",
            num_layers=48,
            num_experts=128,
            top_k=1,
            hidden_size=5120,
            ffn_size=8192,
            num_heads=40,
            num_kv_heads=8,
            head_dim=128,
            vocab_size=202048,
            num_shared_experts=1,
            shared_ffn_size=8192,
            dense_ffn_size=16384,
            moe_layer_step=2,
            hf_model_type="llama4_text",
            norm_topk_prob=False,
        ),
        # zai-org/GLM-4.5 config.json (huggingface.co; the same numbers in transformers' and vLLM's
        # glm4_moe tests): 92 layers, the first 3 dense (first_k_dense_replace, intermediate 12288), then
        # 160 routed experts of width 1536, top-8, normalised, and 1 shared expert of that width; hidden
        # 5120, 96 query and 8 KV heads of 128, q/k norm per head; vocab 151552, embeddings not tied. The
        # multi-token-prediction layer (num_nextn_predict_layers 1) serves speculative decoding only and
        # is left out, as DeepSeek-V3's is. GLM-4.5 report: 355B total, 32B activated.
        ModelSpec(
            "glm-4.5",
            num_layers=92,
            num_experts=160,
            top_k=8,
            hidden_size=5120,
            ffn_size=1536,
            num_heads=96,
            num_kv_heads=8,
            head_dim=128,
            vocab_size=151552,
            num_shared_experts=1,
            shared_ffn_size=1536,
            first_dense_layers=3,
            dense_ffn_size=12288,
            hf_model_type="glm4_moe",
            qk_norm="head",
            norm_topk_prob=True,
        ),
        # deepseek-ai/DeepSeek-V2-Lite config.json (and DeepSeek's 16B inference config): 27 layers, the
        # first dense (first_k_dense_replace 1, intermediate 10944), then 64 routed experts of width
        # 1408, top-6, 2 shared; MLA with kv_lora_rank 512, no query compression, rope 64 / nope 128 /
        # v 128, 16 heads; vocab 102400.
        ModelSpec(
            "deepseek-v2-lite",
            num_layers=27,
            num_experts=64,
            top_k=6,
            hidden_size=2048,
            ffn_size=1408,
            num_heads=16,
            num_kv_heads=16,
            head_dim=192,
            vocab_size=102400,
            num_shared_experts=2,
            shared_ffn_size=1408,
            first_dense_layers=1,
            dense_ffn_size=10944,
            kv_lora_rank=512,
            qk_rope_dim=64,
            qk_nope_dim=128,
            v_head_dim=128,
            hf_model_type="deepseek_v2",
            norm_topk_prob=False,  # (the config's: its top-6 weights are not renormalised)
        ),
        # deepseek-ai/DeepSeek-V3 config.json: 61 layers (the MTP layer is not counted), the first 3
        # dense (intermediate 18432), then 256 routed experts of width 2048, top-8, 1 shared; MLA with
        # kv_lora_rank 512, q_lora_rank 1536, rope 64 / nope 128 / v 128, 128 heads; vocab 129280.
        # Weights in bf16 (the config's torch_dtype; the released checkpoint is FP8 with block scales).
        ModelSpec(
            "deepseek-v3",
            num_layers=61,
            num_experts=256,
            top_k=8,
            hidden_size=7168,
            ffn_size=2048,
            num_heads=128,
            num_kv_heads=128,
            head_dim=192,
            vocab_size=129280,
            num_shared_experts=1,
            shared_ffn_size=2048,
            first_dense_layers=3,
            dense_ffn_size=18432,
            kv_lora_rank=512,
            q_lora_rank=1536,
            qk_rope_dim=64,
            qk_nope_dim=128,
            v_head_dim=128,
            hf_model_type="deepseek_v3",
        ),
        # A quarter-width Mixtral: big enough that transfers dominate on a CPU, small enough to run.
        ModelSpec(
            "small-mixtral",
            num_layers=4,
            num_experts=8,
            top_k=2,
            hidden_size=1024,
            ffn_size=3584,
            num_heads=16,
            num_kv_heads=4,
            head_dim=64,
            vocab_size=32000,
        ),
        # For tests and the CPU runtime: every op runs in microseconds.
        ModelSpec(
            "tiny-mixtral",
            num_layers=2,
            num_experts=4,
            top_k=2,
            hidden_size=64,
            ffn_size=128,
            num_heads=4,
            num_kv_heads=2,
            head_dim=16,
            vocab_size=256,
        ),
        # ... and its Qwen3-MoE and OLMoE twins (`klotski-runtime tiny-checkpoint --model ...` writes
        # matching checkpoints): Qwen3's head_dim is not hidden/heads, as in Qwen3-30B-A3B (128, 2048/32)
        ModelSpec(
            "tiny-qwen3-moe",
            num_layers=2,
            num_experts=8,
            top_k=2,
            hidden_size=64,
            ffn_size=32,
            num_heads=4,
            num_kv_heads=2,
            head_dim=32,
            vocab_size=256,
            hf_model_type="qwen3_moe",
            qk_norm="head",
        ),
        ModelSpec(
            "tiny-olmoe",
            num_layers=2,
            num_experts=8,
            top_k=2,
            hidden_size=64,
            ffn_size=32,
            num_heads=4,
            num_kv_heads=2,
            head_dim=16,
            vocab_size=256,
            hf_model_type="olmoe",
            qk_norm="full",
            norm_topk_prob=False,
        ),
    )
}


# bits a packed code occupies (HQQ's bit packing: uint8 for 8, two to a byte for 4, ten to an int32
# for 3, four to a byte for 2)
PACKED_BITS: dict[int, float] = {8: 8.0, 4: 4.0, 3: 3.2, 2: 2.0}


def quantised(spec: ModelSpec, text: str, where: str) -> ModelSpec:
    """`intN[:gG][:fp16|fp32]`: routed experts in N bits, groups of G weights (default 64, HQQ's
    usual), scale and zero in fp16 (default) or fp32 (Klotski's port: `int4:g16:fp32`)."""
    parts = text.split(":")
    bits = parts[0][3:] if parts[0].startswith("int") else ""
    if not bits.isdigit() or int(bits) not in PACKED_BITS:
        raise UsageError(
            f"model {where!r}: expert dtype must be int8, int4, int3 or int2 (then :gG and :fp16|fp32), "
            f"got {parts[0]!r}"
        )
    group, meta = 64, 4
    given: set[str] = set()
    for part in parts[1:]:
        setting = "the group size" if part.startswith("g") else "the dtype of scales and zeros"
        if setting in given:
            raise UsageError(f"model {where!r}: {setting} is given twice")
        given.add(setting)
        if part.startswith("g") and part[1:].isdigit():
            group = int(part[1:])
            if group < 1:
                raise UsageError(f"model {where!r}: the group size must be a positive integer, got {part!r}")
        elif part in ("fp16", "fp32"):
            meta = 4 if part == "fp16" else 8
        else:
            raise UsageError(
                f"model {where!r}: unknown quantisation setting {part!r} (gG: group size; fp16|fp32: "
                f"the dtype of scales and zeros)"
            )
    weights = spec.hidden_size * spec.ffn_size  # one expert matrix (w1, w3: f x h; w2: h x f)
    if weights % group:  # (HQQ's Quantizer.quantize asserts W.numel() % group_size == 0: a matrix is whole groups)
        raise UsageError(
            f"model {where!r}: the group size {group} does not divide an expert matrix's {weights} "
            f"weights ({spec.hidden_size} x {spec.ffn_size}); HQQ quantises whole groups"
        )
    packed = replace(spec, expert_bits=int(bits), quant_group=group, quant_meta_bytes=meta)
    if packed.expert_bytes() >= spec.expert_bytes():  # (`@int8:g1:fp32` would make experts 4.5x larger)
        raise UsageError(
            f"model {where!r}: {text} stores an expert in {packed.expert_bytes():,} bytes, no fewer "
            f"than the {spec.expert_bytes():,} of unquantised ones (a scale and a zero for every "
            f"{group} weight(s)); give a larger group size (:g64 by default)"
        )
    return packed


def preset_name(name: str) -> str:
    """The preset a model's name is a version of (`mixtral-8x7b:4@int4` -> `mixtral-8x7b`): its
    routing is the preset's."""
    return name.partition("@")[0].partition(":")[0]


def get_model(name: str) -> ModelSpec:
    """Look up a preset by name; `NAME:L` keeps only its first L layers (a big model's few layers
    are enough to validate a schedule on a real GPU) and `@intN[:gG][:fp32]` quantises its routed
    experts (`mixtral-8x7b@int4`). The error lists what exists."""
    plain, at, dtype = name.partition("@")
    if at:
        return replace(quantised(get_model(plain), dtype, name), name=name)
    base, colon, layers = name.partition(":")
    try:
        spec = _config_model(base) if is_config_path(base) else PRESETS[base]
    except KeyError:
        raise UsageError(
            f"unknown model {name!r}; known models: {', '.join(sorted(PRESETS))} (NAME:L keeps the first L layers), "
            f"or a Hugging Face config.json"
        ) from None
    if not colon:  # (`tiny-mixtral:`, a count left out, would run the whole model)
        return spec
    low = spec.first_moe_layer + 1  # (fewer layers would have no experts)
    if not (layers.isascii() and layers.isdigit()) or not low <= int(layers) <= spec.num_layers:
        why = f" (its first MoE layer is layer {low - 1})" if low > 1 else ""
        raise UsageError(f"model {name!r}: after ':' give a layer count from {low} to {spec.num_layers}{why}")
    return replace(spec, name=name, num_layers=int(layers))


def _config_model(path: str) -> ModelSpec:
    """A user's model from its Hugging Face config.json (klotski_sim/workload/hf_config.py)."""
    fields = config_fields(path)
    try:
        return ModelSpec(**fields)
    except UsageError as err:  # (the shape's own checks, said of the file)
        raise UsageError(f"{path}: {str(err).replace(f'model {path!r}: ', '', 1)}") from None
