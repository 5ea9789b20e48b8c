"""Serving at scale: how fast a serving run simulates and how much memory it holds.

Runs each serving policy on Mixtral-8x7B on one L40S at the issue's sizes (B_cfg 32 and 256 requests,
outputs of 1,024 and 4,096 tokens, prompts of 52 tokens: FluxMoE's ShareGPT mean for Mixtral), the
way `klotski-sim serve` runs them (ops dropped once timed; iterations of a known shape timed
compiled), and prints per run: iterations, the share timed compiled, the ops they stand for, wall
seconds, ops/s, iterations/s, what this process's peak memory grew by per iteration, and the
predicted throughput, TTFT, TPOT and mean B_act. Then the smallest size again keeping every op (as
`serve --timeline` does: every op emitted and timed by the engine, a Schedule and Timeline built),
with its bytes per op, and the ratio of the two modes' wall times measured in this one run.

    python experiments/bench_serving.py [--policies vllm-o,ktransformers,fluxmoe-h,fluxmoe] [--quick]

`--quick` (for tests): B_cfg 8 x 64 output tokens on tiny-mixtral.
"""

from __future__ import annotations

import argparse
import gc
import resource
import time

from klotski_sim.hardware.profile import load_profile, with_overrides
from klotski_sim.serving.batcher import ServingRefusal
from klotski_sim.serving.requests import fixed_requests
from klotski_sim.serving.run import ServeSpec, serve
from klotski_sim.workload.model import get_model


def peak_rss_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # (Linux reports kB)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--policies", default="vllm-o,ktransformers,fluxmoe-h,fluxmoe")
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()
    if args.quick:
        model = get_model("tiny-mixtral")
        profile = with_overrides(load_profile("rtx3090"), {"gpu.decompress_bandwidth": 396.5e9})
        sizes = [(8, 64)]
    else:
        model, profile = get_model("mixtral-8x7b"), load_profile("l40s")
        sizes = [(32, 1024), (32, 4096), (256, 1024), (256, 4096)]
    print(f"{model.name} on {profile.name}; prompt 52 tokens")
    print(
        f"{'policy':14} {'B_cfg':>5} {'out':>5} {'mode':>7} {'iters':>7} {'compiled':>8} {'ops':>11} {'wall s':>7} "
        f"{'ops/s':>10} {'iters/s':>8} {'bytes':>6} {'tok/s':>8} {'TTFT s':>7} {'TPOT ms':>8} {'B_act':>6}"
    )
    walls: dict[tuple[str, bool], float] = {}
    runs = [(size, False) for size in sizes] + [(sizes[0], True)]
    for (requests, output), keep in runs:
        for policy in args.policies.split(","):
            gc.collect()
            before = peak_rss_bytes()
            began = time.perf_counter()
            try:
                r = serve(ServeSpec(model, profile, policy, fixed_requests(requests, 52, output)), keep=keep)
            except ServingRefusal as err:
                print(f"{policy:14} {requests:5} {output:5} refused: {err}")
                continue
            wall = time.perf_counter() - began
            if (requests, output) == sizes[0]:
                walls[policy, keep] = wall
            ops, iters = r.meta["num_ops"], len(r.iterations)
            grew = max(0, peak_rss_bytes() - before) / (ops if keep else iters)
            m = r.metrics
            print(
                f"{policy:14} {requests:5} {output:5} {'kept' if keep else 'dropped':>7} {iters:7,} "
                f"{r.meta['iterations_timed_compiled'] / iters:8.0%} {ops:11,} {wall:7.2f} {ops / wall:10,.0f} "
                f"{iters / wall:8,.0f} {grew:6.0f} {m.throughput_tok_s:8.2f} {m.ttft_s.mean:7.3f} "
                f"{m.tpot_s.mean * 1e3:8.1f} {m.mean_active:6.1f}"
            )
            del r
    print(
        "bytes: growth of this process's peak resident memory over the run, per iteration (dropped) or per op "
        "(kept); 0: below an earlier peak"
    )
    for policy in args.policies.split(","):
        if (policy, True) in walls and (policy, False) in walls:
            print(
                f"{policy}: keeping every op takes {walls[policy, True] / walls[policy, False]:.1f}x the time of "
                f"dropping them at B_cfg {sizes[0][0]} x {sizes[0][1]}"
            )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
