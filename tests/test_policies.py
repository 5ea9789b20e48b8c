"""Policies build schedules that validate, run, and do what the paper says."""

import pytest

from klotski_sim.core.engine import simulate
from klotski_sim.hardware.profile import load_profile
from klotski_sim.policies import Placement, PolicyInput, build_schedule
from klotski_sim.workload.model import get_model
from klotski_sim.workload.routing import RunShape
from klotski_sim.workload.trace_synth import synthetic_routing


def _input(model="tiny-mixtral", bs=2, n=2, P=4, G=3, kv="gpu", resident=0, seed=0):
    m = get_model(model)
    shape = RunShape(bs, n, P, G)
    routing = synthetic_routing(m, shape, "uniform", seed)
    return PolicyInput(m, load_profile("rtx3090"), routing, Placement(kv=kv, resident_layers=resident))


@pytest.mark.parametrize("kv", ["gpu", "cpu"])
def test_single_batch_loads_whole_layers_and_runs(kv):
    inp = _input(kv=kv)
    s = build_schedule("single-batch", inp)
    m, sh = inp.model, inp.shape
    loads = [o for o in s.ops if o.category == "moe_weights"]
    # every expert of every layer, every step, every batch: the whole MoE layer
    assert len(loads) == sh.num_batches * sh.num_steps * m.num_layers * m.num_experts
    tl = simulate(s, inp.profile)
    assert tl.status == "ok" and len(tl) == len(s)
    # generated tokens = n * bs * G
    assert s.generated_tokens == 2 * 2 * 3
    # the experts computed are exactly the routed ones, with their token counts
    counts = inp.routing.counts
    computed = {(o.step, o.layer, o.batch, o.expert): o.tokens for o in s.ops if o.category == "expert"}
    expected = {
        (st, layer_, b, e): int(counts[st, layer_, b, e])
        for st in range(sh.num_steps)
        for layer_ in range(m.num_layers)
        for b in range(sh.num_batches)
        for e in range(m.num_experts)
        if counts[st, layer_, b, e]
    }
    assert computed == expected
    if kv == "cpu":
        assert any(o.category == "kv" and o.stream == "h2d_kv" for o in s.ops)
        assert any(o.stream == "d2h_kv" for o in s.ops)


def test_single_batch_prefetches_at_most_one_layer_ahead():
    inp = _input(model="mixtral-8x7b", bs=4, n=1, P=8, G=2)
    tl = simulate(build_schedule("single-batch", inp), inp.profile)
    # double buffering: never more than two layers of weights (+ resident + KV) on the GPU
    m = inp.model
    assert tl.meta["peak_gpu_bytes"] <= m.resident_bytes() + 2 * m.layer_bytes() + 50e6


def test_resident_layers_skip_transfers():
    inp = _input(resident=1)
    s = build_schedule("single-batch", inp)
    assert all(o.layer != 0 for o in s.ops if o.kind == "transfer" and o.category != "kv")
    assert simulate(s, inp.profile).status == "ok"


def test_kv_cache_grows_per_step():
    inp = _input(model="mixtral-8x7b", bs=4, n=1, P=8, G=3)
    s = build_schedule("single-batch", inp)
    kv_allocs = [a for o in s.ops if o.category == "attention" for a in o.alloc]
    m = inp.model
    assert sum(size for _, size in kv_allocs) == m.num_layers * m.kv_bytes(4, 8 + 3 - 1)


def test_oom_when_gpu_is_too_small():
    inp = _input(model="mixtral-8x7b", bs=4, n=1, P=8, G=2)
    from klotski_sim.hardware.profile import with_overrides

    small = with_overrides(inp.profile, {"gpu.memory_bytes": 3e9})
    tl = simulate(build_schedule("single-batch", inp), small)
    assert tl.status == "oom" and tl.meta["oom"]["needed_bytes"] > tl.meta["oom"]["available_bytes"]


def test_unknown_policy_and_option():
    with pytest.raises(ValueError, match="unknown policy"):
        build_schedule("magic", _input())
    inp = _input()
    bad = PolicyInput(inp.model, inp.profile, inp.routing, options={"turbo": True})
    with pytest.raises(ValueError, match="no option"):
        build_schedule("single-batch", bad)
