"""Klotski's correlation-aware expert prefetcher (KLOTSKI.md, "Hot experts").

Path length l = 1. Layer 0 keeps a count vector `T0[e]`; every later layer L keeps a matrix
`T[L][e_prev][e_cur]`, incremented for each (previous-layer top-k x current-layer top-k) pair of
every token. To predict layer L's hot experts for a group of n batches, take `c_prev[e]` = how
often e was selected in layer L-1 over the group's tokens, add `c_prev[e]` to the top-2 entries of
row `T[L][e]`, and keep the top K of the sum (layer 0: the top K of `T0`). The table is filled by
a pre-run on warm-up sequences and keeps learning online after each MoE layer.

It only ever sees what a real system has seen: the warm-up trace and the layers already computed.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from klotski_sim.files.mapped import in_chunks, release
from klotski_sim.workload.routing import CHOICE_CODES, choice_codes, choice_experts, top_by_argmax
from klotski_sim.workload.trace import Trace

_CHUNK_PAIRS = 1 << 18  # (token, layer, pair) counts per bincount pass: ~1 MB of int32, cache-sized
# Above this many counts in the whole table (2 MB of them), pairs are counted one layer's table at a
# time: a pass's bincount makes and adds an array of every count it may touch, and increments land
# at random in it: DeepSeek-V3's 61 x 256 x 256 counts (32 MB) miss the cache, where a layer's 65k
# counts (0.5 MB) stay in it: 2.8x faster on 20k prefill tokens (0.52 -> 0.19 s, the same counts).
_WHOLE_TABLE_COUNTS = 1 << 18
# Up to routing.CHOICE_CODES distinct top-k choices a layer, the pair counts are taken per
# (previous choice, current choice) — one count per token and layer instead of K*K — and expanded
# to expert pairs by a small matrix product: 3.7x faster than counting every pair on a prefill step
# of the default run (73 -> 20 ms, identical counts) ...
# ... when the tokens' pairs outnumber the (choice, choice) cells this many times: a decode step's
# few tokens are counted pair by pair (0.3 ms, against 1 ms by choices).
_CHOICE_PAIRS_PER_CELL = 1
_OBSERVED_IDS = 1 << 22  # ids observed per block (a 16k-token prompt's prefill: a batch a block)
_CODE_TOKENS = 4096  # tokens per pass: [tokens, layers] of index-type codes, ~1 MB at Mixtral's size


@dataclass
class CorrelationTable:
    """Pair counts between consecutive layers' expert choices, and the predictor built on them."""

    num_layers: int
    num_experts: int
    top_k: int
    row_top: int = 2  # "add c_prev[e] to each of the top-2 entries of row T[L][e]"
    t0: np.ndarray = field(init=False)
    pairs: np.ndarray = field(init=False)

    def __post_init__(self) -> None:
        self.t0 = np.zeros(self.num_experts, dtype=np.int64)
        self.pairs = np.zeros((self.num_layers, self.num_experts, self.num_experts), dtype=np.int64)

    def observe_tokens(self, ids: np.ndarray) -> None:
        """Learn from every layer of some tokens at once (`ids[..., layer, k]`, each token's k
        experts distinct, as trace validation guarantees): the same counts as layer by layer,
        in one pass over the tokens. A step's learning can wait until the
        step ends: predicting layer L reads only T[L], which only layer L's own observation changes.
        Many tokens (a prefill) are counted a block along the first axis at a time: the counts are
        sums, so the same, and a mapped routing's pages are given back as the pass moves on."""
        if ids.size > _OBSERVED_IDS and len(ids) > 1:
            for part in in_chunks(ids, max(1, _OBSERVED_IDS // max(1, ids[0].size))):
                self._observe(part)
        else:
            self._observe(ids)
            release(ids)

    def _observe(self, ids: np.ndarray) -> None:
        L, E, K = self.num_layers, self.num_experts, self.top_k
        count = ids.size // (L * K)
        if count == 0:
            return
        self.t0 += np.bincount(ids[..., 0, :].ravel(), minlength=E)
        if L == 1:
            return
        if E**K <= CHOICE_CODES and count * K * K > _CHOICE_PAIRS_PER_CELL * (E**K) ** 2:
            self._observe_choices(ids)
            return
        tokens = ids.reshape(-1, L, K)
        if L * E * E > _WHOLE_TABLE_COUNTS:
            self._observe_layer_by_layer(tokens)
            return
        wide: type[np.signedinteger] = np.int32 if L * E * E < 2**31 else np.int64
        offsets = (np.arange(1, L, dtype=wide) * (E * E)).reshape(-1, 1, 1)
        span = max(1, _CHUNK_PAIRS // ((L - 1) * K * K))  # tokens per pass: bounded temporary memory
        flat_pairs = self.pairs.reshape(-1)
        for start in range(0, len(tokens), span):
            block = tokens[start : start + span].astype(wide)
            flat = offsets + block[:, :-1, :, None] * E + block[:, 1:, None, :]
            flat_pairs += np.bincount(flat.ravel(), minlength=L * E * E)

    def _observe_layer_by_layer(self, tokens: np.ndarray) -> None:
        """The same pair counts (`tokens[token, layer, k]`), one layer's E x E table at a time (see
        _WHOLE_TABLE_COUNTS), a block of tokens turned layer-major at a time."""
        L, E, K = self.num_layers, self.num_experts, self.top_k
        span = max(1, 4 * _CHUNK_PAIRS // (L * K))  # tokens per pass: a 4 MB block of int32 ids
        for start in range(0, len(tokens), span):
            block = np.ascontiguousarray(tokens[start : start + span].transpose(1, 0, 2), dtype=np.int32)
            for layer in range(1, L):
                flat = (block[layer - 1] * E)[:, :, None] + block[layer][:, None, :]
                self.pairs[layer] += np.bincount(flat.ravel(), minlength=E * E).reshape(E, E)

    def _observe_choices(self, ids: np.ndarray) -> None:
        """The same pair counts via each token's whole choice in a layer, coded as sum_k e_k E^k:
        count (choice in L-1, choice in L) per layer, then T[L] += A^T counts A, where A[c, e] says
        whether choice c holds expert e (a token's top-k experts are distinct, so each of its K*K
        expert pairs adds exactly 1, as when counted one by one)."""
        L, E, K = self.num_layers, self.num_experts, self.top_k
        codes = E**K
        holds = choice_experts(E, K)
        offsets = np.arange(L - 1, dtype=np.intp) * (codes * codes)
        choice_pairs = np.zeros((L - 1) * codes * codes, dtype=np.int64)
        # [rows, tokens, L, K] as a view of the routing's [batch, seq, position, L, K] (a step's
        # positions are a slice of it: reshaping all its tokens into one array would copy them all)
        rows = ids.reshape((-1,) + ids.shape[-3:]) if ids.ndim > 3 else ids[:, None]
        span = max(1, _CODE_TOKENS // rows.shape[1])
        for start in range(0, len(rows), span):
            code = choice_codes(rows[start : start + span], E)
            flat = code[..., :-1] * codes + code[..., 1:] + offsets
            choice_pairs += np.bincount(flat.ravel(), minlength=len(choice_pairs))
        self.pairs[1:] += holds.T @ choice_pairs.reshape(L - 1, codes, codes) @ holds

    def warm_up(self, trace: Trace) -> None:
        """The pre-run: every token of the warm-up sequences, every layer."""
        self.observe_tokens(trace.experts)

    def scores(self, layer: int, prev_counts: np.ndarray | None) -> np.ndarray:
        if layer == 0 or prev_counts is None:
            return self.t0.astype(float)
        top_cols = top_columns(self.pairs[layer], self.row_top)
        # each row's c_prev[e] added to its top columns (row by row, as a loop over e would add them)
        weights = np.repeat(np.asarray(prev_counts, dtype=float), top_cols.shape[1])
        return np.bincount(top_cols.ravel(), weights=weights, minlength=self.num_experts)

    def predict(self, layer: int, prev_counts: np.ndarray | None, k: int) -> list[int]:
        """The k hot experts of `layer` (highest score first; ties -> lower expert id)."""
        return np.argsort(-self.scores(layer, prev_counts), kind="stable")[:k].tolist()


PREDICTORS = ("layer", "layer+token")


def spatio_temporal(layer_scores: np.ndarray, previous_token_counts: np.ndarray) -> list[int]:
    """Experts ranked by two predictions' shares added: the table's scores given the previous
    layer (spatial) and the group's own routing of this layer one token earlier (temporal). ST-MoE
    observes expert requests correlated across adjacent layers and consecutive tokens alike
    (shared/docs/MULTIGPU.md); weighing them equally assumes neither is the better. Ties go to the
    lower expert id."""
    total = np.zeros(len(layer_scores))
    for part in (np.asarray(layer_scores, dtype=float), np.asarray(previous_token_counts, dtype=float)):
        if part.sum() > 0:
            total += part / part.sum()
    return np.argsort(-total, kind="stable").tolist()


def top_columns(table: np.ndarray, r: int) -> np.ndarray:
    """The columns of each row's r largest counts, largest first, ties to the lower column: the
    first r columns of a stable argsort of -table, taken by r passes of argmax over a copy
    (`routing.top_by_argmax`) — sorting a DeepSeek-V3 layer's 256 x 256 table whole for its top 2
    columns takes 1.7 ms against 0.03, at every layer and step. Up to 32 experts the sort is the
    quicker (Mixtral's 8 x 8: 1.5 us against 6), and above 4 passes."""
    r = min(r, table.shape[1])
    if r > 4 or table.shape[1] <= 32 or table.dtype.kind not in "iu":  # (counts are integers)
        return np.argsort(-table, axis=1, kind="stable")[:, :r]
    return top_by_argmax(table.astype(np.int64), r)  # (a copy: the picks are struck out in it)


@dataclass
class PrefetchStats:
    """How good the hot-expert predictions of one run were."""

    predictions: int = 0
    hot_used: int = 0  # predicted hot experts that got at least one token
    hot_in_true_top: int = 0  # predicted hot experts among the group's actual top-K
    hot_slots: int = 0
    covered_assignments: int = 0  # token-expert assignments served by hot experts
    assignments: int = 0

    def record(self, hot: list[int], counts: np.ndarray) -> None:
        k = len(hot)
        true_top = set(np.argsort(-counts, kind="stable")[:k].tolist())
        self.predictions += 1
        self.hot_slots += k
        self.hot_used += sum(1 for e in hot if counts[e] > 0)
        self.hot_in_true_top += sum(1 for e in hot if e in true_top)
        self.covered_assignments += int(sum(counts[e] for e in hot))
        self.assignments += int(counts.sum())

    def to_dict(self) -> dict[str, float]:
        slots = max(1, self.hot_slots)
        return {
            "predictions": self.predictions,
            "precision": self.hot_used / slots,  # paper: 100% of prefetched hot experts were used
            "hot_identification": self.hot_in_true_top / slots,  # paper: 58.9%
            "hot_coverage": self.covered_assignments / max(1, self.assignments),
        }
