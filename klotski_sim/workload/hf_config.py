"""A model's shape from a Hugging Face `config.json`, so that a user's own MoE model is simulated from the
file its checkpoint ships with (`--model path/to/config.json`) instead of a preset.

The keys read per `model_type` are those of transformers' configuration classes (MixtralConfig,
Qwen2MoeConfig, Qwen3MoeConfig, OlmoeConfig, DeepseekV2Config, DeepseekV3Config, Llama4TextConfig,
whose multimodal Llama4Config nests it as `text_config`); each built-in preset cites the config it
mirrors, and `tests/test_hf_config.py` checks that those configs give the presets back. Dense layers
between MoE ones are modelled where they recur every k-th layer (Qwen's decoder_sparse_step, Llama
4's interleave_moe_layer_step: `ModelSpec.moe_layer_step`). What the simulator does not model
(sliding-window attention, other patterns of dense layers, other model types) is refused in one line
naming the key. Llama 4's chunked attention is costed as full attention (the same below its chunk)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from klotski_sim.files.textfile import DuplicateKeyError, read_text, unique_json_keys
from klotski_sim.util.errors import UsageError

MAX_CONFIG_BYTES = 1 << 20  # a config.json is a few kB; a larger file is not one

# model_type -> (the routed experts' count key, their width key, q/k norm, norm_topk_prob when absent)
FAMILIES: dict[str, tuple[str, str, str, bool]] = {
    "mixtral": ("num_local_experts", "intermediate_size", "", True),  # MixtralSparseMoeBlock renormalises
    "qwen2_moe": ("num_experts", "moe_intermediate_size", "", False),
    "qwen3_moe": ("num_experts", "moe_intermediate_size", "head", False),
    "olmoe": ("num_experts", "intermediate_size", "full", False),
    "deepseek_v2": ("n_routed_experts", "moe_intermediate_size", "", False),
    "deepseek_v3": ("n_routed_experts", "moe_intermediate_size", "", True),
    "llama4_text": ("num_local_experts", "intermediate_size", "", False),  # (top-1, weighed by a sigmoid)
}
DTYPE_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4}


def is_config_path(name: str) -> bool:
    """Whether a `--model` value names a config file rather than a preset."""
    return name.endswith(".json")


def config_fields(path: str) -> dict[str, Any]:
    """ModelSpec's fields from the Hugging Face config at `path`; a UsageError naming the file and
    key for anything unreadable, missing, of the wrong type or not modelled."""
    text = read_text(Path(path), "model config", UsageError, MAX_CONFIG_BYTES)
    try:
        config = json.loads(text, object_pairs_hook=unique_json_keys)
    except DuplicateKeyError as err:
        raise UsageError(f"{path}: {err} (JSON would keep the last)") from None
    except json.JSONDecodeError as err:
        raise UsageError(f"{path}: not a JSON config ({err})") from None
    except RecursionError:
        raise UsageError(f"{path}: not a JSON config (nested too deeply)") from None
    except ValueError as err:  # (an integer of thousands of digits: Python's int conversion limit)
        raise UsageError(f"{path}: not a JSON config ({err})") from None
    if not isinstance(config, dict):
        raise UsageError(f"{path}: not a JSON object (a Hugging Face config.json is one)")
    return _fields(config, path)


def _fields(config: dict[str, Any], path: str) -> dict[str, Any]:
    if config.get("model_type") == "llama4":  # (the multimodal config: the language model's is nested)
        text = config.get("text_config")
        if not isinstance(text, dict):
            raise UsageError(
                f"{path}: text_config must be an object (a llama4 config holds the language model's there)"
            )
        dtype = config.get("torch_dtype")
        config = {**({"torch_dtype": dtype} if dtype is not None else {}), **text, "model_type": "llama4_text"}
    model_type = config.get("model_type")
    if not isinstance(model_type, str) or model_type not in FAMILIES:
        raise UsageError(
            f"{path}: model_type {model_type!r} is not a MoE family klotski models; known: {', '.join(FAMILIES)}"
        )
    experts_key, width_key, qk_norm, renormalises = FAMILIES[model_type]

    def count(key: str, default: int | None = None, low: int = 1) -> int:
        value = config.get(key, default)
        if value is None:
            raise UsageError(f"{path}: {key} is missing ({model_type} configs have it)")
        if not isinstance(value, int) or isinstance(value, bool) or not low <= value <= 1 << 24:
            raise UsageError(f"{path}: {key} must be an integer from {low} to {1 << 24}, got {value!r}")
        return value

    def flag(key: str, default: bool) -> bool:
        value = config.get(key, default)
        if not isinstance(value, bool):
            raise UsageError(f"{path}: {key} must be true or false, got {value!r}")
        return value

    if flag("use_sliding_window", False):
        raise UsageError(f"{path}: use_sliding_window is true; klotski models full attention only")
    if model_type in ("qwen2_moe", "qwen3_moe") and config.get("mlp_only_layers"):
        raise UsageError(
            f"{path}: mlp_only_layers is set: dense layers at chosen places are not modelled (DeepSeek's first "
            f"layers and every decoder_sparse_step-th are)"
        )
    dtype = config.get("torch_dtype", config.get("dtype", "bfloat16"))
    if not isinstance(dtype, str) or dtype not in DTYPE_BYTES:
        raise UsageError(f"{path}: torch_dtype {dtype!r}: give one of {', '.join(DTYPE_BYTES)}")
    heads, hidden = count("num_attention_heads"), count("hidden_size")
    if "head_dim" not in config and hidden % heads:  # (transformers would floor it and fail in its reshape)
        raise UsageError(
            f"{path}: hidden_size {hidden} is not a multiple of num_attention_heads {heads}, and no head_dim is given"
        )
    fields: dict[str, Any] = dict(
        name=path,
        num_layers=count("num_hidden_layers"),
        num_experts=count(experts_key),
        top_k=count("num_experts_per_tok"),
        hidden_size=hidden,
        ffn_size=count(width_key),
        num_heads=heads,
        num_kv_heads=count("num_key_value_heads", heads),
        head_dim=count("head_dim", hidden // heads),
        vocab_size=count("vocab_size"),
        dtype_bytes=DTYPE_BYTES[dtype],
        hf_model_type=model_type,
        qk_norm=qk_norm,
        norm_topk_prob=flag("norm_topk_prob", renormalises),
    )
    if model_type == "qwen2_moe" and count("shared_expert_intermediate_size", 0, low=0):
        fields.update(num_shared_experts=1, shared_ffn_size=count("shared_expert_intermediate_size"))
    if model_type in ("qwen2_moe", "qwen3_moe") and count("decoder_sparse_step", 1) > 1:
        fields.update(moe_layer_step=count("decoder_sparse_step"), dense_ffn_size=count("intermediate_size"))
    if model_type == "llama4_text":
        step, layers = count("interleave_moe_layer_step", 1), fields["num_layers"]
        listed = config.get("moe_layers")
        whole = isinstance(listed, list) and all(type(v) is int for v in listed)  # (JSON's true == 1 in Python)
        if listed is not None and (not whole or listed != list(range(step - 1, layers, step))):
            raise UsageError(
                f"{path}: moe_layers {listed!r:.60} is not every interleave_moe_layer_step-th layer ({step - 1}, "
                f"{2 * step - 1}, ...): other places of MoE layers are not modelled"
            )
        fields.update(
            num_shared_experts=1,  # (Llama4TextMoe: one shared expert of the routed experts' width)
            shared_ffn_size=fields["ffn_size"],
            moe_layer_step=step,
            dense_ffn_size=count("intermediate_size_mlp") if step > 1 else 0,
        )
    if model_type.startswith("deepseek"):
        rope, nope = count("qk_rope_head_dim"), count("qk_nope_head_dim")
        q_lora = config.get("q_lora_rank")  # (null: queries not compressed, as in V2-Lite)
        fields.update(
            head_dim=rope + nope,
            num_kv_heads=heads,  # (MLA: every head has its own K and V from the shared latent)
            num_shared_experts=count("n_shared_experts", 0, low=0),
            shared_ffn_size=fields["ffn_size"],
            first_dense_layers=count("first_k_dense_replace", 0, low=0),
            dense_ffn_size=count("intermediate_size"),
            kv_lora_rank=count("kv_lora_rank"),
            q_lora_rank=0 if q_lora is None else count("q_lora_rank"),
            qk_rope_dim=rope,
            qk_nope_dim=nope,
            v_head_dim=count("v_head_dim"),
        )
        if fields["first_dense_layers"] == 0:
            fields["dense_ffn_size"] = 0
    return fields
