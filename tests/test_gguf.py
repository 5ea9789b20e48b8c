"""GGUF files as llama.cpp writes them (klotski_sim/workload/gguf.py): each type's bits per weight
from its block layout by hand, and whole files' sizes against the sizes llama-bench printed for
published files (docs/advise.md lists each with its source)."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from klotski_sim.util.errors import UsageError
from klotski_sim.workload.gguf import (
    FILE_TYPES,
    GGML_TYPES,
    gguf_sizes,
    split_model_name,
    tensor_type,
    tensors,
)
from klotski_sim.workload.model import PRESETS, get_model

GIB = 2**30

# (ggml-common.h) block contents in bytes, by hand: fp16 scales (2 bytes each), packed quants, sub-block scales
BY_HAND = {
    "Q4_0": (32, 2 + 32 // 2),  # d + 32 nibbles
    "Q8_0": (32, 2 + 32),  # d + 32 int8
    "Q4_K": (256, 2 * 2 + 12 + 256 // 2),  # d, dmin + 12 bytes of 6-bit scales/mins + nibbles
    "Q5_K": (256, 2 * 2 + 12 + 256 // 8 + 256 // 2),  # ... + one high bit per weight
    "Q6_K": (256, 2 + 256 // 16 + 3 * 256 // 4),  # d + 16 int8 scales + 4+2 bits per weight
    "Q2_K": (256, 2 * 2 + 256 // 16 + 256 // 4),  # d, dmin + 16 scale bytes + 2 bits per weight
    "Q3_K": (256, 2 + 12 + 256 // 8 + 256 // 4),  # d + 12 scale bytes + high-bit mask + 2 bits
    "IQ4_XS": (256, 2 + 2 + 256 // 64 + 256 // 2),  # d, scales_h, scales_l + nibbles
    "MXFP4": (32, 1 + 32 // 2),  # an E8M0 exponent + 32 nibbles
}


@pytest.mark.parametrize("name", sorted(BY_HAND))
def test_each_types_block_is_its_layout_summed_by_hand(name):
    block, nbytes = BY_HAND[name]
    kind = GGML_TYPES[name]
    assert (kind.block, kind.block_bytes) == (block, nbytes)
    assert kind.bits_per_weight == pytest.approx(8 * nbytes / block)


def test_the_k_quants_bits_per_weight_are_the_headers_comments():
    """ggml-common.h: 'Effectively 4.5 bits per weight' (Q4_K), 5.5 (Q5_K), 6.5625 (Q6_K), 2.625 (Q2_K), 3.4375 (Q3_K)."""
    said = {"Q4_K": 4.5, "Q5_K": 5.5, "Q6_K": 6.5625, "Q2_K": 2.625, "Q3_K": 3.4375, "IQ4_XS": 4.25, "Q8_0": 8.5}
    assert {n: GGML_TYPES[n].bits_per_weight for n in said} == said


# llama-bench's `size` (GiB) and `params` columns of published files (docs/advise.md: sources)
PUBLISHED = [
    ("qwen3-30b-a3b", "Q2_K", 10.48, 30.53),
    ("qwen3-30b-a3b", "Q3_K_M", 13.70, 30.53),
    ("qwen3-30b-a3b", "Q4_K_M", 17.28, 30.53),
    ("qwen3-30b-a3b", "Q5_K_M", 20.23, 30.53),
    ("qwen3-30b-a3b", "Q6_K", 23.36, 30.53),
    ("qwen3-30b-a3b", "Q8_0", 30.25, 30.53),
    ("qwen3-30b-a3b", "BF16", 56.89, 30.53),
    ("mixtral-8x7b", "Q4_K_M", 26.49, 46.70),
    ("mixtral-8x7b", "Q6_K", 35.74, 46.70),
    ("mixtral-8x7b", "Q8_0", 46.22, 46.70),
    ("qwen3-235b-a22b", "Q2_K", 79.80, 235.09),
    ("deepseek-v3", "Q4_K_M", 376.65, 671.03),
    ("deepseek-v3", "Q8_0", 664.29, 671.03),
    ("gpt-oss-120b", "MXFP4_MOE", 59.02, 116.83),
    ("gpt-oss-20b", "MXFP4_MOE", 11.27, 20.91),
]


@pytest.mark.parametrize(("model", "kind", "gib", "billions"), PUBLISHED)
def test_a_files_size_and_parameters_are_what_llama_bench_printed(model, kind, gib, billions):
    sizes = gguf_sizes(get_model(model), kind)
    assert sizes.total / GIB == pytest.approx(gib, rel=5e-4)  # (printed to 0.01 GiB; DeepSeek's MLA split: 0.03%)
    assert sizes.params / 1e9 == pytest.approx(billions, abs=0.006)


def test_mixed_types_follow_llama_quant_for_moe_and_mixtral_tensors():
    qwen, mixtral = get_model("qwen3-30b-a3b"), get_model("mixtral-8x7b")
    by_name = {(t.name, t.layer): t for t in tensors(qwen)}
    # Q4_K_M: ffn_down_exps Q6_K where use_more_bits (the first eighth of the blocks), Q4_K between
    assert tensor_type(qwen, "Q4_K_M", by_name[("ffn_down_exps", 0)]).name == "Q6_K"
    assert tensor_type(qwen, "Q4_K_M", by_name[("ffn_down_exps", 7)]).name == "Q4_K"
    assert tensor_type(qwen, "Q4_K_M", by_name[("ffn_up_exps", 0)]).name == "Q4_K"
    assert tensor_type(qwen, "Q4_K_M", by_name[("output", -1)]).name == "Q6_K"
    assert tensor_type(qwen, "Q4_K_M", by_name[("ffn_gate_inp", 0)]).name == "F32"  # (the router is never quantised)
    # n_expert == 8 (Mixtral): attn_k and attn_v Q8_0
    attn_k = next(t for t in tensors(mixtral) if t.name == "attn_k")
    assert tensor_type(mixtral, "Q4_K_M", attn_k).name == "Q8_0"
    # a row whose width the block does not divide falls back (gpt-oss's 2880 = 11.25 x 256)
    oss = get_model("gpt-oss-120b")
    down = {t.layer: t for t in tensors(oss) if t.name == "ffn_down_exps"}
    assert tensor_type(oss, "Q4_K_M", down[0]).name == "Q8_0"  # (Q6_K there: its fallback)
    assert tensor_type(oss, "Q4_K_M", down[5]).name == "Q5_0"  # (Q4_K between: its fallback)


@given(st.sampled_from(sorted(PRESETS)), st.sampled_from(sorted(FILE_TYPES)))
def test_sizes_add_up_and_more_bits_never_make_a_smaller_file(model_name, kind):
    model = get_model(model_name)
    sizes = gguf_sizes(model, kind)
    assert sizes.total == sum(sizes.experts) + sum(sizes.block_rest) + sizes.token_embd + sizes.output
    assert all(e == 0 for layer, e in enumerate(sizes.experts) if not model.is_moe(layer))
    assert gguf_sizes(model, "Q8_0").total <= gguf_sizes(model, "BF16").total
    assert gguf_sizes(model, "Q4_K_M").total <= gguf_sizes(model, "Q5_K_M").total <= gguf_sizes(model, "Q6_K").total


@pytest.mark.parametrize(
    ("text", "message"),
    [("qwen3-30b-a3b", "give MODEL@TYPE"), ("qwen3-30b-a3b@Q4_K_X", "TYPE one of"), ("x@", "TYPE one of")],
)
def test_a_model_name_without_a_known_gguf_type_is_refused_in_one_line(text, message):
    with pytest.raises(UsageError, match=message):
        split_model_name(text)
    assert split_model_name("qwen3-30b-a3b@q4_k_m") == ("qwen3-30b-a3b", "Q4_K_M")
