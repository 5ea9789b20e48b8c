"""What the calibrated generator's what-ifs (`--routing calibrated:KEY=VALUE`) change, and what the
methods that exploit them gain: the routing statistics of each knob (`trace stats`' layer means),
Klotski's hot-expert predictor from the previous layer alone (the paper) against the previous layer
and the previous token (spatio-temporal), and an expert cache's hits under a reuse-biased router.
Prints markdown tables (docs/routing.md holds their output).

    python experiments/routing_knobs.py [--quick]

`--quick` (for tests): 16 sequences of 16 + 8 tokens, one model, the smallest runs.
"""

from __future__ import annotations

import argparse

from klotski_sim.runs.runner import RunSpec, run
from klotski_sim.workload.model import get_model
from klotski_sim.workload.trace_stats import summary
from klotski_sim.workload.trace_synth import synthesize

ROUTINGS = (
    "uniform",
    "calibrated",
    "calibrated:reuse=1",
    "calibrated:reuse=2",
    "calibrated:decode_drift=1",
    "calibrated:domain=code",
    "calibrated:domain=math",
    "calibrated:domain=mixed",
)
STATS = ("reuse_share", "stick_any", "pd_sim", "pd_sim_other", "request_max_share", "max_share")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="the smallest sizes (seconds)")
    args = parser.parse_args()
    models = ("mixtral-8x7b",) if args.quick else ("mixtral-8x7b", "qwen3-30b-a3b")
    sequences, prompt_len, gen_len = (16, 16, 8) if args.quick else (256, 64, 32)

    print(f"Routing statistics: {sequences} sequences of {prompt_len} + {gen_len} tokens, seed 0, layer means\n")
    print("| model | routing | " + " | ".join(STATS) + " |")
    print("|---|---|" + "---|" * len(STATS))
    for name in models:
        model = get_model(name)
        for routing in ROUTINGS:
            stats = summary(synthesize(model, sequences, prompt_len, gen_len, routing, 0))
            print(f"| {name} | {routing} | " + " | ".join(f"{stats[s]:.3f}" for s in STATS) + " |")

    groups = ((1, 1),) if args.quick else ((1, 1), (4, 2), (16, 8))
    steps = 3 if args.quick else 17
    print(
        f"\nKlotski's hot experts (ideal preset, rtx3090, prompt 64, {steps - 1} decode steps): hot identification "
        "(predicted among the group's true top-K) and hot coverage (tokens the predicted experts serve), "
        "predictor=layer -> layer+token\n"
    )
    print("| model | routing | bs x n | hot identification | hot coverage | decode tok/s |")
    print("|---|---|---|---|---|---|")
    for name in models:
        for routing in ("calibrated", "calibrated:reuse=1", "calibrated:domain=mixed"):
            for bs, n in groups:
                cells = []
                for predictor in ("layer", "layer+token"):
                    spec = RunSpec(
                        policy="klotski",
                        model=name,
                        routing=routing,
                        batch_size=bs,
                        num_batches=n,
                        prompt_len=64,
                        gen_len=steps,
                        impl="ideal",
                        options={"predictor": predictor},
                    )
                    s = run(spec).timeline.summary()
                    cells.append((s.extra["prefetch"], s.decode_throughput_tok_s))
                (a, ta), (b, tb) = cells
                print(
                    f"| {name} | {routing} | {bs} x {n} | {a['hot_identification']:.3f} -> {b['hot_identification']:.3f} "
                    f"| {a['hot_coverage']:.3f} -> {b['hot_coverage']:.3f} | {ta:.3f} -> {tb:.3f} |"
                )

    print(
        f"\nAn expert cache of 96 slots (LRU) under Klotski, h800 profile, 1 sequence, prompt 64, {steps - 1} decode "
        "steps (ideal preset)\n"
    )
    print("| model | routing | hits | misses | hit rate | decode tok/s |")
    print("|---|---|---|---|---|---|")
    for routing in ("calibrated", "calibrated:reuse=1", "calibrated:reuse=2"):
        spec = RunSpec(
            policy="klotski",
            model="mixtral-8x7b",
            hardware="h800",
            routing=routing,
            batch_size=1,
            num_batches=1,
            prompt_len=64,
            gen_len=steps,
            impl="ideal",
            options={"expert_cache": 96},
        )
        s = run(spec).timeline.summary()
        cache = s.extra["expert_cache"]
        print(
            f"| mixtral-8x7b | {routing} | {cache['hits']} | {cache['misses']} | {cache['hit_rate']:.3f} "
            f"| {s.decode_throughput_tok_s:.3f} |"
        )


if __name__ == "__main__":
    main()
