"""Engine throughput: ops/second of klotski's SimPy engine vs a naive SimPy model, same run.

The naive model is how a SimPy tutorial would do it: one process per op that waits for an
AllOf of its dependencies' events, requests a `simpy.Resource`, holds it for a Timeout and
signals completion. klotski's engine instead creates one event per op and keeps the streams
and queues in plain lists (see klotski_sim/engine.py). Both must produce the same timeline;
the script checks that before it reports the ratio.

    python experiments/bench_engine.py [--ops 200000] [--repeat 3]
"""

from __future__ import annotations

import argparse
import gc
import time

import numpy as np
import simpy

from klotski_sim.cost import CostModel
from klotski_sim.engine import resource_capacities, simulate
from klotski_sim.hardware import load_profile
from klotski_sim.model import get_model
from klotski_sim.policies import PolicyInput, build_schedule
from klotski_sim.routing import RunShape
from klotski_sim.trace_synth import synthetic_routing
from klotski_sim.schedule import Schedule


def big_schedule(min_ops: int) -> Schedule:
    """A real single-batch Mixtral-8x7B schedule with enough batches to pass `min_ops`."""
    m = get_model("mixtral-8x7b")
    per_batch = 20_459  # ops of one batch at prompt 512, gen 32 (measured)
    n = max(1, -(-min_ops // per_batch))
    shape = RunShape(16, n, 512, 32)
    routing = synthetic_routing(m, shape, "uniform", seed=0)
    return build_schedule("single-batch", PolicyInput(m, load_profile("rtx3090"), routing))


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
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ops", type=int, default=200_000)
    parser.add_argument("--repeat", type=int, default=3, help="best of N for each model")
    args = parser.parse_args()

    t = time.perf_counter()
    schedule = big_schedule(args.ops)
    build_s = time.perf_counter() - t
    profile = load_profile("rtx3090")
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
    print(f"schedule: {n} ops (single-batch Mixtral-8x7B, {schedule.meta['num_batches']} batches), "
          f"built in {build_s:.2f} s; cost model {n / cost_s:,.0f} ops/s")
    t = time.perf_counter()
    tl.summary()
    summary_s = time.perf_counter() - t
    print(f"klotski engine : {e:.3f} s  -> {n / e:,.0f} ops/s (best of {args.repeat}); "
          f"metrics (summary) afterwards {summary_s:.2f} s")
    print(f"naive SimPy    : {nv:.3f} s  -> {n / nv:,.0f} ops/s (best of {args.repeat})")
    print(f"ratio          : {nv / e:.1f}x faster   identical timelines: {same}")


if __name__ == "__main__":
    main()
