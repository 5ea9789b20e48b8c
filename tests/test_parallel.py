"""Many GPUs: collectives against hand computations, placement and replication invariants, the
locality that co-activation placement and grouping buy, and the `parallel` command."""

from __future__ import annotations

import json
from dataclasses import replace

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from klotski_sim.core.collectives import all_gather_seconds, all_reduce_seconds, all_to_all_seconds, best_all_reduce
from klotski_sim.hardware.profile import FabricSpec, load_profile
from klotski_sim.parallel.decode import ParallelSetup, dispatch_bytes, group_sequences, simulate_decode
from klotski_sim.parallel.placement import (
    ExpertPlacement,
    balance,
    by_coactivation,
    by_popularity,
    replicate,
    round_robin,
)
from klotski_sim.util.errors import UsageError
from klotski_sim.workload.model import get_model
from klotski_sim.workload.routing import RoutingTable, RunShape

from .conftest import overriding, run_cli

FABRIC = FabricSpec(kind="nvlink", gpus=8, bandwidth=100e9, base_latency_s=10e-6, step_latency_s=2e-6)


def test_collectives_match_their_alpha_beta_terms_by_hand():
    mb = 1e6
    # ring all-reduce on 4 GPUs: 2*3 steps, 2*3/4 of the buffer sent
    assert all_reduce_seconds(8 * mb, 4, FABRIC, "ring") == pytest.approx(10e-6 + 6 * 2e-6 + 1.5 * 8 * mb / 100e9)
    # tree on 8 GPUs: 2*log2(8) = 6 steps, twice the buffer
    assert all_reduce_seconds(8 * mb, 8, FABRIC, "tree") == pytest.approx(10e-6 + 6 * 2e-6 + 2 * 8 * mb / 100e9)
    assert all_gather_seconds(8 * mb, 4, FABRIC) == pytest.approx(10e-6 + 3 * 2e-6 + 0.75 * 8 * mb / 100e9)
    assert all_reduce_seconds(8 * mb, 1, FABRIC) == all_gather_seconds(8 * mb, 1, FABRIC) == 0.0
    # small buffers take the tree (fewer steps), large ones the ring (less sent)
    assert best_all_reduce(1e3, 8, FABRIC)[1] == "tree" and best_all_reduce(1e9, 8, FABRIC)[1] == "ring"
    # all-to-all: round r pairs i -> i+r; each round lasts its largest message
    sent = np.array([[0, 5, 1], [2, 0, 3], [4, 6, 0]]) * mb
    rounds = max(5, 3, 4) + max(1, 2, 6)  # r=1: 0->1, 1->2, 2->0; r=2: 0->2, 1->0, 2->1
    assert all_to_all_seconds(sent, FABRIC) == pytest.approx(10e-6 + 2 * 2e-6 + rounds * mb / 100e9)
    with pytest.raises(UsageError):
        all_to_all_seconds(np.zeros((2, 3)), FABRIC)


@settings(max_examples=150, deadline=None)
@given(
    tokens=st.lists(st.integers(0, 200), min_size=2, max_size=16),
    ranks=st.integers(2, 5),
    spare=st.integers(0, 3),
    seed=st.integers(0, 10**6),
)
def test_replication_computes_every_token_once_and_never_raises_the_busiest_rank(tokens, ranks, spare, seed):
    tokens = np.array(tokens)
    predicted = np.random.default_rng(seed).permutation(tokens).astype(float)  # a prediction, not the truth
    for base in (round_robin(len(tokens), ranks), by_popularity(predicted, ranks)):
        plain = balance(base, tokens)
        replicated = replicate(base, predicted, spare)
        assigned = balance(replicated, tokens)
        assert (assigned.sum(axis=1) == tokens).all()  # every token once
        for e, where in enumerate(replicated.replicas):  # by exactly one of its replicas
            assert set(np.flatnonzero(assigned[e])) <= set(where)
        assert assigned.sum(axis=0).max() <= plain.sum(axis=0).max()
        assert (replicated.experts_on() <= -(-len(tokens) // ranks) + spare).all()
        assert [r[0] for r in replicated.replicas] == [r[0] for r in base.replicas]  # homes stay


def test_popularity_placement_balances_what_round_robin_does_not():
    load = np.array([100, 2, 90, 3, 80, 5, 70, 10], dtype=float)  # heavy experts on even ids
    rr = balance(round_robin(8, 2), load).sum(axis=0)
    pop = balance(by_popularity(load, 2), load).sum(axis=0)
    assert rr.max() / rr.mean() > 1.3 and pop.max() / pop.mean() < 1.05
    assert (by_popularity(load, 2).experts_on() == 4).all()


def _clustered_routing(num_batches=2, batch_size=16, prompt=32, gen=5, experts=8, layers=2, clusters=True, seed=0):
    """Routing whose tokens pick their 2 experts within one of 4 fixed pairs (co-activation), or
    any 2 at random; a sequence keeps its pair (its domain) across its tokens and layers."""
    rng = np.random.default_rng(seed)
    shape = RunShape(batch_size, num_batches, prompt, gen)
    ids = np.empty((num_batches, batch_size, shape.tokens_per_sequence, layers, 2), dtype=np.int64)
    pairs = np.array([[0, 5], [1, 6], [2, 7], [3, 4]])  # never both on one rank under round-robin over 2
    for b in range(num_batches):
        for s in range(batch_size):
            if clusters:
                ids[b, s] = pairs[rng.integers(4)]
            else:
                for t in range(shape.tokens_per_sequence):
                    for layer in range(layers):
                        ids[b, s, t, layer] = rng.choice(experts, 2, replace=False)
    return RoutingTable(ids, shape, experts)


def test_coactivation_placement_and_grouping_cut_all_to_all_bytes_only_where_routing_has_them():
    model = get_model("tiny-mixtral:2")
    model = type(model)(**{**model.__dict__, "num_experts": 8})
    profile = load_profile("h200")

    def a2a(routing, placement, grouping=False):
        setup = ParallelSetup(2, "ep", placement, 0, grouping)
        return simulate_decode(model, profile, routing, setup).all_to_all_bytes

    clustered = _clustered_routing()
    assert a2a(clustered, "coactivation") < 0.6 * a2a(clustered, "round-robin")
    assert a2a(clustered, "coactivation", grouping=True) < 0.1 * a2a(clustered, "round-robin")
    uniform = _clustered_routing(clusters=False)
    assert a2a(uniform, "coactivation") > 0.85 * a2a(uniform, "round-robin")


def test_dispatch_sends_a_token_once_to_each_other_rank_it_needs():
    compute = np.array([[0, 1], [1, 1], [2, 0]])  # token 0 at home 0 needs ranks 0 and 1; ...
    home = np.array([0, 0, 1])
    sent = dispatch_bytes(compute, home, 3, 10)
    expected = np.zeros((3, 3))
    expected[0, 1] = 10 + 10  # tokens 0 and 1 (token 1's two experts both on rank 1: once)
    expected[1, 2] = expected[1, 0] = 10  # token 2 from rank 1 to ranks 2 and 0
    assert (sent == expected).all()


def test_grouping_keeps_ranks_within_their_share():
    affinity = np.array([[9, 0], [8, 1], [7, 2], [0, 5]], dtype=float)
    ranks = group_sequences(affinity, 2)
    assert np.bincount(ranks, minlength=2).tolist() == [2, 2]
    assert ranks[0] == 0 and ranks[3] == 1


def test_coactivation_placement_puts_pairs_together():
    co = np.zeros((4, 4))
    co[0, 3] = co[3, 0] = co[1, 2] = co[2, 1] = 50
    placed = by_coactivation(np.array([10, 9, 8, 7.0]), co, 2).home()
    assert placed[0] == placed[3] and placed[1] == placed[2] and placed[0] != placed[1]
    assert isinstance(round_robin(4, 2), ExpertPlacement)


def test_parallel_command_prints_every_configuration_and_refuses_in_one_line(tmp_path):
    rc, out, err = run_cli(
        "parallel",
        "--model",
        "qwen3-30b-a3b:4",
        "--hardware",
        "h20",
        "--gpus",
        "4",
        "--batch-size",
        "16",
        "--prompt-len",
        "16",
        "--gen-len",
        "3",
        "--replicas",
        "0,1",
        "--group",
    )
    assert rc == 0, err
    rows = [line for line in out.splitlines() if line.startswith(("tp4", "ep4"))]
    assert len(rows) == 1 + 3 * 2 * 2, out
    for row in rows:
        step_ms, tok_s = (float(x) for x in row[38:].split()[:2])
        assert step_ms > 0 and tok_s > 0
    for args, needle in [
        (("--hardware", "rtx3090", "--gpus", "2"), "no `fabric:` section"),
        (("--hardware", "l40s", "--gpus", "8"), "has 4 GPUs"),
        (("--hardware", "h20", "--gpus", "2", "--placement", "nearest"), "--placement nearest"),
        (("--hardware", "h20", "--gpus", "2", "--replicas", "x"), "--replicas"),
    ]:
        rc, out, err = run_cli("parallel", "--model", "tiny-mixtral", *args)
        assert rc == 2 and err.count("\n") == 1 and needle in err, (args, err)


# ---- tensor parallelism for every policy: the group as one device, its all-reduces in the schedule ---------
TP_RUN = dict(model="tiny-mixtral", hardware="l40s", batch_size=2, num_batches=2, prompt_len=6, gen_len=3)


def test_a_tensor_parallel_group_is_g_gpus_and_g_links_as_far_as_host_memory_feeds_them():
    from klotski_sim.hardware.profile import with_overrides
    from klotski_sim.parallel.tensor import group_machine

    one, model = load_profile("l40s"), get_model("mixtral-8x7b")
    assert group_machine(one, 1, model) is one  # (one GPU: the profile itself, untouched)
    two = group_machine(one, 2, model)
    assert two.tensor_parallel == 2 and two.name == "l40s-tp2"
    assert two.gpu.memory_bytes == 2 * one.gpu.memory_bytes and two.gpu.peak_flops == 2 * one.gpu.peak_flops
    assert two.gpu.memory_bandwidth == 2 * one.gpu.memory_bandwidth
    assert two.gpu.kernel_overhead_s == one.gpu.kernel_overhead_s  # (every rank launches its shard's at once)
    assert two.links.pcie_h2d.bandwidth == 2 * one.links.pcie_h2d.bandwidth and two.links.nvme == one.links.nvme
    assert "2 GPUs' own links" in two.sources["links.pcie_h2d.bandwidth"]
    starved = with_overrides(one, {"cpu.memory_bandwidth": 30e9})  # host memory feeds less than 2 links take
    capped = group_machine(starved, 2, model)
    assert (
        capped.links.pcie_h2d.bandwidth == 30e9
        and "capped by host memory" in capped.sources["links.pcie_h2d.bandwidth"]
    )


def test_tensor_parallel_schedules_reduce_twice_a_layer_and_wait_for_it():
    """Every (step, layer, batch) gets one all-reduce after attention, read by its router and experts,
    and one after its MLP side, read by the next layer's attention or the LM head; each lasts what the
    fabric's best all-reduce of the batch's hidden states costs, by hand for 2 GPUs on PCIe; the other
    ops take at most their one-GPU time (half the work, the same kernel launches)."""
    from klotski_sim.runs.runner import RunSpec, run

    for policy in ("single-batch", "klotski", "flexgen", "fiddler"):
        one = run(RunSpec(policy=policy, **TP_RUN))
        two = run(RunSpec(policy=policy, gpus=2, **TP_RUN))
        ops = {op.id: op for op in two.schedule.ops}
        reduces = [op for op in two.schedule.ops if op.category == "allreduce"]
        attention = [op for op in two.schedule.ops if op.category == "attention"]
        keys = {(op.step, op.layer, b) for op in attention for b in op.batches}
        assert len(reduces) == 2 * len(keys) and all(two.schedule.streams[op.stream] == "fabric" for op in reduces)
        after = {op.id: op for op in reduces}
        for op in two.schedule.ops:
            waits = [after[d] for d in op.deps if d in after]
            if op.category == "gate":
                assert {(r.step, r.layer, r.batches[0]) for r in waits} == {(op.step, op.layer, b) for b in op.batches}
            if op.category in ("attention", "lm_head") and op.phase and (op.layer > 0 or op.category == "lm_head"):
                assert waits and all(r.id.endswith("mlp/allreduce") for r in waits), op.id
        fabric = load_profile("l40s").fabric
        ends, starts = two.timeline.columns["end"], two.timeline.columns["start"]
        index = two.schedule.index
        for r in reduces:
            tokens = r.tokens
            hand = 8.4e-6 + 2 * 5.7e-6 + 2 * (1 / 2) * get_model("tiny-mixtral").hidden_bytes(tokens) / fabric.bandwidth
            assert ends[index[r.id]] - starts[index[r.id]] == pytest.approx(hand, rel=1e-9)
        took_one = np.subtract(one.timeline.columns["end"], one.timeline.columns["start"])
        single = dict(zip((op.id for op in one.schedule.ops), took_one))
        for op, took in zip(two.schedule.ops, np.subtract(ends, starts)):
            if op.kind == "compute" and op.category != "allreduce" and two.schedule.streams[op.stream] == "gpu":
                assert took <= single[op.id] + 1e-12, (policy, op.id)
        assert set(single) < set(ops)  # (the one-GPU schedule's ops, all there)


def test_one_gpu_is_todays_run_byte_for_byte(tmp_path):
    args = ["simulate", "--model", "tiny-mixtral", "--hardware", "l40s", "--policy", "klotski", "--batch-size", "2"]
    args += ["--prompt-len", "6", "--gen-len", "3", "--no-png"]
    assert run_cli(*args, "--out", str(tmp_path / "a"))[0] == 0
    assert run_cli(*args, "--gpus", "1", "--out", str(tmp_path / "b"))[0] == 0
    for name in ("schedule.json", "summary.json", "timeline.csv"):
        assert (tmp_path / "a" / name).read_bytes() == (tmp_path / "b" / name).read_bytes(), name


def test_compare_and_serve_on_two_gpus_run_every_policy_and_refuse_in_one_line(tmp_path):
    policies = "single-batch,multi-batch,hot-prefetch,klotski,klotski-oracle,flexgen,fiddler,llamacpp-moe"
    code, out, err = run_cli(
        "compare", "--model", "tiny-mixtral", "--hardware", "l40s", "--gpus", "2", "--batch-size", "2",
        "--prompt-len", "6", "--gen-len", "3", "--policies", policies, "--workers", "1", "--out", str(tmp_path / "c"),
    )  # fmt: skip
    assert code == 0, err
    rows = [line.split() for line in out.splitlines() if line.split()[:1] and line.split()[0] in policies.split(",")]
    assert sorted(r[0] for r in rows) == sorted(policies.split(",")) and all(r[3] == "ok" for r in rows), out
    code, out, err = run_cli(
        "serve", "--model", "tiny-mixtral", "--hardware", "l40s", "--gpus", "2", "--requests", "4",
        "--output-len", "4", "--policies", "vllm,vllm-o,ktransformers,fluxmoe", "--out", str(tmp_path / "s"),
    )  # fmt: skip
    assert code == 0, err
    assert "tiny-mixtral on l40s-tp2" in out and "refused" not in out, out
    for args, said in (
        (["--hardware", "rtx3090", "--gpus", "2"], "has no `fabric:` section"),
        (["--hardware", "l40s", "--gpus", "8"], "has 4 GPUs"),
        (["--hardware", "l40s", "--gpus", "3", "--model", "mixtral-8x7b"], "give a G that divides both"),
        (["--hardware", "h200", "--gpus", "2", "--model", "deepseek-v2-lite"], "multi-head latent attention"),
    ):
        code, out, err = run_cli("simulate", *overriding(["--model", "tiny-mixtral"], *args), "--no-png")
        assert code == 2 and err.count("\n") == 1 and said in err and "--gpus" in err, err


def test_the_serving_runtime_refuses_a_gpu_groups_schedule_in_one_line(tmp_path):
    """(The offline runtime executes one on emulated ranks: tests/test_tensor_parallel_runtime.py.)"""
    pytest.importorskip("torch")
    from .conftest import runtime_in_process

    code, _, err = run_cli(
        "serve", "--model", "tiny-mixtral", "--hardware", "l40s", "--gpus", "2", "--requests", "2",
        "--output-len", "3", "--policies", "vllm", "--timeline", "--out", str(tmp_path / "s"),
    )  # fmt: skip
    assert code == 0, err
    code, _, err = runtime_in_process("execute", str(tmp_path / "s" / "vllm"))
    assert code == 2 and err.count("\n") == 1 and "all-reduce of a tensor-parallel group" in err, err


def test_the_parallel_command_times_each_rank_on_one_of_the_profiles_gpus():
    """`parallel --gpus G` times G ranks of the profile's GPU; its --gpus once also made the run's machine
    a tensor-parallel group of G (G times the FLOP/s and bandwidth for every rank)."""
    from klotski_sim.runs.runner import RunSpec, make_replay

    spec = RunSpec(model="mixtral-8x7b", hardware="l40s", batch_size=8, prompt_len=16, gen_len=3, num_batches=1)
    model = get_model(spec.model)
    _, rep = make_replay(spec, model, 1)
    want = simulate_decode(model, load_profile("l40s"), rep.routing, ParallelSetup(2, "tp"))
    code, out, err = run_cli(
        "parallel", "--model", "mixtral-8x7b", "--hardware", "l40s", "--gpus", "2", "--batch-size", "8",
        "--prompt-len", "16", "--gen-len", "3", "--parallelism", "tp",
    )  # fmt: skip
    assert code == 0, err
    row = next(line.split() for line in out.splitlines() if line.startswith("tp2 "))
    assert float(row[2]) == pytest.approx(want.tokens_per_s, abs=0.05), out


def test_a_sweep_over_group_sizes_keeps_one_gpus_ids_and_refuses_a_serving_grid(tmp_path):
    import pandas as pd

    from klotski_sim.runs.sweep import SweepError, expand, parse_spec

    grid = {"models": ["tiny-mixtral"], "hardware": ["l40s"], "policies": ["klotski"], "batch_sizes": [2]}
    grid |= {"prompt_lens": [6], "gen_lens": [3]}
    one = {c["id"] for c in expand(parse_spec(grid))}
    both = expand(parse_spec({**grid, "gpus": [1, 2]}))
    assert one < {c["id"] for c in both} and [c.get("gpus", 1) for c in both] == [1, 2]
    (tmp_path / "spec.yaml").write_text(json.dumps({**grid, "gpus": [1, 2]}))
    code, out, err = run_cli("sweep", str(tmp_path / "spec.yaml"), "--out", str(tmp_path / "o"), "--no-progress")
    assert code == 0, err
    df = pd.read_parquet(tmp_path / "o" / "results.parquet").sort_values("gpus")
    assert df["gpus"].tolist() == [1, 2] and (df["status"] == "ok").all()
    from klotski_sim.runs.runner import RunSpec, run

    spec = RunSpec(model="tiny-mixtral", hardware="l40s", policy="klotski", batch_size=2, prompt_len=6, gen_len=3)
    alone = [run(replace(spec, num_batches=None, gpus=g)).timeline.summary().to_dict()["makespan_s"] for g in (1, 2)]
    assert df["m.makespan_s"].tolist() == pytest.approx(alone, rel=1e-12)  # (a tiny model: 2 GPUs add all-reduces)
    with pytest.raises(SweepError, match="gpus: a serving grid runs on one GPU"):
        parse_spec({**grid, "policies": ["vllm"], "gpus": [2], "serving": {"requests": [4]}})


def test_a_group_larger_than_the_kv_heads_copies_one_to_each_rank():
    """Qwen3-30B-A3B has 4 KV heads: on 8 GPUs each rank keeps a copy of one (vLLM's replication), so
    the group holds 8 heads' cache and K/V projections; 3 GPUs neither divide 4 nor are a multiple."""
    from klotski_sim.parallel.tensor import group_model
    from klotski_sim.runs.runner import RunSpec, prepare

    model = get_model("qwen3-30b-a3b")
    spec = RunSpec(model="qwen3-30b-a3b:2", hardware="h20", gpus=8, num_batches=1, prompt_len=8, gen_len=2)
    prepared = prepare(spec)
    assert prepared.model.num_kv_heads == 8 and prepared.model.kv_bytes_per_token() == 2 * 8 * 128 * 2
    assert group_model(model, 4) == model  # (4 ranks: one KV head each, no copy)
    grouped = group_model(model, 8)
    assert grouped.attention_bytes() - model.attention_bytes() == 4 * 128 * 2048 * 2 * 2  # k and v of 4 more heads
    with pytest.raises(UsageError, match="give a G that divides both"):
        group_model(get_model("mixtral-8x7b"), 3)


def test_the_parallel_command_refuses_flags_of_offloaded_runs():
    args = ["parallel", "--model", "tiny-mixtral", "--hardware", "h200", "--gpus", "2", "--gen-len", "3"]
    code, _, err = run_cli(*args, "--kv", "cpu", "--impl", "ideal")
    assert code == 2 and err.startswith("error: --kv cpu, --impl ideal: parallel times decode steps with every"), err
    assert len(err.strip().splitlines()) == 1
    code, _, err = run_cli(*args, "--policy-timeout", "5")  # (no policy file runs here: nothing to limit)
    assert code == 2 and err.startswith("error: --policy-timeout: parallel times decode steps"), err


# ---- expert parallelism with offloading: each rank's experts that do not fit stay in host memory -----------
def _mixtral_on(gpu_gb: float | None, setup: ParallelSetup):
    from klotski_sim.hardware.profile import with_overrides
    from klotski_sim.runs.runner import RunSpec, make_replay

    spec = RunSpec(model="mixtral-8x7b", hardware="l40s", batch_size=16, prompt_len=16, gen_len=4, num_batches=2)
    model = get_model(spec.model)
    _, rep = make_replay(spec, model, 2)
    profile = load_profile("l40s")
    if gpu_gb is not None:
        profile = with_overrides(profile, {"gpu.memory_bytes": gpu_gb * 1e9})
    return profile, simulate_decode(model, profile, rep.routing, setup)


def test_expert_parallel_ranks_offload_what_does_not_fit_and_pay_for_its_copies():
    setup = ParallelSetup(2, "ep", "popularity")
    profile, tight = _mixtral_on(None, setup)  # 2x 48 GB: Mixtral's 93 GB under EP does not fit whole
    _, roomy = _mixtral_on(80.0, setup)  # (the same routing on 80 GB GPUs: every expert resident)
    room = profile.gpu.memory_bytes - profile.gpu.reserved_bytes
    assert roomy.offloaded_bytes == roomy.streamed_bytes == 0.0
    assert 0 < tight.offloaded_bytes < 0.1 * roomy.rank_bytes and tight.rank_bytes <= room
    expert = get_model("mixtral-8x7b").expert_bytes()
    assert tight.offloaded_bytes % expert == 0  # (whole experts)
    assert 0 < tight.streamed_bytes <= 2 * tight.offloaded_bytes  # (each offloaded expert copied at most once)
    assert tight.step_s > roomy.step_s  # the copies cost time ...
    assert tight.all_to_all_bytes == roomy.all_to_all_bytes  # ... and nothing else changes
    _, tighter = _mixtral_on(44.0, setup)
    assert tighter.offloaded_bytes > tight.offloaded_bytes and tighter.step_s > tight.step_s


def test_offloading_keeps_each_ranks_most_used_experts_on_its_gpu():
    from klotski_sim.parallel.decode import STAGING_SLOTS, _offload

    model = type(get_model("tiny-mixtral"))(**{**get_model("tiny-mixtral").__dict__, "num_experts": 8, "num_layers": 1})
    placement = round_robin(8, 2)  # rank 0: experts 0, 2, 4, 6; rank 1: 1, 3, 5, 7
    load = np.array([1, 8, 5, 2, 9, 7, 3, 6], dtype=float)
    fixed = model.total_bytes() - 8 * model.expert_bytes()
    from klotski_sim.hardware.profile import with_overrides

    profile = load_profile("h200")
    room_for_one = fixed + (1 + STAGING_SLOTS + 0.5) * model.expert_bytes() + profile.gpu.reserved_bytes
    profile = with_overrides(profile, {"gpu.memory_bytes": room_for_one})
    setup = ParallelSetup(2, "ep")
    offload = _offload(model, profile, setup, {0: placement}, {0: load}, 4, np.array([0, 0]))
    assert offload is not None
    assert set(np.flatnonzero(offload.on_gpu[0][:, 0])) == {4}  # rank 0's most used
    assert set(np.flatnonzero(offload.on_gpu[0][:, 1])) == {1}
    assert offload.host_bytes == 3 * model.expert_bytes()
    assert offload.staging_bytes == STAGING_SLOTS * model.expert_bytes()  # (where the copies land)
    too_small = with_overrides(profile, {"gpu.memory_bytes": profile.gpu.reserved_bytes + fixed / 2})
    with pytest.raises(UsageError, match="non-expert weights, replica slots and KV cache and 2 experts' staging"):
        _offload(model, too_small, setup, {0: placement}, {0: load}, 4, np.array([0, 0]))
