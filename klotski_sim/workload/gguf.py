"""GGUF models as llama.cpp stores them: ggml's quantisation types, the per-tensor mixes a file type
(`Q4_K_M`, ...) picks, and a model's tensors in them — so that what a llama.cpp user downloads (and
what each device must hold) is known to the byte before anything is downloaded.

Sources (read at these commits):
- block layouts: ggml `src/ggml-common.h` (the `block_*` structs and their static_asserts) and
  `src/ggml.c` `type_traits` (blck_size, type_size), ggml-org/ggml d99724f2;
- mixes: llama.cpp `src/llama-quant.cpp` `llama_tensor_get_type` (ggerganov/llama.cpp c392e509,
  the same branches in ggml-org/llama.cpp 007dbbf3), `llama_ftype_get_default_type` for the
  default type of each file type;
- tensor names and which are quantised: `tensor_allows_quantization` (2-D and 3-D weights only;
  norms, biases and the router `ffn_gate_inp` stay F32).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterator

from klotski_sim.util.errors import UsageError
from klotski_sim.workload.model import ModelSpec


@dataclass(frozen=True)
class GgmlType:
    """One ggml tensor type: `block` weights stored in `block_bytes` bytes (scales included)."""

    name: str
    block: int
    block_bytes: int

    @property
    def bits_per_weight(self) -> float:
        return 8 * self.block_bytes / self.block

    def row_bytes(self, width: int) -> int:
        """Bytes of one row of `width` weights (ggml_row_size; `width` a multiple of the block)."""
        return width // self.block * self.block_bytes


# (blck_size, sizeof(block_*)) from ggml-common.h / ggml.c type_traits, e.g. block_q4_K: 2 fp16
# (d, dmin) + 12 bytes of 6-bit scales + 128 bytes of nibbles = 144 bytes per 256 weights
GGML_TYPES: dict[str, GgmlType] = {
    t.name: t
    for t in (
        GgmlType("F32", 1, 4),
        GgmlType("F16", 1, 2),
        GgmlType("BF16", 1, 2),
        GgmlType("Q4_0", 32, 18),
        GgmlType("Q4_1", 32, 20),
        GgmlType("Q5_0", 32, 22),
        GgmlType("Q5_1", 32, 24),
        GgmlType("Q8_0", 32, 34),
        GgmlType("Q2_K", 256, 84),
        GgmlType("Q3_K", 256, 110),
        GgmlType("Q4_K", 256, 144),
        GgmlType("Q5_K", 256, 176),
        GgmlType("Q6_K", 256, 210),
        GgmlType("IQ2_XXS", 256, 66),
        GgmlType("IQ3_XXS", 256, 98),
        GgmlType("IQ4_NL", 32, 18),
        GgmlType("IQ4_XS", 256, 136),
        GgmlType("MXFP4", 32, 17),
    )
}

# a type whose block does not divide a row's width falls back (llama-quant.cpp tensor_type_fallback)
FALLBACK = {"Q4_K": "Q5_0", "Q5_K": "Q5_1", "Q6_K": "Q8_0", "IQ4_XS": "IQ4_NL", "Q2_K": "Q4_0", "Q3_K": "Q4_0"}

# file type (`general.file_type`, the name users download) -> its default tensor type
FILE_TYPES: dict[str, str] = {
    "Q2_K": "Q2_K",
    "Q3_K_M": "Q3_K",
    "Q4_K_M": "Q4_K",
    "Q5_K_M": "Q5_K",
    "Q6_K": "Q6_K",
    "Q8_0": "Q8_0",
    "IQ4_XS": "IQ4_XS",
    "MXFP4_MOE": "MXFP4",
    "BF16": "BF16",
    "F16": "F16",
}


@dataclass(frozen=True)
class GgufTensor:
    """One weight tensor of a GGUF file: `rows` rows of `width` weights (ggml's ne0), its llama.cpp
    name and layer (-1: outside the blocks)."""

    name: str
    layer: int
    width: int
    rows: int

    @property
    def params(self) -> int:
        return self.width * self.rows

    @property
    def routed_experts(self) -> bool:
        """`blk.N.ffn_{gate,up,down}_exps`: what `--n-cpu-moe` and `-ot exps=CPU` keep on the CPU."""
        return self.name.endswith("_exps")


def tensors(model: ModelSpec) -> Iterator[GgufTensor]:
    """A model's weight tensors with llama.cpp's names (llama-arch.cpp: token_embd, blk.N.attn_q, ...,
    ffn_gate_exps, ffn_down_shexp, output); vectors (norms, biases) included as F32 rows of one."""
    h, L = model.hidden_size, model.num_layers
    yield GgufTensor("token_embd", -1, h, model.vocab_size)
    for layer in range(L):
        yield GgufTensor("attn_norm", layer, h, 1)
        if model.mla:
            heads, qk = model.num_heads, model.qk_nope_dim + model.qk_rope_dim
            if model.q_lora_rank:
                yield GgufTensor("attn_q_a", layer, h, model.q_lora_rank)
                yield GgufTensor("attn_q_a_norm", layer, model.q_lora_rank, 1)
                yield GgufTensor("attn_q_b", layer, model.q_lora_rank, heads * qk)
            else:
                yield GgufTensor("attn_q", layer, h, heads * qk)
            yield GgufTensor("attn_kv_a_mqa", layer, h, model.kv_lora_rank + model.qk_rope_dim)
            yield GgufTensor("attn_kv_a_norm", layer, model.kv_lora_rank, 1)
            yield GgufTensor("attn_kv_b", layer, model.kv_lora_rank, heads * (model.qk_nope_dim + model.v_head_dim))
            yield GgufTensor("attn_output", layer, heads * model.v_head_dim, h)
        else:
            yield GgufTensor("attn_q", layer, h, model.q_dim)
            yield GgufTensor("attn_k", layer, h, model.kv_dim)
            yield GgufTensor("attn_v", layer, h, model.kv_dim)
            yield GgufTensor("attn_output", layer, model.q_dim, h)
            if model.biases:  # (gpt-oss: q, k, v and output biases, one sink per head)
                widths = (model.q_dim, model.kv_dim, model.kv_dim, h, model.num_heads)
                for name, width in zip(("attn_q_b", "attn_k_b", "attn_v_b", "attn_out_b", "attn_sinks"), widths):
                    yield GgufTensor(name, layer, width, 1)
            q_norm, k_norm = model.qk_norm_widths()
            if q_norm:
                yield GgufTensor("attn_q_norm", layer, q_norm, 1)
                yield GgufTensor("attn_k_norm", layer, k_norm, 1)
        yield GgufTensor("ffn_norm", layer, h, 1)
        if not model.is_moe(layer):
            f = model.dense_ffn_size
            yield from (GgufTensor(n, layer, h, f) for n in ("ffn_gate", "ffn_up"))
            yield GgufTensor("ffn_down", layer, f, h)
            continue
        E, f = model.num_experts, model.ffn_size
        yield GgufTensor("ffn_gate_inp", layer, h, E)
        yield from (GgufTensor(n, layer, h, f * E) for n in ("ffn_gate_exps", "ffn_up_exps"))
        yield GgufTensor("ffn_down_exps", layer, f, h * E)
        if model.biases:  # (the router's and each expert's biases: F32 vectors, with the experts)
            yield GgufTensor("ffn_gate_inp_b", layer, E, 1)
            yield from (GgufTensor(n, layer, f * E, 1) for n in ("ffn_gate_exps_b", "ffn_up_exps_b"))
            yield GgufTensor("ffn_down_exps_b", layer, h * E, 1)
        if model.num_shared_experts:
            fs = model.shared_ffn_size * model.num_shared_experts
            yield from (GgufTensor(n, layer, h, fs) for n in ("ffn_gate_shexp", "ffn_up_shexp"))
            yield GgufTensor("ffn_down_shexp", layer, fs, h)
    yield GgufTensor("output_norm", -1, h, 1)
    yield GgufTensor("output", -1, h, model.vocab_size)


def _more_bits(layer: int, layers: int) -> bool:
    """llama-quant.cpp's use_more_bits: the first and last eighth of the layers and every third between."""
    return layer < layers // 8 or layer >= 7 * layers // 8 or (layer - layers // 8) % 3 == 2


def _unquantised(name: str) -> bool:
    return name.endswith("norm") or name == "ffn_gate_inp"


def tensor_type(model: ModelSpec, file_type: str, tensor: GgufTensor) -> GgmlType:
    """The type llama.cpp's quantiser gives `tensor` in a `file_type` file (llama_tensor_get_type's
    branches for the file types of FILE_TYPES, the imatrix-free path), after the block fallback."""
    if file_type not in FILE_TYPES:
        raise UsageError(f"GGUF type {file_type!r}: one of {', '.join(FILE_TYPES)}")
    if tensor.rows == 1 or _unquantised(tensor.name):
        return GGML_TYPES["F32"]
    default = FILE_TYPES[file_type]
    if default in ("BF16", "F16"):
        return GGML_TYPES[default]
    name, layer, L = tensor.name, tensor.layer, model.num_layers
    eight = model.num_experts == 8  # (Mixtral: llama-quant's `n_expert == 8` upgrades)
    gqa = model.num_heads // model.num_kv_heads
    chosen = default
    if file_type == "MXFP4_MOE":
        chosen = "MXFP4" if tensor.routed_experts else "Q8_0"
    elif name == "output":
        chosen = default if default == "Q8_0" else "Q6_K"
    elif name in ("attn_v", "attn_kv_b"):  # (category_is_attn_v: counted one a layer, in order)
        if eight:
            chosen = "Q8_0"
        elif file_type == "Q2_K":
            chosen = "Q4_K" if gqa >= 4 else "Q3_K"
        elif file_type == "Q3_K_M":
            chosen = "Q5_K" if layer < 2 else "Q4_K"
        elif file_type == "IQ4_XS" and gqa >= 4:
            chosen = "Q5_K"
        elif file_type in ("Q4_K_M", "Q5_K_M") and _more_bits(layer, L):
            chosen = "Q6_K"
    elif name == "attn_k" and eight:
        chosen = "Q8_0"
    elif name == "attn_output":
        if eight and file_type in ("Q2_K", "Q3_K_M", "Q4_K_M", "IQ4_XS"):
            chosen = "Q5_K"
        elif not eight:
            chosen = {"Q2_K": "Q3_K", "Q3_K_M": "Q4_K"}.get(file_type, default)
    elif name.startswith("ffn_down"):  # (ffn_down, ffn_down_exps and ffn_down_shexp alike)
        if file_type == "Q2_K":
            chosen = "Q3_K"
        elif file_type == "Q3_K_M":
            chosen = "Q5_K" if layer < L // 16 else "Q4_K"
        elif file_type in ("Q4_K_M", "Q5_K_M") and _more_bits(layer, L):
            chosen = "Q6_K"
        elif file_type == "IQ4_XS" and layer < L // 8:
            chosen = "Q5_K"
    kind = GGML_TYPES[chosen]
    if tensor.width % kind.block:
        kind = GGML_TYPES[FALLBACK.get(chosen, "Q8_0")]
    return kind


def tensor_bytes(model: ModelSpec, file_type: str, tensor: GgufTensor) -> int:
    return tensor_type(model, file_type, tensor).row_bytes(tensor.width) * tensor.rows


@dataclass(frozen=True)
class GgufSizes:
    """A GGUF file's weights by where llama.cpp can put them: per layer, the routed experts
    (`ffn_*_exps`) and the rest of the block; outside the blocks, the token embeddings (always on the
    CPU: GET_ROWS is never offloaded) and the output head."""

    file_type: str
    experts: tuple[int, ...]  # per layer: bytes of its routed experts (0 in a dense layer)
    block_rest: tuple[int, ...]  # per layer: attention, norms, router, shared experts or dense MLP
    token_embd: int
    output: int  # output head and final norm
    params: int
    experts_per_layer: int
    # per layer: its routed experts' bytes by ggml type (Q4_K_M keeps gate/up in Q4_K, down in Q6_K or Q4_K)
    expert_type_bytes: tuple[tuple[tuple[str, int], ...], ...] = ()

    @property
    def total(self) -> int:
        return sum(self.experts) + sum(self.block_rest) + self.token_embd + self.output

    def expert_bytes(self, layer: int) -> float:
        """One routed expert of `layer` (the layer's experts' bytes over their count)."""
        return self.experts[layer] / self.experts_per_layer


def gguf_sizes(model: ModelSpec, file_type: str) -> GgufSizes:
    """Bytes of every part of `model` stored as a `file_type` GGUF file."""
    experts = [0] * model.num_layers
    rest = [0] * model.num_layers
    by_type: list[dict[str, int]] = [{} for _ in range(model.num_layers)]
    embd = output = params = 0
    for tensor in tensors(model):
        kind = tensor_type(model, file_type, tensor)
        nbytes = kind.row_bytes(tensor.width) * tensor.rows
        params += tensor.params
        if tensor.layer < 0:
            if tensor.name == "token_embd":
                embd += nbytes
            else:
                output += nbytes
        elif tensor.routed_experts:
            experts[tensor.layer] += nbytes
            by_type[tensor.layer][kind.name] = by_type[tensor.layer].get(kind.name, 0) + nbytes
        else:
            rest[tensor.layer] += nbytes
    types = tuple(tuple(sorted(layer.items())) for layer in by_type)
    return GgufSizes(file_type, tuple(experts), tuple(rest), embd, output, params, model.num_experts, types)


def split_model_name(text: str) -> tuple[str, str]:
    """`qwen3-30b-a3b@Q4_K_M` -> ("qwen3-30b-a3b", "Q4_K_M"): a model and its GGUF file type."""
    name, at, kind = text.partition("@")
    kind = kind.upper()
    if not at or kind not in FILE_TYPES:
        raise UsageError(
            f"--model {text}: give MODEL@TYPE with TYPE one of {', '.join(FILE_TYPES)} (e.g. qwen3-30b-a3b@Q4_K_M)"
        )
    return name, kind
