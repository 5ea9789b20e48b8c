"""`--model config.json`: a Hugging Face config gives the preset that cites it, every bad file is one
line naming the file and key, and the CLI simulates a model given so."""

from __future__ import annotations

import json
from dataclasses import asdict

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from klotski_sim.util.errors import UsageError
from klotski_sim.workload.model import get_model

from .conftest import run_cli

# The published configs the presets cite (klotski_sim/workload/model.py), the keys klotski reads.
CONFIGS = {
    "mixtral-8x7b": {
        "model_type": "mixtral",
        "num_hidden_layers": 32,
        "num_local_experts": 8,
        "num_experts_per_tok": 2,
        "hidden_size": 4096,
        "intermediate_size": 14336,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "vocab_size": 32000,
        "torch_dtype": "bfloat16",
        "sliding_window": None,
    },
    "qwen3-30b-a3b": {
        "model_type": "qwen3_moe",
        "num_hidden_layers": 48,
        "num_experts": 128,
        "num_experts_per_tok": 8,
        "hidden_size": 2048,
        "intermediate_size": 6144,
        "moe_intermediate_size": 768,
        "num_attention_heads": 32,
        "num_key_value_heads": 4,
        "head_dim": 128,
        "vocab_size": 151936,
        "norm_topk_prob": True,
        "decoder_sparse_step": 1,
        "mlp_only_layers": [],
        "use_sliding_window": False,
        "torch_dtype": "bfloat16",
    },
    "olmoe-1b-7b": {
        "model_type": "olmoe",
        "num_hidden_layers": 16,
        "num_experts": 64,
        "num_experts_per_tok": 8,
        "hidden_size": 2048,
        "intermediate_size": 1024,
        "num_attention_heads": 16,
        "num_key_value_heads": 16,
        "vocab_size": 50304,
        "norm_topk_prob": False,
    },
    "qwen1.5-moe-a2.7b": {
        "model_type": "qwen2_moe",
        "num_hidden_layers": 24,
        "num_experts": 60,
        "num_experts_per_tok": 4,
        "hidden_size": 2048,
        "intermediate_size": 5632,
        "moe_intermediate_size": 1408,
        "shared_expert_intermediate_size": 5632,
        "num_attention_heads": 16,
        "num_key_value_heads": 16,
        "vocab_size": 151936,
        "norm_topk_prob": False,
    },
    "deepseek-v3": {
        "model_type": "deepseek_v3",
        "num_hidden_layers": 61,
        "n_routed_experts": 256,
        "num_experts_per_tok": 8,
        "hidden_size": 7168,
        "intermediate_size": 18432,
        "moe_intermediate_size": 2048,
        "n_shared_experts": 1,
        "first_k_dense_replace": 3,
        "num_attention_heads": 128,
        "num_key_value_heads": 128,
        "kv_lora_rank": 512,
        "q_lora_rank": 1536,
        "qk_rope_head_dim": 64,
        "qk_nope_head_dim": 128,
        "v_head_dim": 128,
        "vocab_size": 129280,
        "norm_topk_prob": True,
        "torch_dtype": "bfloat16",
    },
    "deepseek-v2-lite": {
        "model_type": "deepseek_v2",
        "num_hidden_layers": 27,
        "n_routed_experts": 64,
        "num_experts_per_tok": 6,
        "hidden_size": 2048,
        "intermediate_size": 10944,
        "moe_intermediate_size": 1408,
        "n_shared_experts": 2,
        "first_k_dense_replace": 1,
        "num_attention_heads": 16,
        "num_key_value_heads": 16,
        "kv_lora_rank": 512,
        "q_lora_rank": None,
        "qk_rope_head_dim": 64,
        "qk_nope_head_dim": 128,
        "v_head_dim": 128,
        "vocab_size": 102400,
        "torch_dtype": "bfloat16",
    },
    # meta-llama/Llama-4-Maverick-17B-128E-Instruct's text_config (the file nests it: test below)
    "llama-4-maverick": {
        "model_type": "llama4_text",
        "num_hidden_layers": 48,
        "num_local_experts": 128,
        "num_experts_per_tok": 1,
        "interleave_moe_layer_step": 2,
        "hidden_size": 5120,
        "intermediate_size": 8192,
        "intermediate_size_mlp": 16384,
        "num_attention_heads": 40,
        "num_key_value_heads": 8,
        "head_dim": 128,
        "vocab_size": 202048,
        "attention_chunk_size": 8192,
        "torch_dtype": "bfloat16",
    },
}


@pytest.mark.parametrize("preset", sorted(CONFIGS))
def test_a_published_config_gives_the_preset_that_cites_it(tmp_path, preset):
    path = tmp_path / "config.json"
    path.write_text(json.dumps(CONFIGS[preset]))
    got, want = asdict(get_model(str(path))), asdict(get_model(preset))
    assert got.pop("name") == str(path)
    want.pop("name")
    assert got == want
    keep = want["first_dense_layers"] + want["moe_layer_step"]  # the suffixes work on a file as on a preset
    layers = get_model(f"{path}:{keep}@int4")
    assert layers.num_layers == keep and layers.expert_bits == 4


@pytest.mark.parametrize(
    "change, words",
    [
        ({"model_type": "llama"}, "model_type 'llama' is not a MoE family"),
        ({"num_local_experts": None}, "num_local_experts is missing"),
        ({"num_experts_per_tok": 9}, "top_k=9 > num_experts=8"),
        ({"hidden_size": "4096"}, "hidden_size must be an integer"),
        ({"num_attention_heads": 0}, "num_attention_heads must be an integer from 1"),
        ({"torch_dtype": "float8"}, "torch_dtype 'float8'"),
        ({"use_sliding_window": True}, "use_sliding_window is true"),
        ({"num_key_value_heads": 7}, "num_heads must be a multiple of num_kv_heads"),
        ({"hidden_size": 4100}, "hidden_size 4100 is not a multiple of num_attention_heads 32, and no head_dim"),
    ],
)
def test_a_config_the_simulator_cannot_model_is_one_line_naming_the_key(tmp_path, change, words):
    path = tmp_path / "config.json"
    path.write_text(json.dumps({**CONFIGS["mixtral-8x7b"], **change}))
    with pytest.raises(UsageError) as err:
        get_model(str(path))
    assert str(path) in str(err.value) and words in str(err.value) and "\n" not in str(err.value)


def test_llama4s_multimodal_config_is_read_from_its_text_config(tmp_path):
    path = tmp_path / "config.json"
    text = {k: v for k, v in CONFIGS["llama-4-maverick"].items() if k != "torch_dtype"}
    path.write_text(json.dumps({"model_type": "llama4", "torch_dtype": "bfloat16", "text_config": text}))
    got, want = asdict(get_model(str(path))), asdict(get_model("llama-4-maverick"))
    assert {**got, "name": ""} == {**want, "name": ""}
    for config, words in (
        ({"model_type": "llama4", "text_config": [1]}, "text_config must be an object"),
        ({**CONFIGS["llama-4-maverick"], "moe_layers": [0, 2]}, r"moe_layers \[0, 2\] is not every"),
        ({**CONFIGS["llama-4-maverick"], "moe_layers": [True, 3]}, r"moe_layers \[True, 3\] is not every"),
        ({**CONFIGS["qwen3-30b-a3b"], "mlp_only_layers": [0]}, "mlp_only_layers is set"),
    ):
        path.write_text(json.dumps(config))
        with pytest.raises(UsageError, match=words):
            get_model(str(path))


def test_a_config_without_moe_layers_says_so_naming_its_file(tmp_path):
    path = tmp_path / "config.json"
    path.write_text(json.dumps({**CONFIGS["llama-4-maverick"], "num_hidden_layers": 1}))
    with pytest.raises(UsageError) as err:
        get_model(str(path))
    assert str(err.value).startswith(f"{path}: no layer has experts: the first would be layer 1"), err.value


def test_qwens_sparse_step_gives_interleaved_dense_layers(tmp_path):
    path = tmp_path / "config.json"
    path.write_text(json.dumps({**CONFIGS["qwen3-30b-a3b"], "decoder_sparse_step": 2}))
    model = get_model(str(path))
    assert model.moe_layer_step == 2 and model.dense_ffn_size == 6144 and model.moe_layers[:2] == (1, 3)


def test_unreadable_config_files_are_one_line(tmp_path):
    for name, text in [("list.json", "[1, 2]"), ("bad.json", "{"), ("twice.json", '{"a": 1, "a": 2}')]:
        (tmp_path / name).write_text(text)
        with pytest.raises(UsageError, match=name):
            get_model(str(tmp_path / name))
    with pytest.raises(UsageError, match="cannot read model config"):
        get_model(str(tmp_path / "missing.json"))
    (tmp_path / "folder.json").mkdir()
    with pytest.raises(UsageError, match="is a directory"):
        get_model(str(tmp_path / "folder.json"))


json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**40), 2**40) | st.floats(allow_nan=False) | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=8), inner, max_size=3),
    max_leaves=8,
)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    base=st.sampled_from(sorted(CONFIGS)),
    edits=st.dictionaries(
        st.sampled_from(sorted({k for c in CONFIGS.values() for k in c})), json_values | st.integers(0, 300), max_size=4
    ),
)
def test_fuzzed_configs_give_a_model_or_one_line(tmp_path_factory, base, edits):
    path = tmp_path_factory.mktemp("c") / "config.json"
    path.write_text(json.dumps({**CONFIGS[base], **edits}))
    try:
        spec = get_model(str(path))
    except UsageError as err:
        assert "\n" not in str(err) and str(path) in str(err)
    else:
        assert spec.num_layers >= 1 and spec.top_k <= spec.num_experts and spec.expert_bytes() > 0


def test_simulate_a_model_given_by_its_config(tmp_path):
    path = tmp_path / "config.json"
    path.write_text(json.dumps({**CONFIGS["mixtral-8x7b"], "num_hidden_layers": 2}))
    rc, out, err = run_cli(
        "simulate",
        "--model",
        str(path),
        "--policy",
        "klotski",
        "--num-batches",
        "2",
        "--batch-size",
        "2",
        "--prompt-len",
        "8",
        "--gen-len",
        "2",
        "--no-png",
    )
    assert rc == 0, err
    assert "status ok" in out or "ok" in out
