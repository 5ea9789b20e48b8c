"""Cold experts on the CPU against Klotski, on every built-in profile that has a `cpu:` section:
klotski, klotski-hybrid, fiddler and llamacpp-moe under both implementation presets, at the
default workload (Mixtral-8x7B, prompt 512, gen 32, bs 16, n from the planner under the
as-published preset, shared by both presets as `compare --impl both` shares it — klotski-hybrid's
from its simulated probes up to that n; fiddler and llamacpp-moe keep one batch in flight). Prints
a markdown table (docs/cpu-experts.md holds its output).

    python experiments/cpu_experts.py [--model mixtral-8x7b] [--batch-size 16] [--quick]

`--quick` (for tests): the h800 profile only (80 GB: Mixtral's experts do not all fit, so some run on
the CPU), prompt 32, 2 generated tokens (the whole model: with fewer layers every expert fits the GPU
and none is computed on the CPU).
"""

from __future__ import annotations

import argparse
from dataclasses import replace

from klotski_sim.hardware.profile import builtin_profile_names, load_profile
from klotski_sim.runs.runner import RunSpec, prepare, run

POLICIES = ("klotski", "klotski-hybrid", "fiddler", "llamacpp-moe")
PRESETS = ("as-published", "ideal")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="mixtral-8x7b")
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--quick", action="store_true", help="one profile, prompt 32, gen 2 (seconds)")
    args = parser.parse_args()
    model, prompt_len, gen_len = args.model, *((32, 2) if args.quick else (512, 32))
    profiles = [hw for hw in builtin_profile_names() if load_profile(hw).cpu is not None]
    print(
        f"{model}, bs {args.batch_size}, prompt {prompt_len}, gen {gen_len}; tok/s end to end (decode only); "
        f"n = batches in flight; CPU share = expert ops on the CPU / all expert ops\n"
    )
    print(
        "| profile | policy | n (as-published / ideal) | as-published tok/s | ideal tok/s | CPU share (ideal) "
        "| bound (ideal) |"
    )
    print("|---|---|---|---|---|---|---|")
    for hw in ["h800"] if args.quick else profiles:
        base = RunSpec(
            model=model,
            hardware=hw,
            batch_size=args.batch_size,
            num_batches=None,
            prompt_len=prompt_len,
            gen_len=gen_len,
        )
        prep = prepare(base)
        for policy in POLICIES:
            cells, ns, share, bound = [], [], "", ""
            for impl in PRESETS:
                r = run(replace(base, policy=policy, impl=impl), prepared=prep)
                s = r.timeline.summary()
                cells.append(f"{s.throughput_tok_s:.1f} ({s.decode_throughput_tok_s:.1f})")
                ns.append(str(s.num_batches))
                if impl == "ideal":
                    experts = [o for o in r.schedule.ops if o.category == "expert"]
                    on_cpu = sum(o.stream == "cpu_compute" for o in experts)
                    share = f"{on_cpu / max(1, len(experts)):.0%}"
                    bound = s.lower_bound_resource
            n = ns[0] if ns[0] == ns[1] else " / ".join(ns)
            print(f"| {hw} | {policy} | {n} | {cells[0]} | {cells[1]} | {share} | {bound} |")


if __name__ == "__main__":
    main()
