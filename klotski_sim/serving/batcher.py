"""Continuous batching over a paged KV cache: which requests run in the next iteration, decided from
the state at its start, as vLLM's V1 scheduler decides it (docs/serving.md cites its code):

1. The *running* requests first, in order, each given the tokens it still has to compute (one for
   a request that is decoding; the rest of its prompt, or a chunk of it within the iteration's token
   budget `max_num_batched_tokens`, for one in prefill). A request that needs a KV block when none
   is free preempts the *last* running request (the latest admitted), by recompute: its blocks are
   freed and it goes back to the front of the waiting queue with nothing computed; when the
   request itself is the last, it preempts itself.
2. Then, if nothing was preempted in this iteration, the *waiting* requests that have arrived,
   first come first served, while `max_num_seqs`, the token budget and the free blocks allow; the
   first that does not fit stops admission (no request overtakes an earlier one).
3. When the iteration ends, every request whose computed tokens reach all its known tokens samples
   one output token; a request with all its output tokens leaves and frees its blocks.

The KV cache is `num_blocks` blocks of `block_size` tokens (every layer's K and V for those tokens);
a request holds ceil(computed tokens / block_size) blocks.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import NamedTuple

from klotski_sim.serving.requests import Request, Workload
from klotski_sim.util.errors import UsageError


class ServingRefusal(UsageError):
    """A serving configuration that cannot run (with the numbers)."""


@dataclass(frozen=True)
class BatchingConfig:
    """The scheduler's limits (vLLM's names)."""

    max_num_seqs: int = 256  # requests in the running batch at most
    max_num_batched_tokens: int = 8192  # tokens computed in one iteration at most
    block_size: int = 16  # tokens per KV block
    chunked_prefill: bool = True  # a prompt longer than the budget left is split across iterations

    def __post_init__(self) -> None:
        for name in ("max_num_seqs", "max_num_batched_tokens", "block_size"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ServingRefusal(f"{name} must be a whole number >= 1, got {value!r}")


def check_batching(workload: Workload, config: BatchingConfig) -> None:
    """Refuse a workload the scheduler's limits can never run, whatever the policy."""
    if not config.chunked_prefill:
        longest = max(r.total_len - 1 for r in workload.requests)  # (a recompute after a preemption)
        if longest > config.max_num_batched_tokens:
            raise UsageError(
                f"without chunked prefill a prompt (or a preempted request's recompute) of up to {longest:,} "
                f"tokens must fit one iteration's --max-num-batched-tokens {config.max_num_batched_tokens:,}"
            )


@dataclass
class SequenceState:
    """A request as the scheduler tracks it."""

    request: Request
    computed: int = 0  # tokens whose K and V are in the cache
    generated: int = 0  # output tokens sampled so far
    blocks: int = 0
    admitted_s: float | None = None
    first_token_s: float | None = None
    finished_s: float | None = None
    preemptions: int = 0

    @property
    def known(self) -> int:
        """Tokens the request has: its prompt and the output sampled so far."""
        return self.request.prompt_len + self.generated

    @property
    def to_compute(self) -> int:
        return self.known - self.computed


class Scheduled(NamedTuple):
    """One request's share of an iteration: `new_tokens` computed over a cache that then holds
    `context` tokens; `prefill` when they are prompt (or recomputed) tokens, not one decode token.
    (A NamedTuple: a run makes one per request and iteration, hundreds of thousands.)"""

    request: int
    new_tokens: int
    context: int
    prefill: bool
    samples: bool  # it samples an output token at the iteration's end


@dataclass(frozen=True)
class Iteration:
    """What one iteration runs, and the state it was decided in."""

    index: int
    start_s: float
    seqs: tuple[Scheduled, ...]
    preempted: tuple[int, ...]
    blocks_used: int  # after this iteration's allocations
    waiting: int  # arrived requests left waiting

    @property
    def tokens(self) -> int:
        return sum(s.new_tokens for s in self.seqs)

    @property
    def prefill_tokens(self) -> int:
        return sum(s.new_tokens for s in self.seqs if s.prefill)

    @property
    def decode_seqs(self) -> int:
        return sum(1 for s in self.seqs if not s.prefill)


@dataclass
class ContinuousBatcher:
    """The scheduler's state between iterations (module docstring)."""

    workload: Workload
    config: BatchingConfig
    num_blocks: int
    seqs: list[SequenceState] = field(init=False)
    running: list[int] = field(init=False, default_factory=list)
    waiting: deque[int] = field(init=False, default_factory=deque)
    free_blocks: int = field(init=False)
    next_arrival: int = field(init=False, default=0)  # the first request not yet arrived
    iterations: int = field(init=False, default=0)
    min_blocks: int = field(init=False, default=1)  # the longest request's blocks at its end
    preemptions: int = field(init=False, default=0)

    def __post_init__(self) -> None:
        self.seqs = [SequenceState(r) for r in self.workload.requests]
        self.free_blocks = self.num_blocks
        cfg = self.config
        if self.num_blocks < 1:
            raise ServingRefusal(f"the KV cache holds {self.num_blocks} blocks: no request can run")
        # (a request's cache holds its prompt and every output token but the last, which no iteration computes)
        longest = max(self.workload.requests, key=lambda r: r.total_len)
        need = self.min_blocks = -(-(longest.total_len - 1) // cfg.block_size)
        if need > self.num_blocks:
            raise ServingRefusal(
                f"request {longest.id} ({longest.prompt_len} prompt + {longest.output_len} output tokens) needs "
                f"{need:,} KV blocks of {cfg.block_size} tokens at its end; the KV cache holds {self.num_blocks:,}"
            )
        check_batching(self.workload, cfg)

    # ---- state ---------------------------------------------------------------------------------
    @property
    def done(self) -> bool:
        return self.next_arrival == len(self.seqs) and not self.running and not self.waiting

    @property
    def blocks_used(self) -> int:
        return self.num_blocks - self.free_blocks

    def resize(self, num_blocks: int) -> None:
        """The KV cache grows or shrinks between iterations (a residency planner's decision); it never
        shrinks below the blocks in use."""
        if num_blocks < max(self.blocks_used, self.min_blocks):
            raise ServingRefusal(
                f"the KV cache cannot shrink to {num_blocks} blocks: {self.blocks_used} are in use and the longest "
                f"request needs {self.min_blocks}"
            )
        self.free_blocks += num_blocks - self.num_blocks
        self.num_blocks = num_blocks

    def next_arrival_s(self) -> float | None:
        """When the next request not yet arrived arrives (None: all have)."""
        if self.next_arrival < len(self.seqs):
            return self.seqs[self.next_arrival].request.arrival_s
        return None

    def _arrive(self, now: float) -> None:
        while self.next_arrival < len(self.seqs) and self.seqs[self.next_arrival].request.arrival_s <= now:
            self.waiting.append(self.next_arrival)
            self.next_arrival += 1

    def _blocks_for(self, tokens: int) -> int:
        return -(-tokens // self.config.block_size)

    def _preempt(self, index: int) -> None:
        seq = self.seqs[index]
        self.free_blocks += seq.blocks
        seq.blocks, seq.computed = 0, 0
        seq.preemptions += 1
        self.preemptions += 1
        self.running.remove(index)
        self.waiting.appendleft(index)

    def _ask(self, index: int, budget: int) -> tuple[int, int] | None:
        """The tokens request `index` computes now within `budget`, and the blocks that takes; None
        for a prompt that must not be split (no chunked prefill) and does not fit what is left."""
        seq = self.seqs[index]
        wanted = seq.request.prompt_len + seq.generated - seq.computed
        tokens = wanted if wanted < budget else budget
        if tokens < wanted and not self.config.chunked_prefill:
            return None
        return tokens, -(-(seq.computed + tokens) // self.config.block_size) - seq.blocks

    def _grant(self, index: int, tokens: int, blocks: int, chosen: dict[int, int]) -> None:
        self.free_blocks -= blocks
        self.seqs[index].blocks += blocks
        chosen[index] = tokens

    # ---- one iteration -------------------------------------------------------------------------
    def schedule(self, now: float) -> Iteration:
        """The next iteration's requests, decided from the state at `now` (module docstring)."""
        self._arrive(now)
        cfg = self.config
        budget = cfg.max_num_batched_tokens
        chosen: dict[int, int] = {}  # request -> tokens this iteration
        preempted: list[int] = []
        queue = list(self.running)
        k = 0
        while k < len(queue) and budget > 0:
            index = queue[k]
            if preempted and index not in self.running:  # preempted by a request before it
                k += 1
                continue
            asked = self._ask(index, budget)
            if asked is None:
                break
            tokens, need = asked
            while need > self.free_blocks:
                victim = self.running[-1]
                self._preempt(victim)
                preempted.append(victim)
                budget += chosen.pop(victim, 0)
                if victim == index:
                    break
            if index not in self.running:
                k += 1
                continue
            self._grant(index, tokens, need, chosen)
            budget -= tokens
            k += 1
        if not preempted:
            while self.waiting and budget > 0 and len(self.running) < cfg.max_num_seqs:
                index = self.waiting[0]
                asked = self._ask(index, budget)
                if asked is None or asked[1] > self.free_blocks:
                    break
                tokens, need = asked
                self.waiting.popleft()
                if self.seqs[index].admitted_s is None:
                    self.seqs[index].admitted_s = now
                self.running.append(index)
                self._grant(index, tokens, need, chosen)
                budget -= tokens
        scheduled = tuple(map(self._scheduled, chosen.items()))
        iteration = Iteration(self.iterations, now, scheduled, tuple(preempted), self.blocks_used, len(self.waiting))
        self.iterations += 1
        return iteration

    def _scheduled(self, chosen: tuple[int, int]) -> Scheduled:
        index, tokens = chosen
        seq = self.seqs[index]
        context, known = seq.computed + tokens, seq.request.prompt_len + seq.generated
        return Scheduled(index, tokens, context, known - seq.computed > 1 or seq.generated == 0, context == known)

    def finish(self, iteration: Iteration, end_s: float) -> list[int]:
        """The iteration ended at `end_s`: tokens are sampled, finished requests leave (returned)."""
        finished = []
        for item in iteration.seqs:
            seq = self.seqs[item.request]
            seq.computed += item.new_tokens
            if item.samples:
                seq.generated += 1
                if seq.first_token_s is None:
                    seq.first_token_s = end_s
                if seq.generated == seq.request.output_len:
                    seq.finished_s = end_s
                    self.free_blocks += seq.blocks
                    seq.blocks = 0
                    self.running.remove(item.request)
                    finished.append(item.request)
        return finished
