"""A tensor-parallel group's ranks, emulated on one host: each rank's slice of a layer's weights
(Megatron-LM's split, as klotski_sim/parallel/tensor.py costs it: attention by heads, every expert's,
shared expert's and dense MLP's intermediate dimension) and one thread per rank that computes the
rank's share of an op. The ranks' partial sums meet in the schedule's all-reduce ops, where the
executor adds them up; nothing else is exchanged.

Every rank's slice is a view of the weights the op was given (no copy), and the KV cache keeps the
single-device layout (KV heads on dimension 1): a rank reads its own heads from it. So a G-rank run
moves and stores exactly what the one-device run does, and its output is the one-device output up
to the order of floating-point additions (tests/test_tensor_parallel_runtime.py)."""

from __future__ import annotations

import weakref
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from typing import Callable, TypeVar

import torch

from klotski_sim.workload.model import ModelSpec

T = TypeVar("T")


def split_problem(spec: ModelSpec, ranks: int) -> str:
    """Why `spec` cannot be split over `ranks` ranks (empty when it can)."""
    if spec.mla:
        return "MLA's compressed KV cache is whole on every rank: not split"
    if spec.num_kv_heads < ranks:
        return (
            f"its {spec.num_kv_heads} KV heads are fewer than the {ranks} ranks: the simulation gives each rank a "
            f"copy of one (as vLLM does), the runtime splits heads only"
        )
    if spec.qk_norm == "full":
        return "its q/k RMSNorm spans every head (OLMoE's): a rank holding some heads cannot compute it"
    widths = {
        "num_heads": spec.num_heads,
        "num_kv_heads": spec.num_kv_heads,
        "ffn_size": spec.ffn_size,
        "shared_ffn_size": spec.shared_ffn_size,
        "dense_ffn_size": spec.dense_ffn_size,
    }
    uneven = [f"{name} {value}" for name, value in widths.items() if value % ranks]
    return f"{', '.join(uneven)} not divisible by {ranks} ranks" if uneven else ""


class Ranks:
    """`count` ranks of one model's tensor-parallel group, and the threads they compute in."""

    def __init__(self, spec: ModelSpec, count: int) -> None:
        self.spec, self.count = spec, count
        self.rank_spec = replace(spec, num_heads=spec.num_heads // count, num_kv_heads=spec.num_kv_heads // count)
        self._pool = ThreadPoolExecutor(count, thread_name_prefix="rank")
        weakref.finalize(self, self._pool.shutdown, wait=False)

    def each(self, work: Callable[[int], T]) -> list[T]:
        """`work(rank)` for every rank at once, each in its rank's thread; results in rank order."""
        return list(self._pool.map(work, range(self.count)))

    def _part(self, width: int, rank: int) -> slice:
        share = width // self.count
        return slice(rank * share, (rank + 1) * share)

    def attention(self, weights: tuple[torch.Tensor, ...], rank: int) -> tuple[torch.Tensor, ...]:
        """(wq, wk, wv, wo) of the rank's heads: rows of q, k, v, columns of o."""
        wq, wk, wv, wo = weights
        hd = self.spec.head_dim
        q = self._part(self.spec.num_heads * hd, rank)
        kv = self._part(self.spec.num_kv_heads * hd, rank)
        return wq[q], wk[kv], wv[kv], wo[:, q]

    def kv(self, past: list[tuple], rank: int) -> list[tuple]:
        """The rank's KV heads of each cached chunk (`[B, kv_heads, T, hd]`)."""
        heads = self._part(self.spec.num_kv_heads, rank)
        return [(k[:, heads], v[:, heads]) for k, v in past]

    def ffn(self, weights: tuple[torch.Tensor, ...], rank: int) -> tuple[torch.Tensor, ...]:
        """A SwiGLU (w1, w3, w2)'s share of its intermediate dimension: rows of w1 and w3, columns of w2."""
        w1, w3, w2 = weights
        part = self._part(w1.shape[0], rank)
        return w1[part], w3[part], w2[:, part]

    def shared(self, shared: tuple[torch.Tensor, ...], rank: int) -> tuple[torch.Tensor, ...]:
        """The gate op's shared experts (their gate vector, whole on every rank, then each expert's
        (w1, w3, w2)), each expert split as `ffn`."""
        if not shared:
            return ()
        parts: list[torch.Tensor] = [shared[0]]
        for k in range(1, len(shared), 3):
            parts.extend(self.ffn(tuple(shared[k : k + 3]), rank))
        return tuple(parts)


def all_reduce(partials: list[torch.Tensor]) -> torch.Tensor:
    """The ranks' partial sums added up, in rank order (a ring all-reduce's sum; the order differs
    from NCCL's, so the last bits may)."""
    total = partials[0].clone()
    for part in partials[1:]:
        total += part
    return total
