"""`klotski-runtime` end to end."""

import json
import re
import subprocess
import sys

import pytest

from klotski_sim.core.schedule import Schedule

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from .conftest import ROOT, runtime_in_process, simulate_small  # noqa: E402

run_runtime = runtime_in_process


def runtime_process(*args):
    proc = subprocess.run(
        [sys.executable, "-m", "klotski_runtime.cli", *args], capture_output=True, text=True, cwd=ROOT, timeout=600
    )
    return proc.returncode, proc.stdout, proc.stderr


def test_record_from_tiny_checkpoint(tmp_path):
    rc, _, err = run_runtime("tiny-checkpoint", "--out", str(tmp_path / "ckpt"))
    assert rc == 0, err
    rc, out, err = run_runtime(
        "record",
        "--model-dir",
        str(tmp_path / "ckpt"),
        "--text",
        "traces/sample_text.txt",
        "--max-tokens",
        "40",
        "--gen-len",
        "3",
        "--model-name",
        "tiny-mixtral",
        "--out",
        str(tmp_path / "r.npz"),
    )
    assert rc == 0, err
    assert "12 sequences" in out and (tmp_path / "r.npz").exists()


def test_record_missing_checkpoint_is_one_line(tmp_path):
    rc, _, err = run_runtime(
        "record", "--model-dir", str(tmp_path), "--text", "traces/sample_text.txt", "--out", str(tmp_path / "r.npz")
    )
    assert rc == 2 and "no config.json" in err and "Traceback" not in err


def test_execute_names_the_model_mismatch_and_a_missing_checkpoint_first(tmp_path):
    simulate_small(str(tmp_path / "sim"))
    rc, out, err = run_runtime("execute", str(tmp_path / "sim"), "--model", "mixtral-8x7b")
    assert rc == 2 and "was built for model 'tiny-mixtral'" in err and "GiB" not in err  # not the weights' size
    rc, out, err = run_runtime("execute", str(tmp_path / "sim"), "--checkpoint", str(tmp_path / "nowhere"))
    assert rc == 2 and "no such checkpoint directory" in err
    rc, out, err = run_runtime("record", "--gen-len", "-1", "x")
    assert rc == 2 and "argument --gen-len: expected an integer >= 0, got -1" in err


def test_execute_writes_into_a_folder_inside_the_simulations_and_again(tmp_path):
    """`execute sim --out sim/measured` was refused once `sim/measured` existed ("is a file of sim,
    which this command reads"), so its rerun was; `execute nowhere --out an_existing_folder` said the
    same instead of that the schedule is missing. The simulation's own folder stays refused."""
    simulate_small(str(tmp_path / "sim"))
    for _ in range(2):
        rc, out, err = run_runtime("execute", str(tmp_path / "sim"), "--out", str(tmp_path / "sim" / "measured"))
        assert rc == 0 and (tmp_path / "sim" / "measured" / "summary.json").exists(), err
    rc, out, err = run_runtime("execute", str(tmp_path / "sim"), "--out", str(tmp_path / "sim" / "."))
    assert rc == 2 and "is what this command reads" in err and "the schedule's folder" in err, err
    rc, out, err = run_runtime("execute", str(tmp_path / "nowhere"), "--out", str(tmp_path / "sim" / "measured"))
    assert rc == 2 and err == f"error: {tmp_path / 'nowhere'}: cannot read schedule (No such file or directory)\n"


@pytest.mark.parametrize("model", ["tiny-qwen3-moe", "tiny-olmoe"])
def test_a_tiny_checkpoint_of_another_family_executes_what_simulate_wrote(tmp_path, model):
    rc, out, err = run_runtime("tiny-checkpoint", "--model", model, "--out", str(tmp_path / "ckpt"))
    assert rc == 0 and model in out, err
    simulate_small(str(tmp_path / "sim"), model)
    rc, out, err = run_runtime(
        "execute", str(tmp_path / "sim"), "--checkpoint", str(tmp_path / "ckpt"), "--out", str(tmp_path / "measured")
    )
    assert rc == 0, err
    assert (tmp_path / "measured" / "summary.json").exists()
    other = "tiny-olmoe" if model == "tiny-qwen3-moe" else "tiny-qwen3-moe"
    rc, _, err = run_runtime("tiny-checkpoint", "--model", other, "--out", str(tmp_path / "other"))
    rc, out, err = run_runtime(
        "execute", str(tmp_path / "sim"), "--checkpoint", str(tmp_path / "other"), "--out", str(tmp_path / "m2")
    )
    assert rc == 2 and err.count("\n") == 1 and "does not match model" in err, err


def test_record_refuses_what_it_cannot_read_in_one_line(tmp_path):
    import json
    import shutil

    rc, _, err = run_runtime("tiny-checkpoint", "--model", "tiny-qwen3-moe", "--out", str(tmp_path / "ck"))
    assert rc == 0, err
    args = ("--text", "traces/sample_text.txt", "--max-tokens", "20", "--gen-len", "2")
    bad = tmp_path / "bad"
    shutil.copytree(tmp_path / "ck", bad)
    (bad / "config.json").write_text(json.dumps([1, 2, 3]))
    cases = [
        (("--model-dir", str(bad), "--out", str(tmp_path / "r.npz")), "transformers cannot read it"),
        (
            ("--model-dir", str(tmp_path / "ck"), "--model-name", "tiny-mixtral", "--out", str(tmp_path / "r.npz")),
            "--model-name tiny-mixtral",
        ),
        (("--model-dir", str(tmp_path / "ck"), "--out", str(tmp_path / "nodir" / "r.npz")), "does not exist"),
        (("--model-dir", str(tmp_path / "ck"), "--device", "bogus", "--out", str(tmp_path / "r.npz")), "--device"),
        (("--model-dir", str(tmp_path / "nope"), "--out", str(tmp_path / "r.npz")), "nope: no such folder"),
    ]
    for extra, words in cases:
        rc, _, err = run_runtime("record", *args, *extra)
        errors = [line for line in err.splitlines() if line.startswith("error:")]  # (transformers logs too)
        assert rc == 2 and len(errors) == 1 and words in errors[0] and "Traceback" not in err, (extra, err)


@pytest.mark.parametrize(
    "args,message",
    [
        (("tiny-checkpoint", "--out", "{d}/ckpt", "--seed", "99999999999999999999999"), "a seed from 0 to 2**63 - 1"),
        (("execute", "{d}/run", "--threads", "100000"), "an integer from 1 to 1024"),
        # (more torch threads than cores time-share them: every measured op included its wait for a core)
        (("execute", "{d}/run", "--threads", "1024"), "--threads 1024: this process may use "),
        (("calibrate", "--threads", "1024", "--out", "{d}/p.yaml"), "--threads 1024: this process may use "),
        (("validate", "--threads", "1024", "--out", "{d}/v"), "--threads 1024: this process may use "),
        (
            ("calibrate", "--repeats", "1000000000", "--out", "{d}/p.yaml"),
            "argument --repeats: expected an integer from 1 to 1000",
        ),
        (("validate", "--repeats", "1001", "--out", "{d}/v"), "argument --repeats: expected an integer from 1 to 1000"),
        (("tiny-checkpoint", "--out", "{d}/a_file"), "is a file; a checkpoint is a folder"),
        (("calibrate", "--model", "tiny-mixtral", "--out", "{d}"), "is a folder; give a file name"),
        (
            ("record", "--model-dir", "{d}", "--text", "traces/sample_text.txt", "--out", "{d}/a_file/r.npz"),
            "a_file is not a folder",
        ),
        # silently accepted before: the trace won over --routing, a shape or a policy measured twice, a
        # pageable copy faster than a pinned one, a pageable rate where no link is emulated
        (
            ("validate", "--routing", "uniform", "--trace", "traces/tiny-mixtral-recorded.npz", "--out", "{d}/v"),
            "--routing uniform and --trace traces/tiny-mixtral-recorded.npz: a trace replays its own routing",
        ),
        (
            ("validate", "--policy", "klotski,flexgen,klotski", "--out", "{d}/v"),
            "--policy klotski,flexgen,klotski: 'klotski' is given twice",
        ),
        (("calibrate", "--batch-sizes", "1,2,1", "--out", "{d}/p.yaml"), "argument --batch-sizes: 1 is given twice"),
        (
            ("calibrate", "--prompt-lens", "16,,64", "--out", "{d}/p.yaml"),
            "argument --prompt-lens: expected comma-separated integers, got '16,,64'",
        ),
        pytest.param(
            ("calibrate", "--device", "cuda", "--out", "{d}/p.yaml"),  # (a traceback; execute said it in one line)
            "CUDA was requested but torch sees no GPU (use --device cpu)",
            marks=pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a CUDA GPU"),
        ),
        (
            (
                "record",
                "--model-dir",
                "{d}",
                "--text",
                "{d}/a_file",
                "--out",
                "{d}/a_file",
            ),  # (the text became a trace)
            "a_file: is what this command reads",
        ),
        (
            (
                "validate",
                "--policy",
                "klotski",
                "--num-batches",
                "100000",
                "--out",
                "{d}/v",
                "--profile",
                "experiments/results/cpu/small-mixtral-presets/profile.yaml",
            ),  # (a traceback: the routing it never built)
            "100000 batches of 4 cannot run on this profile: out of GPU memory at the memory check (nothing built)",
        ),
        (
            ("calibrate", "--emulate-pageable", "2e9", "--out", "{d}/p.yaml"),
            "--emulate-pageable 2e+09 B/s is faster than the pinned rate --emulate-pcie 1e+09 B/s",
        ),
        (
            ("calibrate", "--emulate-pcie", "off", "--emulate-pageable", "1e8", "--out", "{d}/p.yaml"),
            "--emulate-pageable 1e+08: applies only to emulated links",
        ),
    ],
)
def test_what_the_runtime_cannot_honour_is_refused_in_one_line(tmp_path, args, message):
    """A seed beyond 64 bits (the simulator took it, torch overflowed), 100,000 threads (can't start
    new thread), a checkpoint folder that is a file (transformers only warned; success was printed)."""
    (tmp_path / "a_file").write_text("x")
    rc, out, err = run_runtime(*(a.format(d=tmp_path) for a in args))
    assert rc == 2 and message in err and "Traceback" not in err and len(err.strip().splitlines()) == 1, err


def test_record_beyond_the_models_positions_is_refused_before_decoding(tmp_path):
    """--gen-len 100000000 decoded on (hours) although the checkpoint allows 2048 positions."""
    assert run_runtime("tiny-checkpoint", "--out", str(tmp_path / "ckpt"))[0] == 0
    rc, out, err = run_runtime(
        "record",
        "--model-dir",
        str(tmp_path / "ckpt"),
        "--text",
        "traces/sample_text.txt",
        "--max-tokens",
        "8",
        "--gen-len",
        "100000000",
        "--out",
        str(tmp_path / "r.npz"),
    )
    assert rc == 2 and "allows 2048 positions (max_position_embeddings)" in err and not (tmp_path / "r.npz").exists()


def test_an_execute_whose_emulated_links_would_take_hours_is_refused_with_the_numbers(tmp_path):
    """--emulate-pcie 1e3 ran a tiny schedule's copies for many minutes without a word (each copy was
    short enough: only a single copy of over an hour was refused); 10 B/s would have taken 36 hours."""
    from .conftest import run_cli

    rc, _, err = run_cli(
        "simulate",
        "--model",
        "tiny-mixtral",
        "--policy",
        "klotski",
        "--num-batches",
        "2",
        "--batch-size",
        "2",
        "--prompt-len",
        "6",
        "--gen-len",
        "3",
        "--out",
        str(tmp_path),
    )
    assert rc == 0, err
    rc, out, err = run_runtime("execute", str(tmp_path), "--emulate-pcie", "1000")  # (22 minutes of copies)
    assert (
        rc == 2
        and err.strip().endswith(
            "--emulate-pcie: expected bytes per second from 1e+06 to 1e+13, got '1000' (a unit slip? 1 GB/s is 1e9)"
        )
        and not out
    ), err
    from klotski_runtime.executor import ExecOptions, ExecutionError, execute
    from klotski_runtime.kernels import WeightStore
    from klotski_sim.workload.model import get_model
    from klotski_sim.workload.routing import RoutingTable

    schedule = Schedule.load(tmp_path / "schedule.json")
    h2d = sum(op.bytes for op in schedule.ops if op.kind == "transfer" and schedule.streams[op.stream] == "pcie_h2d")
    tiny = get_model("tiny-mixtral")
    with pytest.raises(ExecutionError) as refused:  # (the library takes any rate: the run's length is checked)
        execute(
            schedule,
            tiny,
            WeightStore.random(tiny),
            RoutingTable.load(tmp_path / "routing.npz"),
            ExecOptions(emulate_links={"pcie_h2d": 10.0}),
        )
    moved = re.match(
        r"emulated pcie_h2d at 10 B/s: the schedule's copies over it \(([0-9,]+) bytes\) would "
        r"take ([0-9.]+) h, more than 1 h: refused \(check the emulated rate\)$",
        str(refused.value),
    )
    assert moved and int(moved[1].replace(",", "")) == h2d and float(moved[2]) == round(h2d / 10 / 3600, 1)
    rc, out, err = run_runtime("execute", str(tmp_path / "schedule.json"), "--out", str(tmp_path))
    assert rc == 2 and "is what this command reads" in err and not out, err  # (the simulation's files kept)
    meta_int = tmp_path / "meta_int"
    meta_int.mkdir()
    data = json.loads((tmp_path / "schedule.json").read_text())
    data["meta"]["model"] = 5
    (meta_int / "schedule.json").write_text(json.dumps(data))
    (meta_int / "routing.npz").write_bytes((tmp_path / "routing.npz").read_bytes())
    rc, out, err = run_runtime("execute", str(meta_int))  # (an AttributeError traceback)
    assert rc == 2 and "meta.model must be a model preset's name, got 5" in err and not out, err


def test_record_never_overwrites_the_checkpoint_and_refuses_a_device_or_a_pipe_as_text(tmp_path):
    """`record --out` inside the checkpoint it reads replaced its config.json with the trace (exit 0);
    `--text /dev/zero` was read until memory ran out, a FIFO without a writer blocked for ever."""
    import os

    rc, _, err = run_runtime("tiny-checkpoint", "--out", str(tmp_path / "ckpt"))
    assert rc == 0, err
    config = (tmp_path / "ckpt" / "config.json").read_bytes()
    rc, _, err = run_runtime(
        "record",
        "--model-dir",
        str(tmp_path / "ckpt"),
        "--text",
        "traces/sample_text.txt",
        "--max-tokens",
        "8",
        "--gen-len",
        "2",
        "--out",
        str(tmp_path / "ckpt" / "config.json"),
    )
    assert rc == 2 and "is a file of" in err and "would replace it" in err and len(err.splitlines()) == 1
    assert (tmp_path / "ckpt" / "config.json").read_bytes() == config
    os.mkfifo(tmp_path / "fifo")
    for text in ("/dev/zero", str(tmp_path / "fifo")):
        rc, _, err = run_runtime(
            "record",
            "--model-dir",
            str(tmp_path / "ckpt"),
            "--text",
            text,
            "--max-tokens",
            "8",
            "--gen-len",
            "2",
            "--out",
            str(tmp_path / "r.npz"),
        )  # (the FIFO: the timeout fails it)
        assert rc == 2 and "not a regular file" in err and len(err.splitlines()) == 1, err


def test_calibration_sizes_the_memory_cannot_hold_are_refused_before_measuring():
    """A --max-expert-tokens of 2**31 - 1 ran for minutes, --prompt-lens of that size failed at its
    first tensor; sizes beyond 2**31 - 1 were a torch traceback. Refused at once, with the numbers."""
    for sizes in (
        ["--batch-sizes", "1,2", "--prompt-lens", "16", "--max-expert-tokens", "2147483647"],
        ["--batch-sizes", "1,2", "--prompt-lens", "2147483647", "--max-expert-tokens", "32"],
    ):
        rc, _, err = run_runtime("calibrate", "--model", "tiny-mixtral", *sizes, "--repeats", "1", "--out", "x.yaml")
        assert rc == 2 and "calibration sizes too large for cpu memory" in err and "GiB" in err, err
    rc, _, err = run_runtime("calibrate", "--model", "tiny-mixtral", "--batch-sizes", "1180591620717411303424")
    assert rc == 2 and "expected positive integers up to 2**31 - 1" in err and "Traceback" not in err


def test_calibration_of_a_model_whose_first_layers_are_dense_measures_its_cpu_expert():
    """DeepSeek's first layers have a dense MLP and no experts: the CPU expert was taken from layer 0
    and every such calibration failed after its measurements ("no weights for ('expert', 0, 0)")."""
    from dataclasses import replace

    from klotski_runtime.calibrate import calibrate
    from klotski_sim.workload.model import get_model

    small = replace(
        get_model("deepseek-v2-lite:2"),
        name="small-deepseek",
        num_experts=4,
        top_k=2,
        hidden_size=64,
        ffn_size=32,
        num_heads=2,
        num_kv_heads=2,
        head_dim=24,
        vocab_size=128,
        shared_ffn_size=32,
        dense_ffn_size=64,
        kv_lora_rank=16,
        qk_rope_dim=8,
        qk_nope_dim=16,
        v_head_dim=16,
    )
    assert small.first_dense_layers == 1
    profile = calibrate(
        small, "cpu", batch_sizes=(1,), prompt_lens=(4,), max_expert_tokens=4, repeats=1, dtype=torch.float32
    )
    assert profile.measured["cpu:expert"] and profile.cpu is not None


@pytest.mark.parametrize(
    "args,message",
    [
        (("tiny-checkpoint", "--out", ""), "--out: expected a folder, got an empty name"),
        (("tiny-checkpoint", "--out", "/proc/no/such"), "--out /proc/no/such: cannot create the folder"),
        (("calibrate", "--emulate-pcie", "1e-300"), "--emulate-pcie: expected bytes per second from 1e+06 to 1e+13"),
        (
            ("calibrate", "--emulate-pcie", "999999"),
            "got '999999' (a unit slip? 1 GB/s is 1e9)",
        ),  # (refused after 3-5 s)
        (
            ("execute", "x", "--emulate-pageable", "1e30"),
            "--emulate-pageable: expected bytes per second from 1e+06 to 1e+13",
        ),
    ],
)
def test_runtime_flags_are_refused_in_one_line_before_any_work(args, message):
    """Each ran its work first (a calibration, a model built) and then failed in raw errno or
    validation text, or printed a 1e21 GB/s link."""
    rc, _, err = run_runtime(*args)
    assert rc == 2 and message in err and len(err.strip().splitlines()) == 1, err


def test_a_calibration_on_a_full_disk_is_one_line_and_leaves_the_earlier_profile(tmp_path):
    """On a full disk calibrate's measurement of the disk ended in a bare "[Errno 28]" line, and its
    profile was written in place (a cut YAML loaded: a `measured:` table without its last rows).
    Now each is one line, and the earlier profile is as it was."""
    from .conftest import run_on_a_full_disk

    out = tmp_path / "p.yaml"
    out.write_text("the earlier profile\n")
    rc, _, err = run_on_a_full_disk(
        "klotski_runtime.cli",
        "calibrate",
        "--model",
        "tiny-mixtral",
        "--repeats",
        "1",
        "--batch-sizes",
        "1",
        "--prompt-lens",
        "16",
        "--out",
        str(out),
        room=1024,
    )
    progress, refusal = err.splitlines()[:-1], err.splitlines()[-1]  # (calibrate says each phase as it starts)
    assert all(line.startswith("calibrate: ") for line in progress), err
    assert (
        rc == 2
        and refusal.startswith("error: cannot measure the disk: writing a 1,048,576-byte file in ")
        and refusal.endswith(" failed (File too large); free space there or point TMPDIR at another folder")
    ), err
    assert out.read_text() == "the earlier profile\n" and [p.name for p in tmp_path.iterdir()] == ["p.yaml"]
    # (the profile itself is written as `trace stats --csv` writes its table: klotski_sim.files.outfiles.write_file,
    # test_hardening.py's full-disk test; a limit per file cannot fail it here and pass the 1 MB probes)


def test_record_refuses_a_checkpoint_that_lacks_weights_and_prints_only_its_own_lines(tmp_path):
    """A checkpoint missing a layer's weights was recorded: transformers drew them at random, said so
    in a table on stderr among its progress bars, and the trace was a random model's routing."""
    from safetensors.torch import load_file, save_file

    rc, out, err = runtime_in_process("tiny-checkpoint", "--out", str(tmp_path / "ckpt"))
    assert rc == 0 and out.count("\n") == 1, err
    rc, out, err = runtime_process(
        "record",
        "--model-dir",
        str(tmp_path / "ckpt"),
        "--text",
        "traces/sample_text.txt",
        "--max-tokens",
        "20",
        "--gen-len",
        "2",
        "--out",
        str(tmp_path / "whole.npz"),
    )
    assert rc == 0 and err == "" and out.count("\n") == 1, err
    weights = tmp_path / "ckpt" / "model.safetensors"
    tensors = load_file(weights)
    save_file({k: v for k, v in tensors.items() if ".layers.1." not in k}, weights, metadata={"format": "pt"})
    rc, out, err = runtime_process(
        "record",
        "--model-dir",
        str(tmp_path / "ckpt"),
        "--text",
        "traces/sample_text.txt",
        "--max-tokens",
        "20",
        "--gen-len",
        "2",
        "--out",
        str(tmp_path / "r.npz"),
    )
    assert rc == 2 and err.count("\n") == 1 and not (tmp_path / "r.npz").exists(), err
    assert err.startswith(f"error: {tmp_path / 'ckpt'}: the checkpoint lacks ") and "model.layers.1." in err, err


@pytest.mark.parametrize(
    "argv",
    [
        ["calibrate", "--device", "cpu", "--model", "tiny-mixtral"],
        ["validate", "--device", "cpu", "--model", "tiny-mixtral"],
    ],
)
def test_the_runtime_without_torch_says_how_to_install_it_in_one_line(tmp_path, argv):
    """`pip install -e .` then `klotski-runtime calibrate` ended in a ModuleNotFoundError traceback."""
    script = (
        "import sys; sys.modules['torch'] = None\n"  # (import torch then raises ModuleNotFoundError)
        "from klotski_sim.cli.entry import runtime\n"
        f"sys.argv = ['klotski-runtime', *{argv!r}, '--out', {str(tmp_path / 'out')!r}]\n"
        "sys.exit(runtime())"
    )
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: torch is not installed"), proc.stderr
    assert "pip install" in lines[0] and "CPU build" in lines[0]
