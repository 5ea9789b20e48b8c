"""Which schedule wins where: from a sweep's results.parquet, the best policy (highest generated
tokens/s end to end) per (hardware profile x model x batch size), as a grid figure and a markdown
table with the winner's throughput and its margin over the runner-up.

    klotski-sim sweep experiments/specs/where-wins.yaml --out klotski-where-wins --workers 2 --yes
    python experiments/where_wins.py klotski-where-wins/results.parquet --out docs/where-wins.png

`--quick` (for tests), without a results file: first runs experiments/specs/where-wins.yaml cut to
its first model's first 2 layers, its first and last profile and batch size, prompt 32 and 2
generated tokens (every policy), into a fresh temporary folder, where the figure goes too unless
`--out` names a file.
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # a script: no display
import matplotlib.pyplot as plt  # noqa: E402
import pandas as pd  # noqa: E402

COLORS = {
    "klotski": "#4c72b0",
    "klotski-hybrid": "#55a868",
    "fiddler": "#c44e52",
    "llamacpp-moe": "#8172b2",
    "flexgen": "#ccb974",
    "tie": "#bbbbbb",
}
TIE = 0.005  # policies within 0.5% of the best share the cell
SHORT = {"klotski": "K", "klotski-hybrid": "KH", "fiddler": "F", "llamacpp-moe": "L", "flexgen": "FG"}
SPEC = Path(__file__).resolve().parent / "specs" / "where-wins.yaml"


def quick_results(folder: Path) -> Path:
    """The results.parquet of where-wins.yaml cut to a few seconds' sweep (see --quick) in `folder`."""
    from klotski_sim.runs.sweep import load_spec, parse_spec, run_sweep  # (only --quick runs a sweep)

    spec = load_spec(SPEC)
    data = spec.model_dump()
    data.update(
        models=[f"{spec.models[0]}:2"],
        hardware=[spec.hardware[0], spec.hardware[-1]],
        batch_sizes=[spec.batch_sizes[0], spec.batch_sizes[-1]],
        prompt_lens=[32],
        gen_lens=[2],
    )
    run_sweep(parse_spec(data), folder / "sweep", progress=False)
    return folder / "sweep" / "results.parquet"


def winners(df: pd.DataFrame) -> pd.DataFrame:
    """One row per (hardware, model, batch size): the best policy, its tok/s, the runner-up's."""
    ok = df[df["m.status"] == "ok"]
    rows = []
    for (hw, model, bs), group in ok.groupby(["hardware", "model", "batch_size"]):
        ranked = group.sort_values("m.throughput_tok_s", ascending=False)
        top = ranked["m.throughput_tok_s"].iloc[0]
        tied = ranked[ranked["m.throughput_tok_s"] >= top * (1 - TIE)]
        best = ranked.iloc[0]
        second = ranked.iloc[len(tied)] if len(ranked) > len(tied) else None
        rows.append(
            {
                "hardware": hw,
                "model": model,
                "batch_size": int(bs),
                "best": " = ".join(sorted(tied["policy"])),
                "tok_s": best["m.throughput_tok_s"],
                "n": int(best["m.n"]),
                "runner_up": second["policy"] if second is not None else "",
                "margin": best["m.throughput_tok_s"] / second["m.throughput_tok_s"] - 1
                if second is not None
                else float("nan"),
                "failed": ", ".join(
                    sorted(
                        df[
                            (df["hardware"] == hw)
                            & (df["model"] == model)
                            & (df["batch_size"] == bs)
                            & (df["m.status"] != "ok")
                        ]["policy"]
                    )
                ),
            }
        )
    return pd.DataFrame(rows)


def cell_text(row: pd.Series) -> str:
    """A cell's label: the winner's tok/s and its margin over the runner-up; a tie (policies within
    TIE of each other, a grey cell) says `tie` and who tied, never a margin — the tied policies' lead
    over the next one read as a margin between them (`+37%` on a grey cell)."""
    if " = " in row["best"]:
        return f"{row['tok_s']:.0f}\ntie\n" + " = ".join(SHORT.get(p, p) for p in row["best"].split(" = "))
    margin = row["margin"]
    return f"{row['tok_s']:.0f}" + ("" if pd.isna(margin) else f"\n+{margin:.0%}")  # (alone: no runner-up)


def margin_text(row: pd.Series) -> str:
    """The markdown table's margin: `tie` for a tie, `-` with no runner-up."""
    if " = " in row["best"]:
        return "tie"
    return "-" if pd.isna(row["margin"]) else f"{row['margin']:+.0%}"


def figure(win: pd.DataFrame, out: Path | None = None) -> plt.Figure:
    """The grid of winners; saved to `out` (and closed) when given."""
    hws = sorted(win["hardware"].unique())
    cols = sorted({(m, b) for m, b in zip(win["model"], win["batch_size"])})
    fig, ax = plt.subplots(figsize=(1.15 * len(cols) + 2, 0.75 * len(hws) + 1.6))
    for i, hw in enumerate(hws):
        for j, (model, bs) in enumerate(cols):
            cell = win[(win["hardware"] == hw) & (win["model"] == model) & (win["batch_size"] == bs)]
            if cell.empty:
                continue
            r = cell.iloc[0]
            color = COLORS["tie"] if " = " in r["best"] else COLORS.get(r["best"], "#999999")
            ax.add_patch(plt.Rectangle((j, i), 1, 1, color=color, alpha=0.85))
            ax.text(j + 0.5, i + 0.5, cell_text(r), ha="center", va="center", fontsize=7)
    ax.set_xlim(0, len(cols))
    ax.set_ylim(0, len(hws))
    ax.set_xticks([j + 0.5 for j in range(len(cols))])
    ax.set_xticklabels([f"{m}\nbs {b}" for m, b in cols], fontsize=6, rotation=45, ha="right")
    ax.set_yticks([i + 0.5 for i in range(len(hws))])
    ax.set_yticklabels(hws)
    ax.set_title(
        "best policy (tok/s end to end, margin over the runner-up; grey: a tie, no margin — K klotski, "
        "KH klotski-hybrid, F fiddler, L llamacpp-moe, FG flexgen)",
        fontsize=8,
    )
    shown = {("tie" if " = " in b else b) for b in win["best"]}
    handles = [plt.Rectangle((0, 0), 1, 1, color=c) for p, c in COLORS.items() if p in shown]
    ax.legend(
        handles,
        [p if p != "tie" else f"tie (within {TIE:.1%})" for p in COLORS if p in shown],
        fontsize=7,
        loc="upper left",
        bbox_to_anchor=(1.01, 1.0),
    )
    fig.tight_layout()
    if out is not None:
        fig.savefig(out, dpi=130)
        plt.close(fig)
    return fig


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("results", type=Path, nargs="?", help="a sweep's results.parquet (not with --quick)")
    parser.add_argument(
        "--out", type=Path, help="the figure (default: where-wins.png; with --quick, in the temporary folder)"
    )
    parser.add_argument("--quick", action="store_true", help="a few seconds' sweep of the spec first (see above)")
    args = parser.parse_args()
    if (args.results is None) != args.quick:
        parser.error("give a results.parquet, or --quick")
    if args.quick:
        folder = Path(tempfile.mkdtemp(prefix="klotski-where-wins-"))
        args.results = quick_results(folder)
        args.out = args.out or folder / "where-wins.png"
    args.out = args.out or Path("where-wins.png")
    win = winners(pd.read_parquet(args.results))
    figure(win, args.out)
    print("| hardware | model | bs | best | n | tok/s | runner-up | margin | not ok |")
    print("|---|---|---|---|---|---|---|---|---|")
    for _, r in win.iterrows():
        print(
            f"| {r.hardware} | {r.model} | {r.batch_size} | {r.best} | {r.n} | {r.tok_s:.1f} | {r.runner_up} | "
            f"{margin_text(r)} | {r.failed or '-'} |"
        )
    print(f"\nwrote {args.out}")


if __name__ == "__main__":
    main()
