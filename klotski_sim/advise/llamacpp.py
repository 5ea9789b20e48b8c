"""llama.cpp running a GGUF MoE model on one GPU and the host CPU, as it places and runs it.

Placement (llama.cpp `common/arg.cpp`, `src/llama-model.cpp`):
- `-ngl N` puts the last N blocks on the GPU (`i_gpu_start = n_layer - N`), and the output head
  too when N exceeds the block count; the token embeddings stay on the CPU (GET_ROWS is never
  offloaded);
- `--n-cpu-moe N` keeps the routed experts (`blk.i.ffn_{up,down,gate}_exps`) of blocks 0..N-1 in
  host memory (the regex `blk\\.i\\.ffn_(up|down|gate)_(ch|)exps` for each i < N): it counts blocks,
  so a model's first dense blocks use up N without moving anything;
- the KV cache sits with its block (`model.dev_layer(il)`), `ctx x (K + V widths)` cells of the
  cache type (`-ctk/-ctv`, f16 by default), whatever `--n-cpu-moe` says.

Decode, one sequence, token by token: the GPU reads its blocks' weights, the k experts each token
uses in the blocks whose experts it holds, and the KV cache; the CPU reads the k used experts of the
blocks it holds them for. Each such block hands its hidden state to the CPU and takes the result
back (two backend splits). So a token costs the GPU's bytes over its bandwidth, the CPU's over its
read bandwidth, and the fixed costs: the CPU's graph nodes (each a barrier of its thread pool), the
splits, and the GPU's nodes (`LlamaCppCosts`).

Prompt processing in ubatches of `-ub` tokens: with op offload (default; `--no-op-offload` turns it
off) a ubatch of at least `OP_OFFLOAD_MIN_BATCH` tokens runs a CPU-resident expert matmul on the GPU
(ggml-cuda.cu `ggml_backend_cuda_device_offload_op`: `get_op_batch_size(op) >= 32`), which first
copies over PCIe, from pageable (mmap'd) memory, the layer's experts that the ubatch uses (ggml's
scheduler copies only those). So a ubatch costs the copies of every CPU-held layer's used experts
plus the GPU's compute of the ubatch; a larger `-ub` amortises the copies (why users raise it).
"""

from __future__ import annotations

import math
import re
import shlex
from collections.abc import Mapping
from dataclasses import dataclass, field

from klotski_sim.hardware.host_cpu import HostCpu
from klotski_sim.hardware.profile import HardwareProfile
from klotski_sim.util.errors import UsageError
from klotski_sim.util.terminal import one_line
from klotski_sim.util.timelimit import time_limit
from klotski_sim.workload.gguf import GGML_TYPES, GgufSizes
from klotski_sim.workload.model import ModelSpec

OP_OFFLOAD_MIN_BATCH = 32  # ggml-cuda.cu: GGML_OP_OFFLOAD_MIN_BATCH's default
# The GPU's compute buffer, reserved for the worst ubatch (llama-context.cpp sizes it by -ub): ~250 MiB
# at -ub 512 (GoodOlClint/homelab docs/llm-bench-results.md: "~250 MiB compute buffers", Qwen3.6-35B-A3B),
# taken to grow with the ubatch.
COMPUTE_BUFFER_BYTES = 250 * 2**20
COMPUTE_BUFFER_UBATCH = 512
CACHE_TYPES = ("F16", "BF16", "Q8_0", "Q4_0")  # -ctk / -ctv values advise prices (arg.cpp kv_cache_types)


@dataclass(frozen=True)
class LlamaCppCosts:
    """llama.cpp's fixed costs, beside the bytes and FLOPs: each a component measurement (`sources`)."""

    cpu_node_s: float  # one ggml CPU graph node: its thread pool's barrier
    split_s: float  # one hand-over between the GPU and CPU backends: a synchronisation and a small copy
    gpu_node_s: float  # one GPU graph node in decode (a kernel launch, inside a CUDA graph where possible)
    sources: tuple[str, ...] = ()
    # of the host's read rate, what ggml's CPU matmuls stream weights at (1: the read rate itself;
    # a what-if, experiments/fidelity_llamacpp.py --cpu-read-share)
    cpu_read_share: float = 1.0
    # bytes/s of weights one CPU thread's vec_dot processes, by ggml type (a type absent: DRAM-bound)
    cpu_thread_rates: Mapping[str, float] = field(default_factory=dict)


# ggml graph nodes per block in decode (llama-graph.cpp build_attn / build_moe_ffn): attention —
# norm, mul, q/k/v matmuls, reshapes, two RoPEs, attention, output matmul, residual add; a dense
# FFN — norm, mul, gate and up matmuls, the activation, down; the MoE FFN — norm, mul, router
# matmul, softmax, top-k (argsort, view, get_rows), then where the experts lie the gate, up and
# down mul_mat_id (each with one more barrier inside on the CPU: ggml-cpu.c), the activation, the
# weights' mul and one add per used expert but the first (build_moe_ffn: k + 10 compute nodes).
ATTENTION_NODES = 14
DENSE_NODES = 6
MOE_ROUTER_NODES = 7
MOE_EXPERT_NODES = 5
MUL_MAT_ID_BARRIERS = 3


def expert_nodes(model: ModelSpec, on_cpu: bool) -> int:
    """Nodes (CPU: barriers) of one block's routed experts where they lie."""
    return MOE_EXPERT_NODES + model.top_k - 1 + (MUL_MAT_ID_BARRIERS if on_cpu else 0)


@dataclass(frozen=True)
class LlamaCppFlags:
    """A llama.cpp command's placement and batching flags."""

    n_cpu_moe: int = 0  # --n-cpu-moe
    n_gpu_layers: int = 999  # -ngl
    ctx: int = 4096  # -c
    cache_type: str = "F16"  # -ctk and -ctv
    ubatch: int = 512  # -ub
    batch: int = 2048  # -b
    threads: int = 0  # -t (0: the CPU's cores)
    op_offload: bool = True  # --no-op-offload turns it off
    # -ot: the blocks whose routed experts an --override-tensor pattern keeps on the CPU (with
    # --n-cpu-moe's first blocks), and the pattern as given
    cpu_expert_blocks: frozenset[int] = frozenset()
    override: str = ""

    def check(self, model: ModelSpec) -> None:
        if not 0 <= self.n_cpu_moe <= model.num_layers:
            raise UsageError(f"--n-cpu-moe {self.n_cpu_moe}: from 0 to {model.num_layers} ({model.name}'s blocks)")
        if self.n_gpu_layers < 0:
            raise UsageError(f"-ngl {self.n_gpu_layers}: must be 0 or more")
        if self.cache_type not in CACHE_TYPES:
            raise UsageError(f"-ctk/-ctv {self.cache_type}: one of {', '.join(CACHE_TYPES)}")
        if not 1 <= self.ubatch <= self.batch:
            raise UsageError(f"-ub {self.ubatch}: from 1 to -b ({self.batch})")
        if self.ctx < 1:
            raise UsageError(f"-c {self.ctx}: must be positive")

    def first_gpu_block(self, model: ModelSpec) -> int:
        """llama-model.cpp: `i_gpu_start = std::max((int) hparams.n_layer - n_gpu_layers, (int) 0)`."""
        return max(0, model.num_layers - self.n_gpu_layers)

    def output_on_gpu(self, model: ModelSpec) -> bool:
        return self.n_gpu_layers > model.num_layers

    def experts_on_gpu(self, model: ModelSpec, layer: int) -> bool:
        return layer >= self.first_gpu_block(model) and layer >= self.n_cpu_moe and layer not in self.cpu_expert_blocks

    def command(self, model_file: str, tool: str = "llama-server", prompt: int = 512, generated: int = 128) -> str:
        """The flags as a `llama-server` (or `llama-bench`, timing `prompt` and `generated` tokens) command line."""
        parts = [tool, "-m", model_file, "-ngl", str(self.n_gpu_layers)]
        if self.n_cpu_moe:
            parts += ["--n-cpu-moe", str(self.n_cpu_moe)]
        if self.override:
            parts += ["-ot", shlex.quote(self.override)]
        if tool == "llama-bench":
            parts += ["-p", str(prompt), "-n", str(generated), "-ub", str(self.ubatch), "-fa", "1"]
        else:
            parts += ["-c", str(self.ctx), "-fa", "on", "-ub", str(self.ubatch), "-b", str(self.batch)]
        if self.cache_type != "F16":
            parts += ["-ctk", self.cache_type.lower(), "-ctv", self.cache_type.lower()]
        if self.threads:
            parts += ["-t", str(self.threads)]
        if not self.op_offload:
            # (llama-server's flag; llama-bench's own spelling is not advised: the line says so)
            parts.append("--no-op-offload" if tool != "llama-bench" else "# and op offload off, as priced")
        return " ".join(parts)


def one_copy_rate(host: HostCpu) -> float:
    """What llama.cpp's CPU threads read its one copy of the weights at: one NUMA node's share of the
    host's rate (the other nodes' threads read it across the sockets' link, the cost KTransformers
    copies the experts onto every node to avoid: DeepseekR1_V3_tutorial.md)."""
    return host.read_bandwidth / host.numa


def kv_cells(model: ModelSpec, layer: int, ctx: int, ubatch: int) -> int:
    """Cells a block's cache holds: `ctx`, or a sliding-window block's window and one ubatch
    (llama.cpp's iSWA cache; gpt-oss's even blocks)."""
    if model.sliding_window and layer % 2 == 0:
        return min(ctx, model.sliding_window + ubatch)
    return ctx


EXPERT_TENSORS = ("ffn_gate_exps", "ffn_up_exps", "ffn_down_exps")
OVERRIDE_MATCH_S = 2.0  # the most an -ot's patterns may take to match a model's tensor names
MAX_OVERRIDE_CHARS = 4096  # (llama.cpp users' patterns are a line; longer is a paste gone wrong)
OVERRIDE_BUFFERS = ("CPU", "CUDA0")  # what -ot may name with one GPU: the host's buffer and the GPU's


def override_blocks(model: ModelSpec, value: str) -> frozenset[int]:
    """The blocks whose routed experts `-ot VALUE` keeps on the CPU. `VALUE` is llama.cpp's
    `PATTERN=BUFFER[,PATTERN=BUFFER...]` (arg.cpp parse_tensor_buffer_overrides); each tensor takes
    the first pattern that `regex_search`es its name (llama-model.cpp), here `blk.i.ffn_*_exps.weight`
    and the other tensors' names. Refused: a pattern that moves other tensors, or some of a
    block's three expert tensors but not all (advise prices whole blocks' experts)."""
    shown = value if len(value) <= 80 else value[:77] + "..."
    if len(value) > MAX_OVERRIDE_CHARS:
        raise UsageError(f"-ot {shown}: {len(value):,} characters; at most {MAX_OVERRIDE_CHARS:,}")
    if one_line(value) != value:
        raise UsageError(f"-ot {shown!r}: a control character (a newline?) in the patterns")
    rules: list[tuple[re.Pattern[str], str]] = []
    for part in value.split(","):
        pattern, eq, buffer = part.rpartition("=")
        if not eq or not pattern or not buffer:
            raise UsageError(
                f"-ot {shown}: {part[:80]!r} is not PATTERN=BUFFER (e.g. 'blk\\.(1[0-9])\\.ffn_.*_exps=CPU')"
            )
        if buffer not in OVERRIDE_BUFFERS:
            raise UsageError(
                f"-ot {shown}: buffer {buffer[:20]!r}: one of {', '.join(OVERRIDE_BUFFERS)} (llama.cpp's names of "
                f"the host's and the one GPU's buffers)"
            )
        try:
            rules.append((re.compile(pattern), buffer))
        except (re.error, RecursionError, OverflowError) as bad:
            why = bad if isinstance(bad, re.error) else "nested too deeply"
            raise UsageError(f"-ot {shown}: {pattern[:80]!r} is not a regular expression ({why})") from None

    def on_cpu(name: str) -> bool:
        return next((buffer == "CPU" for pattern, buffer in rules if pattern.search(name)), False)

    others = ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate_inp", "ffn_norm", "attn_norm")
    blocks: set[int] = set()

    def classify(layer: int) -> None:
        moved = [on_cpu(f"blk.{layer}.{tensor}.weight") for tensor in EXPERT_TENSORS] if model.is_moe(layer) else []
        if any(moved) and not all(moved):
            raise UsageError(
                f"-ot {shown}: moves some of block {layer}'s expert tensors; advise prices whole blocks' experts"
            )
        if any(on_cpu(f"blk.{layer}.{tensor}.weight") for tensor in others):
            raise UsageError(
                f"-ot {shown}: moves block {layer}'s non-expert tensors; advise prices routed experts on the CPU"
            )
        if all(moved) and moved:
            blocks.add(layer)

    slow = UsageError(
        f"-ot {shown}: matching {model.name}'s tensor names took more than {OVERRIDE_MATCH_S:g} s (a pattern that "
        f"backtracks without end, as nested repeats like (.*.*)* do): refused"
    )
    with time_limit(OVERRIDE_MATCH_S, slow):
        for layer in range(model.num_layers):
            classify(layer)
    return frozenset(blocks)


def kv_bytes_per_cell(model: ModelSpec, cache_type: str) -> float:
    """One token's K and V in one block (MLA: its latent and RoPE key) in the cache type."""
    kind = GGML_TYPES[cache_type]
    widths = model.kv_bytes_per_token() / model.dtype_bytes  # (values a token stores a block)
    return widths * kind.block_bytes / kind.block


@dataclass(frozen=True)
class Memory:
    """Bytes each side holds under a placement."""

    gpu_weights: float
    gpu_kv: float
    gpu_compute: float  # the largest activations of a ubatch (the logits dominate)
    host_weights: float
    host_kv: float

    @property
    def gpu(self) -> float:
        return self.gpu_weights + self.gpu_kv + self.gpu_compute

    @property
    def host(self) -> float:
        return self.host_weights + self.host_kv


def memory(model: ModelSpec, sizes: GgufSizes, flags: LlamaCppFlags) -> Memory:
    """What the GPU and the host hold (weights, KV cache, the ubatch's logits buffer in fp32)."""
    start = flags.first_gpu_block(model)
    gpu_w = host_w = 0.0
    for layer in range(model.num_layers):
        rest, experts = sizes.block_rest[layer], sizes.experts[layer]
        if layer >= start:
            gpu_w += rest
        else:
            host_w += rest
        if flags.experts_on_gpu(model, layer):
            gpu_w += experts
        else:
            host_w += experts
    head_on_gpu = flags.output_on_gpu(model)
    gpu_w += sizes.output if head_on_gpu else 0
    host_w += sizes.token_embd + (0 if head_on_gpu else sizes.output)
    cell = kv_bytes_per_cell(model, flags.cache_type)
    kv = [cell * kv_cells(model, layer, flags.ctx, flags.ubatch) for layer in range(model.num_layers)]
    compute = COMPUTE_BUFFER_BYTES * flags.ubatch / COMPUTE_BUFFER_UBATCH
    return Memory(gpu_w, sum(kv[start:]), compute, host_w, sum(kv[:start]))


@dataclass(frozen=True)
class Speed:
    """Predicted speeds of one placement and where a decode token's time goes."""

    decode_s: float  # one generated token
    parts: dict[str, float]  # decode_s by part: gpu bytes, cpu bytes, cpu nodes, splits, gpu nodes
    prompt_s: float | None  # the whole prompt (None: not priced, `prompt_seconds`)
    prompt_tokens: int

    @property
    def generation_tok_s(self) -> float:
        return 1.0 / self.decode_s

    @property
    def prompt_tok_s(self) -> float | None:
        return None if self.prompt_s is None else self.prompt_tokens / self.prompt_s


def decode_parts(
    model: ModelSpec,
    sizes: GgufSizes,
    flags: LlamaCppFlags,
    gpu: HardwareProfile,
    host: HostCpu,
    costs: LlamaCppCosts,
    depth: int,
) -> dict[str, float]:
    """Seconds of one decode token at KV depth `depth`, by part (module docstring)."""
    start, k = flags.first_gpu_block(model), model.top_k
    gpu_bytes = cpu_bytes = 0.0
    cpu_compute = 0.0  # seconds the CPU's threads take to process the experts' weights (type by type)
    threads = flags.threads or host.cores
    cpu_nodes = gpu_nodes = splits = 0
    for layer in range(model.num_layers):
        used = k * sizes.expert_bytes(layer) if model.is_moe(layer) else 0.0
        moe = model.is_moe(layer)
        if layer >= start:
            gpu_bytes += sizes.block_rest[layer]
            gpu_nodes += ATTENTION_NODES + (MOE_ROUTER_NODES if moe else DENSE_NODES)
            if flags.experts_on_gpu(model, layer):
                gpu_bytes += used
                gpu_nodes += expert_nodes(model, False) if moe else 0
            elif moe:
                cpu_bytes += used
                cpu_compute += _expert_compute(model, sizes, layer, costs, threads)
                cpu_nodes += expert_nodes(model, True)
                splits += 2  # (the hidden state down to the CPU, the experts' output back up)
        else:
            cpu_bytes += sizes.block_rest[layer] + used
            cpu_compute += _expert_compute(model, sizes, layer, costs, threads) if moe else 0.0
            cpu_nodes += ATTENTION_NODES + (MOE_ROUTER_NODES + expert_nodes(model, True) if moe else DENSE_NODES)
    if start > 0:
        splits += 2  # (the blocks on the CPU run first, then hand over to the GPU's)
    head = sizes.output
    gpu_bytes += head if flags.output_on_gpu(model) else 0
    cpu_bytes += 0 if flags.output_on_gpu(model) else head
    cell = kv_bytes_per_cell(model, flags.cache_type)
    read = [cell * kv_cells(model, layer, depth, 0) for layer in range(model.num_layers)]
    gpu_bytes += sum(read[start:])
    cpu_bytes += sum(read[:start])
    gpu_rate = gpu.gpu.memory_bandwidth * gpu.gpu.memory_efficiency
    return {
        "gpu bytes": gpu_bytes / gpu_rate,
        # (the CPU streams its weights and computes on them at once: the slower of the two)
        "cpu bytes": max(cpu_bytes / (one_copy_rate(host) * costs.cpu_read_share), cpu_compute),
        "cpu nodes": cpu_nodes * costs.cpu_node_s,
        "splits": splits * costs.split_s,
        "gpu nodes": gpu_nodes * costs.gpu_node_s,
    }


def _expert_compute(model: ModelSpec, sizes: GgufSizes, layer: int, costs: LlamaCppCosts, threads: int) -> float:
    """Seconds `threads` CPU threads take to process the k used experts of `layer`, type by type
    (a type without a rate: none, it is priced by DRAM alone)."""
    share = model.top_k / model.num_experts
    rates = costs.cpu_thread_rates
    return sum(share * b / (threads * rates[t]) for t, b in sizes.expert_type_bytes[layer] if t in rates)


def prompt_seconds(
    model: ModelSpec,
    sizes: GgufSizes,
    flags: LlamaCppFlags,
    gpu: HardwareProfile,
    host: HostCpu,
    costs: LlamaCppCosts,
    prompt: int,
) -> float | None:
    """Seconds to process a `prompt`-token prompt in ubatches (module docstring); None where a
    ubatch would have the CPU compute its experts (`--no-op-offload`, or fewer than
    OP_OFFLOAD_MIN_BATCH tokens): ggml's CPU matmuls over many tokens are compute-bound, and no
    component rate of them is known here, so those prompts are not priced."""
    start = flags.first_gpu_block(model)
    if start > 0:
        raise UsageError(
            f"-ngl {flags.n_gpu_layers}: advise prices prompts with every block on the GPU (-ngl >= "
            f"{model.num_layers + 1}); blocks on the CPU compute there, which it does not model yet"
        )
    link = gpu.links.pcie_h2d
    rate = link.pageable_bandwidth or link.bandwidth  # (mmap'd weights are pageable)
    flops_rate = gpu.gpu.peak_flops * gpu.gpu.compute_efficiency
    cpu_layers = [layer for layer in model.moe_layers if not flags.experts_on_gpu(model, layer)]
    # (every ubatch runs the whole graph: its nodes' fixed cost is a floor under a short prompt's time)
    graph_nodes = sum(
        ATTENTION_NODES + (MOE_ROUTER_NODES + expert_nodes(model, False) if model.is_moe(layer) else DENSE_NODES)
        for layer in range(model.num_layers)
    )
    total, done = 0.0, 0
    while done < prompt:
        u = min(flags.ubatch, prompt - done)
        if cpu_layers and not (flags.op_offload and u >= OP_OFFLOAD_MIN_BATCH):
            return None
        flops = _ubatch_flops(model, u, done + u)
        # the experts the ubatch's tokens use (k distinct each, drawn independently): only these are
        # copied (ggml-backend.cpp, ggml_backend_sched_compute_splits: "copying only the experts that
        # are used")
        distinct = model.num_experts * (1 - (1 - model.top_k / model.num_experts) ** u)
        used = sum(sizes.expert_bytes(layer) * distinct for layer in cpu_layers)
        total += flops / flops_rate + used / rate + 2 * len(cpu_layers) * costs.split_s + graph_nodes * costs.gpu_node_s
        done += u
    return total


def _ubatch_flops(model: ModelSpec, tokens: int, kv_len: int) -> float:
    """FLOPs of one ubatch of `tokens` tokens of one sequence whose cache then holds `kv_len`: every
    block's attention, router (or dense MLP) and shared experts, its k routed experts a token, and
    the head (ModelSpec's own accounting, as the simulator's ops use it)."""
    blocks = sum(
        model.attention_flops(1, tokens, kv_len)
        + model.gate_flops(tokens, layer)
        + (model.top_k * model.expert_flops(tokens) if model.is_moe(layer) else 0)
        for layer in range(model.num_layers)
    )
    return float(blocks + 2 * tokens * model.vocab_size * model.hidden_size)


def speed(
    model: ModelSpec,
    sizes: GgufSizes,
    flags: LlamaCppFlags,
    gpu: HardwareProfile,
    host: HostCpu,
    costs: LlamaCppCosts,
    prompt: int = 512,
    generated: int = 128,
) -> Speed:
    """llama-bench's pp`prompt` and tg`generated` of one placement (decode timed at the middle of
    the generated tokens' depth, as tg averages over them)."""
    flags.check(model)
    parts = decode_parts(model, sizes, flags, gpu, host, costs, depth=math.ceil(generated / 2))
    return Speed(sum(parts.values()), parts, prompt_seconds(model, sizes, flags, gpu, host, costs, prompt), prompt)
