"""Per-policy simulation speed on the default `compare` configuration (Mixtral-8x7B, rtx3090,
prompt 512, gen 32, bs 16, n from the planner): schedule build, engine run and ops/s, measured
in one run, plus the whole `klotski-sim compare` wall time.

    python experiments/bench_policies.py
"""

from __future__ import annotations

import subprocess
import sys
import tempfile
import time

from klotski_sim.engine import simulate
from klotski_sim.policies import build_schedule
from klotski_sim.runner import RunSpec, prepare

POLICIES = ("single-batch", "multi-batch", "hot-prefetch", "klotski", "klotski-oracle", "flexgen")


def main() -> None:
    t = time.perf_counter()
    prep = prepare(RunSpec(num_batches=None, policy="klotski"))
    print(f"prepare (planner + calibrated trace for n = {prep.num_batches}): {time.perf_counter() - t:.2f} s")
    print(f"{'policy':15} {'ops':>8} {'build s':>8} {'engine s':>9} {'engine ops/s':>13} {'build+engine s':>15}")
    for name in POLICIES:
        p = prep.narrowed(1) if name == "single-batch" else prep
        inp = p.policy_input()
        inp.routing.counts  # computed once per routing, shared by policies
        t0 = time.perf_counter()
        schedule = build_schedule(name, inp)
        t1 = time.perf_counter()
        simulate(schedule, p.profile)
        t2 = time.perf_counter()
        print(f"{name:15} {len(schedule):8d} {t1 - t0:8.2f} {t2 - t1:9.2f} {len(schedule) / (t2 - t1):13,.0f} "
              f"{t2 - t0:15.2f}")
    with tempfile.TemporaryDirectory() as out:
        t = time.perf_counter()
        subprocess.run([sys.executable, "-m", "klotski_sim.cli", "compare", "--out", out], check=True,
                       capture_output=True)
        print(f"klotski-sim compare (all six, with figures and traces): {time.perf_counter() - t:.1f} s wall")


if __name__ == "__main__":
    main()
