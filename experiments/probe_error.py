"""How far `klotski-hybrid`'s probes (klotski_sim/planning/probe.py) predict from the whole runs they stand
for, and what the n they choose loses against the best n they probed: for every built-in profile
with a `cpu:` section, three models and both presets at the default workload (bs 16, prompt 512,
gen 32), each probed n is also run whole (at the placement the probe had). Prints every probe's
prediction error, then, for a few tie margins, what choosing by the predictions would lose against
the best whole run among the probed n ("regret") — the data behind `probe.TIE`.

    python experiments/probe_error.py [--models mixtral-8x7b,olmoe-1b-7b,qwen1.5-moe-a2.7b] [--batch-size 16] [--quick]

`--quick` (for tests): the h800 profile and the first model only, at prompt 32 and 2 generated
tokens.
"""

from __future__ import annotations

import argparse
from dataclasses import replace

from klotski_sim.hardware.profile import builtin_profile_names, load_profile
from klotski_sim.planning.probe import Probe
from klotski_sim.runs.runner import RunSpec, _probe_placement, policy_batches, prepare, probe_batches, run

MARGINS = (0.0, 0.005, 0.01, 0.015, 0.02, 0.03)


def chosen(probes: list[Probe], margin: float) -> Probe:
    """`probe.choose` with another tie margin: the smallest n within `margin` of the best prediction."""
    best = max(p.predicted_tok_s for p in probes)
    return min((p for p in probes if p.predicted_tok_s >= best * (1 - margin)), key=lambda p: p.n)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", default="mixtral-8x7b,olmoe-1b-7b,qwen1.5-moe-a2.7b")
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--quick", action="store_true", help="one profile, one model, prompt 32, gen 2 (seconds)")
    args = parser.parse_args()
    profiles = [name for name in builtin_profile_names() if load_profile(name).cpu is not None]
    models = args.models.split(",")
    size = {"prompt_len": 32, "gen_len": 2} if args.quick else {}
    if args.quick:
        profiles, models = ["h800"], models[:1]
    errors: list[float] = []
    regrets: dict[float, list[float]] = {m: [] for m in MARGINS}
    print(f"{'profile':<9}{'model':<19}{'preset':<14}{'n':>4}{'predicted':>11}{'whole run':>11}{'error':>8}")
    for profile in profiles:
        for model in models:
            for impl in ("as-published", "ideal"):
                spec = RunSpec(
                    model=model,
                    hardware=profile,
                    policy="klotski-hybrid",
                    batch_size=args.batch_size,
                    num_batches=None,
                    impl=impl,
                    **size,
                )
                prep = prepare(spec)
                if prep.refused is not None:
                    print(f"{profile:<9}{model:<19}{impl:<14} refused: {prep.refused}")
                    continue
                prep = prep.narrowed(policy_batches(spec.policy, prep))
                search = probe_batches(spec, prep)
                probes = [p for p in search.probes if p.predicted_tok_s > 0]
                actual: dict[int, float] = {}
                for p in probes:
                    at_n = replace(prep.narrowed(p.n), placement=_probe_placement(spec, prep, p.n))
                    result = run(replace(spec, num_batches=p.n), prepared=at_n)
                    actual[p.n] = result.timeline.summary().throughput_tok_s
                    error = p.predicted_tok_s / actual[p.n] - 1 if actual[p.n] else float("nan")
                    errors.append(error)
                    mark = "   <= chosen" if p.n == search.chosen.n else ""
                    print(
                        f"{profile:<9}{model:<19}{impl:<14}{p.n:>4}{p.predicted_tok_s:>11.1f}{actual[p.n]:>11.1f}"
                        f"{error:>+8.1%}{mark}"
                    )
                best = max(actual.values())
                for margin in MARGINS:
                    regrets[margin].append(best / actual[chosen(probes, margin).n] - 1)
    finite = sorted(abs(e) for e in errors if e == e)
    print(
        f"\n{len(finite)} probes: |prediction error| median {finite[len(finite) // 2]:.2%}, "
        f"90th percentile {finite[int(0.9 * (len(finite) - 1))]:.2%}, max {finite[-1]:.2%}"
    )
    print("tie margin   configurations that lose   mean loss   worst loss   (against the best whole run probed)")
    for margin in MARGINS:
        r = regrets[margin]
        print(
            f"{margin:>10.1%}   {sum(x > 1e-9 for x in r):>10d} of {len(r):<13d}{sum(r) / len(r):>9.2%}{max(r):>12.2%}"
        )


if __name__ == "__main__":
    main()
