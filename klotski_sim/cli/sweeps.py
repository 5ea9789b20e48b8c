"""`klotski-sim sweep` and `optimize`: grids of configurations on a pool or a Dask cluster."""

from __future__ import annotations

import argparse
import sys
from collections import Counter
from pathlib import Path

from klotski_sim.cli.common import (
    CliError,
    local_workers,
    not_an_input,
    output_folder,
)
from klotski_sim.util.argtypes import (
    MAX_COUNT,
    MAX_COUNT_TEXT,
    plain_int,
)
from klotski_sim.util.terminal import one_line
from klotski_sim.util.units import counted

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
    local_workers(args)
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
    # (oom, refused and too-large are what a configuration does on a machine: answers; an `error` row is
    # a run that failed (a policy file's bug, the simulator's): the exit status says so, as optimize's does)
    errors = int((df["status"] == "error").sum()) if len(df) else 0
    if errors:
        print(
            f"error: {errors} of {counted(len(df), 'configuration')} failed (status error); the first: "
            f"{one_line(str(df.loc[df['status'] == 'error', 'error'].iloc[0]))[:300]}",
            file=sys.stderr,
        )
        return 1
    return 0


def cmd_optimize(args: argparse.Namespace) -> int:
    from klotski_sim.runs.optimize import Search, check_search, ok_rows, pareto_front, simulate_command, winner
    from klotski_sim.runs.sweep import run_sweep

    local_workers(args)

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
