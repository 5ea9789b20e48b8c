"""End to end, as a user runs it."""

import gzip
import json
import multiprocessing
import os
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from klotski_sim.workload.trace import Trace

from .conftest import overriding, run_cli

SMALL = ["--num-batches", "1", "--prompt-len", "16", "--gen-len", "3", "--batch-size", "4"]


def test_simulate_writes_every_file(tmp_path):
    rc, out, err = run_cli("simulate", *SMALL, "--out", str(tmp_path))
    assert rc == 0, err
    assert "throughput" in out and "bubbles" in out
    for name in ("summary.json", "timeline.parquet", "timeline.csv", "trace.json.gz", "timeline.png", "schedule.json"):
        assert (tmp_path / name).stat().st_size > 0, name
    trace = json.loads(gzip.decompress((tmp_path / "trace.json.gz").read_bytes()))
    assert any(e["ph"] == "X" for e in trace["traceEvents"])
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["model"] == "mixtral-8x7b" and summary["hardware"] == "rtx3090" and summary["status"] == "ok"


def test_models_and_profiles_list_presets():
    rc, out, _ = run_cli("models")
    assert rc == 0 and "mixtral-8x7b" in out and "352.3" in out
    rc, out, _ = run_cli("profiles")
    assert rc == 0 and "rtx3090" in out and "h200" in out


def test_bad_input_is_one_line_error(tmp_path):
    rc, _, err = run_cli("simulate", "--hardware", "nope")
    assert rc == 2 and err.startswith("error: unknown hardware profile") and "Traceback" not in err
    bad = tmp_path / "p.yaml"
    bad.write_text("name: x\ngpu: {}\n")
    rc, _, err = run_cli("simulate", "--hardware", str(bad))
    assert rc == 2 and "gpu.name" in err and "Traceback" not in err
    rc, _, err = run_cli("simulate", "--batch-size", "0")
    assert rc == 2 and "positive integer" in err
    rc, _, err = run_cli("simulate", *SMALL, "--set", "links.pcie_h2d.bandwidth=-1")
    assert rc == 2 and "links.pcie_h2d.bandwidth: Value error, -1 per second is below 1e+06" in err
    assert err.startswith("error: --set: invalid hardware profile: ")  # (it said "overrides:", no flag of ours)
    rc, _, err = run_cli("simulate", *SMALL, "--set", "links.pcie_h2d.bandwith=1")
    assert rc == 2 and err == "error: --set: 'links.pcie_h2d.bandwith' is not a profile field\n"


def test_trace_stats_names_the_file_of_a_token_set_it_does_not_hold(tmp_path):
    """`--tokens generated` of a trace of prompts alone said `error: the trace holds no generated tokens`,
    naming neither the file nor the flag."""
    path = tmp_path / "t.npz"
    assert (
        run_cli(
            "trace",
            "synth",
            "--model",
            "tiny-mixtral",
            "--sequences",
            "2",
            "--prompt-len",
            "4",
            "--gen-len",
            "2",
            "--out",
            str(path),
        )[0]
        == 0
    )
    trace = Trace.load(path)
    prompts_only = tmp_path / "prompts.npz"
    Trace(trace.experts, trace.seq_offsets, np.diff(trace.seq_offsets).astype(np.int32), trace.meta).save(prompts_only)
    rc, out, err = run_cli("trace", "stats", str(prompts_only), "--tokens", "generated")
    assert (rc, out, err) == (
        2,
        "",
        f"error: {prompts_only}: --tokens generated: the trace holds no generated tokens\n",
    )
    assert run_cli("trace", "stats", str(prompts_only), "--tokens", "prompt")[0] == 0


def test_a_run_stopped_in_its_prefill_or_of_one_token_has_no_decode_phase_and_no_efficiency(tmp_path):
    """A Klotski run out of GPU memory at its first layer printed `prefill 0.004 s + decode 0.013 s`
    (the tail of a copy of the prefill), `efficiency 100.0%` and, in compare, `100.0%`; a run of one
    generated token `0.000 tok/s decode only` and a `0.0 ms` decode step."""
    oom = (
        "--model",
        "mixtral-8x7b:1",
        "--batch-size",
        "2",
        "--num-batches",
        "2",
        "--prompt-len",
        "8",
        "--gen-len",
        "3",
        "--set",
        "gpu.memory_bytes=2e9",
        "--set",
        "gpu.reserved_bytes=1e9",
    )
    rc, out, err = run_cli("simulate", *oom, "--policy", "klotski", "--out", str(tmp_path / "o"))
    summary = json.loads((tmp_path / "o" / "summary.json").read_text())
    assert rc == 3 and summary["status"] == "oom" and summary["decode_s"] == 0.0, out
    assert "(until it stopped: prefill 0.017 s + decode 0.000 s; a batch's prefill" in out
    assert "no decode step)" in out
    assert "throughput  - (the run did not finish)" in out and "efficiency - (the run did not finish)" in out
    bound_line = out.split("\nbound")[1].split("\n")[0]
    assert "ops 138 in the schedule (the run stopped before them all)" in out and "%" not in bound_line
    rc, out, err = run_cli("compare", *oom, "--policies", "klotski", "--no-png", "--out", str(tmp_path / "c"))
    row = next(line for line in out.splitlines() if line.startswith("klotski "))
    assert row.split()[3:6] == ["oom", "-", "-"] and row.split()[11] == "-", row  # (tok/s, decode, efficiency)
    rc, out, err = run_cli("simulate", *overriding(SMALL, "--gen-len", "1"), "--out", str(tmp_path / "g1"))
    summary = json.loads((tmp_path / "g1" / "summary.json").read_text())
    assert rc == 0 and summary["decode_s"] == 0.0 and summary["throughput_tok_s"] > 0, out
    assert "no decode throughput: no decode step" in out and "no decode step)" in out and "0.0 ms" not in out


def test_oom_is_reported_with_exit_3():
    rc, out, err = run_cli("simulate", *SMALL, "--set", "gpu.memory_bytes=2e9")
    assert rc == 3 and "out of GPU memory" in out and "Traceback" not in err


def test_trace_synth_stats_and_simulate_replay(tmp_path):
    path = tmp_path / "t.npz"
    rc, out, err = run_cli(
        "trace", "synth", "--sequences", "24", "--prompt-len", "16", "--gen-len", "4", "--out", str(path)
    )
    assert rc == 0, err
    rc, out, err = run_cli("trace", "stats", str(path), "--csv", str(tmp_path / "s.csv"))
    assert rc == 0 and "stick_top1" in out and "mi_next_bits" in out and (tmp_path / "s.csv").exists()
    rc, out, err = run_cli("simulate", "--trace", str(path), *SMALL)
    assert rc == 0, err
    # 24 sequences - 8 warm-up = 16 < 4 x 4 + ... needs wrap for 5 batches
    rc, out, err = run_cli("simulate", "--trace", str(path), *overriding(SMALL, "--num-batches", "5"))
    assert rc == 2 and "--wrap" in err
    rc, out, err = run_cli("simulate", "--trace", str(path), *overriding(SMALL, "--num-batches", "5"), "--wrap")
    assert rc == 0, err


def test_shipped_recorded_trace_replays():
    rc, out, err = run_cli(
        "simulate",
        "--model",
        "tiny-mixtral",
        "--trace",
        "traces/tiny-mixtral-recorded.npz",
        "--prompt-len",
        "64",
        "--gen-len",
        "16",
        "--batch-size",
        "2",
        "--num-batches",
        "2",
    )
    assert rc == 0, err


def test_trace_errors_are_one_line(tmp_path):
    bad = tmp_path / "bad.npz"
    bad.write_bytes(b"garbage")
    rc, _, err = run_cli("simulate", "--trace", str(bad))
    assert rc == 2 and "truncated or corrupt" in err and "Traceback" not in err
    rc, _, err = run_cli("simulate", "--model", "olmoe-1b-7b", "--trace", "traces/tiny-mixtral-recorded.npz")
    assert rc == 2 and "has another shape than model" in err
    rc, _, err = run_cli("trace", "synth", "--routing", "bimodal", "--out", str(tmp_path / "x.npz"))
    assert rc == 2 and "unknown routing" in err


def test_trace_import_cli(tmp_path):
    lines = [
        json.dumps({"seq_id": 0, "token_idx": t, "layer": layer, "experts": [t % 4, (t + 1) % 4]})
        for t in range(6)
        for layer in range(2)
        if (t, layer) != (4, 1)
    ]
    (tmp_path / "log.jsonl").write_text("\n".join(lines))
    rc, out, err = run_cli("trace", "import", str(tmp_path / "log.jsonl"), "--model", "tiny-mixtral")
    assert rc == 0, err
    assert "missing (token, layer)" in err and (tmp_path / "log.npz").exists()
    rc, out, err = run_cli("trace", "import", str(tmp_path / "log.jsonl"), "--model", "olmoe-1b-7b")
    assert rc == 2 and "the trace has another shape than model 'olmoe-1b-7b' (trace vs model: top-2 vs top-8; " in err
    # 50 sequences with a hole each and ids of 4000 characters: at most 40 warnings and a count, ids cut short
    many = [
        json.dumps({"seq_id": f"{k:02d}" + "x" * 4000, "token_idx": t, "layer": layer, "experts": [0, 1]})
        for k in range(50)
        for t in range(3)
        for layer in range(2)
        if (t, layer) != (2, 1)
    ]
    (tmp_path / "many.jsonl").write_text("\n".join(many))
    rc, out, err = run_cli("trace", "import", str(tmp_path / "many.jsonl"), "--out", str(tmp_path / "many.npz"))
    warnings = err.splitlines()
    assert rc == 0 and len(warnings) == 41 and warnings[-1] == "warning: ... and 10 more problems like these"
    assert max(map(len, warnings)) < 300 and "'00xxxx" in warnings[0] and "50 problem(s) reported" in out, err


def test_compare_both_presets_and_the_memory_check(tmp_path):
    rc, out, err = run_cli(
        "compare",
        "--prompt-len",
        "32",
        "--gen-len",
        "3",
        "--batch-size",
        "4",
        "--policies",
        "klotski,flexgen",
        "--impl",
        "both",
        "--no-png",
        "--out",
        str(tmp_path),
    )
    assert rc == 0, err
    assert "as-published" in out and "ideal" in out and "left on the table" in out
    assert not list(tmp_path.glob("trace_*"))  # traces are opt-in
    rows = json.loads((tmp_path / "compare.json").read_text())
    assert {(r["policy"], r["impl"]) for r in rows} == {
        (p, i) for p in ("klotski", "flexgen") for i in ("as-published", "ideal")
    }
    for r in rows:
        assert r["decode_throughput_tok_s"] > r["throughput_tok_s"] > 0  # prefill excluded from decode
    # an impossible configuration is refused by the memory check, with the numbers, before anything is built
    rc, out, err = run_cli(
        "simulate",
        "--model",
        "mixtral-8x22b",
        "--batch-size",
        "64",
        "--num-batches",
        "16",
        "--prompt-len",
        "4096",
        "--gen-len",
        "8",
        "--policy",
        "klotski",
    )
    assert rc == 3 and "memory check (nothing built)" in out and "activations" in out and "Traceback" not in err
    # ... and with --out it writes what there is (it once crashed on the routing it never built)
    rc, out, err = run_cli(
        "simulate",
        "--model",
        "mixtral-8x22b",
        "--batch-size",
        "64",
        "--num-batches",
        "16",
        "--prompt-len",
        "4096",
        "--gen-len",
        "8",
        "--policy",
        "klotski",
        "--no-png",
        "--out",
        str(tmp_path / "refused"),
    )
    assert rc == 3 and "Traceback" not in err and "routing.npz" not in out, err
    summary = json.loads((tmp_path / "refused" / "summary.json").read_text())
    assert summary["status"] == "oom" and summary["num_ops"] == 0


def test_compare_in_worker_processes_gives_the_serial_results(tmp_path):
    """compare runs its policies in parallel processes: the rows, traces and table are the serial run's."""
    args = (
        "compare",
        "--model",
        "mixtral-8x7b:4",
        "--prompt-len",
        "32",
        "--gen-len",
        "3",
        "--batch-size",
        "4",
        "--policies",
        "single-batch,klotski,flexgen",
        "--impl",
        "both",
        "--no-png",
        "--traces",
    )
    outputs = {}
    for workers in (1, 3):
        out_dir = tmp_path / str(workers)
        rc, out, err = run_cli(*args, "--workers", str(workers), "--out", str(out_dir))
        assert rc == 0, err
        traces = {f.name: gzip.decompress(f.read_bytes()) for f in sorted(out_dir.glob("trace_*.json.gz"))}
        outputs[workers] = (out.replace(str(out_dir), "OUT"), (out_dir / "compare.json").read_text(), traces)
    assert len(outputs[1][2]) == 6 and outputs[1] == outputs[3]


@pytest.mark.skipif("fork" not in multiprocessing.get_all_start_methods(), reason="worker processes need fork")
@pytest.mark.filterwarnings("error::pytest.PytestUnhandledThreadExceptionWarning")  # (an error that escaped)
def test_what_runs_meanwhile_runs_beside_the_workers_and_its_errors_are_ignored(capsys):
    """run_each's `meanwhile` (compare imports pandas and the plotting library there) runs in a
    thread of the main process while the workers run; what it raises is neither printed nor changes
    the results."""
    import threading

    from klotski_sim.runs import runner

    spec = runner.RunSpec(policy="klotski", num_batches=2, batch_size=2, prompt_len=8, gen_len=2)
    prep = runner.prepare(spec)
    ran_in = []

    def meanwhile():
        ran_in.append(threading.current_thread() is not threading.main_thread())
        raise ImportError("no plotting library here")

    alone = runner.run_each([spec, spec], prep, workers=1, keep=())
    beside = runner.run_each([spec, spec], prep, workers=2, keep=(), meanwhile=meanwhile)
    assert ran_in == [True] and "plotting" not in capsys.readouterr().err
    assert [tl.summary() for tl in beside] == [tl.summary() for tl in alone]


def _finishes_and_leaves_a_mark(spec, trace_path=None, prep=None, keep=None, plan=None):
    """A stand-in for a run: it takes a moment, then leaves a file saying it finished."""
    import time

    time.sleep(0.2)
    Path(os.environ["KLOTSKI_TEST_MARKS"], f"{spec.seed}").write_text("")
    return spec.seed


@pytest.mark.skipif("fork" not in multiprocessing.get_all_start_methods(), reason="worker processes need fork")
def test_what_runs_meanwhile_waits_for_a_core_that_no_worker_needs(tmp_path, monkeypatch):
    """Started with the workers, compare's import of the plotting library took 0.15-0.25 s from the
    slowest of them on 2 cores; it starts once fewer runs are left than workers (here 3 runs on 2
    workers: after 2 have finished), and the results keep their order."""
    from klotski_sim.runs import runner

    monkeypatch.setenv("KLOTSKI_TEST_MARKS", str(tmp_path))
    monkeypatch.setattr(runner, "_timeline_of", _finishes_and_leaves_a_mark)
    spec = runner.RunSpec(policy="klotski", num_batches=2, batch_size=2, prompt_len=8, gen_len=2)
    finished_before = []
    results = runner.run_each(
        [replace(spec, seed=k) for k in range(3)],
        None,
        workers=2,
        meanwhile=lambda: finished_before.append(len(list(tmp_path.iterdir()))),
    )
    assert results == [0, 1, 2] and finished_before and finished_before[0] >= 2


def _worker_dies(*args, **kwargs):
    os._exit(3)


def test_a_worker_that_dies_is_one_clear_error(monkeypatch):
    from klotski_sim.runs import runner
    from klotski_sim.util.errors import UsageError

    spec = runner.RunSpec(policy="klotski", num_batches=2, batch_size=2, prompt_len=8, gen_len=2)
    monkeypatch.setattr(runner, "_timeline_of", _worker_dies)
    with pytest.raises(UsageError, match="a worker process died before it finished.*--workers 1"):
        runner.run_each([spec, spec], runner.prepare(spec), workers=2)


def test_compare_prints_the_table_and_writes_figures(tmp_path):
    rc, out, err = run_cli(
        "compare", "--model", "mixtral-8x7b:4", "--prompt-len", "32", "--gen-len", "3", "--batch-size", "4",
        "--traces", "--out", str(tmp_path),
    )  # fmt: skip
    assert rc == 0, err
    for policy in ("single-batch", "multi-batch", "hot-prefetch", "klotski", "klotski-oracle", "flexgen"):
        assert policy in out
        events = json.loads(gzip.decompress((tmp_path / f"trace_{policy}.json.gz").read_bytes()))["traceEvents"]
        assert any(e.get("cat") == "expert" for e in events)
    assert "planner: n =" in out and "xFlexGen" in out
    for name in ("compare.png", "compare.csv", "compare.json", "plan.txt"):
        assert (tmp_path / name).stat().st_size > 0
    rows = json.loads((tmp_path / "compare.json").read_text())
    assert {r["policy"] for r in rows} >= {"klotski", "flexgen"} and all(r["status"] == "ok" for r in rows)


def test_plan_prints_every_term():
    rc, out, err = run_cli("plan", "--batch-size", "16")
    assert rc == 0, err
    for term in ("t_cA", "t_cG", "t_IO_G", "t_IO_E", "t_IO_A", "t_c_hotE", "sum_Q_t_cE", "(4)", "(7)", "=> n ="):
        assert term in out


def test_flags_are_never_abbreviated():
    # `plan --policy X` once silently meant `--policy-file X` (an abbreviation), and X was never loaded
    # (plan has a --policy of its own since; compare has --policies and --policy-file, no --policy)
    rc, out, err = run_cli("compare", "--policy", "mine.py")
    assert rc == 2 and err.count("\n") == 1 and "unrecognized arguments: --policy mine.py" in err
    rc, out, err = run_cli("plan", "--policy-fi", "mine.py")
    assert rc == 2 and err.count("\n") == 1 and "unrecognized arguments: --policy-fi mine.py" in err


def test_a_single_value_flag_given_twice_is_refused_in_one_line():
    """argparse keeps the last of two values silently; a value typed early in a long line was lost.
    Flags declared to repeat (advise's --gpu and --cpu, --set) still add up, and a parser used again in
    one process forgets the last command line's flags."""
    rc, out, err = run_cli("plan", "--batch-size", "16", "--batch-size=32")
    assert rc == 2 and err.count("\n") == 1, err
    assert "argument --batch-size: given twice (--batch-size 16, then --batch-size 32); give it once" in err
    rc, out, err = run_cli("compare", "--policy-file", "a.py", "--policies", "klotski", "--policies", "flexgen")
    assert rc == 2 and "given twice (--policies klotski, then --policies flexgen)" in err
    for _ in range(2):
        rc, out, err = run_cli("plan", "--batch-size", "16")
        assert rc == 0, err
    rc, out, err = run_cli("advise", "--model", "qwen3-30b-a3b@Q4_K_M", "--gpu", "rtx4090", "--gpu", "rtx2080",
                           "--cpu", "ryzen-9-7950x", "--cpu", "i9-10900x", "--ram", "64")  # fmt: skip
    assert rc == 0 and "RTX 2080" in out and "i9-10900x" in out, err


def test_simulate_with_planner_batches(tmp_path):
    rc, out, err = run_cli(
        "simulate",
        "--policy",
        "klotski",
        "--num-batches",
        "auto",
        "--prompt-len",
        "16",
        "--gen-len",
        "3",
        "--out",
        str(tmp_path),
    )
    assert rc == 0, err
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["num_batches"] > 1 and "prefetch" in summary["extra"]


def test_policy_options_from_the_cli(tmp_path):
    rc, out, err = run_cli(
        "simulate",
        "--policy",
        "flexgen",
        *overriding(SMALL, "--num-batches", "2"),
        "--option",
        "overlap=model",
        "--out",
        str(tmp_path),
        "--no-png",
    )
    assert rc == 0, err
    assert json.loads((tmp_path / "schedule.json").read_text())["meta"]["overlap"] == "model"
    rc, _, err = run_cli("simulate", "--policy", "klotski", *SMALL, "--option", "overlap=model")
    assert rc == 2 and "has no option" in err


def test_resident_layers_takes_a_count_or_fill_and_nothing_else(tmp_path):
    code, out, err = run_cli("simulate", "--resident-layers", "most", "--out", str(tmp_path / "a"))
    assert code == 2 and err.count("\n") == 1 and "--resident-layers" in err and "fill" in err, err
    code, out, err = run_cli(
        "simulate", "--model", "tiny-mixtral", "--resident-layers", "3", "--out", str(tmp_path / "b")
    )
    assert code == 2 and err.count("\n") == 1 and "give 0..2" in err, err
    code, out, err = run_cli(
        "simulate",
        "--model",
        "mixtral-8x7b:12",
        "--policy",
        "klotski",
        "--batch-size",
        "2",
        "--num-batches",
        "2",
        "--prompt-len",
        "16",
        "--gen-len",
        "3",
        "--resident-layers",
        "fill",
        "--no-png",
        "--out",
        str(tmp_path / "c"),
    )
    assert code == 0, err
    placement = json.loads((tmp_path / "c" / "summary.json").read_text())["extra"]["placement"]
    assert 0 < placement["resident_layers"] < 12


def test_the_cli_starts_without_pandas_until_a_command_needs_it():
    """pandas is 0.23 s of the CLI's start: `--help`, `plan` and a refused argument never read it
    (klotski_sim/util/lazy.py); a summary does, and gets the real module."""
    import subprocess
    import sys

    probe = (
        "import sys, klotski_sim.cli.main as cli\n"
        "assert 'pandas' not in sys.modules, 'imported at start'\n"
        "cli.main(['plan'])\n"
        "assert 'pandas' not in sys.modules, 'imported by plan'\n"
        "from klotski_sim.util.lazy import pd\n"
        "import pandas\n"
        "assert pd.DataFrame is pandas.DataFrame\n"
    )
    proc = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]


def test_the_makespans_parts_printed_add_up_to_it():
    """The summary printed a batch's mean prefill latency beside the decode time, inside the
    makespan's parentheses: the two "parts" summed past the makespan (0.092 + 0.184 > 0.245 s here)."""
    import re

    rc, out, err = run_cli(
        "simulate",
        "--model",
        "small-mixtral",
        "--hardware",
        "a5000",
        "--policy",
        "single-batch",
        "--impl",
        "ideal",
        "--batch-size",
        "1",
        "--prompt-len",
        "4",
        "--gen-len",
        "4",
        "--num-batches",
        "2",
    )
    assert rc == 0, err
    found = re.search(
        r"makespan +([0-9.]+) s +\(prefill ([0-9.]+) s \+ decode ([0-9.]+) s; a batch's prefill ([0-9.]+)", out
    )
    assert found, out
    makespan, prefill, decode, latency = map(float, found.groups())
    assert abs(prefill + decode - makespan) <= 0.0015 and latency > prefill  # (not a part: here larger than it)


def test_compare_sets_a_compared_policys_option_and_refuses_others_in_one_line(tmp_path):
    """`compare --option POLICY.KEY=VALUE` (as serve's): the option reaches that policy's runs under both
    presets, and an option of a policy not compared, an unknown key or a clash with --flexgen-overlap is
    one line, before anything runs."""
    import json

    tiny = ["--model", "tiny-mixtral", "--prompt-len", "8", "--gen-len", "3", "--batch-size", "2", "--num-batches", "2"]
    base = ["compare", *tiny, "--policies", "klotski,flexgen", "--impl", "both", "--no-png", "--workers", "1"]
    code, out, err = run_cli(*base, "--option", "klotski.sync=per-expert", "--out", str(tmp_path / "a"))
    assert code == 0, err
    code, out, err = run_cli(*base, "--out", str(tmp_path / "b"))
    assert code == 0, err
    rows = {
        folder: {
            (r["policy"], r["impl_preset"]): r for r in json.loads((tmp_path / folder / "compare.json").read_text())
        }
        for folder in "ab"
    }
    for impl in ("as-published", "ideal"):
        assert rows["a"][("flexgen", impl)]["makespan_s"] == rows["b"][("flexgen", impl)]["makespan_s"]
    assert rows["a"][("klotski", "ideal")]["makespan_s"] != rows["b"][("klotski", "ideal")]["makespan_s"]
    for option, says in (
        ("fiddler.x=1", "--option fiddler.x: name a policy being compared as POLICY.KEY (klotski, flexgen)"),
        ("klotski.nope=1", "policy 'klotski' has no option(s) ['nope']"),
    ):
        code, out, err = run_cli(*base, "--option", option, "--out", str(tmp_path / "c"))
        assert code == 2 and says in err and len(err.strip().splitlines()) == 1, err
    code, out, err = run_cli(
        *base, "--option", "flexgen.overlap=model", "--flexgen-overlap", "code", "--out", str(tmp_path / "c")
    )
    assert code == 2 and "both set flexgen's overlap" in err, err
