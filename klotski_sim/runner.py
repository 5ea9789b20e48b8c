"""One simulated run from a plain description: the path CLI, compare, sweeps and the runtime's
validate all share, so a configuration means the same thing everywhere.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, replace
from functools import lru_cache
from pathlib import Path
from typing import Any, Mapping

from .cost import CostModel
from .engine import simulate
from .hardware import HardwareProfile, load_profile, with_overrides
from .model import ModelSpec, get_model
from .policies import Placement, PolicyInput, build_schedule
from .routing import RunShape
from .schedule import Schedule
from .timeline import Timeline
from .trace import Replay, Trace, TraceError, replay
from .trace_synth import synthesize


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
    routing: str = "calibrated"  # synthetic routing kind, used when no trace is given
    trace: str | None = None  # a routing trace file (.npz) to replay instead
    wrap: bool = False  # let a short trace reuse sequences (said in the summary)
    warmup_sequences: int = 8  # sequences kept apart for a prefetcher's pre-run (paper: batch 8)
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


@lru_cache(maxsize=4)
def _synthetic_trace(model: ModelSpec, routing: str, seed: int, sequences: int, prompt_len: int, gen_len: int) -> Trace:
    return synthesize(model, sequences, prompt_len, gen_len, routing, seed)


@lru_cache(maxsize=4)
def _trace_file(path: str, mtime: float) -> Trace:
    return Trace.load(path)


def make_replay(spec: RunSpec, model: ModelSpec) -> Replay:
    """The routing of the run: replayed from `spec.trace`, or from a synthetic trace generated
    for exactly this run (same seed -> same routing for every policy)."""
    shape = spec.shape
    if spec.trace:
        path = Path(spec.trace)
        if not path.exists():
            raise TraceError(f"{path}: no such trace file")
        trace = _trace_file(str(path), path.stat().st_mtime)
        return replay(trace, model, shape, warmup_sequences=spec.warmup_sequences, wrap=spec.wrap, where=str(path))
    trace = _synthetic_trace(model, spec.routing, spec.seed, shape.num_sequences + spec.warmup_sequences,
                             shape.prompt_len, shape.gen_len)
    return replay(trace, model, shape, warmup_sequences=spec.warmup_sequences, where=f"synthetic {spec.routing}")


def prepare(spec: RunSpec) -> tuple[ModelSpec, HardwareProfile, PolicyInput]:
    model = get_model(spec.model)
    profile = resolve_profile(spec)
    rep = make_replay(spec, model)
    inp = PolicyInput(model, profile, rep.routing, Placement(kv=spec.kv), dict(spec.options), warmup=rep.warmup)
    return model, profile, inp


def run(spec: RunSpec, cost: CostModel | None = None) -> RunResult:
    """Build the schedule for `spec` and simulate it."""
    model, profile, inp = prepare(spec)
    schedule = build_schedule(spec.policy, inp)
    timeline = simulate(schedule, profile, cost)
    return RunResult(spec, model, profile, schedule, timeline)


def with_policy(spec: RunSpec, policy: str, **changes: Any) -> RunSpec:
    return replace(spec, policy=policy, **changes)
