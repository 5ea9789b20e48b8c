"""FluxMoE: expert paging over a compressed GPU tier and host memory (SERVING.md "Mechanisms").

The routed experts of *pageable* MoE layers have no GPU memory of their own: every iteration they
are materialised into one of two reusable layer blocks (pageable layer k uses the block of layer
k-2, once the layer that read it has finished: write-after-read) from two backends, and the layer's
experts run only once both parts have landed (read-after-write):

- a *compressed GPU* tier: the experts stored losslessly compressed on the GPU (32.1% smaller,
  FluxMoE Table 3's smallest saving on bf16 experts; option `compressed_size`, which
  `klotski-runtime validate --serve` sets to its own coder's share measured on the weights it runs),
  decompressed on the GPU at the profile's `gpu.decompress_bandwidth`;
- *host memory*: pinned DRAM, copied over PCIe.

`fluxmoe` splits each pageable layer between the two in proportion to their bandwidths, so that
both parts land together ("bandwidth-balanced"), as far as GPU memory lets the compressed share
grow; `fluxmoe-h` (the paper's ablation) keeps each pageable layer wholly in one backend, the
earlier ones compressed. Attention, routers and shared experts stay resident.

Which layers are pageable, and how much of them is compressed, is a residency: with the defaults
it is the one that moves the fewest bytes over PCIe per iteration while the KV cache holds every
request that may run at once (`min(requests, max_num_seqs)`) at its full length, or, where no
residency can, the longest request alone. FluxMoE's own planner changes the residency during a
run as pressure changes (every 16 iterations); that planner is not modelled: the residency is
chosen before the run and kept.

Decompression runs on a GPU unit of its own beside the compute stream (`decompress_on=own`, as
FluxMoE's separate decompression streams), or serialised with compute (`decompress_on=compute`,
the bound where it takes all the SMs); the truth lies between.
"""

from __future__ import annotations

from dataclasses import dataclass

from klotski_sim.core.cost import COMPRESSED_SHARE
from klotski_sim.core.schedule import DEFAULT_STREAMS, ScheduleBuilder
from klotski_sim.hardware.profile import HardwareProfile
from klotski_sim.policies.options import option
from klotski_sim.serving.batcher import ServingRefusal
from klotski_sim.serving.emit import IterationEmitter
from klotski_sim.serving.memory import Residency, plan_memory
from klotski_sim.serving.policies.base import IterationSeen, ServingPolicy, ServingSetup, serving_policy
from klotski_sim.serving.policies.fluxmoe_planner import Feedback, ResidencyPlanner, Step

SHARE_STEPS = 32  # compressed shares tried below the balanced one


def balanced_share(profile: HardwareProfile, who: str) -> float:
    """The share of a layer's experts in the compressed tier that makes both tiers finish together:
    decompression rate / (decompression rate + PCIe rate)."""
    rate = profile.gpu.decompress_bandwidth
    if rate is None:
        raise ServingRefusal(
            f"{who}: hardware profile {profile.name!r} has no gpu.decompress_bandwidth; give one "
            f"with --set gpu.decompress_bandwidth=4e11 (FluxMoE measured 396.5-435.4e9 B/s)"
        )
    return rate / (rate + profile.links.pcie_h2d.bandwidth)


@dataclass(frozen=True)
class FluxMoEOptions:
    pageable_layers: int = option(
        -1, "MoE layers whose routed experts are paged every iteration (-1: chosen with the share below)", minimum=-1
    )
    compressed_share: float = option(
        -1.0,
        "share of the pageable experts in the compressed GPU tier (-1: the bandwidth-balanced share, or less "
        "where GPU memory is short)",
        minimum=-1.0,
        maximum=1.0,
    )
    decompress_on: str = option(
        "own",
        "own: a GPU decompression unit beside compute (FluxMoE's streams); compute: serialised with compute",
        choices=("own", "compute"),
    )
    compressed_size: float = option(
        COMPRESSED_SHARE,
        "stored size of compressed experts as a share of their bf16 size (default: FluxMoE's published 67.9%; "
        "klotski-runtime validate --serve gives its own coder's share measured on the very weights it runs)",
        minimum=0.01,
        maximum=1.0,
    )
    adaptive: bool = option(False, "FluxMoE's residency planner moves tensors between the tiers during the run")
    control_interval: int = option(16, "adaptive: iterations between the planner's decisions (FluxMoE's CI)", minimum=1)
    adjust_granularity: float = option(
        0.25, "adaptive: share of the pageable layers one step moves (FluxMoE's AG)", minimum=0.01, maximum=1.0
    )
    dead_zone: float = option(
        0.9,
        "adaptive: with no request waiting, the last step is reversed when the layers' forward time covers less "
        "than this share of their loads (FluxMoE's theta)",
        minimum=0.0,
        maximum=1.0,
    )


@dataclass(frozen=True)
class _Paging:
    layers: tuple[int, ...]  # pageable MoE layers, in order
    compressed: tuple[float, ...]  # per pageable layer, the share of its experts in the compressed tier


@serving_policy
class FluxMoE(ServingPolicy):
    name = "fluxmoe"
    description = "FluxMoE: pageable layers' experts materialised per iteration from a compressed GPU tier and host"
    Options = FluxMoEOptions
    whole_layers = False  # fluxmoe-h: each pageable layer in one backend

    def __init__(self, setup: ServingSetup) -> None:
        super().__init__(setup)
        m = self.model
        self._layer_bytes = [m.moe_layer_bytes(j) if m.is_moe(j) else 0 for j in range(m.num_layers)]
        self._total = m.total_bytes()

    def streams(self) -> dict[str, str]:
        where = "gpu_decompress" if self.options.get("decompress_on", "own") == "own" else "gpu"
        return {**DEFAULT_STREAMS, "decompress": where}

    # ---- residency ---------------------------------------------------------------------------------
    def _balanced_share(self) -> float:
        return balanced_share(self.profile, self.name)

    def _paging(self, count: int, share: float) -> _Paging:
        moe = [j for j in range(self.model.num_layers) if self.model.is_moe(j)]
        # spread over the stack: the resident layers between them give each materialisation time
        layers = tuple(sorted({moe[min(len(moe) - 1, int((k + 0.5) * len(moe) / count))] for k in range(count)}))
        if self.whole_layers:
            compressed = round(share * len(layers))
            return _Paging(layers, tuple(1.0 if k < compressed else 0.0 for k in range(len(layers))))
        return _Paging(layers, tuple(share for _ in layers))

    def _residency_of(self, paging: _Paging) -> Residency:
        size = self._layer_bytes
        paged = sum(size[j] for j in paging.layers)
        stored_share = self.options.get("compressed_size", COMPRESSED_SHARE)
        stored = sum(c * size[j] * stored_share for j, c in zip(paging.layers, paging.compressed))
        host = sum((1 - c) * size[j] for j, c in zip(paging.layers, paging.compressed))
        block = max((size[j] for j in paging.layers), default=0)
        return Residency(
            gpu_weight_bytes=int(self._total - paged + stored),
            buffer_bytes=min(2, len(paging.layers)) * block,
            offloaded_layers=paging.layers,
            host_weight_bytes=int(host),
        )

    def residency(self) -> Residency:
        m, s = self.model, self.setup
        balanced = self._balanced_share()
        moe_count = sum(1 for j in range(m.num_layers) if m.is_moe(j))
        count, share = self.options.get("pageable_layers", -1), self.options.get("compressed_share", -1.0)
        if count > moe_count:
            raise ServingRefusal(f"{self.name}: pageable_layers {count} is more than {m.name}'s {moe_count} MoE layers")
        counts = [count] if count >= 0 else list(range(moe_count + 1))
        shares = [share] if share >= 0 else [balanced * (1 - i / SHARE_STEPS) for i in range(SHARE_STEPS + 1)]
        longest = max(r.total_len - 1 for r in s.workload.requests)
        at_once = min(len(s.workload.requests), s.batching.max_num_seqs)
        blocks_each = -(-longest // s.batching.block_size)
        # KV target (requests held at once) -> the residency moving the fewest host bytes per iteration
        # (then the most compressed, then the fewest pageable layers)
        best: dict[int, tuple[tuple[float, float, int], _Paging, Residency]] = {}
        for n in counts:
            for c in shares:
                paging = self._paging(n, c) if n else _Paging((), ())
                residency = self._residency_of(paging)
                try:
                    plan = plan_memory(m, self.profile, residency, s.batching, s.gpu_memory_utilization, self.name)
                except ServingRefusal:
                    continue
                for target in (at_once, 1):
                    if plan.num_blocks >= target * blocks_each:
                        key = (float(residency.host_weight_bytes), -sum(paging.compressed), len(paging.layers))
                        if target not in best or key < best[target][0]:
                            best[target] = (key, paging, residency)
        for target in (at_once, 1):
            if target in best:
                _, paging, residency = best[target]
                if self.options.get("adaptive", False):
                    paging, residency = self._start_planner(paging)
                self._paging_chosen = paging
                note = (
                    "" if target == at_once else f" (no residency holds {at_once} requests at once: the longest alone)"
                )
                return Residency(
                    residency.gpu_weight_bytes,
                    residency.buffer_bytes,
                    residency.offloaded_layers,
                    host_weight_bytes=residency.host_weight_bytes,
                    notes=(
                        f"{len(paging.layers)} pageable layers, compressed share "
                        f"{(sum(paging.compressed) / len(paging.layers)) if paging.layers else 0:.2f} "
                        f"(balanced {balanced:.2f}){note}",
                    ),
                )
        raise ServingRefusal(
            f"{self.name}: no residency of {m.name} leaves {self.profile.name} a KV cache for the longest request "
            f"({longest:,} tokens), with {'every' if count < 0 else count} MoE layer(s) pageable"
        )

    # ---- the adaptive planner ---------------------------------------------------------------------
    def _start_planner(self, paging: _Paging) -> tuple[_Paging, Residency]:
        """The planner over the chosen pageable layers, starting from every tensor of them in the
        compressed tier (the most residency), less what the KV cache needs for the longest request
        (taken in the planner's own order); it reclaims more during the run as pressure demands."""
        m, s, o = self.model, self.setup, self.options
        self.planner = ResidencyPlanner(
            paging.layers,
            {j: self._layer_bytes[j] for j in paging.layers},
            {j: {"gate_up", "down"} for j in paging.layers},
            o.get("compressed_size", COMPRESSED_SHARE),
            s.batching.block_size * m.kv_bytes_per_token() * m.num_layers,
            o.get("control_interval", 16),
            o.get("adjust_granularity", 0.25),
            o.get("dead_zone", 0.9),
        )
        longest = max(r.total_len - 1 for r in s.workload.requests)
        need = -(-longest // s.batching.block_size)
        while True:
            snapped = _Paging(paging.layers, tuple(self.planner.share(j) for j in paging.layers))
            residency = self._residency_of(snapped)
            try:
                plan = plan_memory(m, self.profile, residency, s.batching, s.gpu_memory_utilization, self.name)
                if plan.num_blocks >= need:
                    break
            except ServingRefusal:
                pass
            if self.planner._reclaim() is None:
                break  # (the static choice fits: it is what is left)
        self.planner.steps.clear()  # (the start is no step to reverse)
        self._pending: list[tuple[str, Step]] = []
        return snapped, residency

    def preload(self, builder: ScheduleBuilder, residency: Residency) -> None:
        if not hasattr(self, "planner"):
            return super().preload(builder, residency)
        tensors = {
            f"compressed/L{j}/{t}": self.planner.stored_bytes(j, t)
            for j in self.planner.layers
            for t in self.planner.on_gpu[j]
        }
        builder.preload("weights/resident", residency.gpu_weight_bytes - sum(tensors.values()))
        for name, size in tensors.items():  # (each its own buffer: the planner frees and brings back tensors)
            builder.preload(name, size)
        # the buffer each tensor and each reclaimed step's KV memory is held in now (a buffer is allocated
        # once in a schedule: a tensor brought back gets a new name)
        self._held = {(j, t): f"compressed/L{j}/{t}" for j in self.planner.layers for t in self.planner.on_gpu[j]}
        self._kv_extra: list[str] = []

    def after_iteration(self, seen: IterationSeen) -> int:
        if not hasattr(self, "planner"):
            return 0
        d, p = seen.durations, seen.prefix
        loads = [max(d.get(f"{p}L{j}/decompress", 0.0), d.get(f"{p}L{j}/copy", 0.0)) for j in self.planner.layers]
        forward = sum(v for k, v in d.items() if k.rsplit("/", 1)[-1] in ("attn", "gate", "moe"))
        action, step = self.planner.decide(
            Feedback(
                seen.active,
                seen.unfinished,
                sum(loads) / max(1, len(loads)),
                forward / self.model.num_layers,
                seen.free_blocks,
            )
        )
        if step is None:
            return 0
        moved = ", ".join(f"L{j}.{t}" for j, t in step.tensors)
        self.decisions.append(
            f"after {seen.prefix.rstrip('/')}: {action} {moved} ({step.blocks:+d} KV blocks)"
            if action == "reclaim"
            else f"after {seen.prefix.rstrip('/')}: {action} {moved} ({-step.blocks:+d} KV blocks)"
        )
        self._pending.append((action, step))
        return step.blocks if action == "reclaim" else -step.blocks

    def emission_state(self) -> tuple[float, ...] | None:
        """The compressed share of each pageable layer (what the planner moves); None while a move
        decided after the last iteration is still to be emitted."""
        if getattr(self, "_pending", None):
            return None
        return tuple(self.planner.share(j) for j in self.planner.layers) if hasattr(self, "planner") else ()

    def watches_iterations(self) -> bool:
        return hasattr(self, "planner")

    def start_iteration(self, em: IterationEmitter) -> list[str]:
        """The residency steps decided after the last iteration, carried out before this one."""
        if not getattr(self, "_pending", None):
            return []
        after: list[str] = []
        for action, step in self._pending:
            if action == "reclaim":  # the tensors' GPU copies are dropped (host memory holds every tensor)
                dropped = tuple(self._held.pop(key) for key in step.tensors)
                kv = (f"kv/extra@{em.at}", step.blocks * self.planner.block_bytes)
                self._kv_extra.append(kv[0])
                drop = em.b.compute(f"{em.at}/residency/drop", "remap", after, free=dropped)
                after = [em.b.compute(f"{em.at}/residency/grow_kv", "remap", [drop], alloc=(kv,))]
            else:  # their compressed images come back over PCIe into the memory the KV cache gives up
                tensors = []
                for j, t in step.tensors:
                    self._held[(j, t)] = f"compressed/L{j}/{t}@{em.at}"
                    tensors.append((self._held[(j, t)], self.planner.stored_bytes(j, t)))
                shrink = em.b.compute(f"{em.at}/residency/shrink_kv", "remap", after, free=(self._kv_extra.pop(),))
                after = [
                    em.b.transfer(
                        f"{em.at}/residency/restore", "weights", "h2d_weights", sum(b for _, b in tensors), "cpu",
                        "gpu", [shrink], alloc=tuple(tensors), tensor="expert",
                    )
                ]  # fmt: skip
        self._pending = []
        return after

    # ---- one layer ---------------------------------------------------------------------------------
    def layer(self, em: IterationEmitter, layer: int, after: str) -> str:
        m, paging = self.model, self._paging_chosen
        attention = em.attention(layer, [after])
        gate = em.gate(layer, [attention])
        if not m.is_moe(layer):
            return gate
        if layer not in paging.layers:
            return em.moe(layer, [gate])
        k = paging.layers.index(layer)
        if k == 0:
            self._readers: list[str] = []
        share = self.planner.share(layer) if hasattr(self, "planner") else paging.compressed[k]
        nbytes = self._layer_bytes[layer]
        free_first = [self._readers[k - 2]] if k >= 2 else []  # write-after-read: the block two layers back
        tags = dict(step=em.it.index, layer=layer)
        parts, blocks = [], []
        if share > 0:
            block = f"{em.at}/L{layer}/block.decompressed"
            size = int(share * nbytes)
            parts.append(
                em.b.compute(
                    f"{em.at}/L{layer}/decompress", "decompress", free_first, stream="decompress", bytes=size,
                    alloc=((block, size),), phase=em.phase, **tags,
                )
            )  # fmt: skip
            blocks.append(block)
        if share < 1:
            block = f"{em.at}/L{layer}/block.copied"
            size = nbytes - int(share * nbytes)
            parts.append(
                em.b.transfer(
                    f"{em.at}/L{layer}/copy", "weights", "h2d_experts", size, "cpu", "gpu", free_first,
                    alloc=((block, size),), tensor="expert", **tags,
                )
            )  # fmt: skip
            blocks.append(block)
        last = em.moe(layer, [gate, *parts], free=tuple(blocks))  # read-after-write
        self._readers.append(last)
        return last


@serving_policy
class FluxMoEH(FluxMoE):
    name = "fluxmoe-h"
    description = "FluxMoE-H: each pageable layer wholly compressed on the GPU (earlier ones) or in host memory"
    whole_layers = True
