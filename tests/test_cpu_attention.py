"""Decode attention on the host CPU (option attention_device=cpu, MoE-Lightning's CGOPipe split)."""

import pytest

from klotski_sim.core.engine import simulate
from klotski_sim.policies import Placement, PolicyInput, build_schedule
from klotski_sim.runs.runner import RunSpec, run
from klotski_sim.util.errors import UsageError

from .conftest import run_cli
from .test_cpu_experts import cpu_profile
from .test_pipelines import make_input


@pytest.mark.parametrize("policy", ["klotski", "flexgen", "single-batch", "fiddler"])
def test_decode_attention_runs_on_the_cpu_and_the_kv_cache_never_crosses_pcie_in_decode(policy):
    inp = make_input(
        model="small-mixtral", bs=2, n=2, P=6, G=4, placement=Placement(kv="cpu"), profile=cpu_profile(memory_bytes=4e9)
    )
    inp = PolicyInput(
        inp.model, inp.profile, inp.routing, inp.placement, {"attention_device": "cpu"}, inp.warmup, "ideal"
    )
    s = build_schedule(policy, inp)
    m = inp.model
    decode_core = [o for o in s.ops if o.category == "attention" and o.step > 0]
    assert decode_core and all(o.stream == "cpu_compute" for o in decode_core)
    for o in decode_core:
        assert o.bytes == m.kv_bytes(2, o.kv_len) + 2 * 2 * m.q_dim * m.dtype_bytes
    prefill = [o for o in s.ops if o.category == "attention" and o.step == 0]
    assert prefill and all(o.stream == "compute" for o in prefill)
    kv_moves = [o for o in s.ops if o.tensor == "kv"]
    assert kv_moves and all(o.step == 0 and o.stream == "d2h_kv" for o in kv_moves)  # prefill's KV goes down once
    down = [o for o in s.ops if o.id.endswith("/qkv_down")]
    assert all(o.bytes == 2 * (m.q_dim + 2 * m.kv_dim) * m.dtype_bytes for o in down)
    assert len([o for o in s.ops if o.category == "attn_qkv"]) == len([o for o in s.ops if o.category == "attn_out"])
    assert simulate(s, inp.profile).status == "ok"


def test_the_planner_uses_the_gpu_memory_the_kv_cache_leaves():
    on_gpu = run(RunSpec(num_batches=None, policy="klotski"))
    on_cpu = run(RunSpec(num_batches=None, policy="klotski", options={"attention_device": "cpu"}))
    assert on_cpu.timeline.meta["placement"]["kv"] == "cpu"
    assert on_cpu.schedule.meta["num_batches"] > on_gpu.schedule.meta["num_batches"]


@pytest.mark.parametrize(
    "args, message",
    [
        (("--option", "attention_device=cpu", "--hardware", "a100-80g"), "`cpu:` section"),
        (("--option", "attention_device=cpu", "--kv", "gpu"), "--kv gpu contradicts"),
        (("--option", "attention_device=cpu", "--model", "deepseek-v2-lite:2"), "MLA"),
        (("--option", "attention_device=tpu"), "option attention_device must be one of gpu, cpu, got 'tpu'"),
    ],
)
def test_impossible_cpu_attention_is_one_line(args, message):
    code, out, err = run_cli("simulate", "--policy", "klotski", "--no-png", "--gen-len", "4", *args)
    assert code == 2 and err.count("\n") == 1 and message in err, err


def test_the_runtime_executes_the_split_attention_with_the_same_logits():
    torch = pytest.importorskip("torch")
    from klotski_runtime.executor import ExecOptions, execute
    from klotski_runtime.kernels import WeightStore

    inp = make_input(model="tiny-mixtral", bs=2, n=2, P=4, G=4, placement=Placement(kv="cpu"), profile=cpu_profile())
    weights = WeightStore.random(inp.model, dtype=torch.float32)
    for policy in ("klotski", "single-batch", "flexgen"):
        split = build_schedule(
            policy,
            PolicyInput(inp.model, inp.profile, inp.routing, inp.placement, {"attention_device": "cpu"}, inp.warmup),
        )
        plain = build_schedule(policy, PolicyInput(inp.model, inp.profile, inp.routing, inp.placement, {}, inp.warmup))
        tl, run_split = execute(split, inp.model, weights, inp.routing, ExecOptions(record_logits=True))
        _, run_plain = execute(plain, inp.model, weights, inp.routing, ExecOptions(record_logits=True))
        for key, logits in run_plain.logits.items():
            torch.testing.assert_close(run_split.logits[key], logits, atol=1e-4, rtol=1e-4)
        assert "cpu" in set(tl.columns["resource"])
        assert run_split.in_use == run_split.buffer_bytes.get("resident", 0)
    with pytest.raises(UsageError):
        build_schedule(
            "klotski",
            PolicyInput(
                inp.model, inp.profile, inp.routing, Placement(kv="gpu"), {"attention_device": "cpu"}, inp.warmup
            ),
        )


def test_validate_takes_policy_options(tmp_path, small_calibration):
    import json

    from .conftest import runtime_in_process

    pytest.importorskip("torch")
    code, stdout, stderr = runtime_in_process(
        "validate",
        "--model",
        "tiny-mixtral",
        "--policy",
        "klotski",
        "--option",
        "attention_device=cpu",
        "--kv",
        "cpu",
        "--repeats",
        "1",
        "--profile",
        str(small_calibration("tiny-mixtral")),
        "--out",
        str(tmp_path),
    )
    assert code == 0, stderr
    report = json.loads((tmp_path / "validation.json").read_text())
    assert report["setup"]["options"] == {"attention_device": "cpu"}
    assert report["policies"]["klotski"]["per_category"]["attn_qkv"]["ops"] > 0
