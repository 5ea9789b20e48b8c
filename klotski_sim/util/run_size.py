"""How large a run will be, projected from the first steps of its schedule, before it is all built.

A schedule's ops, its dependency graph, the engine's lists and the timeline cost memory in
proportion to the ops, and the ops of an as-published schedule grow with experts x batches x
layers x steps: DeepSeek-V3's Klotski schedule on an H800 profile has 10M ops and takes 282 s and
14 GB with `--out`. On a smaller machine the kernel would kill such a run (no message) after
minutes of building. So each policy loop built by `OpEmitter` is watched: when its third
step begins (prefill and one decode step built), the ops of the whole run are projected — the
ops so far plus the first decode step's ops for each step left, times the batches for a loop
that walks one batch's steps after another — and the run is

- refused (`MachineRefusal`: one line, a sweep row of status `too-large`) when the memory that
  many ops need is more than this machine has available (a share of it, in a pool of worker
  processes: `share_machine`), before the rest is built;
- said to the `Surroundings.listeners` (the CLI's `note:` on stderr) when it will take LONG_RUN_S or more.

The memory and time per op are measured (the fits below), not modelled: they are this project's
figures for its own data structures on its 2-core machine.
"""

from __future__ import annotations

from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass, field, replace
from typing import Any, Callable, Iterator

from klotski_sim.util.errors import MachineRefusal
from klotski_sim.util.machine import available_memory_bytes, resident_bytes, slowdown
from klotski_sim.util.units import counted, memory_text

# Peak resident memory per op of `klotski-sim simulate` (schedule, graph, engine lists, timeline and
# its summary), and with `--out` (the timeline's frame and Arrow table, the files' pieces): the slopes
# of the process tree's peak (`python experiments/tree_memory.py klotski-sim simulate --policy klotski
# [ARGS] [--out DIR]`) over the default run (337,802 ops: 373 / 638 MB), `--gen-len 96` (899,034 ops:
# 794 / 1366 MB) and `--model qwen3-30b-a3b` (1,301,835 ops: 1128 / 1897 MB): 0.75-0.78 kB
# and 1.30-1.31 kB an op.
BYTES_PER_OP = 800
BYTES_PER_OP_WITH_FILES = 1350
# Wall time per op of the same runs (trace cache warm): 3.8-5.2 us without files, 11.2-14.0 us with.
SECONDS_PER_OP = 5e-6
SECONDS_PER_OP_WITH_FILES = 14e-6
LONG_RUN_S = 20.0


@dataclass(frozen=True)
class Surroundings:
    """What a run's projection must know of the process around it, set by whoever starts runs (the
    CLI, a pool worker) for the block they run in (`surroundings`), not a module-wide switch."""

    files_written: bool = False  # its runs also write their timelines' files (simulate --out)
    listeners: tuple[Callable[[str], None], ...] = ()  # who hears that a long run or draw begins


_surroundings: ContextVar[Surroundings] = ContextVar("run_surroundings", default=Surroundings())
# A pool worker's share of the machine is a fact about its whole process (every thread a Dask worker
# runs a task in, and what a forked worker inherits is not its parent's), set once when the worker
# starts (`share_machine`)
_worker_processes = [1]


@contextmanager
def surroundings(**changes: Any) -> Iterator[Surroundings]:
    """Runs inside the block have these surroundings (the others as they were)."""
    token = _surroundings.set(replace(around(), **changes))
    try:
        yield around()
    finally:
        _surroundings.reset(token)


def around() -> Surroundings:
    """The surroundings of the runs started here now."""
    return _surroundings.get()


def share_machine(workers: int) -> None:
    """This worker process is one of a pool of `workers` (compare's, a sweep's) for its whole life:
    the others' runs grow beside this one's, so what is available is shared — each projected alone
    would see it all, and two runs that each fit could together be killed."""
    _worker_processes[0] = max(1, workers)


def sharing() -> int:
    """The worker processes whose runs share this machine, this one included (`share_machine`)."""
    return _worker_processes[0]


@dataclass
class RunSizeWatch:
    """The ops a policy loop has built at the start of its first steps, and the projection made
    from them once (see the module's docstring)."""

    policy: str
    impl: str
    num_steps: int
    num_batches: int
    resident_at_start: int | None
    started: dict[int, int] = field(default_factory=dict)  # step -> ops built before its first op
    batches_in_prefill: set[int] = field(default_factory=set)

    def step_begins(self, step: int, batch: int, ops_built: int) -> None:
        """A policy loop begins (step, batch) with `ops_built` ops built so far."""
        if step == 0:
            self.batches_in_prefill.add(batch)
            return
        if step in self.started or step > 2:
            return
        self.started[step] = ops_built
        if step == 2:
            self._project(ops_built)

    def projected_ops(self, ops_built: int) -> int:
        """The run's ops, from those built before steps 1 and 2 began (`started`)."""
        per_step = ops_built - self.started[1]
        ops = ops_built + per_step * (self.num_steps - 2)
        if len(self.batches_in_prefill) < self.num_batches:  # one batch's steps after another
            ops *= self.num_batches
        return ops

    def _project(self, ops_built: int) -> None:
        ops = self.projected_ops(ops_built)
        where = around()
        with_files = where.files_written
        per_op = BYTES_PER_OP_WITH_FILES if with_files else BYTES_PER_OP
        whose = "its first batch's" if len(self.batches_in_prefill) < self.num_batches else "its"
        projected = (
            f"{counted(self.num_batches, 'batch', 'batches')} x {counted(self.num_steps, 'step')}, "
            f"projected from {whose} first steps"
        )
        needed = (self.resident_at_start or 0) + ops * per_op  # the run's peak, what the process held before included
        available, resident = available_memory_bytes(), resident_bytes()
        runs = sharing()
        if available is not None and resident is not None and self.resident_at_start is not None:
            if (needed - resident) * runs > available:
                shared = (
                    f" for the {runs} runs in flight (--workers {runs}; fewer workers leave each more)"
                    if runs > 1
                    else ""
                )
                fewer = ["a shorter --gen-len"] + (["fewer batches (--num-batches)"] if self.num_batches > 1 else [])
                if self.impl != "ideal":
                    fewer.append("--impl ideal (batched expert ops)")
                raise MachineRefusal(
                    f"{self.policy} would build about {_count(ops)} ops ({projected}) and need about "
                    f"{memory_text(needed)} of memory{' with its files' if with_files else ''} "
                    f"({per_op / 1000:.2f} kB an op), {memory_text(needed - resident)} more than the "
                    f"{memory_text(resident)} it holds, but this machine has {memory_text(available)} available"
                    f"{shared}; {', '.join(fewer[:-1]) + ' or ' if len(fewer) > 1 else ''}{fewer[-1]} builds fewer "
                    f"ops"
                )
        seconds = ops * (SECONDS_PER_OP_WITH_FILES if with_files else SECONDS_PER_OP) * slowdown()
        if seconds >= LONG_RUN_S:
            for listener in where.listeners:
                listener(
                    f"{self.policy} builds about {_count(ops)} ops ({projected}): about {seconds:.0f} s and "
                    f"{memory_text(needed)} of memory on this machine as loaded now"
                )


def _count(ops: int) -> str:
    return f"{ops / 1e6:.1f}M" if ops >= 1_000_000 else f"{ops:,}"


_current: ContextVar[RunSizeWatch | None] = ContextVar("run_size_watch", default=None)
_unwatched: ContextVar[bool] = ContextVar("run_size_unwatched", default=False)


@contextmanager
def watching(policy: str, impl: str, num_steps: int, num_batches: int) -> Iterator[None]:
    """Watch the policy loop built inside the block (`current` hands the watch to its emitter), but
    inside `unwatched`."""
    watch = None if _unwatched.get() else RunSizeWatch(policy, impl, num_steps, num_batches, resident_bytes())
    token = _current.set(watch)
    try:
        yield
    finally:
        _current.reset(token)


@contextmanager
def unwatched() -> Iterator[None]:
    """Schedules built inside the block are not projected: a policy's probes of n (klotski_sim/planning/probe.py),
    shorter runs than the one asked for, whose numbers would describe another run than the user's
    (the run itself is projected when it is built)."""
    token = _unwatched.set(True)
    try:
        yield
    finally:
        _unwatched.reset(token)


def current() -> RunSizeWatch | None:
    """The watch of the policy loop being built, None outside `watching` (an emitter made by hand)."""
    return _current.get()
