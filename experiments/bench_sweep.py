"""Sweep throughput: a grid of >= 200 Mixtral-8x7B configurations with 1 and then 2 local worker
processes, measured in one run; prints configurations per minute and the speed-up.

    python experiments/bench_sweep.py [--workers 2]
"""

from __future__ import annotations

import argparse
import tempfile
import time

from klotski_sim.sweep import expand, parse_spec, run_sweep

GRID = {
    "name": "bench",
    "models": ["mixtral-8x7b"],
    "hardware": ["rtx3090", "h800"],
    "policies": ["single-batch", "multi-batch", "klotski", "flexgen"],
    "batch_sizes": [4, 8, 16],
    "num_batches": [2, 4, 8],
    "prompt_lens": [64],
    "gen_lens": [4],
    "routings": ["calibrated", "uniform"],
    "overrides": {"links.pcie_h2d.bandwidth": [16e9, 32e9]},
}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workers", type=int, default=2)
    args = ap.parse_args()
    spec = parse_spec(GRID)
    n = len(expand(spec))
    times = {}
    for workers in (1, args.workers):
        with tempfile.TemporaryDirectory() as out:
            t = time.perf_counter()
            df = run_sweep(spec, out, workers=workers, progress=False)
            times[workers] = time.perf_counter() - t
            assert len(df) == n and (df["status"] == "ok").all(), df["status"].value_counts()
        print(f"{workers} worker(s): {n} configurations in {times[workers]:.1f} s -> "
              f"{n / times[workers] * 60:.0f} configurations/min")
    print(f"speed-up of {args.workers} workers over 1: {times[1] / times[args.workers]:.2f}x")


if __name__ == "__main__":
    main()
