"""Klotski's constraint-sensitive I/O-compute planner (KLOTSKI.md, "The planner"), plus the
default placement of tensors over GPU / CPU / disk.

Time 0 is the start of attention in an MoE block of a group of n batches. The planner wants the
smallest n for which compute covers every transfer of the block:

    (4) n*t_cA                                  >= t_IO_G
    (5) n*(t_cA + t_cG)                         >= t_IO_G + K*t_IO_E
    (6) n*(t_cA + t_cG) + t_c_hotE              >= t_IO_G + (K+1)*t_IO_E
    (7) n*(t_cA + t_cG) + t_c_hotE + sum_Q t_cE >= t_IO_G + (K+|Q|)*t_IO_E + t_IO_A

(larger n only adds KV cache), then lowers n until the GPU memory fits: resident weights, the
pipeline's weight buffers, activations and the KV cache of n batches at the final length. Every
term comes from the cost model, so a calibrated profile plans with measured numbers. Expert
activity (hot share, |Q|) comes from routing statistics — the warm-up trace when there is one.
Like the paper, the inequalities ignore KV traffic on the same link; the simulator shows its cost.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import numpy as np

from klotski_sim.core.cost import CostModel, op_variant
from klotski_sim.hardware.profile import HardwareProfile
from klotski_sim.policies.base import Placement
from klotski_sim.policies.impl import Impl
from klotski_sim.util.units import GIB, memory_text
from klotski_sim.workload.model import ModelSpec

HOST_HEADROOM = 0.9  # share of host memory the offloaded weights may take


@dataclass(frozen=True)
class Inequality:
    name: str
    lhs: float | np.ndarray  # (arrays: the sides at many n at once, elementwise)
    rhs: float | np.ndarray

    @property
    def holds(self) -> bool | np.ndarray:
        return self.lhs >= self.rhs


@dataclass(frozen=True)
class Plan:
    """The planner's answer and how it got there."""

    n: int
    n_io: int | None  # smallest n meeting (4)-(7), None if no n <= n_max does
    n_memory: int  # largest n whose memory fits (0: not even one batch)
    placement: Placement
    terms: dict[str, float]
    inequalities: tuple[Inequality, ...]  # evaluated at the chosen n
    memory: dict[str, float]
    notes: tuple[str, ...] = field(default_factory=tuple)


# Candidate n the planner weighs at once (vectorised: [n, layers, experts] arrays) before it looks
# for the smallest that closes the bubbles: all 256 at once would hold DeepSeek-V3's 256 x 61 x 256
# arrays (about 190 MB) for 0.19 s, where its n is found among the first 32.
_CANDIDATES_PER_PASS = 32


def expert_activity(model: ModelSpec, popularity: np.ndarray, tokens: int | np.ndarray) -> dict[str, np.ndarray]:
    """Per layer, for a group of `tokens` tokens each choosing top-k experts with the given shares
    (`[layers, experts]`, summing to 1 per layer): the K hottest experts' token counts, and each
    other expert's chance to be used at all and its expected tokens when it is. `tokens` may be an
    array of group sizes: the results then have its shape in front (`[groups, layers, experts]`)."""
    k = model.top_k
    tokens = np.asarray(tokens)[..., None, None]
    q = np.minimum(1.0, k * popularity)  # chance a token selects expert e
    order = np.argsort(-popularity, axis=1, kind="stable")
    p_used = 1 - (1 - q) ** tokens
    expected_tokens = tokens * q

    def take(values: np.ndarray, columns: np.ndarray) -> np.ndarray:
        return np.take_along_axis(values, np.broadcast_to(columns, values.shape[:-1] + columns.shape[-1:]), axis=-1)

    hot, cold = order[:, :k], order[:, k:]
    cold_p = take(p_used, cold)
    return {
        "hot_tokens": take(expected_tokens, hot),
        "cold_p_used": cold_p,
        "cold_tokens_if_used": take(expected_tokens, cold) / np.maximum(cold_p, 1e-12),
    }


def memory_needed(
    model: ModelSpec,
    batch_size: int,
    n: int,
    prompt_len: int,
    gen_len: int,
    placement: Placement,
    buffering: str = "expert-aware",
) -> dict[str, float]:
    """GPU bytes a multi-batch pipeline needs: resident weights, weight buffers (expert-aware:
    double-buffered attention, the gate and a whole MoE layer in flight, the worst case;
    whole-layer: two whole layers), activations and the KV cache."""
    streamed = model.num_layers - min(placement.resident_layers, model.num_layers)
    if not streamed:
        buffers = 0
    elif buffering == "whole-layer":
        buffers = 2 * (model.attention_bytes() + model.gate_bytes() + model.moe_layer_buffer_bytes())
    else:
        buffers = 2 * model.attention_bytes() + model.gate_bytes() + model.moe_layer_buffer_bytes()
    tokens_final = prompt_len + gen_len - 1
    kv_all = n * model.num_layers * model.kv_bytes(batch_size, tokens_final)
    out = {
        "resident": float(model.resident_bytes() + model.resident_layers_bytes(placement.resident_layers)),
        "weight_buffers": float(buffers),
        "activations": float(n * model.hidden_bytes(batch_size * prompt_len)),
        "kv_cache": float(kv_all if placement.kv == "gpu" else 2 * model.kv_bytes(batch_size, tokens_final)),
    }
    out["total"] = sum(out.values())
    return out


def memory_floor(
    model: ModelSpec,
    batch_size: int,
    n: int,
    prompt_len: int,
    gen_len: int,
    placement: Placement,
    holds_moe_layer: bool = False,
) -> dict[str, float]:
    """GPU bytes any schedule of this workload must hold at once — a lower bound, so a
    configuration above it is impossible whatever the policy: the resident weights, the hidden
    states of every batch, the KV cache at its final length (all of it on the GPU, or one batch's
    layer in flight from host memory) and the largest single weight tensor in use. With
    `holds_moe_layer` (a policy whose every expert buffer of a streamed MoE layer is allocated at
    once, FlexGen), the whole of that layer's experts instead of one tensor."""
    tokens_final = prompt_len + gen_len - 1
    kv_layer = model.kv_bytes(batch_size, tokens_final)
    streamed = range(min(placement.resident_layers, model.num_layers), model.num_layers)
    one_tensor = (
        max(model.attention_bytes(), model.expert_bytes(), model.gate_bytes(), model.gate_bytes(0))
        if len(streamed)
        else 0
    )
    streamed_experts = max((model.experts_in(layer) for layer in streamed if model.is_moe(layer)), default=0)
    out = {
        "resident": float(model.resident_bytes() + model.resident_layers_bytes(placement.resident_layers)),
        "activations": float(n * model.hidden_bytes(batch_size * prompt_len)),
        "kv_cache": float(n * model.num_layers * kv_layer if placement.kv == "gpu" else kv_layer),
    }
    if holds_moe_layer and streamed_experts * model.expert_buffer_bytes() > one_tensor:
        out["one_moe_layer"] = float(streamed_experts * model.expert_buffer_bytes())
    else:
        out["one_weight_tensor"] = float(one_tensor)
    out["total"] = sum(out.values())
    return out


def storage_needed(
    model: ModelSpec, placement: Placement, batch_size: int, n: int, prompt_len: int, gen_len: int
) -> dict[str, float]:
    """Bytes the run keeps off the GPU: in host memory (the weights placed there, the staging window
    of the layers read from disk, and the KV cache of n batches when it lives there) and on disk
    (the weights placed there). The layers kept whole on the GPU are counted nowhere else."""
    stored = {"host": 0.0, "disk": 0.0}
    tier_of = {"cpu": "host", "disk": "disk"}
    read_from_disk = []  # (per streamed layer: the bytes of it that are read from disk into the window)
    for layer in range(placement.resident_layers, model.num_layers):
        on_disk = 0.0
        for what, nbytes in (
            ("attention", model.attention_bytes()),
            ("gate", model.gate_bytes(layer)),
            ("experts", model.moe_layer_bytes(layer)),
        ):
            tier = tier_of[placement.tier(what, layer, model.num_layers)]
            stored[tier] += nbytes
            on_disk += nbytes if tier == "disk" else 0.0
        read_from_disk.append(on_disk)
    # the host staging window holds `disk_window` layers read from disk (policies/base.py `_stage`): host
    # memory a run needs even when every weight streams from disk
    stored["host"] += sum(sorted(read_from_disk, reverse=True)[: placement.disk_window])
    if placement.kv == "cpu":
        stored["host"] += host_kv_bytes(model, batch_size, n, prompt_len, gen_len)
    return stored


def host_kv_bytes(model: ModelSpec, batch_size: int, n: int, prompt_len: int, gen_len: int) -> float:
    """The KV cache of n batches at its final length, every layer: what host memory holds of it
    when it lives there."""
    return model.num_layers * model.kv_bytes(n * batch_size, prompt_len + gen_len)


def storage_refusal(
    model: ModelSpec,
    profile: HardwareProfile,
    placement: Placement,
    batch_size: int,
    n: int,
    prompt_len: int,
    gen_len: int,
) -> str | None:
    """Why the host memory or the disk cannot hold what the run keeps there (None: they can): else a
    model on a 1-byte disk would run, its every expert read from it."""
    stored = storage_needed(model, placement, batch_size, n, prompt_len, gen_len)
    for tier, have, field_name in (
        ("host", profile.host.memory_bytes, "host.memory_bytes"),
        ("disk", profile.disk.capacity_bytes, "disk.capacity_bytes"),
    ):
        if stored[tier] > have:
            where = "in host memory" if tier == "host" else "on disk"
            return (
                f"{model.name} keeps {memory_text(stored[tier])} {where} ({placement.describe()}), more than "
                f"the profile's {field_name} ({memory_text(have)}): nothing simulated"
                f"{_room_for_kv(model, placement, batch_size, n, prompt_len, gen_len) if tier == 'host' else ''}"
            )
    return None


def _room_for_kv(model: ModelSpec, placement: Placement, batch_size: int, n: int, prompt_len: int, gen_len: int) -> str:
    """What the KV cache takes of a refused run's host memory, and what would leave it room
    (it may be most of what is refused)."""
    if placement.kv != "cpu":
        return ""
    kv = host_kv_bytes(model, batch_size, n, prompt_len, gen_len)
    ways = ["every expert on disk (--experts disk)"] if placement.experts != "disk" else []
    ways += (["fewer batches"] if n > 1 else []) + ["a smaller batch size", "a shorter prompt"]
    batches = f"{n} batches" if n > 1 else "one batch"
    return f" (the KV cache of {batches} is {memory_text(kv)} of it: {', '.join(ways)} would leave it room)"


def default_placement(model: ModelSpec, profile: HardwareProfile, kv: str = "gpu", host_kv: float = 0.0) -> Placement:
    """Experts get host memory first: when the host cannot hold every layer, the experts of the
    last layers move to disk (as many as needed); attention and gate stay in host memory while
    they fit, else everything streams from disk. `host_kv`: the bytes of KV cache host memory holds
    beside them (a run with its cache there), which the weights' share leaves room for."""
    host = profile.host.memory_bytes * HOST_HEADROOM - host_kv
    streamed = model.layers_bytes()
    if streamed <= host:
        return Placement(kv=kv)
    dense = model.non_expert_bytes()
    if dense > host:
        return Placement(attention="disk", gate="disk", experts="disk", kv=kv)
    in_host = max(0, int((host - dense) // model.moe_layer_bytes()))
    if in_host == 0:
        return Placement(experts="disk", kv=kv)
    return Placement(kv=kv, disk_layers=model.num_layers - in_host)


def largest_fitting_n(
    model: ModelSpec,
    profile: HardwareProfile,
    batch_size: int,
    prompt_len: int,
    gen_len: int,
    placement: Placement,
    buffering: str = "expert-aware",
    n_max: int = 256,
) -> int:
    """The most batches whose memory fits on the GPU (0 when not even one does)."""
    capacity = profile.gpu.usable_bytes
    return next(
        (
            n
            for n in range(n_max, 0, -1)
            if memory_needed(model, batch_size, n, prompt_len, gen_len, placement, buffering)["total"] <= capacity
        ),
        0,
    )


def largest_storable_n(
    model: ModelSpec,
    profile: HardwareProfile,
    batch_size: int,
    prompt_len: int,
    gen_len: int,
    placement: Placement,
    n_max: int = 256,
) -> int:
    """The most batches (up to n_max) whose KV cache host memory holds beside the weights kept
    there, when the KV cache lives there (n_max when it does not; 0 when not even one batch's
    fits): what `storage_refusal` would otherwise refuse after the planner chose n. (The host's
    share grows with n: bisected.)"""

    def stored(n: int) -> bool:
        needed = storage_needed(model, placement, batch_size, n, prompt_len, gen_len)["host"]
        return needed <= profile.host.memory_bytes

    if placement.kv != "cpu" or stored(n_max):
        return n_max
    low, high = 0, n_max  # stored(low) (or low == 0), not stored(high)
    while high - low > 1:
        mid = (low + high) // 2
        low, high = (mid, high) if stored(mid) else (low, mid)
    return low


def fill_resident_layers(
    model: ModelSpec,
    profile: HardwareProfile,
    batch_size: int,
    n: int,
    prompt_len: int,
    gen_len: int,
    placement: Placement,
    buffering: str = "expert-aware",
) -> Placement:
    """`placement` with as many layers kept whole on the GPU as the memory n batches leave allows
    (the planner's use of spare memory; `--resident-layers fill` asks for it at any n)."""
    capacity = profile.gpu.usable_bytes

    def need(pl: Placement) -> float:
        return memory_needed(model, batch_size, n, prompt_len, gen_len, pl, buffering)["total"]

    spare = capacity - need(placement)
    keep = 0
    while keep < model.num_layers and model.resident_layers_bytes(keep + 1) <= spare:
        keep += 1
    filled = replace(placement, resident_layers=keep)
    while keep > 0 and need(filled) > capacity:
        keep -= 1
        filled = replace(filled, resident_layers=keep)
    return filled


def plan(
    model: ModelSpec,
    profile: HardwareProfile,
    batch_size: int,
    prompt_len: int = 512,
    gen_len: int = 32,
    popularity: np.ndarray | None = None,
    placement: Placement | None = None,
    n_max: int = 256,
    cost: CostModel | None = None,
    resident_layers: bool = True,
    impl: Impl | None = None,
) -> Plan:
    """Pick n (and where the KV cache goes) for a Klotski pipeline on `profile`, costing its ops as
    the implementation `impl` runs them (attention kernel, per-batch expert ops, host syncs)."""
    cost = cost or CostModel(profile)
    impl = impl or Impl()
    attention = impl.attention_impl
    notes: list[str] = []
    placement = placement or default_placement(model, profile)
    if placement.uses_disk and model.layers_bytes() <= profile.host.memory_bytes * HOST_HEADROOM:
        notes.append("weights on disk as asked (--experts disk): host memory would hold them")  # (not "exceed")
    elif placement.uses_disk:
        notes.append(f"weights exceed {HOST_HEADROOM:.0%} of host memory: {placement.describe()}")
    if popularity is None:
        popularity = np.full((model.num_layers, model.num_experts), 1 / model.num_experts)
        notes.append("no routing statistics given: uniform routing assumed (the worst case)")
    kv_len = prompt_len + gen_len // 2  # a representative decode step
    h2d = "pcie_h2d"
    t = {
        "t_cA": cost.compute_seconds(
            "attention",
            model.attention_flops(batch_size, 1, kv_len, attention),
            model.attention_io_bytes(batch_size, 1, kv_len, attention),
            batch_size,
            kv_len,
            "decode",
            op_variant(model, "attention", attention),
        ),
        "t_cG": cost.compute_seconds(
            "gate",
            model.gate_flops(batch_size),
            model.gate_io_bytes(batch_size),
            batch_size,
            phase="decode",
            variant=op_variant(model, "gate"),
        ),
        "t_IO_G": cost.transfer_seconds(h2d, model.gate_bytes()),
        "t_IO_E": cost.transfer_seconds(h2d, model.expert_bytes()),
        "t_IO_A": cost.transfer_seconds(h2d, model.attention_bytes()),
    }
    K = model.top_k

    sync = cost.host_seconds() if impl.sync_experts else 0.0

    op_times: dict[int, float] = {}

    def op_time(tok: int) -> float:
        if tok not in op_times:
            op_times[tok] = sync + cost.compute_seconds(
                "expert", model.expert_flops(tok), model.expert_io_bytes(tok), tok, phase="decode"
            )
        return op_times[tok]

    def expert_times(tokens: np.ndarray, ops: np.ndarray) -> np.ndarray:
        """The time of `ops` expert ops sharing `tokens` tokens, elementwise (each op's tokens
        rounded: an op runs whole tokens); costed once per distinct token count."""
        per_op = np.maximum(1, np.rint(tokens / ops)).astype(np.int64)
        distinct, where = np.unique(per_op, return_inverse=True)
        times = np.array([op_time(int(t)) for t in distinct])[where.reshape(per_op.shape)]
        return ops * times

    def group_terms(ns: np.ndarray) -> dict[str, np.ndarray]:
        """The expert terms of groups of n batches, for every n in `ns` at once."""
        act = expert_activity(model, popularity, ns * batch_size)
        # per batch: n ops, each over its share of the tokens
        ops = (ns if impl.per_batch_experts else np.ones_like(ns))[:, None, None]
        hot = expert_times(act["hot_tokens"], ops).sum(axis=-1).mean(axis=-1)
        cold = (act["cold_p_used"] * expert_times(act["cold_tokens_if_used"], ops)).sum(axis=-1).mean(axis=-1)
        return {"t_c_hotE": hot, "sum_Q_t_cE": cold, "Q": act["cold_p_used"].sum(axis=-1).mean(axis=-1)}

    def terms_at(n: int) -> dict[str, float]:
        return {key: float(value[0]) for key, value in group_terms(np.array([n])).items()}

    def inequalities(n: int | np.ndarray) -> tuple[Inequality, ...]:
        """(4)-(7) at n, or elementwise for an array of n (then each side is an array)."""
        g = terms_at(int(n)) if np.ndim(n) == 0 else group_terms(np.asarray(n, dtype=np.int64))
        base = n * (t["t_cA"] + t["t_cG"])
        return (
            Inequality("(4) n*t_cA >= t_IO_G", n * t["t_cA"], t["t_IO_G"]),
            Inequality("(5) n*(t_cA+t_cG) >= t_IO_G + K*t_IO_E", base, t["t_IO_G"] + K * t["t_IO_E"]),
            Inequality(
                "(6) ... + t_c_hotE >= t_IO_G + (K+1)*t_IO_E", base + g["t_c_hotE"], t["t_IO_G"] + (K + 1) * t["t_IO_E"]
            ),
            Inequality(
                "(7) ... + sum_Q t_cE >= t_IO_G + (K+|Q|)*t_IO_E + t_IO_A",
                base + g["t_c_hotE"] + g["sum_Q_t_cE"],
                t["t_IO_G"] + (K + g["Q"]) * t["t_IO_E"] + t["t_IO_A"],
            ),
        )

    n_io = None  # n a block of _CANDIDATES_PER_PASS at a time: the same terms as n by n, until one holds
    for low in range(1, n_max + 1, _CANDIDATES_PER_PASS):
        candidates = np.arange(low, min(n_max, low + _CANDIDATES_PER_PASS - 1) + 1)
        # (each side an array here: numpy's stubs take a list of arrays, or of bools, not of their union)
        holds = np.logical_and.reduce(
            [
                ineq.lhs >= ineq.rhs  # type: ignore[arg-type]
                for ineq in inequalities(candidates)
            ]
        )
        if holds.any():
            n_io = int(candidates[holds][0])
            break
    capacity = profile.gpu.usable_bytes

    def largest_fitting(pl: Placement) -> int:
        return largest_fitting_n(model, profile, batch_size, prompt_len, gen_len, pl, n_max=n_max)

    want = n_io or n_max
    if n_io is None:
        notes.append(
            f"no n <= {n_max} closes the bubbles on this hardware: the link is too slow for the "
            f"compute (try a calibrated profile); taking the most that memory allows"
        )
    n_memory = largest_fitting(placement)
    if n_memory == 0 and placement.kv == "gpu":
        notes.append(
            "not even one batch's KV cache fits on the GPU next to the weight buffers: KV cache "
            "moved to host memory (loaded per batch and layer over PCIe)"
        )
        placement = replace(placement, kv="cpu")
        n_memory = largest_fitting(placement)
    if n_memory == 0:
        one = memory_needed(model, batch_size, 1, prompt_len, gen_len, placement)
        largest = max((k for k in one if k != "total"), key=one.__getitem__)
        notes.append(
            f"not even one batch fits: it needs {memory_text(one['total'])} ({largest} "
            f"{memory_text(one[largest])} the largest part) but {memory_text(capacity)} are usable: "
            f"the run will report out-of-memory"
        )
        n = 1
    elif want > n_memory:
        mem = memory_needed(model, batch_size, want, prompt_len, gen_len, placement)
        notes.append(
            f"n lowered from {want} to {n_memory}: {want} batches need {mem['total'] / GIB:.1f} GiB "
            f"(KV cache {mem['kv_cache'] / GIB:.1f} GiB) but {capacity / GIB:.1f} GiB are usable"
        )
        n = n_memory
    else:
        n = want
    n_host = largest_storable_n(model, profile, batch_size, prompt_len, gen_len, placement, n_max)
    if n_memory and n > max(n_host, 1):  # the KV cache in host memory: as many batches as it holds
        if n_host:
            stored = storage_needed(model, placement, batch_size, n, prompt_len, gen_len)["host"]
            have = memory_text(profile.host.memory_bytes)
            why = f"{n} batches keep {memory_text(stored)} there but the host has {have}"
        else:
            why = "not even one batch fits there beside the weights kept there (the run is refused)"
        notes.append(f"n lowered from {n} to {max(n_host, 1)}: with the KV cache in host memory, {why}")
        n = max(n_host, 1)
    if resident_layers and n_memory and n <= n_memory:
        placement = fill_resident_layers(model, profile, batch_size, n, prompt_len, gen_len, placement)
        if placement.resident_layers:
            notes.append(f"{placement.resident_layers} layer(s) kept resident on the GPU with the spare memory")
    terms = dict(t)
    terms.update(terms_at(n))
    return Plan(
        n=n,
        n_io=n_io,
        n_memory=n_memory,
        placement=placement,
        terms=terms,
        inequalities=inequalities(n),
        memory=memory_needed(model, batch_size, n, prompt_len, gen_len, placement),
        notes=tuple(notes),
    )


def format_plan(p: Plan, model: ModelSpec, profile: HardwareProfile, batch_size: int) -> str:
    ms = 1e3
    lines = [
        f"planner: {model.name} on {profile.name}, batch size {batch_size}, K = {model.top_k} hot experts",
        "terms (ms):",
    ]
    labels = {
        "t_cA": "attention of one batch",
        "t_cG": "gate of one batch",
        "t_IO_G": "gate transfer",
        "t_IO_E": "one expert transfer",
        "t_IO_A": "attention transfer",
        "t_c_hotE": "hot experts over the group",
        "sum_Q_t_cE": "cold experts over the group",
    }
    for key, label in labels.items():
        lines.append(f"  {key:11} {p.terms[key] * ms:10.3f}   {label}")
    lines.append(f"  {'|Q|':11} {p.terms['Q']:10.2f}   expected cold experts per layer")
    lines.append(
        f"smallest n meeting (4)-(7): {p.n_io if p.n_io is not None else 'none'}; memory allows n <= {p.n_memory}"
    )
    lines.append(f"at n = {p.n}:")
    for ineq in p.inequalities:
        lines.append(
            f"  {ineq.name:55} {ineq.lhs * ms:10.3f} >= {ineq.rhs * ms:10.3f}  {'ok' if ineq.holds else 'NOT MET'}"
        )
    lines.append(
        "GPU memory: "
        + ", ".join(f"{k} {v / GIB:.2f} GiB" for k, v in p.memory.items())
        + f" (usable {profile.gpu.usable_bytes / GIB:.2f} GiB)"
    )
    lines.append(f"placement: {p.placement.describe()}")
    lines.extend(f"note: {note}" for note in p.notes)
    lines.append(f"=> n = {p.n}")
    return "\n".join(lines)
