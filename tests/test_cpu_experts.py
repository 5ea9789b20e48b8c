"""Cold experts on the CPU (policies fiddler and llamacpp-moe; the profile's `cpu:` section)."""

from collections import Counter
from dataclasses import replace

import pytest
from hypothesis import given
from hypothesis import strategies as st

from klotski_sim.core.cost import CostModel
from klotski_sim.core.engine import simulate
from klotski_sim.hardware.profile import ProfileError, profile_from_dict
from klotski_sim.policies import PolicyInput, build_schedule
from klotski_sim.policies.fiddler import gpu_expert_slots, popular_experts
from klotski_sim.util.errors import UsageError

from .conftest import make_profile, run_cli
from .test_pipelines import make_input

CPU = {
    "name": "test-cpu",
    "cores": 8,
    "flops": {"bf16": 1e11, "fp32": 2e11},
    "compute_dtype": "bf16",
    "memory_bandwidth": 5e9,
    "op_overhead_s": 0.0,
}


def cpu_profile(memory_bytes=1e12, link=1e9, **cpu):
    data = make_profile(memory_bytes).model_dump(mode="json")
    data["cpu"] = {**CPU, **cpu}
    for name in ("pcie_h2d", "pcie_d2h"):
        data["links"][name]["bandwidth"] = link
        data["links"][name]["pageable_bandwidth"] = link / 2
    return profile_from_dict(data, "test-cpu-profile")


def built(policy, impl="ideal", profile=None, model="tiny-mixtral", **options):
    inp = make_input(model=model, bs=3, n=2, P=6, G=4, profile=profile or cpu_profile())
    inp = PolicyInput(inp.model, inp.profile, inp.routing, inp.placement, options, inp.warmup, impl)
    return inp, build_schedule(policy, inp)


def experts_by_place(schedule):
    """(step, layer, batch, expert) -> 'cpu' | 'gpu', and the tokens computed for each."""
    where, tokens = {}, Counter()
    for op in schedule.ops:
        if op.category == "expert":
            key = (op.step, op.layer, op.batch, op.expert)
            where[key] = "cpu" if op.stream == "cpu_compute" else "gpu"
            tokens[key] += op.tokens
    return where, tokens


@pytest.mark.parametrize("policy", ["fiddler", "llamacpp-moe"])
@pytest.mark.parametrize("impl", ["as-published", "ideal"])
def test_every_routed_token_is_computed_once_on_one_side(policy, impl):
    inp, s = built(policy, impl, cpu_profile(memory_bytes=4e9), model="mixtral-8x7b:2")  # a few experts fit
    where, tokens = experts_by_place(s)
    counts = inp.routing.counts
    expected = {
        (st_, layer_, b, e): int(counts[st_, layer_, b, e])
        for st_ in range(4)
        for layer_ in range(2)
        for b in range(2)
        for e in range(8)
        if counts[st_, layer_, b, e]
    }
    assert dict(tokens) == expected and "cpu" in set(where.values())
    tl = simulate(s, inp.profile)
    assert tl.status == "ok"
    assert "cpu" in set(tl.columns["resource"])


@given(
    cpu_bw=st.floats(1e8, 1e11), cpu_flops=st.floats(1e9, 1e13), link=st.floats(1e8, 5e10), overhead=st.floats(0, 1e-3)
)
def test_the_cost_rule_never_picks_the_side_its_cost_model_says_is_slower(cpu_bw, cpu_flops, link, overhead):
    profile = cpu_profile(
        memory_bytes=2e9, link=link, memory_bandwidth=cpu_bw, flops={"bf16": cpu_flops}, op_overhead_s=overhead
    )
    inp, s = built("fiddler", "ideal", profile, model="mixtral-8x7b:2")  # room for 1 of its 16 experts
    m, cost = inp.model, CostModel(profile)
    on_gpu = popular_experts(inp, gpu_expert_slots(inp, 2))
    downs = {(o.step, o.layer, o.batch) for o in s.ops if o.id.endswith("/hidden_down")}
    where, tokens = experts_by_place(s)
    decided = 0
    for (step, layer, batch, expert), side in where.items():
        if (layer, expert) in on_gpu:
            assert side == "gpu"
            continue
        decided += 1
        n = tokens[(step, layer, batch, expert)]
        cpu_path = (
            cost.cpu_seconds(m.expert_flops(n), m.expert_io_bytes(n, stored=True), "expert", n)
            + cost.transfer_seconds("pcie_d2h", m.hidden_bytes(n))
            + cost.transfer_seconds("pcie_h2d", m.hidden_bytes(n))
        )
        gpu_path = cost.transfer_seconds("pcie_h2d", m.expert_bytes()) + cost.compute_seconds(
            "expert", m.expert_flops(n), m.expert_io_bytes(n), n
        )
        if side == "cpu":
            assert cpu_path < gpu_path and (step, layer, batch) in downs
        else:
            assert cpu_path >= gpu_path
    assert len(on_gpu) == 1 and decided > 10


def test_fiddler_as_published_computes_on_the_cpu_iff_fewer_than_ten_tokens():
    # mixtral-8x7b:2 so that the experts are too big for the GPU: every expert is cold
    inp = make_input(model="mixtral-8x7b:2", bs=3, n=1, P=12, G=3, profile=cpu_profile(memory_bytes=1.2e9))
    s = build_schedule(
        "fiddler", PolicyInput(inp.model, inp.profile, inp.routing, inp.placement, {}, inp.warmup, "as-published")
    )
    assert s.meta["gpu_expert_slots"] == 0
    where, tokens = experts_by_place(s)
    assert where and all((side == "cpu") == (tokens[key] < 10) for key, side in where.items())
    assert {"cpu", "gpu"} == set(where.values())  # prefill (72 choices over 8 experts) has both
    # each CPU expert's input goes down on its own, the host waiting for it
    for op in s.ops:
        if op.stream == "cpu_compute":
            down = next(d for d in op.deps if "hidden_down" in d)
            assert any(h.kind == "host" and down in h.deps for h in s.ops)


def test_llamacpp_moves_whole_layers_for_32_tokens_and_keeps_smaller_ops_on_the_cpu():
    profile = cpu_profile(memory_bytes=6e9)
    inp = make_input(model="mixtral-8x7b:2", bs=6, n=1, P=6, G=3, profile=profile)  # prefill 36 tokens, decode 6
    s = build_schedule(
        "llamacpp-moe", PolicyInput(inp.model, inp.profile, inp.routing, inp.placement, {}, inp.warmup, "as-published")
    )
    where, _ = experts_by_place(s)
    assert all((side == "gpu") == (step == 0) for (step, *_), side in where.items())
    loads = Counter((o.step, o.layer) for o in s.ops if o.kind == "transfer" and o.tensor == "expert")
    assert set(loads) == {(0, 0), (0, 1)} and set(loads.values()) == {8}  # the whole expert tensor


def test_resident_experts_come_from_the_warmup_never_from_the_run():
    inp, _ = built("fiddler", "ideal")
    slots = 3
    chosen = popular_experts(inp, slots)
    other = make_input(model="tiny-mixtral", bs=3, n=2, P=6, G=4, seed=7, profile=inp.profile)
    assert popular_experts(replace(inp, routing=other.routing), slots) == chosen
    assert len(chosen) == slots


def test_resident_experts_fill_memory_and_the_run_fits():
    inp, s = built("fiddler", "ideal", cpu_profile(memory_bytes=3e9), model="mixtral-8x7b:2")
    assert 0 < s.meta["gpu_expert_slots"] < 16
    tl = simulate(s, inp.profile)
    assert tl.status == "ok" and tl.summary().peak_gpu_bytes <= 3e9


def test_a_profile_without_a_cpu_section_is_refused_in_one_line():
    for policy in ("fiddler", "llamacpp-moe", "klotski-hybrid"):
        code, out, err = run_cli(
            "simulate", "--policy", policy, "--model", "tiny-mixtral", "--hardware", "a100-80g", "--no-png"
        )
        assert code == 2 and err.count("\n") == 1 and "`cpu:` section" in err and "a100-80g" in err


def test_cpu_section_is_validated_by_field():
    data = cpu_profile().model_dump(mode="json")
    data["cpu"]["compute_dtype"] = "int8"
    with pytest.raises(ProfileError, match="cpu.*compute_dtype 'int8' has no entry in flops"):
        profile_from_dict(data, "p.yaml")
    data["cpu"]["compute_dtype"], data["cpu"]["memory_bandwidth"] = "bf16", float("inf")
    with pytest.raises(ProfileError, match="cpu.memory_bandwidth"):
        profile_from_dict(data, "p.yaml")


def test_bad_options_are_refused():
    for options in ({"rule": "fastest"}, {"min_batch": 0}, {"expert_buffers": 3}, {"cpu_blocks_host": "yes"}):
        with pytest.raises(UsageError):
            built("fiddler", "ideal", **options)


def test_a_cpu_op_cannot_allocate_gpu_memory():
    from klotski_sim.core.schedule import CPU_STREAMS, DEFAULT_STREAMS, ScheduleBuilder, ScheduleError

    b = ScheduleBuilder({**DEFAULT_STREAMS, **CPU_STREAMS})
    b.compute("x", "expert", stream="cpu_compute", alloc=(("buf", 10),))
    with pytest.raises(ScheduleError, match="CPU compute op cannot allocate"):
        b.build({})


def test_hybrid_with_a_hopeless_cpu_is_exactly_klotski():
    slow = cpu_profile(memory_bytes=3e9, memory_bandwidth=1e6, flops={"bf16": 1e6})
    inp = make_input(model="mixtral-8x7b:2", bs=3, n=3, P=6, G=4, profile=slow)
    hybrid = build_schedule("klotski-hybrid", inp)
    klotski = build_schedule("klotski", inp)
    assert hybrid.meta["cpu_experts"] == 0
    assert [op for op in hybrid.ops] == [op for op in klotski.ops]


def test_hybrid_moves_only_cold_experts_and_computes_every_token_once():
    fast = cpu_profile(memory_bytes=3e9, memory_bandwidth=1e13, flops={"bf16": 1e15}, link=1e9)
    inp = make_input(model="mixtral-8x7b:2", bs=3, n=3, P=6, G=4, profile=fast)
    s = build_schedule("klotski-hybrid", inp)
    assert s.meta["cpu_experts"] > 0
    counts = inp.routing.counts
    done = Counter()
    for op in s.ops:
        if op.category == "expert":
            done[(op.step, op.layer, op.expert)] += op.tokens
    assert dict(done) == {
        (st_, layer_, e): int(counts[st_, layer_, :, e].sum())
        for st_ in range(4)
        for layer_ in range(2)
        for e in range(8)
        if counts[st_, layer_, :, e].sum()
    }
    hot = {(o.step, o.layer, o.expert) for o in s.ops if "load_hot_E" in o.id}
    on_cpu = {(o.step, o.layer, o.expert) for o in s.ops if o.stream == "cpu_compute"}
    assert on_cpu and not (hot & on_cpu)
    # a CPU expert is never also loaded, and its output is back before the next layer's attention
    loaded = {(o.step, o.layer, o.expert) for o in s.ops if o.kind == "transfer" and o.tensor == "expert"}
    assert not (loaded & on_cpu)
    tl = simulate(s, fast)
    end = dict(zip(tl.columns["op_id"], tl.columns["end"]))
    start = dict(zip(tl.columns["op_id"], tl.columns["start"]))
    for op in s.ops:
        if op.stream == "h2d_act":
            nxt = f"s{op.step}/L{op.layer + 1}/b0/attn"
            if nxt in start:
                assert start[nxt] >= end[op.id]
