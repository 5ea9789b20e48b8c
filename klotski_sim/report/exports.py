"""Writing a Timeline out: Parquet (with its metadata, read back losslessly), CSV, the
Chrome/Perfetto trace (one track per stream, a GPU-bubble track, GPU memory as a counter; `.gz`
compressed on request) and the set of files a timeline is written as. The metrics live in
timeline.py; this module only serialises them.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Callable, Iterator, Sequence

import numpy as np

from klotski_sim.core.timeline import Timeline, jsonable
from klotski_sim.files.outfiles import OutputFiles
from klotski_sim.util.lazy import pd  # (imported when first used: klotski_sim/util/lazy.py)


def to_parquet(timeline: Timeline, path: str | Path, df: pd.DataFrame | None = None) -> None:
    """Columns and metadata (the run's meta and its memory trace), read back by `read_parquet`
    (`df`: the timeline's `df`, when the caller has made it already)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    table = pa.Table.from_pandas(timeline.df if df is None else df, preserve_index=False)
    meta = dict(table.schema.metadata or {})
    meta[b"klotski"] = json.dumps(jsonable(timeline.meta)).encode()
    meta[b"klotski_memory"] = json.dumps([timeline.memory[0].tolist(), timeline.memory[1].tolist()]).encode()
    pq.write_table(table.replace_schema_metadata(meta), str(path))


def read_parquet(path: str | Path) -> Timeline:
    """A Timeline written by `to_parquet` (a simulated or a measured one)."""
    import pyarrow.parquet as pq

    table = pq.read_table(str(path))
    meta = json.loads((table.schema.metadata or {}).get(b"klotski", b"{}"))
    mem = json.loads((table.schema.metadata or {}).get(b"klotski_memory", b"[[],[]]"))
    df = table.to_pandas()
    cols = {name: df[name].to_numpy() for name in df.columns}
    return Timeline(cols, meta, (np.asarray(mem[0], dtype=float), np.asarray(mem[1], dtype=np.int64)))


def to_csv(timeline: Timeline, path: str | Path, df: pd.DataFrame | None = None) -> None:
    """The timeline's columns as CSV, by Arrow's writer: a tenth of pandas' time (0.14 against 1.38 s
    at 338k ops). pandas reads back from it the values it reads back from its own writer's CSV (empty
    strings as missing either way); strings are quoted, and a whole float is written without its
    `.0`, so a float column of whole numbers reads back as integers."""
    import pyarrow as pa
    import pyarrow.csv as pa_csv

    pa_csv.write_csv(pa.Table.from_pandas(timeline.df if df is None else df, preserve_index=False), str(path))


def chrome_trace(timeline: Timeline) -> dict[str, Any]:
    """Chrome/Perfetto trace: one track per stream, a bubble track, GPU memory as a counter."""
    return json.loads(chrome_trace_json(timeline))


def chrome_trace_json(timeline: Timeline) -> str:
    """The Chrome trace as JSON text."""
    return "".join(chrome_trace_chunks(timeline))


def chrome_trace_chunks(timeline: Timeline, events_per_chunk: int = 20_000) -> Iterator[str]:
    """The Chrome trace as JSON text in pieces of `events_per_chunk` events, each written by hand
    (a dict per op would cost seconds for the 300k-op timelines of a comparison, and the whole
    text at once a few hundred MB)."""
    yield '{"traceEvents":['
    batch: list[str] = []
    started = False
    for event in _trace_events(timeline):
        batch.append(event)
        if len(batch) == events_per_chunk:
            yield ("," if started else "") + ",".join(batch)
            started, batch = True, []
    if batch:
        yield ("," if started else "") + ",".join(batch)
    yield '],"displayTimeUnit":"ms","metadata":' + json.dumps(jsonable(timeline.meta)) + "}"


def _trace_events(timeline: Timeline) -> Iterator[str]:
    """Every op as an `X` event on its stream's track, then the track names, the GPU bubbles on a
    track of their own, and GPU memory as a counter. Each event written from a template: as
    json.dumps would write it, at a tenth of the cost (a default as-published run's 560k events)."""
    c = timeline.columns
    streams = timeline.streams()
    tid = {s: k + 1 for k, s in enumerate(streams)}
    tids = [tid[s] for s in c["stream"]]
    start_us, end_us = _to_whole_ns(c["start"]), _to_whole_ns(c["end"])
    ts, dur = start_us.tolist(), np.round(np.maximum(end_us - start_us, 0), 3).tolist()
    categories = c["category"]
    escape = _escaper(categories)  # (a name is its category's text and digits: escaped as the category)
    named: dict[tuple[str, int, int, str], tuple[str, str]] = {}  # an op's name and category, made once each
    for t, cat, a, d, op, st, ly, bt, ex, tk, nb, bb in zip(
        tids,
        categories,
        ts,
        dur,
        _json_texts(c["op_id"]),
        c["step"].tolist(),
        c["layer"].tolist(),
        c["batches"],
        c["expert"].tolist(),
        c["tokens"].tolist(),
        c["bytes"].tolist(),
        _json_texts(c["blocked_by"]),
    ):
        texts = named.get((cat, ly, ex, bt))
        if texts is None:  # (a few thousand distinct names among a run's 300k ops)
            texts = named[(cat, ly, ex, bt)] = (escape(_label(cat, ly, ex, bt)), escape(cat))
        yield (
            f'{{"ph":"X","pid":1,"tid":{t},"name":"{texts[0]}","cat":"{texts[1]}","ts":{a!r},"dur":{d!r},'
            f'"args":{{"op":"{op}","step":{st},"layer":{ly},"batches":"{bt}","expert":{ex},"tokens":{tk},'
            f'"bytes":{nb},"blocked_by":"{bb}"}}}}'
        )
    dumps = json.dumps
    label = f"{timeline.meta.get('policy', '')} {timeline.meta.get('model', '')} {timeline.meta.get('hardware', '')}".strip()
    yield dumps({"ph": "M", "name": "process_name", "pid": 1, "args": {"name": label or "klotski"}})
    for s, t in tid.items():
        yield dumps({"ph": "M", "name": "thread_name", "pid": 1, "tid": t, "args": {"name": s}})
        yield dumps({"ph": "M", "name": "thread_sort_index", "pid": 1, "tid": t, "args": {"sort_index": t}})
    bubble_tid = len(tid) + 1
    yield dumps({"ph": "M", "name": "thread_name", "pid": 1, "tid": bubble_tid, "args": {"name": "GPU bubbles"}})
    bub = timeline.bubbles()
    # (json.dumps' own separators, and Python's round: the text a json.dumps of each event gives)
    for start, duration, kind, ended_by, cause in zip(
        (bub["start"].to_numpy(dtype=float) * 1e6).tolist(),
        (bub["duration"].to_numpy(dtype=float) * 1e6).tolist(),
        *(_json_texts(bub[name].tolist()) for name in ("kind", "next_op", "cause")),
    ):
        yield (
            f'{{"ph": "X", "pid": 1, "tid": {bubble_tid}, "name": "bubble ({kind})", "cat": "bubble", '
            f'"ts": {round(start, 3)!r}, "dur": {round(duration, 3)!r}, '
            f'"args": {{"ended_by": "{ended_by}", "cause": "{cause}"}}}}'
        )
    for t, gib in zip((timeline.memory[0].astype(float) * 1e6).tolist(), (timeline.memory[1] / 2**30).tolist()):
        yield f'{{"ph": "C", "pid": 1, "name": "GPU memory (GiB)", "ts": {round(t, 3)!r}, "args": {{"GiB": {gib!r}}}}}'


def _escaper(texts: Sequence[Any] | np.ndarray) -> Callable[[str], str]:
    """How the strings of a text column appear between a JSON string's quotes: as they are when
    all are plain printable ASCII without quotes or backslashes (found in one pass over them all,
    as op ids and categories are in practice), else with json.dumps' escapes."""
    try:
        joined = "".join(texts)
    except TypeError:  # (not all strings: each written as its text)
        return lambda text: json.dumps(str(text))[1:-1]
    if joined.isascii() and joined.isprintable() and '"' not in joined and "\\" not in joined:
        return str
    return lambda text: json.dumps(text)[1:-1]


def _json_texts(texts: Sequence[Any] | np.ndarray) -> Sequence[str] | np.ndarray:
    """A text column's strings as they appear between a JSON string's quotes (see `_escaper`)."""
    escape = _escaper(texts)
    return texts if escape is str else list(map(escape, texts))


# gzip's level for a `.json.gz` trace: the fastest that keeps a default-size as-published trace
# (338k ops; 11.4 MB at level 3 with every digit of its times) under 10 MB. Its times to the
# nanosecond with three decimals: level 3 10.4 MB in 0.45 s, 5 8.7 MB in 0.68 s, 6 8.4 MB in
# 0.97 s; as written here (no trailing zeros) 8.2 MB at level 5.
TRACE_GZIP_LEVEL = 5


def to_chrome_trace(timeline: Timeline, path: str | Path) -> None:
    """Write the Chrome trace, piece by piece; gzip-compressed when the name ends in `.gz`
    (Perfetto and chrome://tracing open `.json.gz` as they are: under a tenth of the size)."""
    path = Path(path)
    if path.suffix == ".gz":
        gzip_beside(path, chrome_trace_chunks(timeline), TRACE_GZIP_LEVEL)
    else:
        with path.open("w", encoding="utf-8") as f:
            f.writelines(chrome_trace_chunks(timeline))


def gzip_beside(path: Path, texts: Iterator[str], level: int) -> None:
    """`texts` gzip-compressed into `path` by a thread of its own while the next ones are made:
    zlib lets go of the GIL as it compresses (a default as-published trace, 338k ops: 1.13 -> 0.86
    s). What the thread raises (a full disk) is raised here; the same text as `gzip.open`'s."""
    import gzip
    import queue
    import threading

    pieces: queue.Queue[bytes | None] = queue.Queue(maxsize=1)  # (one piece ahead: each ~6 MB of text)
    failed: list[BaseException] = []

    def compress() -> None:
        ended = False
        try:
            # (no file name in gzip's header: the file is written under a temporary name, klotski_sim/files/outfiles.py)
            with path.open("wb") as raw, gzip.GzipFile("", "wb", level, raw) as f:
                while (piece := pieces.get()) is not None:
                    f.write(piece)
                ended = True
        except BaseException as err:  # noqa: BLE001 - raised again by the thread that waits
            failed.append(err)
            while not ended:  # (taken until the end, so that the maker never waits on a full queue)
                ended = pieces.get() is None

    writer = threading.Thread(target=compress, daemon=True)
    writer.start()
    try:
        for text in texts:
            if failed:
                break
            pieces.put(text.encode("utf-8"))
    finally:
        pieces.put(None)
        writer.join()
    if failed:
        raise failed[0]


# the files a timeline is written as (`simulate --out`, `klotski-runtime execute --out`)
TIMELINE_FILES = ("summary.json", "timeline.parquet", "timeline.csv", "trace.json.gz", "timeline.png")


def write_timeline_files(timeline: Timeline, files: OutputFiles, *, png: bool = True) -> None:
    """Write `TIMELINE_FILES` (the figure only with `png`) into `files`, not yet committed: the
    caller adds its own files (a schedule, its routing) and commits them all together."""
    files.path("summary.json").write_text(json.dumps(jsonable(timeline.summary().to_dict()), indent=2))
    df = timeline.df  # (made once for both: 0.3 s at 300k ops)
    to_parquet(timeline, files.path("timeline.parquet"), df)
    to_csv(timeline, files.path("timeline.csv"), df)
    del df
    to_chrome_trace(timeline, files.path("trace.json.gz"))
    if png:
        from klotski_sim.report.plot import gantt

        gantt(timeline, files.path("timeline.png"))


def save_all(timeline: Timeline, out_dir: str | Path, *, png: bool = True) -> dict[str, Path]:
    """Write summary.json, timeline.parquet, timeline.csv, trace.json.gz and timeline.png into
    `out_dir`, all or none (klotski_sim/files/outfiles.py); an earlier timeline.png there is removed
    when `png` is off. Returns the files written, by name."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    with OutputFiles(out, stale=TIMELINE_FILES) as files:
        write_timeline_files(timeline, files, png=png)
        return {name: out / name for name in files.commit()}


def _to_whole_ns(seconds: np.ndarray) -> np.ndarray:
    """Times in microseconds (the trace's unit) to the nanosecond: Perfetto shows whole
    nanoseconds (its JSON importer turns microseconds into integer nanoseconds, `CoerceToNs`), and
    the digits beyond, which do not compress, are a tenth of a compressed trace. (The exact
    times are in timeline.parquet.)"""
    return np.round(seconds * 1e6, 3)


def _label(category: str, layer: int, expert: int, batches: str) -> str:
    """A short event name: `expert L3 E5 b[0,1]`."""
    label = category
    if layer >= 0:
        label += f" L{layer}"
    if expert >= 0:
        label += f" E{expert}"
    if batches:
        label += f" b{batches}" if "," not in batches else f" b[{batches}]"
    return label
