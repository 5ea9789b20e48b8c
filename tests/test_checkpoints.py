"""Qwen3-MoE and OLMoE checkpoints run through the executor exactly as transformers computes them.

Each family differs from Mixtral where a silent mistake would still produce plausible logits: the
q/k RMSNorm (per head for Qwen3-MoE, over the whole projections for OLMoE) and whether the router
renormalises its top-k weights (Qwen3-30B-A3B does, OLMoE does not). The tiny checkpoints have
randomised norm weights and Qwen3's head_dim is not hidden/heads, so applying a norm to the wrong
tensor, over the wrong width, or skipping it, moves the logits far beyond the tolerance.
"""

from __future__ import annotations

import importlib.util
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")
if importlib.util.find_spec("transformers") is None:  # (found, not imported: collecting it costs ~2.5 s a process)
    pytest.skip("needs transformers", allow_module_level=True)

from klotski_runtime.executor import ExecOptions, execute  # noqa: E402
from klotski_runtime.kernels import WeightError, WeightStore  # noqa: E402
from klotski_runtime.record import save_tiny_olmoe, save_tiny_qwen3_moe  # noqa: E402
from klotski_sim.hardware.profile import load_profile  # noqa: E402
from klotski_sim.policies import Placement, PolicyInput, build_schedule  # noqa: E402
from klotski_sim.workload.model import ModelSpec, get_model  # noqa: E402
from klotski_sim.workload.routing import RoutingTable, RunShape  # noqa: E402

from .test_cpu_experts import cpu_profile  # noqa: E402

QWEN3, OLMOE = get_model("tiny-qwen3-moe"), get_model("tiny-olmoe")
FAMILIES = {
    "qwen3_moe": (QWEN3, save_tiny_qwen3_moe, "Qwen3MoeForCausalLM"),
    "olmoe": (OLMOE, save_tiny_olmoe, "OlmoeForCausalLM"),
}


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def family(request, tmp_path_factory) -> tuple[ModelSpec, Path, str]:
    spec, save, hf_class = FAMILIES[request.param]
    return spec, save(tmp_path_factory.mktemp(request.param) / "tiny", seed=1), hf_class


def hf_reference(checkpoint: Path, hf_class: str, spec: ModelSpec, n: int, bs: int, P: int, G: int):
    """transformers' logits for each step's last token, the prompt, and the model's own routing
    (from its router logits: softmax, top-k — the ids do not depend on renormalisation)."""
    import transformers

    hf = getattr(transformers, hf_class).from_pretrained(checkpoint).eval()
    prompt = torch.randint(0, spec.vocab_size, (n, bs, P), generator=torch.Generator().manual_seed(3))
    hf_logits = []
    with torch.no_grad():
        ids = prompt.reshape(n * bs, P)
        for step in range(G):
            out = hf(input_ids=ids, output_router_logits=True)
            hf_logits.append(out.logits[:, -1].reshape(n, bs, -1))
            if step < G - 1:
                ids = torch.cat([ids, out.logits[:, -1:].argmax(-1)], dim=1)
        routing = torch.stack(
            [
                torch.topk(torch.softmax(r.float(), -1), spec.top_k, -1).indices.reshape(n * bs, -1, spec.top_k)
                for r in out.router_logits
            ],
            dim=2,
        )
    table = RoutingTable(
        routing.reshape(n, bs, P + G - 1, spec.num_layers, spec.top_k).numpy().astype(np.int16),
        RunShape(bs, n, P, G),
        spec.num_experts,
        "transformers",
    )
    return hf_logits, prompt, table


def test_matches_transformers_logits_with_unforced_routing(family):
    """With the model routing itself (and, for Klotski, with its own routing forced from a table, so
    the forced gate weights are checked too), the executor gives transformers' logits (fp32, atol
    1e-4) — through the fused and eager attention and the decode attention split onto the CPU."""
    spec, checkpoint, hf_class = family
    n, bs, P, G = 2, 2, 5, 3
    hf_logits, prompt, table = hf_reference(checkpoint, hf_class, spec, n, bs, P, G)
    weights = WeightStore.from_checkpoint(checkpoint, spec, dtype=torch.float32)
    assert weights.rms_eps == (1e-6 if spec.hf_model_type == "qwen3_moe" else 1e-5)
    rtx = load_profile("rtx3090")
    runs = [
        ("klotski", PolicyInput(spec, rtx, table), False),
        ("flexgen", PolicyInput(spec, rtx, table), False),
        ("klotski", PolicyInput(spec, rtx, table), True),
        ("klotski", PolicyInput(spec, rtx, table, options={"attention_impl": "eager"}), False),
        ("klotski", PolicyInput(spec, cpu_profile(), table, Placement(kv="cpu"), {"attention_device": "cpu"}), False),
    ]
    for policy, inp, forced in runs:
        schedule = build_schedule(policy, inp)
        _, runner = execute(
            schedule, spec, weights, table, ExecOptions(force_routing=forced, record_logits=True, prompt=prompt.numpy())
        )
        for step in range(G):
            label = f"{policy} {dict(inp.options)} forced={forced} step {step}"
            for b in range(n):
                torch.testing.assert_close(
                    runner.logits[(step, b)],
                    hf_logits[step][b],
                    atol=1e-4,
                    rtol=1e-4,
                    msg=lambda m, label=label: f"{label}: {m}",
                )


def test_random_weights_hold_the_q_k_norms_the_simulator_counts(family):
    """Random-weight runs do the checkpoint's work: unit q/k norm vectors of the right widths, and the
    resident tensors are exactly `resident_bytes()`."""
    spec = family[0]
    weights = WeightStore.random(spec)
    q_width, k_width = (spec.head_dim, spec.head_dim) if spec.qk_norm == "head" else (spec.q_dim, spec.kv_dim)
    for layer in range(spec.num_layers):
        assert weights.resident[f"q_norm/{layer}"].shape == (q_width,)
        assert weights.resident[f"k_norm/{layer}"].shape == (k_width,)
    assert sum(t.numel() for t in weights.resident.values()) * spec.dtype_bytes == spec.resident_bytes()
    loaded = WeightStore.from_checkpoint(family[1], spec)
    assert {k: v.shape for k, v in loaded.resident.items()} == {k: v.shape for k, v in weights.resident.items()}


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> dict[str, Path]:
    """One tiny checkpoint per family for the refusal tests."""
    return {kind: save(tmp_path_factory.mktemp(f"{kind}-refusals") / "tiny") for kind, (_, save, _) in FAMILIES.items()}


def _one_line_error(path: Path, spec: ModelSpec) -> str:
    with pytest.raises(WeightError) as err:
        WeightStore.from_checkpoint(path, spec)
    message = str(err.value)
    assert "\n" not in message and str(path) in message
    return message


@pytest.mark.parametrize(
    "config, dense",
    [({"mlp_only_layers": [1]}, [1]), ({"decoder_sparse_step": 2}, [0])],
    ids=["mlp_only_layers", "decoder_sparse_step"],
)
def test_a_qwen3_checkpoint_with_dense_layers_is_refused(tmp_path, config, dense):
    """Qwen3MoeDecoderLayer makes a layer a dense MLP when it is in mlp_only_layers or off the sparse
    step ((layer + 1) % decoder_sparse_step): refused, naming the keys and the layers."""
    path = save_tiny_qwen3_moe(tmp_path / "dense", **config)
    message = _one_line_error(path, QWEN3)
    key = next(iter(config))
    assert f"{key}={config[key]}" in message and f"layers {dense} dense" in message, message


def test_an_olmoe_checkpoint_that_clips_qkv_is_refused(tmp_path):
    message = _one_line_error(save_tiny_olmoe(tmp_path / "clip", clip_qkv=8.0), OLMOE)
    assert "clip_qkv=8.0" in message, message


@pytest.mark.parametrize(
    "change, key",
    [
        ({"ffn_size": 48}, "moe_intermediate_size=32"),
        ({"num_experts": 4}, "num_local_experts=8"),
        ({"head_dim": 16}, "head_dim=32"),
        ({"num_kv_heads": 4}, "num_key_value_heads=2"),
        ({"norm_topk_prob": False}, "norm_topk_prob=True"),
        ({"qk_norm": "full"}, "q/k norm=head"),
        ({"hf_model_type": "olmoe", "qk_norm": "full", "norm_topk_prob": False}, "model_type='qwen3_moe'"),
    ],
)
def test_a_qwen3_checkpoint_that_does_not_match_the_spec_is_refused_naming_the_key(saved, change, key):
    from dataclasses import replace

    assert key in _one_line_error(saved["qwen3_moe"], replace(QWEN3, name="other", **change))


@pytest.mark.parametrize(
    "change, key",
    [
        ({"ffn_size": 48}, "intermediate_size=32"),
        ({"num_experts": 4}, "num_experts=8"),
        ({"norm_topk_prob": True}, "norm_topk_prob=False"),
        ({"qk_norm": "head"}, "q/k norm=full"),
        ({"qk_norm": ""}, "q/k norm=full"),
        ({"vocab_size": 512}, "vocab_size=256"),
    ],
)
def test_an_olmoe_checkpoint_that_does_not_match_the_spec_is_refused_naming_the_key(saved, change, key):
    from dataclasses import replace

    assert key in _one_line_error(saved["olmoe"], replace(OLMOE, name="other", **change))


@pytest.mark.parametrize(
    "edit, words",
    [
        ({"num_hidden_layers": "x"}, "num_hidden_layers must be an integer, got 'x'"),
        ({"head_dim": "32"}, "head_dim must be an integer, got '32'"),
        ({"mlp_only_layers": "x"}, "mlp_only_layers must be a list of layer numbers"),
        ({"mlp_only_layers": [[0]]}, "mlp_only_layers must be a list of layer numbers"),
        ({"norm_topk_prob": "yes"}, "norm_topk_prob must be true or false"),
        ({"rms_norm_eps": "x"}, "rms_norm_eps must be a finite number"),
        ({"rms_norm_eps": -1}, "rms_norm_eps must be > 0"),
        ({"rms_norm_eps": float("nan")}, "rms_norm_eps must be a finite number, got nan"),  # (passed `<= 0`)
        ({"rope_parameters": [1]}, "rope_parameters must be a JSON object"),
        ({"rope_parameters": {"rope_theta": "x", "rope_type": "default"}}, "rope_theta must be a finite number"),
        # (a NaN base was read: a recorded trace agreed with the checkpoint's routing on 53% of its choices)
        (
            {"rope_parameters": {"rope_theta": float("nan"), "rope_type": "default"}},
            "rope_theta must be a finite number, got nan",
        ),
        ({"rope_parameters": {"rope_theta": -1e6, "rope_type": "default"}}, "rope_theta must be > 0, got -1000000.0"),
        ({"rope_parameters": {"rope_theta": 1e6, "rope_type": "yarn", "factor": 4.0}}, "rope_type='yarn'"),
        ({"hidden_act": "gelu"}, "hidden_act='gelu'"),
        ({"num_hidden_layers": 1}, "num_hidden_layers=1"),
        ({"tie_word_embeddings": False, "drop": "lm_head.weight"}, "'lm_head.weight' is missing"),
    ],
)
def test_a_config_value_of_the_wrong_type_or_an_uncomputed_feature_is_one_line(saved, tmp_path, edit, words):
    """Values read from config.json are checked before use (a traceback before), and what the
    kernels do not compute is refused, never silently computed otherwise."""
    import json
    import shutil

    from safetensors.torch import load_file, save_file

    path = tmp_path / "edited"
    shutil.copytree(saved["qwen3_moe"], path)
    config = json.loads((path / "config.json").read_text())
    edit = dict(edit)
    drop = edit.pop("drop", None)
    config.update(edit)
    (path / "config.json").write_text(json.dumps(config))
    if drop:
        (file,) = path.glob("*.safetensors")
        tensors = load_file(file)
        del tensors[drop]
        save_file(tensors, file, metadata={"format": "pt"})
    assert words in _one_line_error(path, QWEN3)


@pytest.mark.parametrize("garbage", [b"", b"12345678", b"\x00" * 64])
def test_a_safetensors_file_that_is_not_one_is_one_line(saved, tmp_path, garbage):
    import shutil

    path = tmp_path / "garbage"
    shutil.copytree(saved["qwen3_moe"], path)
    (file,) = path.glob("*.safetensors")
    file.write_bytes(garbage)
    assert "not a valid safetensors file" in _one_line_error(path, QWEN3)


def test_a_tensor_of_the_wrong_shape_is_refused_naming_file_and_key(tmp_path):
    """Per-head vs whole-projection q/k norms differ only in their vectors' widths: a checkpoint whose
    q_norm is as wide as the projection while its config says Qwen3 (per head) is refused, not broadcast."""
    from safetensors.torch import load_file, save_file

    path = save_tiny_qwen3_moe(tmp_path / "bad")
    (file,) = path.glob("*.safetensors")
    tensors = load_file(file)
    key = "model.layers.1.self_attn.q_norm.weight"
    tensors[key] = torch.ones(QWEN3.q_dim)
    save_file(tensors, file, metadata={"format": "pt"})
    message = _one_line_error(path, QWEN3)
    assert str(file) in message and f"{key!r} has shape [{QWEN3.q_dim}]" in message and "needs [32]" in message, message


def test_a_quantised_tensor_is_refused_not_cast(tmp_path):
    """Packed integer codes cast to bf16 would compute garbage without a word."""
    from safetensors.torch import load_file, save_file

    path = save_tiny_qwen3_moe(tmp_path / "int8")
    (file,) = path.glob("*.safetensors")
    tensors = load_file(file)
    key = "model.layers.0.mlp.experts.1.down_proj.weight"
    tensors[key] = torch.zeros(tensors[key].shape, dtype=torch.int8)
    save_file(tensors, file, metadata={"format": "pt"})
    message = _one_line_error(path, QWEN3)
    assert str(file) in message and f"{key!r} is int8, not floating point" in message, message


def test_the_simulator_counts_the_kernels_these_models_add():
    """A q/k-norm model's attention launches two RMSNorms more (8 kernels each in transformers'
    eager RMSNorm); a router that keeps its top-k weights as they are skips Mixtral's sum and
    divide. The schedule's ops carry it in their variant, the cost model counts it, and a Mixtral
    schedule is as before."""
    from klotski_sim.core.cost import CostModel, kernels_of, op_variant

    assert kernels_of("attention", "fused+qk_norm") == kernels_of("attention", "fused") + 16 == 25 + 16
    assert kernels_of("attention", "eager+qk_norm") == 34 + 16
    assert kernels_of("attn_qkv", "qk_norm") == 7 + 16
    assert kernels_of("gate", "topk_as_is") == 12 - 2 and kernels_of("gate", "") == 12
    mixtral = get_model("tiny-mixtral")
    assert (op_variant(mixtral, "attention", "eager"), op_variant(mixtral, "gate")) == ("eager", "")
    rtx = load_profile("rtx3090")
    for spec, attention, gate in ((QWEN3, "fused+qk_norm", ""), (OLMOE, "fused+qk_norm", "topk_as_is")):
        table = _routing(spec)
        schedule = build_schedule("klotski", PolicyInput(spec, rtx, table, impl="ideal"))
        ops = {op.category: op for op in schedule.ops if op.category in ("attention", "gate")}
        assert (ops["attention"].variant, ops["gate"].variant) == (attention, gate)
        cost, overhead = CostModel(rtx), rtx.gpu.kernel_overhead_s
        plain = replace(spec, qk_norm="", norm_topk_prob=True)
        for op in ops.values():
            as_mixtral = op_variant(plain, op.category, "fused" if op.category == "attention" else "")
            extra = cost.duration(op, "gpu") - cost.compute_seconds(
                op.category, op.flops, op.bytes, op.tokens, op.kv_len, op.phase, as_mixtral
            )
            assert extra == pytest.approx((16 if op.category == "attention" else -2 if gate else 0) * overhead)


def test_calibration_tables_are_named_as_the_ops_that_read_them():
    """calibrate times a q/k-norm model's attention and an as-is router under the names its
    schedule's ops carry, so the simulator costs them from the measurement, not the roofline."""
    from klotski_runtime.calibrate import calibrate

    profile = calibrate(
        OLMOE, "cpu", batch_sizes=(2,), prompt_lens=(5,), max_expert_tokens=8, repeats=1, dtype=torch.float32
    )
    schedule = build_schedule("klotski", PolicyInput(OLMOE, profile, _routing(OLMOE), impl="ideal"))
    for op in schedule.ops:
        if op.category in ("attention", "gate"):
            assert (
                f"{op.category}.{op.variant}:{op.phase}" in profile.measured
                or f"{op.category}.{op.variant}" in profile.measured
            ), (op.category, op.variant)


def _routing(spec: ModelSpec) -> RoutingTable:
    rng = np.random.default_rng(0)
    n, bs, P, G = 2, 2, 5, 3
    ids = np.argsort(rng.random((n, bs, P + G - 1, spec.num_layers, spec.num_experts)), axis=-1)[..., : spec.top_k]
    return RoutingTable(ids.astype(np.int16), RunShape(bs, n, P, G), spec.num_experts, "random")
