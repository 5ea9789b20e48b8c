"""Shared fixtures: small hand-checkable profiles and schedules."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
from hypothesis import HealthCheck, settings

from klotski_sim.hardware import HardwareProfile, profile_from_dict

settings.register_profile("ci", max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
settings.register_profile("dev", max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
settings.load_profile("ci" if os.environ.get("CI") else "dev")

ROOT = Path(__file__).resolve().parents[1]


def make_profile(memory_bytes: float = 1e12, copy_engines: int = 1, **gpu: float) -> HardwareProfile:
    """A profile with round numbers: 1 TFLOP/s, 1 TB/s, 1 GB/s links, no overheads."""
    data = {
        "name": "test",
        "gpu": {"name": "test-gpu", "memory_bytes": memory_bytes, "reserved_bytes": 0, "peak_flops": 1e12,
                "memory_bandwidth": 1e12, "compute_efficiency": 1.0, "memory_efficiency": 1.0,
                "kernel_overhead_s": 0.0, **gpu},
        "links": {"pcie_h2d": {"bandwidth": 1e9, "latency_s": 0.0, "copy_engines": copy_engines},
                  "pcie_d2h": {"bandwidth": 1e9, "latency_s": 0.0, "copy_engines": copy_engines},
                  "nvme": {"bandwidth": 1e9, "latency_s": 0.0, "copy_engines": 1}},
        "host": {"memory_bytes": 1e12},
        "disk": {"capacity_bytes": 1e13},
    }
    return profile_from_dict(data, "test-profile")


@pytest.fixture
def profile() -> HardwareProfile:
    return make_profile()


def run_cli(*args: str) -> tuple[int, str, str]:
    """Run `klotski-sim` in-process-free (a real subprocess), as a user would."""
    import subprocess

    proc = subprocess.run([sys.executable, "-m", "klotski_sim.cli", *args], capture_output=True, text=True,
                          cwd=ROOT, timeout=600)
    return proc.returncode, proc.stdout, proc.stderr


def run_on_a_full_disk(module: str, *args: str, room: int = 64) -> tuple[int, str, str]:
    """Run `python -m module args` as if its disk held `room` more bytes per file: a write past them
    fails with EFBIG ("File too large"), as ENOSPC would on a full disk (SIGXFSZ ignored, so the write
    fails rather than killing the process; Python's own caches are written best-effort)."""
    import resource
    import signal
    import subprocess

    def limited() -> None:
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # (kept across exec: an ignored signal stays ignored)
        resource.setrlimit(resource.RLIMIT_FSIZE, (room, room))

    proc = subprocess.run([sys.executable, "-m", module, *args], capture_output=True, text=True, cwd=ROOT,
                          timeout=600, preexec_fn=limited)
    return proc.returncode, proc.stdout, proc.stderr


def folder_state(folder: Path) -> dict[str, bytes]:
    """Every file of a folder, by name, with its bytes: what an output folder held, to compare after."""
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir())}
