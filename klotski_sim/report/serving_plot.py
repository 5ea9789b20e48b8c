"""The picture of a serving comparison: per policy, the active batch `B_act` and the KV cache in use
over time, and the end-to-end latency CDF (FluxMoE's figures: SERVING.md)."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

import matplotlib.pyplot as plt  # the backend is the caller's
import numpy as np

from klotski_sim.serving.run import ServeResult


def serving_figure(results: Mapping[str, ServeResult], path: str | Path | None = None, dpi: int = 110) -> plt.Figure:
    """Three panels: B_act per iteration, KV blocks in use (share of the cache), latency CDF."""
    fig, (active, kv, cdf) = plt.subplots(1, 3, figsize=(15, 4.2))
    for name, r in results.items():
        ends = np.array([it.end_s for it in r.iterations])
        active.step(ends, [it.active for it in r.iterations], where="pre", label=name, linewidth=1)
        kv.step(ends, [100 * it.blocks_used / r.memory.num_blocks for it in r.iterations], where="pre", linewidth=1)
        latency = np.sort([q.latency_s for q in r.requests if not q.warmup])
        cdf.plot(latency, np.arange(1, len(latency) + 1) / len(latency), linewidth=1.2)
    active.set(xlabel="time (s)", ylabel="B_act (requests per iteration)", title="active batch")
    kv.set(xlabel="time (s)", ylabel="% of KV blocks in use", title="KV cache", ylim=(0, 105))
    cdf.set(xlabel="end-to-end latency (s)", ylabel="share of requests", title="latency CDF", ylim=(0, 1.02))
    fig.legend(loc="upper center", ncol=max(1, len(results)), frameon=False)
    fig.tight_layout(rect=(0, 0, 1, 0.92))
    if path is not None:
        fig.savefig(path, dpi=dpi, format="png")  # (written under a temporary name)
        plt.close(fig)
    return fig
