"""`klotski-sim`: simulate offloaded MoE inference schedules from the command line.

Every subcommand runs on built-in defaults (Mixtral-8x7B on an RTX 3090 profile); bad input
ends with a one-line `error:` message and exit status 2, never a traceback.
"""

from __future__ import annotations

import argparse
import importlib
import io
import json
import os
import re
import sys
from collections import Counter
from dataclasses import asdict, replace
from functools import partial
from pathlib import Path
from typing import Any, Callable, Sequence

from klotski_sim.cli.common import (
    CliError,
    made_folders,
    output_folder,
    parse_overrides,
    remove_empty_made_folders,
)
from klotski_sim.cli.serve import add_serve_parser
from klotski_sim.core.timeline import FIGURE_COLUMNS, OutOfMemory, Summary, jsonable
from klotski_sim.files.outfiles import OutputFiles, refuse_unwritable, write_file
from klotski_sim.hardware.profile import builtin_profile_names, load_profile, with_overrides
from klotski_sim.planning.planner import format_plan
from klotski_sim.policies import POLICIES, get_policy
from klotski_sim.policies.impl import PRESET_NAMES
from klotski_sim.policies.plugins import load_for_command_line
from klotski_sim.report.exports import TIMELINE_FILES, write_timeline_files
from klotski_sim.runs.runner import (
    LONG_DRAW_S,
    RunPlan,
    RunSpec,
    draw_seconds,
    plan_run,
    prepare,
    resolve_profile,
    run,
    run_each,
)
from klotski_sim.util import run_size
from klotski_sim.util.argtypes import (
    MAX_COUNT,
    MAX_COUNT_TEXT,
    OneLineParser,
    batches,
    bounded_int,
    layers_or_fill,
    name_list,
    nonnegative_int,
    path_arg,
    plain_int,
    positive_float,
    positive_int,
    seed_int,
    workers_int,
)
from klotski_sim.util.errors import KlotskiError, one_line
from klotski_sim.util.lazy import pd  # (imported when first used: klotski_sim/util/lazy.py)
from klotski_sim.util.machine import available_cores
from klotski_sim.util.progress import Progress
from klotski_sim.util.stopping import restore_stops, stopped, take_stops
from klotski_sim.util.units import GIB, counted, duration_text, duration_unit, memory_text, span_text
from klotski_sim.workload.model import PRESETS, get_model
from klotski_sim.workload.trace import MAX_IMPORT_INDEX, Trace, TraceError, import_jsonl
from klotski_sim.workload.trace_stats import format_stats, layer_stats, token_subset
from klotski_sim.workload.trace_synth import DEFAULT_ROUTING, check_routing_fits, synthesize

IMPL_HELP = (
    "implementation preset: as-published (what each system's public code does, docs/implementations.md), "
    "ideal (the best implementation of the same schedule), v0.1 (what klotski 0.1 simulated)"
)


def add_run_arguments(
    p: argparse.ArgumentParser,
    policy: bool = True,
    num_batches: bool = True,
    impl_choices: Sequence[str] = PRESET_NAMES,
) -> None:
    """The options that describe one configuration (shared by simulate, compare, plan...)."""
    p.add_argument(
        "--model",
        default="mixtral-8x7b",
        metavar="NAME[:L][@intN]",
        help=f"model preset ({', '.join(sorted(PRESETS))}) or a Hugging Face config.json of a MoE model "
        f"(mixtral, qwen2_moe, qwen3_moe, olmoe, deepseek_v2/v3); NAME:L keeps its first L layers, "
        f"@int8|int4|int3|int2[:gG][:fp32] quantises its experts (default: %(default)s)",
    )
    p.add_argument(
        "--hardware",
        default="rtx3090",
        type=path_arg,
        metavar="NAME|FILE",
        help=f"built-in profile ({', '.join(builtin_profile_names())}) or a profile YAML (default: %(default)s)",
    )
    if policy:
        p.add_argument(
            "--policy", default="single-batch", choices=list(POLICIES), help="schedule (default: %(default)s)"
        )
    p.add_argument(
        "--policy-file",
        action="append",
        default=[],
        metavar="FILE.py",
        help="a Python file that registers your own policy (docs/own-schedule.md); repeatable",
    )
    p.add_argument("--batch-size", type=positive_int, default=16, help="sequences per batch (default: %(default)s)")
    if num_batches:
        p.add_argument(
            "--num-batches",
            type=batches,
            default="auto",
            help="batches n, or 'auto' for the planner's choice (default: %(default)s; single-batch "
            "keeps one batch in flight)",
        )
    p.add_argument("--prompt-len", type=positive_int, default=512, help="prompt tokens P (default: %(default)s)")
    p.add_argument("--gen-len", type=positive_int, default=32, help="generated tokens G (default: %(default)s)")
    p.add_argument(
        "--seed",
        type=seed_int,
        default=None,
        help="seed of the routing generator, when no --trace is given (default: 0)",
    )
    p.add_argument(
        "--routing",
        default=None,
        metavar="KIND",
        help=f"synthetic routing when no --trace is given: calibrated, uniform, zipf:<a>, skewed "
        f"(default: {DEFAULT_ROUTING})",
    )
    p.add_argument(
        "--trace",
        type=path_arg,
        metavar="FILE",
        help="replay a routing trace (.npz from `trace synth`, `trace import` or `klotski-runtime record`)",
    )
    p.add_argument("--wrap", action="store_true", help="let a trace with too few sequences reuse them")
    p.add_argument(
        "--warmup-sequences",
        type=nonnegative_int,
        default=8,
        metavar="N",
        help="trace sequences reserved for the prefetcher's pre-run, never evaluated (default: %(default)s)",
    )
    p.add_argument(
        "--kv",
        default="auto",
        choices=["auto", "gpu", "cpu"],
        help="where the KV cache lives; auto = GPU when n batches fit (default: %(default)s)",
    )
    p.add_argument(
        "--experts",
        default="auto",
        choices=["auto", "cpu", "disk"],
        help="where experts live; auto = host memory, disk when it is short (default: %(default)s)",
    )
    p.add_argument(
        "--resident-layers",
        type=layers_or_fill,
        default=None,
        metavar="N|fill",
        help="layers kept whole on the GPU; fill: as many as the memory n batches leave allows "
        "(default: fill with --num-batches auto, else 0)",
    )
    p.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="FIELD=VALUE",
        help="override a profile field, e.g. --set links.pcie_h2d.bandwidth=32e9 (repeatable)",
    )
    p.add_argument(
        "--impl", default="as-published", choices=list(impl_choices), help=IMPL_HELP + " (default: %(default)s)"
    )


def routing_kind(routing: str | None, trace: str | None) -> str:
    """The synthetic routing a run draws (--routing, else the default). A trace replays its own
    routing: --routing beside --trace would be ignored, so the pair is refused."""
    if routing is not None and trace is not None:
        raise CliError(f"--routing {routing} and --trace {trace}: a trace replays its own routing; give one of them")
    return DEFAULT_ROUTING if routing is None else routing


def not_an_input(out: Path, flag: str, reads: Sequence[str | os.PathLike]) -> None:
    """Refuse writing where the command reads (`trace stats t.npz --csv t.npz` would replace the
    trace with its table). A folder it reads (a checkpoint) is read whole: none of its files may be
    replaced."""
    for read in reads:
        source = Path(read)
        try:
            same = out.exists() and source.exists() and os.path.samefile(out, source)
        except OSError:
            same = False
        if same or out.resolve() == source.resolve():
            raise CliError(f"{flag} {out}: is what this command reads ({read}); writing there would replace it")
        if source.is_dir() and out.exists() and out.resolve().is_relative_to(source.resolve()):
            raise CliError(
                f"{flag} {out}: is a file of {read}, which this command reads; writing there would replace it"
            )


def output_file(path: str | os.PathLike, flag: str = "--out", reads: Sequence[str | os.PathLike] = ()) -> Path:
    """A file a command will write, checked before any work (not after a whole table or a
    calibration): not a folder, in a folder that exists and can be written, not a device or a
    pipe (the file is written whole beside it and renamed onto it: `write_file`), and none of the
    files it `reads`."""
    if not str(path).strip():
        raise CliError(f"{flag}: expected a file name, got an empty one")
    out = Path(path)
    not_an_input(out, flag, reads)
    if out.is_dir():
        raise CliError(f"{flag} {out}: is a folder; give a file name")
    if out.exists() and not out.is_file():  # (the rename onto it would fail only after the work)
        raise CliError(f"{flag} {out}: not a regular file (a device, a pipe or a socket); give a file name")
    folder = out.resolve().parent
    if not folder.is_dir():
        raise CliError(f"{flag} {out}: {folder} {'is not a folder' if folder.exists() else 'does not exist'}")
    if not os.access(folder, os.W_OK):
        raise CliError(f"{flag} {out}: cannot write in {folder}")
    return out


def spec_from_args(args: argparse.Namespace, **changes: Any) -> RunSpec:
    # (each of these would change nothing, silently: a trace has its own routing, a synthetic one is never short)
    if args.seed is not None and args.trace is not None:
        raise CliError(
            f"--seed {args.seed} and --trace {args.trace}: the seed draws synthetic routing, and a trace "
            f"replays its own; give one of them"
        )
    if args.wrap and args.trace is None:
        raise CliError(
            "--wrap lets a --trace with too few sequences reuse them; without --trace (synthetic routing "
            "has as many as the run needs) it does nothing"
        )
    fields = dict(
        model=args.model,
        hardware=args.hardware,
        policy=getattr(args, "policy", "single-batch"),
        batch_size=args.batch_size,
        num_batches=getattr(args, "num_batches", None),
        prompt_len=args.prompt_len,
        gen_len=args.gen_len,
        seed=args.seed or 0,
        routing=routing_kind(args.routing, args.trace),
        trace=args.trace,
        wrap=args.wrap,
        warmup_sequences=args.warmup_sequences,
        kv=args.kv,
        experts=args.experts,
        resident_layers=args.resident_layers,
        impl=args.impl,
        overrides=parse_overrides(args.overrides, "--set"),
    )
    if fields["overrides"]:  # (checked here to be named by their flag, not as "overrides:")
        with_overrides(load_profile(args.hardware), fields["overrides"], where="--set")
    fields.update(changes)
    return RunSpec(**fields)


def _device_name(resource: str, on_cpu: bool) -> str:
    """In a CPU run the `gpu` resource is the CPU's compute thread."""
    return "cpu-compute" if on_cpu and resource == "gpu" else resource


def _warn_of_routing(source: str) -> None:
    """What a replayed trace's source says the run should not be read without (trace.replay)."""
    for said in re.findall(r"\(((?:WRAPPED|ANOTHER MODEL): [^()]*)\)", source):
        print(f"warning: {said}", file=sys.stderr)


def format_summary(s: Summary) -> str:
    if s.num_ops == 0 and s.oom:  # refused by the memory check: nothing ran
        return "\n".join(
            [
                f"policy      {s.policy}   model {s.model}   hardware {s.hardware}   impl {s.impl}",
                f"workload    n={s.num_batches} x bs={s.batch_size}, prompt {s.prompt_len}, generate "
                f"{s.gen_len} ({s.generated_tokens} tokens)",
                f"status      {s.status}  ({_oom_text(s.oom)})",
            ]
        )
    on_cpu = s.source == "measured" and s.hardware.startswith("cpu")
    device = "CPU" if on_cpu else "GPU"  # a CPU run's "device" is the CPU and its memory host memory
    finished = s.status == "ok"
    # (a run of one generated token has no decode step, nor has one stopped before its first: a "0.0 ms"
    # decode step would read as a measurement)
    decode = (
        f"decode step {duration_text(s.decode_step_s)}, MoE block {duration_text(s.moe_block_s)}"
        if s.decode_s > 0
        else "no decode step"
    )
    # the run's times in the makespan's unit, a tiny run's in ms (0.43 ms of bubbles, not `0.000 s`); a
    # time that would show under two digits there in its own (a long run's 50 us of inter-layer bubbles)
    unit = duration_unit(s.makespan_s)

    def t(seconds: float) -> str:
        return duration_text(seconds, unit)

    lines = [
        f"policy      {s.policy}   model {s.model}   hardware {s.hardware}   impl {s.impl}",
        f"workload    n={s.num_batches} x bs={s.batch_size}, prompt {s.prompt_len}, generate {s.gen_len} "
        f"({s.generated_tokens} tokens)",
        f"status      {s.status}" + (f"  ({_oom_text(s.oom)})" if s.oom else ""),
        # (the two parts add up to the makespan; a batch's own prefill latency is another figure, set after
        # the semicolon so that it does not read as a part)
        f"makespan    {t(s.makespan_s)}   ({'' if finished else 'until it stopped: '}prefill "
        f"{t(s.makespan_s - s.decode_s)} + decode {t(s.decode_s)}; a batch's prefill {t(s.prefill_s)}, {decode})",
        (
            f"throughput  {s.throughput_tok_s:.3f} generated tok/s end to end   "
            + (
                f"{s.decode_throughput_tok_s:.3f} tok/s decode only"
                if s.decode_s > 0
                else "no decode throughput: no decode step"
            )
        )
        if finished
        else "throughput  - (the run did not finish)",
        f"{device} busy    {t(s.gpu_busy_s)}   bubbles {t(s.bubble_s)} "
        f"(inter-layer {t(s.bubble_inter_s)}, intra-layer {t(s.bubble_intra_s)})   "
        f"host blocked {t(s.host_blocked_s)}",
        f"bound       {t(s.lower_bound_s)} on {_device_name(s.lower_bound_resource, on_cpu)}   "
        f"efficiency {f'{s.efficiency:.1%}' if finished else '- (the run did not finish)'}",
        f"peak {'host' if on_cpu else 'GPU'}    {memory_text(s.peak_gpu_bytes)}"
        f"{' (the CPU runtime device store, in host memory)' if on_cpu else ''}   ops {s.num_ops}"
        f"{'' if finished else ' in the schedule (the run stopped before them all)'}",
        "utilisation " + "  ".join(f"{_device_name(r, on_cpu)} {u:.1%}" for r, u in s.utilization.items()),
    ]
    if s.bubble_by_cause:
        lines.append(
            "bubbles by cause "
            + "  ".join(f"{c} {t(v)}" for c, v in sorted(s.bubble_by_cause.items(), key=lambda kv: -kv[1]))
        )
    cache = s.extra.get("expert_cache")
    if cache and s.status == "ok":
        lines.append(
            f"expert cache {cache['slots']} slots ({cache['policy']}): hit rate {cache['hit_rate']:.1%} "
            f"({cache['hits']} hits, {cache['misses']} misses)"
        )
    if "expert_placement" in s.extra:
        placed = s.extra["expert_placement"]
        lines.append(
            f"experts     {placed.get('gpu', 0)} on resident weights, {placed.get('cpu', 0)} on the CPU, "
            f"{placed.get('transfer', 0)} copied over PCIe"
        )
    elif "cpu_experts" in s.extra:
        lines.append(f"experts     {s.extra['cpu_experts']} cold expert ops on the CPU")
    return "\n".join(lines)


def _oom_text(oom: dict[str, Any]) -> str:
    return OutOfMemory.from_dict(oom).describe()


# ---- subcommands ----------------------------------------------------------------------------
def _note(text: str) -> None:
    print(f"note: {text}", file=sys.stderr, flush=True)


def _local_workers(args: argparse.Namespace) -> None:
    """`--workers` held to the cores this process may use, where the workers are its own processes
    (not a remote Dask cluster's), said on stderr: the runs are CPU-bound, so more workers than cores
    finish no sooner and each takes its own memory (~100 MB a process)."""
    cores = available_cores()
    remote = getattr(args, "dask", None) not in (None, "local")
    if args.workers is not None and args.workers > cores and not remote:
        _note(
            f"--workers {args.workers}: this process may use {cores} core(s); running {counted(cores, 'worker')} "
            f"(the runs are CPU-bound: more would finish no sooner, each taking its own memory)"
        )
        args.workers = cores


def cmd_simulate(args: argparse.Namespace) -> int:
    # a long synthetic draw (a fine-grained model's long prompts: a minute) and a long run (millions of
    # ops, projected from its first steps: klotski_sim.util.run_size) are said on stderr before they
    # begin, not taken for hangs
    with run_size.surroundings(files_written=args.out is not None, listeners=(_note,)):
        return _simulate(args)


def _simulate(args: argparse.Namespace) -> int:
    out = output_folder(args.out) if args.out is not None else None
    if out is not None:
        refuse_unwritable(out, SIMULATE_FILES)
    result = run(spec_from_args(args, options=parse_overrides(args.options, "--option")))
    print(format_summary(result.timeline.summary()))
    if result.probes is not None:
        print(
            f"n = {result.probes.chosen.n} chosen by {len(result.probes.probes)} simulated probes "
            f"(klotski-sim plan --policy {result.spec.policy} shows them)"
        )
    _warn_of_routing(result.timeline.meta.get("routing", ""))
    if out is not None:
        drawn = not args.no_png and len(result.timeline) > 0
        if not args.no_png and not drawn:
            print("no timeline.png: nothing was simulated")
        # (all or none: a stopped run leaves the folder as it was)
        with OutputFiles(out, stale=SIMULATE_FILES) as files:
            write_timeline_files(result.timeline, files, png=drawn)
            result.schedule.save(files.path("schedule.json"))
            if result.routing is not None:  # (none when the memory check refused the run before any routing)
                result.routing.save(files.path("routing.npz"))
            written = files.commit()
        print(f"wrote {', '.join(written)} to {out}/{_removed_text(files.removed)}")
    return 0 if result.timeline.status == "ok" else 3


# what `simulate --out` writes: an earlier run's file of these names that this run does not write
# (its figure, when --no-png; its routing, when refused) is removed, so that the folder holds one run
SIMULATE_FILES = (*TIMELINE_FILES, "schedule.json", "routing.npz")


def _removed_text(removed: Sequence[str]) -> str:
    return f" (removed an earlier run's {', '.join(removed)})" if removed else ""


COMPARE_POLICIES = ("single-batch", "multi-batch", "hot-prefetch", "klotski", "klotski-oracle", "flexgen")


def cmd_plan(args: argparse.Namespace) -> int:
    spec = spec_from_args(args, num_batches=None)
    prep = prepare(spec)
    assert prep.plan is not None  # (n was left to the planner)
    print(format_plan(prep.plan, prep.model, prep.profile, spec.batch_size))
    if prep.refused is not None:
        print(f"refused: {prep.refused.describe()}")
    if prep.refused is not None or prep.plan.n_memory == 0:
        return 3  # (as simulate exits on out-of-memory)
    planned = plan_run(spec, prep)
    if planned.probes is not None:
        print(planned.probes.describe(spec.policy, spec.gen_len))
    elif planned.num_batches != prep.num_batches:
        print(f"=> {spec.policy} runs n = {planned.num_batches}")
    return 0


def cmd_compare(args: argparse.Namespace) -> int:
    impls = ["as-published", "ideal"] if args.impl == "both" else [args.impl]
    _local_workers(args)
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
    out = output_folder(args.out)
    compare_files = _compare_files()
    refuse_unwritable(out, compare_files)
    # (its runs' Chrome traces are written piece by piece: not simulate --out's files)
    with run_size.surroundings(files_written=False, listeners=(_note,)):
        return _compare(args, spec, policies, impls, out, compare_files)


def _compare(
    args: argparse.Namespace,
    spec: RunSpec,
    policies: list[str],
    impls: list[str],
    out: Path,
    compare_files: list[str],
) -> int:
    prep = prepare(spec)
    if prep.plan is not None:
        print(f"planner: n = {prep.num_batches} ({'; '.join(prep.plan.notes) or 'bubbles closed within memory'})")
    routing_source = prep.replay.routing.source if prep.replay else "not built (refused by the memory check)"
    print(f"placement: {prep.placement.describe()}; routing: {routing_source}; implementation: {' and '.join(impls)}")
    _warn_of_routing(routing_source)
    runs: dict[tuple[str, str], RunPlan] = {}
    for name in policies:
        options = {"overlap": args.flexgen_overlap} if name == "flexgen" and args.flexgen_overlap else {}
        for impl in impls:  # (probes, where a policy takes them, are taken by the worker that runs it)
            runs[(name, impl)] = plan_run(replace(spec, policy=name, options=options, impl=impl), prep, probe=False)
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
        f"to {out}/{_removed_text(files.removed)}"
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


SWEEP_CONFIRM = 10_000  # a grid larger than this runs only with --yes
# (`python experiments/bench_sweep.py --default-size 20`, every schedule distinct; docs/performance.md)


def cmd_sweep(args: argparse.Namespace) -> int:
    from klotski_sim.runs.sweep import check_spec, grid_size, load_spec, run_sweep, summarize

    spec = load_spec(args.spec, checked=False)
    size = grid_size(spec)
    if size > SWEEP_CONFIRM and not args.yes:  # (before each value is checked against every profile: 2 s at 80k)
        raise CliError(f"{args.spec}: {size} configurations is more than {SWEEP_CONFIRM}; add --yes to run them")
    check_spec(spec, str(args.spec))
    if args.dask is not None and not args.dask.strip():  # (an empty address would run locally, silently)
        raise CliError("--dask: expected a scheduler address like tcp://HOST:8786 or 'local', got an empty one")
    _local_workers(args)
    # (the sweep keeps its spec as DIR/spec.yaml: a link there to the spec it reads would have the user's file,
    # comments and all, replaced by the sweep's own dump of it)
    not_an_input(Path(args.out) / "spec.yaml", "--out", [args.spec])
    output_folder(args.out)  # (after the grid is accepted: a refused one leaves no empty folder)

    def starting(done: int, total: int, others: int) -> None:
        """What the sweep will do, before it does it: a resumed sweep's estimate is of what is left."""
        grid = f"{counted(total, 'configuration')} in the grid"
        if others:
            grid += f" ({counted(others, 'row')} of other code or grids in the folder: kept, not reused)"
        if done == total:
            print(f"{grid}; resumed: all already done")
            return
        left = total - done
        workers = min(max(1, args.workers), left)
        resumed = f"; resumed: {done} already done, {left} left" if done else ""
        # (no time is guessed here: a constant measured on another machine is off 4-15x under load; the
        # progress lines estimate from the rows this machine has finished)
        print(f"{grid}{resumed}: running on {counted(workers, 'worker')}", flush=True)

    df = run_sweep(
        spec, args.out, workers=args.workers, dask=args.dask, progress=not args.no_progress, on_start=starting
    )
    swept = [
        k
        for k, values in (
            ("model", spec.models),
            ("hardware", spec.hardware),
            ("policy", spec.policies),
            ("impl", spec.impls),
            ("batch_size", spec.batch_sizes),
            ("num_batches", spec.num_batches),
            ("prompt_len", spec.prompt_lens),
            ("gen_len", spec.gen_lens),
            ("routing", spec.routings),
            ("seed", spec.seeds),
            ("kv", spec.kv),
            ("experts", spec.experts),
        )
        if len(values) > 1
    ]
    swept += [f"set.{k}" for k in spec.overrides]
    swept += [f"opt.{k}" for k, values in spec.options.items() if len(values) > 1]
    if spec.serving is not None:
        g = spec.serving
        serving_axes = (
            ("requests", g.requests),
            ("output_len", g.output_lens),
            ("lengths", g.lengths),
            ("rate", g.rates),
            ("max_num_seqs", g.max_num_seqs),
            ("max_num_batched_tokens", g.max_num_batched_tokens),
            ("gpu_memory_utilization", g.gpu_memory_utilization),
        )
        swept += [k for k, values in serving_axes if len(values) > 1]
    print(summarize(df, swept))
    failed = int((df["status"] != "ok").sum()) if len(df) else 0
    print(
        f"{counted(len(df), 'configuration')} in {args.out}/results.parquet ({failed} not ok: see the status and "
        f"error columns)"
    )
    return 0


def cmd_optimize(args: argparse.Namespace) -> int:
    from klotski_sim.runs.optimize import Search, check_search, ok_rows, pareto_front, simulate_command, winner
    from klotski_sim.runs.sweep import run_sweep

    _local_workers(args)

    def ints(text: str, flag: str, low: int = 1, words: tuple[str, ...] = ()) -> tuple:
        what = f"comma-separated integers >= {low}" + "".join(f" or {w}" for w in words)
        try:
            values = tuple(v if v in words else plain_int(v) for v in text.split(","))
        except ValueError:
            raise CliError(f"{flag}: give {what}, got {text!r}") from None
        if any(not isinstance(v, str) and not low <= v <= MAX_COUNT for v in values):
            raise CliError(f"{flag}: give {what} (up to {MAX_COUNT_TEXT}), got {text!r}")
        return values

    if "@" in args.model:
        raise CliError(
            f"--model {args.model}: give the model without '@...'; --expert-dtypes chooses the expert "
            f"dtypes to search (default: bf16,int4)"
        )
    search = Search(
        model=args.model,
        hardware=args.hardware,
        prompt_len=args.prompt_len,
        gen_len=args.gen_len,
        policies=tuple(args.policies or ()),
        impls=("as-published", "ideal") if args.impl == "both" else (args.impl,),
        batch_sizes=ints(args.batch_sizes, "--batch-sizes"),
        num_batches=ints(args.num_batches, "--num-batches", words=("auto",)),
        expert_dtypes=tuple(args.expert_dtypes),
        kv=tuple(args.kv),
        cache_sizes=ints(args.cache_sizes, "--cache-sizes", low=0),
        resident_layers=ints(args.resident_layers, "--resident-layers", low=0, words=("auto", "fill")),
        max_token_latency_s=args.max_token_latency,
        budget=args.budget,
        seed=args.seed,
    )
    check_search(search)
    spec = search.spec()
    output_folder(args.out)
    ids, size = search.selected_ids(spec)
    one_batch = search.one_batch_left_out()
    if not ids:
        raise CliError(
            f"--num-batches {args.num_batches}: no configuration left — "
            f"{', '.join(one_batch)} {'keeps' if len(one_batch) == 1 else 'keep'} one batch in flight by "
            f"definition and {'runs' if len(one_batch) == 1 else 'run'} at n auto only"
        )
    sampled = f" (a seeded sample of {len(ids)}: the grid exceeds --budget)" if len(ids) < size else ""
    print(
        f"optimize {args.model} on {args.hardware}: {counted(size, 'configuration')}{sampled} — policies "
        f"{', '.join(search.policy_names())}; impl {', '.join(search.impls)}; batch sizes "
        f"{', '.join(map(str, search.batch_sizes))}; experts {', '.join(search.expert_dtypes)}; kv "
        f"{', '.join(search.kv)}; cache sizes {', '.join(map(str, search.cache_sizes))}; resident layers "
        f"{', '.join(map(str, search.resident_layers))}; n {', '.join(map(str, search.num_batches))}"
        + (" (auto: the planner's; --num-batches auto,4,16 searches n)" if search.num_batches == ("auto",) else "")
    )
    if one_batch:  # (else left out of the grid silently, though the header names them)
        alone = len(one_batch) == 1
        print(
            f"note: {', '.join(one_batch)} {'is' if alone else 'are'} not searched: one batch in flight by "
            f"definition, at n auto only (--num-batches auto,... includes {'it' if alone else 'them'})"
        )
    df = run_sweep(spec, args.out, workers=args.workers, progress=not args.no_progress, only=ids)
    ok = ok_rows(df)
    statuses = Counter(df["status"] if "status" in df.columns else ())
    failed_count, refused, too_large, killed = (statuses[s] for s in ("error", "refused", "too-large", "killed"))
    oom = len(df) - len(ok) - failed_count - refused - too_large - killed
    notes = []
    if oom:
        notes.append(f"{oom} {'does' if oom == 1 else 'do'} not fit in GPU memory")
    if refused:
        notes.append(f"{refused} {'does' if refused == 1 else 'do'} not fit in the profile's host memory or disk")
    if too_large:
        notes.append(f"{too_large} {'is' if too_large == 1 else 'are'} too large for this machine's memory to simulate")
    if killed:
        notes.append(
            f"{killed} ended the worker process that ran {'it' if killed == 1 else 'them'}: killed, or out "
            f"of host memory?"
        )
    if failed_count:
        notes.append(f"{failed_count} failed: see the error column")
    print(
        f"{len(ok)} of {len(df)} ran to the end"
        + (f" ({'; '.join(notes)})" if notes else "")
        + f"; results in {args.out}/results.parquet"
    )
    if ok.empty:
        failed = df[df["status"] == "error"] if "status" in df.columns else df.iloc[0:0]
        if len(failed):
            raise CliError(
                f"{len(failed)} of {counted(len(df), 'configuration')} failed and none ran to the end; "
                f"the first: {failed['error'].iloc[0]}"
            )
        if refused or too_large or killed:
            label = "refused" if refused or too_large else "killed"
            first = df.loc[
                df["status"].isin(["refused", "too-large"] if label == "refused" else ["killed"]), "error"
            ].iloc[0]
            where = ", ".join(
                f"{count} {why}"
                for count, why in (
                    (oom, "not in GPU memory"),
                    (refused, "not in the profile's host memory or disk"),
                    (too_large, "too large to simulate here"),
                    (killed, "killed"),
                )
                if count
            )
            fits = "could run" if too_large or killed else "fits"
            raise CliError(f"no configuration {fits} ({len(df)} tried: {where}); the first {label}: {first}")
        raise CliError(
            f"no configuration fits in GPU memory ({len(df)} tried): try smaller --batch-sizes, "
            f"--num-batches or --expert-dtypes int4"
        )
    front = pareto_front(ok)
    print("Pareto front (throughput vs per-token latency = the decode step):")
    print(f"  {'tok/s':>8} {'latency s':>9}  {'policy':15} {'impl':12} {'bs':>4} {'n':>3} {'kv':4} model")
    for _, r in front.iterrows():
        print(
            f"  {r['m.throughput_tok_s']:8.1f} {r['m.decode_step_s']:9.3g}  {r['policy']:15} {r['impl']:12} "
            f"{int(r['batch_size']):4d} {int(r['m.n']):3d} {str(r['m.kv']):4} {r['model']}"
        )
    best = winner(ok, args.max_token_latency)
    if best is None:
        raise CliError(
            f"no configuration meets --max-token-latency {args.max_token_latency} s (the fastest token "
            f"takes {ok['m.decode_step_s'].min():.3f} s)"
        )
    cap = f" within {args.max_token_latency} s per token" if args.max_token_latency else ""
    ties = (
        int(((ok["m.throughput_tok_s"] - best["m.throughput_tok_s"]).abs() <= 1e-9 * best["m.throughput_tok_s"]).sum())
        - 1
    )
    tied = f" (tied with {ties} other configuration{'s' if ties > 1 else ''} in results.parquet)" if ties else ""
    print(f"winner{cap}: {best['m.throughput_tok_s']:.1f} tok/s, {best['m.decode_step_s']:.3g} s per token{tied}")
    print(f"  {simulate_command(best, args.policy_file)}")
    return 0


def cmd_models(args: argparse.Namespace) -> int:
    print(
        f"{'name':20} {'layers':>6} {'experts':>7} {'top-k':>5} {'hidden':>6} {'ffn':>6} "
        f"{'expert MB':>9} {'layer MB':>9} {'total GB':>8}"
    )
    for m in PRESETS.values():
        print(
            f"{m.name:20} {m.num_layers:6} {m.num_experts:7} {m.top_k:5} {m.hidden_size:6} {m.ffn_size:6} "
            f"{m.expert_bytes() / 1e6:9.1f} {m.layer_bytes() / 1e6:9.1f} {m.total_bytes() / 1e9:8.1f}"
        )
    print(
        "NAME:L keeps the first L layers; NAME@int4 (int8, int3, int2; :gG group size, :fp32 scales) quantises "
        "the routed experts, e.g. mixtral-8x7b@int4:g16:fp32 (Klotski's port)"
    )
    return 0


def _as_option_value(value: Any) -> str:
    """A value as --option KEY=VALUE takes it (JSON, strings bare)."""
    return value if isinstance(value, str) else json.dumps(value)


def cmd_policies(args: argparse.Namespace) -> int:
    """The policies, or one policy's options: what `--option` takes, generated from the options' specs."""
    if args.name is None:
        width = max(len(name) for name in POLICIES)
        for info in POLICIES.values():
            print(f"{info.name:{width}}  {info.description}")
        print("klotski-sim policies NAME lists a policy's options (--option KEY=VALUE)")
        return 0
    info = get_policy(args.name)
    traits = [name for name, value in asdict(info.traits).items() if value is True]
    print(f"{info.name}: {info.description}")
    print(f"buffering: {info.traits.buffering}" + (f"; traits: {', '.join(traits)}" if traits else ""))
    presets = {name: info.preset(name) for name in ("as-published", "ideal")}
    rows = [
        (
            spec.name,
            spec.accepts(),
            *(_as_option_value(presets[p].get(spec.name, spec.default)) for p in presets),
            spec.help,
        )
        for spec in info.option_specs().values()
    ]
    head = ("option", "accepts", "as-published", "ideal", "meaning")
    widths = [max(len(str(row[i])) for row in (head, *rows)) for i in range(4)]
    for row in (head, *rows):
        print("  ".join(f"{cell:{w}}" for cell, w in zip(row[:4], widths)) + "  " + row[4])
    return 0


def cmd_profiles(args: argparse.Namespace) -> int:
    print(
        f"{'name':10} {'GPU':26} {'mem GiB':>7} {'TFLOP/s':>7} {'HBM GB/s':>8} {'H2D GB/s':>8} "
        f"{'NVMe GB/s':>9} {'host GB':>7}  CPU compute (CPU-expert policies)"
    )
    for name in builtin_profile_names():
        p = load_profile(name)
        cpu = (
            f"{p.cpu.cores} cores, {p.cpu.flop_rate / 1e12:.1f} TFLOP/s {p.cpu.compute_dtype}, "
            f"{p.cpu.memory_bandwidth / 1e9:.0f} GB/s"
            if p.cpu
            else "-"
        )
        print(
            f"{name:10} {p.gpu.name[:26]:26} {p.gpu.memory_bytes / GIB:7.1f} {p.gpu.peak_flops / 1e12:7.0f} "
            f"{p.gpu.memory_bandwidth / 1e9:8.0f} {p.links.pcie_h2d.bandwidth / 1e9:8.1f} "
            f"{p.links.nvme.bandwidth / 1e9:9.1f} {p.host.memory_bytes / 1e9:7.0f}  {cpu}"
        )
    return 0


def cmd_trace_synth(args: argparse.Namespace) -> int:
    output_file(args.out)
    model = get_model(args.model)
    check_routing_fits(model, args.sequences, args.prompt_len + args.gen_len, f"{args.sequences} sequences")
    seconds = draw_seconds(model, args.sequences, args.prompt_len + args.gen_len)
    if seconds >= LONG_DRAW_S:  # (100M sequences of a tiny model draw for 17 minutes)
        _note(
            f"drawing {args.sequences:,} sequences x {args.prompt_len + args.gen_len:,} tokens of {model.name}'s "
            f"routing: about {span_text(seconds)} on this machine as loaded now"
        )
    trace = synthesize(
        model, args.sequences, args.prompt_len, args.gen_len, args.routing, args.seed, with_weights=args.with_weights
    )
    trace.save(args.out)
    print(
        f"wrote {args.out}: {trace.num_sequences} sequences x {args.prompt_len + args.gen_len} tokens, "
        f"{model.name}, routing {args.routing}, seed {args.seed} ({Path(args.out).stat().st_size / 1e6:.1f} MB)"
    )
    return 0


def cmd_trace_stats(args: argparse.Namespace) -> int:
    if args.csv is not None:  # (`--csv ''` would write nothing and say nothing)
        output_file(args.csv, "--csv", reads=[args.file])
    trace = Trace.load(args.file)
    try:
        trace = token_subset(trace, args.tokens)
        df = layer_stats(trace)
    except TraceError as err:  # (the load's own errors name the file; these do not)
        raise TraceError(f"{args.file}: {err}") from None
    print(format_stats(trace, df))
    if args.csv is not None:
        from pandas.io.common import infer_compression  # (pandas picks a compression by the name's suffix, as
        # when it writes --csv itself: the temporary's name ends in .tmp)

        write_file(
            args.csv, lambda temporary: df.to_csv(temporary, compression=infer_compression(args.csv, "infer")), "--csv"
        )
        print(f"wrote {args.csv}")
    return 0


SHOWN_WARNINGS = 40  # an import's problems printed at most


def cmd_trace_import(args: argparse.Namespace) -> int:
    out = args.out or str(Path(args.file).with_suffix(".npz"))
    output_file(out, "--out" if args.out else "the output (the log's name with .npz; give --out)", reads=[args.file])
    # (with --model, its expert count: else a log that never uses the highest id is "another shape"; and its
    # dense first layers, which a log has no router records of: DeepSeek's)
    model = get_model(args.model) if args.model else None
    num_experts = args.num_experts or (model.num_experts if model else None)
    trace, problems = import_jsonl(
        args.file,
        num_experts=num_experts,
        model=args.model or "unknown",
        key_fields=tuple(args.key) if args.key else None,
        holes=args.holes,
        source=args.source,
        license=args.license,
        dataset=args.dataset,
        dense_layers=model.first_dense_layers if model else 0,
    )
    for line in problems[:SHOWN_WARNINGS]:  # (a long log can have one per sequence)
        print(f"warning: {line}", file=sys.stderr)
    if len(problems) > SHOWN_WARNINGS:
        print(f"warning: ... and {len(problems) - SHOWN_WARNINGS} more problems like these", file=sys.stderr)
    if model is not None:
        trace.check_model(model, args.file)
    trace.save(out)
    print(
        f"wrote {out}: {trace.num_sequences} sequences, {len(trace.experts)} tokens, {trace.num_layers} layers, "
        f"top-{trace.top_k} of {trace.num_experts} experts"
        + (f"; {len(problems)} problem(s) reported" if problems else "")
    )
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = OneLineParser(prog="klotski-sim", description=__doc__.splitlines()[0])
    parser.add_argument("--debug", action="store_true", help="show the full traceback of an error")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("simulate", help="simulate one schedule and print its summary")
    add_run_arguments(p)
    p.add_argument(
        "--option",
        dest="options",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="a policy option, e.g. --option overlap=model for flexgen (repeatable); "
        "klotski-sim policies NAME lists a policy's options",
    )
    p.add_argument(
        "--out",
        metavar="DIR",
        help="write summary.json, timeline.parquet/.csv, trace.json.gz, "
        "timeline.png, schedule.json and routing.npz here",
    )
    p.add_argument("--no-png", action="store_true", help="skip the Gantt PNG (faster for big runs)")
    p.set_defaults(func=cmd_simulate)

    tp = sub.add_parser("trace", help="routing traces: synth, stats, import").add_subparsers(
        dest="trace_command", required=True
    )
    p = tp.add_parser("synth", help="generate a synthetic routing trace calibrated to real models")
    p.add_argument(
        "--model", default="mixtral-8x7b", choices=sorted(PRESETS), help="model preset (default: %(default)s)"
    )
    p.add_argument("--sequences", type=positive_int, default=512, help="sequences to generate (default: %(default)s)")
    p.add_argument(
        "--prompt-len", type=positive_int, default=512, help="prompt tokens per sequence (default: %(default)s)"
    )
    p.add_argument(
        "--gen-len", type=nonnegative_int, default=32, help="generated tokens per sequence (default: %(default)s)"
    )
    p.add_argument(
        "--routing",
        default=DEFAULT_ROUTING,
        metavar="KIND",
        help="calibrated, uniform, zipf:<a>, skewed (default: %(default)s)",
    )
    p.add_argument("--seed", type=seed_int, default=0, help="generator seed (default: %(default)s)")
    p.add_argument("--with-weights", action="store_true", help="also store synthetic gate weights (3x larger file)")
    p.add_argument("--out", required=True, metavar="FILE", help="trace file to write (.npz)")
    p.set_defaults(func=cmd_trace_synth)
    p = tp.add_parser("stats", help="per-layer statistics: popularity, stickiness, layer correlation, group skew")
    p.add_argument("file", type=path_arg, help="a routing trace (.npz)")
    p.add_argument("--csv", metavar="FILE", help="also write the per-layer table as CSV")
    p.add_argument(
        "--tokens",
        choices=["all", "prompt", "generated"],
        default="all",
        help="measure all tokens, the prompts' or the generated ones (default: %(default)s)",
    )
    p.set_defaults(func=cmd_trace_stats)
    p = tp.add_parser("import", help="convert a JSON-lines routing log (one record per token per layer) to a trace")
    p.add_argument(
        "file",
        type=path_arg,
        help="JSON lines, one record per token and layer: seq_id, token_idx, layer, experts "
        "[, gating_probs][, prompt_len: the sequence's prompt length]",
    )
    p.add_argument("--out", type=path_arg, metavar="FILE", help="output .npz (default: FILE with .npz)")
    p.add_argument("--model", choices=sorted(PRESETS), help="check the log against this model and record its name")
    p.add_argument(
        "--num-experts",
        type=bounded_int(1, MAX_IMPORT_INDEX),
        help="experts per layer (default: --model's, else the largest id + 1)",
    )
    p.add_argument(
        "--key",
        action="append",
        metavar="FIELD",
        help="a record field that, with the sequence id, names a sequence (repeatable; default: "
        "dataset, when the records carry it), so ids of two datasets never merge",
    )
    p.add_argument(
        "--holes",
        choices=["cut", "longest"],
        default="cut",
        help="a sequence with missing (token, layer) records: cut it before its first hole, or keep "
        "its longest run of complete tokens (default: %(default)s)",
    )
    p.add_argument("--source", help="where the log comes from (recorded in the trace; default: the file name)")
    p.add_argument("--license", help="the license of the routing data (recorded in the trace; default: unknown)")
    p.add_argument("--dataset", help="the dataset it was recorded on (recorded in the trace; default: unknown)")
    p.set_defaults(func=cmd_trace_import)

    p = sub.add_parser(
        "compare",
        help="the main job: the ablation ladder, Klotski's oracle and FlexGen on one "
        "configuration (n from the planner)",
        description="Simulate the ablation ladder, Klotski's oracle and FlexGen on one configuration "
        "and print one row per policy (and implementation preset).",
    )
    add_run_arguments(p, policy=False, impl_choices=(*PRESET_NAMES, "both"))
    p.add_argument(
        "--policies", type=name_list, metavar="A,B,...", help=f"comma-separated (default: {','.join(COMPARE_POLICIES)})"
    )
    p.add_argument(
        "--workers",
        type=workers_int,
        default=None,
        help="processes running the policies side by side, at most one per available core (default: "
        "one per available core)",
    )
    p.add_argument(
        "--flexgen-overlap",
        choices=["code", "model"],
        default=None,
        help="FlexGen's overlap: its implementation's (code) or its cost model's (default: the "
        "preset's: code for as-published and v0.1, model for ideal)",
    )
    p.add_argument(
        "--out",
        default="klotski-out",
        metavar="DIR",
        help="write compare.csv/.json, compare.png, plan.txt (and trace_<policy>.json.gz with --traces) "
        "here (default: %(default)s)",
    )
    p.add_argument(
        "--traces",
        action="store_true",
        help="also write each policy's Chrome/Perfetto trace, gzip-compressed (open the .json.gz in ui.perfetto.dev)",
    )
    p.add_argument("--no-png", action="store_true", help="skip the Gantt figure")
    p.set_defaults(func=cmd_compare)

    p = sub.add_parser("sweep", help="run a YAML grid of configurations (resumable) into one Parquet file")
    p.add_argument("spec", help="sweep spec YAML (see klotski_sim/runs/sweep.py or experiments/specs/)")
    p.add_argument("--out", required=True, metavar="DIR", help="results.parquet and rows/ go here; rerun to resume")
    p.add_argument(
        "--workers",
        type=workers_int,
        default=1,
        help="local processes, at most one per available core (default: %(default)s)",
    )
    p.add_argument(
        "--dask",
        metavar="ADDRESS|local",
        help="run on a dask.distributed scheduler, or 'local' to start a LocalCluster with --workers workers",
    )
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument("--yes", action="store_true", help=f"run a grid of more than {SWEEP_CONFIRM:,} configurations")
    p.set_defaults(func=cmd_sweep)

    p = sub.add_parser(
        "optimize",
        help="search policy x preset x batch size x KV placement x expert dtype for the "
        "highest throughput (Pareto front against per-token latency)",
        description="Exhaustive search (memory-floor pruned, n from the planner) on the sweep "
        "machinery; prints the Pareto front and the winner as a runnable simulate command.",
    )
    p.add_argument("--model", default="mixtral-8x7b", metavar="NAME[:L]", help="model preset (default: %(default)s)")
    p.add_argument(
        "--hardware", default="rtx3090", type=path_arg, metavar="NAME|FILE", help="profile (default: %(default)s)"
    )
    p.add_argument("--prompt-len", type=positive_int, default=512, help="prompt tokens (default: %(default)s)")
    p.add_argument("--gen-len", type=positive_int, default=32, help="generated tokens (default: %(default)s)")
    p.add_argument(
        "--max-token-latency",
        type=positive_float,
        default=None,
        metavar="S",
        help="seconds a sequence may wait per generated token (default: no cap)",
    )
    p.add_argument(
        "--budget",
        type=positive_int,
        default=400,
        help="evaluate at most this many configurations (a seeded sample above it; default: %(default)s)",
    )
    p.add_argument("--policies", type=name_list, metavar="A,B,...", help="default: every policy the profile can run")
    p.add_argument("--impl", choices=[*PRESET_NAMES, "both"], default="both", help="presets (default: %(default)s)")
    p.add_argument("--batch-sizes", default="4,16,64", metavar="B,...", help="(default: %(default)s)")
    p.add_argument(
        "--num-batches",
        default="auto",
        metavar="N,...",
        help="batches n to try; auto: the planner's (default: %(default)s)",
    )
    p.add_argument(
        "--expert-dtypes",
        type=name_list,
        default="bf16,int4",
        metavar="D,...",
        help="bf16 and/or int8|int4|int3|int2 (default: %(default)s)",
    )
    p.add_argument(
        "--kv",
        type=name_list,
        default="auto",
        metavar="K,...",
        help="KV cache placements: auto (on the GPU when it fits), gpu, cpu (default: %(default)s)",
    )
    p.add_argument(
        "--cache-sizes",
        default="0",
        metavar="C,...",
        help="expert-cache slots to try (option expert_cache; 0: none) (default: %(default)s)",
    )
    p.add_argument(
        "--resident-layers",
        default="auto",
        metavar="R,...",
        help="layers kept whole on the GPU to try; auto (or fill): as many as the memory left at n "
        "allows (default: %(default)s)",
    )
    p.add_argument(
        "--seed", type=seed_int, default=0, help="seed of the routing and of the sample (default: %(default)s)"
    )
    p.add_argument(
        "--workers",
        type=workers_int,
        default=2,
        help="local processes, at most one per available core (default: %(default)s)",
    )
    p.add_argument("--policy-file", action="append", default=[], metavar="FILE.py", help="your own policy (repeatable)")
    p.add_argument("--out", default="klotski-optimize", metavar="DIR", help="results (resumable; default: %(default)s)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.set_defaults(func=cmd_optimize)

    p = sub.add_parser(
        "plan",
        help="Klotski's planner: every term of inequalities (4)-(7), n, memory check; "
        "with --policy klotski-hybrid, its n by simulated probes",
    )
    add_run_arguments(p, policy=False, num_batches=False)
    p.add_argument(
        "--policy",
        default="klotski",
        choices=list(POLICIES),
        help="whose n: klotski (the inequalities), a policy that chooses n by simulated probes "
        "(klotski-hybrid: the probes are shown), or another policy (the n it runs) "
        "(default: %(default)s)",
    )
    p.set_defaults(func=cmd_plan)

    p = sub.add_parser("models", help="list model presets with their sizes")
    p.set_defaults(func=cmd_models)
    add_serve_parser(sub)
    p = sub.add_parser("policies", help="list the policies, or one policy's options (what --option takes)")
    p.add_argument("name", nargs="?", choices=list(POLICIES), metavar="NAME", help="a policy: list its options")
    p.add_argument("--policy-file", action="append", default=[], metavar="FILE.py", help="your own policy (repeatable)")
    p.set_defaults(func=cmd_policies)
    p = sub.add_parser("profiles", help="list built-in hardware profiles with their key numbers")
    p.set_defaults(func=cmd_profiles)
    return parser


RUNTIME_MODULES = ("torch", "transformers", "safetensors")  # the `runtime` extra's
RUNTIME_INSTALL = (
    "pip install 'klotski[runtime]' (from a checkout: pip install -e '.[runtime]'); on a machine "
    "without CUDA install the CPU build of torch first: pip install torch --index-url "
    "https://download.pytorch.org/whl/cpu"
)


def guarded(parser: argparse.ArgumentParser, argv: Sequence[str] | None) -> int:
    """Parse, run the subcommand, and turn the user's errors (KlotskiError, and OSError for files)
    into one `error:` line (exit 2). Anything else is a bug and shows its traceback; `--debug`
    shows the traceback of a user error too."""
    args = parser.parse_args(argv)
    handler: Callable[[argparse.Namespace], int] = args.func
    made_token = made_folders.set([])
    stops, replaced = take_stops()
    if isinstance(sys.stdout, io.TextIOWrapper):  # (to a file or a pipe, lines as they are printed, not at the end)
        sys.stdout.reconfigure(line_buffering=True)
    stdout, sys.stdout = sys.stdout, ReaderMayGo(sys.stdout)
    try:
        try:
            return handler(args)
        finally:
            stops.done = True  # (a stop from here on ends the process with its word: no traceback)
    except BrokenPipeError:  # a reader other than stdout's has gone (stdout's is `ReaderMayGo`'s)
        return 0
    except (KlotskiError, OSError) as err:
        remove_empty_made_folders()
        if getattr(args, "debug", False):
            raise
        print(f"error: {one_line(str(err))}", file=sys.stderr)
        return 2
    except KeyboardInterrupt as stop:
        remove_empty_made_folders()
        return stopped(stop)
    except ModuleNotFoundError as err:
        if err.name not in RUNTIME_MODULES or getattr(args, "debug", False):
            raise
        remove_empty_made_folders()
        print(
            f"error: {err.name} is not installed, and this command runs models with it: {RUNTIME_INSTALL}",
            file=sys.stderr,
        )
        return 2
    except (MemoryError, RuntimeError) as err:  # (torch's allocators raise RuntimeError: "... can't allocate ...")
        if str(err).startswith("Symlink loop from ") and not getattr(args, "debug", False):
            # (a path given through a link that points back at itself: pathlib's resolve() on Python < 3.13;
            # from 3.13 it is an OSError, ELOOP, said above)
            print(
                f"error: {one_line(str(err).removeprefix('Symlink loop from '))}: a symbolic link that loops back "
                f"on itself",
                file=sys.stderr,
            )
            return 2
        if "can't start new thread" in str(err) and not getattr(args, "debug", False):  # (a process or memory limit)
            print(f"error: the machine refused another thread ({err}): ask for fewer --threads", file=sys.stderr)
            return 2
        if getattr(args, "debug", False) or not (isinstance(err, MemoryError) or "allocate" in str(err)):
            raise
        said = " ".join(str(err).split())[:200]
        print(
            f"error: out of memory{': ' + said if said else ''} (a smaller configuration, or --debug for where)",
            file=sys.stderr,
        )
        return 2
    finally:
        sys.stdout = stdout
        restore_stops(replaced)
        made_folders.reset(made_token)


class ReaderMayGo:
    """A command's stdout: once its reader has gone (`| true`, `| head` done reading), what it prints
    goes nowhere and the command goes on, rather than stopping at its first flushed line (a
    BrokenPipeError) before its files are written, silently, exit 0."""

    def __init__(self, stream: Any) -> None:
        self._stream = stream

    def write(self, text: str) -> int:
        try:
            return self._stream.write(text)
        except BrokenPipeError:
            self._to_nowhere()
            return len(text)

    def flush(self) -> None:
        try:
            self._stream.flush()
        except BrokenPipeError:
            self._to_nowhere()

    def _to_nowhere(self) -> None:
        """The stream's file pointed at /dev/null (what it still buffers is flushed there, also at exit,
        where Python would say `Exception ignored ... BrokenPipeError`), or the stream replaced."""
        try:
            nowhere = os.open(os.devnull, os.O_WRONLY)
            os.dup2(nowhere, self._stream.fileno())
            os.close(nowhere)
        except (OSError, ValueError, AttributeError):  # (no file behind it: a test's capture)
            self._stream = open(os.devnull, "w")

    def __getattr__(self, name: str) -> Any:
        return getattr(self._stream, name)


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    failed = load_for_command_line(argv)  # policies from outside first: --policy's choices must include them
    return failed if failed is not None else guarded(build_parser(), argv)


if __name__ == "__main__":
    sys.exit(main())
