"""Stopping a run from outside: SIGTERM (`timeout`, a batch scheduler, `kill`), SIGHUP and Ctrl-C end it at
once with one line, its worker processes with it, and leave no temporary file; a worker never
outlives its parent, even one killed by SIGKILL. (Linux: /proc tells a process's children.)

Every subprocess here is started by `conftest.start`/`run`: with SIGHUP, SIGINT and SIGTERM at their defaults
(`nohup`, or a shell starting the suite in the background, left them ignored, and an ignored signal stays
ignored: the stops sent went unheard), in a session of its own that is killed whole when the test ends."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from klotski_sim.runs.runner import _worker_start as _original_worker_start
from klotski_sim.runs.runner import worker_pool
from klotski_sim.util.stopping import STOP_WORDS

from .conftest import ROOT, run, start, stop

pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="reads /proc (Linux)")

HANG_S = 60  # (a hang guard, not a timing: each of these ends within a second when it works)
# Configurations in a sweep stopped while it runs: enough that a stop finds most not run yet, few enough
# that one not stopped ends in seconds (400 of them, on a local Dask cluster, ran on for 11 minutes)
SWEEP_SIZE = 24
DASK_SWEEP_SIZE = 12  # (of default-size runs: a second or so each)


def _children(pid: int) -> list[int]:
    return [int(c) for c in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]


def _running(pid: int) -> bool:
    """Alive and not a zombie (a dead child its new parent has not reaped yet)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def _wait_gone(pids: list[int]) -> list[int]:
    """The pids still running after up to HANG_S seconds (killed then, so that a failing test leaves
    no process behind)."""
    deadline = time.monotonic() + HANG_S
    while any(map(_running, pids)) and time.monotonic() < deadline:
        time.sleep(0.05)
    left = [pid for pid in pids if _running(pid)]
    for pid in left:
        os.kill(pid, signal.SIGKILL)
    return left


def _wait_for(found, what: str, proc: subprocess.Popen) -> None:
    deadline = time.monotonic() + HANG_S
    while not found():
        if proc.poll() is not None or time.monotonic() > deadline:
            _, err = stop(proc)  # (the process and all it started: a sweep's workers held its stderr open)
            pytest.fail(f"{what} never happened (exit status {proc.returncode}): {(err or '')[-500:]}")
        time.sleep(0.02)


def _cli(*args: str, **env: str) -> subprocess.Popen:
    return start(
        [sys.executable, "-m", "klotski_sim.cli.main", *args],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, **env},
    )


def test_sigterm_ends_a_sweep_at_once_and_its_workers_with_it(tmp_path):
    """A sweep on two workers: its rows so far kept, nothing more run (a process pool left by an
    exception ran its whole queue first), "terminated" and exit status 143, no worker left (they
    waited on their queue forever)."""
    # (runs of a few tenths of a second: the grid's 24 take seconds on two workers, a stop in the first
    # row's tenth of a second leaves most not run; 400 runs of hundredths ran on for minutes when it failed)
    seeds = ", ".join(map(str, range(SWEEP_SIZE)))
    (tmp_path / "spec.yaml").write_text(
        f"name: long\nmodels: [tiny-mixtral]\nhardware: [rtx3090]\n"
        f"policies: [klotski]\nseeds: [{seeds}]\nprompt_lens: [32]\ngen_lens: [512]\n"
    )
    rows = tmp_path / "out" / "rows"
    proc = _cli("sweep", str(tmp_path / "spec.yaml"), "--out", str(tmp_path / "out"), "--workers", "2", "--no-progress")
    # (a row written whole: `any(rows.iterdir())` also saw a row's temporary, which the stop then removed)
    _wait_for(lambda: rows.is_dir() and any(rows.glob("*.json")), "a first row", proc)
    workers = _children(proc.pid)
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=HANG_S)
    assert proc.returncode == 143 and err.splitlines()[-1] == "terminated" and "Traceback" not in err
    assert len(workers) == 2 and _wait_gone(workers) == []
    assert 1 <= len(list(rows.glob("*.json"))) < SWEEP_SIZE


@pytest.mark.parametrize("command", ["sweep", "compare"])
def test_ctrl_c_to_the_process_group_of_a_pool_ends_in_one_word(tmp_path, command):
    """A terminal sends Ctrl-C to the whole group: the workers too. They printed multiprocessing's
    `Process ForkProcess-2:` beside the command's `interrupted` (now and then: it depends on where
    a worker is when the signal comes; `test_a_worker_leaves_ctrl_c_to_its_parent` holds the cause);
    now only the parent takes it, and says one word after its progress lines."""
    seeds = ", ".join(map(str, range(DASK_SWEEP_SIZE)))
    # (default-size runs, a second or so each: the stop finds both workers at work, as a user's Ctrl-C does)
    (tmp_path / "spec.yaml").write_text(
        f"name: long\nmodels: [mixtral-8x7b]\nhardware: [rtx3090]\npolicies: [klotski]\nimpls: [ideal]\n"
        f"seeds: [{seeds}]\n"
    )
    out = tmp_path / "out"
    if command == "sweep":
        proc = _cli("sweep", str(tmp_path / "spec.yaml"), "--out", str(out), "--workers", "2", "--no-progress")
        _wait_for(lambda: (out / "rows").is_dir() and any((out / "rows").glob("*.json")), "a first row", proc)
    else:
        proc = _cli("compare", "--model", "mixtral-8x7b", "--workers", "2", "--no-png", "--out", str(out))
        _wait_for(lambda: len(_children(proc.pid)) >= 2, "two workers", proc)
        time.sleep(1.0)  # (both at work)
    family = [proc.pid, *_children(proc.pid)]
    os.killpg(proc.pid, signal.SIGINT)
    _, err = proc.communicate(timeout=HANG_S)
    lines = err.splitlines()
    assert proc.returncode == 130 and lines[-1] == "interrupted", err[-3000:]
    assert all(line.startswith(f"{command}: ") for line in lines[:-1]), err[-3000:]  # (its progress lines alone)
    assert _wait_gone(family) == []


def _descendants(pid: int) -> list[int]:
    """Every process below `pid`, whichever of its threads started it (a Dask cluster's are started
    by its event loop's thread, which `_children` of the main thread does not list)."""
    found = []
    try:
        for task in Path(f"/proc/{pid}/task").iterdir():
            for child in map(int, (task / "children").read_text().split()):
                found += [child, *_descendants(child)]
    except OSError:  # (gone meanwhile)
        pass
    return found


def _caught(pid: int, signum: int) -> bool:
    """Whether the process has a handler of its own for `signum` (/proc's SigCgt mask)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("SigCgt:"):
            return bool(int(line.split()[1], 16) >> (signum - 1) & 1)
    return False


DASK_STOPS = [
    ("SIGTERM", "process", "after two rows"),
    ("SIGINT", "group", "after two rows"),
    ("SIGHUP", "group", "after two rows"),
    ("SIGTERM", "group", "after two rows"),
    ("SIGTERM", "process", "as the cluster starts"),
]


@pytest.mark.parametrize("name, to, when", DASK_STOPS, ids=[" ".join(c) for c in DASK_STOPS])
def test_a_stopped_local_dask_sweep_ends_in_one_line(tmp_path, name, to, when):
    """As a local pool's: one line, the signal's status, no process left, the rows kept. A terminal
    sends Ctrl-C and a hang-up to its whole process group, and a batch scheduler may send SIGTERM
    so too. Before: the workers' WARNING lines of cancelled tasks, a KeyboardInterrupt traceback of
    each nanny and worker process, KeyError tracebacks of a resource tracker killed by the hang-up,
    and, stopped as the cluster started, a traceback of its exit hook failing to close it."""
    pytest.importorskip("dask.distributed")
    signum = getattr(signal, name)
    seeds = ", ".join(map(str, range(DASK_SWEEP_SIZE)))
    # (default-size runs, a second or so each: the stop finds both workers' tasks in flight)
    (tmp_path / "spec.yaml").write_text(
        f"name: long\nmodels: [mixtral-8x7b]\nhardware: [rtx3090]\n"
        f"policies: [klotski]\nimpls: [ideal]\nseeds: [{seeds}]\n"
    )
    rows = tmp_path / "out" / "rows"
    proc = _cli(
        "sweep",
        str(tmp_path / "spec.yaml"),
        "--out",
        str(tmp_path / "out"),
        "--workers",
        "2",
        "--dask",
        "local",
        "--no-progress",
    )
    if when == "after two rows":
        _wait_for(lambda: rows.is_dir() and len(list(rows.glob("*.json"))) >= 2, "two rows", proc)
    else:
        _wait_for(lambda: _descendants(proc.pid), "a first process of the cluster", proc)
    family = [proc.pid, *_descendants(proc.pid)]
    if to == "group":
        os.killpg(proc.pid, signum)
    else:
        proc.send_signal(signum)
    _, err = proc.communicate(timeout=HANG_S)
    assert proc.returncode == 128 + signum and err.splitlines() == [STOP_WORDS[signum]], err[-3000:]
    assert _wait_gone(family) == []
    assert len(list(rows.iterdir())) < DASK_SWEEP_SIZE if rows.is_dir() else when == "as the cluster starts"


@pytest.mark.parametrize("name", ["SIGINT", "SIGTERM", "SIGHUP"])
def test_a_console_script_takes_a_stop_while_its_command_is_imported(tmp_path, name):
    """`klotski-sim` and `klotski-runtime` import their command half a second before it sets its own
    handler; the console scripts (klotski_sim.cli.entry) take the stops first: a Ctrl-C then ended in a
    KeyboardInterrupt traceback, SIGTERM and SIGHUP silently (status -15 / -1). A module that takes
    a minute to import stands in for the command's."""
    signum = getattr(signal, name)
    (tmp_path / "slow_to_import.py").write_text("import time\ntime.sleep(HANG := 60)\ndef main():\n    return 0\n")
    code = (
        f"import sys; sys.path.insert(0, {str(tmp_path)!r}); "
        "from klotski_sim.cli.entry import run_main; sys.exit(run_main('slow_to_import'))"
    )
    proc = start([sys.executable, "-c", code], stderr=subprocess.PIPE, text=True)
    _wait_for(lambda: _caught(proc.pid, signal.SIGHUP), "the entry's handlers", proc)  # (Python catches SIGINT itself)
    proc.send_signal(signum)
    _, err = proc.communicate(timeout=HANG_S)
    assert proc.returncode == 128 + signum and err.splitlines() == [STOP_WORDS[signum]], err[-2000:]


def test_the_console_scripts_are_the_entry_that_takes_the_stops_first(monkeypatch):
    import tomllib

    from klotski_sim.cli import entry

    scripts = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]
    assert scripts == {
        "klotski-sim": "klotski_sim.cli.entry:simulator",
        "klotski-runtime": "klotski_sim.cli.entry:runtime",
    }
    monkeypatch.setattr(entry, "run_main", lambda module: module)
    assert (entry.simulator(), entry.runtime()) == ("klotski_sim.cli.main", "klotski_runtime.cli")


def test_sigterm_while_routing_is_drawn_into_the_cache_leaves_no_temporary_file(tmp_path):
    """DeepSeek-V3's routing is drawn into the trace cache block by block (20 s): SIGTERM on the way
    left its temporary file (38 MB) until the cache's hour-old clean-up, and said nothing."""
    cache = tmp_path / "cache"
    proc = _cli(
        "simulate", "--model", "deepseek-v3", "--hardware", "h800", "--gen-len", "2", KLOTSKI_CACHE_DIR=str(cache)
    )
    _wait_for(lambda: any(cache.rglob("*.tmp")), "a temporary file", proc)
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=HANG_S)
    assert proc.returncode == 143 and err.splitlines()[-1] == "terminated" and "Traceback" not in err
    assert list(cache.rglob("*.tmp")) == []


def _nothing() -> None:
    """A pool worker's initializer that does nothing."""


def test_a_pool_left_by_an_exception_cancels_its_queue_and_stops_its_workers():
    started = time.monotonic()
    with pytest.raises(RuntimeError, match="stop"):
        with worker_pool(2, _nothing, fork=True) as pool:
            assert pool.submit(os.getpid).result(timeout=HANG_S) != os.getpid()  # (the workers have started)
            workers = list(pool._processes)
            # (beyond the pool's call queue, which holds workers + 1 of them: the fifth could be in it,
            # moved there by the queue's thread, and so not cancellable: the test failed under load)
            futures = [pool.submit(time.sleep, HANG_S) for _ in range(10)]
            time.sleep(0.2)  # (two of them running)
            raise RuntimeError("stop")
    assert time.monotonic() - started < HANG_S  # (a plain pool would sleep through its whole queue)
    assert _wait_gone(workers) == []
    assert futures[-1].cancelled()


def _one_slow_start(marker: str, *args: object) -> None:
    """The first worker starts at once; the other takes its time, still under its parent's handlers."""
    try:
        os.close(os.open(marker, os.O_CREAT | os.O_EXCL))
    except FileExistsError:
        time.sleep(1.0)
    _original_worker_start(*args)


def test_a_pool_left_while_its_workers_start_stops_them_under_their_parents_handlers(monkeypatch, tmp_path):
    """A worker forked from the CLI runs under the CLI's stop handler until it resets it: a SIGTERM
    then was taken by the inherited handler (lost with it, or turned into a stop the worker survived),
    the worker waited forever on its queue's lock and the command hung at exit joining it (seen once
    in CI: compare --workers 2 with a policy that fails at once). The pool stops its workers with
    SIGKILL, which no handler takes."""
    import functools

    from klotski_sim.runs import runner

    monkeypatch.setattr(runner, "_worker_start", functools.partial(_one_slow_start, str(tmp_path / "first")))
    previous = signal.signal(signal.SIGTERM, lambda signum, frame: None)  # (inherited: a worker survives it)
    try:
        with pytest.raises(RuntimeError, match="stop"):
            with worker_pool(2, _nothing, fork=True) as pool:
                pool.submit(os.getpid).result(timeout=HANG_S)  # (the quick worker: then idle, holding the queue's lock)
                workers = list(pool._processes)
                raise RuntimeError("stop")  # (while the other still sleeps in its start)
    finally:
        signal.signal(signal.SIGTERM, previous)
    assert _wait_gone(workers) == []


PARENT = """
import sys, time
from klotski_sim.runs.runner import worker_pool
from tests.test_signals import _nothing
with worker_pool(2, _nothing) as pool:
    print(*(pool.submit(__import__("os").getpid).result() for _ in range(4)), flush=True)
    time.sleep(600)
"""


def test_a_worker_dies_with_its_parent_even_by_sigkill():
    """SIGKILL leaves no clean-up to run: the kernel ends the workers (prctl PR_SET_PDEATHSIG)."""
    proc = start([sys.executable, "-c", PARENT], stdout=subprocess.PIPE, text=True)
    line = proc.stdout.readline()
    workers = _children(proc.pid)
    assert workers and set(map(int, line.split())) <= set(workers)
    proc.kill()
    proc.wait(timeout=HANG_S)
    assert _wait_gone(workers) == []


STOPPED_WHILE_WRITING = """
import os, signal, sys
from klotski_sim.cli import main as cli
from klotski_sim.report import exports
if sys.argv[1] == "nohup":
    signal.signal(signal.SIGHUP, signal.SIG_IGN)
to_csv = exports.to_csv
def hang_up(*args, **kwargs):  # (as the CSV is written: no race)
    os.kill(os.getpid(), signal.SIGHUP)
    to_csv(*args, **kwargs)
exports.to_csv = hang_up
sys.exit(cli.main(sys.argv[2:]))
"""


@pytest.mark.parametrize("how", ["terminal", "nohup"])
def test_a_hang_up_stops_a_run_as_sigterm_does_unless_it_is_ignored(tmp_path, how):
    """SIGHUP (the terminal closed, an ssh session dropped) killed a run with no word and left its
    temporary output files; now it ends as SIGTERM does (`hung up`, 129), the folder it made
    removed. Under `nohup` (SIGHUP ignored) the run goes on."""
    out = tmp_path / "made" / "out"
    proc = run(
        [
            sys.executable,
            "-c",
            STOPPED_WHILE_WRITING,
            how,
            "simulate",
            "--model",
            "tiny-mixtral",
            "--gen-len",
            "3",
            "--out",
            str(out),
        ],
        timeout=HANG_S,
    )
    if how == "nohup":
        assert proc.returncode == 0 and "wrote summary.json" in proc.stdout, proc.stderr
    else:
        assert proc.returncode == 128 + signal.SIGHUP and proc.stderr.splitlines() == ["hung up"], proc.stderr
        assert list(tmp_path.iterdir()) == []


def _hang_up_handler() -> object:
    return signal.getsignal(signal.SIGHUP)


def test_a_worker_ends_by_a_hang_up_unless_its_parent_ignores_it(stop_signals):
    """A worker takes SIGHUP as any process does (its parent's handler would raise in its work), but
    one that its parent ignores (`nohup`) stays ignored: the workers would end and not the run."""
    for parent, worker in (
        (signal.SIG_IGN, signal.SIG_IGN),
        (lambda *_: None, signal.SIG_DFL),
        (signal.SIG_DFL, signal.SIG_DFL),
    ):
        signal.signal(signal.SIGHUP, parent)
        with worker_pool(1, _nothing, fork=True) as pool:
            assert pool.submit(_hang_up_handler).result(timeout=HANG_S) == worker


def _term_handler() -> object:
    return signal.getsignal(signal.SIGTERM)


def test_a_worker_takes_sigterm_even_where_its_parent_ignores_it(stop_signals):
    """The pool stops its workers with SIGTERM, and the kernel sends it when their parent dies: a
    worker that kept an ignored SIGTERM would outlive both."""
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    with worker_pool(1, _nothing, fork=True) as pool:
        assert pool.submit(_term_handler).result(timeout=HANG_S) == signal.SIG_DFL


def _interrupt_handler() -> object:
    return signal.getsignal(signal.SIGINT)


def test_a_worker_leaves_ctrl_c_to_its_parent(stop_signals):
    """Ctrl-C reaches a terminal's whole process group: a worker that took it raised in its work and
    multiprocessing printed `Process ForkProcess-2:` beside the command's `interrupted`. The parent
    stops its workers itself."""
    with worker_pool(1, _nothing, fork=True) as pool:
        assert pool.submit(_interrupt_handler).result(timeout=HANG_S) == signal.SIG_IGN


STOPPED_TWICE = """
import os, signal, sys
from klotski_sim.cli import main as cli
from klotski_sim.report import exports
from klotski_sim.files import outfiles
to_csv, discard = exports.to_csv, outfiles.OutputFiles.discard
def stopped(*args, **kwargs):  # (the first SIGTERM as the CSV is written)
    os.kill(os.getpid(), signal.SIGTERM)
    to_csv(*args, **kwargs)
def stopped_again(self):  # (the second as the temporaries are removed: Ctrl-C twice, or a scheduler's repeat)
    os.kill(os.getpid(), signal.SIGTERM)
    discard(self)
exports.to_csv, outfiles.OutputFiles.discard = stopped, stopped_again
sys.exit(cli.main(sys.argv[1:]))
"""

STOPPED_AT_THE_END = """
import os, signal, sys
from klotski_sim.cli import main as cli
set_handler, fired = signal.signal, []
def restored(signum, handler):  # (SIGTERM as the command puts its handlers back: its work is done)
    if signum == signal.SIGTERM and handler == signal.SIG_DFL and not fired:
        fired.append(1)
        os.kill(os.getpid(), signal.SIGTERM)
    return set_handler(signum, handler)
signal.signal = restored
sys.exit(cli.main(sys.argv[1:]))
"""


def test_a_second_stop_during_the_clean_up_is_ignored(tmp_path):
    """A second SIGTERM while the first's clean-up removed the temporaries broke it off with a
    traceback and left them; now it is ignored, the clean-up ends, one line, exit 143."""
    # (imported here, not at the top: PARENT imports this module outside pytest)
    from .conftest import folder_state

    out = tmp_path / "out"
    small = ["simulate", "--model", "tiny-mixtral", "--gen-len", "3", "--out", str(out)]
    assert run([sys.executable, "-m", "klotski_sim.cli.main", *small], timeout=HANG_S).returncode == 0
    before = folder_state(out)
    proc = run([sys.executable, "-c", STOPPED_TWICE, *small], timeout=HANG_S)
    assert proc.returncode == 143 and proc.stderr.splitlines() == ["terminated"], proc.stderr
    assert folder_state(out) == before


def test_a_stop_once_the_work_is_done_ends_with_its_word_not_a_traceback(tmp_path):
    proc = run(
        [
            sys.executable,
            "-c",
            STOPPED_AT_THE_END,
            "simulate",
            "--model",
            "tiny-mixtral",
            "--gen-len",
            "3",
            "--out",
            str(tmp_path),
        ],
        timeout=HANG_S,
    )
    assert proc.returncode == 143 and proc.stderr.splitlines() == ["terminated"], proc.stderr
    assert "wrote summary.json" in proc.stdout and (tmp_path / "routing.npz").exists()


def test_a_reader_that_goes_early_does_not_stop_the_command(tmp_path):
    """`klotski-sim simulate --out d | true`: the command goes on and writes its files, exit 0 (it
    stopped at its first line, the summary, before them: exit 0 with nothing written)."""
    proc = start(
        [
            sys.executable,
            "-m",
            "klotski_sim.cli.main",
            "simulate",
            "--model",
            "tiny-mixtral",
            "--gen-len",
            "3",
            "--out",
            str(tmp_path / "out"),
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    proc.stdout.close()  # (the reader has gone before the first line)
    assert proc.wait(timeout=HANG_S) == 0, proc.stderr.read()
    assert proc.stderr.read() == ""
    assert (tmp_path / "out" / "routing.npz").exists()


def test_a_stopped_command_removes_every_folder_it_made_for_its_output(tmp_path):
    """`--out made/x/../out` makes `made`, `made/x` and `made/out`; stopped, it removed `made/out`
    alone (the walk up went through `x/..`, not `x`)."""
    proc = run(
        [
            sys.executable,
            "-c",
            STOPPED_WHILE_WRITING,
            "terminal",
            "simulate",
            "--model",
            "tiny-mixtral",
            "--gen-len",
            "3",
            "--out",
            str(tmp_path / "made" / "x" / ".." / "out"),
        ],
        timeout=HANG_S,
    )
    assert proc.returncode == 128 + signal.SIGHUP, proc.stderr
    assert list(tmp_path.iterdir()) == []


def test_the_runtime_cli_answers_before_importing_torch():
    """`klotski-runtime --help` imported torch (0.8 s of 1.2 s) before anything; a stop in that time
    killed it with no word (a traceback for Ctrl-C). The commands import it themselves now."""
    code = "import sys, klotski_runtime.cli; print('torch' in sys.modules)"
    assert run([sys.executable, "-c", code], timeout=HANG_S).stdout.strip() == "False"
