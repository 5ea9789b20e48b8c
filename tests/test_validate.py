"""Calibration and validation on the CPU (the CUDA twin is the same code with another driver)."""

import json

import pytest

torch = pytest.importorskip("torch")

from klotski_runtime.calibrate import calibrate  # noqa: E402
from klotski_runtime.validate import (  # noqa: E402
    ValidationSetup,
    check_profile_device,
    format_report,
    validate,
)
from klotski_sim.core.cost import CostModel  # noqa: E402
from klotski_sim.hardware.profile import ProfileError, load_profile  # noqa: E402
from klotski_sim.workload.model import get_model  # noqa: E402

from .conftest import every_attempt_missed, runtime_in_process, simulate_small  # noqa: E402

TINY = get_model("tiny-mixtral")


def _runtime(*args):
    return runtime_in_process(*args)


@pytest.fixture
def profile_file(small_calibration):
    return small_calibration("tiny-mixtral")


def test_calibration_writes_a_loadable_profile_with_a_measured_table(profile_file):
    p = load_profile(profile_file)
    assert p.provenance["device_kind"] == "cpu" and p.provenance["torch"] == torch.__version__
    assert "klotski-runtime calibrate" in p.provenance["command"]
    for category in (
        "attention.fused:decode",
        "attention.eager:decode",
        "attention.fused:prefill",
        "attention.eager:prefill",
        "gate",
        "expert",
        "lm_head",
        "embed",
    ):
        assert p.measured[category], category
    assert p.links.pcie_h2d.bandwidth == 1e9  # emulated by default, and said so
    assert p.provenance["emulated_links"]["pcie_h2d"] == 1e9
    # the cost model now answers from the table inside its range
    cost = CostModel(p)
    point = p.measured["expert"][2]
    assert cost.compute_seconds("expert", 1.0, 1.0, point.tokens, phase="decode") == pytest.approx(
        point.seconds + p.gpu.dispatch_overhead_by_category.get("expert", p.gpu.dispatch_overhead_s)
    )
    assert p.gpu.dispatch_overhead_s >= 0 and p.gpu.dependency_latency_s > 0  # the executor's fitted costs
    assert {"attention", "gate", "expert", "embed", "lm_head"} <= set(p.gpu.dispatch_overhead_by_category)


def test_validate_produces_its_files_and_figures(profile_file, tmp_path):
    setup = ValidationSetup(
        model="tiny-mixtral",
        batch_size=2,
        num_batches=2,
        prompt_len=6,
        gen_len=3,
        emulate_links={"pcie_h2d": 1e9, "pcie_d2h": 1e9},
        warmup_runs=0,
    )  # (as calibrated)
    report = validate(setup, str(profile_file), tmp_path, ("klotski", "flexgen"))
    for policy in ("klotski", "flexgen"):
        for name in ("simulated.parquet", "measured.parquet", "validation.png", "validation.json", "schedule.json"):
            assert (tmp_path / policy / name).stat().st_size > 0
        r = report["policies"][policy]
        assert r["makespan"]["measured_s"] > 0 and r["makespan"]["error"] is not None
        assert set(r["bubbles"]) == {"all", "inter", "intra"} and r["worst_ops"]
    saved = json.loads((tmp_path / "validation.json").read_text())
    assert saved["emulated_links"] == {"pcie_h2d": 1e9, "pcie_d2h": 1e9}
    assert "EMULATED" in format_report(report)


def test_a_profile_for_another_device_or_other_emulated_links_is_refused(profile_file):
    with pytest.raises(ProfileError, match="calibrated on a cpu device"):
        check_profile_device(load_profile(profile_file), "cuda")
    check_profile_device(load_profile("rtx3090"), "cuda")  # (a spec sheet against a real GPU of its kind: a check)
    with pytest.raises(ProfileError, match="'rtx3090' is a spec-sheet profile, not a calibration, not cpu"):
        check_profile_device(load_profile("rtx3090"), "cpu")  # (a simulated RTX 3090 against the CPU)
    check_profile_device(load_profile(profile_file), "cpu", {"pcie_h2d": 1e9, "pcie_d2h": 1e9})
    with pytest.raises(
        ProfileError,
        match="calibrated with emulated links pcie_d2h 1e\\+09 B/s, pcie_h2d 1e\\+09 "
        "B/s, this run emulates pcie_d2h 5e\\+09 B/s, pcie_h2d 5e\\+09 B/s",
    ):
        check_profile_device(load_profile(profile_file), "cpu", {"pcie_h2d": 5e9, "pcie_d2h": 5e9})
    with pytest.raises(ProfileError, match="this run emulates none \\(real copies\\)"):
        check_profile_device(load_profile(profile_file), "cpu", {})


def test_validate_cli_end_to_end(tmp_path):
    rc, out, err = _runtime(
        "validate",
        "--policy",
        "klotski",
        "--model",
        "tiny-mixtral",
        "--batch-size",
        "2",
        "--num-batches",
        "2",
        "--prompt-len",
        "6",
        "--gen-len",
        "3",
        "--out",
        str(tmp_path),
    )
    assert rc == 0, err
    assert "calibrating cpu" in out and "klotski" in out and "EMULATED" in out
    assert (tmp_path / "profile.yaml").exists() and (tmp_path / "klotski" / "validation.png").exists()


def test_execute_cli_runs_what_simulate_wrote(tmp_path):
    simulate_small(str(tmp_path / "sim"))
    rc, out, err = _runtime("execute", str(tmp_path / "sim"), "--out", str(tmp_path / "meas"))
    assert rc == 0, err
    assert "throughput" in out and "EMULATED" in out and (tmp_path / "meas" / "trace.json.gz").exists()
    # a schedule for another model is a clear error
    rc, _, err = _runtime("execute", str(tmp_path / "sim"), "--model", "small-mixtral")
    assert rc == 2 and "built for model 'tiny-mixtral'" in err and "Traceback" not in err


def test_missing_checkpoint_is_a_clear_error(tmp_path):
    rc, _, err = _runtime(
        "validate",
        "--policy",
        "klotski",
        "--model",
        "tiny-mixtral",
        "--checkpoint",
        str(tmp_path / "nope"),
        "--profile",
        "experiments/results/cpu/tiny-mixtral/profile.yaml",
        "--emulate-pcie",
        "5e7",
        "--out",
        str(tmp_path / "v"),
    )
    assert rc == 2 and "no such checkpoint directory" in err and "Traceback" not in err
    # a profile measured on another model's ops is refused by validate as by simulate
    rc, _, err = _runtime(
        "validate",
        "--policy",
        "klotski",
        "--model",
        "tiny-mixtral",
        "--profile",
        "experiments/results/cpu/small-mixtral-presets/profile.yaml",
        "--out",
        str(tmp_path / "v"),
    )
    assert rc == 2 and "its measured op times were calibrated on small-mixtral's ops, not tiny-mixtral's" in err


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_calibration(tmp_path):
    p = calibrate(TINY, "cuda", batch_sizes=(2,), prompt_lens=(6,), max_expert_tokens=16, repeats=2)
    assert p.provenance["device_kind"] == "cuda" and p.measured["expert"]


ATTEMPTS = 3  # calibrate + validate again when a timing bound is missed (why: see the test's docstring)


def _bound_misses(report: dict) -> list[str]:
    """The validation bounds a report misses, one line each (empty: all met)."""
    misses = []
    for name, r in report["policies"].items():
        makespan = r["repeats"]["makespan"]["median"]
        bubbles = r["repeats"]["bubbles_all"]["median"]
        if abs(makespan) > 0.10:
            misses.append(f"{name}: median makespan error {makespan:+.1%} (runs {r['repeats']['makespan']})")
        if abs(bubbles) > 0.20:
            misses.append(f"{name}: median bubble error {bubbles:+.1%} (runs {r['repeats']['bubbles_all']})")
    if misses:
        misses.append(f"machine: {report['machine']}")
    return misses


@pytest.mark.serial
def test_small_mixtral_validation_error_is_bounded(tmp_path):
    """Emulated links, small-mixtral, dispatch costs calibrated out of sample (other batch size,
    batch count, prompt and layer count): the median makespan error of 3 runs is within 10% and the
    bubble error within 20% for Klotski and FlexGen as published.

    These are wall-clock measurements on a shared machine (CI's 2 cores): a neighbour that takes a
    core for the minute of one validation slows its runs unevenly (a quiet run measures within a few
    percent; one under a load of 1.2 a core measured FlexGen at -10.1%, its runs from -18% to -7%). So
    a missed bound is calibrated and measured again, up to ATTEMPTS times. An error of the model is
    there in every attempt, quiet or not, and fails the test; where every attempt missed and every
    one was measured as loaded (validate's own load, steal and run-spread warnings), the bound could
    not be checked on this machine, and the test says so with the numbers instead of failing."""
    from klotski_sim.workload.model import get_model

    links = {"pcie_h2d": 1e9, "pcie_d2h": 1e9}
    pageable = {k: v * 10.0 / 25.7 for k, v in links.items()}
    attempts: list[list[str]] = []
    loaded: list[list[str]] = []  # each attempt's machine warnings (empty: a quiet attempt)
    while len(attempts) < ATTEMPTS:
        folder = tmp_path / f"attempt{len(attempts)}"
        folder.mkdir()
        profile = calibrate(
            get_model("small-mixtral"),
            "cpu",
            batch_sizes=(1, 4),
            prompt_lens=(8, 16),
            kv_lens=range(17, 21),
            max_expert_tokens=256,
            repeats=3,
            emulate_links=links,
            emulate_pageable=pageable,
            threads=1,
        )
        path = folder / "profile.yaml"
        path.write_text(profile.to_yaml())
        assert profile.provenance["probe"]["batch_size"] == 1 and profile.provenance["probe"]["prompt_len"] == 8
        assert profile.provenance["machine_load"]["load_per_core"] >= 0 and profile.provenance["cpu_model"]
        setup = ValidationSetup(
            model="small-mixtral",
            batch_size=4,
            num_batches=2,
            prompt_len=16,
            gen_len=4,
            emulate_links=links,
            emulate_pageable=pageable,
            repeats=3,
        )
        report = validate(setup, str(path), folder / "v", ("klotski", "flexgen"))
        assert set(report["policies"]) == {"klotski", "flexgen"}
        for r in report["policies"].values():  # what does not depend on timing holds in every attempt
            assert (
                r["repeats"]["makespan"]["min"] <= r["repeats"]["makespan"]["median"] <= r["repeats"]["makespan"]["max"]
            )
            assert r["in_sample"]["makespan"]["error"] is not None
        assert report["machine"]["expert_drift"] is not None  # (the profile's expert rows re-timed: same process)
        attempts.append(_bound_misses(report))
        if not attempts[-1]:
            return
        loaded.append(report["machine"]["warnings"])
    every_attempt_missed(attempts, loaded)


def test_machine_conditions_warn_about_load_steal_and_spread():
    from klotski_runtime.validate import machine_conditions

    quiet = {"load_per_core": 0.1, "steal_jiffies": 0.0, "total_jiffies": 1000.0}
    busy = {"load_per_core": 1.5, "steal_jiffies": 100.0, "total_jiffies": 2000.0}
    assert machine_conditions(quiet, quiet, [0.01, 0.02])["warnings"] == []
    warned = machine_conditions(quiet, busy, [0.01, 0.2], drift=1.25)
    text = " ".join(warned["warnings"])
    assert "load average 1.50" in text and "10.0% of CPU time stolen" in text and "differ by up to 20.0%" in text
    assert "expert ops take 1.25x their calibrated durations now" in text and warned["expert_drift"] == 1.25
    assert machine_conditions(quiet, quiet, [0.01], drift=1.05)["warnings"] == []  # (within 10%: said nowhere)


def test_calibration_measures_the_host_cpu_and_cpu_expert_policies_validate(profile_file, tmp_path):
    import yaml

    p = load_profile(profile_file)
    assert p.cpu is not None and p.cpu.cores >= 1 and p.cpu.flop_rate > 0 and p.cpu.memory_bandwidth > 0
    table = p.measured["cpu:expert"]
    assert table and [pt.tokens for pt in table] == sorted(pt.tokens for pt in table)
    # the simulator prices a CPU expert from that table inside its range
    cost = CostModel(p)
    assert cost.cpu_seconds(1.0, 1.0, "expert", table[0].tokens) == pytest.approx(
        table[0].seconds + p.cpu.op_overhead_s
    )
    # little GPU memory: Fiddler must put experts on the CPU; a whole-layer upload cannot fit (skipped, said why)
    data = yaml.safe_load(profile_file.read_text())
    data["gpu"]["memory_bytes"], data["gpu"]["reserved_bytes"] = 3.0e5, 0.0
    capped = tmp_path / "capped.yaml"
    capped.write_text(yaml.safe_dump(data))
    # prompt 2 x 16 = 32 tokens: llama.cpp's rule uploads whole layers in prefill
    setup = ValidationSetup(
        model="tiny-mixtral",
        batch_size=2,
        num_batches=2,
        prompt_len=16,
        gen_len=3,
        repeats=1,
        impl="ideal",
        emulate_links=p.provenance["emulated_links"],
    )  # (the links as calibrated)
    # The makespan bound is wall-clock over a ~10 ms run on a profile calibrated once for the session
    # (perhaps beside another worker's tests): a miss is measured again, and only where every attempt
    # ran on a loaded machine is it skipped, with the numbers (`every_attempt_missed`).
    attempts: list[list[str]] = []
    loaded: list[list[str]] = []
    for attempt in range(2):
        policies = ("fiddler", "llamacpp-moe", "klotski-hybrid")
        report = validate(setup, str(capped), tmp_path / f"out{attempt}", policies)
        fiddler = report["policies"]["fiddler"]
        assert fiddler["per_category"]["expert"]["ops"] > 0  # (what does not depend on timing: every attempt)
        assert fiddler["makespan"]["simulated_s"] > 0 and fiddler["makespan"]["measured_s"] > 0
        skipped = report["policies"]["llamacpp-moe"]
        assert "skipped" in skipped and "oom" in skipped["skipped"]
        assert "not compared" in format_report(report)
        error = fiddler["makespan"]["error"]
        attempts.append([] if abs(error) < 1.0 else [f"fiddler makespan error {error:+.0%} ({report['machine']})"])
        if not attempts[-1]:
            return
        loaded.append(report["machine"]["warnings"])
    every_attempt_missed(attempts, loaded)


def test_issue_by_category_sets_the_issuing_threads_measured_time_beside_rule_4s_charge():
    """The CUDA executor's per-op issue times (`OpRunner.issue_s`, op index -> s) summarised per category:
    the median over every run's ops and what the engine charges for one; nothing without them (the CPU)."""
    from klotski_runtime.validate import issue_by_category
    from klotski_sim.core.cost import CostModel
    from klotski_sim.core.schedule import Op, Schedule

    from .conftest import make_profile

    copy = Op("t", "transfer", "h2d_weights", "weights", bytes=1, src="cpu", dst="gpu")
    expert = Op("x", "compute", "compute", "expert", ("t",))
    schedule = Schedule((copy, expert))
    profile = make_profile(kernel_overhead_s=1e-5, copy_issue_s=5e-5)
    got = issue_by_category(schedule, profile, [{0: 1e-4, 1: 2e-4}, {0: 3e-4, 1: 6e-4}])
    assert got == {
        "expert": {"ops": 1, "measured_median_s": pytest.approx(4e-4), "simulated_s": pytest.approx(8e-5)},
        "weights": {"ops": 1, "measured_median_s": pytest.approx(2e-4), "simulated_s": 5e-5},
    }
    assert got["expert"]["simulated_s"] == CostModel(profile).issue_seconds(expert, "gpu")
    assert issue_by_category(schedule, profile, [{}, {}]) == {} == issue_by_category(schedule, profile, [])
