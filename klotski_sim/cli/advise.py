"""`klotski-sim advise`: a GGUF MoE model on the user's GPU and host under llama.cpp — each
`--n-cpu-moe`, what it holds where and its prompt and generation tok/s, the best one as the command
to run, and why not more or fewer (klotski_sim/advise/)."""

from __future__ import annotations

import argparse
import json
import os
from dataclasses import replace
from pathlib import Path
from typing import Any

from klotski_sim.advise.costs import llama_cpp_costs
from klotski_sim.advise.ktransformers import kt_option
from klotski_sim.advise.llamacpp import (
    CACHE_TYPES,
    OP_OFFLOAD_MIN_BATCH,
    LlamaCppFlags,
    memory,
    override_blocks,
    speed,
)
from klotski_sim.advise.search import GOALS, HOST_RESERVE_BYTES, Advice, advise
from klotski_sim.cli.common import CliError, output_file
from klotski_sim.files.outfiles import write_file
from klotski_sim.hardware.host_cpu import CPU_PRESETS, MAX_RAM_GIB, HostCpu, parse_cpu
from klotski_sim.hardware.profile import HardwareProfile, ProfileError, load_profile
from klotski_sim.util.argtypes import bounded_float, bounded_int
from klotski_sim.util.errors import UsageError
from klotski_sim.workload.gguf import FILE_TYPES, GgufSizes, gguf_sizes, split_model_name
from klotski_sim.workload.model import ModelSpec, get_model

GIB = 2**30


def add_advise_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "advise",
        help="llama.cpp: which blocks' experts to keep on the CPU (--n-cpu-moe) for a GGUF model on your GPU and RAM",
    )
    p.add_argument(
        "--model",
        required=True,
        metavar="MODEL@TYPE",
        help=f"a model preset and its GGUF type ({', '.join(FILE_TYPES)})",
    )
    p.add_argument(
        "--gpu",
        required=True,
        action="append",
        metavar="PROFILE[,PROFILE...]",
        help="hardware profiles of GPUs to compare (rtx4090, ...): a list, or the flag repeated",
    )
    p.add_argument(
        "--cpu",
        required=True,
        action="append",
        metavar="PRESET|SPEC",
        help=f"the host: a preset ({', '.join(CPU_PRESETS)}) or cores=C,isa=avx2|avx512|amx,channels=N,mts=M"
        f"[,numa=K][,ram=GiB][,bw=GB/s] (what klotski-runtime calibrate --cpu-only prints); repeat the flag to "
        f"compare hosts",
    )
    p.add_argument(
        "--ram", type=bounded_float(1, MAX_RAM_GIB), metavar="GiB", help="installed RAM (each --cpu's, unless its ram=)"
    )
    p.add_argument(
        "--ctx", type=bounded_int(16, 1 << 21), default=4096, help="-c: context length (default: %(default)s)"
    )
    p.add_argument("--cache-type", choices=CACHE_TYPES, default="F16", help="-ctk/-ctv (default: %(default)s)")
    p.add_argument("--ubatch", type=bounded_int(1, 65536), default=512, help="-ub (default: %(default)s)")
    p.add_argument(
        "--prompt-len", type=bounded_int(1, 1 << 20), default=512, help="prompt tokens priced (default: 512, pp512)"
    )
    p.add_argument(
        "--gen-len", type=bounded_int(1, 1 << 20), default=128, help="generated tokens priced (default: 128, tg128)"
    )
    p.add_argument("--goal", choices=GOALS, default="generation", help="what the best maximises (default: %(default)s)")
    p.add_argument("--no-op-offload", action="store_true", help="price llama.cpp's --no-op-offload")
    p.add_argument(
        "--ot",
        action="append",
        metavar="PATTERN=BUFFER[,...]",
        help="also price your own llama.cpp -ot (--override-tensor) placement of the routed experts, e.g. "
        "'blk\\.([5-9]|[1-9][0-9])\\.ffn_.*_exps=CPU' (repeated: added up, as llama.cpp does)",
    )
    p.add_argument("--all", action="store_true", help="list every --n-cpu-moe, not only those around the best")
    p.add_argument(
        "--json",
        metavar="FILE",
        help="also write every placement of every GPU and host, priced, as JSON (for notebooks and scripts)",
    )
    p.set_defaults(func=cmd_advise)


def _gpus(given: list[str]) -> list[HardwareProfile]:
    """Every --gpu's profiles, each once (a repeated flag adds to the list)."""
    names = [n.strip() for text in given for n in text.split(",")]
    if not all(names):
        raise CliError(f"--gpu {','.join(given)}: an empty profile name")
    # (a profile file named by two paths is one profile)
    keys = [os.path.realpath(n) if n.endswith((".yaml", ".yml")) else n for n in names]
    repeated = next((names[i] for i, k in enumerate(keys) if k in keys[:i]), None)
    if repeated is not None:
        raise CliError(f"--gpu: {repeated} is given twice")
    try:
        return [load_profile(n) for n in names]
    except ProfileError as bad:
        raise CliError(f"--gpu: {bad}") from None


def _hosts(given: list[str], ram: float | None) -> list[HostCpu]:
    """Every --cpu's host, each once."""
    if len(set(given)) != len(given):
        repeated = next(c for i, c in enumerate(given) if c in given[:i])
        raise CliError(f"--cpu {repeated}: given twice")
    hosts = []
    for text in given:
        if "=" not in text and "," in text:
            raise CliError(f"--cpu {text}: one host a flag; repeat --cpu to compare hosts")
        try:
            hosts.append(parse_cpu(text, ram))
        except UsageError as bad:
            raise CliError(str(bad)) from None
    return hosts


def _model_file(text: str) -> str:
    """The GGUF file name the commands show for `--model`: its model's last path part and type."""
    name, _, kind = text.partition("@")
    stem = Path(name).parent.name if name.endswith(".json") else name
    return f"{stem.replace(':', '-')}-{kind.upper()}.gguf"


def cmd_advise(args: argparse.Namespace) -> int:
    try:
        name, file_type = split_model_name(args.model)
        model = get_model(name)
    except UsageError as bad:
        raise CliError(str(bad) if str(bad).startswith("--model") else f"--model {args.model}: {bad}") from None
    hosts = _hosts(args.cpu, args.ram)
    small = next((h for h in hosts if h.ram_bytes <= HOST_RESERVE_BYTES), None)
    if small is not None:
        raise CliError(
            f"--ram / ram=: {small.name} has {small.ram_bytes / GIB:g} GiB, no more than the "
            f"{HOST_RESERVE_BYTES / GIB:g} GiB advise leaves for the system"
        )
    if model.quantised:
        raise CliError(f"--model {args.model}: give a plain preset and its GGUF type (MODEL@TYPE)")
    if args.prompt_len + args.gen_len > args.ctx:
        raise CliError(
            f"--prompt-len {args.prompt_len} + --gen-len {args.gen_len} = {args.prompt_len + args.gen_len} tokens: more "
            f"than the context (--ctx {args.ctx}) llama.cpp would hold them in"
        )
    if args.goal != "generation" and (args.no_op_offload or args.ubatch < OP_OFFLOAD_MIN_BATCH):
        why = "--no-op-offload" if args.no_op_offload else f"--ubatch {args.ubatch} (below {OP_OFFLOAD_MIN_BATCH})"
        raise CliError(
            f"--goal {args.goal}: with {why} the CPU computes its experts' share of a prompt, which advise does not "
            f"price; use --goal generation"
        )
    gpus = _gpus(args.gpu)
    if args.json is not None:  # (never one of the files read: a profile or a model's config)
        inputs = [
            name
            for name in (*(n for t in args.gpu for n in t.split(",")), name)
            if name.endswith((".yaml", ".yml", ".json"))
        ]
        output_file(args.json, "--json", inputs)
    sizes = gguf_sizes(model, file_type)
    # (llama-context.cpp clamps: n_batch = min(n_ctx, n_batch), n_ubatch = min(n_batch, n_ubatch))
    batch = min(args.ctx, LlamaCppFlags.batch)
    base = LlamaCppFlags(
        ctx=args.ctx, cache_type=args.cache_type, ubatch=min(batch, args.ubatch), batch=batch,
        op_offload=not args.no_op_offload,
    )  # fmt: skip
    own = None
    if args.ot is not None:
        override = ",".join(args.ot)
        try:
            own = replace(base, cpu_expert_blocks=override_blocks(model, override), override=override)
        except UsageError as bad:
            raise CliError(f"--ot: {bad}") from None
    clamped = f" (--ubatch {args.ubatch} clamped to -b {batch}, as llama.cpp does)" if args.ubatch > batch else ""
    print(
        f"{model.name}@{file_type}: {sizes.total / GIB:.2f} GiB, {sizes.params / 1e9:.2f} B parameters "
        f"(routed experts {sum(sizes.experts) / GIB:.2f} GiB in {len(model.moe_layers)} blocks); llama.cpp, "
        f"-c {args.ctx}, {args.cache_type} KV cache, -ub {base.ubatch}{clamped}; prompt {args.prompt_len} tokens, "
        f"{args.gen_len} generated"
    )
    results: list[tuple[HardwareProfile, HostCpu, Advice | str]] = []
    for gpu in gpus:
        for host in hosts:
            try:
                found: Advice | str = advise(
                    model, sizes, gpu, host, llama_cpp_costs(gpu, host), base, args.goal, args.prompt_len, args.gen_len
                )
            except UsageError as refused:
                found = str(refused)
            results.append((gpu, host, found))
            _print_one(gpu, host, found, file_type, args)
            if own is not None:
                _print_own(model, sizes, own, gpu, host, args)
    if len(results) > 1:
        print("\nbest of each:")
        print(f"  {'GPU':28} {'host':28} {'--n-cpu-moe':>11} {'prompt tok/s':>12} {'gen tok/s':>9}")
        for gpu, host, found in results:
            if isinstance(found, str):
                print(f"  {gpu.gpu.name:28} {host.name:28} does not fit")
            else:
                s = found.best.speed
                assert s is not None
                print(
                    f"  {gpu.gpu.name:28} {host.name:28} {found.best.flags.n_cpu_moe:11d} "
                    f"{_rate(s.prompt_tok_s, 12)} {s.generation_tok_s:9.1f}"
                )
    if args.json is not None:
        report = advice_json(model, sizes, results, base, args)
        write_file(args.json, lambda temporary: temporary.write_text(json.dumps(report, indent=2) + "\n"), "--json")
        print(f"wrote {args.json}")
    print(
        "predictions from the model file's bytes, the GPU's and the host's bandwidths and llama.cpp's fixed costs "
        "(docs/advise.md; their errors against published runs: docs/fidelity-llamacpp.md)"
    )
    return 0 if any(not isinstance(found, str) for _, _, found in results) else 3


def advice_json(
    model: ModelSpec,
    sizes: GgufSizes,
    results: list[tuple[HardwareProfile, HostCpu, Advice | str]],
    base: LlamaCppFlags,
    args: argparse.Namespace,
) -> dict[str, Any]:
    """Every GPU and host's placements as plain data: what the table prints, every row."""

    def speed_of(option: Any) -> dict[str, Any]:
        s = option.speed
        return {
            "n_cpu_moe": option.flags.n_cpu_moe,
            "gpu_bytes": option.memory.gpu,
            "host_bytes": option.memory.host,
            "prompt_tok_s": None if s is None else s.prompt_tok_s,
            "generation_tok_s": None if s is None else s.generation_tok_s,
            "decode_parts_s": None if s is None else s.parts,
            "refused": option.refused,
        }

    runs = []
    for gpu, host, found in results:
        entry: dict[str, Any] = {"gpu": gpu.name, "host": host.describe()}
        if isinstance(found, str):
            entry["refused"] = found
        else:
            entry["options"] = [speed_of(o) for o in found.options]
            entry["best"] = found.best.flags.n_cpu_moe
            entry["command"] = found.best.flags.command(_model_file(args.model))
        runs.append(entry)
    return {
        "model": model.name,
        "file_type": sizes.file_type,
        "file_bytes": sizes.total,
        "routed_expert_bytes": sum(sizes.experts),
        "ctx": base.ctx,
        "cache_type": base.cache_type,
        "ubatch": base.ubatch,
        "prompt_tokens": args.prompt_len,
        "generated_tokens": args.gen_len,
        "goal": args.goal,
        "runs": runs,
    }


def _rate(value: float | None, width: int = 0) -> str:
    """A tok/s figure, or `-` where it is not priced."""
    return f"{value:{width}.1f}" if value is not None else f"{'-':>{width}}"


def _print_own(
    model: ModelSpec,
    sizes: GgufSizes,
    flags: LlamaCppFlags,
    gpu: HardwareProfile,
    host: HostCpu,
    args: argparse.Namespace,
) -> None:
    """The user's own -ot placement, priced as the table's rows are."""
    held = memory(model, sizes, flags)
    room = gpu.gpu.usable_bytes
    head = (
        f"  your -ot ({len(flags.cpu_expert_blocks)} blocks' experts on the CPU): GPU {held.gpu / GIB:.2f} GiB, "
        f"host {held.host / GIB:.2f} GiB"
    )
    if held.gpu > room:
        print(f"{head}: does not fit: the GPU would hold {held.gpu / GIB:.1f} GiB, more than its {room / GIB:.1f} GiB")
        return
    s = speed(model, sizes, flags, gpu, host, llama_cpp_costs(gpu, host), args.prompt_len, args.gen_len)
    print(f"{head}: {_rate(s.prompt_tok_s)} tok/s prompt, {s.generation_tok_s:.1f} tok/s generated")
    print(f"    {flags.command(_model_file(args.model))}")


def _print_one(
    gpu: HardwareProfile, host: HostCpu, found: Advice | str, file_type: str, args: argparse.Namespace
) -> None:
    print(f"\n{gpu.gpu.name} ({gpu.gpu.usable_bytes / GIB:.1f} GiB usable) + {host.describe()}")
    if isinstance(found, str):
        print(f"  {found}")
        return
    best = found.best
    index = found.options.index(best)
    shown = [
        i
        for i, option in enumerate(found.options)
        if args.all or abs(i - index) <= 2 or i == len(found.options) - 1 or (option.speed is None and i == index - 3)
    ]
    print(f"  {'--n-cpu-moe':>11} {'GPU GiB':>8} {'host GiB':>8} {'prompt tok/s':>12} {'gen tok/s':>9}")
    last = -1
    for i in shown:
        option = found.options[i]
        if i > last + 1:
            print(f"  {'...':>11}")
        last = i
        mark = "  <- best" if option is best else ""
        speeds = (
            f"{_rate(option.speed.prompt_tok_s, 12)} {option.speed.generation_tok_s:9.1f}"
            if option.speed is not None
            else f"  does not fit: {option.refused}"
        )
        print(
            f"  {option.flags.n_cpu_moe:11d} {option.memory.gpu / GIB:8.2f} {option.memory.host / GIB:8.2f} {speeds}{mark}"
        )
    s = best.speed
    assert s is not None
    model_file = _model_file(args.model)
    print(f"  best for {found.goal}: --n-cpu-moe {best.flags.n_cpu_moe}: {s.generation_tok_s:.1f} tok/s generated, "
          f"{_rate(s.prompt_tok_s)} tok/s prompt")  # fmt: skip
    print(f"    {best.flags.command(model_file)}")
    print(f"    {best.flags.command(model_file, 'llama-bench', args.prompt_len, args.gen_len)}")
    why = found.why_not_more()
    if why:
        print(f"  not {why}")
    parts = ", ".join(f"{k} {v * 1e3:.2f}" for k, v in s.parts.items())
    print(f"  a generated token {s.decode_s * 1e3:.2f} ms: {parts} ms")
    kt = kt_option(
        found.model, found.sizes, gpu, host, llama_cpp_costs(gpu, host), args.ctx, model_file, args.gen_len // 2,
        found.host_room,
    )  # fmt: skip
    verdict = f"{kt.generation_tok_s:.1f} tok/s generated" if kt.decode_s else f"does not fit: {kt.refused}"
    beside = ", the shared ones on the GPU beside them" if found.model.num_shared_experts else ""
    print(
        f"  KTransformers (every routed expert on the CPU{beside}; GPU {kt.gpu_bytes / GIB:.2f} GiB, host "
        f"{kt.host_bytes / GIB:.2f} GiB): {verdict}"
    )
    if kt.decode_s:
        print(f"    {kt.command}")
