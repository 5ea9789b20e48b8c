"""Work run in a forked process beside this one (klotski_sim/forked.py): it runs elsewhere, its
failures come back as one line, and this process's buffered output is not written twice."""

import os
import subprocess
import sys

import pytest

from klotski_sim.errors import UsageError
from klotski_sim.forked import BesideError, started_beside

from .conftest import ROOT

forking = pytest.mark.skipif(sys.platform == "win32", reason="no fork")


def _write_pid(path):
    with open(path, "w") as f:
        f.write(str(os.getpid()))


def _refuse():
    raise UsageError("timeline.csv: no room left")


def _fail():
    raise OSError(28, "No space left on device")


def _die():
    os._exit(3)


@forking
def test_the_work_runs_in_another_process_and_the_wait_returns_when_it_is_done(tmp_path):
    wait = started_beside(_write_pid, tmp_path / "pid")
    wait()
    assert int((tmp_path / "pid").read_text()) != os.getpid()


@forking
@pytest.mark.parametrize("work, message", [(_refuse, "timeline.csv: no room left"),
                                           (_fail, "[Errno 28] No space left on device"),
                                           (_die, "_die: its process ended with status 3 (killed, or out of memory?)")])
def test_what_the_work_raises_comes_back_as_one_line(work, message):
    wait = started_beside(work)
    with pytest.raises(BesideError) as err:
        wait()
    assert str(err.value) == message


@forking
def test_output_buffered_before_the_fork_is_written_once():
    """The child's exit flushes its copy of this process's buffers: flushed before the fork."""
    code = ("import sys; print('before'); from klotski_sim.forked import started_beside; "
            "started_beside(print, 'child')(); print('after')")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONUNBUFFERED"}  # (buffered, as a pipe's output is)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, check=True,
                         env=env).stdout
    assert sorted(out.splitlines()) == ["after", "before", "child"]


def _fake_machine(root, available_kb, cgroup_line, files):
    (root / "proc" / "self").mkdir(parents=True)
    (root / "proc" / "meminfo").write_text(f"MemTotal: 99999999 kB\nMemAvailable: {available_kb} kB\n")
    (root / "proc" / "self" / "cgroup").write_text(cgroup_line + "\n")
    for name, text in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text)


@pytest.mark.parametrize("cgroup_line, files, expected", [
    ("0::/box", {"sys/fs/cgroup/box/memory.max": "3000000\n", "sys/fs/cgroup/box/memory.current": "1000000\n"},
     2_000_000),  # v2: the group's limit leaves less than the machine has
    ("0::/box", {"sys/fs/cgroup/box/memory.max": "max\n", "sys/fs/cgroup/box/memory.current": "1000000\n"},
     4096 * 1024),  # v2 without a limit: the machine's
    ("4:memory:/box", {"sys/fs/cgroup/memory/box/memory.limit_in_bytes": "9223372036854771712\n",
                       "sys/fs/cgroup/memory/box/memory.usage_in_bytes": "5\n"}, 4096 * 1024),  # v1, no limit
    ("4:cpu,memory:/box", {"sys/fs/cgroup/memory/box/memory.limit_in_bytes": "1048576\n",
                           "sys/fs/cgroup/memory/box/memory.usage_in_bytes": "2000000\n"}, 0),  # v1, over it
])
def test_the_memory_available_is_the_machines_or_less_where_the_control_group_says_so(tmp_path, cgroup_line, files,
                                                                                     expected):
    from klotski_sim.machine import available_memory

    _fake_machine(tmp_path, 4096, cgroup_line, files)
    assert available_memory(tmp_path) == expected
    assert available_memory(tmp_path / "nowhere") == 0  # (unknown)


@forking
def test_without_room_for_a_copy_of_this_process_the_work_runs_here(tmp_path, monkeypatch):
    """A forked child comes to copy every page it reads: where the memory available is under
    `ROOM_FOR_A_CHILD` times this process's, the work runs in turn, here."""
    from klotski_sim import forked

    monkeypatch.setattr(forked, "available_memory", lambda: 2 * forked.resident_bytes())
    assert not forked.room_beside()
    started_beside(_write_pid, tmp_path / "pid")()
    assert int((tmp_path / "pid").read_text()) == os.getpid()
    monkeypatch.setattr(forked, "available_memory", lambda: 4 * forked.resident_bytes())
    assert forked.room_beside()
