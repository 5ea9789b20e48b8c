"""Serving at scale: how fast a serving run simulates and how much memory it holds per op.

Runs each serving policy on Mixtral-8x7B on one L40S at the issue's sizes (B_cfg 32 and 256 requests,
outputs of 1,024 and 4,096 tokens, ShareGPT-length prompts of 52 tokens: FluxMoE's mean for
Mixtral), and prints per run: iterations, ops, wall seconds, ops/s, the peak memory this process
grew by (bytes per op), and the predicted throughput, TTFT, TPOT and mean B_act.

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
        f"{'policy':14} {'B_cfg':>5} {'out':>5} {'iters':>6} {'ops':>9} {'wall s':>7} {'ops/s':>8} {'B/op':>6} "
        f"{'tok/s':>8} {'TTFT s':>7} {'TPOT ms':>8} {'B_act':>6}"
    )
    for requests, output in sizes:
        for policy in args.policies.split(","):
            gc.collect()
            before = peak_rss_bytes()
            began = time.perf_counter()
            try:
                r = serve(ServeSpec(model, profile, policy, fixed_requests(requests, 52, output)))
            except ServingRefusal as err:
                print(f"{policy:14} {requests:5} {output:5} refused: {err}")
                continue
            wall = time.perf_counter() - began
            ops = len(r.schedule.ops)
            grew = max(0, peak_rss_bytes() - before)
            m = r.metrics
            print(
                f"{policy:14} {requests:5} {output:5} {len(r.iterations):6} {ops:9,} {wall:7.2f} {ops / wall:8,.0f} "
                f"{grew / ops:6.0f} {m.throughput_tok_s:8.1f} {m.ttft_s.mean:7.3f} {m.tpot_s.mean * 1e3:8.1f} "
                f"{m.mean_active:6.1f}"
            )
            del r
    print("B/op: growth of this process's peak resident memory over the run, per op (0: below an earlier peak)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
