"""Quantised experts (`--model NAME@intN[:gG][:fp32]`): bytes, dequantisation ops, memory."""

import pytest

from klotski_sim.core.engine import simulate
from klotski_sim.policies import build_schedule
from klotski_sim.util.errors import UsageError
from klotski_sim.workload.model import get_model

from .conftest import run_cli
from .test_pipelines import make_input

MIXTRAL_EXPERT_PARAMS = 3 * 4096 * 14336  # 176,160,768


@pytest.mark.parametrize(
    "name, expected",
    [
        ("mixtral-8x7b", MIXTRAL_EXPERT_PARAMS * 2),
        # HQQ 4-bit, groups of 64, fp16 scale + zero: half a byte per weight + 4 bytes per 64 weights
        ("mixtral-8x7b@int4", MIXTRAL_EXPERT_PARAMS // 2 + MIXTRAL_EXPERT_PARAMS // 64 * 4),
        # Klotski's port (main.py: HQQConfig(num_bits=4, group_size=16) for experts; fp32 scale and zero)
        ("mixtral-8x7b@int4:g16:fp32", MIXTRAL_EXPERT_PARAMS // 2 + MIXTRAL_EXPERT_PARAMS // 16 * 8),
        ("mixtral-8x7b@int8", MIXTRAL_EXPERT_PARAMS + MIXTRAL_EXPERT_PARAMS // 64 * 4),
        # 3-bit codes packed ten to an int32
        ("mixtral-8x7b@int3", -(-MIXTRAL_EXPERT_PARAMS * 32 // 10 // 8) + MIXTRAL_EXPERT_PARAMS // 64 * 4),
        ("mixtral-8x7b@int2:g128", MIXTRAL_EXPERT_PARAMS // 4 + MIXTRAL_EXPERT_PARAMS // 128 * 4),
    ],
)
def test_quantised_bytes_match_a_hand_computation(name, expected):
    assert get_model(name).expert_bytes() == pytest.approx(expected, abs=4)


def test_the_port_s_group_of_16_with_fp32_metadata_only_halves_the_bytes():
    assert get_model("mixtral-8x7b@int4:g16:fp32").expert_bytes() == MIXTRAL_EXPERT_PARAMS  # 1 byte per weight


@pytest.mark.parametrize(
    "name",
    [
        "mixtral-8x7b@int5",
        "mixtral-8x7b@fp8",
        "mixtral-8x7b@int4:g0",
        "mixtral-8x7b@int4:fp8",
        "mixtral-8x7b@int4:x",
        "mixtral-8x7b@int4:fp32:fp16",
        "mixtral-8x7b@int4:g16:g32",
    ],
)
def test_bad_quantisation_is_refused(name):
    with pytest.raises(UsageError, match="model"):
        get_model(name)


def test_a_group_size_that_does_not_divide_an_expert_matrix_is_refused_with_its_numbers():
    with pytest.raises(
        UsageError,
        match=r"group size 3 does not divide an expert matrix's 58720256 weights "
        r"\(4096 x 14336\)",
    ):
        get_model("mixtral-8x7b@int4:g3")
    assert get_model("mixtral-8x7b@int4:g7").quant_group == 7  # (4096 x 14336 = 2^21 x 28: 7 divides it)


@pytest.mark.parametrize("policy", ["single-batch", "klotski", "flexgen", "fiddler", "klotski-hybrid"])
def test_every_streamed_expert_is_dequantised_once_after_its_copy(policy):
    from .test_cpu_experts import cpu_profile

    profile = {
        "fiddler": cpu_profile(memory_bytes=2.5e9, link=25e9),  # so that some experts are copied
        "klotski-hybrid": cpu_profile(memory_bytes=6e9, link=25e9),
    }.get(policy)
    inp = make_input(model="mixtral-8x7b:2@int4", bs=2, n=2, P=40, G=3, profile=profile)  # prefill: 20 tokens an expert
    s = build_schedule(policy, inp)
    m = inp.model
    loads = {o.id: o for o in s.ops if o.kind == "transfer" and o.tensor == "expert"}
    dequants = [o for o in s.ops if o.category == "dequant"]
    assert loads and len(dequants) == len(loads)
    kinds = {o.id: o.kind for o in s.ops}
    for d in dequants:
        (load,) = [x for x in d.deps if kinds[x] != "host"]  # (and the host, where it has just synchronised)
        assert load in loads and loads[load].bytes == m.expert_bytes()
        assert d.free == (load,) and d.alloc[0][1] == m.expert_buffer_bytes() == m.expert_params() * 2
        assert d.bytes == m.expert_bytes() + m.expert_params() * 2
    uses = {dep for o in s.ops if o.category == "expert" and o.stream == "compute" for dep in o.deps}
    assert not (uses & set(loads))  # experts compute on the dequantised buffer, never on the packed copy
    tl = simulate(s, inp.profile)
    assert tl.status == "ok"


def test_unquantised_schedules_have_no_dequant_ops():
    s = build_schedule("klotski", make_input(model="mixtral-8x7b:2", bs=2, n=2, P=6, G=3))
    assert not [o for o in s.ops if o.category == "dequant"]


def test_quantised_experts_cost_less_to_move_and_the_planner_counts_the_dequantised_buffers():
    from klotski_sim.hardware.profile import load_profile
    from klotski_sim.planning.planner import Placement, memory_needed

    bf16, q4 = get_model("mixtral-8x7b"), get_model("mixtral-8x7b@int4")
    assert q4.expert_bytes() < 0.3 * bf16.expert_bytes()
    need_bf16 = memory_needed(bf16, 16, 4, 512, 32, Placement())
    need_q4 = memory_needed(q4, 16, 4, 512, 32, Placement())
    # a whole MoE layer in flight is dequantised: as big as bf16's, plus one packed copy
    assert need_q4["weight_buffers"] == need_bf16["weight_buffers"] + q4.expert_bytes()
    assert load_profile("rtx3090")  # the default profile runs it (tested end to end below)


def test_the_runtime_validates_a_quantised_model(tmp_path, small_calibration):
    import json

    from .conftest import runtime_in_process

    pytest.importorskip("torch")
    code, stdout, stderr = runtime_in_process(
        "validate",
        "--model",
        "tiny-mixtral@int4",
        "--policy",
        "klotski,single-batch",
        "--repeats",
        "1",
        "--profile",
        str(small_calibration("tiny-mixtral@int4")),
        "--out",
        str(tmp_path),
    )
    assert code == 0, stderr
    report = json.loads((tmp_path / "validation.json").read_text())
    assert report["policies"]["klotski"]["per_category"]["dequant"]["ops"] > 0


def test_simulate_a_quantised_model_end_to_end():
    code, out, err = run_cli("simulate", "--model", "mixtral-8x7b:4@int4", "--policy", "klotski", "--no-png")
    assert code == 0, err
    assert "mixtral-8x7b:4@int4" in out and "status      ok" in out


@pytest.mark.parametrize("dtype", ["int8", "int4", "int3", "int2:g32", "int4:g16:fp32"])
def test_the_runtime_moves_exactly_the_simulated_bytes_and_computes_the_dequantised_model(dtype):
    torch = pytest.importorskip("torch")
    from dataclasses import replace

    from klotski_runtime.executor import ExecOptions, execute
    from klotski_runtime.kernels import WeightStore, dequantise_expert

    inp = make_input(model=f"tiny-mixtral@{dtype}", bs=2, n=2, P=6, G=3)
    m = inp.model
    weights = WeightStore.random(m, dtype=torch.float32)
    stored = sum(t.numel() * t.element_size() for t in weights.get("expert", 0, 0))
    assert abs(stored - m.expert_bytes()) <= 12  # 3-bit: ten codes an int32, padded per matrix
    s = build_schedule("klotski", inp)
    tl, run_q = execute(s, m, weights, inp.routing, ExecOptions(record_logits=True))
    moved = {o.id: o.bytes for o in s.ops if o.kind == "transfer" and o.tensor == "expert"}
    assert moved and all(abs(b - m.expert_bytes()) <= 12 for b in moved.values())
    # the same run, unquantised, on the weights the dequantisation gives back: the same logits
    plain = get_model("tiny-mixtral")
    dense = replace(
        weights,
        spec=plain,
        tensors={
            k: dequantise_expert(v, m, torch.float32) if k[0] == "expert" else v for k, v in weights.tensors.items()
        },
    )
    ref_inp = make_input(model="tiny-mixtral", bs=2, n=2, P=6, G=3)
    ref = build_schedule("klotski", ref_inp)
    _, run_d = execute(ref, plain, dense, inp.routing, ExecOptions(record_logits=True))
    for key, logits in run_d.logits.items():
        torch.testing.assert_close(run_q.logits[key], logits, atol=1e-4, rtol=1e-4)
    assert run_q.in_use == run_q.buffer_bytes.get("resident", 0)


def test_a_quantisation_that_would_store_experts_no_smaller_is_refused():
    """Found by a fault battery: `@int8:g1:fp32` (a scale and a zero per weight) made every expert
    4.5x larger than in bf16, and ran as a "quantised" what-if."""
    with pytest.raises(
        UsageError,
        match=r"int8:g1:fp32 stores an expert in 1,585,446,912 bytes, no fewer than the "
        r"352,321,536 of unquantised ones",
    ):
        get_model("mixtral-8x7b@int8:g1:fp32")
    with pytest.raises(UsageError, match="int8:g4 stores an expert in 352,321,536 bytes"):  # (as large: no gain)
        get_model("mixtral-8x7b@int8:g4")
    assert get_model("mixtral-8x7b@int8:g8").expert_bytes() < get_model("mixtral-8x7b").expert_bytes()
