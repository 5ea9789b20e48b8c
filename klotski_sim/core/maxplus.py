"""A schedule's times as exact functions of one duration that varies, for schedules the engine times
without queueing: each resource's ops come from one stream.

A serving run is tens or hundreds of thousands of iterations, most of them one of a few shapes
whose ops last equally long but for one kind that grows with the requests' context (attention).
On such a schedule the engine's rules reduce to a longest path: an op starts when its last
predecessor (its deps and its stream predecessor) has ended, plus the dependency latency across
streams, because the only op that could hold its resource is its own stream's predecessor (the
issuing thread, rule 4, adds a term of the same kind: the last host op's end plus a constant). A
longest path through ops of which `n` last `a` each is `c + n a`, so every op's end is
`max_n (E[n] + n a)` over the few counts `n` the paths through it can have; `E` is worked out
once per shape and each iteration then costs a few array operations instead of emitting and timing
every op (docs/performance.md, "Serving runs").
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from klotski_sim.core.engine import IssuingThread
from klotski_sim.core.schedule import Op, Schedule
from klotski_sim.hardware.profile import HardwareProfile


class OneVaryingDuration:
    """`schedule` timed as a function of `a`, the duration of every op in `varying` (the others
    last `durations`). `compile` answers None for a schedule the engine would queue on."""

    def __init__(
        self,
        ends: np.ndarray,  # [ops, counts]: E, -inf where no path through the op has that count
        starts: np.ndarray,  # [ops, counts]: the same of each op's start
        durations: np.ndarray,
        varying: np.ndarray,  # bool per op
        allocs: list[tuple[int, int]],  # (op, bytes allocated when it starts)
        frees: list[tuple[int, int]],  # (op, bytes freed when it ends)
        preloaded_bytes: int,
    ) -> None:
        self._counts = np.arange(ends.shape[1], dtype=float)
        self._lines = _upper_hull(ends.max(axis=0))
        self._durations, self._varying = durations, varying
        self._alloc_ops = np.array([i for i, _ in allocs], dtype=np.intp)
        self._free_ops = np.array([i for i, _ in frees], dtype=np.intp)
        # (an allocation's time is its op's start, kept as such: an end less the duration rounds, and
        # an allocation at the very time of a free could then fall after it)
        self._alloc_starts = starts[self._alloc_ops] if allocs else starts[:0]
        self._free_ends = ends[self._free_ops] if frees else ends[:0]
        # at equal times allocations count before frees: a peak never below the engine's
        self._deltas = np.array([b for _, b in allocs] + [-b for _, b in frees], dtype=np.int64)
        self._order_key = np.array([0] * len(allocs) + [1] * len(frees))
        self.preloaded_bytes = preloaded_bytes
        self.peak_bound = preloaded_bytes + int(self._deltas[self._deltas > 0].sum())  # (`compile` narrows it)

    @classmethod
    def compile(
        cls, schedule: Schedule, profile: HardwareProfile, durations: Sequence[float], varying: Sequence[int]
    ) -> "OneVaryingDuration | None":
        """None when two streams of the schedule share a resource (the engine's queue order then
        depends on the durations) or an op depends on a later one."""
        ops = schedule.ops
        if not ops:
            return None
        streams = schedule.column("stream")
        owner: dict[str, str] = {}
        for stream in set(streams):
            if owner.setdefault(schedule.streams[stream], stream) != stream:
                return None
        n, counts = len(ops), len(varying) + 1
        is_varying = np.zeros(n, dtype=bool)
        is_varying[list(varying)] = True
        succ_ptr, succ_flat, _, _ = schedule.graph
        preds: list[list[int]] = [[] for _ in range(n)]
        for i in range(n):
            for s in succ_flat[succ_ptr[i] : succ_ptr[i + 1]]:
                if s <= i:
                    return None
                preds[s].append(i)
        host = [schedule.streams[s] == "host" for s in streams]
        latency = profile.gpu.dependency_latency_s
        # the engine's rule 4: an op is ready no earlier than the issuing thread reaches it (the end
        # of the last host op issued before it, plus the issue costs between) and ends no earlier than
        # the thread has issued it; both are max-plus terms like a dependency's
        issue = IssuingThread.of(schedule, profile, None) if profile.gpu.issue == "serial" else None
        ends = np.full((n, counts), -np.inf)
        starts = np.full((n, counts), -np.inf)
        start_only = np.full(counts, -np.inf)
        start_only[0] = 0.0
        for i in range(n):
            row = start_only.copy() if not preds[i] else None
            for p in preds[i]:
                lag = latency if latency and not host[p] and not host[i] and streams[p] != streams[i] else 0.0
                candidate = ends[p] + lag if lag else ends[p]
                row = candidate.copy() if row is None else np.maximum(row, candidate)
            assert row is not None
            issued = None  # when the thread has issued all of op i (a host op: it waits in it instead)
            if issue is not None:
                h = issue.after_host[i]
                reach = (ends[h] if h >= 0 else start_only) + issue.reach[i]
                row = np.maximum(row, reach)
                issued = None if host[i] else reach + issue.costs[i]
            starts[i] = row
            if is_varying[i]:
                ends[i, 1:] = row[:-1]
            else:
                ends[i] = row + durations[i]
            if issued is not None:
                ends[i] = np.maximum(ends[i], issued)
        allocs = [(i, sum(size for _, size in op.alloc)) for i, op in enumerate(ops) if op.alloc]
        sizes = {name: size for name, size in schedule.preloaded}
        for op in ops:
            sizes.update(op.alloc)
        frees = [(i, sum(sizes[name] for name in op.free)) for i, op in enumerate(ops) if op.free]
        preloaded = sum(size for _, size in schedule.preloaded)
        compiled = cls(ends, starts, np.asarray(durations, dtype=float), is_varying, allocs, frees, preloaded)
        if compiled.peak_bound > profile.gpu.usable_bytes:  # (narrowed only where it matters: it takes longer)
            compiled.peak_bound = preloaded + _most_held_at_once(ops, preds)
        return compiled

    def makespan(self, a: float) -> float:
        """When the last op ends, the varying ops lasting `a` each."""
        return max([c + n * a for n, c in self._lines])

    def durations(self, a: float) -> np.ndarray:
        return np.where(self._varying, a, self._durations)

    def peak_bytes(self, a: float) -> int:
        """The most GPU memory held at once (allocations counted first at equal times, so never
        below the engine's peak for the same durations)."""
        if not len(self._deltas):
            return self.preloaded_bytes
        spans = self._counts * a
        starts = (self._alloc_starts + spans).max(axis=1)
        times = np.concatenate([starts, (self._free_ends + spans).max(axis=1)])
        order = np.lexsort((self._order_key, times))
        return int(self.preloaded_bytes + max(0, int(np.cumsum(self._deltas[order]).max())))


def _most_held_at_once(ops: Sequence[Op], preds: list[list[int]]) -> int:
    """The most bytes of the schedule's own buffers held at once under *any* durations: when op i
    allocates, a buffer may be held unless its allocator comes after i or its freer comes before i
    (in the dependency order), so no peak exceeds the largest such sum over the allocating ops."""
    ancestors = [0] * len(ops)  # bit j set: op j precedes op i
    for i, before in enumerate(preds):
        mask = 0
        for p in before:
            mask |= ancestors[p] | (1 << p)
        ancestors[i] = mask
    allocated_by: dict[str, tuple[int, int]] = {}
    for i, op in enumerate(ops):
        for name, size in op.alloc:
            allocated_by[name] = (i, size)
    freed_by = {name: i for i, op in enumerate(ops) for name in op.free}
    buffers = [(i, size, freed_by.get(name, -1)) for name, (i, size) in allocated_by.items()]
    most = 0
    for i, op in enumerate(ops):
        if not op.alloc:
            continue
        held = sum(
            size
            for a, size, f in buffers
            if (a == i or not ancestors[a] >> i & 1) and not (f >= 0 and ancestors[i] >> f & 1)
        )
        most = max(most, held)
    return most


def _upper_hull(last: np.ndarray) -> list[tuple[int, float]]:
    """The lines `c + n a` (n varying ops on the path, c the rest) that are the largest for some
    `a >= 0`: the makespan's few pieces out of up to one per count."""
    lines = [(n, float(c)) for n, c in enumerate(last) if c != -np.inf]
    kept: list[tuple[int, float]] = []
    for n, c in sorted(lines, key=lambda line: (line[0], line[1])):
        # (slopes increase; a line is dropped when a steeper one is at least as high from a = 0 on,
        # or when it is never above both its neighbours)
        while kept and kept[-1][1] <= c:
            kept.pop()
        while len(kept) >= 2:
            (n1, c1), (n2, c2) = kept[-2], kept[-1]
            # line 2 is above lines 1 and 3 somewhere in a >= 0 iff where 1 meets 2 comes before 2 meets 3
            if (c1 - c2) * (n - n2) >= (c2 - c) * (n2 - n1):
                kept.pop()
            else:
                break
        kept.append((n, c))
    return kept
