"""Shared fixtures: small hand-checkable profiles and schedules."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, settings

from klotski_sim.hardware.profile import HardwareProfile, profile_from_dict

settings.register_profile("ci", max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
settings.register_profile("dev", max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
settings.load_profile("ci" if os.environ.get("CI") else "dev")

ROOT = Path(__file__).resolve().parents[1]

# The suite starts a few hundred Python processes (CLIs, scripts, runtime calls, Dask workers). Where
# PYTHONDONTWRITEBYTECODE is set (our CI machines set it), each compiled klotski from source again (~1 s
# a process that imports the simulator and the runtime) and each pytest process rewrote every test
# module again (~8 s): the test run writes bytecode, into __pycache__ folders git ignores.
sys.dont_write_bytecode = False
os.environ.pop("PYTHONDONTWRITEBYTECODE", None)


def make_profile(memory_bytes: float = 1e12, copy_engines: int = 1, **gpu: float) -> HardwareProfile:
    """A profile with round numbers: 1 TFLOP/s, 1 TB/s, 1 GB/s links, no overheads."""
    data = {
        "name": "test",
        "gpu": {
            "name": "test-gpu",
            "memory_bytes": memory_bytes,
            "reserved_bytes": 0,
            "peak_flops": 1e12,
            "memory_bandwidth": 1e12,
            "compute_efficiency": 1.0,
            "memory_efficiency": 1.0,
            "kernel_overhead_s": 0.0,
            **gpu,
        },
        "links": {
            "pcie_h2d": {"bandwidth": 1e9, "latency_s": 0.0, "copy_engines": copy_engines},
            "pcie_d2h": {"bandwidth": 1e9, "latency_s": 0.0, "copy_engines": copy_engines},
            "nvme": {"bandwidth": 1e9, "latency_s": 0.0, "copy_engines": 1},
        },
        "host": {"memory_bytes": 1e12},
        "disk": {"capacity_bytes": 1e13},
    }
    return profile_from_dict(data, "test-profile")


@pytest.fixture
def profile() -> HardwareProfile:
    return make_profile()


# What a launcher may have left ignored (`nohup`: SIGHUP; a shell without job control starting a job in the
# background: SIGINT) or blocked, and an ignored signal stays ignored across exec: a test's subprocess gets them
# back at their defaults, so that what it does with a stop does not depend on how the suite was started. A test
# of a run "under nohup" ignores SIGHUP itself, in the subprocess.
RESET_SIGNALS = tuple(getattr(signal, name) for name in ("SIGHUP", "SIGINT", "SIGTERM") if hasattr(signal, name))


def default_signals() -> None:
    """A subprocess's first step (preexec_fn, before exec): `RESET_SIGNALS` at their defaults, none blocked.
    (Only sigaction and sigprocmask: nothing that could wait on a lock of another thread of pytest.)"""
    for signum in RESET_SIGNALS:
        signal.signal(signum, signal.SIG_DFL)
    if hasattr(signal, "pthread_sigmask"):
        signal.pthread_sigmask(signal.SIG_SETMASK, [])


@pytest.fixture
def stop_signals() -> Any:
    """For a test that sets the handlers of `RESET_SIGNALS` in the pytest process itself (what its pool's
    workers inherit): it sets each it depends on, whatever the launcher left, and they are put back after."""
    before = {signum: signal.getsignal(signum) for signum in RESET_SIGNALS}
    yield
    for signum, handler in before.items():
        signal.signal(signum, handler)


_STARTED: list[subprocess.Popen] = []  # (by `start`, since the running test began: each leads a session of its own)


def start(args: list[str], preexec: Callable[[], None] | None = None, **popen: Any) -> subprocess.Popen:
    """Popen `args` (from the repository's root unless told) with the stop signals at their defaults, in a
    session of its own: it and whatever it starts (pool workers, a Dask cluster) are ended together, by
    `stop` or, at the latest, by `no_process_left` when the test ends, however it ends. `preexec` runs after
    the signals are reset."""

    def first() -> None:
        default_signals()
        if preexec is not None:
            preexec()

    popen.setdefault("cwd", ROOT)
    proc = subprocess.Popen(args, start_new_session=True, preexec_fn=first, **popen)  # noqa: PLW1509 (as above)
    _STARTED.append(proc)
    return proc


def stop(proc: subprocess.Popen) -> tuple[Any, Any]:
    """SIGKILL to `proc` and every process of its session; its output so far (stdout, stderr) once reaped."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)  # (its group: the session's, unless one of them made another)
    except OSError:  # (none left)
        pass
    _kill(_session(proc.pid))
    try:
        return proc.communicate(timeout=10)
    except subprocess.TimeoutExpired:  # (a pipe still held by something that left the session)
        proc.kill()
        proc.wait()
        return None, None


def run(
    args: list[str], timeout: float, preexec: Callable[[], None] | None = None, **popen: Any
) -> subprocess.CompletedProcess:
    """`start` and wait for its end, its output captured as text (subprocess.run's); on a timeout (or a
    Ctrl-C) its whole session is killed first, not the process alone (subprocess.run's kill), whose
    workers held its pipes open and went on."""
    popen.setdefault("stdout", subprocess.PIPE)
    popen.setdefault("stderr", subprocess.PIPE)
    popen.setdefault("text", True)
    proc = start(args, preexec, **popen)
    try:
        out, err = proc.communicate(timeout=timeout)
    except BaseException:
        stop(proc)
        raise
    return subprocess.CompletedProcess(args, proc.returncode, out, err)


REPEATABLE_FLAGS = {"--option", "--set", "--policy-file", "--gpu", "--cpu", "--ot"}


def overriding(base: Sequence[str], *extra: str) -> list[str]:
    """`base` then `extra`, each single-value flag of `extra` first taken out of `base` with its value:
    the CLIs refuse a flag given twice, where argparse silently kept the last."""
    again = {a for a in extra if a.startswith("--") and a not in REPEATABLE_FLAGS}
    out: list[str] = []
    skip_value = False
    for arg in base:
        if skip_value:
            skip_value = False
            if not arg.startswith("--"):
                continue
        if arg in again:
            skip_value = True
            continue
        out.append(arg)
    return [*out, *extra]


def run_cli(*args: str) -> tuple[int, str, str]:
    """`klotski-sim ARGS` in this process, from the repository's root: the CLI's `main` with its parser,
    its one-line errors and its exit status, without a new interpreter's ~0.8 s of imports a call (~300
    calls in the suite). A call that loads a `--policy-file` (its import registers a policy for the rest
    of the process) is run as a process; what only a whole process shows (an exit by a signal, worker
    processes left behind, a library's own stderr) uses `run_cli_process`."""
    if any(arg.startswith("--policy-file") for arg in args):
        return run_cli_process(*args)
    from klotski_sim.cli.main import main

    return _in_process(main, args)


def _in_process(main: Callable[[list[str]], int], args: Sequence[str]) -> tuple[int, str, str]:
    """A CLI's `main(args)` run from the repository's root, its output captured: (status, stdout, stderr)."""
    import contextlib
    import io

    out, err = io.StringIO(), io.StringIO()
    with contextlib.chdir(ROOT), contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = main(list(args))
        except SystemExit as exit:  # (argparse's usage errors, --help)
            code = exit.code if isinstance(exit.code, int) else 0 if exit.code is None else 1
    return code, out.getvalue(), err.getvalue()


def simulate_small(out: str | Path, model: str = "tiny-mixtral") -> None:
    """`klotski-sim simulate` of a small Klotski run of `model` into `out` (in-process): the schedule the
    runtime's execute tests run."""
    code, _, err = run_cli(
        "simulate", "--model", model, "--policy", "klotski", "--num-batches", "2", "--batch-size", "2",
        "--prompt-len", "6", "--gen-len", "3", "--no-png", "--out", str(out),
    )  # fmt: skip
    assert code == 0, err


def run_cli_process(*args: str) -> tuple[int, str, str]:
    """Run `klotski-sim` as a real subprocess, as a user would."""
    proc = run([sys.executable, "-m", "klotski_sim.cli.main", *args], timeout=600)
    return proc.returncode, proc.stdout, proc.stderr


def run_on_a_full_disk(module: str, *args: str, room: int = 64) -> tuple[int, str, str]:
    """Run `python -m module args` as if its disk held `room` more bytes per file: a write past them
    fails with EFBIG ("File too large"), as ENOSPC would on a full disk (SIGXFSZ ignored, so the write
    fails rather than killing the process; Python's own caches are written best-effort)."""
    import resource

    def limited() -> None:
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # (kept across exec: an ignored signal stays ignored)
        resource.setrlimit(resource.RLIMIT_FSIZE, (room, room))

    proc = run([sys.executable, "-m", module, *args], timeout=600, preexec=limited)
    return proc.returncode, proc.stdout, proc.stderr


# Test files whose tests must leave no process of theirs behind (sweeps: pool workers, Dask clusters, CLIs):
# anything left when such a test ends is killed and the test fails (an error at its teardown) with its
# command line. A failing sweep test left a 400-configuration Dask sweep running for 11 minutes.
NO_PROCESS_LEFT = {"test_signals.py", "test_sweep.py"}
LEFT_GRACE_S = 10  # (what is left that still ends on its own, meanwhile: a cluster's last workers)
# Processes of the multiprocessing module that serve the pytest process as long as it runs, started for it
# by the first pool or cluster that needs one: not a test's to end
_SERVING_PYTEST = ("from multiprocessing.resource_tracker import main", "from multiprocessing.forkserver import main")


def _processes() -> dict[int, tuple[str, int, int]]:
    """Every process this one can see, by pid: its state, parent and session (/proc/<pid>/stat; none
    without /proc)."""
    found: dict[int, tuple[str, int, int]] = {}
    for entry in Path("/proc").iterdir() if Path("/proc/self/stat").exists() else ():
        if entry.name.isdigit():
            try:
                fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            except (OSError, IndexError):  # (gone meanwhile)
                continue
            found[int(entry.name)] = (fields[0], int(fields[1]), int(fields[3]))
    return found


def _session(sid: int) -> list[int]:
    """The running processes of session `sid` (started by `start`): those that outlived it, reparented, too."""
    return [
        pid
        for pid, (state, _, session) in _processes().items()
        if session == sid and pid != os.getpid() and state not in "ZX"
    ]


def _command(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace").strip()
    except OSError:
        return "(gone)"


def _kill(pids: list[int]) -> None:
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except OSError:  # (gone meanwhile)
            pass


@pytest.fixture(autouse=True)
def no_process_left(request: pytest.FixtureRequest):
    """After each test: whatever it started with `start` that still runs (the process or anything of its
    session) is killed and reaped, so that no test leaves a sweep running; in the files of `NO_PROCESS_LEFT`,
    a child of the pytest process the test started (a pool's worker, a Dask cluster's nanny) too, and the
    test fails with their command lines."""
    checked = request.node.path.name in NO_PROCESS_LEFT and Path("/proc/self/stat").exists()
    before = {pid for pid, (_, parent, _) in _processes().items() if parent == os.getpid()} if checked else set()
    del _STARTED[:]
    yield
    started = list(_STARTED)
    del _STARTED[:]
    if not started and not checked:
        return

    def left() -> list[int]:
        everything = _processes()
        return [
            pid
            for pid, (state, parent, session) in everything.items()
            if state not in "ZX"
            and pid != os.getpid()
            and (
                any(session == proc.pid for proc in started)
                or checked
                and parent == os.getpid()
                and pid not in before
                and not any(what in _command(pid) for what in _SERVING_PYTEST)
            )
        ]

    # (a process the test started and did not wait for is left for sure: no grace then)
    deadline = time.monotonic() + (0 if any(proc.poll() is None for proc in started) else LEFT_GRACE_S)
    while (found := left()) and time.monotonic() < deadline:
        time.sleep(0.05)
    commands = [f"{pid}: {_command(pid)}" for pid in found]
    _kill(found)
    for proc in started:
        if proc.poll() is None:
            stop(proc)
    if commands and checked:
        pytest.fail(
            f"{len(commands)} process(es) left running by the test (killed now):\n" + "\n".join(commands), pytrace=False
        )


def folder_state(folder: Path) -> dict[str, bytes]:
    """Every file of a folder, by name, with its bytes: what an output folder held, to compare after."""
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir())}


# A small CPU calibration (tiny shapes, two repeats), made once per model for the whole session and shared
# by the xdist workers: the runtime's tests need a profile of this machine, not a precise one, and each
# calibration takes ~20 s. The one end-to-end validate test still calibrates by itself.
SMALL_CALIBRATION = ("--device", "cpu", "--batch-sizes", "2", "--prompt-lens", "6", "--max-expert-tokens", "32")


@pytest.fixture(scope="session")
def small_calibration(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], Path]:
    """`small_calibration(model)`: the path of a small CPU calibration of `model` (links emulated at
    calibrate's default 1e9 B/s)."""
    import fcntl

    base = tmp_path_factory.getbasetemp()
    root = (base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base) / "small-calibrations"
    root.mkdir(exist_ok=True)

    def get(model: str) -> Path:
        path = root / f"{model.replace('@', '-').replace(':', '-')}.yaml"
        with open(root / ".lock", "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)  # (the other workers wait for the one calibrating)
            if not path.exists():
                proc = run(
                    [sys.executable, "-m", "klotski_runtime.cli", "calibrate", "--model", model, *SMALL_CALIBRATION]
                    + ["--repeats", "2", "--out", str(path)],
                    timeout=600,
                    cwd=ROOT,
                )
                assert proc.returncode == 0, proc.stderr
        return path

    return get


def runtime_in_process(*args: str) -> tuple[int, str, str]:
    """`klotski-runtime ARGS` in this process: torch and transformers are imported once, not ~5 s again per
    call. What only a whole process shows (a library's own stderr, an exit by a signal) needs a subprocess."""
    from klotski_runtime.cli import main

    return _in_process(main, args)


def every_attempt_missed(attempts: list[list[str]], loaded: list[list[str]]) -> None:
    """End a wall-clock bound test whose every attempt missed its bound (`attempts`: each one's
    misses; `loaded`: each one's machine warnings): where every attempt ran loaded the bound could
    not be checked here, and the test says so with the numbers; a quiet attempt that missed fails it."""
    said = "\n".join(f"attempt {i}: " + "; ".join(m) for i, m in enumerate(attempts))
    if all(loaded):
        pytest.skip("the bound could not be checked: every attempt ran on a loaded machine\n" + said)
    pytest.fail("every attempt missed the bound, quiet ones too:\n" + said)
