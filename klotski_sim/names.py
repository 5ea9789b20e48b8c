"""The names the layers and the runtime share: op kinds, tiers, tensors, compute categories, resources
and the conventional streams. They are the Schedule contract's vocabulary; this module imports
nothing so that hardware profiles, the schedule, the policies and the runtime all read one list."""

KINDS = ("compute", "transfer", "host")
TIERS = ("gpu", "cpu", "disk")
TENSORS = ("", "attention", "gate", "expert", "kv", "activation")
# The categories of the compute ops the built-in policies make (the runtime has a kernel for each;
# a policy file may add its own)
COMPUTE_CATEGORIES = (
    "moe",  # a layer's routed experts in one fused kernel (serving engines: vLLM's fused_moe)
    "decompress",  # compressed expert weights decompressed on the GPU (FluxMoE)
    "remap",  # a residency change: weight buffers dropped or KV memory taken or given back (no work)
    "embed",
    "attention",
    "gate",
    "dense_mlp",
    "expert",
    "lm_head",
    "combine",
    "dequant",
    "attn_qkv",
    "attn_out",
    "allreduce",  # tensor parallelism: a layer's partial sums added over the GPU group (NCCL's kernel)
    "alltoall",  # expert parallelism: tokens dispatched to their experts' ranks, or combined back
)
# `gpu_decompress`: a second GPU unit for lossless weight decompression running beside the compute
# stream (FluxMoE's compressed tier); a schedule may instead put decompression on `gpu` itself
# `fabric`: the GPU-to-GPU links of a tensor-parallel group, busy with its all-reduces
RESOURCES = ("gpu", "pcie_h2d", "pcie_d2h", "nvme", "host", "cpu", "gpu_decompress", "fabric")
# A resource of one GPU of several (expert parallelism's ranks, each with its own GPU, links, host
# thread and fabric port): `gpu@1` is rank 1's GPU. An unranked name is the one GPU of a schedule,
# or a resource the ranks share (the host CPU). GPU memory is per rank too: a buffer named `NAME@k`
# lives on rank k's GPU.
RANK_MARK = "@"
COLLECTIVE_CATEGORIES = ("allreduce", "alltoall")  # what runs on `fabric`, and nowhere else


def ranked(resource: str, rank: int) -> str:
    """Rank `rank`'s own `resource` (`ranked("gpu", 1) == "gpu@1"`)."""
    return f"{resource}{RANK_MARK}{rank}"


def base_resource(resource: str) -> str:
    """What a (possibly ranked) resource is: `gpu@1` -> `gpu`."""
    return resource.partition(RANK_MARK)[0]


def resource_rank(resource: str) -> int:
    """The rank a resource or buffer name belongs to (`gpu@1` -> 1); -1 when it has none (or a
    malformed one: the schedule's check names it)."""
    _, mark, rank = resource.rpartition(RANK_MARK)
    return int(rank) if mark and rank.isdigit() and str(int(rank)) == rank else -1


ALLREDUCE_STREAM = "allreduce"  # the stream of a tensor-parallel schedule's all-reduces (on `fabric`)
HOST_STREAM = "host"
# What each link carries (the runtime copies so, and the simulator times a copy on its link: an
# expert copy remapped to nvme would run unemulated and be labelled a disk read)
LINK_DIRECTIONS = {"pcie_h2d": ("cpu", "gpu"), "pcie_d2h": ("gpu", "cpu"), "nvme": ("disk", "cpu")}

# The conventional streams and the physical resource each one runs on. Weight prefetch and
# expert loads share the one H2D copy engine (KLOTSKI.md: inferred single serial copy engine).
DEFAULT_STREAMS: dict[str, str] = {
    "compute": "gpu",
    "h2d_weights": "pcie_h2d",
    "h2d_experts": "pcie_h2d",
    "h2d_kv": "pcie_h2d",
    "d2h_kv": "pcie_d2h",
    "disk_read": "nvme",
    HOST_STREAM: "host",
}

# Streams of schedules that also compute on the host CPU: its compute stream, and the activations
# that cross PCIe to and from it (on the same one copy engine per direction as everything else).
CPU_STREAMS: dict[str, str] = {
    "cpu_compute": "cpu",
    "d2h_act": "pcie_d2h",
    "h2d_act": "pcie_h2d",
}


def kv_buffer(layer: int, batch: int, step: int) -> str:
    """The GPU buffer of the KV entries one attention op adds (layer, batch, decode step): the
    policies allocate it under this name, the runtime reads the past steps' entries by it."""
    return f"kv/L{layer}/b{batch}/s{step}"


def is_disk_read(op: object) -> bool:
    """An op that reads from disk (into host memory): a transfer whose source tier is the disk.
    Its role is in the op itself, so a schedule may put such reads on any stream it names."""
    return getattr(op, "kind", "") == "transfer" and getattr(op, "src", "") == "disk"
