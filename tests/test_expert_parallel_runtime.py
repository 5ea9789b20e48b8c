"""The CPU runtime executes an expert-parallel schedule (`parallel --timing events`) on G ranks
emulated as threads (klotski_runtime/expert_parallel.py): the tokens each dispatch gathers, the
experts each rank holds, copies in, decompresses or leaves to the CPU, and each combine. Its hidden
states are a one-device computation's, and every token's every expert slot is computed once."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

torch = pytest.importorskip("torch")

from klotski_runtime.executor import ExecOptions, ExecutionError  # noqa: E402
from klotski_runtime.expert_parallel import execute_ep, prompt_cache, reference_decode  # noqa: E402
from klotski_runtime.kernels import WeightStore  # noqa: E402
from klotski_sim.core.collectives import all_to_all_time  # noqa: E402
from klotski_sim.hardware.profile import FabricSpec, load_profile, with_overrides  # noqa: E402
from klotski_sim.parallel.decode import ParallelSetup, plan_expert_parallel, without_experts  # noqa: E402
from klotski_sim.parallel.events import EpEvents, ep_schedule  # noqa: E402
from klotski_sim.runs.runner import RunSpec, make_replay  # noqa: E402
from klotski_sim.workload.model import ModelSpec, get_model  # noqa: E402

from .conftest import run_cli, runtime_in_process  # noqa: E402
from .timeline_checks import assert_respects  # noqa: E402

TINY = get_model("tiny-mixtral")
# experts every second layer with a shared expert, a dense MLP between (Llama 4's shape in small)
INTERLEAVED = replace(
    TINY, name="tiny-interleaved", num_layers=4, moe_layer_step=2, dense_ffn_size=96, num_shared_experts=1,
    shared_ffn_size=32, hf_model_type="qwen2_moe",
)  # fmt: skip
PROMPT, GEN = 16, 4


def _routing(model: ModelSpec):
    spec = RunSpec(model=model.name, hardware="h200", batch_size=8, num_batches=1, prompt_len=PROMPT, gen_len=GEN)
    return make_replay(spec, model, 1)[1].routing


def _small_gpus(model: ModelSpec, routing, experts: int):
    """H200s with room for a rank's fixed share and `experts` experts only (the rest stay in host memory)."""
    seqs = -(-routing.shape.num_sequences // 2)
    fixed = without_experts(model, routing.shape.prompt_len + routing.shape.gen_len, seqs)
    h200 = load_profile("h200")
    return with_overrides(h200, {"gpu.memory_bytes": h200.gpu.reserved_bytes + fixed + experts * model.expert_bytes()})


def _plan(model: ModelSpec, gpus: int = 2, experts_on_gpu: int | None = None, compressed: float | None = None, **setup):
    """An EP plan of 8 sequences, on H200s or, with `experts_on_gpu`, on GPUs that hold that many experts."""
    routing = _routing(model)
    profile = load_profile("h200") if experts_on_gpu is None else _small_gpus(model, routing, experts_on_gpu)
    return model, routing, plan_expert_parallel(model, profile, routing, ParallelSetup(gpus, "ep", **setup), compressed)


def _execute(model, routing, plan, how: EpEvents = EpEvents(), dtype=torch.float32, options=ExecOptions()):
    schedule, builder = ep_schedule(model, plan, routing, how)
    weights = WeightStore.random(model, dtype=dtype)
    inputs = prompt_cache(model, len(plan.home_rank), PROMPT, GEN - 1, dtype)
    timeline, runner = execute_ep(schedule, model, weights, plan, builder.part, inputs, options)
    return schedule, timeline, runner, reference_decode(model, weights, plan, inputs)


def _assert_same_and_each_slot_once(runner, reference, tol: float = 1e-4) -> None:
    assert runner.outputs.keys() == reference.keys() == set(range(1, GEN))
    for step, hidden in reference.items():
        torch.testing.assert_close(runner.outputs[step], hidden, atol=tol, rtol=tol)
    assert runner.computed and all((c == 1).all() for c in runner.computed.values())
    assert not runner.staged  # (every staging buffer freed by the op the schedule names)


@pytest.mark.parametrize("model", [TINY, INTERLEAVED], ids=["tiny-mixtral", "interleaved-shared"])
@pytest.mark.parametrize(
    ("placement", "spare", "grouping"), [("round-robin", 0, False), ("coactivation", 1, False), ("popularity", 0, True)]
)
def test_ranks_holding_every_expert_compute_the_one_device_states(model, placement, spare, grouping):
    model, routing, plan = _plan(model, 2, None, placement=placement, spare_slots=spare, grouping=grouping)
    assert plan.offload is None
    schedule, timeline, runner, reference = _execute(model, routing, plan)
    _assert_same_and_each_slot_once(runner, reference)
    assert_respects(schedule, timeline)
    assert timeline.meta["expert_parallel_ranks"] == 2


@pytest.mark.parametrize(
    "how",
    [
        EpEvents(),
        EpEvents(micro_batches=2),
        EpEvents(prefetch=True),
        EpEvents(offloaded_experts="cpu", micro_batches=2),
    ],
    ids=["copy", "micro-batches", "prefetch", "cpu-experts"],
)
def test_offloading_ranks_copy_or_leave_to_the_cpu_what_they_lack_and_compute_the_same(how):
    model, routing, plan = _plan(TINY, 2, experts_on_gpu=3)
    assert plan.offload is not None
    schedule, timeline, runner, reference = _execute(model, routing, plan, how)
    moved = {op.tensor for op in schedule.ops if op.kind == "transfer"}
    assert moved == ({"activation"} if how.offloaded_experts == "cpu" else {"expert"})
    _assert_same_and_each_slot_once(runner, reference)
    assert_respects(schedule, timeline)


def test_a_compressed_tier_is_decoded_for_real_into_the_staging_slots():
    model, routing, plan = _plan(TINY, 2, experts_on_gpu=3, compressed=0.7)
    how = EpEvents(offloaded_experts="compressed", prefetch=True)
    schedule, timeline, runner, reference = _execute(model, routing, plan, how, dtype=torch.bfloat16)
    assert any(op.category == "decompress" for op in schedule.ops) and runner.compressed
    _assert_same_and_each_slot_once(runner, reference, tol=2e-2)
    assert_respects(schedule, timeline)


def test_an_emulated_fabric_holds_each_exchange_to_its_pairwise_time():
    model, routing, plan = _plan(TINY, 4)
    fabric = FabricSpec(kind="pcie", gpus=4, bandwidth=2e6, base_latency_s=0.0, step_latency_s=0.0)
    schedule, timeline, runner, reference = _execute(model, routing, plan, options=ExecOptions(emulate_fabric=fabric))
    _assert_same_and_each_slot_once(runner, reference)
    df = timeline.df.set_index("op_id")
    exchanges = [op for op in schedule.ops if op.category == "alltoall"]
    assert exchanges and any(op.bytes for op in exchanges)
    for op in exchanges:
        assert df.at[op.id, "end"] - df.at[op.id, "start"] >= all_to_all_time(op.bytes, 4, fabric) * 0.999, op.id


def test_the_schedule_runs_on_the_cpu_runtime_only_and_says_so():
    model, routing, plan = _plan(TINY, 2)
    with pytest.raises(ExecutionError, match="runs on the CPU runtime"):
        _execute(model, routing, plan, options=ExecOptions(device="cuda"))
    model, routing, plan = _plan(TINY, 2, experts_on_gpu=3, compressed=0.7)
    with pytest.raises(ExecutionError, match="must be bf16"):
        _execute(model, routing, plan, EpEvents(offloaded_experts="compressed"))


# ---- end to end: what `parallel --timing events --out DIR` wrote, executed by `klotski-runtime execute` ----
def _small_h200() -> str:
    """--set of an H200 that holds a rank's fixed share and 3 of tiny-mixtral's experts (the rest offloaded)."""
    h200 = load_profile("h200")
    fixed = without_experts(TINY, PROMPT + GEN, 4)
    return f"gpu.memory_bytes={h200.gpu.reserved_bytes + fixed + 3 * TINY.expert_bytes():.0f}"


@pytest.mark.parametrize(
    "extra",
    [
        ["--placement", "coactivation", "--replicas", "1", "--micro-batches", "2"],
        ["--placement", "round-robin", "--prefetch", "--micro-batches", "2", "--set", "OFFLOADING"],
    ],
    ids=["replicas", "offloading-prefetch"],
)
def test_the_runtime_executes_an_ep_configuration_the_simulator_wrote(tmp_path, extra):
    out = tmp_path / "ep"
    extra = [_small_h200() if x == "OFFLOADING" else x for x in extra]
    code, _, err = run_cli(
        "parallel", "--model", "tiny-mixtral", "--hardware", "h200", "--gpus", "2", "--batch-size", "8",
        "--prompt-len", str(PROMPT), "--gen-len", str(GEN), "--parallelism", "ep", "--timing", "events", *extra,
        "--out", str(out),
    )  # fmt: skip
    assert code == 0, err
    folder = next(p for p in out.iterdir() if p.is_dir())
    if "--prefetch" in extra:  # (what is executed copies experts in)
        ops = json.loads((folder / "schedule.json").read_text())["ops"]
        assert any(op.get("tensor") == "expert" for op in ops)
    measured = tmp_path / "measured"
    code, text, err = runtime_in_process(
        "execute", str(folder), "--dtype", "float32", "--emulate-fabric", "1e8", "--out", str(measured)
    )
    assert code == 0, err
    assert "ranks EMULATED: 2 expert-parallel ranks" in text and "computed once: yes" in text
    difference = float(text.split("max |difference| ")[1].split()[0])
    assert difference < 1e-4
    assert (measured / "summary.json").is_file()
    # the schedule file is checked against the plan rebuilt from the run's inputs
    written = json.loads((folder / "schedule.json").read_text())
    written["ops"] = written["ops"][:-1]
    (folder / "schedule.json").write_text(json.dumps(written))
    code, _, err = runtime_in_process("execute", str(folder))
    assert code == 2 and "not the schedule its plan gives now" in err and len(err.strip().splitlines()) == 1


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--device", "cuda"], "its ranks are emulated on the CPU"),
        (["--model", "tiny-mixtral"], "its model and routing are the run's own"),
    ],
)
def test_an_ep_folder_refuses_what_does_not_apply_in_one_line(tmp_path, flags, message):
    out = tmp_path / "ep"
    code, _, err = run_cli(
        "parallel", "--model", "tiny-mixtral", "--hardware", "h200", "--gpus", "2", "--gen-len", "3",
        "--parallelism", "ep", "--placement", "round-robin", "--timing", "events", "--out", str(out),
    )  # fmt: skip
    assert code == 0, err
    code, _, err = runtime_in_process("execute", str(out / "ep2-round-robin"), *flags)
    assert code == 2 and message in err and len(err.strip().splitlines()) == 1


# ---- ep.json is a file a user can edit: any value in any field is refused in one line or run -----------
JSON_VALUES = st.recursive(
    st.none() | st.booleans() | st.integers(-5, 70) | st.floats(allow_nan=False) | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=5), inner, max_size=3),
    max_leaves=5,
)


@pytest.fixture(scope="module")
def ep_folder(tmp_path_factory):
    out = tmp_path_factory.mktemp("ep")
    code, _, err = run_cli(
        "parallel", "--model", "tiny-mixtral", "--hardware", "h200", "--gpus", "2", "--gen-len", "3",
        "--parallelism", "ep", "--placement", "round-robin", "--timing", "events", "--out", str(out / "runs"),
    )  # fmt: skip
    assert code == 0, err
    folder = out / "runs" / "ep2-round-robin"
    return folder, json.loads((folder / "ep.json").read_text())


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.data(), JSON_VALUES)
def test_an_edited_ep_json_is_run_or_refused_in_one_line(ep_folder, data, value):
    """One field of ep.json (or a new one) set to any JSON value: the run goes on where the value is
    what was written, else `execute` says what is wrong in one line, never a traceback."""
    folder, base = ep_folder
    section = data.draw(st.sampled_from(["run", "setup", "events"]))
    key = data.draw(st.sampled_from([*sorted(base[section]), "unknown_field"]))
    edited = json.loads(json.dumps(base))
    edited[section][key] = value
    (folder / "ep.json").write_text(json.dumps(edited))
    try:
        code, _, err = runtime_in_process("execute", str(folder), "--dtype", "float32")
    finally:
        (folder / "ep.json").write_text(json.dumps(base))
    assert code in (0, 2), err
    assert code == 0 or (len(err.strip().splitlines()) == 1 and err.startswith("error: ")), err


def test_an_ep_folder_edited_or_written_over_is_refused_in_one_line(ep_folder, tmp_path):
    folder, base = ep_folder
    cases = []
    wrong = json.loads(json.dumps(base))
    wrong["run"]["model"] = "qwen3-30b-a3b"  # (not the routing's model)
    cases.append(("ep.json", json.dumps(wrong), [], "run does not match"))
    cases.append(("ep.json", '{"a":' * 100000 + "1" + "}" * 100000, [], "nested too deeply"))
    schedule = json.loads((folder / "schedule.json").read_text())
    edited = {**schedule, "meta": {**schedule["meta"], "ranks": 3}}
    cases.append(("schedule.json", json.dumps(edited), [], "its meta differ"))
    cases.append((None, None, ["--out", str(folder)], "the measured timeline would replace its simulated files"))
    for name, text, extra, message in cases:
        original = (folder / name).read_text() if name else None
        if name:
            (folder / name).write_text(text)
        try:
            code, _, err = runtime_in_process("execute", str(folder), "--dtype", "float32", *extra)
        finally:
            if name:
                (folder / name).write_text(original)
        assert code == 2 and message in err and len(err.strip().splitlines()) == 1, (name, err)
    code, _, err = runtime_in_process("execute", str(folder / "schedule.json"))
    assert code == 2 and "execute its folder, which must hold the ep.json" in err, err
