"""Engine throughput: ops/second of klotski's SimPy engine vs a naive SimPy model, same run.

The naive model is how a SimPy tutorial would do it: one process per op that waits for an
AllOf of its dependencies' events, requests a `simpy.Resource`, holds it for a Timeout and
signals completion. klotski's engine instead creates one event per op and keeps the streams
and queues in plain lists (see klotski_sim/core/engine.py). Both must produce the same timeline;
the script checks that before it reports the ratio.

It also measures SimPy's own floor — events/s of its loop doing no work, one event scheduled from
the callback of the previous one (what one op per event costs at the least) — and how the engine
scales: ops/s and memory per op at 10k, 100k and 1M ops.

    python experiments/bench_engine.py [--ops 200000] [--repeat 3] [--sizes 10000,100000,1000000] [--quick]

`--quick` (for tests): every measure once on the smallest schedule, one batch (about 20k ops).
"""

from __future__ import annotations

import argparse
import gc
import time

import numpy as np
import simpy

from klotski_sim.core.cost import CostModel
from klotski_sim.core.engine import resource_capacities, simulate
from klotski_sim.core.schedule import Schedule
from klotski_sim.hardware.profile import load_profile, with_overrides
from klotski_sim.policies import PolicyInput, build_schedule
from klotski_sim.util.machine import resident_bytes
from klotski_sim.workload.model import get_model
from klotski_sim.workload.routing import RunShape
from klotski_sim.workload.trace_synth import synthetic_routing


def big_schedule(min_ops: int) -> Schedule:
    """A real single-batch Mixtral-8x7B schedule with enough batches to pass `min_ops`."""
    m = get_model("mixtral-8x7b")
    per_batch = 20_459  # ops of one batch at prompt 512, gen 32 (measured)
    n = max(1, -(-min_ops // per_batch))
    shape = RunShape(16, n, 512, 32)
    routing = synthetic_routing(m, shape, "uniform", seed=0)
    # the v0.1 preset: no host ops, which the textbook model below does not know
    return build_schedule("single-batch", PolicyInput(m, load_profile("rtx3090"), routing, impl="v0.1"))


def simpy_floor(events: int) -> float:
    """Events/s of SimPy's loop alone: each event's callback schedules the next one (a Timeout)."""
    env = simpy.Environment()
    left = [events]

    def next_one(_event: object) -> None:
        left[0] -= 1
        if left[0] > 0:
            simpy.events.Timeout(env, 1e-6).callbacks.append(next_one)

    gc.disable()
    try:
        simpy.events.Timeout(env, 1e-6).callbacks.append(next_one)
        t = time.perf_counter()
        env.run()
        return events / (time.perf_counter() - t)
    finally:
        gc.enable()


def scaling(sizes: list[int], profile) -> None:
    """ops/s of the engine and memory per op (schedule + timeline) as the schedule grows."""
    print(f"{'ops':>10} {'build s':>8} {'engine s':>9} {'engine ops/s':>13} {'bytes/op':>9}")
    for size in sizes:
        gc.collect()
        before = resident_bytes() or 0
        t = time.perf_counter()
        schedule = big_schedule(size)
        build_s = time.perf_counter() - t
        t = time.perf_counter()
        tl = simulate(schedule, profile)
        engine_s = time.perf_counter() - t
        tl.summary()
        per_op = ((resident_bytes() or 0) - before) / len(schedule)
        print(f"{len(schedule):10d} {build_s:8.2f} {engine_s:9.2f} {len(schedule) / engine_s:13,.0f} {per_op:9,.0f}")
        del schedule, tl


def naive_simpy(schedule: Schedule, durations: list[float], caps: dict[str, int]) -> list[float]:
    """One process + one Resource request per op: the textbook SimPy model. Returns end times.
    It runs with the cyclic GC paused, as klotski's engine does, so the ratio compares models."""
    gc.disable()
    try:
        return _naive_simpy(schedule, durations, caps)
    finally:
        gc.enable()


def _naive_simpy(schedule: Schedule, durations: list[float], caps: dict[str, int]) -> list[float]:
    env = simpy.Environment()
    resources = {r: simpy.Resource(env, capacity=c) for r, c in caps.items()}
    done = [env.event() for _ in schedule.ops]
    ends = [0.0] * len(schedule.ops)
    index = schedule.index
    last: dict[str, int] = {}

    def run_op(i: int, waits: list[simpy.Event], resource: simpy.Resource):
        if waits:
            yield env.all_of(waits)
        with resource.request() as req:
            yield req
            yield env.timeout(durations[i])
        ends[i] = env.now
        done[i].succeed()

    for i, op in enumerate(schedule.ops):
        waits = [done[index[d]] for d in op.deps]
        if op.stream in last:
            waits.append(done[last[op.stream]])
        last[op.stream] = i
        env.process(run_op(i, waits, resources[schedule.streams[op.stream]]))
    env.run()
    return ends


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ops", type=int, default=200_000)
    parser.add_argument("--repeat", type=int, default=3, help="best of N for each model")
    parser.add_argument("--sizes", default="10000,100000,1000000", help="schedule sizes for the scaling table")
    parser.add_argument("--quick", action="store_true", help="one batch's schedule, each measure once (seconds)")
    args = parser.parse_args()
    if args.quick:  # (any size up to one batch's ops builds a one-batch schedule)
        args.ops, args.repeat, args.sizes = 1, 1, "1"

    t = time.perf_counter()
    schedule = big_schedule(args.ops)
    build_s = time.perf_counter() - t
    # no cross-stream signalling delay: the textbook model has none
    # the textbook model knows neither signalling latency nor the issuing thread (engine rule 4)
    profile = with_overrides(load_profile("rtx3090"), {"gpu.dependency_latency_s": 0.0, "gpu.issue": "per-stream"})
    t = time.perf_counter()
    durations = CostModel(profile).durations(schedule.ops, schedule.streams)
    cost_s = time.perf_counter() - t
    caps = resource_capacities(schedule, profile)
    n = len(schedule)

    engine_s, naive_s = [], []
    for _ in range(args.repeat):
        t = time.perf_counter()
        tl = simulate(schedule, profile, durations=durations)
        engine_s.append(time.perf_counter() - t)
        t = time.perf_counter()
        naive_ends = naive_simpy(schedule, durations, caps)
        naive_s.append(time.perf_counter() - t)

    ends = dict(zip(tl.columns["op_id"], tl.columns["end"]))
    same = np.allclose([ends[op.id] for op in schedule.ops], naive_ends, rtol=0, atol=1e-9)
    e, nv = min(engine_s), min(naive_s)
    print(
        f"schedule: {n} ops (single-batch Mixtral-8x7B, {schedule.meta['num_batches']} batches), "
        f"built in {build_s:.2f} s; cost model {n / cost_s:,.0f} ops/s"
    )
    t = time.perf_counter()
    tl.summary()
    summary_s = time.perf_counter() - t
    print(
        f"klotski engine : {e:.3f} s  -> {n / e:,.0f} ops/s (best of {args.repeat}); "
        f"metrics (summary) afterwards {summary_s:.2f} s"
    )
    print(f"naive SimPy    : {nv:.3f} s  -> {n / nv:,.0f} ops/s (best of {args.repeat})")
    print(f"ratio          : {nv / e:.1f}x faster   identical timelines: {same}")
    floor = simpy_floor(n)
    print(
        f"SimPy floor    : {floor:,.0f} events/s (its loop alone, one Timeout per event): the engine runs at "
        f"{n / e / floor:.0%} of it, the textbook model at {n / nv / floor:.0%}"
    )
    del schedule, tl
    scaling([int(x) for x in args.sizes.split(",") if x], profile)


if __name__ == "__main__":
    main()
