"""`klotski-sim parallel`: a model's decode steps on G GPUs, by parallelism, placement, replication
and grouping (klotski_sim/parallel/decode.py), one row each."""

from __future__ import annotations

import argparse
import itertools
import json
import re
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from klotski_sim.cli.common import CliError, output_folder
from klotski_sim.cli.run_args import spec_from_args
from klotski_sim.core.cost import COMPRESSED_SHARE
from klotski_sim.core.schedule import Schedule
from klotski_sim.core.timeline import jsonable
from klotski_sim.files.outfiles import OutputFiles
from klotski_sim.parallel.decode import (
    PARALLELISMS,
    EpPlan,
    ParallelResult,
    ParallelSetup,
    machine_fabric,
    plan_expert_parallel,
    simulate_decode,
)
from klotski_sim.parallel.events import OFFLOADED_EXPERTS, EpEvents, EventRun, ep_schedule, simulate_ep_events
from klotski_sim.parallel.placement import PLACEMENTS
from klotski_sim.report.exports import to_chrome_trace, to_csv
from klotski_sim.runs.runner import RunSpec, make_replay, resolve_profile
from klotski_sim.util.argtypes import name_list
from klotski_sim.util.errors import UsageError
from klotski_sim.workload.model import ModelSpec, get_model
from klotski_sim.workload.routing import RoutingTable


def replica_counts(text: str) -> list[int]:
    """`--replicas 0,1,2`: spare slots per rank, each a whole number from 0 to 64."""
    counts = []
    for name in name_list(text):
        if not name.isdigit() or int(name) > 64:
            raise argparse.ArgumentTypeError(f"expected whole numbers 0..64, got {name!r}")
        counts.append(int(name))
    return counts


def _choices(text: str, allowed: tuple[str, ...], flag: str) -> list[str]:
    chosen = list(allowed) if text == "all" else [c.strip() for c in text.split(",")]
    for c in chosen:
        if c not in allowed:
            raise CliError(f"{flag} {text}: {c!r} is not one of {', '.join(allowed)} (or all)")
    return chosen


def setups(args: argparse.Namespace) -> list[ParallelSetup]:
    """Every configuration the flags ask for: TP once, EP for each placement, replica count and grouping."""
    parallelisms = _choices(args.parallelism, PARALLELISMS, "--parallelism")
    placements = _choices(args.placement, PLACEMENTS, "--placement")
    rows = []
    if "tp" in parallelisms:
        rows.append(ParallelSetup(args.gpus, "tp"))
    if "ep" in parallelisms:
        groupings = (False, True) if args.group else (False,)
        for placement, spare, grouped in itertools.product(placements, sorted(set(args.replicas)), groupings):
            rows.append(ParallelSetup(args.gpus, "ep", placement, spare, grouped))
    return rows


def format_results(
    rows: list[tuple[ParallelSetup, ParallelResult | str]], events: dict[ParallelSetup, EventRun] | None = None
) -> str:
    """One line per configuration; with `events` (the event engine's runs, by setup) two more
    columns: the GPU bubbles a step of the rank that waits most, and the prefetched copies used."""
    done = [r for _, r in rows if isinstance(r, ParallelResult)]
    best = max((r.tokens_per_s for r in done), default=0.0)
    lines = [
        f"{'configuration':38} {'step ms':>8} {'tok/s':>9} {'vs best':>7} {'load max/mean':>13} "
        f"{'all-to-all MB':>13} {'collect. ms':>11} {'util min-max':>12} {'GB/rank':>7} {'replicas GB':>11} "
        f"{'host GB/rank':>12} {'H2D GB/step':>11}" + (f" {'bubbles ms':>10} {'prefetch used':>13}" if events else "")
    ]
    for setup, result in rows:
        if isinstance(result, str):
            lines.append(f"{setup.label:38} refused: {result}")
            continue
        util = f"{min(result.utilisation):.0%}-{max(result.utilisation):.0%}"
        line = (
            f"{setup.label:38} {result.step_s * 1e3:8.2f} {result.tokens_per_s:9.1f} {result.tokens_per_s / best:7.2f} "
            f"{result.load_imbalance:13.3f} {result.all_to_all_bytes / 1e6:13.2f} {result.collective_s * 1e3:11.2f} "
            f"{util:>12} {result.rank_bytes / 1e9:7.1f} {result.replica_bytes / 1e9:11.2f} "
            f"{result.offloaded_bytes / 1e9:12.1f} {result.streamed_bytes / 1e9:11.2f}"
        )
        run = (events or {}).get(setup)
        if run is not None:
            used = f"{run.prefetch_used}/{run.prefetched}" if run.prefetched else "-"
            line += f" {max(run.bubble_s) * 1e3:10.2f} {used:>13}"
        elif events:
            line += f" {'-':>10} {'-':>13}"
        lines.append(line)
    return "\n".join(lines)


EP_RUN_FILE = "ep.json"  # what `klotski-runtime execute` rebuilds an EP configuration's plan from


def write_event_runs(
    out: Path, events: dict[ParallelSetup, EventRun], spec: RunSpec, how: EpEvents, routing: RoutingTable
) -> None:
    """Each EP configuration's timeline into `out/<configuration>/`: trace.json.gz (every rank's
    streams, for Perfetto), timeline.csv, ranks.json (each rank's one-GPU summary), and what the
    runtime executes it from: schedule.json, ep.json (the run, the setup, how ranks run) and the
    routing (`out/routing.npz`)."""
    with OutputFiles(out) as files:
        routing.save(files.path("routing.npz"))
        files.commit()
    for setup, run in events.items():
        folder = out / re.sub(r"[^a-z0-9]+", "-", setup.label.lower()).strip("-")
        folder.mkdir(parents=True, exist_ok=True)
        with OutputFiles(folder) as files:
            to_chrome_trace(run.timeline, files.path("trace.json.gz"))
            to_csv(run.timeline, files.path("timeline.csv"))
            ranks = [rank.to_dict() for rank in run.ranks]
            files.path("ranks.json").write_text(json.dumps(jsonable(ranks), indent=2))
            run.schedule.save(files.path("schedule.json"))
            inputs = {"run": spec.to_dict(), "setup": asdict(setup), "events": asdict(how)}
            files.path(EP_RUN_FILE).write_text(json.dumps(jsonable(inputs), indent=2))
            files.commit()


@dataclass(frozen=True)
class SavedEpRun:
    """An EP configuration `parallel --timing events --out DIR` wrote, rebuilt from its files: the
    plan and schedule again from the same inputs, so the runtime executes what was timed."""

    model: ModelSpec
    routing: RoutingTable
    plan: EpPlan
    schedule: Schedule
    micro_batch: Any  # np.ndarray [sequence]: its micro-batch on its rank
    how: EpEvents


# ep.json's setup and events fields: each one's type and what it may be (a user can edit the file)
SETUP_FIELDS: dict[str, tuple[type, Any]] = {
    "gpus": (int, range(2, 1025)),
    "parallelism": (str, ("ep",)),
    "placement": (str, PLACEMENTS),
    "spare_slots": (int, range(0, 1 << 16)),
    "grouping": (bool, (False, True)),
}
EVENTS_FIELDS: dict[str, tuple[type, Any]] = {
    "prefetch": (bool, (False, True)),
    "micro_batches": (int, range(1, 65)),
    "offloaded_experts": (str, OFFLOADED_EXPERTS),
}


def _typed(section: dict[str, Any], name: str, fields: dict[str, tuple[type, Any]]) -> None:
    """Each field of `section` present, of its type and among its values; nothing else."""
    unknown = sorted(set(section) - set(fields))
    if unknown:
        raise ValueError(f"{name}: unknown field(s) {', '.join(unknown)}")
    for key, (kind, allowed) in fields.items():
        value = section.get(key)
        if key not in section or type(value) is not kind or value not in allowed:
            shown = (
                f"{allowed.start}..{allowed.stop - 1}" if isinstance(allowed, range) else ", ".join(map(str, allowed))
            )
            said = {int: "an integer", bool: "true or false", str: "one of"}[kind]
            raise ValueError(f"{name}.{key} must be {said} ({shown}), got {json.dumps(value)}")


def load_ep_run(folder: Path) -> SavedEpRun:
    """The EP run in `folder` (DIR/<configuration>/), checked against the schedule it holds."""
    where = folder / EP_RUN_FILE
    if not where.is_file():
        raise CliError(
            f"{where}: missing or not a file: the folder is not an EP run that parallel --timing events --out wrote"
        )
    try:
        saved = json.loads(where.read_text())
        if not isinstance(saved, dict) or not all(isinstance(saved.get(k), dict) for k in ("run", "setup", "events")):
            raise ValueError("it must be an object of objects run, setup and events")
        _typed(saved["setup"], "setup", SETUP_FIELDS)
        _typed(saved["events"], "events", EVENTS_FIELDS)
        spec = RunSpec(**saved["run"])
        setup = ParallelSetup(**saved["setup"])
        how = EpEvents(**saved["events"])
        how.check()
    except RecursionError:
        raise CliError(
            f"{where}: not an EP run that parallel --timing events --out wrote (nested too deeply)"
        ) from None
    except (OSError, ValueError, KeyError, TypeError, UsageError) as bad:
        raise CliError(f"{where}: not an EP run that parallel --timing events --out wrote ({bad})") from None
    try:
        model = get_model(spec.model)
        profile = resolve_profile(spec)
    except UsageError as bad:  # (ep.json's run names them: say which file)
        raise CliError(f"{where}: run: {bad}") from None
    routing = RoutingTable.load(folder.parent / "routing.npz")
    shape = routing.shape
    mismatch = [
        f"{name} {mine} against the routing's {theirs}"
        for name, mine, theirs in (
            ("model layers", model.num_layers, routing.num_layers),
            ("top-k", model.top_k, routing.top_k),
            ("prompt_len", spec.prompt_len, shape.prompt_len),
            ("gen_len", spec.gen_len, shape.gen_len),
        )
        if mine != theirs
    ]
    if mismatch or routing.num_experts != model.num_experts:
        mismatch += (
            []
            if routing.num_experts == model.num_experts
            else [f"experts {model.num_experts} against {routing.num_experts}"]
        )
        raise CliError(f"{where}: run does not match {folder.parent / 'routing.npz'}: {'; '.join(mismatch)}")
    compressed = COMPRESSED_SHARE if how.offloaded_experts == "compressed" else None
    try:
        plan = plan_expert_parallel(model, profile, routing, setup, compressed)
    except UsageError as bad:
        raise CliError(f"{where}: {bad}") from None
    schedule, builder = ep_schedule(model, plan, routing, how)
    written = Schedule.load(folder / "schedule.json")
    differs = [
        part
        for part, same in (
            ("ops", written.ops == schedule.ops),
            ("meta", jsonable(dict(written.meta)) == jsonable(dict(schedule.meta))),
            ("preloaded", written.preloaded == schedule.preloaded),
            ("streams", dict(written.streams) == dict(schedule.streams)),
        )
        if not same
    ]
    if differs:
        raise CliError(
            f"{folder / 'schedule.json'}: not the schedule its plan gives now (its {', '.join(differs)} differ; "
            f"{len(written.ops)} ops written, {len(schedule.ops)} rebuilt): written by another version, or edited; "
            f"run parallel --out again"
        )
    return SavedEpRun(model, routing, plan, schedule, builder.part, how)


def cmd_parallel(args: argparse.Namespace) -> int:
    # (flags of an offloaded run's placement and implementation, which decode steps on resident weights
    # never read: refused rather than ignored)
    ignored = [
        flag
        for flag, given in (
            (f"--kv {args.kv}", args.kv != "auto"),
            (f"--experts {args.experts}", args.experts != "auto"),
            (f"--resident-layers {args.resident_layers}", args.resident_layers is not None),
            (f"--impl {args.impl}", args.impl != "as-published"),
            ("--policy-file", bool(args.policy_file)),
            ("--policy-timeout", getattr(args, "policy_timeout", None) is not None),
        )
        if given
    ]
    how = EpEvents(args.prefetch, args.micro_batches, args.offloaded_experts)
    if args.timing != "events":
        extra = [
            flag
            for flag, given in (
                ("--prefetch", args.prefetch),
                (f"--micro-batches {args.micro_batches}", args.micro_batches != 1),
                (f"--offloaded-experts {args.offloaded_experts}", args.offloaded_experts != "copy"),
                (f"--out {args.out}", args.out),
            )
            if given
        ]
        if extra:
            raise CliError(f"{', '.join(extra)}: only with --timing events (the event engine's runs)")
    try:
        how.check()
    except UsageError as bad:
        raise CliError(str(bad)) from None
    if ignored:
        raise CliError(
            f"{', '.join(ignored)}: parallel times decode steps with every weight resident on the GPUs, so "
            f"{'this does' if len(ignored) == 1 else 'these do'} not apply (simulate --gpus G runs an offloaded policy)"
        )
    # (its --gpus are ranks it times one by one, each on the profile's one GPU: not a tensor-parallel group)
    spec = spec_from_args(args, num_batches=args.num_batches or 1, gpus=1)
    model = get_model(spec.model)
    profile = resolve_profile(spec)
    if args.gpus < 2:
        raise CliError(f"--gpus {args.gpus}: parallel compares ways to use 2 or more GPUs (simulate runs one)")
    if spec.gen_len < 2:
        raise CliError(f"--gen-len {spec.gen_len}: parallel times decode steps; give at least 2")
    machine_fabric(profile, args.gpus)  # (a machine that cannot: said once, before any routing is drawn)
    out = output_folder(args.out) if args.out else None
    wanted = setups(args)
    _, rep = make_replay(spec, model, spec.num_batches or 1)
    rows: list[tuple[ParallelSetup, ParallelResult | str]] = []
    events: dict[ParallelSetup, EventRun] = {}
    for setup in wanted:
        try:
            if args.timing == "events" and setup.parallelism == "ep":
                run = events[setup] = simulate_ep_events(model, profile, rep.routing, setup, how)
                rows.append((setup, run.result))
            else:
                rows.append((setup, simulate_decode(model, profile, rep.routing, setup)))
        except UsageError as refused:  # this configuration's memory: a row, the others still run
            rows.append((setup, str(refused).split(": ", 1)[-1]))
    shape = rep.routing.shape
    print(
        f"{model.name} on {args.gpus}x {profile.gpu.name} ({profile.fabric.kind if profile.fabric else '?'}), "
        f"{shape.num_sequences} sequences, prompt {shape.prompt_len}, {shape.gen_len - 1} decode steps timed; "
        f"routing: {rep.routing.source or spec.routing}"
    )
    print(format_results(rows, events if args.timing == "events" else None))
    print(
        "placement and grouping from the prompts' routing, replicas for a step from the step before; EP ranks "
        "keep the experts that do not fit in host memory (host GB/rank) and copy the used ones each step "
        "(H2D GB/step) (klotski_sim/parallel/decode.py)"
        + (
            "; EP timed in the event engine, each rank's GPU, link and fabric port its own (parallel/events.py)"
            + (", each rank prefetching the experts it computed a step before" if args.prefetch else "")
            + (f", {args.micro_batches} micro-batches in flight a rank" if args.micro_batches > 1 else "")
            + (
                ", experts a rank does not hold computed on the shared host CPU"
                if args.offloaded_experts == "cpu"
                else ""
            )
            + (
                ", experts a rank lacks room for kept compressed on its GPU where they fit"
                if args.offloaded_experts == "compressed"
                else ""
            )
            if args.timing == "events"
            else ""
        )
    )
    if out is not None and events:
        write_event_runs(out, events, spec, how, rep.routing)
        print(f"timelines of {len(events)} EP configuration(s) in {out}/")
    return 0 if any(isinstance(r, ParallelResult) for _, r in rows) else 3
