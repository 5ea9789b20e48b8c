"""Klotski's loop phase by phase (klotski_sim/policies/klotski_phases.py), and the decisions each
rung of the ablation ladder and each implementation preset give it (docs/KLOTSKI.md,
docs/implementations.md)."""

from dataclasses import replace

import pytest

from klotski_sim.policies import PolicyInput, get_policy
from klotski_sim.policies.base import resolve_options
from klotski_sim.policies.impl import Impl
from klotski_sim.policies.klotski import RUNGS
from klotski_sim.policies.klotski_phases import Decisions, Pipeline

from .test_cpu_experts import cpu_profile
from .test_pipelines import make_input

# rung -> (weights, hot, cold on demand, next attention during the MoE layer, expert order, cold on the CPU)
LADDER = {
    "multi-batch": ("whole-layer", None, False, False, "expert-id", False),
    "hot-prefetch": ("expert-aware", "table", True, True, "expert-id", False),
    "klotski": ("expert-aware", "table", True, True, "arrival", False),
    "klotski-oracle": ("expert-aware", "oracle", True, True, "arrival", False),
    "klotski-hybrid": ("expert-aware", "table", True, True, "arrival", True),
}


def decisions(policy, preset, **options):
    impl = Impl.from_options({**get_policy(policy).preset(preset), **options})
    return Decisions.of(RUNGS[policy], impl)


def fields(d):
    return d.weights, d.hot, d.cold_on_demand, d.attention_during_moe, d.expert_order, d.cold_to_cpu


@pytest.mark.parametrize("policy", list(LADDER))
@pytest.mark.parametrize("preset", ["ideal", "v0.1"])
def test_each_rung_ideally_implemented_is_the_ladder_of_the_docs(policy, preset):
    d = decisions(policy, preset)
    assert fields(d) == LADDER[policy]
    assert not d.sync_sublayers and not d.per_batch_experts  # batched expert ops, no host waits
    assert d.learns == (LADDER[policy][1] == "table")  # the oracle needs no table


@pytest.mark.parametrize("policy", list(LADDER))
def test_as_published_every_rung_waits_per_sublayer_and_computes_experts_batch_by_batch(policy):
    d = decisions(policy, "as-published")
    assert d.sync_sublayers and d.per_batch_experts
    if policy == "multi-batch":  # the port without a predictor loads its MoE layer at the gate sub-layer
        assert fields(d) == ("at-gate", None, False, True, "expert-id", False)
    else:
        assert fields(d) == LADDER[policy]


def test_moe_load_matters_only_below_the_hot_prefetch_rung():
    assert decisions("multi-batch", "ideal", moe_load="at-gate").weights == "at-gate"
    assert decisions("multi-batch", "as-published", moe_load="layer-ahead").weights == "whole-layer"
    # with a predictor, the gate and the hot experts load during attention whatever moe_load says
    assert Decisions.of(RUNGS["klotski"], Impl(moe_load="at-gate")).weights == "expert-aware"
    assert "moe_load" not in get_policy("klotski").impl_options


def test_a_sublayer_sync_alone_makes_the_host_wait_without_per_batch_experts():
    d = decisions("klotski", "ideal", sync="per-sublayer")
    assert d.sync_sublayers and not d.per_batch_experts
    assert not decisions("klotski", "as-published", sync="none").sync_sublayers


def pipeline(policy, impl="ideal", profile=None, **options):
    inp = make_input(model="tiny-mixtral", bs=2, n=3, P=6, G=3, profile=profile)
    inp = PolicyInput(inp.model, inp.profile, inp.routing, inp.placement, options, inp.warmup, impl)
    inp = replace(inp, options=resolve_options(policy, impl, options))
    return Pipeline(inp, decisions(policy, impl, **options)), inp


def new_ops(loop, phase, *args):
    """Run one phase; the ops it issued."""
    before = len(loop.em.b.ops)
    out = phase(*args)
    return out, loop.em.b.ops[before:]


def whole_layer(loop, layer):
    for phase in (
        loop.attention,
        loop.gates,
        loop.fetch_next_attention,
        loop.gpu_experts,
        loop.cpu_experts,
        loop.end_moe,
    ):
        phase(layer)


def test_fetch_ahead_loads_the_gate_and_the_hot_experts_as_the_previous_moe_layer_ends():
    loop, inp = pipeline("klotski")
    loop.embed(0)
    first, ops = new_ops(loop, loop.fetch_ahead, 0, 0)
    assert [o.id for o in ops][:2] == ["s0/L0/load_attn", "s0/L0/load_gate"]  # nothing fetched it earlier
    whole_layer(loop, first)
    assert loop.next_attention == "s0/L1/load_attn"  # fetched during layer 0's MoE layer
    layer, ops = new_ops(loop, loop.fetch_ahead, 0, 1)
    assert layer.attn_w == "s0/L1/load_attn" and loop.next_attention is None
    assert layer.prev_moe == first.moe_done == loop.layer_done[-1]
    assert [o.id for o in ops][0] == "s0/L1/load_gate"
    hot = [o for o in ops if o.category == "hot_expert"]
    assert len(hot) == inp.model.top_k and len(ops) == 1 + len(hot)
    assert all(o.stream == "h2d_experts" and first.moe_done in o.deps for o in ops)
    assert layer.load_order == [o.expert for o in hot] and layer.prefetched == [o.id for o in ops]


def test_gates_load_each_cold_expert_once_right_after_the_gate_that_revealed_it():
    loop, inp = pipeline("klotski")
    loop.embed(0)
    layer = loop.fetch_ahead(0, 0)
    loop.attention(layer)
    hot = set(layer.load_order)
    _, ops = new_ops(loop, loop.gates, layer)
    counts = inp.routing.counts[0, 0]  # [batch, expert]
    gate, requested = None, set(hot)
    for op in ops:
        if op.category == "gate":
            gate, batch = op.id, op.batch
            selected = {e for e in range(inp.model.num_experts) if counts[batch, e]}
            expected, requested = selected - requested, requested | selected
        else:  # a cold load: selected by the last gate, not requested before it
            assert op.category == "cold_expert" and gate in op.deps and op.expert in expected
            expected.discard(op.expert)
    assert requested == {e for e in range(inp.model.num_experts) if counts[:, e].sum()} | hot
    assert layer.gates == [o.id for o in ops if o.category == "gate"] and layer.last_gate == layer.gates[-1]
    assert sorted(layer.load_order) == sorted(layer.expert_w) and len(set(layer.load_order)) == len(layer.load_order)


def test_as_published_gates_wait_for_their_routed_ids_before_the_cold_loads():
    loop, _ = pipeline("klotski", "as-published")
    loop.embed(0)
    layer = loop.fetch_ahead(0, 0)
    loop.attention(layer)
    _, ops = new_ops(loop, loop.gates, layer)
    for k, op in enumerate(ops):
        if op.category == "gate":
            assert ops[k + 1].id == f"{op.id}/sync" and op.id in ops[k + 1].deps
    assert ops[-1].id == "s0/L0/gates/sync" and set(ops[-1].deps) == set(layer.prefetched)


@pytest.mark.parametrize("policy, order", [("klotski", "arrival"), ("hot-prefetch", "expert-id")])
def test_gpu_experts_run_hot_first_then_cold_by_arrival_only_on_the_reorder_rung(policy, order):
    loop, inp = pipeline(policy)
    loop.embed(0)
    layer = loop.fetch_ahead(0, 0)
    for phase in (loop.attention, loop.gates, loop.fetch_next_attention):
        phase(layer)
    _, ops = new_ops(loop, loop.gpu_experts, layer)
    ran = [o.expert for o in ops]
    used = [e for e in range(inp.model.num_experts) if layer.group_tokens[e] > 0]
    assert sorted(ran) == used
    assert ran == ([e for e in layer.load_order if e in used] if order == "arrival" else used)
    for o in ops:  # each on the group's tokens, after its own load, which it frees
        assert o.tokens == layer.group_tokens[o.expert] and o.batches == (0, 1, 2)
        assert layer.expert_w[o.expert] in o.deps and layer.expert_w[o.expert] in o.free
    assert loop.layer_done[-1] == layer.moe_done == ops[-1].id


def test_whole_layer_loads_wait_for_the_layer_two_back_and_nothing_loads_during_the_moe_layer():
    loop, inp = pipeline("multi-batch")
    loop.embed(0)
    for j in range(inp.model.num_layers):
        layer = loop.fetch_ahead(0, j)
        loop.attention(layer)
        loop.gates(layer)
        _, ops = new_ops(loop, loop.fetch_next_attention, layer)
        assert not ops and loop.next_attention is None
        loop.gpu_experts(layer)
    loop.end_step(0)
    loop.embed(1)
    _, ops = new_ops(loop, loop.fetch_ahead, 1, 0)  # the third layer of the run: double-buffered
    assert [o.category for o in ops] == ["weights", "weights"] + ["moe_weights"] * inp.model.num_experts
    assert all(o.deps == (loop.layer_done[-2],) and o.stream == "h2d_weights" for o in ops)


def test_at_gate_the_moe_layer_loads_after_the_attention_sublayer_and_the_host_waits_for_the_next_attention():
    loop, inp = pipeline("multi-batch", "as-published")
    loop.embed(0)
    first = loop.fetch_ahead(0, 0)
    whole_layer(loop, first)
    layer, ops = new_ops(loop, loop.fetch_ahead, 0, 1)
    assert [o.id for o in ops] == ["s0/L1/load_gate"] and first.moe_done in ops[0].deps
    assert layer.attn_w == "s0/L1/load_attn"  # fetched during layer 0's MoE layer
    _, ops = new_ops(loop, loop.attention, layer)
    assert ops[-1].id == "s0/L1/attn/sync" and "s0/L1/load_gate" in ops[-1].deps
    _, ops = new_ops(loop, loop.gates, layer)
    loads = [o for o in ops if o.category == "moe_weights"]
    assert [o.expert for o in loads] == list(range(inp.model.num_experts)) == layer.load_order
    assert ops[: len(loads)] == loads and all(first.moe_done in o.deps for o in loads)
    assert not any(o.category == "cold_expert" for o in ops)
    assert ops[-1].id == "s0/L1/gates/sync" and {o.id for o in loads} <= set(ops[-1].deps)
    loop.fetch_next_attention(layer)
    assert loop.next_attention == "s1/L0/load_attn"
    loop.gpu_experts(layer)
    _, ops = new_ops(loop, loop.end_moe, layer)
    assert [o.id for o in ops] == ["s0/L1/moe/sync"] and "s1/L0/load_attn" in ops[0].deps


def test_the_oracle_prefetches_every_used_expert_most_used_first_and_loads_nothing_on_demand():
    loop, inp = pipeline("klotski-oracle")
    loop.embed(0)
    layer = loop.fetch_ahead(0, 0)
    tokens = layer.group_tokens
    assert layer.load_order == sorted((e for e in range(inp.model.num_experts) if tokens[e]), key=lambda e: -tokens[e])
    loop.attention(layer)
    _, ops = new_ops(loop, loop.gates, layer)
    assert all(o.category == "gate" for o in ops)
    assert not hasattr(loop, "table")  # no predictor to warm up or teach


def test_cpu_experts_run_what_the_gates_sent_to_the_cpu_and_the_next_attention_waits_for_them():
    loop, inp = pipeline(
        "klotski-hybrid", profile=cpu_profile(flops={"bf16": 1e15, "fp32": 1e15}, memory_bandwidth=1e13, link=1e7)
    )
    loop.embed(0)
    layer = loop.fetch_ahead(0, 0)
    for phase in (loop.attention, loop.gates, loop.fetch_next_attention, loop.gpu_experts):
        phase(layer)
    assert layer.cpu_experts and not set(layer.cpu_experts) & set(layer.expert_w)
    assert len(set(layer.cpu_experts)) == len(layer.cpu_experts)
    _, ops = new_ops(loop, loop.cpu_experts, layer)
    assert ops[0].id == "s0/L0/hidden_down" and set(ops[0].deps) >= set(layer.gates)
    assert [o.expert for o in ops if o.stream == "cpu_compute"] == layer.cpu_experts
    assert loop.cpu_out == [f"s0/L0/cpu_E{e}/up" for e in layer.cpu_experts]
    nxt = loop.fetch_ahead(0, 1)
    _, ops = new_ops(loop, loop.attention, nxt)
    assert all(set(loop.cpu_out) <= set(o.deps) for o in ops if o.category == "attention")
    assert loop.on_cpu_count == len(layer.cpu_experts)
