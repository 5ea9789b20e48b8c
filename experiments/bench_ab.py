"""Before/after speed on a noisy machine: the code at a git revision against the working tree,
alternating the two in fresh processes and keeping each one's best, all in one run.

On a shared 2-core machine the same benchmark can differ by 50% twenty minutes apart, so a figure
from an earlier round is no baseline. This checks the revision out in a temporary git worktree and
runs, in turn for the old code and the new (each from its own folder via PYTHONPATH, with this
interpreter and its packages):

- the whole default Klotski run (prepare + build + simulate + summary) in a fresh process, per preset;
- `klotski-sim compare --no-png` (defaults: every policy, worker processes), per preset;
- `--sweep`: the distinct-seed grid of experiments/bench_sweep.py (N default-size ideal Klotski
  configurations on 2 workers), configurations per minute.

    python experiments/bench_ab.py --base REV [--rounds 3] [--sweep 20]
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent

WHOLE_RUN = """
import time
from klotski_sim.runner import RunSpec, run
t = time.perf_counter()
run(RunSpec(policy="klotski", num_batches=None, impl={impl!r})).timeline.summary()
print(time.perf_counter() - t)
"""

SWEEP = """
import sys, tempfile, time
from klotski_sim.sweep import parse_spec, run_sweep
spec = parse_spec({{"name": "ab", "models": ["mixtral-8x7b"], "hardware": ["rtx3090"], "policies": ["klotski"],
                   "impls": ["ideal"], "seeds": list(range({count}))}})
with tempfile.TemporaryDirectory() as out:  # each seed's routing synthesised beforehand: not timed
    run_sweep(spec, out, workers=2, progress=False)
with tempfile.TemporaryDirectory() as out:
    t = time.perf_counter()
    run_sweep(spec, out, workers=2, progress=False)
    print({count} / (time.perf_counter() - t) * 60)
"""


def python_in(code_dir: Path, *args: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=str(code_dir))
    return subprocess.run([sys.executable, *args], cwd=code_dir, env=env, capture_output=True, text=True, check=True)


def whole_run(code_dir: Path, impl: str) -> float:
    return float(python_in(code_dir, "-c", WHOLE_RUN.format(impl=impl)).stdout.split()[-1])


def compare_no_png(code_dir: Path, impl: str) -> float:
    with tempfile.TemporaryDirectory() as out:
        t = time.perf_counter()
        python_in(code_dir, "-m", "klotski_sim.cli", "compare", "--impl", impl, "--no-png", "--out", out)
        return time.perf_counter() - t


def sweep_rate(code_dir: Path, count: int) -> float:
    return float(python_in(code_dir, "-c", SWEEP.format(count=count)).stdout.split()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--base", required=True, help="git revision of the code to compare against")
    parser.add_argument("--rounds", type=int, default=3, help="alternations of old and new per measure")
    parser.add_argument("--sweep", type=int, default=20, metavar="N",
                        help="configurations in the distinct-seed sweep (0: skip it)")
    args = parser.parse_args()
    base = Path(tempfile.mkdtemp(prefix="klotski-ab-"))
    subprocess.run(["git", "-C", str(REPO), "worktree", "add", "--detach", str(base), args.base], check=True,
                   capture_output=True)
    try:
        measures = [(f"whole default Klotski run, {impl}", "s", lambda d, i=impl: whole_run(d, i), min)
                    for impl in ("ideal", "as-published")]
        measures += [(f"compare --no-png, {impl}", "s", lambda d, i=impl: compare_no_png(d, i), min)
                     for impl in ("ideal", "as-published")]
        if args.sweep:
            measures.append((f"distinct default-size sweep ({args.sweep}, ideal, 2 workers)", "configurations/min",
                             lambda d: sweep_rate(d, args.sweep), max))
        print(f"{args.base} (old) against the working tree (new), {args.rounds} alternations each, best of each:")
        for name, unit, measure, best in measures:
            old, new = [], []
            for _ in range(args.rounds):
                old.append(measure(base))
                new.append(measure(REPO))
            print(f"{name:55} {best(old):8.3f} -> {best(new):8.3f} {unit}   "
                  f"(old {min(old):.3f}-{max(old):.3f}, new {min(new):.3f}-{max(new):.3f})")
    finally:
        subprocess.run(["git", "-C", str(REPO), "worktree", "remove", "--force", str(base)], capture_output=True)


if __name__ == "__main__":
    main()
