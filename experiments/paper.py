"""Regenerate the experiments: each runs a sweep spec from experiments/specs/ (resumable) and
writes a CSV and a PNG into experiments/results/<name>/.

    python experiments/paper.py ablation|baselines|batches|routing|links|all [--workers 2] [--quick] [--out DIR]

`--quick` (for tests): each spec on the first 2 layers of its models, at prompt 32 and 2 generated
tokens, every axis of values (batch sizes, n, routings, what-if values) cut to its first and last;
profiles and policies as they are, so that every figure is drawn. Its results go to a fresh
temporary folder unless `--out` names one (`--out` replaces experiments/results/ in either mode).
"""

from __future__ import annotations

import argparse
import tempfile
from dataclasses import dataclass
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import pandas as pd  # noqa: E402
from matplotlib.ticker import MaxNLocator  # noqa: E402

from klotski_sim.hardware.profile import load_profile  # noqa: E402
from klotski_sim.runs.sweep import SweepSpec, load_spec, parse_spec, run_sweep  # noqa: E402

PCIE_GBPS = load_profile("rtx3090").links.pcie_h2d.bandwidth / 1e9

HERE = Path(__file__).resolve().parent
SPECS, RESULTS = HERE / "specs", HERE / "results"
ORDER = ["single-batch", "multi-batch", "hot-prefetch", "klotski", "klotski-oracle", "flexgen"]
COLORS = {
    "single-batch": "#8C8C8C",
    "multi-batch": "#CCB974",
    "hot-prefetch": "#DA8BC3",
    "klotski": "#C44E52",
    "klotski-oracle": "#55A868",
    "flexgen": "#4C72B0",
}
KEEP = [
    "policy",
    "model",
    "hardware",
    "batch_size",
    "num_batches",
    "routing",
    "experts",
    "status",
    "m.num_batches",
    "m.kv",
    "m.throughput_tok_s",
    "m.makespan_s",
    "m.prefill_s",
    "m.decode_step_s",
    "m.bubble_inter_s",
    "m.bubble_intra_s",
    "m.efficiency",
    "m.peak_gpu_bytes",
    "m.hot_precision",
    "m.hot_identification",
]


# --quick's run size: the models' first layers, prompt and generated tokens
QUICK_LAYERS, QUICK_PROMPT, QUICK_GEN = 2, 32, 2


@dataclass(frozen=True)
class Setup:
    """How the experiments run: workers, where results go, and whether at --quick's size."""

    workers: int = 2
    results: Path = RESULTS
    quick: bool = False

    def size(self, model: str = "mixtral-8x7b") -> dict[str, object]:
        """RunSpec fields of a run of `model` at this setup's size."""
        if not self.quick:
            return {"model": model}
        return {"model": f"{model}:{QUICK_LAYERS}", "prompt_len": QUICK_PROMPT, "gen_len": QUICK_GEN}


def quick_spec(spec: SweepSpec) -> SweepSpec:
    """`spec` at --quick's size: each axis of values cut to its first and last (every profile and
    policy kept: the figures look them up by name)."""

    def ends(values: list) -> list:
        return values if len(values) <= 2 else [values[0], values[-1]]

    data = spec.model_dump()
    data.update(
        models=[f"{m}:{QUICK_LAYERS}" for m in spec.models],
        prompt_lens=[QUICK_PROMPT],
        gen_lens=[QUICK_GEN],
        batch_sizes=ends(spec.batch_sizes),
        num_batches=ends(spec.num_batches),
        routings=ends(spec.routings),
        overrides={k: ends(v) for k, v in spec.overrides.items()},
    )
    return parse_spec(data)


def sweep(spec_name: str, setup: Setup) -> pd.DataFrame:
    spec = load_spec(SPECS / f"{spec_name}.yaml")
    if setup.quick:
        spec = quick_spec(spec)
    df = run_sweep(spec, setup.results / spec.name / "sweep", workers=setup.workers)
    if setup.quick:  # the figures look the models up by their whole names
        df["model"] = df["model"].str.removesuffix(f":{QUICK_LAYERS}")
    return df[df["status"] == "ok"].copy() if "status" in df else df


def save(df: pd.DataFrame, name: str, fig: plt.Figure, setup: Setup) -> None:
    out = setup.results / name
    out.mkdir(parents=True, exist_ok=True)
    cols = [c for c in KEEP + [c for c in df.columns if c.startswith("set.")] if c in df.columns]
    df[cols].to_csv(out / f"{name}.csv", index=False)
    if setup.quick:  # (the titles name the full runs' sizes)
        fig.text(
            0.01,
            0.01,
            f"--quick: {QUICK_LAYERS} layers, prompt {QUICK_PROMPT}, {QUICK_GEN} generated, "
            "first and last values of each axis",
            fontsize=7,
            color="r",
        )
    fig.savefig(out / f"{name}.png", dpi=110, bbox_inches="tight")
    plt.close(fig)
    print(f"wrote {out}/{name}.csv and {name}.png")


def ablation(setup: Setup) -> None:
    df = sweep("ablation", setup)
    df = df[~((df["model"] == "mixtral-8x7b") & (df["hardware"] == "h800"))]
    settings = [("mixtral-8x7b", "rtx3090"), ("mixtral-8x22b", "rtx3090"), ("mixtral-8x22b", "h800")]
    fig, axes = plt.subplots(1, 3, figsize=(15, 4))
    for ax, (model, hw) in zip(axes, settings):
        sub = df[(df["model"] == model) & (df["hardware"] == hw)].set_index("policy")
        names = [p for p in ORDER if p in sub.index]
        vals = [sub.at[p, "m.throughput_tok_s"] for p in names]
        ax.bar(names, vals, color=[COLORS[p] for p in names])
        for i, p in enumerate(names):
            ax.text(
                i, vals[i], f"{vals[i]:.1f}\nn={int(sub.at[p, 'm.num_batches'])}", ha="center", va="bottom", fontsize=8
            )
        ax.set_title(f"{model} on {hw}", fontsize=10)
        ax.set_ylabel("generated tokens / s")
        ax.tick_params(axis="x", rotation=30)
        ax.set_ylim(0, max(vals) * 1.25)
    fig.suptitle("ablation ladder (prompt 512, 32 generated, batch 16, n from the planner; as-published)")
    save(df, "ablation", fig, setup)


def baselines(setup: Setup) -> None:
    df = sweep("baselines", setup)
    fig, axes = plt.subplots(1, 2, figsize=(13, 4.5))
    for p in ORDER:
        sub = df[df["policy"] == p].sort_values("batch_size")
        if sub.empty:
            continue
        axes[0].plot(sub["batch_size"], sub["m.throughput_tok_s"], "o-", label=p, color=COLORS[p])
        axes[1].plot(sub["m.decode_step_s"] * 1e3, sub["m.throughput_tok_s"], "o-", label=p, color=COLORS[p])
    axes[0].set(xscale="log", xlabel="per-batch size", ylabel="generated tokens / s", title="throughput vs batch size")
    sizes = sorted(df["batch_size"].unique())
    axes[0].set_xticks(sizes, [str(b) for b in sizes])
    axes[0].minorticks_off()
    axes[1].set(
        xlabel="per-token decode latency (ms)",
        ylabel="generated tokens / s",
        title="throughput-latency trade-off (points: batch sizes)",
    )
    axes[0].legend(fontsize=8)
    save(df, "baselines", fig, setup)


def batches(setup: Setup) -> None:
    df = sweep("batches", setup)
    df["n"] = df["num_batches"].astype(int)
    from klotski_sim.runs.runner import RunSpec, prepare

    pick = prepare(RunSpec(num_batches=None, policy="klotski", **setup.size())).num_batches
    fig, axes = plt.subplots(1, 3, figsize=(16, 4))
    for p in ("multi-batch", "klotski", "flexgen"):
        sub = df[df["policy"] == p].sort_values("n")
        for ax, col, scale in (
            (axes[0], "m.throughput_tok_s", 1),
            (axes[1], "m.decode_step_s", 1e3),
            (axes[2], "m.peak_gpu_bytes", 1 / 2**30),
        ):
            ax.plot(sub["n"], sub[col] * scale, "-", color=COLORS[p], label=p if col == "m.throughput_tok_s" else None)
            on_cpu = sub["m.kv"] == "cpu"  # hollow: KV cache moved to host memory to fit
            ax.plot(sub.loc[~on_cpu, "n"], sub.loc[~on_cpu, col] * scale, "o", color=COLORS[p])
            ax.plot(sub.loc[on_cpu, "n"], sub.loc[on_cpu, col] * scale, "o", mfc="white", color=COLORS[p])
    gpu = load_profile("rtx3090").gpu
    usable_gib = (gpu.memory_bytes - gpu.reserved_bytes) / 2**30
    for ax, label in zip(axes, ("generated tokens / s", "per-token decode latency (ms)", "peak GPU memory (GiB)")):
        ax.axvline(pick, color="k", ls="--", lw=0.8, label=f"planner: n={pick}")
        ax.set(xlabel="batches n", ylabel=label)
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))  # n is a count: no 2.5 batches
    axes[2].axhline(usable_gib, color="r", lw=0.8, label=f"usable GPU memory ({usable_gib:.2f} GiB)")
    axes[0].legend(fontsize=8)
    axes[2].legend(handles=axes[2].get_lines()[-2:], fontsize=8, loc="upper left", bbox_to_anchor=(0.0, 0.94))
    fig.suptitle(
        "Mixtral-8x7B on rtx3090, batch 16, as-published (hollow: KV cache in host memory, the only way n fits)"
    )
    save(df, "batches", fig, setup)


def routing(setup: Setup) -> None:
    df = sweep("routing", setup)
    order = ["uniform", "calibrated", "zipf:1.0", "zipf:1.5", "zipf:2.0", "zipf:3.0"]
    groups = sorted(df["num_batches"].unique(), key=lambda v: (v == "auto", int(v) if v != "auto" else 0))
    fig, axes = plt.subplots(1, len(groups), figsize=(5.5 * len(groups), 4))
    for ax, n in zip(axes, groups):
        sub = df[df["num_batches"] == n]
        piv = sub.pivot_table(index="routing", columns="policy", values="m.throughput_tok_s").reindex(order)
        for p in ("klotski", "klotski-oracle"):
            ax.plot(order, piv[p] / piv["multi-batch"], "o-", label=f"{p} / multi-batch", color=COLORS[p])
        ax.axhline(1.0, color="k", lw=0.8)
        label = f"n = {n} x bs 4" if n != "auto" else "n from the planner, bs 4"
        ax.set(title=label, ylabel="throughput gain over +multi-batch", xlabel="routing (more skew ->)")
        ax.tick_params(axis="x", rotation=30)
        ax.legend(fontsize=8)
    save(df, "routing", fig, setup)


def links(setup: Setup) -> None:
    pcie = sweep("links", setup)
    nvme = sweep("links-disk", setup)
    fig, axes = plt.subplots(1, 2, figsize=(13, 4))
    for p in ORDER:
        sub = pcie[pcie["policy"] == p].sort_values("set.links.pcie_h2d.bandwidth")
        if len(sub):
            axes[0].plot(
                sub["set.links.pcie_h2d.bandwidth"] / 1e9, sub["m.throughput_tok_s"], "o-", label=p, color=COLORS[p]
            )
        sub = nvme[nvme["policy"] == p].sort_values("set.links.nvme.bandwidth")
        if len(sub):
            axes[1].plot(
                sub["set.links.nvme.bandwidth"] / 1e9, sub["m.throughput_tok_s"], "o-", label=p, color=COLORS[p]
            )
    axes[0].set(
        xlabel="PCIe H2D GB/s (gen3 ~8-12, gen4 ~17-25, gen5 ~50)",
        ylabel="generated tokens / s",
        title="experts in host memory",
    )
    axes[1].set(
        xlabel="NVMe GB/s",
        ylabel="generated tokens / s",
        title=f"experts on disk (PCIe {PCIE_GBPS:.1f} GB/s, the profile's)",
    )
    axes[0].legend(fontsize=8)
    save(pd.concat([pcie, nvme]), "links", fig, setup)


EXPERIMENTS = {"ablation": ablation, "baselines": baselines, "batches": batches, "routing": routing, "links": links}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("name", choices=[*EXPERIMENTS, "all"])
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--quick", action="store_true", help="the smallest runs of each figure (see the docstring)")
    ap.add_argument(
        "--out",
        type=Path,
        help="the results folder (default: experiments/results; with --quick, a fresh temporary folder)",
    )
    args = ap.parse_args()
    results = args.out or (Path(tempfile.mkdtemp(prefix="klotski-paper-")) if args.quick else RESULTS)
    setup = Setup(args.workers, results, args.quick)
    for name in EXPERIMENTS if args.name == "all" else [args.name]:
        EXPERIMENTS[name](setup)


if __name__ == "__main__":
    main()
