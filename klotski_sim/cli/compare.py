"""`klotski-sim compare`: several policies and presets on one configuration, side by side."""

from __future__ import annotations

import argparse
import importlib
import json
import sys
from dataclasses import replace
from functools import partial
from pathlib import Path
from typing import Any, Sequence

from klotski_sim.cli.common import (
    CliError,
    local_workers,
    note,
    output_folder,
    per_policy_options,
)
from klotski_sim.cli.run_args import spec_from_args
from klotski_sim.cli.simulate import removed_text
from klotski_sim.cli.summary_text import warn_of_routing
from klotski_sim.core.timeline import FIGURE_COLUMNS, Summary, jsonable
from klotski_sim.files.outfiles import OutputFiles, refuse_unwritable
from klotski_sim.planning.planner import format_plan
from klotski_sim.policies import POLICIES
from klotski_sim.policies.base import resolve_options
from klotski_sim.policies.impl import PRESET_NAMES
from klotski_sim.runs.runner import (
    RunPlan,
    RunSpec,
    plan_run,
    prepare,
    resolve_profile,
    run_each,
)
from klotski_sim.util import run_size
from klotski_sim.util.lazy import pd  # (imported when first used: klotski_sim/util/lazy.py)
from klotski_sim.util.machine import available_cores
from klotski_sim.util.progress import Progress
from klotski_sim.util.units import GIB

COMPARE_POLICIES = ("single-batch", "multi-batch", "hot-prefetch", "klotski", "klotski-oracle", "flexgen")


def cmd_compare(args: argparse.Namespace) -> int:
    impls = ["as-published", "ideal"] if args.impl == "both" else [args.impl]
    local_workers(args)
    spec = spec_from_args(args, policy="klotski", impl=impls[0])
    policies = args.policies or list(COMPARE_POLICIES)
    for name in policies:
        if name not in POLICIES:
            raise CliError(f"unknown policy {name!r}; known policies: {', '.join(POLICIES)}")
    # (said before the plan's placement line, not by each worker after it; the profile read here only for them)
    for info in [POLICIES[name] for name in policies if POLICIES[name].traits.needs_cpu]:
        info.require_machine(resolve_profile(spec))
    if args.flexgen_overlap and "flexgen" not in policies:  # (it would change nothing, silently)
        raise CliError(
            f"--flexgen-overlap {args.flexgen_overlap}: flexgen is not among the policies compared "
            f"({', '.join(policies)})"
        )
    options = per_policy_options(args.options, policies, "compared")
    if args.flexgen_overlap:  # (flexgen is compared: said above)
        if "overlap" in options["flexgen"]:
            raise CliError("--flexgen-overlap and --option flexgen.overlap both set flexgen's overlap: give one")
        options["flexgen"]["overlap"] = args.flexgen_overlap
    for name, given in options.items():  # (refused here in one line, not by each worker)
        if given:
            resolve_options(name, impls[0], given)
    out = output_folder(args.out)
    compare_files = _compare_files()
    refuse_unwritable(out, compare_files)
    # (its runs' Chrome traces are written piece by piece: not simulate --out's files)
    with run_size.surroundings(files_written=False, listeners=(note,)):
        return _compare(args, spec, policies, impls, out, compare_files, options)


def _compare(
    args: argparse.Namespace,
    spec: RunSpec,
    policies: list[str],
    impls: list[str],
    out: Path,
    compare_files: list[str],
    options: dict[str, dict[str, Any]],
) -> int:
    prep = prepare(spec)
    if prep.plan is not None:
        print(f"planner: n = {prep.num_batches} ({'; '.join(prep.plan.notes) or 'bubbles closed within memory'})")
    routing_source = prep.replay.routing.source if prep.replay else "not built (refused by the memory check)"
    print(f"placement: {prep.placement.describe()}; routing: {routing_source}; implementation: {' and '.join(impls)}")
    warn_of_routing(routing_source)
    runs: dict[tuple[str, str], RunPlan] = {}
    for name in policies:
        for impl in impls:  # (probes, where a policy takes them, are taken by the worker that runs it)
            runs[(name, impl)] = plan_run(
                replace(spec, policy=name, options=options.get(name, {}), impl=impl), prep, probe=False
            )
        planned = runs[(name, impls[0])]
        if planned.note:
            print(f"note: {name} runs n = {planned.num_batches} ({planned.note})")
        if planned.probes_pending:
            print(
                f"note: {name} chooses n <= {planned.num_batches} by simulated probes of its own schedule "
                f"(klotski-sim plan --policy {name} shows them)"
            )
    simulated = prep.refused is None
    if prep.refused is not None:
        print(f"refused: {prep.refused.describe()}; no figure or traces: nothing was simulated")
    sys.stdout.flush()  # (before worker processes start)
    figure = not args.no_png and simulated
    with OutputFiles(out, stale=compare_files) as files:  # (all or none, as simulate --out)
        # (each written by the worker that ran it)
        traces: list[Path | None] | None = (
            [files.path(_trace_name(name, impl, impls)) for name, impl in runs] if args.traces and simulated else None
        )
        done = Progress("compare", len(runs))
        timelines = dict(
            zip(
                runs,
                run_each(
                    [planned.spec for planned in runs.values()],
                    prep,
                    args.workers or available_cores(),
                    traces,
                    keep=FIGURE_COLUMNS if figure else (),
                    meanwhile=partial(_import_for_output, figure),
                    on_done=lambda run: done.done(f"({_label(run.policy, run.impl, impls)})"),
                    plans=list(runs.values()),
                ),
            )
        )
        summaries = {key: tl.summary() for key, tl in timelines.items()}
        print(format_comparison(summaries))
        if len(impls) > 1:
            print(format_left_on_table(summaries, policies))
        rows = [{"policy": name, "impl_preset": impl, **s.to_dict()} for (name, impl), s in summaries.items()]
        files.path("compare.json").write_text(json.dumps(jsonable(rows), indent=2))
        pd.DataFrame([{k: v for k, v in r.items() if not isinstance(v, dict)} for r in rows]).to_csv(
            files.path("compare.csv"), index=False
        )
        if prep.plan is not None:  # (without one, an earlier run's plan.txt, of another n, is removed)
            files.path("plan.txt").write_text(format_plan(prep.plan, prep.model, prep.profile, spec.batch_size) + "\n")
        if figure:
            from klotski_sim.report.plot import compare_gantt

            zoom = (min(1, spec.gen_len - 1), prep.model.num_layers // 2)
            compare_gantt(
                {_label(name, impl, impls): tl for (name, impl), tl in timelines.items()},
                files.path("compare.png"),
                zoom=zoom,
            )
        files.commit()
    print(
        f"wrote compare.csv, compare.json{', compare.png' if figure else ''}"
        f"{', trace_<policy>.json.gz' if args.traces and simulated else ''}{', plan.txt' if prep.plan else ''} "
        f"to {out}/{removed_text(files.removed)}"
    )
    return 0 if all(s.status == "ok" for s in summaries.values()) else 3


def _trace_name(policy: str, impl: str, impls: Sequence[str]) -> str:
    return f"trace_{policy}{'' if len(impls) == 1 else '_' + impl}.json.gz"


def _compare_files() -> list[str]:
    """Every file a comparison may write (an earlier one's traces of other policies or presets
    among them), for the one it writes now to replace."""
    traces = {
        _trace_name(policy, impl, impls)
        for policy in POLICIES
        for impl in PRESET_NAMES
        for impls in ([impl], PRESET_NAMES)
    }
    return ["compare.json", "compare.csv", "compare.png", "plan.txt", *sorted(traces)]


def _import_for_output(figure: bool) -> None:
    """pandas (compare.csv is written by it, the figure reads bubbles as a frame) and, for a
    figure, the plotting library, imported while compare's workers run: half a second that the
    main process would otherwise spend after them."""
    importlib.import_module("pandas")
    if figure:
        importlib.import_module("klotski_sim.report.plot")


def _label(name: str, impl: str, impls: Sequence[str]) -> str:
    return name if len(impls) == 1 else f"{name} ({impl})"


def format_comparison(summaries: dict[tuple[str, str], Summary]) -> str:
    """One row per (policy, preset); x FlexGen compares with FlexGen under the same preset."""
    width = max([15] + [len(name) for name, _ in summaries])
    header = (
        f"{'policy':{width}} {'impl':12} {'n':>3} {'status':6} {'tok/s':>7} {'decode':>7} {'xFlexGen':>8} "
        f"{'makespan s':>10} {'inter s':>8} {'intra s':>8} {'host s':>7} {'effic.':>6} {'peak GiB':>8} "
        f"{'hot prec.':>9} {'hot id.':>7}"
    )
    lines = [header, "-" * len(header)]
    for (name, impl), s in summaries.items():
        base = summaries.get(("flexgen", impl))
        pf = s.extra.get("prefetch") or {}
        ratio = f"{s.throughput_tok_s / base.throughput_tok_s:8.2f}" if base and base.throughput_tok_s else f"{'-':>8}"
        finished = s.status == "ok"  # (a stopped run's throughputs and efficiency are none: "-", not 0 or 100%)
        tok_s = f"{s.throughput_tok_s:7.2f}" if finished else f"{'-':>7}"
        decode = f"{s.decode_throughput_tok_s:7.2f}" if finished and s.decode_s > 0 else f"{'-':>7}"
        efficiency = f"{s.efficiency:6.1%}" if finished else f"{'-':>6}"
        lines.append(
            f"{name:{width}} {s.impl[:12]:12} {s.num_batches:3d} {s.status:6} {tok_s} {decode} {ratio} "
            f"{s.makespan_s:10.2f} {s.bubble_inter_s:8.2f} {s.bubble_intra_s:8.2f} {s.host_blocked_s:7.2f} "
            f"{efficiency} "
            f"{s.peak_gpu_bytes / GIB:8.2f} {_pct(pf.get('precision')):>9} "
            f"{_pct(pf.get('hot_identification')):>7}"
        )
    lines.append(
        "tok/s: generated tokens / makespan (prefill included); decode: tokens after the first / decode "
        "time; host s: the host thread blocked on syncs and pageable copies"
    )
    return "\n".join(lines)


def format_left_on_table(summaries: dict[tuple[str, str], Summary], policies: Sequence[str]) -> str:
    """What an ideal implementation of each schedule would gain over its published one."""
    lines = ["what is left on the table (ideal vs as-published, same schedule):"]
    for name in policies:
        pub, ideal = summaries.get((name, "as-published")), summaries.get((name, "ideal"))
        if not pub or not ideal or not pub.throughput_tok_s or not pub.decode_throughput_tok_s:
            continue
        lines.append(
            f"  {name:15} tok/s {pub.throughput_tok_s:7.2f} -> {ideal.throughput_tok_s:7.2f} "
            f"({ideal.throughput_tok_s / pub.throughput_tok_s - 1:+.1%}); decode "
            f"{pub.decode_throughput_tok_s:7.2f} -> {ideal.decode_throughput_tok_s:7.2f} "
            f"({ideal.decode_throughput_tok_s / pub.decode_throughput_tok_s - 1:+.1%})"
        )
    return "\n".join(lines)


def _pct(value: float | None) -> str:
    return "-" if value is None else f"{value:.1%}"
