"""The `klotski-sim` command line: every subcommand, its flags and its help."""

from __future__ import annotations

import argparse

from klotski_sim.cli.advise import add_advise_parser
from klotski_sim.cli.common import add_option_argument
from klotski_sim.cli.compare import COMPARE_POLICIES, cmd_compare
from klotski_sim.cli.listing import cmd_models, cmd_policies, cmd_profiles
from klotski_sim.cli.parallel import cmd_parallel, replica_counts
from klotski_sim.cli.run_args import add_run_arguments
from klotski_sim.cli.serve import add_serve_parser
from klotski_sim.cli.simulate import cmd_plan, cmd_simulate
from klotski_sim.cli.sweeps import SWEEP_CONFIRM, cmd_optimize, cmd_sweep
from klotski_sim.cli.traces import cmd_trace_import, cmd_trace_stats, cmd_trace_synth
from klotski_sim.policies import POLICIES
from klotski_sim.policies.impl import PRESET_NAMES
from klotski_sim.policies.plugins import policy_name
from klotski_sim.serving.policies import SERVING_POLICIES
from klotski_sim.util.argtypes import (
    OneLineParser,
    bounded_int,
    name_list,
    nonnegative_int,
    path_arg,
    positive_float,
    positive_int,
    seed_int,
    workers_int,
)
from klotski_sim.workload.model import PRESETS
from klotski_sim.workload.trace import MAX_IMPORT_INDEX
from klotski_sim.workload.trace_synth import DEFAULT_ROUTING


def build_parser() -> argparse.ArgumentParser:
    parser = OneLineParser(prog="klotski-sim", description=__doc__.splitlines()[0])
    parser.add_argument("--debug", action="store_true", help="show the full traceback of an error")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("simulate", help="simulate one schedule and print its summary")
    add_run_arguments(p)
    add_option_argument(
        p,
        "KEY=VALUE",
        "a policy option, e.g. --option overlap=model for flexgen (repeatable); "
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
        help="calibrated, uniform, zipf:<a>, skewed, or calibrated:KEY=VALUE,... with domain=NAME|code|math|mixed, "
        "decode_drift=0..1, reuse=BIAS, coupling=C, type_coupling=T (docs/routing.md; default: %(default)s)",
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
    add_option_argument(
        p,
        "POLICY.KEY=VALUE",
        "a compared policy's option, e.g. klotski.predictor=layer+token (repeatable; over both presets "
        "with --impl both); klotski-sim policies NAME lists a policy's options",
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
        type=policy_name,
        metavar="NAME",
        help="whose n: klotski (the inequalities), a policy that chooses n by simulated probes "
        "(klotski-hybrid: the probes are shown), or another policy (the n it runs) "
        "(default: %(default)s)",
    )
    p.set_defaults(func=cmd_plan)

    p = sub.add_parser(
        "parallel",
        help="decode on G GPUs: tensor vs expert parallelism, expert placement, replication, grouping",
    )
    add_run_arguments(p, policy=False, gpus=False)
    p.add_argument("--gpus", type=bounded_int(1, 1024), required=True, help="GPUs of the profile's machine to use")
    p.add_argument(
        "--parallelism", default="all", help="ep, tp, or both as a comma-separated list or all (default: %(default)s)"
    )
    p.add_argument(
        "--placement",
        default="all",
        help="EP expert placements: round-robin, popularity, coactivation, a list, or all (default: %(default)s)",
    )
    p.add_argument(
        "--replicas",
        type=replica_counts,
        default=[0],
        metavar="N[,N...]",
        help="EP: spare expert slots per rank and layer for replicas of the experts predicted overloaded (default: 0)",
    )
    p.add_argument("--group", action="store_true", help="EP: also group sequences onto the ranks of their experts")
    p.add_argument(
        "--timing",
        choices=("analytic", "events"),
        default="analytic",
        help="EP: each layer as its slowest rank's phases in a row (analytic), or the event engine with each "
        "rank's GPU, PCIe link and fabric port its own resources (events; per-rank bubbles) (default: %(default)s)",
    )
    p.add_argument(
        "--prefetch",
        action="store_true",
        help="EP with --timing events: each offloading rank copies in, layers ahead (as soon as a staging slot "
        "is free), the experts it computed at a layer a step before and does not hold",
    )
    p.add_argument(
        "--micro-batches",
        type=bounded_int(1, 64),
        default=1,
        metavar="N",
        help="EP with --timing events: each rank's sequences in N micro-batches in flight (one's all-to-all under "
        "another's compute; one expert copy for all) (default: %(default)s)",
    )
    p.add_argument(
        "--offloaded-experts",
        choices=("copy", "compressed", "cpu"),
        default="copy",
        help="EP with --timing events: a used expert a rank does not hold is copied to its GPU, decompressed from a "
        "compressed tier on its GPU (FluxMoE's; copied where that does not fit), or computed on the host CPU the "
        "ranks share (default: %(default)s)",
    )
    p.add_argument(
        "--out",
        metavar="DIR",
        help="with --timing events: each EP configuration's timeline (every rank's streams) in DIR/<configuration>/",
    )
    p.set_defaults(func=cmd_parallel)

    add_advise_parser(sub)
    p = sub.add_parser("models", help="list model presets with their sizes")
    p.set_defaults(func=cmd_models)
    add_serve_parser(sub)
    p = sub.add_parser("policies", help="list the policies, or one policy's options (what --option takes)")
    p.add_argument(
        "name",
        nargs="?",
        metavar="NAME",
        help=f"a policy ({', '.join([*POLICIES, *SERVING_POLICIES])}, or your own: --policy-file): list its options",
    )
    p.add_argument("--policy-file", action="append", default=[], metavar="FILE.py", help="your own policy (repeatable)")
    p.set_defaults(func=cmd_policies)
    p = sub.add_parser("profiles", help="list built-in hardware profiles with their key numbers")
    p.set_defaults(func=cmd_profiles)
    return parser
