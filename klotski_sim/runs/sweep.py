"""What-if sweeps: a YAML grid of configurations, run on a local process pool or a Dask cluster,
collected into one Parquet file (one row per configuration, every input and every metric).

Resumable by construction: each finished configuration is written atomically to
`rows/<id>.json` (temp file + rename) the moment it finishes; `results.parquet` is rebuilt from
those rows (also atomically). Rerunning the same command skips the ids already there; killing
the sweep at any moment loses nothing that finished and never leaves a half-written file. A
configuration that does not run to the end is a row with its status and error: `oom` (GPU memory:
simulated, or refused by the memory check; error holds the numbers as JSON), `refused` (the
profile's host memory or disk cannot hold what the run keeps there: the reason), `too-large` (the
memory of the machine running the sweep cannot hold the run's schedule and timeline, projected
from its first steps: klotski_sim/util/run_size.py; tried again on a rerun), `killed` (its worker process
died running it, on its own: the kernel's OOM killer, a `kill -9`; tried again on a rerun) or `error`.
The id hashes the inputs *and* the simulator's code, so rows computed by older code stay on disk
but are neither reused nor reported.

Spec (every key optional except `policies`; lists are grid axes, each value once — a model or a
profile under a second name counts as given twice):

    name: pcie-what-if
    models: [mixtral-8x7b]           # presets or Hugging Face config.json files
    hardware: [rtx3090, h800]        # built-in names or profile YAML files
    overrides:                       # grid over dotted profile fields
      links.pcie_h2d.bandwidth: [16e9, 32e9, 64e9]
    policies: [klotski, flexgen]
    batch_sizes: [16]
    num_batches: [auto]              # or integers
    prompt_lens: [512]
    gen_lens: [32]
    routings: [calibrated, uniform]  # or trace files: [trace:path/to/file.npz]
                                     # (every file a spec names: relative to the spec, or absolute)
    seeds: [0]
    kv: [auto]
    experts: [auto]
    impls: [as-published]            # implementation presets: as-published, ideal, v0.1
    policy_files: [my_policy.py]     # your own policies (paths relative to this spec; docs/own-schedule.md)
    options:                         # grid over policy options (every policy in the grid must take them)
      expert_cache: [0, 16]
    resident_layers: [auto, 0, fill] # layers kept whole on the GPU (auto: the planner's choice with n auto,
                                     # else 0; fill: as many as the memory left at n allows)
    gpus: [1, 2]                     # tensor-parallel groups of the profile's GPUs (simulate --gpus G)
"""

from __future__ import annotations

import fcntl
import hashlib
import itertools
import json
import logging
import math
import os
import sys
import time
import traceback
from concurrent.futures import as_completed
from contextlib import contextmanager
from dataclasses import fields, replace
from functools import lru_cache
from importlib import resources
from pathlib import Path
from typing import Annotated, Any, Callable, Iterable, Iterator

import yaml
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    StrictInt,
    StrictStr,
    ValidationError,
    field_validator,
    model_validator,
)

from klotski_sim.core.timeline import Summary, jsonable
from klotski_sim.files.npzfile import NPZ_READ_ERRORS, check_npz
from klotski_sim.files.outfiles import refuse_link, write_file
from klotski_sim.files.textfile import read_text
from klotski_sim.files.yamlfile import MAX_BYTES as MAX_YAML_BYTES
from klotski_sim.files.yamlfile import load_yaml
from klotski_sim.hardware.profile import ProfileError, builtin_profile_names, load_profile, with_overrides
from klotski_sim.policies import POLICIES
from klotski_sim.policies.base import resolve_options
from klotski_sim.policies.impl import PRESET_NAMES
from klotski_sim.policies.plugins import load_policy_files
from klotski_sim.runs.serving_sweep import ServingGrid, check_serving_spec, run_serving_config, serving_configs
from klotski_sim.util.argtypes import MAX_COUNT, MAX_COUNT_TEXT, MAX_SEED, first_repeat
from klotski_sim.util.errors import KlotskiError, MachineRefusal, MissingCapability, StorageRefusal, UsageError
from klotski_sim.util.lazy import pd  # (imported when first used: klotski_sim/util/lazy.py)
from klotski_sim.util.progress import Progress
from klotski_sim.util.stopping import signals_deferred, terminal_signals_ignored
from klotski_sim.workload.hf_config import is_config_path
from klotski_sim.workload.model import ModelSpec, get_model, preset_name
from klotski_sim.workload.trace import Trace
from klotski_sim.workload.trace_synth import DEFAULT_ROUTING, params_for


class SweepError(KlotskiError):
    """A sweep spec that cannot run; raised before anything runs."""


def _auto() -> list[int | str]:
    """A fresh `["auto"]`, typed as the number-or-text axes it is the default of."""
    return ["auto"]


class SweepSpec(BaseModel):
    """The grid. Unknown keys are errors (with a suggestion), so a typo never silently shrinks it."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str = "sweep"
    models: list[str] = Field(default_factory=lambda: ["mixtral-8x7b"], min_length=1)
    hardware: list[str] = Field(default_factory=lambda: ["rtx3090"], min_length=1)
    overrides: dict[str, list[Any]] = Field(default_factory=dict)
    policies: list[str] = Field(min_length=1)
    batch_sizes: list[StrictInt] = Field(default_factory=lambda: [16], min_length=1)
    num_batches: list[StrictInt | StrictStr] = Field(default_factory=_auto, min_length=1)
    prompt_lens: list[StrictInt] = Field(default_factory=lambda: [512], min_length=1)
    gen_lens: list[StrictInt] = Field(default_factory=lambda: [32], min_length=1)
    routings: list[StrictStr] = Field(default_factory=lambda: [DEFAULT_ROUTING], min_length=1)
    seeds: list[StrictInt] = Field(default_factory=lambda: [0], min_length=1)
    kv: list[str] = Field(default_factory=lambda: ["auto"], min_length=1)
    experts: list[str] = Field(default_factory=lambda: ["auto"], min_length=1)
    impls: list[str] = Field(default_factory=lambda: ["as-published"], min_length=1)
    policy_files: list[StrictStr] = Field(default_factory=list)  # your own policies (relative to the spec)
    options: dict[str, list[Any]] = Field(default_factory=dict)  # grid over policy options (expert_cache: [0, 16])
    resident_layers: list[StrictInt | StrictStr] = Field(default_factory=_auto, min_length=1)
    # tensor-parallel group sizes (klotski_sim/parallel/tensor.py); offline grids only
    gpus: list[Annotated[StrictInt, Field(ge=1, le=1024)]] = Field(default_factory=lambda: [1], min_length=1)
    serving: ServingGrid | None = None  # serving axes: a grid of `klotski-sim serve` runs (runs/serving_sweep.py)

    @model_validator(mode="after")
    def _groups_offline(self) -> "SweepSpec":
        """A serving grid runs each configuration on one GPU (`serve --gpus G` runs a group)."""
        if self.serving is not None and self.gpus != [1]:
            raise ValueError("gpus: a serving grid runs on one GPU; `klotski-sim serve --gpus G` serves on a group")
        return self

    @field_validator("overrides")
    @classmethod
    def _numbers(cls, grid: dict[str, list[Any]]) -> dict[str, list[Any]]:
        """YAML 1.1 reads `16e9` as text; a number-looking override is a number."""

        def number(v: Any) -> Any:
            if isinstance(v, str):
                try:
                    v = float(v)
                except ValueError:
                    return v
            if isinstance(v, float) and not math.isfinite(v):
                raise ValueError(f"override values must be finite, got {v!r}")
            return v

        return {k: [number(v) for v in values] for k, values in grid.items()}

    @field_validator("batch_sizes", "prompt_lens", "gen_lens")
    @classmethod
    def _positive(cls, values: list[int]) -> list[int]:
        bad = [v for v in values if not 1 <= v <= MAX_COUNT]
        if bad:
            raise UsageError(f"values must be from 1 to {MAX_COUNT_TEXT}, got {bad[0]!r}")
        return values

    @field_validator("seeds")
    @classmethod
    def _seeds(cls, values: list[int]) -> list[int]:
        bad = [v for v in values if not 0 <= v <= MAX_SEED]  # (as the command lines take them)
        if bad:
            raise UsageError(f"seeds must be from 0 to 2**63 - 1, got {bad[0]!r}")
        return values

    @field_validator(
        "models",
        "hardware",
        "policies",
        "batch_sizes",
        "num_batches",
        "prompt_lens",
        "gen_lens",
        "routings",
        "seeds",
        "kv",
        "experts",
        "impls",
        "resident_layers",
        "gpus",
    )
    @classmethod
    def _once_each(cls, values: list[Any]) -> list[Any]:
        """A value given twice would run the same configurations twice (and count them once)."""
        twice = first_repeat(values)
        if twice is not None:
            raise UsageError(f"{twice!r} is given twice")
        return values

    @field_validator("policy_files")
    @classmethod
    def _files_once_each(cls, files: list[str]) -> list[str]:
        """A policy file given twice, by any path to it, would register its policies twice."""
        real = [os.path.realpath(f) for f in files]
        twice = first_repeat(real)
        if twice is not None:
            raise UsageError(f"{files[real.index(twice, real.index(twice) + 1)]!r} is given twice (as {twice})")
        return files

    @field_validator("overrides", "options")
    @classmethod
    def _axes_not_empty(cls, grid: dict[str, list[Any]]) -> dict[str, list[Any]]:
        for key, values in grid.items():
            if not values:
                raise UsageError(f"{key}: give at least one value (an empty axis would empty the grid)")
            twice = first_repeat(values)  # (as on every other axis: `[2e10, 20000000000]` would run twice)
            if twice is not None:
                raise UsageError(f"{key}: {twice!r} is given twice")
        return grid

    @field_validator("num_batches")
    @classmethod
    def _batches(cls, values: list[int | str]) -> list[int | str]:
        for v in values:
            if v != "auto" and (not isinstance(v, int) or v < 1):
                raise UsageError(f"num_batches entries are positive integers or 'auto', got {v!r}")
        return values


def load_spec(path: str | Path, checked: bool = True) -> SweepSpec:
    """A spec file; every file it names (policy files, hardware YAML files, `trace:` routings) is
    relative to the spec's folder, absolute paths as they are. `checked=False`: its types only, not yet
    `check_spec` (which loads every profile once per override value)."""
    path = Path(path)
    data = load_yaml(read_text(path, "sweep spec", SweepError, MAX_YAML_BYTES), str(path), SweepError)
    if isinstance(data, dict):

        def beside_spec(name: Any, prefix: str = "") -> Any:
            if not isinstance(name, str) or not name.startswith(prefix):
                return name
            file = name[len(prefix) :]
            return name if not file or Path(file).is_absolute() else prefix + str(path.parent / file)

        files = {
            "policy_files": beside_spec,
            "routings": lambda r: beside_spec(r, "trace:"),
            "hardware": lambda h: h if h in builtin_profile_names() else beside_spec(h),
            "models": lambda m: beside_spec(m) if isinstance(m, str) and is_config_path(preset_name(m)) else m,
        }
        for key, resolve in files.items():
            if isinstance(data.get(key), list):
                data[key] = [resolve(entry) for entry in data[key]]
    return parse_spec(data, str(path), checked)


def parse_spec(data: Any, where: str = "sweep spec", checked: bool = True) -> SweepSpec:
    import difflib

    if not isinstance(data, dict):
        raise SweepError(f"{where}: a sweep spec is a mapping")
    try:
        spec = SweepSpec.model_validate(data)
    except ValidationError as err:
        problems: dict[str, str] = {}  # one per place (a value failing every type of a union is one problem)
        for e in err.errors():
            place = [str(p) for p in e["loc"] if str(p) not in ("int", "str", "float", "bool")]
            loc = ".".join(place)
            if e["type"] == "extra_forbidden":
                close = difflib.get_close_matches(str(e["loc"][0]), list(SweepSpec.model_fields), n=1)
                problems.setdefault(loc, "unknown key" + (f" (did you mean {close[0]!r}?)" if close else ""))
            elif e["type"] == "missing":
                problems.setdefault(loc, "required")
            elif e["type"] == "value_error" and "error" in e.get("ctx", {}):  # (our own check: it names the value)
                problems.setdefault(loc, str(e["ctx"]["error"]))
            else:
                problems.setdefault(loc, f"{e['msg'][0].lower()}{e['msg'][1:]}, got {e.get('input')!r:.80}")
        raise SweepError(
            f"{where}: invalid sweep spec: " + "; ".join(f"{k}: {v}" for k, v in problems.items())
        ) from None
    if checked:
        check_spec(spec, where)
    return spec


def check_spec(spec: SweepSpec, where: str) -> None:
    """Everything that can be checked before running: models, profiles, overrides, policies,
    routings, placements."""
    problems = check_serving_spec(spec) if spec.serving is not None else []
    layers: dict[str, int] = {}
    spelled: dict[ModelSpec, str] = {}  # a model as resolved, nameless -> the first name that gave it
    for m in spec.models:
        try:
            model = get_model(m)
        except ValueError as err:
            problems.append(str(err))
            continue
        layers[m] = model.num_layers
        same = spelled.setdefault(replace(model, name=""), m)
        if same != m:  # (`mixtral-8x7b:32` is `mixtral-8x7b`: every configuration would run twice)
            problems.append(f"models: {m!r} is {same!r} again under another name")
    try:
        load_policy_files(spec.policy_files)
    except KlotskiError as err:
        problems.append(str(err))
    for r in spec.resident_layers:
        if r in ("auto", "fill"):
            continue
        if not isinstance(r, int) or isinstance(r, bool) or r < 0:
            problems.append(f"resident_layers: {r!r} is neither auto, fill nor a layer count >= 0")
            continue
        problems += [f"resident_layers: {r} is more than {m}'s {n} layers" for m, n in layers.items() if r > n]
    for p in spec.policies if spec.serving is None else ():
        for key, values in spec.options.items():
            for value in values:
                if p in POLICIES:
                    try:
                        resolve_options(p, spec.impls[0], {key: value})
                    except KlotskiError as err:
                        problems.append(f"options.{key}: {err}")
        if p not in POLICIES:
            problems.append(f"unknown policy {p!r}; known: {', '.join(POLICIES)}")
    profiles: dict[str, str] = {}  # a profile's contents -> the first entry that gave them
    for h in spec.hardware:
        try:
            profile = load_profile(h)
        except ProfileError as err:
            problems.append(str(err))
            continue
        same = profiles.setdefault(json.dumps(profile.model_dump(mode="json"), sort_keys=True), h)
        if same != h:  # (a copy of a profile's file, or its path and its name: every configuration twice)
            problems.append(f"hardware: {h!r} is the profile {same!r} again")
        for field, values in spec.overrides.items():
            for v in values:
                try:
                    with_overrides(profile, {field: v}, where=f"override {field}={v!r}")
                except ProfileError as err:
                    problems.append(str(err))
    routed = (
        get_model(spec.models[0]) if not problems and spec.serving is None else None
    )  # the model synthetic routings are drawn for
    drawn: dict[Any, str] = {}  # a synthetic routing's parameters -> the first entry that gave them
    traces: dict[str, str] = {}  # a trace file's real path -> the first entry that named it
    for r in spec.routings:
        if r.startswith("trace:"):
            same = traces.setdefault(os.path.realpath(r[6:]), r)
            if same != r:  # (`trace:t.npz` and `trace:../w/t.npz`: else one configuration kept of two, silently)
                problems.append(f"routings: {r!r} is the trace {same!r} again")
                continue
            try:  # (else a folder or a file of another kind is a failed row of every configuration)
                check_npz(r[6:], "routing trace", SweepError)
                trace = Trace.load(r[6:])
                for m in spec.models:  # (a trace of another shape, too: else an error row each, the sweep exit 0)
                    trace.check_model(get_model(m), f"routing {r!r}")
            except FileNotFoundError:
                problems.append(f"routing {r!r}: no such trace file")
            except KlotskiError as err:
                problems.append(str(err) if str(err).startswith(f"routing {r!r}") else f"routing {r!r}: {err}")
            except NPZ_READ_ERRORS as err:
                problems.append(f"routing {r!r}: not a routing trace ({err})")
        elif routed is not None:
            try:
                same = drawn.setdefault(repr(params_for(r, routed)), r)
            except ValueError as err:  # (said of the spec's field, not the flag the CLI has for it)
                problems.append("routings: " + str(err).removeprefix("--routing "))
                continue
            if same != r:  # (zipf:1 and zipf:1.0: every configuration twice)
                problems.append(f"routings: {r!r} is the routing {same!r} again")
    if len(spec.seeds) > 1 and all(r.startswith("trace:") for r in spec.routings):
        problems.append(
            f"seeds: {spec.seeds} draw synthetic routing, and every routing is a trace, which replays its "
            f"own: each configuration would run {len(spec.seeds)} times (give one seed)"
        )
    for kv in spec.kv:
        if kv not in ("auto", "gpu", "cpu"):
            problems.append(f"kv {kv!r} is not auto, gpu or cpu")
    for ex in spec.experts:
        if ex not in ("auto", "cpu", "disk"):
            problems.append(f"experts {ex!r} is not auto, cpu or disk")
    for impl in spec.impls:
        if impl not in PRESET_NAMES:
            problems.append(f"impls: {impl!r} is not one of {', '.join(PRESET_NAMES)}")
    if problems:
        raise SweepError(f"{where}: " + "; ".join(dict.fromkeys(problems)))


def grid_size(spec: SweepSpec) -> int:
    """How many configurations the grid holds (without building them)."""
    size = 1
    if spec.serving is not None:
        serving_axes: list[list[Any]] = [spec.models, spec.hardware, spec.policies, spec.prompt_lens, spec.seeds]
        for axis in (*serving_axes, *spec.serving.axes(), *spec.overrides.values(), *spec.options.values()):
            size *= len(axis)
        return size
    axes: tuple[list[Any], ...] = (
        spec.models,
        spec.hardware,
        spec.policies,
        spec.batch_sizes,
        spec.num_batches,
        spec.prompt_lens,
        spec.gen_lens,
        spec.routings,
        spec.seeds,
        spec.kv,
        spec.experts,
        spec.impls,
        spec.resident_layers,
        spec.gpus,
        *spec.overrides.values(),
        *spec.options.values(),
    )
    for axis in axes:
        size *= len(axis)
    return size


def expand(spec: SweepSpec) -> list[dict[str, Any]]:
    """Every configuration of the grid, each with a stable id (a hash of its inputs)."""
    if spec.serving is not None:
        served = serving_configs(spec)
        for cfg in served:
            cfg["id"] = config_id(_identity(cfg))
        return served
    fields = list(spec.overrides)
    configs = []
    option_keys = list(spec.options)
    for (
        model,
        hardware,
        policy,
        bs,
        n,
        p,
        g,
        routing,
        seed,
        kv,
        experts,
        impl,
        resident,
        gpus,
        *values,
    ) in itertools.product(
        spec.models,
        spec.hardware,
        spec.policies,
        spec.batch_sizes,
        spec.num_batches,
        spec.prompt_lens,
        spec.gen_lens,
        spec.routings,
        spec.seeds,
        spec.kv,
        spec.experts,
        spec.impls,
        spec.resident_layers,
        spec.gpus,
        *(spec.overrides[f] for f in fields),
        *(spec.options[k] for k in option_keys),
    ):
        cfg = {
            "model": model,
            "hardware": hardware,
            "policy": policy,
            "batch_size": bs,
            "num_batches": n,
            "prompt_len": p,
            "gen_len": g,
            "routing": routing,
            "seed": seed,
            "kv": kv,
            "experts": experts,
            "impl": impl,
            "overrides": dict(zip(fields, values[: len(fields)])),
        }
        if option_keys:  # only when swept: rows of grids without them keep their shape
            cfg["options"] = dict(zip(option_keys, values[len(fields) :]))
        if resident != "auto":
            cfg["resident_layers"] = resident
        if gpus != 1:  # (as resident_layers: one GPU's configurations keep the ids and rows they had)
            cfg["gpus"] = gpus
        if spec.policy_files:  # the files' contents are part of the configuration (an edit is a new result)
            cfg["policy_files"] = {f: content_hash(f) for f in spec.policy_files}
        cfg["id"] = config_id(_identity(cfg))
        configs.append(cfg)
    return configs


@lru_cache(maxsize=256)
def _file_hash(path: str, size: int, mtime_ns: int) -> str:
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha1").hexdigest()[:12]


def content_hash(path: str) -> str:
    """A file's contents as a short hash (read once per version of the file); a file that cannot
    be read is named by its path, for its run to report."""
    try:
        stat = os.stat(path)
        return _file_hash(os.path.realpath(path), stat.st_size, stat.st_mtime_ns)
    except OSError:
        return f"unreadable:{path}"


def _identity(cfg: dict[str, Any]) -> dict[str, Any]:
    """What a configuration's id is made of: its files (a hardware YAML, a `trace:` routing, policy
    files) by their contents, not their paths: an edited profile or trace reruns (its rows are not
    reused under the old numbers), and the same spec started from another folder, its paths spelt
    otherwise, reruns nothing."""
    identity = dict(cfg)
    if cfg["hardware"] not in builtin_profile_names():
        identity["hardware"] = "file:" + content_hash(cfg["hardware"])
    if cfg.get("routing", "").startswith("trace:"):
        identity["routing"] = "trace:" + content_hash(cfg["routing"][len("trace:") :])
    config = preset_name(cfg["model"])
    if is_config_path(config):  # (a Hugging Face config.json: by its contents, its suffixes kept)
        identity["model"] = "file:" + content_hash(config) + cfg["model"][len(config) :]
    if "policy_files" in cfg:
        identity["policy_files"] = sorted(cfg["policy_files"].values())
    return identity


@lru_cache(maxsize=1)
def code_fingerprint() -> str:
    """A hash of the simulator's own code and data: a result computed by other code is not a
    result of this configuration (rows of older code are kept on disk but never reused)."""
    root = resources.files("klotski_sim")
    h = hashlib.sha1()
    for path in sorted(_files(root), key=str):
        h.update(str(path.relative_to(root) if hasattr(path, "relative_to") else path).encode())
        h.update(path.read_bytes())
    return h.hexdigest()[:12]


def _files(folder: Any) -> list[Any]:
    out = []
    for entry in folder.iterdir():
        if entry.is_dir() and entry.name != "__pycache__":
            out.extend(_files(entry))
        elif entry.name.endswith((".py", ".yaml", ".json")):
            out.append(entry)
    return out


def config_id(cfg: dict[str, Any]) -> str:
    """Stable id of a configuration under this code (inputs + code fingerprint)."""
    canonical = json.dumps({k: v for k, v in cfg.items() if k != "id"}, sort_keys=True, default=str)
    return hashlib.sha1((canonical + code_fingerprint()).encode()).hexdigest()[:16]


@lru_cache(maxsize=1)
def _process_reuse() -> Any:
    """The schedule a what-if over hardware numbers shares between configurations: one per process
    that runs configurations (a worker, or the sweep's own process), each running its share in grid
    order. Made on first use: the runner is imported only where configurations run."""
    from klotski_sim.runs.runner import ScheduleReuse

    return ScheduleReuse()


def run_config(cfg: dict[str, Any]) -> dict[str, Any]:
    """Simulate one configuration; never raises — a failure is a row with status `refused` (host
    memory or disk), `too-large` (this machine's memory) or `error`."""
    from klotski_sim.runs.runner import RunSpec, run

    t = time.perf_counter()
    row = _row_of(cfg)
    if cfg.get("kind") == "serving":
        try:
            run_serving_config(cfg, row)
        except MachineRefusal as err:
            row["status"], row["error"] = "too-large", str(err)
        except Exception as err:  # noqa: BLE001 - recorded, the sweep goes on
            row["status"], row["error"] = "error", f"{type(err).__name__}: {err}"
            row["traceback"] = traceback.format_exc(limit=3)
        row["wall_s"] = time.perf_counter() - t
        return jsonable(row)
    try:
        load_policy_files(cfg.get("policy_files", {}))  # a worker process imports them itself
        routing = cfg["routing"]
        spec = RunSpec(
            model=cfg["model"],
            hardware=cfg["hardware"],
            policy=cfg["policy"],
            batch_size=cfg["batch_size"],
            num_batches=None if cfg["num_batches"] == "auto" else int(cfg["num_batches"]),
            prompt_len=cfg["prompt_len"],
            gen_len=cfg["gen_len"],
            seed=cfg["seed"],
            routing="calibrated" if routing.startswith("trace:") else routing,
            trace=routing[6:] if routing.startswith("trace:") else None,
            kv=cfg["kv"],
            experts=cfg["experts"],
            overrides=cfg["overrides"],
            impl=cfg.get("impl", "as-published"),
            options=cfg.get("options", {}),
            resident_layers=cfg.get("resident_layers"),
            gpus=cfg.get("gpus", 1),
        )
        result = run(spec, reuse=_process_reuse())  # a what-if over hardware numbers builds each schedule once
        s = result.timeline.summary()
        metrics = {
            k: v
            for k, v in s.to_dict().items()
            if k
            not in (
                "policy",
                "model",
                "hardware",
                "batch_size",
                "prompt_len",
                "gen_len",
                "extra",
                "utilization",
                "bubble_by_cause",
                "oom",
                "impl",
            )
        }
        row.update({f"m.{k}": v for k, v in metrics.items()})
        row["m.n"] = s.num_batches
        row["m.kv"] = result.timeline.meta.get("placement", {}).get("kv")
        row["m.utilization_gpu"] = s.utilization.get("gpu", 0.0)
        row["m.utilization_pcie_h2d"] = s.utilization.get("pcie_h2d", 0.0)
        pf = s.extra.get("prefetch") or {}
        row["m.hot_precision"] = pf.get("precision")
        row["m.hot_identification"] = pf.get("hot_identification")
        row["status"] = s.status
        row["error"] = "" if s.status == "ok" else json.dumps(s.oom)
    except (StorageRefusal, MissingCapability) as err:  # (the configuration, not the simulator: no traceback)
        row["status"] = "refused"
        row["error"] = spec_field_message(str(err))
    except MachineRefusal as err:  # (this machine's memory, not the simulated one's)
        row["status"] = "too-large"
        row["error"] = str(err)
    except Exception as err:  # noqa: BLE001 - recorded, the sweep goes on
        row["status"] = "error"
        row["error"] = f"{type(err).__name__}: {err}"
        row["traceback"] = traceback.format_exc(limit=3)
    row["wall_s"] = time.perf_counter() - t
    return jsonable(row)


def spec_field_message(text: str) -> str:
    """A refusal as a sweep's user reads it: a group's refusal names the spec's `gpus:` field, which
    the command line's `--gpus` flag is to a single run."""
    return "gpus: " + text.removeprefix("--gpus ") if text.startswith("--gpus ") else text


def _row_of(cfg: dict[str, Any]) -> dict[str, Any]:
    """A configuration's row before its run: its id, the code's, and its inputs."""
    row: dict[str, Any] = {
        "id": cfg["id"],
        "code": code_fingerprint(),
        **{k: v for k, v in cfg.items() if k not in ("id", "overrides", "policy_files", "options")},
        **{f"set.{k}": v for k, v in cfg["overrides"].items()},
        **{f"opt.{k}": v for k, v in cfg.get("options", {}).items()},
    }
    if "num_batches" in cfg:
        row["num_batches"] = str(cfg["num_batches"])
    return row


def killed_row(cfg: dict[str, Any], how: str) -> dict[str, Any]:
    """The row of a configuration whose worker process died running it (`how`: on its own, or on
    every Dask worker it was given), status `killed`: the kernel's OOM killer or a `kill -9`
    leaves no error to record."""
    return jsonable(
        {
            **_row_of(cfg),
            "status": "killed",
            "wall_s": 0.0,
            "error": f"its worker process died running it {how} (killed, or out of host memory?)",
        }
    )


def write_row(rows_dir: Path, row: dict[str, Any]) -> None:
    """Atomically: a reader sees the whole row or none of it."""
    write_file(rows_dir / f"{row['id']}.json", lambda temporary: temporary.write_text(json.dumps(row)))


ROW_STATUSES = ("ok", "oom", "refused", "too-large", "error", "killed")
# a row's metrics that are text (the summary's text fields, and the KV cache's place); the others are numbers
_TEXT_METRICS = frozenset({f"m.{f.name}" for f in fields(Summary) if f.type == "str"} | {"m.kv"})


def read_row(path: Path) -> dict[str, Any] | None:
    """A finished row, or None when the file is not one (damaged, edited by hand, or not ours): its
    configuration is then run again, not taken as done. A row of valid JSON whose status is none of
    ours, or whose metric is text where a number belongs (`"m.throughput_tok_s": "fast"`), would go
    into results.parquet as it is, making the column text and every reader of it fail or rank wrongly."""
    try:
        row = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):  # (ValueError: not JSON, or not UTF-8 text)
        return None
    if not isinstance(row, dict) or row.get("id") != path.stem or row.get("status") not in ROW_STATUSES:
        return None
    if not _number(row.get("wall_s")) or not row["wall_s"] >= 0 or not isinstance(row.get("error", ""), str):
        return None
    for key, value in row.items():
        if (
            key.startswith("m.")
            and value is not None
            and not (isinstance(value, str) if key in _TEXT_METRICS else _number(value))
        ):
            return None
    return row


def _number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def finished_ids(rows_dir: Path) -> set[str]:
    """The ids a rerun skips: every row's but a `too-large` or `killed` one's (the machine running
    klotski could not hold that run, or something ended its worker: a rerun, perhaps on a larger
    machine, tries it again)."""
    return {
        p.stem
        for p in rows_dir.glob("*.json")
        if (row := read_row(p)) is not None and row.get("status") not in ("too-large", "killed")
    }


def collect(out_dir: str | Path, ids: Iterable[str] | None = None) -> pd.DataFrame:
    """Finished rows (those in `ids`, when given: the current grid under the current code) as a
    DataFrame sorted by id, also written atomically to results.parquet."""
    out = Path(out_dir)
    wanted = set(ids) if ids is not None else None
    rows = []
    for p in sorted((out / "rows").glob("*.json")):
        if wanted is not None and p.stem not in wanted:
            continue
        row = read_row(p)
        if row is not None:  # (a damaged row's configuration was run again: its file is rewritten)
            rows.append(row)
    df = pd.DataFrame(rows)
    if "gpus" in df:  # (a grid over group sizes: its one-GPU rows leave the key out, to keep their ids)
        df["gpus"] = df["gpus"].fillna(1).astype(int)
    if len(df):
        df = df.sort_values("id").reset_index(drop=True)
        for col in df.columns:  # mixed-type columns (e.g. num_batches) as text for Parquet
            if df[col].dtype == object:
                df[col] = df[col].map(lambda v: v if v is None or isinstance(v, str) else json.dumps(v))
    write_file(out / "results.parquet", lambda temporary: df.to_parquet(temporary, index=False))
    return df


def run_sweep(
    spec: SweepSpec,
    out_dir: str | Path,
    workers: int = 1,
    dask: str | None = None,
    progress: bool = True,
    on_row: Callable[[dict[str, Any]], None] | None = None,
    only: Iterable[str] | None = None,
    on_start: Callable[[int, int, int], None] | None = None,
) -> pd.DataFrame:
    """Run every configuration not finished yet (of those whose ids are in `only`, when given);
    returns their rows. `on_start` hears, before any runs, how many of how many are finished
    already (a resumed sweep) and how many rows in the folder are of other code or grids. One
    sweep at a time writes to an output folder (a lock file says which process): a second one is
    refused, not interleaved."""
    out = Path(out_dir)
    rows_dir = out / "rows"
    if dask and dask != "local":  # (before the folder is made: a bad address would leave it a lock, spec, no rows)
        _check_dask_address(dask)
    _check_sweep_folder(out)
    rows_dir.mkdir(parents=True, exist_ok=True)
    with _locked(out):
        return _run_sweep(
            spec, out, rows_dir, workers, dask, progress, on_row, None if only is None else set(only), on_start
        )


def _check_sweep_folder(out: Path) -> None:
    """What a sweep writes in `out` must be what it can write: a folder, a file or a row where the
    other is (a damaged or foreign folder) would end a resumed sweep in a raw `[Errno 21] Is a
    directory`, perhaps after a configuration has run; a FIFO where a file goes (its spec, lock or a
    row) would hang it forever, opened for reading or writing with no process at the other end."""
    expected = [
        (out / "rows", True, "its rows folder"),
        (out / ".lock", False, "its lock file"),
        (out / "spec.yaml", False, "its spec file"),
        (out / "results.parquet", False, "its results file"),
    ]
    if (out / "rows").is_dir():
        expected += [(row, False, "a finished row's file") for row in (out / "rows").glob("*.json")]
    for path, folder, what in expected:
        if path.is_symlink() and not folder and path.name != ".lock":  # (the lock: never through a link at all)
            refuse_link(path, f"{path} ({what})")
        if path.exists() and not (path.is_dir() if folder else path.is_file()):
            found = "not a folder" if folder else "a folder" if path.is_dir() else "not a regular file (a FIFO?)"
            raise SweepError(
                f"{path}: is {found}, but the sweep keeps {what} there: not a sweep folder as this "
                f"command writes it (move it away, or give another --out)"
            )


class _locked:
    """An exclusive lock on `out/.lock` for the duration of a sweep."""

    def __init__(self, out: Path) -> None:
        self.path = out / ".lock"

    def __enter__(self) -> None:
        # (never through a link planted as `.lock`: its target would be truncated to our pid)
        try:
            descriptor = os.open(self.path, os.O_RDWR | os.O_CREAT | getattr(os, "O_NOFOLLOW", 0), 0o644)
        except OSError as err:
            raise SweepError(
                f"{self.path}: cannot open the sweep's lock file "
                f"({'it is a symbolic link' if self.path.is_symlink() else err.strerror or err})"
            ) from None
        self.file = os.fdopen(descriptor, "a+")
        try:
            fcntl.flock(self.file, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            self.file.seek(0)
            holder = self.file.read().strip() or "another process"
            self.file.close()
            raise SweepError(
                f"{self.path.parent}: another sweep is writing there ({holder}); wait for it or use another --out"
            ) from None
        self.file.seek(0)
        self.file.truncate()
        self.file.write(f"pid {os.getpid()}")
        self.file.flush()

    def __exit__(self, *exc: object) -> None:
        fcntl.flock(self.file, fcntl.LOCK_UN)
        self.file.close()


def _run_sweep(
    spec: SweepSpec,
    out: Path,
    rows_dir: Path,
    workers: int,
    dask: str | None,
    progress: bool,
    on_row: Callable[[dict[str, Any]], None] | None,
    only: set[str] | None = None,
    on_start: Callable[[int, int, int], None] | None = None,
) -> pd.DataFrame:
    write_file(
        out / "spec.yaml", lambda temporary: temporary.write_text(yaml.safe_dump(spec.model_dump(), sort_keys=False))
    )
    configs = [c for c in expand(spec) if only is None or c["id"] in only]
    done = finished_ids(rows_dir)
    todo = [c for c in configs if c["id"] not in done]
    if on_start:
        on_start(len(configs) - len(todo), len(configs), len(done - {c["id"] for c in configs}))

    def finished(row: dict[str, Any]) -> None:
        write_row(rows_dir, row)
        if on_row:
            on_row(row)

    in_flight = min(max(1, workers), len(todo))  # (the runs in flight at once: a local pool's or a local cluster's)
    with _progress(progress, len(configs), len(configs) - len(todo), spec.name) as advance:
        if not todo:  # (all finished already: no cluster or pool to start)
            pass
        elif dask:
            _run_dask(todo, dask, in_flight, finished, advance)
        elif workers <= 1:
            for cfg in todo:
                finished(run_config(cfg))
                advance()
        else:
            _run_pool(todo, in_flight, finished, advance)
    return collect(out, [c["id"] for c in configs])


def _run_pool(todo: list[dict[str, Any]], in_flight: int, finished: Callable, advance: Callable) -> None:
    """On a local pool of `in_flight` processes (no more than there are runs). A worker that dies
    (the kernel's OOM killer, a `kill -9`) breaks the whole pool and the runs in flight with it;
    then the first `in_flight + 1` configurations not finished (those that
    were running, and the one queued next) are run one at a time, each on a worker of its own: one
    that kills that worker too is a row of status `killed`. Then a new pool takes the rest."""
    from klotski_sim.runs.runner import WorkerDied, pool_worker, worker_pool

    left = list(todo)
    while left:
        done: set[str] = set()
        try:
            with worker_pool(in_flight, pool_worker, (in_flight,)) as pool:
                futures = {pool.submit(run_config, cfg): cfg["id"] for cfg in left}
                for fut in as_completed(futures):
                    finished(fut.result())
                    done.add(futures[fut])
                    advance()
            return
        except WorkerDied:
            left = [cfg for cfg in left if cfg["id"] not in done]
        for cfg in left[: in_flight + 1]:  # (in submission order: a pool hands its runs out in it)
            try:
                with worker_pool(1, pool_worker, (1,)) as alone:
                    row = alone.submit(run_config, cfg).result()
            except WorkerDied:
                row = killed_row(cfg, "on its own")
            finished(row)
            advance()
        left = left[in_flight + 1 :]


def _run_dask(todo: list[dict[str, Any]], address: str, in_flight: int, finished: Callable, advance: Callable) -> None:
    """On a Dask cluster; the scheduler gives a run whose worker died to another worker, and a
    configuration that ended every worker it was given (four) is a row of status `killed`."""
    try:
        from dask.distributed import KilledWorker
        from dask.distributed import as_completed as dask_completed
        from distributed.scheduler import NoValidWorkerError
    except ImportError:
        raise SweepError("--dask needs dask.distributed: pip install 'klotski[dask]'") from None
    no_worker = f"no Dask worker was left to run it for {NO_WORKERS_TIMEOUT_S} s (its workers died and none restarted)"
    with _dask_client(address, in_flight) as client:
        with signals_deferred():  # (a stop raised inside distributed's `sync` makes it log a NameError
            futures = client.map(run_config, todo, pure=False)  # of its own and a failed gather)
        config_of = {fut.key: cfg for fut, cfg in zip(futures, todo)}
        left = {fut.key: fut for fut in futures}
        completed = dask_completed(futures)
        watch = _NoWorkerWatch(client) if address == "local" else None  # (a cluster of the user's: its own timeouts)
        while left:
            batch = completed.next_batch(block=False)
            if not batch:
                if watch is not None and watch.gone_for() > NO_WORKERS_TIMEOUT_S:  # (the scheduler's did not fire)
                    for key, fut in left.items():
                        fut.cancel()
                        finished(killed_row(config_of[key], no_worker))
                        advance()
                    return
                time.sleep(DASK_POLL_S)
                continue
            for fut in batch:
                del left[fut.key]
                try:
                    with signals_deferred():
                        row = fut.result()
                except KilledWorker:
                    row = killed_row(config_of[fut.key], "on every Dask worker it was given")
                except NoValidWorkerError:
                    row = killed_row(config_of[fut.key], no_worker)
                finished(row)
                advance()


class _NoWorkerWatch:
    """How long the cluster has had no worker, asked of the scheduler at most every few seconds. The
    scheduler fails the runs left after NO_WORKERS_TIMEOUT_S without a worker (a local cluster is
    set so), but a local sweep under load still waited forever once: its nannies had closed, no
    worker process was left, and no run ever failed. The client then gives up on them itself."""

    def __init__(self, client: Any) -> None:
        self.client = client
        self.since: float | None = None
        self.asked = -math.inf

    def gone_for(self) -> float:
        now = time.monotonic()
        if now - self.asked >= DASK_WATCH_S:
            self.asked = now
            try:
                with signals_deferred():
                    workers = self.client.scheduler_info(n_workers=-1).get("workers", {})
            except (OSError, TimeoutError):  # (a scheduler that does not answer: no worker it can give)
                workers = {}
            self.since = None if workers else (self.since or now)
        return 0.0 if self.since is None else now - self.since


@contextmanager
def _dask_client(address: str, in_flight: int) -> Iterator[Any]:
    """A client of the Dask scheduler at `address`, or of a local cluster of `in_flight` processes
    (`local`), closed whole however the block ends.

    - Set up and closed with the stops held back: a stop inside distributed's calls would leave a
      cluster half made, which its exit hook then fails to close, with a traceback.
    - A local cluster's processes start with the terminal's signals ignored, so that its Ctrl-C or
      hang-up, sent to the whole process group, is this process's alone.
    - A local cluster is silenced, this process's part of it (its scheduler and nannies) too, and
      left so after a stop: every failure reaches the user through a future (a run's error is its
      row, and so is a run that killed every worker it was given), and what it logs besides is
      noise — a stopped sweep's cancelled tasks (a WARNING each), workers missing the heartbeat of
      a scheduler that closed, a task given up after its fourth dead worker (ERRORs), and, after
      the cluster restores the log level on closing, a CommClosedError traceback once in a few
      stops.
    - Its HTTP server, which it always starts, listens on a free port of this host (the default
      8787 warns when it is taken)."""
    import dask
    from dask.distributed import Client, LocalCluster

    local = address == "local"  # (another address was checked by run_sweep, before the output folder was made)
    distributed_log = logging.getLogger("distributed")
    level, stopped = distributed_log.level, False
    env_level = os.environ.get(_DASK_LOG_LEVEL)
    if local:  # (the environment's level for its processes from their first import: else one the nanny
        distributed_log.setLevel(logging.CRITICAL)  # restarts after a death logs its start at INFO)
        os.environ[_DASK_LOG_LEVEL] = "critical"
    cluster = client = None
    try:
        with signals_deferred():
            if local:
                # A local cluster's nannies restart a worker a run killed, but under load a restart
                # can time out, and the nanny then closes: with no worker left, the runs still to
                # do would wait forever. The scheduler (in this process) fails them instead.
                with (
                    terminal_signals_ignored(),
                    dask.config.set({"distributed.scheduler.no-workers-timeout": f"{NO_WORKERS_TIMEOUT_S}s"}),
                ):
                    cluster = LocalCluster(
                        n_workers=in_flight,
                        threads_per_worker=1,
                        processes=True,
                        dashboard_address="127.0.0.1:0",
                        silence_logs=logging.CRITICAL,
                    )
            try:
                client = Client(cluster or address, timeout=DASK_TIMEOUT_S)
            except (OSError, TimeoutError, ValueError) as err:
                raise SweepError(
                    f"--dask {address}: no Dask scheduler answered within {DASK_TIMEOUT_S} s "
                    f"({type(err).__name__}: {err})"
                ) from err
            if local:  # (its workers are this machine's processes: they share it as a local pool's do)
                from klotski_sim.runs.dask_worker import SharesTheMachine

                client.register_plugin(SharesTheMachine(in_flight))
        yield client
    except KeyboardInterrupt:
        stopped = True
        raise
    finally:
        with signals_deferred():
            if client is not None:
                client.close()
            if cluster is not None:
                cluster.close()
            if local and not stopped:
                distributed_log.setLevel(level)
            if local:
                if env_level is None:
                    os.environ.pop(_DASK_LOG_LEVEL, None)
                else:
                    os.environ[_DASK_LOG_LEVEL] = env_level


_DASK_LOG_LEVEL = "DASK_LOGGING__DISTRIBUTED"  # (dask's configuration from the environment: logging.distributed)


DASK_TIMEOUT_S = 10
NO_WORKERS_TIMEOUT_S = 60  # a local cluster's runs fail when it has had no worker for this long
DASK_POLL_S, DASK_WATCH_S = 0.1, 5.0  # how often finished runs are collected, and workers counted


def _check_dask_address(address: str) -> None:
    """Before handing an address to Dask's client, see what answers there. A Dask scheduler speaks
    first: an 8-byte little-endian message length, then its handshake. Anything else — silence (an
    HTTP server waits for its client), a banner, an absurd length — is refused with what answered:
    the client would read such bytes as a length and try to allocate it."""
    import socket
    from urllib.parse import urlparse

    try:  # (a port out of range or not a number, a broken IPv6 bracket: urllib's ValueError)
        parsed = urlparse(address if "://" in address else f"tcp://{address}")
        usable = parsed.scheme == "tcp" and parsed.hostname and parsed.port
    except ValueError:
        usable = False
    if not usable:
        raise SweepError(f"--dask {address!r}: give a scheduler address like tcp://HOST:8786, or 'local'")
    try:
        with socket.create_connection((parsed.hostname, parsed.port), timeout=DASK_TIMEOUT_S) as sock:
            sock.settimeout(3.0)
            try:
                greeting = sock.recv(64)
            except OSError:
                greeting = b""
    except OSError as err:
        raise SweepError(f"--dask {address}: cannot connect ({err})") from err
    if len(greeting) < 8:
        raise SweepError(
            f"--dask {address}: the service there did not greet as a Dask scheduler does "
            f"(it sent {greeting[:40]!r} in 3 s)"
        )
    length = int.from_bytes(greeting[:8], "little")
    if not 0 < length < 1 << 20:
        raise SweepError(f"--dask {address}: not a Dask scheduler; it answered {greeting[:40]!r}")


class _progress:
    """A sweep's progress as a context manager yielding `advance()`: a live rich bar where stderr is
    a terminal, plain lines (`progress.Progress`) where it is not — a log file, CI, a notebook, where
    the bar prints nothing until the end — and nothing when not `enabled`."""

    def __init__(self, enabled: bool, total: int, done: int, name: str) -> None:
        self.enabled, self.total, self.done, self.name = enabled, total, done, name
        self.bar: Any = None

    def __enter__(self) -> Callable[[], None]:
        if not self.enabled or self.done >= self.total:
            return lambda: None
        if not sys.stderr.isatty():
            lines = Progress(f"sweep {self.name}", self.total, done=self.done)
            return lambda: lines.done()
        from rich.progress import BarColumn, MofNCompleteColumn, TextColumn, TimeRemainingColumn
        from rich.progress import Progress as Bar

        self.bar = Bar(
            TextColumn("[bold]{task.description}"),
            BarColumn(),
            MofNCompleteColumn(),
            TimeRemainingColumn(),
            transient=False,
        )
        self.bar.start()
        task = self.bar.add_task(self.name, total=self.total, completed=self.done)
        return lambda: self.bar.advance(task)

    def __exit__(self, *exc: object) -> None:
        if self.bar is not None:
            self.bar.stop()


def summarize(df: pd.DataFrame, swept: Iterable[str] = ("policy",)) -> str:
    """The table a sweep prints: the swept columns first (sorted by the grid), then the headline
    metrics."""
    keys = [c for c in dict.fromkeys(["policy", *swept]) if c in df.columns]
    metrics = [
        c
        for c in (
            "status",
            "m.num_batches",
            "m.throughput_tok_s",
            "m.ttft_mean_s",
            "m.tpot_mean_s",
            "m.mean_active",
            "m.decode_throughput_tok_s",
            "m.bubble_s",
            "m.efficiency",
        )
        if c in df.columns
    ]
    if not len(df):
        return "(no rows)"
    table = df[keys + metrics].sort_values(keys, kind="stable") if keys else df[metrics]
    with pd.option_context("display.width", 200, "display.max_rows", 60, "display.float_format", "{:.3f}".format):
        return table.to_string(index=False)
