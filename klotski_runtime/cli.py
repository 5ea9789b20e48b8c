"""`klotski-runtime`: the real side — record traces, execute schedules, calibrate, validate.

Bad input ends with a one-line `error:` message and exit status 2, never a traceback.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any, Sequence

from klotski_sim.cli.common import CliError, not_an_input, output_file, output_folder, parse_overrides, routing_kind
from klotski_sim.cli.main import guarded
from klotski_sim.cli.parallel import EP_RUN_FILE
from klotski_sim.files.outfiles import refuse_unwritable, write_file
from klotski_sim.hardware.profile import RATE_FLOOR
from klotski_sim.names import resource_rank
from klotski_sim.report.exports import TIMELINE_FILES
from klotski_sim.util.argtypes import (
    MAX_COUNT,
    MAX_COUNT_TEXT,
    OneLineParser,
    bounded_int,
    first_repeat,
    nonnegative_int,
    path_arg,
    plain_int,
    positive_float,
    positive_int,
    seed_int,
)
from klotski_sim.util.machine import available_cores
from klotski_sim.util.progress import say
from klotski_sim.util.units import flop_rate_text
from klotski_sim.workload.trace_synth import DEFAULT_ROUTING

# (torch, 0.8 s, is imported by the commands that use it: `--help` and a refused flag answer without it,
# and a stop during its import is a stop of the command, said in one line)


def cmd_record(args: argparse.Namespace) -> int:
    from .record import read_texts, record

    output_file(args.out, reads=[args.text, args.model_dir])
    texts = read_texts(args.text)
    trace = record(
        args.model_dir,
        texts,
        max_tokens=args.max_tokens,
        gen_len=args.gen_len,
        device=args.device,
        dataset=args.dataset or Path(args.text).name,
        model_name=args.model_name,
    )
    trace.save(args.out)
    print(
        f"wrote {args.out}: {trace.num_sequences} sequences, {len(trace.experts)} tokens, "
        f"{trace.num_layers} layers, top-{trace.top_k} of {trace.num_experts} experts ({trace.meta['recorder']})"
    )
    return 0


TINY_CHECKPOINTS = {
    "tiny-mixtral": ("save_tiny_mixtral", "Mixtral"),  # (record.py's functions)
    "tiny-qwen3-moe": ("save_tiny_qwen3_moe", "Qwen3-MoE"),
    "tiny-olmoe": ("save_tiny_olmoe", "OLMoE"),
}


def cmd_tiny_checkpoint(args: argparse.Namespace) -> int:
    if Path(args.out).exists() and not Path(args.out).is_dir():  # (transformers only warns, and writes nothing)
        raise CliError(f"--out {args.out}: is a file; a checkpoint is a folder")
    output_folder(args.out)  # before the model is built: a bad name would fail after it, in raw errno text
    from . import record

    save, family = TINY_CHECKPOINTS[args.model]
    path = getattr(record, save)(args.out, seed=args.seed)
    print(f"wrote a tiny random {family} checkpoint (model {args.model}) to {path}/")
    return 0


def _csv_ints(text: str) -> list[int]:
    try:  # an empty item is no integer either: `1,,2` is refused, not read as 1,2
        values = [plain_int(v) for v in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if min(values) < 1 or max(values) > MAX_COUNT:
        raise argparse.ArgumentTypeError(f"expected positive integers up to {MAX_COUNT_TEXT}, got {text!r}")
    repeated = first_repeat(values)
    if repeated is not None:  # (each shape would be measured twice, and the profile hold it once)
        raise argparse.ArgumentTypeError(f"{repeated} is given twice in {text!r}")
    return values


# pageable : pinned copy rate of the DGX A100 bandwidthTest (10.0 vs 25.7 GB/s H2D), the default
# ratio when emulating pageable copies (klotski_sim/hardware/profiles/a100-80g.yaml cites the run)
PAGEABLE_RATIO = 10.0 / 25.7
# torch compute threads: far more than any CPU has cores (too many fail to start: "can't start new thread")
MAX_THREADS = 1024
# runs of one shape or schedule: a median of more is no steadier, and a huge count runs for days
MAX_REPEATS = 1000


def _emulation(args: argparse.Namespace) -> dict[str, float]:
    if args.device != "cpu" or args.emulate_pcie == "off":
        return {}
    return {"pcie_h2d": args.emulate_pcie, "pcie_d2h": args.emulate_pcie}


# An emulated link's rate, bytes/s: at least a profile's least rate (hardware.RATE_FLOOR: slower, a tiny
# run copies for minutes, and calibrate would refuse the profile it measures), at most 10 TB/s (above
# any host link: NVLink-C2C is 0.9 TB/s).
EMULATED_RATES = (RATE_FLOOR, 1e13)


def _emulated_rate(text: str) -> float:
    rate = positive_float(text)
    low, high = EMULATED_RATES
    if not low <= rate <= high:
        slip = " (a unit slip? 1 GB/s is 1e9)" if rate < low else ""
        raise argparse.ArgumentTypeError(f"expected bytes per second from {low:g} to {high:g}, got {text!r}{slip}")
    return rate


def _rate_or_off(text: str) -> float | str:
    """A link rate to emulate (EMULATED_RATES), or `off` for real memcpy speed."""
    return "off" if text == "off" else _emulated_rate(text)


def _pageable(args: argparse.Namespace) -> dict[str, float]:
    """Emulated rate of copies from pageable host memory (only with emulated links). A pageable
    copy is staged through a pinned buffer, so it is never faster than a pinned one: a faster
    rate, or one given where nothing is emulated, is refused rather than ignored."""
    links = _emulation(args)
    rate = args.emulate_pageable
    if rate is not None and not links:
        raise CliError(
            f"--emulate-pageable {rate:g}: applies only to emulated links (--device cpu with "
            f"--emulate-pcie RATE), which this run does not emulate"
        )
    if rate is not None and rate > args.emulate_pcie:
        raise CliError(
            f"--emulate-pageable {rate:g} B/s is faster than the pinned rate --emulate-pcie "
            f"{args.emulate_pcie:g} B/s; a pageable copy goes through a pinned buffer, so it cannot be"
        )
    return {r: (rate if rate else bw * PAGEABLE_RATIO) for r, bw in links.items()}


def _add_device(p: argparse.ArgumentParser) -> None:
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"], help="where to run (default: %(default)s)")
    p.add_argument(
        "--emulate-pcie",
        type=_rate_or_off,
        default=1e9,
        metavar="BYTES_PER_S|off",
        help="CPU only: emulate PCIe H2D/D2H at this rate, labelled as emulation in every output "
        "(off = real memcpy speed; default: %(default)s)",
    )
    p.add_argument(
        "--emulate-pageable",
        type=_emulated_rate,
        default=None,
        metavar="BYTES_PER_S",
        help="CPU only: emulated rate of copies from pageable memory (default: --emulate-pcie x "
        f"{PAGEABLE_RATIO:.3f}, the pageable:pinned ratio of a DGX A100 bandwidthTest)",
    )
    p.add_argument(
        "--threads",
        type=bounded_int(1, MAX_THREADS),
        default=None,
        help="CPU only: torch compute threads, at most the cores this process may use; the other cores "
        "run the copy threads (default: 1; calibrate --cpu-only: every core)",
    )


def _threads(args: argparse.Namespace) -> int | None:
    """torch's compute threads on the CPU (None on a GPU), at most the cores this process may use: more
    time-share them, and every measured op would include its wait for a core (a profile calibrated so,
    or a measured timeline, describes the contention, not the machine)."""
    if args.device != "cpu":
        return None
    cores = available_cores()
    if args.threads is not None and args.threads > cores:
        raise CliError(
            f"--threads {args.threads}: this process may use {cores} core(s); more torch threads than "
            f"cores would time-share them and every measured op would include the wait (give at most "
            f"{cores})"
        )
    return 1 if args.threads is None else args.threads


def cmd_calibrate(args: argparse.Namespace) -> int:
    import torch

    from klotski_sim.workload.model import get_model

    from .calibrate import calibrate

    if args.cpu_only:
        return _calibrate_cpu(args)
    if args.out is None:
        raise CliError("--out FILE: the profile to write is required (or --cpu-only to measure the host's CPU)")
    output_file(args.out)
    profile = calibrate(
        get_model(args.model),
        args.device,
        batch_sizes=args.batch_sizes,
        prompt_lens=args.prompt_lens,
        max_expert_tokens=args.max_expert_tokens,
        repeats=args.repeats,
        dtype=getattr(torch, args.dtype),
        emulate_links=_emulation(args),
        emulate_pageable=_pageable(args),
        command="klotski-runtime " + " ".join(sys.argv[1:]),
        threads=_threads(args),
        progress=say,
    )
    write_file(args.out, lambda temporary: temporary.write_text(profile.to_yaml()), "--out")
    print(
        f"wrote {args.out}: {profile.gpu.name}; peak {flop_rate_text(profile.gpu.peak_flops)}, memory "
        f"{profile.gpu.memory_bandwidth / 1e9:.1f} GB/s, H2D {profile.links.pcie_h2d.bandwidth / 1e9:.2f} GB/s"
        f"{' (emulated)' if _emulation(args) else ''}; "
        f"{sum(len(v) for v in profile.measured.values())} measured op durations"
    )
    return 0


def _calibrate_cpu(args: argparse.Namespace) -> int:
    """`calibrate --cpu-only`: the host's CPU measured (klotski_runtime/cpu_probe.py), as a spec line."""
    from .cpu_probe import probe_cpu

    given = [
        flag
        for flag, on in (
            ("--device", args.device != "cpu"),
            ("--model", args.model != "small-mixtral"),
            ("--dtype", args.dtype != "bfloat16"),
            ("--batch-sizes", args.batch_sizes != [1, 2, 4, 8, 16]),
            ("--prompt-lens", args.prompt_lens != [16, 64, 256]),
            ("--max-expert-tokens", args.max_expert_tokens != 1024),
            ("--repeats", args.repeats != 5),
            ("--emulate-pageable", args.emulate_pageable is not None),
        )
        if on
    ]
    if given:
        raise CliError(f"{', '.join(given)}: --cpu-only measures the host's CPU, not a model's ops on a device")
    if args.out is not None:
        output_file(args.out)
    _threads(args)  # (a --threads above the cores is refused as for the other measurements)
    found = probe_cpu(threads=args.threads)
    line = found.spec_line()
    print(
        f"{found.cores} physical cores ({found.threads} threads measured), {found.isa}, {found.ram_gib:.0f} GiB: "
        f"DRAM read {found.read_bytes_per_s / 1e9:.1f} GB/s; float32 matrix-vector {found.gemv_bytes_per_s / 1e9:.1f} "
        f"GB/s of weights; float32 GEMM {flop_rate_text(found.gemm_flops)}"
    )
    print(f"--cpu {line}    (this host for klotski-sim advise, beside --model MODEL@TYPE --gpu PROFILE)")
    if args.out is not None:
        write_file(args.out, lambda temporary: temporary.write_text(line + "\n"), "--out")
        print(f"wrote {args.out}")
    return 0


def cmd_validate(args: argparse.Namespace) -> int:
    from .calibrate import calibrate
    from .validate import ALL_POLICIES, ValidationSetup, format_report, validate

    threads = _threads(args)
    if args.serve:
        return _validate_serving(args, threads)
    for flag in ("--requests", "--output-len"):
        if getattr(args, flag[2:].replace("-", "_")) is not None:
            raise CliError(f"{flag}: a serving workload's; give --serve (offline runs take --num-batches, --gen-len)")
    policies = ALL_POLICIES if args.policy == "all" else tuple(args.policy.split(","))
    repeated = first_repeat(policies)
    if repeated is not None:
        raise CliError(f"--policy {args.policy}: {repeated!r} is given twice")
    # (what is cheap to check, checked before calibration's minute: a policy, its options, the model)
    from klotski_sim.policies import POLICIES
    from klotski_sim.policies.base import resolve_options
    from klotski_sim.workload.model import get_model

    unknown = [p for p in policies if p not in POLICIES]
    if unknown:
        raise CliError(
            f"--policy {args.policy}: unknown {', '.join(map(repr, unknown))}; policies: {', '.join(POLICIES)}"
        )
    get_model(args.model)
    options = parse_overrides(args.options, "--option")
    for policy in policies:
        for impl in ("as-published", "ideal") if args.impl == "both" else (args.impl,):
            resolve_options(policy, impl, options)
    setup = ValidationSetup(
        model=args.model,
        device=args.device,
        batch_size=args.batch_size,
        num_batches=args.num_batches,
        prompt_len=args.prompt_len,
        gen_len=args.gen_len,
        routing=routing_kind(args.routing, args.trace),
        trace=args.trace,
        seed=args.seed,
        kv=args.kv,
        emulate_links=_emulation(args),
        emulate_pageable=_pageable(args),
        checkpoint=args.checkpoint,
        dtype=args.dtype,
        threads=threads or 1,
        impl=args.impl,
        repeats=args.repeats,
        options=options,
    )
    out = output_folder(args.out)
    profile_path = args.profile
    if profile_path is None:
        import torch

        from klotski_sim.workload.model import get_model

        print(f"no --profile: calibrating {args.device} for {args.model} first ...")
        # the dispatch probes run at batch 1 and half the prompt: out of sample for this validation
        profile = calibrate(
            get_model(args.model),
            args.device,
            batch_sizes=sorted({1, args.batch_size}),
            prompt_lens=sorted({max(1, args.prompt_len // 2), args.prompt_len}),
            kv_lens=range(args.prompt_len + 1, args.prompt_len + max(2, args.gen_len)),
            max_expert_tokens=max(64, 2 ** (args.batch_size * args.num_batches * args.prompt_len).bit_length()),
            dtype=getattr(torch, args.dtype),
            emulate_links=_emulation(args),
            emulate_pageable=_pageable(args),
            threads=threads,
            command="klotski-runtime " + " ".join(sys.argv[1:]),
            progress=say,
            size_flags=("--batch-size x --num-batches x --prompt-len", "--batch-size x --prompt-len"),
        )
        profile_path = str(out / "profile.yaml")
        write_file(profile_path, lambda temporary: temporary.write_text(profile.to_yaml()), "--out")
        print(f"wrote {profile_path}")
    report = validate(setup, profile_path, out, policies, progress=True)
    print(format_report(report))
    print(f"wrote validation.json and <policy>/{{simulated,measured}}.parquet, validation.png to {out}/")
    return 0


def _validate_serving(args: argparse.Namespace, threads: int | None) -> int:
    """`validate --serve`: calibrate the serving ops, simulate a serving run, execute its Schedule."""
    from .serving_validate import (
        SERVING_VALIDATION_POLICIES,
        ServingValidationSetup,
        format_serving_extra,
        validate_serving,
    )
    from .validate import format_report

    offline = [
        flag
        for flag, given in (
            ("--checkpoint", args.checkpoint),
            ("--trace", args.trace),
            ("--routing", args.routing),
            ("--kv cpu", args.kv != "gpu"),
            ("--impl", args.impl != "as-published"),
            ("--policy-file", args.policy_file),
            ("--dtype", args.dtype != "bfloat16"),
        )
        if given
    ]
    if offline:
        raise CliError(
            f"--serve: {', '.join(offline)} apply to offline schedules; a serving validation runs random bf16 "
            f"weights with real routing"
        )
    policies = SERVING_VALIDATION_POLICIES if args.policy == "all" else tuple(args.policy.split(","))
    repeated = first_repeat(policies)
    if repeated is not None:
        raise CliError(f"--policy {args.policy}: {repeated!r} is given twice")
    from klotski_sim.serving.policies import SERVING_POLICIES

    unknown = [p for p in policies if p not in SERVING_POLICIES]
    if unknown:
        raise CliError(f"--serve --policy: {', '.join(unknown)}: not serving policies ({', '.join(SERVING_POLICIES)})")
    options: dict[str, dict] = {p: {} for p in policies}
    for key, value in parse_overrides(args.options, "--option").items():
        policy, _, name = key.rpartition(".")
        if policy not in options:
            raise CliError(
                f"--option {key}: with --serve name a policy validated as POLICY.KEY ({', '.join(policies)})"
            )
        options[policy][name] = value
    setup = ServingValidationSetup(
        model=args.model,
        device=args.device,
        requests=args.requests or 3,
        prompt_len=args.prompt_len,
        output_len=args.output_len or args.gen_len,
        policies=policies,
        options=options,
        seed=args.seed,
        emulate_links=_emulation(args),
        emulate_pageable=_pageable(args),
        threads=threads or 1,
        repeats=args.repeats,
    )
    out = output_folder(args.out)
    report = validate_serving(setup, out, args.profile, progress=True)
    print(format_report(report))
    print(format_serving_extra(report))
    print(f"wrote profile.yaml, validation.json and <policy>/{{simulated,measured}}.parquet, schedule.json, "
          f"validation.png to {out}/")  # fmt: skip
    return 0


def _model_of(args: argparse.Namespace, schedule: Any, schedule_path: Path) -> Any:
    """The model `execute` runs a schedule on: --model, else the one the schedule says it is of."""
    from klotski_sim.workload.model import get_model

    if not (args.model or schedule.meta.get("model")):
        raise CliError(f"{schedule_path}: meta.model is missing (which model the schedule is of); give --model")
    return get_model(args.model or schedule.meta["model"])


def _weights(args: argparse.Namespace, model: Any, dtype: Any) -> Any:
    """--checkpoint's weights for `model`, else random ones."""
    from .kernels import WeightStore

    if args.checkpoint:
        return WeightStore.from_checkpoint(args.checkpoint, model, dtype=dtype)
    return WeightStore.random(model, dtype=dtype)


def _execute_serving(args: argparse.Namespace, schedule: object, schedule_path: Path, threads: int | None) -> int:
    """`execute` of a serving Schedule (`klotski-sim serve --timeline --out DIR` writes DIR/POLICY/schedule.json)."""
    import torch

    from klotski_sim.core.schedule import Schedule

    from .executor import ExecOptions
    from .serving_exec import check_serving, execute_serving

    assert isinstance(schedule, Schedule)
    if args.routing is not None:
        raise CliError(f"--routing: {schedule_path} is a serving schedule; it routes for real (no routing table)")
    if args.dtype != "bfloat16":
        raise CliError(f"--dtype {args.dtype}: a serving schedule moves bf16 experts (their bytes are the schedule's)")
    model = _model_of(args, schedule, schedule_path)
    check_serving(schedule, model, str(schedule_path))  # before any weights are made or read
    weights = _weights(args, model, torch.bfloat16)
    timeline, runner = execute_serving(
        schedule,
        model,
        weights,
        ExecOptions(
            device=args.device, emulate_links=_emulation(args), emulate_pageable=_pageable(args), threads=threads
        ),
    )
    sampled = sum(len(v) for v in runner.sampled.values())
    moved = sum(written for written, _ in runner.moved.values())
    print(
        f"executed {len(runner.comp.by_step)} iterations of {schedule.meta.get('policy')} on {timeline.meta['device']}: "
        f"makespan {timeline.makespan:.3f} s, {sampled} tokens sampled, {moved:,} bytes copied or decompressed"
        f"{f', {len(runner.dropped)} KV caches dropped for recompute' if runner.dropped else ''}"
    )
    return _measured(timeline, args.out)


def cmd_execute(args: argparse.Namespace) -> int:
    import torch

    from klotski_sim.core.schedule import Schedule
    from klotski_sim.workload.routing import RoutingTable

    from .executor import ExecOptions, check_compatible, execute

    threads = _threads(args)
    folder = Path(args.schedule)
    if folder.is_dir() and (folder / EP_RUN_FILE).is_file():
        return _execute_ep(args, folder, threads)
    schedule_path = folder / "schedule.json" if folder.is_dir() else folder
    routing_path = args.routing or (folder if folder.is_dir() else folder.parent) / "routing.npz"
    if args.out is not None:
        _measured_folder(
            args.out,
            [schedule_path, routing_path],
            [schedule_path.parent],
            f"is what this command reads ({schedule_path.parent}, the schedule's folder); writing there would "
            f"replace the simulation's files",
        )
    schedule = Schedule.load(schedule_path)
    if any(resource_rank(r) >= 0 for r in schedule.streams.values()):
        raise CliError(
            f"{schedule_path}: an expert-parallel run's schedule: execute its folder, which must hold the ep.json "
            f"that parallel --timing events --out wrote beside it ({schedule_path.parent / EP_RUN_FILE} is missing)"
        )
    if not len(schedule):
        raise CliError(
            f"{schedule_path}: the schedule has no ops (a configuration the memory check refused?): nothing to execute"
        )
    if schedule.meta.get("mode") == "serving":
        return _execute_serving(args, schedule, schedule_path, threads)
    routing = RoutingTable.load(routing_path)
    model = _model_of(args, schedule, schedule_path)
    check_compatible(schedule, model, None, routing)  # before any weights are made or read
    fabric = _fabric(args, schedule)
    weights = _weights(args, model, getattr(torch, args.dtype))
    timeline, _ = execute(
        schedule,
        model,
        weights,
        routing,
        ExecOptions(
            device=args.device,
            emulate_links=_emulation(args),
            emulate_pageable=_pageable(args),
            threads=threads,
            emulate_fabric=fabric,
        ),
    )
    from klotski_sim.cli.summary_text import format_summary

    print(format_summary(timeline.summary()))
    return _measured(timeline, args.out)


def _measured_folder(out: str, reads: list[Path], simulated: list[Path], why: str) -> None:
    """`execute --out`: a folder that is none of the files read and none of the folders the simulation
    wrote (its summary and timeline files would be replaced: `why` says so); a folder inside one holds
    none of them, so `execute sim --out sim/measured` and its rerun are allowed."""
    not_an_input(Path(out), "--out", reads)
    if Path(out).resolve() in [folder.resolve() for folder in simulated]:
        raise CliError(f"--out {out}: {why}")
    refuse_unwritable(output_folder(out), TIMELINE_FILES)


def _execute_ep(args: argparse.Namespace, folder: Path, threads: int | None) -> int:
    """`execute` of an EP configuration `klotski-sim parallel --timing events --out DIR` wrote
    (DIR/<configuration>/): its plan rebuilt, its schedule executed on emulated ranks, the ranks'
    hidden states checked against one device's (klotski_runtime/expert_parallel.py)."""
    import torch

    from klotski_sim.cli.parallel import load_ep_run
    from klotski_sim.hardware.profile import FabricSpec

    from .executor import ExecOptions
    from .expert_parallel import execute_ep, prompt_cache, reference_decode

    given = [flag for flag, on in (("--routing", args.routing), ("--model", args.model)) if on]
    if given:
        raise CliError(f"{', '.join(given)}: {folder} is an EP run; its model and routing are the run's own")
    if args.device != "cpu":
        raise CliError(
            f"--device {args.device}: {folder} is an expert-parallel run; its ranks are emulated on the CPU "
            f"(--device cpu); executing it on G real GPUs is not built yet"
        )
    if args.out is not None:
        _measured_folder(
            args.out,
            [folder / "schedule.json", folder / EP_RUN_FILE],
            [folder, folder.parent],  # (parallel --out wrote the folder above too: its routing.npz)
            "is the EP run's folder (or the one above it, which parallel --out wrote); the measured timeline would "
            "replace its simulated files: give a folder of its own",
        )
    run = load_ep_run(folder)
    gpus = run.plan.setup.gpus
    fabric = None
    if args.emulate_fabric != "off":
        fabric = FabricSpec(
            kind="pcie", gpus=gpus, bandwidth=args.emulate_fabric, base_latency_s=0.0, step_latency_s=0.0
        )
    dtype = getattr(torch, args.dtype)
    if run.how.offloaded_experts == "compressed" and dtype != torch.bfloat16:
        raise CliError(f"--dtype {args.dtype}: {folder} decompresses bf16 experts (the lossless coder's); use bfloat16")
    weights = _weights(args, run.model, dtype)
    shape = run.routing.shape
    inputs = prompt_cache(run.model, len(run.plan.home_rank), shape.prompt_len, shape.gen_len - 1, dtype)
    options = ExecOptions(
        emulate_links=_emulation(args), emulate_pageable=_pageable(args), threads=threads, emulate_fabric=fabric
    )
    timeline, runner = execute_ep(run.schedule, run.model, weights, run.plan, run.micro_batch, inputs, options)
    reference = reference_decode(run.model, weights, run.plan, inputs)
    error = max(float((runner.outputs[s] - ref).abs().max()) for s, ref in reference.items())
    scale = max(float(ref.abs().max()) for ref in reference.values())
    slots = [int(c.min()) == int(c.max()) == 1 for c in runner.computed.values()]
    steps = shape.gen_len - 1
    print(
        f"executed {run.schedule.meta['policy']} of {run.model.name} ({len(run.schedule.ops)} ops, {steps} decode "
        f"steps) on {timeline.meta['device']}: makespan {timeline.makespan:.3f} s, {timeline.makespan / steps * 1e3:.2f} "
        f"ms a step"
    )
    for k in range(gpus):
        rank = timeline.rank_view(k).summary()
        busy = rank.gpu_busy_s
        print(
            f"  rank {k}: compute busy {busy:.3f} s ({busy / timeline.makespan:.0%}), idle between its ops {rank.bubble_s:.3f} s"
        )
    print(
        f"ranks EMULATED: {gpus} expert-parallel ranks as threads of this host"
        + (f", each all-to-all held to a {fabric.bandwidth / 1e9:.3g} GB/s fabric" if fabric else "")
    )
    print(
        f"hidden states of {len(reference)} decode steps against one device's: max |difference| {error:.3g} "
        f"(largest value {scale:.3g}); every token's expert slots computed once: {'yes' if all(slots) else 'NO'}"
    )
    code = _measured(timeline, args.out)
    return code if all(slots) and error <= 1e-2 * max(scale, 1.0) else 1


def _fabric(args: argparse.Namespace, schedule: Any) -> Any:
    """The fabric `--emulate-fabric` holds a group's all-reduces to (its rate alone: no latency terms),
    refused where nothing would be held to it."""
    from klotski_sim.hardware.profile import FabricSpec

    from .executor import tensor_parallel_ranks

    if args.emulate_fabric == "off":
        return None
    ranks = tensor_parallel_ranks(schedule)
    if args.device != "cpu" or ranks == 1:
        raise CliError(
            f"--emulate-fabric {args.emulate_fabric:g}: applies to a tensor-parallel schedule (simulate --gpus G) "
            f"on --device cpu; this is a {ranks}-GPU schedule on --device {args.device}"
        )
    return FabricSpec(kind="pcie", gpus=ranks, bandwidth=args.emulate_fabric, base_latency_s=0.0, step_latency_s=0.0)


def _measured(timeline: Any, out: str | None) -> int:
    """`execute`'s last lines: the emulated links named, the measured timeline written to `out`."""
    if timeline.meta.get("emulated_links"):
        print(
            "links EMULATED: "
            + ", ".join(
                f"{k} {v / 1e9:.3g} GB/s" for k, v in timeline.meta["emulated_links"]["bandwidth_bytes_per_s"].items()
            )
        )
    if timeline.meta.get("tensor_parallel_ranks"):
        ranks = timeline.meta["tensor_parallel_ranks"]
        fabric = timeline.meta.get("emulated_fabric_bytes_per_s")
        print(
            f"ranks EMULATED: {ranks} tensor-parallel ranks as threads of this host"
            + (f", all-reduces held to a {fabric / 1e9:.2f} GB/s fabric" if fabric else "")
        )
    if out:
        from klotski_sim.report.exports import save_all

        save_all(timeline, out)
        print(
            f"wrote the measured timeline (summary.json, timeline.parquet/.csv, trace.json.gz, timeline.png) to {out}/"
        )
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = OneLineParser(prog="klotski-runtime", description=__doc__.splitlines()[0])
    parser.add_argument("--debug", action="store_true", help="show the full traceback of an error")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("record", help="record a routing trace from a local Hugging Face MoE checkpoint")
    p.add_argument(
        "--model-dir", required=True, type=path_arg, metavar="DIR", help="checkpoint directory (config.json + weights)"
    )
    p.add_argument(
        "--text",
        required=True,
        type=path_arg,
        metavar="FILE",
        help="UTF-8 text; blank-line separated paragraphs are sequences",
    )
    p.add_argument(
        "--max-tokens", type=positive_int, default=512, help="prompt tokens per sequence (default: %(default)s)"
    )
    p.add_argument(
        "--gen-len",
        type=nonnegative_int,
        default=32,
        help="greedy tokens generated per sequence (default: %(default)s)",
    )
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"], help="where to run (default: %(default)s)")
    p.add_argument("--dataset", help="dataset name for the provenance (default: the text file's name)")
    p.add_argument(
        "--model-name",
        help="model name recorded in the trace, e.g. a klotski-sim preset (default: the checkpoint directory's name)",
    )
    p.add_argument("--out", required=True, metavar="FILE", help="trace file to write (.npz)")
    p.set_defaults(func=cmd_record)

    p = sub.add_parser(
        "execute",
        help="execute a schedule written by `klotski-sim simulate --out DIR` (or an EP configuration's folder "
        "`klotski-sim parallel --timing events --out DIR` wrote, its ranks emulated) and measure it",
    )
    p.add_argument("schedule", type=path_arg, metavar="DIR|schedule.json")
    p.add_argument("--routing", type=path_arg, metavar="FILE", help="routing.npz (default: next to the schedule)")
    p.add_argument("--model", help="model preset (default: the schedule's)")
    p.add_argument(
        "--checkpoint",
        type=path_arg,
        metavar="DIR",
        help="load weights from a local safetensors checkpoint (default: random weights of the true shapes)",
    )
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    p.add_argument("--out", metavar="DIR", help="write the measured timeline files here")
    _add_device(p)
    p.add_argument(
        "--emulate-fabric",
        type=_rate_or_off,
        default="off",
        metavar="BYTES_PER_S|off",
        help="CPU only, a tensor-parallel schedule (simulate --gpus G) or an EP run: hold each all-reduce to NCCL's "
        "ring or tree time, each all-to-all to its pairwise exchange's, at this per-GPU fabric rate, labelled as "
        "emulation (off = as fast as the host moves them; default: off)",
    )
    p.set_defaults(func=cmd_execute)

    p = sub.add_parser("calibrate", help="microbenchmark ops and links into a hardware profile with a measured table")
    p.add_argument("--model", default="small-mixtral", help="model whose op shapes to measure (default: %(default)s)")
    p.add_argument("--out", metavar="FILE", help="profile YAML to write (with --cpu-only: the spec line)")
    p.add_argument(
        "--cpu-only",
        action="store_true",
        help="measure this host's CPU only (DRAM read rate, matrix-vector and GEMM throughput, under a minute) and "
        "print it as `klotski-sim advise --cpu` takes it",
    )
    p.add_argument(
        "--batch-sizes",
        type=_csv_ints,
        default=[1, 2, 4, 8, 16],
        metavar="A,B,...",
        help="batch sizes to time attention at (default: 1,2,4,8,16)",
    )
    p.add_argument(
        "--prompt-lens",
        type=_csv_ints,
        default=[16, 64, 256],
        metavar="A,B,...",
        help="prompt lengths to time prefill at (default: 16,64,256)",
    )
    p.add_argument(
        "--max-expert-tokens",
        type=positive_int,
        default=1024,
        help="largest token count timed for one expert op (default: %(default)s)",
    )
    p.add_argument(
        "--repeats",
        type=bounded_int(1, MAX_REPEATS),
        default=5,
        help=f"median of this many runs per shape, at most {MAX_REPEATS} (default: %(default)s)",
    )
    p.add_argument(
        "--dtype",
        default="bfloat16",
        choices=["bfloat16", "float16", "float32"],
        help="weight and activation dtype (default: %(default)s)",
    )
    _add_device(p)
    p.set_defaults(func=cmd_calibrate)

    p = sub.add_parser("validate", help="simulate and execute the same schedules; report the errors")
    p.add_argument(
        "--policy",
        "--policies",
        default="all",
        help="a policy, a comma-separated list, or all (default: %(default)s; with --serve: serving policies)",
    )
    p.add_argument(
        "--serve",
        action="store_true",
        help="validate a serving run (klotski-sim serve): continuous batching of --requests requests of "
        "--prompt-len + --output-len tokens under serving policies (vllm, vllm-o, ktransformers, fluxmoe-h, "
        "fluxmoe); options as POLICY.KEY=VALUE",
    )
    p.add_argument("--requests", type=positive_int, default=None, help="--serve: requests submitted (default: 3)")
    p.add_argument(
        "--output-len", type=positive_int, default=None, help="--serve: output tokens per request (default: --gen-len)"
    )
    p.add_argument(
        "--policy-file",
        action="append",
        default=[],
        metavar="FILE.py",
        help="a Python file that registers your own policy (docs/own-schedule.md); repeatable",
    )
    p.add_argument(
        "--option",
        dest="options",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="a policy option for every schedule validated, e.g. expert_cache=8 or attention_device=cpu (repeatable)",
    )
    p.add_argument("--model", default="small-mixtral", help="model preset (default: %(default)s)")
    p.add_argument(
        "--profile", metavar="FILE", help="calibrated profile (default: calibrate now, into DIR/profile.yaml)"
    )
    p.add_argument("--out", default="klotski-validate", metavar="DIR", help="where to write (default: %(default)s)")
    p.add_argument("--batch-size", type=positive_int, default=4, help="sequences per batch (default: %(default)s)")
    p.add_argument("--num-batches", type=positive_int, default=2, help="batches n (default: %(default)s)")
    p.add_argument("--prompt-len", type=positive_int, default=32, help="prompt tokens (default: %(default)s)")
    p.add_argument("--gen-len", type=positive_int, default=4, help="generated tokens (default: %(default)s)")
    p.add_argument(
        "--routing",
        default=None,
        metavar="KIND",
        help=f"synthetic routing kind when no --trace is given (default: {DEFAULT_ROUTING})",
    )
    p.add_argument("--trace", type=path_arg, metavar="FILE", help="replay a routing trace instead of synthetic routing")
    p.add_argument("--seed", type=seed_int, default=0, help="routing and weight seed (default: %(default)s)")
    p.add_argument(
        "--kv", default="gpu", choices=["gpu", "cpu"], help="where the KV cache lives (default: %(default)s)"
    )
    p.add_argument(
        "--checkpoint", type=path_arg, metavar="DIR", help="weights from a local checkpoint (default: random)"
    )
    p.add_argument(
        "--dtype",
        default="bfloat16",
        choices=["bfloat16", "float16", "float32"],
        help="weight and activation dtype (default: %(default)s)",
    )
    p.add_argument(
        "--impl",
        default="as-published",
        choices=["as-published", "ideal", "v0.1", "both"],
        help="implementation preset of the schedules validated (default: %(default)s)",
    )
    p.add_argument(
        "--repeats",
        type=bounded_int(1, MAX_REPEATS),
        default=3,
        help=f"measured runs per schedule, at most {MAX_REPEATS}; errors are reported as median and "
        f"spread (default: %(default)s)",
    )
    _add_device(p)
    p.set_defaults(func=cmd_validate)

    p = sub.add_parser("tiny-checkpoint", help="save a tiny random checkpoint (for trying record/execute/validate)")
    p.add_argument(
        "--model",
        default="tiny-mixtral",
        choices=list(TINY_CHECKPOINTS),
        help="whose shapes and layout (default: %(default)s)",
    )
    p.add_argument("--out", required=True, metavar="DIR")
    p.add_argument("--seed", type=seed_int, default=0)
    p.set_defaults(func=cmd_tiny_checkpoint)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    from klotski_sim.policies.plugins import load_for_command_line

    argv = list(sys.argv[1:] if argv is None else argv)
    failed = load_for_command_line(argv)  # your own policies, before the command looks policies up
    return failed if failed is not None else guarded(build_parser(), argv)


if __name__ == "__main__":
    sys.exit(main())
