"""`klotski-runtime` end to end."""

import subprocess
import sys

import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")

from .conftest import ROOT  # noqa: E402


def run_runtime(*args):
    proc = subprocess.run([sys.executable, "-m", "klotski_runtime.cli", *args], capture_output=True, text=True,
                          cwd=ROOT, timeout=600)
    return proc.returncode, proc.stdout, proc.stderr


def test_record_from_tiny_checkpoint(tmp_path):
    rc, _, err = run_runtime("tiny-checkpoint", "--out", str(tmp_path / "ckpt"))
    assert rc == 0, err
    rc, out, err = run_runtime("record", "--model-dir", str(tmp_path / "ckpt"), "--text", "traces/sample_text.txt",
                               "--max-tokens", "40", "--gen-len", "3", "--model-name", "tiny-mixtral",
                               "--out", str(tmp_path / "r.npz"))
    assert rc == 0, err
    assert "12 sequences" in out and (tmp_path / "r.npz").exists()


def test_record_missing_checkpoint_is_one_line(tmp_path):
    rc, _, err = run_runtime("record", "--model-dir", str(tmp_path), "--text", "traces/sample_text.txt",
                             "--out", str(tmp_path / "r.npz"))
    assert rc == 2 and "no config.json" in err and "Traceback" not in err
