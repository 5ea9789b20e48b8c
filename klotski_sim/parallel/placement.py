"""Where each expert of a MoE layer lives across G ranks, and which replicas compute which tokens.

Three placements, each of E/G experts a rank (rounded up):
- `round_robin`: expert e on rank e mod G (DeepSpeed-MoE's and vLLM's default expert-parallel split
  by contiguous or strided ids: the same load on average, blind to routing).
- `by_popularity`: the heaviest experts first, each onto the least-loaded rank with room (greedy
  longest-processing-time scheduling, Graham 1969), from loads measured on routing history.
- `by_coactivation`: experts often chosen by the same token placed together, so a token's top-k
  experts sit on fewer ranks and its dispatch crosses the fabric fewer times (Bambhaniya et al.'s
  locality placement, shared/docs/MULTIGPU.md): the heaviest expert still unplaced goes to the
  rank with room whose experts it co-activates with most, ties to the lighter rank.

Replication (`replicate`) copies the experts predicted to be overloaded onto the ranks predicted to
be lightest, into spare expert slots (the prediction comes from routing history only, as the
dynamic-replication work in MULTIGPU.md does); `balance` then splits each replicated expert's
tokens among its replicas. Every token is computed once, by one replica, and the busiest rank never
carries more than it would without the replicas (`balance` keeps the unreplicated assignment when
its water-filling would not beat it).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from klotski_sim.util.errors import UsageError

PLACEMENTS = ("round-robin", "popularity", "coactivation")


@dataclass(frozen=True)
class ExpertPlacement:
    """One MoE layer's experts over `ranks` ranks: `replicas[e]` the ranks holding expert e, its
    home (where it was placed) first."""

    ranks: int
    replicas: tuple[tuple[int, ...], ...]

    @property
    def num_experts(self) -> int:
        return len(self.replicas)

    def home(self) -> np.ndarray:
        """Each expert's first rank."""
        return np.array([r[0] for r in self.replicas], dtype=np.int64)

    def experts_on(self) -> np.ndarray:
        """Experts held by each rank, replicas included."""
        held = np.zeros(self.ranks, dtype=np.int64)
        for where in self.replicas:
            held[list(where)] += 1
        return held

    def extra_copies(self) -> int:
        """Replicas beyond each expert's one copy."""
        return sum(len(r) - 1 for r in self.replicas)


def _slots(num_experts: int, ranks: int) -> int:
    if ranks < 1:
        raise UsageError(f"ranks must be at least 1, got {ranks}")
    return -(-num_experts // ranks)


def round_robin(num_experts: int, ranks: int) -> ExpertPlacement:
    _slots(num_experts, ranks)
    return ExpertPlacement(ranks, tuple((e % ranks,) for e in range(num_experts)))


def by_popularity(load: np.ndarray, ranks: int) -> ExpertPlacement:
    """Heaviest expert first onto the least-loaded rank that has a slot left."""
    load = np.asarray(load, dtype=float)
    room = np.full(ranks, _slots(len(load), ranks))
    total = np.zeros(ranks)
    home = np.empty(len(load), dtype=np.int64)
    for e in np.argsort(-load, kind="stable"):
        open_ranks = np.flatnonzero(room > 0)
        r = open_ranks[np.argmin(total[open_ranks])]
        home[e], total[r], room[r] = r, total[r] + load[e], room[r] - 1
    return ExpertPlacement(ranks, tuple((int(r),) for r in home))


def by_coactivation(load: np.ndarray, coactivation: np.ndarray, ranks: int) -> ExpertPlacement:
    """Heaviest expert first onto the rank with a slot left whose experts it is chosen with most
    (`coactivation[a, b]`: tokens that chose both a and b), ties to the lighter rank."""
    load = np.asarray(load, dtype=float)
    co = np.asarray(coactivation, dtype=float)
    if co.shape != (len(load), len(load)):
        raise UsageError(f"co-activation matrix of shape {co.shape} for {len(load)} experts")
    room = np.full(ranks, _slots(len(load), ranks))
    total = np.zeros(ranks)
    affinity = np.zeros((ranks, len(load)))  # affinity[r, e]: co-activation of e with rank r's experts
    home = np.empty(len(load), dtype=np.int64)
    for e in np.argsort(-load, kind="stable"):
        open_ranks = np.flatnonzero(room > 0)
        # most affinity first, then least load (lexicographic: the load only breaks ties)
        order = np.lexsort((total[open_ranks], -affinity[open_ranks, e]))
        r = open_ranks[order[0]]
        home[e], total[r], room[r] = r, total[r] + load[e], room[r] - 1
        affinity[r] += co[e]
    return ExpertPlacement(ranks, tuple((int(r),) for r in home))


def place(kind: str, load: np.ndarray, coactivation: np.ndarray, ranks: int) -> ExpertPlacement:
    """The placement named `kind` (one of PLACEMENTS) from measured loads and co-activations."""
    if kind == "round-robin":
        return round_robin(len(load), ranks)
    if kind == "popularity":
        return by_popularity(load, ranks)
    if kind == "coactivation":
        return by_coactivation(load, coactivation, ranks)
    raise UsageError(f"placement {kind!r}: one of {', '.join(PLACEMENTS)}")


def replicate(placement: ExpertPlacement, predicted: np.ndarray, spare_slots: int) -> ExpertPlacement:
    """Up to `spare_slots` more expert slots on each rank filled with copies of the experts whose
    predicted load most overloads their ranks: the busiest rank (as `balance` would split the
    predicted load) gives a copy of its heaviest expert to the rank lightest with a slot left, as
    long as that lowers the predicted busiest load."""
    predicted = np.asarray(predicted, dtype=float)
    replicas = [list(r) for r in placement.replicas]
    room = np.full(placement.ranks, spare_slots)
    if spare_slots <= 0 or placement.ranks == 1:
        return placement
    while True:
        current = ExpertPlacement(placement.ranks, tuple(map(tuple, replicas)))
        per_rank = balance(current, predicted).sum(axis=0)
        busiest = int(np.argmax(per_rank))
        candidates = [e for e in np.argsort(-predicted, kind="stable") if busiest in replicas[e] and predicted[e] > 0]
        improved = False
        for e in candidates:
            targets = [r for r in np.argsort(per_rank, kind="stable") if room[r] > 0 and r not in replicas[e]]
            if not targets:
                continue
            trial = [list(r) for r in replicas]
            trial[e].append(int(targets[0]))
            after = balance(ExpertPlacement(placement.ranks, tuple(map(tuple, trial))), predicted).sum(axis=0)
            if after.max() < per_rank.max() - 1e-9:
                replicas, room[targets[0]] = trial, room[targets[0]] - 1
                improved = True
                break
        if not improved:
            return ExpertPlacement(placement.ranks, tuple(map(tuple, replicas)))


def balance(placement: ExpertPlacement, tokens: np.ndarray) -> np.ndarray:
    """`assigned[e, r]`: tokens of expert e computed on rank r. An expert with one copy computes all
    of its tokens at home; a replicated expert's tokens are water-filled onto its replicas, lightest
    rank first, largest experts first, in whole tokens. Each expert's row sums to its tokens (every
    token computed once), and the busiest rank's total is never above what the unreplicated
    assignment (every token at its expert's home) gives: where filling would be worse, that is kept."""
    tokens = np.asarray(tokens)
    experts, ranks = placement.num_experts, placement.ranks
    at_home = np.zeros((experts, ranks), dtype=tokens.dtype)
    at_home[np.arange(experts), placement.home()] = tokens
    replicated = [e for e in range(experts) if len(placement.replicas[e]) > 1]
    if not replicated:
        return at_home
    assigned = at_home.copy()
    assigned[replicated] = 0
    per_rank = assigned.sum(axis=0).astype(float)
    for e in sorted(replicated, key=lambda e: -tokens[e]):
        where = list(placement.replicas[e])
        share = _water_fill(per_rank[where], float(tokens[e]))
        whole = np.floor(share).astype(np.int64)
        for i in np.argsort(-(share - whole), kind="stable")[: int(round(tokens[e] - whole.sum()))]:
            whole[i] += 1  # the tokens the rounding left go to the largest remainders
        assigned[e, where] = whole
        per_rank[where] += whole
    if assigned.sum(axis=0).max() > at_home.sum(axis=0).max():
        return at_home
    return assigned


def _water_fill(levels: np.ndarray, amount: float) -> np.ndarray:
    """Shares of `amount` that raise the lowest `levels` to one common level (water-filling)."""
    order = np.sort(levels)
    level = order[0] + amount
    for k in range(1, len(order) + 1):
        level = (amount + order[:k].sum()) / k
        if k == len(order) or level <= order[k]:
            break
    return np.maximum(level - levels, 0.0)
