"""The templates a serving run times its iterations by: most iterations of a run have one of a few
shapes, so each shape's ops are validated once (`IterationTemplates`, timed by the engine), and a
run that does not keep its ops times an iteration of a known shape without emitting it
(`CompiledIterations`, by klotski_sim.core.maxplus: exact, attention's duration the one that
changes with the requests' context)."""

from __future__ import annotations

from collections.abc import Hashable, Mapping
from dataclasses import dataclass

from klotski_sim.core.cost import CostModel, costed_fields
from klotski_sim.core.maxplus import OneVaryingDuration
from klotski_sim.core.schedule import Op, Schedule
from klotski_sim.serving.emit import BatchShape, IterationEmitter


class IterationTemplates:
    """One iteration's ops as a Schedule of their own (dependencies on earlier iterations are met by
    its start), built and validated once per *shape* — the ops, streams, dependencies and buffers,
    iteration number aside — and reused with each iteration's own durations: most iterations of a
    run have one of a few shapes, and validating each again took half the run's time."""

    def __init__(self, streams: Mapping[str, str], preloaded: list[tuple[str, int]]) -> None:
        self.streams = dict(streams)
        self.live = dict(preloaded)  # the GPU buffers held between iterations (weights, the KV pool)
        self._live_version = 0
        self._schedules: dict[tuple, Schedule] = {}

    def ran(self, ops: list[Op]) -> None:
        """An iteration's ops ran: the buffers they left allocated (or freed) are held from now on."""
        for op in ops:
            if op.alloc or op.free:
                for name, size in op.alloc:
                    self.live[name] = size
                for name in op.free:
                    self.live.pop(name, None)
        if any(op.alloc or op.free for op in ops):
            held = {name for op in ops for name, _ in op.alloc} - {name for op in ops for name in op.free}
            dropped = {name for op in ops for name in op.free} - {name for op in ops for name, _ in op.alloc}
            if held or dropped:
                self._live_version += 1

    def schedule(self, ops: list[Op], prefix: str) -> Schedule:
        # An op id names its role in the iteration (`it7/L3/moe`): within one run the same ids have
        # the same streams and dependencies, so the ids and the buffer sizes are the shape. (The run's
        # whole Schedule is validated at the end, and the tests time it whole against the iterations.)
        cut = len(prefix)
        key = (self._live_version, tuple(op.id[cut:] for op in ops), tuple(b for op in ops for _, b in op.alloc))
        found = self._schedules.get(key)
        if found is None:
            ids = {op.id for op in ops}
            own = tuple(
                op if all(d in ids for d in op.deps) else op._replace(deps=tuple(d for d in op.deps if d in ids))
                for op in ops
            )
            found = self._schedules[key] = Schedule(ops=own, streams=self.streams, preloaded=tuple(self.live.items()))
        return found

    @property
    def live_version(self) -> int:
        """Changes whenever the buffers held between iterations change (a template's preloaded set)."""
        return self._live_version


@dataclass(frozen=True)
class CompiledIteration:
    """One iteration shape timed as a function of its attention ops' duration."""

    timing: OneVaryingDuration
    attention: Op  # one of its attention ops (they are costed alike)
    resource: str  # the attention ops' resource
    ids: tuple[str, ...]  # the ops' ids without the iteration's prefix


class CompiledIterations:
    """Compiled iteration shapes by (the policy's emission state, the held buffers, the batch's timing
    key); None for a shape the engine would queue on (klotski_sim.core.maxplus)."""

    def __init__(self, cost: CostModel, em: IterationEmitter, capacity: int) -> None:
        self.cost, self.em, self.capacity = cost, em, capacity
        self._compiled: dict[Hashable, CompiledIteration | None] = {}  # None: the engine times that shape

    def get(self, key: Hashable | None) -> CompiledIteration | None:
        return self._compiled.get(key) if key is not None else None

    def add(self, key: Hashable, template: Schedule, durations: list[float], prefix: str) -> None:
        """Compile the iteration just timed by the engine (its ops `template`, its emitter's record of
        which ops grow with the context)."""
        if key in self._compiled:
            return
        varying = self.em.context_ops
        attention = {costed_fields(template.ops[i]) for i in varying}
        timing = (
            OneVaryingDuration.compile(template, self.cost.profile, durations, varying) if len(attention) <= 1 else None
        )
        if timing is None or not varying:
            self._compiled[key] = None
            return
        first = template.ops[varying[0]]
        cut = len(prefix)
        ids = tuple(op.id[cut:] for op in template.ops)
        self._compiled[key] = CompiledIteration(timing, first, template.streams[first.stream], ids)

    def attention_seconds(self, compiled: CompiledIteration, shape: BatchShape) -> float:
        flops, nbytes, kv_len = self.em.attention_cost(shape)
        op = compiled.attention._replace(flops=flops, bytes=nbytes, kv_len=kv_len)
        return self.cost.duration(op, compiled.resource)

    def durations(self, compiled: CompiledIteration, a: float, prefix: str) -> Mapping[str, float]:
        return dict(zip((prefix + i for i in compiled.ids), compiled.timing.durations(a).tolist()))
