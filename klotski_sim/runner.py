"""One simulated run from a plain description: the path CLI, compare, sweeps and the runtime's
validate all share, so a configuration means the same thing everywhere.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, replace
from typing import Any, Mapping

from .cost import CostModel
from .engine import simulate
from .hardware import HardwareProfile, load_profile, with_overrides
from .model import ModelSpec, get_model
from .policies import Placement, PolicyInput, build_schedule
from .routing import RoutingTable, RunShape, uniform_routing
from .schedule import Schedule
from .timeline import Timeline


@dataclass(frozen=True)
class RunSpec:
    """Inputs of one run. `hardware` is a built-in profile name or a YAML path; `overrides` are
    dotted profile fields (`links.pcie_h2d.bandwidth`) for what-if questions."""

    model: str = "mixtral-8x7b"
    hardware: str = "rtx3090"
    policy: str = "single-batch"
    batch_size: int = 16
    num_batches: int = 1
    prompt_len: int = 512
    gen_len: int = 32
    seed: int = 0
    routing: str = "uniform"
    kv: str = "gpu"
    overrides: Mapping[str, Any] = field(default_factory=dict)
    options: Mapping[str, Any] = field(default_factory=dict)

    @property
    def shape(self) -> RunShape:
        return RunShape(self.batch_size, self.num_batches, self.prompt_len, self.gen_len)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass
class RunResult:
    spec: RunSpec
    model: ModelSpec
    profile: HardwareProfile
    schedule: Schedule
    timeline: Timeline


def resolve_profile(spec: RunSpec) -> HardwareProfile:
    profile = load_profile(spec.hardware)
    return with_overrides(profile, dict(spec.overrides)) if spec.overrides else profile


def make_routing(spec: RunSpec, model: ModelSpec) -> RoutingTable:
    if spec.routing != "uniform":
        raise ValueError(f"unknown routing {spec.routing!r}; available: uniform")
    return uniform_routing(model.num_layers, model.num_experts, model.top_k, spec.shape, spec.seed)


def prepare(spec: RunSpec) -> tuple[ModelSpec, HardwareProfile, PolicyInput]:
    model = get_model(spec.model)
    profile = resolve_profile(spec)
    routing = make_routing(spec, model)
    return model, profile, PolicyInput(model, profile, routing, Placement(kv=spec.kv), dict(spec.options))


def run(spec: RunSpec, cost: CostModel | None = None) -> RunResult:
    """Build the schedule for `spec` and simulate it."""
    model, profile, inp = prepare(spec)
    schedule = build_schedule(spec.policy, inp)
    timeline = simulate(schedule, profile, cost)
    return RunResult(spec, model, profile, schedule, timeline)


def with_policy(spec: RunSpec, policy: str, **changes: Any) -> RunSpec:
    return replace(spec, policy=policy, **changes)
