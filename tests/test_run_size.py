"""A run's size projected from its first steps: close to the ops it builds, a refusal when this
machine's memory cannot hold it (one line; a sweep row `too-large`, tried again on a rerun), a note
when it will take long."""

from __future__ import annotations

from dataclasses import replace

import pytest

from klotski_sim.cli.main import main
from klotski_sim.policies import build_schedule
from klotski_sim.runs.runner import RunSpec, plan_run, prepare
from klotski_sim.runs.sweep import parse_spec, run_sweep
from klotski_sim.util import machine, run_size
from klotski_sim.util.errors import MachineRefusal


def built(spec: RunSpec):
    prep = plan_run(spec, prepare(spec)).prepared
    return build_schedule(spec.policy, replace(prep.policy_input(spec.options), impl=spec.impl))


@pytest.fixture
def projections(monkeypatch):
    """The ops each projection gave, and the ops built when it was made."""
    seen: list[tuple[int, int]] = []
    project = run_size.RunSizeWatch._project

    def spy(self, ops_built):
        seen.append((self.projected_ops(ops_built), ops_built))
        project(self, ops_built)

    monkeypatch.setattr(run_size.RunSizeWatch, "_project", spy)
    return seen


@pytest.mark.parametrize(
    "model, policy, impl",
    [
        ("small-mixtral", "klotski", "as-published"),
        ("small-mixtral", "klotski", "ideal"),
        ("small-mixtral", "flexgen", "as-published"),
        ("small-mixtral", "single-batch", "as-published"),
        ("small-mixtral", "multi-batch", "as-published"),
        ("small-mixtral", "fiddler", "as-published"),
        ("small-mixtral", "llamacpp-moe", "as-published"),
        ("tiny-olmoe", "klotski", "as-published"),
        ("tiny-qwen3-moe", "flexgen", "as-published"),
    ],
)
def test_the_projection_is_within_a_few_percent_of_the_ops_built(projections, model, policy, impl):
    """Made once, at the third step, from prefill and the first decode step (wrong step counts in
    the projection miss by a fifth or more at 10 steps)."""
    schedule = built(
        RunSpec(model=model, policy=policy, impl=impl, num_batches=None, prompt_len=32, gen_len=10, batch_size=4)
    )
    assert len(projections) == 1
    projected, at = projections[0]
    assert at < len(schedule) / 3  # made early: before a third of the ops are built
    assert abs(projected / len(schedule) - 1) < 0.05, (projected, len(schedule))


def projected_in_loop_order(order: list[tuple[int, int]]) -> int:
    """The projection of a loop over 3 batches x 6 steps that walks (step, batch) in `order`, each
    batch's prefill 50 ops and each decode step 10: 3 x (50 + 5 x 10) = 300 ops in all."""
    watch = run_size.RunSizeWatch("p", "as-published", num_steps=6, num_batches=3, resident_at_start=None)
    ops, projected = 0, -1
    for step, batch in order:
        watch.step_begins(step, batch, ops)
        if (step, batch) == (2, 0):
            projected = watch.projected_ops(ops)
        ops += 50 if step == 0 else 10
    assert ops == 300
    return projected


def test_a_loop_over_one_batch_steps_after_another_is_projected_for_every_batch():
    """Prefill of batch 0 alone, then its decode steps: its ops times the batches; a loop over
    steps, each step of every batch: as they come."""
    assert projected_in_loop_order([(step, batch) for batch in range(3) for step in range(6)]) == 300
    assert projected_in_loop_order([(step, batch) for step in range(6) for batch in range(3)]) == 300


def test_a_run_this_machine_cannot_hold_is_refused_after_its_first_steps(projections, monkeypatch):
    monkeypatch.setattr(run_size, "available_memory_bytes", lambda: 10_000_000)  # 10 MB to spare
    with pytest.raises(MachineRefusal) as refusal:
        built(RunSpec(model="small-mixtral", policy="klotski", num_batches=None, prompt_len=32, gen_len=40))
    ((projected, at),) = projections
    assert at < projected / 10  # refused before a tenth of it was built
    message = str(refusal.value)
    assert message.startswith(f"klotski would build about {projected:,} ops (") and "0.80 kB an op" in message
    assert "this machine has 9.54 MiB available" in message and "--impl ideal" in message


def test_refused_only_above_what_is_available(projections, monkeypatch):
    """The same run with the memory it needs, and with a little less."""
    spec = RunSpec(model="small-mixtral", policy="klotski", num_batches=None, prompt_len=32, gen_len=20)
    monkeypatch.setattr(run_size, "resident_bytes", lambda: 100_000_000)
    built(spec)
    ops = projections[-1][0]
    needed = 100_000_000 + ops * run_size.BYTES_PER_OP - 100_000_000  # (resident at start and now: the same)
    monkeypatch.setattr(run_size, "available_memory_bytes", lambda: needed)
    built(spec)
    monkeypatch.setattr(run_size, "available_memory_bytes", lambda: needed - 1)
    with pytest.raises(MachineRefusal):
        built(spec)


def test_the_cli_refuses_in_one_line_and_says_long_runs(projections, monkeypatch, capsys, tmp_path):
    monkeypatch.setattr(run_size, "available_memory_bytes", lambda: 1_000_000)
    args = ["simulate", "--model", "small-mixtral", "--policy", "klotski", "--prompt-len", "32", "--gen-len", "12"]
    assert main(args) == 2
    out, err = capsys.readouterr()
    assert err.count("\n") == 1 and err.startswith("error: klotski would build about "), err
    monkeypatch.setattr(run_size, "available_memory_bytes", lambda: None)  # (unknown: nothing refused)
    monkeypatch.setattr(run_size, "LONG_RUN_S", 0.0)
    monkeypatch.setattr("klotski_sim.util.machine._slowdown", [1.0])  # (the reference machine's speed: fixed figures)
    assert main([*args, "--out", str(tmp_path / "o")]) == 0
    out, err = capsys.readouterr()
    projected = projections[-1][0]
    assert f"note: klotski builds about {projected:,} ops (" in err
    seconds = projected * run_size.SECONDS_PER_OP_WITH_FILES  # (--out: the figures with files)
    assert f"about {seconds:.0f} s and " in err and " of memory on this machine as loaded now" in err, err


def test_a_sweep_records_too_large_and_tries_it_again_on_a_rerun(projections, monkeypatch, tmp_path):
    """Status `too-large` (this machine, not the simulated one: not `refused`, not `error`), the
    other configuration run; a rerun with room runs it."""
    spec = parse_spec(
        {
            "name": "t",
            "models": ["tiny-mixtral"],
            "policies": ["klotski"],
            "batch_sizes": [2],
            "num_batches": [2],
            "prompt_lens": [8],
            "gen_lens": [3, 60],
            "routings": ["calibrated"],
        }
    )
    monkeypatch.setattr(run_size, "resident_bytes", lambda: 0)
    monkeypatch.setattr(run_size, "BYTES_PER_OP", 10**9)  # 1 GB an op: 3 steps fit in 900 GB, 60 do not
    monkeypatch.setattr(run_size, "available_memory_bytes", lambda: 900 * 10**9)
    df = run_sweep(spec, tmp_path, progress=False).sort_values("gen_len")
    assert list(df["status"]) == ["ok", "too-large"]
    assert df["error"].iloc[1].startswith("klotski would build about ")
    monkeypatch.setattr(run_size, "available_memory_bytes", lambda: None)
    df = run_sweep(spec, tmp_path, progress=False).sort_values("gen_len")
    assert list(df["status"]) == ["ok", "ok"]


def test_available_memory_is_the_least_of_meminfo_and_every_cgroup_levels_room(monkeypatch, tmp_path):
    """MemAvailable, and the room of this process's memory cgroup and of each of its ancestors (v2
    and v1), a folder that is not there skipped; None when nothing can be read."""
    meminfo, own = tmp_path / "meminfo", tmp_path / "cgroup"
    meminfo.write_text("MemTotal:       24000000 kB\nMemFree:         1000 kB\nMemAvailable:    2000000 kB\n")
    monkeypatch.setattr(machine, "_MEMINFO", meminfo)
    monkeypatch.setattr(machine, "_PROC_CGROUP", own)
    monkeypatch.setattr(machine, "_CGROUP_ROOT", tmp_path / "fs")
    assert machine.available_memory_bytes() == 2_000_000 * 1024  # no cgroup file at all
    own.write_text("0::/slice/job/step\n")
    job, step = tmp_path / "fs" / "slice" / "job", tmp_path / "fs" / "slice" / "job" / "step"
    step.mkdir(parents=True)
    (step / "memory.max").write_text("max\n")
    (step / "memory.current").write_text("500\n")
    assert machine.available_memory_bytes() == 2_000_000 * 1024  # no limit
    (job / "memory.max").write_text("1000000\n")  # a job's limit, on the parent
    (job / "memory.current").write_text("600\n")
    assert machine.available_memory_bytes() == 1_000_000 - 600
    (step / "memory.max").write_text("2000000\n")  # a looser one below it: the parent's still binds
    assert machine.available_memory_bytes() == 1_000_000 - 600
    own.write_text("12:pids:/x\n4:cpu,memory:/gone/away\n")  # v1, its own folder not in this view
    v1 = tmp_path / "fs" / "memory"
    v1.mkdir()
    (v1 / "memory.limit_in_bytes").write_text(f"{(1 << 63) - 4096}\n")  # (v1's "no limit")
    (v1 / "memory.usage_in_bytes").write_text("7\n")
    assert machine.available_memory_bytes() == 2_000_000 * 1024
    (v1 / "memory.limit_in_bytes").write_text("3000\n")
    assert machine.available_memory_bytes() == 3000 - 7
    meminfo.write_text("nothing here\n")
    own.write_text("garbage\n")
    assert machine.available_memory_bytes() is None


def test_optimize_counts_the_configurations_too_large_to_simulate_here(monkeypatch, capsys, tmp_path):
    monkeypatch.setattr(run_size, "available_memory_bytes", lambda: 1_000_000)
    code = main(
        [
            "optimize",
            "--model",
            "small-mixtral",
            "--batch-sizes",
            "2",
            "--prompt-len",
            "16",
            "--gen-len",
            "6",
            "--policies",
            "klotski",
            "--impl",
            "as-published",
            "--expert-dtypes",
            "bf16",
            "--no-progress",
            "--workers",
            "1",
            "--out",
            str(tmp_path / "o"),
        ]
    )
    out, err = capsys.readouterr()
    assert code == 2 and "0 of 1 ran to the end (1 is too large for this machine's memory to simulate)" in out, out
    assert err.count("\n") == 1 and err.startswith(
        "error: no configuration could run (1 tried: 1 too large to "
        "simulate here); the first refused: klotski would build about "
    ), err


def test_worker_processes_share_what_is_available(projections, monkeypatch, tmp_path):
    """Two workers' runs each projected with the whole machine in view could both fit alone and be
    killed together: a sweep's (and compare's) workers each count on a share."""
    spec = parse_spec(
        {
            "name": "t",
            "models": ["tiny-mixtral"],
            "policies": ["klotski"],
            "batch_sizes": [2],
            "num_batches": [2],
            "prompt_lens": [8],
            "gen_lens": [3],
            "seeds": [0, 1],
        }
    )
    monkeypatch.setattr(run_size, "resident_bytes", lambda: 0)
    monkeypatch.setattr(run_size, "BYTES_PER_OP", 10**9)
    monkeypatch.setattr(run_size, "available_memory_bytes", lambda: None)
    built(RunSpec(model="tiny-mixtral", policy="klotski", batch_size=2, num_batches=2, prompt_len=8, gen_len=3))
    ops = projections[-1][0]
    monkeypatch.setattr(run_size, "available_memory_bytes", lambda: int(1.5 * ops * 10**9))  # one run's and a half
    shared = run_sweep(spec, tmp_path / "two", workers=2, progress=False)  # (forked: the patches hold there)
    assert list(shared["status"]) == ["too-large", "too-large"]
    assert "available for the 2 runs in flight (--workers 2; " in shared["error"].iloc[0]
    alone = run_sweep(spec, tmp_path / "one", workers=1, progress=False)  # (after: it keeps a schedule built)
    assert list(alone["status"]) == ["ok", "ok"]
    assert run_size.sharing() == 1  # (this process: not a worker)


def test_compares_workers_share_what_is_available_too(projections, monkeypatch, capsys, tmp_path):
    monkeypatch.setattr(run_size, "resident_bytes", lambda: 0)
    monkeypatch.setattr(run_size, "BYTES_PER_OP", 10**9)
    monkeypatch.setattr(run_size, "available_memory_bytes", lambda: None)
    args = [
        "compare",
        "--model",
        "tiny-mixtral",
        "--batch-size",
        "2",
        "--prompt-len",
        "8",
        "--gen-len",
        "3",
        "--no-png",
        "--out",
        str(tmp_path / "o"),
    ]
    assert main([*args, "--workers", "1"]) == 0
    largest = max(ops for ops, _ in projections)
    monkeypatch.setattr(run_size, "available_memory_bytes", lambda: int(1.5 * largest * 10**9))  # each fits alone
    assert main([*args, "--workers", "1"]) == 0
    capsys.readouterr()
    assert main([*args, "--workers", "2"]) == 2
    out, err = capsys.readouterr()
    assert err.count("\n") == 1 and "available for the 2 runs in flight (--workers 2; " in err, err


def test_a_policys_probes_of_n_are_not_projected_the_run_is(projections, monkeypatch):
    """klotski-hybrid simulates a probe per candidate n (shorter, fewer batches): a refusal or a note
    of one would describe another run than the user's."""
    from klotski_sim.runs.runner import run

    monkeypatch.setattr(run_size, "available_memory_bytes", lambda: None)
    result = run(RunSpec(model="small-mixtral", policy="klotski-hybrid", num_batches=None, prompt_len=32, gen_len=12))
    assert result.probes is not None and len(result.probes.probes) > 1
    ((projected, _),) = projections  # the run's alone
    assert abs(projected / len(result.schedule) - 1) < 0.05


def test_a_compare_stops_starting_runs_once_one_is_refused(monkeypatch, capsys, tmp_path):
    """Its workers went on through every policy queued behind a refused one before the error (the
    first policy refused at once here; the others take a while each). Now none starts after it, and
    the one the other worker had begun is stopped where it is (klotski_sim.runs.runner.worker_pool)."""
    from klotski_sim.runs import runner

    seen = tmp_path / "projected"
    project, run_planned = run_size.RunSizeWatch._project, runner.run_planned

    def spy(self, ops_built):
        with seen.open("a") as f:  # (from the worker processes)
            f.write(f"{self.policy}\n")
        project(self, ops_built)

    def refusing_the_first(plan, *args, **kwargs):
        if plan.spec.policy == "single-batch":
            raise MachineRefusal("single-batch would build about ... ops")
        return run_planned(plan, *args, **kwargs)

    monkeypatch.setattr(run_size.RunSizeWatch, "_project", spy)
    monkeypatch.setattr(runner, "run_planned", refusing_the_first)
    monkeypatch.setattr(run_size, "available_memory_bytes", lambda: None)
    code = main(
        [
            "compare",
            "--model",
            "small-mixtral",
            "--gen-len",
            "160",
            "--no-png",
            "--workers",
            "2",
            "--out",
            str(tmp_path / "o"),
        ]
    )
    out, err = capsys.readouterr()
    assert code == 2 and err == "error: single-batch would build about ... ops\n", err
    ran = seen.read_text().split() if seen.exists() else []
    assert ran in ([], ["multi-batch"]), ran  # of the 5 others: at most the one the other worker had begun


def test_a_refused_run_leaves_no_output_folder_it_made(projections, monkeypatch, capsys, tmp_path):
    monkeypatch.setattr(run_size, "available_memory_bytes", lambda: 1)
    args = ["simulate", "--model", "small-mixtral", "--policy", "klotski", "--gen-len", "6"]
    assert main([*args, "--out", str(tmp_path / "new" / "deeper")]) == 2
    assert not (tmp_path / "new").exists()
    (tmp_path / "mine").mkdir()
    assert main([*args, "--out", str(tmp_path / "mine" / "deeper")]) == 2
    assert (tmp_path / "mine").is_dir() and not (tmp_path / "mine" / "deeper").exists()  # (not made by it: kept)
    assert (
        main(
            [
                "compare",
                "--model",
                "small-mixtral",
                "--gen-len",
                "6",
                "--no-png",
                "--workers",
                "1",
                "--out",
                str(tmp_path / "c"),
            ]
        )
        == 2
    )
    assert not (tmp_path / "c").exists()


def test_a_sweeps_workers_share_only_among_the_runs_left(projections, monkeypatch, tmp_path):
    """One configuration left on 4 workers is one run in flight, not four."""
    spec = parse_spec(
        {
            "name": "t",
            "models": ["tiny-mixtral"],
            "policies": ["klotski"],
            "batch_sizes": [2],
            "num_batches": [2],
            "prompt_lens": [8],
            "gen_lens": [3],
        }
    )
    monkeypatch.setattr(run_size, "resident_bytes", lambda: 0)
    monkeypatch.setattr(run_size, "BYTES_PER_OP", 10**9)
    monkeypatch.setattr(run_size, "available_memory_bytes", lambda: None)
    built(RunSpec(model="tiny-mixtral", policy="klotski", batch_size=2, num_batches=2, prompt_len=8, gen_len=3))
    ops = projections[-1][0]
    monkeypatch.setattr(run_size, "available_memory_bytes", lambda: int(1.5 * ops * 10**9))
    df = run_sweep(spec, tmp_path, workers=4, progress=False)
    assert list(df["status"]) == ["ok"], df["error"].tolist()
