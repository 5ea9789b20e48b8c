"""The two process-wide settings a CPU measurement needs, set for its duration and restored after.

torch's intra-op thread count and the interpreter's GIL switch interval are properties of the
whole process, not of a call: the executor, calibrate and validate change them only inside
`cpu_threads`, so that a caller (a notebook, a test) gets its own settings back however the
measurement ends."""

from __future__ import annotations

import sys
from contextlib import contextmanager
from typing import Iterator

import torch

# The executor's stream threads wait on each other's events: with the default 5 ms switch interval
# a thread woken by another waits for the running one to give up the GIL, which adds up to
# milliseconds per op; 0.1 ms hands it over at once.
QUICK_SWITCH_S = 1e-4


@contextmanager
def cpu_threads(threads: int | None = None, quick_switch: bool = False) -> Iterator[None]:
    """torch's CPU threads set to `threads` (None: left as they are) and, with `quick_switch`, the
    GIL handed over every QUICK_SWITCH_S, both restored on leaving."""
    previous, switch = torch.get_num_threads(), sys.getswitchinterval()
    if threads:
        torch.set_num_threads(threads)
    if quick_switch:
        sys.setswitchinterval(QUICK_SWITCH_S)
    try:
        yield
    finally:
        torch.set_num_threads(previous)
        sys.setswitchinterval(switch)
