"""A schedule timed as a function of one varying duration (klotski_sim.core.maxplus) against the engine."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from klotski_sim.core.engine import run_engine
from klotski_sim.core.maxplus import OneVaryingDuration
from klotski_sim.core.schedule import LINK_DIRECTIONS, Op, Schedule

from .conftest import make_profile

ONE_STREAM_EACH = {"compute": "gpu", "h2d": "pcie_h2d", "d2h": "pcie_d2h", "cpu_compute": "cpu", "host": "host"}
SHARED = {**ONE_STREAM_EACH, "aux": "gpu"}


@st.composite
def cases(draw, streams=ONE_STREAM_EACH):
    n = draw(st.integers(1, 25))
    ops, durations, varying, live = [], [], [], []
    for i in range(n):
        stream = draw(st.sampled_from(sorted(streams)))
        resource = streams[stream]
        kind = {"gpu": "compute", "cpu": "compute", "host": "host"}.get(resource, "transfer")
        deps = sorted(set(draw(st.lists(st.integers(0, i - 1), max_size=3)))) if i else []
        ids = [f"o{d}" for d in deps]
        freeable = [b for b in live if b[1] in ids]
        free: tuple[str, ...] = ()
        if freeable and stream in ("compute", "h2d") and draw(st.booleans()):
            free = (freeable[0][0],)
            live.remove(freeable[0])
        alloc: tuple[tuple[str, int], ...] = ()
        if stream in ("compute", "h2d") and draw(st.booleans()):  # (GPU buffers: allocated on the GPU or into it)
            alloc = ((f"buf{i}", draw(st.integers(0, 400))),)
            live.append((f"buf{i}", f"o{i}"))
        extra = {}
        if kind == "transfer":
            src, dst = LINK_DIRECTIONS[resource]
            extra = dict(bytes=1, src=src, dst=dst)
        category = {"compute": "attention", "transfer": "weights", "host": "sync"}[kind]
        ops.append(Op(f"o{i}", kind, stream, category, tuple(ids), alloc=alloc, free=free, **extra))
        durations.append(draw(st.floats(0, 5, allow_nan=False)))
        if kind == "compute" and draw(st.booleans()):
            varying.append(i)
    latency = draw(st.sampled_from([0.0, 0.3]))
    profile = make_profile(memory_bytes=1e9, copy_engines=draw(st.integers(1, 2)), dependency_latency_s=latency)
    a = draw(st.floats(0, 5, allow_nan=False))
    return Schedule(tuple(ops), streams=streams), durations, varying, profile, a


@settings(max_examples=150, deadline=None)
@given(cases())
def test_the_compiled_makespan_is_the_engines_and_its_peak_never_below(case):
    schedule, durations, varying, profile, a = case
    compiled = OneVaryingDuration.compile(schedule, profile, durations, varying)
    assert compiled is not None  # (one stream on each resource, every dependency on an earlier op)
    actual = [a if i in varying else d for i, d in enumerate(durations)]
    ran = run_engine(schedule, profile, durations=actual)
    assert compiled.makespan(a) == pytest.approx(ran.makespan, rel=1e-12, abs=1e-12)
    assert compiled.durations(a).tolist() == actual
    peak = compiled.peak_bytes(a)
    assert ran.peak_gpu_bytes <= min(peak, compiled.peak_bound)  # (two bounds: at this `a`, and at any)
    assert compiled.peak_bound <= sum(size for op in schedule.ops for _, size in op.alloc)


@given(cases(SHARED))
def test_a_schedule_whose_streams_share_a_resource_is_not_compiled(case):
    schedule, durations, varying, profile, _ = case
    compiled = OneVaryingDuration.compile(schedule, profile, durations, varying)
    used = {op.stream for op in schedule.ops}
    assert (compiled is None) == ({"compute", "aux"} <= used)


def test_golden_a_chain_and_a_copy_beside_it():
    """attention (a) -> gate (1) on the GPU, a copy (3) beside them, a host wait for both: the
    makespan is max(a + 1, 3) + the host's 0.5, a line of slope 1 then flat."""
    ops = (
        Op("attn", "compute", "compute", "attention"),
        Op("gate", "compute", "compute", "gate", ("attn",)),
        Op("copy", "transfer", "h2d", "weights", bytes=1, src="cpu", dst="gpu"),
        Op("sync", "host", "host", "sync", ("gate", "copy")),
    )
    schedule = Schedule(ops, streams=ONE_STREAM_EACH)
    compiled = OneVaryingDuration.compile(schedule, make_profile(), [9.0, 1.0, 3.0, 0.5], [0])
    assert compiled is not None
    assert [compiled.makespan(a) for a in (0.0, 2.0, 4.0)] == [3.5, 3.5, 5.5]
