"""The multi-batch policies (ablation ladder, oracle, FlexGen), the prefetcher and the planner."""

from collections import Counter
from dataclasses import replace
from unittest.mock import patch

import numpy as np
import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from klotski_sim.core.engine import simulate
from klotski_sim.core.schedule import Op, compute_op, transfer_op
from klotski_sim.hardware.profile import load_profile, with_overrides
from klotski_sim.planning.planner import largest_storable_n, memory_floor, memory_needed, plan, storage_refusal
from klotski_sim.policies import POLICIES, Placement, PolicyInput, build_schedule, prefetch
from klotski_sim.policies.base import OpEmitter
from klotski_sim.policies.prefetch import CorrelationTable, top_columns
from klotski_sim.workload.model import get_model
from klotski_sim.workload.routing import RoutingTable, RunShape, expert_id_type
from klotski_sim.workload.trace import replay
from klotski_sim.workload.trace_synth import synthesize

from .conftest import make_profile

MULTI = ("multi-batch", "hot-prefetch", "klotski", "klotski-oracle", "flexgen")
EXPERT_LOADS = ("moe_weights", "hot_expert", "cold_expert")


def make_input(
    model="tiny-mixtral",
    bs=2,
    n=3,
    P=6,
    G=3,
    routing="calibrated",
    seed=0,
    placement=None,
    profile=None,
    warmup=4,
    options=None,
):
    m = get_model(model)
    shape = RunShape(bs, n, P, G)
    trace = synthesize(m, shape.num_sequences + warmup, P, G, routing, seed)
    rep = replay(trace, m, shape, warmup_sequences=warmup)
    return PolicyInput(
        m, profile or load_profile("rtx3090"), rep.routing, placement or Placement(), options or {}, warmup=rep.warmup
    )


@pytest.mark.parametrize("policy", MULTI + ("single-batch",))
@pytest.mark.parametrize(
    "placement",
    [
        Placement(),
        Placement(kv="cpu"),
        Placement(experts="disk"),
        Placement(resident_layers=1),
        Placement(disk_layers=1),
    ],
)
def test_every_policy_validates_and_runs(policy, placement):
    inp = make_input(placement=placement)
    s = build_schedule(policy, inp)
    tl = simulate(s, inp.profile)
    assert tl.status == "ok" and len(tl) == len(s)
    # every routed (step, layer, expert) with tokens is computed over exactly its tokens
    counts = inp.routing.counts
    done = Counter()
    for o in s.ops:
        if o.category == "expert":
            done[(o.step, o.layer, o.expert)] += o.tokens
    expected = {
        (st_, layer_, e): int(counts[st_, layer_, :, e].sum())
        for st_ in range(3)
        for layer_ in range(2)
        for e in range(4)
        if counts[st_, layer_, :, e].sum()
    }
    assert dict(done) == expected


@pytest.mark.parametrize("policy", MULTI)
def test_each_expert_loads_at_most_once_per_layer_and_step(policy):
    s = build_schedule(policy, make_input(model="mixtral-8x7b", bs=2, n=3, P=4, G=3))
    loads = Counter((o.step, o.layer, o.expert) for o in s.ops if o.category in EXPERT_LOADS and o.dst == "gpu")
    assert loads and max(loads.values()) == 1


@pytest.mark.parametrize("policy", ("hot-prefetch", "klotski"))
def test_cold_loads_never_start_before_the_gate_that_revealed_them(policy):
    inp = make_input(model="mixtral-8x7b", bs=2, n=3, P=4, G=4)
    s = build_schedule(policy, inp)
    tl = simulate(s, inp.profile)
    df = tl.df.set_index("op_id")
    counts = inp.routing.counts
    cold = [o for o in s.ops if o.category == "cold_expert"]
    assert cold
    for o in cold:
        gates = [s.op(d) for d in o.deps if s.op(d).category == "gate"]
        assert len(gates) == 1
        g = gates[0]
        assert (g.step, g.layer) == (o.step, o.layer) and counts[o.step, o.layer, g.batch, o.expert] > 0
        # no earlier gate of the group had revealed it
        assert all(counts[o.step, o.layer, b, o.expert] == 0 for b in range(g.batch))
        assert df.at[o.id, "start"] >= df.at[g.id, "end"]


def test_klotski_computes_hot_experts_first_then_cold_in_arrival_order():
    inp = make_input(model="mixtral-8x7b", bs=2, n=3, P=4, G=4)
    s = build_schedule("klotski", inp)
    loads = {}
    for i, o in enumerate(s.ops):
        if o.category in ("hot_expert", "cold_expert"):
            loads[(o.step, o.layer, o.expert)] = (0 if o.category == "hot_expert" else 1, i)
    for step in range(4):
        for layer in range(inp.model.num_layers):
            order = [
                loads[(o.step, o.layer, o.expert)]
                for o in s.ops
                if o.category == "expert" and (o.step, o.layer) == (step, layer)
            ]
            assert order == sorted(order)  # hot (0) before cold (1), cold by issue position


def test_hot_prefetch_without_reorder_runs_in_expert_id_order():
    s = build_schedule("hot-prefetch", make_input(model="mixtral-8x7b", bs=2, n=3, P=4, G=3))
    for step in range(3):
        for layer in range(32):
            experts = [o.expert for o in s.ops if o.category == "expert" and (o.step, o.layer) == (step, layer)]
            assert experts == sorted(experts)


def _hot_sets(schedule):
    hot = {}
    for o in schedule.ops:
        if o.category == "hot_expert":
            hot.setdefault((o.step, o.layer), []).append(o.expert)
    return hot


@given(cut_step=st.integers(0, 2), cut_layer=st.integers(0, 1), seed=st.integers(0, 10_000))
def test_prefetch_never_uses_the_future(cut_step, cut_layer, seed):
    """Changing the trace after (step, layer) never changes hot sets up to and including it."""
    inp = make_input(n=2, G=3)
    ids = inp.routing.ids.copy()
    rng = np.random.default_rng(seed)
    future = ids.copy()
    sh = inp.shape
    for step in range(sh.num_steps):
        for layer in range(inp.model.num_layers):
            if (step, layer) > (cut_step, cut_layer):
                pos = sh.step_positions(step)
                shape = future[:, :, pos, layer, :].shape
                keys = rng.random(shape[:-1] + (4,))
                future[:, :, pos, layer, :] = np.argsort(keys, axis=-1)[..., :2]
    changed = PolicyInput(inp.model, inp.profile, RoutingTable(future, sh, 4), inp.placement, {}, inp.warmup)
    a, b = _hot_sets(build_schedule("klotski", inp)), _hot_sets(build_schedule("klotski", changed))
    # the hot set of layer j is chosen from layer j-1 of the same step: it may depend on the cut
    for key in a:
        if key <= (cut_step, cut_layer):
            assert a[key] == b[key], key


def test_correlation_table_follows_the_paper():
    t = CorrelationTable(num_layers=2, num_experts=4, top_k=2)
    # two tokens: layer 0 chose {0,1} and {0,2}; layer 1 chose {3,2} and {3,1}
    t.observe_tokens(np.array([[[0, 1], [3, 2]], [[0, 2], [3, 1]]]))
    assert t.predict(0, None, 2) == [0, 1]  # T0 counts: e0=2, e1=1, e2=1 (tie -> lower id)
    assert t.pairs[1].tolist() == [[0, 1, 1, 2], [0, 0, 1, 1], [0, 1, 0, 1], [0, 0, 0, 0]]
    # row 0's top-2 columns: 3 (2 pairs), then 1 (tie with 2 -> lower id)
    assert sorted(t.predict(1, np.array([5, 0, 0, 0]), 2)) == [1, 3]


@settings(max_examples=40, deadline=None)
@given(
    st.integers(1, 4),
    st.sampled_from([2, 3, 4, 5, 6, 200]),
    st.integers(1, 3),
    st.integers(0, 30),
    st.integers(1, 64),
    st.integers(0, 2**31 - 1),
    st.booleans(),
    st.booleans(),
    st.booleans(),
)
@example(3, 200, 1, 5, 7, 0, True, False, 0)  # (a choice's code that does not fit the ids' byte: always tried)
@example(3, 200, 2, 5, 7, 0, False, True, 0)  # (a pair's code, likewise)
@example(3, 200, 2, 30, 7, 0, False, True, 1)  # (layer by layer, a byte's ids)
def test_correlation_table_counts_every_pair_once_whatever_the_chunking(
    L, E, K, tokens, chunk, seed, by_choice, step_of_routing, layer_by_layer
):
    """The one-pass learner (counting pairs, or pairs of whole top-k choices; in chunks of any size)
    counts what a token-by-token, layer-by-layer loop counts, for top-k choices of distinct experts
    (as every trace is: trace validation refuses an expert chosen twice) — given a trace's
    [token, layer, k] or, as a run learns a step, a slice of positions of [batch, seq, position, layer, k] —
    its ids in a byte, as traces hold them (200 experts: a pair's or a choice's code overflows a byte)."""
    K = min(K, E)
    rng = np.random.default_rng(seed)
    if step_of_routing:
        ids = np.argsort(rng.random((2, 3, tokens + 2, L, E)), axis=-1)[..., :K][:, :, 1 : tokens + 1]
    else:
        ids = np.argsort(rng.random((tokens, L, E)), axis=-1)[..., :K]
    ids = ids.astype(expert_id_type(E))
    t = CorrelationTable(num_layers=L, num_experts=E, top_k=K)
    with (
        patch.object(prefetch, "_CHUNK_PAIRS", chunk),
        patch.object(prefetch, "_CODE_TOKENS", chunk),
        patch.object(prefetch, "_WHOLE_TABLE_COUNTS", 0 if layer_by_layer else 1 << 62),
        patch.object(prefetch, "CHOICE_CODES", 6**3 if by_choice else 0),
        patch.object(prefetch, "_CHOICE_PAIRS_PER_CELL", 0),
    ):
        t.observe_tokens(ids)
    t0, pairs = np.zeros(E, dtype=np.int64), np.zeros((L, E, E), dtype=np.int64)
    for token in ids.reshape(-1, L, K):
        for e in token[0]:
            t0[e] += 1
        for layer in range(1, L):
            for prev in token[layer - 1]:
                for cur in token[layer]:
                    pairs[layer, prev, cur] += 1
    assert (t.t0 == t0).all() and (t.pairs == pairs).all()


@settings(max_examples=200, deadline=None)
@given(
    st.integers(1, 7),
    st.sampled_from([1, 2, 5, 33, 40, 70]),
    st.integers(1, 6),
    st.integers(1, 4),
    st.integers(0, 2**31 - 1),
)
def test_top_columns_are_a_stable_argsorts_first_columns(rows, cols, r, spread, seed):
    """Largest first, ties to the lower column (counts drawn from few values: many ties), r above
    the columns too; the argmax passes above 32 columns and up to r = 4, the sort otherwise."""
    table = np.random.default_rng(seed).integers(0, spread + 1, size=(rows, cols)).astype(np.int64)
    before = table.copy()
    expected = np.argsort(-table, axis=1, kind="stable")[:, :r]
    assert np.array_equal(top_columns(table, r), expected)
    assert np.array_equal(table, before)  # (the table itself untouched)


def test_prefetch_precision_is_reported():
    s = build_schedule("klotski", make_input(model="mixtral-8x7b", bs=4, n=4, P=8, G=4))
    pf = s.meta["prefetch"]
    assert 0 <= pf["hot_identification"] <= 1 and pf["precision"] > 0.5 and pf["predictions"] == 4 * 32


def _tput(policy, routing, n=4, seed=0, model="mixtral-8x7b"):
    inp = make_input(model=model, bs=8, n=n, P=16, G=6, routing=routing, seed=seed)
    return simulate(build_schedule(policy, inp), inp.profile).summary()


def test_reorder_shrinks_intra_layer_bubbles_with_skewed_routing():
    # a slow link and slow compute make loads and hot compute comparable
    slow = with_overrides(load_profile("rtx3090"), {"gpu.kernel_overhead_s": 2e-4})
    m = get_model("mixtral-8x7b")
    shape = RunShape(2, 2, 8, 6)
    trace = synthesize(m, shape.num_sequences + 8, 8, 6, "zipf:1.5", 0)
    rep = replay(trace, m, shape, warmup_sequences=8)
    inp = PolicyInput(m, slow, rep.routing, Placement(), {}, rep.warmup)
    klotski = simulate(build_schedule("klotski", inp), slow).summary()
    no_reorder = simulate(build_schedule("hot-prefetch", inp), slow).summary()
    assert klotski.bubble_intra_s < no_reorder.bubble_intra_s


def test_klotski_advantage_over_multi_batch_shrinks_with_uniform_routing():
    gain = {}
    for routing in ("zipf:1.5", "uniform"):
        gain[routing] = (
            _tput("klotski", routing, n=1).throughput_tok_s / _tput("multi-batch", routing, n=1).throughput_tok_s
        )
    assert gain["uniform"] < gain["zipf:1.5"]


def test_more_batches_never_reduce_expert_load_volume():
    m = get_model("mixtral-8x7b")
    trace = synthesize(m, 8 * 2 + 4, 4, 4, "calibrated", 0)
    volume = []
    for n in (1, 2, 4, 8):
        rep = replay(trace, m, RunShape(2, n, 4, 4), warmup_sequences=4)
        inp = PolicyInput(m, load_profile("rtx3090"), rep.routing, Placement(), {}, rep.warmup)
        s = build_schedule("klotski", inp)
        per_step = Counter()
        for o in s.ops:
            if o.category in EXPERT_LOADS:
                per_step[o.step] += o.bytes
        volume.append([per_step[k] for k in range(4)])
    for small, big in zip(volume, volume[1:]):
        assert all(b >= a for a, b in zip(small, big))


@pytest.mark.parametrize("overlap", ["code", "model"])
def test_flexgen_overlap_variants(overlap):
    inp = make_input(model="mixtral-8x7b", bs=2, n=3, P=4, G=3, options={"overlap": overlap})
    s = build_schedule("flexgen", inp)
    assert s.meta["overlap"] == overlap
    second_batch_attention = [o for o in s.ops if o.category == "attention" and o.batch == 1 and o.layer == 0]
    waits_for_next_layer = any(s.op(d).layer == 1 for d in second_batch_attention[0].deps)
    assert waits_for_next_layer == (overlap == "code")
    code = simulate(build_schedule("flexgen", make_input(model="mixtral-8x7b", bs=2, n=3, P=4, G=3)), inp.profile)
    model = simulate(s, inp.profile)
    if overlap == "model":
        assert model.makespan <= code.makespan
    with pytest.raises(ValueError, match="overlap must be"):
        build_schedule("flexgen", make_input(options={"overlap": "sometimes"}))


def test_disk_weights_are_staged_through_host_memory_within_the_window():
    inp = make_input(placement=Placement(experts="disk", disk_window=2), n=2, G=3)
    s = build_schedule("klotski", inp)
    tl = simulate(s, inp.profile)
    df = tl.df.set_index("op_id")
    reads = [o for o in s.ops if o.stream == "disk_read"]
    assert reads and all(o.category in ("moe_weights",) for o in reads)
    for o in s.ops:
        if o.stream != "disk_read" and o.category in EXPERT_LOADS:
            disk = [d for d in o.deps if s.op(d).stream == "disk_read"]
            assert len(disk) == 1 and df.at[disk[0], "end"] <= df.at[o.id, "start"]


@pytest.mark.parametrize("policy", ["klotski", "single-batch", "flexgen"])
def test_a_disk_read_waits_for_the_latest_copy_per_stream_as_it_would_for_every_copy(policy):
    """A disk read names, of the evicted layer's H2D copies, the latest on each stream (streams are
    in order: its end implies the others'); the timeline is the one of the same schedule with every
    copy of that layer issued before the read named, op by op (start, end, readiness, blocker)."""
    # (a window of one layer: a read that waited for the earliest copy alone would start sooner here)
    inp = make_input(model="mixtral-8x7b", placement=Placement(experts="disk", disk_window=1), bs=2, n=2, P=8, G=4)
    s = build_schedule(policy, inp)
    h2d = {"h2d_weights", "h2d_experts"}
    copies: dict[tuple[int, int], list[int]] = {}  # (step, layer) -> positions of its H2D weight copies
    every, expanded = [], 0
    for k, op in enumerate(s.ops):
        named = [s.index[d] for d in op.deps if s.ops[s.index[d]].stream in h2d]
        if op.stream == "disk_read" and named:  # (the first layer's reads wait for no copy: the window is free)
            streams = [s.ops[d].stream for d in named]
            assert len(streams) == len(set(streams)), op.id  # (one copy per stream)
            (layer,) = {(s.ops[d].step, s.ops[d].layer) for d in named}  # (the evicted layer)
            all_copies = [c for c in copies[layer] if c < k]  # its copies issued before this read
            for d in named:  # the latest of its stream among them
                assert d == max(c for c in all_copies if s.ops[c].stream == s.ops[d].stream), op.id
            others = tuple(s.ops[c].id for c in all_copies if s.ops[c].id not in op.deps)
            expanded += len(others)
            op = op._replace(deps=op.deps + others)
        elif op.kind == "transfer" and op.stream in h2d and op.dst == "gpu":
            copies.setdefault((op.step, op.layer), []).append(k)
        every.append(op)
    assert expanded > 0  # (the reads named fewer copies than there are)
    full = replace(s, ops=tuple(every))
    assert full is not s and len(full.ops) == len(s.ops)
    named, all_named = simulate(s, inp.profile), simulate(full, inp.profile)
    for column in ("start", "end", "ready", "blocked_by"):
        assert np.array_equal(named.columns[column], all_named.columns[column]), column


def test_flexgen_runs_out_of_memory_with_too_many_batches():
    small = with_overrides(load_profile("rtx3090"), {"gpu.memory_bytes": 8e9})
    inp = make_input(model="mixtral-8x7b", bs=16, n=4, P=512, G=2, profile=small)
    assert simulate(build_schedule("flexgen", inp), small).status == "oom"


# ---- planner ----------------------------------------------------------------------------------
def _slow_profile(**gpu):
    return make_profile(peak_flops=1e9, **gpu)


def test_planner_terms_by_hand():
    """tiny-mixtral, bs 2, P 8, G 4 on 1 GFLOP/s, 1 TB/s, 1 GB/s links, no overheads:
    t_cA = projections 2*2*12288 + scores 2*2*(2 tokens)*(4 heads)*(16 dims)*(kv 10) = 54,272 FLOPs
    = 54.272 us; t_cG = 2*2*64*4 = 1.024 us; t_IO_E = 49,152 B / 1 GB/s = 49.152 us;
    t_IO_A = 24.576 us; t_IO_G = 0.512 us. (5) needs n * 55.296 us >= 98.816 us -> n = 2."""
    p = plan(get_model("tiny-mixtral"), _slow_profile(), batch_size=2, prompt_len=8, gen_len=4)
    t = p.terms
    assert t["t_cA"] == pytest.approx(54.272e-6)
    assert t["t_cG"] == pytest.approx(1.024e-6)
    assert t["t_IO_E"] == pytest.approx(49.152e-6)
    assert t["t_IO_A"] == pytest.approx(24.576e-6)
    assert t["t_IO_G"] == pytest.approx(0.512e-6)
    # uniform routing: each hot expert gets 2 of the 4 tokens (2 x 98.304 us); the 2 cold experts are
    # used with probability 1 - 0.5^4 = 0.9375 each
    assert t["t_c_hotE"] == pytest.approx(2 * 98.304e-6)
    assert t["Q"] == pytest.approx(1.875)
    assert p.n_io == 2 and p.n == 2 and all(i.holds for i in p.inequalities)


def test_memory_cap_lowers_n_with_an_explanation():
    m = get_model("tiny-mixtral")
    one = memory_needed(m, 2, 1, 8, 4, Placement())["total"]
    p = plan(m, _slow_profile(memory_bytes=one + 10), batch_size=2, prompt_len=8, gen_len=4, resident_layers=False)
    assert p.n_io == 2 and p.n == 1 and p.n_memory == 1
    assert any("lowered from 2 to 1" in note for note in p.notes)


def test_planner_moves_kv_to_host_when_one_batch_does_not_fit():
    m = get_model("mixtral-8x7b")  # 32 layers of KV cache vs one batch-layer buffered
    no_kv = memory_needed(m, 16, 1, 512, 32, Placement(kv="cpu"))["total"]
    p = plan(m, _slow_profile(memory_bytes=no_kv + 10), batch_size=16, resident_layers=False)
    assert p.placement.kv == "cpu" and any("moved to host memory" in note for note in p.notes)


@pytest.mark.parametrize("prompt_len", [2048, 8192, 16384, 32768])
@pytest.mark.parametrize("batch_size", [8, 16, 32])
@pytest.mark.parametrize("host_bytes", [64e9, 128e9, 256e9, 1e12])
def test_the_planners_n_is_one_whose_kv_cache_host_memory_holds(prompt_len, batch_size, host_bytes):
    """With the KV cache moved to host memory, the planner chose n by GPU memory alone, and the
    run was then refused (a 16k-token prompt on the rtx3090: 273 GiB in 238 GiB): n is now the
    most batches the host holds, the largest such, and refused only when not even one fits."""
    m = get_model("mixtral-8x7b")
    profile = with_overrides(load_profile("rtx3090"), {"host.memory_bytes": host_bytes})
    p = plan(m, profile, batch_size=batch_size, prompt_len=prompt_len, gen_len=8)
    n_host = largest_storable_n(m, profile, batch_size, prompt_len, 8, p.placement)
    refused = storage_refusal(m, profile, p.placement, batch_size, p.n, prompt_len, 8)
    assert (refused is None) == (n_host >= 1)
    if p.placement.kv == "cpu" and not n_host and p.n_memory:  # refused: at one batch, the least it could need
        assert p.n == 1
    if p.placement.kv == "cpu" and n_host >= 1:
        assert p.n <= n_host
        if p.n < p.n_memory:  # lowered by the host alone: one more batch would not fit there (before the
            # spare GPU memory took resident layers, which the host then no longer holds)
            unfilled = replace(p.placement, resident_layers=0)
            assert storage_refusal(m, profile, unfilled, batch_size, p.n + 1, prompt_len, 8) is not None


def test_a_16k_prompt_on_the_rtx3090_runs_as_many_batches_as_host_memory_holds():
    """(the Klotski paper's 256 GiB host: 5 batches of 16 x 16k tokens' KV cache beside the weights)"""
    p = plan(get_model("mixtral-8x7b"), load_profile("rtx3090"), batch_size=16, prompt_len=16384, gen_len=8)
    assert p.n == 5 and p.placement.kv == "cpu"
    by_host = [note for note in p.notes if note.startswith("n lowered from ") and "KV cache in host memory" in note]
    assert len(by_host) == 1 and " to 5: with the KV cache in host memory" in by_host[0]


@pytest.mark.parametrize(
    "model,hardware,batch_size,as_prepared,expected_n_io",
    [
        ("mixtral-8x7b", "rtx3090", 16, True, 29),
        ("qwen3-30b-a3b", "rtx3090", 16, True, 5),
        ("deepseek-v3", "h800", 16, True, 26),
        ("olmoe-1b-7b", "t4", 64, True, 6),
        ("mixtral-8x7b", "rtx3090", 16, False, 182),
        ("qwen3-30b-a3b", "rtx3090", 16, False, 76),
        ("mixtral-8x7b", "h800", 4, False, 147),
        ("deepseek-v3", "h800", 16, False, None),
    ],
)
def test_the_planner_weighs_n_a_block_at_a_time_and_finds_what_all_at_once_found(
    model, hardware, batch_size, as_prepared, expected_n_io
):
    """The planner weighs candidate n a block at a time and stops at the first block where one closes
    the bubbles: the same plan (n, terms, notes) as every n at once (one block of 256) or n by n,
    whether that n is in the first block (a run's plan, as `prepare` asks for it: as published, layers
    kept resident), a later one or none (the planner's defaults, which ask for more)."""
    from klotski_sim.planning import planner
    from klotski_sim.runs.runner import RunSpec, planner_impl, planning_popularity, resolve_placement

    spec = RunSpec(model=model, hardware=hardware, batch_size=batch_size)
    m, profile = get_model(model), load_profile(hardware)
    popularity, placement = planning_popularity(spec, m), resolve_placement(spec, m, load_profile(hardware))
    asked = {"resident_layers": True, "impl": planner_impl(spec)} if as_prepared else {}
    plans = []
    for block in (planner._CANDIDATES_PER_PASS, 256, 1, 7):
        with patch.object(planner, "_CANDIDATES_PER_PASS", block):
            plans.append(plan(m, profile, batch_size, 512, 32, popularity=popularity, placement=placement, **asked))
    assert all(p == plans[0] for p in plans[1:]), [(p.n, p.n_io) for p in plans]
    assert plans[0].n_io == expected_n_io


def test_planner_reproduces_the_papers_memory_bound_n_order():
    p = plan(get_model("mixtral-8x7b"), load_profile("rtx3090"), batch_size=16)
    assert 10 <= p.n <= 20 and p.placement.kv == "gpu"  # paper: n = 15 on the 3090
    big = plan(get_model("mixtral-8x22b"), load_profile("rtx3090"), batch_size=16)
    # 8x22B (281 GB) does not fit in 256 GB of DRAM: the last layers' experts go to disk
    assert big.placement.uses_disk and 0 < big.placement.disk_layers < 56 and big.n < p.n


@pytest.mark.parametrize("policy", ("single-batch", "klotski", "flexgen"))
def test_kv_loads_wait_for_the_previous_steps_store(policy):
    """With the KV cache in host memory, a step's load must follow the store of the step before
    (the runtime found this dependency missing once: the simulator would have let it race)."""
    s = build_schedule(policy, make_input(placement=Placement(kv="cpu"), n=2, G=4))
    stores = {(o.layer, o.batch, o.step): o.id for o in s.ops if o.stream == "d2h_kv"}
    loads = [o for o in s.ops if o.stream == "h2d_kv"]
    assert loads
    for o in loads:
        assert stores[(o.layer, o.batch, o.step - 1)] in o.deps


def test_fetch_keeps_what_a_policy_of_its_own_adds():
    """OpEmitter.fetch is public (docs/own-schedule.md, examples/lru_single_batch.py): its `free` and
    any other tag reach the copy op, which is otherwise the positional one the built-in loops use."""
    em = OpEmitter(make_input())
    a = em.fetch("a", "experts", 10, "moe_weights", "h2d_weights", step=0, layer=0, expert=1)
    em.fetch("b", "experts", 10, "moe_weights", "h2d_weights", [a], step=0, layer=0, expert=2, free=(a,))
    em.fetch("c", "experts", 10, "moe_weights", "h2d_weights", step=0, layer=0, expert=3, batches=(0,))
    ops = {o.id: o for o in em.b.ops}
    assert ops["a"] == transfer_op(
        "a", "moe_weights", "h2d_weights", 10, "cpu", "gpu", (), 0, 0, 1, "expert", False, (("a", 10),), ()
    )
    assert ops["b"].free == ("a",) and ops["b"].deps == ("a",)
    assert ops["c"].batches == (0,) and ops["c"].alloc == (("c", 10),) and ops["c"].expert == 3


@settings(max_examples=40, deadline=None)
@given(
    st.lists(st.tuples(st.integers(0, 3), st.integers(1, 50), st.booleans(), st.booleans()), min_size=0, max_size=6),
    st.sampled_from([None, "gate", ""]),
    st.booleans(),
    st.sampled_from(["per-expert", "none"]),
)
def test_an_expert_chain_in_one_pass_issues_what_the_builder_does_op_by_op(parts, after, barrier_first, sync):
    """expert_chain builds an expert loop's sync/op pairs in one pass: the same ops, and the builder
    left in the same state (what is issued next waits for the same host op), as a host wait and an
    append per op (what `expert` did before it)."""

    def emit(one_pass: bool) -> list[Op]:
        em = OpEmitter(make_input(options={"sync": sync, "expert_ops": "per-batch"}))
        if barrier_first:
            em.sync("before", ["x"])
        em.b.append(compute_op("x", "gate", (), 0, 0, 0, "decode", 0, (0,), -1, 1, 0, (), (), ""))
        ops = [
            (f"E{i}", e, (i % 2,), tokens, ("w",) if own else (), ("w",) if free else ())
            for i, (e, tokens, own, free) in enumerate(parts)
        ]
        if one_pass:
            last = em.expert_chain(0, 0, after, ops)
        else:
            last = after
            for op_id, e, batches, tokens, deps, free in ops:
                deps = list(deps)
                if sync == "per-expert" and last is not None:
                    deps.append(em.b.host_wait(f"{op_id}/rows/sync", "sync", [last]))
                last = em.b.append(
                    compute_op(
                        op_id,
                        "expert",
                        tuple(deps),
                        em.model.expert_flops(tokens),
                        em.model.expert_io_bytes(tokens),
                        0,
                        "prefill",
                        0,
                        batches,
                        e,
                        tokens,
                        0,
                        (),
                        free,
                        "",
                    )
                )
        em.b.transfer("next", "weights", "h2d_weights", 1, "cpu", "gpu")  # (waits for the latest host op)
        em.b.append(compute_op("y", "gate", (), 0, 0, 0, "decode", 0, (0,), -1, 1, 0, (), (), ""))
        return [*em.b.ops, last, em.b.last_issued()]

    assert emit(True) == emit(False)


@pytest.mark.parametrize("model", ["tiny-mixtral", "tiny-olmoe@int4:g16"])
@pytest.mark.parametrize("policy", sorted(POLICIES))
def test_no_schedule_holds_less_than_the_memory_floor(model, policy):
    """The memory check refuses, before building anything, what exceeds `memory_floor` — "impossible
    whatever the schedule" — so every schedule's simulated peak must reach it (and FlexGen's, which
    holds a streamed MoE layer's every expert at once, the floor with that layer)."""
    from .test_cpu_experts import cpu_profile

    info = POLICIES[policy]
    for placement, options, impl in [
        (Placement(), {}, "as-published"),
        (Placement(kv="cpu"), {}, "ideal"),
        (Placement(resident_layers=1), {}, "as-published"),
        (Placement(experts="disk"), {}, "ideal"),
        (Placement(), {} if info.traits.manages_experts else {"expert_cache": 2}, "ideal"),
    ]:
        inp = make_input(
            model=model, placement=placement, options=options, profile=cpu_profile() if info.traits.needs_cpu else None
        )
        timeline = simulate(build_schedule(policy, replace(inp, impl=impl)), inp.profile)
        sh = inp.shape
        holds = info.traits.holds_moe_layer and not options
        floor = memory_floor(
            inp.model, sh.batch_size, sh.num_batches, sh.prompt_len, sh.gen_len, placement, holds_moe_layer=holds
        )
        assert timeline.status == "ok" and timeline.meta["peak_gpu_bytes"] >= floor["total"], (placement, impl)
        assert ("one_moe_layer" in floor) == (holds and placement.resident_layers < inp.model.num_layers)


def test_a_kv_cache_in_host_memory_moves_more_expert_layers_to_disk_not_the_run_to_a_refusal():
    """Mixtral-8x22B on the Klotski paper's 256 GiB host with its KV cache there (10 batches of 16):
    weights and cache are 257 GiB unless the cache's share sends more layers' experts to disk; the
    placement made room for the weights alone (7 layers on disk) and the run was refused."""
    from klotski_sim.hardware.profile import load_profile
    from klotski_sim.planning.planner import HOST_HEADROOM, host_kv_bytes, storage_needed
    from klotski_sim.runs.runner import RunSpec, resolve_placement
    from klotski_sim.workload.model import get_model

    model, profile = get_model("mixtral-8x22b"), load_profile("rtx3090")
    spec = RunSpec(model="mixtral-8x22b", num_batches=10, prompt_len=512, gen_len=32, kv="cpu")
    on_gpu = resolve_placement(RunSpec(model="mixtral-8x22b", num_batches=10, kv="gpu"), model, profile)
    in_host = resolve_placement(spec, model, profile)
    assert in_host.disk_layers > on_gpu.disk_layers == 7
    kv = host_kv_bytes(model, 16, 10, 512, 32)
    host = storage_needed(model, in_host, 16, 10, 512, 32)["host"]
    assert host <= profile.host.memory_bytes and host - kv <= profile.host.memory_bytes * HOST_HEADROOM
