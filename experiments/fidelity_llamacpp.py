"""Published llama.cpp and KTransformers runs of MoE models with experts on the CPU, next to
`klotski-sim advise`'s predictions of them: docs/fidelity-llamacpp.md.

    python experiments/fidelity_llamacpp.py [--out docs/fidelity-llamacpp.md] [--quick] [--cpu-read-share S]

Each row is a measurement someone published with its model file, GPU, CPU, RAM and flags (its
source and the quoted figure in the row). The prediction uses the row's own flags; nothing in the
model is fitted to these figures (docs/advise.md: where each constant comes from). A row whose
setting advise cannot price (a GPU or CPU the source does not name, another engine) is listed as
not priced, with the reason, and counts in no median. `--quick` (for tests, which compare its rows
with the committed page) writes into a fresh temporary folder unless `--out` names a file.
`--cpu-read-share S` asks what if llama.cpp's CPU matmuls streamed at S of the host's read rate.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
from dataclasses import dataclass, replace
from pathlib import Path

from klotski_sim.advise.costs import llama_cpp_costs
from klotski_sim.advise.ktransformers import decode_parts as kt_decode_parts
from klotski_sim.advise.llamacpp import LlamaCppFlags, memory, override_blocks, speed
from klotski_sim.hardware.host_cpu import parse_cpu
from klotski_sim.hardware.profile import load_profile
from klotski_sim.workload.gguf import gguf_sizes
from klotski_sim.workload.model import get_model

KT_TUTORIAL = "kvcache-ai/ktransformers doc/en/DeepseekR1_V3_tutorial.md @95009ea6"


@dataclass(frozen=True)
class Row:
    """One published run. `tg`: generated tok/s; `tg_kind`: "tg" or "avg" (an average that includes
    prompt processing: the true tg is higher, so the row is a lower bound)."""

    label: str
    source: str
    engine: str  # llama.cpp | ktransformers
    model: str
    file_type: str
    gpu: str  # a profile, or "" where the source does not say
    cpu: str  # a preset or spec, or "" where the source does not say
    ram_gib: float
    tg: float
    n_cpu_moe: int = 0
    ctx: int = 4096
    ubatch: int = 512
    depth: int = 64  # KV depth the tg was measured at (tg128: 64 on average)
    tg_kind: str = "tg"
    experts_per_token: int | None = None  # KTransformers' fewer-experts runs
    unpriced: str = ""  # why advise cannot price it
    pp: float = 0.0  # prompt tok/s where published (llama.cpp rows), over `prompt` tokens
    prompt: int = 512
    override: str = ""  # the run's -ot


ROWS = (
    Row(
        "Qwen3-30B-A3B Q4_K_M, RTX 2080 8GB, i9-10900X quad DDR4, --n-cpu-moe 36",
        'AlexsJones/llmfit PR #755: "-ngl 99 --n-cpu-moe 36 ... Pure generation speed measured by the server itself is '
        '36.7 tok/s" (host: "measured ~102 GB/s quad-channel DDR4"; PR #775: "62 GB RAM", context 4096)',
        "llama.cpp", "qwen3-30b-a3b", "Q4_K_M", "rtx2080", "cores=10,isa=avx512,bw=102,ram=62", 62, 36.7, n_cpu_moe=36,
    ),
    Row(
        "gpt-oss-20b MXFP4, RTX 2080 8GB, i9-10900X quad DDR4, --n-cpu-moe 12",
        'AlexsJones/llmfit PR #775: "gpt-oss-20B (MoE, 3.6B active) | 36.4 | --n-cpu-moe 12" (llmfit bench average, '
        "which includes prompt processing: PR #755; context 4096)",
        "llama.cpp", "gpt-oss-20b", "MXFP4_MOE", "rtx2080", "cores=10,isa=avx512,bw=102,ram=62", 62, 36.4, n_cpu_moe=12, tg_kind="avg",
    ),
    Row(
        "gpt-oss-120b (MXFP4 experts), RTX 5090, Ryzen 9 9900X, 64 GB DDR5-5600, 22 blocks' experts on the CPU",
        "kvcache-ai/ktransformers doc/en/kt-kernel/GPT-OSS-120B-Kernel-Work.md @1f634203: llama-server -fit on, "
        '"22 layers overflowing (MoE expert weights spill to CPU via mmap)", -ub 2048, context 20,480 a slot x 2, '
        '"Generation speed (single) | 44.2 t/s" (the Q4_K_M file of 60 GB keeps the experts in MXFP4)',
        "llama.cpp", "gpt-oss-120b", "MXFP4_MOE", "rtx5090", "ryzen-9-9900x", 64, 44.2, n_cpu_moe=22, ctx=40960,
        ubatch=2048,
    ),
    *(
        Row(
            f"Qwen3-30B-A3B Q4_K_M, Quadro RTX 5000, i9-14900K (6 P-cores, VM), DDR5-{mts}, --n-cpu-moe {n}",
            "GoodOlClint/homelab docs/llm-bench-results.md @1d6ce6e8 (llama-bench -ngl 99 -fa 1 -n 128, threads 6): "
            f'"| qwen3moe 30B.A3B Q4_K - Medium | 17.28 GiB | 30.53 B | CUDA | 99 | {n} | 1 | tg128 | {tg} |"; host '
            '"i9-14900K, 128 GB non-ECC at 2DPC" (docs/decisions/0056-...md @4e261876), memory at JEDEC 4000 or 4800 MT/s',
            "llama.cpp", "qwen3-30b-a3b", "Q4_K_M", "quadro-rtx5000", f"cores=6,isa=avx2,channels=2,mts={mts}", 128, tg,
            n_cpu_moe=n,
            pp=pp,
        )
        for mts, n, tg, pp in (
            (4000, 40, 37.02, 264.92), (4000, 24, 50.86, 373.11), (4000, 16, 62.90, 487.27),
            (4800, 40, 44.95, 269.16), (4800, 24, 60.26, 378.81), (4800, 16, 73.01, 496.98),
        )
    ),
    Row(
        "gpt-oss-120b MXFP4, RTX 4070, i5-12600K (6 P-cores), 64 GB DDR5-5867, --n-cpu-moe 31, llama-server",
        "carteakey/carteakey.dev 2025-09-21-optimizing-gpt-oss-120b-local-inference.md @fddd48cf: --n-cpu-moe 31 "
        '--n-gpu-layers 99 --ctx-size 24576 -ub 2048 --cpu-range 0-5 -fa on; "| TG (tps) | ... | 10.95 |", '
        '"| Prompt tokens | ... | 5501 |", "| Eval tokens | ... | 1968 |"; RAM "DDR5-5867 (4x16 GB)" (carteakey/lllms '
        "docs/bench-runbook.md @827b9607)",
        "llama.cpp", "gpt-oss-120b", "MXFP4_MOE", "rtx4070", "cores=6,isa=avx2,channels=2,mts=5867", 64, 10.95,
        n_cpu_moe=31, ctx=24576, ubatch=2048, depth=6485,
    ),
    Row(
        "gpt-oss-120b MXFP4, RTX 4070, i5-12600K, 64 GB DDR5-5867, experts of blocks 5-35 on the CPU, llama-bench",
        "carteakey/lllms docs/bench-results.md @827b9607 (512pp + 128tg, 10 threads, FA=1, no-mmap): "
        '"| partial-cpu blk 5+ on CPU | default | 37 | 427.92 | 23.36 |" (-ot blk 5..35 ffn_*_exps=CPU, -ngl 37: '
        "its pattern as given)",
        "llama.cpp", "gpt-oss-120b", "MXFP4_MOE", "rtx4070", "cores=10,isa=avx2,channels=2,mts=5867", 64, 23.36,
        pp=427.92, override=r"blk\.(5|[6-9]|[0-9][0-9]|[0-9][0-9][0-9])\.ffn_(up|down|gate)_(ch|)exps=CPU",
    ),
    Row(
        "DeepSeek-R1 Q4_K_M, RTX 4090, EPYC 9274F (24 cores), 12x DDR5-4800 (230 GB/s measured), KTransformers",
        'kvcache-ai/ktransformers#587: "AMD EPYC 9274F 24-Core ... DDR5 RDIMM 4800, 12根内存 ... RTX 4090", --cpu_infer 22, '
        '"Q4_K_M ... prefill 63.57..., decode 12.137..."; the same host\'s Intel MLC: "实测出来只有230GB左右" (a shared server)',
        "ktransformers", "deepseek-v3", "Q4_K_M", "rtx4090", "cores=24,isa=avx512,channels=12,mts=4800,bw=230", 576,
        12.14, depth=600,
    ),
    *(
        Row(
            f"DeepSeek-R1 4-bit (taken as Q4_K_M), RTX 4090, EPYC 9654 (84 cores used), 12x DDR5-4800, {ctx} context, "
            "KTransformers",
            'kvcache-ai/ktransformers#314: "CPU: AMD EPYC 9654 96-core x1 / RAM: 64G 4800MHz DDR5 x12 / GPU: RTX 4090 24G '
            'x1 / ... 推理时调用84核心 / 1k上下文Decode速度: 14tps / 10k上下文Decode速度: 10tps" (the post names the model '
            '"DeepSeek-R1-671B-4bit", not its file: KTransformers\' 4-bit R1 is its tutorial\'s Q4_K_M GGUF)',
            "ktransformers", "deepseek-v3", "Q4_K_M", "rtx4090", "cores=84,isa=avx512,channels=12,mts=4800", 768, tg,
            depth=ctx,
        )
        for ctx, tg in ((1000, 14.0), (10000, 10.0))
    ),
    Row(
        "DeepSeek-R1 Q4_K_M, RTX 4090, 4x Xeon Platinum 8280 (6x DDR4-3200 each), KTransformers",
        'kvcache-ai/ktransformers#806: "Xeon(R) Platinum 8280 ... Core(s) per socket: 28, Socket(s): 4 ... each socket '
        'with 6xDDR4-3200", --cpu_infer 65, "eval rate: 4.025818136519449 tokens/s" (1000 tokens)',
        "ktransformers", "deepseek-v3", "Q4_K_M", "rtx4090", "", 1536, 4.03, depth=500,
        unpriced="four sockets with NUMA not set up (a reply in the thread says so): how far each socket reads another's "
        "DRAM is not known",
    ),
    Row(
        "gpt-oss-120b MXFP4, --n-cpu-moe 36, i9-14900K, 64 GB",
        'gokawiil.com/article/74814 (a r/LocalLLaMA post): "--n-cpu-moe 36 ... about 8GB [on the GPU] ... eval time '
        '... 25.62 tokens per second"',
        "llama.cpp", "gpt-oss-120b", "MXFP4_MOE", "", "", 64, 25.62, n_cpu_moe=36,
        unpriced="the GPU and the RAM's type and speed are not stated",
    ),
    Row(
        "gpt-oss-120b, RTX 3090, EPYC 7343, 64 GB DDR4-3200, --n-cpu-moe 27",
        'hardware-corner.net/gpt-oss-offloading-moe-layers: "--n-cpu-moe 27 ... 85 tokens 48.49 t/s 1.81 t/s"',
        "llama.cpp", "gpt-oss-120b", "MXFP4_MOE", "rtx3090", "epyc-7343", 64, 1.81, n_cpu_moe=27,
        unpriced="the model (about 60 GiB) and the host's 64 GB leave the page cache short: the run pages from disk",
    ),
    Row(
        "gpt-oss-120b, RTX 4080, Threadripper PRO 5975WX, -ot exps=CPU (ik_llama.cpp)",
        'ikawrakow/ik_llama.cpp PR #829: "-ngl 100 -ot exps=CPU ... | 4096 | 1024 | 0 | 3.903 | 1049.37 | 41.022 | 24.96 |"',
        "ik_llama.cpp", "gpt-oss-120b", "MXFP4_MOE", "", "threadripper-pro-5975wx", 0, 24.96,
        unpriced="ik_llama.cpp, a fork with its own CPU kernels; advise prices mainline llama.cpp",
    ),
    Row(
        "DeepSeek-V3 Q4_K_M, RTX 4090D, one Xeon Gold 6454S (8x DDR5-4800), 8 experts",
        f'{KT_TUTORIAL}, V0.2 table: "Single socket Ktrans (8 experts) ... Decode token/s ... 8.73" (500-token prompt)',
        "ktransformers", "deepseek-v3", "Q4_K_M", "rtx4090", "xeon-gold-6454s", 1024, 8.73, depth=550,
    ),
    Row(
        "DeepSeek-V3 Q4_K_M, RTX 4090D, two Xeon Gold 6454S (16x DDR5-4800), 8 experts",
        f'{KT_TUTORIAL}, V0.2 table: "Dual socket Ktrans (8 experts) ... 12.208"',
        "ktransformers", "deepseek-v3", "Q4_K_M", "rtx4090", "2x-xeon-gold-6454s", 1024, 12.208, depth=550,
    ),
    Row(
        "DeepSeek-V3 Q4_K_M, RTX 4090D, one Xeon Gold 6454S, 6 experts",
        f'{KT_TUTORIAL}, V0.2 table: "Single socket Ktrans (6 experts) ... 10.303"',
        "ktransformers", "deepseek-v3", "Q4_K_M", "rtx4090", "xeon-gold-6454s", 1024, 10.303, depth=550,
        experts_per_token=6,
    ),
    Row(
        "DeepSeek-V3 Q4_K_M, RTX 4090D, two Xeon Gold 6454S, 6 experts",
        f'{KT_TUTORIAL}, V0.2 table: "Dual socket Ktrans (6 experts) ... 13.69"',
        "ktransformers", "deepseek-v3", "Q4_K_M", "rtx4090", "2x-xeon-gold-6454s", 1024, 13.69, depth=550,
        experts_per_token=6,
    ),
    Row(
        "DeepSeek-V3 Q4_K_M, RTX 4090D, two Xeon Gold 6454S, llama.cpp (8 experts)",
        f'{KT_TUTORIAL}, V0.2 table: "llama.cpp (8 experts) ... 4.51"',
        "llama.cpp", "deepseek-v3", "Q4_K_M", "rtx4090", "2x-xeon-gold-6454s", 1024, 4.51,
        unpriced="its llama.cpp flags are not stated",
    ),
)  # fmt: skip


def row_flags(row: Row) -> LlamaCppFlags:
    """The run's llama.cpp flags."""
    blocks = override_blocks(get_model(row.model), row.override) if row.override else frozenset()
    return LlamaCppFlags(
        n_cpu_moe=row.n_cpu_moe, ctx=row.ctx, ubatch=row.ubatch, batch=max(2048, row.ubatch), cpu_expert_blocks=blocks,
        override=row.override,
    )  # fmt: skip


def predict_prompt(row: Row) -> float:
    """The row's predicted prompt tok/s (llama.cpp rows with a published pp)."""
    model = get_model(row.model)
    gpu, host = load_profile(row.gpu), parse_cpu(row.cpu, row.ram_gib)
    flags = row_flags(row)
    sizes = gguf_sizes(model, row.file_type)
    return speed(model, sizes, flags, gpu, host, llama_cpp_costs(gpu, host), prompt=row.prompt).prompt_tok_s


def predict(row: Row, cpu_read_share: float = 1.0) -> tuple[float, str]:
    """The row's predicted tok/s and where its time goes (one line)."""
    model = get_model(row.model)
    sizes = gguf_sizes(model, row.file_type)
    gpu = load_profile(row.gpu)
    host = parse_cpu(row.cpu, row.ram_gib)
    costs = replace(llama_cpp_costs(gpu, host), cpu_read_share=cpu_read_share)
    if row.engine == "ktransformers":
        parts = kt_decode_parts(model, sizes, gpu, host, costs, row.depth, row.experts_per_token)
    else:
        flags = row_flags(row)
        held = memory(model, sizes, flags)
        if held.gpu > gpu.gpu.usable_bytes:
            return float("nan"), f"does not fit: GPU {held.gpu / 2**30:.1f} GiB > {gpu.gpu.usable_bytes / 2**30:.1f}"
        parts = speed(model, sizes, flags, gpu, host, costs, generated=2 * row.depth).parts
    total = sum(parts.values())
    return 1 / total, ", ".join(f"{k} {v * 1e3:.1f}" for k, v in parts.items()) + " ms"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", help="the page to write (default: docs/fidelity-llamacpp.md)")
    parser.add_argument("--quick", action="store_true", help="write into a fresh temporary folder (tests)")
    parser.add_argument("--cpu-read-share", type=float, default=1.0, help="a what-if: llama.cpp's CPU read share")
    args = parser.parse_args()
    if args.out is None:
        args.out = Path(tempfile.mkdtemp()) / "fidelity-llamacpp.md" if args.quick else "docs/fidelity-llamacpp.md"
    lines = [
        "# advise against published llama.cpp and KTransformers runs",
        "",
        "Generated by `python experiments/fidelity_llamacpp.py` (do not edit by hand). Each row: a published",
        "run of a MoE model with its experts on the CPU, its generation tok/s, and what `klotski-sim advise`'s",
        "model predicts for that run's own model file, GPU, CPU, RAM and flags. Error = predicted / measured - 1.",
        "An `avg` row's figure includes prompt processing (a lower bound on generation): it is listed, not in",
        "the median. docs/advise.md says where every constant comes from; none is fitted to these rows.",
        "",
        "| run | engine | measured tok/s | predicted | error | where a token's time goes |",
        "|---|---|---:|---:|---:|---|",
    ]
    errors = []
    unpriced = []
    refused = 0
    by_engine: dict[str, list[float]] = {}
    for row in ROWS:
        if row.unpriced:
            unpriced.append(row)
            continue
        value, parts = predict(row, args.cpu_read_share)
        kind = " (avg)" if row.tg_kind == "avg" else ""
        if value != value:  # (the memory model refuses a placement the run had: a miss of its own)
            refused += 1
            lines.append(f"| {row.label} | {row.engine} | {row.tg:.2f}{kind} | refused | - | {parts} |")
            continue
        error = value / row.tg - 1
        if row.tg_kind == "tg":
            errors.append(error)
            by_engine.setdefault(row.engine, []).append(error)
        lines.append(f"| {row.label} | {row.engine} | {row.tg:.2f}{kind} | {value:.2f} | {error:+.0%} | {parts} |")
    prompts = [row for row in ROWS if row.pp and not row.unpriced]
    pp_errors = [predict_prompt(row) / row.pp - 1 for row in prompts]
    pp_summary = (
        f"prompt tok/s, {len(pp_errors)} rows with a published pp{prompts[0].prompt if prompts else ''}: median "
        f"|error| {statistics.median(abs(e) for e in pp_errors):.0%}"
        if pp_errors
        else "no prompt rows"
    )
    lines += [
        "",
        f"Prompt processing ({pp_summary}):",
        "",
        "| run | measured pp tok/s | predicted | error |",
        "|---|---:|---:|---:|",
    ]
    lines += [
        f"| {row.label} | {row.pp:.2f} | {row.pp * (1 + e):.2f} | {e:+.0%} |" for row, e in zip(prompts, pp_errors)
    ]
    lines += ["", "Sources:", ""]
    lines += [f"- {row.label}: {row.source}" for row in ROWS if not row.unpriced]
    lines += ["", "Not priced:", ""]
    lines += [f"- {row.label} ({row.engine}, {row.tg} tok/s): {row.unpriced}. Source: {row.source}" for row in unpriced]
    median = statistics.median(abs(e) for e in errors) if errors else float("nan")
    summary = f"median |error| of generation tok/s over {len(errors)} priced tg rows: {median:.0%}"
    within = sum(abs(e) <= 0.2 for e in errors)
    engines = "; ".join(
        f"{engine}: {len(e)} rows, median {statistics.median(abs(x) for x in e):.0%}" for engine, e in by_engine.items()
    )
    detail = (
        f"{within} of {len(errors)} within 20%; {engines}; {refused} run(s) the memory model refuses although "
        f"they ran; {len(unpriced)} not priced"
    )
    lines[1:1] = ["", f"**{summary}** ({detail})"]
    Path(args.out).write_text("\n".join(lines) + "\n")
    print(summary)
    print(detail)
    print(pp_summary)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
