"""A command stopped from outside: the signals that stop it, the exception they raise, and holding
them back over a few steps that must not be cut in two.

The CLIs (`cli.guarded`) run a command under `StopHandler`, which turns SIGTERM and SIGHUP into
`Terminated`, a KeyboardInterrupt, so that the clean-up Ctrl-C runs runs for them too; pool workers
reset them to the default (runner), and an output folder's renames hold them back (outfiles).
"""

from __future__ import annotations

import signal
import sys
import threading
from contextlib import contextmanager
from typing import Any, Iterator

# SIGTERM (`timeout`, a batch scheduler's end of a job, `kill`) and SIGHUP (the terminal closed, an
# ssh session dropped), where the platform has them, with the word a stopped command ends with
_STOPPED_BY = {"SIGTERM": "terminated", "SIGHUP": "hung up"}
STOP_WORDS = {
    signal.SIGINT: "interrupted",
    **{getattr(signal, name): word for name, word in _STOPPED_BY.items() if hasattr(signal, name)},
}
STOP_SIGNALS = tuple(signum for signum in STOP_WORDS if signum != signal.SIGINT)


class Terminated(KeyboardInterrupt):
    """A stop signal (`STOP_SIGNALS`), raised in the main thread as Ctrl-C raises KeyboardInterrupt:
    the same clean-up runs (a trace being drawn into the cache leaves no temporary file, output
    files are left as they were, worker processes are stopped), then one line and exit status
    128 + the signal's number (SIGTERM: `terminated`, 143; SIGHUP: `hung up`, 129). Unhandled, they
    would end a run with no word, its workers left waiting forever and its temporary files behind."""

    def __init__(self, signum: int = signal.SIGTERM) -> None:
        super().__init__(signum)
        self.signum = signum


def stop_received() -> bool:
    """Whether a KeyboardInterrupt now is a stop from outside (Ctrl-C, a stop signal, as the
    command's StopHandler saw one), not one a user's code raised itself. Without a StopHandler
    (klotski used as a library), every one counts as a stop."""
    handler = signal.getsignal(signal.SIGINT)
    return not isinstance(handler, StopHandler) or handler.stopping


class StopHandler:
    """The handler a CLI command runs under, for Ctrl-C and `STOP_SIGNALS`: the first stop raises
    (KeyboardInterrupt for Ctrl-C, `Terminated` for the others) and the clean-up runs; a repeat
    during the clean-up (a fraction of a second: temporaries removed, workers stopped) is ignored,
    rather than break the clean-up off with a traceback and leave temporary files; once the
    command's work has ended (`done`), a stop ends the process with the signal's word and status,
    rather than raise out of the command's last lines with a traceback."""

    def __init__(self) -> None:
        self.stopping = False
        self.done = False

    def __call__(self, signum: int, frame: object) -> None:
        if self.stopping:
            return
        self.stopping = True
        if self.done:
            raise SystemExit(_said(signum))
        if signum == signal.SIGINT:
            raise KeyboardInterrupt
        raise Terminated(signum)


def take_stops() -> tuple[StopHandler, dict[int, Any]]:
    """A new StopHandler for Ctrl-C and each stop signal that has its default handler, or an outer
    StopHandler (the console script's, `entry`); a caller's own handler is kept, and an ignored
    signal stays ignored (`nohup` ignores SIGHUP). Returns the handler and what it replaced, for
    `restore_stops`. Only the main thread can set handlers: elsewhere, none is taken."""
    stops = StopHandler()
    if threading.current_thread() is not threading.main_thread():
        return stops, {}
    defaults = {signal.SIGINT: signal.default_int_handler, **{signum: signal.SIG_DFL for signum in STOP_SIGNALS}}
    replaced = {signum: signal.getsignal(signum) for signum in defaults}
    replaced = {
        signum: handler
        for signum, handler in replaced.items()
        if handler == defaults[signum] or isinstance(handler, StopHandler)
    }
    for signum in replaced:
        signal.signal(signum, stops)
    return stops, replaced


def restore_stops(replaced: dict[int, Any]) -> None:
    """Put back the handlers `take_stops` replaced."""
    for signum, handler in replaced.items():
        signal.signal(signum, handler)


def stopped(stop: KeyboardInterrupt) -> int:
    """Say the word of the stop that ended a command (on stderr) and return its exit status."""
    return _said(stop.signum if isinstance(stop, Terminated) else signal.SIGINT)


def _said(signum: int) -> int:
    """A stop's word said on stderr; the exit status of a process it ends."""
    print(STOP_WORDS.get(signum, "stopped"), file=sys.stderr, flush=True)
    return 128 + signum


@contextmanager
def signals_deferred() -> Iterator[None]:
    """Ctrl-C and the stop signals held back until the block has run, then the first of them taken
    as it would have been: their handlers raise in the main thread, and between two of an output
    folder's renames that would leave a mix of two runs. Only the main thread can change handlers;
    elsewhere, and for a signal without a Python handler (ignored, or the default), as is."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    held: list[tuple[int, Any]] = []
    installed = {signum: signal.getsignal(signum) for signum in (signal.SIGINT, *STOP_SIGNALS)}
    handlers = {signum: handler for signum, handler in installed.items() if callable(handler)}
    for signum in handlers:
        signal.signal(signum, lambda signum, frame: held.append((signum, frame)))
    try:
        yield
    finally:
        for signum, handler in handlers.items():
            signal.signal(signum, handler)
        for signum, frame in held[:1]:
            handlers[signum](signum, frame)


# What a terminal sends to its whole process group: Ctrl-C, and a hang-up when it closes
TERMINAL_SIGNALS = tuple(getattr(signal, name) for name in ("SIGINT", "SIGHUP") if hasattr(signal, name))


@contextmanager
def terminal_signals_ignored() -> Iterator[None]:
    """Ctrl-C and a hang-up ignored over the block, for the processes it starts to inherit: a
    terminal sends them to its whole process group, and a local Dask cluster's nanny and worker
    processes would print a KeyboardInterrupt traceback each for a Ctrl-C, multiprocessing's resource
    tracker die of a hang-up and its successor print a KeyError traceback for every semaphore; started
    with them ignored, they leave them to the command, which stops them itself. One sent during the
    block itself is lost (the second or so of a cluster's start: press Ctrl-C again). (Blocking them
    instead does not reach them: they are started by threads of the cluster's event loop, which do
    not keep the blocking thread's mask.) Only the main thread can change a handler; elsewhere, as is."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    handlers = {signum: signal.signal(signum, signal.SIG_IGN) for signum in TERMINAL_SIGNALS}
    try:
        yield
    finally:
        for signum, handler in handlers.items():
            signal.signal(signum, handler)
