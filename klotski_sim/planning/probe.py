"""n chosen by simulated probes, for policies whose best n no closed form gives.

Klotski's inequalities (planner.py) assume every cold expert crosses the link. `klotski-hybrid`
sends some to the CPU, and which ones depends on the tokens each gets, so on n; its layer is bound
by a chain (attention, gates, on-demand loads, experts, CPU outputs back before the next
attention) that no closed form tried for it captures (docs/cpu-experts.md, "n for
klotski-hybrid: simulated probes"). So the planner measures: for each candidate n it simulates a probe — the run's
own schedule, at that n with the resident layers its memory leaves room for, over the prefill and
a few generated tokens of the run's first n batches (`probe_gen_len`) — and predicts the whole run
as the probe's prefill plus its mean decode step times the run's decode steps. The split between link
and CPU follows from n through the policy's own rule, so choosing n chooses it.

Candidates: the powers of two below the planner's n (the most the run's routing holds), that n, then the midpoints
around the best of those. Predictions within `TIE` of the best are a tie, won by the smaller n
(less KV cache, lower per-token latency) — the margin the where-wins figure calls a tie.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

DECODE_STEPS = 2  # decode steps a probe averages at the least
BATCH_STEPS = 16  # ... and at least this many batch-steps (n x steps): one batch's routing, so its step time,
# varies from step to step (OLMoE, bs 4, n 1: two steps predict 79.4 tok/s, the whole run gives 77.0)
TIE = 0.005


def probe_gen_len(n: int, gen_len: int) -> int:
    """Generated tokens of the probe at n: the prefill's, then the decode steps it averages."""
    return min(gen_len, 1 + max(DECODE_STEPS, -(-BATCH_STEPS // n)))


@dataclass(frozen=True)
class Probe:
    """One candidate n, simulated briefly, and the whole run predicted from it."""

    n: int
    resident_layers: int
    prefill_s: float
    decode_step_s: float
    predicted_tok_s: float  # generated tokens / (prefill + decode steps x the run's decode steps)
    cpu_expert_share: float  # expert ops of the probe's decode steps that ran on the CPU


def candidates(n_max: int) -> list[int]:
    """The coarse candidates: powers of two below `n_max`, and `n_max`."""
    out = [1 << k for k in range(n_max.bit_length()) if 1 << k < n_max]
    return out + [n_max]


def choose(probes: dict[int, Probe]) -> Probe:
    """The smallest n whose prediction is within `TIE` of the best."""
    best = max(p.predicted_tok_s for p in probes.values())
    return min((p for p in probes.values() if p.predicted_tok_s >= best * (1 - TIE)), key=lambda p: p.n)


@dataclass(frozen=True)
class ProbeSearch:
    chosen: Probe
    probes: tuple[Probe, ...]  # every probe taken, in order of n

    def describe(self, policy: str, gen_len: int) -> str:
        """The probe table (`plan --policy`, `simulate`)."""
        lines = [
            f"{policy}: n by simulated probes (the prefill and {DECODE_STEPS}-{BATCH_STEPS} decode steps of the "
            f"run's first n batches; the whole run of {gen_len} generated predicted from them)",
            f"  {'n':>4} {'resident':>8} {'prefill s':>10} {'decode step s':>14} {'predicted tok/s':>16} "
            f"{'CPU experts':>12}",
        ]
        for p in self.probes:
            lines.append(
                f"  {p.n:4d} {p.resident_layers:8d} {p.prefill_s:10.3f} {p.decode_step_s:14.4f} "
                f"{p.predicted_tok_s:16.1f} {p.cpu_expert_share:12.0%}" + ("   <=" if p.n == self.chosen.n else "")
            )
        lines.append(
            f"=> n = {self.chosen.n} (predictions within {TIE:.1%} of the best are a tie, won by the smaller n)"
        )
        return "\n".join(lines)


def search(measure: Callable[[int], Probe], n_max: int) -> ProbeSearch:
    """Probe the coarse candidates, then the midpoints between the best one and its neighbours."""
    probes = {n: measure(n) for n in candidates(n_max)}
    coarse = sorted(probes)
    best = max(coarse, key=lambda n: probes[n].predicted_tok_s)
    at = coarse.index(best)
    for neighbour in coarse[max(0, at - 1) : at] + coarse[at + 1 : at + 2]:
        mid = (best + neighbour) // 2
        if mid not in probes:
            probes[mid] = measure(mid)
    return ProbeSearch(choose(probes), tuple(probes[n] for n in sorted(probes)))
