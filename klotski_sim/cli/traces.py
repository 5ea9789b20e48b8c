"""`klotski-sim trace synth|stats|import`: routing traces."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from klotski_sim.cli.common import CliError, note, output_file
from klotski_sim.files.outfiles import write_file
from klotski_sim.runs.runner import (
    LONG_DRAW_S,
    draw_seconds,
)
from klotski_sim.util.argtypes import first_repeat
from klotski_sim.util.units import span_text
from klotski_sim.workload.model import get_model
from klotski_sim.workload.trace import Trace, TraceError, import_jsonl
from klotski_sim.workload.trace_stats import format_stats, layer_stats, token_subset
from klotski_sim.workload.trace_synth import check_routing_fits, synthesize


def cmd_trace_synth(args: argparse.Namespace) -> int:
    output_file(args.out)
    model = get_model(args.model)
    check_routing_fits(model, args.sequences, args.prompt_len + args.gen_len, f"{args.sequences} sequences")
    seconds = draw_seconds(model, args.sequences, args.prompt_len + args.gen_len)
    if seconds >= LONG_DRAW_S:  # (100M sequences of a tiny model draw for 17 minutes)
        note(
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
    twice = first_repeat(args.key or [])
    if twice is not None:  # (said, not silently one field)
        raise CliError(f"--key {twice}: given twice")
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
        dense_layers=tuple(j for j in range(model.num_layers) if not model.is_moe(j)) if model else (),
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
