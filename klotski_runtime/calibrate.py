"""Microbenchmarks -> a HardwareProfile for the machine at hand.

Each op kind is timed on the shapes the policies produce (attention by batch and KV length for
decode, by batch and prompt for prefill; gate, expert FFN, embedding and lm_head by token count)
and stored as the profile's measured table, which the cost model uses inside the measured range.
Links (H2D/D2H pinned and pageable, disk reads) are timed over several sizes and fitted to
`latency + bytes / bandwidth`. The roofline fields (peak FLOP/s, memory bandwidth, per-kernel
overhead) are measured too, for shapes outside the table. Provenance (device, versions, date,
command) goes into the file.
"""

from __future__ import annotations

import datetime as _dt
import os
import platform
import statistics
import sys
import tempfile
import time
from functools import partial
from pathlib import Path
from typing import Any, Callable, Iterable, Mapping

import numpy as np
import pandas as pd
import torch

from klotski_sim.core.cost import op_variant
from klotski_sim.hardware.profile import HardwareProfile, profile_from_dict
from klotski_sim.util.linefit import rate_and_fixed
from klotski_sim.util.machine import cpu_model, machine_load, steal_share
from klotski_sim.workload.model import ModelSpec

from . import kernels
from .executor import ExecutionError, require_cuda
from .kernels import WeightStore
from .threads import compute_threads, cpu_threads

MB = 1 << 20
PROBE_BATCHES, PROBE_GEN = 3, 3  # the dispatch probes' batch count and generation length
LONG_PROBE_S = 0.2  # a probe whose warm-up is at least this long is timed once (Bench.run)


def _timer(device: torch.device) -> Callable[[Callable[[], object], int], float]:
    """The fastest of `repeats` runs of `fn` after one warm-up (a long probe: one run; Bench.run)."""

    def measure(fn: Callable[[], object], repeats: int) -> float:
        bench = Bench(device, repeats)
        row: dict = {}
        bench.add(row, fn)
        bench.run()
        return row["seconds"]

    return measure


class Bench:
    """Probes timed in interleaved rounds: each round runs every probe once, and a probe's
    `seconds` is the fastest of its rounds. On a shared machine a burst of other work then lands
    on one sample of many probes rather than on every sample of one probe, and other work only
    ever adds time: the minimum is what the machine does alone (Python's `timeit` docs: "the
    lowest value gives a lower bound for how fast your machine can run the given code snippet;
    higher values ... are typically ... caused by other processes interfering"). A median kept
    that interference: on a lightly loaded 2-core machine it inflated the expert table by 80%."""

    def __init__(self, device: torch.device, repeats: int) -> None:
        self.device, self.repeats = device, max(1, repeats)
        self.probes: list[tuple[dict, Callable[[], object]]] = []

    def add(self, row: dict, fn: Callable[[], object]) -> dict:
        """Time `fn` into `row["seconds"]` when `run` is called; returns `row`."""
        self.probes.append((row, fn))
        return row

    def _once(self, fn: Callable[[], object]) -> float:
        cuda = self.device.type == "cuda"
        if cuda:
            torch.cuda.synchronize()
        t = time.perf_counter()
        fn()
        if cuda:
            torch.cuda.synchronize()
        return time.perf_counter() - t

    def run(self) -> None:
        # warm-up: first-touch allocation, lazy kernel selection (page faults of a fresh buffer can be
        # a large part of a first run: it is never a sample). A probe whose warm-up lasts LONG_PROBE_S
        # or more is then timed once: its length averages out what repeats are for, and each repeat
        # would cost as long (a bf16 GEMM on a CPU without native bf16: 2.2 s a 1024^3 multiply; its
        # six runs were 13.6 s of a 22.6 s calibration)
        long = [self._once(fn) >= LONG_PROBE_S for _, fn in self.probes]
        samples: list[list[float]] = [[] for _ in self.probes]
        for k in range(self.repeats):
            for i, (_, fn) in enumerate(self.probes):
                if k == 0 or not long[i]:
                    samples[i].append(self._once(fn))
        for (row, _), times in zip(self.probes, samples):
            row["seconds"] = min(times)
        self.probes = []


def _host_memory() -> float:
    return float(kernels.host_memory("MemTotal") or 16e9)


def gpu_section(
    dev: torch.device, peak: float, membw: float, overhead: float, dependency: float, host_sync: float
) -> dict[str, Any]:
    """A profile's `gpu:` fields from the measured roofline and hand-offs, named and sized as CUDA
    says (a CPU "device" holds half of host memory: it shares it with the host store)."""
    if dev.type == "cuda":
        props = torch.cuda.get_device_properties(dev)
        name, memory = props.name, float(props.total_memory)
        reserved = float(torch.cuda.memory_reserved(dev)) + 512 * MB
    else:
        name, memory, reserved = f"CPU ({cpu_model()})", _host_memory() / 2, 0.0
    return {
        "name": name,
        "memory_bytes": memory,
        "reserved_bytes": reserved,
        "peak_flops": peak,
        "memory_bandwidth": membw,
        "compute_efficiency": 1.0,
        "memory_efficiency": 1.0,
        "kernel_overhead_s": overhead,
        "dependency_latency_s": dependency,
        "host_sync_latency_s": host_sync,
        # the CUDA executor issues every stream from one thread; the CPU runtime's streams are threads
        "issue": "serial" if dev.type == "cuda" else "per-stream",
    }


def calibrate(
    spec: ModelSpec,
    device: str = "cpu",
    batch_sizes: Iterable[int] = (1, 2, 4, 8, 16),
    prompt_lens: Iterable[int] = (16, 64, 256),
    kv_lens: Iterable[int] | None = None,
    max_expert_tokens: int = 1024,
    repeats: int = 5,
    dtype: torch.dtype = torch.bfloat16,
    emulate_links: Mapping[str, float] | None = None,
    link_latency_s: float = 0.0,
    command: str = "",
    threads: int | None = None,
    emulate_pageable: Mapping[str, float] | None = None,
    progress: Callable[[str], None] | None = None,
    size_flags: tuple[str, str] = ("--max-expert-tokens", "--batch-sizes x --prompt-lens"),
) -> HardwareProfile:
    """Measure `device` running `spec`'s ops and return a profile with a measured table.
    `threads` sets torch's CPU threads for the measurement (use the executor's setting);
    `progress` is told each phase as it starts (the whole takes a minute or more on a CPU);
    `size_flags`: the caller's flags for the most expert tokens and for the largest batch and
    prompt, which a refusal of sizes too large names."""
    load_before = machine_load()
    started = time.perf_counter()

    def say(phase: str) -> None:
        if progress is not None:
            progress(f"calibrate: {phase} ({time.perf_counter() - started:.0f} s)")

    with cpu_threads(compute_threads(device, threads)):
        profile = _calibrate(
            spec,
            device,
            batch_sizes,
            prompt_lens,
            kv_lens,
            max_expert_tokens,
            repeats,
            dtype,
            emulate_links,
            link_latency_s,
            command,
            emulate_pageable or {},
            say,
            size_flags,
        )
    load_after = machine_load()
    conditions = {
        "load_per_core": round(max(load_before["load_per_core"], load_after["load_per_core"]), 3),
        "steal_share": round(steal_share(load_before, load_after), 4),
        "seconds": round(time.perf_counter() - started, 1),
    }
    return profile.model_copy(update={"provenance": {**profile.provenance, "machine_load": conditions}})


def _calibrate(
    spec: ModelSpec,
    device: str,
    batch_sizes: Iterable[int],
    prompt_lens: Iterable[int],
    kv_lens: Iterable[int] | None,
    max_expert_tokens: int,
    repeats: int,
    dtype: torch.dtype,
    emulate_links: Mapping[str, float] | None,
    link_latency_s: float,
    command: str,
    emulate_pageable: Mapping[str, float],
    say: Callable[[str], None],
    size_flags: tuple[str, str],
) -> HardwareProfile:
    require_cuda(device)
    dev = torch.device(device)
    measure = _timer(dev)
    moe = spec.first_moe_layer  # (DeepSeek's first layers are dense, Llama 4's even ones)
    w = WeightStore.random(spec, layers=moe + 1, dtype=dtype)
    attn = tuple(t.to(dev) for t in w.get("attention", 0))
    gate, *shared = (t.to(dev) for t in w.get("gate", moe))  # the router, then any shared experts
    expert = tuple(t.to(dev) for t in w.get("expert", moe, 0))
    dense_mlp = tuple(t.to(dev) for t in w.get("gate", 0)) if moe else None
    packed = expert if spec.quantised else None
    if packed is not None:  # a quantised expert is dequantised after its copy, then computed in the model dtype
        expert = kernels.dequantise_expert(packed, spec, dtype)
    norm = w.resident["norm1/0"].to(dev)
    embed_t, head_t, final = (w.resident[k].to(dev) for k in ("embed", "lm_head", "final_norm"))
    h = spec.hidden_size
    batch_sizes, prompt_lens = sorted(set(batch_sizes)), sorted(set(prompt_lens))
    kv_lens = sorted(set(kv_lens or [p + d for p in prompt_lens for d in (1, 16)]))
    _check_fits(spec, dev, batch_sizes, prompt_lens, kv_lens, max_expert_tokens, dtype, size_flags)
    # tables named as the schedules' ops are (`attention.fused+qk_norm`, `gate.topk_as_is`: cost.op_variant)
    gate_key = ".".join(filter(None, ("gate", op_variant(spec, "gate"))))
    attention_key = {impl: f"attention.{op_variant(spec, 'attention', impl)}" for impl in kernels.ATTENTION_IMPLS}
    qk = kernels.qk_norms(w.resident, spec, 0)
    qk_norm = (qk[0].to(dev), qk[1].to(dev)) if qk else None
    measured: dict[str, list[dict]] = {k: [] for k in (gate_key, "expert", "embed", "lm_head")}
    for impl in kernels.ATTENTION_IMPLS:
        measured[f"{attention_key[impl]}:decode"] = []
        measured[f"{attention_key[impl]}:prefill"] = []

    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, device=dev, dtype=dtype)

    say("attention")
    bench = Bench(dev, repeats)
    for impl in kernels.ATTENTION_IMPLS:  # each implementation the schedules may ask for
        for bs in batch_sizes:
            x1 = rand(bs, 1, h)
            for kv in kv_lens:
                past = [kernels.kv_chunk(spec, bs, kv - 1, dtype, dev)]
                measured[f"{attention_key[impl]}:decode"].append(
                    bench.add(
                        {"tokens": bs, "kv_len": kv},
                        partial(kernels.attention, x1, attn, norm, past, kv - 1, spec, 1e6, 1e-5, impl, qk_norm),
                    )
                )
            for p in prompt_lens:
                xp = rand(bs, p, h)
                measured[f"{attention_key[impl]}:prefill"].append(
                    bench.add(
                        {"tokens": bs * p, "kv_len": p},
                        partial(kernels.attention, xp, attn, norm, [], 0, spec, 1e6, 1e-5, impl, qk_norm),
                    )
                )
    bench.run()
    token_grid = sorted(
        {1 << i for i in range(int(np.log2(max_expert_tokens)) + 1)}
        | set(batch_sizes)
        | {bs * p for bs in batch_sizes for p in prompt_lens}
    )
    gnorm = w.resident[f"norm2/{moe}"].to(dev)
    if dense_mlp is not None:
        measured["dense_mlp"] = []
    say("gate, embedding and lm_head")
    for tokens in token_grid:
        hs = rand(1, tokens, h)
        forced = np.stack([np.arange(tokens) % spec.num_experts, (np.arange(tokens) + 1) % spec.num_experts], axis=1)[
            :, : spec.top_k
        ].astype(np.int64)
        measured[gate_key].append(
            bench.add(
                {"tokens": tokens},
                partial(
                    kernels.gate_step, hs, gnorm, gate, spec.top_k, 1e-5, forced, tuple(shared), spec.norm_topk_prob
                ),
            )
        )
        if dense_mlp is not None:
            measured["dense_mlp"].append(
                bench.add(
                    {"tokens": tokens},
                    partial(lambda hs: kernels.expert(kernels.rms_norm(hs, gnorm, 1e-5).reshape(-1, h), dense_mlp), hs),
                )
            )
        ids = torch.randint(0, spec.vocab_size, (tokens,)).to(dev)
        measured["embed"].append(bench.add({"tokens": tokens}, partial(kernels.embed, ids, embed_t)))
        if tokens <= max(batch_sizes):
            z = rand(tokens, 1, h)
            measured["lm_head"].append(
                bench.add(
                    {"tokens": tokens}, partial(lambda z: kernels.lm_head(z + z, final, head_t, 1e-5).argmax(-1), z)
                )
            )
    bench.run()
    say("experts")
    for tokens in sorted({1 << i for i in range(int(np.log2(max_expert_tokens)) + 1)}):
        measured["expert"].append(bench.add({"tokens": tokens}, expert_probe(spec, dev, dtype, tokens, expert)))
    bench.run()
    if packed is not None:
        measured["dequant"] = [
            {"tokens": 0, "seconds": measure(lambda: kernels.dequantise_expert(packed, spec, dtype), repeats)}
        ]
    say("the host CPU")
    cpu_section = _measure_host_cpu(spec, w, dtype, repeats, max_expert_tokens, measured)
    say("roofline, links and hand-offs")

    # roofline fields: a big GEMM, a big copy, a tiny kernel. On the CPU the device *is* the host
    # CPU, measured just now with the same GEMM and copy in the same dtype: not measured twice.
    if dev.type == "cpu":
        peak, membw = cpu_section["flops"][cpu_section["compute_dtype"]], cpu_section["memory_bandwidth"]
    else:
        n = 2048
        a, b = rand(n, n), rand(n, n)
        peak = 2 * n**3 / measure(lambda: a @ b, repeats)
        big = rand(16 * MB // 2)
        membw = 2 * big.numel() * big.element_size() / measure(lambda: big.clone(), repeats)
    one = rand(1)
    overhead = measure(lambda: one + one, max(repeats, 20))

    links = _measure_links(dev, measure, repeats, emulate_links or {}, link_latency_s, emulate_pageable)
    dependency_latency = _measure_dependency_latency(dev, max(repeats, 50))
    host_sync = _measure_host_sync(dev, max(repeats, 50)) if dev.type == "cuda" else dependency_latency
    gpu = gpu_section(dev, peak, membw, overhead, dependency_latency, host_sync)
    gpu_name = gpu["name"]
    import transformers

    data: dict[str, Any] = {
        "name": f"calibrated-{device}",
        "description": f"measured by klotski-runtime calibrate on {gpu_name} for {spec.name} shapes",
        "gpu": gpu,
        "links": links,
        "host": {"memory_bytes": _host_memory(), "cpu": cpu_model()},
        "cpu": cpu_section,
        "disk": {"capacity_bytes": float(_disk_capacity())},
        "sources": {
            "measured": "klotski-runtime calibrate (this file's provenance)",
            "gpu.host_sync_latency_s": "CUDA: a small kernel, synchronize, the next kernel (gap between "
            "them); CPU: the host stream thread's wake-up after an event, as gpu.dependency_latency_s",
            "gpu.memory_bytes": "CUDA device properties"
            if dev.type == "cuda"
            else "half of host memory (the CPU 'device' shares it with the host store)",
            "cpu": "measured on the host CPU with torch: a GEMM, a large copy, the executor's CPU expert "
            "(measured['cpu:expert']); op_overhead_s = the probe's expert dispatch cost",
        },
        "measured": measured,
        "provenance": {
            "device": gpu_name,
            "device_kind": dev.type,
            "model_shapes": spec.name,
            "dtype": str(dtype),
            "torch": torch.__version__,
            "cuda": torch.version.cuda,
            "transformers": transformers.__version__,
            "python": sys.version.split()[0],
            "host": platform.node(),
            "date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
            "command": command or " ".join(sys.argv),
            "threads": torch.get_num_threads(),
            "cpu_model": cpu_model(),
            "cpu_capability": torch.backends.cpu.get_cpu_capability(),
            "emulated_links": dict(emulate_links or {}),
        },
    }
    draft = profile_from_dict(data, "calibration")
    say("dispatch probes (small Klotski and FlexGen schedules, executed)")
    overall, by_category, copy_issue = _probe_dispatch(
        spec, draft, dev, dtype, emulate_links or {}, min(batch_sizes), min(prompt_lens)
    )
    data["gpu"]["dispatch_overhead_s"] = overall
    data["gpu"]["dispatch_overhead_by_category"] = by_category
    if copy_issue is not None:
        data["gpu"]["copy_issue_s"] = copy_issue
        data["sources"]["gpu.copy_issue_s"] = (
            "median host time the CUDA executor's issuing thread spent on one copy of the dispatch probes "
            "(from the op's turn to the next op's: its event waits, buffer bookkeeping and the copy call)"
        )
    data["sources"]["gpu.issue"] = (
        "the CUDA executor issues every stream's ops from one host thread (klotski_runtime/executor.py _run_cuda)"
        if dev.type == "cuda"
        else "the CPU runtime runs each stream on a thread of its own (klotski_runtime/executor.py _run_cpu)"
    )
    data["cpu"]["op_overhead_s"] = by_category.get("expert", overall)
    data["sources"]["gpu.dispatch_overhead_s"] = (
        "median (measured - simulated) duration of the compute ops of "
        "small Klotski and FlexGen probe schedules run through the executor "
        f"(2 layers, batch {min(batch_sizes)}, {PROBE_BATCHES} batches, "
        f"prompt {min(prompt_lens)}, {PROBE_GEN} generated; per category "
        "in dispatch_overhead_by_category)"
    )
    data["provenance"]["probe"] = {
        "layers": min(2, spec.num_layers),
        "batch_size": min(batch_sizes),
        "num_batches": PROBE_BATCHES,
        "prompt_len": min(prompt_lens),
        "gen_len": PROBE_GEN,
    }
    return profile_from_dict(data, "calibration")


def probed_expert(w: WeightStore, spec: ModelSpec, dev: torch.device, dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
    """The expert an expert probe computes: expert 0 of the first layer with experts (DeepSeek's first
    layers are dense) on `dev`, in the model dtype (a quantised one dequantised, as after its copy)."""
    stored = tuple(t.to(dev) for t in w.get("expert", spec.first_moe_layer, 0))
    return kernels.dequantise_expert(stored, spec, dtype) if spec.quantised else stored


def expert_probe(
    spec: ModelSpec, dev: torch.device, dtype: torch.dtype, tokens: int, weights: tuple[torch.Tensor, ...]
) -> Callable[[], None]:
    """What the executor does for one expert op over `tokens` tokens: host-side rows, gather,
    SwiGLU, scale, scatter-add. Each token is routed to this expert in one of its top-k slots
    (slot j holds expert j), as a router does: routing every slot to it would compute top_k rows a
    token, and on a CPU whose bf16 matmul reuses no weights (AVX2) time an expert at top_k times
    its cost."""
    z = torch.randn(tokens, spec.hidden_size, device=dev, dtype=dtype)
    gate_w = torch.full((tokens, spec.top_k), 1.0 / spec.top_k, device=dev)
    routed = np.tile(np.arange(spec.top_k, dtype=np.int64), (tokens, 1))
    out = torch.zeros(tokens, spec.hidden_size, device=dev, dtype=dtype)

    def one_expert() -> None:
        rows, slots = kernels.upload(np.stack(np.nonzero(routed == 0)), dev)
        kernels.expert_step(z, gate_w, rows, slots, weights, out)

    return one_expert


def _check_fits(
    spec: ModelSpec,
    dev: torch.device,
    batch_sizes: list[int],
    prompt_lens: list[int],
    kv_lens: list[int],
    max_expert_tokens: int,
    dtype: torch.dtype,
    size_flags: tuple[str, str],
) -> None:
    """Refuse, before any measurement, sizes whose largest tensors the device's memory cannot hold
    (they would fail only once allocated, possibly after minutes of measuring). Counted: an
    expert's intermediate activations at the most tokens any op gets, and an eager attention's
    scores at the longest prompt."""
    item = torch.tensor([], dtype=dtype).element_size()
    tokens = max(max_expert_tokens, batch_sizes[-1] * prompt_lens[-1])
    expert = tokens * (spec.hidden_size * 2 + spec.ffn_size * 3) * item
    scores = batch_sizes[-1] * spec.num_heads * prompt_lens[-1] * max(prompt_lens[-1], kv_lens[-1]) * 4
    need = max(expert, scores)
    have = torch.cuda.get_device_properties(dev).total_memory if dev.type == "cuda" else _host_memory()
    if need > have:
        what = (
            size_flags[0]
            if expert >= scores and max_expert_tokens >= batch_sizes[-1] * prompt_lens[-1]
            else size_flags[1]
        )
        raise ExecutionError(
            f"calibration sizes too large for {dev.type} memory: {what} ({tokens:,} tokens at most, "
            f"prompts up to {prompt_lens[-1]:,}) needs {need / 2**30:,.1f} GiB for one op's tensors, "
            f"the {dev.type} has {have / 2**30:,.1f} GiB"
        )


DTYPE_KEYS = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}
CPU_EXPERT_MAX_TOKENS = 256  # CPU experts serve few tokens; above this the roofline answers
CPU_EXPERT_MAX_SECONDS = 0.25  # ... and above the first token count whose expert takes this long


def _measure_host_cpu(
    spec: ModelSpec,
    w: WeightStore,
    dtype: torch.dtype,
    repeats: int,
    max_expert_tokens: int,
    measured: dict[str, list[dict]],
) -> dict[str, Any]:
    """The host CPU as a compute device (a profile's `cpu:` section): its GEMM rate and copy
    bandwidth in the run's dtype, and the executor's CPU expert (host weights, CPU hidden
    states) over a grid of token counts into `measured['cpu:expert']`."""
    cpu = torch.device("cpu")
    measure = _timer(cpu)
    n = 1024
    a, b = torch.randn(n, n, dtype=dtype), torch.randn(n, n, dtype=dtype)
    flops = 2 * n**3 / measure(lambda: a @ b, repeats)
    big = torch.randn(16 * MB // 2, dtype=dtype)
    bandwidth = 2 * big.numel() * big.element_size() / measure(lambda: big.clone(), repeats)
    weights = probed_expert(w, spec, cpu, dtype)
    measured["cpu:expert"] = []
    for tokens in sorted({1 << i for i in range(int(np.log2(min(max_expert_tokens, CPU_EXPERT_MAX_TOKENS))) + 1)}):
        x = torch.randn(tokens, spec.hidden_size, dtype=dtype)
        scale = torch.full((tokens,), 1.0 / spec.top_k, dtype=dtype)
        seconds = measure(lambda: kernels.expert(x, weights) * scale[:, None], repeats)
        measured["cpu:expert"].append({"tokens": tokens, "seconds": seconds})
        if seconds > CPU_EXPERT_MAX_SECONDS:  # a slow CPU (no native bf16): the roofline answers above this
            break
    key = DTYPE_KEYS.get(dtype, str(dtype).replace("torch.", ""))
    return {
        "name": cpu_model(),
        "cores": os.cpu_count() or 1,
        "flops": {key: flops},
        "compute_dtype": key,
        "memory_bandwidth": bandwidth,
        "op_overhead_s": 0.0,
    }


def _probe_dispatch(
    spec: ModelSpec,
    draft: HardwareProfile,
    dev: torch.device,
    dtype: torch.dtype,
    emulate: Mapping[str, float],
    batch_size: int,
    prompt_len: int,
) -> tuple[float, dict[str, float], float | None]:
    """The executor's fixed cost per compute op beyond the kernels the table timed (looking up
    buffers, bookkeeping, thread hand-offs): run small real schedules (Klotski's batched experts
    and FlexGen's per-batch ones), compare with their simulation; overall and per category. On
    CUDA also the issuing thread's median time per copy (None on the CPU: no issuing thread)."""
    from dataclasses import replace

    from klotski_sim.core.engine import simulate
    from klotski_sim.policies import Placement, PolicyInput, build_schedule
    from klotski_sim.workload.routing import RunShape
    from klotski_sim.workload.trace import replay
    from klotski_sim.workload.trace_synth import synthesize

    from .executor import ExecOptions, execute

    # out of sample: the probes have their own layer count, batch size, batch count, prompt and
    # generation lengths, so a validation that uses this profile is not checked on its own fit
    # the model's first layers (at least one with experts: DeepSeek-V3's first three are dense), its
    # quantisation kept; cut from the spec itself, which need not be a preset
    layers = min(spec.num_layers, max(2, spec.first_moe_layer + 1))
    plain, at, dtype_text = spec.name.partition("@")
    probe = replace(spec, name=f"{plain.split(':')[0]}:{layers}" + (f"@{dtype_text}" if at else ""), num_layers=layers)
    shape = RunShape(batch_size, PROBE_BATCHES, prompt_len, PROBE_GEN)
    rep = replay(
        synthesize(probe, shape.num_sequences + 2, prompt_len, PROBE_GEN, "calibrated", 0),
        probe,
        shape,
        warmup_sequences=2,
    )
    weights = WeightStore.random(probe, dtype=dtype)
    options = ExecOptions(
        device=dev.type,
        emulate_links=dict(emulate) if dev.type == "cpu" else {},
        emulate_pageable={r: draft.link(r).pageable_bandwidth for r in emulate} if dev.type == "cpu" else {},
        threads=torch.get_num_threads(),
    )
    residuals = []
    copy_issue: list[float] = []
    for policy in ("klotski", "flexgen"):
        schedule = build_schedule(policy, PolicyInput(probe, draft, rep.routing, Placement(), {}, rep.warmup))
        sim = simulate(schedule, draft).df.set_index("op_id")
        execute(schedule, probe, weights, rep.routing, options)  # warm-up
        timeline, runner = execute(schedule, probe, weights, rep.routing, options)
        meas = timeline.df.set_index("op_id")
        copy_issue += [s for i, s in runner.issue_s.items() if schedule.ops[i].kind == "transfer"]
        compute = sim["resource"] == "gpu"
        residuals.append(
            pd.DataFrame(
                {
                    "category": sim.loc[compute, "category"],
                    "residual": ((meas["end"] - meas["start"]) - (sim["end"] - sim["start"]))[compute],
                }
            )
        )
    both = pd.concat(residuals)
    by_category = {str(c): max(0.0, float(g.median())) for c, g in both.groupby("category")["residual"]}
    return (
        max(0.0, float(both["residual"].median())),
        by_category,
        float(np.median(copy_issue)) if copy_issue else None,
    )


def _measure_links(
    dev: torch.device,
    measure: Callable,
    repeats: int,
    emulate: Mapping[str, float],
    latency: float,
    emulate_pageable: Mapping[str, float],
) -> dict:
    sizes = [1 * MB, 4 * MB, 16 * MB, 64 * MB]
    out: dict = {}

    def fit(copy: Callable[[torch.Tensor], object], pin: bool) -> tuple[float, float]:
        secs = []
        for size in sizes:
            src = torch.empty(size, dtype=torch.uint8)
            if pin and dev.type == "cuda":
                src = src.pin_memory()
            secs.append(measure(lambda: copy(src), repeats))
        return rate_and_fixed(sizes, secs)

    if dev.type == "cuda":
        h2d_bw, h2d_lat = fit(lambda s: s.to(dev, non_blocking=True), pin=True)
        h2d_pageable, _ = fit(lambda s: s.to(dev), pin=False)
        dst = {size: torch.empty(size, dtype=torch.uint8, device=dev) for size in sizes}
        pinned_dst = {size: torch.empty(size, dtype=torch.uint8).pin_memory() for size in sizes}
        d2h_bw, d2h_lat = fit(lambda s: pinned_dst[s.numel()].copy_(dst[s.numel()]), pin=False)
        d2h_pageable, _ = fit(lambda s: dst[s.numel()].to("cpu"), pin=False)
    else:  # no pinned memory on the CPU: both are a memcpy, unless emulated
        h2d_bw, h2d_lat = fit(lambda s: s.clone(), pin=False)
        h2d_pageable, d2h_bw, d2h_lat, d2h_pageable = h2d_bw, h2d_bw, h2d_lat, h2d_bw
    # a pageable copy is staged through a pinned buffer: a measurement above the pinned rate is noise
    h2d_pageable, d2h_pageable = min(h2d_pageable, h2d_bw), min(d2h_pageable, d2h_bw)
    disk_bw, disk_lat = _measure_disk(sizes, repeats)
    out["pcie_h2d"] = {
        "bandwidth": emulate.get("pcie_h2d", h2d_bw),
        "pageable_bandwidth": emulate_pageable.get("pcie_h2d", h2d_pageable),
        "latency_s": latency if "pcie_h2d" in emulate else h2d_lat,
        "copy_engines": 1,
    }
    out["pcie_d2h"] = {
        "bandwidth": emulate.get("pcie_d2h", d2h_bw),
        "pageable_bandwidth": emulate_pageable.get("pcie_d2h", d2h_pageable),
        "latency_s": latency if "pcie_d2h" in emulate else d2h_lat,
        "copy_engines": 1,
    }
    out["nvme"] = {
        "bandwidth": emulate.get("nvme", disk_bw),
        "latency_s": latency if "nvme" in emulate else disk_lat,
        "copy_engines": 1,
    }
    return out


def _measure_host_sync(dev: torch.device, rounds: int) -> float:
    """CUDA: from the end of a kernel the host synchronises on to the start of the next kernel it
    launches (CUDA events around the synchronise): what one host sync costs the GPU."""
    x = torch.ones(1, device=dev)
    gaps = []
    for _ in range(rounds):
        done, nxt = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        x.add_(1)
        done.record()
        torch.cuda.synchronize()
        nxt.record()
        x.add_(1)
        torch.cuda.synchronize()
        gaps.append(done.elapsed_time(nxt) / 1e3)
    return max(0.0, statistics.median(gaps))


def _measure_dependency_latency(dev: torch.device, rounds: int) -> float:
    """How long after a dependency on another stream ends its successor can start.
    CPU runtime: a thread hand-off (one worker sets an event, another wakes), timed as the
    executor runs (short GIL switch interval). CUDA: a kernel on one stream, an event, a kernel
    on another stream waiting for it — the gap between them, from CUDA events."""
    if dev.type == "cuda":
        a, b = torch.cuda.Stream(), torch.cuda.Stream()
        x = torch.ones(1, device=dev)
        gaps = []
        for _ in range(rounds):
            e1, done, e2 = (torch.cuda.Event(enable_timing=True) for _ in range(3))
            with torch.cuda.stream(a):
                x.add_(1)
                e1.record(a)
                done.record(a)
            b.wait_event(done)
            with torch.cuda.stream(b):
                e2.record(b)
                x.add_(1)
            torch.cuda.synchronize()
            gaps.append(e1.elapsed_time(e2) / 1e3)
        return max(0.0, statistics.median(gaps))
    import threading

    with cpu_threads(quick_switch=True):  # as the executor runs its stream threads
        ping, pong = threading.Event(), threading.Event()
        stamps: list[float] = []

        def responder() -> None:
            for _ in range(rounds):
                ping.wait()
                stamps.append(time.perf_counter())
                ping.clear()
                pong.set()

        stop = threading.Event()

        def busy() -> None:  # the compute thread keeps the GIL busy between kernels, as in a run
            x = torch.ones(64)
            while not stop.is_set():
                for _ in range(50):
                    x = x * 1.0
                sum(range(200))

        thread = threading.Thread(target=responder, daemon=True)
        load = threading.Thread(target=busy, daemon=True)
        thread.start()
        load.start()
        gaps = []
        try:
            for _ in range(rounds):
                pong.clear()
                t = time.perf_counter()
                ping.set()
                pong.wait(5)
                gaps.append(stamps[-1] - t)
        finally:
            stop.set()
            thread.join(5)
            load.join(5)
    return max(0.0, statistics.median(gaps))


def _measure_disk(sizes: list[int], repeats: int) -> tuple[float, float]:
    """File reads (the page cache may serve them: this is what a re-read of staged weights costs)."""
    secs = []
    with tempfile.TemporaryDirectory() as tmp:
        for size in sizes:
            path = Path(tmp) / f"blob-{size}"
            try:
                path.write_bytes(os.urandom(size))
            except OSError as err:  # a full disk: say which folder, not a bare "[Errno 28]"
                raise ExecutionError(
                    f"cannot measure the disk: writing a {size:,}-byte file in {tmp} failed "
                    f"({err.strerror or err}); free space there or point TMPDIR at another "
                    f"folder"
                ) from None
            samples = []
            for _ in range(repeats):
                t = time.perf_counter()
                with open(path, "rb") as f:
                    f.readinto(bytearray(size))
                samples.append(time.perf_counter() - t)
            secs.append(statistics.median(samples))
    return rate_and_fixed(sizes, secs)


def _disk_capacity() -> int:
    st = os.statvfs(tempfile.gettempdir())
    return st.f_blocks * st.f_frsize
