"""Pipeline Gantt charts: one lane per stream, colour by op category, GPU bubbles in red.

Honest at any zoom: each lane is drawn in about 2,000 bins, and in every bin each category gets
a bar exactly as long as the time it was busy there (stacked, left-aligned), so a lane that is 5%
busy looks 5% filled however many short ops it holds — nothing is merged into a solid block. One
compound path per (lane, category), not an artist per bar: a timeline of 300k ops plots in well under a second.
Long axes are in seconds, short ones in milliseconds.
"""

from __future__ import annotations

from pathlib import Path
from typing import Mapping, Sequence

import matplotlib.pyplot as plt  # the backend is the caller's: a notebook's inline one, Agg on a headless box
import numpy as np
from matplotlib.collections import PathCollection
from matplotlib.patches import Patch
from matplotlib.path import Path as MplPath

from .timeline import Timeline, merge_intervals

CATEGORY_COLORS: dict[str, str] = {
    "attention": "#4C72B0",
    "gate": "#8172B2",
    "expert": "#55A868",
    "embed": "#937860",
    "lm_head": "#3B3B3B",
    "weights": "#DD8452",
    "hot_expert": "#C44E52",
    "cold_expert": "#DA8BC3",
    "moe_weights": "#CCB974",
    "kv": "#64B5CD",
    "hidden": "#8C8C8C",
    "activation": "#17BECF",
    "dequant": "#BCBD22",
    "attn_qkv": "#6A8FC8",
    "attn_out": "#2F4F8F",
    "dense_mlp": "#2CA02C",
    "combine": "#B0B0B0",
}
BINS = 2000  # about a pixel at our figure widths
BUBBLE_COLOR = (0.894, 0.102, 0.110, 0.22)


def _color(category: str) -> str:
    return CATEGORY_COLORS.get(category, "#999999")


def draw_timeline(ax: plt.Axes, timeline: Timeline, window: tuple[float, float] | None = None,
                  streams: Sequence[str] | None = None, show_bubbles: bool = True) -> list[str]:
    """Draw one timeline into `ax` (times in ms); returns the categories drawn, for a legend.
    Each lane shows, per bin of about a pixel, the busy time of each category side by side from
    the bin's start; the compute lane's bubbles follow its busy time in the same bin (a bar per
    bubble took Agg 400 MB to rasterise the 150k bubbles of a long run)."""
    c = timeline.columns
    lanes = list(streams or timeline.streams())
    t0, t1 = window if window else (0.0, timeline.makespan)
    scale, unit = time_unit(t1 - t0)
    if not lanes:  # (a run the memory check refused: no op ran, and an empty panel says nothing)
        ax.text(0.5, 0.5, f"no op ran (status {timeline.status})", transform=ax.transAxes, ha="center", va="center")
        ax.set_yticks([])
        if t1 > t0:
            ax.set_xlim(t0 * scale, t1 * scale)
        ax.set_xlabel(f"time ({unit})")
        return []
    edges = np.linspace(t0, t1, BINS + 1)
    drawn: list[str] = []
    compute_filled = np.zeros(BINS)
    in_window = (c["end"] >= t0) & (c["start"] <= t1)
    category_codes, categories = timeline.codes("category")
    for lane, stream in enumerate(lanes):
        mask = timeline.rows_where("stream", stream) & in_window
        cats = category_codes[mask]
        starts, ends = c["start"][mask], c["end"][mask]
        filled = np.zeros(BINS)  # busy time already drawn in each bin (by earlier categories)
        first_rows = np.unique(cats, return_index=True)[1]
        for code in cats[np.sort(first_rows)]:  # categories in order of first appearance in the lane
            sel = cats == code
            cat = categories[code]
            busy = busy_per_bin(starts[sel], ends[sel], edges)
            keep = busy > 0
            draw_bars(ax, (edges[:-1][keep] + filled[keep]) * scale, busy[keep] * scale, lane - 0.38, 0.76,
                      _color(cat))
            filled += busy
            if cat not in drawn:
                drawn.append(cat)
        if stream == "compute":
            compute_filled = filled
    if show_bubbles and "compute" in lanes:
        bub = timeline.bubbles()
        if len(bub):
            idle = busy_per_bin(bub["start"].to_numpy(), bub["end"].to_numpy(), edges)
            keep = idle > 0
            draw_bars(ax, (edges[:-1][keep] + compute_filled[keep]) * scale, idle[keep] * scale,
                      lanes.index("compute") - 0.45, 0.9, BUBBLE_COLOR)
    ax.set_yticks(range(len(lanes)), lanes)
    ax.set_ylim(len(lanes) - 0.5, -0.5)
    ax.set_xlim(t0 * scale, t1 * scale)
    ax.set_xlabel(f"time ({unit})")
    ax.grid(axis="x", alpha=0.3)
    return drawn


def draw_bars(ax: plt.Axes, x: np.ndarray, width: np.ndarray, y: float, height: float, color: object) -> None:
    """Rectangles [x, x + width] x [y, y + height] drawn as one compound path: what `broken_barh`
    draws, without an artist (and unit conversion) per bar — thousands of bars per lane."""
    if not len(x):
        return
    x0, x1 = np.asarray(x, dtype=float), np.asarray(x, dtype=float) + np.asarray(width, dtype=float)
    corners = np.stack([np.stack([x0, np.full_like(x0, y)], axis=1), np.stack([x1, np.full_like(x0, y)], axis=1),
                        np.stack([x1, np.full_like(x0, y + height)], axis=1),
                        np.stack([x0, np.full_like(x0, y + height)], axis=1),
                        np.stack([x0, np.full_like(x0, y)], axis=1)], axis=1)  # [bars, 5, 2]
    codes = np.tile([MplPath.MOVETO, MplPath.LINETO, MplPath.LINETO, MplPath.LINETO, MplPath.CLOSEPOLY], len(x0))
    bars = PathCollection([MplPath(corners.reshape(-1, 2), codes)], facecolors=[color], edgecolors="none",
                          linewidths=0, snap=True)  # snapped to pixels as broken_barh's bars are
    ax.add_collection(bars, autolim=False)  # (the caller sets the limits)


def time_unit(span_s: float) -> tuple[float, str]:
    """Seconds on axes longer than two seconds, milliseconds below."""
    return (1.0, "s") if span_s > 2.0 else (1e3, "ms")


def busy_per_bin(starts: np.ndarray, ends: np.ndarray, edges: np.ndarray) -> np.ndarray:
    """Busy time of the union of [start, end) intervals inside each bin between `edges`: the
    increments of the busy-time-so-far function at the bin edges."""
    bs, be = merge_intervals(starts, ends, 0.0)
    if not len(bs):
        return np.zeros(len(edges) - 1)
    cum = np.concatenate([[0.0], np.cumsum(be - bs)])  # busy time before each interval starts

    def busy_before(t: np.ndarray) -> np.ndarray:
        k = np.searchsorted(bs, t, side="right")  # intervals starting at or before t
        inside = np.where(k > 0, np.clip(t - bs[np.maximum(k - 1, 0)], 0, (be - bs)[np.maximum(k - 1, 0)]), 0.0)
        return cum[np.maximum(k - 1, 0)] * (k > 0) + inside

    return np.diff(busy_before(edges))


def legend(fig: plt.Figure, categories: Sequence[str]) -> None:
    handles = [Patch(color=_color(cat), label=cat) for cat in categories]
    handles.append(Patch(facecolor=BUBBLE_COLOR, label="GPU bubble"))
    fig.legend(handles=handles, loc="upper center", ncol=min(8, len(handles)), frameon=False, fontsize=8)


def _finish(fig: plt.Figure, categories: Sequence[str], path: str | Path | None, top: float, dpi: int) -> plt.Figure:
    """Legend on top, layout, and save (closing the figure) when a path is given."""
    legend(fig, categories)
    fig.tight_layout(rect=(0, 0, 1, top))
    # laid out once, and no layout engine left: with one (even the placeholder that "none" leaves
    # after tight_layout) saving draws the whole figure once more before it renders (0.18 of 0.67 s
    # for compare.png); None removes it unless the user's rcParams ask for a layout
    with plt.rc_context({"figure.autolayout": False, "figure.constrained_layout.use": False}):
        fig.set_layout_engine(None)
    if path is not None:
        fig.savefig(path, dpi=dpi)
        plt.close(fig)
    return fig


def gantt(timeline: Timeline, path: str | Path | None = None, window: tuple[float, float] | None = None,
          title: str | None = None) -> plt.Figure:
    """One timeline, one lane per stream. Saved to `path` when given."""
    lanes = timeline.streams()
    fig, ax = plt.subplots(figsize=(14, 1.0 + 0.55 * len(lanes)))
    cats = draw_timeline(ax, timeline, window)
    s = timeline.summary()
    ax.set_title(title or f"{s.policy} · {s.model} · {s.hardware} · bs={s.batch_size} n={s.num_batches} · "
                          f"{s.throughput_tok_s:.2f} tok/s · bubbles {s.bubble_s * 1e3:.0f} ms", fontsize=10)
    return _finish(fig, cats, path, top=0.9, dpi=110)


def moe_block_window(timeline: Timeline, step: int, layer: int, pad_layers: int = 0) -> tuple[float, float]:
    """The time span of one layer (attention through the last expert) of one step on the GPU."""
    c = timeline.columns
    mask = timeline.rows_where("resource", "gpu") & (c["step"] == step) & (c["layer"] >= layer - pad_layers) & (
        c["layer"] <= layer + pad_layers)
    if not mask.any():
        return (0.0, timeline.makespan)
    return float(c["start"][mask].min()), float(c["end"][mask].max())


def compare_gantt(timelines: Mapping[str, Timeline], path: str | Path | None = None,
                  zoom: tuple[int, int] | None = None) -> plt.Figure:
    """One panel per policy on a shared time axis; with `zoom=(step, layer)` a second column
    shows that MoE block of every policy, each on its own axis."""
    names = list(timelines)
    ncols = 2 if zoom else 1
    heights = [1.0 + 0.45 * len(timelines[n].streams()) for n in names]
    fig, axes = plt.subplots(len(names), ncols, figsize=(16 if zoom else 14, sum(heights) + 1.0),
                             gridspec_kw={"height_ratios": heights, "width_ratios": [3, 2] if zoom else [1]},
                             squeeze=False)
    horizon = max(tl.makespan for tl in timelines.values())
    if zoom:  # every zoom panel on one scale: as wide as the longest of the blocks
        windows = {n: moe_block_window(timelines[n], *zoom) for n in names}
        width = max(b - a for a, b in windows.values())
    cats: list[str] = []
    for row, name in enumerate(names):
        tl = timelines[name]
        s = tl.summary()
        for cat in draw_timeline(axes[row][0], tl, (0.0, horizon)):
            if cat not in cats:
                cats.append(cat)
        status = "" if s.status == "ok" else f" [{s.status}]"
        axes[row][0].set_title(f"{name}{status}: {s.throughput_tok_s:.2f} tok/s, makespan {s.makespan_s:.2f} s, "
                               f"bubbles inter {s.bubble_inter_s:.2f} s / intra {s.bubble_intra_s:.2f} s",
                               fontsize=9, loc="left")
        if zoom:
            start = windows[name][0]
            draw_timeline(axes[row][1], tl, (start, start + width))
            axes[row][1].set_title(f"step {zoom[0]}, layer {zoom[1]} (zoom, one scale)", fontsize=9, loc="left")
    return _finish(fig, cats, path, top=0.97, dpi=100)
