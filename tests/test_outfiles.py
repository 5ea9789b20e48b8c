"""A command's output files are written all or none: a run stopped or failing while it writes leaves
its output folder as it was (an earlier run's files whole, no temporary); a run that completes
replaces the earlier run's files and removes those of them it does not write."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from contextlib import contextmanager

import pytest

from klotski_sim.cli.simulate import SIMULATE_FILES
from klotski_sim.files.outfiles import OutputFiles, follow_symlinks
from klotski_sim.report import exports
from klotski_sim.runs.runner import RunSpec, run
from klotski_sim.util.errors import UsageError

from .conftest import folder_state, overriding, run_cli

SMALL = ["--model", "tiny-mixtral", "--prompt-len", "16", "--gen-len", "3"]


@pytest.fixture(scope="module")
def tiny_timeline():
    return run(RunSpec(model="tiny-mixtral", prompt_len=16, gen_len=3)).timeline


@contextmanager
def following_links():
    """As --follow-symlinks: outputs written through a link at their name."""
    follow_symlinks(True)
    try:
        yield
    finally:
        follow_symlinks(False)


def test_files_appear_only_at_commit_and_keep_their_suffix(tmp_path):
    (tmp_path / "a.txt").write_text("old a")
    (tmp_path / "gone.png").write_text("an earlier figure")
    (tmp_path / "linked.png").symlink_to(tmp_path / "no-such-file.png")  # (dangling: removed as well)
    with OutputFiles(tmp_path, stale=["a.txt", "gone.png", "linked.png", "never-made.csv"]) as files:
        files.path("a.txt").write_text("new a")
        files.path("b.json.gz").write_text("new b")
        assert files.path("b.json.gz").name.endswith(".json.gz")  # (writers choose a format by it)
        assert (tmp_path / "a.txt").read_text() == "old a" and not (tmp_path / "b.json.gz").exists()
        assert files.commit() == ["a.txt", "b.json.gz"]
    assert folder_state(tmp_path) == {"a.txt": b"new a", "b.json.gz": b"new b"}
    assert files.removed == ["gone.png", "linked.png"]


@pytest.mark.parametrize("stop", [KeyboardInterrupt, OSError])
def test_files_left_without_a_commit_leave_the_folder_as_it_was(tmp_path, stop):
    (tmp_path / "a.txt").write_text("old a")
    with pytest.raises(stop), OutputFiles(tmp_path, stale=["a.txt"]) as files:
        files.path("a.txt").write_text("new a")
        files.path("b.txt").write_text("new b")
        raise stop()
    assert folder_state(tmp_path) == {"a.txt": b"old a"}


def test_save_all_failing_half_way_keeps_the_earlier_timeline(tmp_path, monkeypatch, tiny_timeline):
    exports.save_all(tiny_timeline, tmp_path)
    before = folder_state(tmp_path)

    def full_disk(*_args, **_kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(exports, "to_chrome_trace", full_disk)  # (after the summary, Parquet and CSV)
    with pytest.raises(
        UsageError,
        match=r": cannot write trace.json.gz \(No space left on device\); the folder is "
        r"as it was$",
    ):
        exports.save_all(tiny_timeline, tmp_path)
    assert folder_state(tmp_path) == before


def test_simulate_stopped_while_it_writes_leaves_the_earlier_run(tmp_path):
    """SIGTERM as the CSV is written (sent by the process to itself there: no race): the folder holds
    the earlier run's files, unchanged, and no temporary; it held a new summary beside the earlier
    schedule and a cut trace."""
    out = tmp_path / "out"
    rc, _, err = run_cli("simulate", *SMALL, "--out", str(out))
    assert rc == 0, err
    before = folder_state(out)
    stop_in_csv = (
        "import os, signal, sys\n"
        "from klotski_sim.report import exports\n"
        "from klotski_sim.cli import main as cli\n"
        "def stopped(*args, **kwargs):\n"
        "    os.kill(os.getpid(), signal.SIGTERM)\n"
        "exports.to_csv = stopped\n"
        "sys.exit(cli.main(sys.argv[1:]))\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", stop_in_csv, "simulate", *overriding(SMALL, "--gen-len", "4"), "--out", str(out)],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ},
    )
    assert proc.returncode == 128 + signal.SIGTERM and proc.stderr.splitlines()[-1] == "terminated", proc.stderr
    assert folder_state(out) == before


def test_simulate_into_an_earlier_run_replaces_it_and_says_what_it_removed(tmp_path):
    rc, _, err = run_cli("simulate", *SMALL, "--out", str(tmp_path))
    assert rc == 0 and (tmp_path / "timeline.png").exists(), err
    rc, out, err = run_cli("simulate", *overriding(SMALL, "--gen-len", "4"), "--no-png", "--out", str(tmp_path))
    assert rc == 0, err
    assert "(removed an earlier run's timeline.png)" in out.splitlines()[-1]
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(
        ["summary.json", "timeline.parquet", "timeline.csv", "trace.json.gz", "schedule.json", "routing.npz"]
    )
    assert json.loads((tmp_path / "summary.json").read_text())["gen_len"] == 4


def test_compare_without_traces_removes_an_earlier_comparisons_traces(tmp_path):
    args = ("compare", *SMALL, "--policies", "klotski,flexgen", "--no-png", "--workers", "1", "--out", str(tmp_path))
    rc, _, err = run_cli(*args, "--traces")
    assert rc == 0 and (tmp_path / "trace_klotski.json.gz").exists() and (tmp_path / "trace_flexgen.json.gz").exists()
    rc, out, err = run_cli(*args)
    assert rc == 0, err
    assert "removed an earlier run's trace_flexgen.json.gz, trace_klotski.json.gz" in out.splitlines()[-1]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["compare.csv", "compare.json", "plan.txt"]


def test_a_folder_where_a_file_goes_is_refused_before_the_run(tmp_path):
    (tmp_path / "timeline.csv").mkdir()
    (tmp_path / "summary.json").write_text("an earlier summary")
    rc, out, err = run_cli("simulate", *SMALL, "--out", str(tmp_path))
    assert rc == 2 and err.strip() == (
        f"error: --out {tmp_path}: {tmp_path / 'timeline.csv'} is a folder; cannot write timeline.csv there"
    )
    assert out == "" and (tmp_path / "summary.json").read_text() == "an earlier summary"
    with pytest.raises(UsageError, match="timeline.csv is a folder"), OutputFiles(tmp_path) as files:
        files.path("summary.json").write_text("new")
        files.path("timeline.csv").write_text("new")
        files.commit()  # (refused before the first rename: the summary is not replaced either)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["summary.json", "timeline.csv"]
    assert (tmp_path / "summary.json").read_text() == "an earlier summary"


def test_a_write_that_fails_is_said_of_the_file_not_of_its_temporary(tmp_path):
    with pytest.raises(UsageError) as refused, OutputFiles(tmp_path) as files:
        temporary = files.path("timeline.parquet")
        raise OSError(28, "No space left on device", str(temporary))
    assert str(refused.value) == (
        f"{tmp_path}: cannot write timeline.parquet (No space left on device); the folder is as it was"
    )
    assert list(tmp_path.iterdir()) == []


def test_a_linked_output_file_is_written_through_its_link(tmp_path, tiny_timeline):
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (elsewhere / "kept.csv").write_text("old")
    out = tmp_path / "out"
    out.mkdir()
    (out / "timeline.csv").symlink_to(elsewhere / "kept.csv")
    with pytest.raises(UsageError, match=r"timeline.csv: is a symbolic link .*--follow-symlinks"):
        exports.save_all(tiny_timeline, out, png=False)  # (not asked for: refused, nothing written)
    assert (elsewhere / "kept.csv").read_text() == "old" and sorted(p.name for p in out.iterdir()) == ["timeline.csv"]
    with following_links():
        exports.save_all(tiny_timeline, out, png=False)
    assert (out / "timeline.csv").is_symlink() and (elsewhere / "kept.csv").read_text().startswith('"op_id"')


STOPPED_IN_COMMIT = """
import os, pathlib, signal, sys
from klotski_sim.cli import main as cli
replace = pathlib.Path.replace
def first_rename_then_stopped(self, target):
    if pathlib.Path(target).name == "summary.json":  # (the first file renamed into place: no race)
        os.kill(os.getpid(), signal.SIGTERM)
    return replace(self, target)
pathlib.Path.replace = first_rename_then_stopped
sys.exit(cli.main(sys.argv[1:]))
"""


def test_a_stop_among_the_renames_comes_after_them(tmp_path):
    """SIGTERM as the first file is renamed: the renames finish (the folder holds the new run whole,
    not one new file beside the earlier run's), then the command stops as it would have."""
    rc, _, err = run_cli("simulate", *SMALL, "--out", str(tmp_path))
    assert rc == 0, err
    proc = subprocess.run(
        [
            sys.executable,
            "-c",
            STOPPED_IN_COMMIT,
            "simulate",
            *overriding(SMALL, "--gen-len", "4"),
            "--out",
            str(tmp_path),
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 128 + signal.SIGTERM and proc.stderr.splitlines()[-1] == "terminated", proc.stderr
    assert json.loads((tmp_path / "summary.json").read_text())["gen_len"] == 4
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(SIMULATE_FILES)
    schedule = json.loads((tmp_path / "schedule.json").read_text())
    assert schedule["meta"]["gen_len"] == 4  # (the last file renamed is of the new run too)


COMMITTER = """
import sys
from klotski_sim.files.outfiles import OutputFiles, follow_symlinks
with OutputFiles(sys.argv[1]) as files:
    files.path("a.txt").write_text("new")
    print("written", flush=True)
    files.commit()
"""


def test_a_commit_waits_for_another_into_the_same_folder(tmp_path):
    """Two runs into one folder at once: each one's renames wait for the other's (a lock on the
    folder), so the folder ends with one run's files, not a mix of both."""
    from klotski_sim.files.outfiles import _folder_locked

    with _folder_locked(tmp_path):
        proc = subprocess.Popen([sys.executable, "-c", COMMITTER, str(tmp_path)], stdout=subprocess.PIPE, text=True)
        assert proc.stdout.readline() == "written\n"
        time.sleep(0.5)  # (its commit, a rename, would take microseconds)
        assert not (tmp_path / "a.txt").exists() and proc.poll() is None
    assert proc.wait(timeout=60) == 0 and (tmp_path / "a.txt").read_text() == "new"


def test_a_file_that_cannot_be_put_in_place_undoes_the_others(tmp_path, monkeypatch, tiny_timeline):
    """The third file of a commit cannot be moved (another user's file in a sticky folder, say):
    the two moved before it are put back as they were, and the error says so in one line."""
    from klotski_sim.files import outfiles

    exports.save_all(tiny_timeline, tmp_path)
    before = folder_state(tmp_path)
    move, moved = outfiles._move, []

    def third_refused(temporary, target):
        if len(moved) == 2:
            raise PermissionError(1, "Operation not permitted", str(target))
        moved.append(target.name)
        move(temporary, target)

    monkeypatch.setattr(outfiles, "_move", third_refused)
    with pytest.raises(
        UsageError,
        match=r"cannot write timeline.csv \(Operation not permitted\); the folder is as "
        r"it was",
    ):
        exports.save_all(tiny_timeline, tmp_path, png=False)
    assert moved == ["summary.json", "timeline.parquet"] and folder_state(tmp_path) == before


def test_a_link_into_a_missing_folder_leaves_the_folder_as_it_was(tmp_path, tiny_timeline):
    exports.save_all(tiny_timeline, tmp_path)
    (tmp_path / "trace.json.gz").unlink()
    (tmp_path / "trace.json.gz").symlink_to(tmp_path / "no-such-folder" / "t.json.gz")
    before = {p.name: (p.read_bytes() if not p.is_symlink() else "link") for p in tmp_path.iterdir()}
    with (
        following_links(),
        pytest.raises(UsageError, match=r"cannot write trace.json.gz \(No such file or directory\)"),
    ):
        exports.save_all(tiny_timeline, tmp_path)
    assert {p.name: (p.read_bytes() if not p.is_symlink() else "link") for p in tmp_path.iterdir()} == before


def test_a_file_system_without_hard_links_keeps_the_earlier_files_by_copy(tmp_path, monkeypatch, tiny_timeline):
    exports.save_all(tiny_timeline, tmp_path)

    def no_hard_links(*_args):
        raise OSError(1, "Operation not permitted")

    monkeypatch.setattr(os, "link", no_hard_links)
    assert sorted(exports.save_all(tiny_timeline, tmp_path)) == sorted(p.name for p in tmp_path.iterdir())


def test_a_replaced_file_keeps_its_permissions(tmp_path, tiny_timeline):
    exports.save_all(tiny_timeline, tmp_path)
    (tmp_path / "timeline.csv").chmod(0o600)
    exports.save_all(tiny_timeline, tmp_path)
    assert (tmp_path / "timeline.csv").stat().st_mode & 0o777 == 0o600
