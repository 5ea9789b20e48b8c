"""Validate the serving simulation: calibrate what serving ops need, simulate a serving run on the
calibrated profile, execute the very Schedule it kept, and report the errors as `validate` does.

Calibration (`serving_profile`, then `measure_tables`) measures on this device:

- the roofline fields, the per-kernel overhead and the thread (or CUDA stream) hand-off, as
  `klotski-runtime calibrate` does;
- the links: on the CPU *emulated* at the rates given (every output says so), on CUDA real copies;
- `gpu.decompress_bandwidth`: the rate at which `lossless.decode` decodes this model's compressed
  experts here (the coder's own rate, a calibrated value with its provenance);
- a measured table of every compute op shape the serving schedules use (`attention.fused:decode`
  at each active batch and mean context, `moe:prefill` at each token count, ...), each the median of
  the serving runner's own op run alone, at the shape the simulation will cost: the offline
  validation calibrates at its run's batch sizes, prompt and KV lengths the same way. What the
  tables do not hold — how the ops of several streams overlap and wait for each other, the emulated
  copies, the decompression against compute — is what the validation checks.

The simulation moves the bytes the execution moves: FluxMoE's compressed tier is sized with the
coder's share *measured* on the very weights executed (`fluxmoe.compressed_size`), not the
published 67.9%. Iterations are decided from the request state alone in an offline run, so the
run simulated on an uncalibrated draft profile has the shapes of the calibrated one.
"""

from __future__ import annotations

import datetime as _dt
import json
import os
import statistics
import sys
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any, Mapping

import torch

from klotski_sim.core.schedule import Op, Schedule
from klotski_sim.core.timeline import Timeline, jsonable
from klotski_sim.hardware.profile import HardwareProfile, load_profile, profile_from_dict
from klotski_sim.report.exports import to_parquet
from klotski_sim.serving.batcher import BatchingConfig, ServingRefusal
from klotski_sim.serving.policies import SERVING_POLICIES
from klotski_sim.serving.policies.base import resolve_serving_options
from klotski_sim.serving.requests import fixed_requests
from klotski_sim.serving.run import ServeResult, ServeSpec, serve
from klotski_sim.util.errors import UsageError
from klotski_sim.util.linefit import rate_and_fixed
from klotski_sim.util.machine import cpu_model, machine_load
from klotski_sim.util.progress import say
from klotski_sim.workload.model import ModelSpec, get_model

from . import lossless
from .calibrate import _measure_dependency_latency, _measure_host_sync, _measure_links, _timer, gpu_section
from .executor import ExecOptions, require_cuda
from .kernels import WeightStore, host_memory
from .serving_exec import (
    CompressedLayer,
    ServingRunner,
    ServingStore,
    compress_layer,
    execute_serving,
    measured_share,
)
from .threads import compute_threads, cpu_threads
from .validate import check_profile_device, compare, judge_repeats, machine_conditions, refit_dispatch, side_by_side

SERVING_VALIDATION_POLICIES = ("vllm", "vllm-o", "ktransformers", "fluxmoe-h", "fluxmoe")
MB = 1 << 20


@dataclass(frozen=True)
class ServingValidationSetup:
    """One serving validation: a model, an offline workload of equal requests, the policies and
    how links are treated. `options`: per policy, its serving options (validation defaults first:
    `validation_defaults`)."""

    model: str = "small-mixtral:2"
    device: str = "cpu"
    requests: int = 3
    prompt_len: int = 8
    output_len: int = 4
    policies: tuple[str, ...] = ("vllm", "fluxmoe")
    options: Mapping[str, Mapping[str, Any]] = field(default_factory=dict)
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 8192
    seed: int = 0
    emulate_links: Mapping[str, float] = field(default_factory=dict)
    emulate_pageable: Mapping[str, float] = field(default_factory=dict)
    threads: int | None = 1
    warmup_runs: int = 1
    repeats: int = 3
    calibration_repeats: int = 3
    plots: bool = True  # validation.png per policy (a second each)


def validation_defaults(policy: str, model: ModelSpec) -> dict[str, Any]:
    """Options that make each policy's mechanism run on a device with memory to spare (a CPU's
    'GPU' holds every weight: FluxMoE would page nothing, vLLM-O offload nothing): FluxMoE pages
    every MoE layer, vLLM-O offloads the second half of the layers. Given options win."""
    moe = sum(1 for j in range(model.num_layers) if model.is_moe(j))
    if policy in ("fluxmoe", "fluxmoe-h"):
        return {"pageable_layers": moe}
    if policy == "vllm-o":
        return {"offload_layers": max(1, model.num_layers // 2)}
    return {}


# ---- calibration ----------------------------------------------------------------------------------------
def decode_rate(images: Mapping[int, CompressedLayer], device: torch.device, repeats: int) -> float:
    """Bytes/s of decoded output of `lossless.decode` on `device`, timed on this model's own
    compressed expert matrices: eight decoded one after another into a block (as a decompress op
    decodes a layer's), the median of `repeats` rounds. A decompress op decodes whole matrices (and
    the start of one), so the per-matrix cost is part of the rate."""
    layer = images[min(images)]
    matrices = [c.to(device) for c in layer.matrices[:8]]
    if device.type != "cuda":
        lossless.warm(max(c.count for c in matrices))
    out = torch.empty(sum(c.count for c in matrices), dtype=torch.bfloat16, device=device)

    def run() -> None:
        at = 0
        for c in matrices:
            lossless.decode(c, out[at : at + c.count])
            at += c.count

    # (calibrate's timer: a warm-up first, which faults in `out`'s pages and makes the work arrays)
    return 2 * out.numel() / _timer(device)(run, max(1, repeats))


def serving_profile(
    spec: ModelSpec,
    device: str,
    images: Mapping[int, CompressedLayer],
    emulate_links: Mapping[str, float],
    emulate_pageable: Mapping[str, float],
    repeats: int = 3,
    command: str = "",
) -> dict[str, Any]:
    """The profile's fields other than its measured tables, measured on `device` (module docstring)
    as a dict (`measure_tables` adds the tables; `profile_from_dict` validates it)."""
    require_cuda(device)
    dev = torch.device(device)
    measure = _timer(dev)
    n = 1024 if dev.type == "cuda" else 512
    a, b = torch.randn(n, n, dtype=torch.bfloat16, device=dev), torch.randn(n, n, dtype=torch.bfloat16, device=dev)
    peak = 2 * n**3 / measure(lambda: a @ b, repeats)
    big = torch.randn(8 * MB, dtype=torch.bfloat16, device=dev)
    copy_into = torch.empty_like(big)
    membw = 2 * big.numel() * 2 / measure(lambda: copy_into.copy_(big), repeats)
    one = torch.ones(1, device=dev)
    overhead = measure(lambda: one + one, max(repeats, 20))
    dependency = _measure_dependency_latency(dev, 50)
    host_sync = _measure_host_sync(dev, 50) if dev.type == "cuda" else dependency
    if dev.type == "cuda":
        links = _measure_links(dev, measure, repeats, {}, 0.0, {})
    else:
        links = _cpu_links(emulate_links, emulate_pageable, repeats)
    gpu = gpu_section(dev, peak, membw, overhead, dependency, host_sync)
    name = gpu["name"]
    sources = {
        "measured": "klotski-runtime validate --serve: the serving runner's ops at the run's shapes (this file's "
        "provenance)",
        "gpu.memory_bytes": "CUDA device properties" if dev.type == "cuda" else "half of host memory",
        "links": "CUDA copies (pinned and pageable)"
        if dev.type == "cuda"
        else "EMULATED at the rates given (transfers sleep to them); nvme: not used by serving schedules",
    }
    if images:
        gpu["decompress_bandwidth"] = decode_rate(images, dev, repeats)
        sources["gpu.decompress_bandwidth"] = (
            f"measured: klotski_runtime.lossless.decode ({'numpy' if dev.type == 'cpu' else 'torch'}) of eight of "
            f"{spec.name}'s compressed expert matrices on {name}, one after another (median of {repeats})"
        )
    return {
        "name": f"calibrated-serving-{device}",
        "description": f"measured by klotski-runtime validate --serve on {name} for {spec.name}'s serving ops",
        "gpu": gpu,
        "links": links,
        "host": {"memory_bytes": float(host_memory("MemTotal") or 16e9), "cpu": cpu_model()},
        "cpu": {
            "name": cpu_model(),
            "cores": os.cpu_count() or 1,
            "flops": {"bf16": peak if dev.type == "cpu" else _cpu_flops(repeats)},
            "compute_dtype": "bf16",
            "memory_bandwidth": membw if dev.type == "cpu" else 2e10,
            "op_overhead_s": 0.0,
        },
        "disk": {"capacity_bytes": 1e12},
        "sources": sources,
        "measured": {},
        "provenance": {
            "device": name,
            "device_kind": dev.type,
            "model_shapes": spec.name,
            "dtype": "torch.bfloat16",
            "torch": torch.__version__,
            "cuda": torch.version.cuda,
            "python": sys.version.split()[0],
            "date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
            "command": command or " ".join(sys.argv),
            "threads": torch.get_num_threads(),
            "cpu_model": cpu_model(),
            "emulated_links": dict(emulate_links),
            "serving": True,
        },
    }


def _cpu_flops(repeats: int) -> float:
    a = torch.randn(512, 512, dtype=torch.bfloat16)
    return 2 * 512**3 / _timer(torch.device("cpu"))(lambda: a @ a, repeats)


def _cpu_links(emulate: Mapping[str, float], pageable: Mapping[str, float], repeats: int) -> dict[str, Any]:
    """CPU links: the emulated rates, or a memcpy fitted over sizes where a link is not emulated."""
    sizes = [1 * MB, 4 * MB, 16 * MB]
    src = torch.empty(sizes[-1], dtype=torch.uint8)
    dst = torch.empty_like(src)
    measure = _timer(torch.device("cpu"))

    def copy(size: int) -> float:
        return measure(lambda: dst[:size].copy_(src[:size]), repeats)

    rate, latency = rate_and_fixed(sizes, [copy(size) for size in sizes])
    out = {}
    for link in ("pcie_h2d", "pcie_d2h", "nvme"):
        bw = emulate.get(link, rate)
        out[link] = {
            "bandwidth": bw,
            "pageable_bandwidth": pageable.get(link, bw),
            "latency_s": 0.0 if link in emulate else latency,
            "copy_engines": 1,
        }
    return out


def table_key(op: Op, resource: str) -> str | None:
    """The measured table a compute op is costed from (cost.CostModel's names), None for ops priced
    otherwise (decompression by its rate, a remap's no work, copies and host waits)."""
    if op.kind != "compute" or op.category in ("decompress", "remap"):
        return None
    if resource == "cpu":
        return f"cpu:{op.category}"
    name = f"{op.category}.{op.variant}" if op.variant else op.category
    return f"{name}:{op.phase}" if op.phase else name


def measure_tables(
    schedule: Schedule,
    spec: ModelSpec,
    weights: WeightStore,
    options: ExecOptions,
    store: ServingStore,
    repeats: int,
    tables: dict[str, dict[tuple[int, int], list[float]]],
) -> None:
    """Run `schedule` one op at a time (no threads, no emulated waits, nothing overlapping), `repeats`
    times after a warm-up, on prompts of another seed than the validated run's (other tokens, other
    routing: the same shapes on other data, as calibration's microbenchmarks are), and add each
    compute op's duration to `tables[key][(tokens, kv_len)]`. Rounds of whole runs, not an op's
    repeats back to back: a burst of other work lands on one sample of many shapes (calibrate.Bench)."""
    cuda = torch.device(options.device).type == "cuda"
    other = replace(options, seed=options.seed + 1)
    for round_ in range(1 + repeats):
        runner = ServingRunner(schedule, spec, weights, other, store)
        for op in schedule.ops:
            key = table_key(op, schedule.streams[op.stream])
            if cuda:
                torch.cuda.synchronize()
            t = time.perf_counter()
            runner.run(op)
            if cuda:
                torch.cuda.synchronize()
            if key is not None and round_:
                shape = (op.tokens, op.kv_len if op.category == "attention" else 0)
                tables.setdefault(key, {}).setdefault(shape, []).append(time.perf_counter() - t)


def off_the_table(schedule: Schedule, profile: HardwareProfile) -> int:
    """Compute ops whose shape the profile's tables do not hold (the roofline costs them: a profile
    calibrated for other shapes, or a residency decided from the times differently than the draft's)."""
    points = {key: {(p.tokens, p.kv_len) for p in table} for key, table in profile.measured.items()}
    count = 0
    for op in schedule.ops:
        key = table_key(op, schedule.streams[op.stream])
        if key is not None and (op.tokens, op.kv_len if op.category == "attention" else 0) not in points.get(key, ()):
            count += 1
    return count


def with_tables(data: dict[str, Any], tables: Mapping[str, Mapping[tuple[int, int], list[float]]]) -> HardwareProfile:
    """The profile with each table point the median of its samples."""
    measured = {
        key: [
            {"tokens": t, "kv_len": kv, "seconds": max(statistics.median(s), 1e-9)}
            for (t, kv), s in sorted(points.items())
        ]
        for key, points in sorted(tables.items())
    }
    return profile_from_dict({**data, "measured": measured}, "serving calibration")


# ---- validation ---------------------------------------------------------------------------------------
def _spec(setup: ServingValidationSetup, model: ModelSpec, profile: HardwareProfile, policy: str, options: Any):
    batching = BatchingConfig(setup.max_num_seqs, setup.max_num_batched_tokens)
    workload = fixed_requests(setup.requests, setup.prompt_len, setup.output_len)
    return ServeSpec(model, profile, policy, workload, batching, options=options, seed=setup.seed)


def moved_bytes(result: ServeResult, runner: ServingRunner) -> dict[str, int]:
    """What the simulated schedule says moves and what the execution moved, by kind: copied bytes,
    decompressed (decoded) bytes, compressed bytes read, and the compressed tier's stored bytes."""
    schedule = result.schedule
    assert schedule is not None
    ops = schedule.ops
    copies = [op for op in ops if op.kind == "transfer" and op.tensor != "activation"]
    decompress = [op for op in ops if op.category == "decompress"]
    stored = sum(size for name, size in schedule.preloaded if name.startswith("compressed/"))
    if not stored and decompress:  # (a static residency: its stored bytes are inside weights/resident)
        m, residency = result.spec.model, result.residency
        paged = sum(m.moe_layer_bytes(j) for j in residency.offloaded_layers)
        stored = residency.gpu_weight_bytes - m.total_bytes() + paged
    return {
        "copied_simulated": sum(op.bytes for op in copies),
        "copied_executed": sum(runner.moved[op.id][0] for op in copies),
        "decompressed_simulated": sum(op.bytes for op in decompress),
        "decompressed_executed": sum(runner.moved[op.id][0] for op in decompress),
        "compressed_read_executed": sum(runner.moved[op.id][1] for op in decompress),
        "compressed_tier_simulated": stored,
        "compressed_tier_executed": runner.compressed_bytes,
    }


def validate_serving(
    setup: ServingValidationSetup,
    out_dir: str | Path,
    profile_path: str | None = None,
    progress: bool = False,
) -> dict[str, Any]:
    """Calibrate (unless `profile_path`), then for each policy simulate, execute `setup.repeats`
    times and compare; returns (and writes) the report, shaped as `validate`'s."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)

    def note(text: str) -> None:
        if progress:
            say(f"validate --serve: {text}")

    unknown = [p for p in setup.policies if p not in SERVING_POLICIES]
    if unknown:
        raise UsageError(f"unknown serving policy {unknown[0]!r}; serving policies: {', '.join(SERVING_POLICIES)}")
    model = get_model(setup.model)
    options = {
        p: {**validation_defaults(p, model), **dict(setup.options.get(p, {}))}
        for p in setup.policies  # (a typo in an option is an error before anything runs)
    }
    load_before = machine_load()
    weights = WeightStore.random(model, dtype=torch.bfloat16, seed=setup.seed)
    paging = [p for p in setup.policies if p in ("fluxmoe", "fluxmoe-h")]
    images: dict[int, CompressedLayer] = {}
    share = None
    if paging:
        note("compressing the experts (lossless exponent coding)")
        images = {j: compress_layer(weights, model, j) for j in range(model.num_layers) if model.is_moe(j)}
        share = measured_share(images)
        for p in paging:
            options[p].setdefault("compressed_size", round(share, 6))
    for p in setup.policies:
        resolve_serving_options(p, options[p])
    store = ServingStore(weights, model, images)
    exec_options = ExecOptions(
        device=setup.device,
        emulate_links=dict(setup.emulate_links),
        emulate_pageable=dict(setup.emulate_pageable),
        seed=setup.seed,
        threads=setup.threads if setup.device == "cpu" else None,
    )
    with cpu_threads(compute_threads(setup.device, exec_options.threads)):
        if profile_path is None:
            note("calibrating the device (roofline, hand-offs, links, decompression rate)")
            data = serving_profile(
                model, setup.device, images, setup.emulate_links, setup.emulate_pageable, setup.calibration_repeats
            )
            tables: dict[str, dict[tuple[int, int], list[float]]] = {}
            draft = profile_from_dict(data, "serving calibration")
            for p in setup.policies:
                note(f"timing {p}'s op shapes")
                result = _serve(setup, model, draft, p, options[p])
                if isinstance(result, str):
                    continue
                assert result.schedule is not None
                measure_tables(result.schedule, model, weights, exec_options, store, setup.calibration_repeats, tables)
            profile = with_tables(data, tables)
            profile_path = str(out / "profile.yaml")
            Path(profile_path).write_text(profile.to_yaml())
        else:
            profile = load_profile(profile_path)
            check_profile_device(profile, setup.device, setup.emulate_links)
            if not profile.provenance.get("serving"):
                raise UsageError(
                    f"profile {profile_path}: not a serving calibration (no measured moe, decompress rate, ...): "
                    f"leave out --profile (validate --serve calibrates into DIR/profile.yaml) or give that file"
                )
    report: dict[str, Any] = {
        "setup": {**asdict(setup), "policies": list(setup.policies)},
        "profile": profile_path,
        "mode": "serving",
        "compressed_share": {
            "coder_measured": share,
            "published": 1 - 0.321,
            "decompress_bandwidth": profile.gpu.decompress_bandwidth,
        },
        "policies": {},
    }
    spreads: list[float] = []
    for p in setup.policies:
        result = _serve(setup, model, profile, p, options[p])
        if isinstance(result, str):
            report["policies"][p] = {"skipped": result}
            note(f"{p}: skipped ({result})")
            continue
        schedule, sim = result.schedule, result.timeline
        assert schedule is not None and sim is not None
        measured = []
        runner = None
        for k in range(setup.warmup_runs + max(1, setup.repeats)):
            timeline, runner = execute_serving(schedule, model, weights, exec_options, store)
            if k >= setup.warmup_runs:
                measured.append(timeline)
        assert runner is not None
        entry, meas, spread = judge_repeats(sim, measured)
        entry["options"] = dict(result.meta["options"])
        entry["in_sample"] = compare(_refit(setup, model, profile, p, options[p], sim, meas), meas)
        entry["bytes"] = moved_bytes(result, runner)
        entry["ops_off_the_table"] = off_the_table(schedule, profile)
        entry["iterations"] = len(result.iterations)
        entry["kv_dropped_for_recompute"] = len(runner.dropped)
        spreads.append(spread)
        folder = out / p
        folder.mkdir(exist_ok=True)
        to_parquet(sim, folder / "simulated.parquet")
        to_parquet(meas, folder / "measured.parquet")
        schedule.save(folder / "schedule.json")
        if setup.plots:
            title = f"{p} · {model.name} · {setup.device} · {setup.requests} requests x {setup.prompt_len}+{setup.output_len}"
            side_by_side(sim, meas, folder / "validation.png", title)
        (folder / "validation.json").write_text(json.dumps(jsonable(entry), indent=2))
        report["policies"][p] = entry
        note(f"{p}: makespan error {entry['makespan']['error']:+.1%}")
    report["emulated_links"] = dict(setup.emulate_links)
    report["machine"] = machine_conditions(load_before, machine_load(), spreads)
    (out / "validation.json").write_text(json.dumps(jsonable(report), indent=2))
    return report


def _serve(
    setup: ServingValidationSetup, model: ModelSpec, profile: HardwareProfile, policy: str, options: Any
) -> ServeResult | str:
    """A kept serving run, or why the policy cannot serve this on this profile."""
    try:
        result = serve(_spec(setup, model, profile, policy, options), keep=True)
    except ServingRefusal as err:
        return f"refused: {err}"
    if result.timeline is None or result.timeline.meta.get("status") != "ok":
        return f"the simulated run ends with status {result.timeline and result.timeline.meta.get('status')}"
    return result


def _refit(
    setup: ServingValidationSetup,
    model: ModelSpec,
    profile: HardwareProfile,
    policy: str,
    options: Any,
    sim: Timeline,
    meas: Timeline,
) -> Timeline:
    """The run simulated again with the dispatch costs refitted on this measurement (in-sample)."""
    result = serve(_spec(setup, model, refit_dispatch(profile, sim, meas), policy, options), keep=True)
    assert result.timeline is not None
    return result.timeline


def format_serving_extra(report: dict[str, Any]) -> str:
    """What a serving validation adds to `format_report`: the bytes moved, simulated and executed."""
    lines = []
    share = report.get("compressed_share", {})
    if share.get("coder_measured") is not None:
        lines.append(
            f"compressed experts: the coder stores {share['coder_measured']:.1%} of their bf16 size on these "
            f"weights (the simulation used it; FluxMoE published {share['published']:.1%}); decodes at "
            f"{share['decompress_bandwidth'] / 1e9:.2f} GB/s here"
        )
    for name, r in report["policies"].items():
        b = r.get("bytes")
        if not b:
            continue
        if r.get("ops_off_the_table"):
            lines.append(f"{name}: {r['ops_off_the_table']} compute ops of shapes the profile's tables lack (roofline)")
        lines.append(
            f"{name}: copied {b['copied_executed']:,} B (schedule {b['copied_simulated']:,}); decompressed "
            f"{b['decompressed_executed']:,} B (schedule {b['decompressed_simulated']:,}) from "
            f"{b['compressed_read_executed']:,} compressed; compressed tier {b['compressed_tier_executed']:,} B "
            f"(simulated {b['compressed_tier_simulated']:,})"
        )
    return "\n".join(lines)
