"""One piece of work run in a forked process beside this one, for writing that holds the GIL:
`simulate --out`'s timeline.csv (pandas' writer, 1.3 s of its 6.0 s at 338k ops) and schedule.json
(0.7 s) written while this process writes the other files, on the core that would otherwise idle.

The child inherits what it needs by the fork (copy-on-write: nothing is pickled), writes, and
exits. It is not free in memory: reading an object writes its reference count, so the child comes
to hold a copy of every page it reads (`simulate --out`'s two children took the command's process
tree from 615 MB to 1.39 GB at 338k ops). So the work runs here and now, in turn, where fork is not
available or the machine's available memory is under `ROOM_FOR_A_CHILD` times this process's
resident size (a 10M-op DeepSeek-V3 run holds 10 GB or more: its files are written in turn).
"""

from __future__ import annotations

import multiprocessing
import os
from typing import Any, Callable

from .errors import KlotskiError
from .machine import available_memory, resident_bytes

ROOM_FOR_A_CHILD = 3  # available memory / this process's: room for this child's copy and another's


class BesideError(KlotskiError):
    """The work failed in its process: its error's text, brought back (a user's error or a file's
    as its own message, as the CLIs show them here; anything else with its type)."""


def started_beside(work: Callable[..., object], *args: Any) -> Callable[[], None]:
    """Start `work(*args)` in a forked process and return the wait for it, which raises a
    BesideError with the text of what the work raised (or how its process ended); without room
    for the child (`room_beside`), run it now and return a wait that does nothing."""
    if not room_beside():
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


def room_beside() -> bool:
    """Whether a child may be forked beside this process: fork available, and the memory available
    to it (`machine.available_memory`: the machine's, or its control group's) at least
    `ROOM_FOR_A_CHILD` times this process's (unknown: no)."""
    if "fork" not in multiprocessing.get_all_start_methods():
        return False
    resident = resident_bytes()
    return resident > 0 and available_memory() >= ROOM_FOR_A_CHILD * resident


def _run_and_report(writing: Any, work: Callable[..., object], args: tuple[Any, ...]) -> None:
    try:
        work(*args)
    except BaseException as err:  # noqa: BLE001 - reported to the waiting process, which raises it
        writing.send(str(err) if isinstance(err, (KlotskiError, OSError)) else f"{type(err).__name__}: {err}")
        writing.close()
        os._exit(1)
    writing.close()
