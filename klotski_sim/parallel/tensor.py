"""Tensor parallelism for every offloading policy: a group of G GPUs that runs each op together,
every GPU on its 1/G shard (Megatron-LM's split: Shoeybi et al., "Megatron-LM: Training Multi-Billion
Parameter Language Models Using Model Parallelism", 2019, section 3 — attention heads and the MLP's
intermediate dimension split, one all-reduce after attention and one after the MLP; vLLM and SGLang
split MoE experts' intermediate dimension the same way, FluxMoE's testbeds run so).

The ranks of a tensor-parallel group do the same work at the same time, so one schedule describes them
all: `group_machine` makes the profile of the group seen as one device (G times one GPU's memory,
FLOP/s and HBM bandwidth; G PCIe links, as far as host memory feeds them; the kernel launches of one
rank, since every rank launches its shard's kernels at once), and `with_all_reduces` adds the two
all-reduces a layer pays on the group's fabric. Each policy then plans and runs on the group exactly
as on one GPU. What that leaves out: smaller GEMMs reach a lower share of peak than the whole ones
(the profile's efficiencies are one GPU's at full shapes), and an MLA model's latent KV cache, the same
on every rank, is refused rather than modelled.
"""

from __future__ import annotations

from collections import defaultdict

from klotski_sim.core.schedule import Op, Schedule
from klotski_sim.hardware.profile import HardwareProfile
from klotski_sim.names import ALLREDUCE_STREAM
from klotski_sim.parallel.decode import check_splits, kv_replicated, machine_fabric
from klotski_sim.util.errors import MissingCapability, UsageError
from klotski_sim.workload.model import ModelSpec

# The ops whose output is a partial sum on each rank (a row-parallel GEMM ends them): attention's
# output projection, and a layer's MLP side (routed experts wherever they run, shared experts, dense MLP)
ATTENTION_OUTPUT = ("attention", "attn_out")
MLP_SIDE = ("expert", "moe", "dense_mlp", "combine")
# What reads the reduced attention output (a layer's MLP side and its router) and what reads the
# reduced MLP output (the next layer's attention, or the LM head after the last layer)
AFTER_ATTENTION = ("gate", *MLP_SIDE)
AFTER_MLP = ("attention", "attn_qkv", "lm_head")


def group_model(model: ModelSpec, gpus: int) -> ModelSpec:
    """The model as a group of `gpus` ranks holds it (`decode.kv_replicated`), refused in one line
    when its attention does not split over them."""
    check_splits(model, gpus)
    return kv_replicated(model, gpus)


def group_machine(profile: HardwareProfile, gpus: int, model: ModelSpec) -> HardwareProfile:
    """The profile of `gpus` of `profile`'s GPUs run as one tensor-parallel group (the module's
    docstring); `profile` itself for one GPU. Refused in one line: a profile without a fabric of that
    many GPUs, a calibrated profile (its measured tables time one GPU's whole ops, not a shard's), a
    model whose heads do not split."""
    fabric = machine_fabric(profile, gpus)
    if gpus == 1:
        return profile
    check_splits(model, gpus)
    if profile.measured:
        raise MissingCapability(
            f"--gpus {gpus}: hardware profile {profile.name!r} holds measured op durations (a calibration), "
            f"which time one GPU's whole ops, not a {gpus}-way shard; use a built-in profile"
        )
    gpu = profile.gpu
    grouped_gpu = gpu.model_copy(
        update={
            "memory_bytes": gpu.memory_bytes * gpus,
            "reserved_bytes": gpu.reserved_bytes * gpus,
            "peak_flops": gpu.peak_flops * gpus,
            "memory_bandwidth": gpu.memory_bandwidth * gpus,
            "decompress_bandwidth": None if gpu.decompress_bandwidth is None else gpu.decompress_bandwidth * gpus,
        }
    )
    # Each GPU copies its shard over its own PCIe link; together they read host memory, which feeds
    # them at most its DRAM bandwidth (where the profile has a `cpu:` section saying what it is)
    host_feed = profile.cpu.memory_bandwidth if profile.cpu is not None else None
    sources = dict(profile.sources)

    def grouped(name: str) -> object:
        link = profile.link(name)
        update: dict[str, float] = {}
        for field in ("bandwidth", "pageable_bandwidth"):
            one = getattr(link, field)
            if one is None:
                continue
            update[field] = one * gpus if host_feed is None else min(one * gpus, host_feed)
            capped = host_feed is not None and one * gpus > host_feed
            sources[f"links.{name}.{field}"] = (
                f"{gpus} GPUs' own links at {one:.4g} B/s each"
                + (f", capped by host memory's {host_feed:.4g} B/s (cpu.memory_bandwidth)" if capped else "")
                + (" (no cpu: section says what host memory feeds; uncapped)" if host_feed is None else "")
            )
        return link.model_copy(update=update)

    links = profile.links.model_copy(update={"pcie_h2d": grouped("pcie_h2d"), "pcie_d2h": grouped("pcie_d2h")})
    for field in ("memory_bytes", "reserved_bytes", "peak_flops", "memory_bandwidth"):
        sources[f"gpu.{field}"] = f"{gpus} x one GPU's (tensor parallelism: each holds and computes 1/{gpus})"
    return profile.model_copy(
        update={
            "name": f"{profile.name}-tp{gpus}",
            "description": f"{gpus} GPUs of {profile.name} as one tensor-parallel group ({fabric.kind})",
            "gpu": grouped_gpu,
            "links": links,
            "tensor_parallel": gpus,
            "sources": sources,
        }
    )


def with_all_reduces(schedule: Schedule, model: ModelSpec, gpus: int) -> Schedule:
    """`schedule` with a tensor-parallel layer's two all-reduces per batch, step and layer, on the
    `allreduce` stream (the group's fabric): one after the attention output, read by the layer's
    router and MLP side; one after the MLP side, read by the next layer's attention (or the LM head).
    Each reduces the batch's hidden states (tokens x hidden size). A layer whose attention or MLP ops
    cannot be found by their categories is refused, naming the op. The meta's `tensor_parallel` says
    how many ranks share each op (the runtime splits the op's heads and FFN width among them)."""
    ops = schedule.ops
    attention: dict[tuple[int, int, int], int] = {}  # (step, layer, batch) -> the attention output's position
    mlp: dict[tuple[int, int, int], list[int]] = defaultdict(list)
    for i, op in enumerate(ops):
        if op.kind != "compute":
            continue
        if op.category in ATTENTION_OUTPUT:
            for b in op.batches:
                attention[(op.step, op.layer, b)] = i
        elif op.category in MLP_SIDE:
            for b in op.batches:
                mlp[(op.step, op.layer, b)].append(i)
    if not attention:
        raise UsageError(
            f"tensor parallelism: schedule of {schedule.meta.get('policy', '?')!r} has no attention ops "
            f"(categories {', '.join(ATTENTION_OUTPUT)}) to add its all-reduces after"
        )
    last_layer = max(layer for _, layer, _ in attention)
    added: dict[int, list[Op]] = defaultdict(list)  # position -> all-reduces placed right after it
    after_attention: dict[tuple[int, int, int], str] = {}
    after_mlp: dict[tuple[int, int, int], str] = {}
    for key, i in attention.items():
        step, layer, batch = key
        op = ops[i]
        tokens = op.tokens // max(1, len(op.batches))
        nbytes = model.hidden_bytes(tokens)
        reduce_attention = Op(
            id=f"{op.id}/allreduce" if len(op.batches) == 1 else f"{op.id}/b{batch}/allreduce",
            kind="compute",
            stream=ALLREDUCE_STREAM,
            category="allreduce",
            deps=(op.id,),
            bytes=nbytes,
            step=step,
            phase=op.phase,
            layer=layer,
            batches=(batch,),
            tokens=tokens,
        )
        added[i].append(reduce_attention)
        after_attention[key] = reduce_attention.id
        side = mlp.get(key)
        if not side:
            raise UsageError(
                f"tensor parallelism: attention op {op.id!r} has no MLP-side op (categories "
                f"{', '.join(MLP_SIDE)}) of its step, layer and batch to reduce after"
            )
        reduce_mlp = reduce_attention._replace(
            id=reduce_attention.id.removesuffix("allreduce") + "mlp/allreduce",
            deps=tuple(ops[j].id for j in side),
        )
        added[max(side)].append(reduce_mlp)
        after_mlp[key] = reduce_mlp.id
    out: list[Op] = []
    for i, op in enumerate(ops):
        extra: list[str] = []
        if op.kind == "compute" and op.category in AFTER_ATTENTION:
            extra = [after_attention[k] for b in op.batches if (k := (op.step, op.layer, b)) in after_attention]
        elif op.kind == "compute" and op.category in AFTER_MLP:
            before = last_layer if op.category == "lm_head" else op.layer - 1
            extra = [after_mlp[k] for b in op.batches if (k := (op.step, before, b)) in after_mlp]
        out.append(op._replace(deps=op.deps + tuple(d for d in extra if d not in op.deps)) if extra else op)
        out.extend(added.get(i, ()))
    return Schedule(
        ops=tuple(out),
        streams={**schedule.streams, ALLREDUCE_STREAM: "fabric"},
        preloaded=schedule.preloaded,
        meta={**schedule.meta, "tensor_parallel": gpus},
    )
