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
