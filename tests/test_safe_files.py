"""Outputs on a shared machine: a symbolic link planted where a command will write is refused (its
target, another user's file, untouched) unless --follow-symlinks asks for it; temporaries are created
exclusively under unpredictable names, so links planted at the names earlier versions used (this
process's pid in them) are never written through; the sweep's lock file is never opened through a link."""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest
import yaml

from klotski_sim.files.outfiles import temporary_beside

from .conftest import run_cli

TINY = ("--model", "tiny-mixtral", "--prompt-len", "8", "--gen-len", "3", "--batch-size", "2")
ORIGINAL = b"another user's file"
SYNTH = ("trace", "synth", "--model", "tiny-mixtral", "--sequences", "2", "--prompt-len", "4", "--gen-len", "2")


def _victim(tmp_path: Path) -> Path:
    victim = tmp_path / "victim.txt"
    victim.write_bytes(ORIGINAL)
    return victim


def _plant_old_temporaries(folder: Path, name: str, victim: Path) -> list[Path]:
    """Links at the temporary names earlier versions took for `name` in `folder` (by this process's
    pid, which an attacker can guess): a write through any of them would reach the victim."""
    pid = os.getpid()
    links = [folder / f".{name}.{pid}.tmp", folder / f".tmp-{pid}-{name}", folder / f".old-{pid}-{name}"]
    for link in links:
        link.symlink_to(victim)
    return links


def _sweep_spec(tmp_path: Path) -> Path:
    spec = tmp_path / "spec.yaml"
    spec.write_text(
        yaml.safe_dump(
            {
                "models": ["tiny-mixtral"],
                "policies": ["single-batch"],
                "batch_sizes": [2],
                "num_batches": [1],
                "prompt_lens": [8],
                "gen_lens": [3],
            }
        )
    )
    return spec


# (command, the output folder or file, the name inside it that is linked)
CASES = {
    "trace synth --out": (lambda out: (*SYNTH, "--out", str(out / "t.npz")), "t.npz"),
    "simulate --out": (lambda out: ("simulate", *TINY, "--no-png", "--out", str(out)), "summary.json"),
    "compare --out": (
        lambda out: ("compare", *TINY, "--policies", "single-batch", "--no-png", "--out", str(out)),
        "compare.csv",
    ),
    "serve --out": (
        lambda out: ("serve", "--model", "tiny-mixtral", "--requests", "2", "--output-len", "3", "--out", str(out)),
        "serving.json",
    ),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_a_link_planted_at_an_output_is_refused_unless_asked_and_old_temporary_names_are_never_used(tmp_path, case):
    command, linked = CASES[case]
    out = tmp_path / "out"
    out.mkdir()
    victim = _victim(tmp_path)
    (out / linked).symlink_to(victim)
    code, _, err = run_cli(*command(out))
    assert code == 2 and err.count("\n") == 1, err
    assert "is a symbolic link" in err and "--follow-symlinks" in err, err
    assert victim.read_bytes() == ORIGINAL
    # the link gone, links at the old predictable temporary names: the run writes its files, not through them
    (out / linked).unlink()
    planted = _plant_old_temporaries(out, linked, victim)
    code, _, err = run_cli(*command(out))
    assert code == 0, err
    assert victim.read_bytes() == ORIGINAL and all(link.is_symlink() for link in planted)
    assert (out / linked).is_file() and not (out / linked).is_symlink()
    # asked for: written through the link
    (out / linked).unlink()
    (out / linked).symlink_to(victim)
    code, _, err = run_cli(*command(out), "--follow-symlinks")
    assert code == 0, err
    assert (out / linked).is_symlink() and victim.read_bytes() != ORIGINAL


def test_trace_stats_csv_and_the_sweeps_files_refuse_a_planted_link(tmp_path):
    trace = tmp_path / "t.npz"
    assert run_cli(*SYNTH, "--out", str(trace))[0] == 0
    victim = _victim(tmp_path)
    (tmp_path / "stats.csv").symlink_to(victim)
    code, _, err = run_cli("trace", "stats", str(trace), "--csv", str(tmp_path / "stats.csv"))
    assert code == 2 and "is a symbolic link" in err and victim.read_bytes() == ORIGINAL, err
    spec = _sweep_spec(tmp_path)
    for name in ("spec.yaml", ".lock", "results.parquet"):
        out = tmp_path / f"sweep-{name.strip('.')}"
        out.mkdir()
        (out / name).symlink_to(victim)
        code, _, err = run_cli("sweep", str(spec), "--out", str(out), "--workers", "1")
        assert code == 2 and err.count("\n") == 1, (name, err)
        assert "symbolic link" in err, (name, err)
        assert victim.read_bytes() == ORIGINAL, name


def test_temporaries_are_our_own_new_files_under_unpredictable_names(tmp_path):
    names = {temporary_beside(tmp_path, ".tmp-", "-x.csv").name for _ in range(50)}
    assert len(names) == 50 and all(n.startswith(".tmp-") and n.endswith("-x.csv") for n in names)
    assert str(os.getpid()) not in "".join(names)
    one = tmp_path / next(iter(names))
    assert one.is_file() and not one.is_symlink() and one.stat().st_size == 0
    assert oct(one.stat().st_mode & 0o777) == oct(0o666 & ~_umask())


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


# ---- exit codes and refusals that tell the truth (issue 43, item 5) ------------------------------------------
CYCLIC = """
from klotski_sim.core.schedule import Op, Schedule
from klotski_sim.policies import register


@register("cyclic", "a schedule whose two ops wait for each other")
def build(inp):
    ops = (Op("a", "compute", "compute", "attention", ("b",)), Op("b", "compute", "compute", "attention", ("a",)))
    return Schedule(ops, validate=False)
"""


def test_a_sweep_whose_rows_fail_exits_non_zero_and_says_how_many(tmp_path):
    (tmp_path / "cyclic.py").write_text(CYCLIC)
    spec = tmp_path / "spec.yaml"
    spec.write_text(
        yaml.safe_dump(
            {
                "models": ["tiny-mixtral"],
                "policies": ["cyclic", "single-batch"],
                "policy_files": ["cyclic.py"],
                "batch_sizes": [2],
                "num_batches": [1],
                "prompt_lens": [8],
                "gen_lens": [3],
            }
        )
    )
    code, out, err = run_cli("sweep", str(spec), "--out", str(tmp_path / "out"), "--workers", "1", "--no-progress")
    assert code == 1, (out, err)
    assert "error: 1 of 2 configurations failed (status error); the first:" in err, err


def test_a_value_listed_twice_is_refused_where_it_would_run_twice(tmp_path):
    (tmp_path / "cyclic.py").write_text(CYCLIC)
    spec = tmp_path / "spec.yaml"
    spec.write_text(
        yaml.safe_dump(
            {"models": ["tiny-mixtral"], "policies": ["cyclic"], "policy_files": ["cyclic.py", "./cyclic.py"]}
        )
    )
    code, _, err = run_cli("sweep", str(spec), "--out", str(tmp_path / "out"))
    assert code == 2 and re.search(r"policy_files: '[^']*cyclic\.py' is given twice \(as /", err), err
    assert err.count("\n") == 1 and "already registered" not in err, err
    spec.write_text(yaml.safe_dump({"models": ["tiny-mixtral"], "policies": ["klotski", "flexgen", "klotski"]}))
    code, _, err = run_cli("sweep", str(spec), "--out", str(tmp_path / "out"))
    assert code == 2 and "policies: 'klotski' is given twice" in err, err
    log = tmp_path / "log.jsonl"
    log.write_text('{"seq_id": 0, "token_idx": 0, "layer": 0, "experts": [0, 1]}\n')
    code, _, err = run_cli("trace", "import", str(log), "--key", "dataset", "--key", "dataset")
    assert code == 2 and err == "error: --key dataset: given twice\n", err


def test_a_cache_policy_without_a_cache_is_refused_lru_as_lfu():
    for policy in ("lru", "lfu"):
        code, _, err = run_cli("simulate", *TINY, "--policy", "single-batch", "--option", f"cache_policy={policy}")
        assert code == 2 and f"cache_policy={policy} needs expert_cache > 0" in err, (policy, err)
    assert run_cli("simulate", *TINY, "--option", "cache_policy=lru", "--option", "expert_cache=2")[0] == 0


def test_execute_names_the_op_and_field_of_a_category_it_has_no_kernel_for(tmp_path):
    """A gate op edited to `category: bogus` was reported as "0 gate or dense MLP ops ..." with neither
    the op nor the field named."""
    pytest.importorskip("torch")
    import json

    from .conftest import runtime_in_process

    assert run_cli("simulate", *TINY, "--no-png", "--out", str(tmp_path / "a"))[0] == 0
    path = tmp_path / "a" / "schedule.json"
    data = json.loads(path.read_text())
    gate = next(op for op in data["ops"] if op["category"] == "gate")
    gate["category"] = "bogus"
    path.write_text(json.dumps(data))
    code, _, err = runtime_in_process("execute", str(tmp_path / "a"))
    assert code == 2 and err.count("\n") == 1, err
    assert f"op {gate['id']!r}: category 'bogus': the runtime has no kernel for it" in err, err


def test_validate_refuses_what_is_cheap_to_check_before_calibrating(tmp_path):
    """`validate --policy bogus` calibrated for ~40 s and left profile.yaml behind before saying so."""
    pytest.importorskip("torch")
    from .conftest import runtime_in_process

    for args, message in (
        (("--policy", "bogus"), "--policy bogus: unknown 'bogus'; policies:"),
        (("--policy", "klotski", "--option", "nonsense=1"), "has no option(s) ['nonsense']"),
        (("--model", "no-such-model"), "no-such-model"),
    ):
        out = tmp_path / "v"
        code, _, err = runtime_in_process("validate", "--model", "tiny-mixtral", *args, "--out", str(out))
        assert code == 2 and message in err and err.count("\n") == 1, (args, err)
        assert not out.exists() or not any(out.iterdir()), (args, list(out.iterdir()))


def test_validate_names_its_own_flags_for_sizes_its_device_cannot_hold(tmp_path):
    """It named `--max-expert-tokens`, a flag of calibrate that validate does not have."""
    pytest.importorskip("torch")
    from .conftest import runtime_in_process

    code, _, err = runtime_in_process(
        "validate", "--model", "tiny-mixtral", "--policy", "single-batch", "--batch-size", "65536",
        "--num-batches", "64", "--prompt-len", "65536", "--gen-len", "2", "--out", str(tmp_path / "v"),
    )  # fmt: skip
    assert code == 2 and err.count("\n") == 1, err
    assert "--max-expert-tokens" not in err and "--batch-size x" in err, err
