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

from klotski_sim.core.cost import CostModel
from klotski_sim.core.engine import resource_capacities, simulate
from klotski_sim.core.schedule import Schedule
from klotski_sim.core.timeline import OutOfMemory, Timeline, jsonable
from klotski_sim.hardware.profile import HardwareProfile, ProfileError
from klotski_sim.policies import build_schedule, get_policy
from klotski_sim.report.exports import to_parquet
from klotski_sim.runs.runner import RunSpec, prepare
from klotski_sim.util.errors import UsageError
from klotski_sim.util.machine import machine_load, steal_share
from klotski_sim.util.progress import Progress
from klotski_sim.workload.model import ModelSpec, get_model

from .calibrate import Bench, expert_probe, probed_expert
from .executor import ExecOptions, execute
from .kernels import WeightStore
from .threads import cpu_threads

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
    repeats: int = 3  # measured runs per schedule: errors are reported as median and spread
    threads: int | None = 1  # CPU: torch threads for compute; the other cores run the copy threads
    options: Mapping[str, Any] = field(default_factory=dict)  # policy options for every schedule (expert_cache, ...)


def check_profile_device(profile: HardwareProfile, device: str, emulated: Mapping[str, float] | None = None) -> None:
    """A calibrated profile describes one kind of device, and its links the rates they were
    emulated at: refuse to validate another device, or other emulated rates, with it (the simulated
    and measured runs would differ by construction). A CPU run needs a CPU calibration: a GPU's
    spec-sheet profile (no device kind) would compare a simulated GPU with a CPU."""
    kind = profile.provenance.get("device_kind")
    want = "cuda" if device.startswith("cuda") else "cpu"
    if kind and kind != want or want == "cpu" and kind != "cpu":
        what = (
            f"was calibrated on a {kind} device ({profile.provenance.get('device')})"
            if kind
            else "is a spec-sheet profile, not a calibration"
        )
        raise ProfileError(
            f"profile {profile.name!r} {what}, not {want}: calibrate this device first (or leave "
            f"out --profile: validate calibrates it)"
        )
    if emulated is not None and kind == "cpu":
        calibrated = dict(profile.provenance.get("emulated_links") or {})
        if calibrated != dict(emulated):

            def rates(links: Mapping[str, float]) -> str:
                return ", ".join(f"{k} {v:g} B/s" for k, v in sorted(links.items())) or "none (real copies)"

            raise ProfileError(
                f"profile {profile.name!r} was calibrated with emulated links {rates(calibrated)}, "
                f"this run emulates {rates(emulated)}: give the same --emulate-pcie, or calibrate "
                f"again"
            )


def compare(sim: Timeline, meas: Timeline, worst: int = 10) -> dict[str, Any]:
    """Error figures of a simulated vs a measured timeline of the same schedule."""
    s, m = sim.summary(), meas.summary()

    def rel(a: float, b: float) -> float | None:
        return (a - b) / b if b > 0 else None

    ds, dm = sim.df.set_index("op_id"), meas.df.set_index("op_id")
    dur = pd.DataFrame(
        {
            "category": ds["category"],
            "stream": ds["stream"],
            "simulated_s": ds["end"] - ds["start"],
            "measured_s": dm["end"] - dm["start"],
        }
    )
    dur["diff_s"] = dur["simulated_s"] - dur["measured_s"]
    per_category = {}
    for cat, g in dur.groupby("category"):
        total_s, total_m = float(g["simulated_s"].sum()), float(g["measured_s"].sum())
        per_category[str(cat)] = {
            "ops": int(len(g)),
            "simulated_s": total_s,
            "measured_s": total_m,
            "error": rel(total_s, total_m),
            "median_op_error": float(
                np.median((g["simulated_s"] - g["measured_s"]) / g["measured_s"].clip(lower=1e-9))
            ),
        }
    worst_ops = dur.reindex(dur["diff_s"].abs().sort_values(ascending=False).index).head(worst)
    return {
        "makespan": {"simulated_s": s.makespan_s, "measured_s": m.makespan_s, "error": rel(s.makespan_s, m.makespan_s)},
        "bubbles": {
            kind: {
                "simulated_s": getattr(s, key),
                "measured_s": getattr(m, key),
                "error": rel(getattr(s, key), getattr(m, key)),
            }
            for kind, key in (("all", "bubble_s"), ("inter", "bubble_inter_s"), ("intra", "bubble_intra_s"))
        },
        "throughput_tok_s": {"simulated": s.throughput_tok_s, "measured": m.throughput_tok_s},
        "peak_gpu_bytes": {"simulated": s.peak_gpu_bytes, "measured": m.peak_gpu_bytes},
        "per_category": per_category,
        "worst_ops": [
            {"op": idx, **{k: (float(v) if isinstance(v, (float, np.floating)) else v) for k, v in row.items()}}
            for idx, row in worst_ops.iterrows()
        ],
    }


def side_by_side(sim: Timeline, meas: Timeline, path: Path, title: str) -> None:
    import matplotlib.pyplot as plt

    from klotski_sim.report.plot import draw_timeline, legend

    horizon = max(sim.makespan, meas.makespan)
    lanes = sim.streams()
    fig, axes = plt.subplots(2, 1, figsize=(14, 2.0 + 1.0 * len(lanes)), sharex=True)
    cats = draw_timeline(axes[0], sim, (0.0, horizon), lanes)
    for cat in draw_timeline(axes[1], meas, (0.0, horizon), lanes):
        if cat not in cats:
            cats.append(cat)
    axes[0].set_title(f"{title}\nsimulated: makespan {sim.makespan * 1e3:.1f} ms", fontsize=9, loc="left")
    emulated = " (links EMULATED)" if meas.meta.get("emulated_links") else ""
    axes[1].set_title(
        f"measured on {meas.meta.get('device')}{emulated}: makespan {meas.makespan * 1e3:.1f} ms",
        fontsize=9,
        loc="left",
    )
    legend(fig, cats)
    fig.tight_layout(rect=(0, 0, 1, 0.93))
    fig.savefig(path, dpi=100)
    plt.close(fig)


def refit_dispatch(profile: HardwareProfile, sim: Timeline, meas: Timeline) -> HardwareProfile:
    """The profile with its per-category dispatch cost refitted on this very measurement: what an
    in-sample calibration would have given (the reported in-sample error uses it)."""
    ds, dm = sim.df.set_index("op_id"), meas.df.set_index("op_id")
    compute = ds.index[ds["resource"] == "gpu"]
    residual = (dm["end"] - dm["start"]).reindex(ds.index) - (ds["end"] - ds["start"])
    frame = pd.DataFrame({"category": ds.loc[compute, "category"], "residual": residual.loc[compute]})
    gpu = profile.gpu
    fitted = {
        str(c): max(0.0, gpu.dispatch_overhead_by_category.get(str(c), gpu.dispatch_overhead_s) + float(v))
        for c, v in frame.groupby("category")["residual"].median().items()
    }
    return profile.model_copy(
        update={
            "gpu": gpu.model_copy(
                update={"dispatch_overhead_by_category": {**gpu.dispatch_overhead_by_category, **fitted}}
            )
        }
    )


def _spread(values: list[float | None]) -> dict[str, float | None]:
    vals = [v for v in values if v is not None]
    if not vals:
        return {"median": None, "min": None, "max": None}
    return {"median": float(np.median(vals)), "min": float(min(vals)), "max": float(max(vals))}


def judge_repeats(sim: Timeline, measured: list[Timeline]) -> tuple[dict[str, Any], Timeline, float]:
    """`compare` of the median run (by makespan) of `measured` against `sim`, with every error's median
    and spread over the runs under `repeats`; that run; and the runs' makespan spread (max - min over
    the median: what `machine_conditions` warns about)."""
    results = [compare(sim, m) for m in measured]
    median_run = int(np.argsort([m.makespan for m in measured])[len(measured) // 2])
    result = results[median_run]
    result["repeats"] = {
        "makespan": _spread([r["makespan"]["error"] for r in results]),
        **{f"bubbles_{k}": _spread([r["bubbles"][k]["error"] for r in results]) for k in ("all", "inter", "intra")},
        "measured_makespan_s": [m.makespan for m in measured],
    }
    spans = [m.makespan for m in measured]
    spread = (max(spans) - min(spans)) / float(np.median(spans)) if len(spans) > 1 else 0.0
    return result, measured[median_run], spread


def validate(
    setup: ValidationSetup,
    profile_path: str,
    out_dir: str | Path,
    policies: tuple[str, ...] = ALL_POLICIES,
    progress: bool = False,
) -> dict[str, Any]:
    """Run every policy `setup.repeats` times; returns (and writes) the report: for each schedule the
    errors of the median run, the median and spread of every error over the runs, and the same
    errors with the dispatch costs refitted on the measurement itself (in-sample). `progress`: a
    line on stderr as each schedule is done."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    spec = RunSpec(
        model=setup.model,
        hardware=profile_path,
        policy=policies[0],
        batch_size=setup.batch_size,
        num_batches=setup.num_batches,
        prompt_len=setup.prompt_len,
        gen_len=setup.gen_len,
        seed=setup.seed,
        routing=setup.routing,
        trace=setup.trace,
        kv=setup.kv,
        experts="cpu",
        resident_layers=0,
        warmup_sequences=2,
        options=dict(setup.options),
    )
    prep = prepare(spec)
    if prep.refused is not None:  # (nothing to build, run or measure, and no routing to run it on)
        raise UsageError(
            f"{setup.num_batches} batches of {setup.batch_size} cannot run on this profile: {prep.refused.describe()}"
        )
    check_profile_device(prep.profile, setup.device, setup.emulate_links)
    model = get_model(setup.model)
    dtype = getattr(torch, setup.dtype)
    weights = (
        WeightStore.from_checkpoint(setup.checkpoint, model, dtype=dtype)
        if setup.checkpoint
        else WeightStore.random(model, dtype=dtype, seed=setup.seed)
    )
    options = ExecOptions(
        device=setup.device,
        emulate_links=dict(setup.emulate_links),
        emulate_pageable=dict(setup.emulate_pageable),
        seed=setup.seed,
        threads=setup.threads if setup.device == "cpu" else None,
    )
    report: dict[str, Any] = {
        "setup": asdict(setup),
        "profile": profile_path,
        "policies": {},
        "calibration_probe": prep.profile.provenance.get("probe"),
    }
    load_before = machine_load()
    drift = expert_drift(prep.profile, model, weights, setup)
    impls = ("as-published", "ideal") if setup.impl == "both" else (setup.impl,)
    runs = [(name, impl) for name in policies for impl in impls]
    spreads: list[float] = []  # run-to-run spread of the measured makespan, per schedule
    done = Progress("validate", len(runs), enabled=progress)
    for name, impl in runs:
        key = name if len(impls) == 1 else f"{name}/{impl}"
        # a policy that keeps one batch in flight by definition runs at n = 1, as compare runs it
        p = prep.narrowed(1) if get_policy(name).traits.one_batch else prep
        assert p.replay is not None  # (prepare makes the routing of every run it does not refuse)
        schedule = build_schedule(name, replace(p.policy_input(dict(setup.options)), impl=impl))
        sim = simulate(schedule, p.profile)
        if sim.status != "ok":  # a measurement of a run the simulator says cannot happen compares nothing
            oom = sim.meta.get("oom") or {}
            where = f" ({OutOfMemory.from_dict(oom).describe()})" if oom else ""
            report["policies"][key] = {
                "skipped": f"the simulated run ends with status {sim.status}{where}: give "
                f"the profile more GPU memory, or run a smaller batch",
                "impl": impl,
            }
            done.done(f"({key}: skipped)")
            continue
        options = replace(options, capacities=resource_capacities(schedule, p.profile))  # one definition
        for _ in range(setup.warmup_runs):  # first-touch costs (allocator, lazy init) are not the schedule's
            execute(schedule, model, weights, p.replay.routing, options)
        executed = [execute(schedule, model, weights, p.replay.routing, options) for _ in range(max(1, setup.repeats))]
        measured = [timeline for timeline, _ in executed]
        result, meas, spread = judge_repeats(sim, measured)
        result["impl"] = impl
        issue = issue_by_category(schedule, p.profile, [runner.issue_s for _, runner in executed])
        if issue:  # (CUDA: the CPU runtime has no issuing thread)
            result["issue"] = issue
        in_sample = refit_dispatch(p.profile, sim, meas)
        result["in_sample"] = compare(simulate(schedule, in_sample), meas)
        spreads.append(spread)
        folder = out / key.replace("/", "-")
        folder.mkdir(exist_ok=True)
        to_parquet(sim, folder / "simulated.parquet")
        to_parquet(meas, folder / "measured.parquet")
        schedule.save(folder / "schedule.json")
        side_by_side(
            sim,
            meas,
            folder / "validation.png",
            f"{key} · {model.name} · {setup.device} · n={p.num_batches} bs={setup.batch_size} "
            f"P={setup.prompt_len} G={setup.gen_len}",
        )
        (folder / "validation.json").write_text(json.dumps(jsonable(result), indent=2))
        report["policies"][key] = result
        done.done(f"({key}: makespan error {result['makespan']['error']:+.1%})")
    report["emulated_links"] = dict(setup.emulate_links)
    report["machine"] = machine_conditions(load_before, machine_load(), spreads, drift)
    (out / "validation.json").write_text(json.dumps(jsonable(report), indent=2))
    return report


def issue_by_category(
    schedule: Schedule, profile: HardwareProfile, issued: list[dict[int, float]]
) -> dict[str, dict[str, float]]:
    """The CUDA issuing thread's time per op, measured (the median over the runs' ops of each
    category) next to what the engine's rule 4 charges (`CostModel.issue_seconds`): where a
    schedule's issuing, not its kernels, sets the pace, this is the table to read. Empty without
    measurements (the CPU runtime)."""
    seconds: dict[str, list[float]] = {}
    for run in issued:
        for i, value in run.items():
            seconds.setdefault(schedule.ops[i].category, []).append(value)
    cost = CostModel(profile)
    charged: dict[str, float] = {}
    for op in schedule.ops:
        if op.category in seconds and op.category not in charged:
            charged[op.category] = cost.issue_seconds(op, schedule.streams[op.stream])
    return {
        category: {
            "ops": len(values) // max(1, len(issued)),
            "measured_median_s": float(np.median(values)),
            "simulated_s": charged[category],
        }
        for category, values in sorted(seconds.items())
    }


LOAD_WARNING, STEAL_WARNING, SPREAD_WARNING, DRIFT_WARNING = 0.5, 0.02, 0.05, 0.10
DRIFT_MAX_TOKENS = 64  # the expert rows re-timed before a validation: those a small run's ops use


def expert_drift(
    profile: HardwareProfile, model: ModelSpec, weights: WeightStore, setup: ValidationSetup
) -> float | None:
    """The profile's expert probes timed again now, on the validation's own weights: the median
    ratio of now to the profile's table (1.0: the machine runs experts as it did at calibration).
    A profile made earlier, or another process's state of the same machine, can differ; this says
    by how much before the runs are compared. None where the profile has no expert table of this
    device's."""
    table = [pt for pt in profile.measured.get("expert", []) if pt.tokens <= DRIFT_MAX_TOKENS]
    if not table or profile.provenance.get("device_kind") != ("cuda" if setup.device.startswith("cuda") else "cpu"):
        return None
    dev = torch.device(setup.device)
    expert = probed_expert(weights, model, dev, getattr(torch, setup.dtype))
    with cpu_threads(setup.threads if setup.device == "cpu" else None):
        bench = Bench(dev, 3)
        rows = [
            bench.add({"table": pt.seconds}, expert_probe(model, dev, getattr(torch, setup.dtype), pt.tokens, expert))
            for pt in table
        ]
        bench.run()
    return float(np.median([row["seconds"] / row["table"] for row in rows if row["table"] > 0]))


def machine_conditions(
    before: dict[str, float], after: dict[str, float], spreads: list[float], drift: float | None = None
) -> dict[str, Any]:
    """The measured load during validation, and warnings when it was high enough to distort it:
    load average, CPU time stolen by the hypervisor, how much the executor's own runs of one
    schedule disagreed with each other (their makespans' spread), and how far the expert ops run
    now from the profile's table (`expert_drift`)."""
    steal = steal_share(before, after)
    load = max(before["load_per_core"], after["load_per_core"])
    spread = max(spreads) if spreads else 0.0
    warnings = []
    if load > LOAD_WARNING:
        warnings.append(
            f"load average {load:.2f} per core during validation (above {LOAD_WARNING}): other work "
            f"shares the cores, measured durations are inflated"
        )
    if steal > STEAL_WARNING:
        warnings.append(f"{steal:.1%} of CPU time stolen by the hypervisor during validation")
    if spread > SPREAD_WARNING:
        warnings.append(
            f"repeated runs of one schedule differ by up to {spread:.1%} in makespan (above "
            f"{SPREAD_WARNING:.0%}): the machine was not quiet; trust the medians, not single runs"
        )
    if drift is not None and abs(drift - 1.0) > DRIFT_WARNING:
        warnings.append(
            f"expert ops take {drift:.2f}x their calibrated durations now (re-timed before the runs): "
            f"the machine is not as it was at calibration; expect errors of that size, or calibrate "
            f"again"
        )
    return {
        "load_per_core": load,
        "steal_share": steal,
        "max_run_spread": spread,
        "expert_drift": drift,
        "warnings": warnings,
    }


def format_report(report: dict[str, Any]) -> str:
    def pct(v: float | None) -> str:
        return "   n/a" if v is None else f"{v:+6.1%}"

    def spread(s: dict[str, float | None]) -> str:
        if s.get("median") is None:
            return "n/a"
        return f"{s['median']:+.1%} [{s['min']:+.1%}, {s['max']:+.1%}]"

    lines = [
        f"{'policy':28} {'sim ms':>8} {'meas ms':>8} {'makespan':>26} {'bubbles':>26} {'inter':>7} {'intra':>7} "
        f"{'in-sample':>9}  worst category",
        f"{'':28} {'':>8} {'(median)':>8} {'median [min, max] of runs':>26} {'median [min, max]':>26}",
    ]
    for name, r in report["policies"].items():
        if "skipped" in r:
            lines.append(f"{name:28} not compared: {r['skipped']}")
            continue
        cats = {c: v for c, v in r["per_category"].items() if v["error"] is not None}
        worst = max(cats.items(), key=lambda kv: abs(kv[1]["error"]), default=None)
        wtext = f"{worst[0]} {pct(worst[1]['error'])}" if worst is not None and worst[0] else "-"
        b = r["bubbles"]
        rep = r.get("repeats", {})
        lines.append(
            f"{name:28} {r['makespan']['simulated_s'] * 1e3:8.1f} {r['makespan']['measured_s'] * 1e3:8.1f} "
            f"{spread(rep.get('makespan', {})):>26} {spread(rep.get('bubbles_all', {})):>26} "
            f"{pct(b['inter']['error'])} {pct(b['intra']['error'])} "
            f"{pct(r.get('in_sample', {}).get('makespan', {}).get('error'))}  {wtext}"
        )
    lines.append(
        "errors: (simulated - measured) / measured, out of sample (dispatch costs calibrated on other "
        "shapes); in-sample: makespan error with them refitted on this measurement"
    )
    if report.get("emulated_links"):
        lines.append(
            "links EMULATED: " + ", ".join(f"{k} {v / 1e9:.2f} GB/s" for k, v in report["emulated_links"].items())
        )
    for w in report.get("machine", {}).get("warnings", []):
        lines.append(f"WARNING: {w}")
    return "\n".join(lines)
