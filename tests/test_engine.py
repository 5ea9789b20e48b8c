import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from klotski_sim.core.engine import EngineDeadlock, simulate
from klotski_sim.core.schedule import DEFAULT_STREAMS, LINK_DIRECTIONS, Op, Schedule, ScheduleError, topological_order

from .conftest import make_profile
from .timeline_checks import assert_respects

STREAMS = {
    "compute": "gpu",
    "aux": "gpu",
    "h2d_a": "pcie_h2d",
    "h2d_b": "pcie_h2d",
    "d2h": "pcie_d2h",
    "disk_read": "nvme",
}


def op(op_id, kind, stream, deps=(), category=None, **kw):
    if kind == "transfer":  # (the direction of the stream's link)
        src, dst = LINK_DIRECTIONS.get(STREAMS.get(stream) or DEFAULT_STREAMS.get(stream), ("cpu", "gpu"))
        kw.setdefault("bytes", 1)
        kw.setdefault("src", src)
        kw.setdefault("dst", dst)
    return Op(op_id, kind, stream, category or ("weights" if kind == "transfer" else "attention"), tuple(deps), **kw)


def golden_schedule():
    return Schedule(
        (
            op("w0", "transfer", "h2d_weights", category="weights"),
            op("e0", "transfer", "h2d_experts", category="moe_weights"),
            op("a0", "compute", "compute", ["w0"], category="attention"),
            op("x0", "compute", "compute", ["e0"], category="expert"),
        )
    )


def test_golden_shared_copy_engine():
    """w0 (2 s) and e0 (3 s) share one H2D engine: w0 runs [0,2], e0 [2,5]; a0 [2,3]; x0 waits
    for e0 and runs [5,6], leaving a 2 s intra-layer bubble caused by the expert load."""
    tl = simulate(golden_schedule(), make_profile(), durations=[2, 3, 1, 1])
    df = tl.df.set_index("op_id")
    assert df.loc["e0", ["start", "end"]].tolist() == [2, 5]
    assert df.loc["x0", ["start", "end"]].tolist() == [5, 6]
    s = tl.summary()
    assert s.makespan_s == 6 and s.gpu_busy_s == 2
    assert s.bubble_s == 2 and s.bubble_intra_s == 2 and s.bubble_inter_s == 0
    assert s.bubble_by_cause == {"moe_weights": 2}
    assert s.lower_bound_s == 5 and s.lower_bound_resource == "pcie_h2d"
    assert s.efficiency == pytest.approx(5 / 6)


def test_golden_two_copy_engines_remove_the_bubble():
    tl = simulate(golden_schedule(), make_profile(copy_engines=2), durations=[2, 3, 1, 1])
    df = tl.df.set_index("op_id")
    assert df.loc["e0", ["start", "end"]].tolist() == [0, 3]
    assert tl.summary().bubble_s == 0 and tl.makespan == 4


def test_golden_inter_layer_bubble_and_cost_model():
    """Cost model path: a 1 GB transfer at 1 GB/s takes 1 s, a 1e12-FLOP op 1 s at 1 TFLOP/s."""
    s = Schedule(
        (
            op("a0", "compute", "compute", flops=int(1e12)),
            op("w1", "transfer", "h2d_weights", bytes=int(2e9)),
            op("a1", "compute", "compute", ["w1"], flops=int(1e12)),
        )
    )
    tl = simulate(s, make_profile())
    summary = tl.summary()
    assert tl.makespan == pytest.approx(3.0)
    assert summary.bubble_inter_s == pytest.approx(1.0)  # a1 waits 1 s for attention weights
    assert summary.bubble_intra_s == 0


def test_out_of_memory_is_a_status_not_a_crash():
    s = Schedule(
        (
            op("w0", "transfer", "h2d_a", alloc=(("w0", 600),)),
            op("w1", "transfer", "h2d_a", alloc=(("w1", 600),)),
            op("a", "compute", "compute", ["w0", "w1"], free=("w0", "w1")),
        ),
        streams=STREAMS,
    )
    tl = simulate(s, make_profile(memory_bytes=1000), durations=[1, 1, 1])
    assert tl.status == "oom"
    oom = tl.meta["oom"]
    assert oom["op_id"] == "w1" and oom["needed_bytes"] == 1200 and oom["available_bytes"] == 1000
    summary = tl.summary()
    assert summary.throughput_tok_s == 0 and summary.status == "oom"


def test_deadlock_is_reported_not_hung():
    ops = (op("a", "compute", "compute", ["y"]), op("y", "transfer", "h2d_weights", ["a"]))
    s = Schedule(ops, validate=False)
    with pytest.raises(EngineDeadlock, match="2 op\\(s\\) can never start: a, y"):
        simulate(s, make_profile(), durations=[1, 1])


def test_a_run_leaves_no_reference_cycle():
    """The collector is paused while the engine runs: what a run allocates must go by reference
    counting, signalled dependencies and out-of-memory runs included."""
    import gc

    runs = [
        (golden_schedule(), make_profile(dependency_latency_s=0.5), [2, 3, 1, 1]),
        (
            Schedule((op("w0", "transfer", "h2d_a", alloc=(("w0", 600),)),), streams=STREAMS),
            make_profile(memory_bytes=100),
            [1],
        ),
    ]
    gc.collect()
    was = gc.isenabled()
    gc.disable()
    try:
        assert [simulate(*run[:2], durations=run[2]).status for run in runs] == ["ok", "oom"]
        assert gc.collect() == 0
    finally:
        if was:
            gc.enable()


def test_zero_duration_ops_and_empty_schedule():
    tl = simulate(Schedule((op("a", "compute", "compute"),)), make_profile(), durations=[0.0])
    assert tl.makespan == 0 and tl.summary().bubble_s == 0
    assert len(simulate(Schedule(()), make_profile())) == 0


# ---- properties over random valid schedules ----------------------------------------------------
@st.composite
def random_schedules(draw):
    n = draw(st.integers(1, 30))
    names = list(STREAMS)
    ops, durations, live = [], [], []
    for i in range(n):
        stream = draw(st.sampled_from(names))
        kind = "compute" if STREAMS[stream] == "gpu" else "transfer"
        deps = sorted(set(draw(st.lists(st.integers(0, i - 1), max_size=3)))) if i else []
        dep_ids = [f"o{d}" for d in deps]
        alloc, free = (), ()
        # free only buffers whose allocator is a dependency (so the free is ordered after it)
        freeable = [b for b in live if b[1] in dep_ids]
        if freeable and draw(st.booleans()):
            name = freeable[0][0]
            free = (name,)
            live.remove(freeable[0])
        if draw(st.booleans()):
            alloc = ((f"buf{i}", draw(st.integers(0, 400))),)
            live.append((f"buf{i}", f"o{i}"))
        ops.append(
            op(
                f"o{i}",
                kind,
                stream,
                dep_ids,
                alloc=alloc,
                free=free,
                category=draw(st.sampled_from(["attention", "expert", "gate"])) if kind == "compute" else None,
            )
        )
        durations.append(draw(st.floats(0, 5, allow_nan=False)))
    capacity = draw(st.sampled_from([300, 800, 1e6]))
    engines = draw(st.integers(1, 2))
    latency = draw(st.sampled_from([0.0, 0.3]))
    return (
        Schedule(tuple(ops), streams=STREAMS),
        durations,
        make_profile(memory_bytes=capacity, copy_engines=engines, dependency_latency_s=latency),
    )


@given(random_schedules())
def test_engine_invariants(case):
    schedule, durations, profile = case
    tl = simulate(schedule, profile, durations=durations)
    assert_respects(
        schedule, tl, profile.gpu.dependency_latency_s, tl.meta["capacities"], in_order_ends=True, host_waits=False
    )
    df = tl.df.set_index("op_id")
    assert tl.status == "oom" or all(o.id in df.index for o in schedule.ops)
    for o in schedule.ops:
        if o.id in df.index:
            assert df.at[o.id, "end"] - df.at[o.id, "start"] == pytest.approx(durations[schedule.index[o.id]])
    # busy + bubbles == span on the GPU
    gpu = df[df["resource"] == "gpu"]
    if len(gpu):
        span = gpu["end"].max() - gpu["start"].min()
        s = tl.summary()
        assert s.gpu_busy_s + s.bubble_s == pytest.approx(span, abs=1e-9)
        assert s.bubble_inter_s + s.bubble_intra_s == pytest.approx(s.bubble_s)
    # memory never exceeds capacity unless the run reports oom
    if tl.status == "ok":
        assert tl.meta["peak_gpu_bytes"] <= profile.gpu.usable_bytes
        assert len(tl) == len(schedule)
    else:
        assert tl.meta["oom"]["needed_bytes"] > profile.gpu.usable_bytes
    assert max(tl.memory[1]) == tl.meta["peak_gpu_bytes"]
    # deterministic
    again = simulate(schedule, profile, durations=durations)
    assert again.df.equals(tl.df)


@given(random_schedules())
def test_dispatch_serves_the_earliest_ready_first_and_idles_no_unit(case):
    """The three rules, exactly, with memory to spare: an op is ready when its deps have ended (plus
    the signalling latency, from another stream) and its stream predecessor has; it starts at once if
    a unit of its resource is free, else when one frees, every unit busy meanwhile; and no op that
    waits starts after one of later (ready time, schedule position)."""
    schedule, durations, drawn = case
    profile = make_profile(
        copy_engines=drawn.link("pcie_h2d").copy_engines, dependency_latency_s=drawn.gpu.dependency_latency_s
    )
    tl = simulate(schedule, profile, durations=durations)
    assert tl.status == "ok"
    c = tl.columns
    start, end, ready, resource = (list(c[k]) for k in ("start", "end", "ready", "resource"))
    caps = tl.meta["capacities"]
    index, latency = schedule.index, profile.gpu.dependency_latency_s
    previous: dict[str, int] = {}
    for i, o in enumerate(schedule.ops):
        seen = [end[index[d]] + (latency if schedule.op(d).stream != o.stream else 0.0) for d in o.deps]
        if o.stream in previous:
            seen.append(end[previous[o.stream]])
        previous[o.stream] = i
        assert ready[i] == max(seen, default=0.0)
        assert start[i] >= ready[i]
        on_resource = [k for k in range(len(start)) if resource[k] == resource[i]]
        if start[i] > ready[i]:  # it waited: every unit was busy from its ready time until one freed at its start
            assert any(end[k] == start[i] for k in on_resource)
            for t in [ready[i]] + [end[k] for k in on_resource if ready[i] < end[k] < start[i]]:
                assert sum(start[k] <= t < end[k] for k in on_resource) == caps[resource[i]]
        for k in on_resource:  # none served before i that i was ready before and precedes
            if start[k] < start[i] and ready[i] < start[k]:
                assert (ready[k], k) < (ready[i], i)


def _cyclic(n: int, edges: set[tuple[int, int]]) -> bool:
    """The reference: a depth-first search meets an op still on its path."""
    successors: dict[int, list[int]] = {i: [] for i in range(n)}
    for a, b in edges:
        successors[a].append(b)
    state = [0] * n  # 0: not seen, 1: on the path, 2: done

    def visit(i: int) -> bool:
        state[i] = 1
        for s in successors[i]:
            if state[s] == 1 or (state[s] == 0 and visit(s)):
                return True
        state[i] = 2
        return False

    return any(state[i] == 0 and visit(i) for i in range(n))


@st.composite
def op_graphs(draw):
    """Ops on three streams, each depending on up to two of the three before it (chains, along which
    an op can lead to a later one), then on up to three later ops: a cycle where one leads back."""
    n = draw(st.integers(1, 8))
    streams = draw(st.lists(st.sampled_from(["compute", "h2d_a", "d2h"]), min_size=n, max_size=n))
    deps = [{i - gap for gap in draw(st.sets(st.integers(1, 3), max_size=2)) if gap <= i} for i in range(n)]
    for i, gap in draw(st.lists(st.tuples(st.integers(0, n - 1), st.integers(1, 4)), max_size=3)):
        if i + gap < n:
            deps[i].add(i + gap)
    return streams, deps


@settings(max_examples=150)  # (a few ms each; some 5-20% of them a cycle across streams)
@given(op_graphs())
def test_the_schedule_refuses_exactly_the_cyclic_graphs(graph):
    """The check refuses a schedule exactly when a depth-first search finds a cycle in its deps plus
    stream order, and names a cycle of it; the engine runs every op of an acyclic one and finds a
    cyclic one (unchecked) deadlocked."""
    streams, deps = graph
    n = len(streams)
    ops = tuple(
        op(f"o{i}", "compute" if stream == "compute" else "transfer", stream, [f"o{d}" for d in sorted(ds)])
        for i, (stream, ds) in enumerate(zip(streams, deps))
    )
    edges = {(d, i) for i, ds in enumerate(deps) for d in ds}
    last: dict[str, int] = {}
    for i, stream in enumerate(streams):
        if stream in last:
            edges.add((last[stream], i))
        last[stream] = i
    durations = [1.0] * n
    if not _cyclic(n, edges):
        schedule = Schedule(ops, streams=STREAMS)
        assert sorted(topological_order(schedule)) == list(range(n))
        assert simulate(schedule, make_profile(), durations=durations).status == "ok"
        return
    with pytest.raises(ScheduleError, match="cycle|depends on itself|contradicts stream order") as refused:
        Schedule(ops, streams=STREAMS)
    named = str(refused.value).partition("cycle (deps + stream order): ")[2]
    if named:  # each op of the cycle named leads to the next
        cycle = [int(name[1:]) for name in named.split(" -> ")]
        assert cycle[0] == cycle[-1] and all(edge in edges for edge in zip(cycle, cycle[1:]))
    with pytest.raises(EngineDeadlock):
        simulate(Schedule(ops, streams=STREAMS, validate=False), make_profile(), durations=durations)


def test_memory_trace_follows_allocations():
    s = Schedule(
        (
            op("w0", "transfer", "h2d_a", alloc=(("w0", 100),)),
            op("a", "compute", "compute", ["w0"], free=("w0",)),
        ),
        streams=STREAMS,
        preloaded=(("resident", 50),),
    )
    tl = simulate(s, make_profile(), durations=[1, 1])
    assert tl.memory[1].tolist() == [50, 150, 50]
    assert tl.meta["peak_gpu_bytes"] == 150
    assert not math.isnan(tl.df["ready"].iloc[1])


def test_golden_dependency_latency_delays_cross_stream_successors_only():
    """With a 0.5 s signalling latency: a0 waits for w0 (other stream) -> starts at 2.5, not 2;
    a1 follows a0 on the same stream without delay."""
    s = Schedule(
        (
            op("w0", "transfer", "h2d_weights"),
            op("a0", "compute", "compute", ["w0"]),
            op("a1", "compute", "compute"),
        )
    )
    tl = simulate(s, make_profile(dependency_latency_s=0.5), durations=[2, 1, 1])
    df = tl.df.set_index("op_id")
    assert df.loc["a0", ["start", "end"]].tolist() == [2.5, 3.5]
    assert df.loc["a1", "start"] == 3.5
    assert df.loc["a0", "blocked_by"] == "w0"


@pytest.mark.parametrize("bad", [-1.0, float("nan"), float("inf")])
def test_non_finite_or_negative_durations_are_refused_naming_the_op(bad):
    s = golden_schedule()
    with pytest.raises(ScheduleError, match="op 'a0' would last"):
        simulate(s, make_profile(), durations=[1, 1, bad, 1])


@pytest.mark.parametrize(
    "policy,impl", [("klotski", "as-published"), ("flexgen", "ideal"), ("klotski-hybrid", "ideal")]
)
def test_durations_costed_once_per_distinct_op_equal_costing_every_op(policy, impl):
    """CostModel.durations costs each distinct op once: the same numbers as costing every op."""
    from dataclasses import replace

    from klotski_sim.core.cost import CostModel
    from klotski_sim.hardware.profile import load_profile
    from klotski_sim.policies import build_schedule

    from .test_pipelines import make_input

    inp = make_input(model="mixtral-8x7b", bs=4, n=3, P=16, G=4, profile=load_profile("rtx3090"))
    schedule = build_schedule(policy, replace(inp, impl=impl))
    cost = CostModel(inp.profile)
    each = [cost.duration(o, schedule.streams[o.stream]) for o in schedule.ops]
    assert cost.durations(schedule.ops, schedule.streams) == each and len(set(each)) < len(each) / 3


@given(
    st.lists(
        st.tuples(
            st.sampled_from(["compute", "h2d_weights", "h2d_experts", "d2h_kv", "host"]),
            st.sets(st.integers(0, 40), max_size=8),
            st.sampled_from([0.0, 1e-3, 2e-3, 5e-3]),
        ),
        min_size=1,
        max_size=40,
    ),
    st.sampled_from([0.0, 1e-4]),
    st.booleans(),
)
def test_the_graph_keeps_an_ops_latest_dep_per_stream_alone_and_nothing_changes(ops, latency, copy_engines_two):
    """Above a few deps per op, the graph keeps of an op's deps on one stream only the latest (its
    end implies the others'): the timeline — starts, ends, ready times, the dep that made each op
    ready, memory — and the runtime's issue order are those of the whole graph."""
    from unittest.mock import patch

    from klotski_sim.core import schedule as schedule_module

    built = []
    for i, (stream, deps, _) in enumerate(ops):
        deps = tuple(f"o{d}" for d in sorted(deps) if d < i)
        if stream == "host":
            built.append(Op(f"o{i}", "host", "host", "sync", deps))
        elif stream == "compute":
            built.append(
                Op(f"o{i}", "compute", "compute", "expert", deps, flops=1, alloc=((f"o{i}", 1),), free=(f"o{i}",))
            )
        else:
            to_gpu = stream.startswith("h2d")
            built.append(
                Op(
                    f"o{i}",
                    "transfer",
                    stream,
                    "weights",
                    deps,
                    bytes=1,
                    src="cpu" if to_gpu else "gpu",
                    dst="gpu" if to_gpu else "cpu",
                )
            )
    durations = [d for _, _, d in ops]
    profile = make_profile(
        copy_engines=2 if copy_engines_two else 1, dependency_latency_s=latency, host_sync_latency_s=latency
    )
    results = []
    for pruned_above in (10**9, 0):  # never, and always
        with patch.object(schedule_module, "_PRUNED_ABOVE", pruned_above):
            schedule = Schedule(tuple(built))
            tl = simulate(schedule, profile, durations=durations)
            c = tl.columns
            results.append(
                (
                    [c[k].tolist() for k in ("start", "end", "ready", "blocked_by")],
                    tl.memory[1].tolist(),
                    topological_order(schedule),
                )
            )
    assert results[0] == results[1]
