"""The engine: Schedule x HardwareProfile -> Timeline, by discrete-event simulation.

The whole model is four rules, applied as events come off a time-ordered heap (the fourth below):

1. An op becomes *ready* when its deps and its stream predecessor have ended (in-order streams),
   plus the profile's `dependency_latency_s` for a dependency on another stream (not to or from
   a host op: its `host_sync_latency_s` is the whole round trip).
2. A ready op waits in its resource's queue (first ready, first served; ties by schedule order)
   until one of the resource's units is free (1 for the GPU and the host thread, `copy_engines`
   for a link).
3. A started op allocates its GPU buffers, holds its unit for its duration, then frees its
   buffers and wakes its successors.

A host op (the host thread blocked on a sync or a pageable copy) is timed from the moment the
host reaches it — its predecessor on the host stream ended — to the end of its wait plus its
own latency: the host is occupied for all of it.

4. Under `gpu.issue: serial` (the default: PyTorch eager issues every stream's work from one host
   thread, as the CUDA runtime does) the issuing thread walks the ops in program order, spending
   each op's issue cost (`CostModel.issue_seconds`: its kernel launches and dispatch) and stopping
   at every host op until it ends. An op is ready no earlier than the thread reaches it and ends no
   earlier than the thread has issued it. Its GPU duration already holds its launches (that is how
   launch-bound ops are measured), so on one in-order stream nothing changes; what the rule adds is
   that ops of *different* streams are issued one after another: copies, decompressions and CPU
   experts take the issuing thread's time from the compute stream. A wait the issuing thread
   caused is blamed on the op issued just before. `per-stream` leaves rule 4 out (klotski 0.1's
   model, and the CPU runtime's, whose streams are threads of their own).

The event heap is the engine's own, not SimPy's: an op is one (time, order, op) tuple (its end;
one more when a dependency on another stream is seen after its other deps), handled in one loop.
Through SimPy's public API (`env.timeout(delay, op)` with a callback, `env.run()`) the same
engine runs at 0.6x the speed (median of 7 alternating runs each): 90k vs 142k ops/s on
experiments/bench_engine.py's 205k-op schedule, 120k vs 186k on a default as-published Klotski
run (338k ops). SimPy also places an event only at a delay from now, and a signalled dependency
falls at an absolute time that `now + (t - now)` does not always give back. Nothing here waits
on wall-clock time, so a run is deterministic.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass
from itertools import compress, count
from operator import not_
from typing import Sequence

import numpy as np

from klotski_sim.core.cost import CostModel
from klotski_sim.core.schedule import Schedule, ScheduleError, gc_paused, topological_order
from klotski_sim.core.timeline import OutOfMemory, Timeline
from klotski_sim.hardware.profile import HardwareProfile
from klotski_sim.names import base_resource, resource_rank
from klotski_sim.util.errors import UsageError


class EngineDeadlock(ScheduleError):
    """Some ops can never start (a schedule built without validation can have a cycle)."""


def resource_capacities(schedule: Schedule, profile: HardwareProfile) -> dict[str, int]:
    """Units per resource: one GPU compute unit (and one decompression unit beside it), one host
    thread, one CPU compute stream (an op there uses every core), one all-reduce at a time on a GPU
    group's fabric (NCCL runs a communicator's collectives in order); each link as many as its copy
    engines."""
    caps = {}
    for resource in set(schedule.streams.values()):
        kind = base_resource(resource)  # (each rank's own resource has the units of its kind)
        caps[resource] = (
            1 if kind in ("gpu", "host", "cpu", "gpu_decompress", "fabric") else profile.link(kind).copy_engines
        )
    return dict(sorted(caps.items()))


@dataclass(frozen=True)
class EngineRun:
    """The engine's raw answer for one schedule: per-op times aligned with `schedule.ops` (NaN: never
    ran). A caller that runs many small schedules one after another (serving's iterations) reads
    these instead of building a Timeline for each."""

    start: list[float]
    end: list[float]
    ready: list[float]
    blocked_by: list[int]
    oom: OutOfMemory | None
    peak_gpu_bytes: int
    memory_trace: list[tuple[float, int]]
    capacities: dict[str, int]
    rank_peaks: tuple[int, ...] = ()  # a schedule of several ranks: each rank's GPU memory peak

    @property
    def makespan(self) -> float:
        return max((t for t in self.end if t == t), default=0.0)


def simulate(
    schedule: Schedule,
    profile: HardwareProfile,
    cost: CostModel | None = None,
    durations: Sequence[float] | None = None,
) -> Timeline:
    """Run `schedule` on `profile`. Out-of-memory ends the run with status `oom` (never raises);
    ops that can never start raise EngineDeadlock naming them."""
    result = run_engine(schedule, profile, cost, durations)
    return Timeline.from_schedule(
        schedule,
        start=result.start,
        end=result.end,
        ready=result.ready,
        blocked_by=result.blocked_by,
        status="oom" if result.oom else "ok",
        oom=result.oom,
        peak_gpu_bytes=result.peak_gpu_bytes,
        memory_trace=result.memory_trace,
        capacities=result.capacities,
        source="simulated",
        extra_meta={
            "hardware": profile.name,
            "gpu_capacity_bytes": int(profile.gpu.usable_bytes) * max(1, len(result.rank_peaks)),
            **({"rank_peak_gpu_bytes": list(result.rank_peaks)} if result.rank_peaks else {}),
        },
    )


def run_engine(
    schedule: Schedule,
    profile: HardwareProfile,
    cost: CostModel | None = None,
    durations: Sequence[float] | None = None,
) -> EngineRun:
    """The engine's per-op times for `schedule` on `profile` (see `simulate`)."""
    with gc_paused():
        return _simulate(schedule, profile, cost, durations)


@dataclass(frozen=True)
class IssuingThread:
    """Rule 4's program order, worked out before the run, in numpy (a default as-published run has
    338k ops, 156k of them host ops). `costs`: each op's issue cost; `after_host`: the last host op
    issued before each (-1: none); `reach`: how long after that host op's end (or after time 0) the
    thread reaches the op; `before`: the op issued just before each (None: list order, so i - 1).
    `waiting_on`: for a host op, the ops issued after it that the graph does not already make wait
    for it (the thread is blocked in it): its end counts them down like a dependency's (a few per
    host op at most: the policies make most ops after a sync depend on it already)."""

    costs: list[float]
    after_host: list[int]
    reach: list[float]
    before: list[int] | None
    waiting_on: dict[int, list[int]]

    def issued_before(self, i: int) -> int:
        return i - 1 if self.before is None else self.before[i]

    @staticmethod
    def of(schedule: Schedule, profile: HardwareProfile, cost: CostModel | None) -> "IssuingThread":
        ops = schedule.ops
        n = len(ops)
        graph = schedule.graph
        costs = (cost or CostModel(profile)).issue_costs(ops, schedule.streams)
        # the CUDA runtime's order (topological_order): list order, unless a dep points forward; ops on
        # a cycle (a schedule built without its check) never start: they come last
        before: list[int] | None = None
        streams = np.asarray(schedule.column("stream"), dtype=object)
        # each rank of several has a thread of its own (a process per GPU, as torchrun and vLLM's
        # workers run them) issuing its own ops, those on a resource the ranks share included (a
        # stream `NAME@k` on the host CPU is rank k's); other unranked ops are the first thread's
        rank_of_stream = {
            s: max(0, resource_rank(r) if resource_rank(r) >= 0 else resource_rank(s))
            for s, r in schedule.streams.items()
        }
        threads = len(set(rank_of_stream.values()))
        if graph.forward:
            topo = topological_order(schedule)
            placed = np.zeros(n, dtype=bool)
            placed[topo] = True
            order = np.concatenate([np.asarray(topo, dtype=np.int64), np.flatnonzero(~placed)])
        else:
            order = np.arange(n)
        thread = np.zeros(n, dtype=np.int64)
        if threads > 1:  # each thread's ops in program order, one thread's after another's
            thread = np.fromiter(map(rank_of_stream.__getitem__, streams), dtype=np.int64, count=n)
            order = order[np.argsort(thread[order], kind="stable")]
        if graph.forward or threads > 1:
            previous = np.full(n, -1, dtype=np.int64)
            previous[order[1:]] = np.where(thread[order[1:]] == thread[order[:-1]], order[:-1], -1)
            before = previous.tolist()
        in_order = np.asarray(costs, dtype=float)[order]  # (a host op costs 0: the thread waits in it)
        passed = np.cumsum(in_order)  # the issuing time up to and with each position (all threads in a row)
        host_streams = [s for s, r in schedule.streams.items() if base_resource(r) == "host"]
        host_at = np.flatnonzero(np.isin(streams[order], host_streams))  # positions of host ops
        segment = np.searchsorted(host_at, np.arange(n), side="left") - 1  # the last host position before
        last_host = host_at[np.maximum(segment, 0)] if len(host_at) else np.zeros(n, dtype=np.int64)
        thread_at = thread[order]
        seen = (segment >= 0) & (thread_at[last_host] == thread_at)  # (a host op of the same thread)
        # where nothing blocked a thread yet, its time counts from its own first op
        first = np.concatenate(([True], thread_at[1:] != thread_at[:-1]))
        thread_start = np.maximum.accumulate(np.where(first, np.arange(n), 0))
        before_thread = np.where(thread_start > 0, passed[np.maximum(thread_start - 1, 0)], 0.0)
        reach = np.empty(n)
        reach[order] = passed - in_order - np.where(seen, passed[last_host], before_thread)
        after_host = np.full(n, -1, dtype=np.int64)
        after_host[order] = np.where(seen, order[last_host], -1)
        # the ops issued after a host op that no edge of the graph makes wait for it
        ptr = np.asarray(graph.ptr, dtype=np.int64)
        flat = np.asarray(graph.flat, dtype=np.int64)
        src = np.repeat(np.arange(n, dtype=np.int64), np.diff(ptr))
        linked = np.zeros(n, dtype=bool)
        linked[flat[after_host[flat] == src]] = True
        needy = np.flatnonzero((after_host >= 0) & ~linked)
        waiting_on: dict[int, list[int]] = {}
        for op_index, host in zip(needy.tolist(), after_host[needy].tolist()):
            waiting_on.setdefault(host, []).append(op_index)
        return IssuingThread(costs, after_host.tolist(), reach.tolist(), before, waiting_on)


def _simulate(
    schedule: Schedule, profile: HardwareProfile, cost: CostModel | None, durations: Sequence[float] | None
) -> EngineRun:
    ops = schedule.ops
    n = len(ops)
    if durations is None:
        durations = (cost or CostModel(profile)).durations(ops, schedule.streams)
    if len(durations) != n:
        raise UsageError(f"{len(durations)} durations for {n} ops")
    checked = np.asarray(durations, dtype=float)
    bad = np.flatnonzero(~np.isfinite(checked) | (checked < 0)) if n else np.empty(0, dtype=np.intp)
    if len(bad):
        raise ScheduleError(
            f"op {ops[bad[0]].id!r} would last {checked[bad[0]]} s: durations must be finite and "
            f">= 0 (check the profile's numbers)"
        )
    durations = checked.tolist()
    issue = IssuingThread.of(schedule, profile, cost) if profile.gpu.issue == "serial" and n else None
    caps = resource_capacities(schedule, profile)
    resources = sorted(caps)
    res_number = {r: k for k, r in enumerate(resources)}
    stream_res = {s: res_number[r] for s, r in schedule.streams.items()}
    stream_names = schedule.column("stream")
    resource_of = list(map(stream_res.__getitem__, stream_names))
    capacity = int(profile.gpu.usable_bytes)

    # Graph: successors of each op (its dependents and its stream successor), and how many
    # predecessors each op still waits for.
    succ_ptr, succ_flat, indegree, _ = schedule.graph
    pending = list(indegree)  # (the graph is the schedule's: counted down on a copy)
    if issue is not None:  # an op issued after a host op waits for it too (the issuing thread was blocked)
        after_host, reach_of, waiting_on = issue.after_host, issue.reach, issue.waiting_on
        issued_before = issue.issued_before
        for waiting in waiting_on.values():
            for s in waiting:
                pending[s] += 1
    alloc_of, free_of = schedule.column("alloc"), schedule.column("free")

    nan = float("nan")
    ready_at, start, end, blocker = [nan] * n, [nan] * n, [nan] * n, [-1] * n
    # host ops: when the host thread reached them (their host-stream predecessor ended)
    # (a host op is an op of a host stream: the schedule's check allows no other kind there, nor a host op elsewhere)
    is_host = list(map({s: base_resource(r) == "host" for s, r in schedule.streams.items()}.__getitem__, stream_names))
    arrival = [0.0] * n  # (read of host ops alone)
    # a dependency on another stream is seen `latency` after it ends (event signalling)
    latency = profile.gpu.dependency_latency_s
    stream_number = {s: k for k, s in enumerate(schedule.streams)}
    stream_of = list(map(stream_number.__getitem__, stream_names)) if latency else []
    floors = bool(latency) or issue is not None
    # the earliest an op may be ready: a signalled dependency's latency, the issuing thread's reach
    ready_floor = [0.0] * n if floors else []
    issued_at = [0.0] * n if issue is not None else []  # when the issuing thread reaches each op
    free_units = [caps[r] for r in resources]
    queues: list[list[tuple[float, int]]] = [[] for _ in resources]
    preloaded = sum(size for _, size in schedule.preloaded)
    buffers: dict[str, int] = dict(schedule.preloaded)
    memory_trace: list[tuple[float, int]] = [(0.0, preloaded)]
    mem = [preloaded, preloaded]  # in use, peak (of all ranks together)
    # GPU memory of each rank of several, each with the profile's capacity (a buffer NAME@k is rank k's)
    ranks = sorted({resource_rank(r) for r in schedule.streams.values()} - {-1})
    rank_in_use = [0] * (ranks[-1] + 1) if ranks else []
    for name, size in schedule.preloaded if ranks else ():
        rank_in_use[resource_rank(name)] += size
    rank_peak = list(rank_in_use)
    oom: list[OutOfMemory] = []
    # The event heap: (time, order, code), `order` counting pushes so that events of one time come
    # out first pushed, first out; code i >= 0: op i ends; code ~s < 0: a dependency of op s on
    # another stream is signalled.
    events: list[tuple[float, int, int]] = []
    order = count()
    heappush, heappop = heapq.heappush, heapq.heappop
    # a one-unit resource's current op ends at busy_until: an op signalled before then can wait in
    # the queue without an event of its own (the end of the running op dispatches it)
    single = [caps[r] == 1 for r in resources]
    busy_until = [0.0] * len(resources)

    def rank_allocate(alloc: tuple[tuple[str, int], ...], i: int, now: float) -> bool:
        """Op i's buffers taken on their ranks' GPUs; False (and the run's end) when one lacks room."""
        wanted: dict[int, int] = {}
        for name, size in alloc:
            k = resource_rank(name)
            wanted[k] = wanted.get(k, 0) + size
        for k, size in wanted.items():
            if rank_in_use[k] + size > capacity:
                oom.append(
                    OutOfMemory(
                        op_id=ops[i].id,
                        time=now,
                        needed_bytes=rank_in_use[k] + size,
                        available_bytes=capacity,
                        in_use_bytes=rank_in_use[k],
                        detail=f"rank {k}'s GPU",
                    )
                )
                return False
        for k, size in wanted.items():
            rank_in_use[k] += size
            if rank_in_use[k] > rank_peak[k]:
                rank_peak[k] = rank_in_use[k]
        return True

    def dispatch(r: int, now: float) -> None:
        """Start queued ops on resource r while it has free units."""
        queue = queues[r]
        while queue and free_units[r] and not oom:
            i = heappop(queue)[1]
            alloc = alloc_of[i]
            if alloc:
                need = alloc[0][1] if len(alloc) == 1 else sum(size for _, size in alloc)  # (mostly one buffer)
                if ranks:
                    if not rank_allocate(alloc, i, now):
                        return
                elif mem[0] + need > capacity:
                    oom.append(
                        OutOfMemory(
                            op_id=ops[i].id,
                            time=now,
                            needed_bytes=mem[0] + need,
                            available_bytes=capacity,
                            in_use_bytes=mem[0],
                        )
                    )
                    return
                for name, size in alloc:
                    buffers[name] = size
                mem[0] += need
                if mem[0] > mem[1]:
                    mem[1] = mem[0]
                memory_trace.append((now, mem[0]))
            free_units[r] -= 1
            start[i] = arrival[i] if is_host[i] else now
            done = now + durations[i]
            if issue is not None and not is_host[i]:  # (not before the thread has issued all of it)
                issued = issued_at[i] + issue.costs[i]
                if issued > done:
                    done = issued
            busy_until[r] = done
            heappush(events, (done, next(order), i))

    if ranks and max(rank_in_use) > capacity:
        k = rank_in_use.index(max(rank_in_use))
        oom.append(
            OutOfMemory(
                op_id="<preloaded>",
                time=0.0,
                needed_bytes=rank_in_use[k],
                available_bytes=capacity,
                in_use_bytes=0,
                detail=f"rank {k}'s GPU",
            )
        )
    elif not ranks and preloaded > capacity:
        oom.append(
            OutOfMemory(op_id="<preloaded>", time=0.0, needed_bytes=preloaded, available_bytes=capacity, in_use_bytes=0)
        )
    else:
        for i in compress(range(n), map(not_, pending)):  # (the ops waiting for none: a C-level filter)
            if issue is not None and reach_of[i] > 0.0:  # (the issuing thread reaches it later; no host op before it)
                issued_at[i] = ready_floor[i] = arrival[i] = reach_of[i]
                blocker[i] = issued_before(i)
                heappush(events, (reach_of[i], next(order), ~i))
                continue
            ready_at[i] = 0.0
            heappush(queues[resource_of[i]], (0.0, i))
        for r in range(len(resources)):
            dispatch(r, 0.0)
    while events:
        now, _, i = heappop(events)
        if i < 0:  # a dependency on another stream has been signalled: the op joins its resource's queue
            s = ~i
            ready_at[s] = now
            rs = resource_of[s]
            heappush(queues[rs], (now, s))
            dispatch(rs, now)
            continue
        # op i ends: its buffers are freed, its unit released, its successors counted down
        end[i] = now
        freed = free_of[i]
        if freed:
            for name in freed:
                if name not in buffers:
                    raise ScheduleError(
                        f"op {ops[i].id!r} frees buffer {name!r}, which is not allocated when "
                        f"the op ends (freed twice, or a dependency on its allocator is missing)"
                    )
                size = buffers.pop(name)
                mem[0] -= size
                if ranks:
                    rank_in_use[resource_rank(name)] -= size
            memory_trace.append((now, mem[0]))
        r = resource_of[i]
        free_units[r] += 1
        woken, more_woken = -1, None  # other resources with newly ready ops (mostly one: no set for it)
        host_i = is_host[i]
        signal = latency and not host_i
        if signal:
            own_stream, seen_at = stream_of[i], now + latency
        successors = succ_flat[succ_ptr[i] : succ_ptr[i + 1]]
        if host_i and issue is not None and i in waiting_on:  # (rule 4: the ops the thread issues next)
            successors = successors + waiting_on[i]
        for s in successors:
            if host_i and is_host[s]:
                arrival[s] = now  # the host thread moves on to its next wait
            if signal and stream_of[s] != own_stream and not is_host[s]:
                # (a host op's own latency is the whole round trip: GPU done -> host -> next launch)
                if ready_floor[s] < seen_at:
                    ready_floor[s] = seen_at
            left = pending[s] - 1
            pending[s] = left
            if not left:
                blocker[s] = i
                if issue is not None:  # when the issuing thread reached it (its host op has ended)
                    h = after_host[s]
                    reach = end[h] + reach_of[s] if h >= 0 else reach_of[s]
                    issued_at[s] = reach
                    if ready_floor[s] < reach:
                        ready_floor[s] = reach
                    if is_host[s] and arrival[s] < reach:
                        arrival[s] = reach
                if floors and ready_floor[s] > now:
                    if issue is not None and issued_at[s] >= ready_floor[s]:
                        blocker[s] = issued_before(s)  # the issuing thread reached it last
                    floor = ready_floor[s]
                    rs = resource_of[s]
                    if single[rs] and not free_units[rs] and busy_until[rs] > floor:
                        ready_at[s] = floor  # seen while its resource is still busy
                        heappush(queues[rs], (floor, s))
                    else:
                        heappush(events, (floor, next(order), ~s))
                    continue
                ready_at[s] = now
                rs = resource_of[s]
                heappush(queues[rs], (now, s))
                if rs != r and rs != woken:
                    if woken < 0:
                        woken = rs
                    else:
                        more_woken = more_woken or {woken}
                        more_woken.add(rs)
        if queues[r]:
            dispatch(r, now)
        if more_woken:
            for rs in sorted(more_woken):
                dispatch(rs, now)
        elif woken >= 0:
            dispatch(woken, now)

    never_ended = np.flatnonzero(np.isnan(np.asarray(end, dtype=float))) if n else np.empty(0, dtype=np.intp)
    if not oom and len(never_ended):
        stuck = [ops[i].id for i in range(n) if start[i] != start[i]]
        shown = ", ".join(stuck[:10]) + (f" ... ({len(stuck)} in all)" if len(stuck) > 10 else "")
        raise EngineDeadlock(f"deadlock: {len(stuck)} op(s) can never start: {shown}")

    return EngineRun(
        start, end, ready_at, blocker, oom[0] if oom else None, mem[1], memory_trace, caps, tuple(rank_peak)
    )
