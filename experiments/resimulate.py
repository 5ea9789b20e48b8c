"""A validation's measurements against the simulator as it is now: each schedule of a
`klotski-runtime validate` report re-simulated by this checkout from the same calibrated profile and
setting, next to the makespan the run measured and the one simulated when it ran.

    python experiments/resimulate.py VALIDATION.json PROFILE.yaml [--set gpu.issue=per-stream] [--only KEY,...]

What a change to the simulator does to errors already measured on a GPU, without the GPU: the
measurement stays, only the prediction is new (experiments/results/NVIDIA-H200/README.md uses it).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from klotski_sim.cli.common import parse_overrides
from klotski_sim.policies import get_policy
from klotski_sim.runs.runner import RunSpec, run


def resimulate(
    report: dict, profile: str, overrides: dict, only: set[str] | None = None
) -> list[tuple[str, float, float, float]]:
    """(schedule, measured s, simulated s when it ran, simulated s now) for each schedule of `report`,
    run as `validate` runs it (experts in host memory, no resident layers, 2 warm-up sequences)."""
    setup = report["setup"]
    rows = []
    for key, result in report["policies"].items():
        if only is not None and key not in only or "makespan" not in result:  # (a skipped schedule has none)
            continue
        policy, _, impl = key.partition("/")
        spec = RunSpec(
            model=setup["model"],
            hardware=profile,
            policy=policy,
            batch_size=setup["batch_size"],
            # (a policy that keeps one batch in flight runs at n = 1, as validate runs it)
            num_batches=1 if get_policy(policy).traits.one_batch else setup["num_batches"],
            prompt_len=setup["prompt_len"],
            gen_len=setup["gen_len"],
            seed=setup["seed"],
            routing=setup["routing"],
            kv=setup["kv"] or "auto",
            experts="cpu",
            resident_layers=0,
            warmup_sequences=2,
            options=setup.get("options") or {},
            impl=impl or "as-published",
            overrides=overrides,
        )
        makespan = result["makespan"]
        rows.append((key, makespan["measured_s"], makespan["simulated_s"], run(spec).timeline.makespan))
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("report", type=Path, help="a validation.json written by klotski-runtime validate")
    parser.add_argument("profile", help="the calibrated profile the validation used")
    parser.add_argument("--set", action="append", default=[], metavar="FIELD=VALUE", help="a profile override")
    parser.add_argument("--only", help="the schedules to re-simulate, comma-separated (e.g. klotski/ideal)")
    args = parser.parse_args(argv)
    report = json.loads(args.report.read_text(encoding="utf-8"))
    only = set(args.only.split(",")) if args.only else None
    unknown = sorted((only or set()) - set(report["policies"]))
    if unknown:
        parser.error(f"--only: {', '.join(unknown)} not in {args.report} (it has {', '.join(report['policies'])})")
    print(f"{'schedule':30s} {'measured ms':>12s} {'then ms':>9s} {'error':>8s} {'now ms':>9s} {'error':>8s}")
    for key, measured, then, now in resimulate(report, args.profile, parse_overrides(args.set, "--set"), only):
        print(
            f"{key:30s} {measured * 1e3:12.1f} {then * 1e3:9.1f} {then / measured - 1:+8.1%} "
            f"{now * 1e3:9.1f} {now / measured - 1:+8.1%}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
