"""One piece of work run in a forked process beside this one, for writing that holds the GIL: a
run's timeline.csv (pandas' writer, 1.3 s of `simulate --out`'s 6.5 s at 338k ops) written while
this process writes the other files, on the core that would otherwise idle.

The child inherits what it needs by the fork (copy-on-write: nothing is pickled), writes, and
exits; where fork is not available the work runs here and now.
"""

from __future__ import annotations

import multiprocessing
import os
from typing import Any, Callable

from .errors import KlotskiError


class BesideError(KlotskiError):
    """The work failed in its process: its error's text, brought back (a user's error or a file's
    as its own message, as the CLIs show them here; anything else with its type)."""


def started_beside(work: Callable[..., object], *args: Any) -> Callable[[], None]:
    """Start `work(*args)` in a forked process and return the wait for it, which raises a
    BesideError with the text of what the work raised (or how its process ended)."""
    if "fork" not in multiprocessing.get_all_start_methods():
        work(*args)
        return lambda: None
    # (multiprocessing flushes this process's stdout and stderr before it forks: the child's exit
    # does not write their buffered output a second time)
    reading, writing = multiprocessing.get_context("fork").Pipe(duplex=False)
    child = multiprocessing.get_context("fork").Process(target=_run_and_report, args=(writing, work, args),
                                                        daemon=True)
    child.start()
    writing.close()

    def wait() -> None:
        try:
            message = reading.recv()  # (what failed says so; a child that ends closes the pipe: EOF)
        except EOFError:
            message = None
        reading.close()
        child.join()
        if child.exitcode != 0 or message is not None:
            what = getattr(work, "__name__", "work")
            raise BesideError(message or f"{what}: its process ended with status {child.exitcode} (killed, or out of "
                                         f"memory?)")

    return wait


def _run_and_report(writing: Any, work: Callable[..., object], args: tuple[Any, ...]) -> None:
    try:
        work(*args)
    except BaseException as err:  # noqa: BLE001 - reported to the waiting process, which raises it
        writing.send(str(err) if isinstance(err, (KlotskiError, OSError)) else f"{type(err).__name__}: {err}")
        writing.close()
        os._exit(1)
    writing.close()
