"""The runtime executes serving Schedules (issue 39 item 7): real kernels per request over its own
KV cache, real routing, compressed experts stored and decoded for real, bytes moved as simulated,
and a validated run within the offline validation's makespan bound."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from klotski_runtime import lossless
from klotski_runtime.executor import ExecOptions
from klotski_runtime.kernels import WeightStore
from klotski_runtime.serving_exec import ServingStore, check_serving, compress_layer, execute_serving, measured_share
from klotski_sim.core.schedule import Schedule, ScheduleError
from klotski_sim.hardware.profile import profile_from_dict
from klotski_sim.serving.policies.base import resolve_serving_options
from klotski_sim.serving.policies.fluxmoe import COMPRESSED_SHARE
from klotski_sim.serving.requests import fixed_requests
from klotski_sim.serving.run import ServeSpec, serve
from klotski_sim.util.errors import UsageError
from klotski_sim.workload.model import get_model

from .conftest import every_attempt_missed, make_profile, runtime_in_process

TINY = get_model("tiny-mixtral")
OPTIONS: dict[str, dict[str, object]] = {
    "vllm": {},
    "vllm-o": {"offload_layers": 1},
    "ktransformers": {},
    "fluxmoe": {"pageable_layers": 2},
    "fluxmoe-h": {"pageable_layers": 2, "compressed_share": 0.5},  # (one layer decompressed, one copied)
}


def _profile(kv_blocks: int | None = None):
    """Round numbers (conftest), a decompression rate, a CPU for KTransformers; with `kv_blocks`, GPU
    memory for tiny-mixtral's weights, activations and that many KV blocks (vllm's plan)."""
    memory = 1e12 if kv_blocks is None else (509_568 + 14_942_208 + kv_blocks * 4096 + 1) / 0.9
    data = make_profile(memory_bytes=memory, decompress_bandwidth=2e9).model_dump(mode="json", exclude_none=True)
    data["cpu"] = {"name": "test-cpu", "cores": 2, "flops": {"bf16": 1e11}, "compute_dtype": "bf16"}
    data["cpu"]["memory_bandwidth"] = 1e10
    return profile_from_dict(data, "test profile")


def _served(policy: str, requests: int = 3, prompt: int = 8, output: int = 4, kv_blocks: int | None = None, **extra):
    spec = ServeSpec(
        TINY,
        _profile(kv_blocks),
        policy,
        fixed_requests(requests, prompt, output),
        options={**OPTIONS[policy], **extra},
    )
    return serve(spec, keep=True)


@pytest.fixture(scope="module")
def tiny_weights() -> WeightStore:
    return WeightStore.random(TINY, dtype=torch.bfloat16, seed=0)


# ---- the coder ----------------------------------------------------------------------------------------
@given(st.lists(st.integers(0, 0xFFFF), min_size=1, max_size=300), st.sampled_from(["numpy", "torch"]))
def test_lossless_coder_round_trips_every_bf16_bit_pattern(bits, impl):
    """Any bf16 values (NaNs, infinities, subnormals, both zeros) decode to the very bits encoded."""
    values = torch.from_numpy(np.array(bits, dtype=np.uint16).view(np.int16)).view(torch.bfloat16)
    image = lossless.encode(values)
    assert torch.equal(lossless.decode(image, impl=impl).view(torch.int16), values.view(torch.int16))
    into = torch.empty(len(bits) * 2, dtype=torch.uint8)  # (decoded into a byte block, as a decompress op does)
    lossless.decode(image, into, impl=impl)
    assert torch.equal(into.view(torch.int16), values.view(torch.int16))


def test_lossless_coder_stores_gaussian_weights_in_about_70_percent():
    w = (torch.randn(1 << 16, generator=torch.Generator().manual_seed(1)) / 32).to(torch.bfloat16)
    image = lossless.encode(w)
    # sign+mantissa byte + a 3-bit exponent code = 11/16 of the bits, plus a few escapes
    assert image.bits == 3 and 0.68 < image.nbytes / image.raw_bytes < 0.72
    assert image.escapes.numel() < 0.05 * image.count


# ---- the compressed_size option --------------------------------------------------------------------------
def test_compressed_size_is_a_validated_fluxmoe_option_that_sizes_the_compressed_tier():
    assert resolve_serving_options("fluxmoe", {})["compressed_size"] == pytest.approx(COMPRESSED_SHARE)
    for bad in (0, 1.5, "small"):
        with pytest.raises(UsageError, match="compressed_size"):
            resolve_serving_options("fluxmoe", {"compressed_size": bad})
    # every MoE layer paged, all of it compressed: the tier holds compressed_size x the experts' bytes
    weights = {
        size: _served("fluxmoe", compressed_share=1.0, compressed_size=size).residency.gpu_weight_bytes
        for size in (0.5, 0.7)
    }
    experts = 2 * TINY.moe_layer_bytes(0)
    assert weights[0.5] == TINY.total_bytes() - experts + int(0.5 * experts)
    assert weights[0.7] - weights[0.5] == pytest.approx(0.2 * experts, abs=2)


# ---- execution ------------------------------------------------------------------------------------------
def test_every_policy_executes_the_same_requests_to_the_same_tokens(tiny_weights):
    """Real routing, each policy's weights where it keeps them (the paged ones decoded bit-exactly or
    copied): the same greedy tokens for every request, one per iteration that samples it, and bytes
    moved as the Schedule says."""
    tokens = {}
    for policy in ("vllm", "vllm-o", "ktransformers", "fluxmoe-h", "fluxmoe"):
        result = _served(policy)
        schedule = result.schedule
        timeline, runner = execute_serving(schedule, TINY, tiny_weights, ExecOptions(threads=1))
        assert timeline.meta["status"] == "ok" and timeline.makespan > 0
        sampled = {
            r: [runner.sampled[s][r] for s in sorted(runner.sampled) if r in runner.sampled[s]] for r in range(3)
        }
        assert all(len(t) == 4 for t in sampled.values())  # (each request's output length)
        tokens[policy] = sampled
        for op in schedule.ops:  # the bytes each copy and decompression moved are the schedule's
            if op.kind == "transfer" and op.tensor != "activation":
                assert runner.moved[op.id] == (op.bytes, op.bytes)
            elif op.category == "decompress":
                assert runner.moved[op.id][0] - op.bytes in (0, 1)  # (a whole last bf16 value)
        by_layer: dict = {}
        for op in schedule.ops:
            if op.category == "decompress" or op.kind == "transfer" and op.tensor == "expert":
                by_layer.setdefault((op.step, op.layer), 0)
                by_layer[(op.step, op.layer)] += op.bytes
        assert all(v == TINY.moe_layer_bytes(layer) for (_, layer), v in by_layer.items())  # (the layer, once)
        if policy in ("fluxmoe", "fluxmoe-h"):
            assert by_layer and any(op.category == "decompress" for op in schedule.ops)
        if policy == "vllm-o":
            loads = [op for op in schedule.ops if op.category == "weights"]
            assert loads and all(runner.moved[op.id][0] == TINY.layer_bytes(op.layer) for op in loads)
        if policy == "ktransformers":
            assert all(runner.active_experts[op.id] > 0 for op in schedule.ops if op.stream == "cpu_compute")
    assert all(t == tokens["vllm"] for t in tokens.values()), tokens


def test_kv_caches_follow_the_composition_and_preempted_requests_are_recomputed(tiny_weights):
    """Three KV blocks for three requests of 8 + 24 tokens: vLLM preempts, and the runner drops the
    preempted request's caches and recomputes them; every attention reads exactly the context
    `meta.iterations` gives its request, and every request still samples exactly its 24 tokens."""
    result = _served("vllm", output=24, kv_blocks=3)
    assert result.metrics.preemptions >= 1
    schedule = result.schedule
    _, runner = execute_serving(schedule, TINY, tiny_weights, ExecOptions(threads=1))
    steps = sorted(runner.comp.by_step)
    for step, entries in zip(steps, schedule.meta["iterations"]):
        for request, _, context, _, _ in entries:
            for layer in range(TINY.num_layers):
                assert runner.attended[(step, layer, request)] == context
    recomputes = sum(
        1
        for k, entries in enumerate(schedule.meta["iterations"])
        for request, new, context, _, _ in entries
        if context == new and any(e[0] == request for its in schedule.meta["iterations"][:k] for e in its)
    )
    assert recomputes >= 1 and len(runner.dropped) == recomputes * TINY.num_layers
    counts = {r: sum(1 for v in runner.sampled.values() if r in v) for r in range(3)}
    assert counts == {0: 24, 1: 24, 2: 24} and all(len(runner.tokens[r]) == 8 + 24 for r in range(3))


def test_compressed_tier_holds_what_the_simulation_sized_with_the_measured_share(tiny_weights):
    """The simulation sized with the coder's share measured on these weights stores the bytes the
    runtime's compressed images hold (their headers and the odd last value aside)."""
    images = {j: compress_layer(tiny_weights, TINY, j) for j in range(TINY.num_layers)}
    share = measured_share(images)
    assert 0.6 < share < 0.8
    result = _served("fluxmoe", compressed_share=1.0, compressed_size=share)
    store = ServingStore(tiny_weights, TINY, images)
    _, runner = execute_serving(result.schedule, TINY, tiny_weights, ExecOptions(threads=1), store)
    stored = result.residency.gpu_weight_bytes - TINY.total_bytes() + 2 * TINY.moe_layer_bytes(0)
    assert runner.compressed_bytes == pytest.approx(stored, abs=8)


# ---- bad input: one line naming the file, op and field ------------------------------------------------
def test_bad_serving_schedules_are_refused_in_one_line(tmp_path):
    schedule = _served("vllm").schedule
    with pytest.raises(ScheduleError, match=r"built for model 'tiny-mixtral', not 'small-mixtral'"):
        check_serving(schedule, get_model("small-mixtral"))
    data = json.loads("".join(schedule.json_pieces()))
    cases = {}
    bad = json.loads(json.dumps(data))
    next(op for op in bad["ops"] if op["id"] == "it1/L0/moe")["category"] = "frobnicate"
    cases["category"] = (bad, r"op 'it1/L0/moe': category 'frobnicate': the serving runner executes")
    bad = json.loads(json.dumps(data))
    bad["meta"]["iterations"][3][0][1:3] = [2, 12]  # (a cache that continues: only the token count is off)
    cases["tokens"] = (bad, r"op 'it3/embed': tokens 3, but meta.iterations says 4")
    bad = json.loads(json.dumps(data))
    bad["meta"]["iterations"][2][1][2] = 30
    cases["cache"] = (bad, r"meta.iterations\[2\]: request 1 computes tokens 29..29 but its cache holds 9")
    bad = json.loads(json.dumps(data))
    del bad["meta"]["iterations"]
    cases["missing"] = (bad, r"meta.iterations is missing")
    for name, (content, message) in cases.items():
        path = tmp_path / f"{name}.json"
        path.write_text(json.dumps(content))
        with pytest.raises(ScheduleError, match=message):
            check_serving(Schedule.load(path), TINY, str(path))
        code, out, err = runtime_in_process("execute", str(path), "--emulate-pcie", "off")
        assert code == 2 and err.count("\n") == 1 and err.startswith("error: ") and str(path) in err, (name, err)
    code, _, err = runtime_in_process("execute", str(tmp_path / "tokens.json"), "--model", "small-mixtral")
    assert code == 2 and "not 'small-mixtral'" in err and err.count("\n") == 1
    out = str(tmp_path / "v")
    for args, message in (
        (["--requests", "3"], "--requests: a serving workload's; give --serve"),
        (["--serve", "--policy", "klotski"], "klotski: not serving policies"),
        (["--serve", "--trace", str(path)], "--trace apply to offline schedules"),
        (["--serve", "--policy", "vllm", "--option", "fluxmoe.x=1"], "name a policy validated as POLICY.KEY"),
    ):
        code, _, err = runtime_in_process("validate", *args, "--out", out)
        assert code == 2 and message in err and err.count("\n") == 1, (args, err)


def test_serve_timeline_writes_the_schedule_that_execute_runs(tmp_path):
    from klotski_sim.cli.main import main as sim_main

    profile = tmp_path / "profile.yaml"
    profile.write_text(_profile().to_yaml())
    out = tmp_path / "served"
    args = ["serve", "--model", "tiny-mixtral", "--hardware", str(profile), "--requests", "2", "--prompt-len", "6"]
    args += ["--output-len", "3", "--policies", "fluxmoe", "--option", "fluxmoe.pageable_layers=2", "--timeline"]
    assert sim_main([*args, "--out", str(out)]) == 0
    assert Schedule.load(out / "fluxmoe" / "schedule.json").meta["iterations"]
    code, text, err = runtime_in_process("execute", str(out / "fluxmoe"), "--emulate-pcie", "2e9")
    assert code == 0, err
    assert "executed 3 iterations of fluxmoe" in text and "6 tokens sampled" in text and "EMULATED" in text


# ---- validation: simulated against measured, within the offline bounds --------------------------------
ATTEMPTS = 2


@pytest.mark.serial
def test_serving_validation_error_is_bounded(tmp_path):
    """small-mixtral's first two layers, 3 requests of 8 + 4 tokens, PCIe emulated at 1 GB/s, the serving
    ops calibrated on their shapes (serving_validate's docstring): vLLM, and FluxMoE paging both layers
    (decompressing its share for real, copying the rest), each within the offline validation's bound —
    median makespan error of 3 runs within 10% — and moving the bytes it simulated.

    FluxMoE runs with `decompress_on=compute`: on a CPU of two cores the decoder and the compute thread
    share the memory bandwidth and slow each other ~1.2-2x, which the `own` bound (a decompression
    unit that costs compute nothing) does not model (docs/runtime.md). Wall-clock on a shared machine:
    a missed bound is measured again, and where every attempt ran loaded the test says so and skips
    (tests/test_validate.py's pattern)."""
    from klotski_runtime.serving_validate import ServingValidationSetup, validate_serving

    links = {"pcie_h2d": 1e9, "pcie_d2h": 1e9}
    setup = ServingValidationSetup(
        model="small-mixtral:2",
        requests=3,
        prompt_len=8,
        output_len=4,
        policies=("vllm", "fluxmoe"),
        options={"fluxmoe": {"decompress_on": "compute"}},
        emulate_links=links,
        emulate_pageable={k: v * 10 / 25.7 for k, v in links.items()},
        repeats=3,
        calibration_repeats=2,
        plots=False,
    )
    attempts: list[list[str]] = []
    loaded: list[list[str]] = []
    while len(attempts) < ATTEMPTS:
        report = validate_serving(setup, tmp_path / f"attempt{len(attempts)}")
        flux = report["policies"]["fluxmoe"]
        moved = flux["bytes"]
        assert moved["copied_executed"] == moved["copied_simulated"] > 0
        assert 0 <= moved["decompressed_executed"] - moved["decompressed_simulated"] <= 2 * 4 * 2  # (per op: 1)
        assert moved["compressed_tier_executed"] == pytest.approx(moved["compressed_tier_simulated"], rel=1e-3)
        assert flux["options"]["compressed_size"] == pytest.approx(report["compressed_share"]["coder_measured"])
        assert "decompress" in flux["per_category"] and "moe" in flux["per_category"]
        assert all(r["ops_off_the_table"] == 0 for r in report["policies"].values())
        misses = [
            f"{name}: median makespan error {r['repeats']['makespan']['median']:+.1%} (runs {r['repeats']['makespan']})"
            for name, r in report["policies"].items()
            if abs(r["repeats"]["makespan"]["median"]) > 0.10
        ]
        attempts.append(misses + ([f"machine: {report['machine']}"] if misses else []))
        if not misses:
            return
        loaded.append(report["machine"]["warnings"])
    every_attempt_missed(attempts, loaded)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_streams_execute_a_serving_schedule(tiny_weights):
    """On CUDA: a stream per schedule stream, the compressed tier on the GPU decoded by torch there;
    the same KV lengths, bytes and (within each device) the same tokens for every policy."""
    image = lossless.encode(tiny_weights.get("expert", 0, 0)[0]).to("cuda")
    assert torch.equal(
        lossless.decode(image).cpu().view(torch.int16), tiny_weights.get("expert", 0, 0)[0].view(torch.int16)
    )
    tokens = {}
    for policy in ("vllm", "vllm-o", "ktransformers", "fluxmoe"):
        schedule = _served(policy).schedule
        timeline, runner = execute_serving(schedule, TINY, tiny_weights, ExecOptions(device="cuda"))
        assert timeline.meta["status"] == "ok" and torch.cuda.get_device_name() in timeline.meta["device"]
        for op in schedule.ops:
            if op.kind == "transfer" and op.tensor != "activation":
                assert runner.moved[op.id] == (op.bytes, op.bytes)
        tokens[policy] = runner.sampled
    # (KTransformers' experts run on the host CPU: other kernels, other rounding; the rest run the same GPU ones)
    assert all(t == tokens["vllm"] for p, t in tokens.items() if p != "ktransformers")
