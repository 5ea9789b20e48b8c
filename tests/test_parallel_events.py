"""Ranks with resources of their own in the event engine (`gpu@1`, `pcie_h2d@1`, ...): golden
schedules by hand, and expert parallelism timed by events against the analytic timing of the same
plan (klotski_sim/parallel/events.py)."""

from __future__ import annotations

import json

import numpy as np
import pytest

from klotski_sim.core.engine import simulate
from klotski_sim.core.schedule import Op, Schedule, ScheduleError
from klotski_sim.hardware.profile import load_profile, with_overrides
from klotski_sim.parallel.decode import STAGING_SLOTS, ParallelSetup, plan_expert_parallel, simulate_decode
from klotski_sim.parallel.events import EpEvents, ep_schedule, rank_streams, simulate_ep_events
from klotski_sim.runs.runner import RunSpec, make_replay
from klotski_sim.serving.policies.fluxmoe import COMPRESSED_SHARE
from klotski_sim.util.errors import UsageError
from klotski_sim.workload.model import get_model

from .conftest import make_profile, run_cli

TWO_RANKS = {**rank_streams(0), **rank_streams(1)}


def _op(op_id: str, stream: str, deps: tuple[str, ...] = (), **kw: object) -> Op:
    kind = "transfer" if stream.startswith("h2d") else "compute"
    if kind == "transfer":
        kw = {"src": "cpu", "dst": "gpu", "bytes": 1, **kw}
    return Op(op_id, kind, stream, str(kw.pop("category", "attention")), deps, **kw)  # type: ignore[arg-type]


# ---- the engine: each rank's resources are its own -------------------------------------------------
def test_golden_two_ranks_compute_at_once_and_their_collective_waits_for_the_slower():
    """a0 (2 s) on rank 0 and a1 (3 s) on rank 1 run at once; each rank's part of an all-to-all
    (x0, x1: 1 s) starts when both have joined, at 3; rank 0's GPU idles 1 s waiting for it."""
    s = Schedule(
        (
            _op("a0", "compute@0"),
            _op("a1", "compute@1"),
            _op("x0", "alltoall@0", ("a0", "a1"), category="alltoall"),
            _op("x1", "alltoall@1", ("a0", "a1"), category="alltoall"),
            _op("m0", "compute@0", ("x0",), category="moe"),
            _op("m1", "compute@1", ("x1",), category="moe"),
        ),
        TWO_RANKS,
    )
    tl = simulate(s, make_profile(issue="per-stream"), durations=[2, 3, 1, 1, 1, 1])
    df = tl.df.set_index("op_id")
    assert (df.at["a0", "start"], df.at["a1", "end"]) == (0, 3)
    assert (df.at["x0", "start"], df.at["x1", "start"]) == (3, 3)
    assert tl.makespan == 5
    rank0 = tl.rank_view(0).summary()
    assert rank0.bubble_s == 2.0 and rank0.bubble_by_cause == {
        "alltoall": 2.0
    }  # waits [2, 4]: the slower rank, the exchange
    assert tl.rank_view(1).summary().bubble_s == 1.0
    assert tl.ranks() == [0, 1]
    with pytest.raises(KeyError):
        tl.rank_view(2)


def test_golden_each_rank_has_its_own_memory_and_its_own_issuing_thread():
    """Each GPU holds 10 bytes: rank 0's 8 preloaded bytes leave rank 1's 8 untouched; rank 1's
    copy of 3 more bytes runs out on rank 1 alone. Two ranks' launches (1 s each to issue) are
    issued by two threads at once, not one after another."""
    preloaded = (("w@0", 8), ("w@1", 8))
    copies = Schedule(
        (_op("t0", "h2d@0", alloc=(("b@0", 2),)), _op("t1", "h2d@1", alloc=(("b@1", 3),))), TWO_RANKS, preloaded
    )
    tl = simulate(copies, make_profile(memory_bytes=10, issue="per-stream"), durations=[1, 1])
    assert tl.status == "oom" and tl.meta["oom"]["op_id"] == "t1" and "rank 1" in tl.meta["oom"]["detail"]
    fits = Schedule((_op("t0", "h2d@0", alloc=(("b@0", 2),)),), TWO_RANKS, preloaded)
    ok = simulate(fits, make_profile(memory_bytes=10, issue="per-stream"), durations=[1])
    assert ok.status == "ok" and ok.meta["rank_peak_gpu_bytes"] == [10, 8]
    launches = Schedule(
        (
            _op("c0", "compute@0", category="embed"),
            _op("c1", "compute@1", category="embed"),
            _op("p1", "cpu_compute@1", ("c1",), category="expert"),  # (on the CPU both ranks share: rank 1's thread)
        ),
        TWO_RANKS,
    )
    serial = simulate(launches, make_profile(kernel_overhead_s=1.0), durations=[2, 2, 1]).df.set_index("op_id")
    assert serial.at["c0", "end"] == serial.at["c1", "end"] == 2  # (one thread would issue c1 2 s late)
    assert serial.at["p1", "end"] == 3


@pytest.mark.parametrize(
    ("streams", "buffers", "message"),
    [
        ({"compute": "gpu@x"}, (), "unknown resource 'gpu@x'"),
        ({"compute": "gpu@01"}, (), "unknown resource 'gpu@01'"),
        ({"compute": "tpu@1"}, (), "unknown resource 'tpu@1'"),
        ({"compute@0": "gpu@0"}, (("weights", 1),), "buffer 'weights': a schedule of several ranks"),
    ],
)
def test_the_schedule_check_names_a_bad_rank_or_a_buffer_on_no_rank(streams, buffers, message):
    with pytest.raises(ScheduleError, match=message):
        Schedule((), streams, buffers)


# ---- expert parallelism timed by events -----------------------------------------------------------
def _run(model_name: str, hardware: str, batch: int, gen_len: int = 4, **overrides: object):
    spec = RunSpec(model=model_name, hardware=hardware, batch_size=batch, num_batches=1, prompt_len=32, gen_len=gen_len)
    model = get_model(model_name)
    _, rep = make_replay(spec, model, 1)
    profile = load_profile(hardware)
    if overrides:
        profile = with_overrides(profile, overrides)
    return model, profile, rep.routing


@pytest.mark.parametrize(
    ("model_name", "hardware", "gpus", "batch"),
    [("mixtral-8x7b", "l40s", 4, 64), ("qwen3-30b-a3b", "h20", 8, 64), ("tiny-mixtral", "h200", 2, 8)],
)
@pytest.mark.parametrize(("placement", "spare"), [("round-robin", 0), ("coactivation", 1)])
def test_without_offloading_or_latencies_the_engine_gives_the_analytic_step(
    model_name, hardware, gpus, batch, placement, spare
):
    """With every expert resident, no signalling latency and no issuing thread, each layer's ranks
    meet at both collectives, so the engine's step is the analytic sum of each phase's slowest rank."""
    model, profile, routing = _run(
        model_name, hardware, batch, **{"gpu.dependency_latency_s": 0.0, "gpu.issue": "per-stream"}
    )
    setup = ParallelSetup(gpus, "ep", placement, spare)
    analytic = simulate_decode(model, profile, routing, setup)
    events = simulate_ep_events(model, profile, routing, setup)
    assert events.result.step_s == pytest.approx(analytic.step_s, rel=1e-9)
    assert events.result.utilisation == pytest.approx(analytic.utilisation, rel=1e-9)
    assert events.result.all_to_all_bytes == pytest.approx(analytic.all_to_all_bytes)
    assert events.result.streamed_bytes == analytic.streamed_bytes == 0.0
    # and with the profile's latencies and its issuing thread, a little slower, never faster
    model, profile, routing = _run(model_name, hardware, batch)
    real = simulate_ep_events(model, profile, routing, setup).result.step_s
    assert analytic.step_s <= real * (1 + 1e-9) and real < analytic.step_s * 1.05


def _offloading():
    """Mixtral-8x7B on 2 L40S, 32 sequences: each rank keeps 5 of its 128 experts in host memory."""
    return _run("mixtral-8x7b", "l40s", 32, gen_len=5)


def test_offloading_ranks_copy_each_used_expert_they_do_not_hold_once_and_compute_every_token_once():
    model, profile, routing = _offloading()
    setup = ParallelSetup(2, "ep")
    plan = plan_expert_parallel(model, profile, routing, setup)
    assert plan.offload is not None
    schedule, _ = ep_schedule(model, plan, routing)
    copies = [op for op in schedule.ops if op.kind == "transfer"]
    analytic = simulate_decode(model, profile, routing, setup)
    assert len(copies) * model.expert_bytes() / (routing.shape.gen_len - 1) == pytest.approx(analytic.streamed_bytes)
    # every (token, expert) pair of every decode step computed exactly once, on one rank
    moe = [op for op in schedule.ops if op.category == "moe"]
    sequences = routing.shape.num_sequences
    assert sum(op.tokens for op in moe) == sequences * routing.top_k * len(model.moe_layers) * (
        routing.shape.gen_len - 1
    )
    run = simulate_ep_events(model, profile, routing, setup)
    capacity = profile.gpu.usable_bytes
    peaks = run.timeline.meta["rank_peak_gpu_bytes"]
    assert len(peaks) == 2 and max(peaks) <= capacity
    assert max(peaks) > min(op.alloc[0][1] for op in copies)  # (the copies' buffers were taken)
    # the rank waits for its copies: its GPU idles, blamed on the expert copies
    worst = max(run.bubble_s)
    assert worst > 0 and run.timeline.rank_view(0).summary().bubble_by_cause.get("expert", 0) > 0


def test_prefetch_copies_only_what_the_step_before_used_and_never_reads_the_step_it_decides():
    model, profile, routing = _offloading()
    setup = ParallelSetup(2, "ep")
    plan = plan_expert_parallel(model, profile, routing, setup)
    schedule, builder = ep_schedule(model, plan, routing, EpEvents(prefetch=True))
    at = {(p.step, p.layer): p for p in plan.layers}
    early = [op for op in schedule.ops if "/pre/" in op.id]
    assert early and builder.prefetched == len(early)
    for op in early:
        rank = int(op.stream.rsplit("@", 1)[1])
        step = op.step - 1  # (0-based decode step)
        assert step >= 1, op.id  # (the first decode step has no step before it)
        assert at[(step - 1, op.layer)].assigned[op.expert, rank] > 0, op.id
        assert not plan.offload.on_gpu[op.layer][op.expert, rank], op.id  # (never one it holds)
    per_layer = {}
    for op in early:
        per_layer[(op.step, op.layer, op.stream)] = per_layer.get((op.step, op.layer, op.stream), 0) + 1
    assert max(per_layer.values()) <= STAGING_SLOTS
    run = simulate_ep_events(model, profile, routing, setup, EpEvents(prefetch=True))
    df = run.timeline.df.set_index("op_id")
    for op in early:  # (copied no earlier than the rank saw the step before's routing of that layer)
        seen = f"s{op.step - 1}/L{op.layer}/r{op.stream.rsplit('@', 1)[1]}/dispatch"
        assert df.at[op.id, "start"] >= df.at[seen, "end"], op.id
    without = simulate_ep_events(model, profile, routing, setup)
    assert run.result.step_s <= without.result.step_s * (1 + 1e-9)  # (copies start earlier, never later)
    assert 0 < run.prefetch_used <= run.prefetched
    assert (
        run.timeline.meta["rank_peak_gpu_bytes"]
        and max(run.timeline.meta["rank_peak_gpu_bytes"]) <= profile.gpu.usable_bytes
    )


def _tokens_computed(schedule: Schedule) -> int:
    """Token-expert pairs computed: the fused kernels' tokens on the GPUs, the experts' on the CPU."""
    return sum(op.tokens for op in schedule.ops if op.category == "moe" or op.stream.startswith("cpu_compute"))


@pytest.mark.parametrize("offloaded", ["copy", "compressed", "cpu"])
@pytest.mark.parametrize("micro_batches", [1, 2, 3])
def test_micro_batches_and_cpu_experts_compute_every_token_once_and_copy_an_expert_once(offloaded, micro_batches):
    """However a rank runs (micro-batches in flight, the experts it lacks copied in or computed on
    the shared CPU), every decode token-expert pair is computed once, an expert a rank lacks is
    copied at most once a layer whatever the micro-batches, and the shared CPU runs one op at a time."""
    model, profile, routing = _offloading()
    setup = ParallelSetup(2, "ep")
    plan = plan_expert_parallel(model, profile, routing, setup)
    how = EpEvents(micro_batches=micro_batches, offloaded_experts=offloaded)
    schedule, _ = ep_schedule(model, plan, routing, how)
    steps = routing.shape.gen_len - 1
    pairs = routing.shape.num_sequences * routing.top_k * len(model.moe_layers) * steps
    assert _tokens_computed(schedule) == pairs
    copies = [op for op in schedule.ops if op.kind == "transfer" and op.tensor == "expert"]
    one_batch, _ = ep_schedule(model, plan, routing)
    assert len(copies) == (0 if offloaded == "cpu" else sum(op.tensor == "expert" for op in one_batch.ops))
    dispatches = [op for op in schedule.ops if op.category == "alltoall" and "dispatch" in op.id]
    assert len(dispatches) == 2 * micro_batches * len(model.moe_layers) * steps
    run = simulate_ep_events(model, profile, routing, setup, how)
    df = run.timeline.df
    cpu = df[df["resource"] == "cpu"].sort_values("start")
    assert (len(cpu) > 0) == (offloaded == "cpu")
    assert (cpu["start"].to_numpy()[1:] >= cpu["end"].to_numpy()[:-1] - 1e-12).all()  # (one op at a time)
    assert max(run.timeline.meta["rank_peak_gpu_bytes"]) <= profile.gpu.usable_bytes


def test_a_compressed_tier_keeps_every_expert_in_one_tier_and_stages_each_used_one_once():
    """FluxMoE's compressed tier per rank: each expert a rank homes is uncompressed, compressed or
    in host memory (one of the three), no more in host memory than without the tier, the rank's
    bytes within its GPU; each used expert it lacks staged once a layer (decompressed or copied)."""
    model, profile, routing = _offloading()
    setup = ParallelSetup(2, "ep")
    plain = plan_expert_parallel(model, profile, routing, setup)
    tiered = plan_expert_parallel(model, profile, routing, setup, COMPRESSED_SHARE)
    assert plain.offload is not None and tiered.offload is not None
    assert tiered.offload.host_bytes <= plain.offload.host_bytes
    assert tiered.offload.compressed_saving > 0
    for layer in model.moe_layers:
        both = tiered.offload.on_gpu[layer] & tiered.offload.compressed[layer]
        assert not both.any(), layer
    schedule, _ = ep_schedule(model, tiered, routing, EpEvents(offloaded_experts="compressed"))
    staged = [op for op in schedule.ops if op.category == "decompress" or op.tensor == "expert"]
    used_elsewhere = sum(
        int(((p.assigned[:, k] > 0) & ~tiered.offload.on_gpu[p.layer][:, k]).sum())
        for p in tiered.layers
        for k in range(2)
    )
    assert len(staged) == used_elsewhere
    assert any(op.category == "decompress" for op in staged)
    run = simulate_ep_events(model, profile, routing, setup, EpEvents(offloaded_experts="compressed"))
    copy = simulate_ep_events(model, profile, routing, setup)
    assert run.result.streamed_bytes <= copy.result.streamed_bytes
    assert run.result.rank_bytes <= profile.gpu.memory_bytes - profile.gpu.reserved_bytes
    assert max(run.timeline.meta["rank_peak_gpu_bytes"]) <= profile.gpu.usable_bytes
    assert _tokens_computed(schedule) == routing.shape.num_sequences * routing.top_k * len(model.moe_layers) * (
        routing.shape.gen_len - 1
    )


def test_a_compressed_tier_is_refused_with_its_reason_where_it_has_no_measurement():
    compressed = EpEvents(offloaded_experts="compressed")
    model, profile, routing = _run("tiny-mixtral", "l40s", 8)
    with pytest.raises(UsageError, match="not 16-bit floats.*FluxMoE's measurement on bf16"):
        simulate_ep_events(get_model("tiny-mixtral@int8"), profile, routing, ParallelSetup(2, "ep"), compressed)
    model, profile, routing = _run("tiny-mixtral", "h200", 8)  # (no decompression rate in the profile)
    with pytest.raises(UsageError, match="has no gpu.decompress_bandwidth"):
        simulate_ep_events(model, profile, routing, ParallelSetup(2, "ep"), compressed)


def test_the_runtime_refuses_a_schedule_of_ranks_in_one_line():
    pytest.importorskip("torch")
    from klotski_runtime.executor import check_tensor_parallel

    model, profile, routing = _run("tiny-mixtral", "h200", 8)
    plan = plan_expert_parallel(model, profile, routing, ParallelSetup(2, "ep"))
    schedule, _ = ep_schedule(model, plan, routing)
    with pytest.raises(ScheduleError, match="runs from its plan on emulated ranks"):
        check_tensor_parallel(schedule, model)


def test_the_parallel_command_times_ep_by_events_and_writes_each_ranks_summary(tmp_path):
    args = ["parallel", "--model", "tiny-mixtral", "--hardware", "h200", "--gpus", "2", "--gen-len", "3"]
    code, out, err = run_cli(
        *args, "--batch-size", "8", "--placement", "round-robin", "--timing", "events", "--out", str(tmp_path)
    )
    assert code == 0, err
    assert "bubbles ms" in out and "EP timed in the event engine" in out
    ranks = json.loads((tmp_path / "ep2-round-robin" / "ranks.json").read_text())
    assert len(ranks) == 2 and all(r["gpu_busy_s"] > 0 for r in ranks)
    assert (tmp_path / "ep2-round-robin" / "trace.json.gz").stat().st_size > 0
    code, _, err = run_cli(*args, "--prefetch", "--micro-batches", "2")
    assert code == 2 and err.strip() == (
        "error: --prefetch, --micro-batches 2: only with --timing events (the event engine's runs)"
    )
    code, _, err = run_cli(*args, "--timing", "events", "--prefetch", "--offloaded-experts", "cpu")
    assert code == 2 and err.strip() == (
        "error: --prefetch copies experts in; with --offloaded-experts cpu nothing is copied"
    ), err
    np.testing.assert_equal(len(err.strip().splitlines()), 1)
