import json
import re

import pytest
from hypothesis import given
from hypothesis import strategies as st

from klotski_sim.core.schedule import (
    Op,
    Schedule,
    ScheduleBuilder,
    ScheduleError,
    compute_op,
    dep_positions,
    transfer_op,
)


def c(op_id, deps=(), stream="compute", **kw):
    return Op(op_id, "compute", stream, kw.pop("category", "attention"), tuple(deps), **kw)


def t(op_id, deps=(), stream="h2d_weights", nbytes=10, **kw):
    return Op(
        op_id, "transfer", stream, kw.pop("category", "weights"), tuple(deps), bytes=nbytes, src="cpu", dst="gpu", **kw
    )


def test_valid_schedule_roundtrips_json(tmp_path):
    s = Schedule(
        (t("w", alloc=(("w", 10),)), c("a", ["w"], free=("w",), step=0, layer=1, batches=(0, 1))), meta={"policy": "x"}
    )
    path = tmp_path / "s.json"
    s.save(path)
    back = Schedule.load(path)
    assert back.ops == s.ops and dict(back.meta) == {"policy": "x"}
    assert back.op("a").batches == (0, 1) and back.op("a").batch == -1


@pytest.mark.parametrize("ops_per_piece", [1, 2, 3, 1000])
def test_saved_text_is_the_compact_json_of_the_schedule_in_any_pieces(tmp_path, ops_per_piece):
    """save writes, piece by piece, exactly the compact JSON of to_json_dict: every kind of field,
    text that JSON escapes, and the pieces' seams wherever they fall."""
    ops = (
        t('w\u00e9"', alloc=(("w", 10), ("x", 3)), pageable=True, tensor="expert", layer=2),
        c("a", ['w\u00e9"'], free=("w", "x"), step=0, layer=1, batches=(0, 1), tokens=7, variant="eager"),
        Op("h", "host", "host", "sync", ("a",)),
    )
    s = Schedule(ops, preloaded=(("emb", 5),), meta={"policy": "x", "ratio": 0.1, "nested": {"k": [1, "\u2603"]}})
    expected = json.dumps(s.to_json_dict(), separators=(",", ":"))
    assert "".join(s.json_pieces(ops_per_piece)) == expected
    s.save(tmp_path / "s.json")
    assert (tmp_path / "s.json").read_bytes() == expected.encode("ascii")
    assert Schedule.load(tmp_path / "s.json").ops == ops
    empty = Schedule((), meta={"policy": "none"})
    assert "".join(empty.json_pieces(ops_per_piece)) == json.dumps(empty.to_json_dict(), separators=(",", ":"))


def test_an_op_dict_leaves_out_its_defaults_and_lists_its_tuples():
    op = t("w", alloc=(("w", 10),), layer=0)
    assert op.to_dict() == {
        "id": "w",
        "kind": "transfer",
        "stream": "h2d_weights",
        "category": "weights",
        "bytes": 10,
        "src": "cpu",
        "dst": "gpu",
        "layer": 0,
        "alloc": [["w", 10]],
    }
    assert Op.from_dict(op.to_dict()) == op


def test_a_column_is_one_field_of_every_op_and_is_made_once():
    ops = (t("w", alloc=(("w", 10),)), c("a", ["w"], free=("w",), step=3), Op("h", "host", "host", "sync", ("a",)))
    s = Schedule(ops)
    # (what the check read, and what a timeline's summary reads: taken in the check's pass)
    assert set(s.kept_columns()) == {"stream", "alloc", "free", "category", "step", "layer", "batches"}
    for name in Op._fields:
        assert s.column(name) == [getattr(op, name) for op in ops]
    assert s.column("stream") is s.column("stream")  # (kept: the check made it, the engine reads it again)
    assert s.column("free") == [(), ("w",), ()]


def test_unknown_dep_names_op():
    with pytest.raises(ScheduleError, match="'a' depends on unknown op 'ghost'"):
        Schedule((c("a", ["ghost"]),))


def _copy(text: str) -> str:
    """An equal string that is another object (what JSON reading gives a dep)."""
    return "".join(list(text)) if len(text) > 1 else text  # (CPython keeps one object per 1-char string)


@given(
    st.lists(st.text(min_size=1, max_size=4), min_size=1, max_size=30, unique=True).flatmap(
        lambda ids: st.tuples(
            st.just(ids),
            st.lists(
                st.lists(st.tuples(st.sampled_from(ids), st.booleans()), max_size=4),
                min_size=len(ids),
                max_size=len(ids),
            ),
        )
    )
)
def test_a_dep_is_found_at_its_ops_position_whether_it_is_the_ids_object_or_an_equal_string(case):
    ids, picks = case
    deps = [tuple(dep if same else _copy(dep) for dep, same in row) for row in picks]
    expected = [ids.index(dep) for row in deps for dep in row]
    assert dep_positions(ids, deps, len(expected)).tolist() == expected


def test_a_dep_on_no_op_is_a_key_error_for_dep_positions():
    with pytest.raises(KeyError):
        dep_positions(["a", "b"], [(), ("a", _copy("ghost"))], 2)


class _OneHash(str):
    """An id whose hash every other shares."""

    def __hash__(self) -> int:
        return 7


def test_deps_are_matched_by_equal_ids_whatever_their_hashes():
    """Ids of one hash: a dep is found at the position of the id equal to it, not of one of its hash;
    and a dep equal to no id is still a KeyError."""
    ids = [_OneHash(name) for name in ("a", "bb", "ccc")]
    deps = [(), (_OneHash("ccc"), _OneHash("a")), (_OneHash("bb"),)]
    assert dep_positions(ids, deps, 3).tolist() == [2, 0, 1]
    with pytest.raises(KeyError):
        dep_positions(ids, [(_OneHash("dddd"),), (), ()], 1)


def test_a_built_schedule_and_its_json_copy_have_one_graph(tmp_path):
    """The built ops' deps are their ids' very objects, the loaded ones equal strings: one graph."""
    b = ScheduleBuilder()
    w = b.transfer("w", "weights", "h2d_weights", 10, "cpu", "gpu", alloc=(("w", 10),))
    a = b.compute("a", "attention", [w])
    b.host_wait("a/sync", "sync", [a])
    b.compute("e", "expert", [a, w], free=("w",))
    built = b.build({})
    built.save(tmp_path / "s.json")
    assert Schedule.load(tmp_path / "s.json").graph == built.graph


def test_duplicate_id():
    with pytest.raises(ScheduleError, match="duplicate op id 'a'"):
        Schedule((c("a"), c("a")))


def test_dep_contradicting_stream_order():
    with pytest.raises(ScheduleError, match="contradicts stream order"):
        Schedule((c("a", ["b"]), c("b")))


def test_cross_stream_cycle_is_named():
    # a (compute) waits for y; y (h2d) follows x on its stream; x waits for b; b follows a.
    ops = (c("a", ["y"]), t("x", ["b"]), t("y"), c("b"))
    with pytest.raises(ScheduleError, match="cycle") as err:
        Schedule(ops)
    assert "a" in str(err.value) and "y" in str(err.value)


@pytest.mark.parametrize(
    "op,msg",
    [
        (t("z", nbytes=0), "positive number of bytes"),
        (c("n", flops=-1), "flops must be >= 0"),
        (Op("k", "teleport", "compute", "x"), "kind 'teleport'"),
        (c("s", stream="nowhere"), "stream 'nowhere' is not declared"),
        (Op("q", "transfer", "h2d_weights", "w", bytes=5, src="cpu", dst="cpu"), "distinct src/dst"),
        (Op("r", "compute", "h2d_weights", "w"), "compute op placed on pcie_h2d"),
        # (a copy remapped to another link was run and timed there: unemulated on nvme, labelled a disk read)
        (
            Op("e", "transfer", "disk_read", "hot_expert", bytes=5, src="cpu", dst="gpu"),
            "op 'e': a cpu -> gpu copy placed on stream 'disk_read', which maps to nvme: that link carries disk -> cpu",
        ),
        (
            Op("k", "transfer", "d2h_kv", "kv", bytes=5, src="cpu", dst="gpu"),
            "which maps to pcie_d2h: that link carries gpu",
        ),
        (Op("g", "transfer", "h2d_weights", "w", bytes=5, src="disk", dst="gpu"), "a disk -> gpu copy placed on"),
    ],
)
def test_bad_ops_are_rejected(op, msg):
    with pytest.raises(ScheduleError, match=msg):
        Schedule((op,))


def test_memory_effects_are_checked():
    with pytest.raises(ScheduleError, match="frees buffer 'nope'"):
        Schedule((c("a", free=("nope",)),))
    with pytest.raises(ScheduleError, match="already allocated"):
        Schedule((c("a", alloc=(("b", 1),)), c("b", alloc=(("b", 1),))))
    with pytest.raises(ScheduleError, match="op 'c' frees buffer 'x', which op 'b' frees too"):
        Schedule((c("a", alloc=(("x", 1),)), c("b", ["a"], free=("x",)), c("c", ["a"], free=("x",))))


def test_a_key_given_twice_in_a_schedule_file_is_refused(tmp_path):
    """JSON keeps the last: `"ops"` given twice, the second empty, was a schedule of no ops; a
    `"category"` given twice sent the check's message to another field."""
    path = tmp_path / "s.json"
    Schedule((c("a"),)).save(path)
    text = path.read_text()
    path.write_text(text[:-1] + ',"ops":[]}')
    with pytest.raises(ScheduleError, match=r"s.json: key 'ops' is given twice in one JSON object \(JSON would keep"):
        Schedule.load(path)
    path.write_text(text.replace('"category":', '"category":"x","category":', 1))
    with pytest.raises(ScheduleError, match="key 'category' is given twice"):
        Schedule.load(path)


def test_corrupt_json_gives_clear_error(tmp_path):
    path = tmp_path / "s.json"
    Schedule((c("a"),)).save(path)
    path.write_text(path.read_text()[:-7])
    with pytest.raises(ScheduleError, match="truncated or corrupt"):
        Schedule.load(path)
    for text, found in (('{"hello": 1}', "no format key"), ("[1]", "a JSON list"), ('{"format": "x"}', "format 'x'")):
        path.write_text(text)
        with pytest.raises(ScheduleError, match=f"not a klotski schedule \\({found}; expected format 'klotski-"):
            Schedule.load(path)
    path.write_text(
        json.dumps(
            {
                "format": "klotski-schedule",
                "version": 1,
                "streams": {"compute": "gpu"},
                "ops": [{"id": "a", "kind": "compute", "stream": "compute", "category": "x", "colour": "red"}],
            }
        )
    )
    with pytest.raises(ScheduleError, match="unknown field"):
        Schedule.load(path)
    good = {
        "format": "klotski-schedule",
        "version": 1,
        "streams": {"compute": "gpu"},
        "ops": [{"id": "a", "kind": "compute", "stream": "compute", "category": "x"}],
    }
    for bad, message in (
        ({**good, "version": True}, "version True"),
        ({**good, "colour": 1}, "unknown key"),
        ({**good, "preloaded": [["w", 1], ["w", 2]]}, "'w' is preloaded twice"),
    ):
        path.write_text(json.dumps(bad))
        with pytest.raises(ScheduleError, match=message):
            Schedule.load(path)
    path.write_bytes(b"\xff\xfe\x00 not text")
    with pytest.raises(ScheduleError, match="not a text file"):
        Schedule.load(path)
    path.write_text("[" * 200_000 + "]" * 200_000)
    with pytest.raises(ScheduleError, match="nested too deeply"):
        Schedule.load(path)


def test_builder_drops_none_deps_and_duplicates():
    b = ScheduleBuilder()
    w = b.transfer("w", "weights", "h2d_weights", 10, "cpu", "gpu")
    b.compute("a", "attention", [w, None, w])
    s = b.build({})
    assert s.op("a").deps == ("w",)
    b.compute("a", "attention")
    with pytest.raises(ScheduleError, match="duplicate op id 'a'"):  # reported when the schedule is built
        b.build({})


def test_a_positional_compute_op_is_the_op_keywords_build():
    """compute_op fills Op's fields by position (the policies' hot path): a field added to or moved in
    Op without compute_op would shift every value after it."""
    fast = compute_op(
        "x", "expert", ("d",), 1, 2, 3, "decode", 4, (5,), 6, 7, 8, (("a", 9),), ("b",), "fused", stream="cpu_compute"
    )
    assert fast == Op(
        "x",
        "compute",
        "cpu_compute",
        "expert",
        ("d",),
        flops=1,
        bytes=2,
        step=3,
        phase="decode",
        layer=4,
        batches=(5,),
        expert=6,
        tokens=7,
        kv_len=8,
        alloc=(("a", 9),),
        free=("b",),
        variant="fused",
    )
    assert type(fast) is Op and fast.tensor == "" and fast.pageable is False


def test_a_positional_transfer_op_is_the_op_keywords_build():
    """transfer_op, like compute_op, fills Op's fields by position (a policy's weight loads)."""
    fast = transfer_op(
        "x", "cold_expert", "h2d_experts", 5, "cpu", "gpu", ("d",), 3, 4, 6, "expert", True, (("x", 5),), ("v",)
    )
    assert fast == Op(
        "x",
        "transfer",
        "h2d_experts",
        "cold_expert",
        ("d",),
        bytes=5,
        src="cpu",
        dst="gpu",
        step=3,
        layer=4,
        expert=6,
        tensor="expert",
        pageable=True,
        alloc=(("x", 5),),
        free=("v",),
    )
    assert type(fast) is Op and fast.phase == "" and fast.batches == () and fast.variant == ""


def test_an_appended_op_waits_for_the_host_like_an_added_one():
    b = ScheduleBuilder()
    b.host_wait("sync", "sync", [])
    b.append(compute_op("a", "gate", (), 0, 0, 0, "decode", 0, (0,), -1, 1, 0, (), (), ""))
    b.append(compute_op("b", "gate", (), 0, 0, 0, "decode", 0, (0,), -1, 1, 0, (), (), ""))
    assert [op.deps for op in b.ops] == [(), ("sync",), ()]  # the stream's first op only


def test_what_a_gc_pause_leaves_alive_is_old_and_its_cycles_still_collected():
    import gc
    import weakref

    from klotski_sim.core.schedule import gc_paused

    class Node:
        pass

    was = gc.isenabled()
    gc.enable()
    try:
        with gc_paused():
            assert not gc.isenabled()
            kept = [(i, str(i)) for i in range(1000)]
            cycle = Node()
            cycle.me = cycle
            gone = weakref.ref(cycle)
            del cycle
        assert gc.isenabled()
        oldest = {id(o) for o in gc.get_objects(generation=2)}
        assert id(kept) in oldest and id(kept[-1]) in oldest  # promoted without a scan
        assert gone() is not None  # (a cycle: not freed by reference counting)
        gc.collect()
        assert gone() is None  # the next full collection still finds it
        with gc_paused():  # nested: the inner pause leaves the collector off
            with gc_paused():
                pass
            assert not gc.isenabled()
    finally:
        if not was:
            gc.disable()


@pytest.mark.parametrize(
    "key,value,message",
    [
        ("placement", None, "meta.placement must be a JSON object"),
        ("placement", {"resident_layers": "2"}, "meta.placement.resident_layers must be an integer >= 0"),
        ("generated_tokens", "12", "meta.generated_tokens must be an integer >= 0"),
        ("gen_len", -1, "meta.gen_len must be an integer >= 0"),
        ("batch_size", True, "meta.batch_size must be an integer >= 0"),
        ("model", 7, "meta.model must be a model preset's name"),
        ("policy", ["x"], "meta.policy must be a string"),
        ("resident_weights", [["expert", 0]], "meta.resident_weights must be a list of [tensor, layer, expert]"),
        ("resident_weights", "all", "meta.resident_weights must be a list of [tensor, layer, expert]"),
    ],
)
def test_schedule_meta_fields_the_tools_read_are_checked_when_loaded(key, value, message):
    """A hand-edited schedule file's meta of another type than the tools read it as: refused when
    the file is read (found by a fuzz of `klotski-runtime execute`: AttributeError, ValueError)."""
    good = {
        "policy": "x",
        "model": "tiny-mixtral",
        "batch_size": 2,
        "gen_len": 3,
        "generated_tokens": 12,
        "placement": {"resident_layers": 0},
        "resident_weights": [["expert", 0, 1]],
    }
    data = Schedule((t("w", alloc=(("w", 10),)), c("a", ["w"], free=("w",))), meta=good).to_json_dict()
    Schedule.from_json_dict(data, where="s.json")
    data["meta"] = {**data["meta"], key: value}
    with pytest.raises(ScheduleError, match=re.escape(message)):
        Schedule.from_json_dict(data, where="s.json")
    data["meta"] = {**data["meta"], "routing": None, "anything": [1, {"else": None}]}  # (free otherwise)
    data["meta"].pop(key)
    Schedule.from_json_dict(data, where="s.json")
