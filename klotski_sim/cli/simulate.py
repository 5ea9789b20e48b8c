"""`klotski-sim simulate` and `plan`: one configuration."""

from __future__ import annotations

import argparse
from typing import Sequence

from klotski_sim.cli.common import (
    note,
    output_folder,
    parse_overrides,
)
from klotski_sim.cli.run_args import spec_from_args
from klotski_sim.cli.summary_text import format_summary, warn_of_routing
from klotski_sim.files.outfiles import OutputFiles, refuse_unwritable
from klotski_sim.planning.planner import format_plan
from klotski_sim.report.exports import TIMELINE_FILES, write_timeline_files
from klotski_sim.runs.runner import (
    plan_run,
    prepare,
    run,
)
from klotski_sim.util import run_size


def cmd_simulate(args: argparse.Namespace) -> int:
    # a long synthetic draw (a fine-grained model's long prompts: a minute) and a long run (millions of
    # ops, projected from its first steps: klotski_sim.util.run_size) are said on stderr before they
    # begin, not taken for hangs
    with run_size.surroundings(files_written=args.out is not None, listeners=(note,)):
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
    warn_of_routing(result.timeline.meta.get("routing", ""))
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
        print(f"wrote {', '.join(written)} to {out}/{removed_text(files.removed)}")
    return 0 if result.timeline.status == "ok" else 3


# what `simulate --out` writes: an earlier run's file of these names that this run does not write
# (its figure, when --no-png; its routing, when refused) is removed, so that the folder holds one run
SIMULATE_FILES = (*TIMELINE_FILES, "schedule.json", "routing.npz")


def removed_text(removed: Sequence[str]) -> str:
    return f" (removed an earlier run's {', '.join(removed)})" if removed else ""


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
