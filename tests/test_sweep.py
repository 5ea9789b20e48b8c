"""Sweeps: spec validation, local vs Dask, resume after a kill, failures recorded."""

import json
import os
import re
import signal
import subprocess
import sys
import time
from unittest.mock import patch

import pandas as pd
import pytest
import yaml

from klotski_sim.runs.sweep import SweepError, collect, expand, parse_spec, run_sweep

from .conftest import ROOT, run, run_cli, run_cli_process, start

SMALL = {
    "name": "t",
    "models": ["tiny-mixtral"],
    "policies": ["klotski", "flexgen"],
    "batch_sizes": [2],
    "num_batches": [2, "auto"],
    "prompt_lens": [8],
    "gen_lens": [3],
    "routings": ["calibrated", "uniform"],
}
METRICS = ["m.makespan_s", "m.throughput_tok_s", "m.bubble_s", "m.peak_gpu_bytes", "status"]


def test_spec_errors_come_before_anything_runs():
    with pytest.raises(SweepError, match="polices: unknown key \\(did you mean 'policies'\\?\\)"):
        parse_spec({"polices": ["klotski"]})
    with pytest.raises(SweepError, match="unknown hardware profile 'rtx9090'"):
        parse_spec({"policies": ["klotski"], "hardware": ["rtx9090"]})
    with pytest.raises(SweepError, match="links.pcie_h2d.bandwith"):
        parse_spec({"policies": ["klotski"], "overrides": {"links.pcie_h2d.bandwith": [1e9]}})
    with pytest.raises(SweepError, match="unknown policy 'klotsky'"):
        parse_spec({"policies": ["klotsky"]})
    with pytest.raises(SweepError, match="unknown routing 'zipfy'"):
        parse_spec({"policies": ["klotski"], "routings": ["zipfy"]})
    with pytest.raises(SweepError, match="num_batches"):
        parse_spec({"policies": ["klotski"], "num_batches": [0]})
    with pytest.raises(SweepError, match="gpu.peak_flops: Value error, -1 per second is below 1e\\+06"):
        parse_spec({"policies": ["klotski"], "overrides": {"gpu.peak_flops": [-1]}})


def test_a_grids_routings_are_checked_against_its_models_and_for_repeats_before_anything_runs(tmp_path):
    """Each ran a whole grid: a trace of another shape (or an unreadable meta) made an error row of
    every configuration, the sweep exit 0; `seeds: [0, 1]` beside traces alone, or `zipf:1` beside
    `zipf:1.0`, ran every configuration twice."""
    from klotski_sim.workload.model import get_model
    from klotski_sim.workload.trace_synth import synthesize

    synthesize(get_model("tiny-olmoe"), 4, 4, 2, "calibrated", 0).save(tmp_path / "o.npz")
    base = {"policies": ["klotski"], "models": ["tiny-mixtral"]}
    with pytest.raises(
        SweepError,
        match=r"routing 'trace:.*o.npz': the trace \(recorded for 'tiny-olmoe'\) has "
        r"another shape than model 'tiny-mixtral' \(trace vs model: 8 experts vs 4\)",
    ):
        parse_spec({**base, "routings": [f"trace:{tmp_path / 'o.npz'}"]})
    with pytest.raises(SweepError, match=r"seeds: \[0, 1\] draw synthetic routing, and every routing is a trace"):
        parse_spec({**base, "models": ["tiny-olmoe"], "routings": [f"trace:{tmp_path / 'o.npz'}"], "seeds": [0, 1]})
    parse_spec(
        {**base, "models": ["tiny-olmoe"], "routings": [f"trace:{tmp_path / 'o.npz'}", "uniform"], "seeds": [0, 1]}
    )  # (the seeds draw the uniform routing)
    with pytest.raises(SweepError, match="routings: 'zipf:1.0' is the routing 'zipf:1' again"):
        parse_spec({**base, "routings": ["zipf:1", "zipf:1.0"]})
    (tmp_path / "sub").mkdir()  # (one trace under two paths: one configuration of two, without a word)
    again = f"trace:{tmp_path / 'sub' / '..' / 'o.npz'}"
    with pytest.raises(
        SweepError, match=re.escape(f"routings: {again!r} is the trace 'trace:{tmp_path / 'o.npz'}' again")
    ):
        parse_spec({**base, "models": ["tiny-olmoe"], "routings": [f"trace:{tmp_path / 'o.npz'}", again]})


def test_grid_ids_are_stable_and_unique():
    spec = parse_spec(SMALL)
    configs = expand(spec)
    assert len(configs) == 2 * 2 * 2 and len({c["id"] for c in configs}) == len(configs)
    assert [c["id"] for c in expand(parse_spec(SMALL))] == [c["id"] for c in configs]


# A policy whose build ends the process that runs it, as the kernel's OOM killer or a `kill -9` would.
DIES = """import os
from klotski_sim.policies import register

@register("dies", "ends the process that builds it")
def build(inp):
    os._exit(3)
"""


@pytest.mark.parametrize(
    "where", [["--workers", "2"], ["--workers", "2", "--dask", "local"]], ids=["local pool", "local dask cluster"]
)
def test_a_configuration_that_kills_its_worker_is_a_row_and_the_sweep_goes_on(tmp_path, where):
    """A worker killed mid-sweep ended the sweep with the traceback of BrokenProcessPool (a local
    pool, whose every run in flight broke with it) or of KilledWorker (Dask, after the fourth
    worker died on the run). Now the configuration that kills its worker even on its own is a row
    of status `killed`, the others run, and a rerun tries it again."""
    if "--dask" in where:
        pytest.importorskip("dask.distributed")
    (tmp_path / "dies.py").write_text(DIES)
    spec = {
        **SMALL,
        "policy_files": ["dies.py"],
        "policies": ["klotski", "flexgen", "dies"],
        "routings": ["calibrated", "uniform"],
    }  # (12 configurations, 4 of them the policy that dies)
    (tmp_path / "spec.yaml").write_text(yaml.safe_dump(spec))
    rc, out, err = run_cli_process(  # (its spec's policy file registers a policy)
        "sweep", str(tmp_path / "spec.yaml"), "--out", str(tmp_path / "out"), *where, "--no-progress"
    )
    assert rc == 0 and err == "", err
    df = pd.read_parquet(tmp_path / "out" / "results.parquet")
    assert len(df) == 12 and df["id"].is_unique
    assert (df["status"] == "killed").sum() == 4 and set(df[df["status"] == "killed"]["policy"]) == {"dies"}
    assert (df["status"] == "ok").sum() == 8
    how = "on every Dask worker it was given" if "--dask" in where else "on its own"
    assert set(df[df["status"] == "killed"]["error"]) == {
        f"its worker process died running it {how} (killed, or out of host memory?)"
    }
    assert "12 configurations in" in out and "(4 not ok" in out
    rc, out, err = run_cli_process(
        "sweep", str(tmp_path / "spec.yaml"), "--out", str(tmp_path / "out"), "--workers", "2", "--no-progress"
    )
    assert rc == 0 and "resumed: 8 already done, 4 left" in out, out + err


def test_failures_are_rows_not_crashes(tmp_path):
    spec = parse_spec(
        {
            **SMALL,
            "policies": ["klotski"],
            "num_batches": [2],
            "routings": ["calibrated"],
            "overrides": {"gpu.memory_bytes": [1.0000001e9, 1e12]},
        }
    )  # 100 usable bytes: oom
    df = run_sweep(spec, tmp_path, progress=False)
    assert sorted(df["status"]) == ["ok", "oom"]
    assert (tmp_path / "results.parquet").exists()


def test_a_group_the_model_or_machine_cannot_form_is_a_refused_row_naming_the_spec_field(tmp_path):
    """gpus: 3 on a model of 8 KV heads and gpus: 8 on a 4-GPU machine are the configuration's
    limits, not the simulator's failures: rows `refused`, saying `gpus:` as the spec does."""
    spec = parse_spec(
        {
            "models": ["tiny-mixtral"],
            "hardware": ["l40s"],
            "policies": ["flexgen"],
            "batch_sizes": [2],
            "num_batches": [2],
            "prompt_lens": [8],
            "gen_lens": [3],
            "gpus": [1, 3, 8],
        }
    )
    df = run_sweep(spec, tmp_path, progress=False).set_index("gpus").sort_index()
    assert list(df["status"]) == ["ok", "refused", "refused"]
    assert df.at[3, "error"].startswith("gpus: 3: tensor parallelism splits attention by heads"), df.at[3, "error"]
    assert df.at[8, "error"] == "gpus: 8: hardware profile 'l40s' has 4 GPUs"


def test_a_configuration_host_memory_cannot_hold_is_refused_not_an_error(tmp_path):
    """A configuration whose weights the profile's host memory cannot hold is the configuration's
    verdict, as a GPU that cannot hold it is (`oom`): status `refused` with the reason, not `error`
    with a traceback (which reads as the simulator failing); optimize counts it apart too."""
    spec = parse_spec(
        {
            **SMALL,
            "models": ["mixtral-8x7b"],
            "policies": ["single-batch"],
            "routings": ["calibrated"],
            "experts": ["cpu"],
            "impls": ["ideal"],
            "num_batches": [2],
            "overrides": {"host.memory_bytes": [50e9, 500e9]},
        }
    )
    df = run_sweep(spec, tmp_path, progress=False)
    assert list(df.sort_values("set.host.memory_bytes")["status"]) == ["refused", "ok"]
    refused = df[df["status"] == "refused"].iloc[0]
    assert refused["error"].startswith("mixtral-8x7b keeps ") and "host.memory_bytes (46.57 GiB)" in refused["error"]
    assert "traceback" not in df.columns or pd.isna(refused["traceback"])


def test_a_cpu_policy_on_a_profile_without_a_cpu_is_refused_before_anything_runs(tmp_path):
    """klotski-hybrid on a profile without a `cpu:` section: `plan` printed its whole plan, `compare`
    its placement, `optimize` ran every configuration (and wrote a results folder) before the error,
    and a sweep recorded it as an `error` row, the simulator's failure."""
    from .conftest import run_cli

    tiny = (
        "--model",
        "tiny-mixtral",
        "--batch-size",
        "2",
        "--prompt-len",
        "8",
        "--gen-len",
        "3",
        "--hardware",
        "a100-80g",
    )
    said = "policy 'klotski-hybrid' computes on the CPU, but hardware profile 'a100-80g' has no `cpu:` section"
    for args in (
        ("plan", *tiny, "--policy", "klotski-hybrid"),
        ("compare", *tiny, "--policies", "klotski-hybrid", "--no-png", "--out", str(tmp_path / "c")),
        (
            "optimize",
            "--model",
            "tiny-mixtral",
            "--prompt-len",
            "8",
            "--gen-len",
            "3",
            "--hardware",
            "a100-80g",
            "--policies",
            "klotski-hybrid",
            "--no-progress",
            "--out",
            str(tmp_path / "o"),
        ),
    ):
        rc, out, err = run_cli(*args)
        assert (rc, out) == (2, "") and err.count("\n") == 1 and said in err, (args[0], out, err)
    assert not (tmp_path / "o").exists() and not (tmp_path / "c").exists()
    spec = parse_spec(
        {
            **SMALL,
            "policies": ["klotski-hybrid", "klotski"],
            "hardware": ["a100-80g"],
            "num_batches": [2],
            "routings": ["calibrated"],
        }
    )
    df = run_sweep(spec, tmp_path / "s", progress=False)
    assert sorted(zip(df["policy"], df["status"])) == [("klotski", "ok"), ("klotski-hybrid", "refused")]
    assert said in df.loc[df["policy"] == "klotski-hybrid", "error"].iloc[0]
    # so is a profile measured on another model's ops (its tables key on category and tokens alone)
    spec = parse_spec(
        {
            **SMALL,
            "models": ["tiny-mixtral", "small-mixtral"],
            "policies": ["klotski"],
            "hardware": [
                os.path.join(
                    os.path.dirname(__file__), "..", "experiments", "results", "cpu", "tiny-mixtral", "profile.yaml"
                )
            ],
            "num_batches": [2],
            "routings": ["calibrated"],
        }
    )
    df = run_sweep(spec, tmp_path / "m", progress=False)
    assert sorted(zip(df["model"], df["status"])) == [("small-mixtral", "refused"), ("tiny-mixtral", "ok")]


def test_local_and_dask_give_identical_results(tmp_path):
    """A local pool and a local Dask cluster give the same rows; the cluster's workers, processes of
    this machine, share it as the pool's do (`runner.pool_worker`: the memory a run projects against,
    the threads of a draw)."""
    distributed = pytest.importorskip("dask.distributed")
    from klotski_sim.runs.dask_worker import SharesTheMachine

    spec = parse_spec(SMALL)
    local = run_sweep(spec, tmp_path / "local", workers=2, progress=False)
    real_register, plugins = distributed.Client.register_plugin, []

    def recorded(client, plugin, *args, **kwargs):
        plugins.append(plugin)
        return real_register(client, plugin, *args, **kwargs)

    with patch.object(distributed.Client, "register_plugin", recorded):
        dask = run_sweep(spec, tmp_path / "dask", workers=2, dask="local", progress=False)
    assert len(local) == len(dask) == 8
    pd.testing.assert_frame_equal(local[["id"] + METRICS], dask[["id"] + METRICS])
    assert [(type(p), p.in_flight) for p in plugins] == [(SharesTheMachine, 2)]


def test_resume_after_a_killed_sweep_loses_and_duplicates_nothing(tmp_path):
    spec_file = tmp_path / "spec.yaml"
    spec = {**SMALL, "seeds": [0, 1, 2]}
    spec_file.write_text(yaml.safe_dump(spec))
    out = tmp_path / "out"
    cmd = [
        sys.executable,
        "-m",
        "klotski_sim.cli.main",
        "sweep",
        str(spec_file),
        "--out",
        str(out),
        "--workers",
        "2",
        "--no-progress",
    ]
    # (in a session of its own, with the stop signals at their defaults, killed whole if the test fails)
    proc = start(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.time() + 120
    while time.time() < deadline and proc.poll() is None:
        if (out / "rows").exists() and len(list((out / "rows").glob("*.json"))) >= 3:
            break
        time.sleep(0.05)
    os.killpg(proc.pid, signal.SIGKILL)  # the sweep and its worker processes, mid-run
    proc.wait()
    survived = {p.stem: p.read_text() for p in (out / "rows").glob("*.json")}
    assert 0 < len(survived) < 24
    for text in survived.values():
        json.loads(text)  # every row on disk is whole
    rerun = run(cmd, timeout=600)
    assert rerun.returncode == 0, rerun.stderr
    df = pd.read_parquet(out / "results.parquet")
    assert len(df) == 24 and df["id"].is_unique
    for row_id, text in survived.items():  # finished rows were kept, not recomputed or rewritten
        assert (out / "rows" / f"{row_id}.json").read_text() == text
    assert len(collect(out)) == 24


@pytest.mark.parametrize("damage", [b"{garbage", b"", b"[1, 2]", bytes(range(256)), b'{"id": "another"}'])
def test_a_damaged_row_is_run_again_not_taken_as_done(tmp_path, damage):
    """A row file that is not a finished row (damaged by hand or by a disk, or not ours) made the
    resumed sweep crash (KeyError, UnicodeDecodeError) or count its configuration as done and drop
    it from the results; it is run again and its row rewritten."""
    spec = {**SMALL, "policies": ["klotski"], "routings": ["calibrated"], "num_batches": [2]}
    first = run_sweep(parse_spec(spec), tmp_path, workers=1, progress=False)
    victim = tmp_path / "rows" / f"{first['id'].iloc[0]}.json"
    whole = victim.read_text()
    victim.write_bytes(damage)
    again = run_sweep(parse_spec(spec), tmp_path, workers=1, progress=False)
    assert len(again) == len(first) and json.loads(victim.read_text())["id"] == victim.stem
    assert json.loads(victim.read_text())["m.makespan_s"] == json.loads(whole)["m.makespan_s"]


@pytest.mark.parametrize(
    "edit",
    [
        {"m.throughput_tok_s": "fast"},
        {"m.efficiency": True},
        {"m.kv": 3},
        {"status": "great"},
        {"wall_s": -1.0},
        {"wall_s": "0.1"},
        {"error": None},
    ],
)
def test_a_row_edited_into_what_no_run_writes_is_run_again(tmp_path, edit):
    """A hand-edited row of valid JSON (a throughput as text) was collected as it was: results.parquet's
    column became text and optimize, the figures and any reader ranked on strings. It is run again."""
    spec = {**SMALL, "policies": ["klotski"], "routings": ["calibrated"], "num_batches": [2]}
    first = run_sweep(parse_spec(spec), tmp_path, workers=1, progress=False)
    victim = tmp_path / "rows" / f"{first['id'].iloc[0]}.json"
    whole = json.loads(victim.read_text())
    victim.write_text(json.dumps({**whole, **edit}))
    again = run_sweep(parse_spec(spec), tmp_path, workers=1, progress=False)
    rewritten = json.loads(victim.read_text())
    assert rewritten != {**whole, **edit} and isinstance(rewritten["wall_s"], float) and rewritten["wall_s"] >= 0
    assert len(again) == len(first) and rewritten["m.throughput_tok_s"] == whole["m.throughput_tok_s"]
    assert all(rewritten[key] == whole[key] for key in edit if key != "wall_s")
    assert again["m.throughput_tok_s"].dtype == float


def test_sweep_cli_validates_spec(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("policies: [klotski]\nhardwares: [rtx3090]\n")
    proc = run(
        [sys.executable, "-m", "klotski_sim.cli.main", "sweep", str(bad), "--out", str(tmp_path / "o")], timeout=600
    )
    assert proc.returncode == 2 and "hardwares: unknown key (did you mean 'hardware'?)" in proc.stderr


def test_rows_of_other_code_are_not_reused(tmp_path, monkeypatch):
    import klotski_sim.runs.sweep as sweep

    spec = parse_spec({**SMALL, "policies": ["klotski"], "num_batches": [2], "routings": ["calibrated"]})
    first = run_sweep(spec, tmp_path, progress=False)
    assert len(first) == 1 and first["code"].iloc[0] == sweep.code_fingerprint()
    monkeypatch.setattr(sweep, "code_fingerprint", lambda: "other-code")
    second = run_sweep(spec, tmp_path, progress=False)
    assert len(second) == 1 and second["code"].iloc[0] == "other-code"
    assert len(list((tmp_path / "rows").glob("*.json"))) == 2  # the old row is kept, not rewritten


def test_policy_options_and_resident_layers_are_grid_axes(tmp_path):
    spec = parse_spec(
        {
            "policies": ["klotski", "single-batch"],
            "models": ["tiny-mixtral"],
            "batch_sizes": [2],
            "prompt_lens": [8],
            "gen_lens": [3],
            "options": {"expert_cache": [0, 4]},
            "resident_layers": ["auto", 0],
        }
    )
    df = run_sweep(spec, tmp_path / "out", progress=False)
    assert len(df) == 2 * 2 * 2 and set(df["status"]) == {"ok"}
    assert set(df["opt.expert_cache"]) == {0, 4}
    with pytest.raises(SweepError, match="options.expert_cache.*must be a whole number >= 0"):
        parse_spec({"policies": ["klotski"], "options": {"expert_cache": ["lots"]}})
    with pytest.raises(SweepError, match="resident_layers"):
        parse_spec({"policies": ["klotski"], "resident_layers": [-2]})


def test_speed_independent_policies_build_the_same_schedule_whatever_the_speeds():
    """What `speed_independent` promises (and a sweep over hardware numbers relies on): the schedule
    is the same under any link, GPU or CPU speed, given the same n and placement."""
    from klotski_sim.hardware.profile import load_profile, with_overrides
    from klotski_sim.policies import POLICIES, PolicyInput, build_schedule
    from klotski_sim.runs.runner import RunSpec, prepare

    base = load_profile("rtx3090")
    faster = with_overrides(
        base,
        {
            "links.pcie_h2d.bandwidth": 3.1e9,
            "links.pcie_d2h.bandwidth": 77e9,
            "gpu.peak_flops": 1e13,
            "gpu.memory_bandwidth": 3e11,
            "gpu.kernel_overhead_s": 1e-3,
            "cpu.memory_bandwidth": 1e9,
            "cpu.op_overhead_s": 0.01,
        },
    )
    prep = prepare(RunSpec(model="mixtral-8x7b:4", num_batches=3, batch_size=4, prompt_len=16, gen_len=3))
    marked = [name for name, info in POLICIES.items() if info.traits.speed_independent]
    assert {"single-batch", "multi-batch", "hot-prefetch", "klotski", "klotski-oracle", "flexgen"} <= set(marked)
    assert not POLICIES["klotski-hybrid"].traits.speed_independent and not POLICIES["fiddler"].traits.speed_independent
    for name in marked:
        for impl in ("as-published", "ideal"):
            built = [
                build_schedule(
                    name,
                    PolicyInput(
                        prep.model, profile, prep.replay.routing, prep.placement, warmup=prep.replay.warmup, impl=impl
                    ),
                ).to_json_dict()
                for profile in (base, faster)
            ]
            assert built[0] == built[1], (name, impl)


def test_a_what_if_over_hardware_numbers_reuses_the_schedule_and_gives_the_same_results():
    from klotski_sim.runs.runner import RunSpec, ScheduleReuse, run

    small = dict(model="mixtral-8x7b:4", num_batches=3, batch_size=4, prompt_len=16, gen_len=3)
    for policy, reused in (("klotski", True), ("fiddler", False)):
        reuse = ScheduleReuse()
        first = run(RunSpec(policy=policy, overrides={"links.pcie_h2d.bandwidth": 8e9}, **small), reuse=reuse)
        spec = RunSpec(policy=policy, overrides={"links.pcie_h2d.bandwidth": 32e9}, **small)
        second = run(spec, reuse=reuse)
        assert (second.schedule is first.schedule) == reused
        assert second.timeline.summary() == run(spec).timeline.summary()  # the same numbers as a fresh build
    reuse = ScheduleReuse()
    before = run(RunSpec(policy="klotski", **small), reuse=reuse).schedule
    other = run(RunSpec(policy="klotski", seed=1, **small), reuse=reuse)  # another routing: built anew
    again = run(RunSpec(policy="klotski", seed=1, overrides={"links.pcie_h2d.bandwidth": 8e9}, **small), reuse=reuse)
    assert other.schedule is not before and again.schedule is other.schedule


@pytest.mark.parametrize(
    "text, words",
    [
        (
            "name: t\nmodels: [tiny-mixtral]\npolicies: [klotski]\nmodels: [tiny-olmoe]\n",
            "spec.yaml:4: not valid YAML (key 'models' is given twice)",
        ),
        (
            "name: t\npolicies: [klotski]\nresident_layers: [true]\n",
            "resident_layers.0: input should be a valid integer, got True",
        ),
        (
            "name: t\npolicies: [klotski]\nnum_batches: [2.5]\n",
            "num_batches.0: input should be a valid integer, got 2.5",
        ),
        ("name: t\npolicies: [klotski]\nnum_batches: ['0']\n", "positive integers or 'auto', got '0'"),
        ("name: t\npolicies: [klotski]\nseeds: [3, -2]\n", "seeds: seeds must be from 0 to 2**63 - 1, got -2"),
        ("name: t\npolicies: [klotski]\nseeds: [99999999999999999999999]\n", "got 99999999999999999999999"),
    ],
)
def test_a_spec_key_given_twice_or_a_value_of_the_wrong_type_is_one_line_with_the_value(tmp_path, text, words):
    from klotski_sim.runs.sweep import load_spec
    from klotski_sim.util.errors import KlotskiError

    path = tmp_path / "spec.yaml"
    path.write_text(text)
    with pytest.raises(KlotskiError) as err:
        load_spec(path)
    assert "\n" not in str(err.value) and words in str(err.value) and str(err.value).count("got") <= 1, str(err.value)


def test_every_file_a_spec_names_is_relative_to_the_spec(tmp_path):
    """Policy files were relative to the spec, hardware YAML files and `trace:` routings to where the
    sweep was started: a spec that ran from its own folder failed from any other."""
    import shutil

    from klotski_sim.hardware.profile import builtin_profile_names
    from klotski_sim.runs.sweep import load_spec

    from .conftest import run_cli

    folder = tmp_path / "specs"
    folder.mkdir()
    # a what-if of the rtx3090 (an unchanged copy next to "rtx3090" is refused: the same profile twice)
    mine = (ROOT / "klotski_sim" / "hardware" / "profiles" / "rtx3090.yaml").read_text()
    (folder / "mine.yaml").write_text(mine.replace("bandwidth: 25.7e9", "bandwidth: 16e9", 1))
    shutil.copy(ROOT / "klotski_sim" / "hardware" / "profiles" / "h800.yaml", tmp_path / "other.yaml")
    shutil.copy(ROOT / "traces" / "tiny-mixtral-recorded.npz", folder / "tr.npz")
    absolute = str(tmp_path / "other.yaml")
    (folder / "spec.yaml").write_text(
        yaml.safe_dump(
            {
                "name": "rel",
                "models": ["tiny-mixtral"],
                "hardware": ["mine.yaml", absolute, "rtx3090"],
                "policies": ["klotski"],
                "batch_sizes": [2],
                "num_batches": [2],
                "prompt_lens": [4],
                "gen_lens": [2],
                "routings": ["trace:tr.npz", "calibrated"],
            }
        )
    )
    spec = load_spec(folder / "spec.yaml")
    assert "rtx3090" in builtin_profile_names() and spec.hardware == [str(folder / "mine.yaml"), absolute, "rtx3090"]
    assert spec.routings == [f"trace:{folder / 'tr.npz'}", "calibrated"]
    rc, out, err = run_cli("sweep", str(folder / "spec.yaml"), "--out", str(tmp_path / "out"), "--no-progress")
    assert rc == 0 and "Traceback" not in err, err


def test_a_configuration_s_files_are_part_of_its_id_by_contents_not_by_path(tmp_path, monkeypatch):
    """An edited hardware YAML or trace file reran nothing (its rows were reused under the old
    numbers, status ok), and the same spec started from another folder reran everything."""
    import shutil

    from klotski_sim.runs.sweep import load_spec
    from klotski_sim.workload.model import get_model
    from klotski_sim.workload.trace_synth import synthesize

    from .conftest import ROOT

    folder = tmp_path / "specs"
    folder.mkdir()
    shutil.copy(ROOT / "klotski_sim" / "hardware" / "profiles" / "rtx3090.yaml", folder / "hw.yaml")
    shutil.copy(ROOT / "traces" / "tiny-mixtral-recorded.npz", folder / "tr.npz")
    (folder / "spec.yaml").write_text(
        yaml.safe_dump(
            {
                "name": "ids",
                "models": ["tiny-mixtral"],
                "hardware": ["hw.yaml"],
                "policies": ["klotski"],
                "batch_sizes": [2],
                "num_batches": [2],
                "prompt_lens": [4],
                "gen_lens": [2],
                "routings": ["trace:tr.npz"],
            }
        )
    )

    def ids(spec_path) -> list[str]:
        return [c["id"] for c in expand(load_spec(spec_path))]

    first = ids(folder / "spec.yaml")
    monkeypatch.chdir(folder)
    assert ids("spec.yaml") == first  # (the same files, spelt from another folder)
    text = (folder / "hw.yaml").read_text()
    assert "kernel_overhead_s: 8.6e-6" in text
    (folder / "hw.yaml").write_text(text.replace("kernel_overhead_s: 8.6e-6", "kernel_overhead_s: 8.6e-3"))
    edited_profile = ids("spec.yaml")
    assert edited_profile != first
    synthesize(get_model("tiny-mixtral"), 12, 4, 2, "calibrated", 3).save(folder / "tr.npz")
    assert ids("spec.yaml") not in (first, edited_profile)


def test_the_cli_says_what_a_resumed_sweep_has_left_before_it_runs(tmp_path):
    """The estimate is of the configurations left, on the workers they can use, said before any
    runs (it came after the sweep, counting every row file, of other code too; "1 configurations")."""
    spec = tmp_path / "s.yaml"
    spec.write_text(
        yaml.safe_dump(
            {
                "name": "t",
                "models": ["tiny-mixtral"],
                "policies": ["klotski", "flexgen"],
                "batch_sizes": [2],
                "num_batches": [2],
                "prompt_lens": [8],
                "gen_lens": [3],
            }
        )
    )
    out = tmp_path / "o"
    code, first, _ = run_cli("sweep", str(spec), "--out", str(out), "--no-progress", "--workers", "4")
    assert code == 0 and first.splitlines()[0] == "2 configurations in the grid: running on 2 workers"
    code, again, _ = run_cli("sweep", str(spec), "--out", str(out), "--no-progress")
    assert again.splitlines()[0] == "2 configurations in the grid; resumed: all already done"
    min(out.glob("rows/*.json")).unlink()
    code, resumed, _ = run_cli("sweep", str(spec), "--out", str(out), "--no-progress")
    assert (
        resumed.splitlines()[0] == "2 configurations in the grid; resumed: 1 already done, 1 left: running on 1 worker"
    )
    assert resumed.splitlines()[-1].startswith("2 configurations in ")
    spec.write_text(spec.read_text().replace("- flexgen\n", ""))
    code, one, _ = run_cli("sweep", str(spec), "--out", str(out), "--no-progress")
    assert one.splitlines()[0] == (
        "1 configuration in the grid (1 row of other code or grids in the folder: kept, "
        "not reused); resumed: all already done"
    ), one


def test_a_sweep_on_a_full_disk_is_one_line_leaves_no_temporaries_and_a_rerun_collects(tmp_path):
    """On a full disk a sweep ended in a bare "[Errno 28]" line and left a `.results.parquet.<pid>.tmp`
    behind on each try. Now the line names the file, nothing half written is left, and the rows
    written before it stay: a rerun with room runs nothing again and collects them."""
    from .conftest import run_on_a_full_disk

    (tmp_path / "spec.yaml").write_text(yaml.safe_dump(SMALL))
    out = tmp_path / "out"
    rc, _, err = run_on_a_full_disk(
        "klotski_sim.cli.main", "sweep", str(tmp_path / "spec.yaml"), "--out", str(out), "--no-progress", room=6000
    )  # (a row's JSON fits, the Parquet table not)
    assert rc == 2 and err == f"error: {out}/results.parquet: cannot write (File too large)\n", err
    rows = sorted(p.name for p in (out / "rows").iterdir())
    assert len(rows) == len(expand(parse_spec(SMALL))) and all(not name.startswith(".") for name in rows)
    assert sorted(p.name for p in out.iterdir()) == [".lock", "rows", "spec.yaml"]
    rc, stdout, err = run_cli("sweep", str(tmp_path / "spec.yaml"), "--out", str(out), "--no-progress")
    assert rc == 0 and err == "" and "resumed: all already done" in stdout, stdout
    assert len(pd.read_parquet(out / "results.parquet")) == len(rows)


def test_more_local_workers_than_cores_run_as_many_as_there_are_cores(tmp_path, monkeypatch, capsys):
    """`--workers 1024` started a thousand worker processes (~100 MB each) on a 2-core machine, for
    CPU-bound runs that finish no sooner: held to the cores, and said so (a remote Dask cluster's
    workers are not this machine's)."""
    from klotski_sim.cli import common
    from klotski_sim.cli import main as cli
    from klotski_sim.cli.parser import build_parser
    from klotski_sim.runs import sweep as sweep_module

    monkeypatch.setattr(common, "available_cores", lambda: 1)
    given = []
    real = sweep_module.run_sweep
    monkeypatch.setattr(sweep_module, "run_sweep", lambda *a, **k: given.append(k["workers"]) or real(*a, **k))
    spec = tmp_path / "s.yaml"
    spec.write_text(
        yaml.safe_dump(
            {
                "name": "t",
                "models": ["tiny-mixtral"],
                "policies": ["klotski", "flexgen"],
                "batch_sizes": [2],
                "num_batches": [2],
                "prompt_lens": [4],
                "gen_lens": [2],
            }
        )
    )
    assert cli.main(["sweep", str(spec), "--out", str(tmp_path / "o"), "--no-progress", "--workers", "1024"]) == 0
    out, err = capsys.readouterr()
    assert given == [1] and out.splitlines()[0].endswith(": running on 1 worker")
    assert err.splitlines() == [
        "note: --workers 1024: this process may use 1 core(s); running 1 worker (the runs "
        "are CPU-bound: more would finish no sooner, each taking its own memory)"
    ]
    args = build_parser().parse_args(["sweep", str(spec), "--out", "o", "--workers", "8", "--dask", "tcp://h:8786"])
    common.local_workers(args)
    assert args.workers == 8  # (a remote cluster's)


def test_a_local_dask_worker_restarted_by_its_nanny_shares_the_machine_as_the_first_ones_did():
    """Set up by one `client.run`, a worker the nanny restarted after a run killed it skipped the setup:
    it checked its runs' memory as if it had the machine alone (`run_size`'s runs in flight: 1)."""
    pytest.importorskip("distributed")
    from klotski_sim.runs.sweep import _dask_client
    from klotski_sim.util import run_size

    def runs_in_flight() -> int:
        return run_size.sharing()

    with _dask_client("local", 2) as client:
        assert set(client.run(runs_in_flight).values()) == {2}
        client.restart()  # (every worker ended and started again by its nanny)
        assert set(client.run(runs_in_flight).values()) == {2}


def test_the_no_worker_watch_counts_from_the_first_answer_without_workers(monkeypatch):
    """A local Dask sweep whose nannies had all closed waited forever: the client now gives up on the
    runs left once the scheduler has answered `no worker` for NO_WORKERS_TIMEOUT_S."""
    from klotski_sim.runs import sweep

    answers = iter([{"a": {}}, {}, {}, {"b": {}}, {}])
    clock = iter([0.0, 10.0, 20.0, 30.0, 40.0, 43.0])

    class Client:
        def scheduler_info(self, n_workers: int = -1) -> dict:
            return {"workers": next(answers)}

    monkeypatch.setattr(sweep.time, "monotonic", lambda: next(clock))
    watch = sweep._NoWorkerWatch(Client())
    assert [watch.gone_for() for _ in range(5)] == [0.0, 0.0, 10.0, 0.0, 0.0]  # (a worker back: counted anew)
    assert watch.gone_for() == 3.0  # (asked at most every DASK_WATCH_S: at 43 s, no new question)
