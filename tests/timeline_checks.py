"""One assertion for "this timeline respects this schedule", shared by the engine's and the runtime's
tests: every op after its deps (plus the cross-stream latency the simulator charges) and after its
stream predecessor, no resource running more ops at once than its units."""

from __future__ import annotations

from typing import Mapping

EPS = 1e-9


def assert_respects(
    schedule,
    timeline,
    latency: float = 0.0,
    capacities: Mapping[str, int] | None = None,
    in_order_ends: bool = False,
    host_waits: bool = True,
) -> None:
    """`latency` is added to a dependency on another stream; `capacities` (resource -> units)
    bounds the ops running at once on each resource. `in_order_ends`: an op starts after its stream
    predecessor ended (the simulator's streams), not merely after it started (a real stream's
    ops are issued in order). `host_waits`: a host op is the host blocked on its deps, so it must
    end after them rather than start after them."""
    df = timeline.df.set_index("op_id")
    last_on: dict[str, str] = {}
    for op in schedule.ops:
        if op.id not in df.index:  # (a run cut short: out of memory)
            continue
        start, end = df.at[op.id, "start"], df.at[op.id, "end"]
        assert start <= end + EPS, op.id
        for dep in op.deps:
            lag = latency if schedule.op(dep).stream != op.stream else 0.0
            bound = end if op.kind == "host" and host_waits else start
            assert dep in df.index and df.at[dep, "end"] + lag <= bound + EPS, (op.id, dep)
        if op.stream in last_on:
            before = df.at[last_on[op.stream], "end" if in_order_ends else "start"]
            assert before <= start + EPS, (op.stream, op.id)
        last_on[op.stream] = op.id
    for resource, units in (capacities or {}).items():
        group = df[df["resource"] == resource]
        events = sorted([(s, 1) for s in group["start"]] + [(e, -1) for e in group["end"]])
        running = 0
        for _, delta in events:
            running += delta
            assert running <= units, resource
