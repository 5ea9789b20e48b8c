"""A limit on the time a user's policy file may run (`--policy-timeout SECONDS`, default off): its
import and each schedule a policy of it builds. A policy file is the user's own code, run with the
user's permissions; a limit only turns a file that never returns (a loop, a sleep, a wait on a
network) into one line naming it, as a command line asks for. It is a SIGALRM timer, so it works in a
process's main thread on Unix: where a command runs policies in worker processes, each worker takes
the parent's limit (runs/runner.py)."""

from __future__ import annotations

import signal
import threading
from contextlib import contextmanager
from typing import Iterator

from klotski_sim.util.errors import UsageError

_limit_s: float | None = None


class PolicyTimeout(UsageError):
    """A policy file's code ran longer than --policy-timeout."""


def set_policy_timeout(seconds: float | None) -> None:
    """The limit for this process (None: none)."""
    global _limit_s
    _limit_s = seconds


def policy_timeout() -> float | None:
    return _limit_s


@contextmanager
def policy_time_limit(what: str) -> Iterator[None]:
    """Run the block under the limit: past it, PolicyTimeout naming `what` is raised where the code is."""
    limit = _limit_s
    if limit is None:
        yield
        return
    with time_limit(limit, PolicyTimeout(f"{what}: still running after --policy-timeout {limit:g} s, stopped")):
        yield


@contextmanager
def time_limit(seconds: float, refusal: UsageError) -> Iterator[None]:
    """Run the block for at most `seconds`, then raise `refusal` where the code is (a SIGALRM timer:
    it also stops a regular expression's backtracking, which checks for signals; no limit outside
    the main thread or where the platform has no timer)."""
    if not hasattr(signal, "setitimer") or threading.current_thread() is not threading.main_thread():
        yield
        return

    def expired(signum: int, frame: object) -> None:
        raise refusal

    previous = signal.signal(signal.SIGALRM, expired)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
