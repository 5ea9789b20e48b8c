"""FluxMoE's budget-aware residency planner, decided during the run (SERVING.md "Mechanisms").

Every `control_interval` iterations (16 in the paper) it reads the last iteration: the active batch
`B_act`, the unfinished requests `B_rem`, the mean time to materialise a pageable layer (`tau_load`)
and the mean forward time of a layer (`tau_eff`). SERVING.md names these quantities and the pressure
ratio rho = B_rem / B_act, but not how the times enter the rule; the rule here is ours, written so
that it does what the summary says the planner is for:

- *reclaim* one step when requests wait (rho > 1, B_act < B_rem): up to ceil(granularity x L) of
  the pageable layers' down-projection tensors still in the compressed GPU tier move to host memory
  (L: the pageable layers; granularity 0.25), then, when none is left, up to
  ceil(granularity x L / 2) gate/up tensors, each time from the layers with the least volume
  already in host memory; the GPU memory they held becomes KV blocks;
- *reverse* the last step when no request waits and the loads are exposed — the layers' forward
  time covers less than `dead_zone` (0.9) of their materialisation (tau_eff / tau_load < 0.9) — and
  the KV cache has the blocks free;
- keep the residency otherwise.

Which layers are pageable is not changed during a run (that needs a remapping between engine
launches).

A layer's experts are three equal matrices per expert: the fused gate/up projection is 2/3 of them,
the down projection 1/3.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

TENSOR_SHARE = {"gate_up": 2 / 3, "down": 1 / 3}


@dataclass(frozen=True)
class Feedback:
    """What the planner reads of the iteration that just ended."""

    active: int  # B_act
    unfinished: int  # B_rem: arrived requests not finished (running and waiting)
    tau_load: float  # mean seconds to materialise a pageable layer
    tau_eff: float  # mean seconds of a layer's forward compute
    free_blocks: int


@dataclass(frozen=True)
class Step:
    """One reclaim: tensors moved from the compressed GPU tier to host memory, and the KV blocks
    their memory became."""

    tensors: tuple[tuple[int, str], ...]  # (layer, "gate_up" | "down")
    freed_bytes: int
    blocks: int


@dataclass
class ResidencyPlanner:
    layers: tuple[int, ...]  # pageable layers
    layer_bytes: dict[int, int]  # uncompressed routed-expert bytes of each pageable layer
    on_gpu: dict[int, set[str]]  # tensors of each pageable layer in the compressed GPU tier
    stored_share: float  # compressed size / uncompressed size
    block_bytes: int
    control_interval: int = 16
    granularity: float = 0.25
    dead_zone: float = 0.9
    steps: list[Step] = field(default_factory=list)
    since: int = 0
    log: list[tuple[str, float]] = field(default_factory=list)  # (action, rho) at each decision

    def share(self, layer: int) -> float:
        """The share of `layer`'s experts in the compressed tier."""
        return sum(TENSOR_SHARE[t] for t in self.on_gpu.get(layer, ()))

    def stored_bytes(self, layer: int, tensor: str) -> int:
        return int(TENSOR_SHARE[tensor] * self.layer_bytes[layer] * self.stored_share)

    def _host_bytes(self, layer: int) -> float:
        return (1 - self.share(layer)) * self.layer_bytes[layer]

    def decide(self, fb: Feedback) -> tuple[str, Step | None]:
        """After an iteration: `("reclaim", step)`, `("reverse", step)` or `("keep", None)`."""
        self.since += 1
        if self.since < self.control_interval or not self.layers:
            return "keep", None
        self.since = 0
        rho = fb.unfinished / max(1, fb.active)
        hidden = fb.tau_eff / fb.tau_load if fb.tau_load > 0 else math.inf
        if rho > 1 and fb.active < fb.unfinished:
            step = self._reclaim()
            self.log.append(("reclaim" if step else "keep", rho))
            return ("reclaim", step) if step else ("keep", None)
        if hidden < self.dead_zone and self.steps and fb.free_blocks >= self.steps[-1].blocks:
            step = self.steps.pop()
            for layer, tensor in step.tensors:
                self.on_gpu[layer].add(tensor)
            self.log.append(("reverse", rho))
            return "reverse", step
        self.log.append(("keep", rho))
        return "keep", None

    def _reclaim(self) -> Step | None:
        for tensor, count in (
            ("down", self.granularity * len(self.layers)),
            ("gate_up", self.granularity * len(self.layers) / 2),
        ):
            candidates = sorted(
                (j for j in self.layers if tensor in self.on_gpu[j]), key=lambda j: (self._host_bytes(j), j)
            )
            chosen = candidates[: math.ceil(count)]
            if chosen:
                freed = sum(self.stored_bytes(j, tensor) for j in chosen)
                for j in chosen:
                    self.on_gpu[j].discard(tensor)
                step = Step(tuple((j, tensor) for j in chosen), freed, freed // self.block_bytes)
                self.steps.append(step)
                return step
        return None
