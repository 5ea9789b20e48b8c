"""Long prompts: wall time and peak memory of `klotski-sim simulate --out` (Klotski, ideal preset,
8 generated tokens, n from the planner) at long prompt lengths, with a cold trace cache (the
synthetic routing generated, then cached), a warm one, and the cache off (`KLOTSKI_CACHE_DIR=off`),
each in a fresh process. `--code DIR`
runs another checkout's code (e.g. a git worktree at an older revision) for a before/after.

    python experiments/bench_long_prompt.py [--prompts 4096,16384,32768] [--code DIR] [--quick]

`--quick` (for tests): one short prompt (256) on the first 2 of Mixtral-8x7B's layers, without the
Gantt figure: the same three runs in seconds.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench_policies import PEAK_OF

# what --quick adds to each simulate command: a 2-layer model and no figure (the figure alone is a second)
QUICK = ("--model", "mixtral-8x7b:2", "--no-png")


def simulate(prompt_len: int, cache: str, code: str | None, extra: tuple[str, ...] = ()) -> tuple[float, float, float]:
    """Wall seconds, peak RSS (MB) and the routing.npz written (MB) of one simulate run."""
    env = dict(os.environ, KLOTSKI_CACHE_DIR=cache)
    if code:
        env["PYTHONPATH"] = code
    with tempfile.TemporaryDirectory() as out:
        start = time.perf_counter()
        result = subprocess.run(
            [
                sys.executable,
                "-c",
                PEAK_OF,
                sys.executable,
                "-m",
                "klotski_sim.cli.main",
                "simulate",
                "--policy",
                "klotski",
                "--impl",
                "ideal",
                "--prompt-len",
                str(prompt_len),
                "--gen-len",
                "8",
                *extra,
                "--out",
                out,
            ],
            capture_output=True,
            text=True,
            env=env,
            check=True,
            cwd=code or None,
        )
        took = time.perf_counter() - start
        peak_kb, rc = result.stdout.split()
        if rc != "0":
            raise SystemExit(f"simulate --prompt-len {prompt_len} failed (exit {rc})")
        routing = Path(out) / "routing.npz"
        return took, int(peak_kb) / 1024, routing.stat().st_size / 1e6 if routing.exists() else 0.0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--prompts", default="4096,16384,32768")
    parser.add_argument("--code", help="a checkout whose klotski_sim to run (default: this one)")
    parser.add_argument("--quick", action="store_true", help="prompt 256 on a 2-layer Mixtral-8x7B, no figure")
    args = parser.parse_args()
    code = str(Path(args.code).resolve()) if args.code else None
    prompts, extra = ("256", QUICK) if args.quick else (args.prompts, ())
    print(f"code: {code or 'this checkout'}" + (f"; {' '.join(extra)}" if extra else ""))
    print(
        f"{'prompt':>7} {'cold s':>7} {'cold MB':>8} {'warm s':>7} {'warm MB':>8} {'off s':>7} {'off MB':>8} "
        f"{'routing.npz MB':>15}"
    )
    for prompt_len in (int(p) for p in prompts.split(",")):
        with tempfile.TemporaryDirectory() as cache:
            cold_s, cold_mb, _ = simulate(prompt_len, cache, code, extra)
            warm_s, warm_mb, routing_mb = simulate(prompt_len, cache, code, extra)
        off_s, off_mb, _ = simulate(prompt_len, "off", code, extra)
        print(
            f"{prompt_len:7d} {cold_s:7.1f} {cold_mb:8.0f} {warm_s:7.1f} {warm_mb:8.0f} {off_s:7.1f} {off_mb:8.0f} "
            f"{routing_mb:15.1f}"
        )


if __name__ == "__main__":
    main()
