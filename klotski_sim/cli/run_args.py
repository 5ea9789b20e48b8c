"""Run configurations from the command line: the flags every simulating command shares, and
the RunSpec they give."""

from __future__ import annotations

import argparse
from typing import Any, Sequence

from klotski_sim.cli.common import (
    CliError,
    parse_overrides,
    routing_kind,
)
from klotski_sim.hardware.profile import builtin_profile_names, load_profile, with_overrides
from klotski_sim.policies import POLICIES
from klotski_sim.policies.impl import PRESET_NAMES
from klotski_sim.policies.plugins import policy_name
from klotski_sim.runs.runner import (
    RunSpec,
)
from klotski_sim.util.argtypes import (
    batches,
    bounded_int,
    layers_or_fill,
    nonnegative_int,
    path_arg,
    positive_int,
    seed_int,
)
from klotski_sim.workload.model import PRESETS
from klotski_sim.workload.trace_synth import DEFAULT_ROUTING

IMPL_HELP = (
    "implementation preset: as-published (what each system's public code does, docs/implementations.md), "
    "ideal (the best implementation of the same schedule), v0.1 (what klotski 0.1 simulated)"
)


def add_run_arguments(
    p: argparse.ArgumentParser,
    policy: bool = True,
    num_batches: bool = True,
    impl_choices: Sequence[str] = PRESET_NAMES,
    gpus: bool = True,
) -> None:
    """The options that describe one configuration (shared by simulate, compare, plan...)."""
    p.add_argument(
        "--model",
        default="mixtral-8x7b",
        metavar="NAME[:L][@intN]",
        help=f"model preset ({', '.join(sorted(PRESETS))}) or a Hugging Face config.json of a MoE model "
        f"(mixtral, qwen2_moe, qwen3_moe, olmoe, deepseek_v2/v3, llama4); NAME:L keeps its first L layers, "
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
            "--policy",
            default="single-batch",
            type=policy_name,
            metavar="NAME",
            help=f"schedule: {', '.join(POLICIES)}, or your own (--policy-file) (default: %(default)s)",
        )
    p.add_argument(
        "--policy-file",
        action="append",
        default=[],
        metavar="FILE.py",
        help="a Python file that registers your own policy (docs/own-schedule.md); repeatable",
    )
    p.add_argument("--batch-size", type=positive_int, default=16, help="sequences per batch (default: %(default)s)")
    if gpus:
        p.add_argument(
            "--gpus",
            type=bounded_int(1, 1024),
            default=1,
            metavar="G",
            help="run on a tensor-parallel group of G of the profile's GPUs (its `fabric:` section: h200, h20, "
            "l40s): each holds and computes 1/G of every layer, with two all-reduces a layer "
            "(default: %(default)s; klotski-sim parallel compares expert parallelism)",
        )
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
        help=f"synthetic routing when no --trace is given: calibrated, uniform, zipf:<a>, skewed, or "
        f"calibrated:KEY=VALUE,... with domain=NAME|code|math|mixed, decode_drift=0..1, reuse=BIAS, coupling=C, type_coupling=T "
        f"(docs/routing.md; default: {DEFAULT_ROUTING})",
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
        gpus=getattr(args, "gpus", 1),
    )
    if fields["overrides"]:  # (checked here to be named by their flag, not as "overrides:")
        with_overrides(load_profile(args.hardware), fields["overrides"], where="--set")
    fields.update(changes)
    return RunSpec(**fields)
