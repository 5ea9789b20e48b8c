"""Progress lines of long commands, and the estimates that measure this machine."""

import subprocess
import sys

from klotski_sim.util import machine
from klotski_sim.util.progress import Progress
from klotski_sim.util.units import span_text

from .conftest import ROOT


def test_progress_lines_say_the_first_and_last_item_and_estimate_only_from_items_done():
    now = [0.0]
    lines: list[str] = []
    p = Progress("sweep x", 10, out=lines.append, clock=lambda: now[0], min_interval_s=5.0)
    for step in range(10):
        now[0] += 2.0  # each item takes 2 s
        p.done(f"(#{step})")
    assert lines[0] == "sweep x: 1/10 (#0), 2 s, about 18 s left"
    assert lines[-1] == "sweep x: 10/10 (#9), 20 s"  # (the last: no time left said)
    assert [line.split(",")[0] for line in lines] == [
        "sweep x: 1/10 (#0)",
        "sweep x: 4/10 (#3)",  # (5 s apart)
        "sweep x: 7/10 (#6)",
        "sweep x: 10/10 (#9)",
    ]
    assert all("left" in line for line in lines[:-1])


def test_a_resumed_progress_estimates_from_what_it_finished_itself():
    now = [0.0]
    lines: list[str] = []
    p = Progress("sweep", 4, done=2, out=lines.append, clock=lambda: now[0])
    now[0] = 30.0
    p.done()
    assert lines == ["sweep: 3/4, 30 s, about 30 s left"]  # (not 4 x 10 s: the two done before took no time here)
    disabled: list[str] = []
    Progress("x", 1, enabled=False, out=disabled.append).done()
    assert disabled == []


def test_span_text_reads_as_a_person_would():
    assert [span_text(s) for s in (4.4, 59.4, 90, 5400)] == ["4 s", "59 s", "1.5 min", "1.5 h"]


def test_the_machine_slowdown_is_measured_once_and_bounded(monkeypatch):
    monkeypatch.setattr(machine, "_slowdown", [])
    monkeypatch.setattr(machine, "_speed_probe", lambda: machine.SPEED_PROBE_REFERENCE_S * 3)
    assert machine.slowdown() == 3.0
    monkeypatch.setattr(machine, "_speed_probe", lambda: 0.0)
    assert machine.slowdown() == 3.0  # (once a process)
    monkeypatch.setattr(machine, "_slowdown", [])
    assert machine.slowdown() == 0.25  # (a fast machine is not promised below a quarter)


def test_a_sweep_whose_stderr_is_a_file_prints_progress_lines(tmp_path):
    """The rich bar printed nothing until the end where stderr was not a terminal (a log, CI)."""
    spec = tmp_path / "s.yaml"
    spec.write_text(
        "name: lines\nmodels: [tiny-mixtral]\nhardware: [rtx3090]\npolicies: [klotski, flexgen]\n"
        "batch_sizes: [2]\nnum_batches: [2]\nprompt_lens: [8]\ngen_lens: [2]\n"
    )
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "klotski_sim.cli.main",
            "sweep",
            str(spec),
            "--out",
            str(tmp_path / "o"),
            "--workers",
            "1",
        ],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr
    said = [line for line in proc.stderr.splitlines() if line.startswith("sweep lines: ")]
    assert said and said[0].startswith("sweep lines: 1/2,") and said[-1].startswith("sweep lines: 2/2,"), proc.stderr
    assert "about" not in proc.stdout.splitlines()[0]  # (no estimate from a constant of another machine)
