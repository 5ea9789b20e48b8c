"""Sweep throughput, measured in one run.

- default: a grid of 288 small Mixtral-8x7B configurations (prompt 64, gen 4) with 1 and then 2
  local worker processes; configurations per minute and the speed-up.
- `--default-size N`: N default-size Klotski configurations (prompt 512, gen 32, batch 16, planner
  n) on `--workers` workers, per implementation preset, twice: a what-if grid over the PCIe
  bandwidth (schedules reused where they do not change) and N routing seeds (every schedule
  distinct); configurations per minute and the time 1,000 of them would take at that rate.

    python experiments/bench_sweep.py [--workers 2] [--default-size 40] [--quick]

`--quick` (for tests): the small grid cut to 4 configurations; with `--default-size N`, the N
configurations on the first 2 of Mixtral-8x7B's layers at prompt 32, 2 generated tokens. Both on
the same workers as without it, in seconds.
"""

from __future__ import annotations

import argparse
import tempfile
import time

import pandas as pd

from klotski_sim.runs.sweep import expand, parse_spec, run_sweep

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
# --quick's grid: every axis of GRID kept, cut to 4 configurations
QUICK_GRID = dict(
    GRID,
    hardware=["rtx3090"],
    policies=["klotski", "flexgen"],
    batch_sizes=[4],
    num_batches=[2],
    routings=["calibrated"],
)
# --quick's default-size configuration: the smallest run (sweep spec axes)
QUICK_SIZE = {"models": ["mixtral-8x7b:2"], "prompt_lens": [32], "gen_lens": [2]}


def default_size(count: int, workers: int, impl: str, grid: str, size: dict | None = None) -> None:
    """`what-if`: one configuration over `count` PCIe bandwidths (a Klotski schedule does not depend
    on the link's speed: the sweep builds it once per n and simulates it again); `distinct`: `count`
    routing seeds, every schedule built anew (their routings synthesised beforehand, untimed)."""
    took, df = time_default_size(count, workers, impl, grid, size)
    rate = count / took * 60
    what = "smallest" if size else "default"
    print(
        f"{impl:13} {grid:8} {count} {what}-size configurations on {workers} workers in {took:.1f} s -> "
        f"{rate:.0f} configurations/min; 1,000 would take {1000 / rate:.1f} min "
        f"(ops per configuration: {int(df['m.num_ops'].median())}; distinct n: {df['m.n'].nunique()})"
    )


def time_default_size(
    count: int, workers: int, impl: str, grid: str, size: dict | None = None
) -> tuple[float, pd.DataFrame]:
    """The seconds the sweep of `default_size` takes, and its results (experiments/bench_ab.py times it
    for old and new code); `size` (sweep spec axes: QUICK_SIZE) replaces the default size."""
    axes: dict = (
        {"overrides": {"links.pcie_h2d.bandwidth": [8e9 + 48e9 * k / max(1, count - 1) for k in range(count)]}}
        if grid == "what-if"
        else {"seeds": list(range(count))}
    )
    spec = parse_spec(
        {
            "name": "bench-default",
            "models": ["mixtral-8x7b"],
            "hardware": ["rtx3090"],
            "policies": ["klotski"],
            "impls": [impl],
            **axes,
            **(size or {}),
        }
    )
    if grid == "distinct":  # each seed's routing synthesised once beforehand (the trace cache): not timed
        with tempfile.TemporaryDirectory() as out:
            run_sweep(spec, out, workers=workers, progress=False)
    with tempfile.TemporaryDirectory() as out:
        t = time.perf_counter()
        df = run_sweep(spec, out, workers=workers, progress=False)
        took = time.perf_counter() - t
    assert len(df) == count and (df["status"] == "ok").all(), df["status"].value_counts()
    return took, df


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument(
        "--default-size",
        type=int,
        default=0,
        metavar="N",
        help="measure N default-size configurations per preset instead of the small grid",
    )
    ap.add_argument("--quick", action="store_true", help="4 configurations, or N of the smallest size (seconds)")
    args = ap.parse_args()
    if args.default_size:
        for impl in ("ideal", "as-published"):
            for grid in ("what-if", "distinct"):
                default_size(args.default_size, args.workers, impl, grid, QUICK_SIZE if args.quick else None)
        return
    spec = parse_spec(QUICK_GRID if args.quick else GRID)
    n = len(expand(spec))
    times = {}
    for workers in (1, args.workers):
        with tempfile.TemporaryDirectory() as out:
            t = time.perf_counter()
            df = run_sweep(spec, out, workers=workers, progress=False)
            times[workers] = time.perf_counter() - t
            assert len(df) == n and (df["status"] == "ok").all(), df["status"].value_counts()
        print(
            f"{workers} worker(s): {n} configurations in {times[workers]:.1f} s -> "
            f"{n / times[workers] * 60:.0f} configurations/min"
        )
    print(f"speed-up of {args.workers} workers over 1: {times[1] / times[args.workers]:.2f}x")


if __name__ == "__main__":
    main()
