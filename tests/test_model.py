import pytest

from klotski_sim.model import PRESETS, ModelSpec, get_model


def test_mixtral_8x7b_numbers_match_klotski_table():
    m = get_model("mixtral-8x7b")
    assert m.expert_bytes() == 352_321_536
    assert m.attention_bytes() == 83_886_080
    assert m.gate_bytes() == 65_536
    assert m.kv_bytes_per_token() == 4_096


def test_mixtral_8x22b_numbers_match_klotski_table():
    m = get_model("mixtral-8x22b")
    assert m.expert_bytes() == 603_979_776
    assert m.attention_bytes() == 176_160_768
    assert m.gate_bytes() == 98_304
    assert m.kv_bytes_per_token() == 4_096


def test_mixtral_8x7b_total_is_about_93_gb():
    # 46.7B parameters in bf16
    assert 92e9 < get_model("mixtral-8x7b").total_bytes() < 95e9


def test_fine_grained_presets_exist_with_top8_and_shared_expert():
    assert any(m.num_experts >= 64 and m.top_k == 8 for m in PRESETS.values())
    qwen = get_model("qwen1.5-moe-a2.7b")
    assert qwen.num_shared_experts == 1
    assert qwen.gate_bytes() > qwen.hidden_size * qwen.num_experts * 2  # includes the shared expert


def test_flops_scale_with_tokens_and_kv():
    m = get_model("mixtral-8x7b")
    assert m.expert_flops(10) == 10 * m.expert_flops(1) == 2 * 10 * 3 * 4096 * 14336
    assert m.attention_flops(16, 1, 1024) > m.attention_flops(16, 1, 512)
    # prefill is causal: cheaper than P decode steps at full length
    assert m.attention_flops(1, 512, 512) < 512 * m.attention_flops(1, 1, 512)
    assert m.kv_bytes(16, 512) == 16 * 512 * 4096


def test_unknown_model_lists_presets():
    with pytest.raises(ValueError, match="known models: .*mixtral-8x7b"):
        get_model("gpt-5")


@pytest.mark.parametrize("field,value", [("num_layers", 0), ("hidden_size", -1), ("top_k", 9)])
def test_invalid_specs_are_rejected(field, value):
    kwargs = dict(name="x", num_layers=2, num_experts=8, top_k=2, hidden_size=8, ffn_size=8, num_heads=2,
                  num_kv_heads=1, head_dim=4, vocab_size=10)
    kwargs[field] = value
    with pytest.raises(ValueError):
        ModelSpec(**kwargs)


def test_layer_subset_of_a_preset():
    m = get_model("mixtral-8x7b:4")
    assert m.num_layers == 4 and m.name == "mixtral-8x7b:4" and m.expert_bytes() == 352_321_536
    with pytest.raises(ValueError, match="from 1 to 32"):
        get_model("mixtral-8x7b:40")
