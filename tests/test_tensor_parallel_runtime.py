"""The CPU runtime executes a tensor-parallel group's schedule (`simulate --gpus G`) on G emulated
ranks (klotski_runtime/ranks.py): each rank its heads and its share of every FFN, the schedule's
all-reduces adding the ranks' partial sums. Its logits are the one-GPU run's."""

from dataclasses import replace

import pytest

torch = pytest.importorskip("torch")

from klotski_runtime.executor import ExecOptions, execute  # noqa: E402
from klotski_runtime.kernels import WeightStore  # noqa: E402
from klotski_sim.core.schedule import Schedule, ScheduleError  # noqa: E402
from klotski_sim.hardware.profile import FabricSpec, load_profile  # noqa: E402
from klotski_sim.parallel.tensor import group_machine  # noqa: E402
from klotski_sim.policies import Placement, PolicyInput, build_schedule  # noqa: E402
from klotski_sim.workload.model import ModelSpec, get_model  # noqa: E402
from klotski_sim.workload.routing import RunShape  # noqa: E402
from klotski_sim.workload.trace import replay  # noqa: E402
from klotski_sim.workload.trace_synth import synthesize  # noqa: E402

from .timeline_checks import assert_respects  # noqa: E402

TINY = get_model("tiny-mixtral")
# Llama 4's shape in small: experts every second layer with a shared expert, a dense MLP between
INTERLEAVED = replace(
    TINY,
    name="tiny-interleaved",
    num_layers=4,
    moe_layer_step=2,
    dense_ffn_size=96,
    num_shared_experts=1,
    shared_ffn_size=32,
    hf_model_type="qwen2_moe",
)


def _inputs(
    model: ModelSpec, gpus: int, policy: str, placement: Placement = Placement()
) -> tuple[Schedule, Schedule, PolicyInput]:
    """The schedule of `policy` on one H200 and on a group of `gpus`, over the same routing."""
    shape = RunShape(2, 2, 5, 3)
    rep = replay(synthesize(model, shape.num_sequences + 2, 5, 3, "calibrated", 0), model, shape, warmup_sequences=2)
    one = PolicyInput(model, load_profile("h200"), rep.routing, placement, warmup=rep.warmup)
    group = replace(one, profile=group_machine(load_profile("h200"), gpus, model))
    return build_schedule(policy, one), build_schedule(policy, group), one


@pytest.mark.parametrize("model", [TINY, INTERLEAVED], ids=["tiny-mixtral", "interleaved-shared"])
@pytest.mark.parametrize("policy", ["klotski", "flexgen", "single-batch"])
def test_a_group_computes_the_one_gpu_logits(model, policy):
    one, group, inp = _inputs(model, 2, policy)
    assert group.meta["tensor_parallel"] == 2 and any(o.category == "allreduce" for o in group.ops)
    weights = WeightStore.random(model, dtype=torch.float32)
    _, ref = execute(one, model, weights, inp.routing, ExecOptions(record_logits=True))
    timeline, runner = execute(group, model, weights, inp.routing, ExecOptions(record_logits=True))
    assert runner.ranks is not None and runner.ranks.count == 2
    assert runner.logits.keys() == ref.logits.keys() and ref.logits
    for key, logits in ref.logits.items():
        torch.testing.assert_close(runner.logits[key], logits, atol=1e-4, rtol=1e-4)
    assert not runner.attention_partials and not runner.mlp_partials  # every partial sum was reduced
    assert_respects(group, timeline)


def test_a_group_with_its_kv_cache_in_host_memory_copies_whole_chunks_and_computes_the_same():
    """The KV cache keeps the one-device layout, so the copies to and from host memory are unchanged."""
    one, group, inp = _inputs(TINY, 2, "klotski", Placement(kv="cpu"))
    assert sum(o.kind == "transfer" and o.tensor == "kv" for o in group.ops) > 0
    weights = WeightStore.random(TINY, dtype=torch.float32)
    _, ref = execute(one, TINY, weights, inp.routing, ExecOptions(record_logits=True))
    _, runner = execute(group, TINY, weights, inp.routing, ExecOptions(record_logits=True))
    for key, logits in ref.logits.items():
        torch.testing.assert_close(runner.logits[key], logits, atol=1e-4, rtol=1e-4)


def test_four_ranks_split_the_heads_and_the_widths_four_ways():
    model = replace(TINY, name="tiny-4-kv", num_kv_heads=4)
    one, group, inp = _inputs(model, 4, "klotski")
    weights = WeightStore.random(model, dtype=torch.float32)
    _, ref = execute(one, model, weights, inp.routing, ExecOptions(record_logits=True))
    _, runner = execute(group, model, weights, inp.routing, ExecOptions(record_logits=True))
    assert runner.ranks is not None and runner.ranks.rank_spec.num_heads == 1
    for key, logits in ref.logits.items():
        torch.testing.assert_close(runner.logits[key], logits, atol=1e-4, rtol=1e-4)


def test_an_emulated_fabric_holds_each_all_reduce_to_its_time():
    from klotski_sim.core.collectives import best_all_reduce

    _, group, inp = _inputs(TINY, 2, "klotski")
    slow = FabricSpec(kind="pcie", gpus=2, bandwidth=2e6, base_latency_s=1e-3, step_latency_s=0.0)
    weights = WeightStore.random(TINY, dtype=torch.float32)
    timeline, _ = execute(group, TINY, weights, inp.routing, ExecOptions(emulate_fabric=slow))
    reduces = timeline.df[timeline.df["category"] == "allreduce"]
    assert len(reduces) == sum(o.category == "allreduce" for o in group.ops)
    for _, row in reduces.iterrows():
        assert row["end"] - row["start"] >= best_all_reduce(row["bytes"], 2, slow)[0] * 0.999


def test_what_the_ranks_cannot_execute_is_refused_before_it_runs():
    _, group, inp = _inputs(TINY, 2, "klotski")
    weights = WeightStore.random(TINY, dtype=torch.float32)
    expert = next(i for i, o in enumerate(group.ops) if o.category == "expert")
    on_cpu = Schedule(
        group.ops[:expert] + (group.ops[expert]._replace(stream="cpu_compute"),) + group.ops[expert + 1 :],
        {**group.streams, "cpu_compute": "cpu"},
        group.preloaded,
        group.meta,
    )
    with pytest.raises(ScheduleError, match=r"op '.*': the ranks of a tensor-parallel group execute the GPU side"):
        execute(on_cpu, TINY, weights, inp.routing)
    three = Schedule(group.ops, group.streams, group.preloaded, {**group.meta, "tensor_parallel": 3})
    with pytest.raises(ScheduleError, match="its 2 KV heads are fewer than the 3 ranks: the simulation gives each"):
        execute(three, TINY, weights, inp.routing)
    with pytest.raises(ScheduleError, match="ffn_size 129 not divisible by 2 ranks"):
        execute(group, replace(TINY, ffn_size=129), weights, inp.routing)
    for bad in (True, 1.5, "2", 0):
        odd = Schedule(group.ops, group.streams, group.preloaded, {**group.meta, "tensor_parallel": bad})
        with pytest.raises(ScheduleError, match="meta tensor_parallel must be the group's GPU count"):
            execute(odd, TINY, weights, inp.routing)
    one, _, _ = _inputs(TINY, 2, "klotski")
    claimed = Schedule(one.ops, one.streams, one.preloaded, {**one.meta, "tensor_parallel": 2})
    with pytest.raises(ScheduleError, match="meta tensor_parallel 2, but the schedule has 0 all-reduce ops where"):
        execute(claimed, TINY, weights, inp.routing)
    lost = Schedule(
        group.ops, group.streams, group.preloaded, {k: v for k, v in group.meta.items() if k != "tensor_parallel"}
    )
    with pytest.raises(ScheduleError, match="an all-reduce in a schedule whose meta names no tensor_parallel group"):
        execute(lost, TINY, weights, inp.routing)


def test_execute_runs_a_simulated_group_and_labels_its_ranks_and_fabric(tmp_path):
    from .conftest import run_cli, runtime_in_process

    run = ("--model", "tiny-mixtral", "--policy", "klotski", "--batch-size", "2", "--num-batches", "2")
    run += ("--prompt-len", "6", "--gen-len", "3")
    code, _, err = run_cli("simulate", *run, "--hardware", "h200", "--gpus", "2", "--out", str(tmp_path / "tp"))
    assert code == 0, err
    code, out, err = runtime_in_process("execute", str(tmp_path / "tp"), "--emulate-fabric", "1e9")
    assert code == 0, err
    assert "ranks EMULATED: 2 tensor-parallel ranks as threads of this host, all-reduces held to a 1.00 GB/s" in out
    code, _, err = run_cli("simulate", *run, "--out", str(tmp_path / "one"))
    assert code == 0, err
    code, _, err = runtime_in_process("execute", str(tmp_path / "one"), "--emulate-fabric", "1e9")
    assert code == 2 and "--emulate-fabric 1e+09: applies to a tensor-parallel schedule" in err, err
    assert len(err.strip().splitlines()) == 1
