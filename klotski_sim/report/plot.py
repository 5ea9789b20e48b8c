"""Pipeline Gantt charts: one lane per stream, colour by op category, GPU bubbles in red.

Honest at any zoom. A window a lane's ops resolve in (a zoomed MoE block) is drawn in about 2,000
bins, and in every bin each category gets a bar exactly as long as the time it was busy there
(stacked, left-aligned). A window too long for that (a whole run: tens of thousands of ops, many to
a pixel, whose sub-pixel bars would blend bubble and compute into one grey-green band) is drawn in bins
a few pixels wide, each lane's height split by the share of the bin each category (and, on the
compute lane, each bubble) took: a lane 5% busy is 5% filled either way, and no colour is mixed.
One compound path per (lane, category), not an artist per bar: a timeline of 300k ops plots in
well under a second. Long axes are in seconds, short ones in milliseconds; the prefill/decode
boundary is a dashed line. The host lane is left out where it only waits on syncs (it is blocked
nearly all of every run: a solid bar; the title says its share once).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import matplotlib.pyplot as plt  # the backend is the caller's: a notebook's inline one, Agg on a headless box
import numpy as np
from matplotlib.collections import PathCollection
from matplotlib.patches import Patch
from matplotlib.path import Path as MplPath

from klotski_sim.core.timeline import Timeline, merge_intervals
from klotski_sim.util.units import duration_text, duration_unit

if TYPE_CHECKING:
    import pandas as pd

CATEGORY_COLORS: dict[str, str] = {
    "attention": "#4C72B0",
    "gate": "#8172B2",
    "expert": "#55A868",
    "embed": "#937860",
    "lm_head": "#3B3B3B",
    "weights": "#DD8452",
    "hot_expert": "#882255",  # (Paul Tol's wine and cyan: hot and cold told apart also without colour
    "cold_expert": "#88CCEE",  # vision, and neither near the bubbles' red)
    "moe_weights": "#CCB974",
    "kv": "#64B5CD",
    "hidden": "#8C8C8C",
    "activation": "#17BECF",
    "dequant": "#BCBD22",
    "attn_qkv": "#6A8FC8",
    "attn_out": "#2F4F8F",
    "dense_mlp": "#2CA02C",
    "combine": "#B0B0B0",
    "moe": "#55A868",  # a layer's experts in one fused op: the experts' colour
    "decompress": "#AA3377",  # compressed experts decompressed on the GPU (FluxMoE)
    "remap": "#DDDDDD",  # a residency change (no work)
    "sync": "#BBBBBB",  # the host waiting on a GPU op
    "copy_wait": "#5F3C1E",  # the host waiting on a pageable copy
}
BINS = 2000  # about a pixel at our figure widths
BUBBLE_COLOR = "#E31A1C"  # opaque: a translucent pink over sub-pixel bars mixes into the compute colours
SHARE_BIN_PX = 3  # a bin of a long window's share drawing: a few pixels, wide enough that no colour mixes
HOST_WAITS = ("sync",)  # a host lane of nothing else is not drawn (a solid bar); its share goes in the title


def _color(category: str) -> str:
    return CATEGORY_COLORS.get(category, "#999999")


def figure_lanes(timeline: Timeline) -> list[str]:
    """The lanes a figure draws: every stream but a host lane that only waits on syncs (the host
    thread is blocked nearly all of every run, on the very ops the GPU lane shows: a solid bar)."""
    lanes = timeline.streams()
    if "host" in lanes:
        codes, categories = timeline.codes("category")
        waits = {categories[k] for k in np.unique(codes[timeline.rows_where("stream", "host")])}
        if waits <= set(HOST_WAITS):
            lanes.remove("host")
    return lanes


def draw_timeline(
    ax: plt.Axes,
    timeline: Timeline,
    window: tuple[float, float] | None = None,
    streams: Sequence[str] | None = None,
    show_bubbles: bool = True,
    relative: bool = False,
) -> list[str]:
    """Draw one timeline into `ax`; returns the categories drawn, for a legend. `streams`: the lanes
    (default: `figure_lanes`); `relative`: the axis reads time from the window's start. Where the
    lanes' ops are a few pixels long or more (`typical_op_seconds`: a zoomed MoE block) each lane
    shows, per bin of about a pixel, the busy time of each category side by side from the bin's
    start, the compute lane's bubbles after it (a bar per bubble takes Agg 400 MB to rasterise the
    150k bubbles of a long run); where they are shorter (a whole run: many to a pixel, which blends
    their colours), bins of a few pixels, each lane's height split by the shares of the bin
    (`draw_shares`). The prefill/decode changes are marked (`mark_phases`)."""
    c = timeline.columns
    lanes = list(streams) if streams is not None else figure_lanes(timeline)
    t0, t1 = window if window else (0.0, timeline.makespan)
    scale, unit = time_unit(t1 - t0)
    origin = t0 if relative else 0.0
    ax.set_xlabel(f"{unit} from the window's start" if relative else f"time ({unit})")
    if not lanes:  # (a run the memory check refused: no op ran, and an empty panel says nothing)
        ax.text(0.5, 0.5, f"no op ran (status {timeline.status})", transform=ax.transAxes, ha="center", va="center")
        ax.set_yticks([])
        if t1 > t0:
            ax.set_xlim((t0 - origin) * scale, (t1 - origin) * scale)
        return []
    in_window = (c["end"] >= t0) & (c["start"] <= t1)
    category_codes, categories = timeline.codes("category")
    rows = [timeline.rows_where("stream", stream) & in_window for stream in lanes]
    bubbles = timeline.bubbles() if show_bubbles and "compute" in lanes else None
    if bubbles is not None and not len(bubbles):
        bubbles = None
    pixels = max(50.0, ax.get_window_extent().width)
    shown = np.logical_or.reduce(rows)
    if typical_op_seconds(c["start"][shown], c["end"][shown], (t0, t1)) < 2 * (t1 - t0) / pixels:
        bins = int(pixels / SHARE_BIN_PX)
        drawn = draw_shares(ax, timeline, lanes, rows, (t0, t1), bins, bubbles, origin, scale)
        ax.set_xlabel(
            f"{ax.get_xlabel()} · lane height: share of each {duration_text((t1 - t0) / bins, decimals=2)} "
            f"bin per category"
        )
    else:
        edges = np.linspace(t0, t1, BINS + 1)
        drawn = []
        compute_filled = np.zeros(BINS)
        for lane, (stream, mask) in enumerate(zip(lanes, rows)):
            cats = category_codes[mask]
            starts, ends = c["start"][mask], c["end"][mask]
            filled = np.zeros(BINS)  # busy time already drawn in each bin (by earlier categories)
            first_rows = np.unique(cats, return_index=True)[1]
            for code in cats[np.sort(first_rows)]:  # categories in order of first appearance in the lane
                sel = cats == code
                cat = categories[code]
                busy = busy_per_bin(starts[sel], ends[sel], edges)
                keep = busy > 0
                draw_bars(
                    ax,
                    (edges[:-1][keep] + filled[keep] - origin) * scale,
                    busy[keep] * scale,
                    lane - 0.38,
                    0.76,
                    _color(cat),
                )
                filled += busy
                if cat not in drawn:
                    drawn.append(cat)
            if stream == "compute":
                compute_filled = filled
        if bubbles is not None:
            idle = busy_per_bin(bubbles["start"].to_numpy(), bubbles["end"].to_numpy(), edges)
            keep = idle > 0
            draw_bars(
                ax,
                (edges[:-1][keep] + compute_filled[keep] - origin) * scale,
                idle[keep] * scale,
                lanes.index("compute") - 0.45,
                0.9,
                BUBBLE_COLOR,
            )
    ax.set_yticks(range(len(lanes)), lanes)
    ax.set_ylim(len(lanes) - 0.5, -0.5)
    ax.set_xlim((t0 - origin) * scale, (t1 - origin) * scale)
    ax.grid(axis="x", alpha=0.3)
    mark_phases(ax, timeline, (t0, t1), origin, scale)
    return drawn


def typical_op_seconds(starts: np.ndarray, ends: np.ndarray, window: tuple[float, float]) -> float:
    """The length of op half the busy time inside the window is in (a median weighted by length: the
    host's thousands of microsecond syncs do not make a zoomed block's millisecond ops look short)."""
    t0, t1 = window
    d = np.sort(np.clip(ends, t0, t1) - np.clip(starts, t0, t1))
    d = d[d > 0]
    if not len(d):
        return float("inf")
    return float(d[np.searchsorted(np.cumsum(d), d.sum() / 2)])


def draw_shares(
    ax: plt.Axes,
    timeline: Timeline,
    lanes: Sequence[str],
    rows: Sequence[np.ndarray],
    window: tuple[float, float],
    bins: int,
    bubbles: pd.DataFrame | None,
    origin: float,
    scale: float,
) -> list[str]:
    """Each lane in `bins` bins, its height split by the share of each bin each category was busy
    (stacked from the lane's foot, in order of first appearance), then, on the compute lane, the
    share of the bin its bubbles took: a lane's fill is its busy share, and bars a few pixels wide
    keep every colour its own."""
    c = timeline.columns
    category_codes, categories = timeline.codes("category")
    t0, t1 = window
    edges = np.linspace(t0, t1, bins + 1)
    width = np.diff(edges)
    x = (edges[:-1] - origin) * scale
    drawn: list[str] = []
    for lane, (stream, mask) in enumerate(zip(lanes, rows)):
        cats = category_codes[mask]
        starts, ends = c["start"][mask], c["end"][mask]
        filled = np.zeros(bins)  # share of each bin already drawn (by earlier categories)
        first_rows = np.unique(cats, return_index=True)[1]
        parts = [
            (categories[code], busy_per_bin(starts[cats == code], ends[cats == code], edges))
            for code in cats[np.sort(first_rows)]
        ]
        if stream == "compute" and bubbles is not None:
            parts.append(("GPU bubble", busy_per_bin(bubbles["start"].to_numpy(), bubbles["end"].to_numpy(), edges)))
        for cat, busy in parts:
            share = np.minimum(busy / width, 1.0 - filled)  # (overlapping ops of a lane fill it once)
            keep = share > 0
            foot = lane + 0.38 - filled[keep] * 0.76  # (lanes run down the axis: a lane's foot is its larger y)
            color = BUBBLE_COLOR if cat == "GPU bubble" else _color(cat)
            draw_bars(
                ax,
                x[keep],
                np.full(int(keep.sum()), width[0] * scale),
                foot - share[keep] * 0.76,
                share[keep] * 0.76,
                color,
            )
            filled += np.maximum(share, 0.0)
            if cat != "GPU bubble" and cat not in drawn:
                drawn.append(cat)
    return drawn


def phase_changes(timeline: Timeline) -> list[tuple[float, str, str]]:
    """Where the GPU goes from one phase to the other: (time, phase before, phase after) at the start
    of the first GPU op of each run of ops of one phase, in time order — one prefill -> decode change
    where the batches share their steps, one per batch where they run one after another. The ops'
    `phase` tag, or, in a timeline kept to the figure's columns, their step (step 0 is the prefill)."""
    c = timeline.columns
    gpu = timeline.rows_where("resource", "gpu")
    if not gpu.any():
        return []
    try:
        prefill = np.asarray(c["phase"][gpu] == "prefill", dtype=bool)
    except KeyError:
        prefill = c["step"][gpu] == 0
    order = np.argsort(c["start"][gpu], kind="stable")
    starts, prefill = c["start"][gpu][order], prefill[order]
    changes = np.flatnonzero(prefill[1:] != prefill[:-1]) + 1
    names = {True: "prefill", False: "decode"}
    return [(float(starts[i]), names[bool(prefill[i - 1])], names[bool(prefill[i])]) for i in changes]


def mark_phases(ax: plt.Axes, timeline: Timeline, window: tuple[float, float], origin: float, scale: float) -> None:
    """A dashed line at each prefill/decode change inside the window, labelled at the top of the
    panel (the first of each kind, where there are many: a single-batch run of many batches)."""
    t0, t1 = window
    labelled: set[tuple[str, str]] = set()
    for t, before, after in phase_changes(timeline):
        if not t0 < t < t1:
            continue
        x = (t - origin) * scale
        ax.axvline(x, color="black", lw=1.0, ls="--", zorder=5, gid="phase-change")
        if (before, after) not in labelled:
            labelled.add((before, after))
            ax.text(
                x,
                1.0,
                f"{before} | {after}",
                transform=ax.get_xaxis_transform(),
                ha="center",
                va="bottom",
                fontsize=7,
                zorder=6,
                gid="phase-change",
            )


def draw_bars(
    ax: plt.Axes, x: np.ndarray, width: np.ndarray, y: float | np.ndarray, height: float | np.ndarray, color: object
) -> None:
    """Rectangles [x, x + width] x [y, y + height] drawn as one compound path: what `broken_barh`
    draws, without an artist (and unit conversion) per bar — thousands of bars per lane. `y` and
    `height`: one for every bar, or one each."""
    if not len(x):
        return
    x0, x1 = np.asarray(x, dtype=float), np.asarray(x, dtype=float) + np.asarray(width, dtype=float)
    y0 = np.broadcast_to(np.asarray(y, dtype=float), x0.shape)
    y1 = y0 + np.broadcast_to(np.asarray(height, dtype=float), x0.shape)
    corners = np.stack(
        [
            np.stack([x0, y0], axis=1),
            np.stack([x1, y0], axis=1),
            np.stack([x1, y1], axis=1),
            np.stack([x0, y1], axis=1),
            np.stack([x0, y0], axis=1),
        ],
        axis=1,
    )  # [bars, 5, 2]
    codes = np.tile([MplPath.MOVETO, MplPath.LINETO, MplPath.LINETO, MplPath.LINETO, MplPath.CLOSEPOLY], len(x0))
    bars = PathCollection(
        [MplPath(corners.reshape(-1, 2), codes)], facecolors=[color], edgecolors="none", linewidths=0, snap=True
    )  # snapped to pixels as broken_barh's bars are
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
    handles.append(Patch(facecolor=BUBBLE_COLOR, label="GPU bubble (idle)"))
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


def run_title(timeline: Timeline) -> str:
    """What a panel's title says of its run: throughput, makespan, the GPU's bubbles (their share and
    kinds) and, once, the host thread's blocked share (its lane is not drawn where it only syncs)."""
    s = timeline.summary()
    unit = duration_unit(s.makespan_s)

    def t(seconds: float) -> str:
        return duration_text(seconds, unit, decimals=2)

    def share(seconds: float) -> str:
        return f"{seconds / s.makespan_s:.0%}" if s.makespan_s > 0 else "-"

    return (
        f"{s.throughput_tok_s:.2f} tok/s, makespan {t(s.makespan_s)}, GPU bubbles {share(s.bubble_s)} "
        f"(inter {t(s.bubble_inter_s)} / intra {t(s.bubble_intra_s)}), host blocked {share(s.host_blocked_s)} "
        f"of the makespan"
    )


def gantt(
    timeline: Timeline,
    path: str | Path | None = None,
    window: tuple[float, float] | None = None,
    title: str | None = None,
) -> plt.Figure:
    """One timeline, one lane per stream. Saved to `path` when given."""
    lanes = figure_lanes(timeline)
    fig, ax = plt.subplots(figsize=(14, 1.3 + 0.55 * len(lanes)))
    cats = draw_timeline(ax, timeline, window)
    s = timeline.summary()
    ax.set_title(
        title or f"{s.policy} · {s.model} · {s.hardware} · bs={s.batch_size} n={s.num_batches} · {run_title(timeline)}",
        fontsize=10,
        pad=12,
    )
    return _finish(fig, cats, path, top=0.9, dpi=110)


def moe_block_window(timeline: Timeline, step: int, layer: int, pad_layers: int = 0) -> tuple[float, float]:
    """The time span of one layer (attention through the last expert) of one step on the GPU."""
    c = timeline.columns
    mask = (
        timeline.rows_where("resource", "gpu")
        & (c["step"] == step)
        & (c["layer"] >= layer - pad_layers)
        & (c["layer"] <= layer + pad_layers)
    )
    if not mask.any():
        return (0.0, timeline.makespan)
    return float(c["start"][mask].min()), float(c["end"][mask].max())


def compare_gantt(
    timelines: Mapping[str, Timeline], path: str | Path | None = None, zoom: tuple[int, int] | None = None
) -> plt.Figure:
    """One panel per policy on a shared time axis; with `zoom=(step, layer)` a second column
    shows that MoE block of every policy, each from its own start, all on one span (the longest
    block's): the blocks' lengths compare at a glance."""
    names = list(timelines)
    ncols = 2 if zoom else 1
    heights = [1.2 + 0.45 * len(figure_lanes(timelines[n])) for n in names]
    fig, axes = plt.subplots(
        len(names),
        ncols,
        figsize=(16 if zoom else 14, sum(heights) + 1.0),
        gridspec_kw={"height_ratios": heights, "width_ratios": [3, 2] if zoom else [1]},
        squeeze=False,
    )
    horizon = max(tl.makespan for tl in timelines.values())
    if zoom:  # every zoom panel on one scale: as wide as the longest of the blocks
        windows = {n: moe_block_window(timelines[n], *zoom) for n in names}
        width = max(b - a for a, b in windows.values())
        step = "prefill" if zoom[0] == 0 else f"decode step {zoom[0]}"
    cats: list[str] = []
    for row, name in enumerate(names):
        tl = timelines[name]
        s = tl.summary()
        for cat in draw_timeline(axes[row][0], tl, (0.0, horizon)):
            if cat not in cats:
                cats.append(cat)
        status = "" if s.status == "ok" else f" [{s.status}]"
        axes[row][0].set_title(f"{name}{status}: {run_title(tl)}", fontsize=9, loc="left", pad=13)
        if zoom:
            start = windows[name][0]
            for cat in draw_timeline(axes[row][1], tl, (start, start + width), relative=True):
                if cat not in cats:
                    cats.append(cat)
            unit = time_unit(width)[1]
            axes[row][1].set_xlabel(f"{unit} from the block's start")
            axes[row][1].set_title(
                f"zoom: {step}, MoE layer {zoom[1]} ({unit} from its start)", fontsize=9, loc="left", pad=13
            )
    return _finish(fig, cats, path, top=0.97, dpi=100)
