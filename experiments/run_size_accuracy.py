"""How close the run-size projection (klotski_sim/util/run_size.py: made when a policy loop's third step
begins) comes to the ops the schedule then has, per policy and model at default size.

    python experiments/run_size_accuracy.py [--quick]

`--quick` (for tests): Mixtral-8x7B's cases only, on its first 2 layers at prompt 32 and 4 generated
tokens (the projection is made when the third step begins: a run needs at least three).
"""

from __future__ import annotations

import argparse
from dataclasses import replace

from klotski_sim.policies import build_schedule
from klotski_sim.runs.runner import RunSpec, plan_run, prepare
from klotski_sim.util import run_size

CASES = [
    ("mixtral-8x7b", policy, impl)
    for policy in (
        "single-batch",
        "multi-batch",
        "hot-prefetch",
        "klotski",
        "klotski-oracle",
        "flexgen",
        "fiddler",
        "llamacpp-moe",
        "klotski-hybrid",
    )
    for impl in ("as-published", "ideal")
] + [
    ("qwen3-30b-a3b", "klotski", "as-published"),
    ("deepseek-v2-lite", "flexgen", "as-published"),
    ("olmoe-1b-7b", "klotski", "as-published"),
]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="Mixtral-8x7B only, 2 layers, prompt 32, gen 4 (seconds)")
    args = ap.parse_args()
    size = {"prompt_len": 32, "gen_len": 4} if args.quick else {}
    projected: list[int] = []
    project = run_size.RunSizeWatch._project

    def spy(self: run_size.RunSizeWatch, ops_built: int) -> None:
        projected.append(self.projected_ops(ops_built))
        project(self, ops_built)

    run_size.RunSizeWatch._project = spy  # type: ignore[method-assign]
    print(f"{'model':17} {'policy':14} {'impl':13} {'ops built':>10} {'projected':>10} {'error':>7}")
    worst = 0.0
    for model, policy, impl in CASES:
        if args.quick and model != "mixtral-8x7b":
            continue
        spec = RunSpec(model=f"{model}:2" if args.quick else model, policy=policy, impl=impl, num_batches=None, **size)
        prep = plan_run(spec, prepare(spec)).prepared  # (klotski-hybrid's probes: projected too)
        projected.clear()
        ops = len(build_schedule(policy, replace(prep.policy_input(spec.options), impl=impl)))
        error = projected[0] / ops - 1
        worst = max(worst, abs(error))
        print(f"{spec.model:17} {policy:14} {impl:13} {ops:10,} {projected[0]:10,} {error:+7.2%}")
    print(f"largest error {worst:.2%}")


if __name__ == "__main__":
    main()
