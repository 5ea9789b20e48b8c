"""The real compute of each op kind on a Mixtral-style model, and the weights it runs on.

Every op of a schedule maps to one function here: `embed`, `attention` (input RMSNorm, q/k/v,
the q/k RMSNorm when the model has one, RoPE, per-batch KV cache, o, residual), `gate`
(post-attention RMSNorm + router: softmax, top-k, renormalised when the model's router does — or
routing forced from a trace), `expert` (SwiGLU over exactly the tokens routed to it, scaled by
their gate weights and added into the batch's MoE output) and `lm_head`. The math is Hugging
Face's, so with routing not forced the logits match `MixtralForCausalLM`, `Qwen3MoeForCausalLM`
(q/k norm per head) and `OlmoeForCausalLM` (q/k norm over the whole projection, top-k weights
not renormalised).

Weights live in a `WeightStore` (the host tier): random tensors of the model's true shapes (a few
layers of a big model are enough), or read per tensor from a local safetensors checkpoint of one
of those three families (`CHECKPOINT_FAMILIES`).
"""

from __future__ import annotations

import json
import math
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from klotski_sim.util.errors import KlotskiError
from klotski_sim.workload.model import ModelSpec


class WeightError(KlotskiError):
    """Weights that cannot be used for this model; the message says which file and tensor."""


@dataclass
class WeightStore:
    """Host-side weights keyed the way schedules name them: `("attention", L)`, `("gate", L)`,
    `("expert", L, e)`, plus the resident tensors (embeddings, norms, lm_head)."""

    spec: ModelSpec
    tensors: dict[tuple, tuple[torch.Tensor, ...]]
    resident: dict[str, torch.Tensor]
    rope_theta: float = 1e6
    rms_eps: float = 1e-5
    source: str = "random"
    num_layers: int = 0
    notes: list[str] = field(default_factory=list)
    pinned: dict[tuple, tuple[torch.Tensor, ...]] = field(default_factory=dict)

    def get(self, tensor: str, layer: int, expert: int = -1) -> tuple[torch.Tensor, ...]:
        key = (tensor, layer) if expert < 0 else (tensor, layer, expert)
        try:
            return self.tensors[key]
        except KeyError:
            raise WeightError(f"no weights for {key} (the store holds {self.num_layers} layers)") from None

    def to(self, dtype: torch.dtype) -> "WeightStore":
        conv = {k: tuple(t.to(dtype) for t in v) for k, v in self.tensors.items()}
        res = {k: v.to(dtype) for k, v in self.resident.items()}
        return WeightStore(
            self.spec, conv, res, self.rope_theta, self.rms_eps, self.source, self.num_layers, list(self.notes)
        )

    def pin(self) -> None:
        """A pinned copy of every host tensor, made once, so pinned H2D copies run at full speed and
        asynchronously; the unpinned originals stay for copies a schedule marks pageable."""
        if not self.pinned:
            self.pinned = {k: tuple(t.pin_memory() for t in v) for k, v in self.tensors.items()}

    def host(self, tensor: str, layer: int, expert: int = -1, pinned: bool = False) -> tuple[torch.Tensor, ...]:
        """The host copy a transfer reads: pinned (when `pin` made one) or the pageable original."""
        if pinned and self.pinned:
            return self.pinned[(tensor, layer) if expert < 0 else (tensor, layer, expert)]
        return self.get(tensor, layer, expert)

    @staticmethod
    def check_fits(spec: ModelSpec, layers: int, dtype: torch.dtype, where: str) -> None:
        """Refuse, before allocating, weights that host memory cannot hold (a model of 90 GB on a
        24 GB machine would otherwise allocate for minutes and die)."""
        params = (spec.layer_bytes() * layers + spec.resident_bytes()) // spec.dtype_bytes
        need = params * torch.finfo(dtype).bits // 8
        available = host_memory()
        if available and need > 0.8 * available:
            raise WeightError(
                f"{where}: {spec.name} needs {need / 2**30:.1f} GiB of host memory for its weights "
                f"({layers} layers, {dtype}), {available / 2**30:.1f} GiB are available: use fewer "
                f"layers (NAME:L) or a smaller model"
            )

    @staticmethod
    def random(
        spec: ModelSpec, layers: int | None = None, dtype: torch.dtype = torch.bfloat16, seed: int = 0
    ) -> "WeightStore":
        """Random weights of the true shapes. `layers` < spec.num_layers keeps only the first
        layers (a big model's schedule must then be built for that many layers)."""
        L = spec.num_layers if layers is None else min(layers, spec.num_layers)
        WeightStore.check_fits(spec, L, dtype, "random weights")
        g = torch.Generator().manual_seed(seed)
        h, f, qd, kvd = spec.hidden_size, spec.ffn_size, spec.q_dim, spec.kv_dim

        def w(out: int, inp: int) -> torch.Tensor:
            return (torch.randn(out, inp, generator=g) / inp**0.5).to(dtype)

        tensors: dict[tuple, tuple[torch.Tensor, ...]] = {}
        resident = {
            "embed": (torch.randn(spec.vocab_size, h, generator=g) * 0.02).to(dtype),
            "lm_head": w(spec.vocab_size, h),
            "final_norm": torch.ones(h, dtype=dtype),
        }
        for layer in range(L):
            if spec.mla:
                heads, qk = spec.num_heads, spec.qk_nope_dim + spec.qk_rope_dim
                q = (
                    (w(spec.q_lora_rank, h), w(heads * qk, spec.q_lora_rank))
                    if spec.q_lora_rank
                    else (w(heads * qk, h),)
                )
                tensors[("attention", layer)] = (
                    *q,
                    w(spec.kv_lora_rank + spec.qk_rope_dim, h),
                    w(heads * (spec.qk_nope_dim + spec.v_head_dim), spec.kv_lora_rank),
                    w(h, heads * spec.v_head_dim),
                )
            else:
                tensors[("attention", layer)] = (w(qd, h), w(kvd, h), w(kvd, h), w(h, qd))
            resident[f"norm1/{layer}"] = torch.ones(h, dtype=dtype)
            resident[f"norm2/{layer}"] = torch.ones(h, dtype=dtype)
            if spec.qk_norm:  # unit vectors, as transformers initialises them: the same work as a checkpoint
                q_width, k_width = spec.qk_norm_widths()
                resident[f"q_norm/{layer}"] = torch.ones(q_width, dtype=dtype)
                resident[f"k_norm/{layer}"] = torch.ones(k_width, dtype=dtype)
            if not spec.is_moe(layer):  # a dense layer: its MLP is the gate op, no experts
                df = spec.dense_ffn_size
                tensors[("gate", layer)] = (w(df, h), w(df, h), w(h, df))
                continue
            shared = [w(1, h)] if spec.num_shared_experts else []  # the shared experts' gate, then each expert
            for _ in range(spec.num_shared_experts):
                sf = spec.shared_ffn_size
                shared += [w(sf, h), w(sf, h), w(h, sf)]
            tensors[("gate", layer)] = (w(spec.num_experts, h), *shared)
            for e in range(spec.num_experts):
                dense = (w(f, h), w(f, h), w(h, f))  # w1, w3, w2
                tensors[("expert", layer, e)] = quantise_expert(dense, spec) if spec.quantised else dense
        notes = [] if L == spec.num_layers else [f"random weights for the first {L} of {spec.num_layers} layers"]
        return WeightStore(spec, tensors, resident, source=f"random(seed={seed})", num_layers=L, notes=notes)

    @staticmethod
    def from_checkpoint(
        path: str | Path, spec: ModelSpec, dtype: torch.dtype = torch.bfloat16, layers: int | None = None
    ) -> "WeightStore":
        """Read a local checkpoint (config.json + *.safetensors) of a Mixtral, Qwen3-MoE or OLMoE
        model tensor by tensor, after checking that its config is the spec's shape and math."""
        if spec.mla or spec.first_dense_layers or spec.moe_layer_step > 1 or spec.num_shared_experts:
            raise WeightError(
                f"model {spec.name!r}: checkpoints are read in the Mixtral, Qwen3-MoE and OLMoE "
                f"layouts; this model's MLA, dense or shared-expert weights run with random weights only"
            )
        if spec.hf_model_type not in CHECKPOINT_FAMILIES:
            raise WeightError(
                f"model {spec.name!r}: checkpoints of model_type {spec.hf_model_type!r} are not read "
                f"(only {', '.join(CHECKPOINT_FAMILIES)}); it runs with random weights only"
            )
        from safetensors import safe_open

        path = Path(path)
        if not path.is_dir():
            raise WeightError(f"{path}: no such checkpoint directory")
        config_file = path / "config.json"
        if not config_file.is_file():
            raise WeightError(f"{path}: no config.json — not a checkpoint directory")
        files = sorted(path.glob("*.safetensors"))
        if not files:
            raise WeightError(f"{path}: no *.safetensors files")
        try:
            config = json.loads(config_file.read_text())
        except (UnicodeDecodeError, json.JSONDecodeError) as err:
            raise WeightError(f"{config_file}: not valid JSON ({err})") from None
        if not isinstance(config, dict):
            raise WeightError(f"{config_file}: not a JSON object")
        theta, eps = check_config(config, spec, config_file)
        index: dict[str, Path] = {}
        for f in files:
            try:
                with safe_open(f, "pt") as st:
                    for key in st.keys():
                        index[key] = f
            except Exception as err:  # noqa: BLE001 - safetensors raises its own SafetensorError on a bad file
                raise WeightError(f"{f}: not a valid safetensors file ({err})") from None

        def load(key: str, *shape: int) -> torch.Tensor:
            """The tensor `key` in `dtype`, refused unless it has `shape` (when given)."""
            if key not in index:
                raise WeightError(f"{path}: tensor {key!r} is missing from the checkpoint")
            with safe_open(index[key], "pt") as st:
                tensor = st.get_tensor(key)
            if shape and tuple(tensor.shape) != shape:
                raise WeightError(
                    f"{index[key]}: tensor {key!r} has shape {list(tensor.shape)}, "
                    f"model {spec.name!r} needs {list(shape)}"
                )
            if not tensor.is_floating_point():  # packed codes (GPTQ, AWQ, bitsandbytes): casting would compute garbage
                raise WeightError(
                    f"{index[key]}: tensor {key!r} is {str(tensor.dtype).removeprefix('torch.')}, "
                    f"not floating point: quantised checkpoints are not read (give the bf16/fp16/fp32 "
                    f"one; the simulator's @intN presets model quantised experts)"
                )
            return tensor.to(dtype)

        h, f_, E, V = spec.hidden_size, spec.ffn_size, spec.num_experts, spec.vocab_size
        qd, kvd = spec.q_dim, spec.kv_dim
        L = spec.num_layers if layers is None else min(layers, spec.num_layers)
        tensors: dict[tuple, tuple[torch.Tensor, ...]] = {}
        resident = {
            "embed": load("model.embed_tokens.weight", V, h),
            "final_norm": load("model.norm.weight", h),
            "lm_head": load("model.embed_tokens.weight", V, h)
            if config.get("tie_word_embeddings")
            else load("lm_head.weight", V, h),
        }
        q_width, k_width = spec.qk_norm_widths()
        for layer in range(L):
            p = f"model.layers.{layer}"
            attn = f"{p}.self_attn"
            tensors[("attention", layer)] = (
                load(f"{attn}.q_proj.weight", qd, h),
                load(f"{attn}.k_proj.weight", kvd, h),
                load(f"{attn}.v_proj.weight", kvd, h),
                load(f"{attn}.o_proj.weight", h, qd),
            )
            moe = f"{p}.block_sparse_moe" if f"{p}.block_sparse_moe.gate.weight" in index else f"{p}.mlp"
            tensors[("gate", layer)] = (load(f"{moe}.gate.weight", E, h),)
            # per expert: Mixtral's w1/w3/w2, or Qwen3-MoE's and OLMoE's gate_proj/up_proj/down_proj (the
            # names transformers 5 saves); else the fused [E, 2f, h] (gate rows, then up) and [E, h, f]
            names = next(
                (
                    n
                    for n in (("w1", "w3", "w2"), ("gate_proj", "up_proj", "down_proj"))
                    if f"{moe}.experts.0.{n[0]}.weight" in index
                ),
                None,
            )
            if names:
                for e in range(E):
                    w1, w3, w2 = (f"{moe}.experts.{e}.{n}.weight" for n in names)
                    tensors[("expert", layer, e)] = (load(w1, f_, h), load(w3, f_, h), load(w2, h, f_))
            elif f"{moe}.experts.gate_up_proj" in index:
                gate_up = load(f"{moe}.experts.gate_up_proj", E, 2 * f_, h)
                down = load(f"{moe}.experts.down_proj", E, h, f_)
                for e in range(E):
                    tensors[("expert", layer, e)] = (
                        gate_up[e, :f_].contiguous(),
                        gate_up[e, f_:].contiguous(),
                        down[e].contiguous(),
                    )
            else:
                raise WeightError(
                    f"{path}: no expert weights found for layer {layer} (looked for "
                    f"{moe}.experts.0.w1, {moe}.experts.0.gate_proj and {moe}.experts.gate_up_proj)"
                )
            resident[f"norm1/{layer}"] = load(f"{p}.input_layernorm.weight", h)
            resident[f"norm2/{layer}"] = load(f"{p}.post_attention_layernorm.weight", h)
            if spec.qk_norm:
                resident[f"q_norm/{layer}"] = load(f"{attn}.q_norm.weight", q_width)
                resident[f"k_norm/{layer}"] = load(f"{attn}.k_norm.weight", k_width)
        if spec.quantised:
            tensors = {k: quantise_expert(v, spec) if k[0] == "expert" else v for k, v in tensors.items()}
        return WeightStore(
            spec, tensors, resident, rope_theta=theta, rms_eps=eps, source=f"checkpoint:{path}", num_layers=L
        )


# ---- checkpoints of the model families the kernels compute exactly as transformers does ---------------
# config.json keys per family: (routed experts' width, their count: the first key present), and the
# q/k norm and top-k renormalisation the family's modeling code applies (the config's norm_topk_prob
# when it has one; transformers' default for the family when the key is absent).
CHECKPOINT_FAMILIES: dict[str, dict[str, Any]] = {
    # MixtralSparseMoeBlock: always renormalises; no q/k norm
    "mixtral": {"ffn": "intermediate_size", "experts": ("num_local_experts",), "qk_norm": "", "norm_topk_prob": None},
    # Qwen3MoeAttention: q_norm/k_norm over head_dim; Qwen3MoeTopKRouter: renormalises when norm_topk_prob
    "qwen3_moe": {
        "ffn": "moe_intermediate_size",
        "experts": ("num_experts", "num_local_experts"),
        "qk_norm": "head",
        "norm_topk_prob": False,
    },
    # OlmoeAttention: q_norm/k_norm over the whole q and k projections; OlmoeTopKRouter as Qwen3's
    "olmoe": {
        "ffn": "intermediate_size",
        "experts": ("num_experts", "num_local_experts"),
        "qk_norm": "full",
        "norm_topk_prob": False,
    },
}


def check_config(config: dict[str, Any], spec: ModelSpec, where: Path) -> tuple[float, float]:
    """Refuse, in one line naming the keys, a checkpoint config whose shapes or math differ from the
    spec's, or that uses a feature the kernels do not compute (dense layers, clipped q/k/v, biases,
    sliding windows); returns the RoPE base and the RMSNorm epsilon it read."""
    family = CHECKPOINT_FAMILIES[spec.hf_model_type]
    for key in (
        "hidden_size",
        "intermediate_size",
        "moe_intermediate_size",
        "num_local_experts",
        "num_experts",
        "num_experts_per_tok",
        "num_attention_heads",
        "num_key_value_heads",
        "head_dim",
        "vocab_size",
        "num_hidden_layers",
        "decoder_sparse_step",
    ):
        value = config.get(key)
        if value is not None and (not isinstance(value, int) or isinstance(value, bool)):
            raise WeightError(f"{where}: {key} must be an integer, got {value!r}")
    for key in ("norm_topk_prob", "tie_word_embeddings", "attention_bias", "use_sliding_window"):
        if key in config and not isinstance(config[key], bool):
            raise WeightError(f"{where}: {key} must be true or false, got {config[key]!r}")
    mlp_only = config.get("mlp_only_layers") or []
    if not isinstance(mlp_only, list) or not all(isinstance(j, int) and not isinstance(j, bool) for j in mlp_only):
        raise WeightError(f"{where}: mlp_only_layers must be a list of layer numbers, got {mlp_only!r}")
    theta = rope_theta(config, where)  # (a bad value is one line here, before any tensor is read)
    eps = _config_number(config, "rms_norm_eps", 1e-5, where)
    if eps <= 0:
        raise WeightError(f"{where}: rms_norm_eps must be > 0, got {config['rms_norm_eps']!r}")
    model_type = config.get("model_type", spec.hf_model_type)
    if model_type != spec.hf_model_type:
        raise WeightError(
            f"{where}: checkpoint does not match model {spec.name!r}: model_type={model_type!r} "
            f"(model {spec.name!r} has {spec.hf_model_type!r})"
        )
    heads = config.get("num_attention_heads")
    # transformers' attention: the config's head_dim, else hidden_size // num_attention_heads
    derived = config.get("hidden_size", 0) // heads if isinstance(heads, int) and heads > 0 else None
    head_dim = config.get("head_dim") or derived
    kv_heads = config.get("num_key_value_heads")
    if spec.hf_model_type == "olmoe" and kv_heads is None:  # OlmoeConfig: None means one per query head
        kv_heads = heads
    experts_key = next((k for k in family["experts"] if k in config), family["experts"][0])
    checks: dict[str, tuple[object, object]]  # a key -> (the config's value, the model's)
    checks = {
        "hidden_size": (config.get("hidden_size"), spec.hidden_size),
        family["ffn"]: (config.get(family["ffn"]), spec.ffn_size),
        experts_key: (config.get(experts_key), spec.num_experts),
        "num_experts_per_tok": (config.get("num_experts_per_tok"), spec.top_k),
        "num_attention_heads": (heads, spec.num_heads),
        "num_key_value_heads": (kv_heads, spec.num_kv_heads),
        "head_dim": (head_dim, spec.head_dim),
        "vocab_size": (config.get("vocab_size"), spec.vocab_size),
    }
    if config.get("num_hidden_layers", spec.num_layers) < spec.num_layers:  # (a `model:L` spec reads the first L)
        checks["num_hidden_layers"] = (config["num_hidden_layers"], spec.num_layers)
    renorm = config.get("norm_topk_prob", family["norm_topk_prob"])
    if renorm is not None:
        checks["norm_topk_prob"] = (renorm, spec.norm_topk_prob)
    elif not spec.norm_topk_prob:  # Mixtral's router always renormalises
        checks["norm_topk_prob"] = ("absent: always renormalised", spec.norm_topk_prob)
    if spec.qk_norm != family["qk_norm"]:
        checks["q/k norm"] = (family["qk_norm"] or "none", spec.qk_norm or "none")
    bad = [f"{k}={got} (model {spec.name!r} has {want})" for k, (got, want) in checks.items() if got != want]
    if bad:
        raise WeightError(f"{where}: checkpoint does not match model {spec.name!r}: {'; '.join(bad)}")
    unsupported = []
    if config.get("attention_bias"):
        unsupported.append("attention_bias=true (q/k/v/o biases)")
    if config.get("clip_qkv") is not None:  # OlmoeAttention clamps q, k and v to +-clip_qkv
        unsupported.append(f"clip_qkv={config['clip_qkv']} (q/k/v clipping)")
    if config.get("use_sliding_window") or (spec.hf_model_type == "mixtral" and config.get("sliding_window")):
        # (Qwen's configs switch it on with use_sliding_window; Mixtral's apply any sliding_window set)
        unsupported.append(f"sliding_window={config.get('sliding_window')} (sliding-window attention)")
    if config.get("hidden_act", "silu") != "silu":  # the experts' SwiGLU is SiLU-gated
        unsupported.append(f"hidden_act={config['hidden_act']!r} (the kernels compute silu)")
    rope = config.get("rope_parameters") or config.get("rope_scaling") or {}
    if rope.get("rope_type", rope.get("type", "default")) != "default":
        unsupported.append(f"rope_type={rope.get('rope_type', rope.get('type'))!r} (the kernels compute plain RoPE)")
    if spec.hf_model_type == "qwen3_moe":  # Qwen3MoeDecoderLayer: dense unless sparse-step and not mlp-only
        step = config.get("decoder_sparse_step", 1)
        layers = config.get("num_hidden_layers", spec.num_layers)
        dense = [j for j in range(layers) if j in mlp_only or not step or (j + 1) % step]
        if dense:
            unsupported.append(
                f"decoder_sparse_step={step}, mlp_only_layers={mlp_only} make layers {dense} dense "
                f"(every layer must be MoE)"
            )
    if unsupported:
        raise WeightError(f"{where}: checkpoint uses what the runtime does not compute: {'; '.join(unsupported)}")
    return theta, eps


def _config_number(config: dict[str, Any], key: str, default: float, where: Path) -> float:
    value = config.get(key, default)
    if value is None:
        value = default
    if not isinstance(value, (int, float)) or isinstance(value, bool) or not math.isfinite(value):
        raise WeightError(f"{where}: {key} must be a finite number, got {value!r}")  # (a NaN base: any routing)
    return float(value)


def rope_theta(config: dict[str, Any], where: Path) -> float:
    """RoPE's base: transformers 5's `rope_parameters.rope_theta`, else the older `rope_theta`."""
    params = config.get("rope_parameters")
    if params is not None and not isinstance(params, dict):
        raise WeightError(f"{where}: rope_parameters must be a JSON object, got {params!r}")
    scaling = config.get("rope_scaling")
    if scaling is not None and not isinstance(scaling, dict):
        raise WeightError(f"{where}: rope_scaling must be a JSON object, got {scaling!r}")
    if params and params.get("rope_theta") is not None:
        theta = _config_number(params, "rope_theta", 1e6, where)
    else:
        theta = _config_number(config, "rope_theta", 1e6, where)
    if theta <= 0:
        raise WeightError(f"{where}: rope_theta must be > 0, got {theta!r}")
    return theta


def qk_norms(
    resident: dict[str, torch.Tensor], spec: ModelSpec, layer: int
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """The resident (q_norm, k_norm) of `layer` that attention applies, None when the model has none."""
    if not spec.qk_norm:
        return None
    return resident[f"q_norm/{layer}"], resident[f"k_norm/{layer}"]


def host_memory(field: str = "MemAvailable") -> int:
    """A /proc/meminfo field in bytes (`MemAvailable`, `MemTotal`); 0 when unknown."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith(f"{field}:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError):
        pass
    return 0


# ---- kernels --------------------------------------------------------------------------------------
def upload(data: np.ndarray | torch.Tensor, device: torch.device | str) -> torch.Tensor:
    """Host data (token ids, routed rows) onto `device` without blocking the issuing thread. A copy
    from pageable memory, `.to("cuda")`, is ATen's memcpy_and_sync: cudaMemcpyAsync then
    cudaStreamSynchronize, a host sync the schedule does not have, which stalls every stream's
    issuing until the compute stream drains. A copy from pinned memory is asynchronous, and the
    caching host allocator keeps the pinned block until the copy has read it."""
    tensor = torch.from_numpy(data) if isinstance(data, np.ndarray) else data
    if torch.device(device).type != "cuda" or tensor.is_cuda:
        return tensor.to(device)
    return tensor.pin_memory().to(device, non_blocking=True)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    dtype = x.dtype
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x32.to(dtype)


def rope(x: torch.Tensor, positions: torch.Tensor, theta: float) -> torch.Tensor:
    """Rotary embedding, Hugging Face convention (rotate_half). x: [B, heads, T, hd]."""
    hd = x.shape[-1]
    inv_freq = 1.0 / (theta ** (torch.arange(0, hd, 2, dtype=torch.float32, device=x.device) / hd))
    freqs = positions.float()[:, None] * inv_freq[None, :]
    emb = torch.cat((freqs, freqs), dim=-1)
    cos, sin = emb.cos().to(x.dtype), emb.sin().to(x.dtype)
    x1, x2 = x[..., : hd // 2], x[..., hd // 2 :]
    return x * cos + torch.cat((-x2, x1), dim=-1) * sin


def embed(tokens: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
    return F.embedding(tokens, table)


def repeat_kv(x: torch.Tensor, n_rep: int) -> torch.Tensor:
    """[B, kv_heads, T, hd] -> [B, kv_heads * n_rep, T, hd], materialised (transformers' repeat_kv)."""
    if n_rep == 1:
        return x
    B, KVH, T, hd = x.shape
    return x[:, :, None, :, :].expand(B, KVH, n_rep, T, hd).reshape(B, KVH * n_rep, T, hd)


ATTENTION_IMPLS = ("fused", "eager")


def attention(
    x: torch.Tensor,
    weights: tuple[torch.Tensor, ...],
    norm: torch.Tensor,
    past: list[tuple],
    pos0: int,
    spec: ModelSpec,
    theta: float,
    eps: float,
    impl: str = "fused",
    qk_norm: tuple[torch.Tensor, torch.Tensor] | None = None,
    residual: bool = True,
) -> tuple[torch.Tensor, tuple]:
    """x: [B, T, h] -> x + attn(norm(x)) (without x when not `residual`: a tensor-parallel rank's
    partial sum), and this step's (k, v) chunk `[B, kv_heads, T, hd]`.
    `past` lists earlier chunks of this batch's KV cache, oldest first. `impl`: `fused` is one
    scaled_dot_product_attention reading the KV heads as they are (GQA); `eager` is transformers'
    eager path: repeat_kv copies, QK^T * scale, causal mask, fp32 softmax, AV, transpose back.
    `qk_norm`: the layer's (q_norm, k_norm) when `spec.qk_norm` says the model has them (see
    `attention_qkv`)."""
    if spec.mla:
        return mla_attention(x, weights, norm, past, pos0, spec, theta, eps)
    wo = weights[3]
    B, T, _ = x.shape
    H, KVH, hd = spec.num_heads, spec.num_kv_heads, spec.head_dim
    q, k, v = attention_qkv(x, weights, norm, pos0, spec, theta, eps, qk_norm)
    keys = torch.cat([c[0] for c in past] + [k], dim=2) if past else k
    values = torch.cat([c[1] for c in past] + [v], dim=2) if past else v
    causal = T > 1 and not past
    if impl == "fused":
        out = F.scaled_dot_product_attention(q, keys, values, is_causal=causal, enable_gqa=H != KVH)
    elif impl == "eager":
        keys, values = repeat_kv(keys, H // KVH), repeat_kv(values, H // KVH)
        scores = torch.matmul(q, keys.transpose(2, 3)) * hd**-0.5
        if causal:
            mask = torch.ones(T, T, dtype=torch.bool, device=x.device).tril()
            scores = scores.masked_fill(~mask, torch.finfo(scores.dtype).min)
        probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
        out = torch.matmul(probs, values)
    else:
        raise ValueError(f"attention impl must be one of {ATTENTION_IMPLS}, got {impl!r}")
    out = out.transpose(1, 2).reshape(B, T, H * hd)
    projected = F.linear(out, wo)
    return (x + projected if residual else projected), (k, v)


def kv_chunk(
    spec: ModelSpec,
    batch: int,
    tokens: int,
    dtype: torch.dtype,
    device: Any = "cpu",
    generator: torch.Generator | None = None,
) -> tuple:
    """A random KV-cache chunk of `tokens` tokens in the layout attention stores: (k, v) per KV head,
    or MLA's (latent, shared RoPE key) — `spec.kv_bytes_per_token()` bytes a token either way."""
    if spec.mla:
        shapes = [(batch, 1, tokens, spec.kv_lora_rank), (batch, 1, tokens, spec.qk_rope_dim)]
    else:
        shapes = [(batch, spec.num_kv_heads, tokens, spec.head_dim)] * 2
    return tuple(torch.randn(*s, generator=generator, dtype=dtype, device=device) for s in shapes)


def mla_attention(
    x: torch.Tensor,
    weights: tuple[torch.Tensor, ...],
    norm: torch.Tensor,
    past: list[tuple],
    pos0: int,
    spec: ModelSpec,
    theta: float,
    eps: float,
) -> tuple[torch.Tensor, tuple]:
    """DeepSeek's multi-head latent attention, the cache holding the normalised latent and the
    shared RoPE key (what `spec.kv_bytes_per_token` counts); keys and values are re-expanded from
    the latent each step (the non-absorbed form). Weights: (wq) or (wq_a, wq_b), wkv_a, wkv_b, wo;
    the q and kv RMSNorms are unit vectors here (random weights)."""
    B, T, _ = x.shape
    H, nope, rope_d, vd, r = spec.num_heads, spec.qk_nope_dim, spec.qk_rope_dim, spec.v_head_dim, spec.kv_lora_rank
    *wq, wkv_a, wkv_b, wo = weights
    hs = rms_norm(x, norm, eps)
    q = (
        F.linear(
            rms_norm(F.linear(hs, wq[0]), torch.ones(wq[0].shape[0], dtype=hs.dtype, device=hs.device), eps), wq[1]
        )
        if len(wq) == 2
        else F.linear(hs, wq[0])
    )
    q = q.view(B, T, H, nope + rope_d).transpose(1, 2)
    kv = F.linear(hs, wkv_a)
    latent = rms_norm(kv[..., :r], torch.ones(r, dtype=hs.dtype, device=hs.device), eps).unsqueeze(1)  # [B,1,T,r]
    positions = torch.arange(pos0, pos0 + T, device=x.device)
    k_pe = rope(kv[..., r:].unsqueeze(1), positions, theta)  # [B,1,T,rope]
    q = torch.cat([q[..., :nope], rope(q[..., nope:], positions, theta)], dim=-1)
    latents = torch.cat([c[0] for c in past] + [latent], dim=2)
    k_pes = torch.cat([c[1] for c in past] + [k_pe], dim=2)
    total = latents.shape[2]
    expanded = F.linear(latents.squeeze(1), wkv_b).view(B, total, H, nope + vd).transpose(1, 2)
    keys = torch.cat([expanded[..., :nope], k_pes.expand(B, H, total, rope_d)], dim=-1)
    out = F.scaled_dot_product_attention(q, keys, expanded[..., nope:], is_causal=T > 1 and not past)
    return x + F.linear(out.transpose(1, 2).reshape(B, T, H * vd), wo), (latent, k_pe)


# ---- attention split between GPU and CPU (option attention_device=cpu) -----------------------------
def attention_qkv(
    x: torch.Tensor,
    weights: tuple[torch.Tensor, ...],
    norm: torch.Tensor,
    pos0: int,
    spec: ModelSpec,
    theta: float,
    eps: float,
    qk_norm: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The GPU half before: input RMSNorm, q/k/v, the q/k RMSNorm, RoPE — `attention` up to its
    scores. The q/k norm goes between the projections and RoPE, in the model's dtype like every
    RMSNorm here: over each head's head_dim (`spec.qk_norm == "head"`, transformers
    Qwen3MoeAttention: q_norm/k_norm on the [.., heads, head_dim] view) or over the whole q and k
    projections before the split into heads (`"full"`, transformers OlmoeAttention). Without
    `qk_norm` given, a model that has one is normalised with unit weights (what random weights
    hold), so a timing of this kernel does the same work."""
    wq, wk, wv, _ = weights
    B, T, _ = x.shape
    hs = rms_norm(x, norm, eps)
    q, k = F.linear(hs, wq), F.linear(hs, wk)
    if spec.qk_norm:
        q_norm, k_norm = (
            qk_norm
            if qk_norm is not None
            else (torch.ones(w, dtype=hs.dtype, device=hs.device) for w in spec.qk_norm_widths())
        )
        if spec.qk_norm == "full":
            q, k = rms_norm(q, q_norm, eps), rms_norm(k, k_norm, eps)
    q = q.view(B, T, spec.num_heads, spec.head_dim)
    k = k.view(B, T, spec.num_kv_heads, spec.head_dim)
    if spec.qk_norm == "head":
        q, k = rms_norm(q, q_norm, eps), rms_norm(k, k_norm, eps)
    v = F.linear(hs, wv).view(B, T, spec.num_kv_heads, spec.head_dim).transpose(1, 2)
    positions = torch.arange(pos0, pos0 + T, device=x.device)
    return rope(q.transpose(1, 2), positions, theta), rope(k.transpose(1, 2), positions, theta), v


def attention_core(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, past: list[tuple], spec: ModelSpec
) -> torch.Tensor:
    """The CPU half: a decode step's attention over the cache (`past` chunks, then this step's k, v)."""
    keys = torch.cat([c[0] for c in past] + [k], dim=2)
    values = torch.cat([c[1] for c in past] + [v], dim=2)
    out = F.scaled_dot_product_attention(q, keys, values, enable_gqa=spec.num_heads != spec.num_kv_heads)
    B, _, T, _ = q.shape
    return out.transpose(1, 2).reshape(B, T, spec.num_heads * spec.head_dim)


def router(
    z: torch.Tensor, weight: torch.Tensor, top_k: int, renormalise: bool = True
) -> tuple[torch.Tensor, torch.Tensor]:
    """The router on `[tokens, h]`: fp32 softmax over experts, top-k, then the k weights
    renormalised to sum to 1 (Mixtral; Qwen3-MoE's `norm_topk_prob`) or left as the softmax's
    probabilities (`renormalise=False`: OLMoE, Qwen1.5-MoE)."""
    logits = F.linear(z, weight)
    probs = torch.softmax(logits.float(), dim=-1)
    w, ids = torch.topk(probs, top_k, dim=-1)
    return (w / w.sum(dim=-1, keepdim=True) if renormalise else w), ids


def forced_weights(z: torch.Tensor, weight: torch.Tensor, ids: torch.Tensor, renormalise: bool = True) -> torch.Tensor:
    """Gate weights for experts chosen elsewhere (a trace), as the router would weight them: the
    softmax restricted to them (renormalised), or the full softmax's probabilities of them
    (`renormalise=False`), so the combine stays realistic."""
    logits = F.linear(z, weight).float()
    if not renormalise:
        return torch.gather(torch.softmax(logits, dim=-1), -1, ids)
    chosen = torch.gather(logits, -1, ids)
    return torch.softmax(chosen, dim=-1)


# ---- quantised experts (the model's `@intN[:gG][:fp32]`) -----------------------------------------
# Group-wise min-max affine quantisation as HQQ's `quantize` without its proximal refinement
# (the bytes and the dequantisation are HQQ's; the rounding error is not what we measure), packed
# as HQQ packs: uint8 for 8 bits, two codes a byte for 4, four for 2, ten to an int32 for 3.
def _pack(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """Flat uint8 codes (< 2**bits) -> packed tensor."""
    if bits == 8:
        return codes
    if bits in (4, 2):
        per = 8 // bits
        rows = codes.reshape(per, -1).to(torch.uint8)
        out = torch.zeros(rows.shape[1], dtype=torch.uint8)
        for k in range(per):
            out |= rows[k] << (bits * (per - 1 - k))
        return out
    pad = (-codes.numel()) % 10  # 3 bits: ten codes to an int32
    rows = torch.cat([codes.to(torch.int32), torch.zeros(pad, dtype=torch.int32)]).reshape(10, -1)
    out = torch.zeros(rows.shape[1], dtype=torch.int32)
    for k in range(10):
        out |= rows[k] << (3 * (9 - k))
    return out


def _unpack(packed: torch.Tensor, bits: int, count: int) -> torch.Tensor:
    """Packed tensor -> the first `count` codes, as float32."""
    if bits == 8:
        return packed[:count].float()
    if bits in (4, 2):
        per, mask = 8 // bits, (1 << bits) - 1
        parts = [(packed >> (bits * (per - 1 - k))) & mask for k in range(per)]
        return torch.cat(parts)[:count].float()
    parts = [(packed >> (3 * (9 - k))) & 7 for k in range(10)]
    return torch.cat(parts)[:count].float()


def quantise_expert(weights: tuple[torch.Tensor, ...], spec: ModelSpec) -> tuple[torch.Tensor, ...]:
    """(w1, w3, w2) -> per matrix (codes, scale, zero): what a quantised expert stores and moves."""
    bits, group = spec.expert_bits, spec.quant_group
    meta = torch.float32 if spec.quant_meta_bytes == 8 else torch.float16
    out: list[torch.Tensor] = []
    for w in weights:
        flat = w.float().reshape(-1)
        pad = (-flat.numel()) % group
        groups = torch.cat([flat, flat[-1:].expand(pad)]).reshape(-1, group)
        low, high = groups.min(dim=1).values, groups.max(dim=1).values
        scale = ((high - low) / ((1 << bits) - 1)).clamp(min=1e-8)
        codes = torch.round((groups - low[:, None]) / scale[:, None]).clamp(0, (1 << bits) - 1)
        out += [_pack(codes.reshape(-1)[: flat.numel()].to(torch.uint8), bits), scale.to(meta), low.to(meta)]
    return tuple(out)


def dequantise_expert(
    packed: tuple[torch.Tensor, ...], spec: ModelSpec, dtype: torch.dtype
) -> tuple[torch.Tensor, ...]:
    """HQQ's dequantize on whatever device the packed tensors are: unpack, codes * scale + zero
    (the group's minimum), reshape, cast — (w1, w3, w2) in the model dtype."""
    h, f, group = spec.hidden_size, spec.ffn_size, spec.quant_group
    out = []
    for (codes, scale, low), shape in zip(zip(packed[0::3], packed[1::3], packed[2::3]), ((f, h), (f, h), (h, f))):
        count = shape[0] * shape[1]
        values = _unpack(codes, spec.expert_bits, count)
        pad = (-count) % group
        values = torch.cat([values, values.new_zeros(pad)]).reshape(-1, group)
        w = values * scale.float()[:, None] + low.float()[:, None]
        out.append(w.reshape(-1)[:count].reshape(shape).to(dtype))
    return tuple(out)


def expert(x: torch.Tensor, weights: tuple[torch.Tensor, ...]) -> torch.Tensor:
    """SwiGLU: w2(silu(w1 x) * w3 x)."""
    w1, w3, w2 = weights
    return F.linear(F.silu(F.linear(x, w1)) * F.linear(x, w3), w2)


def lm_head(x: torch.Tensor, norm: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return F.linear(rms_norm(x, norm, eps), weight).float()


# ---- whole ops, exactly as the executor runs them (calibration times these same functions) -----
def gate_step(
    h: torch.Tensor,
    norm: torch.Tensor,
    router_weight: torch.Tensor,
    top_k: int,
    eps: float,
    forced_ids: "np.ndarray | None" = None,
    shared: tuple[torch.Tensor, ...] = (),
    renormalise: bool = True,
):
    """Post-attention RMSNorm + routing of `h` ([B, T, h]): returns the expert input `[tokens, h]`,
    the gate weights and expert ids `[tokens, k]`, and the MoE output to accumulate into — zeros,
    or the always-active shared experts' output (`shared`: their gate vector, then (w1, w3, w2) per
    shared expert; Qwen-MoE's sigmoid-gated shared expert), which the gate op computes.
    `renormalise`: the model's `norm_topk_prob` (see `router`)."""
    z = rms_norm(h, norm, eps).reshape(-1, h.shape[-1])
    if forced_ids is not None:
        ids = upload(forced_ids, z.device)
        weights = forced_weights(z, router_weight, ids, renormalise)
    else:
        weights, ids = router(z, router_weight, top_k, renormalise)
    return z, weights, ids, shared_experts(z, shared)


def shared_experts(z: torch.Tensor, shared: tuple[torch.Tensor, ...]) -> torch.Tensor:
    """The always-active shared experts' output on `[tokens, h]` (zeros without them): `shared` is
    their gate vector, then (w1, w3, w2) per shared expert (Qwen-MoE's sigmoid-gated shared expert)."""
    out = torch.zeros_like(z)
    if shared:
        scale = torch.sigmoid(F.linear(z, shared[0]))
        for k in range(1, len(shared), 3):
            out = out + expert(z, shared[k : k + 3]) * scale
    return out


def expert_step(
    z: torch.Tensor,
    weights: torch.Tensor,
    rows: torch.Tensor,
    slots: torch.Tensor,
    expert_weights: tuple[torch.Tensor, ...],
    out: torch.Tensor,
    guard: AbstractContextManager[Any] = nullcontext(),
) -> None:
    """One expert over the rows routed to it, scaled by their gate weights, added into `out` while
    holding `guard` (the executor's lock: other threads add into the same output)."""
    y = expert(z[rows], expert_weights) * weights[rows, slots, None].to(z.dtype)
    with guard:
        out.index_add_(0, rows, y)
