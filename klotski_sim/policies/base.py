"""What every policy shares: its inputs, the registry, and an emitter for the standard ops.

A policy is one function `build(PolicyInput) -> Schedule`, registered by name; adding a policy
is adding one file. The `OpEmitter` turns "attention of batch b at step s, layer j" into an op
with the right FLOPs, bytes, tags, KV traffic and memory effects, so policies only decide
*order and dependencies* — which is what distinguishes them.
"""

from __future__ import annotations

import re
import sys
import traceback
from contextlib import nullcontext
from dataclasses import asdict, dataclass, field
from pathlib import Path
from types import ModuleType
from typing import Any, Callable, Iterable, Mapping, Sequence, overload

import numpy as np

from klotski_sim.core.cost import op_variant
from klotski_sim.core.schedule import (
    CPU_STREAMS,
    Op,
    Schedule,
    ScheduleBuilder,
    ScheduleError,
    check_foreign,
    clean_deps,
    compute_op,
    gc_paused,
    host_op,
    transfer_op,
)
from klotski_sim.hardware.profile import HardwareProfile
from klotski_sim.names import kv_buffer
from klotski_sim.parallel.tensor import with_all_reduces
from klotski_sim.policies.impl import IMPL_CHOICES, IMPL_SPECS, PRESET_NAMES, Impl, preset_options
from klotski_sim.policies.options import GENERIC_SPECS, OptionSpec, specs_from_defaults, specs_of
from klotski_sim.util import run_size
from klotski_sim.util.errors import KlotskiError, UsageError
from klotski_sim.util.timelimit import policy_time_limit
from klotski_sim.workload.model import ModelSpec
from klotski_sim.workload.routing import RoutingTable, RunShape
from klotski_sim.workload.trace import Trace

TIERS = ("gpu", "cpu", "disk")
_TENSOR = {"attention": "attention", "gate": "gate", "experts": "expert"}  # placement field -> Op.tensor


@dataclass(frozen=True)
class Placement:
    """Where each tensor type lives before it is needed. `resident_layers` layers stay whole on
    the GPU (no transfers); the others stream their attention, gate and experts from their tier."""

    attention: str = "cpu"
    gate: str = "cpu"
    experts: str = "cpu"
    kv: str = "gpu"
    resident_layers: int = 0
    disk_window: int = 2  # layers staged in host memory ahead of the GPU when weights live on disk
    disk_layers: int = 0  # with experts="cpu": the last `disk_layers` layers keep their experts on disk

    def __post_init__(self) -> None:
        for name in ("attention", "gate", "experts"):
            if getattr(self, name) not in ("cpu", "disk"):
                raise UsageError(
                    f"placement.{name} must be 'cpu' or 'disk' (use resident_layers to keep "
                    f"layers on the GPU), got {getattr(self, name)!r}"
                )
        if self.kv not in ("gpu", "cpu"):
            raise UsageError(f"placement.kv must be 'gpu' or 'cpu', got {self.kv!r}")
        if self.resident_layers < 0:
            raise UsageError("placement.resident_layers must be >= 0")
        if self.disk_window < 1:
            raise UsageError("placement.disk_window must be >= 1")
        if self.disk_layers < 0:
            raise UsageError("placement.disk_layers must be >= 0")

    @property
    def uses_disk(self) -> bool:
        return "disk" in (self.attention, self.gate, self.experts) or self.disk_layers > 0

    def tier(self, what: str, layer: int, num_layers: int) -> str:
        """Where `what` (attention | gate | experts) of `layer` lives before it is needed."""
        if what == "experts" and self.disk_layers and layer >= num_layers - self.disk_layers:
            return "disk"
        return getattr(self, what)

    def describe(self) -> str:
        experts = (
            self.experts
            if not self.disk_layers or self.experts == "disk"
            else f"cpu (last {self.disk_layers} layers on disk)"
        )
        text = (
            f"attention={self.attention} gate={self.gate} experts={experts} kv={self.kv} "
            f"resident_layers={self.resident_layers}"
        )
        return text + (f" disk_window={self.disk_window}" if self.uses_disk else "")


@dataclass(frozen=True)
class PolicyInput:
    """Everything a policy may look at. `options` holds the policy's own switches."""

    model: ModelSpec
    profile: HardwareProfile
    routing: RoutingTable
    placement: Placement = field(default_factory=Placement)
    options: Mapping[str, Any] = field(default_factory=dict)
    warmup: "Trace | None" = None  # disjoint sequences for a prefetcher's pre-run
    impl: str = "as-published"  # implementation preset (klotski_sim.policies.impl); `options` override it

    @property
    def shape(self) -> RunShape:
        return self.routing.shape


PolicyBuilder = Callable[[PolicyInput], Schedule]


BUFFERING = ("whole-layer", "expert-aware")

# One expert op as `OpEmitter.expert_chain` takes it: op id, expert, batches, tokens, deps, frees.
ExpertOp = tuple[str, int, tuple[int, ...], int, tuple[str, ...], tuple[str, ...]]


@dataclass(frozen=True)
class PolicyTraits:
    """What the planner, the runner and sweeps must know of a policy beyond the schedule it builds."""

    # the GPU weight buffers it needs, which the planner sizes n with: `whole-layer` (two whole
    # layers, double-buffered) or `expert-aware` (two attention buffers, the gate and at most one
    # MoE layer of experts)
    buffering: str = "whole-layer"
    one_batch: bool = False  # one batch in flight by definition: the planner's n does not apply
    manages_experts: bool = False  # keeps its own expert cache: the generic expert_cache option is not offered
    needs_cpu: bool = False  # computes on the host CPU: runs only on profiles with a `cpu:` section
    # its schedule depends on the hardware only through the n and placement it is given, never on a
    # speed (no cost model in its decisions): a sweep over hardware numbers may build it once
    speed_independent: bool = False
    # its best n is not what Klotski's inequalities give (its work moves between devices with n):
    # with auto n, the planner chooses n by simulated probes (klotski_sim/planning/probe.py)
    probe_n: bool = False
    # every expert buffer of a streamed MoE layer is allocated at once (its last expert op waits for
    # them all, then frees them together): the memory check counts the whole layer, not one tensor
    holds_moe_layer: bool = False

    def __post_init__(self) -> None:
        if self.buffering not in BUFFERING:
            raise UsageError(f"PolicyTraits.buffering must be one of {BUFFERING}, got {self.buffering!r}")
        for name in ("one_batch", "manages_experts", "needs_cpu", "speed_independent", "probe_n", "holds_moe_layer"):
            if not isinstance(getattr(self, name), bool):
                raise UsageError(f"PolicyTraits.{name} must be true or false, got {getattr(self, name)!r}")


@dataclass(frozen=True)
class PolicyInfo:
    """A registered policy. `impl_options` are the implementation choices (klotski_sim.policies.impl)
    it honours; `presets` gives, per preset, the values that differ from the generic ones — for
    `as-published`, every choice of that system's code."""

    name: str
    description: str
    build: PolicyBuilder
    own_options: tuple[OptionSpec, ...] = ()  # the policy's own switches (not generic, not implementation)
    traits: PolicyTraits = PolicyTraits()
    impl_options: tuple[str, ...] = ()
    presets: Mapping[str, Mapping[str, Any]] = field(default_factory=dict)

    @property
    def defaults(self) -> dict[str, Any]:
        """The policy's own options' defaults."""
        return {spec.name: spec.default for spec in self.own_options}

    def option_specs(self) -> dict[str, OptionSpec]:
        """Every option `--option` takes for this policy: generic, its own, its implementation choices."""
        generic = [s for s in GENERIC_SPECS if not (self.traits.manages_experts and s.name in _CACHE_OPTIONS)]
        impl = [IMPL_SPECS[name] for name in self.impl_options]
        return {spec.name: spec for spec in (*generic, *self.own_options, *impl)}

    def preset(self, name: str) -> dict[str, Any]:
        """All option values the preset `name` gives this policy."""
        own = dict(self.presets.get(name, {}))
        stray = set(own) - set(self.impl_options) - set(self.defaults)
        if stray:
            raise UsageError(f"policy {self.name!r}: preset {name!r} sets options it does not have: {sorted(stray)}")
        out = preset_options(name, self.impl_options, {k: v for k, v in own.items() if k in IMPL_CHOICES})
        out.update(own)
        specs = self.option_specs()
        for key, value in own.items():
            specs[key].check(self.name, value)
        return out

    def require_machine(self, profile: HardwareProfile, who: str = "") -> None:
        """Refuse, before anything is built, a profile this policy cannot run on (one that computes on
        the CPU, on a profile without a `cpu:` section); `who` names it in the message."""
        if self.traits.needs_cpu:
            profile.require_cpu(who or f"policy {self.name!r}")


POLICIES: dict[str, PolicyInfo] = {}


_POLICY_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")


def register(
    name: str,
    description: str,
    defaults: Mapping[str, Any] | None = None,
    *,
    options: type | None = None,
    traits: PolicyTraits = PolicyTraits(),
    impl_options: tuple[str, ...] = (),
    presets: Mapping[str, Mapping[str, Any]] | None = None,
) -> Callable[[PolicyBuilder], PolicyBuilder]:
    """Decorator: make a build function available as `--policy NAME`. `options` is a dataclass of
    `option()` fields (klotski_sim.policies.options); `defaults` overrides its defaults, or, without
    it, declares options typed by their default values."""
    if not isinstance(name, str) or not _POLICY_NAME.fullmatch(name):  # (it names files: trace_<policy>.json.gz)
        raise UsageError(
            f"policy name {name!r}: use letters, digits, '-', '_' and '.', starting with a letter or digit (at most 64)"
        )
    if not isinstance(traits, PolicyTraits):
        raise UsageError(f"policy {name!r}: traits must be a PolicyTraits, got {traits!r:.80}")
    unknown = set(impl_options) - set(IMPL_CHOICES)
    if unknown:
        raise UsageError(f"policy {name!r}: unknown implementation options {sorted(unknown)}")

    def wrap(fn: PolicyBuilder) -> PolicyBuilder:
        if name in POLICIES and POLICIES[name].build is not fn:
            raise UsageError(
                f"policy {name!r} is already registered (by {POLICIES[name].build.__module__}); give yours another name"
            )
        # (`KLOTSKI` beside `klotski`: two policies a reader takes for one, whose trace_<policy>.json.gz files are
        # one file where names are case-insensitive, as on macOS and Windows)
        same = next((other for other in POLICIES if other != name and other.lower() == name.lower()), None)
        if same is not None:
            raise UsageError(
                f"policy {name!r}: policy {same!r} is registered (by {POLICIES[same].build.__module__}); "
                f"give yours a name that differs from it in more than case"
            )
        own = _own_options(name, options, defaults or {})
        info = PolicyInfo(name, description, fn, own, traits, tuple(impl_options), dict(presets or {}))
        for preset in PRESET_NAMES:
            info.preset(preset)  # every preset must be complete for this policy
        POLICIES[name] = info
        return fn

    return wrap


def _own_options(policy: str, options: type | None, defaults: Mapping[str, Any]) -> tuple[OptionSpec, ...]:
    """A policy's own option specs: its options class with `defaults` applied, or `defaults` alone."""
    try:
        if options is None:
            return specs_from_defaults(defaults)
        specs = {spec.name: spec for spec in specs_of(options)}
        stray = set(defaults) - set(specs)
        if stray:
            raise UsageError(f"defaults name options {options.__name__} does not have: {sorted(stray)}")
        return tuple(spec.with_default(defaults[n]) if n in defaults else spec for n, spec in specs.items())
    except UsageError as err:
        raise UsageError(f"policy {policy!r}: {err}") from None


def get_policy(name: str) -> PolicyInfo:
    try:
        return POLICIES[name]
    except KeyError:
        raise UsageError(f"unknown policy {name!r}; known policies: {', '.join(POLICIES)}") from None


_CACHE_OPTIONS = ("expert_cache", "cache_policy")  # generic; not offered by a policy that keeps its own cache


def _make_cache(inp: "PolicyInput") -> Any:
    from klotski_sim.policies.cache import ExpertCache

    slots, policy = inp.options.get("expert_cache", 0), inp.options.get("cache_policy", "lru")
    if not slots:
        ExpertCache(0, policy)  # still refuse a bad cache_policy
        return None
    m = inp.model
    experts = m.routed_experts
    if isinstance(slots, int) and slots > experts:
        raise UsageError(f"expert_cache={slots} is more than the model's {experts} experts")
    pinned = (
        ExpertCache.hot_set(
            inp.warmup.experts if inp.warmup is not None else None,
            m.num_layers,
            m.num_experts,
            slots,
            m.moe_layers,
        )
        if policy == "hot-pinned"
        else frozenset()
    )
    return ExpertCache(slots, policy, pinned)


def cpu_expert_seconds(cost: Any, model: ModelSpec, tokens: int, hidden_down: bool = False) -> float:
    """What `OpEmitter.cpu_expert` costs end to end, as the CPU-expert policies price their
    choices: (the hidden states down,) the expert on the CPU, its output back up."""
    down = cost.transfer_seconds("pcie_d2h", model.hidden_bytes(tokens)) if hidden_down else 0.0
    return (
        down
        + cost.cpu_seconds(model.expert_flops(tokens), model.expert_io_bytes(tokens, stored=True), "expert", tokens)
        + cost.transfer_seconds("pcie_h2d", model.hidden_bytes(tokens))
    )


def _attention_on_cpu(inp: "PolicyInput") -> bool:
    if inp.options.get("attention_device", "gpu") == "gpu":
        return False
    inp.profile.require_cpu("attention_device=cpu")
    if inp.model.mla:
        raise UsageError(f"attention_device=cpu is modelled for GQA attention; {inp.model.name!r} uses MLA")
    if inp.placement.kv != "cpu":
        raise UsageError("attention_device=cpu keeps the KV cache in host memory: run it with --kv cpu")
    return True


def resolve_options(name: str, impl: str, options: Mapping[str, Any]) -> dict[str, Any]:
    """A policy's options: its defaults, then the implementation preset, then `options`, each value
    checked against its option's spec (klotski_sim.policies.options)."""
    info = get_policy(name)
    specs = info.option_specs()
    resolved = {key: spec.default for key, spec in specs.items()}
    resolved.update(info.preset(impl))
    unknown = set(options) - set(specs)
    if unknown:
        raise UsageError(
            f"policy {name!r} has no option(s) {sorted(unknown)}; options: {', '.join(specs) or 'none'} "
            f"(klotski-sim policies {name} explains them)"
        )
    for key, value in options.items():
        specs[key].check(name, value)
    resolved.update(options)
    # (asked for without a cache, a cache policy, lru too, would do nothing: refused, not ignored)
    if ("cache_policy" in options or resolved.get("cache_policy", "lru") != "lru") and not resolved.get("expert_cache"):
        raise UsageError(f"policy {name!r}: cache_policy={resolved['cache_policy']} needs expert_cache > 0")
    return resolved


def impl_label(name: str, impl: str, options: Mapping[str, Any]) -> str:
    """The preset name, with the options that depart from it (`as-published+sync=none`)."""
    base = get_policy(name).preset(impl)
    changed = [f"{k}={v}" for k, v in sorted(options.items()) if k in base and base[k] != v]
    return impl + ("+" + ",".join(changed) if changed else "")


def build_schedule(name: str, inp: PolicyInput) -> Schedule:
    info = get_policy(name)
    options = resolve_options(name, inp.impl, inp.options)
    with gc_paused(), run_size.watching(name, inp.impl, inp.shape.num_steps, inp.shape.num_batches):
        ours = getattr(info.build, "__module__", "").startswith("klotski_sim.")
        try:
            with nullcontext() if ours else policy_time_limit(f"policy {name!r} building its schedule"):
                schedule = info.build(
                    PolicyInput(inp.model, inp.profile, inp.routing, inp.placement, options, inp.warmup, inp.impl)
                )
        except KlotskiError:
            raise
        except (Exception, SystemExit, GeneratorExit) as err:  # (a policy's sys.exit(0) would end a run, sweep
            # or compare "done")
            module = sys.modules.get(getattr(info.build, "__module__", ""))
            if module is None or module.__name__.startswith("klotski_sim."):
                raise  # a bug of ours: the traceback is the report
            raise PolicyError(
                f"policy {name!r} failed at {_where(err, module)}: {type(err).__name__}: {err} "
                f"(--debug shows the traceback)"
            ) from err
    if not isinstance(schedule, Schedule):
        raise PolicyError(
            f"policy {name!r} returned {type(schedule).__name__}, not a Schedule (end its build "
            f"function with OpEmitter.build or ScheduleBuilder.build)"
        )
    if not getattr(info.build, "__module__", "").startswith("klotski_sim."):
        _check_from_outside(name, schedule, inp)
    if inp.profile.tensor_parallel:  # one schedule for the whole group: its layers' all-reduces added
        schedule = with_all_reduces(schedule, inp.model, inp.profile.tensor_parallel)
    return schedule


def _check_from_outside(name: str, schedule: Schedule, inp: PolicyInput) -> None:
    """A policy file's schedule is checked whole, as a schedule file is, and must be of the run it
    was asked for: else it runs into a traceback (an unknown dep with validation off, 10**400
    bytes) or a false figure (negative tok/s from `generated_tokens: -5`, a run of no ops)."""
    where = f"the schedule of policy {name!r}"
    try:
        if not schedule.validate:
            schedule.check()
        check_foreign(schedule, where)
    except ScheduleError as err:
        raise PolicyError(str(err) if str(err).startswith(where) else f"{where}: {err}") from None
    if not schedule.ops:
        raise PolicyError(f"{where} has no ops: nothing to simulate")
    shape = inp.shape
    if schedule.meta.get("generated_tokens", shape.generated_tokens) != shape.generated_tokens:
        raise PolicyError(
            f"{where}: meta.generated_tokens {schedule.meta['generated_tokens']!r} is not the run's "
            f"{shape.generated_tokens} (batch size {shape.batch_size} x {shape.num_batches} batches x "
            f"{shape.gen_len} generated)"
        )


class PolicyError(UsageError):
    """A policy from outside the package failed while building its schedule."""


def line_in(err: BaseException, file: str | Path) -> int | None:
    """The line of `file` deepest in the error's traceback (None: the file is not in it): where a
    user's policy file failed."""
    own = Path(file).resolve()
    frames = [f for f in traceback.extract_tb(err.__traceback__) if Path(f.filename).resolve() == own]
    return frames[-1].lineno if frames else None


def _where(err: BaseException, module: ModuleType) -> str:
    """`file:line` of the deepest frame of the policy's own file in the error's traceback."""
    own = getattr(module, "__file__", None)
    line = line_in(err, own) if own else None
    return f"{own}:{line}" if line is not None else (own or module.__name__)


class OpEmitter:
    """Emits the standard ops of a Mixtral-style layer onto a ScheduleBuilder.

    Weight buffers are named after the transfer op that fills them and freed by the op passed
    `free=`; KV on the GPU grows by one allocation per attention op; KV on the CPU is loaded
    before attention (`h2d_kv`) and the new entries stored after it (`d2h_kv`).
    """

    def __init__(self, inp: PolicyInput, builder: ScheduleBuilder | None = None) -> None:
        self.inp = inp
        self.model = inp.model
        self.shape = inp.shape
        self.placement = inp.placement
        self.b = builder or ScheduleBuilder()
        self.impl = Impl.from_options(inp.options)
        self._attention_costs: dict[tuple[int, int], tuple[int, int, int]] = {}
        self._expert_costs: dict[int, tuple[int, int]] = {}  # tokens -> FLOPs, bytes
        # (tokens, layer) -> category, FLOPs, bytes, variant
        self._gate_costs: dict[tuple[int, int], tuple[str, int, int, str]] = {}
        self._last_kv_store: dict[tuple[int, int], str] = {}  # (layer, batch) -> its latest KV store
        self._attention_ops: list[str] = []
        self._kv_buffers: dict[int, list[str]] = {}
        self._staged: dict[tuple[int, int], dict[tuple[str, int], str]] = {}  # (step, layer) -> disk reads
        self._staged_at: dict[tuple[int, int], int] = {}  # (step, layer) -> position in the staging order
        self._staged_order: list[tuple[int, int]] = []
        # (step, layer) -> per H2D stream, the position and id of its latest copy of that layer's weights
        self._h2d_of_layer: dict[tuple[int, int], dict[str, tuple[int, str]]] = {}
        self._last_cpu_attention: dict[int, str] = {}  # layer -> its latest CPU attention (host KV in order)
        # `(b,)` for each batch, one tuple shared by all of its ops (not a new one per op: 48 bytes each)
        self.batch_tuple = [(b,) for b in range(self.shape.num_batches)]
        self.cache = _make_cache(inp)
        self._attention_variant = op_variant(self.model, "attention", self.impl.attention_impl)
        self._qkv_variant = op_variant(self.model, "attn_qkv")  # (the GPU half of a CPU attention)
        self.attention_on_cpu = _attention_on_cpu(inp)
        if self.attention_on_cpu:
            self.b.streams.update(CPU_STREAMS)
        self._preload_resident()
        self._size_watch = run_size.current()  # (None for an emitter made outside build_schedule)

    # ---- residency ----------------------------------------------------------------------------
    def _preload_resident(self) -> None:
        m = self.model
        self.b.preload("resident/embed+lm_head+norms", m.resident_bytes())
        for j in range(min(self.placement.resident_layers, m.num_layers)):
            self.b.preload(f"resident/L{j}", m.resident_layer_bytes(j))
        for batch in range(self.shape.num_batches):
            self.b.preload(f"hidden/b{batch}", m.hidden_bytes(self.shape.batch_size * self.shape.prompt_len))

    def is_resident(self, layer: int) -> bool:
        return layer < self.placement.resident_layers

    # ---- weight transfers -----------------------------------------------------------------------
    def tier(self, what: str, layer: int) -> str:
        return self.placement.tier(what, layer, self.model.num_layers)

    def fetch(
        self,
        op_id: str,
        what: str,
        nbytes: int,
        category: str,
        stream: str,
        deps: Iterable[str | None] = (),
        *,
        step: int,
        layer: int,
        expert: int = -1,
        free: Iterable[str] = (),
        **tags: Any,
    ) -> str:
        """Bring `nbytes` of weights (`what` = attention|gate|experts) to the GPU. From disk
        this is two chained links: the tensor is first staged in host memory by an NVMe read
        (see `_stage`), then copied over PCIe. `free` and any other `tags` go on the copy op."""
        deps = list(deps)
        cached = False
        free = tuple(free)
        if what == "experts" and self.cache is not None:  # the expert cache first: a hit copies nothing
            held = self.cache.lookup((layer, expert))
            if held is not None:
                return held
            cached, victim, victim_last = self.cache.admit((layer, expert))
            if victim is not None:  # the copy that replaces it waits for its last use and frees it
                deps.append(victim_last)
                free += (victim,)
        key = (step, layer)
        if self.tier(what, layer) == "disk":
            staged_at = self._staged_at.get(key)
            # (re)stage unless this layer is still inside the host window (single-batch streams
            # the same (step, layer) again for every batch)
            if staged_at is None or staged_at < len(self._staged_order) - self.placement.disk_window:
                self._stage(step, layer)
            deps.append(self._staged[key][(what, expert)])
        pageable = self.impl.copy_memory_weights == "pageable"
        nbytes = int(nbytes)
        if tags:  # (tags a policy of its own adds: the op built by keywords)
            op = self.b.transfer(
                op_id,
                category,
                stream,
                nbytes,
                "cpu",
                "gpu",
                deps,
                alloc=((op_id, nbytes),),
                step=step,
                layer=layer,
                expert=expert,
                tensor=_TENSOR[what],
                pageable=pageable,
                free=free,
                **tags,
            )
        else:
            op = self.b.append(
                transfer_op(
                    op_id,
                    category,
                    stream,
                    nbytes,
                    "cpu",
                    "gpu",
                    clean_deps(deps),
                    step,
                    layer,
                    expert,
                    _TENSOR[what],
                    pageable,
                    ((op_id, nbytes),),
                    free,
                )
            )
        self._h2d_of_layer.setdefault(key, {})[stream] = (len(self.b.ops) - 1, op)  # (the op just issued)
        if pageable:
            self.copy_wait(op)
        if what == "experts" and self.model.quantised:
            op = self.dequantise(op, step, layer, expert)
        if cached:
            self.cache.insert((layer, expert), op)
        return op

    def releasable(self, buffers: Iterable[str]) -> tuple[str, ...]:
        """The buffers an op may free: all but those the expert cache holds."""
        if self.cache is None:
            return tuple(buffers)
        return tuple(b for b in buffers if not self.cache.holds(b))

    def dequantise(self, load: str, step: int, layer: int, expert: int) -> str:
        """A quantised expert, once copied, is dequantised on the GPU into a buffer in the model
        dtype (HQQ's `dequantize`; Klotski's port does it in `load_weight`); the packed copy is
        freed. Callers use (and free) the returned buffer as they would the copy's."""
        m = self.model
        op_id = f"{load}/dequant"
        return self.b.compute(
            op_id,
            "dequant",
            [load],
            flops=m.dequant_flops(),
            bytes=m.dequant_io_bytes(),
            alloc=((op_id, m.expert_params() * m.dtype_bytes),),
            free=(load,),
            step=step,
            phase=self.phase(step),
            layer=layer,
            expert=expert,
        )

    def fetch_attention(self, at: str, step: int, layer: int, deps: Iterable[str | None] = ()) -> str:
        """A layer's attention weights on the weight stream (op id `{at}/load_attn`)."""
        return self.fetch(
            f"{at}/load_attn",
            "attention",
            self.model.attention_bytes(),
            "weights",
            "h2d_weights",
            deps,
            step=step,
            layer=layer,
        )

    def fetch_layer(
        self, at: str, step: int, layer: int, deps: Iterable[str | None] = ()
    ) -> tuple[str, str, list[str]]:
        """The whole of a layer — attention, gate and every expert — on the weight stream, as the
        single-batch, multi-batch and FlexGen prefetches load it. Returns the attention, gate and
        per-expert load ids."""
        deps = list(deps)
        attention = self.fetch_attention(at, step, layer, deps)
        gate = self.fetch_gate(at, step, layer, deps)
        return attention, gate, self.fetch_moe_layer(at, step, layer, deps)

    def fetch_gate(
        self, at: str, step: int, layer: int, deps: Iterable[str | None] = (), stream: str = "h2d_weights"
    ) -> str:
        """A layer's gate (router) weights (op id `{at}/load_gate`)."""
        return self.fetch(
            f"{at}/load_gate", "gate", self.model.gate_bytes(layer), "weights", stream, deps, step=step, layer=layer
        )

    def fetch_moe_layer(self, at: str, step: int, layer: int, deps: Iterable[str | None] = ()) -> list[str]:
        """Every expert of a layer on the weight stream (op ids `{at}/load_E{e}`), in expert-id order."""
        deps = list(deps)
        return [
            self.fetch(
                f"{at}/load_E{e}",
                "experts",
                self.model.expert_bytes(),
                "moe_weights",
                "h2d_weights",
                deps,
                step=step,
                layer=layer,
                expert=e,
            )
            for e in range(self.model.experts_in(layer))
        ]

    def _stage(self, step: int, layer: int) -> None:
        """Read a whole layer's disk-resident tensors into the host staging window. The window
        holds `disk_window` layers: this read waits until the layer `disk_window` places back
        has been copied to the GPU (and so may be evicted from host memory): for the latest copy of it
        on each stream, whose end implies the end of the stream's earlier ones (streams are in order).
        Naming every copy would make each of a DeepSeek-V3 layer's 256 reads wait for its 259 copies:
        42.9M deps of 1M ops in its Klotski schedule on an RTX 3090 rather than 1.8M, each kept,
        looked up and checked."""
        m, pl = self.model, self.placement
        g = len(self._staged_order)
        self._staged_order.append((step, layer))
        self._staged_at[(step, layer)] = g
        copied = self._h2d_of_layer.get(self._staged_order[g - pl.disk_window], {}) if g >= pl.disk_window else {}
        evict = [op for _, op in sorted(copied.values())]  # (in issue order)
        reads: dict[tuple[str, int], str] = {}
        tensors = [("attention", -1, m.attention_bytes(), "weights"), ("gate", -1, m.gate_bytes(layer), "weights")]
        tensors += [("experts", e, m.expert_bytes(), "moe_weights") for e in range(m.experts_in(layer))]
        evict_deps = clean_deps(evict)  # (one tuple, shared by the layer's reads)
        for what, expert, nbytes, category in tensors:
            if self.tier(what, layer) == "disk":  # (built positionally, as `fetch` builds its copies)
                name = f"disk/{g}/s{step}/L{layer}/{what}" + (f"/E{expert}" if expert >= 0 else "")
                reads[(what, expert)] = self.b.append(
                    transfer_op(
                        name,
                        category,
                        "disk_read",
                        int(nbytes),
                        "disk",
                        "cpu",
                        evict_deps,
                        step,
                        layer,
                        expert,
                        _TENSOR[what],
                        False,
                        (),
                        (),
                    )
                )
        self._staged[(step, layer)] = reads

    # ---- compute ------------------------------------------------------------------------------
    def embed(self, op_id: str, step: int, batch: int, deps: Iterable[str | None] = ()) -> str:
        """A batch's embedding at `step`: the first op of its step in every policy loop, where the
        run's size is projected (klotski_sim.util.run_size)."""
        if self._size_watch is not None:
            self._size_watch.step_begins(step, batch, len(self.b.ops))
        tokens = self.new_tokens(step) * self.shape.batch_size
        return self.b.compute(
            op_id,
            "embed",
            deps,
            bytes=self.model.hidden_bytes(tokens),
            step=step,
            phase=self.phase(step),
            batches=self.batch_tuple[batch],
            tokens=tokens,
        )

    def lm_head(self, op_id: str, step: int, batch: int, deps: Iterable[str | None] = ()) -> str:
        """Logits of the last position of each sequence; after the last step the batch is done
        and its KV cache is released."""
        bs = self.shape.batch_size
        done = step == self.shape.num_steps - 1
        return self.b.compute(
            op_id,
            "lm_head",
            deps,
            flops=self.model.lm_head_flops(bs),
            bytes=self.model.lm_head_io_bytes(bs),
            step=step,
            phase=self.phase(step),
            batches=self.batch_tuple[batch],
            tokens=bs,
            free=tuple(self._kv_buffers.pop(batch, ())) if done else (),
        )

    def attention(
        self, op_id: str, step: int, layer: int, batch: int, deps: Iterable[str | None] = (), free: tuple[str, ...] = ()
    ) -> str:
        """Attention of one batch, with its KV cache: grown on the GPU, or loaded from and stored to
        the CPU around the op."""
        m, sh = self.model, self.shape
        deps = list(deps)
        if self._one_gpu_op(step):
            return self.attentions_on_gpu([(op_id, batch)], step, layer, deps, tuple(free))[0]
        if self.attention_on_cpu and step > 0:
            return self._decode_attention_on_cpu(op_id, step, layer, batch, deps, tuple(free))
        new = self.new_tokens(step)
        kv_len = sh.kv_len(step)
        flops, nbytes, kv_new = self._attention_cost(new, kv_len)
        free = tuple(free)
        tags: dict[str, Any] = dict(step=step, phase=self.phase(step), layer=layer, batches=self.batch_tuple[batch])
        if kv_len - new > 0:
            # Double-buffered like FlexGen's load_cache(j, k+1): the cache of this attention may
            # load once the attention two before it has finished with its own buffer.
            past = m.kv_bytes(sh.batch_size, kv_len - new)
            # ... and once the entries of this batch's previous step have been stored
            after = self._attention_ops[-2:-1] + [self._last_kv_store.get((layer, batch))]
            pageable = self.impl.copy_memory_kv == "pageable"
            load = self.b.transfer(
                f"{op_id}/kv_load",
                "kv",
                "h2d_kv",
                past,
                "cpu",
                "gpu",
                after,
                alloc=((f"{op_id}/kv_load", past),),
                tensor="kv",
                pageable=pageable,
                **tags,
            )
            if pageable:
                self.copy_wait(load)
            deps.append(load)
            free = free + (load,)
        op = self.b.append(
            compute_op(
                op_id,
                "attention",
                clean_deps(deps),
                flops,
                nbytes,
                step,
                self.phase(step),
                layer,
                self.batch_tuple[batch],
                -1,
                sh.batch_size * new,
                kv_len,
                (),
                free,
                self._attention_variant,
            )
        )
        self._attention_ops.append(op)
        pageable = self.impl.copy_memory_kv == "pageable"
        store = self.b.transfer(
            f"{op_id}/kv_store", "kv", "d2h_kv", kv_new, "gpu", "cpu", [op], tensor="kv", pageable=pageable, **tags
        )
        if pageable:
            self.copy_wait(store)
        self._last_kv_store[(layer, batch)] = store
        return op

    def attentions(
        self,
        at: str,
        step: int,
        layer: int,
        batches: Sequence[int],
        deps: Iterable[str | None],
        free_last: tuple[str, ...] = (),
    ) -> list[str]:
        """Attention of each batch in turn (op ids `{at}/b{b}/attn`), the last freeing `free_last`.
        With the KV cache on the GPU the ops of all batches are built together (they cost the same)."""
        if self._one_gpu_op(step):
            return self.attentions_on_gpu([(f"{at}/b{b}/attn", b) for b in batches], step, layer, list(deps), free_last)
        last = batches[-1]
        return [
            self.attention(f"{at}/b{b}/attn", step, layer, b, deps, free=free_last if b == last else ())
            for b in batches
        ]

    def _one_gpu_op(self, step: int) -> bool:
        """Whether an attention at `step` is one GPU op that grows its KV cache on the GPU (not split
        with the CPU, and its cache not loaded from the CPU)."""
        return self.placement.kv == "gpu" and not (self.attention_on_cpu and step > 0)

    def attentions_on_gpu(
        self, ops: list[tuple[str, int]], step: int, layer: int, deps: list[str | None], free_last: tuple[str, ...]
    ) -> list[str]:
        """(op id, batch) attentions with the KV cache on the GPU, each allocating the entries it
        adds; the last frees `free_last`."""
        new = self.new_tokens(step)
        kv_len = self.shape.kv_len(step)
        flops, nbytes, kv_new = self._attention_cost(new, kv_len)
        deps_, phase, tokens, variant = (
            clean_deps(deps),
            self.phase(step),
            self.shape.batch_size * new,
            self._attention_variant,
        )
        append, batch_tuple, kv_buffers, last = self.b.append, self.batch_tuple, self._kv_buffers, ops[-1][0]
        out = []
        for op_id, batch in ops:
            name = kv_buffer(layer, batch, step)
            kv_buffers.setdefault(batch, []).append(name)
            out.append(
                append(
                    compute_op(
                        op_id,
                        "attention",
                        deps_,
                        flops,
                        nbytes,
                        step,
                        phase,
                        layer,
                        batch_tuple[batch],
                        -1,
                        tokens,
                        kv_len,
                        ((name, kv_new),),
                        free_last if op_id == last else (),
                        variant,
                    )
                )
            )
        self._attention_ops.extend(out)
        return out

    def hidden_down(
        self,
        op_id: str,
        step: int,
        layer: int,
        batches: Iterable[int],
        tokens: int,
        deps: Iterable[str | None],
        expert: int = -1,
    ) -> str:
        """The hidden states of `tokens` tokens to host memory, for experts the CPU computes."""
        return self.b.transfer(
            op_id,
            "activation",
            "d2h_act",
            self.model.hidden_bytes(tokens),
            "gpu",
            "cpu",
            deps,
            step=step,
            layer=layer,
            batches=tuple(batches),
            expert=expert,
            tensor="activation",
        )

    def cpu_expert(
        self,
        op_id: str,
        step: int,
        layer: int,
        expert: int,
        batches: Iterable[int],
        tokens: int,
        hidden: str,
        blocks_host: bool = False,
    ) -> str:
        """One expert on the host CPU over `tokens` tokens whose hidden states `hidden` brought
        down (on the weights as stored: packed codes when quantised); with `blocks_host` it runs on
        the issuing thread. Returns the copy of its output back to the GPU (`{op_id}/up`)."""
        m, batches = self.model, tuple(batches)
        cpu = self.b.compute(
            op_id,
            "expert",
            [hidden],
            stream="cpu_compute",
            flops=m.expert_flops(tokens),
            bytes=m.expert_io_bytes(tokens, stored=True),
            step=step,
            phase=self.phase(step),
            layer=layer,
            batches=batches,
            expert=expert,
            tokens=tokens,
        )
        if blocks_host:
            self.sync(op_id, [cpu])
        return self.b.transfer(
            f"{op_id}/up",
            "activation",
            "h2d_act",
            m.hidden_bytes(tokens),
            "cpu",
            "gpu",
            [cpu],
            step=step,
            layer=layer,
            batches=batches,
            expert=expert,
            tensor="activation",
        )

    def _decode_attention_on_cpu(
        self, op_id: str, step: int, layer: int, batch: int, deps: list[str | None], free: tuple[str, ...]
    ) -> str:
        """MoE-Lightning's CGOPipe split of a decode attention (option `attention_device=cpu`): q, k,
        v projected on the GPU, sent to host memory, attention over the KV cache there on the CPU
        (the new k, v appended to it), the result sent back and projected by o on the GPU. The KV
        cache never crosses PCIe in decode."""
        m, sh = self.model, self.shape
        tokens, kv_len = sh.batch_size, sh.kv_len(step)
        tags: dict[str, Any] = dict(step=step, phase=self.phase(step), layer=layer, batches=self.batch_tuple[batch])
        h, q, kv = m.hidden_size, m.q_dim, m.kv_dim
        qkv = self.b.compute(
            f"{op_id}/qkv",
            "attn_qkv",
            deps,
            flops=2 * tokens * h * (q + 2 * kv),
            bytes=h * (q + 2 * kv) * m.dtype_bytes + m.hidden_bytes(tokens) + tokens * (q + 2 * kv) * m.dtype_bytes,
            tokens=tokens,
            variant=self._qkv_variant,
            **tags,
        )
        # in order behind this layer's previous CPU attention, and behind the prefill's KV store
        down = self.b.transfer(
            f"{op_id}/qkv_down",
            "activation",
            "d2h_act",
            tokens * (q + 2 * kv) * m.dtype_bytes,
            "gpu",
            "cpu",
            [qkv, self._last_cpu_attention.get(layer), self._last_kv_store.get((layer, batch))],
            tensor="activation",
            **tags,
        )
        core = self.b.compute(
            f"{op_id}/cpu",
            "attention",
            [down],
            stream="cpu_compute",
            flops=2 * 2 * tokens * m.num_heads * m.head_dim * kv_len,
            bytes=m.kv_bytes(tokens, kv_len) + 2 * tokens * q * m.dtype_bytes,
            tokens=tokens,
            kv_len=kv_len,
            **tags,
        )
        self._last_cpu_attention[layer] = core
        up = self.b.transfer(
            f"{op_id}/out_up",
            "activation",
            "h2d_act",
            tokens * q * m.dtype_bytes,
            "cpu",
            "gpu",
            [core],
            tensor="activation",
            **tags,
        )
        op = self.b.compute(
            op_id,
            "attn_out",
            [up, *deps],
            flops=2 * tokens * q * h,
            bytes=q * h * m.dtype_bytes + 2 * m.hidden_bytes(tokens),
            tokens=tokens,
            free=free,
            **tags,
        )
        self._attention_ops.append(op)
        return op

    def gate(
        self, op_id: str, step: int, layer: int, batch: int, deps: Iterable[str | None] = (), free: tuple[str, ...] = ()
    ) -> str:
        return self.b.append(self.gate_ops([(op_id, batch)], step, layer, deps, tuple(free))[0])

    def gate_ops(
        self,
        ops: list[tuple[str, int]],
        step: int,
        layer: int,
        deps: Iterable[str | None],
        free_last: tuple[str, ...] = (),
    ) -> list[Op]:
        """The gates (a dense layer: its MLP) of (op id, batch) pairs, the last freeing `free_last`,
        built together and not yet issued: a policy appends each where its loop issues it."""
        tokens = self.new_tokens(step) * self.shape.batch_size
        cost = self._gate_costs.get((tokens, layer))
        if cost is None:  # a dense layer's MLP takes the gate's place
            m = self.model
            category = "gate" if m.is_moe(layer) else "dense_mlp"
            cost = self._gate_costs[(tokens, layer)] = (
                category,
                m.gate_flops(tokens, layer),
                m.gate_io_bytes(tokens, layer),
                op_variant(m, category),
            )
        category, flops, nbytes, variant = cost
        deps_, phase, batch_tuple, last = clean_deps(deps), self.phase(step), self.batch_tuple, ops[-1][0]
        return [
            compute_op(
                op_id,
                category,
                deps_,
                flops,
                nbytes,
                step,
                phase,
                layer,
                batch_tuple[batch],
                -1,
                tokens,
                0,
                (),
                free_last if op_id == last else (),
                variant,
            )
            for op_id, batch in ops
        ]

    def expert(
        self,
        op_id: str,
        step: int,
        layer: int,
        expert: int,
        batches: Iterable[int],
        tokens: int,
        deps: Iterable[str | None] = (),
        free: tuple[str, ...] = (),
        rows_of: str | None = None,
    ) -> str:
        """One expert over `tokens` tokens gathered from `batches`. With option `sync=per-expert`
        the host first reads the expert's token rows, which `rows_of` produced (a `.tolist()`:
        sync op `{op_id}/rows/sync`)."""
        last = self.expert_chain(
            step, layer, rows_of, [(op_id, expert, tuple(batches), tokens, clean_deps(list(deps)), tuple(free))]
        )
        assert last is not None  # (a chain of one op ends with it)
        return last

    @overload
    def expert_chain(
        self, step: int, layer: int, after: str, ops: Sequence[ExpertOp], last_also: tuple[str, ...] = ()
    ) -> str: ...

    @overload
    def expert_chain(
        self, step: int, layer: int, after: str | None, ops: Sequence[ExpertOp], last_also: tuple[str, ...] = ()
    ) -> str | None: ...

    def expert_chain(
        self, step: int, layer: int, after: str | None, ops: Sequence[ExpertOp], last_also: tuple[str, ...] = ()
    ) -> str | None:
        """Expert ops (op id, expert, batches, tokens, deps, frees; deps without Nones or
        repeats) issued one after another, as a published MoE loop walks them: with option
        `sync=per-expert` each after the host reads its token rows, which the op before it (the
        first: `after`, if any) produced. The last op also waits for and frees `last_also` (weights
        loaded and never used). Built in one pass: an as-published schedule has such a pair per
        expert, batch, layer and step. Returns the last op (`after` without ops)."""
        if last_also and ops:
            op_id, expert, batches, tokens, deps, free = ops[-1]
            ops = [*ops[:-1], (op_id, expert, batches, tokens, deps + last_also, free + last_also)]
        phase, costs, cache, sync_rows = self.phase(step), self._expert_costs, self.cache, self.impl.sync_experts
        pairs: list[tuple[Op, Op]] = []  # (a sync, the op it holds back)
        op = after
        for op_id, expert, batches, tokens, deps, free in ops:
            cost = costs.get(tokens) or self._expert_cost(tokens)
            sync = f"{op_id}/rows/sync" if sync_rows and op is not None else None
            expert_op = compute_op(
                op_id,
                "expert",
                deps + (sync,) if sync else deps,
                cost[0],
                cost[1],
                step,
                phase,
                layer,
                batches,
                expert,
                tokens,
                0,
                (),
                free if cache is None else self.releasable(free),
                "",
            )
            if sync is not None and op is not None:
                pairs.append((host_op(sync, "sync", (op,)), expert_op))
            else:  # (no rows to read first: issued as it is)
                self.b.append(expert_op)
            if cache is not None:
                for d in expert_op.deps:
                    cache.used_by(d, op_id)
            op = op_id
        return self.b.append_after_syncs(pairs) if pairs else op

    def _expert_cost(self, tokens: int) -> tuple[int, int]:
        """FLOPs and bytes of one expert over `tokens` tokens, kept: an as-published schedule has an
        expert op per expert, batch, layer and step, over a few hundred distinct token counts."""
        cost = self._expert_costs[tokens] = (self.model.expert_flops(tokens), self.model.expert_io_bytes(tokens))
        return cost

    def _attention_cost(self, new: int, kv_len: int) -> tuple[int, int, int]:
        """FLOPs and bytes of one batch's attention, and the bytes of the KV entries it adds (the
        same for every batch and layer of a step)."""
        key = (new, kv_len)
        cost = self._attention_costs.get(key)
        if cost is None:
            m, bs, variant = self.model, self.shape.batch_size, self.impl.attention_impl
            cost = self._attention_costs[key] = (
                m.attention_flops(bs, new, kv_len, variant),
                m.attention_io_bytes(bs, new, kv_len, variant),
                m.kv_bytes(bs, new),
            )
        return cost

    # ---- the host thread -------------------------------------------------------------------------
    def sync(self, at: str, waits_for: Iterable[str | None]) -> str | None:
        """The host waits for `waits_for` (`torch.cuda.synchronize`, `stream.synchronize` or a
        `.tolist()`) before issuing anything else; op id `{at}/sync`."""
        waits = [w for w in waits_for if w is not None]
        return self.b.host_wait(f"{at}/sync", "sync", waits) if waits else None

    def sync_device(self, at: str) -> str | None:
        """A device-wide synchronise: the host waits for everything issued so far."""
        return self.sync(at, self.b.last_issued())

    def copy_wait(self, copy: str) -> str:
        """A copy from/to pageable memory holds the host thread until it has finished."""
        return self.b.host_wait(f"{copy}/wait", "copy_wait", [copy])

    def cold_orders(self, step: int, layer: int) -> list[list[int]]:
        """For each batch, the experts it selected at this step and layer in the order their
        on-demand loads are issued (option `cold_order`)."""
        routing, order = self.inp.routing, self.impl.cold_order
        counts = routing.counts[step, layer]  # (all zero in a dense layer, whose routed ids are never used)
        if order == "expert-id":
            return [[e for e, tokens in enumerate(row) if tokens] for row in counts.tolist()]
        if order == "most-tokens-first":  # (a stable sort: ties in expert-id order)
            ranked = np.argsort(-counts, axis=1, kind="stable").tolist()
            return [row[:used] for row, used in zip(ranked, np.count_nonzero(counts, axis=1).tolist())]
        return routing.first_use_orders(step, layer)

    # ---- helpers --------------------------------------------------------------------------------
    def new_tokens(self, step: int) -> int:
        """Tokens each sequence adds at `step` (RunShape.new_tokens)."""
        return self.shape.new_tokens(step)

    phase = staticmethod(RunShape.phase)

    def build(self, policy: str, **extra_meta: Any) -> Schedule:
        sh, m = self.shape, self.model
        meta = dict(
            policy=policy,
            model=m.name,
            hardware=self.inp.profile.name,
            batch_size=sh.batch_size,
            num_batches=sh.num_batches,
            prompt_len=sh.prompt_len,
            gen_len=sh.gen_len,
            generated_tokens=sh.generated_tokens,
            placement=asdict(self.placement),
            routing=self.inp.routing.source,
            options=dict(self.inp.options),
            impl=impl_label(policy, self.inp.impl, self.inp.options),
        )
        meta.update(extra_meta)
        if self.cache is not None:
            meta["expert_cache"] = self.cache.stats()
            held = list(self.cache.entries.values())
            if held:  # the run ends with nothing allocated: the cache lets go of what it holds
                self.b.compute(
                    "release_expert_cache", "combine", [self.cache.last_use.get(b, b) for b in held], free=tuple(held)
                )
        return self.b.build(meta)
