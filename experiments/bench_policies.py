"""Per-policy simulation speed on the default `compare` configuration (Mixtral-8x7B, rtx3090,
prompt 512, gen 32, bs 16, n from the planner), per implementation preset: schedule build, engine
run and ops/s, the whole default Klotski run (prepare + build + simulate + summary, in a fresh
process with a cold and a warm trace cache), and `klotski-sim compare` wall time and peak memory
(in one process, and with its default one worker process per core), and `klotski-sim simulate
--out` with every file it writes — all measured in one run.

    python experiments/bench_policies.py [--quick]

`--quick` (for tests): the ideal preset only, on the smallest run (the first 2 of Mixtral-8x7B's
layers, prompt 32, 2 generated tokens), `compare` without its figure (in one process and with
workers) and `simulate` without its figure: every measure's code in seconds.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path

from klotski_sim.core.engine import simulate
from klotski_sim.policies import build_schedule
from klotski_sim.runs.runner import RunSpec, policy_batches, prepare

POLICIES = ("single-batch", "multi-batch", "hot-prefetch", "klotski", "klotski-oracle", "flexgen")
# the run --quick measures (RunSpec fields, and the same as klotski-sim flags)
QUICK = {"model": "mixtral-8x7b:2", "prompt_len": 32, "gen_len": 2}
QUICK_FLAGS = ("--model", "mixtral-8x7b:2", "--prompt-len", "32", "--gen-len", "2")


WHOLE_RUN = """
import time
t = time.perf_counter()
from klotski_sim.runs.runner import RunSpec, run
t1 = time.perf_counter()
r = run(RunSpec(policy="klotski", num_batches=None, impl={impl!r}, **{size!r}))
r.timeline.summary()
print(f"{{t1 - t:.2f}} {{time.perf_counter() - t1:.2f}} {{len(r.schedule)}}")
"""


def whole_run(impl: str, cache: str, size: dict[str, object]) -> str:
    """A default Klotski run (`size`: RunSpec fields that shrink it) in a fresh process: import time, then
    prepare + build + simulate + summary."""
    env = dict(os.environ, KLOTSKI_CACHE_DIR=cache)
    out = subprocess.run(
        [sys.executable, "-c", WHOLE_RUN.format(impl=impl, size=size)],
        check=True,
        capture_output=True,
        text=True,
        env=env,
    ).stdout.split()
    return f"import {out[0]} s, run {out[1]} s ({out[2]} ops)"


# Runs a command and prints the peak RSS of its largest process. A small process of its own: a
# child forked from this (by then large) benchmark would report this process's size at the fork
# as its own peak (Linux keeps the parent's high-water mark across fork + exec).
PEAK_OF = """
import resource, subprocess, sys
code = subprocess.run(sys.argv[1:], stdout=subprocess.DEVNULL).returncode
print(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss, code)
"""


def command_wall(command: str, impl: str, *extra: str) -> str:
    """Wall time, bytes written and the peak RSS of the klotski-sim command's largest process (its
    own, or a worker's: the largest waited-for descendant)."""
    with tempfile.TemporaryDirectory() as out:
        t = time.perf_counter()
        result = subprocess.run(
            [
                sys.executable,
                "-c",
                PEAK_OF,
                sys.executable,
                "-m",
                "klotski_sim.cli.main",
                command,
                "--impl",
                impl,
                "--out",
                out,
                *extra,
            ],
            check=True,
            capture_output=True,
            text=True,
        )
        took = time.perf_counter() - t
        peak_kb, code = result.stdout.split()
        if code != "0":
            raise SystemExit(f"{command} {impl} {' '.join(extra)} failed: {result.stderr}")
        sizes = [f.stat().st_size for f in Path(out).iterdir()]
    largest = f" (largest file {max(sizes) / 1e6:.1f} MB)" if "--traces" in extra else ""
    return f"{took:.1f} s wall, {sum(sizes) / 1e6:.1f} MB written{largest}, peak RSS {int(peak_kb) / 1024:.0f} MB"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="the ideal preset on the smallest run (seconds)")
    args = parser.parse_args()
    size, flags = (QUICK, QUICK_FLAGS) if args.quick else ({}, ())
    variants = (
        (("--no-png", "--workers", "1"), ("--no-png",))
        if args.quick
        else (("--no-png", "--workers", "1"), ("--workers", "1"), ("--no-png",), (), ("--traces",))
    )
    if args.quick:
        print("quick: " + " ".join(flags))
    for impl in ("ideal",) if args.quick else ("ideal", "as-published"):
        t = time.perf_counter()
        prep = prepare(RunSpec(num_batches=None, policy="klotski", impl=impl, **size))
        print(
            f"[{impl}] prepare (planner + calibrated trace for n = {prep.num_batches}): {time.perf_counter() - t:.2f} s"
        )
        print(
            f"{'policy':15} {'n':>3} {'ops':>8} {'build s':>8} {'engine s':>9} {'engine ops/s':>13} {'build+engine s':>15}"
        )
        for name in POLICIES:
            p = prep.narrowed(policy_batches(name, prep))  # each policy's n, as compare runs it
            inp = replace(p.policy_input(), impl=impl)
            inp.routing.counts  # computed once per routing, shared by policies
            t0 = time.perf_counter()
            schedule = build_schedule(name, inp)
            t1 = time.perf_counter()
            status = simulate(schedule, p.profile).status
            t2 = time.perf_counter()
            assert status == "ok", (name, status)
            print(
                f"{name:15} {p.num_batches:3d} {len(schedule):8d} {t1 - t0:8.2f} {t2 - t1:9.2f} {len(schedule) / (t2 - t1):13,.0f} "
                f"{t2 - t0:15.2f}"
            )
        with tempfile.TemporaryDirectory() as cache:
            print(
                f"[{impl}] whole default Klotski run, fresh process: cold trace cache "
                f"{whole_run(impl, cache, size)}; warm {whole_run(impl, cache, size)}"
            )
        for extra in variants:
            label = " ".join(extra) + (" (figure)" if "--no-png" not in extra and "--traces" not in extra else "")
            print(
                f"[{impl}] klotski-sim compare {label}: {command_wall('compare', impl, *extra, *flags)}".replace(
                    "  ", " "
                )
            )
        simulate_flags = ("--policy", "klotski", *flags, *(("--no-png",) if args.quick else ()))
        print(
            f"[{impl}] klotski-sim simulate {' '.join(simulate_flags)} --out (every file): "
            f"{command_wall('simulate', impl, *simulate_flags)}"
        )


if __name__ == "__main__":
    main()
