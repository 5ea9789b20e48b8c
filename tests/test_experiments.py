"""Every script under experiments/ runs: each one's quick mode (the smallest sizes of the same code,
seconds), as a user runs it — a fresh process from the repository's root — with a check of what it
printed or wrote. A script without a case here fails `test_every_script_has_a_quick_case`, so a new
one cannot go unrun; a quick mode runs every kind of its script's work, as a crash in work that no
test runs goes unnoticed.
"""

from __future__ import annotations

import importlib.util
import json
import math
import os
import re
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pandas as pd
import pytest

from klotski_sim.serving.policies import SERVING_POLICIES
from klotski_sim.util.errors import StorageRefusal

from .conftest import ROOT, run

EXPERIMENTS = ROOT / "experiments"
TIMEOUT_S = 600  # (a loaded 2-core machine runs these several times slower than an idle one)
NUMBER = re.compile(r"[-+]?\d[\d,]*(?:\.\d+)?(?:e[-+]?\d+)?")


def numbers(text: str) -> list[float]:
    """The numbers in `text`, in order (thousands separators allowed)."""
    return [float(n.replace(",", "")) for n in NUMBER.findall(text)]


def positive(values: list[float]) -> bool:
    return bool(values) and all(math.isfinite(v) and v > 0 for v in values)


def lines_with(out: str, pattern: str) -> list[str]:
    return [line for line in out.splitlines() if re.search(pattern, line)]


def written(out: str, tmp: Path) -> Path:
    """The file or folder the last `wrote PATH` line names: a fresh temporary one (its TMPDIR is `tmp`), never
    the committed docs or results a full run writes."""
    path = Path(lines_with(out, r"^wrote ")[-1].split(" ", 1)[1].split(" and ")[0])
    assert tmp in path.parents, path
    return path


# ---- the checks, one per case: (stdout, the case's temporary folder) --------------------------------------------
def check_bench_ab(out: str, tmp: Path) -> None:
    assert "HEAD (old) against the working tree (new), 1 alternations each" in out
    rows = lines_with(out, r" -> ")
    assert len(rows) == 6, out  # run, compare, simulate, sweep, the draw's seconds and peak
    for row in rows:
        old, new = re.search(r"(\S+) ->\s+(\S+)", row).groups()
        assert positive([float(old), float(new)]), row


def check_bench_engine(out: str, tmp: Path) -> None:
    assert "identical timelines: True" in out
    assert positive(numbers(lines_with(out, r"^ratio")[0])[:1])
    ops, build_s, engine_s, ops_per_s = numbers(lines_with(out, r"^\s+\d")[-1])[:4]
    assert ops > 10_000 and positive([engine_s, ops_per_s])


def check_bench_long_prompt(out: str, tmp: Path) -> None:
    row = lines_with(out, r"^\s+256 ")
    assert len(row) == 1, out
    assert positive(numbers(row[0])), row  # seconds and MB of the cold, warm and off runs, routing.npz's MB


def check_bench_npz(out: str, tmp: Path) -> None:
    assert "same ids: True" in out
    assert positive(numbers(lines_with(out, r"^ratio")[0])[:2])


def check_bench_phases(out: str, tmp: Path) -> None:
    rows = lines_with(out, r"^(ideal|as-published) ")
    assert [r.split()[0] for r in rows] == ["ideal", "as-published"], out
    for row in rows:
        ops, *seconds = numbers(row)
        assert ops > 0 and len(seconds) == 8 and all(0 <= s < 60 for s in seconds), row


def check_bench_policies(out: str, tmp: Path) -> None:
    rows = lines_with(out, r"^(single-batch|multi-batch|hot-prefetch|klotski|klotski-oracle|flexgen) ")
    assert len(rows) == 6, out
    for row in rows:
        n, ops, build_s, engine_s, ops_per_s, total_s = numbers(row)  # (no digit in a policy's name)
        assert positive([n, ops, ops_per_s]) and 0 <= build_s <= total_s, row
    assert len(lines_with(out, r"klotski-sim compare .*s wall.*peak RSS \d+ MB")) == 2, out
    assert len(lines_with(out, r"klotski-sim simulate .*s wall.*peak RSS \d+ MB")) == 1, out


def check_bench_sweep(out: str, tmp: Path) -> None:
    assert len(lines_with(out, r"^[12] worker\(s\): 4 configurations in ")) == 2, out
    assert positive(numbers(lines_with(out, r"^speed-up")[0])[1:])


def check_bench_sweep_default_size(out: str, tmp: Path) -> None:
    rows = lines_with(out, r"2 smallest-size configurations on 2 workers")
    assert [r.split()[:2] for r in rows] == [
        ["ideal", "what-if"],
        ["ideal", "distinct"],
        ["as-published", "what-if"],
        ["as-published", "distinct"],
    ], out
    for row in rows:
        assert positive(numbers(row.split(" in ", 1)[1])), row


def check_calibrate_synth(out: str, tmp: Path) -> None:
    rows = lines_with(out, r"^conc=")
    assert len(rows) == 8, out  # the grid: 2 x 2 x 2 settings
    for row in rows:
        stats = dict(re.findall(r"(\w+)=([\d.]+)", row.split(": ", 1)[1]))
        assert all(0 <= float(stats[k]) <= 1 for k in ("max_share", "topk_share", "stick_top1", "stick_any")), row


def check_coupled(out: str, tmp: Path) -> None:
    """The coupled setting is within 25% of every real figure; plain calibrated is not."""
    plain, coupled = lines_with(out, r"^calibrated: "), lines_with(out, r"^calibrated:coupling=")
    assert len(plain) == len(coupled) == 1, out
    worst = float(re.search(r"worst (\d+)%", coupled[0]).group(1))
    assert worst <= 25 < float(re.search(r"worst (\d+)%", plain[0]).group(1)), out


def check_length_quantiles(out: str, tmp: Path) -> None:
    row = lines_with(out, r"^quick: 300 requests, prompt mean")[0]
    found = re.search(r"prompt mean ([\d.]+) P50 (\d+) max (\d+)", row)
    assert found, row
    prompt_mean, p50, top = map(float, found.groups())
    assert 1 <= p50 <= top <= 499 and 1 <= prompt_mean <= 499, row


def check_bench_serving(out: str, tmp: Path) -> None:
    rows = [line.split() for line in out.splitlines() if line.split()[:1] and line.split()[0] in SERVING_POLICIES]
    names = ["vllm-o", "ktransformers", "fluxmoe-h", "fluxmoe"]
    assert [(r[0], r[3]) for r in rows] == [(n, "dropped") for n in names] + [(n, "kept") for n in names], out
    by_mode: dict[str, dict[str, list[str]]] = {"dropped": {}, "kept": {}}
    for row in rows:
        iterations, compiled, ops = numbers(row[4])[0], float(row[5].rstrip("%")), numbers(row[6])[0]
        wall, rate = float(row[7]), numbers(row[8])[0]
        assert iterations >= 64 and ops > iterations and wall >= 0, row  # (a quick dropped run can print 0.00 s)
        assert ops / (wall + 0.005) <= rate, row  # (wall printed to 0.01 s)
        if wall >= 0.01:
            assert rate <= ops / (wall - 0.005), row
        assert float(row[11]) > 0 and float(row[14]) <= 8, row  # tok/s; B_act at most B_cfg
        # a dropped run times most iterations compiled; a kept one emits every op
        assert compiled >= 90 if row[3] == "dropped" else compiled == 0, row
        by_mode[row[3]][row[0]] = row
    for name in names:  # the same predictions either way (to the printed digits)
        assert by_mode["dropped"][name][11:] == by_mode["kept"][name][11:], (name, out)
    assert len(re.findall(r"keeping every op takes [0-9.]+x the time", out)) == 4, out


def check_cpu_experts(out: str, tmp: Path) -> None:
    rows = lines_with(out, r"^\| h800 \| ")
    assert [r.split("|")[2].strip() for r in rows] == ["klotski", "klotski-hybrid", "fiddler", "llamacpp-moe"], out
    for row in rows:
        cells = row.split("|")
        assert positive(numbers(cells[4] + cells[5])), row  # tok/s under both presets
    assert any(row.split("|")[6].strip() != "0%" for row in rows), out  # some expert computed on the CPU


def fidelity_rows(text: str) -> dict[tuple[str, ...], list[str]]:
    """docs/fidelity.md's table rows by (system, figure, setting, profile)."""
    rows = [
        line.split(" | ") for line in text.splitlines() if line.startswith("| ") and not line.startswith("| system")
    ]
    return {tuple(cells[:4]): cells for cells in rows if len(cells) > 10}


def check_fidelity_llamacpp(out: str, tmp: Path) -> None:
    """Every row as the committed docs/fidelity-llamacpp.md has it (a change that shifts a prediction
    fails here: regenerate the page with `python experiments/fidelity_llamacpp.py`)."""
    text = written(out, tmp).read_text()
    committed = (ROOT / "docs" / "fidelity-llamacpp.md").read_text()
    rows = [line for line in text.splitlines() if line.startswith("| ") and "tok/s" not in line]
    assert len(rows) >= 5 and all(row in committed for row in rows), text
    assert lines_with(out, r"^median \|error\| of generation tok/s over \d+ priced tg rows: \d+%$")


def check_fidelity(out: str, tmp: Path) -> None:
    """The quick rows: 3 per-op anchors under both Env 1 profiles and two batch-1 latency rows, each
    predicted as the committed docs/fidelity.md says (a change that shifts a prediction fails here:
    regenerate the page with `python experiments/fidelity.py`)."""
    text = written(out, tmp).read_text()
    rows = fidelity_rows(text)
    assert len(rows) == 8, text
    committed = fidelity_rows((ROOT / "docs" / "fidelity.md").read_text())
    for key, cells in rows.items():
        for value, error in ((cells[6], cells[7]), (cells[8], cells[9])):  # as-published, ideal
            assert positive(numbers(value)[:1]) and error, cells
        assert key in committed and committed[key][4:10] == cells[4:10], (cells, committed.get(key))
    in_sample = [cells for cells in rows.values() if cells[4] == "in"]
    assert {cells[1] for cells in in_sample} == {"attention of one batch, decode", "one expert transfer"}
    assert all(cells[7] in ("+0%", "-0%") for cells in in_sample), in_sample  # built from these very figures
    assert "## Reading the table" not in text  # (the guide reads the whole table)


def check_fingerprint(out: str, tmp: Path) -> None:
    count = int(re.search(r"^(\d+) configurations fingerprinted", out, re.M).group(1))
    prints = json.loads((tmp / "prints.json").read_text())
    assert count == len(prints) >= 25
    assert all(
        re.fullmatch(r"[0-9a-f]{40}", p[part]) for p in prints.values() for part in ("schedule", "timeline", "summary")
    )
    assert f"{count} configurations against" in out and ": 0 differ" in out  # (its own file, read back)


def check_paper(out: str, tmp: Path) -> None:
    results = written(out, tmp).parent.parent  # (wrote <results>/links/links.csv and links.png)
    for name in ("ablation", "baselines", "batches", "routing", "links"):
        df = pd.read_csv(results / name / f"{name}.csv")
        assert len(df) > 0 and (df["status"] == "ok").all() and (df["m.throughput_tok_s"] > 0).all(), name
        assert (results / name / f"{name}.png").stat().st_size > 10_000, name


def check_probe_error(out: str, tmp: Path) -> None:
    probes = lines_with(out, r"^h800\s+mixtral-8x7b\s+(as-published|ideal)\s+\d")
    assert len(probes) >= 4 and sum("<= chosen" in p for p in probes) == 2, out
    for row in probes:
        n, predicted, whole = numbers(row.split("mixtral-8x7b", 1)[1])[:3]
        assert positive([n, predicted, whole]), row
    assert len(lines_with(out, r"^\s+\d\.\d%\s+\d+ of 2 ")) == 6, out  # the tie margins' losses


def check_run_size_accuracy(out: str, tmp: Path) -> None:
    rows = lines_with(out, r"^mixtral-8x7b:2 ")
    assert len(rows) == 18, out  # 9 policies x 2 presets
    for row in rows:
        built, projected, error = numbers(row.split(None, 3)[3])[:3]
        assert built > 0 and projected > 0 and abs(error) < 50, row


# the H200 rerun the simulator's current code simulated on the device (experiments/results/NVIDIA-H200/README.md)
RERUN = "experiments/results/NVIDIA-H200/2026-12-04-late/ladder-small-rerun"


def check_resimulate(out: str, tmp: Path) -> None:
    """The rerun was simulated by this code on the device: re-simulated here it must give the same
    makespans (a change to the simulator that moves them fails here, with the measurement beside it)."""
    rows = {row.split()[0]: numbers(row.split(maxsplit=1)[1]) for row in lines_with(out, r"^(single|multi)-batch/")}
    assert set(rows) == {"single-batch/as-published", "multi-batch/ideal"}, out
    for measured, then, _, now, _ in rows.values():
        assert now == pytest.approx(then, rel=2e-3) and measured > 0, out


def check_routing_knobs(out: str, tmp: Path) -> None:
    statistics, predictors, cache = out.split("\nKlotski's hot experts")[0], *out.split("\nAn expert cache")
    stats = {row.split("|")[2].strip(): numbers(row.split("|", 3)[3]) for row in lines_with(statistics, r"^\| mix")}
    assert len(stats) == 8 and all(len(v) == 6 for v in stats.values()), out
    assert stats["uniform"][0] < stats["calibrated"][0] < stats["calibrated:reuse=1"][0], out  # reuse_share
    rows = lines_with(predictors, r"^\| mixtral-8x7b \| .* \| 1 x 1 \|")
    assert len(rows) == 3 and all(len(numbers(row.split("1 x 1", 1)[1])) == 6 for row in rows), out
    rows = lines_with(cache, r"^\| mixtral-8x7b \| calibrated(:reuse=\d)? \| \d+ \| \d+ \| ")
    assert len(rows) == 3 and all(numbers(row.split("|", 3)[3])[1] > 0 for row in rows), out  # misses


def check_tree_memory(out: str, tmp: Path) -> None:
    seconds, peak_mb, code = numbers(out)[:3]
    assert code == 0 and seconds > 0
    assert peak_mb >= 40, out  # the child's 40 MB counted with its parent


def check_where_wins(out: str, tmp: Path) -> None:
    rows = lines_with(out, r"^\| (rtx3090|h800) \| mixtral-8x7b:2 \| ")
    assert len(rows) == 4, out  # 2 profiles x 2 batch sizes
    assert written(out, tmp).stat().st_size > 10_000


def check_cpu_expert_contention(out: str, tmp: Path) -> None:
    rows = lines_with(out, r"^\s+\d+\s+\d+\.\d\d\s+\d+\.\d\d\s+\d+\.\d\d$")
    assert 1 <= len(rows) <= 2, out  # every core, and every core but one where there are two or more
    for row in rows:
        _, alone, busy, ratio = numbers(row)
        assert alone > 0 and busy > 0 and abs(ratio - busy / alone) < 0.02 * ratio, row


def check_gpu_validate(out: str, tmp: Path) -> None:
    tmp = written(out, tmp)
    readme = (tmp / "README-cpu-experts.md").read_text()
    assert "FAILED" not in readme, readme
    assert "QUICK=1" in readme and "## Results" in readme
    for run_dir in ("small-mixtral-cpu-experts", "mixtral-8x7b-4layers-cpu-experts"):
        validation = (tmp / run_dir / "validation.json").read_text()
        for policy in ("fiddler", "llamacpp-moe", "klotski-hybrid", "klotski"):
            assert f'"{policy}/as-published"' in validation and f'"{policy}/ideal"' in validation, (run_dir, policy)


# ---- the cases -------------------------------------------------------------------------------------------------
# A child that holds 40 MB while its parent waits: what tree_memory.py sums and /usr/bin/time would not.
CHILD_HOLDING_40MB = (
    "import subprocess, sys; subprocess.run([sys.executable, '-c', "
    "'import time; b = bytearray(40 << 20); b[::4096] = b\"x\" * len(b[::4096]); time.sleep(0.5)'])"
)


@dataclass(frozen=True)
class Case:
    """One quick run of a script: its command ({python} and {tmp} filled in), its environment, its check. Each
    runs with its TMPDIR in the test's temporary folder: the quick modes' default outputs go there."""

    script: str  # the file under experiments/ it runs
    command: tuple[str, ...]
    check: Callable[[str, Path], None]
    env: tuple[tuple[str, str], ...] = ()
    name: str = ""

    @property
    def id(self) -> str:
        return self.name or self.script


def py(script: str, *args: str, check: Callable[[str, Path], None], name: str = "") -> Case:
    return Case(script, ("{python}", f"experiments/{script}", *args), check, name=name)


CASES = [
    py("bench_ab.py", "--quick", check=check_bench_ab),
    py("bench_engine.py", "--quick", check=check_bench_engine),
    py("bench_long_prompt.py", "--quick", check=check_bench_long_prompt),
    py("bench_npz.py", "--quick", check=check_bench_npz),
    py("bench_phases.py", "--quick", check=check_bench_phases),
    py("bench_policies.py", "--quick", check=check_bench_policies),
    py("bench_serving.py", "--quick", check=check_bench_serving),
    py("bench_sweep.py", "--quick", check=check_bench_sweep),
    py(
        "bench_sweep.py",
        "--quick",
        "--default-size",
        "2",
        check=check_bench_sweep_default_size,
        name="bench_sweep.py-default-size",
    ),
    py("calibrate_synth.py", "--quick", "--grid", check=check_calibrate_synth),
    py("calibrate_synth.py", "--quick", "--coupled", check=check_coupled, name="calibrate_synth.py --coupled"),
    py("cpu_expert_contention.py", "--quick", check=check_cpu_expert_contention),
    py("cpu_experts.py", "--quick", check=check_cpu_experts),
    py("fidelity.py", "--quick", check=check_fidelity),
    py("fidelity_llamacpp.py", "--quick", check=check_fidelity_llamacpp),
    py("fingerprint.py", "--quick", "{tmp}/prints.json", "--against", "{tmp}/prints.json", check=check_fingerprint),
    py("length_quantiles.py", "--quick", check=check_length_quantiles),
    py("paper.py", "all", "--quick", "--workers", "1", check=check_paper),
    py("probe_error.py", "--quick", check=check_probe_error),
    py("run_size_accuracy.py", "--quick", check=check_run_size_accuracy),
    py("routing_knobs.py", "--quick", check=check_routing_knobs),
    py(
        "resimulate.py",
        f"{RERUN}/small-mixtral-validation.json",
        f"{RERUN}/profile-small-mixtral.yaml",
        "--only",
        "single-batch/as-published,multi-batch/ideal",
        check=check_resimulate,
    ),
    py("tree_memory.py", "{python}", "-c", CHILD_HOLDING_40MB, check=check_tree_memory),
    py("where_wins.py", "--quick", check=check_where_wins),
    # A dry run on the CPU (no GPU needed): QUICK=1 is tiny-mixtral at the smallest sizes, but a CPU calibration's
    # dispatch probes alone take 10-15 s, so this is the slowest case; `cpu-experts` is the cheaper of its parts
    # (the other's steps are the same commands with other policies).
    Case(
        "gpu_validate.sh",
        ("bash", "experiments/gpu_validate.sh", "cpu-experts"),
        check_gpu_validate,
        env=(("DEVICE", "cpu"), ("QUICK", "1")),
    ),
]


@pytest.mark.slow
@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_quick_mode_runs(case: Case, tmp_path: Path) -> None:
    """The script's quick mode exits 0 and prints (or writes) what its full mode does, at its size."""

    def fill(text: str) -> str:
        return text.replace("{python}", sys.executable).replace("{tmp}", str(tmp_path))

    env = dict(os.environ, TMPDIR=str(tmp_path), **{k: fill(v) for k, v in case.env})
    for name in ("OUT", "OUT_DIR"):  # (gpu_validate.sh writes into these when set, as on the device machine)
        env.pop(name, None)
    # the interpreter running the tests first on PATH: gpu_validate.sh and its steps run `python3`
    env["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), env.get("PATH", "")])
    proc = run([fill(arg) for arg in case.command], timeout=TIMEOUT_S, cwd=ROOT, env=env)
    assert proc.returncode == 0, f"{case.id}: exit {proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    case.check(proc.stdout, tmp_path)


def test_every_script_has_a_quick_case() -> None:
    """A script added under experiments/ without a quick case here fails: nothing there goes unrun."""
    scripts = {p.name for p in EXPERIMENTS.iterdir() if p.suffix in (".py", ".sh")}
    assert scripts == {c.script for c in CASES}


def test_gpu_validate_parses() -> None:
    """Every part of gpu_validate.sh is valid bash (the quick case runs one part of it)."""
    proc = subprocess.run(["bash", "-n", str(EXPERIMENTS / "gpu_validate.sh")], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr


def _fidelity():
    spec = importlib.util.spec_from_file_location("fidelity", EXPERIMENTS / "fidelity.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["fidelity"] = module  # (dataclasses look their module up)
    spec.loader.exec_module(module)
    return module


def test_fidelity_reports_a_refused_row_with_its_reason() -> None:
    """A setting the simulated machine cannot hold is a row that says `refused` and why, in one line (a `|` of
    the reason escaped), and leaves the statistics to the other rows: the script runs to its end."""
    fidelity = _fidelity()

    def refuse(impl: str) -> float:
        raise StorageRefusal("model keeps 2 GiB in host memory | 1 GiB\nin the profile")

    kept = fidelity.Figure("Klotski", "a kept figure", 2.0, "tok/s", "somewhere", "a paper", lambda impl: 3.0)
    refused = fidelity.Figure(
        "Klotski", "a refused figure", 1.0, "tok/s", "somewhere", "a paper", refuse, note="a note"
    )
    impls = ["as-published", "ideal"]
    for f in (kept, refused):
        f.predict_all(impls)
    assert refused.refused.keys() == set(impls) and not refused.predicted
    text = fidelity.render([kept, refused], impls, "python experiments/fidelity.py")
    row = next(line for line in text.splitlines() if line.startswith("| Klotski | a refused figure |"))
    assert "| 1 tok/s | refused | - | refused | - | a paper |" in row
    assert row.endswith("| a note; refused: model keeps 2 GiB in host memory \\| 1 GiB\\nin the profile |")
    assert "- `ideal`, out of sample, each figure once: 1 figures from 1 system; median |error| 50%" in text
    assert "1 refused" in text and "on 0 of 1 primary rows" in text


def test_fidelity_errors_of_bands_and_bounds() -> None:
    """A band's error is 0 when it brackets the published figure, else the distance to its nearer end;
    a bound's is 0 on its side."""
    fidelity = _fidelity()

    def row(published: float, predicted: object, bound: str = "") -> object:
        f = fidelity.Figure("S", "f", published, "tok/s", "x", "y", lambda impl: predicted, bound=bound)
        f.predict_all(["ideal"])
        return f

    assert row(5.0, (4.0, 6.0)).error("ideal") == 0.0 and row(5.0, (4.0, 6.0)).error_text("ideal") == "within"
    assert row(5.0, (6.0, 8.0)).error("ideal") == pytest.approx(0.2)
    assert row(5.0, (2.0, 4.0)).error("ideal") == pytest.approx(-0.2)
    assert row(5.0, 4.0).error_text("ideal") == "-20%"
    assert row(1.0, 0.5, bound="upper").error_text("ideal") == "within"
    assert row(1.0, 1.5, bound="upper").error("ideal") == pytest.approx(0.5)
    assert row(3.0, 2.4, bound="lower").error("ideal") == pytest.approx(-0.2)
    assert row(3.0, 3.5, bound="lower").error_text("ideal") == "within"
