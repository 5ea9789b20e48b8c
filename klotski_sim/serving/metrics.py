"""What a serving run is judged by: output throughput, time to first token (TTFT), time per output
token after the first (TPOT), end-to-end latency (mean, P50, P90, P99), the active batch `B_act` per
iteration, preemptions and KV-cache use; FluxMoE's metrics (SERVING.md "Testbeds and workloads").
Warm-up requests are served but not counted."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any, Sequence

import numpy as np


@dataclass(frozen=True)
class RequestRecord:
    """One request as it was served."""

    id: int
    prompt_len: int
    output_len: int
    arrival_s: float
    admitted_s: float
    first_token_s: float
    finished_s: float
    preemptions: int
    warmup: bool

    @property
    def ttft_s(self) -> float:
        return self.first_token_s - self.arrival_s

    @property
    def tpot_s(self) -> float:
        """Mean interval between its later tokens (0 for a one-token output)."""
        return (self.finished_s - self.first_token_s) / (self.output_len - 1) if self.output_len > 1 else 0.0

    @property
    def latency_s(self) -> float:
        return self.finished_s - self.arrival_s


@dataclass(frozen=True)
class IterationRecord:
    """One iteration as it ran."""

    index: int
    start_s: float
    end_s: float
    active: int  # B_act: requests scheduled
    tokens: int
    prefill_tokens: int
    decode_seqs: int
    blocks_used: int
    waiting: int
    preempted: int


@dataclass(frozen=True)
class Spread:
    mean: float
    p50: float
    p90: float
    p99: float

    @classmethod
    def of(cls, values: Sequence[float]) -> "Spread":
        if not len(values):
            return cls(float("nan"), float("nan"), float("nan"), float("nan"))
        a = np.asarray(values, dtype=float)
        p50, p90, p99 = np.percentile(a, [50, 90, 99])
        return cls(float(a.mean()), float(p50), float(p90), float(p99))


@dataclass(frozen=True)
class ServingMetrics:
    requests: int  # measured (warm-up excluded)
    output_tokens: int
    duration_s: float  # from the first measured arrival to the last measured finish
    throughput_tok_s: float  # output tokens per second over `duration_s`
    ttft_s: Spread
    tpot_s: Spread
    latency_s: Spread
    mean_active: float  # B_act averaged over iterations
    max_active: int
    iterations: int
    preemptions: int
    peak_kv_blocks: int
    num_blocks: int

    @classmethod
    def of(
        cls, requests: Sequence[RequestRecord], iterations: Sequence[IterationRecord], num_blocks: int
    ) -> "ServingMetrics":
        measured = [r for r in requests if not r.warmup]
        begin = min(r.arrival_s for r in measured)
        finish = max(r.finished_s for r in measured)
        tokens = sum(r.output_len for r in measured)
        duration = finish - begin
        active = [it.active for it in iterations]
        return cls(
            requests=len(measured),
            output_tokens=tokens,
            duration_s=duration,
            throughput_tok_s=tokens / duration if duration > 0 else float("nan"),
            ttft_s=Spread.of([r.ttft_s for r in measured]),
            tpot_s=Spread.of([r.tpot_s for r in measured if r.output_len > 1]),
            latency_s=Spread.of([r.latency_s for r in measured]),
            mean_active=float(np.mean(active)) if active else 0.0,
            max_active=max(active, default=0),
            iterations=len(iterations),
            preemptions=sum(r.preemptions for r in requests),
            peak_kv_blocks=max((it.blocks_used for it in iterations), default=0),
            num_blocks=num_blocks,
        )

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)
