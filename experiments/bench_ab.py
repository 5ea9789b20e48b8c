"""Before/after speed on a noisy machine: the code at a git revision against the working tree,
alternating the two in fresh processes and keeping each one's best, all in one run.

On a shared 2-core machine the same benchmark can differ by 50% twenty minutes apart, so a figure
from an earlier round is no baseline. This checks the revision out in a temporary git worktree and
runs, in turn for the old code and the new (each from its own folder via PYTHONPATH, with this
interpreter and its packages):

- the whole default Klotski run (prepare + build + simulate + summary) in a fresh process, per preset;
- `klotski-sim compare --no-png` (defaults: every policy, worker processes), per preset, and the
  main job itself (`klotski-sim compare`: as-published, with its figure);
- `klotski-sim simulate --policy klotski --out` (as-published) with every file it writes;
- `--sweep`: the distinct-seed grid of experiments/bench_sweep.py (N default-size ideal Klotski
  configurations on 2 workers), configurations per minute;
- `--synth`: the synthetic routing generator alone (`synthesize`, a fresh process each), seconds and
  peak memory, at the sequences and tokens of default runs of Mixtral-8x7B, DeepSeek-V2-Lite and
  Qwen3-30B-A3B (each run's n batches of 16, plus its warm-up sequences) and of a long prompt.

    python experiments/bench_ab.py --base REV [--rounds 3] [--sweep 20] [--synth | --only-synth]
    python experiments/bench_ab.py --quick [--base HEAD]

`--quick` (for tests): one alternation of every kind of measure on the smallest run (the first 2 of
Mixtral-8x7B's layers, prompt 32, 2 generated tokens), the ideal preset only, no figures, no
worker processes (compare and a sweep of 2 such configurations on 1 worker) and one small
synthetic draw; `--base` defaults to HEAD.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench_policies import QUICK, QUICK_FLAGS, WHOLE_RUN

REPO = Path(__file__).resolve().parent.parent

EXPERIMENTS = Path(__file__).resolve().parent
# the snippets the benchmarks themselves time, run here by either code (bench_policies' whole run
# prints its import and run seconds; bench_sweep's distinct grid is timed by its own function)
SWEEP = """
from bench_sweep import time_default_size
print(time_default_size({count}, {workers}, "ideal", "distinct", {size!r})[0])
"""
SYNTH = """
import resource, time
from klotski_sim.workload.model import get_model
from klotski_sim.workload.trace_synth import synthesize
t = time.perf_counter()
synthesize(get_model({model!r}), {sequences}, {prompt}, {gen})
print(time.perf_counter() - t, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024)
"""
# (model, sequences, prompt, generated tokens): the traces of default Klotski runs (`klotski-sim simulate
# --policy klotski --model M` caches one of 296, 184 and 88 sequences: its batches and its warm-up
# sequences) and a long prompt of a fine-grained model
SYNTH_CASES = [
    ("mixtral-8x7b", 296, 512, 32),
    ("deepseek-v2-lite", 184, 512, 32),
    ("qwen3-30b-a3b", 88, 512, 32),
    ("qwen3-30b-a3b", 16, 8192, 1),
]
# --quick's draw, and its sweep's configurations (sweep spec axes) at the run size of QUICK
QUICK_SYNTH_CASES = [("mixtral-8x7b", 16, 32, 2)]
QUICK_SWEEP = {"models": [QUICK["model"]], "prompt_lens": [QUICK["prompt_len"]], "gen_lens": [QUICK["gen_len"]]}


def python_in(code_dir: Path, *args: str) -> subprocess.CompletedProcess:
    """Run this interpreter on the klotski_sim of `code_dir` (the benchmarks' own modules beside it)."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(code_dir), str(EXPERIMENTS)]))
    result = subprocess.run([sys.executable, *args], cwd=code_dir, env=env, capture_output=True, text=True)
    if result.returncode:  # (its error, not only its exit status: the worktree is gone by the time one looks)
        raise SystemExit(
            f"failed (exit {result.returncode}) in {code_dir}: python {' '.join(args)[:200]}\n{result.stderr[-3000:]}"
        )
    return result


def whole_run(code_dir: Path, impl: str, size: dict[str, object]) -> float:
    out = python_in(code_dir, "-c", WHOLE_RUN.format(impl=impl, size=size)).stdout
    return float(out.split()[1])  # (import s, run s, ops)


def command(code_dir: Path, *args: str) -> float:
    """Wall seconds of one klotski-sim command writing into a fresh folder."""
    with tempfile.TemporaryDirectory() as out:
        t = time.perf_counter()
        python_in(code_dir, "-m", "klotski_sim.cli.main", *args, "--out", out)
        return time.perf_counter() - t


def compare(code_dir: Path, impl: str, figure: bool = False, flags: tuple[str, ...] = ()) -> float:
    return command(code_dir, "compare", "--impl", impl, *([] if figure else ["--no-png"]), *flags)


def sweep_rate(code_dir: Path, count: int, workers: int, size: dict | None) -> float:
    out = python_in(code_dir, "-c", SWEEP.format(count=count, workers=workers, size=size)).stdout
    return count / float(out.split()[-1]) * 60


# the peak memory of the draws the seconds' measure made, taken by its twin measure in the same order
_SYNTH_PEAKS: dict[tuple[Path, tuple[str, int, int, int]], list[float]] = {}


def synth_seconds(code_dir: Path, case: tuple[str, int, int, int]) -> float:
    """Seconds of one synthetic draw in a fresh process (its peak resident MB kept for `synth_peak`)."""
    model, sequences, prompt, gen = case
    out = python_in(code_dir, "-c", SYNTH.format(model=model, sequences=sequences, prompt=prompt, gen=gen))
    seconds, peak = map(float, out.stdout.split())
    _SYNTH_PEAKS.setdefault((code_dir, case), []).append(peak)
    return seconds


def synth_peak(code_dir: Path, case: tuple[str, int, int, int]) -> float:
    """Peak resident MB of the draw `synth_seconds` made in the same alternation (one draw, not two)."""
    return _SYNTH_PEAKS[(code_dir, case)].pop(0)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--base", help="git revision of the code to compare against (with --quick: HEAD)")
    parser.add_argument("--rounds", type=int, default=3, help="alternations of old and new per measure")
    parser.add_argument(
        "--sweep", type=int, default=20, metavar="N", help="configurations in the distinct-seed sweep (0: skip it)"
    )
    parser.add_argument("--synth", action="store_true", help="also time the synthetic routing generator alone")
    parser.add_argument("--only-synth", action="store_true", help="only the generator's measures")
    parser.add_argument(
        "--quick",
        action="store_true",
        help="every kind of measure once on the smallest run (seconds; see the docstring)",
    )
    args = parser.parse_args()
    if args.base is None and not args.quick:
        parser.error("--base is required (or --quick, which compares HEAD)")
    if args.quick:
        args.base, args.rounds, args.sweep, args.synth = args.base or "HEAD", 1, 2, True
    size, flags = (QUICK, QUICK_FLAGS) if args.quick else ({}, ())
    impls = ("ideal",) if args.quick else ("ideal", "as-published")
    workers = 1 if args.quick else 2  # (a pool's start-up would be most of a quick sweep's time)
    base = Path(tempfile.mkdtemp(prefix="klotski-ab-"))
    subprocess.run(
        ["git", "-C", str(REPO), "worktree", "add", "--detach", str(base), args.base], check=True, capture_output=True
    )
    try:
        run_name = "smallest Klotski run" if args.quick else "whole default Klotski run"
        measures = [(f"{run_name}, {impl}", "s", lambda d, i=impl: whole_run(d, i, size), min) for impl in impls]
        # (quick: in one process, as a pool's start-up would be most of so small a comparison)
        compare_flags = (*flags, "--workers", "1") if args.quick else ()
        measures += [
            (
                f"compare --no-png{' --workers 1' if args.quick else ''}, {impl}",
                "s",
                lambda d, i=impl: compare(d, i, flags=compare_flags),
                min,
            )
            for impl in impls
        ]
        if not args.quick:  # (quick runs draw no figure: matplotlib alone takes seconds)
            measures.append(
                (
                    "compare (the main job: as-published, figure)",
                    "s",
                    lambda d: compare(d, "as-published", figure=True),
                    min,
                )
            )
            measures.append(
                (
                    "simulate --policy klotski --out (every file), as-published",
                    "s",
                    lambda d: command(d, "simulate", "--policy", "klotski"),
                    min,
                )
            )
        else:
            measures.append(
                (
                    "simulate --policy klotski --no-png --out, as-published",
                    "s",
                    lambda d: command(d, "simulate", "--policy", "klotski", "--no-png", *flags),
                    min,
                )
            )
        if args.only_synth:
            measures = []
        elif args.sweep:
            kind = "smallest" if args.quick else "default"
            measures.append(
                (
                    f"distinct {kind}-size sweep ({args.sweep}, ideal, {workers} worker{'s' if workers > 1 else ''})",
                    "configurations/min",
                    lambda d: sweep_rate(d, args.sweep, workers, QUICK_SWEEP if args.quick else None),
                    max,
                )
            )
        if args.synth or args.only_synth:
            for case in QUICK_SYNTH_CASES if args.quick else SYNTH_CASES:
                what = f"synthesize {case[0]} {case[1]} x {case[2] + case[3]} tokens"
                measures.append((what, "s", lambda d, c=case: synth_seconds(d, c), min))
                measures.append((f"{what}, peak", "MB", lambda d, c=case: synth_peak(d, c), min))
        print(f"{args.base} (old) against the working tree (new), {args.rounds} alternations each, best of each:")
        for name, unit, measure, best in measures:
            old, new = [], []
            for _ in range(args.rounds):
                old.append(measure(base))
                new.append(measure(REPO))
            print(
                f"{name:55} {best(old):8.3f} -> {best(new):8.3f} {unit}   "
                f"(old {min(old):.3f}-{max(old):.3f}, new {min(new):.3f}-{max(new):.3f})"
            )
    finally:
        subprocess.run(["git", "-C", str(REPO), "worktree", "remove", "--force", str(base)], capture_output=True)


if __name__ == "__main__":
    main()
