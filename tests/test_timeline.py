import gzip
import json
from fractions import Fraction

import numpy as np
import pandas as pd
import pytest
from hypothesis import given
from hypothesis import strategies as st

from klotski_sim.core.engine import simulate
from klotski_sim.core.schedule import Op, Schedule
from klotski_sim.report.exports import chrome_trace_json, read_parquet, save_all

from .conftest import make_profile


def _timeline_schedule():
    ops = (
        Op(
            "w0",
            "transfer",
            "h2d_weights",
            "weights",
            bytes=1,
            src="cpu",
            dst="gpu",
            alloc=(("w0", 10),),
            step=0,
            layer=0,
        ),
        Op("a0", "compute", "compute", "attention", ("w0",), step=0, layer=0, batches=(0,), free=("w0",)),
        Op("e0", "transfer", "h2d_experts", "moe_weights", bytes=1, src="cpu", dst="gpu", step=0, layer=0, expert=1),
        Op("x0", "compute", "compute", "expert", ("e0",), step=0, layer=0, batches=(0,), expert=1),
        Op("a1", "compute", "compute", "attention", (), step=1, layer=0, batches=(0,)),
    )
    return Schedule(ops, meta={"policy": "golden", "generated_tokens": 4})


def _timeline():
    return simulate(_timeline_schedule(), make_profile(), durations=[1, 1, 2, 1, 1])


def test_bubbles_are_attributed_to_the_op_that_ends_them():
    tl = _timeline()
    bub = tl.bubbles()
    # w0 [0,1], a0 [1,2], e0 [1,3], x0 [3,4], a1 [4,5]: gaps [0,1] is before the first GPU op (not a bubble)
    assert bub[["start", "end", "kind", "next_op", "cause"]].values.tolist() == [
        [2.0, 3.0, "intra", "x0", "moe_weights"]
    ]


def test_step_latency_and_throughput():
    tl = _timeline()
    lat = tl.step_latencies()
    assert lat.to_dict() == {0: 4.0, 1: 1.0}
    s = tl.summary()
    assert s.prefill_s == 4.0 and s.decode_step_s == 1.0
    assert s.throughput_tok_s == pytest.approx(4 / 5)


def test_a_timeline_read_back_from_its_csv_summarises_as_it_did(tmp_path):
    """pandas reads an op of no batch back as NaN, and a lone batch's "1" as the number 1.0: the
    per-step latencies (grouped by batches) still find each batch."""
    from klotski_sim.core.timeline import Timeline
    from klotski_sim.report.exports import to_csv

    ops = (
        Op("a0", "compute", "compute", "attention", step=0, layer=0, batches=(0,)),
        Op("a1", "compute", "compute", "attention", step=0, layer=0, batches=(1,)),
        Op("w", "transfer", "h2d_weights", "weights", bytes=1, src="cpu", dst="gpu"),
        Op("b0", "compute", "compute", "attention", ("w",), step=1, layer=0, batches=(0,)),
        Op("b1", "compute", "compute", "attention", step=1, layer=0, batches=(1,)),
    )
    tl = simulate(Schedule(ops, meta={"generated_tokens": 4}), make_profile(), durations=[1, 2, 5, 1, 1])
    to_csv(tl, tmp_path / "t.csv")
    frame = pd.read_csv(tmp_path / "t.csv")
    assert frame["batches"].dtype == float and frame["batches"].isna().sum() == 1
    back = Timeline({name: frame[name].to_numpy() for name in frame.columns}, tl.meta)
    assert back.step_latencies().to_dict() == tl.step_latencies().to_dict() == {0: 2.0, 1: 4.5}
    assert back.summary() == tl.summary()


def test_exports(tmp_path):
    tl = _timeline()
    paths = save_all(tl, tmp_path)
    for p in paths.values():
        assert p.exists() and p.stat().st_size > 0
    trace = json.loads(gzip.decompress(paths["trace.json.gz"].read_bytes()))
    names = {e["args"]["name"] for e in trace["traceEvents"] if e.get("name") == "thread_name"}
    assert {"compute", "h2d_weights", "h2d_experts", "GPU bubbles"} <= names
    assert sum(e["ph"] == "X" and e.get("cat") != "bubble" for e in trace["traceEvents"]) == 5
    assert any(e["ph"] == "C" for e in trace["traceEvents"])  # memory counter
    summary = json.loads(paths["summary.json"].read_text())
    for key in (
        "policy",
        "model",
        "hardware",
        "batch_size",
        "num_batches",
        "prompt_len",
        "gen_len",
        "status",
        "makespan_s",
        "throughput_tok_s",
        "gpu_busy_s",
        "bubble_s",
        "bubble_inter_s",
        "bubble_intra_s",
        "lower_bound_s",
        "efficiency",
        "peak_gpu_bytes",
        "num_ops",
    ):
        assert key in summary
    back = read_parquet(paths["timeline.parquet"])
    assert back.summary() == tl.summary()
    assert np.array_equal(back.memory[1], tl.memory[1])


@given(
    ids=st.lists(
        st.text(alphabet=st.sampled_from('ab,"\\ \n/é'), min_size=1, max_size=6), min_size=5, max_size=5, unique=True
    )
)
def test_the_csv_reads_back_as_the_frame_pandas_writes(tmp_path_factory, ids):
    """timeline.csv is written by Arrow's writer (a tenth of pandas' time): pandas reads it back with
    the very values it reads back from its own writer's CSV — op ids with commas, quotes,
    backslashes, newlines and non-ASCII letters included. (Arrow writes a whole float without its
    `.0`: a float column whose every value is whole reads back as integers — as `flops` does here.)"""
    from klotski_sim.report.exports import to_csv

    renamed = dict(zip([op.id for op in _timeline_schedule().ops], ids))
    ops = tuple(
        op._replace(id=renamed[op.id], deps=tuple(renamed[d] for d in op.deps)) for op in _timeline_schedule().ops
    )
    tl = simulate(
        Schedule(ops, meta={"policy": "golden", "generated_tokens": 4}),
        make_profile(),
        durations=[1, 1, 2, 1e-7 / 3, 1],
    )
    folder = tmp_path_factory.mktemp("csv")
    to_csv(tl, folder / "arrow.csv")
    tl.df.to_csv(folder / "pandas.csv", index=False)
    arrow, pandas = pd.read_csv(folder / "arrow.csv"), pd.read_csv(folder / "pandas.csv")
    pd.testing.assert_frame_equal(arrow, pandas, check_dtype=False)
    assert list(arrow["op_id"]) == ids and arrow["end"].dtype == pandas["end"].dtype == float


@given(texts=st.lists(st.text(), max_size=8))
def test_a_trace_compressed_beside_its_making_is_what_gzip_open_writes(tmp_path_factory, texts):
    """The trace's text is gzip-compressed by a thread of its own while the next pieces are made
    (zlib lets go of the GIL): the same text as `gzip.open`'s, non-ASCII included."""
    from klotski_sim.report.exports import gzip_beside

    folder = tmp_path_factory.mktemp("gz")
    gzip_beside(folder / "t.json.gz", iter(texts), 5)
    with gzip.open(folder / "u.json.gz", "wt", compresslevel=5, encoding="utf-8") as f:
        f.writelines(texts)
    assert gzip.decompress((folder / "t.json.gz").read_bytes()) == gzip.decompress((folder / "u.json.gz").read_bytes())


def test_what_fails_while_a_trace_is_compressed_is_raised_and_nothing_waits_forever(tmp_path, monkeypatch):
    """A failing disk (the writer thread's error) or a failing maker (the caller's) is raised in the
    caller, with the queue between them never left full: every case ends within seconds."""
    import threading

    from klotski_sim.report import exports

    def run(*args):
        outcome = []
        worker = threading.Thread(target=lambda: outcome.append(_raised(exports.gzip_beside, *args)), daemon=True)
        worker.start()
        worker.join(timeout=20)
        assert not worker.is_alive(), "gzip_beside hung"
        return outcome[0]

    many = (f"piece {i} " * 1000 for i in range(200))
    (tmp_path / "folder.gz").mkdir()
    assert isinstance(run(tmp_path / "folder.gz", many, 5), IsADirectoryError)  # (failed before the first piece)

    def broken_maker():
        yield "first"
        raise ValueError("the maker failed")

    assert str(run(tmp_path / "m.gz", broken_maker(), 5)) == "the maker failed"
    real_open = gzip.GzipFile

    class FullDisk:
        def __init__(self, *args, **kwargs):
            self.f, self.written = real_open(*args, **kwargs), 0

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            self.f.close()

        def write(self, data):
            self.written += 1
            if self.written == 3:
                raise OSError(28, "No space left on device")
            self.f.write(data)

    monkeypatch.setattr(gzip, "GzipFile", FullDisk)
    error = run(tmp_path / "full.gz", (f"piece {i} " * 1000 for i in range(200)), 5)
    assert isinstance(error, OSError) and error.errno == 28


def _raised(call, *args):
    try:
        call(*args)
    except BaseException as err:  # noqa: BLE001 - the test looks at it
        return err
    return None


def test_chrome_trace_times_are_the_timelines_to_the_nanosecond():
    tl = simulate(
        _timeline_schedule(),
        make_profile(),
        durations=[1.23456789e-5, 2.5e-6 + 1e-13, 3.14159265e-6, 7.7777777e-7, 1e-9 / 3],
    )
    events = [e for e in json.loads(chrome_trace_json(tl))["traceEvents"] if e["ph"] == "X" and "op" in e["args"]]
    c = tl.columns
    row = {op: k for k, op in enumerate(c["op_id"])}
    assert len(events) == len(tl)
    for e in events:
        k = row[e["args"]["op"]]
        assert e["ts"] == pytest.approx(c["start"][k] * 1e6, abs=5e-4)  # (microseconds: half a nanosecond)
        assert e["dur"] == pytest.approx((c["end"][k] - c["start"][k]) * 1e6, abs=1e-3)
        assert len(repr(float(e["ts"])).split(".")[1]) <= 3


@pytest.mark.parametrize("odd", [False, True])
def test_chrome_trace_events_are_what_json_dumps_writes(odd):
    """Each event written from a template is the very text json.dumps writes for it (ops compact,
    bubbles and memory with json.dumps' own separators, as they were written one dumps each): plain
    text, and ids and categories that JSON must escape (quotes, backslashes, non-ASCII, a newline)."""
    ops = _timeline_schedule().ops
    if odd:
        ops = tuple(
            op._replace(
                id=f'{op.id}"\\\u00e9', category=f"{op.category}\n", deps=tuple(f'{d}"\\\u00e9' for d in op.deps)
            )
            for op in ops
        )
    durations = [1e-3, 1.5e-3, 2.25e-3, 1e-3, 7e-4]
    tl = simulate(Schedule(ops, meta={"policy": "golden"}), make_profile(), durations=durations)
    text = chrome_trace_json(tl)
    events = json.loads(text)["traceEvents"]
    assert any(e.get("cat") == "bubble" for e in events) and any(e["ph"] == "C" for e in events)
    rewritten = [
        json.dumps(e, separators=(",", ":")) if e["ph"] == "X" and e["cat"] != "bubble" else json.dumps(e)
        for e in events
    ]
    assert text.startswith('{"traceEvents":[' + ",".join(rewritten) + "]")


def test_chrome_trace_escapes_unusual_ids():
    ops = (
        Op('w"0\\', "transfer", "h2d_weights", "weights", bytes=1, src="cpu", dst="gpu"),
        Op("a0", "compute", "compute", 'attention "x"', ('w"0\\',)),
    )
    tl = simulate(Schedule(ops), make_profile(), durations=[1, 1])
    events = json.loads(chrome_trace_json(tl))["traceEvents"]
    assert {e["args"]["op"] for e in events if e["ph"] == "X" and "op" in e.get("args", {})} == {'w"0\\', "a0"}


@given(
    st.lists(st.tuples(st.floats(0, 10), st.floats(0, 3)), min_size=1, max_size=40),
    st.floats(0, 5),
    st.floats(0.1, 10),
    st.integers(1, 50),
)
def test_gantt_bins_keep_exactly_the_busy_time(intervals, t0, span, bins):
    """The Gantt draws each bin's busy time, never a merged block: the bars add up to the union of
    the ops' intervals inside the window, and no bin is fuller than its width."""
    import numpy as np

    from klotski_sim.core.timeline import merge_intervals
    from klotski_sim.report.plot import busy_per_bin

    starts = np.array([a for a, _ in intervals])
    ends = starts + np.array([d for _, d in intervals])
    edges = np.linspace(t0, t0 + span, bins + 1)
    busy = busy_per_bin(starts, ends, edges)
    s, e = merge_intervals(starts, ends)
    inside = np.clip(e, t0, t0 + span) - np.clip(s, t0, t0 + span)
    assert busy.sum() == pytest.approx(inside.sum(), abs=1e-9)
    assert (busy <= np.diff(edges) + 1e-9).all() and (busy >= -1e-12).all()


@given(st.lists(st.tuples(st.integers(0, 40), st.integers(0, 6)), max_size=40), st.sampled_from([0.0, 0.5, 2.0]))
def test_merged_intervals_are_the_union_a_loop_finds(intervals, tolerance):
    """merge_intervals (a sort, then one reduction per run of overlapping intervals) gives what a
    plain loop over the intervals in start order gives, nested and touching ones included."""
    from klotski_sim.core.timeline import merge_intervals

    starts = np.array([float(a) for a, _ in intervals])
    ends = starts + np.array([float(d) for _, d in intervals])
    expected: list[list[float]] = []
    for a, b in sorted(zip(starts.tolist(), ends.tolist()), key=lambda ab: ab[0]):
        if expected and a <= expected[-1][1] + tolerance:
            expected[-1][1] = max(expected[-1][1], b)
        else:
            expected.append([a, b])
    s, e = merge_intervals(starts, ends, tolerance)
    assert [[a, b] for a, b in zip(s.tolist(), e.tolist())] == expected


def test_long_axes_are_in_seconds():
    from klotski_sim.report.plot import time_unit

    assert time_unit(30.0) == (1.0, "s") and time_unit(0.5) == (1e3, "ms")


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_bars_drawn_as_one_path_look_exactly_like_broken_barh(seed):
    """draw_bars (one compound path per lane and category) renders the very pixels of
    matplotlib's broken_barh (an artist per bar), sub-pixel bars included."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from klotski_sim.report.plot import draw_bars

    rng = np.random.default_rng(seed)
    x = np.sort(rng.uniform(0, 100, 400))
    width = rng.choice([0.01, 0.05, 0.3, 2.0], 400)
    images = []
    for method in ("broken_barh", "draw_bars"):
        fig, ax = plt.subplots(figsize=(8, 1.5), dpi=100)
        if method == "broken_barh":
            ax.broken_barh(list(zip(x, width)), (0.2, 0.6), facecolors="#55A868", edgecolor="none")
        else:
            draw_bars(ax, x, width, 0.2, 0.6, "#55A868")
        ax.set_xlim(0, 102)
        ax.set_ylim(0, 1)
        fig.canvas.draw()
        images.append(np.asarray(fig.canvas.buffer_rgba()).copy())
        plt.close(fig)
    assert (images[0] != 255).any() and np.array_equal(images[0], images[1])


def _columns_equal(a, b):
    assert sorted(a) == sorted(b)
    for name in a:
        assert a[name].dtype == b[name].dtype and len(a[name]) == len(b[name]), name
        assert pd.Series(a[name]).equals(pd.Series(b[name])), name  # (NaN equals NaN here)


@pytest.mark.parametrize("never_ran", [(), (4,), (2, 3)])
def test_columns_made_one_at_a_time_equal_the_whole_transpose_and_pickle_whole(never_ran):
    import pickle

    from klotski_sim.core.timeline import ScheduleColumns, Timeline

    sched = _timeline_schedule()
    start, end = [0.0, 1.0, 1.0, 3.0, 4.0], [1.0, 2.0, 3.0, 4.0, 5.0]
    for i in never_ran:
        start[i] = end[i] = float("nan")
    blocked = [-1, 0, -1, 2, 3]

    def columns():
        return ScheduleColumns(sched, start, end, None, blocked)

    one_at_a_time = columns()
    _columns_equal({name: one_at_a_time[name] for name in reversed(list(one_at_a_time))}, columns().materialize())
    back = pickle.loads(pickle.dumps(columns()))
    assert type(back) is dict and list(back) == list(columns())  # in the timeline's column order
    _columns_equal(back, columns().materialize())
    # blockers found from the engine's indices equal those found by op id (a timeline read from a file)
    lazy = Timeline(columns(), {"generated_tokens": 4})
    plain = Timeline(columns().materialize(), {"generated_tokens": 4})
    assert lazy.bubbles().to_dict("list") == plain.bubbles().to_dict("list")
    assert lazy.summary() == plain.summary()
    with pytest.raises(KeyError):
        columns()["no_such_column"]


def test_a_timeline_kept_to_the_figure_columns_draws_the_same_figure():
    """compare keeps only FIGURE_COLUMNS of each timeline (Timeline.detach), held small: the figure
    needs no other column (it would raise KeyError) and is pixel-identical to one drawn from every
    column; each kept column reads back as it was, in its type, also once pickled."""
    import pickle

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from klotski_sim.core.timeline import FIGURE_COLUMNS, CompactColumns
    from klotski_sim.report.plot import compare_gantt
    from klotski_sim.runs.runner import RunSpec, run

    def timelines(keep):
        out = {}
        for policy in ("klotski", "flexgen"):
            tl = run(RunSpec(policy=policy, num_batches=3, prompt_len=16, gen_len=3)).timeline
            tl.summary()
            tl.detach(keep)
            out[policy] = tl
        return out

    kept, whole = timelines(FIGURE_COLUMNS), timelines(None)
    assert set(kept["klotski"].columns) == set(FIGURE_COLUMNS)
    for policy, tl in kept.items():  # held small (codes, narrow integers), read back as they were
        assert isinstance(tl.columns, CompactColumns) and set(tl.columns.coded) == {"stream", "resource", "category"}
        for name in FIGURE_COLUMNS:
            column, full = tl.columns[name], whole[policy].columns[name]
            assert column.dtype == full.dtype and np.array_equal(column, full), name
            if full.dtype == object:
                assert tl.codes(name)[1] == whole[policy].codes(name)[1]
        sent = pickle.loads(pickle.dumps(tl))  # (what a worker sends back)
        assert np.array_equal(sent.columns["category"], whole[policy].columns["category"])
        assert sent.summary() == whole[policy].summary()
    images = []
    for tls in (whole, kept):
        fig = compare_gantt(tls, zoom=(1, 16))
        fig.canvas.draw()
        images.append(np.asarray(fig.canvas.buffer_rgba()).copy())
        plt.close(fig)
    assert np.array_equal(images[0], images[1])


def test_a_timeline_sent_back_by_a_worker_unpickles_without_pandas(tmp_path):
    """A worker hands its timeline back with its bubbles found (compare's figure draws them): the
    bubbles travel as arrays, so unpickling imports no pandas (it did, on compare's critical path,
    while a worker waited for its next run); they read back as they were, whole or detached."""
    import pickle
    import subprocess
    import sys

    from klotski_sim.core.timeline import FIGURE_COLUMNS
    from klotski_sim.runs.runner import RunSpec, run

    for keep in (None, FIGURE_COLUMNS):
        tl = run(RunSpec(policy="klotski", num_batches=3, prompt_len=16, gen_len=3)).timeline
        tl.summary()
        found = tl.bubbles()
        assert len(found) > 0
        tl.detach(keep)
        sent = pickle.dumps(tl)
        back = pickle.loads(sent).bubbles()
        assert list(back.columns) == [name for name in found.columns if keep is None or name in keep]
        pd.testing.assert_frame_equal(back, found[list(back.columns)])
        back.loc[0, "start"] = -1.0  # (a copy: the timeline's bubbles stay as they were)
        assert pickle.loads(sent).bubbles()["start"].iloc[0] == found["start"].iloc[0]
        (tmp_path / "tl.pkl").write_bytes(sent)
        probe = "import pickle, sys; pickle.loads(open(sys.argv[1], 'rb').read()); print('pandas' in sys.modules)"
        out = subprocess.run(
            [sys.executable, "-c", probe, str(tmp_path / "tl.pkl")], capture_output=True, text=True, check=True
        ).stdout.strip()
        assert out == "False"


@given(
    st.lists(
        st.tuples(
            st.floats(0.001, 5.0),
            st.floats(0.0, 2.0),
            st.sampled_from(["weights", "kv", "cold_expert", "attention", "sync", None, "none"]),
        ),
        min_size=2,
        max_size=40,
    )
)
def test_bubbles_by_cause_are_summed_per_cause_in_name_order(ops):
    """The GPU's idle seconds per cause (the category of the op whose end made the op after a gap
    ready; "unknown" without one): each cause's gaps summed, the causes in name order (a missing
    category, in a timeline made by hand, named "None" as str() names it)."""
    from klotski_sim.core.timeline import Timeline

    start, end, t = [], [], 0.0
    for duration, gap, _ in ops:  # GPU ops one after another, `gap` seconds of idle before each
        start.append(t + gap)
        end.append(t + gap + duration)
        t = end[-1]
    blockers = [cause for _, _, cause in ops]  # each op made ready by a host op of that category
    n = len(ops)
    columns = {
        "op_id": np.array([f"g{i}" for i in range(n)] + [f"h{i}" for i in range(n)], dtype=object),
        "resource": np.array(["gpu"] * n + ["host"] * n, dtype=object),
        "start": np.array(start + [0.0] * n),
        "end": np.array(end + [0.0] * n),
        "category": np.array(["expert"] * n + blockers, dtype=object),
        "blocked_by": np.array(
            ["" if b == "none" else f"h{i}" for i, b in enumerate(blockers)] + [""] * n, dtype=object
        ),
    }
    got = Timeline(columns, meta={})._bubble_seconds()[3]
    expected: dict[str, Fraction] = {}
    for i in range(1, n):
        if start[i] - end[i - 1] > 1e-12:
            cause = "unknown" if blockers[i] == "none" else str(blockers[i])
            expected[cause] = expected.get(cause, Fraction(0)) + Fraction(start[i] - end[i - 1])
    assert list(got) == sorted(expected)
    assert all(got[c] == float(expected[c]) for c in expected)  # (each cause's exact sum, rounded once)


@given(st.lists(st.integers(-(2**63), 2**63 - 1), min_size=1, max_size=20))
def test_compact_columns_give_integers_back_exactly(values):
    """A detached timeline's integer columns are held in the smallest integer type that holds them,
    never a float (which would round past 2^53), and read back exactly, in their own type."""
    from klotski_sim.core.timeline import CompactColumns

    column = np.array(values, dtype=np.int64)
    back = CompactColumns({"step": column}, {})["step"]
    assert back.dtype == np.int64 and back.tolist() == values


@given(st.lists(st.sampled_from(["compute", "h2d_kv", "host", ""]), min_size=1, max_size=30))
def test_codes_of_a_text_column_are_its_values_in_order_of_first_appearance(values):
    """Timeline.codes/rows_where (what summaries and figures compare instead of strings) give the
    column back, its values as dict.fromkeys orders them, and the rows == would select."""
    from klotski_sim.core.timeline import Timeline

    column = np.array(values, dtype=object)
    tl = Timeline({"stream": column, "end": np.zeros(len(values))}, meta={})
    codes, distinct = tl.codes("stream")
    assert distinct == list(dict.fromkeys(values)) and [distinct[k] for k in codes] == values
    for value in ("compute", "host", "absent"):
        assert np.array_equal(tl.rows_where("stream", value), column == value)
    tl.detach(("end",))
    assert "codes:stream" not in tl._memo  # (a dropped column's codes are dropped with it)


def test_a_timeline_does_not_keep_its_schedule_alive():
    """A timeline reads the schedule's ops and kept columns but not the schedule, whose dependency
    graph (~150 bytes an op) a comparison's worker must free before it writes a trace."""
    import gc
    import weakref

    schedule = _timeline_schedule()
    tl = simulate(schedule, make_profile(), durations=[1, 1, 2, 1, 1])
    ref = weakref.ref(schedule)
    del schedule
    gc.collect()
    assert ref() is None and list(tl.columns["stream"])[:2] == ["h2d_weights", "compute"]


@pytest.mark.parametrize("events_per_chunk", [1, 3, 1_000_000])
def test_the_chrome_trace_written_in_pieces_is_the_whole_trace(events_per_chunk):
    from klotski_sim.report.exports import chrome_trace_chunks

    tl = _timeline()
    text = "".join(chrome_trace_chunks(tl, events_per_chunk))
    assert text == chrome_trace_json(tl)
    events = json.loads(text)["traceEvents"]
    assert sum(e["ph"] == "X" and e.get("cat") != "bubble" for e in events) == len(tl)
