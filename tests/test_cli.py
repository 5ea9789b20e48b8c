"""End to end, as a user runs it."""

import json

from .conftest import run_cli

SMALL = ["--prompt-len", "16", "--gen-len", "3", "--batch-size", "4"]


def test_simulate_writes_every_file(tmp_path):
    rc, out, err = run_cli("simulate", *SMALL, "--out", str(tmp_path))
    assert rc == 0, err
    assert "throughput" in out and "bubbles" in out
    for name in ("summary.json", "timeline.parquet", "timeline.csv", "trace.json", "timeline.png", "schedule.json"):
        assert (tmp_path / name).stat().st_size > 0, name
    trace = json.loads((tmp_path / "trace.json").read_text())
    assert any(e["ph"] == "X" for e in trace["traceEvents"])
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["model"] == "mixtral-8x7b" and summary["hardware"] == "rtx3090" and summary["status"] == "ok"


def test_models_and_profiles_list_presets():
    rc, out, _ = run_cli("models")
    assert rc == 0 and "mixtral-8x7b" in out and "352.3" in out
    rc, out, _ = run_cli("profiles")
    assert rc == 0 and "rtx3090" in out and "h200" in out


def test_bad_input_is_one_line_error(tmp_path):
    rc, _, err = run_cli("simulate", "--hardware", "nope")
    assert rc == 2 and err.startswith("error: unknown hardware profile") and "Traceback" not in err
    bad = tmp_path / "p.yaml"
    bad.write_text("name: x\ngpu: {}\n")
    rc, _, err = run_cli("simulate", "--hardware", str(bad))
    assert rc == 2 and "gpu.name" in err and "Traceback" not in err
    rc, _, err = run_cli("simulate", "--batch-size", "0")
    assert rc == 2 and "positive integer" in err
    rc, _, err = run_cli("simulate", *SMALL, "--set", "links.pcie_h2d.bandwidth=-1")
    assert rc == 2 and "greater than 0" in err


def test_oom_is_reported_with_exit_3():
    rc, out, err = run_cli("simulate", *SMALL, "--set", "gpu.memory_bytes=2e9")
    assert rc == 3 and "out of GPU memory" in out and "Traceback" not in err
