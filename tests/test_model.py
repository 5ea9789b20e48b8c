import pytest

from klotski_sim.util.errors import UsageError
from klotski_sim.workload.model import PRESETS, ModelSpec, get_model


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
    kwargs = dict(
        name="x",
        num_layers=2,
        num_experts=8,
        top_k=2,
        hidden_size=8,
        ffn_size=8,
        num_heads=2,
        num_kv_heads=1,
        head_dim=4,
        vocab_size=10,
    )
    kwargs[field] = value
    with pytest.raises(ValueError):
        ModelSpec(**kwargs)


def test_layer_subset_of_a_preset():
    m = get_model("mixtral-8x7b:4")
    assert m.num_layers == 4 and m.name == "mixtral-8x7b:4" and m.expert_bytes() == 352_321_536
    with pytest.raises(ValueError, match="from 1 to 32"):
        get_model("mixtral-8x7b:40")


def _active_params(m):
    """Parameters one token uses: embeddings and lm_head, every layer's attention, and per layer the
    dense MLP or the router, shared experts and top-k routed experts."""
    total = 2 * m.embedding_bytes()
    for j in range(m.num_layers):
        total += m.attention_bytes() + (
            m.gate_bytes(j) + m.top_k * m.expert_bytes() if m.is_moe(j) else m.dense_mlp_bytes()
        )
    return total / m.dtype_bytes


@pytest.mark.parametrize(
    "name, total_b, active_b, active_rel",
    [
        ("deepseek-v3", 671, 37, 0.025),  # DeepSeek-V3 technical report: 671B total, 37B activated (MTP not counted)
        ("qwen3-30b-a3b", 30.5, 3.3, 0.025),  # Qwen3-30B-A3B model card: 30.5B total, 3.3B activated
        ("deepseek-v2-lite", 15.7, None, 0),  # DeepSeek-V2-Lite model card: 15.7B total
        ("mixtral-8x7b", 46.7, 12.9, 0.025),  # Mixtral of Experts paper: 47B total, 13B active
        ("qwen3-235b-a22b", 235, 22, 0.025),  # Qwen3-235B-A22B model card: 235B total, 22B activated
        # GLM-4.5 technical report: 355B total, "32B" activated, a round figure: counted as the others are
        # (embedding and LM head, each layer's attention, router, shared and 8 routed experts) it is 33.6B
        ("glm-4.5", 355, 32, 0.06),
        ("llama-4-maverick", 400, 17, 0.025),  # Llama 4 model card: 400B total, 17B active
    ],
)
def test_new_presets_have_their_published_parameter_counts(name, total_b, active_b, active_rel):
    m = get_model(name)
    assert m.total_bytes() / m.dtype_bytes / 1e9 == pytest.approx(total_b, rel=0.01)
    if active_b:
        assert _active_params(m) / 1e9 == pytest.approx(active_b, rel=active_rel)


def test_mla_caches_the_latent_and_the_rope_key():
    for name in ("deepseek-v2-lite", "deepseek-v3"):
        assert get_model(name).kv_bytes_per_token() == (512 + 64) * 2
    assert get_model("qwen3-30b-a3b").kv_bytes_per_token() == 2 * 4 * 128 * 2


@pytest.mark.parametrize("policy", ["single-batch", "klotski", "flexgen"])
def test_dense_first_layers_route_nothing_and_run_their_mlp_in_the_gate_op(policy):
    from klotski_sim.core.engine import simulate
    from klotski_sim.policies import build_schedule

    from .test_pipelines import make_input

    inp = make_input(model="deepseek-v2-lite:3", bs=2, n=2, P=6, G=3)
    m = inp.model
    assert m.first_dense_layers == 1 and not inp.routing.counts[:, 0].any() and inp.routing.counts[:, 1:].any()
    s = build_schedule(policy, inp)
    assert not [o for o in s.ops if o.layer == 0 and (o.category == "expert" or o.tensor == "expert")]
    assert [o for o in s.ops if o.layer == 1 and o.category == "expert"]
    gate0 = next(o for o in s.ops if o.category == "dense_mlp" and o.layer == 0)
    gate1 = next(o for o in s.ops if o.category == "gate" and o.layer == 1)
    assert gate0.flops == m.gate_flops(gate0.tokens, 0) == 2 * gate0.tokens * 3 * m.hidden_size * m.dense_ffn_size
    assert gate1.flops == m.gate_flops(gate1.tokens, 1)
    loads = [o for o in s.ops if o.kind == "transfer" and o.tensor == "gate" and o.layer == 0]
    assert all(o.bytes == m.dense_mlp_bytes() for o in loads)
    assert simulate(s, inp.profile).status == "ok"


@pytest.mark.parametrize("policy", ["single-batch", "klotski", "flexgen", "fiddler"])
def test_interleaved_moe_layers_route_only_where_they_have_experts(policy):
    """Llama 4 Maverick: experts in layers 1, 3, ... (transformers' moe_layers), a dense MLP between."""
    from klotski_sim.core.engine import simulate
    from klotski_sim.hardware.profile import load_profile
    from klotski_sim.policies import build_schedule

    from .test_pipelines import make_input

    # (an H800: one of its MoE layers, 128 experts of 252 MB, would not fit an RTX 3090 whole; fiddler
    # needs the cpu: section the h800 profile has)
    inp = make_input(model="llama-4-maverick:4", bs=2, n=2, P=6, G=3, profile=load_profile("h800"))
    m = inp.model
    assert m.moe_layers == (1, 3) and m.first_moe_layer == 1 and m.routed_experts == 2 * 128
    counts = inp.routing.counts
    assert not counts[:, [0, 2]].any() and counts[:, 1].any() and counts[:, 3].any()
    s = build_schedule(policy, inp)
    for layer in (0, 2):
        assert not [o for o in s.ops if o.layer == layer and (o.category == "expert" or o.tensor == "expert")]
        assert [o for o in s.ops if o.layer == layer and o.category == "dense_mlp"]
    for layer in (1, 3):
        assert not [o for o in s.ops if o.layer == layer and o.category == "dense_mlp"]
    assert simulate(s, inp.profile).status == "ok"


def test_a_model_needs_a_moe_layer_and_dense_layers_their_width():
    from dataclasses import replace

    with pytest.raises(UsageError, match=r"give a layer count from 2 to 48 \(its first MoE layer is layer 1\)"):
        get_model("llama-4-maverick:1")
    with pytest.raises(UsageError, match="no layer has experts: the first would be layer 4 .* of 4 layers"):
        replace(get_model("llama-4-maverick:4"), moe_layer_step=5)
    with pytest.raises(UsageError, match="dense layers need dense_ffn_size > 0"):
        replace(get_model("mixtral-8x7b"), moe_layer_step=2)
    with pytest.raises(UsageError, match="moe_layer_step must be a positive integer"):
        replace(get_model("mixtral-8x7b"), moe_layer_step=0)


def test_checkpoints_are_read_in_the_mixtral_qwen3_moe_and_olmoe_layouts_only(tmp_path):
    pytest.importorskip("torch")
    from dataclasses import replace

    from klotski_runtime.kernels import WeightError, WeightStore

    for name in ("deepseek-v2-lite:2", "qwen1.5-moe-a2.7b:1"):  # MLA / dense / shared experts: random weights only
        with pytest.raises(WeightError, match="Mixtral, Qwen3-MoE and OLMoE layouts.*random weights only"):
            WeightStore.from_checkpoint(tmp_path, get_model(name))
    other = replace(get_model("tiny-mixtral"), name="tiny-phimoe", hf_model_type="phimoe")
    with pytest.raises(WeightError, match="model_type 'phimoe' are not read"):
        WeightStore.from_checkpoint(tmp_path, other)


def test_qk_norm_and_top_k_renormalisation_follow_the_published_configs():
    """Qwen3-30B-A3B: q/k norm per head, norm_topk_prob true; OLMoE-1B-7B: q/k norm over the whole
    projections, false; Qwen1.5-MoE-A2.7B: no q/k norm, false; Mixtral: none, renormalised."""
    expected = {
        "qwen3-30b-a3b": ("head", True),
        "olmoe-1b-7b": ("full", False),
        "qwen1.5-moe-a2.7b": ("", False),
        "mixtral-8x7b": ("", True),
        "deepseek-v3": ("", True),
    }
    for name, (qk_norm, renorm) in expected.items():
        m = get_model(name)
        assert (m.qk_norm, m.norm_topk_prob) == (qk_norm, renorm), name
    # the norm vectors are resident: one head_dim vector each for q and k (Qwen3), or q_dim + kv_dim (OLMoE)
    qwen3, olmoe = get_model("qwen3-30b-a3b"), get_model("olmoe-1b-7b")

    def base(m):  # embeddings, lm_head, the final norm and each layer's two hidden-size norms
        return 2 * m.embedding_bytes() + (2 * m.num_layers + 1) * m.hidden_size * m.dtype_bytes

    assert qwen3.resident_bytes() - base(qwen3) == 48 * 2 * 128 * 2
    assert olmoe.resident_bytes() - base(olmoe) == 16 * (2048 + 2048) * 2
    assert get_model("mixtral-8x7b").resident_bytes() == base(get_model("mixtral-8x7b"))


@pytest.mark.parametrize(
    "field,value,match",
    [("qk_norm", "per-head", "qk_norm must be one of"), ("norm_topk_prob", 1, "norm_topk_prob must be true or false")],
)
def test_qk_norm_and_norm_topk_prob_are_validated(field, value, match):
    kwargs = dict(
        name="x",
        num_layers=2,
        num_experts=8,
        top_k=2,
        hidden_size=8,
        ffn_size=8,
        num_heads=2,
        num_kv_heads=1,
        head_dim=4,
        vocab_size=10,
    )
    with pytest.raises(ValueError, match=match):
        ModelSpec(**kwargs, **{field: value})


def test_mla_models_take_no_qk_norm():
    from dataclasses import replace

    with pytest.raises(ValueError, match="MLA normalises its own"):
        replace(get_model("deepseek-v2-lite"), qk_norm="head")
