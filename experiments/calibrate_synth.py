"""Fit the calibrated generator's knobs: print trace statistics for a grid of settings next to
the targets (klotski_sim/workload/data/CALIBRATION-README.md), so the chosen constants in
klotski_sim/workload/trace_synth.py can be checked and re-fitted.

    python experiments/calibrate_synth.py [--model mixtral-8x7b] [--sequences 256] [--grid] [--quick]
    python experiments/calibrate_synth.py --coupled [--quick]

`--coupled`: the coupling of real Mixtral-8x7B decode routing (issue 41's figures from a public log
of 577 decode tokens) against plain `calibrated` and `calibrated:coupling=0.8,type_coupling=3`
(trace_synth.COUPLED_MIXTRAL) on traces of that size (18 sequences x 33 generated tokens, decode
tokens only, the mean over layers of `trace stats`, 3 seeds), each statistic's error, the worst.

`--quick` (for tests): 16 sequences of 64 prompt and 4 generated tokens per setting (seconds, with
`--grid` too); the statistics are then noisy.
"""

from __future__ import annotations

import argparse
import itertools
from dataclasses import replace

import klotski_sim.workload.trace_synth as ts
from klotski_sim.workload.model import get_model
from klotski_sim.workload.trace_stats import summary

TARGETS = {
    "mixtral": "max_share ~0.16 (corpus), request_max_share 0.20-0.30, stick_top1 ~0.25, stick_any ~0.62, "
    "mi (top1->top1, layers 0-7/7-15) 0.05-0.25 bits",
    "fine-grained": "top-8 of 64 take 0.20-0.51, mi 0.4-1.3 bits",
}


def coupled() -> None:
    """`--coupled`: plain calibrated and the coupled setting against real routing (module docstring)."""
    from klotski_sim.workload.trace_stats import layer_stats, token_subset

    model = get_model("mixtral-8x7b")
    knobs = ",".join(f"{k}={v:g}" for k, v in ts.COUPLED_MIXTRAL.items())
    real = ts.REAL_MIXTRAL_DECODE
    print("real: " + " ".join(f"{k}={v:.3f}" for k, v in real.items()))
    for routing in ("calibrated", f"calibrated:{knobs}"):
        means = []
        for seed in (0, 1, 2):  # (cheap at this size: --quick runs the same)
            trace = token_subset(ts.synthesize(model, 18, 32, 33, routing, seed=seed), "generated")
            frame = layer_stats(trace)
            means.append({k: float(frame[k].mean()) for k in real})
        got = {k: sum(m[k] for m in means) / len(means) for k in real}
        errors = {k: got[k] / real[k] - 1 for k in real}
        print(
            f"{routing}: "
            + " ".join(f"{k}={got[k]:.3f} ({errors[k]:+.0%})" for k in real)
            + f"; worst {max(map(abs, errors.values())):.0%}"
        )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="mixtral-8x7b")
    ap.add_argument("--sequences", type=int, default=256)
    ap.add_argument("--grid", action="store_true", help="scan a small grid around the current constants")
    ap.add_argument("--quick", action="store_true", help="16 short sequences per setting (seconds)")
    ap.add_argument("--coupled", action="store_true", help="real Mixtral decode coupling vs the coupled setting")
    args = ap.parse_args()
    if args.coupled:
        coupled()
        return
    prompt_len, gen_len = (64, 4) if args.quick else (512, 32)
    if args.quick:
        args.sequences = 16
    model = get_model(args.model)
    base = ts.params_for("calibrated", model)
    print("targets:", TARGETS["fine-grained" if model.num_experts > 16 else "mixtral"])
    settings = [base]
    if args.grid:
        settings = [
            replace(base, concentration=c, coupling=g, type_coupling=t)
            for c, g, t in itertools.product(
                (base.concentration / 2, base.concentration),
                (base.coupling * 0.7, base.coupling),
                (base.type_coupling * 0.7, base.type_coupling),
            )
        ]
    original = ts.params_for
    for p in settings:
        ts.params_for = lambda routing, m, p=p: p  # evaluate this setting
        s = summary(ts.synthesize(model, args.sequences, prompt_len, gen_len, "calibrated", seed=1))
        print(
            f"conc={p.concentration} stick_all={p.stick_all} stick_one={p.stick_one} coupling={p.coupling} "
            f"type_coupling={p.type_coupling}: "
            + " ".join(
                f"{k}={s[k]:.3f}"
                for k in (
                    "max_share",
                    "max_share_max",
                    "topk_share",
                    "request_max_share",
                    "stick_top1",
                    "stick_any",
                    "mi_next_bits",
                    "mi_skip7_bits",
                )
            )
        )
    ts.params_for = original


if __name__ == "__main__":
    main()
