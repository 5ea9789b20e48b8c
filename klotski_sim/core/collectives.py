"""What a collective costs on a machine's fabric, by the published algorithms' latency and bandwidth
terms (the alpha-beta model): alpha is NCCL's base latency of a call plus its latency per algorithm
step (`FabricSpec`, from NVIDIA/nccl src/graph/tuning.cc), beta the time one byte takes over one
GPU's fabric bandwidth in one direction.

- All-reduce, ring (Patarasuk & Yuan, "Bandwidth optimal all-reduce algorithms for clusters of
  workstations", JPDC 2009; NCCL's ring): 2(G-1) steps, each GPU sends 2(G-1)/G of the buffer.
- All-reduce, tree (reduce then broadcast over a binary tree, pipelined in chunks as NCCL's double
  binary trees are; Sanders, Speck & Traeff, "Two-tree algorithms for full bandwidth broadcast,
  reduction and scan", Parallel Computing 2009): 2 ceil(log2 G) steps, each GPU sends 2x the buffer.
- All-to-all, pairwise exchange (Thakur, Rabenseifner & Gropp, "Optimization of collective
  communication operations in MPICH", IJHPCA 2005, section 4.5): G-1 rounds; in round r rank i
  sends to rank (i+r) mod G and receives from (i-r) mod G, and a round lasts as long as its largest
  message, so an uneven exchange (expert parallelism's dispatch) costs what its busiest pairs send.
- All-gather and reduce-scatter, ring: G-1 steps, each GPU sends (G-1)/G of the whole buffer.

These are the conventions of nccl-tests' doc/PERFORMANCE.md too (bus bandwidth = algorithm
bandwidth x 2(G-1)/G for all-reduce, (G-1)/G for all-gather, reduce-scatter and all-to-all).
"""

from __future__ import annotations

import math
from typing import Literal

import numpy as np

from klotski_sim.hardware.profile import FabricSpec
from klotski_sim.util.errors import UsageError

ALL_REDUCE_ALGORITHMS = ("ring", "tree")
AllReduceAlgorithm = Literal["ring", "tree"]


def _alpha(fabric: FabricSpec, steps: int) -> float:
    return fabric.base_latency_s + steps * fabric.step_latency_s


def all_reduce_seconds(nbytes: float, gpus: int, fabric: FabricSpec, algorithm: AllReduceAlgorithm = "ring") -> float:
    """One all-reduce of a buffer of `nbytes` on every one of `gpus` GPUs."""
    if gpus <= 1:
        return 0.0
    if algorithm == "ring":
        return _alpha(fabric, 2 * (gpus - 1)) + 2 * (gpus - 1) / gpus * nbytes / fabric.bandwidth
    if algorithm == "tree":
        return _alpha(fabric, 2 * math.ceil(math.log2(gpus))) + 2 * nbytes / fabric.bandwidth
    raise UsageError(f"all-reduce algorithm {algorithm!r}: one of {', '.join(ALL_REDUCE_ALGORITHMS)}")


def best_all_reduce(nbytes: float, gpus: int, fabric: FabricSpec) -> tuple[float, str]:
    """The faster algorithm for this size, as NCCL's tuner picks one (small buffers: tree's fewer
    steps; large ones: ring's smaller bandwidth term)."""
    ring, tree = all_reduce_seconds(nbytes, gpus, fabric, "ring"), all_reduce_seconds(nbytes, gpus, fabric, "tree")
    return (tree, "tree") if tree < ring else (ring, "ring")


def all_gather_seconds(nbytes: float, gpus: int, fabric: FabricSpec) -> float:
    """A ring all-gather whose result is `nbytes` on every GPU (each contributes nbytes / gpus);
    a reduce-scatter of an `nbytes` buffer costs the same."""
    if gpus <= 1:
        return 0.0
    return _alpha(fabric, gpus - 1) + (gpus - 1) / gpus * nbytes / fabric.bandwidth


def all_to_all_seconds(sent: np.ndarray, fabric: FabricSpec) -> float:
    """A pairwise-exchange all-to-all where rank i sends `sent[i, j]` bytes to rank j (the diagonal,
    what a rank keeps, costs nothing). Each round's time is its largest message over the bandwidth;
    a rank sends one message and receives one a round, so its link is never shared within one."""
    sent = np.asarray(sent, dtype=float)
    return all_to_all_time(critical_bytes(sent), sent.shape[0], fabric)


def critical_bytes(sent: np.ndarray) -> float:
    """What a pairwise-exchange all-to-all of the byte matrix `sent` waits for: the sum over its
    rounds of the round's largest message (an event-engine op of the exchange carries it as its bytes)."""
    sent = np.asarray(sent, dtype=float)
    gpus = sent.shape[0]
    if sent.shape != (gpus, gpus):
        raise UsageError(f"an all-to-all's byte matrix must be square, got {sent.shape}")
    ranks = np.arange(gpus)
    return sum(float(sent[ranks, (ranks + r) % gpus].max()) for r in range(1, gpus))


def all_to_all_time(critical: float, gpus: int, fabric: FabricSpec) -> float:
    """A pairwise-exchange all-to-all over `gpus` GPUs whose rounds' largest messages sum to `critical` bytes."""
    if gpus <= 1:
        return 0.0
    return _alpha(fabric, gpus - 1) + critical / fabric.bandwidth
