"""Simulate vs execute the same schedule, and say how far apart they are.

For each policy: build the schedule once, simulate it on a (calibrated) profile, execute it on
the device, then report the makespan error, the bubble errors (inter- and intra-layer), the
per-category duration errors and the worst mismatched ops; write both timelines, a side-by-side
Gantt (simulated above, measured below, same time axis) and `validation.json`.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any, Mapping

import numpy as np
import pandas as pd
import torch

from klotski_sim.engine import resource_capacities, simulate
from klotski_sim.hardware import HardwareProfile, ProfileError
from klotski_sim.model import get_model
from klotski_sim.policies import build_schedule
from klotski_sim.runner import RunSpec, prepare
from klotski_sim.timeline import Timeline, jsonable

from .executor import ExecOptions, execute
from .kernels import WeightStore

ALL_POLICIES = ("single-batch", "multi-batch", "hot-prefetch", "klotski", "klotski-oracle", "flexgen")


@dataclass(frozen=True)
class ValidationSetup:
    """One validation campaign: a model, a device, a workload and how links are treated."""

    model: str = "small-mixtral"
    device: str = "cpu"
    batch_size: int = 4
    num_batches: int = 2
    prompt_len: int = 32
    gen_len: int = 4
    routing: str = "calibrated"
    trace: str | None = None
    seed: int = 0
    kv: str = "gpu"
    emulate_links: Mapping[str, float] = field(default_factory=dict)
    emulate_pageable: Mapping[str, float] = field(default_factory=dict)
    impl: str = "as-published"  # an implementation preset, or "both" (as-published and ideal)
    checkpoint: str | None = None
    dtype: str = "bfloat16"
    warmup_runs: int = 1
    threads: int | None = 1  # CPU: torch threads for compute; the other cores run the copy threads


def check_profile_device(profile: HardwareProfile, device: str) -> None:
    """A calibrated profile describes one kind of device; refuse to validate another with it."""
    kind = profile.provenance.get("device_kind")
    want = "cuda" if device.startswith("cuda") else "cpu"
    if kind and kind != want:
        raise ProfileError(f"profile {profile.name!r} was calibrated on a {kind} device "
                           f"({profile.provenance.get('device')}), not {want}: calibrate this device first")


def compare(sim: Timeline, meas: Timeline, worst: int = 10) -> dict[str, Any]:
    """Error figures of a simulated vs a measured timeline of the same schedule."""
    s, m = sim.summary(), meas.summary()

    def rel(a: float, b: float) -> float | None:
        return (a - b) / b if b > 0 else None

    ds, dm = sim.df.set_index("op_id"), meas.df.set_index("op_id")
    dur = pd.DataFrame({"category": ds["category"], "stream": ds["stream"],
                        "simulated_s": ds["end"] - ds["start"], "measured_s": dm["end"] - dm["start"]})
    dur["diff_s"] = dur["simulated_s"] - dur["measured_s"]
    per_category = {}
    for cat, g in dur.groupby("category"):
        total_s, total_m = float(g["simulated_s"].sum()), float(g["measured_s"].sum())
        per_category[str(cat)] = {"ops": int(len(g)), "simulated_s": total_s, "measured_s": total_m,
                                  "error": rel(total_s, total_m),
                                  "median_op_error": float(np.median((g["simulated_s"] - g["measured_s"])
                                                                     / g["measured_s"].clip(lower=1e-9)))}
    worst_ops = dur.reindex(dur["diff_s"].abs().sort_values(ascending=False).index).head(worst)
    return {
        "makespan": {"simulated_s": s.makespan_s, "measured_s": m.makespan_s, "error": rel(s.makespan_s, m.makespan_s)},
        "bubbles": {kind: {"simulated_s": getattr(s, key), "measured_s": getattr(m, key),
                           "error": rel(getattr(s, key), getattr(m, key))}
                    for kind, key in (("all", "bubble_s"), ("inter", "bubble_inter_s"), ("intra", "bubble_intra_s"))},
        "throughput_tok_s": {"simulated": s.throughput_tok_s, "measured": m.throughput_tok_s},
        "peak_gpu_bytes": {"simulated": s.peak_gpu_bytes, "measured": m.peak_gpu_bytes},
        "per_category": per_category,
        "worst_ops": [{"op": idx, **{k: (float(v) if isinstance(v, (float, np.floating)) else v)
                                     for k, v in row.items()}} for idx, row in worst_ops.iterrows()],
    }


def side_by_side(sim: Timeline, meas: Timeline, path: Path, title: str) -> None:
    import matplotlib.pyplot as plt

    from klotski_sim.plot import _legend, draw_timeline

    horizon = max(sim.makespan, meas.makespan)
    lanes = sim.streams()
    fig, axes = plt.subplots(2, 1, figsize=(14, 2.0 + 1.0 * len(lanes)), sharex=True)
    cats = draw_timeline(axes[0], sim, (0.0, horizon), lanes)
    for cat in draw_timeline(axes[1], meas, (0.0, horizon), lanes):
        if cat not in cats:
            cats.append(cat)
    axes[0].set_title(f"{title}\nsimulated: makespan {sim.makespan * 1e3:.1f} ms", fontsize=9, loc="left")
    emulated = " (links EMULATED)" if meas.meta.get("emulated_links") else ""
    axes[1].set_title(f"measured on {meas.meta.get('device')}{emulated}: makespan {meas.makespan * 1e3:.1f} ms",
                      fontsize=9, loc="left")
    _legend(fig, cats)
    fig.tight_layout(rect=(0, 0, 1, 0.93))
    fig.savefig(path, dpi=100)
    plt.close(fig)


def validate(setup: ValidationSetup, profile_path: str, out_dir: str | Path,
             policies: tuple[str, ...] = ALL_POLICIES) -> dict[str, Any]:
    """Run every policy; returns (and writes) the report."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    spec = RunSpec(model=setup.model, hardware=profile_path, policy=policies[0], batch_size=setup.batch_size,
                   num_batches=setup.num_batches, prompt_len=setup.prompt_len, gen_len=setup.gen_len,
                   seed=setup.seed, routing=setup.routing, trace=setup.trace, kv=setup.kv, experts="cpu",
                   resident_layers=0, warmup_sequences=2)
    prep = prepare(spec)
    check_profile_device(prep.profile, setup.device)
    model = get_model(setup.model)
    dtype = getattr(torch, setup.dtype)
    weights = (WeightStore.from_checkpoint(setup.checkpoint, model, dtype=dtype) if setup.checkpoint
               else WeightStore.random(model, dtype=dtype, seed=setup.seed))
    options = ExecOptions(device=setup.device, emulate_links=dict(setup.emulate_links),
                          emulate_pageable=dict(setup.emulate_pageable), seed=setup.seed,
                          threads=setup.threads if setup.device == "cpu" else None)
    report: dict[str, Any] = {"setup": asdict(setup), "profile": profile_path, "policies": {}}
    impls = ("as-published", "ideal") if setup.impl == "both" else (setup.impl,)
    runs = [(name, impl) for name in policies for impl in impls]
    for name, impl in runs:
        key = name if len(impls) == 1 else f"{name}/{impl}"
        p = prep.narrowed(1) if name == "single-batch" and prep.num_batches > 1 else prep
        schedule = build_schedule(name, replace(p.policy_input(), impl=impl))
        sim = simulate(schedule, p.profile)
        options = replace(options, capacities=resource_capacities(schedule, p.profile))  # one definition
        for _ in range(setup.warmup_runs):  # first-touch costs (allocator, lazy init) are not the schedule's
            execute(schedule, model, weights, p.replay.routing, options)
        meas, _ = execute(schedule, model, weights, p.replay.routing, options)
        result = compare(sim, meas)
        result["impl"] = impl
        folder = out / key.replace("/", "-")
        folder.mkdir(exist_ok=True)
        sim.to_parquet(folder / "simulated.parquet")
        meas.to_parquet(folder / "measured.parquet")
        schedule.save(folder / "schedule.json")
        side_by_side(sim, meas, folder / "validation.png",
                     f"{key} · {model.name} · {setup.device} · n={p.num_batches} bs={setup.batch_size} "
                     f"P={setup.prompt_len} G={setup.gen_len}")
        (folder / "validation.json").write_text(json.dumps(jsonable(result), indent=2))
        report["policies"][key] = result
    report["emulated_links"] = dict(setup.emulate_links)
    (out / "validation.json").write_text(json.dumps(jsonable(report), indent=2))
    return report


def format_report(report: dict[str, Any]) -> str:
    def pct(v: float | None) -> str:
        return "   n/a" if v is None else f"{v:+6.1%}"

    lines = [f"{'policy':28} {'sim ms':>8} {'meas ms':>8} {'makespan':>8} {'bubbles':>8} {'inter':>7} {'intra':>7}  "
             f"worst category"]
    for name, r in report["policies"].items():
        cats = {c: v for c, v in r["per_category"].items() if v["error"] is not None}
        worst = max(cats.items(), key=lambda kv: abs(kv[1]["error"]), default=(None, None))
        wtext = f"{worst[0]} {pct(worst[1]['error'])}" if worst[0] else "-"
        b = r["bubbles"]
        lines.append(f"{name:28} {r['makespan']['simulated_s'] * 1e3:8.1f} {r['makespan']['measured_s'] * 1e3:8.1f} "
                     f"{pct(r['makespan']['error'])} {pct(b['all']['error'])} {pct(b['inter']['error'])} "
                     f"{pct(b['intra']['error'])}  {wtext}")
    if report.get("emulated_links"):
        lines.append("links EMULATED: " + ", ".join(f"{k} {v / 1e9:.2f} GB/s" for k, v in report["emulated_links"].items()))
    return "\n".join(lines)
