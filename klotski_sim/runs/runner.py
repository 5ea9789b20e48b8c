"""One simulated run from a plain description: the path CLI, compare, sweeps and the runtime's
validate all share, so a configuration means the same thing everywhere.
"""

from __future__ import annotations

import ctypes
import multiprocessing
import os
import signal
import sys
import threading
from concurrent.futures import FIRST_COMPLETED, Future, ProcessPoolExecutor, wait
from concurrent.futures.process import BrokenProcessPool
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field, replace
from functools import lru_cache
from pathlib import Path
from typing import Any, Callable, Collection, Iterator, Mapping

import numpy as np

from klotski_sim.core.cost import CostModel
from klotski_sim.core.engine import simulate
from klotski_sim.core.schedule import Schedule, quiet_gc_in_worker
from klotski_sim.core.timeline import MEMORY_CHECK, OutOfMemory, Timeline
from klotski_sim.files.disk_cache import cache_dir
from klotski_sim.hardware.profile import HardwareProfile, load_profile, with_overrides
from klotski_sim.parallel.tensor import group_machine, group_model
from klotski_sim.planning.planner import (
    Plan,
    default_placement,
    fill_resident_layers,
    host_kv_bytes,
    largest_fitting_n,
    memory_floor,
    memory_needed,
    plan,
    storage_refusal,
)
from klotski_sim.planning.probe import Probe, ProbeSearch, probe_gen_len, search
from klotski_sim.policies import Placement, PolicyInput, build_schedule, get_policy
from klotski_sim.policies.base import resolve_options
from klotski_sim.policies.impl import Impl
from klotski_sim.report.exports import to_chrome_trace
from klotski_sim.util import run_size
from klotski_sim.util.argtypes import MAX_COUNT, MAX_SEED
from klotski_sim.util.errors import KlotskiError, MissingCapability, StorageRefusal, UsageError
from klotski_sim.util.machine import slowdown
from klotski_sim.util.stopping import STOP_SIGNALS
from klotski_sim.util.timelimit import policy_timeout, set_policy_timeout
from klotski_sim.util.units import memory_text
from klotski_sim.workload.model import ModelSpec, get_model
from klotski_sim.workload.routing import RoutingTable, RunShape
from klotski_sim.workload.trace import Replay, Trace, TraceError, replay
from klotski_sim.workload.trace_cache import cached_trace
from klotski_sim.workload.trace_stats import popularity
from klotski_sim.workload.trace_synth import (
    DEFAULT_ROUTING,
    base_popularity,
    check_routing_fits,
    params_for,
    synthesize,
    synthesized_blocks,
)


@dataclass(frozen=True)
class RunSpec:
    """Inputs of one run. `hardware` is a built-in profile name or a YAML path; `overrides` are
    dotted profile fields (`links.pcie_h2d.bandwidth`) for what-if questions."""

    model: str = "mixtral-8x7b"
    hardware: str = "rtx3090"
    policy: str = "single-batch"
    batch_size: int = 16
    num_batches: int | None = 1  # None: the planner picks n
    prompt_len: int = 512
    gen_len: int = 32
    seed: int = 0
    routing: str = DEFAULT_ROUTING  # synthetic routing kind, used when no trace is given
    trace: str | None = None  # a routing trace file (.npz) to replay instead
    wrap: bool = False  # let a short trace reuse sequences (said in the summary)
    warmup_sequences: int = 8  # sequences kept apart for a prefetcher's pre-run (paper: batch 8)
    kv: str = "auto"  # gpu | cpu | auto (GPU when the KV cache of n batches fits)
    experts: str = "auto"  # cpu | disk | auto (disk when host memory is short)
    # None: the planner's choice with auto n, else 0; "fill": as many as the memory n batches leave allows
    resident_layers: int | str | None = None
    overrides: Mapping[str, Any] = field(default_factory=dict)
    options: Mapping[str, Any] = field(default_factory=dict)
    impl: str = "as-published"  # implementation preset (klotski_sim.policies.impl); `options` override it
    gpus: int = 1  # a tensor-parallel group of this many of the profile's GPUs (parallel.tensor)

    def __post_init__(self) -> None:
        """Each field of the type it is read as, numpy integers taken as ints: from a notebook,
        `seed=None` would draw random routing (cached under `seed: null`), `batch_size=np.int64(2)`
        fail in the trace cache's JSON, `options=None` and `model=3` in attribute look-ups."""

        def count(name: str, low: int, high: int, optional: bool = False) -> None:
            value = getattr(self, name)
            if optional and value is None:
                return
            if isinstance(value, np.integer):
                value = int(value)
                object.__setattr__(self, name, value)
            if not isinstance(value, int) or isinstance(value, bool) or not low <= value <= high:
                raise UsageError(
                    f"RunSpec.{name} must be an integer from {low} to {high}"
                    f"{' (or None)' if optional else ''}, got {value!r}"
                )

        for name in ("batch_size", "prompt_len", "gen_len"):
            count(name, 1, MAX_COUNT)
        count("num_batches", 1, MAX_COUNT, optional=True)
        count("warmup_sequences", 0, MAX_COUNT)
        count("seed", 0, MAX_SEED)
        count("gpus", 1, 1024)
        if isinstance(self.hardware, os.PathLike):  # (a profile file given as a Path)
            object.__setattr__(self, "hardware", os.fspath(self.hardware))
        for name in ("model", "hardware", "policy", "routing", "kv", "experts", "impl"):
            if not isinstance(getattr(self, name), str):
                raise UsageError(f"RunSpec.{name} must be a string, got {getattr(self, name)!r}")
        if self.trace is not None and not isinstance(self.trace, (str, os.PathLike)):
            raise UsageError(f"RunSpec.trace must be a path (or None), got {self.trace!r}")
        if not isinstance(self.wrap, bool):
            raise UsageError(f"RunSpec.wrap must be true or false, got {self.wrap!r}")
        for name in ("overrides", "options"):
            value = getattr(self, name)
            if not isinstance(value, Mapping) or not all(isinstance(k, str) for k in value):
                raise UsageError(f"RunSpec.{name} must map names (strings) to values, got {value!r:.80}")

    def shape(self, num_batches: int) -> RunShape:
        return RunShape(self.batch_size, num_batches, self.prompt_len, self.gen_len)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True)
class Prepared:
    """A RunSpec resolved into the workload all policies of a comparison share: model, profile,
    the planner's n and placement, and the routing drawn for that n."""

    spec: RunSpec
    model: ModelSpec
    profile: HardwareProfile
    num_batches: int
    placement: Placement
    trace: Trace | None
    replay: Replay | None
    plan: Plan | None
    refused: OutOfMemory | None = None  # the memory check's verdict: nothing was built

    def narrowed(self, num_batches: int) -> "Prepared":
        """The same run with fewer batches: the first `num_batches` batches of the same routing."""
        if num_batches == self.num_batches:
            return self
        if self.trace is None:
            return replace(self, num_batches=num_batches)
        return replace(self, num_batches=num_batches, replay=replay_run(self.spec, self.model, self.trace, num_batches))

    @property
    def drawn(self) -> tuple[Trace, Replay]:
        """The routing drawn for this run and its replay at n; a preparation the memory check
        refused drew none (nothing is built from it)."""
        if self.trace is None or self.replay is None:
            raise UsageError(f"{self.spec.policy}: no routing was drawn: the memory check refused the run")
        return self.trace, self.replay

    def policy_input(self, options: Mapping[str, Any] | None = None) -> PolicyInput:
        replay = self.drawn[1]
        return PolicyInput(
            self.model,
            self.profile,
            replay.routing,
            self.placement,
            dict(self.spec.options if options is None else options),
            warmup=replay.warmup,
            impl=self.spec.impl,
        )


@dataclass
class RunResult:
    spec: RunSpec
    model: ModelSpec
    profile: HardwareProfile
    schedule: Schedule
    timeline: Timeline
    plan: Plan | None = None
    routing: "RoutingTable | None" = None
    probes: ProbeSearch | None = None  # how n was chosen for a `probe_n` policy with auto n


def resolve_profile(spec: RunSpec) -> HardwareProfile:
    """The run's machine: the profile with its overrides, as a tensor-parallel group of `spec.gpus`."""
    profile = load_profile(spec.hardware)
    profile = with_overrides(profile, dict(spec.overrides)) if spec.overrides else profile
    return group_machine(profile, spec.gpus, get_model(spec.model)) if spec.gpus > 1 else profile


# A long synthetic draw is said to the run's listeners (run_size.Surroundings: the CLI's simulate and
# compare print a note on stderr), so that a minute of drawing is not taken for a hang. A draw happens only when the trace cache has no
# trace for the run; "long": an estimated LONG_DRAW_S or more on a 2-core machine, at DRAW_S_PER_ELEMENT
# an element of the generator's [tokens, layers, experts] work and DRAW_S_PER_TOKEN_LAYER a token and
# layer — fitted to `synthesize` drawing in two threads (`trace_synth.draw_threads`): Qwen3-30B-A3B
# 16 x 8193 tokens 5.08 s, Mixtral-8x7B 136 x 16392 5.68 s; the fit gives DeepSeek-V2-Lite 64 x 8193
# 5.9 s, measured 5.56 s, and DeepSeek-V3's default 424 x 516 21.1 s, measured 16.4 s (its 256
# experts' top-k is argmax passes, cheaper an expert).
# Many short sequences cost DRAW_S_PER_SEQUENCE_LAYER a sequence and layer beside: tiny-mixtral
# 1M x 11 tokens 9.44 s, 100k x 110 2.45 s; Mixtral-8x7B 200k x 11 26.9 s, 2000 x 1100 7.43 s (one
# process; the terms above alone give 1.2, 1.2, 5.6 and 5.6 s).
LONG_DRAW_S = 3.0
DRAW_S_PER_ELEMENT = 6.1e-9
DRAW_S_PER_TOKEN_LAYER = 31e-9
DRAW_S_PER_SEQUENCE_LAYER = 3.5e-6


def draw_seconds(model: ModelSpec, sequences: int, tokens: int) -> float:
    """About how long `synthesize` draws `sequences` x `tokens` of `model`'s routing on this machine
    (the constants above, scaled by `machine.slowdown`)."""
    per_token = model.num_experts * DRAW_S_PER_ELEMENT + DRAW_S_PER_TOKEN_LAYER
    per_sequence = tokens * per_token + DRAW_S_PER_SEQUENCE_LAYER
    return sequences * model.num_layers * per_sequence * slowdown()


def _announce_draw(model: ModelSpec, routing: str, sequences: int, tokens: int) -> None:
    """Tell the run's listeners that a long draw begins (see above)."""
    seconds = draw_seconds(model, sequences, tokens)
    if seconds >= LONG_DRAW_S:
        cached = "the trace cache is off" if cache_dir() is None else "not in the trace cache yet"
        for listener in run_size.around().listeners:
            listener(
                f"drawing the {routing} routing of {sequences} sequences x {tokens:,} tokens for {model.name} "
                f"({model.num_layers} layers x {model.num_experts} experts; {cached}): about {seconds:.0f} s on "
                f"this machine as loaded now"
            )


@lru_cache(maxsize=4)
def _synthetic_trace(model: ModelSpec, routing: str, seed: int, sequences: int, prompt_len: int, gen_len: int) -> Trace:
    said: list[bool] = []  # (the cache may ask for the stream, then draw with `make` after all: said once)

    def announced(draw: Callable[[], Any]) -> Any:
        if not said:
            said.append(True)
            _announce_draw(model, routing, sequences, prompt_len + gen_len)
        return draw()

    return cached_trace(
        model,
        routing,
        seed,
        sequences,
        prompt_len,
        gen_len,
        lambda: announced(lambda: synthesize(model, sequences, prompt_len, gen_len, routing, seed)),
        lambda: announced(lambda: synthesized_blocks(model, sequences, prompt_len, gen_len, routing, seed)),
    )


@lru_cache(maxsize=4)
def _trace_file(path: str, mtime: float) -> Trace:
    return Trace.load(path)


def _load_trace(spec: RunSpec) -> Trace:
    if spec.trace is None:
        raise UsageError("no trace file given")
    path = Path(spec.trace)
    if not path.exists():
        raise TraceError(f"{path}: no such trace file")
    return _trace_file(str(path), path.stat().st_mtime)


def replay_run(spec: RunSpec, model: ModelSpec, trace: Trace, num_batches: int) -> Replay:
    """The routing of n batches of `spec`, cut out of `trace` after the warm-up sequences."""
    return replay(
        trace,
        model,
        spec.shape(num_batches),
        warmup_sequences=spec.warmup_sequences,
        wrap=spec.wrap,
        where=spec.trace or f"synthetic {spec.routing}",
    )


def make_replay(spec: RunSpec, model: ModelSpec, num_batches: int) -> tuple[Trace, Replay]:
    """The routing of the run: replayed from `spec.trace`, or from a synthetic trace generated
    for exactly this run (same seed -> same routing for every policy)."""
    if spec.trace:
        trace = _load_trace(spec)
    else:
        shape = spec.shape(num_batches)
        sequences = shape.num_sequences + spec.warmup_sequences
        check_routing_fits(
            model,
            sequences,
            shape.tokens_per_sequence,
            f"{sequences} sequences ({spec.warmup_sequences} of them --warmup-sequences)",
        )
        trace = _synthetic_trace(model, spec.routing, spec.seed, sequences, shape.prompt_len, shape.gen_len)
    return trace, replay_run(spec, model, trace, num_batches)


def planning_popularity(spec: RunSpec, model: ModelSpec) -> np.ndarray | None:
    """Routing statistics the planner may use: the warm-up sequences of a trace (what a real
    system has seen before serving), or the synthetic generator's corpus-level shares."""
    if spec.trace:
        trace = _load_trace(spec)
        trace.check_model(model, spec.trace)
        if spec.warmup_sequences <= 0:
            return None
        return popularity(trace.subset(range(min(spec.warmup_sequences, trace.num_sequences)))).to_numpy()
    return base_popularity(model, params_for(spec.routing, model), np.random.default_rng(spec.seed))


def resolve_placement(spec: RunSpec, model: ModelSpec, profile: HardwareProfile) -> Placement:
    resident = spec.resident_layers
    if (
        resident is not None
        and resident != "fill"
        and not (isinstance(resident, int) and 0 <= resident <= model.num_layers)
    ):
        raise UsageError(f"--resident-layers {resident}: give 0..{model.num_layers} ({model.name}'s layers) or fill")
    if spec.warmup_sequences < 0:
        raise UsageError(f"--warmup-sequences {spec.warmup_sequences}: must be >= 0")
    # a KV cache in host memory for a given n takes its share first (an auto n is planned for the GPU)
    host_kv = (
        host_kv_bytes(model, spec.batch_size, spec.num_batches, spec.prompt_len, spec.gen_len)
        if spec.kv == "cpu" and spec.num_batches is not None
        else 0.0
    )
    base = default_placement(model, profile, host_kv=host_kv)
    if spec.experts != "auto":
        base = replace(base, experts=spec.experts, disk_layers=0)
    return replace(
        base, kv="gpu" if spec.kv == "auto" else spec.kv, resident_layers=resident if isinstance(resident, int) else 0
    )


def planner_impl(spec: RunSpec) -> Impl:
    """The implementation Klotski's planner costs: the klotski policy under the run's preset (and
    the run's options that klotski also has)."""
    own = set(get_policy("klotski").impl_options)
    return Impl.from_options(resolve_options("klotski", spec.impl, {k: v for k, v in spec.options.items() if k in own}))


def check_measured_for(profile: HardwareProfile, model: ModelSpec) -> None:
    """A profile's measured op times are of the model it was calibrated on (`provenance.model_shapes`):
    its tables key on an op's category and tokens alone, so another model's ops would be timed as
    that one's (tiny-mixtral's table gives small-mixtral's experts 0.26 ms for 0.91, without a word).
    The same model with fewer layers is the same ops; a calibration of no known model is not checked."""
    calibrated = profile.provenance.get("model_shapes")
    if not profile.measured or not isinstance(calibrated, str):
        return
    try:
        shapes = get_model(calibrated)
    except UsageError:
        return
    ours, theirs = asdict(model), asdict(shapes)  # (a copy of fewer layers would be refused for DeepSeek's dense ones)
    differ = [
        f"{key} {theirs[key]} vs {ours[key]}"
        for key in ours
        if key not in ("name", "num_layers") and ours[key] != theirs[key]
    ]
    if differ:
        raise MissingCapability(
            f"hardware profile {profile.name!r}: its measured op times were calibrated on {calibrated}'s ops, not "
            f"{model.name}'s ({', '.join(differ[:3])}{' ...' if len(differ) > 3 else ''}); calibrate for this model "
            f"(klotski-runtime calibrate --model {model.name}), or drop the profile's `measured:` tables to time its "
            f"ops by the roofline"
        )


def prepare(spec: RunSpec) -> Prepared:
    """Resolve model, profile, n (planner when `num_batches` is None), placement and routing."""
    profile = resolve_profile(spec)  # (a group that cannot split the model is refused here)
    model = group_model(get_model(spec.model), spec.gpus)
    check_measured_for(profile, model)
    attention_on_cpu = spec.options.get("attention_device") == "cpu"  # decode attention reads the KV cache there
    # (before any plan is printed or routing drawn)
    get_policy(spec.policy).require_machine(profile)
    if attention_on_cpu:
        profile.require_cpu("attention_device=cpu")
    if attention_on_cpu and spec.kv == "gpu":
        raise UsageError("attention_device=cpu keeps the KV cache in host memory: --kv gpu contradicts it")
    # The KV cache's place: given (or implied by CPU attention, which reads it there), else decided
    # below by the planner or by whether n batches' KV cache fits beside the policy's buffers.
    kv_given = "cpu" if attention_on_cpu else None if spec.kv == "auto" else spec.kv
    placement = resolve_placement(spec, model, profile)
    if kv_given is not None:
        placement = replace(placement, kv=kv_given)
    buffering = get_policy(spec.policy).traits.buffering
    the_plan = None
    if spec.num_batches is None:
        the_plan = plan(
            model,
            profile,
            spec.batch_size,
            spec.prompt_len,
            spec.gen_len,
            popularity=planning_popularity(spec, model),
            placement=placement,
            resident_layers=spec.resident_layers in (None, "fill"),
            impl=planner_impl(spec),
        )
        n = the_plan.n
        placement = the_plan.placement if kv_given is None else replace(the_plan.placement, kv=kv_given)
    else:
        n = spec.num_batches
        if (
            kv_given is None
            and memory_needed(model, spec.batch_size, n, spec.prompt_len, spec.gen_len, placement, buffering)["total"]
            > profile.gpu.usable_bytes
        ):
            placement = replace(placement, kv="cpu")
        if spec.resident_layers == "fill":
            placement = fill_resident_layers(
                model, profile, spec.batch_size, n, spec.prompt_len, spec.gen_len, placement, buffering
            )
    # impossible whatever the schedule: refused before any routing is made
    refused = memory_refusal(model, profile, spec, n, placement)
    if refused is not None:
        return Prepared(spec, model, profile, n, placement, None, None, the_plan, refused)
    unstorable = storage_refusal(model, profile, placement, spec.batch_size, n, spec.prompt_len, spec.gen_len)
    if unstorable is not None:
        raise StorageRefusal(unstorable)
    trace, rep = make_replay(spec, model, n)
    return Prepared(spec, model, profile, n, placement, trace, rep, the_plan)


def memory_refusal(
    model: ModelSpec,
    profile: HardwareProfile,
    spec: RunSpec,
    n: int,
    placement: Placement,
    holds_moe_layer: bool = False,
) -> OutOfMemory | None:
    """The memory check: the refusal, every part named, when what any schedule of this run must hold
    at once (memory_floor) exceeds the GPU's usable memory; None when it fits. `holds_moe_layer`
    counts a whole MoE layer's experts at once (FlexGen's buffers), so that such a run is refused
    before a schedule of a million ops is built and simulated to find out at its first MoE layer."""
    floor = memory_floor(
        model, spec.batch_size, n, spec.prompt_len, spec.gen_len, placement, holds_moe_layer=holds_moe_layer
    )
    if floor["total"] <= profile.gpu.usable_bytes:
        return None
    return OutOfMemory(
        op_id=MEMORY_CHECK,
        time=0.0,
        needed_bytes=int(floor["total"]),
        available_bytes=int(profile.gpu.usable_bytes),
        in_use_bytes=0,
        detail=", ".join(f"{k} {memory_text(v)}" for k, v in floor.items() if k != "total"),
    )


def policy_batches(policy: str, prep: Prepared) -> int:
    """n for one policy when the planner chose it: single-batch (and any `one_batch` policy) keeps one batch in flight, and a
    policy whose weight buffers are larger than Klotski's may fit fewer batches' KV cache."""
    if get_policy(policy).traits.one_batch:
        return 1
    s = prep.spec
    fit = largest_fitting_n(
        prep.model,
        prep.profile,
        s.batch_size,
        s.prompt_len,
        s.gen_len,
        prep.placement,
        get_policy(policy).traits.buffering,
    )
    return min(prep.num_batches, fit) if fit else prep.num_batches


@dataclass(frozen=True)
class RunPlan:
    """One policy's run, decided once before anything is built: its n and placement (KV cache place
    and resident layers included) with the routing narrowed to that n (`prepared`), the memory
    check's refusal with its numbers, why n differs from the shared preparation's, and the probes
    that chose n. The CLI prints it, `run_planned` builds and simulates it, compare's workers share
    it; nothing downstream decides any of it again."""

    spec: RunSpec
    prepared: Prepared
    refused: OutOfMemory | None = None
    note: str = ""  # why this policy's n is not the preparation's
    probes: ProbeSearch | None = None
    probes_pending: bool = False  # a probe_n policy planned without its probes (`plan_run(probe=False)`)

    @property
    def num_batches(self) -> int:
        return self.prepared.num_batches

    @property
    def placement(self) -> Placement:
        return self.prepared.placement


def plan_run(spec: RunSpec, prep: Prepared, cost: CostModel | None = None, probe: bool = True) -> RunPlan:
    """`spec.policy`'s plan on a shared preparation. With the planner's n, a policy takes the n its
    buffers allow (`policy_batches`) and a `probe_n` policy the n of its best simulated probe at
    that n's placement (not yet with `probe=False`: `finish_probes` takes them where the run runs)."""
    if prep.refused is not None:
        return RunPlan(spec, prep, prep.refused)
    traits = get_policy(spec.policy).traits
    note = ""
    if spec.num_batches is None:
        n = policy_batches(spec.policy, prep)
        if n != prep.num_batches:
            note = (
                "one batch in flight by definition"
                if traits.one_batch
                else f"its {traits.buffering} weight buffers leave room for {n} batches' KV cache"
            )
        prep = prep.narrowed(n)
        if traits.probe_n:
            pending = RunPlan(spec, prep, note=note, probes_pending=True)
            return finish_probes(pending, cost) if probe else pending
    return _checked(RunPlan(spec, prep, note=note))


def finish_probes(pending: RunPlan, cost: CostModel | None = None) -> RunPlan:
    """A `probe_n` policy's plan completed: n chosen by its simulated probes (probe_batches)."""
    if not pending.probes_pending:
        return pending
    spec, prep = pending.spec, pending.prepared
    probes = probe_batches(spec, prep, cost)
    n = probes.chosen.n
    chosen = replace(prep.narrowed(n), placement=_probe_placement(spec, prep, n))
    return _checked(replace(pending, prepared=chosen, probes=probes, probes_pending=False))


def _checked(plan: RunPlan) -> RunPlan:
    """The plan with the memory check of what this policy holds beyond any schedule's floor: a whole
    MoE layer's experts for a `holds_moe_layer` policy, unless an expert cache's slots are shared."""
    spec, prep = plan.spec, plan.prepared
    if not get_policy(spec.policy).traits.holds_moe_layer or spec.options.get("expert_cache"):
        return plan
    refused = memory_refusal(prep.model, prep.profile, spec, prep.num_batches, prep.placement, holds_moe_layer=True)
    return replace(plan, refused=refused)


def refused_run(plan: RunPlan) -> RunResult:
    """The result of a configuration the memory check refused: status `oom`, no ops."""
    spec, prep = plan.spec, plan.prepared
    meta = dict(
        policy=spec.policy,
        model=prep.model.name,
        hardware=prep.profile.name,
        batch_size=spec.batch_size,
        num_batches=prep.num_batches,
        prompt_len=spec.prompt_len,
        gen_len=spec.gen_len,
        generated_tokens=spec.shape(prep.num_batches).generated_tokens,
        placement=asdict(prep.placement),
        impl=spec.impl,
    )
    schedule = Schedule(ops=(), meta=meta)
    timeline = Timeline.from_schedule(
        schedule,
        [],
        [],
        status="oom",
        oom=plan.refused,
        source="simulated",
        extra_meta={"gpu_capacity_bytes": int(prep.profile.gpu.usable_bytes)},
    )
    return RunResult(spec, prep.model, prep.profile, schedule, timeline, prep.plan, None)


class ScheduleReuse:
    """The last schedule built, kept for the next run that would build the same one: the same policy,
    options, model, routing, n and placement, of a policy whose schedule no speed of the hardware
    changes (a sweep over what-if hardware numbers builds each schedule once). One schedule only: it
    may be large. Its owner decides its lifetime (a sweep: one per worker process)."""

    def __init__(self) -> None:
        self._key: tuple[Any, ...] | None = None
        self._schedule: Schedule | None = None

    def schedule(self, plan: "RunPlan", build: Callable[[], Schedule]) -> Schedule:
        key = _schedule_key(plan.spec, plan.prepared)
        if key is not None and key == self._key and self._schedule is not None:
            return self._schedule
        schedule = build()
        self._key, self._schedule = (key, schedule) if key is not None else (None, None)
        return schedule


def run(
    spec: RunSpec, cost: CostModel | None = None, prepared: Prepared | None = None, reuse: ScheduleReuse | None = None
) -> RunResult:
    """Plan `spec` (on `prepared`, the routing and plan the policies of one comparison share),
    build its schedule and simulate it: `run_planned(plan_run(...))`."""
    return run_planned(plan_run(spec, prepared or prepare(spec), cost), cost, reuse)


def run_planned(plan: RunPlan, cost: CostModel | None = None, reuse: ScheduleReuse | None = None) -> RunResult:
    """Build the planned run's schedule (or take `reuse`'s, when it is the same schedule) and
    simulate it."""
    plan = finish_probes(plan, cost)
    if plan.refused is not None:
        return refused_run(plan)
    spec, prep = plan.spec, plan.prepared

    def build() -> Schedule:
        return build_schedule(spec.policy, replace(prep.policy_input(spec.options), impl=spec.impl))

    schedule = reuse.schedule(plan, build) if reuse is not None else build()
    timeline = simulate(schedule, prep.profile, cost)
    return RunResult(spec, prep.model, prep.profile, schedule, timeline, prep.plan, prep.drawn[1].routing, plan.probes)


def _probe_placement(spec: RunSpec, prep: Prepared, n: int) -> Placement:
    """The placement of a probe at n: with the planner's resident layers (`--resident-layers` not
    given, or fill), as many whole layers as n batches leave room for; else the given ones."""
    if spec.resident_layers not in (None, "fill"):
        return prep.placement
    return fill_resident_layers(
        prep.model,
        prep.profile,
        spec.batch_size,
        n,
        spec.prompt_len,
        spec.gen_len,
        replace(prep.placement, resident_layers=0),
        get_policy(spec.policy).traits.buffering,
    )


def probe_batches(spec: RunSpec, prep: Prepared, cost: CostModel | None = None) -> ProbeSearch:
    """n for a `probe_n` policy (klotski_sim/planning/probe.py): each candidate up to the run's n simulated
    over the prefill and a few generated tokens of the run's own first batches, at the placement
    that n would run with; the whole run predicted from it. (The run's routing is drawn for the
    planner's n, so no larger n is tried: `optimize --num-batches` searches beyond it.)"""
    decode_steps = spec.gen_len - 1

    def measure(n: int) -> Probe:
        rep = replay_run(replace(spec, gen_len=probe_gen_len(n, spec.gen_len)), prep.model, prep.drawn[0], n)
        placement = _probe_placement(spec, prep, n)
        inp = PolicyInput(
            prep.model, prep.profile, rep.routing, placement, dict(spec.options), warmup=rep.warmup, impl=spec.impl
        )
        with run_size.unwatched():  # (a probe's numbers are not the run's: the run is projected itself)
            schedule = build_schedule(spec.policy, inp)
        summary = simulate(schedule, prep.profile, cost).summary()  # (timed as the run will be)
        decode_experts = [op.stream for op in schedule.ops if op.category == "expert" and op.phase == "decode"]
        on_cpu = decode_experts.count("cpu_compute") / len(decode_experts) if decode_experts else 0.0
        step = summary.decode_step_s if decode_steps else 0.0
        predicted = (
            spec.shape(n).generated_tokens / (summary.prefill_s + decode_steps * step)
            if summary.status == "ok"
            else 0.0
        )  # a probe out of memory is never chosen
        return Probe(n, placement.resident_layers, summary.prefill_s, step, predicted, on_cpu)

    return search(measure, prep.num_batches)


def _schedule_key(spec: RunSpec, prep: Prepared) -> tuple[Any, ...] | None:
    """What a speed-independent policy's schedule is a function of (None: the policy's schedule may
    depend on the hardware's speeds, never reused). The profile enters by name and by whether it
    has a CPU section (the only things such a schedule reads of it); the routing by what builds it."""
    if not get_policy(spec.policy).traits.speed_independent:
        return None
    trace = (spec.trace, Path(spec.trace).stat().st_mtime) if spec.trace else None
    return (
        spec.policy,
        spec.impl,
        repr(sorted(spec.options.items())),
        spec.model,
        spec.batch_size,
        prep.num_batches,
        spec.prompt_len,
        spec.gen_len,
        spec.seed,
        spec.routing,
        trace,
        spec.wrap,
        spec.warmup_sequences,
        prep.placement,
        prep.profile.name,
        prep.profile.cpu is not None,
    )


# What `run_each`'s forked worker processes share: set by their initializer, in them only (a pool's
# initializer can hand a worker nothing else), so that routing and plans are inherited, never pickled.
_SHARED: tuple[Prepared | None, list[RunPlan] | None] = (None, None)


def pool_worker(workers: int) -> None:
    """A worker process of a pool of `workers` (compare's, a local sweep's, a local Dask cluster's): the
    collector set for a worker, and this machine's memory shared with the other workers' runs
    (klotski_sim/util/run_size.py)."""
    quiet_gc_in_worker()
    run_size.share_machine(workers)


@contextmanager
def worker_pool(
    workers: int, initializer: Callable[..., None], initargs: tuple[Any, ...] = (), fork: bool = False
) -> Iterator[ProcessPoolExecutor]:
    """A pool of `workers` processes that never outlive the run that started them. Leaving the
    `with` of a plain ProcessPoolExecutor by an exception (Ctrl-C, SIGTERM, an error) waits for
    every run still queued, a sweep's whole grid; here what has not started is cancelled and the
    workers are stopped at once. And a worker whose parent dies, even by SIGKILL, is ended by
    the kernel, not left waiting on its queue forever, holding its memory (Linux; `_worker_start`)."""
    context = multiprocessing.get_context("fork" if fork else None)
    parent = os.getpid() if context.get_start_method() in ("fork", "spawn") else None  # (forkserver: its server)
    pool = ProcessPoolExecutor(
        workers,
        mp_context=context,
        initializer=_worker_start,
        initargs=(parent, initializer, initargs, policy_timeout()),
    )
    try:
        yield pool
    except BaseException as err:
        processes = list((getattr(pool, "_processes", None) or {}).values())  # (Python 3.14 has
        # terminate_workers(); before it, only the executor's own table of them, which shutdown empties)
        pool.shutdown(wait=False, cancel_futures=True)
        for process in processes:
            # SIGKILL, not SIGTERM: a worker just forked still runs under the CLI's inherited stop handler
            # until `_worker_start` resets it, and a SIGTERM then can be lost with the handler; the worker
            # lived on, waiting on its queue's lock, and the command hung at exit joining it
            process.kill()
        if isinstance(err, BrokenProcessPool):  # (the kernel's OOM killer, a `kill -9`: said in one line)
            raise WorkerDied(
                f"a worker process died before it finished (killed, or out of host memory?): "
                f"rerun with --workers 1, or fewer than {workers}"
            ) from None
        raise
    pool.shutdown(wait=True)


class WorkerDied(UsageError):
    """A pool's worker process ended without finishing its run (killed from outside, or by the
    kernel for want of host memory), which breaks the pool: one line, where BrokenProcessPool's
    traceback says nothing the user can act on (compare); a sweep goes on (sweep._run_pool)."""


def _worker_start(
    parent: int | None, initializer: Callable[..., None], initargs: tuple[Any, ...], timeout: float | None = None
) -> None:
    """A pool worker's first steps: the stop signals end it as they end any process (a worker forked
    from the CLI inherits its handler, which turns them into an interruption of the main process's
    work) and Ctrl-C is the parent's alone, the kernel sends it SIGTERM when its parent dies, then
    `initializer`. SIGTERM always:
    the kernel stops orphaned workers with it (the pool stops its own with SIGKILL, `worker_pool`);
    SIGHUP unless the parent ignores it (under `nohup` a hang-up would end the workers and not the
    run)."""
    for signum in STOP_SIGNALS:
        if signum == signal.SIGTERM or callable(signal.getsignal(signum)):
            signal.signal(signum, signal.SIG_DFL)
    # Ctrl-C reaches the terminal's whole process group, workers too: the parent owns it and stops its
    # workers itself (`worker_pool`); a worker raising KeyboardInterrupt would print multiprocessing's
    # "Process ForkProcess-2:" beside the command's one word
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    if sys.platform == "linux":
        try:
            ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, int(signal.SIGTERM))
        except (OSError, AttributeError):  # (a libc without prctl: no death signal)
            pass
        if parent is not None and os.getppid() != parent:  # the parent died before the kernel was told
            os._exit(1)
    set_policy_timeout(timeout)  # (the parent's --policy-timeout, whichever way the worker was started)
    initializer(*initargs)


_PR_SET_PDEATHSIG = 1  # <linux/prctl.h>


def _share(prep: Prepared | None, plans: list[RunPlan] | None, workers: int) -> None:
    """A comparison's worker process: the preparation and plans it shares, then as any `pool_worker`."""
    global _SHARED
    _SHARED = (prep, plans)
    pool_worker(workers)


def _timeline_of(
    spec: RunSpec,
    trace_path: Path | None = None,
    prep: Prepared | None = None,
    keep: Collection[str] | None = None,
    plan: RunPlan | None = None,
) -> Timeline:
    """One run's timeline with its summary derived and its Chrome trace written when asked, then
    reduced to the columns `keep` names (all when None): what needs to leave a worker (its
    schedule, a few times larger, stays behind)."""
    timeline = (run_planned(plan) if plan is not None else run(spec, prepared=prep)).timeline
    timeline.summary()
    if trace_path is not None:
        to_chrome_trace(timeline, trace_path)
    timeline.detach(keep)
    return timeline


def _ignoring_errors(work: Callable[[], object]) -> None:
    try:
        work()
    except Exception:  # noqa: BLE001 - see run_each's `meanwhile`
        pass


class WorkerError(KlotskiError):
    """An error raised in a worker process, brought back as text (any exception pickles this way)."""


def _timeline_in_worker(k: int, spec: RunSpec, trace_path: Path | None, keep: Collection[str] | None) -> Timeline:
    prep, plans = _SHARED
    try:
        return _timeline_of(spec, trace_path, prep, keep, plans[k] if plans is not None else None)
    except KlotskiError as err:
        raise WorkerError(str(err)) from None
    except Exception as err:  # noqa: BLE001 - reported with where to find the traceback
        raise WorkerError(
            f"{spec.policy} ({spec.impl}): {type(err).__name__}: {err} (rerun with --workers 1 "
            f"--debug for the traceback)"
        ) from None


def run_each(
    specs: list[RunSpec],
    prep: Prepared,
    workers: int = 1,
    trace_paths: list[Path | None] | None = None,
    keep: Collection[str] | None = None,
    meanwhile: Callable[[], object] | None = None,
    on_done: Callable[[RunSpec], None] | None = None,
    plans: list[RunPlan] | None = None,
) -> list[Timeline]:
    """The timelines of several runs on one preparation (compare's policies and presets), in
    `workers` processes when more than one: each run is independent and single-threaded. Each
    run's Chrome trace is written where `trace_paths` says (by the process that ran it); each
    timeline keeps its summary and the columns `keep` names (all when None). With worker processes,
    `meanwhile` runs in a thread of this process once fewer runs are left than workers, on the core
    a worker no longer needs (what it raises is ignored: compare imports pandas and the plotting
    library there, and imports them again, raising, where it needs them; started with the workers,
    the import takes 0.15-0.25 s of their time from the slowest of them). `on_done` is told each run
    as it ends. `plans`, one per spec, are run as planned (`plan_run`) instead of planned again."""
    traces = trace_paths or [None] * len(specs)
    workers = min(workers, len(specs))
    done_with = on_done or (lambda spec: None)
    if workers <= 1 or "fork" not in multiprocessing.get_all_start_methods():
        ran = []
        for k, (spec, path) in enumerate(zip(specs, traces)):
            ran.append(_timeline_of(spec, path, prep, keep, plans[k] if plans is not None else None))
            done_with(spec)
        return ran
    # forked workers inherit the preparation (routing, plan, policies loaded from files) as it is
    helper = threading.Thread(target=_ignoring_errors, args=(meanwhile,), daemon=True) if meanwhile else None
    timelines: dict[int, Timeline] = {}
    queued = iter(enumerate(zip(specs, traces)))
    with worker_pool(workers, _share, (prep, plans, workers), fork=True) as pool:
        # a run is handed out only when a worker is free: the pool would queue more than its workers take,
        # and those would run to their end after a run is refused or fails, before its error is said
        in_flight: dict[Future[Timeline], int] = {}

        def hand_out() -> None:
            for k, (spec, path) in queued:
                in_flight[pool.submit(_timeline_in_worker, k, spec, path, keep)] = k
                return

        for _ in range(workers):
            hand_out()
        while in_flight:
            done, _ = wait(in_flight, return_when=FIRST_COMPLETED)
            for future in done:
                k = in_flight.pop(future)
                timelines[k] = future.result()  # (an error: said now, nothing more handed out)
                done_with(specs[k])
                hand_out()
            if helper is not None and len(in_flight) < workers:
                # (a worker idle: its core is the helper's; started after the forks, no worker holds its locks)
                helper.start()
                helper = None
    return [timelines[k] for k in range(len(specs))]
