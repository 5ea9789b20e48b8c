"""The issuing thread (engine rule 4, `gpu.issue: serial`): one host thread issues every stream's
ops in program order, so an op is ready no earlier than the thread reaches it and ends no earlier
than the thread has issued it; a host op stops the thread until it ends."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from klotski_sim.core.cost import CostModel
from klotski_sim.core.engine import simulate
from klotski_sim.core.schedule import Op, Schedule

from .conftest import make_profile
from .test_engine import STREAMS, op, random_schedules


def serial(**gpu: object) -> object:
    """The test profile with one second per kernel launch and per copy issued."""
    return make_profile(**{"kernel_overhead_s": 1.0, "copy_issue_s": 1.0, **gpu})


def times(schedule: Schedule, profile: object, durations: list[float]) -> dict[str, tuple[float, float]]:
    df = simulate(schedule, profile, durations=durations).df.set_index("op_id")  # type: ignore[arg-type]
    return {i: (df.at[i, "start"], df.at[i, "end"]) for i in df.index}


def test_golden_a_copy_issued_between_two_kernels_delays_the_second():
    """c0 (embed: 2 launches = 2 s to issue, 2 s long), t0 (a copy: 1 s to issue, 1 s long), c1 (as
    c0). Per stream: c0 [0,2], t0 [0,1], c1 [2,4]. Issued by one thread: it reaches t0 at 2 and c1
    at 3, so t0 [2,3] and c1 [3,5]; the GPU's 1 s gap is blamed on the copy issued before c1."""
    s = Schedule(
        (
            op("c0", "compute", "compute", category="embed"),
            op("t0", "transfer", "h2d_weights"),
            op("c1", "compute", "compute", category="embed"),
        )
    )
    per_stream = times(s, serial(issue="per-stream"), [2, 1, 2])
    assert per_stream == {"c0": (0, 2), "t0": (0, 1), "c1": (2, 4)}
    tl = simulate(s, serial(), durations=[2, 1, 2])
    df = tl.df.set_index("op_id")
    assert {i: (df.at[i, "start"], df.at[i, "end"]) for i in df.index} == {"c0": (0, 2), "t0": (2, 3), "c1": (3, 5)}
    assert df.at["c1", "blocked_by"] == "t0"
    assert tl.summary().bubble_by_cause == {"weights": 1}


def test_golden_an_op_ends_no_earlier_than_its_last_launch_is_issued():
    """An embed op costed at 0.5 s (a measured table, say) still takes the thread 2 s to launch:
    it ends at 2, and the copy after it starts when the thread gets to it."""
    s = Schedule((op("c0", "compute", "compute", category="embed"), op("t0", "transfer", "h2d_weights")))
    assert times(s, serial(), [0.5, 1]) == {"c0": (0, 2), "t0": (2, 3)}
    assert times(s, serial(issue="per-stream"), [0.5, 1]) == {"c0": (0, 0.5), "t0": (0, 1)}


def test_golden_a_host_op_stops_the_thread_until_it_ends():
    """c0 (2 s), a sync on it, then a copy that does not depend on the sync: the thread waits in
    the sync until c0 ends at 2 and issues the copy then (per stream it would start at 0)."""
    s = Schedule(
        (
            op("c0", "compute", "compute", category="embed"),
            Op("h", "host", "host", "sync", ("c0",)),
            op("t0", "transfer", "h2d_weights"),
        ),
        streams={"compute": "gpu", "host": "host", "h2d_weights": "pcie_h2d"},
    )
    got = times(s, serial(kernel_overhead_s=0.0, copy_issue_s=0.0), [2, 0, 1])
    assert got == {"c0": (0, 2), "h": (0, 2), "t0": (2, 3)}
    per_stream = times(s, serial(kernel_overhead_s=0.0, copy_issue_s=0.0, issue="per-stream"), [2, 0, 1])
    assert per_stream["t0"] == (0, 1)


def test_with_nothing_to_issue_the_thread_changes_nothing():
    """Issue costs of zero and no host op: `serial` and `per-stream` give the same timeline."""
    s = Schedule(
        tuple(op(f"o{i}", "compute" if i % 2 else "transfer", "compute" if i % 2 else "h2d_a") for i in range(6)),
        streams=STREAMS,
    )
    durations = [1.0, 2.0, 0.5, 1.5, 3.0, 0.25]
    assert times(s, make_profile(), durations) == times(s, make_profile(issue="per-stream"), durations)


@settings(max_examples=60, deadline=None)
@given(random_schedules(), st.sampled_from([0.0, 0.2, 1.0]), st.sampled_from([0.0, 0.5]))
def test_every_op_waits_for_the_thread_and_nothing_else_changes_order(case, launch, copy):
    """Walking the ops in program order, the thread reaches each at the sum of the issue costs
    before it; an op starts no earlier than that and ends no earlier than that plus its own cost.
    Stream order and deps still hold."""
    schedule, durations, drawn = case
    profile = make_profile(
        memory_bytes=1e12, copy_engines=drawn.link("pcie_h2d").copy_engines, kernel_overhead_s=launch, copy_issue_s=copy
    )
    tl = simulate(schedule, profile, durations=durations)
    df = tl.df.set_index("op_id")
    costs = CostModel(profile).issue_costs(schedule.ops, schedule.streams)
    reach = 0.0
    for o, cost, d in zip(schedule.ops, costs, durations):
        start, end = df.at[o.id, "start"], df.at[o.id, "end"]
        assert start >= reach - 1e-9
        assert end == pytest.approx(max(start + d, reach + cost))
        for dep in o.deps:
            assert start >= df.at[dep, "end"] - 1e-9
        reach += cost


def test_issue_costs_are_the_launches_and_one_call_per_copy():
    """A compute op's issue cost is its kernel launches and dispatch (what `compute_seconds`
    charges beyond the kernels' work); a copy's is `copy_issue_s`, else one launch; a host op's 0."""
    profile = make_profile(kernel_overhead_s=1e-5, dispatch_overhead_s=3e-5)
    cost = CostModel(profile)
    expert = Op("x", "compute", "compute", "expert")
    copy = Op("t", "transfer", "h2d_weights", "weights", bytes=1, src="cpu", dst="gpu")
    sync = Op("h", "host", "host", "sync")
    assert cost.issue_seconds(expert, "gpu") == pytest.approx(8 * 1e-5 + 3e-5)  # 8 kernels (cost.KERNELS_PER_OP)
    assert cost.issue_seconds(copy, "pcie_h2d") == pytest.approx(1e-5)
    assert cost.issue_seconds(sync, "host") == 0.0
    assert CostModel(make_profile(kernel_overhead_s=1e-5, copy_issue_s=4e-5)).issue_seconds(copy, "pcie_h2d") == 4e-5
    # compute_seconds charges the same launches beyond the roofline: a launch-bound op lasts its issue
    assert cost.compute_seconds("expert", 0, 0) == pytest.approx(cost.issue_seconds(expert, "gpu"))


def test_a_cpu_calibration_without_the_field_issues_per_stream():
    from klotski_sim.hardware.profile import load_profile

    assert load_profile("experiments/results/cpu/small-mixtral-presets/profile.yaml").gpu.issue == "per-stream"
    assert load_profile("rtx3090").gpu.issue == "serial"
    assert load_profile("experiments/profiles/rtx3090-v0.1.yaml").gpu.issue == "per-stream"
