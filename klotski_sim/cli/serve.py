"""`klotski-sim serve`: one serving workload under several serving policies, side by side."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from klotski_sim.cli.common import CliError, add_option_argument, output_folder, parse_overrides, per_policy_options
from klotski_sim.files.outfiles import OutputFiles, refuse_unwritable, write_file
from klotski_sim.hardware.profile import load_profile, with_overrides
from klotski_sim.parallel.tensor import group_machine, group_model
from klotski_sim.policies import POLICIES
from klotski_sim.serving.batcher import BatchingConfig, ServingRefusal, check_batching
from klotski_sim.serving.policies import SERVING_POLICIES
from klotski_sim.serving.policies.base import resolve_serving_options
from klotski_sim.serving.requests import (
    Workload,
    builtin_distributions,
    drawn_requests,
    fixed_requests,
    read_requests,
    with_poisson_arrivals,
)
from klotski_sim.serving.run import GPU_MEMORY_UTILIZATION, ServeResult, ServeSpec, serve
from klotski_sim.util.argtypes import bounded_int, name_list, nonnegative_int, positive_float, positive_int, seed_int
from klotski_sim.workload.model import get_model

SERVE_FILES = ("serving.json", "serving.png")


def _utilisation(text: str) -> float:
    value = positive_float(text)
    if value > 1:
        raise argparse.ArgumentTypeError(f"a share of the GPU's memory, above 0 and at most 1, got {text}")
    return value


def add_serve_parser(sub: Any) -> None:
    p = sub.add_parser(
        "serve",
        help="serve a request workload with continuous batching under several serving policies (vllm, ...)",
        description="Continuous batching over a paged KV cache; each policy places the weights its own way "
        "(docs/serving.md). Prints throughput, TTFT, TPOT, latency and the active batch per policy.",
    )
    p.add_argument("--model", default="mixtral-8x7b", help="model preset or config.json (default: %(default)s)")
    p.add_argument("--hardware", default="l40s", help="hardware profile name or YAML (default: %(default)s)")
    p.add_argument(
        "--set", dest="sets", action="append", default=[], metavar="FIELD=VALUE", help="override a profile field"
    )
    p.add_argument(
        "--gpus",
        type=bounded_int(1, 1024),
        default=1,
        metavar="G",
        help="serve on a tensor-parallel group of G of the profile's GPUs (its `fabric:`; default: %(default)s)",
    )
    p.add_argument(
        "--policies",
        type=name_list,
        default=["vllm", "vllm-o", "ktransformers"],
        metavar="A,B,...",
        help=f"serving policies: {', '.join(SERVING_POLICIES)} (default: vllm,vllm-o,ktransformers)",
    )
    p.add_argument("--requests", type=positive_int, default=32, help="B_cfg: requests submitted (default: %(default)s)")
    p.add_argument("--prompt-len", type=positive_int, default=52, help="prompt tokens (default: %(default)s)")
    p.add_argument("--output-len", type=positive_int, default=None, help="output tokens (default: 1024)")
    p.add_argument(
        "--lengths",
        choices=list(builtin_distributions()),
        default=None,
        help="draw prompt (and, without --output-len, output) lengths from a shipped distribution",
    )
    p.add_argument("--requests-file", default=None, metavar="FILE", help="requests from a CSV or JSON-lines file")
    p.add_argument("--rate", type=positive_float, default=None, help="online: Poisson arrivals per second")
    p.add_argument("--warmup", type=nonnegative_int, default=0, help="online: first requests left out of the metrics")
    p.add_argument("--seed", type=seed_int, default=0, help="lengths, arrivals and expert popularity (default: 0)")
    p.add_argument("--max-num-seqs", type=positive_int, default=256, help="running requests at most (default: 256)")
    p.add_argument(
        "--max-num-batched-tokens", type=positive_int, default=8192, help="tokens per iteration at most (default: 8192)"
    )
    p.add_argument("--block-size", type=positive_int, default=16, help="tokens per KV block (default: 16)")
    p.add_argument("--no-chunked-prefill", action="store_true", help="a prompt is computed in one iteration")
    p.add_argument(
        "--gpu-memory-utilization",
        type=_utilisation,
        default=GPU_MEMORY_UTILIZATION,
        help="share of the GPU's memory the engine may use (default: %(default)s)",
    )
    add_option_argument(p, "POLICY.KEY=VALUE", "a serving policy's option, e.g. vllm-o.offload_layers=8 (repeatable)")
    p.add_argument(
        "--out",
        default=None,
        metavar="DIR",
        help="write serving.json (every policy's metrics and iterations) and serving.png (B_act, KV use, latency CDF)",
    )
    p.add_argument(
        "--timeline",
        action="store_true",
        help="also write each policy's timeline into DIR/POLICY/: trace.json.gz (Perfetto), gantt.png of "
        "the iterations --gantt-iterations picks, and schedule.json (what `klotski-runtime execute` runs; holds "
        "every op in memory)",
    )
    p.add_argument(
        "--gantt-iterations",
        default="1:4",
        metavar="FIRST:END",
        help="the iterations gantt.png shows, FIRST included, END not (default: %(default)s)",
    )
    p.add_argument(
        "--search",
        action="store_true",
        help="search expert paging's residency for this workload (one policy: fluxmoe or fluxmoe-h): pageable "
        "layers x compressed share; prints the Pareto front of throughput and TPOT and the best",
    )
    p.add_argument(
        "--max-tpot", type=positive_float, default=None, metavar="MS", help="--search: the TPOT cap the best must meet"
    )
    p.set_defaults(func=cmd_serve)


def workload_from_args(args: argparse.Namespace) -> Workload:
    if args.requests_file is not None:
        if args.lengths is not None:
            raise CliError("--requests-file and --lengths both give lengths: choose one")
        workload = read_requests(args.requests_file)
    elif args.lengths is not None:
        workload = drawn_requests(args.requests, args.lengths, args.seed, args.output_len)
    else:
        workload = fixed_requests(args.requests, args.prompt_len, args.output_len or 1024)
    if args.rate is not None:
        workload = with_poisson_arrivals(workload, args.rate, args.seed, args.warmup)
    elif args.warmup:
        raise CliError("--warmup needs --rate (an offline workload measures every request)")
    return workload


def _row(name: str, r: ServeResult) -> str:
    m = r.metrics
    return (
        f"{name:14} {m.throughput_tok_s:9.1f} {m.ttft_s.mean:8.3f} {m.ttft_s.p99:8.3f} {m.tpot_s.mean * 1e3:8.1f} "
        f"{m.tpot_s.p99 * 1e3:8.1f} {m.latency_s.mean:8.2f} {m.mean_active:6.1f} {m.preemptions:6d} "
        f"{r.memory.num_blocks:8,d} {len(r.residency.offloaded_layers) or len(r.residency.cpu_expert_layers):4d}"
    )


def _iterations(text: str) -> tuple[int, int]:
    first, sep, end = text.partition(":")
    try:
        window = (int(first), int(end))
    except ValueError:
        window = (-1, -1)
    if not sep or not 0 <= window[0] < window[1]:
        raise CliError(f"--gantt-iterations {text}: expected FIRST:END, whole numbers with 0 <= FIRST < END")
    return window


def _write_timeline(folder: Path, name: str, result: ServeResult, window: tuple[int, int]) -> None:
    """A policy's Perfetto trace, the Gantt of a window of its iterations, and its Schedule (with what
    each iteration computed: `klotski-runtime execute DIR/POLICY` runs it)."""
    from klotski_sim.report.exports import to_chrome_trace
    from klotski_sim.report.plot import gantt

    timeline = result.timeline
    assert timeline is not None
    folder.mkdir(exist_ok=True)
    its = result.iterations
    first, last = min(window[0], len(its) - 1), max(0, min(window[1], len(its)) - 1)
    last = max(first, last)
    files = OutputFiles(folder)  # (both or neither: temporaries renamed at the commit)
    to_chrome_trace(timeline, files.path("trace.json.gz"))
    assert result.schedule is not None  # (kept with the timeline)
    result.schedule.save(files.path("schedule.json"))
    title = f"{name} · {result.meta['model']} · iterations {first}-{last} of {len(its)}"
    gantt(timeline, files.path("gantt.png"), window=(its[first].start_s, its[last].end_s), title=title)
    files.commit()


def _search(args: argparse.Namespace, model: Any, profile: Any, workload: Workload, batching: Any, options: Any) -> int:
    from klotski_sim.runs.serving_search import best, grid, pareto, search

    if len(args.policies) != 1:
        raise CliError(f"--search: give one policy (fluxmoe or fluxmoe-h), got --policies {','.join(args.policies)}")
    name = args.policies[0]
    spec = ServeSpec(model, profile, name, workload, batching, args.gpu_memory_utilization, options[name], args.seed)
    points_total = len(grid(spec))
    print(f"{model.name} on {profile.name}: {workload.describe()}")
    print(f"searching {name}'s residency: {points_total} points (pageable layers x compressed share)")
    points = search(spec)
    print(f"{'pageable':>8} {'share':>6} {'tok/s':>9} {'TPOT ms':>8} {'TTFT s':>7} {'B_act':>6}")
    for p in points:
        if p.refused:
            print(f"{p.pageable_layers:8d} {p.compressed_share:6.3f}  refused: {p.refused}")
        else:
            print(
                f"{p.pageable_layers:8d} {p.compressed_share:6.3f} {p.throughput_tok_s:9.1f} {p.tpot_s * 1e3:8.1f} "
                f"{p.ttft_s:7.3f} {p.mean_active:6.1f}"
            )
    front = pareto(points)
    print("Pareto front (throughput against TPOT): " + "; ".join(
        f"{p.pageable_layers} layers, share {p.compressed_share:.3f}: {p.throughput_tok_s:.1f} tok/s, "
        f"{p.tpot_s * 1e3:.1f} ms" for p in front
    ))  # fmt: skip
    cap = args.max_tpot / 1e3 if args.max_tpot is not None else None
    winner = best(points, cap)
    if winner is None:
        print(f"no residency meets --max-tpot {args.max_tpot} ms")
        return 3
    print(
        f"best{f' within TPOT {args.max_tpot} ms' if cap else ''}: {winner.pageable_layers} pageable layers, "
        f"compressed share {winner.compressed_share:.3f}: {winner.throughput_tok_s:.1f} tok/s, TPOT "
        f"{winner.tpot_s * 1e3:.1f} ms; reproduce: --policies {name} --option {name}.pageable_layers="
        f"{winner.pageable_layers} --option {name}.compressed_share={winner.compressed_share}"
    )
    return 0


def cmd_serve(args: argparse.Namespace) -> int:
    offline = [p for p in args.policies if p not in SERVING_POLICIES and p in POLICIES]
    if offline:  # (their schedules are fixed batches of equal requests, built before the run)
        raise CliError(
            f"--policies: {', '.join(offline)} schedule{'s' if len(offline) == 1 else ''} a fixed number of equal "
            f"batches decided before the run, not requests admitted as they come: use klotski-sim simulate or "
            f"compare; serving policies: {', '.join(SERVING_POLICIES)}"
        )
    unknown = [p for p in args.policies if p not in SERVING_POLICIES]
    if unknown:
        raise CliError(f"--policies: unknown {', '.join(unknown)}; serving policies: {', '.join(SERVING_POLICIES)}")
    model = get_model(args.model)
    profile = load_profile(args.hardware)
    if args.sets:
        profile = with_overrides(profile, parse_overrides(args.sets, "--set"), where="--set")
    if args.gpus > 1:
        profile = group_machine(profile, args.gpus, model)
        model = group_model(model, args.gpus)
    options = per_policy_options(args.options, args.policies)
    for name in args.policies:  # (a typo in an option is an error before anything runs, not a refused row)
        resolve_serving_options(name, options[name])
    workload = workload_from_args(args)
    batching = BatchingConfig(
        args.max_num_seqs, args.max_num_batched_tokens, args.block_size, chunked_prefill=not args.no_chunked_prefill
    )
    check_batching(workload, batching)
    if args.timeline and args.out is None:
        raise CliError("--timeline writes into --out DIR: give one")
    window = _iterations(args.gantt_iterations)
    if args.search:
        return _search(args, model, profile, workload, batching, options)
    if args.max_tpot is not None:
        raise CliError("--max-tpot caps --search's best: give --search")
    out = output_folder(args.out) if args.out is not None else None
    if out is not None:
        refuse_unwritable(out, SERVE_FILES)
    print(f"{model.name} on {profile.name}: {workload.describe()}")
    print(
        f"batching: max_num_seqs {batching.max_num_seqs}, max_num_batched_tokens {batching.max_num_batched_tokens}, "
        f"blocks of {batching.block_size} tokens, chunked prefill {'on' if batching.chunked_prefill else 'off'}, "
        f"GPU memory utilisation {args.gpu_memory_utilization}"
    )
    print(
        f"{'policy':14} {'tok/s':>9} {'TTFT s':>8} {'TTFT p99':>8} {'TPOT ms':>8} {'TPOT p99':>8} {'E2E s':>8} "
        f"{'B_act':>6} {'preem':>6} {'KV blks':>8} {'off':>4}"
    )
    report: dict[str, Any] = {"model": model.name, "hardware": profile.name, "workload": workload.describe()}
    results: dict[str, Any] = {}
    served: dict[str, ServeResult] = {}
    for name in args.policies:
        spec = ServeSpec(
            model, profile, name, workload, batching, args.gpu_memory_utilization, options[name], args.seed
        )
        try:
            result = serve(spec, keep=args.timeline)
        except ServingRefusal as err:  # a policy that cannot serve this is a row; the others still run
            print(f"{name:14} refused: {err}")
            results[name] = {"refused": str(err)}
            continue
        print(_row(name, result))
        served[name] = result
        if args.timeline and out is not None:
            _write_timeline(Path(out) / name, name, result, window)
        results[name] = {
            "metrics": result.metrics.to_dict(),
            "memory": result.memory.describe(),
            "offloaded_layers": list(result.residency.offloaded_layers),
            "cpu_expert_layers": list(result.residency.cpu_expert_layers),
            "options": dict(result.meta["options"]),
            "decisions": list(result.meta["decisions"]),
            "iterations": [
                [it.start_s, it.end_s, it.active, it.tokens, it.blocks_used, it.waiting, it.preempted]
                for it in result.iterations
            ],
        }
    print(
        "tok/s: output tokens per second; TTFT: arrival to first token; TPOT: between later tokens; E2E: arrival "
        "to last token (means; p99 columns: 99th percentile); B_act: requests per iteration, mean; preem: "
        "preemptions (recompute); off: layers offloaded (vllm-o) or with CPU experts (ktransformers)"
    )
    if out is not None:
        report["policies"] = results
        path = Path(out) / "serving.json"
        write_file(path, lambda tmp: tmp.write_text(json.dumps(report, indent=1) + "\n"), "--out")
        written = [path]
        if served:
            from klotski_sim.report.serving_plot import serving_figure  # (matplotlib: only when drawing)

            figure = Path(out) / "serving.png"
            write_file(figure, lambda tmp: serving_figure(served, tmp), "--out")
            written.append(figure)
        print(f"wrote {', '.join(map(str, written))}")
    return 0
