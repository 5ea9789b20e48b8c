"""Your own schedule in one file: --policy-file, entry points, sweeps and the runtime."""

import json
import subprocess
import sys
from collections import OrderedDict
from importlib.metadata import EntryPoint

import pytest

from klotski_sim.policies import POLICIES, register
from klotski_sim.policies.plugins import load_entry_points, load_policy_file
from klotski_sim.runs.runner import RunSpec, run
from klotski_sim.util.errors import UsageError

from .conftest import ROOT, run_cli, run_cli_process

EXAMPLE = ROOT / "examples" / "lru_single_batch.py"


def lru_hits(routing, slots):
    """Brute force: replay the run's expert accesses (batch, step, layer, expert in id order) through
    an LRU of `slots` entries."""
    cache, hits, misses = OrderedDict(), 0, 0
    counts = routing.counts
    for b in range(routing.shape.num_batches):
        for s in range(routing.shape.num_steps):
            for layer in range(routing.num_layers):
                for e in counts[s, layer, b].nonzero()[0]:
                    key = (layer, int(e))
                    if key in cache:
                        hits += 1
                        cache.move_to_end(key)
                    else:
                        misses += 1
                        if len(cache) >= slots:
                            cache.popitem(last=False)
                        cache[key] = True
    return hits, misses


@pytest.mark.parametrize("slots", [1, 3, 8])
def test_the_example_cache_hits_equal_a_brute_force_replay(slots):
    load_policy_file(EXAMPLE)
    r = run(
        RunSpec(
            model="tiny-mixtral",
            policy="lru-single-batch",
            batch_size=2,
            num_batches=2,
            prompt_len=5,
            gen_len=4,
            options={"slots": slots},
        )
    )
    assert r.timeline.status == "ok"
    cache = r.schedule.meta["cache"]
    assert (cache["hits"], cache["misses"]) == lru_hits(r.routing, slots)
    loads = [o for o in r.schedule.ops if o.kind == "transfer" and o.tensor == "expert"]
    assert len(loads) == cache["misses"]
    assert r.timeline.summary().peak_gpu_bytes > 0


def test_policy_file_in_simulate_and_compare(tmp_path):
    code, out, err = run_cli_process(
        "simulate",
        "--policy-file",
        str(EXAMPLE),
        "--policy",
        "lru-single-batch",
        "--model",
        "tiny-mixtral",
        "--no-png",
        "--out",
        str(tmp_path / "sim"),
    )
    assert code == 0, err
    assert "lru-single-batch" in out
    assert json.loads((tmp_path / "sim" / "summary.json").read_text())["policy"] == "lru-single-batch"
    code, out, err = run_cli_process(
        "compare",
        "--policy-file",
        str(EXAMPLE),
        "--policies",
        "single-batch,lru-single-batch",
        "--model",
        "tiny-mixtral",
        "--no-png",
        "--out",
        str(tmp_path / "cmp"),
    )
    assert code == 0, err
    assert "lru-single-batch" in out and "single-batch" in out


def test_policy_file_in_a_sweep(tmp_path):
    (tmp_path / "my_policy.py").write_text(EXAMPLE.read_text())
    (tmp_path / "spec.yaml").write_text(
        "policies: [lru-single-batch, single-batch]\nmodels: [tiny-mixtral]\n"
        "batch_sizes: [2]\nprompt_lens: [8]\ngen_lens: [3]\n"
        "policy_files: [my_policy.py]\n"
    )
    code, out, err = run_cli_process(
        "sweep", str(tmp_path / "spec.yaml"), "--out", str(tmp_path / "out"), "--no-progress", "--workers", "2"
    )
    assert code == 0, err
    import pandas as pd

    df = pd.read_parquet(tmp_path / "out" / "results.parquet")
    assert set(df["policy"]) == {"lru-single-batch", "single-batch"} and set(df["status"]) == {"ok"}


def test_policy_file_in_the_runtime(tmp_path):
    pytest.importorskip("torch")
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "klotski_runtime.cli",
            "validate",
            "--policy-file",
            str(EXAMPLE),
            "--policy",
            "lru-single-batch",
            "--model",
            "tiny-mixtral",
            "--repeats",
            "1",
            # a committed calibration of this model (its links emulated at 50 MB/s): what is checked
            # here is the policy file in the runtime, not a calibration (validate's own: test_validate)
            "--profile",
            "experiments/results/cpu/tiny-mixtral/profile.yaml",
            "--emulate-pcie",
            "5e7",
            "--out",
            str(tmp_path / "v"),
        ],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr
    report = json.loads((tmp_path / "v" / "validation.json").read_text())
    assert "lru-single-batch" in report["policies"]


@pytest.mark.parametrize(
    "body, message",
    [
        ("def f(:\n", "bad.py:1: syntax error"),
        ("x = 1\nundefined_name\n", "bad.py:2: NameError"),
        ("x = 1\n", "registers no policy"),
        (
            "from klotski_sim.policies import register\n@register('klotski', 'mine')\ndef b(inp):\n    pass\n",
            "already registered",
        ),
        (
            "import sys\nsys.exit(0)\n",
            "bad.py:2: exits (sys.exit(0)) while being imported",
        ),  # (ended silently, status 0)
        # ("registers no policy", the built-in replaced for the rest of the process)
        (
            "from klotski_sim.policies import POLICIES, register\nPOLICIES.pop('klotski')\n"
            "@register('klotski', 'mine')\ndef b(inp):\n    pass\n",
            "bad.py: replaces or removes the registered policy 'klotski' (register yours under another name)",
        ),
    ],
)
def test_a_bad_policy_file_is_one_line(tmp_path, body, message):
    bad = tmp_path / "bad.py"
    bad.write_text(body)
    code, out, err = run_cli_process("simulate", "--policy-file", str(bad), "--model", "tiny-mixtral", "--no-png")
    assert code == 2 and err.count("\n") == 1 and message in err, err
    code, out, err = run_cli_process("simulate", "--policy-file", str(tmp_path / "missing.py"), "--no-png")
    assert code == 2 and "missing.py: no such file" in err


def test_entry_points_register_installed_policies(tmp_path, monkeypatch):
    (tmp_path / "klotski_plugin_demo.py").write_text(
        "from klotski_sim.policies import register\n"
        "from klotski_sim.policies.single_batch import build\n"
        "register('demo-plugin', 'an installed policy')(lambda inp: build(inp))\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    ep = EntryPoint("demo", "klotski_plugin_demo", "klotski.policies")
    import importlib.metadata

    monkeypatch.setattr(
        importlib.metadata, "entry_points", lambda group=None: [ep] if group == "klotski.policies" else []
    )
    try:
        assert load_entry_points() == ["demo-plugin"]
        assert "demo-plugin" in POLICIES
    finally:
        POLICIES.pop("demo-plugin", None)
    broken = EntryPoint("broken", "no_such_module_here", "klotski.policies")
    monkeypatch.setattr(importlib.metadata, "entry_points", lambda group=None: [broken])
    with pytest.raises(UsageError, match="entry point 'broken'.*does not load"):
        load_entry_points()
    (tmp_path / "klotski_plugin_exits.py").write_text("import sys\nsys.exit(3)\n")
    exits = EntryPoint("exits", "klotski_plugin_exits", "klotski.policies")
    monkeypatch.setattr(importlib.metadata, "entry_points", lambda group=None: [exits])
    with pytest.raises(UsageError, match="entry point 'exits'.*does not load: SystemExit: 3"):
        load_entry_points()


def test_a_policy_file_that_replaces_a_registered_policy_is_refused_and_the_registry_put_back(tmp_path):
    from klotski_sim.policies.plugins import load_policy_file

    built_in = POLICIES["klotski"]
    bad = tmp_path / "replaces.py"
    bad.write_text(
        "from klotski_sim.policies import POLICIES, register\nPOLICIES.pop('klotski')\n"
        "@register('klotski', 'mine')\ndef b(inp):\n    pass\n@register('mine-too', 'x')\n"
        "def c(inp):\n    pass\n"
    )
    with pytest.raises(UsageError, match="replaces or removes the registered policy 'klotski'"):
        load_policy_file(bad)
    assert POLICIES["klotski"] is built_in and "mine-too" not in POLICIES


def test_register_refuses_a_second_policy_of_the_same_name():
    with pytest.raises(UsageError, match="already registered"):
        register("flexgen", "another flexgen")(lambda inp: None)


def test_register_refuses_a_name_that_differs_from_a_registered_one_in_case_alone():
    """`KLOTSKI` beside `klotski` was registered: two policies a reader takes for one, whose trace files
    are one file where names are case-insensitive (macOS, Windows)."""
    with pytest.raises(UsageError, match="policy 'KLOTSKI': policy 'klotski' is registered .* more than case"):
        register("KLOTSKI", "another klotski")(lambda inp: None)
    assert "KLOTSKI" not in POLICIES


@pytest.mark.parametrize("name", ["", "../../escaped", "a/b", ".hidden", "x" * 65, " spaced"])
def test_register_refuses_a_name_that_cannot_name_a_file(name):
    """A policy's name names its files (compare --traces: trace_<policy>.json.gz): "../../escaped"
    was accepted and its trace written outside the output folder, or failed with an errno."""
    with pytest.raises(UsageError, match="policy name"):
        register(name, "a policy")


@pytest.mark.parametrize(
    "args, message",
    [
        (("--option", "slots=abc"), "option slots must be a whole number >= 1, got"),
        (("--option", "slots=-1"), "option slots must be a whole number >= 1, got -1"),
        (("--option", "slots=9"), "slots must be from 1 to 8"),
        (("--option", "slots=NaN"), "option slots must be a whole number >= 1, got"),
        (("--option", "slots=2.5"), "option slots must be a whole number >= 1, got"),
        (("--option", "expert_cache=4"), "has no option(s) ['expert_cache']"),  # it keeps its own cache
    ],
)
def test_the_example_s_options_are_checked_in_one_line(args, message):
    code, out, err = run_cli_process(
        "simulate",
        "--policy-file",
        str(EXAMPLE),
        "--policy",
        "lru-single-batch",
        "--model",
        "tiny-mixtral",
        "--no-png",
        *args,
    )
    assert code == 2 and err.count("\n") == 1 and message in err, err


@pytest.mark.parametrize(
    "argv",
    [("simulate", "--batch-size", "0"), ("optimize", "--budget", "0"), ("bogus",)],
)
def test_argparse_errors_are_one_line_too(argv):
    code, out, err = run_cli_process(*argv)
    assert code == 2 and err.count("\n") == 1 and err.startswith("error: klotski-sim"), err


def test_an_unknown_policy_is_one_line_naming_the_flag_once_policy_files_are_loaded():
    code, out, err = run_cli_process("simulate", "--policy", "nope")
    assert code == 2 and err.count("\n") == 1 and err.startswith("error: --policy nope: unknown policy; policies:"), err


BROKEN = """
from klotski_sim.util.errors import UsageError
from klotski_sim.policies import register


class TwoArgError(UsageError):  # an error that cannot be rebuilt from its pickle
    def __init__(self, a, b):
        super().__init__(f"bad thing {a} {b}")


@register("broken-div", "divides by zero")
def build_div(inp):
    return 1 / 0


@register("broken-pickle", "raises an error that does not pickle")
def build_pickle(inp):
    raise TwoArgError(1, 2)


@register("broken-none", "returns None")
def build_none(inp):
    return None


@register("broken-exit", "ends the process")
def build_exit(inp):
    import sys
    sys.exit(0)
"""


@pytest.mark.parametrize(
    "policy,workers,message",
    [
        ("broken-div", "1", "policy 'broken-div' failed at {file}:13: ZeroDivisionError: division by zero"),
        ("broken-div", "2", "policy 'broken-div' failed at {file}:13: ZeroDivisionError: division by zero"),
        ("broken-pickle", "2", "bad thing 1 2"),
        ("broken-none", "1", "policy 'broken-none' returned NoneType, not a Schedule"),
        # (compare, simulate and sweeps ended with status 0 and wrote nothing)
        ("broken-exit", "1", "policy 'broken-exit' failed at {file}:29: SystemExit: 0"),
        ("broken-exit", "2", "policy 'broken-exit' failed at {file}:29: SystemExit: 0"),
    ],
)
def test_a_broken_policy_file_is_one_line_naming_where(tmp_path, policy, workers, message):
    path = tmp_path / "broken.py"
    path.write_text(BROKEN)
    rc, out, err = run_cli_process(
        "compare",
        "--model",
        "tiny-mixtral",
        "--prompt-len",
        "8",
        "--gen-len",
        "2",
        "--batch-size",
        "2",
        "--no-png",
        "--policy-file",
        str(path),
        "--policies",
        f"klotski,{policy}",
        "--workers",
        workers,
        "--out",
        str(tmp_path / "o"),
    )
    assert rc == 2 and message.format(file=path) in err and "Traceback" not in err, err


_HEAD = """from klotski_sim.policies import register
from klotski_sim.core.schedule import Op, Schedule, ScheduleBuilder


@register("{name}", "a fault battery's case")
def build(inp):
    made = inp.shape.batch_size * inp.shape.num_batches * inp.shape.gen_len
"""


@pytest.mark.parametrize(
    "body, message",
    [
        # each of these was a traceback
        (
            "    b = ScheduleBuilder()\n    b.compute('a', 'attention', [], alloc=(('buf', float('nan')),))\n"
            "    return b.build({'generated_tokens': made})",
            "op 'a': buffer 'buf' has size nan: give a number of bytes",
        ),
        (
            "    b = ScheduleBuilder()\n    b.preload('w', 10**30)\n    b.compute('a', 'attention', [], flops=1)\n"
            "    return b.build({'generated_tokens': made})",
            "preloaded buffer 'w' has size 10000",
        ),
        (
            "    b = ScheduleBuilder()\n    b.compute('a', 'attention', [], flops=10**400)\n"
            "    return b.build({'generated_tokens': made})",
            "op 'a': flops must be an integer from 0 to 2**62 - 1",
        ),
        (
            "    b = ScheduleBuilder()\n    b.compute('a', 'attention', [], flops=1)\n"
            "    return b.build({'generated_tokens': 'many'})",
            "meta.generated_tokens must be an integer >= 0, got 'many'",
        ),
        (
            "    return Schedule([Op('a', 'compute', 'compute', 'attention', ('zzz',))], meta={'generated_tokens': made},\n"
            "                    validate=False)",
            "op 'a' depends on unknown op 'zzz'",
        ),
        ("    raise GeneratorExit()", "failed at "),
        # (a string's characters were taken for its deps: "depends on unknown op 'b'")
        (
            "    b = ScheduleBuilder()\n    b.compute('abc', 'attention', [], flops=1)\n"
            "    return Schedule([Op('a', 'compute', 'compute', 'attention', 'abc')], meta={'generated_tokens': made})",
            "op 'a': deps must be a tuple of op ids, got the string 'abc'",
        ),
        # and each of these a figure: -23,256 tok/s, 4.6e15 tok/s, a run of no ops
        (
            "    b = ScheduleBuilder()\n    b.compute('a', 'attention', [], flops=1)\n"
            "    return b.build({'generated_tokens': -5})",
            "meta.generated_tokens must be an integer >= 0, got -5",
        ),
        (
            "    b = ScheduleBuilder()\n    b.compute('a', 'attention', [], flops=1)\n"
            "    return b.build({'generated_tokens': 10**12})",
            "meta.generated_tokens 1000000000000 is not the run's 4 (batch size 2 x 1 batches x 2 generated)",
        ),
        ("    return ScheduleBuilder().build({'generated_tokens': made})", "has no ops: nothing to simulate"),
    ],
)
def test_a_policy_files_schedule_is_checked_as_a_schedule_file_is(tmp_path, body, message):
    """Found by a fault battery: a policy file's schedule was trusted as the package's own builders'
    are, so sizes out of range ended in tracebacks (the timeline, the cost model) and a wrong meta
    in absurd throughputs. Each is one line naming the policy's schedule."""
    path = tmp_path / "faulty.py"
    path.write_text(_HEAD.format(name="faulty") + body + "\n")
    rc, out, err = run_cli_process(
        "simulate",
        "--model",
        "tiny-mixtral",
        "--prompt-len",
        "8",
        "--gen-len",
        "2",
        "--batch-size",
        "2",
        "--policy-file",
        str(path),
        "--policy",
        "faulty",
    )
    assert rc == 2 and err.count("\n") == 1 and err.startswith("error: ") and message in err, err


MARKS = """
import pathlib
pathlib.Path(__file__).with_suffix(".ran").write_text("imported")
"""


@pytest.mark.parametrize(
    "argv",
    [
        ("models", "--policy-file", "{file}"),  # (a command that takes no policy file)
        ("trace", "stats", "{trace}", "--", "--policy-file={file}"),  # (after --: not an option at all)
        ("simulate", "--policy-file", "{file}", "--batch-size", "0"),  # (a command line argparse refuses)
    ],
)
def test_a_policy_file_runs_only_in_a_command_that_takes_it_and_only_once_its_command_line_is_right(tmp_path, argv):
    file = tmp_path / "marks.py"
    file.write_text(MARKS)
    trace = tmp_path / "t.npz"
    assert run_cli("trace", "synth", "--model", "tiny-mixtral", "--sequences", "1", "--out", str(trace))[0] == 0
    code, _, err = run_cli_process(*(a.format(file=file, trace=trace) for a in argv))
    assert code == 2 and err.count("\n") == 1, err
    assert not file.with_suffix(".ran").exists(), "the policy file was run"
    code, _, err = run_cli_process("policies", "--policy-file", str(file))
    assert file.with_suffix(".ran").exists(), err  # (where it is taken: run; it registers no policy, which is said)
    assert code == 2 and "registers no policy" in err


def test_a_policy_file_raising_keyboardinterrupt_at_import_is_named_not_taken_for_a_stop(tmp_path):
    file = tmp_path / "stops.py"
    file.write_text("x = 1\nraise KeyboardInterrupt\n")
    code, _, err = run_cli_process("simulate", "--policy-file", str(file), "--model", "tiny-mixtral")
    assert code == 2 and err.count("\n") == 1, err
    assert f"{file}:2: raises KeyboardInterrupt while being imported (no stop was received)" in err, err


SLEEPY_IMPORT = "import time\nwhile True:\n    time.sleep(0.05)\n"
SLEEPY_BUILD = """
import time
from klotski_sim.policies import register


@register("sleepy", "never returns its schedule")
def build(inp):
    while True:
        time.sleep(0.05)
"""


def test_policy_timeout_stops_a_policy_file_that_never_returns_in_one_line(tmp_path):
    (tmp_path / "hangs.py").write_text(SLEEPY_IMPORT)
    (tmp_path / "sleepy.py").write_text(SLEEPY_BUILD)
    code, _, err = run_cli_process(
        "simulate", "--policy-file", str(tmp_path / "hangs.py"), "--policy-timeout", "0.5", "--model", "tiny-mixtral"
    )
    assert code == 2 and err.count("\n") == 1, err
    assert "hangs.py: importing it: still running after --policy-timeout 0.5 s, stopped" in err, err
    tiny = ("--model", "tiny-mixtral", "--prompt-len", "8", "--gen-len", "2", "--batch-size", "2", "--no-png")
    for command in (
        ("simulate", "--policy", "sleepy"),
        ("compare", "--policies", "sleepy,single-batch", "--workers", "2"),
    ):
        code, _, err = run_cli_process(
            *command, *tiny, "--policy-file", str(tmp_path / "sleepy.py"), "--policy-timeout", "0.5"
        )
        assert (
            code == 2 and "policy 'sleepy' building its schedule: still running after --policy-timeout 0.5 s" in err
        ), (
            command,
            err,
        )
    code, _, err = run_cli_process("models", "--policy-timeout", "1")  # (only where a policy file can run)
    assert code == 2 and "unrecognized arguments: --policy-timeout" in err, err
