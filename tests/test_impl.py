"""Implementation options and presets (klotski_sim.policies.impl): each changes the schedule as documented."""

from collections import Counter
from unittest.mock import patch

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from klotski_sim.core.cost import CostError, CostModel
from klotski_sim.core.engine import simulate
from klotski_sim.core.schedule import Op, Schedule, ScheduleBuilder
from klotski_sim.hardware.profile import load_profile
from klotski_sim.policies import (
    POLICIES,
    Placement,
    PolicyInput,
    build_schedule,
    get_policy,
)
from klotski_sim.policies.impl import IMPL_CHOICES
from klotski_sim.runs.runner import RunSpec, run
from klotski_sim.workload import routing as routing_module
from klotski_sim.workload.model import get_model
from klotski_sim.workload.routing import RoutingTable, RunShape

from .conftest import make_profile
from .test_cpu_experts import cpu_profile
from .test_pipelines import make_input

LADDER = ("multi-batch", "hot-prefetch", "klotski", "klotski-oracle")
BUILT_IN = tuple(POLICIES)  # at import: other tests may register policies of their own later


CPU_EXPERT_POLICIES = ("fiddler", "llamacpp-moe")


def build(policy, impl="ideal", **options):
    if policy in CPU_EXPERT_POLICIES:  # experts that do not all fit on the GPU, so some run on the CPU
        inp = make_input(model="mixtral-8x7b:2", bs=3, n=1, P=5, G=3, profile=cpu_profile(memory_bytes=2e9))
    else:
        inp = make_input(model="tiny-mixtral", bs=3, n=3, P=5, G=3)
    return inp, build_schedule(
        policy, PolicyInput(inp.model, inp.profile, inp.routing, inp.placement, options, inp.warmup, impl)
    )


@pytest.mark.parametrize("policy", LADDER)
def test_per_batch_gives_one_op_per_expert_and_batch(policy):
    inp, batched = build(policy, expert_ops="batched")
    _, per_batch = build(policy, expert_ops="per-batch")
    counts = inp.routing.counts
    for s in range(3):
        for j in range(2):
            ops_b = [o for o in batched.ops if o.category == "expert" and o.step == s and o.layer == j]
            ops_p = [o for o in per_batch.ops if o.category == "expert" and o.step == s and o.layer == j]
            assert len(ops_b) == int((counts[s, j].sum(axis=0) > 0).sum())
            assert len(ops_p) == int((counts[s, j] > 0).sum())  # n x (experts each batch uses)
            assert all(len(o.batches) == 1 for o in ops_p)
            # the same tokens, but every per-batch op reads the expert's weights again
            assert sum(o.tokens for o in ops_p) == sum(o.tokens for o in ops_b)
            weights = inp.model.expert_bytes()
            assert sum(o.bytes for o in ops_p) - sum(o.bytes for o in ops_b) == (len(ops_p) - len(ops_b)) * weights


def _tiny_routing(ids: list[list[list[int]]]) -> RoutingTable:
    """One layer, one step (gen 1), prompt of 1 token per sequence: ids[batch][seq] = [top1, top2]."""
    arr = np.array(ids, dtype=np.int64)[:, :, None, None, :]  # [batch, seq, pos, layer, slot]
    nb, bs = arr.shape[:2]
    return RoutingTable(arr, RunShape(bs, nb, 1, 1), 8)


def test_cold_order_golden():
    """Batch 0's tokens choose (5,1), (3,5), (1,0): first use is 5, 1, 3, 0; by id 0, 1, 3, 5; by tokens
    5 and 1 (2 tokens each, id breaks the tie: 1 then 5), then 0 and 3."""
    routing = _tiny_routing([[[5, 1], [3, 5], [1, 0]]])
    model = get_model("mixtral-8x7b:1")
    expected = {"first-use": [5, 1, 3, 0], "expert-id": [0, 1, 3, 5], "most-tokens-first": [1, 5, 0, 3]}
    assert routing.first_use(0, 0, 0) == [5, 1, 3, 0]
    for order, want in expected.items():
        inp = PolicyInput(model, load_profile("rtx3090"), routing, Placement(), {"cold_order": order}, None, "ideal")
        s = build_schedule("hot-prefetch", inp)
        hot = {o.expert for o in s.ops if o.category == "hot_expert"}
        cold = [o.expert for o in s.ops if o.category == "cold_expert"]
        assert cold == [e for e in want if e not in hot]


@pytest.mark.parametrize("order", ["first-use", "expert-id", "most-tokens-first"])
def test_a_dense_layer_loads_no_experts_whatever_the_cold_order(order):
    """DeepSeek's first layer is a dense MLP: its routed ids exist in a trace but are never used, so no
    order may issue a load for them (first-use reads the ids themselves)."""
    inp = make_input(model="deepseek-v2-lite:3", bs=2, n=2, P=4, G=3)
    s = build_schedule(
        "klotski",
        PolicyInput(inp.model, inp.profile, inp.routing, inp.placement, {"cold_order": order}, inp.warmup, "ideal"),
    )
    loads = [o for o in s.ops if o.category in ("hot_expert", "cold_expert")]
    assert loads and not [o for o in loads if o.layer == 0]


@settings(max_examples=30, deadline=None)
@given(st.integers(1, 40), st.integers(1, 3), st.integers(2, 12), st.integers(0, 2**31 - 1))
def test_first_use_by_sort_is_the_order_a_loop_meets_the_ids(seqs, positions, experts, seed):
    """Past `_FIRST_USE_BY_SORT` ids the first-use order is found by a sort: the same list as a loop
    over the routed ids in order (token by token, each token's choices in rank order)."""
    rng = np.random.default_rng(seed)
    top_k = min(2, experts)
    ids = np.argsort(rng.random((1, seqs, positions, 1, experts)), axis=-1)[..., :top_k]
    routing = RoutingTable(ids, RunShape(seqs, 1, positions, 1), experts)
    loop = list(dict.fromkeys(ids[0, :, :, 0, :].ravel().tolist()))
    with patch.object(routing_module, "_FIRST_USE_BY_SORT", 0):
        assert routing.first_use(0, 0, 0) == loop


@settings(max_examples=40, deadline=None)
@given(
    st.integers(1, 3),
    st.integers(1, 4),
    st.integers(1, 80),
    st.integers(1, 3),
    st.integers(2, 9),
    st.integers(0, 1),
    st.integers(0, 2**31 - 1),
    st.sampled_from([1, 2, 64]),
)
def test_first_use_orders_read_from_a_head_are_every_batchs_whole_order(
    nb, bs, prompt, gen, experts, dense, seed, head
):
    """first_use_orders reads each batch's order from the head of its ids when the head holds every
    expert the batch uses, else from all of them: always `first_use` of the used experts (none in
    a dense layer), for a head of one token (almost always short) or more."""
    rng = np.random.default_rng(seed)
    top_k = min(2, experts)
    shape = RunShape(bs, nb, prompt, gen)
    # skewed: a few experts take most tokens, the rest turn up late if at all
    weights = rng.dirichlet(np.full(experts, 0.3))
    ids = np.stack(
        [
            np.stack(
                [
                    rng.choice(experts, top_k, replace=False, p=weights)
                    for _ in range(nb * bs * shape.tokens_per_sequence * 2)
                ]
            )
        ]
    ).reshape(nb, bs, shape.tokens_per_sequence, 2, top_k)
    routing = RoutingTable(ids, shape, experts, dense_layers=dense)
    with patch.object(routing_module, "_FIRST_USE_HEAD", head):
        for step in range(shape.num_steps):
            for layer in range(2):
                want = [
                    [e for e in routing.first_use(step, layer, b) if routing.counts[step, layer, b, e]]
                    for b in range(nb)
                ]
                assert routing.first_use_orders(step, layer) == want


def test_first_use_matches_the_routing_on_random_traces():
    inp, s = build("klotski", cold_order="first-use")
    routing = inp.routing
    for step in range(3):
        for j in range(2):
            issued = [
                o.expert
                for o in s.ops
                if o.category in ("hot_expert", "cold_expert") and o.step == step and o.layer == j
            ]
            hot = [o.expert for o in s.ops if o.category == "hot_expert" and o.step == step and o.layer == j]
            expected, seen = list(hot), set(hot)
            for b in range(3):
                for e in routing.first_use(step, j, b):
                    if e not in seen:
                        expected.append(e)
                        seen.add(e)
            assert issued == expected


@pytest.mark.parametrize("policy", BUILT_IN)
def test_host_ops_block_what_is_issued_after_them(policy):
    inp, s = build(policy, "as-published")
    tl = simulate(s, inp.profile)
    df = tl.df.set_index("op_id")
    host = [o for o in s.ops if o.kind == "host"]
    assert host, "as-published waits on the host somewhere"
    assert set(df.loc[[o.id for o in host], "resource"]) == {"host"}
    latency = inp.profile.gpu.host_sync_latency_s
    position = {o.id: i for i, o in enumerate(s.ops)}
    for o in host:
        end = df.at[o.id, "end"]
        waited = max(df.at[d, "end"] for d in o.deps)  # the host op's latency is the whole round trip
        assert end == pytest.approx(max(df.at[o.id, "start"], waited) + latency)
        # nothing issued after the host op starts before it ends
        later = [x.id for x in s.ops[position[o.id] + 1 :] if x.kind != "host"]
        if later:
            assert df.loc[later, "start"].min() >= end - 1e-12


def test_engine_host_op_golden():
    """The host reaches s1 at 0 and waits for g (2 s) + 0.5 s latency: s1 = [0, 2.5]; a2 issued after it
    starts at 2.5 although nothing else holds it; s2 starts when s1 ends (3rd second)."""
    b = ScheduleBuilder()
    g = b.compute("g", "attention")
    b.host_wait("s1", "sync", [g])
    b.compute("a2", "attention", stream="compute")
    w = b.transfer("w", "weights", "h2d_weights", 10, "cpu", "gpu")
    b.host_wait("s2", "sync", [w])
    sched = b.build({})
    assert sched.op("w").deps == ("s1",)
    tl = simulate(sched, make_profile(host_sync_latency_s=0.5), durations=[2, 0.5, 1, 3, 0.5])
    df = tl.df.set_index("op_id")
    assert df.loc["s1", ["start", "end"]].tolist() == [0, 2.5]
    assert df.loc["a2", ["start", "end"]].tolist() == [2.5, 3.5]
    assert df.loc["w", ["start", "end"]].tolist() == [2.5, 5.5]
    assert df.loc["s2", ["start", "end"]].tolist() == [2.5, 6.0]
    assert tl.summary().host_blocked_s == 6.0
    assert tl.summary().bubble_by_cause == {"sync": 0.5}


def test_pageable_copies_use_the_pageable_bandwidth_and_block_the_host():
    inp = make_input(model="tiny-mixtral", placement=Placement(kv="cpu"))
    s = build_schedule(
        "flexgen",
        PolicyInput(
            inp.model,
            inp.profile,
            inp.routing,
            inp.placement,
            {"copy_memory_kv": "pageable", "copy_memory_weights": "pageable"},
            inp.warmup,
            "ideal",
        ),
    )
    cost = CostModel(inp.profile)
    link = inp.profile.links
    pageable = [o for o in s.ops if o.kind == "transfer" and o.src != "disk"]
    assert pageable and all(o.pageable for o in pageable)
    for o in pageable:
        lk = link.pcie_h2d if o.dst == "gpu" else link.pcie_d2h
        assert cost.duration(o, s.streams[o.stream]) == pytest.approx(lk.latency_s + o.bytes / lk.pageable_bandwidth)
        waits = [w for w in s.ops if w.kind == "host" and w.deps == (o.id,)]
        assert len(waits) == 1 and waits[0].category == "copy_wait"


def test_pageable_copy_without_a_pageable_bandwidth_is_refused():
    profile = make_profile()
    op = Op("t", "transfer", "h2d_kv", "kv", bytes=10, src="cpu", dst="gpu", pageable=True)
    with pytest.raises(CostError, match="pcie_h2d.pageable_bandwidth"):
        CostModel(profile).duration(op, "pcie_h2d")


def test_eager_attention_moves_what_it_materialises():
    """Decode, 2 sequences, KV length 10, tiny-mixtral (4 heads, 2 KV heads of 16, bf16): KV = 2*10*64 B
    each of K and V = 2560 B; eager adds concat 2 KV, repeat_kv (1+2) KV, matmuls 2 KV and scores."""
    m = get_model("tiny-mixtral")
    kv = m.kv_bytes(2, 10)
    assert kv == 2 * 10 * 2 * 2 * 16 * 2
    fused = m.attention_io_bytes(2, 1, 10, "fused")
    eager = m.attention_io_bytes(2, 1, 10, "eager")
    scores = 2 * 4 * 1 * 10 * (8 * 2 + 8)
    assert fused == m.attention_bytes() + kv + 2 * m.hidden_bytes(2)
    assert eager == m.attention_bytes() + (2 + 3 + 2) * kv + scores + 4 * m.hidden_bytes(2)
    # prefill: eager multiplies the whole square, fused only the causal half
    assert m.attention_flops(1, 8, 8, "eager") > m.attention_flops(1, 8, 8, "fused")
    assert m.attention_flops(2, 1, 10, "eager") == m.attention_flops(2, 1, 10, "fused")


@pytest.mark.parametrize("policy", ["multi-batch", "single-batch"])  # the policies that load MoE layers whole
def test_moe_load_at_gate_waits_for_the_previous_moe_layer(policy):
    inp, s = build(policy, moe_load="at-gate")
    tl = simulate(s, inp.profile).df.set_index("op_id")
    loads = [o for o in s.ops if o.category == "moe_weights"]
    for o in loads:
        prev_moe_end = [tl.at[d, "end"] for d in o.deps if s.op(d).category == "expert"]
        if prev_moe_end:
            assert tl.at[o.id, "start"] >= max(prev_moe_end)


def test_presets_are_complete_and_cited_for_every_policy():
    doc = (__import__("pathlib").Path(__file__).resolve().parents[1] / "docs" / "implementations.md").read_text()
    for name, info in ((n, POLICIES[n]) for n in BUILT_IN):
        for preset in ("as-published", "ideal", "v0.1"):
            values = info.preset(preset)
            assert set(info.impl_options) <= set(values)
        for option in info.impl_options:
            assert f"`{option}`" in doc, f"{option} is not documented"


def test_unknown_option_values_are_refused_with_the_choices():
    inp = make_input()
    with pytest.raises(
        ValueError, match="option cold_order must be one of first-use, expert-id, most-tokens-first, got 'random'"
    ):
        build_schedule("klotski", PolicyInput(inp.model, inp.profile, inp.routing, options={"cold_order": "random"}))
    with pytest.raises(ValueError, match="has no option"):
        build_schedule("flexgen", PolicyInput(inp.model, inp.profile, inp.routing, options={"cold_order": "expert-id"}))
    assert set(IMPL_CHOICES) >= set(get_policy("klotski").impl_options)


def test_label_names_the_options_that_depart_from_the_preset():
    r = run(
        RunSpec(
            model="tiny-mixtral",
            policy="klotski",
            num_batches=2,
            batch_size=2,
            prompt_len=4,
            gen_len=2,
            options={"sync": "none"},
        )
    )
    assert r.timeline.summary().impl == "as-published+sync=none"
    assert r.timeline.summary().extra["options"]["sync"] == "none"


@pytest.mark.parametrize("model,hardware", [("mixtral-8x7b", "rtx3090"), ("mixtral-8x22b:8", "h800")])
def test_ideal_is_never_slower_than_as_published(model, hardware):
    """On the default workload (gen shortened for CI); a counter-example would be documented."""
    for policy in BUILT_IN:
        base = dict(
            model=model,
            hardware=hardware,
            policy=policy,
            gen_len=4,
            num_batches=1 if policy == "single-batch" else None,
        )
        pub = run(RunSpec(impl="as-published", **base)).timeline.summary()
        ideal = run(RunSpec(impl="ideal", **base)).timeline.summary()
        assert ideal.throughput_tok_s >= pub.throughput_tok_s * (1 - 1e-9), policy


def test_decode_throughput_and_moe_block_on_a_hand_checked_timeline():
    """Two batches; step 0 (prefill) ends at 4 s, decode step 1 runs 4..6 s: decode tokens = 2 x 2 x (2-1)."""
    ops = []
    for step, (start, layer_ends) in enumerate([(0, (2, 4)), (4, (5, 6))]):
        for layer, end in enumerate(layer_ends):
            ops.append(
                Op(f"s{step}/L{layer}", "compute", "compute", "attention", step=step, layer=layer, batches=(0, 1))
            )
    sched = Schedule(tuple(ops), meta={"generated_tokens": 8, "batch_size": 2, "num_batches": 2})
    tl = simulate(sched, make_profile(), durations=[2, 2, 1, 1])
    s = tl.summary()
    assert s.makespan_s == 6 and s.decode_s == pytest.approx(2)
    assert s.decode_throughput_tok_s == pytest.approx(4 / 2)
    assert s.moe_block_s == pytest.approx(1.0)
    assert s.throughput_tok_s == pytest.approx(8 / 6)


def test_profiles_carry_pinned_and_pageable_bandwidths():
    from klotski_sim.hardware.profile import builtin_profile_names

    for name in builtin_profile_names():
        p = load_profile(name)
        for link in (p.links.pcie_h2d, p.links.pcie_d2h):
            assert link.pageable_bandwidth and link.pageable_bandwidth < link.bandwidth


def test_old_pageable_field_gets_a_pointer_to_the_new_one():
    from klotski_sim.hardware.profile import ProfileError

    data = load_profile("rtx3090").model_dump(mode="json")
    data["links"]["pageable_h2d_bandwidth"] = 6.7e9
    with pytest.raises(ProfileError, match="moved to links.pcie_h2d.pageable_bandwidth"):
        from klotski_sim.hardware.profile import profile_from_dict

        profile_from_dict(data, "old.yaml")


def test_counter_of_host_ops_per_preset():
    """as-published synchronises; ideal and v0.1 never do."""
    for preset, want in (("as-published", True), ("ideal", False), ("v0.1", False)):
        for policy in BUILT_IN:
            _, s = build(policy, preset)
            assert bool(Counter(o.kind for o in s.ops)["host"]) == want, (policy, preset)


def test_fidelity_script_quick_rows(tmp_path):
    """The component rows of docs/fidelity.md come from the cost model as documented."""
    import importlib.util
    import sys

    from .conftest import ROOT

    spec = importlib.util.spec_from_file_location("fidelity", ROOT / "experiments" / "fidelity.py")
    fidelity = importlib.util.module_from_spec(spec)
    sys.modules["fidelity"] = fidelity  # dataclasses look their module up
    spec.loader.exec_module(fidelity)
    assert fidelity.main(["--quick", "--out", str(tmp_path / "f.md")]) == 0
    text = (tmp_path / "f.md").read_text()
    component = (
        "| Klotski | attention of one batch, decode |",
        "| Klotski | one expert transfer |",
        "| Klotski | one expert over one token",
    )
    # each under the spec-sheet profile and the one built from the paper's components
    assert all(text.count(row) == 2 for row in component) and "as-published" in text and "ideal" in text
    expert = get_model("mixtral-8x7b").expert_bytes()
    for hw in ("rtx3090", "rtx3090-env1"):
        profile = load_profile(hw)
        assert fidelity.expert_transfer_ms(hw)("as-published") == pytest.approx(
            1e3 * (profile.links.pcie_h2d.latency_s + expert / profile.links.pcie_h2d.bandwidth)
        )
        assert fidelity.attention_ms(hw)("as-published") > fidelity.attention_ms(hw)("ideal")  # eager moves more
