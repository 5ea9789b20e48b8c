"""Where a whole default Klotski run's time goes, per implementation preset, in fresh processes:
prepare (planner + calibrated routing), build (the policy loop, then the schedule's check), simulate,
summary, and the garbage collector's share of it all; `run` is prepare + build + simulate (what
issue 10's goal times), `total` adds the summary. The best of `--rounds` fresh processes per
column (this machine is noisy); the run's figures, not a model of them.

    python experiments/bench_phases.py [--rounds 3] [--quick]

`--quick` (for tests): one round of the smallest Klotski run (the first 2 of Mixtral-8x7B's layers,
prompt 32, 2 generated tokens).
"""

from __future__ import annotations

import argparse
import subprocess
import sys

# One run, timed phase by phase in a fresh process (the trace cache warm: bench_policies times the cold one).
PHASES = """
import gc, time
from dataclasses import replace
from klotski_sim.core.engine import simulate
from klotski_sim.policies import build_schedule
from klotski_sim.runs.runner import RunSpec, plan_run, prepare
from klotski_sim.core.schedule import Schedule

collecting = {{}}
def on_gc(phase, info):
    if phase == "start":
        collecting["since"] = time.perf_counter()
    else:
        collecting["total"] = collecting.get("total", 0.0) + time.perf_counter() - collecting["since"]
gc.callbacks.append(on_gc)
checking = [0.0]
check = Schedule.check
def timed_check(self):
    t = time.perf_counter()
    check(self)
    checking[0] += time.perf_counter() - t
Schedule.check = timed_check

t0 = time.perf_counter()
spec = RunSpec(num_batches=None, policy="klotski", impl={impl!r}, **{size!r})
prep = plan_run(spec, prepare(spec)).prepared
inp = replace(prep.policy_input(spec.options), impl={impl!r})
t1 = time.perf_counter()
schedule = build_schedule("klotski", inp)
t2 = time.perf_counter()
timeline = simulate(schedule, prep.profile)
t3 = time.perf_counter()
timeline.summary()
t4 = time.perf_counter()
print(len(schedule), t1 - t0, t2 - t1 - checking[0], checking[0], t3 - t2, t4 - t3, t3 - t0, t4 - t0,
      collecting.get("total", 0.0))
"""
# "run": prepare + build + simulate, what issue 10's 0.5 s goal names; "total" adds the summary
# the run --quick times instead of the default one
QUICK = {"model": "mixtral-8x7b:2", "prompt_len": 32, "gen_len": 2}
COLUMNS = ("prepare", "policy loop", "check", "simulate", "summary", "run", "total", "of it GC")


def phases(impl: str, size: dict[str, object]) -> tuple[int, list[float]]:
    out = subprocess.run(
        [sys.executable, "-c", PHASES.format(impl=impl, size=size)], check=True, capture_output=True, text=True
    ).stdout.split()
    return int(out[0]), [float(v) for v in out[1:]]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3, help="fresh processes per preset (the best of each phase)")
    parser.add_argument("--quick", action="store_true", help="one round of the smallest run (seconds)")
    args = parser.parse_args()
    if args.rounds < 1:
        parser.error("--rounds must be at least 1")
    size = QUICK if args.quick else {}
    rounds = 1 if args.quick else args.rounds
    what = ("Klotski run, " + ", ".join(f"{k} {v}" for k, v in size.items())) if size else "whole default Klotski run"
    print(f"{what}, seconds, best of {rounds} fresh processes per column")
    print(f"{'preset':<14}{'ops':>8}" + "".join(f"{c:>13}" for c in COLUMNS))
    for impl in ("ideal", "as-published"):
        runs = [phases(impl, size) for _ in range(rounds)]
        best = [min(r[1][k] for r in runs) for k in range(len(COLUMNS))]
        print(f"{impl:<14}{runs[0][0]:>8}" + "".join(f"{v:>13.3f}" for v in best))


if __name__ == "__main__":
    main()
