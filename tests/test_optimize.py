"""`klotski-sim optimize`: the Pareto front, the latency cap, the budget, and a winner that reproduces."""

import re

import pandas as pd
import pytest
from hypothesis import given
from hypothesis import strategies as st

from klotski_sim.runs.optimize import Search, pareto_front, winner

from .conftest import run_cli

SMALL = (
    "--model",
    "tiny-mixtral",
    "--batch-sizes",
    "1,4",
    "--policies",
    "klotski,fiddler,single-batch",
    "--expert-dtypes",
    "bf16,int4",
    "--kv",
    "auto",
    "--prompt-len",
    "16",
    "--gen-len",
    "4",
    "--no-progress",
    "--workers",
    "1",
)


def _throughput(text: str) -> float:
    return float(re.search(r"throughput\s+([\d.]+) generated tok/s", text).group(1))


def test_the_winner_reproduces_through_simulate(tmp_path):
    code, out, err = run_cli("optimize", *SMALL, "--out", str(tmp_path / "opt"))
    assert code == 0, err
    best = float(re.search(r"winner: ([\d.]+) tok/s", out).group(1))
    command = out.strip().splitlines()[-1].split()
    assert command[:2] == ["klotski-sim", "simulate"]
    code, sim_out, err = run_cli(*command[1:], "--no-png")
    assert code == 0, err
    assert _throughput(sim_out) == pytest.approx(best, abs=0.06)  # both printed to one decimal or more
    df = pd.read_parquet(tmp_path / "opt" / "results.parquet")
    assert len(df) == 2 * 3 * 2 * 2  # batch sizes x policies x dtypes x presets
    assert best == pytest.approx(df[df["status"] == "ok"]["m.throughput_tok_s"].max(), abs=0.06)


def test_the_latency_cap_is_honoured_and_an_impossible_cap_is_one_line(tmp_path):
    code, out, err = run_cli("optimize", *SMALL, "--out", str(tmp_path / "opt"))
    df = pd.read_parquet(tmp_path / "opt" / "results.parquet")
    ok = df[df["status"] == "ok"]
    cap = float(ok["m.decode_step_s"].median())
    code, out, err = run_cli("optimize", *SMALL, "--out", str(tmp_path / "opt"), "--max-token-latency", str(cap))
    assert code == 0, err
    latency = float(re.search(r"tok/s, ([\d.]+) s per token", out).group(1))
    assert latency <= cap + 5e-4
    code, out, err = run_cli("optimize", *SMALL, "--out", str(tmp_path / "opt"), "--max-token-latency", "1e-9")
    assert code == 2 and err.count("\n") == 1 and "--max-token-latency" in err


def test_above_the_budget_a_seeded_sample_is_evaluated_and_said(tmp_path):
    code, out, err = run_cli("optimize", *SMALL, "--budget", "5", "--out", str(tmp_path / "opt"))
    assert code == 0, err
    assert "a seeded sample of 5" in out
    assert len(pd.read_parquet(tmp_path / "opt" / "results.parquet")) == 5
    ids_a, size = Search("tiny-mixtral", "rtx3090", budget=5, batch_sizes=(1, 4)).selected_ids(
        Search("tiny-mixtral", "rtx3090", batch_sizes=(1, 4)).spec()
    )
    assert len(ids_a) == 5 and size > 5


@pytest.mark.parametrize(
    "args, message",
    [
        (("--expert-dtypes", "int5"), "int8, int4"),
        (("--batch-sizes", "0,4"), "--batch-sizes"),
        (("--batch-sizes", "4,4"), "--batch-sizes: 4 is given twice"),
        (("--num-batches", "auto,8,auto"), "--num-batches: auto is given twice"),
        (("--expert-dtypes", "int4,int4"), "--expert-dtypes: 'int4' is given"),
        (("--kv", "gpu,gpu"), "argument --kv: 'gpu' is given twice"),
        # (an empty list was said to be "  is given twice")
        (("--expert-dtypes", ","), "--expert-dtypes: expected comma-separated"),
        (("--cache-sizes", "0,0"), "--cache-sizes: 0 is given twice"),
        (("--resident-layers", "auto,auto"), "--resident-layers: auto is given"),
        (("--policies", "nope"), "unknown policy"),
    ],
)
def test_bad_search_settings_are_one_line(tmp_path, args, message):
    code, out, err = run_cli("optimize", "--model", "tiny-mixtral", *args, "--out", str(tmp_path / "o"))
    assert code == 2 and err.count("\n") == 1 and message in err, err


def test_configurations_host_memory_cannot_hold_are_counted_apart_from_failures(tmp_path):
    """Refused by the profile's host memory (16 batches of 8 x 8k tokens' KV cache there, more than
    the L4 host's 192 GB with every weight on disk): not "failed", and the one line says why with
    the numbers."""
    code, out, err = run_cli(
        "optimize",
        "--model",
        "mixtral-8x22b",
        "--hardware",
        "l4",
        "--batch-sizes",
        "8",
        "--prompt-len",
        "8192",
        "--gen-len",
        "2",
        "--num-batches",
        "16",
        "--kv",
        "cpu",
        "--policies",
        "klotski",
        "--impl",
        "ideal",
        "--expert-dtypes",
        "bf16",
        "--no-progress",
        "--workers",
        "1",
        "--out",
        str(tmp_path / "o"),
    )
    assert code == 2 and "0 of 1 ran to the end (1 does not fit in the profile's host memory or disk)" in out, out
    assert (
        err.count("\n") == 1
        and "no configuration fits (1 tried: 1 not in the profile's host memory or disk); "
        "the first refused: mixtral-8x22b keeps 233.38 GiB in host memory"
        in err
    ), err


def test_configurations_that_kill_their_worker_are_counted_apart_from_gpu_memory(tmp_path):
    """A configuration whose worker process dies (its row `killed`) was counted as one that does not
    fit in GPU memory; with nothing else left, the one line says so."""
    from .test_sweep import DIES

    (tmp_path / "dies.py").write_text(DIES)
    common = (
        "--model",
        "tiny-mixtral",
        "--prompt-len",
        "32",
        "--gen-len",
        "3",
        "--policy-file",
        str(tmp_path / "dies.py"),
        "--batch-sizes",
        "2",
        "--impl",
        "ideal",
        "--expert-dtypes",
        "bf16",
        "--workers",
        "2",
        "--no-progress",
    )
    code, out, err = run_cli("optimize", *common, "--policies", "klotski,dies", "--out", str(tmp_path / "a"))
    assert (
        code == 0
        and "1 of 2 ran to the end (1 ended the worker process that ran it: killed, or out of host memory?)" in out
    ), out + err
    code, out, err = run_cli("optimize", *common, "--policies", "dies", "--out", str(tmp_path / "b"))
    assert (
        code == 2
        and err
        == "error: no configuration could run (1 tried: 1 killed); the first killed: its "
        "worker process died running it on its own (killed, or out of host memory?)\n"
    ), err


@given(st.lists(st.tuples(st.floats(0.1, 100), st.floats(0.001, 10)), min_size=1, max_size=30))
def test_the_front_is_exactly_the_undominated_points(points):
    df = pd.DataFrame({"m.throughput_tok_s": [p[0] for p in points], "m.decode_step_s": [p[1] for p in points]})
    front = pareto_front(df)
    for i, r in df.iterrows():
        dominated = (
            (df["m.throughput_tok_s"] >= r["m.throughput_tok_s"])
            & (df["m.decode_step_s"] <= r["m.decode_step_s"])
            & ((df["m.throughput_tok_s"] > r["m.throughput_tok_s"]) | (df["m.decode_step_s"] < r["m.decode_step_s"]))
        )
        if not dominated.any():  # every undominated point is on the front (or an exact duplicate of one)
            assert (
                (front["m.throughput_tok_s"] == r["m.throughput_tok_s"])
                & (front["m.decode_step_s"] == r["m.decode_step_s"])
            ).any()
    for i, r in front.iterrows():  # and nothing on the front is dominated
        assert not (
            (df["m.throughput_tok_s"] > r["m.throughput_tok_s"]) & (df["m.decode_step_s"] <= r["m.decode_step_s"])
        ).any()
    best = winner(df, None)
    assert best["m.throughput_tok_s"] == df["m.throughput_tok_s"].max()


def test_cache_sizes_and_resident_layers_are_searched_and_the_winner_reproduces(tmp_path):
    args = (
        "optimize",
        "--model",
        "tiny-mixtral",
        "--batch-sizes",
        "2",
        "--policies",
        "single-batch",
        "--expert-dtypes",
        "bf16",
        "--impl",
        "ideal",
        "--cache-sizes",
        "0,4,8",
        "--resident-layers",
        "auto,0",
        "--prompt-len",
        "16",
        "--gen-len",
        "4",
        "--no-progress",
        "--workers",
        "1",
        "--out",
        str(tmp_path / "o"),
    )
    code, out, err = run_cli(*args)
    assert code == 0, err
    df = pd.read_parquet(tmp_path / "o" / "results.parquet")
    assert len(df) == 3 * 2 and set(df["opt.expert_cache"]) == {0, 4, 8}
    best = float(re.search(r"winner: ([\d.]+) tok/s", out).group(1))
    command = out.strip().splitlines()[-1].split()
    code, sim_out, err = run_cli(*command[1:], "--no-png")
    assert code == 0, err
    assert _throughput(sim_out) == pytest.approx(best, abs=0.06)


def test_resident_layers_fill_at_the_planners_n_is_the_planners_placement():
    """`fill` keeps as many whole layers as the memory n batches leave: at the planner's own n it is
    exactly the planner's placement, and one more layer would not fit."""
    from dataclasses import replace

    from klotski_sim.planning.planner import memory_needed
    from klotski_sim.runs.runner import RunSpec, prepare

    kept = []
    for hardware, bs in (("rtx3090", 16), ("h800", 16), ("rtx3090", 64)):  # (the last: n is memory-bound, none kept)
        auto = prepare(RunSpec(hardware=hardware, batch_size=bs, num_batches=None, prompt_len=64, gen_len=4))
        fill = prepare(
            RunSpec(
                hardware=hardware,
                batch_size=bs,
                num_batches=auto.num_batches,
                resident_layers="fill",
                prompt_len=64,
                gen_len=4,
                policy="klotski",
            )
        )
        assert fill.placement == auto.placement
        kept.append(fill.placement.resident_layers)
        more = replace(fill.placement, resident_layers=fill.placement.resident_layers + 1)
        assert memory_needed(fill.model, bs, fill.num_batches, 64, 4, more)["total"] > fill.profile.gpu.usable_bytes
    assert kept[0] > 0 and kept[1] > 0 and kept[2] == 0
    fewer = prepare(RunSpec(num_batches=2, resident_layers="fill", prompt_len=64, gen_len=4, policy="klotski"))
    assert fewer.placement.resident_layers > kept[0]  # fewer batches leave room for more layers


def test_n_is_searched_and_the_winner_at_a_given_n_reproduces(tmp_path):
    args = (
        "optimize",
        "--model",
        "mixtral-8x7b:12",
        "--batch-sizes",
        "2",
        "--policies",
        "klotski,fiddler",
        "--num-batches",
        "auto,2",
        "--expert-dtypes",
        "bf16",
        "--impl",
        "ideal",
        "--prompt-len",
        "16",
        "--gen-len",
        "3",
        "--no-progress",
        "--workers",
        "1",
        "--out",
        str(tmp_path / "o"),
    )
    code, out, err = run_cli(*args)
    assert code == 0, err
    assert "n auto, 2" in out
    df = pd.read_parquet(tmp_path / "o" / "results.parquet")
    # fiddler keeps one batch in flight by definition: it runs at n auto only
    assert sorted(zip(df["policy"], df["num_batches"].astype(str))) == [
        ("fiddler", "auto"),
        ("klotski", "2"),
        ("klotski", "auto"),
    ]
    assert (df["resident_layers"].astype(str) == "fill").all()
    best = float(re.search(r"winner: ([\d.]+) tok/s", out).group(1))
    command = out.strip().splitlines()[-1].split()
    assert "--resident-layers" in command and command[command.index("--resident-layers") + 1] == "fill"
    code, sim_out, err = run_cli(*command[1:], "--no-png")
    assert code == 0, err
    assert _throughput(sim_out) == pytest.approx(best, abs=0.06)


def test_a_one_batch_policy_left_out_of_a_search_over_n_is_said(tmp_path):
    """single-batch runs at n auto only: asked beside klotski at --num-batches 2 it was dropped from
    the grid without a word, the header naming it all the same."""
    code, out, err = run_cli(
        "optimize",
        "--model",
        "tiny-mixtral",
        "--prompt-len",
        "8",
        "--gen-len",
        "3",
        "--batch-sizes",
        "2",
        "--policies",
        "klotski,single-batch",
        "--num-batches",
        "2",
        "--expert-dtypes",
        "bf16",
        "--impl",
        "ideal",
        "--workers",
        "1",
        "--no-progress",
        "--out",
        str(tmp_path / "o"),
    )
    assert code == 0, err
    assert "note: single-batch is not searched: one batch in flight by definition, at n auto only" in out, out
    assert set(pd.read_parquet(tmp_path / "o" / "results.parquet")["policy"]) == {"klotski"}


@pytest.mark.parametrize(
    "args, message",
    [
        (("--policies", "single-batch,fiddler", "--num-batches", "3"), "keep one batch in flight"),
        (
            ("--policies", "single-batch", "--num-batches", "3"),
            "single-batch keeps one batch in flight by definition and runs at n auto only",
        ),
        (("--cache-sizes", "0,9"), "--cache-sizes 9: tiny-mixtral has 8 routed experts"),
        (("--num-batches", "3_0"), "--num-batches: give comma-separated integers"),
        (("--num-batches", "\u0663"), "--num-batches: give comma-separated integers"),
    ],
)
def test_search_settings_that_leave_nothing_or_cannot_run_are_one_line_before_any_run(tmp_path, args, message):
    code, out, err = run_cli(
        "optimize",
        "--model",
        "tiny-mixtral",
        "--prompt-len",
        "8",
        "--gen-len",
        "3",
        "--batch-sizes",
        "2",
        "--workers",
        "1",
        "--no-progress",
        *args,
        "--out",
        str(tmp_path / "o"),
    )
    assert code == 2 and err.count("\n") == 1 and message in err, err
    assert not (tmp_path / "o" / "results.parquet").exists()


def test_the_winner_command_is_shell_quoted():
    from klotski_sim.runs.optimize import simulate_command

    row = {
        "model": "tiny-mixtral",
        "hardware": "/tmp/my prof/hw x.yaml",
        "policy": "klotski",
        "impl": "ideal",
        "batch_size": 2,
        "num_batches": "auto",
        "kv": "auto",
        "prompt_len": 8,
        "gen_len": 3,
    }
    import shlex

    words = shlex.split(simulate_command(row))
    assert words[words.index("--hardware") + 1] == "/tmp/my prof/hw x.yaml"


def test_fill_is_auto_for_optimize_resident_layers(tmp_path):
    code, out, err = run_cli(
        "optimize",
        "--model",
        "tiny-mixtral",
        "--prompt-len",
        "8",
        "--gen-len",
        "3",
        "--batch-sizes",
        "2",
        "--workers",
        "1",
        "--no-progress",
        "--policies",
        "klotski",
        "--impl",
        "ideal",
        "--expert-dtypes",
        "bf16",
        "--resident-layers",
        "fill",
        "--out",
        str(tmp_path / "o"),
    )
    assert code == 0, err
