"""FluxMoE: expert paging over a compressed GPU tier and host memory (SERVING.md "Mechanisms").

The routed experts of *pageable* MoE layers have no GPU memory of their own: every iteration they
are materialised into one of two reusable layer blocks (pageable layer k uses the block of layer
k-2, once the layer that read it has finished: write-after-read) from two backends, and the layer's
experts run only once both parts have landed (read-after-write):

- a *compressed GPU* tier: the experts stored losslessly compressed on the GPU (32.1% smaller,
  FluxMoE Table 3's smallest saving on bf16 experts), decompressed on the GPU at the profile's
  `gpu.decompress_bandwidth`;
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

from klotski_sim.core.schedule import DEFAULT_STREAMS
from klotski_sim.policies.options import option
from klotski_sim.serving.batcher import ServingRefusal
from klotski_sim.serving.emit import IterationEmitter
from klotski_sim.serving.memory import Residency, plan_memory
from klotski_sim.serving.policies.base import ServingPolicy, ServingSetup, serving_policy

COMPRESSED_SHARE = 1 - 0.321  # stored size of compressed bf16 experts (FluxMoE §6.3 Table 3: 32.1-32.5% saved)
SHARE_STEPS = 32  # compressed shares tried below the balanced one


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
        rate = self.profile.gpu.decompress_bandwidth
        if rate is None:
            raise ServingRefusal(
                f"{self.name}: hardware profile {self.profile.name!r} has no gpu.decompress_bandwidth; give one "
                f"with --set gpu.decompress_bandwidth=4e11 (FluxMoE measured 396.5-435.4e9 B/s)"
            )
        link = self.profile.links.pcie_h2d.bandwidth
        return rate / (rate + link)

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
        stored = sum(c * size[j] * COMPRESSED_SHARE for j, c in zip(paging.layers, paging.compressed))
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
        share, nbytes = paging.compressed[k], self._layer_bytes[layer]
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
