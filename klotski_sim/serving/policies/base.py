"""Serving policies: where a serving engine keeps each layer's weights, and the ops one layer of one
iteration becomes. A policy is a class registered by `@serving_policy`; its options are an
`option()` dataclass (klotski_sim.policies.options), validated and listed like the offline ones'.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any, ClassVar, Hashable, Mapping

from klotski_sim.core.schedule import DEFAULT_STREAMS, ScheduleBuilder
from klotski_sim.hardware.profile import HardwareProfile
from klotski_sim.policies.options import OptionSpec, specs_of
from klotski_sim.serving.batcher import BatchingConfig
from klotski_sim.serving.emit import IterationEmitter
from klotski_sim.serving.memory import Residency
from klotski_sim.serving.requests import Workload
from klotski_sim.util.errors import UsageError
from klotski_sim.workload.model import ModelSpec


@dataclass(frozen=True)
class NoOptions:
    pass


@dataclass(frozen=True)
class ServingSetup:
    """What a serving policy may look at when it places weights."""

    model: ModelSpec
    profile: HardwareProfile
    batching: BatchingConfig
    workload: Workload
    gpu_memory_utilization: float
    options: Mapping[str, Any] = field(default_factory=dict)


class ServingPolicy(ABC):
    """One serving engine's weight placement and per-layer ops (subclass and register)."""

    name: ClassVar[str]
    description: ClassVar[str]
    Options: ClassVar[type] = NoOptions
    needs_cpu: ClassVar[bool] = False  # computes on the host CPU: needs a profile with a `cpu:` section

    def __init__(self, setup: ServingSetup) -> None:
        self.setup, self.model, self.profile = setup, setup.model, setup.profile
        self.options = setup.options
        self.decisions: list[str] = []  # what a policy that decides during the run decided, and when
        if self.needs_cpu:
            self.profile.require_cpu(f"serving policy {self.name!r}")

    def streams(self) -> dict[str, str]:
        return dict(DEFAULT_STREAMS)

    @abstractmethod
    def residency(self) -> Residency:
        """What the GPU holds for the whole run, and what stays in host memory."""

    def preload(self, builder: ScheduleBuilder, residency: Residency) -> None:
        """The GPU memory held for the whole run (the KV pool is preloaded by the run itself)."""
        builder.preload("weights/resident", residency.gpu_weight_bytes)

    @abstractmethod
    def layer(self, em: IterationEmitter, layer: int, after: str) -> str:
        """Emit `layer` of the current iteration after op `after`; returns the layer's last op."""

    def finish_iteration(self, em: IterationEmitter) -> list[str]:
        """Ops still in flight at the iteration's end that the host must wait for (besides the logits)."""
        return []

    def start_iteration(self, em: IterationEmitter) -> list[str]:
        """Ops the iteration's first op waits for (a residency change decided after the last one)."""
        return []

    def after_iteration(self, seen: "IterationSeen") -> int:
        """Read the iteration that just ran; returns the change in KV blocks it decides (0: none)."""
        return 0

    def watches_iterations(self) -> bool:
        """Whether `after_iteration` reads the iterations (the run then gives it every op's duration)."""
        return type(self).after_iteration is not ServingPolicy.after_iteration

    def emission_state(self) -> Hashable | None:
        """What this policy's ops depend on besides the batch's shape, as a value: equal states and
        shapes give equal ops, and a run then times an iteration from the template of an earlier one
        instead of emitting it (klotski_sim.core.maxplus). None, the default for a policy that does not
        say: its ops are emitted every iteration."""
        return None


@dataclass(frozen=True)
class IterationSeen:
    """An iteration as it ran, for a policy that decides during the run."""

    durations: Mapping[str, float]  # op id -> seconds
    prefix: str  # the iteration's op-id prefix (`it7/`)
    active: int  # B_act
    unfinished: int  # arrived requests not finished
    free_blocks: int  # blocks the cache could give up now (free, and not needed by the longest request)
    block_bytes: int


SERVING_POLICIES: dict[str, type[ServingPolicy]] = {}


def serving_policy(cls: type[ServingPolicy]) -> type[ServingPolicy]:
    """Register a serving policy class under its `name`."""
    if cls.name in SERVING_POLICIES:
        raise UsageError(f"serving policy {cls.name!r} is already registered")
    specs_of(cls.Options)  # (a bad options class is refused here, not in a run)
    SERVING_POLICIES[cls.name] = cls
    return cls


def get_serving_policy(name: str) -> type[ServingPolicy]:
    try:
        return SERVING_POLICIES[name]
    except KeyError:
        raise UsageError(f"unknown serving policy {name!r}; serving policies: {', '.join(SERVING_POLICIES)}") from None


def serving_option_specs(name: str) -> dict[str, OptionSpec]:
    return {spec.name: spec for spec in specs_of(get_serving_policy(name).Options)}


def resolve_serving_options(name: str, options: Mapping[str, Any]) -> dict[str, Any]:
    """The policy's option values: its defaults, then `options`, each checked against its spec."""
    specs = serving_option_specs(name)
    unknown = set(options) - set(specs)
    if unknown:
        raise UsageError(
            f"serving policy {name!r} has no option(s) {sorted(unknown)}; options: {', '.join(specs) or 'none'}"
        )
    for key, value in options.items():
        specs[key].check(name, value)
    return {**{k: s.default for k, s in specs.items()}, **options}
