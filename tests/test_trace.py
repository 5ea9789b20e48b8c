"""Trace format, replay, import, generator and statistics."""

import json
import re
from pathlib import Path
from unittest.mock import patch

import numpy as np
import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from klotski_sim.workload import routing as routing_module
from klotski_sim.workload.model import get_model
from klotski_sim.workload.routing import RoutingTable, RunShape
from klotski_sim.workload.trace import Trace, TraceError, import_jsonl, replay
from klotski_sim.workload.trace_stats import layer_stats, summary
from klotski_sim.workload.trace_synth import synthesize, synthesized_blocks

from .conftest import run_cli

TINY = get_model("tiny-mixtral")
MIXTRAL = get_model("mixtral-8x7b")


def _tiny_trace(sequences=6, length=10, seed=0):
    return synthesize(TINY, sequences, length - 2, 2, "uniform", seed=seed, with_weights=True)


def test_roundtrip_and_identical_bytes_for_same_seed(tmp_path):
    t = _tiny_trace()
    t.save(tmp_path / "a.npz")
    _tiny_trace().save(tmp_path / "b.npz")
    assert (tmp_path / "a.npz").read_bytes() == (tmp_path / "b.npz").read_bytes()
    back = Trace.load(tmp_path / "a.npz")
    assert np.array_equal(back.experts, t.experts) and back.meta["model"] == "tiny-mixtral"
    assert back.weights is not None and back.weights.shape == t.experts.shape


@pytest.mark.parametrize(
    "num_experts,held",
    [
        (8, np.uint8),
        (256, np.uint8),
        (257, np.int16),
        (300, np.int16),
        (32768, np.int16),
        (32769, np.int32),
        (65536, np.int32),
    ],
)
def test_a_trace_holds_its_ids_in_a_byte_up_to_256_experts_whatever_type_it_was_given(tmp_path, num_experts, held):
    """A trace holds its ids in the type they are stored in (a long prompt's trace is the largest
    thing its run holds): given in int16 or int64, or read from a file written in int16 (klotski
    0.1's), the ids are the same numbers in a byte up to 256 experts, in int16 up to 32,768, in int32
    beyond (never wrapped: id 40,000 of 65,536 stays 40,000, and so does its routing table)."""
    rng = np.random.default_rng(num_experts)
    first = rng.integers(0, num_experts, (12, 3))
    first[0, 0] = num_experts - 1  # (the largest id)
    ids = np.stack([first, (first + 1) % num_experts], axis=-1)  # (a token's two choices distinct)
    meta = {"model": "t", "num_experts": num_experts, "top_k": 2, "num_layers": 3}
    wide = np.int16 if num_experts <= 1 << 15 else np.int32  # (what holds them as given)
    for given_type in (wide, np.int64):
        trace = Trace(ids.astype(given_type), np.array([0, 5, 12]), np.array([3, 4], dtype=np.int32), meta)
        assert trace.experts.dtype == held and np.array_equal(trace.experts, ids)
    table = RoutingTable(ids[:6].reshape(2, 1, 3, 3, 2).astype(np.int64), RunShape(1, 2, 2, 2), num_experts)
    assert table.ids.dtype == held and np.array_equal(table.ids.reshape(-1), ids[:6].reshape(-1))
    old = tmp_path / "old.npz"  # (as numpy.savez_compressed wrote a trace before ids were held in a byte)
    np.savez_compressed(
        old,
        experts=ids.astype(wide),
        seq_offsets=np.array([0, 5, 12]),
        prompt_lens=np.array([3, 4], dtype=np.int32),
        meta=np.array(json.dumps({"format": "klotski-routing-trace", "version": 1, **meta})),
    )
    back = Trace.load(old)
    assert back.experts.dtype == held and np.array_equal(back.experts, ids)
    assert synthesize(TINY, 2, 4, 2, "calibrated").experts.dtype == np.uint8


@pytest.mark.parametrize("num_experts,stored", [(8, np.uint8), (300, np.int16)])
def test_a_routing_file_gives_back_the_ids_it_was_saved_from(tmp_path, num_experts, stored):
    """routing.npz (what `simulate --out` writes for the runtime) stores ids in a byte up to 256
    experts, holds them in memory in that type too, and reads them back as they were, with the
    shape, source and dense layers."""
    shape = RunShape(batch_size=2, num_batches=3, prompt_len=5, gen_len=3)
    first = np.random.default_rng(0).integers(0, num_experts, (3, 2, 7, 4))
    second = (first + np.random.default_rng(1).integers(1, num_experts, first.shape)) % num_experts  # (distinct)
    ids = np.stack([first, second], axis=-1).astype(np.int16)
    table = RoutingTable(ids, shape, num_experts, source="synth:x", dense_layers=1, moe_step=2)
    assert table.ids.dtype == stored and np.array_equal(table.ids, ids)
    assert not table.counts[:, [0, 1, 3]].any() and table.counts[:, 2].any()  # (layers 2, 4, ... route)
    table.save(tmp_path / "routing.npz")
    with np.load(tmp_path / "routing.npz", allow_pickle=False) as z:
        assert z["ids"].dtype == stored
    back = RoutingTable.load(tmp_path / "routing.npz")
    assert back.ids.dtype == stored and np.array_equal(back.ids, ids)
    assert (back.shape, back.num_experts, back.source, back.dense_layers) == (shape, num_experts, "synth:x", 1)
    assert back.moe_step == 2
    assert [p.name for p in tmp_path.iterdir()] == ["routing.npz"]  # (written atomically: no temporary left)


def test_an_npz_written_at_level_1_is_one_numpy_reads_and_a_failed_write_leaves_nothing(tmp_path):
    from klotski_sim.files.npzfile import write_npz

    arrays = {"a": np.arange(1000, dtype=np.int64).reshape(10, 100), "text": np.array("héllo"), "n": np.array(3)}
    write_npz(tmp_path / "x.npz", arrays)
    with np.load(tmp_path / "x.npz", allow_pickle=False) as z:
        assert set(z.files) == set(arrays) and all(np.array_equal(z[k], v) for k, v in arrays.items())
    with pytest.raises(ValueError):  # an object array would need pickling: refused, and no file is left
        write_npz(tmp_path / "y.npz", {"bad": np.array([{}, 1], dtype=object)})
    assert sorted(p.name for p in tmp_path.iterdir()) == ["x.npz"]
    from klotski_sim.util.errors import UsageError

    with pytest.raises(UsageError, match=r"nowhere/x\.npz: cannot write \(No such file"):  # (the path asked for)
        write_npz(tmp_path / "nowhere" / "x.npz", arrays)


def test_a_trace_whose_meta_is_not_one_json_string_is_said_so(tmp_path):
    """A meta of two strings, or stored as bytes, or not JSON, was "the file is truncated or corrupt"."""
    path = tmp_path / "t.npz"
    _tiny_trace().save(path)
    arrays = dict(np.load(path))
    for meta, said in (
        (np.array([str(arrays["meta"])] * 2), "meta must be one JSON string, got <U"),
        (
            np.frombuffer(str(arrays["meta"]).encode(), dtype=np.uint8),
            "meta must be one JSON string, got uint8 of shape",
        ),
        (np.array("{not json"), "its meta is not valid JSON (Expecting property name"),
    ):
        np.savez(path, **{**arrays, "meta": meta})
        with pytest.raises(TraceError, match=re.escape(f"{path}: {said}")):
            Trace.load(path)


def test_truncated_and_corrupt_files(tmp_path):
    path = tmp_path / "t.npz"
    _tiny_trace().save(path)
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])
    with pytest.raises(TraceError, match="truncated or corrupt"):
        Trace.load(path)
    path.write_bytes(b"not a zip at all")
    with pytest.raises(TraceError, match="truncated or corrupt"):
        Trace.load(path)
    with pytest.raises(TraceError, match="no such trace file"):
        Trace.load(tmp_path / "missing.npz")
    np.savez(path, something=np.zeros(3))
    with pytest.raises(TraceError, match="not a routing trace"):
        Trace.load(path)


def test_invalid_contents_are_named():
    t = _tiny_trace()
    bad = t.experts.copy()
    bad[0, 0, 0] = 7
    with pytest.raises(TraceError, match="expert id 7 out of range for num_experts=4"):
        Trace(bad, t.seq_offsets, t.prompt_lens, t.meta)
    with pytest.raises(TraceError, match="seq_offsets"):
        Trace(t.experts, t.seq_offsets[:-1], t.prompt_lens[:-1], t.meta)
    dup = t.experts.copy()
    dup[0, 0, 1] = dup[0, 0, 0]
    with pytest.raises(TraceError, match="same expert twice"):
        Trace(dup, t.seq_offsets, t.prompt_lens, t.meta)
    falling = t.seq_offsets.astype(np.uint64)  # (unsigned: a falling offset's difference wraps, never negative)
    falling[1], falling[2] = falling[2], falling[1]
    with pytest.raises(TraceError, match="seq_offsets"):
        Trace(t.experts, falling, t.prompt_lens, t.meta)
    as_unsigned = Trace(t.experts, t.seq_offsets.astype(np.uint64), t.prompt_lens.astype(np.uint32), t.meta)
    assert as_unsigned.seq_offsets.dtype == np.int64 and np.array_equal(as_unsigned.seq_offsets, t.seq_offsets)
    weights = np.full(t.experts.shape, 0.5, dtype=np.float16)
    assert Trace(t.experts, t.seq_offsets, t.prompt_lens, t.meta, weights).weights is weights
    for bad_weights in (
        np.full(t.experts.shape, np.nan),
        np.full(t.experts.shape, -0.5),
        weights.astype(np.int8),
        weights.astype(str),
    ):
        with pytest.raises(TraceError, match="weights must be finite non-negative"):
            Trace(t.experts, t.seq_offsets, t.prompt_lens, t.meta, bad_weights)


@given(st.integers(2, 40), st.integers(1, 300), st.integers(0, 2**32 - 1))
def test_mutual_information_over_used_cells_is_the_dense_tables(experts, tokens, seed):
    """Past 2048 experts trace stats reads MI and the best-map accuracy from the joint table's used
    cells (a dense one for 65,536 experts took 32 GiB): the same numbers as the dense table."""
    from klotski_sim.workload.trace_stats import _mutual_information_bits, _mutual_information_bits_sparse

    rng = np.random.default_rng(seed)
    a, b = rng.integers(0, experts, tokens), rng.integers(0, experts, tokens)
    dense, sparse = _mutual_information_bits(a, b, experts), _mutual_information_bits_sparse(a, b, experts)
    assert sparse == pytest.approx(dense, abs=1e-9)


def test_stats_of_a_trace_declaring_65536_experts_take_no_gigabytes(tmp_path):
    t = _tiny_trace()
    Trace(t.experts, t.seq_offsets, t.prompt_lens, {**t.meta, "num_experts": 65536}).save(tmp_path / "wide.npz")
    rc, out, err = run_cli("trace", "stats", str(tmp_path / "wide.npz"))
    assert rc == 0 and "mi_next_bits" in out, err


def test_trace_for_another_model_is_refused():
    t = synthesize(MIXTRAL, 2, 8, 2, "uniform")
    with pytest.raises(TraceError, match="8 experts vs 64"):
        replay(t, get_model("olmoe-1b-7b"), RunShape(1, 1, 4, 2))


def test_replay_shapes_warmup_and_wrap():
    t = _tiny_trace(sequences=6, length=10)
    shape = RunShape(batch_size=2, num_batches=2, prompt_len=6, gen_len=3)
    rep = replay(t, TINY, shape, warmup_sequences=2)
    assert rep.routing.ids.shape == (2, 2, 8, TINY.num_layers, 2)
    assert set(rep.evaluated).isdisjoint(range(2)) and rep.warmup.num_sequences == 2
    # the replayed ids are the trace's tokens
    assert np.array_equal(rep.routing.ids[0, 0], t.sequence(rep.evaluated[0])[:8])
    with pytest.raises(TraceError, match="--wrap"):
        replay(t, TINY, RunShape(2, 3, 6, 3), warmup_sequences=2)
    wrapped = replay(t, TINY, RunShape(2, 3, 6, 3), warmup_sequences=2, wrap=True)
    assert wrapped.wrapped and "WRAPPED: 4 distinct sequences for 6 needed" in wrapped.routing.source
    with pytest.raises(TraceError, match="no sequence has the 19 tokens"):
        replay(t, TINY, RunShape(1, 1, 10, 10))


@given(st.lists(st.integers(3, 6), min_size=1, max_size=6), st.data())
def test_the_chosen_sequences_ids_are_a_view_where_they_follow_one_another_and_a_copy_elsewhere(lengths, data):
    """replay's cut of a trace: the first `tokens` ids of each chosen sequence, without a copy of a
    long prompt's routing where the sequences are consecutive and equally long."""
    from klotski_sim.workload.trace import _sequences_ids

    offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
    first = np.random.default_rng(len(lengths)).integers(0, 8, (offsets[-1], 3))
    experts = np.stack([first, (first + 1 + np.arange(first.size).reshape(first.shape) % 7) % 8], axis=-1)
    experts = experts.astype(np.int16)  # (a token's two choices distinct, as a router's are)
    trace = Trace(
        experts,
        offsets,
        np.full(len(lengths), 2, dtype=np.int32),
        {"model": "t", "num_experts": 8, "top_k": 2, "num_layers": 3},
    )
    chosen = data.draw(st.lists(st.integers(0, len(lengths) - 1), min_size=1, max_size=8))
    tokens = data.draw(st.integers(1, min(lengths[i] for i in chosen)))
    got = _sequences_ids(trace, chosen, tokens)
    assert np.array_equal(got, np.stack([trace.sequence(i)[:tokens] for i in chosen]))
    consecutive = chosen == list(range(chosen[0], chosen[0] + len(chosen)))
    same_length = len({lengths[i] for i in chosen}) == 1
    assert np.shares_memory(got, trace.experts) == (consecutive and same_length)


def test_counts_match_ids():
    rep = replay(_tiny_trace(), TINY, RunShape(2, 2, 6, 3))
    r = rep.routing
    for step in range(3):
        for layer in range(TINY.num_layers):
            for b in range(2):
                ids = r.step_ids(step, layer, b)
                assert np.array_equal(r.counts[step, layer, b], np.bincount(ids.ravel(), minlength=4))


@settings(max_examples=40, deadline=None)
@given(
    st.integers(1, 3),
    st.integers(1, 3),
    st.integers(1, 5),
    st.integers(1, 4),
    st.integers(1, 3),
    st.sampled_from([(2, 1), (4, 2), (8, 2), (3, 3), (9, 2), (200, 2), (256, 3)]),
    st.integers(0, 2),
    st.booleans(),
    st.integers(0, 9),
    st.sampled_from([1, 7, 1 << 20]),
)
@example(1, 2, 3, 2, 2, (200, 2), 0, True, 0, 7)  # (ids in a byte whose choice codes do not fit one: always tried)
def test_counts_by_choice_or_by_expert_are_the_ids_counted_one_by_one(
    nb, bs, prompt, gen, layers, experts_k, dense, by_choice, seed, keys_per_pass
):
    """RoutingTable.counts, by whole choices (up to CHOICE_CODES of them) or expert by expert, and
    a batch's positions in one pass or in chunks (`_COUNTED_KEYS`: a long prompt's), are each
    (step, layer, batch)'s ids counted one by one (repeats within a token counted too) — ids held in
    a byte up to 256 experts, whose choice codes and keys do not fit one."""
    E, K = experts_k
    shape = RunShape(bs, nb, prompt, gen)
    ids = np.random.default_rng(seed).integers(0, E, (nb, bs, shape.tokens_per_sequence, layers, K)).astype(np.int16)
    dense = min(dense, layers)
    expected = np.zeros((shape.num_steps, layers, nb, E), dtype=np.int64)
    for b in range(nb):
        for position in range(shape.tokens_per_sequence):
            step = 0 if position < prompt else position - prompt + 1
            for layer in range(dense, layers):
                for e in ids[b, :, position, layer].ravel():
                    expected[step, layer, b, e] += 1
    with (
        patch.object(routing_module, "CHOICE_CODES", 10**6 if by_choice else 0),
        patch.object(routing_module, "_COUNTED_KEYS", keys_per_pass),
    ):
        counts = RoutingTable(ids, shape, E, dense_layers=dense).counts
    assert np.array_equal(counts, expected)


@pytest.mark.parametrize(
    "model,sequences,prompt,gen,routing,weights,digest",
    [
        ("tiny-mixtral", 5, 30, 4, "calibrated", True, "3768d5ca6f6276fd"),
        ("mixtral-8x7b", 3, 9000, 2, "calibrated", False, "c97cec01750ee1df"),  # (a long prompt)
        ("olmoe-1b-7b", 4, 20, 3, "calibrated", True, "a1e96e71f0efe832"),  # (top-8: a partition, not argmax passes)
        ("mixtral-8x7b", 4, 20, 3, "uniform", False, "7ad9279eba0310d8"),
    ],
)
def test_the_generator_draws_what_it_drew(model, sequences, prompt, gen, routing, weights, digest):
    """Golden draws of the synthetic generator (every run without a trace replays one): its working
    arrays are computed in place where the numbers are the same, and these digests (taken when each
    kind of draw got its own random stream) pin it. (A numpy that changed its random streams would
    change them, and every synthetic run with them.)"""
    import hashlib

    t = synthesize(get_model(model), sequences, prompt, gen, routing, seed=11, with_weights=weights)
    data = t.experts.astype(np.int64).tobytes() + (t.weights.tobytes() if weights else b"")
    assert hashlib.sha256(data).hexdigest()[:16] == digest


@settings(max_examples=25, deadline=None)
@given(
    model=st.sampled_from(["tiny-mixtral", "olmoe-1b-7b"]),
    routing=st.sampled_from(["calibrated", "uniform", "zipf:1.2"]),
    fewer=st.integers(1, 9),
    more=st.integers(1, 9),
    chunk=st.sampled_from([None, 1, 2, 3, 64]),
    tokens=st.integers(1, 7),
    seed=st.integers(0, 2**32),
)
def test_a_sequence_is_drawn_the_same_however_many_are_drawn_and_however_many_at_a_time(
    model, routing, fewer, more, chunk, tokens, seed
):
    """Sequence i of a synthetic trace depends on the seed, the model, the routing and the lengths
    alone: a trace of more sequences, or drawn fewer at a time, begins with the same sequences (with
    one random stream for every draw, a run of 1 batch and one of 17 replayed different first
    batches, and a planner's n set by an unrelated hardware number changed every run's routing)."""
    spec = get_model(model)
    few = synthesize(spec, fewer, tokens, 1, routing, seed=seed, with_weights=True)
    many = synthesize(spec, fewer + more, tokens, 1, routing, seed=seed, with_weights=True, chunk=chunk)
    rows = fewer * (tokens + 1)
    assert np.array_equal(many.experts[:rows], few.experts)
    assert np.array_equal(many.weights[:rows], few.weights)


@pytest.mark.parametrize(
    "model,sequences,tokens",
    [("qwen3-30b-a3b", 20, 544), ("qwen3-30b-a3b", 2, 4100), ("olmoe-1b-7b", 40, 300), ("mixtral-8x7b", 150, 100)],
)
def test_the_generator_draws_as_many_sequences_at_a_time_as_its_element_budget_allows(model, sequences, tokens):
    """A chunk's working arrays are [sequences, tokens, experts]: the default chunk holds at most
    `_ELEMENTS_PER_CHUNK` of their elements (or one sequence, when one alone is more) and at most 64
    sequences — a fine-grained model's 128 experts drawn 64 sequences at a time took four times the
    memory, and longer."""
    from klotski_sim.workload import trace_synth

    spec = get_model(model)
    blocks = list(synthesized_blocks(spec, sequences, tokens - 1, 1, "calibrated", seed=2).blocks)
    per_sequence = tokens * spec.num_experts
    largest = max(1, min(64, trace_synth._ELEMENTS_PER_CHUNK // per_sequence))
    assert [len(b) // tokens for b in blocks[:-1]] == [largest] * (len(blocks) - 1)
    assert sum(len(b) for b in blocks) == sequences * tokens
    assert max(len(b) // tokens for b in blocks) * per_sequence <= max(per_sequence, trace_synth._ELEMENTS_PER_CHUNK)


def test_the_first_batch_a_policy_replays_does_not_depend_on_its_number_of_batches():
    """A single-batch run (1 batch) and a Klotski run (17 batches) of one configuration replay the
    same first batch, so a comparison of policies compares schedules, not routing draws."""
    from klotski_sim.runs.runner import RunSpec, make_replay

    spec = RunSpec(model="tiny-mixtral", batch_size=3, prompt_len=9, gen_len=3, num_batches=None)
    one = make_replay(spec, TINY, 1)[1].routing.counts
    many = make_replay(spec, TINY, 17)[1].routing.counts
    assert one.shape[2] == 1 and many.shape[2] == 17
    assert np.array_equal(many[:, :, :1], one)
    assert not np.array_equal(many[:, :, 1:2], one)  # (and the next batch is another draw)


def test_calibrated_mixtral_statistics_land_near_targets():
    s = summary(synthesize(MIXTRAL, 128, 128, 16, "calibrated", seed=1))
    assert 0.14 <= s["max_share"] <= 0.21  # corpus-level max share ~0.16
    assert 0.19 <= s["request_max_share"] <= 0.30  # within one request 0.20-0.30
    assert 0.21 <= s["stick_top1"] <= 0.30  # first choice repeats ~25% (random 12.5%)
    assert 0.56 <= s["stick_any"] <= 0.68  # share at least one ~62% (random 46%)
    assert 0.03 <= s["mi_skip7_bits"] <= 0.25  # weak layer-to-layer information


def test_uniform_shows_none_of_it():
    s = summary(synthesize(MIXTRAL, 128, 128, 16, "uniform", seed=1))
    assert s["max_share"] < 0.135 and abs(s["stick_top1"] - 0.125) < 0.01
    assert abs(s["stick_any"] - 0.464) < 0.02 and s["mi_next_bits"] < 0.01


def test_fine_grained_calibrated_has_strong_layer_correlation():
    s = summary(synthesize(get_model("olmoe-1b-7b"), 96, 240, 16, "calibrated", seed=1))  # enough tokens for a 64x64 MI
    assert 0.3 <= s["mi_skip7_bits"] <= 1.5 and s["topk_share"] >= 0.2


def test_group_skew_is_higher_for_skewed_routing():
    skew = layer_stats(synthesize(MIXTRAL, 64, 32, 8, "zipf:1.5", seed=0))
    flat = layer_stats(synthesize(MIXTRAL, 64, 32, 8, "uniform", seed=0))
    assert skew["hot_share_n4"].mean() > flat["hot_share_n4"].mean() + 0.1
    assert skew["active_n1"].mean() < flat["active_n1"].mean()


def test_bad_routing_names():
    with pytest.raises(ValueError, match="unknown routing"):
        synthesize(TINY, 2, 4, 1, "bimodal")
    with pytest.raises(ValueError, match="exponent"):
        synthesize(TINY, 2, 4, 1, "zipf:x")


def _jsonl(path, records):
    path.write_text("\n".join(json.dumps(r) for r in records) + "\n")


def test_import_jsonl(tmp_path):
    recs = [
        {
            "seq_id": s,
            "token_idx": t,
            "layer": layer,
            "experts": [(t + layer) % 4, (t + layer + 1) % 4],
            "gating_probs": [0.6, 0.4],
        }
        for s in ("a", "b")
        for t in range(5)
        for layer in range(2)
    ]
    _jsonl(tmp_path / "log.jsonl", recs)
    trace, problems = import_jsonl(tmp_path / "log.jsonl", num_experts=4, model="tiny-mixtral")
    assert problems == [] and trace.num_sequences == 2 and trace.experts.shape == (10, 2, 2)
    assert trace.experts[3, 1].tolist() == [0, 1]
    # a hole is reported and the sequence is cut before it, never filled in
    holed = [r for r in recs if not (r["seq_id"] == "b" and r["token_idx"] == 3 and r["layer"] == 1)]
    _jsonl(tmp_path / "holed.jsonl", holed)
    trace, problems = import_jsonl(tmp_path / "holed.jsonl", num_experts=4)
    assert len(problems) == 1 and "token 3 layer 1" in problems[0]
    assert trace.lengths.tolist() == [5, 3]


def test_import_rejects_malformed_lines(tmp_path):
    (tmp_path / "bad.jsonl").write_text('{"seq_id": 1, "token_idx": 0, "layer": 0, "experts": [1, 2]}\n{oops\n')
    with pytest.raises(TraceError, match="bad.jsonl:2: not valid JSON"):
        import_jsonl(tmp_path / "bad.jsonl")
    (tmp_path / "bad2.jsonl").write_text('{"seq_id": 1, "token_idx": 0, "layer": 0}\n')
    with pytest.raises(TraceError, match="bad2.jsonl:1: record has none of"):
        import_jsonl(tmp_path / "bad2.jsonl")


def test_the_trace_cache_key_covers_every_source_of_a_draw(tmp_path, monkeypatch):
    """A cached draw is keyed by the generator's code, the top-k code it calls, its calibration data
    and numpy's version (whose Generator may draw otherwise in another release): changing any one
    of them misses the cache; a file the generator does not read (the data's README) does not."""
    import shutil
    from importlib import resources

    from klotski_sim.workload import trace_cache as cache

    package = Path(resources.files("klotski_sim.workload"))
    copy = tmp_path / "klotski_sim"
    (copy / "data").mkdir(parents=True)
    for name in cache.GENERATOR_SOURCES:
        shutil.copy(package / name, copy / name)
    for entry in (package / "data").iterdir():
        shutil.copy(entry, copy / "data" / entry.name)
    same = cache.generator_fingerprint()
    assert cache.generator_fingerprint(copy) == same
    sources = [*cache.GENERATOR_SOURCES, *(f"data/{p.name}" for p in (copy / "data").glob("*.json"))]
    assert len(sources) >= 4
    for name in [*sources, "data/CALIBRATION-README.md"]:
        original = (copy / name).read_bytes()
        (copy / name).write_bytes(original + b" ")
        assert (cache.generator_fingerprint(copy) != same) == (name in sources), name
        (copy / name).write_bytes(original)
    monkeypatch.setattr(np, "__version__", "0.0.0")
    assert cache.generator_fingerprint() != same

    monkeypatch.setenv("KLOTSKI_CACHE_DIR", str(tmp_path / "cache"))
    m = get_model("tiny-mixtral")
    calls = []

    def make():
        calls.append(1)
        return synthesize(m, 5, 6, 3, "calibrated", 7)

    cache.cached_trace(m, "calibrated", 7, 5, 6, 3, make)
    cache.cached_trace(m, "calibrated", 7, 5, 6, 3, make)
    monkeypatch.undo()  # (numpy's own version again: the trace drawn under "0.0.0" is not served)
    monkeypatch.setenv("KLOTSKI_CACHE_DIR", str(tmp_path / "cache"))
    cache.cached_trace(m, "calibrated", 7, 5, 6, 3, make)
    assert len(calls) == 2


def test_trace_cache_serves_the_same_trace_and_survives_a_bad_file(tmp_path, monkeypatch):
    from klotski_sim.workload.trace_cache import cached_trace

    monkeypatch.setenv("KLOTSKI_CACHE_DIR", str(tmp_path))
    m = get_model("tiny-mixtral")
    calls = []

    def make():
        calls.append(1)
        return synthesize(m, 5, 6, 3, "calibrated", 7)

    first = cached_trace(m, "calibrated", 7, 5, 6, 3, make)
    second = cached_trace(m, "calibrated", 7, 5, 6, 3, make)
    assert len(calls) == 1 and np.array_equal(first.experts, second.experts)
    assert second.meta == first.meta
    for f in (tmp_path / "traces").glob("*.npz"):  # a truncated cache file is regenerated, not trusted
        f.write_bytes(f.read_bytes()[:100])
    third = cached_trace(m, "calibrated", 7, 5, 6, 3, make)
    assert len(calls) == 2 and np.array_equal(third.experts, first.experts)
    for f in (tmp_path / "traces").glob("*.npz"):  # a readable file that is no valid trace: regenerated too
        with np.load(f) as z:
            arrays = dict(z)
        arrays["experts"] = np.full_like(arrays["experts"], 200)  # (ids out of range for 8 experts)
        np.savez(f, **arrays)
    assert np.array_equal(cached_trace(m, "calibrated", 7, 5, 6, 3, make).experts, first.experts)
    assert len(calls) == 3
    monkeypatch.setenv("KLOTSKI_CACHE_DIR", "off")
    cached_trace(m, "calibrated", 7, 5, 6, 3, make)
    assert len(calls) == 4
    (tmp_path / "a-file").write_text("")
    monkeypatch.setenv("KLOTSKI_CACHE_DIR", str(tmp_path / "a-file"))  # a cache that cannot be written
    assert np.array_equal(cached_trace(m, "calibrated", 7, 5, 6, 3, make).experts, first.experts)
    monkeypatch.setenv("KLOTSKI_CACHE_DIR", str(tmp_path))
    for f in (tmp_path / "traces").glob("*.npz"):  # its folder is there, the file's place is taken: the write fails
        f.unlink()
        f.mkdir()
    assert np.array_equal(cached_trace(m, "calibrated", 7, 5, 6, 3, make).experts, first.experts)
    assert len(calls) == 6 and [f.is_dir() for f in (tmp_path / "traces").iterdir()] == [True]


def test_trace_cache_keeps_the_recently_used_within_its_cap_and_refuses_a_bad_cap(tmp_path, monkeypatch):
    """The cache is bounded (KLOTSKI_CACHE_MAX_GB): the least recently used traces go first, a
    trace larger than the cap is not kept, a bad cap is one clear error naming the variable."""
    import os
    import time

    from klotski_sim.util.errors import UsageError
    from klotski_sim.workload.trace_cache import cached_trace

    monkeypatch.setenv("KLOTSKI_CACHE_DIR", str(tmp_path))
    m = get_model("tiny-mixtral")
    folder = tmp_path / "traces"

    def get(seed):
        return cached_trace(m, "calibrated", seed, 5, 6, 3, lambda: synthesize(m, 5, 6, 3, "calibrated", seed))

    first = get(1)
    assert first.experts.dtype == np.uint8 and np.array_equal(get(1).experts, first.experts)  # (a byte, on disk too)
    size = next(folder.glob("*.npz")).stat().st_size
    monkeypatch.setenv("KLOTSKI_CACHE_MAX_GB", str(2.5 * size / 2**30))  # room for two traces
    for seed in (2, 3):
        time.sleep(0.01)  # (distinct modification times)
        get(seed)
    kept = {f.stat().st_mtime for f in folder.glob("*.npz")}
    assert len(kept) == 2 and sum(f.stat().st_size for f in folder.glob("*.npz")) <= 2.5 * size
    time.sleep(0.01)
    get(2)  # used again: now the most recent
    time.sleep(0.01)
    get(4)  # evicts 3, the least recently used, and keeps 2
    names = set(folder.glob("*.npz"))
    assert len(names) == 2 and max(os.path.getmtime(f) for f in names) > max(kept)
    calls = []
    cached_trace(m, "calibrated", 2, 5, 6, 3, lambda: calls.append(1) or synthesize(m, 5, 6, 3, "calibrated", 2))
    assert calls == []  # (2 was kept)
    mine = folder / "my_important_trace.npz"  # a user's own file where the cache keeps its traces
    mine.write_bytes(b"not the cache's")
    os.utime(mine, (0, 0))  # (the least recently used of all)
    monkeypatch.setenv("KLOTSKI_CACHE_MAX_GB", "0")
    get(5)
    # larger than the cap: not kept; a cap of 0 keeps none of the cache's traces, and deletes nothing else
    assert list(folder.glob("*.npz")) == [mine] and mine.read_bytes() == b"not the cache's"
    for bad in ("lots", "-1", "inf", "nan"):
        monkeypatch.setenv("KLOTSKI_CACHE_MAX_GB", bad)
        with pytest.raises(UsageError, match="KLOTSKI_CACHE_MAX_GB"):
            get(6)


def test_mutual_information_is_reported_against_a_shuffled_baseline():
    from klotski_sim.workload.model import get_model
    from klotski_sim.workload.trace_stats import layer_stats
    from klotski_sim.workload.trace_synth import synthesize

    uniform = layer_stats(synthesize(get_model("mixtral-8x7b"), 40, 32, 8, "uniform", 0))
    assert uniform["mi_next_bits"].mean() > 0.01  # the plug-in estimate reads information that is not there
    assert abs(uniform["mi_next_excess_bits"].mean()) < 0.005  # the baseline removes it


def test_one_short_sequence_does_not_truncate_the_groups():
    import numpy as np

    from klotski_sim.workload.trace import Trace
    from klotski_sim.workload.trace_stats import layer_stats

    rng = np.random.default_rng(0)
    lengths = [20] * 16 + [2]
    experts = rng.integers(0, 8, size=(sum(lengths), 4, 2)).astype(np.int16)
    experts[:, :, 1] = (experts[:, :, 0] + 1) % 8
    offsets = np.concatenate([[0], np.cumsum(lengths)])
    meta = {"model": "x", "num_experts": 8, "top_k": 2, "num_layers": 4}
    with_short = Trace(experts, offsets, np.full(17, 2, dtype=np.int32), meta)
    without = Trace(experts[: 16 * 20], offsets[:17], np.full(16, 2, dtype=np.int32), meta)
    a, b = layer_stats(with_short), layer_stats(without)
    assert np.allclose(a["hot_share_n1"], b["hot_share_n1"]) and np.allclose(a["active_n1"], b["active_n1"])


def test_prompt_and_generated_tokens_are_measured_apart(tmp_path):
    from klotski_sim.workload.model import get_model
    from klotski_sim.workload.trace_stats import token_subset
    from klotski_sim.workload.trace_synth import synthesize

    trace = synthesize(get_model("tiny-mixtral"), 6, 10, 5, "calibrated", 0)
    prompt, generated = token_subset(trace, "prompt"), token_subset(trace, "generated")
    assert len(prompt.experts) + len(generated.experts) == len(trace.experts)
    assert (prompt.lengths == 10).all() and (generated.prompt_lens == 0).all()
    path = tmp_path / "t.npz"
    trace.save(path)
    code, out, err = run_cli("trace", "stats", str(path), "--tokens", "generated")
    assert code == 0 and "tokens: generated only" in out and "not measured — a group of n = 1" in out
    code, out, err = run_cli("trace", "stats", str(path), "--tokens", "decode")
    assert code == 2 and err.count("\n") == 1


def _log(tmp_path, records):
    path = tmp_path / "log.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in records) + "\n")
    return path


def test_sequence_ids_of_two_datasets_never_merge(tmp_path):
    records = [
        {"dataset": d, "seq_id": s, "token_idx": t, "layer": layer_, "experts": [0, 1]}
        for d in ("a", "b")
        for s in (0, 1)
        for t in range(3)
        for layer_ in range(2)
    ]
    trace, problems = import_jsonl(_log(tmp_path, records))
    assert trace.num_sequences == 4 and not problems
    assert trace.meta["sequence_key"] == ["dataset", "sequence id"]
    merged = [dict(r, shard=r.pop("dataset")) for r in records]  # another field name: say which with --key
    assert import_jsonl(_log(tmp_path, merged), key_fields=("shard",))[0].num_sequences == 4
    with pytest.raises(TraceError, match=r"log.jsonl:1: key field 'corpus'"):
        import_jsonl(_log(tmp_path, merged), key_fields=("corpus",))


def test_holes_cut_or_keep_the_longest_complete_run(tmp_path):
    records = [
        {"seq_id": 0, "token_idx": t, "layer": layer_, "experts": [0, 1], "prompt_len": 4}
        for t in range(10)
        for layer_ in range(2)
        if not (t == 2 and layer_ == 1)
    ]
    cut, problems = import_jsonl(_log(tmp_path, records))
    assert cut.lengths.tolist() == [2] and "first at token 2 layer 1" in problems[0] and "log.jsonl:1:" in problems[0]
    longest, problems = import_jsonl(_log(tmp_path, records), holes="longest")
    assert longest.lengths.tolist() == [7] and "tokens 3-9" in problems[0]
    assert longest.prompt_lens.tolist() == [1]  # tokens 3..9: one of them was prompt


def test_provenance_flags_and_late_errors_name_the_line(tmp_path):
    records = [{"seq_id": 0, "token_idx": t, "layer": 0, "experts": [t + 1, 0]} for t in range(3)]
    path = _log(tmp_path, records)
    code, out, err = run_cli(
        "trace",
        "import",
        str(path),
        "--source",
        "vLLM --enable-return-routed-experts",
        "--license",
        "CC-BY-4.0",
        "--dataset",
        "ShareGPT",
        "--out",
        str(tmp_path / "t.npz"),
    )
    assert code == 0, err
    meta = Trace.load(tmp_path / "t.npz").meta
    assert (meta["source"], meta["license"], meta["dataset"]) == (
        "vLLM --enable-return-routed-experts",
        "CC-BY-4.0",
        "ShareGPT",
    )
    with pytest.raises(TraceError, match=r"log.jsonl:3: expert id 3 is out of range for --num-experts 3"):
        import_jsonl(path, num_experts=3)


IMPORT_REFUSALS = [
    (
        [{"seq_id": 0, "token_idx": 0, "layer": 0, "experts": [1, 2], "gating_probs": [float("nan"), 0.5]}],
        "log.jsonl:1: gate weights must be a list of numbers from 0 to 65504.0",
    ),
    ([{"seq_id": 0, "token_idx": 0, "layer": 0, "experts": [1, 2], "gating_probs": [-0.5, 1.5]}], "from 0 to 65504.0"),
    (
        [{"seq_id": 0, "token_idx": 0, "layer": 0, "experts": [1, 2], "gating_probs": [1e6, 0.5]}],  # (inf in float16)
        "log.jsonl:1: gate weights must be a list of numbers from 0 to 65504.0 (stored as float16)",
    ),
    (
        [
            {"seq_id": 0, "token_idx": 0, "layer": 0, "experts": [1, 2]},
            {"seq_id": 0, "token_idx": 1, "layer": 0, "experts": [3, 3]},
        ],
        "log.jsonl:2: the token selects an expert twice ([3, 3]); a router's top-k experts are distinct",
    ),
    (
        [{"seq_id": 0, "token_idx": t, "layer": 0, "experts": [1, 2], "prompt_len": 100} for t in range(3)],
        "has prompt_len 100 but only 3 tokens",
    ),
    (
        [{"seq_id": 0, "token_idx": t, "layer": 0, "experts": [1, 2], "prompt_len": 2 + t} for t in range(3)],
        "prompt_len 3 for sequence 0, whose earlier records said 2",
    ),
    ('{"seq_id": 0, "seq_id": 1, "token_idx": 0, "layer": 0, "experts": [1, 2]}', "key 'seq_id' is given twice"),
]


def test_gate_weights_missing_from_some_records_are_dropped_with_a_warning(tmp_path):
    records = [
        {"seq_id": 0, "token_idx": t, "layer": 0, "experts": [1, 2], "gating_probs": [0.6, 0.4]} for t in range(3)
    ]
    del records[1]["gating_probs"]
    (tmp_path / "log.jsonl").write_text("\n".join(json.dumps(r) for r in records) + "\n")
    trace, problems = import_jsonl(tmp_path / "log.jsonl", num_experts=4)
    assert trace.weights is None and problems == [
        f"{tmp_path / 'log.jsonl'}: 1 of 3 records have no gate weights; the trace keeps none"
    ]


@pytest.mark.parametrize("records,message", IMPORT_REFUSALS)
def test_an_imported_log_is_taken_as_written_or_refused_by_line(tmp_path, records, message):
    """NaN or negative gate probabilities were stored, a prompt longer than its sequence was
    clipped, a sequence's two prompt lengths resolved silently, a repeated key kept its last value."""
    text = records if isinstance(records, str) else "\n".join(json.dumps(r) for r in records)
    (tmp_path / "log.jsonl").write_text(text + "\n")
    with pytest.raises(TraceError, match=re.escape(message)):
        import_jsonl(tmp_path / "log.jsonl", num_experts=4)


@pytest.mark.parametrize("top_k", [3, 4, 8, 9])
def test_a_single_repeat_in_any_pair_of_slots_of_any_token_is_found(top_k):
    """Every pair of slots, in the first, a middle and the last token, in passes of 3 rows."""
    from klotski_sim.workload import routing

    distinct = np.tile(np.arange(top_k), (7, 2, 1))  # [tokens, layers, k]: no repeat
    with patch.object(routing, "_REPEAT_ROWS", 3):
        assert not routing.repeats_an_expert(distinct)
        for token in (0, 3, 6):
            for i in range(top_k):
                for j in range(i + 1, top_k):
                    ids = distinct.copy()
                    ids[token, 1, j] = ids[token, 1, i]
                    assert routing.repeats_an_expert(ids), (token, i, j)


@given(st.integers(1, 10), st.integers(0, 6), st.integers(1, 12), st.integers(1, 5), st.integers(0, 2**32 - 1))
def test_a_repeated_expert_is_found_as_token_by_token_would_find_it(top_k, tokens, experts, rows_per_pass, seed):
    """`routing.repeats_an_expert` (traces and routing tables share it) answers as a set per token would:
    slots compared pair by pair up to top-8 (in passes of any number of rows), sorted above."""
    from klotski_sim.workload import routing

    rng = np.random.default_rng(seed)
    ids = rng.integers(0, experts, (tokens, 2, top_k))
    if experts >= top_k and rng.random() < 0.5:  # (distinct ids but, perhaps, one token's)
        ids = np.argsort(rng.random((tokens, 2, experts)), axis=-1)[..., :top_k]
        if tokens and rng.random() < 0.5:
            token, layer = rng.integers(tokens), rng.integers(2)
            ids[token, layer, rng.integers(top_k)] = ids[token, layer, rng.integers(top_k)]
    expected = any(len(set(row)) < top_k for row in ids.reshape(-1, top_k).tolist())
    with patch.object(routing, "_REPEAT_ROWS", rows_per_pass):
        assert routing.repeats_an_expert(ids) == expected


@pytest.mark.parametrize("setting", ["off", " off", "OFF\n"])
def test_the_trace_cache_is_off_however_it_is_spelt(monkeypatch, setting):
    from klotski_sim.files.disk_cache import cache_dir

    monkeypatch.setenv("KLOTSKI_CACHE_DIR", setting)
    assert cache_dir() is None  # (" off" was a folder named " off")


@pytest.mark.parametrize("model", [None, ["tiny-mixtral"], 3])
def test_a_trace_whose_meta_model_is_no_name_is_refused(tmp_path, model):
    """(A fuzz of trace files: a model of null or a list was accepted, though a missing one is not.)"""
    t = _tiny_trace()
    Trace(t.experts, t.seq_offsets, t.prompt_lens, {**t.meta, "model": "tiny-mixtral"})  # (a name: fine)
    with pytest.raises(TraceError, match="meta model must be a model's name"):
        Trace(t.experts, t.seq_offsets, t.prompt_lens, {**t.meta, "model": model})


@settings(max_examples=60, deadline=None)
@given(
    count=st.integers(5, 9),
    experts=st.sampled_from([10, 16, 64, 129, 256]),
    spread=st.sampled_from([2, 8, 1000, 0]),
    rows=st.integers(1, 300),
    seed=st.integers(0, 2**32),
)
def test_the_generators_top_k_by_argmax_passes_is_its_partition_and_sort_ties_and_all(
    count, experts, spread, rows, seed
):
    """Over many experts the generator picks a token's top-5 and more by argmax passes, and a row
    with a tie among its largest by the partition and sort it drew with before (as it still does
    over fewer experts; here the passes are asked of every width): the same indices in the same
    order for every row, whether its values are all distinct (`spread` 0: random floats), few
    (`spread` 2: nearly every row tied) or some of each, so every draw is as it was."""
    from klotski_sim.workload import trace_synth

    rng = np.random.default_rng(seed)
    values = (
        rng.integers(0, spread, (rows, 2, experts)).astype(np.float32)
        if spread
        else rng.standard_normal((rows, 2, experts)).astype(np.float32)
    )
    expected = trace_synth._partition_sorted(values.copy(), count)
    with patch.object(trace_synth, "_PARTITION_UP_TO", 0):
        assert np.array_equal(trace_synth._top_sorted(values.copy(), count), expected)
    assert np.array_equal(trace_synth._top_sorted(values.copy(), count), expected)
    ranked = np.take_along_axis(values, expected, axis=-1)
    assert np.all(ranked[..., :-1] >= ranked[..., 1:])  # (largest first: the reference is a top-k at all)
    assert np.all(ranked[..., -1] >= np.sort(values, axis=-1)[..., -count])


@settings(max_examples=15, deadline=None)
@given(
    model=st.sampled_from(["tiny-mixtral", "olmoe-1b-7b"]),
    threads=st.integers(2, 5),
    chunk=st.sampled_from([1, 2, 3]),
    sequences=st.integers(1, 9),
    seed=st.integers(0, 2**32),
)
def test_a_draw_in_threads_is_the_draw_of_one(model, threads, chunk, sequences, seed):
    """Chunks drawn by several threads at once read each random stream chunk after chunk: the
    same ids and weights as one thread draws, block by block, in order."""
    spec = get_model(model)

    def blocks(count):
        stream = synthesized_blocks(spec, sequences, 5, 2, "calibrated", seed=seed, with_weights=True, chunk=chunk)
        return list(stream.drawn(threads=count))

    alone, together = blocks(1), blocks(threads)
    assert len(alone) == len(together) == -(-sequences // chunk)
    for (ids, weights), (ids_t, weights_t) in zip(alone, together):
        assert np.array_equal(ids, ids_t) and np.array_equal(weights, weights_t)


def _within(seconds, work):
    """`work()`'s result or error, failing the test if it has not ended after `seconds` (a hang)."""
    import threading

    out = {}

    def run():
        try:
            out["result"] = work()
        except BaseException as err:  # noqa: BLE001 - handed to the test
            out["error"] = err

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(seconds)
    assert not thread.is_alive(), f"still running after {seconds} s"
    if "error" in out:
        raise out["error"]
    return out["result"]


def test_a_draw_that_fails_in_a_thread_says_its_error_and_leaves_no_thread_waiting():
    """A chunk that fails (here the third top-k of the draw) ends the draw with its own error, not
    a hang of the chunks that wait for the turns it will never pass on; a draw stopped after its
    first block leaves no thread behind either."""
    import threading

    from klotski_sim.workload import trace_synth

    spec = get_model("olmoe-1b-7b")
    real, calls = trace_synth._top_sorted, []

    def failing(values, count):
        calls.append(count)
        if len(calls) == 3:
            raise MemoryError("no room for the third layer")
        return real(values, count)

    before = threading.active_count()
    with patch.object(trace_synth, "_top_sorted", failing):
        stream = synthesized_blocks(spec, 6, 4, 1, "calibrated", seed=1, chunk=1)
        with pytest.raises(MemoryError, match="third layer"):
            _within(60, lambda: list(stream.drawn(threads=3)))
    stream = synthesized_blocks(spec, 12, 4, 1, "calibrated", seed=1, chunk=1)
    blocks = stream.drawn(threads=3)
    first = _within(60, lambda: next(blocks))
    _within(60, blocks.close)
    assert threading.active_count() == before
    assert np.array_equal(first[0], synthesize(spec, 1, 4, 1, "calibrated", seed=1).experts)


def test_a_draw_uses_the_cores_its_pool_leaves_it_and_the_memory_its_chunks_allow():
    """A draw's threads: the process's cores, shared with the other workers of its pool (a sweep's
    two workers on two cores draw with one thread each), at most MAX_DRAW_THREADS, and no more
    chunks' working arrays at once than _ELEMENTS_IN_FLIGHT (a long prompt's chunk is one sequence
    of tokens x experts: DeepSeek-V3 at 16k tokens in two threads, at 32k in one)."""
    from klotski_sim.util import run_size
    from klotski_sim.workload import trace_synth

    budget = trace_synth._ELEMENTS_IN_FLIGHT
    default_chunk = trace_synth._ELEMENTS_PER_CHUNK
    for cores, workers, elements, expected in [
        (2, 1, default_chunk, 2),
        (2, 2, default_chunk, 1),
        (1, 1, default_chunk, 1),
        (16, 1, default_chunk, trace_synth.MAX_DRAW_THREADS),
        (16, 8, default_chunk, 2),
        (3, 4, default_chunk, 1),
        (16, 1, 16386 * 256, 2),
        (16, 1, 32770 * 256, 1),
        (16, 1, budget // 3, 3),
        (2, 1, budget + 1, 1),
    ]:
        with (
            patch.object(trace_synth, "available_cores", return_value=cores),
            patch.object(run_size, "sharing", return_value=workers),
        ):
            assert trace_synth.draw_threads(elements) == expected, (cores, workers, elements)
    # a drawn chunk asks for the threads its own size allows
    seen = []
    real = trace_synth.draw_threads
    with patch.object(
        trace_synth, "draw_threads", side_effect=lambda elements: seen.append(elements) or real(elements)
    ):
        synthesize(get_model("olmoe-1b-7b"), 3, 99, 1, "calibrated", seed=3)
    assert seen == [min(64, default_chunk // (100 * 64)) * 100 * 64]


def test_a_key_given_twice_in_a_traces_meta_is_refused(tmp_path):
    """`num_experts` given twice, 4 then 8: the trace was read with 8 experts (JSON keeps the last)."""
    path = tmp_path / "t.npz"
    synthesize(get_model("tiny-mixtral"), 3, 4, 2, "calibrated", 0).save(path)
    with np.load(path) as z:
        arrays = dict(z)
    meta = str(arrays["meta"])
    arrays["meta"] = np.array(meta[:-1] + ', "num_experts": 8}')
    np.savez(path, **arrays)
    with pytest.raises(TraceError, match=r"t.npz: its meta's key 'num_experts' is given twice \(JSON would keep"):
        Trace.load(path)


def test_import_with_a_model_takes_its_expert_count_when_the_log_never_uses_its_highest_id(tmp_path):
    """A tiny-mixtral log of experts 0-2 was refused as "another shape (3 experts vs 4)": the count
    was the largest id + 1 even with --model given."""
    from .conftest import run_cli

    log = tmp_path / "lo.jsonl"
    log.write_text(
        "".join(
            json.dumps(
                {"seq_id": s, "token_idx": t, "layer": layer, "experts": [0, 1 + (t + layer) % 2], "prompt_len": 2}
            )
            + "\n"
            for s in range(2)
            for t in range(4)
            for layer in range(2)
        )
    )
    rc, out, err = run_cli("trace", "import", str(log), "--model", "tiny-mixtral", "--out", str(tmp_path / "t.npz"))
    assert rc == 0 and "top-2 of 4 experts" in out, err
    assert Trace.load(tmp_path / "t.npz").num_experts == 4
    rc, out, err = run_cli("trace", "import", str(log), "--out", str(tmp_path / "u.npz"))  # (no model: the ids')
    assert rc == 0 and "top-2 of 3 experts" in out, err


def test_a_trace_recorded_for_another_model_of_the_same_shape_is_said_so(tmp_path):
    """A tiny-olmoe trace replayed on tiny-qwen3-moe (same experts, top-k and layers) ran without a
    word; now the routing's source says so and the CLI warns. A version of the model itself (`:L`
    layers, `@int4` experts) routes as it does: nothing said."""
    from klotski_sim.workload.routing import RunShape

    from .conftest import run_cli

    olmoe, qwen = get_model("tiny-olmoe"), get_model("tiny-qwen3-moe")
    assert (olmoe.num_experts, olmoe.top_k, olmoe.num_layers) == (qwen.num_experts, qwen.top_k, qwen.num_layers)
    trace = synthesize(olmoe, 12, 6, 3, "calibrated", 0)  # (the CLI keeps 8 for warm-up)
    shape = RunShape(2, 2, 6, 3)
    assert (
        "ANOTHER MODEL: recorded for 'tiny-olmoe', replayed on 'tiny-qwen3-moe'"
        in replay(trace, qwen, shape).routing.source
    )
    assert "ANOTHER MODEL" not in replay(trace, olmoe, shape).routing.source
    assert "ANOTHER MODEL" not in replay(trace, get_model("tiny-olmoe@int4"), shape).routing.source
    trace.save(tmp_path / "o.npz")
    rc, _, err = run_cli(
        "simulate",
        "--model",
        "tiny-qwen3-moe",
        "--trace",
        str(tmp_path / "o.npz"),
        "--prompt-len",
        "6",
        "--gen-len",
        "3",
        "--batch-size",
        "2",
        "--num-batches",
        "2",
    )
    assert rc == 0 and err == (
        "warning: ANOTHER MODEL: recorded for 'tiny-olmoe', replayed on 'tiny-qwen3-moe' of "
        "the same shape: the routing is not this model's\n"
    ), err


def test_trace_synth_says_a_long_draw_before_it_begins(tmp_path, monkeypatch, capsys):
    """100M sequences of a tiny model drew for some 15 minutes without a word (the estimate left out
    the cost a sequence: many short ones)."""
    from klotski_sim.cli import main as cli
    from klotski_sim.cli import traces

    drawn = []
    monkeypatch.setattr("klotski_sim.util.machine._slowdown", [1.0])  # (the reference machine's speed: fixed figures)
    monkeypatch.setattr(
        traces, "synthesize", lambda m, *a, **k: drawn.append(a) or synthesize(m, 2, 4, 2, "uniform", 0)
    )
    assert (
        cli.main(
            [
                "trace",
                "synth",
                "--model",
                "tiny-mixtral",
                "--sequences",
                "100000000",
                "--prompt-len",
                "8",
                "--gen-len",
                "3",
                "--out",
                str(tmp_path / "t.npz"),
            ]
        )
        == 0
    )
    err = capsys.readouterr().err
    assert (
        err
        == (
            "note: drawing 100,000,000 sequences x 11 tokens of tiny-mixtral's routing: about 13.7 min on "
            "this machine as loaded now\n"
        )
        and drawn
    )
    assert (
        cli.main(
            [
                "trace",
                "synth",
                "--model",
                "tiny-mixtral",
                "--sequences",
                "100",
                "--prompt-len",
                "8",
                "--gen-len",
                "3",
                "--out",
                str(tmp_path / "t.npz"),
            ]
        )
        == 0
    )
    assert capsys.readouterr().err == ""  # (a short draw: nothing said)


def test_a_log_of_a_model_with_dense_first_layers_imports_with_them_filled(tmp_path):
    """A DeepSeek log has no router records for its dense first layer: every token was a hole at
    layer 0, and the import failed with "no sequence has a complete first token", the warnings that
    said why unprinted. With --model, the dense layers are filled (their routing is never read); the
    refusal without it says where the first hole is."""
    from .conftest import run_cli

    model = get_model("deepseek-v2-lite")
    assert model.first_dense_layers == 1
    log = tmp_path / "ds.jsonl"
    log.write_text(
        "".join(
            json.dumps(
                {
                    "seq_id": s,
                    "token_idx": t,
                    "layer": layer,
                    "prompt_len": 2,
                    "experts": [(t + layer + k) % 64 for k in range(model.top_k)],
                }
            )
            + "\n"
            for s in range(2)
            for t in range(4)
            for layer in range(1, model.num_layers)
        )
    )
    rc, out, err = run_cli("trace", "import", str(log), "--model", "deepseek-v2-lite", "--out", str(tmp_path / "d.npz"))
    assert rc == 0 and "2 sequences, 8 tokens, 27 layers, top-6 of 64 experts" in out and not err, err
    trace = Trace.load(tmp_path / "d.npz")
    assert trace.meta["dense_layers_filled"] == [0] and (trace.experts[:, 0] == np.arange(6)).all()
    assert (
        trace.experts[:, 1:]
        == np.array(
            [[[(t + layer + k) % 64 for k in range(6)] for layer in range(1, 27)] for _ in range(2) for t in range(4)]
        )
    ).all()
    rc, out, err = run_cli("trace", "import", str(log), "--out", str(tmp_path / "e.npz"))  # (no model: no dense layers)
    assert rc == 2 and err.endswith(
        "no sequence has a complete first token (sequence 0: 4 missing (token, layer) "
        "entries, first at token 0 layer 0; kept its first 0 tokens)\n"
    ), err
