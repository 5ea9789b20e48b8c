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

from klotski_sim.util.machine import available_cores

# The executor's stream threads wait on each other's events: with the default 5 ms switch interval
# a thread woken by another waits for the running one to give up the GIL, which adds up to
# milliseconds per op; 0.1 ms hands it over at once.
QUICK_SWITCH_S = 1e-4


def compute_threads(device: str, requested: int | None) -> int | None:
    """torch's CPU threads for a run on `device`. On a CPU: `requested` (the other cores run the
    copy threads). Beside a GPU: every core but one, whatever was requested, because the thread that
    issues GPU work spins on a core in CUDA event waits, and an OpenMP team sharing that core (a CPU
    expert's GEMM) waits for its slowest member at every parallel region
    (experiments/cpu_expert_contention.py measures it)."""
    if torch.device(device).type == "cpu":
        return requested
    return max(1, available_cores() - 1)


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
