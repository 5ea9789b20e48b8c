"""What a newcomer saw in the figures and printouts: a tiny run's `bubbles 0.000 s`, full-run Gantt
panels whose bubbles and compute blurred into one band, cold experts as pink as the bubbles, a
host lane that was one solid bar, no prefill/decode mark, zoom axes in absolute ms, and where-wins'
tie cells showing a margin. Torch-free and fast."""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path

import matplotlib
import matplotlib.pyplot as plt
import numpy as np
import pandas as pd
import pytest
from matplotlib.colors import to_rgb

from klotski_sim.runs.runner import RunSpec, run

matplotlib.use("Agg")
ROOT = Path(__file__).resolve().parents[1]
TINY = {"model": "tiny-mixtral", "num_batches": 2, "batch_size": 2, "prompt_len": 6, "gen_len": 3}  # README's


def tiny(policy: str = "klotski", **changes):
    return run(RunSpec(policy=policy, **{**TINY, **changes})).timeline


# ---- printouts ----------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "seconds, unit, text",
    [
        (0.00043, None, "0.430 ms"),
        (12.3, None, "12.300 s"),
        (85e-6, None, "0.085 ms"),
        (8.5e-6, None, "8.500 us"),
        (0.245, None, "0.245 s"),
        (0.017, None, "0.017 s"),
        (0.0083, None, "8.300 ms"),
        (0.0, None, "0.000 s"),
        (0.00043, "s", "0.430 ms"),
        (0.062, "s", "0.062 s"),
        (4.97e-5, "ms", "0.050 ms"),
        (4.97e-6, "ms", "4.970 us"),
        (120.11, "s", "120.110 s"),
        (0.0, "ms", "0.000 ms"),
        (12.3, "ms", "12300.000 ms"),
    ],
)
def test_a_duration_prints_in_a_unit_that_shows_it(seconds, unit, text):
    from klotski_sim.util.units import duration_text

    assert duration_text(seconds, unit) == text


def test_the_simulate_summary_of_a_tiny_run_prints_its_bubbles_in_ms_never_as_zero_seconds():
    """README's tiny `simulate`: 0.43 ms of bubbles (5% of its 8 ms) printed `bubbles 0.000 s`."""
    from klotski_sim.cli.summary_text import format_summary

    s = tiny().summary()
    assert 0 < s.bubble_s < 1e-3
    text = format_summary(s)
    found = re.search(r"bubbles ([0-9.]+) ms \(inter-layer ([0-9.]+) (ms|us), intra-layer ([0-9.]+) ms\)", text)
    assert found, text
    assert float(found.group(1)) == pytest.approx(s.bubble_s * 1e3, abs=5e-4)
    assert not re.search(r"\b0\.000 s\b", text), text
    cause = re.search(r"bubbles by cause sync ([0-9.]+) ms", text)
    assert cause and float(cause.group(1)) > 0, text
    makespan = re.search(r"makespan +([0-9.]+) ms +\(prefill ([0-9.]+) ms \+ decode ([0-9.]+) ms", text)
    assert makespan, text  # (one unit for the parts: they still add up on sight)
    total, prefill, decode = map(float, makespan.groups())
    assert abs(prefill + decode - total) <= 0.0015


# ---- colours ------------------------------------------------------------------------------------
def test_bubbles_are_a_colour_of_their_own():
    """Cold experts were pink (#DA8BC3) beside bubbles drawn in a translucent red that rendered
    pink: told apart by neither eye nor legend. The bubble colour is opaque and far (in RGB) from
    every category's, cold experts' above all, and hot and cold experts differ."""
    from klotski_sim.report.plot import BUBBLE_COLOR, CATEGORY_COLORS

    bubble = np.array(matplotlib.colors.to_rgba(BUBBLE_COLOR))
    assert bubble[3] == 1.0

    def distance(a, b):
        return float(np.linalg.norm(np.array(to_rgb(a)) - np.array(to_rgb(b))))

    assert distance(BUBBLE_COLOR, CATEGORY_COLORS["cold_expert"]) > 0.8
    assert min(distance(BUBBLE_COLOR, c) for c in CATEGORY_COLORS.values()) > 0.35
    assert distance(CATEGORY_COLORS["hot_expert"], CATEGORY_COLORS["cold_expert"]) > 0.5


# ---- the Gantt panels ---------------------------------------------------------------------------
def _phase_marks(ax):
    lines = [line for line in ax.get_lines() if line.get_gid() == "phase-change"]
    labels = [t.get_text() for t in ax.texts if t.get_gid() == "phase-change"]
    return [float(line.get_xdata()[0]) for line in lines], labels


@pytest.mark.parametrize("kept", [False, True])
def test_the_gantt_marks_where_prefill_ends_and_decode_begins(kept):
    """A dashed line at the first decode op on the GPU (the ops' phase tag; in a timeline kept to
    the figure's columns, as compare keeps them, their step), labelled `prefill | decode`."""
    from klotski_sim.core.timeline import FIGURE_COLUMNS
    from klotski_sim.report.plot import draw_timeline

    tl = tiny()
    c = tl.columns
    gpu = tl.rows_where("resource", "gpu")
    first_decode = float(c["start"][gpu & (c["phase"] == "decode")].min())
    if kept:
        tl.summary()
        tl.detach(FIGURE_COLUMNS)
        assert "phase" not in tl.columns
    fig, ax = plt.subplots(figsize=(10, 2))
    draw_timeline(ax, tl)
    xs, labels = _phase_marks(ax)
    plt.close(fig)
    assert xs == [pytest.approx(first_decode * 1e3)]  # (a tiny run: an axis in ms)
    assert labels == ["prefill | decode"]


def test_batches_run_one_after_another_have_a_mark_at_each_change_of_phase():
    from klotski_sim.report.plot import draw_timeline

    tl = tiny("single-batch")
    fig, ax = plt.subplots(figsize=(10, 2))
    draw_timeline(ax, tl)
    xs, labels = _phase_marks(ax)
    plt.close(fig)
    assert len(xs) == 3 and xs == sorted(xs)
    assert labels == ["prefill | decode", "decode | prefill"]  # (each kind labelled once)


def test_a_host_lane_that_only_syncs_is_not_drawn_and_its_share_is_said_once():
    """The host thread is blocked nearly all of every run: its lane was one solid grey bar in
    every panel. It is left out, and the title says the blocked share."""
    from klotski_sim.report.plot import figure_lanes, gantt

    tl = tiny()
    assert "host" in tl.streams() and "host" not in figure_lanes(tl)
    fig = gantt(tl)
    ax = fig.axes[0]
    lanes = [t.get_text() for t in ax.get_yticklabels()]
    title = ax.get_title()
    plt.close(fig)
    assert "host" not in lanes and lanes == figure_lanes(tl)
    share = tl.summary().host_blocked_s / tl.summary().makespan_s
    assert f"host blocked {share:.0%} of the makespan" in title
    assert "bubbles 0 ms" not in title and re.search(r"GPU bubbles \d+% \(inter [0-9.]+ (us|ms)", title), title


def test_a_host_lane_that_waits_on_pageable_copies_is_drawn():
    from klotski_sim.core.timeline import Timeline
    from klotski_sim.report.plot import figure_lanes

    def timeline(host_category):
        columns = {
            "stream": np.array(["compute", "host"], dtype=object),
            "resource": np.array(["gpu", "host"], dtype=object),
            "start": np.array([0.0, 0.0]),
            "end": np.array([1.0, 1.0]),
            "category": np.array(["attention", host_category], dtype=object),
            "step": np.array([0, -1]),
            "layer": np.array([0, -1]),
        }
        return Timeline(columns, {})

    assert figure_lanes(timeline("sync")) == ["compute"]
    assert figure_lanes(timeline("copy_wait")) == ["compute", "host"]


def test_a_whole_run_is_drawn_in_bins_a_few_pixels_wide_whose_shares_fill_the_compute_lane():
    """A whole run has many ops to a pixel: drawn a pixel's bin at a time, the sub-pixel bars of
    compute and bubbles mixed into one grey-green band. Every bar is now a few pixels wide, and on
    the compute lane busy and bubble shares fill each bin of the run (nothing is left out)."""
    from klotski_sim.report.plot import BUBBLE_COLOR, SHARE_BIN_PX, draw_timeline

    tl = tiny(num_batches=4, prompt_len=32, gen_len=64)
    fig, ax = plt.subplots(figsize=(10, 2), dpi=100)
    draw_timeline(ax, tl)
    fig.canvas.draw()
    heights = {}  # x of a bin on the compute lane (the first) -> the height drawn there
    bubble_drawn = False
    for collection in ax.collections:
        for path in collection.get_paths():
            corners = path.vertices.reshape(-1, 5, 2)
            px = ax.transData.transform(corners.reshape(-1, 2)).reshape(corners.shape)
            widths = px[:, 1, 0] - px[:, 0, 0]
            assert widths.min() >= SHARE_BIN_PX - 0.5, widths.min()
            on_compute = np.abs(corners[:, 0, 1]) < 0.5
            for x, h in zip(corners[on_compute, 0, 0], np.abs(corners[on_compute, 2, 1] - corners[on_compute, 0, 1])):
                heights[round(float(x), 9)] = heights.get(round(float(x), 9), 0.0) + h
        if np.allclose(collection.get_facecolor()[0], matplotlib.colors.to_rgba(BUBBLE_COLOR)):
            bubble_drawn = True
    plt.close(fig)
    assert bubble_drawn
    inner = np.array([h for x, h in sorted(heights.items())][1:-1])  # (the first and last bins: the run's ends)
    assert np.allclose(inner, 0.76, atol=1e-6)


def test_the_zoom_panels_read_time_from_the_blocks_start():
    """The zoom column read `47375 ... 47550` ms under `(zoom, one scale)`: each block is drawn
    from its own start now, all on one span, and the title says which block and in what unit."""
    from klotski_sim.report.plot import compare_gantt

    tls = {p: tiny(p) for p in ("klotski", "flexgen")}
    fig = compare_gantt(tls, zoom=(1, 1))
    zooms = fig.axes[1::2]
    limits = [ax.get_xlim() for ax in zooms]
    titles = [ax.get_title(loc="left") for ax in zooms]
    plt.close(fig)
    assert all(lo == 0 for lo, _ in limits) and len({hi for _, hi in limits}) == 1
    assert titles == ["zoom: decode step 1, MoE layer 1 (ms from its start)"] * 2


# ---- where-wins ---------------------------------------------------------------------------------
def _where_wins():
    spec = importlib.util.spec_from_file_location("where_wins", ROOT / "experiments" / "where_wins.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_where_wins_tie_cells_show_no_margin():
    """A grey (tie) cell printed the tied policies' lead over the next one, `+37%`, read as a margin
    between the tied: it says `tie` and who tied; only a decisive cell shows its margin."""
    ww = _where_wins()
    rows = []
    for bs, tok_s in (
        (1, {"klotski": 100.0, "fiddler": 100.2, "flexgen": 73.0}),
        (2, {"klotski": 137.0, "fiddler": 100.0, "flexgen": 50.0}),
    ):
        rows += [
            {
                "hardware": "rtx3090",
                "model": "tiny",
                "batch_size": bs,
                "policy": p,
                "m.status": "ok",
                "m.throughput_tok_s": v,
                "m.n": 4,
            }
            for p, v in tok_s.items()
        ]
    win = ww.winners(pd.DataFrame(rows))
    fig = ww.figure(win)
    texts = sorted(t.get_text() for t in fig.axes[0].texts)
    plt.close(fig)
    tie, decisive = texts  # ("100\ntie\nF = K" sorts before "137\n+37%")
    assert "%" not in tie and "tie" in tie and "F = K" in tie
    assert decisive == "137\n+37%"
    assert [ww.margin_text(r) for _, r in win.iterrows()] == ["tie", "+37%"]
