"""Fuzzing every file a user can hand us: profile YAML, sweep specs, trace .npz, JSON-lines logs and
schedule.json. Whatever the bytes, the CLI answers with a result or one `error:` line and exit
status 2 — never a traceback, never a hang."""

from __future__ import annotations

import contextlib
import io
import json
import os
import signal

import numpy as np
import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from klotski_sim.cli import main as cli
from klotski_sim.hardware.profile import load_profile

FUZZ = settings(
    max_examples=int(os.environ.get("KLOTSKI_FUZZ_EXAMPLES", "25")),
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)
SMALL_RUN = [
    "--model",
    "tiny-mixtral",
    "--batch-size",
    "2",
    "--num-batches",
    "2",
    "--prompt-len",
    "4",
    "--gen-len",
    "2",
    "--no-png",
]


def run_cli(*argv: str, seconds: int = 60) -> tuple[int, str]:
    """klotski-sim in this process: its exit status and stderr. A traceback fails the test (the
    exception propagates); a hang is cut by an alarm and fails it too."""

    def hang(*_: object) -> None:
        raise TimeoutError(f"klotski-sim {' '.join(argv)} did not answer within {seconds} s")

    err = io.StringIO()
    old = signal.signal(signal.SIGALRM, hang)
    signal.alarm(seconds)
    try:
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
            try:
                code = cli.main(list(argv))
            except SystemExit as exit_:  # argparse's own usage errors
                code = exit_.code if isinstance(exit_.code, int) else 2
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)
    return code, err.getvalue()


def check_answer(code: int, err: str) -> None:
    assert code in (0, 2, 3), (code, err)
    if code == 2:
        assert err.strip(), "an error must say what is wrong"
        assert "Traceback" not in err


json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-(10**12), 10**12) | st.floats(allow_nan=True) | st.text(max_size=12),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=12,
)


def mutated_profile(draw_path: list[str], value: object) -> dict:
    data = load_profile("rtx3090").model_dump(mode="json")
    node = data
    for key in draw_path[:-1]:
        node = node.setdefault(key, {}) if isinstance(node, dict) else node
    if isinstance(node, dict):
        node[draw_path[-1]] = value
    return data


PROFILE_PATHS = [
    ["gpu", "memory_bytes"],
    ["gpu", "reserved_bytes"],
    ["gpu", "peak_flops"],
    ["gpu", "kernel_overhead_s"],
    ["gpu", "compute_efficiency"],
    ["links", "pcie_h2d", "bandwidth"],
    ["links", "pcie_h2d", "copy_engines"],
    ["links", "pcie_d2h", "pageable_bandwidth"],
    ["links", "nvme"],
    ["host", "memory_bytes"],
    ["gpu"],
    ["name"],
    ["measured", "expert"],
    ["sources"],
    ["extra"],
]


@FUZZ
@given(path=st.sampled_from(PROFILE_PATHS), value=json_values)
def test_fuzzed_profiles(tmp_path_factory, path, value):
    f = tmp_path_factory.mktemp("p") / "profile.yaml"
    f.write_text(yaml.safe_dump(mutated_profile(path, value)))
    check_answer(*run_cli("simulate", "--hardware", str(f), *SMALL_RUN))


@FUZZ
@given(text=st.text(max_size=300))
def test_fuzzed_profile_text(tmp_path_factory, text):
    f = tmp_path_factory.mktemp("p") / "profile.yaml"
    f.write_text(text)
    check_answer(*run_cli("simulate", "--hardware", str(f), *SMALL_RUN))


SPEC_KEYS = [
    "name",
    "models",
    "hardware",
    "overrides",
    "policies",
    "batch_sizes",
    "num_batches",
    "prompt_lens",
    "gen_lens",
    "routings",
    "seeds",
    "kv",
    "experts",
    "impls",
    "bogus",
]


@FUZZ
@given(changes=st.dictionaries(st.sampled_from(SPEC_KEYS), json_values, max_size=3))
def test_fuzzed_sweep_specs(tmp_path_factory, changes):
    base = {
        "name": "f",
        "models": ["tiny-mixtral"],
        "policies": ["klotski"],
        "batch_sizes": [2],
        "num_batches": [2],
        "prompt_lens": [4],
        "gen_lens": [2],
    }
    folder = tmp_path_factory.mktemp("s")
    (folder / "spec.yaml").write_text(yaml.safe_dump({**base, **changes}))
    check_answer(*run_cli("sweep", str(folder / "spec.yaml"), "--out", str(folder / "out"), "--no-progress"))


def _trace_arrays(draw: st.DrawFn) -> dict[str, np.ndarray]:
    tokens = draw(st.integers(0, 12))
    arrays = {
        "experts": np.array(
            draw(st.lists(st.integers(-3, 9), min_size=tokens * 4, max_size=tokens * 4)), dtype=np.int64
        )
        .astype(draw(st.sampled_from([np.int16, np.uint8, np.float32, np.int64])))
        .reshape(tokens, 2, 2)
        if tokens
        else np.zeros((0, 2, 2), np.int16),
        "seq_offsets": np.array(
            draw(st.lists(st.integers(-2, 14), min_size=1, max_size=4)),
            dtype=draw(st.sampled_from([np.int64, np.float64])),
        ),
        "prompt_lens": np.array(draw(st.lists(st.integers(-2, 14), max_size=3)), dtype=np.int32),
        "meta": np.array(
            json.dumps(
                draw(
                    st.sampled_from(
                        [
                            {
                                "format": "klotski-routing-trace",
                                "version": 1,
                                "model": "tiny-mixtral",
                                "num_experts": 4,
                                "top_k": 2,
                                "num_layers": 2,
                            },
                            {
                                "format": "klotski-routing-trace",
                                "version": 1,
                                "model": "x",
                                "num_experts": 10**9,
                                "top_k": 2,
                                "num_layers": 2,
                            },
                            {"format": "klotski-routing-trace", "version": 1, "num_experts": "4"},
                            [1, 2],
                            "text",
                            None,
                        ]
                    )
                )
            )
        ),
    }
    for name in draw(st.lists(st.sampled_from(list(arrays)), max_size=2)):
        arrays.pop(name, None)
    return arrays


@FUZZ
@given(data=st.data())
def test_fuzzed_trace_files(tmp_path_factory, data):
    f = tmp_path_factory.mktemp("t") / "trace.npz"
    np.savez(f, **_trace_arrays(data.draw))
    check_answer(*run_cli("trace", "stats", str(f)))
    check_answer(*run_cli("simulate", "--trace", str(f), "--wrap", "--warmup-sequences", "0", *SMALL_RUN))


@FUZZ
@given(data=st.data(), deflated=st.booleans())
def test_fuzzed_trace_files_unpacked_into_the_cache(tmp_path_factory, monkeypatch, data, deflated):
    """The same files, their arrays unpacked into the trace cache and mapped (disk_cache.unpacked_array,
    its size floor lowered to a byte): the same one-line answers."""
    from klotski_sim.files import disk_cache

    folder = tmp_path_factory.mktemp("t")
    monkeypatch.setenv("KLOTSKI_CACHE_DIR", str(folder / "cache"))
    monkeypatch.setattr(disk_cache, "MAPPED_ABOVE", 1)
    (np.savez_compressed if deflated else np.savez)(folder / "trace.npz", **_trace_arrays(data.draw))
    check_answer(*run_cli("trace", "stats", str(folder / "trace.npz")))
    check_answer(
        *run_cli("simulate", "--trace", str(folder / "trace.npz"), "--wrap", "--warmup-sequences", "0", *SMALL_RUN)
    )


@FUZZ
@given(blob=st.binary(max_size=200))
def test_fuzzed_trace_bytes(tmp_path_factory, blob):
    f = tmp_path_factory.mktemp("t") / "trace.npz"
    f.write_bytes(blob)
    check_answer(*run_cli("trace", "stats", str(f)))


record = st.fixed_dictionaries(
    {},
    optional={
        "seq_id": json_values,
        "token_idx": json_values | st.integers(0, 6),
        "layer": json_values | st.integers(0, 1),
        "experts": json_values | st.lists(st.integers(0, 3), min_size=2, max_size=2),
        "gating_probs": json_values,
        "prompt_len": json_values,
    },
)


@FUZZ
@given(records=st.lists(record | json_values, max_size=8))
def test_fuzzed_jsonl_logs(tmp_path_factory, records):
    folder = tmp_path_factory.mktemp("j")
    (folder / "log.jsonl").write_text("\n".join(json.dumps(r) for r in records))
    check_answer(*run_cli("trace", "import", str(folder / "log.jsonl"), "--out", str(folder / "t.npz")))


@pytest.fixture(scope="module")
def simulated(tmp_path_factory):
    out = tmp_path_factory.mktemp("sim")
    code, err = run_cli("simulate", "--policy", "klotski", *SMALL_RUN, "--out", str(out))
    assert code == 0, err
    return json.loads((out / "schedule.json").read_text())


@FUZZ
@given(
    field=st.sampled_from(
        [
            "id",
            "kind",
            "stream",
            "category",
            "deps",
            "bytes",
            "batches",
            "alloc",
            "free",
            "layer",
            "expert",
            "pageable",
            "tokens",
            "bogus",
        ]
    ),
    value=json_values,
    which=st.integers(0, 50),
)
def test_fuzzed_schedules_for_execute(tmp_path_factory, simulated, field, value, which):
    """A mutated schedule.json is refused with one line by the same loader `execute` uses."""
    from klotski_runtime import cli as runtime_cli

    folder = tmp_path_factory.mktemp("e")
    data = json.loads(json.dumps(simulated))
    op = data["ops"][which % len(data["ops"])]
    op[field] = value
    (folder / "schedule.json").write_text(json.dumps(data))
    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        code = runtime_cli.main(["execute", str(folder / "schedule.json"), "--routing", str(folder / "missing.npz")])
    check_answer(code, err.getvalue())
