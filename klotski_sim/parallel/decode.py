"""A MoE model's decode steps on G GPUs under expert or tensor parallelism, replayed from routing.

Expert parallelism (EP, with data-parallel attention as DeepSpeed-MoE and vLLM's EP run it): each
sequence lives on one rank, which computes its attention and gate; its hidden state is sent to every
other rank that holds one of its top-k experts (all-to-all dispatch; once per destination rank, as
DeepEP and vLLM's all2all backends deduplicate), the experts compute there, and the results come
back (all-to-all combine). A layer waits for its busiest rank at both collectives.

Tensor parallelism (TP, Megatron-LM's split; Shoeybi et al. 2019): every rank computes every
sequence with 1/G of the attention heads and 1/G of each expert's FFN columns; an all-reduce of the
hidden states ends the attention and another the MoE layer (two a layer).

What a step costs is the cost model's (`core.cost.CostModel`, the profile's roofline and measured
tables) for each rank's ops, and `collectives` for the fabric's. A rank's routed experts of a layer
are one fused kernel, as in the engines that run EP and TP (vLLM's fused_moe; the serving policies'
`moe` op): its FLOPs those of the tokens it computes, its bytes the weights of the experts they
use, so a replica splits the tokens but reads its expert's weights again.

Weights that do not fit (EP): each rank keeps on its GPU as many of its experts of every layer as its
memory leaves after the non-expert weights, its spare replica slots, its sequences' KV cache and two
staging slots for the experts it copies in — the ones its layer's prompts used most — and the others
in host memory. A decode step copies each used
host-resident expert to its rank over the rank's own PCIe link once its tokens arrive (the dispatch
ends), the ranks' links sharing the host's memory bandwidth (the profile's `cpu.memory_bandwidth`);
the rank computes its resident experts while they load and each loaded one as it lands, so its expert
phase lasts max(compute, loads + one expert's compute): per-rank offloading in Klotski's order (hot,
resident experts first) without its prefetch (`parallel.events` times the same plan in the event
engine, with per-rank resources and, on request, each rank's prefetch). A configuration whose non-expert weights, replicas and
KV cache alone exceed a GPU, or whose offloaded experts exceed host memory, is refused with the numbers.
Placement, replication and grouping decide from routing already seen: the experts are placed and
sequences grouped from the prompts' routing (prefill-to-decode correlation), replicas for a step
are predicted from the step before it; nothing reads the routing of the step it decides.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import NamedTuple

import numpy as np

from klotski_sim.core.collectives import all_to_all_seconds, best_all_reduce
from klotski_sim.core.cost import CostModel
from klotski_sim.hardware.profile import FabricSpec, HardwareProfile
from klotski_sim.parallel.placement import ExpertPlacement, balance, place, replicate
from klotski_sim.util.errors import MissingCapability, UsageError
from klotski_sim.workload.model import ModelSpec
from klotski_sim.workload.routing import RoutingTable

PARALLELISMS = ("ep", "tp")
# GPU memory slots an offloading EP rank keeps for the experts it copies in: two, so one expert lands
# while the one before it computes (the double buffer of Klotski's and FlexGen's weight copies)
STAGING_SLOTS = 2


@dataclass(frozen=True)
class ParallelSetup:
    """One way to spread a model over `gpus` GPUs."""

    gpus: int
    parallelism: str = "ep"  # ep | tp
    placement: str = "round-robin"  # ExpertPlacement kind (EP only)
    spare_slots: int = 0  # replica slots a rank keeps per layer (EP only)
    grouping: bool = False  # sequences to the ranks their experts live on (EP only)

    @property
    def label(self) -> str:
        if self.parallelism == "tp":
            return f"tp{self.gpus}"
        parts = [f"ep{self.gpus}", self.placement]
        if self.spare_slots:
            parts.append(f"+{self.spare_slots} replicas")
        if self.grouping:
            parts.append("grouped")
        return " ".join(parts)


@dataclass(frozen=True)
class ParallelResult:
    """What a decode step costs and where its time goes, averaged over the run's decode steps."""

    setup: ParallelSetup
    step_s: float  # one decode step of every sequence
    tokens_per_s: float
    load_imbalance: float  # max / mean per-rank expert tokens, mean over layers and steps (1 = even)
    all_to_all_bytes: float  # dispatch + combine bytes crossing the fabric per step
    collective_s: float  # of step_s: the fabric's collectives
    utilisation: tuple[float, ...]  # per rank: its compute time / step_s
    replica_bytes: float  # per rank at most, over all MoE layers: extra expert copies held
    rank_bytes: float  # per rank at most: weights, replicas and KV cache
    offloaded_bytes: float = 0.0  # per rank at most: its experts kept in host memory (EP)
    streamed_bytes: float = 0.0  # host-to-GPU expert copies per step, all ranks


def coactivation(ids: np.ndarray, num_experts: int) -> np.ndarray:
    """`co[a, b]`: tokens whose top-k holds both a and b (ids `[tokens, k]`)."""
    onehot = np.zeros((ids.shape[0], num_experts), dtype=np.float64)
    np.put_along_axis(onehot, ids.astype(np.int64), 1.0, axis=1)
    co = onehot.T @ onehot
    np.fill_diagonal(co, 0.0)
    return co


def group_sequences(affinity: np.ndarray, ranks: int) -> np.ndarray:
    """Each sequence's rank: the one holding the experts its prompt chose most (`affinity[s, r]`:
    its prompt's choices, over all MoE layers, of experts whose home is rank r), with at most
    ceil(S / ranks) sequences a rank, the sequences with the clearest preference placed first
    (workload-aware micro-batch grouping, shared/docs/MULTIGPU.md)."""
    sequences = affinity.shape[0]
    cap = -(-sequences // ranks)
    order = np.argsort(-(affinity.max(axis=1) - affinity.mean(axis=1)), kind="stable")
    room = np.full(ranks, cap)
    rank_of = np.empty(sequences, dtype=np.int64)
    for s in order:
        choices = [r for r in np.argsort(-affinity[s], kind="stable") if room[r] > 0]
        rank_of[s] = choices[0]
        room[choices[0]] -= 1
    return rank_of


def _route_tokens(
    ids: np.ndarray, home_rank: np.ndarray, placement: ExpertPlacement, assigned: np.ndarray
) -> np.ndarray:
    """`rank[t, slot]` computing token t's slot-th expert: its own rank when that holds a replica with
    quota left, else the replicas in order of their quota (`assigned[e, r]`, from `balance`)."""
    rank = np.empty(ids.shape, dtype=np.int64)
    quota = assigned.copy()
    flat_tokens, flat_slots = np.indices(ids.shape).reshape(2, -1)
    experts = ids[flat_tokens, flat_slots]
    for e in np.unique(experts):
        where = placement.replicas[e]
        picks = np.flatnonzero(experts == e)
        if len(where) == 1:
            rank[flat_tokens[picks], flat_slots[picks]] = where[0]
            continue
        left = []
        for p in picks:
            h = home_rank[flat_tokens[p]]
            if h in where and quota[e, h] > 0:
                rank[flat_tokens[p], flat_slots[p]] = h
                quota[e, h] -= 1
            else:
                left.append(p)
        for p in left:
            r = max(where, key=lambda r: quota[e, r])
            rank[flat_tokens[p], flat_slots[p]] = r
            quota[e, r] -= 1
    return rank


def dispatch_bytes(compute_rank: np.ndarray, home_rank: np.ndarray, ranks: int, token_bytes: int) -> np.ndarray:
    """`sent[i, j]`: bytes of hidden states rank i sends rank j, each token once per distinct rank
    other than its own that computes one of its experts."""
    sent = np.zeros((ranks, ranks))
    for t in range(compute_rank.shape[0]):
        for r in set(compute_rank[t].tolist()) - {int(home_rank[t])}:
            sent[home_rank[t], r] += token_bytes
    return sent


@dataclass(frozen=True)
class EpLayer:
    """One MoE layer of one decode step under EP, as the plan decides it: the placement with this
    step's replicas, the tokens each rank computes of each expert (`assigned[e, r]`), which rank
    computes each token's experts (`compute_rank[t, slot]`) and the bytes each rank dispatches to
    each other (`sent[i, j]`; combine sends them back)."""

    step: int  # decode step, 0-based (the run's step step + 1)
    layer: int
    placement: ExpertPlacement
    assigned: np.ndarray
    compute_rank: np.ndarray
    sent: np.ndarray
    ids: np.ndarray  # [sequence, k] the experts each token chose


@dataclass(frozen=True)
class EpPlan:
    """What expert parallelism decides before anything is timed, from routing already seen
    (module docstring): each sequence's rank, each layer's placement, what stays in host memory,
    and per decode step and MoE layer the tokens' ranks. The analytic timing (`simulate_decode`)
    and the event engine's (`parallel.events`) both read it."""

    setup: ParallelSetup
    home_rank: np.ndarray  # [sequence] its rank
    seqs_on: np.ndarray  # [rank] its sequences
    offload: "Offload | None"
    layers: tuple[EpLayer, ...]  # in step, then layer order
    replica_bytes: float  # per rank at most

    @property
    def imbalance(self) -> list[float]:
        """Per step and MoE layer: the busiest rank's expert tokens over the mean."""
        loads = [layer.assigned.sum(axis=0) for layer in self.layers]
        return [float(per_rank.max() / max(per_rank.mean(), 1e-12)) for per_rank in loads]


def plan_expert_parallel(
    model: ModelSpec,
    profile: HardwareProfile,
    routing: RoutingTable,
    setup: ParallelSetup,
    compressed_size: float | None = None,
) -> EpPlan:
    """Placement, grouping, offloading (with a compressed GPU tier of experts stored at
    `compressed_size` of their size, if given) and each step's replicas and token routes (see EpPlan)."""
    shape, G, E = routing.shape, setup.gpus, model.num_experts
    S = shape.num_sequences
    prompt = routing.ids[:, :, : shape.prompt_len].reshape(S, shape.prompt_len, model.num_layers, -1)
    decode = routing.decode_ids.reshape(S, shape.gen_len - 1, model.num_layers, -1)
    placements: dict[int, ExpertPlacement] = {}
    prompt_load: dict[int, np.ndarray] = {}
    for layer in model.moe_layers:
        chosen = prompt[:, :, layer].reshape(-1, routing.top_k)
        load = np.bincount(chosen.reshape(-1).astype(np.int64), minlength=E).astype(float)
        prompt_load[layer] = load
        co = coactivation(chosen, E) if setup.placement == "coactivation" else np.zeros((E, E))
        placements[layer] = place(setup.placement, load, co, G)
    home_rank = np.arange(S) % G
    if setup.grouping:
        signature = np.zeros((S, G))
        for layer in model.moe_layers:
            homes = placements[layer].home()
            for s in range(S):
                signature[s] += np.bincount(homes[prompt[s, :, layer].reshape(-1).astype(np.int64)], minlength=G)
        home_rank = group_sequences(signature, G)
    seqs_on = np.bincount(home_rank, minlength=G)
    offload = _offload(
        model, profile, setup, placements, prompt_load, shape.prompt_len + shape.gen_len, seqs_on, compressed_size
    )
    token_bytes = model.hidden_bytes(1)
    replica_bytes = 0.0
    previous: dict[int, np.ndarray] = {}
    layers = []
    for step in range(shape.gen_len - 1):
        for layer in model.moe_layers:
            ids = decode[:, step, layer].astype(np.int64)  # [S, k]
            placement = placements[layer]
            tokens = np.bincount(ids.reshape(-1), minlength=E)
            if setup.spare_slots:
                predicted = previous.get(
                    layer, np.bincount(prompt[:, :, layer].reshape(-1).astype(np.int64), minlength=E) / shape.prompt_len
                )
                placement = replicate(placement, predicted, setup.spare_slots)
                extra = float(placement.experts_on().max() - -(-E // G)) * model.expert_bytes() * len(model.moe_layers)
                replica_bytes = max(replica_bytes, extra)
            previous[layer] = tokens.astype(float)
            assigned = balance(placement, tokens)
            compute_rank = _route_tokens(ids, home_rank, placement, assigned)
            sent = dispatch_bytes(compute_rank, home_rank, G, token_bytes)
            layers.append(EpLayer(step, layer, placement, assigned, compute_rank, sent, ids))
    return EpPlan(setup, home_rank, seqs_on, offload, tuple(layers), replica_bytes)


def check_setup(model: ModelSpec, profile: HardwareProfile, routing: RoutingTable, setup: ParallelSetup) -> FabricSpec:
    """Refuse, in one line, what no timing of this setup can run; the machine's fabric otherwise."""
    fabric = machine_fabric(profile, setup.gpus)
    if setup.parallelism not in PARALLELISMS:
        raise UsageError(f"parallelism {setup.parallelism!r}: one of {', '.join(PARALLELISMS)}")
    if setup.parallelism == "tp" and model.mla:
        raise UsageError(mla_tensor_parallel(model))
    if setup.parallelism == "tp":
        check_splits(model, setup.gpus)
    if routing.shape.gen_len < 2:
        raise UsageError("a parallel decode run needs at least 2 generated tokens (--gen-len 2): it times decode steps")
    return fabric


def simulate_decode(
    model: ModelSpec, profile: HardwareProfile, routing: RoutingTable, setup: ParallelSetup
) -> ParallelResult:
    """Every decode step of `routing` on `setup.gpus` GPUs of `profile` (see the module's docstring),
    each layer timed as its slowest rank's phases in a row (`parallel.events` times the same plan
    in the event engine)."""
    fabric = check_setup(model, profile, routing, setup)
    if setup.parallelism == "tp":  # (the group's model: KV heads copied where the ranks outnumber them)
        return _tensor_parallel(kv_replicated(model, setup.gpus), profile, routing, setup, fabric)
    shape, G = routing.shape, setup.gpus
    cost = CostModel(profile)
    plan = plan_expert_parallel(model, profile, routing, setup)
    offload, seqs_on = plan.offload, plan.seqs_on
    moe_at = {(p.step, p.layer): p for p in plan.layers}
    streamed_total = 0.0
    steps = shape.gen_len - 1
    step_total, collective_total, a2a_total = 0.0, 0.0, 0.0
    busy = np.zeros(G)
    for step in range(steps):
        kv_len = shape.prompt_len + step + 1
        for layer in range(model.num_layers):
            attention = np.array(
                [sum(seconds(cost, w) for w in works) for works in rank_attention(model, seqs_on, kv_len, layer)]
            )
            if not model.is_moe(layer):
                step_total += float(attention.max())
                busy += attention
                continue
            planned = moe_at[(step, layer)]
            assigned, sent = planned.assigned, planned.sent
            dispatch, combine = all_to_all_seconds(sent, fabric), all_to_all_seconds(sent.T, fabric)
            expert_s = np.array([seconds(cost, fused_moe(model, assigned[:, r])) for r in range(G)])
            busy += attention + expert_s  # (computing: a rank waiting for its copies is not busy)
            if offload is not None:  # the used experts held in host memory load once the tokens are there
                loaded = offload.streamed(layer, planned.placement, assigned)  # [rank] experts copied
                used = np.maximum(1, (assigned > 0).sum(axis=0))
                load_s = loaded * model.expert_bytes() / offload.link_rate
                expert_s = np.where(loaded > 0, np.maximum(expert_s, load_s + expert_s / used), expert_s)
                streamed_total += float(loaded.sum()) * model.expert_bytes()
            step_total += float(attention.max()) + dispatch + float(expert_s.max()) + combine
            collective_total += dispatch + combine
            a2a_total += 2 * float(sent.sum())
    step_s = step_total / steps
    return ep_result(
        model,
        profile,
        plan,
        shape.prompt_len + shape.gen_len,
        step_s=step_s,
        collective_s=collective_total / steps,
        utilisation=tuple(float(b / step_total) for b in busy),
        all_to_all_bytes=a2a_total / steps,
        streamed_bytes=streamed_total / steps,
    )


def ep_result(
    model: ModelSpec,
    profile: HardwareProfile,
    plan: EpPlan,
    tokens: int,
    *,
    step_s: float,
    collective_s: float,
    utilisation: tuple[float, ...],
    all_to_all_bytes: float,
    streamed_bytes: float,
) -> ParallelResult:
    """An EP run's result from its plan and its timing; refused when a rank's GPU cannot hold it."""
    setup, offload = plan.setup, plan.offload
    imbalance = plan.imbalance
    result = ParallelResult(
        setup=setup,
        step_s=step_s,
        tokens_per_s=len(plan.home_rank) / step_s,
        load_imbalance=float(np.mean(imbalance)) if imbalance else 1.0,
        all_to_all_bytes=all_to_all_bytes,
        collective_s=collective_s,
        utilisation=utilisation,
        replica_bytes=plan.replica_bytes,
        rank_bytes=_rank_bytes(model, setup, tokens, int(plan.seqs_on.max()), len(plan.home_rank), plan.replica_bytes)
        - (offload.host_bytes + offload.compressed_saving - offload.staging_bytes if offload is not None else 0.0),
        offloaded_bytes=offload.host_bytes if offload is not None else 0.0,
        streamed_bytes=streamed_bytes,
    )
    _check_rank_room(profile, result)
    return result


def _check_rank_room(profile: HardwareProfile, result: ParallelResult) -> None:
    room = profile.gpu.memory_bytes - profile.gpu.reserved_bytes
    if result.rank_bytes > room:
        raise UsageError(
            f"{result.setup.label}: a rank would hold {result.rank_bytes / 1e9:.1f} GB (weights, replicas, KV cache) "
            f"but {profile.name}'s GPU has {room / 1e9:.1f} GB: more GPUs, fewer sequences, or offloading "
            f"(not yet modelled across ranks)"
        )


def _tensor_parallel(
    model: ModelSpec, profile: HardwareProfile, routing: RoutingTable, setup: ParallelSetup, fabric: FabricSpec
) -> ParallelResult:
    """TP's decode steps: each layer's shards on every rank at once, two all-reduces a layer."""
    shape, G, E = routing.shape, setup.gpus, model.num_experts
    S = shape.num_sequences
    decode = routing.decode_ids.reshape(S, shape.gen_len - 1, model.num_layers, -1)
    cost = CostModel(profile)
    steps = shape.gen_len - 1
    step_total, collective_total = 0.0, 0.0
    for step in range(steps):
        kv_len = shape.prompt_len + step + 1
        for layer in range(model.num_layers):
            ids = decode[:, step, layer].astype(np.int64)  # [S, k]
            sharded = sum(seconds(cost, w) for w in sequence_work(model, S, kv_len, layer)) / G
            if model.is_moe(layer):
                sharded += seconds(cost, fused_moe(model, np.bincount(ids.reshape(-1), minlength=E), 1.0 / G))
            ar, _ = best_all_reduce(model.hidden_bytes(S), G, fabric)
            collective_total += 2 * ar
            step_total += sharded + 2 * ar
    busy = step_total - collective_total
    result = ParallelResult(
        setup=setup,
        step_s=step_total / steps,
        tokens_per_s=S / (step_total / steps),
        load_imbalance=1.0,
        all_to_all_bytes=0.0,
        collective_s=collective_total / steps,
        utilisation=tuple(busy / step_total for _ in range(G)),
        replica_bytes=0.0,
        rank_bytes=_rank_bytes(model, setup, shape.prompt_len + shape.gen_len, 0, S, 0.0),
    )
    _check_rank_room(profile, result)
    return result


@dataclass(frozen=True)
class Offload:
    """Which of each rank's experts stay in host memory under EP, and the rate they load at."""

    on_gpu: dict[int, np.ndarray]  # layer -> [expert, rank]: the expert's copy on that rank is on its GPU
    host_bytes: float  # per rank at most: its experts held in host memory
    link_rate: float  # bytes/s of one rank's host-to-GPU copies with every rank copying at once
    staging_bytes: float  # per rank: GPU memory the experts it copies land in (STAGING_SLOTS of them)
    # a compressed GPU tier (FluxMoE's, per rank): layer -> [expert, rank] held compressed on that
    # rank's GPU (decompressed into a staging slot when used), and the bytes compression saves a rank
    compressed: dict[int, np.ndarray] = field(default_factory=dict)
    compressed_saving: float = 0.0

    def held(self, layer: int, placement: ExpertPlacement) -> np.ndarray:
        """`[expert, rank]`: that rank's copy of the expert is on its GPU uncompressed, ready to
        compute. A replica always is (spare slots are GPU memory)."""
        on_gpu = self.on_gpu[layer].copy()
        home = placement.home()
        for e, ranks in enumerate(placement.replicas):
            for r in ranks:
                if r != home[e]:
                    on_gpu[e, r] = True
        return on_gpu

    def streamed(self, layer: int, placement: ExpertPlacement, assigned: np.ndarray) -> np.ndarray:
        """Per rank: the experts it computes this step (`assigned[e, r]` tokens) whose copy there
        is in host memory (neither `held` nor in a compressed tier)."""
        on_gpu = self.held(layer, placement)
        if layer in self.compressed:
            on_gpu |= self.compressed[layer]
        return ((assigned > 0) & ~on_gpu).sum(axis=0)


def _offload(
    model: ModelSpec,
    profile: HardwareProfile,
    setup: ParallelSetup,
    placements: dict[int, ExpertPlacement],
    prompt_load: dict[int, np.ndarray],
    tokens: int,
    seqs_on: np.ndarray,
    compressed_size: float | None = None,
) -> Offload | None:
    """The experts each rank keeps on its GPU when they do not all fit (module docstring): the slots
    its memory leaves, spread evenly over the layers and given to the rank's most-used experts on the
    prompts; None when every expert fits. Refused in one line when the rest alone does not fit, or host memory cannot
    hold what is offloaded. With `compressed_size` (a compressed expert's share of its size) a
    compressed GPU tier first: as many experts as fit compressed stay on the GPU (decompressing
    beats any PCIe copy), the hottest of them uncompressed as far as the memory left allows."""
    G, E, expert = setup.gpus, model.num_experts, model.expert_bytes()
    moe = model.moe_layers
    room = profile.gpu.memory_bytes - profile.gpu.reserved_bytes
    fixed = without_experts(model, tokens, int(seqs_on.max())) + setup.spare_slots * expert * len(moe)
    per_rank = {layer: placements[layer].experts_on() for layer in moe}  # [rank] home experts
    held = sum(int(experts.max()) for experts in per_rank.values())  # the busiest rank's, over the layers
    budget = int((room - fixed) // expert) if room > fixed else -1  # experts a rank's GPU can hold
    if budget >= held:
        return None
    budget -= STAGING_SLOTS  # (the copies need somewhere to land)
    if budget < 0:
        raise UsageError(
            f"{setup.label}: a rank would hold {fixed / 1e9:.1f} GB of non-expert weights, replica slots and KV "
            f"cache and {STAGING_SLOTS} experts' staging ({STAGING_SLOTS * expert / 1e9:.2f} GB) alone, but "
            f"{profile.name}'s GPU has {room / 1e9:.1f} GB: more GPUs or fewer sequences"
        )
    plain, packed = budget, 0  # experts a rank holds uncompressed, compressed
    if compressed_size is not None:
        if compressed_size * held <= budget:
            plain = int((budget - compressed_size * held) // (1 - compressed_size))
            packed = held - plain
        else:
            plain, packed = 0, int(budget // compressed_size)
    # the uncompressed spread over the layers as evenly as it goes (the first layers one more); the
    # compressed one at a time to the layers with the most experts left, each layer's shares given to
    # each rank's experts its prompts used most, the uncompressed first
    share, more = divmod(plain, len(moe))
    firsts = [share + (i < more) for i in range(len(moe))]
    left = [max(0, int(per_rank[layer].max()) - first) for layer, first in zip(moe, firsts)]
    thens = [0] * len(moe)
    for _ in range(packed):
        i = max(range(len(moe)), key=lambda j: (left[j] - thens[j], -j))
        if left[i] - thens[i] <= 0:
            break
        thens[i] += 1
    packed = sum(thens)
    on_gpu: dict[int, np.ndarray] = {}
    compressed: dict[int, np.ndarray] = {}
    for i, layer in enumerate(moe):
        home = placements[layer].home()
        keep = np.zeros((E, G), dtype=bool)
        pack = np.zeros((E, G), dtype=bool)
        first, then = firsts[i], thens[i]
        for r in range(G):
            mine = np.flatnonzero(home == r)
            hottest = mine[np.argsort(-prompt_load[layer][mine], kind="stable")]
            keep[hottest[:first], r] = True
            pack[hottest[first : first + then], r] = True
        on_gpu[layer] = keep
        if compressed_size is not None:
            compressed[layer] = pack
    host_bytes = float(max(0, held - plain - packed) * expert)
    if profile.host.memory_bytes < G * host_bytes:
        raise UsageError(
            f"{setup.label}: the ranks would offload {G * host_bytes / 1e9:.1f} GB of experts to host memory, "
            f"but {profile.name} has {profile.host.memory_bytes / 1e9:.1f} GB"
        )
    link = profile.link("pcie_h2d").bandwidth
    shared = profile.cpu.memory_bandwidth / G if profile.cpu is not None else float("inf")
    saving = float(packed * expert * (1 - compressed_size)) if compressed_size is not None else 0.0
    return Offload(on_gpu, host_bytes, min(link, shared), float(STAGING_SLOTS * expert), compressed, saving)


def mla_tensor_parallel(model: ModelSpec) -> str:
    """Why an MLA model's tensor parallelism is refused (no ": " in it: a row of `parallel` shows it whole)."""
    return (
        f"multi-head latent attention keeps {model.name}'s compressed KV cache whole on every "
        f"tensor-parallel rank (not split by heads), which is not modelled"
    )


def check_splits(model: ModelSpec, gpus: int) -> None:
    """Refuse, in one line, a model whose attention cannot be split over `gpus` tensor-parallel ranks."""
    if gpus == 1:
        return
    if model.mla:
        raise MissingCapability(
            f"--gpus {gpus}: {mla_tensor_parallel(model)} (klotski-sim parallel --parallelism ep times its "
            f"decode with expert parallelism)"
        )
    kv = model.num_kv_heads
    if model.num_heads % gpus or (kv % gpus if gpus <= kv else gpus % kv):
        raise MissingCapability(
            f"--gpus {gpus}: tensor parallelism splits attention by heads, and {model.name} has "
            f"{model.num_heads} query and {kv} KV heads: give a G that divides both (or, above {kv}, a "
            f"multiple of the KV heads that divides the query heads: each rank then keeps a copy of one KV head)"
        )


def kv_replicated(model: ModelSpec, gpus: int) -> ModelSpec:
    """The model as `gpus` tensor-parallel ranks hold it. With fewer KV heads than ranks, each rank
    keeps a copy of one KV head, its cache and its K/V projections (vLLM's QKVParallelLinear
    replicates them when the group is a multiple of the KV heads): the group holds and reads `gpus`
    KV heads' worth, so a rank's decode attention reads 1/KV of the cache, not 1/G."""
    return model if gpus <= model.num_kv_heads else replace(model, num_kv_heads=gpus)


def machine_fabric(profile: HardwareProfile, gpus: int) -> FabricSpec:
    """The profile's fabric, refused in one line when it has none or fewer GPUs than asked for."""
    if gpus < 1:
        raise UsageError(f"--gpus {gpus}: at least 1")
    if gpus == 1:
        return profile.fabric or FabricSpec(kind="pcie", gpus=1, bandwidth=1.0, base_latency_s=0.0, step_latency_s=0.0)
    if profile.fabric is None:
        raise MissingCapability(
            f"--gpus {gpus}: hardware profile {profile.name!r} has no `fabric:` section (kind, gpus, bandwidth, "
            f"base_latency_s, step_latency_s); pick one that has it (h200, h20, l40s) or add it"
        )
    if gpus > profile.fabric.gpus:
        raise MissingCapability(f"--gpus {gpus}: hardware profile {profile.name!r} has {profile.fabric.gpus} GPUs")
    return profile.fabric


class Work(NamedTuple):
    """One compute op of a rank: what the cost model needs to time it (the analytic timing costs
    it, the event engine's op carries it)."""

    category: str
    flops: float
    io_bytes: float
    tokens: int
    kv_len: int = 0
    phase: str = ""


def seconds(cost: CostModel, work: Work | None) -> float:
    if work is None:
        return 0.0
    return cost.compute_seconds(work.category, work.flops, work.io_bytes, work.tokens, work.kv_len, work.phase)


def sequence_work(model: ModelSpec, sequences: int, kv_len: int, layer: int) -> list[Work]:
    """A rank's part of a layer besides its routed experts, for its `sequences`: attention with the
    gate, then a dense layer's MLP or a MoE layer's shared experts (where it has them)."""
    if sequences == 0:
        return []
    flops = model.attention_flops(sequences, 1, kv_len) + model.gate_flops(sequences, layer)
    io = model.attention_io_bytes(sequences, 1, kv_len) + model.gate_io_bytes(sequences, layer)
    works = [Work("attention", flops, io, sequences, kv_len, "decode")]
    if not model.is_moe(layer):
        flops = 2 * sequences * 3 * model.hidden_size * model.dense_ffn_size
        works.append(Work("dense_mlp", flops, model.dense_mlp_bytes() + 2 * model.hidden_bytes(sequences), sequences))
    elif model.num_shared_experts:
        flops = 2 * sequences * 3 * model.hidden_size * model.shared_ffn_size * model.num_shared_experts
        io = model.shared_expert_bytes() + 2 * model.hidden_bytes(sequences)
        works.append(Work("expert", flops, io, 0))
    return works


def fused_moe(model: ModelSpec, tokens: np.ndarray, share: float = 1.0) -> Work | None:
    """One fused MoE kernel over `tokens[e]` tokens of each expert, `share` of each expert's FFN
    (TP: 1 / G): the tokens' FLOPs, the used experts' weights and the tokens' activations (None:
    no token)."""
    used = int(np.count_nonzero(tokens))
    if not used:
        return None
    total = int(tokens.sum())
    flops = model.expert_flops(total) * share
    nbytes = used * model.expert_params() * model.dtype_bytes * share + 2 * model.hidden_bytes(total)
    return Work("moe", flops, nbytes, total)


def rank_attention(model: ModelSpec, seqs_on: np.ndarray, kv_len: int, layer: int) -> list[list[Work]]:
    """`sequence_work` of each rank for its sequences."""
    return [sequence_work(model, int(n), kv_len, layer) for n in seqs_on]


def _rank_bytes(
    model: ModelSpec, setup: ParallelSetup, tokens: int, seqs_on_rank: int, sequences: int, replicas: float
) -> float:
    """What one rank holds: EP keeps the non-expert weights on every rank and E/G experts of each
    MoE layer, plus its replicas and its sequences' KV cache; TP a G-th of all weights and caches."""
    G = setup.gpus
    if setup.parallelism == "tp":
        return (model.total_bytes() + model.kv_bytes(sequences, tokens)) / G
    experts = -(-model.num_experts // G) * model.expert_bytes() * len(model.moe_layers)
    return without_experts(model, tokens, seqs_on_rank) + experts + replicas


def without_experts(model: ModelSpec, tokens: int, sequences: int) -> float:
    """What every EP rank holds besides routed experts: the other weights and its sequences' KV cache."""
    return model.total_bytes() - model.routed_experts * model.expert_bytes() + model.kv_bytes(sequences, tokens)
