"""HardwareProfile: a GPU, its links and the host behind it, loaded from validated YAML.

Profiles are where what-if questions start ("what if PCIe gen5?"), so every number is checked
on load: a missing, negative or misspelled field is an error that names the file and the field.
Pydantic does the checking; the models are frozen so a profile can be shared between runs.
"""

from __future__ import annotations

import difflib
import math
import re
from functools import lru_cache
from importlib import resources
from pathlib import Path
from types import UnionType
from typing import Annotated, Any, Literal, Union, get_args, get_origin

import yaml
from pydantic import AfterValidator, BaseModel, BeforeValidator, ConfigDict, Field, ValidationError, model_validator

from klotski_sim.files.textfile import read_text
from klotski_sim.files.yamlfile import MAX_BYTES as MAX_YAML_BYTES
from klotski_sim.files.yamlfile import load_yaml
from klotski_sim.names import COMPUTE_CATEGORIES
from klotski_sim.util.argtypes import MAX_COUNT
from klotski_sim.util.errors import KlotskiError, MissingCapability, UsageError


def _a_number(value: Any) -> Any:
    """A number field refuses true/false (which would be read as 1 and 0: `--set
    links.pcie_h2d.bandwidth=true` would be a 1 B/s link) and NaN or infinity (said so before any bound
    is checked against it); numbers written as text (`25e9`, which YAML reads as a string) are
    still converted."""
    if isinstance(value, bool):
        raise ValueError(f"expected a number, got {str(value).lower()}")
    if isinstance(value, float) and not math.isfinite(value):
        raise ValueError(f"expected a finite number, got {value}")
    if isinstance(value, str):  # (else `--set ...bandwidth=nan` is said to be below the field's bound)
        try:
            number = float(value)
        except ValueError:
            return value  # (pydantic says it is no number)
        if not math.isfinite(number):
            raise ValueError(f"expected a finite number, got {value}")
        # (as the number: `cores: 2.4e1`, text to YAML 1.1, is 24 as `--set cpu.cores=2.4e1` is; a whole
        # number written so is an integer field's, a fraction is not)
        return int(number) if number.is_integer() and abs(number) < 2**53 else number
    return value


_Number = BeforeValidator(_a_number)
Positive = Annotated[float, _Number, Field(gt=0, allow_inf_nan=False)]  # finite: an infinite bandwidth is no what-if
NonNegative = Annotated[float, _Number, Field(ge=0, allow_inf_nan=False)]
# A rate (bytes/s, FLOP/s) below a million per second, or a fixed per-op cost (launch, dispatch,
# signal, sync, link latency: microseconds on every machine) above a second, is a unit slip, not a
# what-if (`bandwidth: 25.7`, GB/s meant, is a link a billion times too slow), and rates below one
# per second make ops of 1e300 s whose sums overflow into inf and NaN in every output. The slowest
# device a profile could describe (a USB 2 disk, ~30 MB/s; a CPU core's 1e9 FLOP/s) is far above it.
RATE_FLOOR = 1e6


def _a_rate(value: float) -> float:
    if value < RATE_FLOOR:
        raise ValueError(
            f"{value:g} per second is below {RATE_FLOOR:g}: a unit slip? rates are in bytes or FLOPs "
            f"per second (25.7 GB/s is 25.7e9)"
        )
    return value


Rate = Annotated[float, _Number, Field(allow_inf_nan=False), AfterValidator(_a_rate)]
PerOpSeconds = Annotated[float, _Number, Field(ge=0, le=1, allow_inf_nan=False)]
Fraction = Annotated[float, _Number, Field(gt=0, le=1, allow_inf_nan=False)]


# More copy engines than any GPU has (an H100 has 7 DMA engines per direction at most, CUDA's
# asyncEngineCount reports 2-5): an absurd count would run every transfer at once.
MAX_COPY_ENGINES = 64
# A measured op of more than an hour is a unit slip; calibrate's
# tables are of single kernels, milliseconds to seconds.
MAX_MEASURED_S = 3600.0
# A measured table's name: `[cpu:]category[.variant][:prefill|decode]` (cost.CostModel reads them so)
_MEASURED_KEY = re.compile(r"(cpu:)?[a-z][a-z0-9_]*(\.[a-z0-9_+]+)?(:(prefill|decode))?")


def _not_misspelt(field: str, category: str) -> None:
    """A category that is not a built-in op's but close to one (`expret`) is a slip: it would be
    read by no op, silently. One far from them all may be a policy file's own, and is kept."""
    if category not in COMPUTE_CATEGORIES:
        close = difflib.get_close_matches(category, COMPUTE_CATEGORIES, n=1, cutoff=0.8)
        if close:
            raise ValueError(f"{field}: {category!r} is no op category (did you mean {close[0]!r}?)")


class _Strict(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


class GPUSpec(_Strict):
    """The accelerator: capacity, roofline and how far real kernels stay from it."""

    name: str
    memory_bytes: Positive
    reserved_bytes: NonNegative = Field(0, description="CUDA context, allocator slack, workspace")
    peak_flops: Rate = Field(description="dense bf16 FLOP/s")
    memory_bandwidth: Rate = Field(description="HBM/GDDR bytes/s")
    compute_efficiency: Fraction = Field(description="share of peak FLOP/s real GEMMs reach")
    memory_efficiency: Fraction = Field(description="share of memory bandwidth real kernels reach")
    kernel_overhead_s: PerOpSeconds = Field(description="launch + framework dispatch per kernel")
    dispatch_overhead_s: PerOpSeconds = Field(
        0.0, description="fixed host cost of issuing one compute op in the runtime, beyond its kernels"
    )
    dispatch_overhead_by_category: dict[str, PerOpSeconds] = Field(
        default_factory=dict, description="the same per op category, where measured (overrides the above)"
    )
    dependency_latency_s: PerOpSeconds = Field(
        0.0,
        description="delay before an op may start after a dependency on another stream ends "
        "(event signalling; a host thread hand-off in the CPU runtime)",
    )
    host_sync_latency_s: PerOpSeconds = Field(
        0.0,
        description="from the end of the GPU work a host synchronisation waits for to the moment "
        "the host thread runs again (cudaStreamSynchronize / .tolist() round trip)",
    )
    decompress_bandwidth: Rate | None = Field(
        None,
        description="lossless expert decompression on the GPU, bytes/s of uncompressed output "
        "(FluxMoE's compressed tier; none: not measured for this GPU)",
    )
    issue: Literal["serial", "per-stream"] = Field(
        "serial",
        description="how GPU work is issued: `serial`, one host thread issues every stream's ops in "
        "program order (PyTorch eager, the CUDA runtime), so an op starts no earlier than the thread "
        "reaches it; `per-stream`, each stream issues its own (the CPU runtime's thread per stream, "
        "and klotski 0.1's model)",
    )
    copy_issue_s: PerOpSeconds | None = Field(
        None,
        description="host time the issuing thread spends on one copy (its event waits and the copy "
        "call); none: one eager op call, kernel_overhead_s",
    )

    @model_validator(mode="after")
    def _categories_known(self) -> "GPUSpec":
        for category in self.dispatch_overhead_by_category:
            _not_misspelt(f"dispatch_overhead_by_category.{category}", category)
        return self

    @model_validator(mode="after")
    def _reserved_fits(self) -> "GPUSpec":
        if self.reserved_bytes >= self.memory_bytes:
            raise ValueError(
                f"reserved_bytes ({self.reserved_bytes:.4g}) must be below memory_bytes ({self.memory_bytes:.4g})"
            )
        # the rates the roofline uses are the peaks times these shares: held to a Rate's bound too
        # (memory_efficiency 1e-300 would make a ~1e-288 B/s GPU)
        for rate, share in (("peak_flops", "compute_efficiency"), ("memory_bandwidth", "memory_efficiency")):
            if getattr(self, rate) * getattr(self, share) < RATE_FLOOR:
                raise ValueError(
                    f"{rate} x {share} ({getattr(self, rate):.4g} x {getattr(self, share):.4g}) is "
                    f"below {RATE_FLOOR:g} per second: a unit slip, not a what-if"
                )
        return self

    @property
    def usable_bytes(self) -> float:
        return self.memory_bytes - self.reserved_bytes


class LinkSpec(_Strict):
    """One direction of one link; `copy_engines` transfers may run on it at once. PCIe links
    carry both the pinned and the pageable (unpinned host memory) bandwidth of large copies."""

    bandwidth: Rate = Field(description="sustained bytes/s for large copies from/to pinned host memory")
    pageable_bandwidth: Rate | None = Field(
        None, description="sustained bytes/s for large copies from/to pageable (unpinned) host memory"
    )
    latency_s: PerOpSeconds = 0.0
    copy_engines: Annotated[int, _Number, Field(ge=1, le=MAX_COPY_ENGINES)] = 1


class LinksSpec(_Strict):
    pcie_h2d: LinkSpec
    pcie_d2h: LinkSpec
    nvme: LinkSpec = Field(description="disk -> host memory reads")

    @model_validator(mode="before")
    @classmethod
    def _moved_fields(cls, data: Any) -> Any:
        if isinstance(data, dict) and "pageable_h2d_bandwidth" in data:
            raise UsageError(
                "links.pageable_h2d_bandwidth has moved to links.pcie_h2d.pageable_bandwidth "
                "(and links.pcie_d2h.pageable_bandwidth for the other direction)"
            )
        return data


class FabricSpec(_Strict):
    """How the GPUs of one machine reach each other, for collectives (klotski_sim/core/collectives.py):
    the alpha-beta model NCCL's own tuner uses (src/graph/tuning.cc: a call's base latency, a latency
    per algorithm step, bytes over the bandwidth one GPU has to the others in each direction)."""

    kind: Literal["nvlink", "pcie"] = Field(description="NVLink (switch or bridge) or PCIe peer-to-peer")
    gpus: Annotated[int, _Number, Field(ge=1, le=1024)] = Field(description="GPUs in the machine")
    bandwidth: Rate = Field(description="bytes/s one GPU sends to the others at once (and receives), per direction")
    base_latency_s: PerOpSeconds = Field(description="fixed cost of one collective call")
    step_latency_s: PerOpSeconds = Field(description="cost of one algorithm step (one hop of a ring or tree)")


class HostSpec(_Strict):
    memory_bytes: Positive
    cpu: str = "unknown"


class CPUSpec(_Strict):
    """The host CPU as a compute device, for schedules that run cold experts (Fiddler, llama.cpp)
    or decode attention (MoE-Lightning) on it instead of moving weights over PCIe. Small-batch expert
    compute on a CPU is bound by how fast it streams the weights from DRAM, large-batch by its
    FLOP/s in the dtype it computes in — which depends on the ISA (AVX-512, AVX512-BF16, AMX)."""

    name: str
    cores: Annotated[int, _Number, Field(ge=1)]
    isa: list[str] = Field(
        default_factory=list,
        description="vector/matrix extensions, e.g. avx512, amx: a record "
        "of the machine (the cost model reads compute_dtype and "
        "flops, which the ISA decides, not this list)",
    )
    flops: dict[str, Rate] = Field(description="sustained FLOP/s of a multi-threaded GEMM, per compute dtype")
    compute_dtype: str = Field(description="the dtype expert weights are computed in on this CPU (a key of flops)")
    memory_bandwidth: Rate = Field(description="sustained DRAM read bytes/s of all cores (weights streamed once)")
    op_overhead_s: PerOpSeconds = Field(
        0.0, description="fixed cost of one CPU op: framework dispatch and waking the thread pool"
    )

    @model_validator(mode="after")
    def _dtype_has_flops(self) -> "CPUSpec":
        if self.compute_dtype not in self.flops:
            raise ValueError(
                f"compute_dtype {self.compute_dtype!r} has no entry in flops "
                f"(has: {', '.join(sorted(self.flops)) or 'none'})"
            )
        return self

    @property
    def flop_rate(self) -> float:
        return self.flops[self.compute_dtype]


class DiskSpec(_Strict):
    capacity_bytes: Positive


class MeasuredPoint(_Strict):
    """One measured op duration; `tokens` is the op's token count, `kv_len` its KV length."""

    tokens: Annotated[int, _Number, Field(ge=0, le=MAX_COUNT)]
    kv_len: Annotated[int, _Number, Field(ge=0, le=MAX_COUNT)] = 0
    seconds: Annotated[float, _Number, Field(gt=0, le=MAX_MEASURED_S, allow_inf_nan=False)]


def _a_printable_name(name: str) -> str:
    """A profile's name is printed in summaries, tables and error lines: a newline in it would split them."""
    if not name or any(ord(c) < 32 or ord(c) == 127 for c in name):
        raise ValueError(
            f"{name!r}: give a non-empty name of printable characters (no newline or other control character)"
        )
    return name


class HardwareProfile(_Strict):
    """Everything the cost model needs about one machine, with the sources of its numbers."""

    name: Annotated[str, AfterValidator(_a_printable_name)]
    description: str = ""
    gpu: GPUSpec
    links: LinksSpec
    host: HostSpec
    disk: DiskSpec
    cpu: CPUSpec | None = Field(None, description="the host CPU as a compute device (CPU-expert policies need it)")
    fabric: FabricSpec | None = Field(None, description="the GPU-to-GPU fabric of a machine with several GPUs")
    tensor_parallel: Annotated[int, _Number, Field(ge=2, le=1024)] | None = Field(
        None,
        description="GPUs that run every op together, each on its shard (parallel.tensor.group_machine makes such "
        "a profile: `gpu` and the PCIe links then describe the whole group); none: one GPU",
    )
    sources: dict[str, str] = Field(default_factory=dict, description="field -> where the number comes from")
    measured: dict[str, list[MeasuredPoint]] = Field(
        default_factory=dict, description="op category -> measured durations (from calibrate)"
    )
    provenance: dict[str, Any] = Field(default_factory=dict, description="who measured this, when, how")

    @model_validator(mode="before")
    @classmethod
    def _cpu_runtime_issues_per_stream(cls, data: Any) -> Any:
        """A profile calibrated on the CPU runtime before `gpu.issue` existed times a runtime whose
        streams are threads of their own: it issues per stream unless it says otherwise."""
        if isinstance(data, dict) and isinstance(data.get("provenance"), dict) and isinstance(data.get("gpu"), dict):
            if data["provenance"].get("device_kind") == "cpu" and "issue" not in data["gpu"]:
                data = {**data, "gpu": {**data["gpu"], "issue": "per-stream"}}
        return data

    @model_validator(mode="after")
    def _measured_tables(self) -> "HardwareProfile":
        """Refuse a table whose name is not of the form the cost model reads, or one shape measured
        twice with two durations (unknown fields elsewhere are refused too). A well-formed
        name of a category no built-in op has is kept: a policy file's own ops may read it."""
        for name, points in self.measured.items():
            if not _MEASURED_KEY.fullmatch(name):
                raise ValueError(
                    f"measured.{name}: not a table name the cost model reads "
                    f"([cpu:]category[.variant][:prefill|decode], e.g. expert, attention.fused:decode)"
                )
            category = re.split(r"[.:]", name.removeprefix("cpu:"))[0]
            _not_misspelt(f"measured.{name}", category)
            seen: dict[tuple[int, int], float] = {}
            for row, point in enumerate(points, start=1):
                # (a kv_len on an expert row would move it out of the rows the expert's ops are read from;
                # a decode attention at kv_len 0 reads no cache)
                if point.kv_len and category != "attention":
                    raise ValueError(
                        f"measured.{name}: row {row} gives kv_len {point.kv_len}, but {category} ops "
                        f"read no KV cache (only attention tables have a kv_len)"
                    )
                if not point.kv_len and category == "attention" and name.endswith(":decode"):
                    raise ValueError(
                        f"measured.{name}: row {row} has no kv_len: a decode step's attention reads "
                        f"the KV cache (give its length)"
                    )
                shape = (point.tokens, point.kv_len)
                if shape in seen and seen[shape] != point.seconds:
                    raise ValueError(
                        f"measured.{name}: tokens {shape[0]}, kv_len {shape[1]} measured twice, "
                        f"{seen[shape]:.4g} s and {point.seconds:.4g} s"
                    )
                seen[shape] = point.seconds
        return self

    @model_validator(mode="after")
    def _group_on_a_fabric(self) -> "HardwareProfile":
        """A tensor-parallel group needs the fabric its all-reduces cross, with that many GPUs."""
        if self.tensor_parallel is not None:
            if self.fabric is None:
                raise ValueError(f"tensor_parallel: {self.tensor_parallel} GPUs, but the profile has no `fabric:`")
            if self.tensor_parallel > self.fabric.gpus:
                raise ValueError(f"tensor_parallel: {self.tensor_parallel} GPUs, but fabric.gpus is {self.fabric.gpus}")
        return self

    def link(self, resource: str) -> LinkSpec:
        """The link behind a transfer resource name (`pcie_h2d`, `pcie_d2h`, `nvme`)."""
        return getattr(self.links, resource)

    def require_cpu(self, who: str) -> CPUSpec:
        """The CPU section, or a one-line refusal naming what needs it."""
        if self.cpu is None:
            raise MissingCapability(
                f"{who} computes on the CPU, but hardware profile {self.name!r} has no `cpu:` "
                f"section (cores, flops, compute_dtype, memory_bandwidth); add one or pick a "
                f"profile that has it"
            )
        return self.cpu

    def to_yaml(self) -> str:
        return yaml.safe_dump(self.model_dump(mode="json", exclude_none=True), sort_keys=False)


class ProfileError(KlotskiError):
    """A profile that cannot be used; the message names the file and the field."""


def _did_you_mean(location: tuple) -> str:
    """For an unknown key, suggest the closest allowed one."""
    model: type[BaseModel] = HardwareProfile
    for part in location[:-1]:
        field = model.model_fields.get(str(part)) if isinstance(part, str) else None
        annotation = getattr(field, "annotation", None)
        if not (isinstance(annotation, type) and issubclass(annotation, BaseModel)):
            return ""
        model = annotation
    close = difflib.get_close_matches(str(location[-1]), list(model.model_fields), n=1)
    return f" (did you mean {close[0]!r}?)" if close else ""


def profile_from_dict(data: Any, where: str) -> HardwareProfile:
    """Validate a parsed profile; `where` (a path or label) starts every error message."""
    if not isinstance(data, dict):
        raise ProfileError(f"{where}: a profile must be a mapping, got {type(data).__name__}")
    try:
        return HardwareProfile.model_validate(data)
    except ValidationError as err:
        problems = []  # (a misspelt field first: it usually explains the missing one)
        for e in sorted(err.errors(), key=lambda e: e["type"] != "extra_forbidden"):
            loc = ".".join(str(p) for p in e["loc"])
            hint = _did_you_mean(e["loc"]) if e["type"] == "extra_forbidden" else ""
            msg = "unknown field" if e["type"] == "extra_forbidden" else e["msg"]
            problems.append(f"{loc}: {msg}{hint}" if loc else f"{msg}{hint}")  # (a whole-profile check: no location)
        shown = "; ".join(problems[:6]) + (f"; ... ({len(problems)} problems in all)" if len(problems) > 6 else "")
        raise ProfileError(f"{where}: invalid hardware profile: {shown}") from None  # (one line, every field named)


def load_profile_file(path: str | Path) -> HardwareProfile:
    path = Path(path)
    text = read_text(path, "profile", ProfileError, MAX_YAML_BYTES)
    return profile_from_dict(load_yaml(text, str(path), ProfileError), str(path))


@lru_cache(maxsize=1)
def builtin_profile_names() -> tuple[str, ...]:
    """The packaged profiles' names, listed once (a sweep asks for every configuration)."""
    folder = resources.files("klotski_sim.hardware") / "profiles"
    return tuple(sorted(p.name[:-5] for p in folder.iterdir() if p.name.endswith(".yaml")))


def load_profile(name_or_path: str | Path) -> HardwareProfile:
    """A built-in profile by name (`rtx3090`) or a YAML file by path."""
    text = str(name_or_path)
    if text in builtin_profile_names():
        if Path(text).is_file():  # (`--hardware t4` beside a file named t4: else the built-in, without a word)
            raise ProfileError(
                f"{text!r} names a built-in profile and a file here: give ./{text} for the file, or rename it"
            )
        ref = resources.files("klotski_sim.hardware") / "profiles" / f"{text}.yaml"
        with resources.as_file(ref) as path:
            return load_profile_file(path)
    if Path(text).exists() or Path(text).is_symlink() or text.endswith((".yaml", ".yml")):
        return load_profile_file(text)  # (a link to nowhere: its reading says so, not "unknown profile")
    raise ProfileError(
        f"unknown hardware profile {text!r}; built-in profiles: "
        f"{', '.join(builtin_profile_names())} (or give a path to a YAML file)"
    )


def with_overrides(profile: HardwareProfile, overrides: dict[str, Any], where: str = "overrides") -> HardwareProfile:
    """A copy of `profile` with dotted-path fields replaced (`links.pcie_h2d.bandwidth: 50e9`),
    validated like a file, so a what-if cannot produce a nonsensical profile."""
    data = profile.model_dump(mode="json")
    for dotted, value in overrides.items():
        node = data
        parts = dotted.split(".")
        for part in parts[:-1]:
            if not isinstance(node.get(part), dict):
                raise ProfileError(f"{where}: {dotted!r} is not a profile field")
            node = node[part]
        if parts[-1] not in node and not _names_a_map(parts[:-1]):
            raise ProfileError(f"{where}: {dotted!r} is not a profile field")
        node[parts[-1]] = value
    return profile_from_dict(data, where)


def _names_a_map(parts: list[str]) -> bool:
    """Whether the dotted path is a field whose keys are the user's to give (a dict: `sources`,
    `cpu.flops`, `gpu.dispatch_overhead_by_category`), so that an override may add a key to it
    (`--set gpu.dispatch_overhead_by_category.expert=1e-5` where the profile's file has no such
    key); the profile's validation then checks the key and its value."""
    model: type[BaseModel] = HardwareProfile
    for k, part in enumerate(parts):
        field = model.model_fields.get(part)
        if field is None:
            return False
        annotation = (
            next((a for a in get_args(field.annotation) if a is not type(None)), field.annotation)
            if get_origin(field.annotation) in (Union, UnionType)
            else field.annotation
        )
        if get_origin(annotation) is dict:
            return k == len(parts) - 1
        if not (isinstance(annotation, type) and issubclass(annotation, BaseModel)):
            return False
        model = annotation
    return False
