"""Mapped arrays (klotski_sim/files/mapped.py): a cached trace's ids read from the file's pages, passes
that give the pages back, and routing files written from them byte for byte as numpy writes."""

import os
import re
import tempfile
import zipfile
from dataclasses import replace
from pathlib import Path
from unittest.mock import patch

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from klotski_sim.files import disk_cache, npzfile
from klotski_sim.files.mapped import in_chunks, is_mapped, map_stored_array, release
from klotski_sim.files.npzfile import write_npz
from klotski_sim.workload import trace_cache as cache

SMAPS = Path("/proc/self/smaps")
needs_smaps = pytest.mark.skipif(not SMAPS.exists(), reason="resident pages are read from /proc/self/smaps (Linux)")


def _resident_kb(path: Path | re.Pattern, field: str = "Rss") -> int:
    """Resident kB (or another smaps `field`: `Size`, mapped) of this process's mappings of `path`
    (or of the files whose path, removed or not, matches the pattern)."""
    total, current = 0, False
    for line in SMAPS.read_text().splitlines():
        if re.match(r"^[0-9a-f]+-[0-9a-f]+ ", line):
            named = line.split(maxsplit=5)[5].removesuffix(" (deleted)") if len(line.split()) > 5 else ""
            current = bool(path.fullmatch(named)) if isinstance(path, re.Pattern) else named == str(path)
        elif current and line.startswith(field + ":"):
            total += int(line.split()[1])
    return total


@settings(max_examples=40, deadline=None)
@given(
    shape=st.lists(st.integers(0, 6), min_size=1, max_size=4),
    dtype=st.sampled_from([np.uint8, np.int16, np.int32, np.float16]),
    seed=st.integers(0, 2**32 - 1),
)
def test_a_stored_array_maps_to_what_numpy_reads(tmp_path_factory, shape, dtype, seed):
    folder = tmp_path_factory.mktemp("npz")
    array = np.random.default_rng(seed).integers(0, 100, size=shape).astype(dtype)
    write_npz(folder / "a.npz", dict(meta=np.array("x"), experts=array), level=None)
    mapped = map_stored_array(folder / "a.npz", "experts")
    with np.load(folder / "a.npz") as z:
        assert mapped is not None and mapped.dtype == z["experts"].dtype and np.array_equal(mapped, z["experts"])
    assert not mapped.flags.writeable and (is_mapped(mapped) or mapped.size == 0)
    assert map_stored_array(folder / "a.npz", "weights") is None  # no such member


def test_what_cannot_be_mapped_is_left_to_numpy(tmp_path):
    """A compressed member, a Fortran-order array, a truncated or absent file: None, never a wrong array."""
    array = np.arange(4096, dtype=np.uint8).reshape(64, 64)
    write_npz(tmp_path / "deflated.npz", dict(experts=array))
    np.savez(tmp_path / "fortran.npz", experts=np.asfortranarray(array))
    write_npz(tmp_path / "whole.npz", dict(experts=array), level=None)
    whole = (tmp_path / "whole.npz").read_bytes()
    (tmp_path / "cut.npz").write_bytes(whole[: len(whole) // 2])
    (tmp_path / "junk.npz").write_bytes(b"PK\x03\x04" + b"\0" * 100)
    for name in ("deflated", "fortran", "cut", "junk", "absent"):
        assert map_stored_array(tmp_path / f"{name}.npz", "experts") is None, name
    assert np.array_equal(map_stored_array(tmp_path / "whole.npz", "experts"), array)


@needs_smaps
def test_release_gives_the_pages_back_and_keeps_the_values(tmp_path):
    array = np.random.default_rng(0).integers(0, 256, size=(64, 1 << 16), dtype=np.uint8)  # 4 MiB
    path = tmp_path / "big.npz"
    write_npz(path, dict(experts=array), level=None)
    mapped = map_stored_array(path, "experts")
    assert int(mapped.sum(dtype=np.int64)) == int(array.sum(dtype=np.int64))  # every page read
    assert _resident_kb(path) >= 3 * 1024
    release(mapped[::-1, ::3])  # (a view with negative and uneven strides spans the same bytes)
    assert _resident_kb(path) < 512
    total = sum(int(part.sum(dtype=np.int64)) for part in in_chunks(mapped, 8))  # a pass in chunks
    assert total == int(array.sum(dtype=np.int64)) and _resident_kb(path) < 1024
    assert np.array_equal(mapped, array)  # released pages are read again
    release(np.zeros(3))  # an array in memory: nothing to give back


@settings(max_examples=60, deadline=None)
@given(
    shape=st.lists(st.integers(1, 5), min_size=1, max_size=4),
    data=st.data(),
    limit=st.sampled_from([1, 3, 16, 100, 4096]),
)
def test_a_mapped_view_is_written_as_numpy_writes_it(tmp_path_factory, shape, data, limit):
    """Routing files are written from a mapped trace in blocks of at most `_WRITTEN_BYTES`: the
    bytes are numpy's for any view (cut, strided) and any block size."""
    folder = tmp_path_factory.mktemp("w")
    array = np.arange(int(np.prod(shape)), dtype=np.int16).reshape(shape)
    write_npz(folder / "src.npz", dict(experts=array), level=None)
    mapped = map_stored_array(folder / "src.npz", "experts")
    cut = tuple(slice(data.draw(st.integers(0, n - 1)), None, data.draw(st.sampled_from([1, 2]))) for n in shape)
    view = mapped[cut]
    old = npzfile._WRITTEN_BYTES
    try:
        npzfile._WRITTEN_BYTES = limit
        write_npz(folder / "mapped.npz", dict(ids=view))
    finally:
        npzfile._WRITTEN_BYTES = old
    write_npz(folder / "memory.npz", dict(ids=np.ascontiguousarray(array[cut])))
    with zipfile.ZipFile(folder / "mapped.npz") as a, zipfile.ZipFile(folder / "memory.npz") as b:
        assert a.read("ids.npy") == b.read("ids.npy")


@needs_smaps
def test_a_long_prompt_run_from_the_cache_builds_the_same_schedule_without_holding_its_routing(tmp_path, monkeypatch):
    """A run whose trace comes from the cache (mapped) builds the schedule a run without the
    cache builds, writes the same routing.npz, and leaves at most a quarter of the trace's pages
    resident once Klotski's schedule (counts, first-use orders, online learning) is built."""
    from klotski_sim.policies import build_schedule
    from klotski_sim.runs.runner import RunSpec, prepare

    spec = RunSpec(
        model="mixtral-8x7b",
        policy="klotski",
        impl="ideal",
        batch_size=4,
        num_batches=4,
        prompt_len=4096,
        gen_len=4,
        seed=11,
    )
    monkeypatch.setenv("KLOTSKI_CACHE_DIR", "off")
    plain = prepare(spec)
    expected = build_schedule("klotski", plain.policy_input())
    plain.replay.routing.save(tmp_path / "plain.npz")
    monkeypatch.setenv("KLOTSKI_CACHE_DIR", str(tmp_path / "cache"))
    from klotski_sim.runs.runner import _synthetic_trace

    _synthetic_trace.cache_clear()
    prepare(spec)  # (writes the cache)
    _synthetic_trace.cache_clear()
    cached = prepare(spec)
    (trace_file,) = (tmp_path / "cache" / "traces").glob("*.npz")
    routing = cached.replay.routing
    assert is_mapped(routing.ids) and routing.ids.nbytes > 4 << 20
    schedule = build_schedule("klotski", cached.policy_input())
    assert schedule.ops == expected.ops
    assert _resident_kb(trace_file) <= trace_file.stat().st_size / 1024 / 4
    routing.save(tmp_path / "cached.npz")
    with zipfile.ZipFile(tmp_path / "plain.npz") as a, zipfile.ZipFile(tmp_path / "cached.npz") as b:
        assert a.read("ids.npy") == b.read("ids.npy")
    assert _resident_kb(trace_file) <= trace_file.stat().st_size / 1024 / 4
    # the cache off, the trace drawn into a temporary file (the bar for that lowered to fit this trace)
    monkeypatch.setenv("KLOTSKI_CACHE_DIR", "off")
    monkeypatch.setattr(disk_cache, "MAPPED_ABOVE", 1 << 20)
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    _synthetic_trace.cache_clear()
    unnamed = prepare(spec)
    assert is_mapped(unnamed.replay.routing.ids) and not list(tmp_path.glob("klotski-trace-*"))
    assert build_schedule("klotski", unnamed.policy_input()).ops == expected.ops
    drawn_file = re.compile(re.escape(str(tmp_path)) + r"/klotski-trace-[^/]+/trace\.npz")
    assert _resident_kb(drawn_file, "Size") >= trace_file.stat().st_size / 1024 / 2  # (mapped, removed)
    assert _resident_kb(drawn_file) <= trace_file.stat().st_size / 1024 / 4
    _synthetic_trace.cache_clear()


def test_a_large_trace_the_cache_does_not_keep_is_drawn_into_a_temporary_file_and_mapped(tmp_path, monkeypatch):
    """The cache off, not writable, or with a cap below the trace: a trace of at least
    disk_cache.MAPPED_ABOVE bytes (lowered here) is drawn into a temporary file, mapped, the file removed
    at once; the same ids as `synthesize`, `make` never called, nothing left in the temporary
    folder or the cache. A smaller trace, or no writable temporary folder: drawn into memory."""
    cached_trace = cache.cached_trace
    from klotski_sim.workload.model import get_model
    from klotski_sim.workload.trace_synth import synthesize, synthesized_blocks

    m = get_model("mixtral-8x7b")
    expected = synthesize(m, 70, 40, 3, routing="calibrated", seed=5)
    made = []

    def make():
        made.append(1)
        return synthesize(m, 70, 40, 3, routing="calibrated", seed=5)

    def drawn():
        return cached_trace(
            m, "calibrated", 5, 70, 40, 3, make, lambda: synthesized_blocks(m, 70, 40, 3, routing="calibrated", seed=5)
        )

    temporary = tmp_path / "tmp"
    temporary.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(temporary))
    monkeypatch.setattr(disk_cache, "MAPPED_ABOVE", expected.experts.nbytes)
    (tmp_path / "file").write_text("")
    for setting, cap in (("off", "2"), (str(tmp_path / "file"), "2"), (str(tmp_path / "cache"), "0.0001")):
        monkeypatch.setenv("KLOTSKI_CACHE_DIR", setting)  # off; a folder that cannot be made; a cap of ~100 kB
        monkeypatch.setenv("KLOTSKI_CACHE_MAX_GB", cap)
        trace = drawn()
        assert not made and is_mapped(trace.experts) and np.array_equal(trace.experts, expected.experts), setting
        assert np.array_equal(trace.seq_offsets, expected.seq_offsets) and trace.meta == json_round_trip(expected.meta)
        assert not list(temporary.iterdir()) and not list(tmp_path.glob("cache/traces/*.npz"))
    monkeypatch.setenv("KLOTSKI_CACHE_DIR", "off")
    monkeypatch.setattr(disk_cache, "MAPPED_ABOVE", expected.experts.nbytes + 1)  # smaller than the bar: in memory
    trace = drawn()
    assert made == [1] and not is_mapped(trace.experts) and np.array_equal(trace.experts, expected.experts)
    monkeypatch.setattr(disk_cache, "MAPPED_ABOVE", expected.experts.nbytes)
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "file" / "below"))  # no temporary file can be made
    trace = drawn()
    assert made == [1, 1] and not is_mapped(trace.experts) and np.array_equal(trace.experts, expected.experts)


def test_a_trace_drawn_into_the_cache_is_the_one_drawn_in_memory_and_comes_back_mapped(tmp_path, monkeypatch):
    """The cache writes a synthetic trace as it is drawn (a chunk of sequences at a time) and
    reads it back mapped: the same ids as `synthesize`, `make` never called; a cache that cannot
    be written falls back to `make`."""
    cached_trace = cache.cached_trace
    from klotski_sim.workload.model import get_model
    from klotski_sim.workload.trace_synth import synthesize, synthesized_blocks

    m = get_model("mixtral-8x7b")
    args = (m, 70, 40, 3, "calibrated", 5)  # (70 sequences: two chunks of up to 64)
    expected = synthesize(*args[:4], routing="calibrated", seed=5)
    made = []

    def make():
        made.append(1)
        return synthesize(*args[:4], routing="calibrated", seed=5)

    monkeypatch.setenv("KLOTSKI_CACHE_DIR", str(tmp_path / "cache"))
    streamed = cached_trace(
        m, "calibrated", 5, 70, 40, 3, make, lambda: synthesized_blocks(*args[:4], routing="calibrated", seed=5)
    )
    assert not made and is_mapped(streamed.experts) and np.array_equal(streamed.experts, expected.experts)
    assert streamed.meta == json_round_trip(expected.meta)
    assert np.array_equal(streamed.seq_offsets, expected.seq_offsets)
    assert np.array_equal(streamed.prompt_lens, expected.prompt_lens)
    (tmp_path / "file").write_text("")
    monkeypatch.setenv("KLOTSKI_CACHE_DIR", str(tmp_path / "file"))  # (a folder that cannot be made)
    fallback = cached_trace(
        m, "calibrated", 5, 70, 40, 3, make, lambda: synthesized_blocks(*args[:4], routing="calibrated", seed=5)
    )
    assert made == [1] and np.array_equal(fallback.experts, expected.experts)


@settings(max_examples=8, deadline=None)
@given(first=st.integers(1, 70), then=st.integers(1, 70))
def test_a_cached_trace_serves_fewer_sequences_and_a_larger_one_replaces_it(tmp_path_factory, first, then):
    """Runs of one workload at other batch sizes or n share one cached trace: a request for fewer
    sequences than a cached trace holds gets its first ones, exactly the trace drawn for that many
    (ids, offsets, prompt lengths and meta), nothing drawn; a request for more draws it, and it
    replaces the smaller file."""
    from klotski_sim.workload.model import get_model
    from klotski_sim.workload.trace_synth import synthesize, synthesized_blocks

    folder = tmp_path_factory.mktemp("cache")
    m = get_model("tiny-mixtral")
    drawn = []

    def cached(sequences):
        def stream():
            drawn.append(sequences)
            return synthesized_blocks(m, sequences, 20, 3, routing="calibrated", seed=5)

        return cache.cached_trace(m, "calibrated", 5, sequences, 20, 3, lambda: 1 / 0, stream)

    with patch.dict(os.environ, {"KLOTSKI_CACHE_DIR": str(folder), "KLOTSKI_CACHE_MAX_GB": "1"}):
        cached(first)
        trace = cached(then)
    expected = synthesize(m, then, 20, 3, "calibrated", seed=5)
    assert drawn == ([first] if then <= first else [first, then])
    assert np.array_equal(trace.experts, expected.experts) and trace.meta == json_round_trip(expected.meta)
    assert np.array_equal(trace.seq_offsets, expected.seq_offsets)
    assert np.array_equal(trace.prompt_lens, expected.prompt_lens)
    kept = sorted(p.name.rsplit("-", 1)[1] for p in (folder / "traces").glob("*.npz"))
    assert kept == [f"{max(first, then)}.npz"]


def test_models_of_one_shape_share_a_cached_trace_named_for_each(tmp_path, monkeypatch):
    """The generator reads a model's layers, experts and top-k alone: Mixtral-8x7B with int4 experts
    is served the bf16 model's cached trace (its meta naming the int4 model, as a fresh draw for it
    does), a model of another shape is not."""
    from klotski_sim.workload.model import get_model
    from klotski_sim.workload.trace_synth import synthesize, synthesized_blocks

    monkeypatch.setenv("KLOTSKI_CACHE_DIR", str(tmp_path / "cache"))
    drawn = []

    def cached(name, sequences):
        m = get_model(name)

        def stream():
            drawn.append(name)
            return synthesized_blocks(m, sequences, 20, 3, routing="calibrated", seed=5)

        return cache.cached_trace(m, "calibrated", 5, sequences, 20, 3, lambda: 1 / 0, stream)

    cached("mixtral-8x7b", 9)
    for name, sequences in (("mixtral-8x7b@int4", 9), ("mixtral-8x7b@int4", 4), ("mixtral-8x7b", 9)):
        expected = synthesize(get_model(name), sequences, 20, 3, "calibrated", seed=5)
        trace = cached(name, sequences)
        assert np.array_equal(trace.experts, expected.experts) and trace.meta == json_round_trip(expected.meta)
    assert drawn == ["mixtral-8x7b"]
    assert cached("mixtral-8x7b:4", 9).num_layers == 4 and drawn == ["mixtral-8x7b", "mixtral-8x7b:4"]


def _tiny_workload():
    """`cached(sequences)`: the trace cache's tiny-mixtral trace of that many sequences (never made in
    memory: `make` fails); `expected(sequences)`: the one `synthesize` draws."""
    from klotski_sim.workload.model import get_model
    from klotski_sim.workload.trace_synth import synthesize, synthesized_blocks

    m = get_model("tiny-mixtral")

    def cached(sequences):
        return cache.cached_trace(
            m,
            "calibrated",
            5,
            sequences,
            20,
            3,
            lambda: 1 / 0,
            lambda: synthesized_blocks(m, sequences, 20, 3, routing="calibrated", seed=5),
        )

    return cached, lambda sequences: synthesize(m, sequences, 20, 3, "calibrated", seed=5)


def _damage(kind, path, good):
    """Put a damaged cache file of kind `kind` at `path` (`good`: the file's undamaged arrays)."""
    import io
    import json

    arrays = dict(good)
    if kind == "meta of another type":
        arrays["meta"] = np.array("null")
    elif kind == "generator settings not a mapping":
        meta = json.loads(str(arrays["meta"]))
        arrays["meta"] = np.array(json.dumps({**meta, "generator": [1]}))
    elif kind == "another prompt/generated split":  # (the same tokens a sequence: 20 + 3 as 21 + 2)
        arrays["prompt_lens"] = arrays["prompt_lens"] + 1
    elif kind == "a header asking for terabytes":
        with zipfile.ZipFile(path, "w") as z:
            head = io.BytesIO()
            np.lib.format.write_array_header_1_0(
                head, {"descr": "|u1", "fortran_order": False, "shape": (10**13, 2, 2)}
            )
            z.writestr("experts.npy", head.getvalue() + bytes(1000))
            for name in ("seq_offsets", "prompt_lens", "meta"):
                body = io.BytesIO()
                np.save(body, arrays[name])
                z.writestr(f"{name}.npy", body.getvalue())
        return
    elif kind == "a FIFO":
        os.mkfifo(path)
        return
    elif kind == "a link to nowhere":
        os.symlink(path.parent / "elsewhere.npz", path)
        return
    np.savez(path, **arrays)


@pytest.mark.parametrize(
    "kind",
    [
        "meta of another type",
        "generator settings not a mapping",
        "another prompt/generated split",
        "a header asking for terabytes",
        "a FIFO",
        "a link to nowhere",
    ],
)
@pytest.mark.parametrize("wanted", [5, 20])
def test_a_damaged_cache_file_is_drawn_again_never_a_traceback_a_hang_or_a_write_elsewhere(
    tmp_path, monkeypatch, kind, wanted
):
    """The cache fuzzed (a helper's battery): each of these cache files, under the name of a 20-sequence
    trace of the workload, raised out of `cached_trace` (TypeError, MemoryError), blocked it for
    ever (a FIFO), served another prompt/generated split, or made it write outside the cache (a
    link's target). Each is passed over now, and the run gets the trace `synthesize` draws."""
    import signal

    monkeypatch.setenv("KLOTSKI_CACHE_DIR", str(tmp_path / "cache"))
    cached, expected = _tiny_workload()
    cached(20)
    (path,) = (tmp_path / "cache" / "traces").glob("*.npz")
    with np.load(path) as z:
        good = {name: z[name] for name in z.files}
    path.unlink()
    _damage(kind, path, good)
    signal.signal(signal.SIGALRM, lambda *_: pytest.fail("the cache blocked"))
    signal.alarm(30)
    try:
        trace = cached(wanted)
    finally:
        signal.alarm(0)
    assert np.array_equal(trace.experts, expected(wanted).experts)
    assert trace.meta == json_round_trip(expected(wanted).meta)
    assert np.array_equal(trace.prompt_lens, expected(wanted).prompt_lens)
    assert not (tmp_path / "cache" / "traces" / "elsewhere.npz").exists()


def test_a_cache_file_that_cannot_be_touched_is_used_all_the_same(tmp_path, monkeypatch):
    """Marking a cached file used (its time, for eviction) raised out of a run where the cache was
    read-only or another user's (PermissionError), or where another process had just replaced the
    file by a larger trace and removed it (FileNotFoundError)."""
    monkeypatch.setenv("KLOTSKI_CACHE_DIR", str(tmp_path / "cache"))
    cached, expected = _tiny_workload()
    cached(9)
    for error in (PermissionError, FileNotFoundError):

        def refuse(*args, error=error, **kwargs):
            raise error("refused")

        monkeypatch.setattr(disk_cache.os, "utime", refuse)
        for wanted in (9, 4):
            assert np.array_equal(cached(wanted).experts, expected(wanted).experts)


def json_round_trip(value):
    import json

    return json.loads(json.dumps(value))


def test_blocks_are_written_as_the_whole_array_and_must_add_up_to_it(tmp_path):
    whole = np.arange(7 * 3 * 2, dtype=np.uint8).reshape(7, 3, 2)
    write_npz(tmp_path / "blocks.npz", dict(a=npzfile.Blocks(whole.shape, whole.dtype, iter([whole[:3], whole[3:]]))))
    write_npz(tmp_path / "whole.npz", dict(a=whole))
    with zipfile.ZipFile(tmp_path / "blocks.npz") as a, zipfile.ZipFile(tmp_path / "whole.npz") as b:
        assert a.read("a.npy") == b.read("a.npy")
    for blocks in ([whole[:3]], [whole, whole[:1]], [whole.astype(np.int16)]):
        with pytest.raises(ValueError):
            write_npz(tmp_path / "bad.npz", dict(a=npzfile.Blocks(whole.shape, whole.dtype, iter(blocks))))
    assert not (tmp_path / "bad.npz").exists()  # (an interrupted write leaves no file)


def test_without_madvise_a_mapping_is_read_and_never_released(tmp_path, monkeypatch):
    """(Windows has no madvise: the pages stay, the values are the same.)"""
    from klotski_sim.files import mapped

    monkeypatch.setattr(mapped, "_DONTNEED", None)
    array = np.arange(1 << 16, dtype=np.uint8)
    write_npz(tmp_path / "a.npz", dict(experts=array), level=None)
    view = map_stored_array(tmp_path / "a.npz", "experts")
    assert sum(int(part.sum(dtype=np.int64)) for part in in_chunks(view, 4096)) == int(array.sum(dtype=np.int64))
    release(view)
    assert np.array_equal(view, array)


def test_a_large_recorded_trace_is_unpacked_into_the_cache_once_and_mapped(tmp_path, monkeypatch):
    """A trace file's large arrays (above disk_cache.MAPPED_ABOVE, lowered here) are decompressed once
    into the cache and mapped: the same values as numpy reads, the copy reused while the file is
    unchanged and made again when it changes; the cache off, or a small array, read as before."""
    from klotski_sim.workload.model import get_model
    from klotski_sim.workload.trace import Trace
    from klotski_sim.workload.trace_synth import synthesize

    m = get_model("tiny-mixtral")
    original = synthesize(m, 6, 30, 4, "calibrated", seed=2, with_weights=True)
    original.save(tmp_path / "t.npz")
    monkeypatch.setenv("KLOTSKI_CACHE_DIR", str(tmp_path / "cache"))
    assert not is_mapped(Trace.load(tmp_path / "t.npz").experts)  # (small: read as it is)
    monkeypatch.setattr(disk_cache, "MAPPED_ABOVE", 64)
    monkeypatch.setattr(disk_cache, "_UNPACKED_BLOCK", 100)  # (several blocks, and rows cut at their bounds)
    loaded = Trace.load(tmp_path / "t.npz")
    assert is_mapped(loaded.experts) and is_mapped(loaded.weights)
    assert np.array_equal(loaded.experts, original.experts) and np.array_equal(loaded.weights, original.weights)
    copies = sorted((tmp_path / "cache" / "traces").glob("*.npz"))
    assert len(copies) == 2  # (ids and gate weights)
    again = Trace.load(tmp_path / "t.npz")
    assert np.array_equal(again.experts, original.experts)
    assert sorted((tmp_path / "cache" / "traces").glob("*.npz")) == copies
    other = synthesize(m, 6, 30, 4, "calibrated", seed=3, with_weights=True)
    other.save(tmp_path / "t.npz")
    assert np.array_equal(Trace.load(tmp_path / "t.npz").experts, other.experts)  # (a new file: a new copy)
    monkeypatch.setenv("KLOTSKI_CACHE_DIR", "off")
    off = Trace.load(tmp_path / "t.npz")
    assert not is_mapped(off.experts) and np.array_equal(off.experts, other.experts)


def test_a_damaged_recorded_trace_is_refused_alike_with_the_cache_on_and_off(tmp_path, monkeypatch):
    from klotski_sim.workload.model import get_model
    from klotski_sim.workload.trace import Trace, TraceError
    from klotski_sim.workload.trace_synth import synthesize

    synthesize(get_model("tiny-mixtral"), 40, 60, 4, "calibrated", seed=2).save(tmp_path / "t.npz")
    data = bytearray((tmp_path / "t.npz").read_bytes())
    with zipfile.ZipFile(tmp_path / "t.npz") as archive:
        info = archive.getinfo("experts.npy")
    middle = info.header_offset + 100 + info.compress_size // 2
    data[middle : middle + 16] = bytes(16)  # (deflated ids overwritten: a CRC or inflate error)
    (tmp_path / "bad.npz").write_bytes(bytes(data))
    monkeypatch.setattr(disk_cache, "MAPPED_ABOVE", 64)
    messages = []
    for where in ("off", str(tmp_path / "cache")):
        monkeypatch.setenv("KLOTSKI_CACHE_DIR", where)
        with pytest.raises(TraceError) as refused:
            Trace.load(tmp_path / "bad.npz")
        messages.append(str(refused.value).split(" (")[0])
    assert messages[0] == messages[1] and "cannot read trace, the file is truncated or corrupt" in messages[0]
    assert not list((tmp_path / "cache" / "traces").glob("*.npz"))  # (no copy of a damaged array is kept)


def test_a_bad_cache_cap_is_named_when_a_trace_file_is_read(tmp_path, monkeypatch):
    from klotski_sim.util.errors import UsageError
    from klotski_sim.workload.model import get_model
    from klotski_sim.workload.trace import Trace
    from klotski_sim.workload.trace_synth import synthesize

    synthesize(get_model("tiny-mixtral"), 2, 6, 2, "calibrated", seed=2).save(tmp_path / "t.npz")
    monkeypatch.setenv("KLOTSKI_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setenv("KLOTSKI_CACHE_MAX_GB", "lots")
    with pytest.raises(UsageError, match="KLOTSKI_CACHE_MAX_GB"):
        Trace.load(tmp_path / "t.npz")


def test_a_killed_writes_temporary_file_is_evicted_once_stale(tmp_path):
    """(A write killed before its rename left `.NAME.PID.tmp` in the cache for good: eviction
    counts only hash-named traces.) Only the cache's own temporary names go, and only when stale."""
    import os
    import time

    from klotski_sim.files.disk_cache import STALE_TEMP_S, evict

    stale = tmp_path / ".0123456789abcdef0123.npz.4242.tmp"
    fresh = tmp_path / ".fedcba9876543210fedc.npz.4243.tmp"
    theirs = tmp_path / ".notes.npz.1.tmp"
    for path in (stale, fresh, theirs):
        path.write_bytes(b"x" * 10)
    old = time.time() - STALE_TEMP_S - 60
    os.utime(stale, (old, old))
    os.utime(theirs, (old, old))
    evict(tmp_path, 1 << 30)
    assert not stale.exists() and fresh.exists() and theirs.exists()


def test_a_cached_trace_replaced_by_another_models_is_drawn_again(tmp_path, monkeypatch):
    """A cache file overwritten by a valid trace of another shape failed every later run of its
    configuration ("the trace (recorded for ...) has another shape"), naming no cache file."""
    from klotski_sim.workload.model import get_model
    from klotski_sim.workload.trace_synth import synthesize, synthesized_blocks

    m, tiny = get_model("mixtral-8x7b"), get_model("tiny-mixtral")
    monkeypatch.setenv("KLOTSKI_CACHE_DIR", str(tmp_path / "cache"))

    def drawn():
        return cache.cached_trace(
            m,
            "calibrated",
            5,
            6,
            40,
            3,
            lambda: synthesize(m, 6, 40, 3, "calibrated", 5),
            lambda: synthesized_blocks(m, 6, 40, 3, routing="calibrated", seed=5),
        )

    expected = drawn().experts.copy()
    (path,) = (tmp_path / "cache" / "traces").glob("*.npz")
    synthesize(tiny, 3, 10, 2, "calibrated", 1).save(path)
    again = drawn()
    assert again.num_experts == m.num_experts and np.array_equal(again.experts, expected)


@pytest.mark.parametrize("cache_setting", ["folder", "off"])
def test_a_long_synthetic_draw_is_said_once_before_it_begins_and_never_when_cached(
    tmp_path, monkeypatch, cache_setting
):
    """A draw estimated at `LONG_DRAW_S` or more is told to the run's listeners (the CLI: a note on
    stderr) once, with its size — also when the cache asks for the stream and then draws with
    `make` after all (the cache off, a trace below the mapping's bar) — and a run that finds its
    trace in the cache says nothing."""
    from klotski_sim.runs import runner
    from klotski_sim.util import run_size
    from klotski_sim.workload.model import get_model

    monkeypatch.setenv("KLOTSKI_CACHE_DIR", str(tmp_path / "cache") if cache_setting == "folder" else "off")
    monkeypatch.setattr(runner, "LONG_DRAW_S", 1e-6)
    heard: list[str] = []
    spec = runner.RunSpec(model="tiny-mixtral", batch_size=2, prompt_len=9, gen_len=3, num_batches=None)
    runner._synthetic_trace.cache_clear()
    with run_size.surroundings(listeners=(heard.append,)):
        runner.make_replay(spec, get_model("tiny-mixtral"), 3)
    sequences = 3 * 2 + spec.warmup_sequences
    cached = "not in the trace cache yet" if cache_setting == "folder" else "the trace cache is off"
    assert heard == [
        f"drawing the calibrated routing of {sequences} sequences x 12 tokens for tiny-mixtral "
        f"(2 layers x 4 experts; {cached}): about 0 s on this machine as loaded now"
    ]
    runner._synthetic_trace.cache_clear()
    with run_size.surroundings(listeners=(heard.append,)):
        runner.make_replay(spec, get_model("tiny-mixtral"), 3)
    runner._synthetic_trace.cache_clear()
    runner.make_replay(spec, get_model("tiny-mixtral"), 3)  # (a draw heard by no one: outside the block)
    assert len(heard) == (1 if cache_setting == "folder" else 2)  # (drawn again only without a cache)
    monkeypatch.setattr(runner, "LONG_DRAW_S", 1e6)
    runner._synthetic_trace.cache_clear()
    runner.make_replay(replace(spec, seed=1), get_model("tiny-mixtral"), 3)  # short: drawn without a word
    assert len(heard) == (1 if cache_setting == "folder" else 2)
    runner._synthetic_trace.cache_clear()
