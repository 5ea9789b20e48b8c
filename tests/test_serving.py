"""Serving: continuous batching over a paged KV cache, the serving policies and the iteration loop."""

from __future__ import annotations

import json

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from klotski_sim.core.engine import simulate
from klotski_sim.hardware.profile import load_profile, with_overrides
from klotski_sim.serving.batcher import BatchingConfig, ContinuousBatcher, ServingRefusal
from klotski_sim.serving.requests import (
    Request,
    Workload,
    WorkloadError,
    builtin_distributions,
    drawn_requests,
    fixed_requests,
    read_requests,
    with_poisson_arrivals,
)
from klotski_sim.serving.run import ServeSpec, serve
from klotski_sim.util.errors import UsageError
from klotski_sim.workload.model import get_model

from .conftest import overriding, run_cli

TINY = get_model("tiny-mixtral")
# rtx3090 with a decompression rate (FluxMoE's lower measurement) for the compressed tier
PAGED = with_overrides(load_profile("rtx3090"), {"gpu.decompress_bandwidth": 396.5e9})


# ---- the scheduler ----------------------------------------------------------------------------
@st.composite
def batching_cases(draw):
    count = draw(st.integers(1, 12))
    requests = []
    t = 0.0
    online = draw(st.booleans())
    for i in range(count):
        if online:
            t += draw(st.sampled_from([0.0, 0.5, 3.0]))
        requests.append(Request(i, draw(st.integers(1, 40)), draw(st.integers(1, 12)), t))
    chunked = draw(st.booleans())
    budget = draw(st.integers(4, 64))
    if not chunked:  # (a prompt, or a preempted request's recompute, must fit one iteration: refused otherwise)
        budget = max(budget, max(r.total_len - 1 for r in requests))
    config = BatchingConfig(
        max_num_seqs=draw(st.integers(1, 6)),
        max_num_batched_tokens=budget,
        block_size=draw(st.integers(1, 8)),
        chunked_prefill=chunked,
    )
    longest = max(-(-(r.total_len - 1) // config.block_size) for r in requests)
    num_blocks = longest + draw(st.integers(0, 3 * longest))
    return Workload(tuple(requests), "test"), config, num_blocks


def drive(workload: Workload, config: BatchingConfig, num_blocks: int, seconds: float = 1.0):
    """The serving loop without ops: each iteration takes `seconds`; every invariant checked as it goes."""
    batcher = ContinuousBatcher(workload, config, num_blocks)
    now, iterations, computed = 0.0, [], {r.id: 0 for r in workload.requests}
    admitted_order: list[int] = []
    while not batcher.done:
        before = {i: s.computed for i, s in enumerate(batcher.seqs)}
        it = batcher.schedule(now)
        assert len(iterations) < 10_000, "the scheduler does not make progress"
        if not it.seqs:
            assert batcher.next_arrival_s() is not None and batcher.next_arrival_s() > now
            now = batcher.next_arrival_s()
            continue
        assert it.tokens <= config.max_num_batched_tokens
        assert len(batcher.running) <= config.max_num_seqs
        assert 0 <= batcher.free_blocks and batcher.blocks_used <= num_blocks
        assert batcher.blocks_used == sum(s.blocks for s in batcher.seqs)
        for k in batcher.running:  # a running request holds the blocks of what it has computed and will compute now
            s = batcher.seqs[k]
            assert s.blocks >= -(-s.computed // config.block_size)
        for item in it.seqs:
            seq = batcher.seqs[item.request]
            assert seq.request.arrival_s <= now
            assert item.new_tokens >= 1 and item.context == before[item.request] + item.new_tokens
            assert seq.blocks * config.block_size >= item.context  # the cache holds what is computed
            if not config.chunked_prefill:
                assert item.new_tokens == seq.to_compute
            if seq.admitted_s == now and item.request not in admitted_order:
                admitted_order.append(item.request)
            computed[item.request] += item.new_tokens
        for victim in it.preempted:
            assert batcher.seqs[victim].computed == 0 and batcher.seqs[victim].blocks == 0
        iterations.append(it)
        batcher.finish(it, now + seconds)
        now += seconds
    return batcher, iterations, computed, admitted_order


@settings(max_examples=150, deadline=None)
@given(batching_cases())
def test_every_request_finishes_once_with_its_tokens_and_the_cache_is_never_overfull(case):
    workload, config, num_blocks = case
    batcher, iterations, computed, admitted = drive(workload, config, num_blocks)
    assert batcher.free_blocks == num_blocks  # everything freed at the end
    preempted = sum(len(it.preempted) for it in iterations)
    assert preempted == batcher.preemptions == sum(s.preemptions for s in batcher.seqs)
    for s in batcher.seqs:
        r = s.request
        assert s.generated == r.output_len and s.finished_s is not None and s.first_token_s <= s.finished_s
        # a request computes its prompt and all outputs but the last once, and again what a preemption dropped
        if not s.preemptions:
            assert computed[r.id] == r.prompt_len + r.output_len - 1
        else:
            assert computed[r.id] > r.prompt_len + r.output_len - 1
    # first come, first served: requests are first admitted in arrival order
    assert admitted == sorted(admitted, key=lambda i: (workload.requests[i].arrival_s, i))


def test_a_request_the_cache_can_never_hold_is_refused_with_the_numbers():
    with pytest.raises(
        ServingRefusal, match=r"request 1 \(100 prompt \+ 30 output tokens\) needs 9 KV blocks of 16 tokens"
    ):
        ContinuousBatcher(
            Workload((Request(0, 10, 10), Request(1, 100, 30)), "t"), BatchingConfig(block_size=16), num_blocks=8
        )
    with pytest.raises(UsageError, match="without chunked prefill a prompt .* of up to 129 tokens"):
        ContinuousBatcher(
            Workload((Request(0, 100, 30),), "t"),
            BatchingConfig(max_num_batched_tokens=64, chunked_prefill=False),
            num_blocks=100,
        )


def test_preemption_takes_the_latest_admitted_and_readmits_it_first():
    """Two requests, a cache of 3 one-token blocks: the second is preempted when the first grows."""
    workload = Workload((Request(0, 1, 3), Request(1, 1, 3)), "t")
    batcher = ContinuousBatcher(workload, BatchingConfig(block_size=1), num_blocks=3)
    it = batcher.schedule(0.0)
    assert [s.request for s in it.seqs] == [0, 1] and it.blocks_used == 2
    batcher.finish(it, 1.0)  # both sampled one token: each now needs a second block
    it = batcher.schedule(1.0)
    assert it.preempted == (1,) and [s.request for s in it.seqs] == [0] and list(batcher.waiting) == [1]
    assert batcher.seqs[1].computed == 0 and batcher.seqs[1].generated == 1  # its token is kept, its cache is not


# ---- workloads ----------------------------------------------------------------------------------
def test_request_files_in_csv_and_json_lines(tmp_path):
    csv = tmp_path / "r.csv"
    csv.write_text("prompt_len,output_len,arrival_s\n10,5,0\n20,7,0.5\n")
    w = read_requests(csv)
    assert [(r.prompt_len, r.output_len, r.arrival_s) for r in w.requests] == [(10, 5, 0.0), (20, 7, 0.5)]
    jl = tmp_path / "r.jsonl"
    jl.write_text('{"prompt_len": 3, "output_len": 4}\n\n{"prompt_len": 5, "output_len": 6}\n')
    assert [(r.prompt_len, r.output_len) for r in read_requests(jl).requests] == [(3, 4), (5, 6)]


@pytest.mark.parametrize(
    "name, text, message",
    [
        ("a.csv", "prompt_len\n3\n", "r/a.csv:1: the header must name prompt_len and output_len"),
        ("b.csv", "prompt_len,output_len\n3,x\n", "r/b.csv:2: output_len 'x' is not a number"),
        ("c.csv", "prompt_len,output_len\n3,0\n", "r/c.csv:2: output_len must be a whole number from 1"),
        ("d.csv", "prompt_len,output_len,arrival_s\n3,4,2\n3,4,1\n", "r/d.csv:3: arrival_s 1.0 is before"),
        ("e.jsonl", '{"prompt_len": 3}\n', "r/e.jsonl:1: output_len must be"),
        ("f.jsonl", "[1]\n", "r/f.jsonl:1: expected an object"),
        ("g.jsonl", '{"prompt_len": 3, "output_len": 4, "x": 1}\n', "r/g.jsonl:1: unknown field"),
        ("h.jsonl", "{\n", "r/h.jsonl:1: not JSON"),
        ("i.csv", "prompt_len,output_len\n", "r/i.csv: no requests"),
        ("j.jsonl", '{"prompt_len": 3, "output_len": 4, "arrival_s": NaN}\n', "r/j.jsonl:1: arrival_s must be"),
        ("k.csv", "prompt_len,output_len\n1,2,3\n", "r/k.csv:2: expected 2 fields"),
    ],
)
def test_a_bad_request_file_is_one_line_naming_its_line(tmp_path, name, text, message):
    folder = tmp_path / "r"
    folder.mkdir()
    (folder / name).write_text(text)
    with pytest.raises(WorkloadError) as err:
        read_requests(folder / name)
    assert message in str(err.value).replace(str(tmp_path) + "/", "") and "\n" not in str(err.value)


def test_poisson_arrivals_are_seeded_and_have_the_rate():
    w = with_poisson_arrivals(fixed_requests(4000, 8, 8), rate=20.0, seed=3, warmup=10)
    times = np.array([r.arrival_s for r in w.requests])
    assert times[0] == 0 and np.all(np.diff(times) >= 0)
    assert 4000 / times[-1] == pytest.approx(20.0, rel=0.05)
    assert [r.warmup for r in w.requests[:11]] == [True] * 10 + [False] and len(w.measured) == 3990
    assert w == with_poisson_arrivals(fixed_requests(4000, 8, 8), rate=20.0, seed=3, warmup=10)


def test_the_shipped_length_distribution_reproduces_its_quantiles():
    dist = builtin_distributions()["sharegpt4-sarathi"]
    w = drawn_requests(20000, "sharegpt4-sarathi", seed=1)
    prompts = np.array([r.prompt_len for r in w.requests])
    outputs = np.array([r.output_len for r in w.requests])
    for p, tokens in dist.prompt_quantiles[10:-10:10]:
        assert np.quantile(prompts, p) == pytest.approx(tokens, rel=0.06, abs=3)
    for p, tokens in dist.output_quantiles[10:-10:10]:
        assert np.quantile(outputs, p) == pytest.approx(tokens, rel=0.06, abs=3)
    fixed = drawn_requests(50, "sharegpt4-sarathi", seed=1, output_len=1024)
    assert {r.output_len for r in fixed.requests} == {1024}


# ---- the serving loop ---------------------------------------------------------------------------
def test_one_request_is_one_prefill_then_a_decode_per_token():
    r = serve(ServeSpec(TINY, load_profile("rtx3090"), "vllm", fixed_requests(1, 12, 5)))
    assert [it.prefill_tokens for it in r.iterations] == [12, 0, 0, 0, 0]
    assert [it.active for it in r.iterations] == [1] * 5
    rec = r.requests[0]
    assert rec.first_token_s == r.iterations[0].end_s and rec.finished_s == r.iterations[-1].end_s
    assert r.metrics.output_tokens == 5 and r.metrics.throughput_tok_s == pytest.approx(5 / rec.finished_s)
    assert r.metrics.tpot_s.mean == pytest.approx((rec.finished_s - rec.first_token_s) / 4)


@pytest.mark.parametrize(
    "policy, options",
    [
        ("vllm", {}),
        ("vllm-o", {"offload_layers": 2}),
        ("ktransformers", {}),
        ("fluxmoe", {"pageable_layers": 2}),
        ("fluxmoe-h", {"pageable_layers": 2, "compressed_share": 0.5, "decompress_on": "compute"}),
    ],
)
def test_an_offline_serving_run_is_a_plain_schedule_the_engine_times_alike(policy, options):
    """Simulated whole, the run's Schedule gives the times its iterations were simulated with."""
    spec = ServeSpec(
        TINY,
        PAGED,
        policy,
        fixed_requests(6, 20, 6),
        BatchingConfig(max_num_seqs=4, max_num_batched_tokens=32, block_size=4),
        options=options,
    )
    r = serve(spec)
    whole = simulate(r.schedule, spec.profile)
    assert whole.meta["status"] == "ok"
    np.testing.assert_allclose(whole.columns["start"], r.timeline.columns["start"], rtol=1e-9, atol=1e-12)
    np.testing.assert_allclose(whole.columns["end"], r.timeline.columns["end"], rtol=1e-9, atol=1e-12)


def test_vllm_o_pages_whole_layers_through_two_blocks():
    spec = ServeSpec(TINY, load_profile("rtx3090"), "vllm-o", fixed_requests(3, 16, 4), options={"offload_layers": 2})
    r = serve(spec)
    tl = r.timeline
    ops = {op.id: k for k, op in enumerate(r.schedule.ops)}
    start, end = tl.columns["start"], tl.columns["end"]
    for it in r.iterations:
        for layer in (0, 1):
            load, attn = ops[f"it{it.index}/L{layer}/load"], ops[f"it{it.index}/L{layer}/attn"]
            assert start[attn] >= end[load]  # read-after-write
    assert r.residency.offloaded_layers == (0, 1) and r.residency.buffer_bytes == 2 * TINY.layer_bytes(0)
    assert tl.meta["peak_gpu_bytes"] <= r.memory.budget_bytes


def test_vllm_is_refused_when_the_weights_leave_no_kv_cache_and_vllm_o_offloads_just_enough():
    mixtral, l40s = get_model("mixtral-8x7b"), load_profile("l40s")
    with pytest.raises(ServingRefusal, match=r"vllm: mixtral-8x7b leaves no KV cache on l40s: .*weights 86\.99 GiB"):
        serve(ServeSpec(mixtral, l40s, "vllm", fixed_requests(2, 8, 8)))
    r = serve(ServeSpec(mixtral, l40s, "vllm-o", fixed_requests(2, 8, 8)))
    count = len(r.residency.offloaded_layers)
    assert r.memory.num_blocks >= 1 and 0 < count < 32
    # one layer fewer would not have run: the policy offloads the fewest that leave a KV cache
    with pytest.raises(ServingRefusal):
        serve(ServeSpec(mixtral, l40s, "vllm-o", fixed_requests(2, 8, 8), options={"offload_layers": count - 1}))


def test_fluxmoe_materialises_each_pageable_layer_from_both_tiers_in_proportion_to_their_bandwidths():
    spec = ServeSpec(TINY, PAGED, "fluxmoe", fixed_requests(3, 16, 4), options={"pageable_layers": 2})
    r = serve(spec)
    rate, link = 396.5e9, PAGED.links.pcie_h2d.bandwidth
    share = rate / (rate + link)  # bandwidth-balanced: both parts land together
    layer_bytes = TINY.moe_layer_bytes(0)
    ops = {op.id: (k, op) for k, op in enumerate(r.schedule.ops)}
    start, end = r.timeline.columns["start"], r.timeline.columns["end"]
    for it in r.iterations:
        for layer in (0, 1):
            at = f"it{it.index}/L{layer}"
            (d, dec), (c, copy), (e, _) = ops[f"{at}/decompress"], ops[f"{at}/copy"], ops[f"{at}/moe"]
            assert dec.bytes == int(share * layer_bytes) and dec.bytes + copy.bytes == layer_bytes
            assert end[d] - start[d] == pytest.approx(dec.bytes / rate + PAGED.gpu.kernel_overhead_s)
            assert start[e] >= max(end[d], end[c])  # read-after-write
    # the compressed tier stores 67.9% of its share; the rest of the pageable experts is in host memory
    stored = 2 * share * layer_bytes * (1 - 0.321)
    assert r.residency.gpu_weight_bytes == pytest.approx(TINY.total_bytes() - 2 * layer_bytes + stored, abs=2)
    assert r.residency.host_weight_bytes == pytest.approx(2 * (1 - share) * layer_bytes, abs=2)


def test_fluxmoe_h_keeps_each_pageable_layer_in_one_tier_and_a_block_is_reused_only_after_its_reader():
    four = get_model("tiny-mixtral")  # 2 layers: two pageable layers, the first compressed, the second copied
    spec = ServeSpec(
        four, PAGED, "fluxmoe-h", fixed_requests(2, 8, 3), options={"pageable_layers": 2, "compressed_share": 0.5}
    )
    r = serve(spec)
    names = {op.id for op in r.schedule.ops}
    assert "it0/L0/decompress" in names and "it0/L0/copy" not in names
    assert "it0/L1/copy" in names and "it0/L1/decompress" not in names


def test_fluxmoe_needs_a_decompression_rate():
    with pytest.raises(ServingRefusal, match="has no gpu.decompress_bandwidth; give one with --set"):
        serve(ServeSpec(TINY, load_profile("rtx3090"), "fluxmoe", fixed_requests(1, 4, 2)))


def test_serving_options_are_checked_like_policy_options():
    with pytest.raises(Exception, match="option offload_layers must be a whole number >= -1, got -2"):
        serve(
            ServeSpec(TINY, load_profile("rtx3090"), "vllm-o", fixed_requests(1, 4, 2), options={"offload_layers": -2})
        )
    with pytest.raises(Exception, match="serving policy 'vllm' has no option"):
        serve(ServeSpec(TINY, load_profile("rtx3090"), "vllm", fixed_requests(1, 4, 2), options={"x": 1}))


def test_the_serve_command_prints_every_policys_metrics(tmp_path):
    code, out, err = run_cli(
        "serve", "--model", "tiny-mixtral", "--hardware", "rtx3090", "--policies", "vllm,vllm-o,ktransformers,fluxmoe",
        "--set", "gpu.decompress_bandwidth=4e11",
        "--requests", "8", "--prompt-len", "16", "--output-len", "8", "--out", str(tmp_path / "s"),
    )  # fmt: skip
    assert code == 0, err
    for policy in ("vllm", "vllm-o", "ktransformers", "fluxmoe"):
        assert any(line.startswith(policy + " ") for line in out.splitlines()), out
    assert "tok/s" in out and "TTFT" in out and "B_act" in out
    report = json.loads((tmp_path / "s" / "serving.json").read_text())
    assert set(report["policies"]) == {"vllm", "vllm-o", "ktransformers", "fluxmoe"}
    assert report["policies"]["vllm"]["metrics"]["output_tokens"] == 8 * 8
    assert (tmp_path / "s" / "serving.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_serve_writes_each_policys_timeline_when_asked(tmp_path, capsys):
    import gzip

    from klotski_sim.cli.main import main

    out = tmp_path / "s"
    args = ["serve", "--model", "tiny-mixtral", "--hardware", "rtx3090", "--policies", "vllm-o", "--requests", "3"]
    args += ["--output-len", "5", "--option", "vllm-o.offload_layers=1", "--out", str(out), "--timeline"]
    assert main(args) == 0
    trace = json.loads(gzip.decompress((out / "vllm-o" / "trace.json.gz").read_bytes()))
    names = {e.get("args", {}).get("op") for e in trace["traceEvents"]}
    assert {"it0/L1/load", "it4/lm_head"} <= names  # every iteration's ops, the paging copies included
    assert (out / "vllm-o" / "gantt.png").read_bytes()[:4] == b"\x89PNG"
    assert main(["serve", "--model", "tiny-mixtral", "--hardware", "rtx3090", "--timeline"]) == 2
    assert "--timeline writes into --out DIR" in capsys.readouterr().err


def assert_same_times(a, b):
    """Equal records, their times to rounding: a compiled iteration adds the same durations in
    another order (klotski_sim.core.maxplus)."""
    assert type(a) is type(b)
    if isinstance(a, float):
        assert a == pytest.approx(b, rel=1e-12, abs=1e-15, nan_ok=True)
    elif isinstance(a, (tuple, list)):
        assert len(a) == len(b)
        for x, y in zip(a, b):
            assert_same_times(x, y)
    elif hasattr(a, "__dataclass_fields__"):
        for name in a.__dataclass_fields__:
            assert_same_times(getattr(a, name), getattr(b, name))
    else:
        assert a == b


@pytest.mark.parametrize(
    "policy, options",
    [
        ("vllm", {}),
        ("vllm-o", {"offload_layers": 1}),
        ("ktransformers", {}),
        ("fluxmoe", {"pageable_layers": 2}),
        ("fluxmoe-h", {"pageable_layers": 2}),
        ("fluxmoe", {"pageable_layers": 2, "decompress_on": "compute"}),
        ("fluxmoe", {"adaptive": True, "control_interval": 2}),
    ],
)
def test_a_run_that_keeps_no_ops_times_known_shapes_compiled_and_gives_the_same_metrics(policy, options):
    """keep=False times most iterations from a compiled template (no ops emitted): the same metrics
    and iterations as the kept run, which emits and times every op with the engine."""
    spec = ServeSpec(TINY, PAGED, policy, fixed_requests(6, 12, 9), BatchingConfig(max_num_seqs=4), options=options)
    kept, dropped = serve(spec), serve(spec, keep=False)
    assert dropped.schedule is None and dropped.timeline is None
    assert_same_times(dropped.metrics, kept.metrics)
    assert_same_times(dropped.iterations, kept.iterations)
    assert dropped.meta["decisions"] == kept.meta["decisions"]
    compiled = dropped.meta["iterations_timed_compiled"]
    assert kept.meta["iterations_timed_compiled"] == 0
    if options.get("decompress_on") == "compute":  # two streams on the GPU: the engine queues, times it all
        assert compiled == 0
    else:
        assert compiled >= len(dropped.iterations) // 3


@pytest.mark.parametrize(
    "policy, options, loads, reader",
    [
        ("fluxmoe", {"pageable_layers": 4}, ("decompress", "copy"), "moe"),
        ("vllm-o", {"offload_layers": 4}, ("load",), "moe"),
    ],
)
def test_a_weight_block_is_overwritten_only_after_the_layer_that_read_it(policy, options, loads, reader):
    """Two reusable blocks: pageable layer k's materialisation waits for layer k-2's last read of its block."""
    small = get_model("small-mixtral")  # 4 layers, all pageable
    r = serve(ServeSpec(small, PAGED, policy, fixed_requests(4, 24, 5), options=options))
    index = {op.id: k for k, op in enumerate(r.schedule.ops)}
    start, end = r.timeline.columns["start"], r.timeline.columns["end"]
    for it in r.iterations:
        for layer in (2, 3):
            for load in loads:
                assert (
                    start[index[f"it{it.index}/L{layer}/{load}"]] >= end[index[f"it{it.index}/L{layer - 2}/{reader}"]]
                )
    # at most two layers' blocks are held at once, beside what stays resident
    held = r.residency.gpu_weight_bytes + r.memory.kv_bytes + r.memory.activation_bytes
    assert r.timeline.meta["peak_gpu_bytes"] <= held + r.residency.buffer_bytes


# ---- FluxMoE's residency planner ----------------------------------------------------------------
def planner(layers=8, interval=1):
    from klotski_sim.serving.policies.fluxmoe_planner import ResidencyPlanner

    return ResidencyPlanner(
        tuple(range(layers)), {j: 300 for j in range(layers)}, {j: {"gate_up", "down"} for j in range(layers)},
        stored_share=0.5, block_bytes=10, control_interval=interval,
    )  # fmt: skip


def test_the_planner_reclaims_down_projections_first_then_gate_up_and_reverses_the_last_step():
    from klotski_sim.serving.policies.fluxmoe_planner import Feedback

    p = planner()
    waiting = Feedback(active=4, unfinished=10, tau_load=1.0, tau_eff=1.0, free_blocks=0)
    action, step = p.decide(waiting)
    # ceil(0.25 x 8) = 2 down tensors of 100 bytes, stored at half: 100 bytes freed, 10 blocks
    assert (
        action == "reclaim"
        and step.tensors == ((0, "down"), (1, "down"))
        and (step.freed_bytes, step.blocks) == (100, 10)
    )
    for _ in range(3):
        p.decide(waiting)
    assert all("down" not in p.on_gpu[j] for j in range(8))
    action, step = p.decide(waiting)  # no down tensor left: ceil(0.25 x 8 / 2) = 1 gate/up tensor
    assert action == "reclaim" and step.tensors == ((0, "gate_up"),) and p.share(0) == 0
    assert p.share(1) == pytest.approx(2 / 3)
    # nobody waits and the loads are exposed (forward covers 50% of them): the last step comes back,
    # when the KV cache can give its blocks up
    exposed = Feedback(active=4, unfinished=4, tau_load=2.0, tau_eff=1.0, free_blocks=0)
    assert p.decide(exposed) == ("keep", None)
    action, step = p.decide(Feedback(4, 4, 2.0, 1.0, free_blocks=step.blocks))
    assert action == "reverse" and step.tensors == ((0, "gate_up"),) and p.share(0) == pytest.approx(2 / 3)
    hidden = Feedback(active=4, unfinished=4, tau_load=1.0, tau_eff=1.0, free_blocks=10**6)
    assert p.decide(hidden) == ("keep", None)  # the loads are hidden: nothing to gain


def test_the_planner_decides_once_per_control_interval():
    from klotski_sim.serving.policies.fluxmoe_planner import Feedback

    p = planner(interval=16)
    waiting = Feedback(active=4, unfinished=10, tau_load=1.0, tau_eff=1.0, free_blocks=0)
    actions = [p.decide(waiting)[0] for _ in range(48)]
    assert [k for k, a in enumerate(actions) if a == "reclaim"] == [15, 31, 47]


def test_adaptive_fluxmoe_grows_the_kv_cache_under_pressure_within_the_memory_budget():
    small = get_model("small-mixtral")
    profile = with_overrides(PAGED, {"gpu.memory_bytes": 2.2e9})
    w = with_poisson_arrivals(fixed_requests(60, 40, 24), rate=400.0, seed=1)
    options = {"adaptive": True, "pageable_layers": 4, "control_interval": 4}
    spec = ServeSpec(small, profile, "fluxmoe", w, BatchingConfig(max_num_seqs=64), options=options)
    r = serve(spec)
    decisions = r.schedule.meta["decisions"]
    assert any(" reclaim L" in d for d in decisions), decisions
    assert max(it.blocks_used for it in r.iterations) > r.memory.num_blocks  # more than the cache it started with
    assert r.timeline.meta["peak_gpu_bytes"] <= r.memory.budget_bytes
    assert all(rec.finished_s > 0 for rec in r.requests)
    # timed from compiled shapes between the moves, the run decides the same moves at the same times
    dropped = serve(spec, keep=False)
    assert dropped.meta["decisions"] == decisions and dropped.meta["iterations_timed_compiled"] > 0
    assert_same_times(dropped.iterations, r.iterations)
    assert_same_times(dropped.metrics, r.metrics)


def test_an_offline_run_whose_residency_changes_is_still_a_schedule_the_engine_times_alike():
    small = get_model("small-mixtral")
    profile = with_overrides(PAGED, {"gpu.memory_bytes": 2.2e9})
    options = {"adaptive": True, "pageable_layers": 4, "control_interval": 2}
    r = serve(
        ServeSpec(
            small, profile, "fluxmoe", fixed_requests(40, 40, 16), BatchingConfig(max_num_seqs=64), options=options
        )
    )
    assert any(" reclaim L" in d for d in r.schedule.meta["decisions"])
    whole = simulate(r.schedule, profile)
    assert whole.meta["status"] == "ok" and whole.meta["peak_gpu_bytes"] <= r.memory.budget_bytes
    np.testing.assert_allclose(whole.columns["end"], r.timeline.columns["end"], rtol=1e-9, atol=1e-12)


@pytest.mark.parametrize(
    "args, message",
    [
        (("--policies", "klotski"), "klotski schedules a fixed number of equal batches"),
        (("--policies", "vllm,nope"), "--policies: unknown nope"),
        (("--option", "vllm.x=1"), "serving policy 'vllm' has no option(s) ['x']"),
        (("--option", "x=1"), "--option x: name a policy being served as POLICY.KEY"),
        (
            ("--option", "vllm-o.offload_layers=abc", "--policies", "vllm-o"),
            "offload_layers must be a whole number >= -1",
        ),
        (("--gpu-memory-utilization", "1.5"), "at most 1, got 1.5"),
        (("--rate", "-1"), "--rate: expected a finite number > 0"),
        (("--warmup", "2"), "--warmup needs --rate"),
        (("--rate", "5", "--warmup", "8", "--requests", "8"), "--warmup 8: must be from 0 to 7"),
        (("--requests-file", "/nonexistent/r.csv"), "/nonexistent/r.csv: cannot read request file"),
        (("--lengths", "sharegpt4-sarathi", "--requests-file", "x.csv"), "--requests-file and --lengths both"),
        (("--requests", "0"), "--requests"),
        (("--max-num-batched-tokens", "8", "--no-chunked-prefill", "--prompt-len", "52"), "without chunked prefill"),
        (
            ("--model", "mixtral-8x7b", "--hardware", "l40s", "--policies", "vllm"),
            "refused: vllm: mixtral-8x7b leaves no KV",
        ),
    ],
)
def test_bad_serve_input_is_one_line(args, message, capsys):
    from klotski_sim.cli.main import main

    base = [
        "serve",
        "--model",
        "tiny-mixtral",
        "--hardware",
        "rtx3090",
        "--requests",
        "4",
        "--output-len",
        "4",
        "--policies",
        "vllm",
    ]
    try:
        code = main(overriding(base, *args))
    except SystemExit as exit:  # (argparse's usage errors)
        code = exit.code
    out, err = capsys.readouterr()
    if message.startswith("refused:"):  # a policy that cannot serve is a row; the others still run
        assert code == 0 and message in out, out
        return
    assert code == 2 and message in err and err.count("\n") == 1 and "Traceback" not in err, (out, err)


# ---- sweeps -------------------------------------------------------------------------------------
SERVING_SPEC = """
name: residency
models: [small-mixtral]
hardware: [rtx3090]
overrides:
  gpu.decompress_bandwidth: [4e11]
  gpu.memory_bytes: [2.2e9]
policies: [fluxmoe, fluxmoe-h]
prompt_lens: [40]
options:
  pageable_layers: [2, 4]
serving:
  requests: [16, 40]
  output_lens: [16]
"""


def test_a_serving_sweep_runs_each_configuration_as_serve_does(tmp_path):
    import yaml

    from klotski_sim.runs.sweep import collect, grid_size, parse_spec, run_sweep

    spec = parse_spec(yaml.safe_load(SERVING_SPEC))
    assert grid_size(spec) == 8
    df = run_sweep(spec, tmp_path / "out", workers=1, progress=False)
    assert len(df) == 8 and set(df["status"]) == {"ok", "refused"}
    assert (df[df["opt.pageable_layers"] == 2]["status"] == "refused").all()  # two layers leave no KV cache
    row = df[(df["policy"] == "fluxmoe") & (df["requests"] == 40) & (df["opt.pageable_layers"] == 4)].iloc[0]
    profile = with_overrides(load_profile("rtx3090"), {"gpu.decompress_bandwidth": 4e11, "gpu.memory_bytes": 2.2e9})
    alone = serve(
        ServeSpec(
            get_model("small-mixtral"), profile, "fluxmoe", fixed_requests(40, 40, 16), options={"pageable_layers": 4}
        )
    )
    assert row["m.throughput_tok_s"] == pytest.approx(alone.metrics.throughput_tok_s)
    assert row["m.kv_blocks"] == alone.memory.num_blocks
    again = run_sweep(spec, tmp_path / "out", workers=1, progress=False)  # resumable: nothing runs again
    assert list(again["id"]) == list(df["id"]) and len(collect(tmp_path / "out")) == 8


@pytest.mark.parametrize(
    "change, message",
    [
        ("policies: [fluxmoe, vllm-o]", "options.pageable_layers: serving policy 'vllm-o' has no option"),
        ("policies: [klotski]", "unknown serving policy 'klotski'"),
        ("gen_lens: [8]", "gen_lens: an offline axis"),
        ("serving:\n  rates: [0]", "rates are 'offline' or requests per second > 0"),
        ("serving:\n  lengths: [nope]", "lengths: 'nope' is not one of fixed"),
        ("serving:\n  requests: [4, 4]", "4 is given twice"),
        ("serving:\n  warmup: 2", "serving.warmup needs rates"),
    ],
)
def test_a_bad_serving_grid_is_refused_before_it_runs(change, message):
    import yaml

    from klotski_sim.runs.sweep import check_spec, parse_spec
    from klotski_sim.util.errors import KlotskiError

    data = yaml.safe_load(SERVING_SPEC)
    data.update(yaml.safe_load(change))
    with pytest.raises(KlotskiError, match=message.replace("(", "\\(").replace(")", "\\)").replace("[", "\\[")):
        check_spec(parse_spec(data), "spec")


# ---- the residency search -----------------------------------------------------------------------
@given(st.lists(st.tuples(st.floats(1, 100), st.floats(0.001, 1)), min_size=1, max_size=12))
def test_the_pareto_front_is_undominated_and_dominates_the_rest(pairs):
    from klotski_sim.runs.serving_search import Point, best, pareto

    points = [Point(k, 0.5, thr, tpot, 0.1, 1.0) for k, (thr, tpot) in enumerate(pairs)]
    front = pareto(points)

    def beats(q, p):
        return (
            q.throughput_tok_s >= p.throughput_tok_s
            and q.tpot_s <= p.tpot_s
            and q != p
            and (q.throughput_tok_s, q.tpot_s) != (p.throughput_tok_s, p.tpot_s)
        )

    assert front and all(not any(beats(q, p) for q in points) for p in front)
    assert all(
        p in front
        or any(beats(q, p) for q in front)
        or any((q.throughput_tok_s, q.tpot_s) == (p.throughput_tok_s, p.tpot_s) for q in front)
        for p in points
    )
    cap = sorted(t for _, t in pairs)[len(pairs) // 2]
    chosen = best(points, cap)
    assert chosen.tpot_s <= cap and chosen.throughput_tok_s == max(
        p.throughput_tok_s for p in points if p.tpot_s <= cap
    )


def test_the_serve_search_finds_a_residency_that_reproduces(capsys):
    import re

    from klotski_sim.cli.main import main

    args = ["serve", "--model", "small-mixtral", "--hardware", "rtx3090", "--set", "gpu.decompress_bandwidth=4e11"]
    args += ["--set", "gpu.memory_bytes=2.2e9", "--policies", "fluxmoe", "--requests", "24", "--prompt-len", "40"]
    args += ["--output-len", "12"]
    assert main([*args, "--search"]) == 0
    out = capsys.readouterr().out
    found = re.search(
        r"^best: \d+ pageable layers, .*: ([\d.]+) tok/s, .*reproduce: --policies fluxmoe (.*)$", out, re.M
    )
    assert found, out
    claimed, reproduce = float(found.group(1)), found.group(2).split()
    ran = [line for line in out.splitlines() if re.match(r"^\s+\d+\s+[\d.]+\s+[\d.]+\s", line)]
    assert claimed == max(float(line.split()[2]) for line in ran)  # the best of the points served
    assert main([*args, *reproduce]) == 0
    row = next(x for x in capsys.readouterr().out.splitlines() if x.startswith("fluxmoe "))
    assert float(row.split()[1]) == pytest.approx(claimed, rel=1e-3)
    assert main([*args, "--search", "--max-tpot", "0.000001"]) == 3  # nothing that fast
    assert main([*args, "--max-tpot", "5"]) == 2  # a cap without a search
