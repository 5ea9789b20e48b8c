"""Cost model: how long one op takes on one hardware profile.

Compute ops follow a roofline with efficiencies plus a per-kernel overhead (eager PyTorch pays a
launch and a dispatch per kernel, which dominates small decode ops) plus the runtime's fixed cost
of issuing an op (`dispatch_overhead_s`, fitted by calibration); transfers cost
`latency + bytes / bandwidth` at the link's pinned or pageable bandwidth; a host op (the host
thread blocked on a sync or a pageable copy) costs the profile's host-sync latency on top of its
wait. A profile may carry measured durations (from `klotski-runtime calibrate`); inside the range
they cover they override the analytic value.
"""

from __future__ import annotations

import bisect
import functools
from collections import namedtuple
from operator import itemgetter
from typing import TYPE_CHECKING, Callable, Mapping, Sequence

from klotski_sim.core.collectives import all_to_all_time, best_all_reduce
from klotski_sim.core.schedule import DEFAULT_STREAMS, Op
from klotski_sim.hardware.profile import HardwareProfile, MeasuredPoint
from klotski_sim.names import base_resource, resource_rank
from klotski_sim.util.errors import KlotskiError, UsageError

if TYPE_CHECKING:
    from klotski_sim.workload.model import ModelSpec

# Kernels one op launches in an eager PyTorch implementation of a Mixtral layer (HF-style):
# attention = input RMSNorm, q/k/v/o, RoPE, KV append, SDPA, residual; gate = post-attention
# RMSNorm, router GEMM, softmax, top-k, renormalise; expert = gather, w1, w3, SiLU*mul, w2,
# scale, scatter-add. The overhead per kernel comes from the profile. `category.variant` keys
# count an implementation's own kernels: eager attention adds repeat_kv's two expand+copy
# kernels, QK^T, the scale, the mask add, the fp32 up-cast, softmax, the down-cast, AV and the
# transpose back (transformers' `eager_attention_forward`) in place of the one SDPA kernel.
KERNELS_PER_OP: dict[str, int] = {
    "attention": 25,
    "attention.fused": 25,
    "attention.eager": 34,
    "gate": 12,
    "expert": 8,
    "embed": 2,
    "lm_head": 4,
    "dequant": 4,  # HQQ dequantize: unpack the codes, subtract the zeros, multiply by the scales, reshape + cast
    "attn_qkv": 7,  # attention on the CPU, GPU side: input RMSNorm, q/k/v, RoPE on q and k, the copy out
    "attn_out": 3,  # ... the copy in, o, residual
    "dense_mlp": 6,  # a dense layer's MLP: post-attention RMSNorm, w1, w3, SiLU*mul, w2, residual
}
# Kernels an op launches again for each batch beyond its first: an expert op over the tokens of B
# batches finds, gathers, scales and scatters back each batch's rows (the index rows, the gather,
# the gate scale, the index-add: half of its 8 kernels at one batch) and runs its GEMMs once, over
# all of them (the CUDA executor's `_expert_into`; Klotski's port also loops over batches).
KERNELS_PER_EXTRA_BATCH: dict[str, int] = {"expert": 4}


# What a model adds to an op's kernels, by the tags its ops' `variant` carries after the
# implementation (`attention.fused+qk_norm`; see `op_variant`). An RMSNorm is 8 kernels in
# transformers' eager code (Qwen3MoeRMSNorm / OlmoeRMSNorm.forward: cast up, pow, mean, add eps,
# rsqrt, multiply, cast back, scale); Mixtral's router renormalises its top-k weights with a sum
# and a divide that OLMoE's and Qwen1.5-MoE's (norm_topk_prob false) do not launch.
# The stored size of losslessly compressed bf16 expert weights (their exponents compress): FluxMoE
# §6.3 Table 3, 32.1-32.5% saved; its compressed tier (serving's `fluxmoe`, EP ranks' `compressed`)
COMPRESSED_SHARE = 1 - 0.321
RMSNORM_KERNELS = 8
KERNEL_TAGS: dict[str, int] = {
    "qk_norm": 2 * RMSNORM_KERNELS,  # q_norm and k_norm before RoPE (Qwen3-MoE, OLMoE)
    "topk_as_is": -2,  # the top-k weights are not renormalised
}


def op_variant(model: "ModelSpec", category: str, impl: str = "") -> str:
    """The `variant` of one of `model`'s ops: its implementation (`impl`, e.g. fused | eager
    attention), then, joined by `+`, the KERNEL_TAGS this model's version of the op carries — so
    that ops which launch different kernels are costed (and calibrated) apart."""
    tags = [impl] if impl else []
    if model.qk_norm and category in ("attention", "attn_qkv"):
        tags.append("qk_norm")
    if not model.norm_topk_prob and category == "gate":
        tags.append("topk_as_is")
    return "+".join(tags)


@functools.cache  # (a few distinct names; a serving run asks for each op it costs)
def variant_impl(variant: str) -> str:
    """The implementation a `variant` names, without the model's tags (`fused+qk_norm` -> `fused`)."""
    return next((p for p in variant.split("+") if p not in KERNEL_TAGS), "") if variant else ""


@functools.cache
def kernels_of(category: str, variant: str = "", batches: int = 1) -> int:
    """Kernels one op over `batches` batches launches: its implementation's count (`category.impl`,
    else the category's), plus what its KERNEL_TAGS add and its per-batch kernels for each batch
    beyond the first (KERNELS_PER_EXTRA_BATCH)."""
    impl = variant_impl(variant)
    base = KERNELS_PER_OP.get(f"{category}.{impl}") if impl else None
    return (
        (base or KERNELS_PER_OP.get(category, 1))
        + sum(KERNEL_TAGS.get(p, 0) for p in variant.split("+"))
        + KERNELS_PER_EXTRA_BATCH.get(category, 0) * max(0, batches - 1)
    )


class CostError(KlotskiError):
    """An op the profile cannot cost (a pageable copy on a link without a pageable bandwidth)."""


class MeasuredTable:
    """Measured durations of one op category, interpolated linearly in tokens and, for
    attention, between the two nearest measured KV lengths. Outside the measured range it
    answers None, so the analytic model takes over instead of a wild extrapolation."""

    def __init__(self, points: Sequence[MeasuredPoint]) -> None:
        by_kv: dict[int, list[tuple[int, float]]] = {}
        for p in points:
            by_kv.setdefault(p.kv_len, []).append((p.tokens, p.seconds))
        self.kv_levels = sorted(by_kv)
        self.rows = {kv: sorted(rows) for kv, rows in by_kv.items()}

    @staticmethod
    def _interp(rows: list[tuple[int, float]], tokens: int) -> float | None:
        xs = [r[0] for r in rows]
        if tokens < xs[0] or tokens > xs[-1]:
            return None
        i = bisect.bisect_left(xs, tokens)
        if xs[i] == tokens:
            return rows[i][1]
        (x0, y0), (x1, y1) = rows[i - 1], rows[i]
        return y0 + (y1 - y0) * (tokens - x0) / (x1 - x0)

    def lookup(self, tokens: int, kv_len: int = 0) -> float | None:
        levels = self.kv_levels
        if kv_len < levels[0] or kv_len > levels[-1]:
            return None
        i = bisect.bisect_left(levels, kv_len)
        if levels[i] == kv_len:
            return self._interp(self.rows[kv_len], tokens)
        lo, hi = levels[i - 1], levels[i]
        y0, y1 = self._interp(self.rows[lo], tokens), self._interp(self.rows[hi], tokens)
        if y0 is None or y1 is None:
            return None
        return y0 + (y1 - y0) * (kv_len - lo) / (hi - lo)


class CostModel:
    """Turns ops into seconds on one profile. `override` (op -> seconds or None) lets a caller
    plug in any other source of truth ahead of the measured table and the roofline."""

    def __init__(self, profile: HardwareProfile, override: Callable[[Op], float | None] | None = None) -> None:
        self.profile = profile
        self.override = override
        self.tables = {cat: MeasuredTable(points) for cat, points in profile.measured.items() if points}
        gpu = profile.gpu
        self._flop_rate = gpu.peak_flops * gpu.compute_efficiency
        self._byte_rate = gpu.memory_bandwidth * gpu.memory_efficiency

    def compute_seconds(
        self,
        category: str,
        flops: float,
        io_bytes: float,
        tokens: int = 0,
        kv_len: int = 0,
        phase: str = "",
        variant: str = "",
        batches: int = 1,
    ) -> float:
        """Measured when the profile's table covers the shape (`category:phase` first, e.g.
        `attention:decode`, then `category`; with a variant `attention.eager:decode`, then
        `attention.eager` — never another variant's table), else the roofline plus kernel overheads.
        A table times one batch's op: an op over more batches adds its per-batch kernels' launches."""
        name = f"{category}.{variant}" if variant else category
        for key in (f"{name}:{phase}", name) if phase else (name,):
            table = self.tables.get(key)
            if table is not None:
                measured = table.lookup(tokens, kv_len)
                if measured is not None:  # (its one batch's launches are in the measurement)
                    one = kernels_of(category, variant) * self.profile.gpu.kernel_overhead_s
                    return measured + self.launch_seconds(category, variant, batches) - one
        roofline = max(flops / self._flop_rate, io_bytes / self._byte_rate)
        return roofline + self.launch_seconds(category, variant, batches)

    def launch_seconds(self, category: str, variant: str = "", batches: int = 1) -> float:
        """What a GPU compute op costs beyond its kernels' work: its kernel launches and the
        runtime's fixed cost per op (`dispatch_overhead_s`, by category where measured). The
        issuing thread spends the same on it (`issue_seconds`)."""
        gpu = self.profile.gpu
        dispatch = gpu.dispatch_overhead_by_category.get(category, gpu.dispatch_overhead_s)
        return kernels_of(category, variant, batches) * gpu.kernel_overhead_s + dispatch

    def transfer_seconds(self, resource: str, nbytes: float, pageable: bool = False) -> float:
        link = self.profile.link(resource)
        if not pageable:
            return link.latency_s + nbytes / link.bandwidth
        if link.pageable_bandwidth is None:
            raise CostError(
                f"hardware profile {self.profile.name!r}: links.{resource}.pageable_bandwidth is not "
                f"set, but the schedule copies from pageable host memory (set it, or use pinned copies)"
            )
        return link.latency_s + nbytes / link.pageable_bandwidth

    def cpu_seconds(self, flops: float, io_bytes: float, category: str = "expert", tokens: int = 0) -> float:
        """A compute op on the host CPU: measured when the profile's `cpu:<category>` table covers
        the token count, else a roofline on its sustained FLOP/s (in its compute dtype) and DRAM
        bandwidth; plus a fixed cost per op. The profile must have a `cpu:` section."""
        cpu = self.profile.require_cpu("this schedule")
        table = self.tables.get(f"cpu:{category}")
        measured = table.lookup(tokens) if table is not None else None
        if measured is not None:
            return measured + cpu.op_overhead_s
        return max(flops / cpu.flop_rate, io_bytes / cpu.memory_bandwidth) + cpu.op_overhead_s

    def decompress_seconds(self, nbytes: float) -> float:
        """Lossless decompression of `nbytes` (uncompressed output) on the GPU, at the profile's
        measured decompression rate, plus one kernel launch."""
        gpu = self.profile.gpu
        if gpu.decompress_bandwidth is None:
            raise UsageError(
                f"hardware profile {self.profile.name!r} has no gpu.decompress_bandwidth (bytes/s of decompressed "
                f"output): give one with --set gpu.decompress_bandwidth=4e11 (FluxMoE measured 396.5-435.4e9)"
            )
        return nbytes / gpu.decompress_bandwidth + gpu.kernel_overhead_s

    def all_reduce_seconds(self, nbytes: float) -> float:
        """An all-reduce of an `nbytes` buffer over the profile's tensor-parallel group, by the
        faster of NCCL's ring and tree algorithms for that size (collectives.best_all_reduce)."""
        group = self.profile.tensor_parallel or 1
        if self.profile.fabric is None or group == 1:
            raise UsageError(
                f"hardware profile {self.profile.name!r} is not a tensor-parallel group, but the schedule "
                f"all-reduces over one (simulate it with --gpus G on a profile with a `fabric:` section)"
            )
        return best_all_reduce(nbytes, group, self.profile.fabric)[0]

    def host_seconds(self) -> float:
        """What a host op costs beyond its wait: the host-sync round trip."""
        return self.profile.gpu.host_sync_latency_s

    def all_to_all_seconds(self, critical_bytes: float, ranks: int) -> float:
        """An expert-parallel all-to-all over `ranks` GPUs of the profile's fabric, by pairwise
        exchange (collectives.all_to_all_time; `critical_bytes`: its rounds' largest messages)."""
        if self.profile.fabric is None or ranks > self.profile.fabric.gpus:
            raise UsageError(
                f"hardware profile {self.profile.name!r} has no fabric of {ranks} GPUs, but the schedule "
                f"exchanges tokens over one (pick a profile with a `fabric:` section: h200, h20, l40s)"
            )
        return all_to_all_time(critical_bytes, ranks, self.profile.fabric)

    def duration(self, op: Op, resource: str, ranks: int = 1) -> float:
        """Op's seconds on `resource` (a rank's own resource costs as its kind); `ranks`: the GPUs of
        the schedule, which its all-to-alls span."""
        if self.override is not None:
            value = self.override(op)
            if value is not None:
                return value
        resource = base_resource(resource)
        if op.kind == "transfer":
            return self.transfer_seconds(resource, op.bytes, op.pageable)
        if op.kind == "host":
            return self.host_seconds()
        if resource == "cpu":
            return self.cpu_seconds(op.flops, op.bytes, op.category, op.tokens)
        if op.category == "decompress":
            return self.decompress_seconds(op.bytes)
        if resource == "fabric":
            if op.category == "alltoall":
                return self.all_to_all_seconds(op.bytes, ranks)
            return self.all_reduce_seconds(op.bytes)
        return self.compute_seconds(
            op.category, op.flops, op.bytes, op.tokens, op.kv_len, op.phase, op.variant, max(1, len(op.batches))
        )

    def issue_seconds(self, op: Op, resource: str) -> float:
        """Host time the issuing thread spends on `op` (`gpu.issue: serial`): a compute op's kernel
        launches and the runtime's fixed cost per op (what `compute_seconds` charges beyond the
        kernels' work, so a launch-bound op takes as long to issue as to run); a copy, a CPU op
        handed to its worker, a decompression or a collective one call (`gpu.copy_issue_s` for
        copies where calibrated); a host op nothing (the thread waits in it, timed by the op)."""
        gpu = self.profile.gpu
        resource = base_resource(resource)
        if op.kind == "host":
            return 0.0
        if op.kind == "transfer":
            return gpu.kernel_overhead_s if gpu.copy_issue_s is None else gpu.copy_issue_s
        if resource in ("cpu", "fabric") or op.category == "decompress":
            return gpu.kernel_overhead_s
        return self.launch_seconds(op.category, op.variant, max(1, len(op.batches)))

    def issue_costs(self, ops: Sequence[Op], streams: Mapping[str, str] = DEFAULT_STREAMS) -> list[float]:
        """Every op's `issue_seconds`, each distinct (kind, stream, category, variant, batches) costed once."""
        return list(map(_IssuedOnce(self, streams).__getitem__, map(_ISSUE_FIELDS, ops)))

    def durations(self, ops: Sequence[Op], streams: Mapping[str, str] = DEFAULT_STREAMS) -> list[float]:
        """Every op's duration. Ops that differ only in id, tags and deps last equally long, and a
        schedule has few distinct ones: each is costed once (unless an override sees every op)."""
        if self.override is not None:
            ranks = schedule_ranks(streams)
            return [self.duration(op, streams[op.stream], ranks) for op in ops]
        return list(map(_CostedOnce(self, streams).__getitem__, map(_COSTED_FIELDS, ops)))


def schedule_ranks(streams: Mapping[str, str]) -> int:
    """The GPUs a schedule's streams span: its ranks (1 for a schedule of one GPU)."""
    return max(1, len({resource_rank(r) for r in streams.values()} - {-1}))


class _CostedOnce(dict):
    """Duration by an op's costed fields, each distinct key costed when first asked (a C-level
    look-up for the rest: a schedule has hundreds of thousands of ops and a few hundred keys)."""

    def __init__(self, cost: CostModel, streams: Mapping[str, str]) -> None:
        super().__init__()
        self.cost, self.streams, self.ranks = cost, streams, schedule_ranks(streams)

    def __missing__(self, key: tuple) -> float:
        costed = _Costed(*key)
        value = self[key] = self.cost.duration(costed, self.streams[costed.stream], self.ranks)  # type: ignore[arg-type]
        return value


class _IssuedOnce(dict):
    """Issue cost by an op's (kind, stream, category, variant, batches), each costed when first asked."""

    def __init__(self, cost: CostModel, streams: Mapping[str, str]) -> None:
        super().__init__()
        self.cost, self.streams = cost, streams

    def __missing__(self, key: tuple[str, str, str, str, tuple[int, ...]]) -> float:
        kind, stream, category, variant, batches = key
        value = self[key] = self.cost.issue_seconds(
            Op("", kind, stream, category, variant=variant, batches=batches), self.streams[stream]
        )
        return value


_ISSUE_FIELDS = itemgetter(*map(Op._fields.index, ("kind", "stream", "category", "variant", "batches")))

# what an op's duration depends on (see `CostModel.duration`), and those fields alone as an op
_Costed = namedtuple(
    "_Costed",
    ("kind", "stream", "category", "flops", "bytes", "tokens", "kv_len", "phase", "variant", "pageable", "batches"),
)
_COSTED_FIELDS = itemgetter(*map(Op._fields.index, _Costed._fields))  # (by position: an op is a tuple; 10-40% faster)


def costed_fields(op: Op) -> tuple:
    """The fields an op's duration depends on: ops equal in them last equally long."""
    return _COSTED_FIELDS(op)
