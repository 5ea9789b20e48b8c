"""RoutingTable: the expert choices of the exact tokens a run processes, in the shape policies ask.

A run of n batches x bs sequences with prompt length P and G generated tokens processes, per
sequence, the P prompt tokens at step 0 (prefill, which emits the first token) and one token
at each decode step 1..G-1. Policies ask "which experts, with how many tokens, does batch b
need at step s in layer j?"; this answers from a dense array cut out of a trace, with counts
precomputed once (np.bincount) so the question costs nothing inside the policy loops. The
array may be a mapped trace file (`mapped.py`): each pass over the prefill gives its pages back.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from pathlib import Path

import numpy as np

from klotski_sim.files.mapped import in_chunks, release
from klotski_sim.files.npzfile import NPZ_READ_ERRORS, check_npz, write_npz
from klotski_sim.util.argtypes import MAX_COUNT, MAX_COUNT_TEXT
from klotski_sim.util.errors import UsageError
from klotski_sim.workload.model import routes

# Above this many routed ids, a batch's first-use order is found by numpy's sort rather than a dict
# over every id: a default batch's 16k prefill ids in 0.15 ms instead of 0.42 (a decode step's 32
# stay with the dict, which takes 3 us for them).
_FIRST_USE_BY_SORT = 256
# A batch's first-use order is read from its first sequence's first tokens (`first_use_orders`): in
# the default run (Mixtral's 8 experts, top-2, 512-token prompts) 525 of the 544 prefill orders
# have every used expert within the first 64 tokens; the other 19 fall back to every id.
_FIRST_USE_HEAD = 64
_COUNTED_KEYS = 1 << 20  # keys the routing counts take per pass (8 MB): a batch of a long prompt in chunks
# Up to this many distinct top-k choices (E^K: Mixtral's 8^2 = 64), tokens are counted by their
# whole choice, one count per token instead of K, and the counts expanded to experts by a small
# matrix product (`choice_experts`): the routing's expert counts (30 -> 20 ms at the default size)
# and the prefetcher's pair counts (73 -> 20 ms per prefill step) are taken this way.
CHOICE_CODES = 64


def expert_id_type(num_experts: int) -> type[np.integer]:
    """The type expert ids are held in, in memory as in files: a byte for up to 256 experts, int16
    up to 32,768, int32 beyond (a trace may declare up to 65,536). A trace of every token is the
    largest thing a long prompt's run holds (16k-token prompts: 134 MB in a byte, twice that in
    int16); every reader widens ids before arithmetic."""
    return np.uint8 if num_experts <= 1 << 8 else np.int16 if num_experts <= 1 << 15 else np.int32


def choice_codes(ids: np.ndarray, num_experts: int, out: np.ndarray | None = None) -> np.ndarray:
    """Each token's choice `ids[..., :K]` as one number, sum_k ids[..., k] * E^k (added to `out`
    when given: an offset per token, in a buffer reused from call to call)."""
    code = ids[..., 0].astype(np.intp) if out is None else np.add(out, ids[..., 0], out=out)
    for k in range(1, ids.shape[-1]):
        code += ids[..., k] * np.intp(num_experts**k)  # (a numpy scalar: no product in the ids' own small type)
    return code


def top_by_argmax(work: np.ndarray, count: int, values: list[np.ndarray] | None = None) -> np.ndarray:
    """Indices of the `count` largest values along the last axis of `work`, largest first, ties to
    the lower index: `count` passes of argmax (its first maximum), each pick struck out below every
    value — quicker than a partition and a sort, up to top-9 of 256 at least (the generator's
    top-k, the prefetcher's top columns). `work`, the caller's own, is overwritten; the picked
    values, pass by pass, are appended to `values` when given."""
    floor = -np.inf if work.dtype.kind == "f" else np.iinfo(work.dtype).min
    picks = []
    for _ in range(count):
        best = np.argmax(work, axis=-1)[..., None]
        picks.append(best[..., 0])
        if values is not None:
            values.append(np.take_along_axis(work, best, axis=-1)[..., 0])
        np.put_along_axis(work, best, floor, axis=-1)
    return np.stack(picks, axis=-1) if picks else np.empty(work.shape[:-1] + (0,), dtype=np.intp)


_PAIRED_UP_TO = 8  # top-k up to which `repeats_an_expert` compares slots pair by pair (above: sorts)
_REPEAT_ROWS = 1 << 20  # tokens' top-k rows per pass of it: a bounded temporary


def repeats_an_expert(ids: np.ndarray) -> bool:
    """Whether some token's top-k ids (`ids[..., k]`) name one expert twice (a router's are distinct).
    Up to top-8 each pair of slots is compared, on a block of rows turned slot-major (each slot's
    ids contiguous): sorting every token's 8 ids takes 0.8 s of a 6.6 s Qwen3-30B-A3B run, which
    validates its cached trace on every load; pair by pair it is 15 times quicker."""
    k = ids.shape[-1]
    if k < 2 or not ids.size:
        return False
    if k == 2:
        return bool(np.any(ids[..., 0] == ids[..., 1]))
    if k > _PAIRED_UP_TO:
        ranked = np.sort(ids, axis=-1)
        return bool(np.any(ranked[..., 1:] == ranked[..., :-1]))
    rows = ids.reshape(-1, k)  # (a view of a contiguous array: the trace's blocks are)
    for start in range(0, len(rows), _REPEAT_ROWS):
        slots = rows[start : start + _REPEAT_ROWS].T.copy()
        if any(np.any(slots[i] == slots[j]) for i in range(k - 1) for j in range(i + 1, k)):
            return True
    return False


def choice_experts(num_experts: int, top_k: int) -> np.ndarray:
    """`[code, expert]`: how many of a choice's K slots hold the expert (one per distinct expert
    when the slots are distinct, as a router's top-k are)."""
    codes = num_experts**top_k
    digits = (np.arange(codes)[:, None] // num_experts ** np.arange(top_k)[None, :]) % num_experts
    holds = np.zeros((codes, num_experts), dtype=np.int64)
    np.add.at(holds, (np.repeat(np.arange(codes), top_k), digits.ravel()), 1)
    return holds


@dataclass(frozen=True)
class RunShape:
    """How many sequences a run processes and how long they are."""

    batch_size: int
    num_batches: int
    prompt_len: int
    gen_len: int

    def __post_init__(self) -> None:
        for name in ("batch_size", "num_batches", "prompt_len", "gen_len"):
            value = getattr(self, name)
            if not isinstance(value, (int, np.integer)) or not 1 <= value <= MAX_COUNT:
                raise UsageError(f"{name} must be a positive integer up to {MAX_COUNT_TEXT}, got {value!r}")

    @property
    def num_steps(self) -> int:
        """Step 0 is prefill; steps 1..gen_len-1 decode one token each."""
        return self.gen_len

    @property
    def tokens_per_sequence(self) -> int:
        """Tokens that pass through the model per sequence (the last generated one never does)."""
        return self.prompt_len + self.gen_len - 1

    @property
    def num_sequences(self) -> int:
        return self.batch_size * self.num_batches

    @property
    def generated_tokens(self) -> int:
        return self.num_sequences * self.gen_len

    def step_positions(self, step: int) -> slice:
        """Token positions a step processes."""
        if step == 0:
            return slice(0, self.prompt_len)
        return slice(self.prompt_len + step - 1, self.prompt_len + step)

    def kv_len(self, step: int) -> int:
        """Tokens in each sequence's KV cache once the step has run."""
        return self.prompt_len + step

    def new_tokens(self, step: int) -> int:
        """Tokens each sequence adds at `step`: the prompt, then one."""
        return self.prompt_len if step == 0 else 1

    @staticmethod
    def phase(step: int) -> str:
        """What a step is: step 0 the prefill, later steps decode."""
        return "prefill" if step == 0 else "decode"


class RoutingTable:
    """Top-k expert ids of every token of a run: `ids[batch, seq, position, layer, slot]`."""

    def __init__(
        self,
        ids: np.ndarray,
        shape: RunShape,
        num_experts: int,
        source: str = "",
        dense_layers: int = 0,
        moe_step: int = 1,
    ) -> None:
        expected = (shape.num_batches, shape.batch_size, shape.tokens_per_sequence)
        if ids.ndim != 5 or ids.shape[:3] != expected:
            raise UsageError(f"routing ids have shape {ids.shape}, expected {expected} + (layers, top_k)")
        if any(
            part.size and (part.min() < 0 or part.max() >= num_experts) for part in in_chunks(ids, 1)
        ):  # (a batch at a time: a mapped trace's pages given back)
            raise UsageError(f"routing ids out of range [0, {num_experts})")
        self.ids = ids.astype(expert_id_type(num_experts), copy=False)  # (a view of a trace's ids stays one)
        self.shape = shape
        self.num_experts = num_experts
        self.num_layers = ids.shape[3]
        self.top_k = ids.shape[4]
        self.source = source
        # the model's layers without experts route nothing: its first `dense_layers`, then all but
        # every `moe_step`-th (`model.routes`)
        self.dense_layers = dense_layers
        self.moe_step = moe_step
        # the decode steps' few ids a sequence, held in memory (`step_block`): read step after step,
        # they would otherwise keep resident the pages of a mapped trace that hold them, and the
        # prefill's around them (in a 16k-token prompt's run: 61 MB of 134)
        self.decode_ids = np.ascontiguousarray(self.ids[:, :, shape.prompt_len :])  # [batch, seq, step - 1, L, K]
        release(self.ids)

    @cached_property
    def counts(self) -> np.ndarray:
        """`counts[step, layer, batch, expert]` = tokens of that batch routed to that expert."""
        sh = self.shape
        nb, L, E = sh.num_batches, self.num_layers, self.num_experts
        step_of_position = np.empty(sh.tokens_per_sequence, dtype=np.int64)
        step_of_position[: sh.prompt_len] = 0
        step_of_position[sh.prompt_len :] = np.arange(1, sh.gen_len)
        counts = np.empty((sh.num_steps, L, nb, E), dtype=np.int64)
        by_choice = E**self.top_k <= CHOICE_CODES
        bins = E**self.top_k if by_choice else E  # per (step, layer): its choices, or its experts
        # bin = (step of the position, layer, choice or expert), counted over a batch's positions a
        # chunk at a time: the keys (numpy's index type, which bincount counts without a copy) of a
        # chunk are a bounded temporary however long the prompt (16k tokens: 67 MB a batch at once)
        offset = (step_of_position[:, None] * L + np.arange(L)[None, :]) * bins  # [position, layer]
        keys_per_position = sh.batch_size * L * (1 if by_choice else self.top_k)
        chunk = min(sh.tokens_per_sequence, max(1, _COUNTED_KEYS // keys_per_position))
        buffer = np.empty(
            (sh.batch_size, chunk, L) if by_choice else (sh.batch_size, chunk, L, self.top_k), dtype=np.intp
        )  # (reused from pass to pass)
        holds = choice_experts(E, self.top_k) if by_choice else None
        for b in range(nb):
            tally = None
            for lo in range(0, sh.tokens_per_sequence, chunk):
                ids = self.ids[b, :, lo : lo + chunk]  # [seq, position, layer, slot]
                key = buffer[:, : ids.shape[1]]  # (a batch's last chunk of a long prompt may be shorter)
                if by_choice:
                    key[...] = offset[lo : lo + chunk]
                    choice_codes(ids, E, out=key)
                else:
                    np.add(offset[lo : lo + chunk, :, None], ids, out=key)
                part = np.bincount(key.reshape(-1), minlength=sh.num_steps * L * bins)
                release(ids)
                tally = part if tally is None else tally + part
            assert tally is not None  # (a sequence holds at least one token: the loop above ran)
            by_bin = tally.reshape(-1, bins) @ holds if holds is not None else tally
            counts[:, :, b, :] = by_bin.reshape(sh.num_steps, L, E)
        counts[:, [not routes(j, self.dense_layers, self.moe_step) for j in range(L)]] = 0
        return counts

    def tokens_per_expert(self, step: int, layer: int, batches: list[int] | range) -> np.ndarray:
        """Token count per expert over the given batches (length num_experts)."""
        return self.counts[step, layer, list(batches)].sum(axis=0)

    def save(self, path: str | Path) -> None:
        """The exact routing a schedule was built from (the runtime replays it with the schedule)."""
        sh = self.shape
        write_npz(
            path,
            dict(
                ids=self.ids,
                num_experts=np.array(self.num_experts),
                shape=np.array([sh.batch_size, sh.num_batches, sh.prompt_len, sh.gen_len]),
                source=np.array(self.source),
                dense_layers=np.array(self.dense_layers),
                moe_step=np.array(self.moe_step),
            ),
        )

    @staticmethod
    def load(path: str | Path) -> "RoutingTable":
        """The routing `save` wrote (a run's routing.npz), every array checked: what `execute`
        replays must be what the schedule was built from, not a coerced look-alike."""
        try:
            check_npz(path, "routing table", UsageError)
            with np.load(path, allow_pickle=False) as z:
                ids, shape, num_experts, source = z["ids"], z["shape"], z["num_experts"], z["source"]
                dense = z["dense_layers"] if "dense_layers" in z.files else np.array(0)
                step = z["moe_step"] if "moe_step" in z.files else np.array(1)
        except FileNotFoundError:
            raise UsageError(f"{path}: no such routing file") from None
        except (*NPZ_READ_ERRORS, KeyError) as err:
            raise UsageError(f"{path}: not a routing table written by klotski-sim ({err})") from None
        for name, array, size in (
            ("ids", ids, None),
            ("shape", shape, 4),
            ("num_experts", num_experts, 1),
            ("dense_layers", dense, 1),
            ("moe_step", step, 1),
        ):
            if array.dtype.kind not in "iu" or (size is not None and array.size != size):
                raise UsageError(
                    f"{path}: {name} must be {'integers' if size != 1 else 'an integer'}"
                    f"{f' ({size} of them)' if size and size > 1 else ''}, got {array.dtype} "
                    f"of shape {array.shape}"
                )
        bs, nb, p, g = (int(v) for v in shape)
        try:  # (the table's own checks, said of this file: they name none)
            table = RoutingTable(ids, RunShape(bs, nb, p, g), int(num_experts), str(source), int(dense), int(step))
        except UsageError as err:
            raise UsageError(f"{path}: {err}") from None
        if not 0 <= table.dense_layers <= table.num_layers:
            raise UsageError(
                f"{path}: dense_layers {table.dense_layers} is not within the routing's {table.num_layers} layers"
            )
        if not 1 <= table.moe_step <= table.num_layers:
            raise UsageError(
                f"{path}: moe_step {table.moe_step} is not from 1 to the routing's {table.num_layers} layers"
            )
        if repeats_an_expert(table.ids):
            raise UsageError(f"{path}: a token selects the same expert twice (a router's top-k experts are distinct)")
        return table

    def first_use_orders(self, step: int, layer: int) -> list[list[int]]:
        """For every batch, `first_use` of the experts it uses (tokens routed to them) at this step
        and layer, from the fewest ids it takes: the first `_FIRST_USE_HEAD` tokens of a batch's
        first sequence hold every expert it uses in all but rare cases (a prefill's thousands of
        ids then cost a few dozen), and a batch whose head misses one is looked at whole."""
        nb = self.shape.num_batches
        used = self.counts[step, layer]  # [batch, expert]; all zero in a dense layer
        ids = self.step_block(step)[:, :, :, layer, :]  # [batch, seq, token, slot]
        head = ids[:, 0, :_FIRST_USE_HEAD] if ids.shape[2] > _FIRST_USE_HEAD else ids  # (in loop order)
        orders = [list(dict.fromkeys(row)) for row in head.reshape(nb, -1).tolist()]
        release(head)
        needed = np.count_nonzero(used, axis=1).tolist()
        rows = used.tolist()
        return [
            [e for e in (order if len(order) >= need else self.first_use(step, layer, b)) if row[e]]
            for b, (order, need, row) in enumerate(zip(orders, needed, rows))
        ]

    def first_use(self, step: int, layer: int, batch: int) -> list[int]:
        """The experts one batch uses at one step and layer, in the order its tokens first select
        them (tokens in order, sequence by sequence, then each token's choices in rank order):
        the order a loop over the routed ids meets them."""
        ids = self.step_ids(step, layer, batch)
        flat = ids.ravel()
        if len(flat) > _FIRST_USE_BY_SORT:  # a prefill's thousands of ids: each expert's first position, by a sort
            experts, first = np.unique(flat, return_index=True)
            release(ids)
            return experts[np.argsort(first)].tolist()
        return list(dict.fromkeys(flat.tolist()))

    def step_ids(self, step: int, layer: int, batch: int) -> np.ndarray:
        """`[seq, tokens_of_step, slot]` expert ids of one batch at one step and layer."""
        return self.step_block(step)[batch, :, :, layer, :]

    def step_block(self, step: int) -> np.ndarray:
        """`[batch, seq, tokens_of_step, layer, slot]`: the ids one step processes (a decode step's
        from memory, the prefill's where the routing is held, perhaps a mapped file)."""
        return self.ids[:, :, : self.shape.prompt_len] if step == 0 else self.decode_ids[:, :, step - 1 : step]
