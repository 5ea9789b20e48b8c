"""The expert cache any policy can keep (options expert_cache, cache_policy)."""

from collections import OrderedDict

import pytest

from klotski_sim.core.engine import simulate
from klotski_sim.policies import PolicyInput, build_schedule
from klotski_sim.util.errors import UsageError

from .test_pipelines import make_input


def build(policy, impl="ideal", model="tiny-mixtral", n=2, **options):
    inp = make_input(model=model, bs=2, n=n, P=6, G=4)
    inp = PolicyInput(inp.model, inp.profile, inp.routing, inp.placement, options, inp.warmup, impl)
    return inp, build_schedule(policy, inp)


def lru_replay(accesses, slots):
    cache, hits = OrderedDict(), 0
    for key in accesses:
        if key in cache:
            hits += 1
            cache.move_to_end(key)
        else:
            if len(cache) >= slots:
                cache.popitem(last=False)
            cache[key] = True
    return hits, len(accesses) - hits


@pytest.mark.parametrize("slots", [4, 6, 8])
@pytest.mark.parametrize("impl", ["ideal", "as-published"])
def test_lru_hits_equal_a_brute_force_replay(slots, impl):
    inp, s = build("single-batch", impl, n=1, expert_cache=slots, cache_policy="lru")
    m, sh = inp.model, inp.shape
    # single-batch copies every expert of each layer before computing it: batch, step, layer, expert order
    accesses = [
        (layer, e)
        for _ in range(sh.num_batches)
        for _ in range(sh.num_steps)
        for layer in range(m.num_layers)
        for e in range(m.num_experts)
    ]
    stats = s.meta["expert_cache"]
    assert (stats["hits"], stats["misses"]) == lru_replay(accesses, slots)
    loads = [o for o in s.ops if o.kind == "transfer" and o.tensor == "expert"]
    assert len(loads) == stats["misses"]
    tl = simulate(s, inp.profile)
    assert tl.status == "ok"


@pytest.mark.parametrize("policy", ["single-batch", "multi-batch", "klotski", "flexgen", "klotski-oracle"])
@pytest.mark.parametrize("cache_policy", ["lru", "lfu", "hot-pinned"])
def test_every_policy_runs_with_a_cache_and_never_uses_a_freed_buffer(policy, cache_policy):
    inp, s = build(policy, expert_cache=3, cache_policy=cache_policy)
    tl = simulate(s, inp.profile)  # the engine refuses a free of a buffer that is not allocated
    assert tl.status == "ok"
    stats = s.meta["expert_cache"]
    assert stats["hits"] + stats["misses"] > 0 and 0 <= stats["hit_rate"] <= 1
    assert s.ops[-1].id == "release_expert_cache" or not stats["misses"]


def test_a_cache_holding_every_expert_copies_each_once():
    inp, s = build("klotski", expert_cache=8)  # tiny-mixtral: 2 layers x 4 experts
    loads = [(o.layer, o.expert) for o in s.ops if o.kind == "transfer" and o.tensor == "expert"]
    assert len(loads) == len(set(loads)) == s.meta["expert_cache"]["misses"]


def test_hot_pinned_keeps_the_warmup_s_most_used_experts_and_streams_the_rest():
    inp, s = build("klotski", expert_cache=2, cache_policy="hot-pinned")
    cached = {(o.layer, o.expert) for o in s.ops if o.kind == "transfer" and o.tensor == "expert"}
    from klotski_sim.policies.cache import ExpertCache

    pinned = ExpertCache.hot_set(inp.warmup.experts, 2, 4, 2)
    assert len(pinned) == 2
    hits = s.meta["expert_cache"]["hits"]
    assert hits > 0 and cached  # pinned ones hit after their first copy; the others keep streaming


def test_bad_cache_options_are_refused():
    for options in ({"expert_cache": -1}, {"expert_cache": "many"}, {"cache_policy": "fifo", "expert_cache": 2}):
        with pytest.raises(UsageError):
            build("klotski", **options)
    for options in ({"cache_policy": "LRU"}, {"cache_policy": "LRU", "expert_cache": 2}):  # ("needs expert_cache > 0")
        with pytest.raises(UsageError, match="cache_policy must be one of lru, lfu, hot-pinned, got 'LRU'"):
            build("klotski", **options)
    with pytest.raises(UsageError, match="cache_policy=lfu needs expert_cache > 0"):
        build("klotski", cache_policy="lfu")


def test_the_runtime_executes_a_cached_schedule_and_ends_with_nothing_allocated():
    torch = pytest.importorskip("torch")
    from klotski_runtime.executor import ExecOptions, execute
    from klotski_runtime.kernels import WeightStore

    inp, s = build("single-batch", expert_cache=6)
    _, plain = build("single-batch")
    weights = WeightStore.random(inp.model, dtype=torch.float32)
    _, cached_run = execute(s, inp.model, weights, inp.routing, ExecOptions(record_logits=True))
    _, plain_run = execute(plain, inp.model, weights, inp.routing, ExecOptions(record_logits=True))
    for key, logits in plain_run.logits.items():
        torch.testing.assert_close(cached_run.logits[key], logits)
    assert cached_run.in_use == cached_run.buffer_bytes.get("resident", 0)
