"""The best residency of expert paging for one serving workload: `klotski-sim serve --search`.

FluxMoE's static residency is two numbers — how many MoE layers are pageable and what share of their
experts sits in the compressed GPU tier — and the right pair depends on the workload: more pageable
layers leave more KV memory (a larger active batch), more host share makes each iteration longer.
The search serves the workload at every pair of a grid (pageable layers in eighths of the stack,
compressed shares from the bandwidth-balanced one down to none), each run dropping its ops as they
are timed, and reports the Pareto front of throughput against TPOT and the winner: the highest
throughput within `--max-tpot`. An exhaustive grid, for the reasons `optimize` gives
(klotski_sim/runs/optimize.py): few points, a non-smooth objective, reproducible.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from klotski_sim.serving.batcher import ServingRefusal
from klotski_sim.serving.run import ServeSpec, serve

SHARES = (1.0, 0.75, 0.5, 0.25, 0.0)  # of the bandwidth-balanced share


@dataclass(frozen=True)
class Point:
    pageable_layers: int
    compressed_share: float
    throughput_tok_s: float
    tpot_s: float
    ttft_s: float
    mean_active: float
    refused: str = ""


def grid(spec: ServeSpec) -> list[tuple[int, float]]:
    """(pageable layers, compressed share) pairs for a `fluxmoe` or `fluxmoe-h` spec."""
    from klotski_sim.serving.policies.fluxmoe import balanced_share

    if spec.policy not in ("fluxmoe", "fluxmoe-h"):
        raise ServingRefusal(f"--search searches expert paging's residency: fluxmoe or fluxmoe-h, not {spec.policy}")
    moe = sum(1 for j in range(spec.model.num_layers) if spec.model.is_moe(j))
    counts = sorted({max(1, round(moe * q / 8)) for q in range(1, 9)})
    balanced = balanced_share(spec.profile, spec.policy)
    return [(n, round(balanced * s, 4)) for n in counts for s in SHARES]


def search(spec: ServeSpec) -> list[Point]:
    """Serve `spec` at every point of the grid (each point's own options over the spec's)."""
    points = []
    for count, share in grid(spec):
        options = {**spec.options, "pageable_layers": count, "compressed_share": share}
        try:
            m = serve(replace(spec, options=options), keep=False).metrics
        except ServingRefusal as err:
            points.append(Point(count, share, float("nan"), float("nan"), float("nan"), 0.0, str(err)))
            continue
        points.append(Point(count, share, m.throughput_tok_s, m.tpot_s.mean, m.ttft_s.mean, m.mean_active))
    return points


def pareto(points: list[Point]) -> list[Point]:
    """The points no other beats on both throughput (higher) and TPOT (lower), by throughput."""
    ran = [p for p in points if not p.refused]
    front = [
        p
        for p in ran
        if not any(
            q.throughput_tok_s >= p.throughput_tok_s
            and q.tpot_s <= p.tpot_s
            and (q.throughput_tok_s > p.throughput_tok_s or q.tpot_s < p.tpot_s)
            for q in ran
        )
    ]
    return sorted(front, key=lambda p: -p.throughput_tok_s)


def best(points: list[Point], max_tpot_s: float | None) -> Point | None:
    """The highest throughput within the TPOT cap (None: no point meets it)."""
    fits = [p for p in points if not p.refused and (max_tpot_s is None or p.tpot_s <= max_tpot_s)]
    return max(fits, key=lambda p: (p.throughput_tok_s, -p.tpot_s), default=None)
