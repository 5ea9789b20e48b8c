"""Bad input ends in one clear line naming the flag, file or field — by class, as the hostile
battery found them (huge sizes, non-finite values, alias bombs, impostor services, concurrent
sweeps, mismatched files)."""

from __future__ import annotations

import http.server
import os
import socket
import threading

import numpy as np
import pytest
import yaml
from hypothesis import given
from hypothesis import strategies as st

from klotski_sim.hardware.profile import (
    ProfileError,
    load_profile,
    load_profile_file,
    with_overrides,
)
from klotski_sim.runs.sweep import SweepError, _locked, grid_size, parse_spec, run_sweep
from klotski_sim.util.argtypes import first_repeat
from klotski_sim.util.errors import KlotskiError

from .conftest import run_cli, runtime_in_process

TINY = {
    "name": "t",
    "models": ["tiny-mixtral"],
    "policies": ["klotski"],
    "batch_sizes": [2],
    "num_batches": [2],
    "prompt_lens": [4],
    "gen_lens": [2],
}


@pytest.mark.parametrize(
    "field,value,message",
    [
        ("gpu.memory_bytes", float("inf"), "finite"),
        ("gpu.kernel_overhead_s", float("nan"), "finite"),
        ("gpu.reserved_bytes", 1e12, "reserved_bytes"),
        ("links.pcie_h2d.bandwidth", -1.0, "links.pcie_h2d.bandwidth: Value error, -1 per second is below 1e\\+06"),
        ("links.nvme.bandwidth", 1e-300, "below 1e\\+06"),  # (ops of 1e300 s: inf and NaN outputs)
        (
            "links.pcie_h2d.bandwidth",
            25.7,
            r"25.7 per second is below 1e\+06: a unit slip\? .* \(25.7 GB/s is 25.7e9\)",
        ),
        (
            "links.pcie_h2d.pageable_bandwidth",
            12,
            "pageable_bandwidth: Value error, 12 per second",
        ),  # (GB/s meant: ran)
        ("gpu.peak_flops", 71, "gpu.peak_flops: Value error, 71 per second"),  # (TFLOP/s meant)
        ("cpu.flops.fp32", 1e3, "cpu.flops.fp32: Value error, 1000 per second"),
        ("cpu.memory_bandwidth", 200, "cpu.memory_bandwidth: Value error, 200 per second"),
        ("gpu.kernel_overhead_s", 1e300, "gpu.kernel_overhead_s: Input should be less than or equal to 1"),
        ("cpu.op_overhead_s", 2.0, "less than or equal to 1"),
        (
            "links.pcie_h2d.bandwidth",
            True,
            "links.pcie_h2d.bandwidth: Value error, expected a number, got true",
        ),  # (1 B/s)
        ("links.pcie_h2d.copy_engines", True, "expected a number, got true"),
        ("links.pcie_h2d.copy_engines", 2**70, "copy_engines: Input should be less than or equal to 64"),
        ("gpu.memory_efficiency", 1e-300, "memory_bandwidth x memory_efficiency .* is below 1e\\+06 per second"),
        ("gpu.compute_efficiency", 1e-15, "peak_flops x compute_efficiency .* is below 1e\\+06 per second"),
        # (a misspelt category was kept, read by no op: the cost it carried silently unused)
        (
            "gpu.dispatch_overhead_by_category",
            {"expret": 1e-5},
            "dispatch_overhead_by_category.expret: 'expret' is no op category \\(did you mean 'expert'\\?\\)",
        ),
        ("measured", {"cpu:atention.fused:decode": [{"tokens": 1, "seconds": 1e-3}]}, "did you mean 'attention'"),
    ],
)
def test_non_finite_and_inconsistent_profile_values_are_refused(field, value, message):
    with pytest.raises(ProfileError, match=message):
        with_overrides(load_profile("rtx3090"), {field: value})


def test_a_category_far_from_every_built_in_one_is_kept_for_a_policy_files_own_ops():
    profile = with_overrides(
        load_profile("rtx3090"),
        {
            "gpu.dispatch_overhead_by_category": {"my_op": 1e-5},
            "measured": {"expert_big": [{"tokens": 1, "seconds": 1e-3}]},
        },
    )
    assert profile.gpu.dispatch_overhead_by_category == {"my_op": 1e-5} and "expert_big" in profile.measured


def test_yaml_merge_keys_are_read_and_a_key_given_twice_beside_one_is_refused(tmp_path):
    """`pcie_d2h: {<<: *h2d, bandwidth: 5e9}` is valid YAML (yaml.safe_load reads it) and was refused:
    "could not determine a constructor for the tag 'tag:yaml.org,2002:merge'"."""
    text = load_profile("rtx3090").to_yaml()
    own = "  pcie_d2h:\n    bandwidth: 25800000000.0\n    pageable_bandwidth: 10800000000.0\n"
    assert own in text and "  pcie_h2d:\n" in text
    merged = text.replace("  pcie_h2d:\n", "  pcie_h2d: &h2d\n", 1).replace(
        own, "  pcie_d2h:\n    <<: *h2d\n    bandwidth: 25800000000.0\n", 1
    )
    path = tmp_path / "merged.yaml"
    path.write_text(merged)
    d2h = load_profile_file(path).links.pcie_d2h
    assert d2h.bandwidth == 25.8e9 and d2h.pageable_bandwidth == 10.0e9  # (its own key, then the h2d link's)
    path.write_text(merged.replace("    <<: *h2d\n", "    <<: *h2d\n    bandwidth: 1.0e9\n", 1))
    with pytest.raises(ProfileError, match="merged.yaml:[0-9]+: not valid YAML \\(key 'bandwidth' is given twice\\)"):
        load_profile_file(path)


@pytest.mark.parametrize(
    "written, read_as",
    [
        ("010", "octal in YAML 1.1 \\(read as 8\\)"),
        ("-012", "octal in YAML 1.1 \\(read as -10\\)"),
        ("1:30", "base-60 number in YAML 1.1 \\(read as 90\\)"),
        ("1:30.5", "base-60 number in YAML 1.1 \\(read as 90.5\\)"),
    ],
)
def test_yaml_1_1_octal_and_base_60_numbers_are_refused_naming_the_line(tmp_path, written, read_as):
    """PyYAML reads YAML 1.1: `copy_engines: 010` was 8 copy engines and `1:30` was 90, silently
    (YAML 1.2, and every reader's eye, take them as 10 and as text)."""
    text = load_profile("rtx3090").to_yaml()
    assert "    copy_engines: 1\n" in text
    path = tmp_path / "p.yaml"
    path.write_text(text.replace("    copy_engines: 1\n", f"    copy_engines: {written}\n", 1))
    line = path.read_text().splitlines().index(f"    copy_engines: {written}") + 1
    with pytest.raises(
        ProfileError,
        match=f"p.yaml:{line}: not valid YAML \\('{written}' .*{read_as}; write the "
        f"number in decimal, or quote it if it is text\\)",
    ):
        load_profile_file(path)
    spec = tmp_path / "s.yaml"
    spec.write_text(f"name: t\nmodels: [tiny-mixtral]\nprompt_lens: [{written}]\n")
    rc, out, err = run_cli("sweep", str(spec), "--out", str(tmp_path / "o"))
    assert rc == 2 and err.startswith(f"error: {spec}:3: not valid YAML ('{written}' ") and len(err.splitlines()) == 1
    path.write_text(text.replace("    copy_engines: 1\n", "    copy_engines: 0x2\n", 1))  # (the unambiguous stays)
    assert load_profile_file(path).links.pcie_h2d.copy_engines == 2


def test_a_control_character_in_a_path_or_a_profiles_name_keeps_the_error_one_line(tmp_path):
    """A newline in a file name, or in a profile's name (printed in every summary), split the one
    `error:` line in two."""
    rc, out, err = run_cli("simulate", "--model", "tiny-mixtral", "--hardware", str(tmp_path / "x\ny.yaml"))
    assert rc == 2 and err == f"error: {tmp_path}/x\\ny.yaml: cannot read profile (No such file or directory)\n"
    text = load_profile("rtx3090").to_yaml()
    assert text.startswith("name: rtx3090\n")
    for name, shown in (('"rtx\\n3090"', r"'rtx\n3090'"), ('"rtx\\e[31m"', r"'rtx\x1b[31m'"), ('""', "''")):
        path = tmp_path / "p.yaml"
        path.write_text(text.replace("name: rtx3090", f"name: {name}", 1))
        rc, out, err = run_cli("simulate", "--model", "tiny-mixtral", "--hardware", str(path))
        assert rc == 2 and err.count("\n") == 1 and err.startswith(f"error: {path}: invalid hardware profile: name: ")
        assert f"{shown}: give a non-empty name of printable characters" in err, err


def test_a_byte_order_mark_is_read_past_in_json_as_in_yaml(tmp_path):
    """A schedule.json saved by a Windows editor (a UTF-8 byte-order mark first) was refused as
    "not valid JSON", where a profile with one was read."""
    from klotski_sim.core.schedule import Schedule

    assert (
        run_cli(
            "simulate",
            "--model",
            "tiny-mixtral",
            "--batch-size",
            "2",
            "--num-batches",
            "2",
            "--prompt-len",
            "4",
            "--gen-len",
            "2",
            "--no-png",
            "--out",
            str(tmp_path / "run"),
        )[0]
        == 0
    )
    plain = tmp_path / "run" / "schedule.json"
    marked = tmp_path / "marked.json"
    marked.write_bytes(b"\xef\xbb\xbf" + plain.read_bytes())
    assert Schedule.load(marked).ops == Schedule.load(plain).ops
    profile = tmp_path / "p.yaml"
    profile.write_bytes(b"\xef\xbb\xbf" + load_profile("rtx3090").to_yaml().encode())
    assert load_profile_file(profile) == load_profile("rtx3090")


def test_an_integer_field_written_with_an_exponent_is_read_as_its_number(tmp_path):
    """`cores: 2.4e1` (text to YAML 1.1, which wants `2.4e+1`) was refused as "unable to parse string
    as an integer" while `--set cpu.cores=2.4e1` was 24; a fraction is still refused."""
    text = load_profile("rtx3090").to_yaml()
    assert "  cores: 24\n" in text
    path = tmp_path / "p.yaml"
    path.write_text(text.replace("  cores: 24\n", "  cores: 2.4e1\n", 1))
    assert load_profile_file(path).cpu.cores == 24
    path.write_text(text.replace("  cores: 24\n", "  cores: 2.45e1\n", 1))
    with pytest.raises(
        ProfileError, match="cpu.cores: Input should be a valid integer, got a number with a fractional part"
    ):
        load_profile_file(path)


def test_a_whole_profile_check_is_said_without_an_empty_location():
    """A misspelt measured table was said as `invalid hardware profile: : Value error, measured.expret ...`."""
    with pytest.raises(ProfileError) as refused:
        with_overrides(load_profile("rtx3090"), {"measured": {"expret": [{"tokens": 1, "seconds": 1e-3}]}})
    assert str(refused.value) == (
        "overrides: invalid hardware profile: Value error, measured.expret: 'expret' is no "
        "op category (did you mean 'expert'?)"
    )


def test_yaml_alias_bomb_is_refused(tmp_path):
    lines = ['a: &a ["x", "x", "x", "x", "x", "x", "x", "x", "x", "x"]']
    for k in range(1, 12):
        prev, cur = chr(ord("a") + k - 1), chr(ord("a") + k)
        lines.append(f"{cur}: &{cur} [" + ", ".join([f"*{prev}"] * 10) + "]")
    path = tmp_path / "bomb.yaml"
    path.write_text("\n".join(lines))
    with pytest.raises(ProfileError, match="aliases"):
        load_profile_file(path)
    rc, out, err = run_cli("sweep", str(path), "--out", str(tmp_path / "o"))
    assert rc == 2 and "aliases" in err and "Traceback" not in err
    # under the alias cap (72 of them, nested 8 deep: a 382-byte spec) but 43 million policies (91 million values) once
    # expanded: a 312 MB error line after 7 s, and at 10 levels a hang
    lines = ["name: t", "l0: &l0 [" + ", ".join(["klotski"] * 9) + "]"]
    lines += [f"l{k}: &l{k} [" + ", ".join([f"*l{k - 1}"] * 9) + "]" for k in range(1, 8)]
    path.write_text("\n".join([*lines, "policies: *l7"]))
    rc, out, err = run_cli("sweep", str(path), "--out", str(tmp_path / "o"))
    assert rc == 2 and err == (
        f"error: {path}: its YAML aliases expand to 91,474,292 values (at most 100,000): refused\n"
    ), err
    # a long list without any alias is said as such (it was said to be aliases that expand)
    path.write_text("name: t\nseeds: [" + ", ".join(map(str, range(100_001))) + "]\n")
    rc, out, err = run_cli("sweep", str(path), "--out", str(tmp_path / "o"))
    assert rc == 2 and err == f"error: {path}: it holds 100,004 values (at most 100,000): refused\n", err


READERS = [
    ("trace", "import", "{f}", "--out", "{d}/t.npz"),
    ("sweep", "{f}", "--out", "{d}/o"),
    ("simulate", "--hardware", "{f}"),
]


@pytest.mark.parametrize("command", READERS)
@pytest.mark.parametrize(
    "content",
    [b"\xff\xfe\x00 not text\n", b"[" * 100_000 + b"]" * 100_000 + b"\n", b'{"seq": 1' + b"0" * 5000 + b"}\n"],
)
def test_a_file_that_is_no_text_or_too_deep_is_named_in_one_line(tmp_path, command, content):
    """A routing log, a sweep spec or a profile that is binary, JSON nested past the parser's depth,
    or a number of 5000 digits: one line naming the file (were tracebacks: UnicodeDecodeError,
    RecursionError, ValueError)."""
    path = tmp_path / "input.txt"
    path.write_bytes(content)
    rc, out, err = run_cli(*(a.format(f=path, d=tmp_path) for a in command))
    assert rc == 2 and str(path) in err and "Traceback" not in err and len(err.strip().splitlines()) == 1, err


@pytest.mark.parametrize("command", READERS)
@pytest.mark.parametrize("kind", ["device", "pipe", "directory", "huge"])
def test_a_file_that_is_no_regular_file_or_too_large_is_refused_before_reading(tmp_path, command, kind):
    """/dev/zero was read until memory ran out, a pipe blocked, a sparse 2 GB file was read whole:
    each is refused, naming the file, before a byte is read."""
    import os

    path = {
        "device": "/dev/zero",
        "pipe": str(tmp_path / "pipe"),
        "directory": str(tmp_path / "folder"),
        "huge": str(tmp_path / "huge.txt"),
    }[kind]
    if kind == "pipe":
        os.mkfifo(path)
    elif kind == "directory":
        os.mkdir(path)
    elif kind == "huge":
        with open(path, "wb") as f:
            f.truncate((2 << 30) + 1)  # (sparse: no disk used)
    rc, out, err = run_cli(*(a.format(f=path, d=tmp_path) for a in command))
    assert rc == 2 and path in err and "Traceback" not in err and len(err.strip().splitlines()) == 1, err


def _npz_declaring(path, shape, **arrays):
    """An .npz whose `experts` member's header declares `shape` of bytes but holds none of them."""
    import io
    import zipfile

    import numpy as np

    with zipfile.ZipFile(path, "w") as archive:
        header = io.BytesIO()
        np.lib.format.write_array_header_1_0(header, {"descr": "|u1", "fortran_order": False, "shape": shape})
        archive.writestr("experts.npy", header.getvalue())
        for name, array in arrays.items():
            member = io.BytesIO()
            np.save(member, array)
            archive.writestr(name + ".npy", member.getvalue())


@pytest.mark.parametrize("damage", ["inflate", "encrypted", "method"])
def test_a_trace_whose_zip_cannot_be_inflated_is_refused_in_one_line(tmp_path, damage):
    """A deflated member damaged before its CRC is reached (zlib.error), flagged encrypted
    (RuntimeError) or compressed by an unknown method (NotImplementedError): found by a mutation
    fuzz of a trace file, each was a traceback from zipfile."""
    import struct
    import zipfile

    from klotski_sim.workload.model import get_model
    from klotski_sim.workload.trace_synth import synthesize

    synthesize(get_model("tiny-mixtral"), 4, 6, 2, "calibrated", seed=1).save(tmp_path / "t.npz")
    data = bytearray((tmp_path / "t.npz").read_bytes())
    with zipfile.ZipFile(tmp_path / "t.npz") as archive:
        info = archive.getinfo("seq_offsets.npy")
    name_len, extra_len = struct.unpack("<HH", data[info.header_offset + 26 : info.header_offset + 30])
    start = info.header_offset + 30 + name_len + extra_len
    central = next(
        k
        for k in range(len(data))
        if data[k : k + 4] == b"PK\x01\x02" and data[k + 46 : k + 46 + len("seq_offsets.npy")] == b"seq_offsets.npy"
    )
    if damage == "inflate":
        data[start : start + 4] = b"\xff\xff\xff\xff"  # (an invalid deflate block header)
    elif damage == "encrypted":
        data[central + 8] |= 1  # (general purpose flag bit 0 in the central directory)
    else:
        data[central + 10 : central + 12] = struct.pack("<H", 99)  # (compression method 99)
    (tmp_path / "bad.npz").write_bytes(bytes(data))
    rc, _, err = run_cli("trace", "stats", str(tmp_path / "bad.npz"))
    assert rc == 2 and "Traceback" not in err and len(err.strip().splitlines()) == 1, err
    assert "bad.npz" in err


def test_an_npz_whose_header_declares_more_than_it_holds_is_refused_before_numpy_allocates(tmp_path):
    """A few hundred bytes declaring a 4 TB array: numpy allocated it before finding the data missing
    (_ArrayMemoryError traceback); now refused, naming the array, by trace stats, simulate --trace
    and execute's routing."""
    import json

    import numpy as np

    from klotski_sim.workload.routing import RoutingTable

    meta = {
        "format": "klotski-routing-trace",
        "version": 1,
        "model": "m",
        "num_experts": 4,
        "top_k": 2,
        "num_layers": 2,
    }
    path = tmp_path / "lie.npz"
    _npz_declaring(
        path,
        (10**12, 2, 2),
        seq_offsets=np.array([0, 4]),
        prompt_lens=np.array([2], dtype=np.int32),
        meta=np.array(json.dumps(meta)),
    )
    for args in (("trace", "stats", str(path)), ("simulate", "--trace", str(path), "--gen-len", "2")):
        rc, out, err = run_cli(*args)
        assert rc == 2 and "declares shape" in err and "Traceback" not in err, err
    with pytest.raises(KlotskiError, match="declares shape"):
        RoutingTable.load(path)


@pytest.mark.parametrize(
    "field,value,message",
    [
        ("ids", np.full((2, 1, 3, 2, 2), 0.7), "ids must be integers"),
        ("shape", np.array([1.5, 2, 2, 2]), "shape must be"),
        ("num_experts", np.array(4.9), "num_experts must be an integer"),
        ("dense_layers", np.array(9), "dense_layers 9"),
        ("moe_step", np.array(0), "moe_step 0 is not from 1"),
        ("moe_step", np.array([1, 2]), "moe_step must be an integer"),
        ("ids", np.zeros((2, 1, 3, 2, 2), dtype=np.uint8), "same expert twice"),
    ],
)
def test_a_routing_table_is_read_back_only_as_it_was_written(tmp_path, field, value, message):
    """routing.npz's arrays were coerced (float ids truncated, a shape of 1.5 batches, 4.9 experts)
    or not checked (dense layers beyond the model, a token choosing one expert twice)."""
    from klotski_sim.files.npzfile import write_npz
    from klotski_sim.workload.routing import RoutingTable

    ids = np.array([[0, 1], [2, 3], [1, 0]] * 4, dtype=np.uint8).reshape(2, 1, 3, 2, 2)
    arrays = {
        "ids": ids,
        "num_experts": np.array(4),
        "shape": np.array([1, 2, 2, 2]),
        "source": np.array("x"),
        "dense_layers": np.array(0),
    }
    arrays[field] = value
    write_npz(tmp_path / "routing.npz", arrays)
    with pytest.raises(KlotskiError, match=message):
        RoutingTable.load(tmp_path / "routing.npz")


def test_an_npz_is_never_written_over_a_device_or_a_pipe_and_a_link_keeps_pointing(tmp_path):
    """The atomic rename put a regular file where a pipe (or, run as root, /dev/full) was; a link
    given as --out was replaced by a file instead of its target being written."""
    import os

    synth = (
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
    )
    os.mkfifo(tmp_path / "pipe")
    rc, out, err = run_cli(*synth, str(tmp_path / "pipe"))
    assert rc == 2 and "not a regular file" in err and (tmp_path / "pipe").is_fifo()
    (tmp_path / "link.npz").symlink_to(tmp_path / "target.npz")
    rc, out, err = run_cli(*synth, str(tmp_path / "link.npz"))  # (a planted link: refused, its target untouched)
    assert (
        rc == 2
        and "is a symbolic link" in err
        and "--follow-symlinks" in err
        and not (tmp_path / "target.npz").exists()
    )
    rc, out, err = run_cli(*synth, str(tmp_path / "link.npz"), "--follow-symlinks")
    assert rc == 0 and (tmp_path / "link.npz").is_symlink() and (tmp_path / "target.npz").stat().st_size > 0


@pytest.mark.parametrize("blocked", ["schedule.json", "timeline.csv", "timeline.parquet"])
def test_a_file_simulate_out_cannot_write_is_one_line(tmp_path, blocked):
    """A folder where one of `simulate --out`'s files goes (Arrow's CSV writer among them) is one
    `error:` line naming it."""
    (tmp_path / "o" / blocked).mkdir(parents=True)
    rc, out, err = run_cli(
        "simulate",
        "--policy",
        "klotski",
        "--impl",
        "ideal",
        "--model",
        "tiny-mixtral",
        "--prompt-len",
        "8",
        "--gen-len",
        "2",
        "--out",
        str(tmp_path / "o"),
    )
    assert rc == 2 and err.count("\n") == 1 and err.startswith("error: ") and blocked in err, err


def test_a_synthetic_trace_larger_than_the_machine_is_refused_with_the_numbers():
    """trace synth of 100k sequences x 4k tokens of DeepSeek-V3 died allocating 186 GiB."""
    rc, out, err = run_cli(
        "trace",
        "synth",
        "--model",
        "deepseek-v3",
        "--sequences",
        "100000",
        "--prompt-len",
        "4096",
        "--out",
        "never.npz",
    )
    assert rc == 2 and "100000 sequences x 4128 tokens would need about" in err and "GiB of host memory" in err


@pytest.mark.parametrize(
    "args,flag",
    [
        (["--batch-size", "1000000000"], "memory check"),
        (["--prompt-len", "1000000000"], "memory check"),
        (["--warmup-sequences", "-1"], "--warmup-sequences"),
        (["--resident-layers", "99"], "--resident-layers"),
        (["--routing", "zipf:nan"], "zipf"),
        (["--set", "gpu.memory_bytes=Infinity"], "gpu.memory_bytes"),
        (["--seed", str(2**63)], "--seed"),
        (
            ["--option", "sync=none", "--option", "sync=per-expert"],
            "--option sync is given twice (sync=none and sync=per-expert)",
        ),  # (as typed: not `sync="none"`)
        (
            ["--set", "gpu.memory_bytes=1e9", "--set", "gpu.memory_bytes=2e9"],
            "--set gpu.memory_bytes is given twice (gpu.memory_bytes=1e9 and gpu.memory_bytes=2e9)",
        ),
        (["--set", "gpu.name="], "--set gpu.name=: expected KEY=VALUE with both given"),
        (["--set", "gpu.memory_bytes=3e6", "--set", "gpu.reserved_bytes=1e6"], "1.91 MiB available"),  # (was 0.00 GiB)
        (["--option", "=none"], "--option =none: expected KEY=VALUE with both given"),
    ],
)
def test_bad_flags_end_in_one_line(args, flag):
    rc, out, err = run_cli("simulate", "--policy", "klotski", "--gen-len", "2", *args)
    assert rc in (2, 3) and flag in (err + out) and "Traceback" not in err


def test_memory_figures_never_print_as_nothing():
    from klotski_sim.util.units import memory_text

    assert [memory_text(b) for b in (0, 1, 7, 50, 2_000_000, 0.3 * 2**30, 3 * 2**30)] == [
        "0.00 GiB",
        "1 byte",
        "7 bytes",
        "0.05 KiB",
        "1.91 MiB",
        "0.30 GiB",
        "3.00 GiB",
    ]


def test_sweep_grid_types_are_strict():
    with pytest.raises(SweepError, match="batch_sizes"):
        parse_spec({**TINY, "batch_sizes": [True]})
    with pytest.raises(SweepError, match="finite"):
        parse_spec({**TINY, "overrides": {"links.pcie_h2d.bandwidth": [float("inf")]}})


def test_a_huge_grid_asks_for_yes(tmp_path):
    spec = {**TINY, "seeds": list(range(200)), "batch_sizes": list(range(1, 101))}
    assert grid_size(parse_spec(spec)) == 20_000
    path = tmp_path / "big.yaml"
    path.write_text(yaml.safe_dump(spec))
    rc, out, err = run_cli("sweep", str(path), "--out", str(tmp_path / "o"))
    assert rc == 2 and "20000 configurations" in err and "--yes" in err
    assert not (tmp_path / "o").exists()  # (refused before its output folder is made)


_AXIS_VALUES = st.one_of(
    st.integers(-3, 3),
    st.floats(-3, 3),
    st.just(float("nan")),
    st.booleans(),
    st.sampled_from("ab"),
    st.lists(st.integers(0, 2), max_size=2),
    st.dictionaries(st.sampled_from("xy"), st.integers(0, 1)),
)


@given(st.lists(_AXIS_VALUES, max_size=8))
def test_first_repeat_is_the_first_value_equal_to_an_earlier_one(values):
    """`first_repeat` (every sweep axis, every comma-separated list) by sets, as the quadratic look
    back through the list it replaced defined it: equal values (1, 1.0, True) count as one, NaN
    never equals anything, lists and mappings by value."""
    expected = next((v for k, v in enumerate(values) if v in values[:k]), None)
    got = first_repeat(values)
    assert got is expected or got == expected


def test_a_huge_override_axis_is_refused_before_each_value_is_checked(tmp_path, monkeypatch):
    """An axis of 80,000 override values took 25 s to refuse: every value was looked for among those
    before it, then checked against every profile (a whole profile validated each time), before the
    grid's size was looked at."""
    from klotski_sim.runs import sweep as sweep_module

    checked = []
    monkeypatch.setattr(sweep_module, "with_overrides", lambda *a, **k: checked.append(a))
    path = tmp_path / "big.yaml"
    axis = {"links.pcie_h2d.bandwidth": list(range(1, 80_001))}
    path.write_text(yaml.safe_dump({**TINY, "overrides": axis}))
    rc, out, err = run_cli("sweep", str(path), "--out", str(tmp_path / "o"))
    assert rc == 2 and "80000 configurations" in err and "--yes" in err and not out
    assert not checked


@pytest.mark.parametrize(
    "damage,message",
    [
        (
            lambda out: (out / ".lock").mkdir(parents=True),
            ".lock: is a folder, but the sweep keeps its lock file there",
        ),
        (
            lambda out: out.mkdir() or (out / "rows").write_text("x"),
            "rows: is not a folder, but the sweep keeps its rows",
        ),
        (
            lambda out: (out / "rows" / "0123456789abcdef.json").mkdir(parents=True),
            "0123456789abcdef.json: is a folder, but the sweep keeps a finished row's file there",
        ),
        (
            lambda out: (out / "rows").mkdir(parents=True) or os.mkfifo(out / "rows" / "0123456789abcdef.json"),
            r"0123456789abcdef.json: is not a regular file \(a FIFO\?\), but the sweep keeps a finished row's file there",
        ),
        (
            lambda out: out.mkdir() or os.mkfifo(out / "spec.yaml"),
            r"spec.yaml: is not a regular file \(a FIFO\?\), but the sweep keeps its spec file there",
        ),
        (lambda out: out.mkdir() or os.mkfifo(out / ".lock"), r".lock: is not a regular file \(a FIFO\?\)"),
    ],
)
def test_a_sweep_into_a_damaged_folder_is_refused_in_one_line(tmp_path, damage, message):
    """Each ended a resumed sweep in a raw `[Errno 21] Is a directory` (one after a configuration ran),
    or, a FIFO where a file goes, hung it forever."""
    damage(tmp_path / "o")
    with pytest.raises(SweepError, match=message):
        run_sweep(parse_spec(TINY), tmp_path / "o", progress=False)


def test_two_sweeps_into_one_folder_do_not_interleave(tmp_path):
    with _locked(tmp_path):
        with pytest.raises(SweepError, match="another sweep is writing there"):
            run_sweep(parse_spec(TINY), tmp_path, progress=False)
    assert len(run_sweep(parse_spec(TINY), tmp_path, progress=False)) == 1  # free again afterwards


def test_dask_pointed_at_another_service_says_what_answered(tmp_path):
    pytest.importorskip("dask.distributed")
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), http.server.SimpleHTTPRequestHandler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        with pytest.raises(SweepError, match="did not greet as a Dask scheduler"):
            run_sweep(parse_spec(TINY), tmp_path, dask=f"tcp://127.0.0.1:{server.server_address[1]}", progress=False)
    finally:
        server.shutdown()
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with pytest.raises(SweepError, match="cannot connect"):
        run_sweep(parse_spec(TINY), tmp_path / "b", dask=f"tcp://127.0.0.1:{port}", progress=False)
    assert not (tmp_path / "b").exists()  # (refused before the output folder is made: it kept a lock and a spec)


def test_every_user_error_is_a_klotski_error():
    for cls in (ProfileError, SweepError):
        assert issubclass(cls, KlotskiError)
    pytest.importorskip("torch")
    from klotski_runtime.executor import ExecutionError
    from klotski_runtime.kernels import WeightError

    assert issubclass(ExecutionError, KlotskiError) and issubclass(WeightError, KlotskiError)


def test_execute_refuses_routing_of_another_run(tmp_path):
    pytest.importorskip("torch")
    common = [
        "--model",
        "tiny-mixtral",
        "--policy",
        "klotski",
        "--batch-size",
        "2",
        "--prompt-len",
        "4",
        "--gen-len",
        "2",
        "--no-png",
    ]
    assert run_cli("simulate", *common, "--num-batches", "2", "--out", str(tmp_path / "a"))[0] == 0
    assert run_cli("simulate", *common, "--num-batches", "3", "--out", str(tmp_path / "b"))[0] == 0
    # the same shape drawn from another seed: other tokens (executed without a word before)
    assert run_cli("simulate", *common, "--num-batches", "2", "--seed", "7", "--out", str(tmp_path / "c"))[0] == 0

    for other, message in (("b", "num_batches 2 vs 3"), ("c", "it is 'synth:calibrated(seed=7)'")):
        code, _, err = runtime_in_process(
            "execute", str(tmp_path / "a"), "--routing", str(tmp_path / other / "routing.npz")
        )
        assert code == 2 and "does not belong to this schedule" in err and message in err


def test_a_schedule_without_the_lm_head_a_step_embeds_from_is_one_clear_line(tmp_path):
    """A hand-edited schedule without the lm_head ops its later steps embed from: named, not a KeyError."""
    pytest.importorskip("torch")
    import json
    import subprocess
    import sys

    from .conftest import ROOT

    assert (
        run_cli(
            "simulate",
            "--model",
            "tiny-mixtral",
            "--policy",
            "klotski",
            "--batch-size",
            "2",
            "--num-batches",
            "2",
            "--prompt-len",
            "4",
            "--gen-len",
            "3",
            "--no-png",
            "--out",
            str(tmp_path / "a"),
        )[0]
        == 0
    )
    data = json.loads((tmp_path / "a" / "schedule.json").read_text())
    kept = [op for op in data["ops"] if op["category"] != "lm_head"]
    names = {op["id"] for op in kept}
    for op in kept:
        op["deps"] = [d for d in op.get("deps", []) if d in names]
    data["ops"] = kept
    (tmp_path / "a" / "schedule.json").write_text(json.dumps(data))
    proc = subprocess.run(
        [sys.executable, "-m", "klotski_runtime.cli", "execute", str(tmp_path / "a"), "--out", str(tmp_path / "m")],
        capture_output=True,
        text=True,
        cwd=ROOT,
    )
    assert proc.returncode == 2 and "Traceback" not in proc.stderr and len(proc.stderr.strip().splitlines()) == 1
    # (refused before it runs, since every batch-step's lm_head is checked: it had been found at the embed)
    assert "no lm_head op makes batch 0's tokens at step 0 (6 of the run's 6 batch-steps have none)" in proc.stderr


def test_execute_refuses_routing_with_other_dense_layers_and_shortens_a_long_source(tmp_path):
    """(Found by a fuzz of routing.npz: dense_layers 2 for a model without dense layers ran; a
    100,000-character source was echoed whole in the one error line.)"""
    pytest.importorskip("torch")

    from klotski_sim.workload.routing import RoutingTable

    assert (
        run_cli(
            "simulate",
            "--model",
            "tiny-mixtral",
            "--policy",
            "klotski",
            "--batch-size",
            "2",
            "--num-batches",
            "2",
            "--prompt-len",
            "4",
            "--gen-len",
            "2",
            "--no-png",
            "--out",
            str(tmp_path / "a"),
        )[0]
        == 0
    )
    good = RoutingTable.load(tmp_path / "a" / "routing.npz")
    for name, table, message in (
        (
            "dense",
            RoutingTable(good.ids, good.shape, good.num_experts, good.source, dense_layers=1),
            "the routing routes no tokens in its first 1 layer(s), model tiny-mixtral in its first 0",
        ),
        (
            "long",
            RoutingTable(good.ids, good.shape, good.num_experts, "x" * 100_000),
            "the routing does not belong to this schedule: it is 'xxx",
        ),
    ):
        table.save(tmp_path / f"{name}.npz")
        code, _, err = runtime_in_process(
            "execute", str(tmp_path / "a"), "--routing", str(tmp_path / f"{name}.npz"), "--out", str(tmp_path / "m")
        )
        assert code == 2 and message in err, err
        assert len(err) < 600


TINY_RUN = ["--model", "tiny-mixtral", "--prompt-len", "8", "--gen-len", "2", "--batch-size", "2"]


@pytest.mark.parametrize(
    "args,message",
    [
        (["simulate", "--seed", "-1"], "argument --seed: expected a seed from 0 to 2**63 - 1, got -1"),
        (["simulate", *TINY_RUN, "--warmup-sequences", "2000000000"], "GiB of host memory; this machine has"),
        (["compare", "--policies", "klotski,klotski"], "argument --policies: 'klotski' is given twice"),
        (["compare", "--policies", ""], "argument --policies: expected comma-separated names"),
        (
            ["compare", *TINY_RUN, "--routing", "uniform", "--trace", "traces/tiny-mixtral-recorded.npz"],
            "--routing uniform and --trace traces/tiny-mixtral-recorded.npz: a trace replays its own routing; give one",
        ),
        (
            ["simulate", *TINY_RUN, "--seed", "5", "--trace", "traces/tiny-mixtral-recorded.npz"],
            "--seed 5 and --trace traces/tiny-mixtral-recorded.npz: the seed draws synthetic routing",
        ),
        (["simulate", *TINY_RUN, "--wrap"], "--wrap lets a --trace with too few sequences reuse them"),
        (
            ["compare", *TINY_RUN, "--policies", "klotski", "--flexgen-overlap", "model"],
            "--flexgen-overlap model: flexgen is not among the policies compared (klotski)",
        ),
        (["optimize", "--policies", "klotski,,flexgen"], "argument --policies: expected comma-separated names"),
        (["compare", *TINY_RUN, "--out", "{file}"], "exists and is not a folder"),
        (["compare", *TINY_RUN, "--out", ""], "--out: expected a folder, got an empty name"),
        (["trace", "synth", "--model", "tiny-mixtral", "--out", "{file}/x.npz"], "afile is not a folder"),
        (["trace", "synth", "--model", "tiny-mixtral", "--out", "{tmp}"], "is a folder; give a file name"),
        (["trace", "stats", "traces/tiny-mixtral-recorded.npz", "--csv", "{tmp}"], "--csv"),
        # written over what is read, with a success line: the trace became its table, the log its trace
        (
            ["trace", "stats", "traces/tiny-mixtral-recorded.npz", "--csv", "./traces/tiny-mixtral-recorded.npz"],
            "--csv traces/tiny-mixtral-recorded.npz: is what this command reads (traces/tiny-mixtral-recorded.npz)",
        ),
        (
            ["trace", "stats", "traces/tiny-mixtral-recorded.npz", "--csv", ""],
            "--csv: expected a file name, got an empty",
        ),
        (["trace", "import", "{file}", "--out", "{file}"], "afile: is what this command reads"),
        (
            ["trace", "import", "{tmp}/log.npz"],
            "the output (the log's name with .npz; give --out) {tmp}/log.npz: is what",
        ),
        (["simulate", *TINY_RUN, "--out", " "], "--out: expected a folder, got an empty name"),
        (["simulate", *TINY_RUN, "--out", "{file}/sub"], "cannot create the folder"),
        (
            ["optimize", "--model", "tiny-mixtral", "--resident-layers", "99", "--out", "{tmp}/o"],
            "resident_layers: 99 is more than tiny-mixtral's 2 layers",
        ),
        (["simulate", *TINY_RUN, "--policy-file", "/dev/null"], "--policy-file /dev/null: not a regular file"),
        (["simulate", *TINY_RUN, "--hardware", ""], "--hardware: expected a name or a path, got an empty one"),
        (["simulate", "--model", "tiny-mixtral:\uff12"], "after ':' give a layer count"),  # (fullwidth digits ran)
        (["simulate", "--model", "tiny-mixtral:"], "model 'tiny-mixtral:': after ':' give a layer count from 1 to 2"),
        (["simulate", *TINY_RUN, "--routing", "zipf:\uff11.\uff12"], "zipf routing needs an exponent"),
        (["trace", "stats", " "], "file: expected a name or a path, got an empty one"),
        (["trace", "import", "{file}", "--out", ""], "--out: expected a name or a path, got an empty one"),
        # (written whole beside it and renamed onto it: a device would be replaced, as root, by a file)
        (
            ["trace", "stats", "traces/tiny-mixtral-recorded.npz", "--csv", "/dev/full"],
            "--csv /dev/full: not a regular file (a device, a pipe or a socket)",
        ),
    ],
)
def test_refused_in_one_line_before_any_work(tmp_path, args, message):
    """Found by a fuzz pass: each of these was a traceback, a silent default or work thrown away."""
    afile = tmp_path / "afile"
    afile.write_text("x")
    (tmp_path / "log.npz").write_text('{"seq_id": 0, "token_idx": 0, "layer": 0, "experts": [0, 1]}\n')
    args = [a.format(file=afile, tmp=tmp_path) for a in args]
    message = message.format(tmp=tmp_path)
    rc, out, err = run_cli(*args)
    assert rc == 2 and message in err and err.count("\n") == 1 and "Traceback" not in err, (out, err)


def test_sweep_specs_refuse_empty_axes_repeats_and_negative_seeds():
    for bad, message in (
        ({"overrides": {"links.pcie_h2d.bandwidth": []}}, "give at least one value"),
        ({"options": {"expert_cache": []}}, "give at least one value"),
        ({"policies": ["klotski", "klotski"]}, "'klotski' is given twice"),
        ({"seeds": [-1]}, r"seeds must be from 0 to 2\*\*63 - 1"),
        ({"resident_layers": [999]}, "more than"),
        ({"options": {"expert_cache": [-1]}}, "expert_cache must be a whole number"),
        ({"options": {"expert_cache": [0, 0]}}, "expert_cache: 0 is given twice"),
        (
            {"overrides": {"links.pcie_h2d.bandwidth": [2e10, "20000000000"]}},
            "links.pcie_h2d.bandwidth: 20000000000.0 is given twice",
        ),
        (
            {"options": {"expert_cache": [float("nan")]}},
            "option expert_cache must be a whole number >= 0, got nan",
        ),
        ({"routings": ["trace:/tmp"]}, "is a directory, not a routing trace"),
        ({"routings": ["trace:README.md"]}, "not a routing trace"),
        (
            {"models": ["tiny-mixtral", "tiny-mixtral:2"]},
            "models: 'tiny-mixtral:2' is 'tiny-mixtral' again under another name",
        ),
    ):
        with pytest.raises(SweepError, match=message):
            parse_spec({**TINY, **bad})


def test_a_sweep_refuses_one_profile_under_two_names(tmp_path):
    """A copy of a packaged profile's file (or two copies) next to its name ran every configuration
    twice, under two hardware labels; a copy with one number changed is another profile."""
    from importlib import resources

    copy = tmp_path / "mine.yaml"
    copy.write_text((resources.files("klotski_sim.hardware") / "profiles" / "rtx3090.yaml").read_text())
    with pytest.raises(SweepError, match=f"hardware: '{copy}' is the profile 'rtx3090' again"):
        parse_spec({**TINY, "hardware": ["rtx3090", str(copy)]})
    copy.write_text(copy.read_text().replace("bandwidth: 25.7e9", "bandwidth: 25.8e9", 1))
    assert parse_spec({**TINY, "hardware": ["rtx3090", str(copy)]}).hardware == ["rtx3090", str(copy)]


def test_a_refused_configuration_compares_and_executes_in_one_line(tmp_path):
    big = [
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
    ]
    rc, out, err = run_cli("compare", *big, "--traces", "--out", str(tmp_path / "c"))
    assert rc == 3 and "refused: out of GPU memory at the memory check" in out and "GiB available" in out
    assert not list((tmp_path / "c").glob("trace_*")) and not (tmp_path / "c" / "compare.png").exists()
    assert "Warning" not in err, err
    rc, out, err = run_cli("simulate", *big, "--out", str(tmp_path / "s"))
    assert rc == 3 and "no timeline.png: nothing was simulated" in out and "Warning" not in err, err
    import subprocess
    import sys

    proc = subprocess.run(
        [sys.executable, "-m", "klotski_runtime.cli", "execute", str(tmp_path / "s")],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 2 and "the schedule has no ops" in proc.stderr and proc.stderr.count("\n") == 1


def test_plan_names_what_does_not_fit():
    rc, out, err = run_cli("plan", "--batch-size", "4", "--prompt-len", "2000000000")
    assert rc == 3 and "not even one batch fits" in out and "weight buffers alone" not in out  # (exit 3 as simulate)
    # experts put on disk by hand: said as asked, not "weights exceed 90% of host memory" for a 0.0 GB model
    rc, out, err = run_cli("plan", *TINY_RUN, "--experts", "disk")
    assert rc == 0 and "note: weights on disk as asked (--experts disk)" in out and "exceed" not in out, err


@pytest.mark.parametrize(
    "raised,shown",
    [
        (MemoryError("Unable to allocate 3.64 TiB"), "error: out of memory: Unable to allocate 3.64 TiB"),
        (
            RuntimeError("[enforce fail] DefaultCPUAllocator: can't allocate memory: you tried to allocate 2560 bytes"),
            "error: out of memory: [enforce fail]",
        ),
        (
            RuntimeError("can't start new thread"),  # (execute --threads 1000 under a memory limit: a traceback)
            "error: the machine refused another thread (can't start new thread): ask for fewer --threads",
        ),
    ],
)
def test_running_out_of_memory_is_one_line_and_other_errors_keep_their_traceback(capsys, raised, shown):
    """numpy's and torch's allocation failures (calibrate --batch-sizes 1000000000 ended in a torch
    traceback) are one line; any other RuntimeError is a bug and keeps its traceback."""
    import argparse

    from klotski_sim.cli.main import guarded

    def parser_raising(error: BaseException) -> argparse.ArgumentParser:
        def fail(args: argparse.Namespace) -> int:
            raise error

        parser = argparse.ArgumentParser()
        parser.set_defaults(func=fail)
        return parser

    assert guarded(parser_raising(raised), []) == 2
    err = capsys.readouterr().err
    assert err.startswith(shown) and err.count("\n") == 1
    with pytest.raises(RuntimeError, match="a bug"):
        guarded(parser_raising(RuntimeError("a bug")), [])


def test_flexgen_that_cannot_hold_a_moe_layer_is_refused_before_its_schedule_is_built():
    """DeepSeek-V3's 256 experts a layer (21 GiB) on a T4: FlexGen loads a layer whole, and its
    1.3M-op schedule was built and simulated (33 s, 5.8 GB) to find out at its first MoE layer."""
    rc, out, err = run_cli("simulate", "--model", "deepseek-v3", "--hardware", "t4", "--policy", "flexgen")
    assert rc == 3 and "status      oom  (out of GPU memory at the memory check (nothing built)" in out, err
    assert "one_moe_layer 21.00 GiB" in out and len(out.strip().splitlines()) == 3  # (policy, workload, status)
    rc, out, err = run_cli(
        "simulate",
        "--model",
        "deepseek-v3",
        "--hardware",
        "t4",
        "--policy",
        "klotski",
        "--gen-len",
        "2",
        "--prompt-len",
        "16",
        "--batch-size",
        "2",
    )
    assert rc == 0 and "status      ok" in out, err  # (expert-aware buffers: it runs)


@pytest.mark.parametrize(
    "args,message",
    [
        (("simulate", "--batch-size", str(2**70)), "--batch-size: expected a positive integer up to 2**31 - 1"),
        (("plan", "--prompt-len", "2147483648"), "--prompt-len: expected a positive integer up to 2**31 - 1"),
        (("sweep", "spec.yaml", "--out", "x", "--workers", str(2**70)), "expected a number of workers from 1"),
        (
            ("trace", "import", "log.jsonl", "--num-experts", "100000"),
            "--num-experts: expected an integer from 1 to 16384",
        ),
        (("sweep", "spec.yaml", "--out", "x", "--dask", ""), "--dask: expected a scheduler address"),
    ],
)
def test_sizes_beyond_what_a_run_can_compute_with_are_refused_on_the_command_line(tmp_path, args, message):
    """2**70 as a batch size was an OverflowError from the planner's int64 arithmetic, as --workers
    from the process pool's locks; --num-experts 100,000 wrote a trace no reader takes; an empty
    --dask address ran locally."""
    (tmp_path / "spec.yaml").write_text(yaml.safe_dump(TINY))
    rc, _, err = run_cli(*[str(tmp_path / a) if a in ("spec.yaml", "x") else a for a in args])
    assert rc == 2 and message in err and "Traceback" not in err and len(err.strip().splitlines()) == 1, err


def test_sizes_beyond_what_a_run_can_compute_with_are_refused_by_the_python_api_and_a_sweep_spec(tmp_path):
    from klotski_sim.runs.runner import RunSpec, prepare
    from klotski_sim.workload.trace import TraceError, import_jsonl

    with pytest.raises(KlotskiError, match="RunSpec.batch_size must be an integer from 1 to 2147483647"):
        prepare(RunSpec(model="tiny-mixtral", batch_size=2**70, num_batches=None, prompt_len=8, gen_len=2))
    with pytest.raises(KlotskiError, match="from 1 to 2\\*\\*31 - 1"):
        parse_spec({**TINY, "batch_sizes": [2**40]})
    log = tmp_path / "log.jsonl"
    log.write_text('{"seq": 0, "token_idx": 0, "layer": 0, "experts": [0, 1]}\n')
    with pytest.raises(TraceError, match="--num-experts 100000 must be from 1 to 16384"):
        import_jsonl(log, num_experts=100_000)


@pytest.mark.parametrize(
    "address", ["tcp://127.0.0.1:99999", "tcp://127.0.0.1:abc", "tcp://[::1", "tcp://", "http://x:1"]
)
def test_a_malformed_dask_address_is_one_line(address):
    """A port out of range or not a number, a broken IPv6 bracket: urllib's ValueError was a traceback."""
    from klotski_sim.runs.sweep import _check_dask_address

    with pytest.raises(SweepError, match="give a scheduler address like tcp://HOST:8786"):
        _check_dask_address(address)


@pytest.mark.parametrize("setting", ["1e308", "1e10", "nan", "-1", "inf"])
def test_a_cache_cap_beyond_any_disk_is_refused(monkeypatch, setting):
    """1e308 GiB passed the check and overflowed converting to bytes (an OverflowError traceback)."""
    from klotski_sim.files.disk_cache import cache_max_bytes

    monkeypatch.setenv("KLOTSKI_CACHE_MAX_GB", setting)
    with pytest.raises(KlotskiError, match="KLOTSKI_CACHE_MAX_GB=.*must be a number of GiB from 0 to 1e\\+09"):
        cache_max_bytes()
    monkeypatch.setenv("KLOTSKI_CACHE_MAX_GB", "1e9")
    assert cache_max_bytes() == int(1e9 * 2**30)


def test_a_measured_table_is_held_to_names_the_cost_model_reads_single_durations_and_an_hours_bound():
    """1e30 s in a calibrated table made a 2e30 s makespan; two durations for one shape, and a
    table named as no op reads it, were kept silently."""
    from klotski_sim.hardware.profile import profile_from_dict

    base = load_profile("rtx3090").model_dump(mode="json", exclude_none=True)
    point = {"tokens": 1, "kv_len": 0, "seconds": 1e-4}
    for measured, message in (
        (
            {"expert": [{**point, "seconds": 1e30}]},
            "measured.expert.0.seconds: Input should be less than or equal to 3600",
        ),
        ({"expert": [point, {**point, "seconds": 2e-4}]}, "measured.expert: tokens 1, kv_len 0 measured twice"),
        ({"expert": [{**point, "tokens": 2**63}]}, "measured.expert.0.tokens: Input should be less than or equal"),
        ({"Expert Table": [point]}, "measured.Expert Table: not a table name the cost model reads"),
        ({"attention.fused:later": [point]}, "not a table name"),
        # (a kv_len on an expert row took it out of the rows expert ops are read from: utilisation 39.1 -> 33.2%)
        (
            {"expert": [point, {**point, "tokens": 2, "kv_len": 5}]},
            "measured.expert: row 2 gives kv_len 5, but expert ops read no KV cache",
        ),
        (
            {"attention:decode": [point]},
            "measured.attention:decode: row 1 has no kv_len: a decode step's attention reads the KV cache",
        ),
    ):
        with pytest.raises(ProfileError, match=message):
            profile_from_dict({**base, "measured": measured}, "p.yaml")
    for name in ("expert", "cpu:expert", "attention.fused+qk_norm:decode", "gate.topk_as_is", "my_plugin_op"):
        rows = [{**point, "kv_len": 8}] if name.startswith("attention") else [point, dict(point)]
        assert profile_from_dict({**base, "measured": {name: rows}}, "p.yaml").measured[name]
    assert profile_from_dict({**base, "measured": {"attention:prefill": [{**point, "kv_len": 0}]}}, "p.yaml")


def test_a_routing_file_whose_shape_cannot_be_is_named(tmp_path):
    """A routing.npz with a batch size of -1 said "batch_size must be ..." without naming the file."""
    from klotski_sim.workload.routing import RoutingTable, RunShape

    ids = np.zeros((1, 1, 2, 2, 2), dtype=np.int16)
    ids[..., 1] = 1
    RoutingTable(ids, RunShape(1, 1, 2, 1), 4, "test").save(tmp_path / "r.npz")
    arrays = dict(np.load(tmp_path / "r.npz"))
    arrays["shape"] = np.array([-1, 1, 2, 1])
    np.savez(tmp_path / "bad.npz", **arrays)
    with pytest.raises(KlotskiError, match=f"{tmp_path / 'bad.npz'}: batch_size must be a positive integer"):
        RoutingTable.load(tmp_path / "bad.npz")


def test_a_run_whose_weights_or_kv_cache_the_host_or_disk_cannot_hold_is_refused_with_the_numbers():
    """Mixtral-8x7B's every expert on a 1-byte disk (or its weights in 46 GiB of host memory) ran
    and reported status ok: the host and the disk were never checked."""
    from klotski_sim.planning.planner import storage_needed
    from klotski_sim.policies import Placement
    from klotski_sim.workload.model import get_model

    rc, out, err = run_cli(
        "simulate",
        "--no-png",
        "--prompt-len",
        "64",
        "--gen-len",
        "4",
        "--resident-layers",
        "0",
        "--experts",
        "disk",
        "--set",
        "host.memory_bytes=100e9",
        "--set",
        "disk.capacity_bytes=1",
    )
    assert rc == 2 and "keeps 84.00 GiB on disk" in err and "disk.capacity_bytes" in err and len(err.splitlines()) == 1
    # a model streamed from disk stages `disk_window` layers in host memory: with 1 byte of it, the run had gone on
    rc, out, err = run_cli(
        "simulate",
        "--no-png",
        "--prompt-len",
        "64",
        "--gen-len",
        "4",
        "--resident-layers",
        "0",
        "--set",
        "host.memory_bytes=1",
    )
    assert rc == 2 and err == (
        "error: mixtral-8x7b keeps 5.41 GiB in host memory (attention=disk gate=disk "
        "experts=disk kv=gpu resident_layers=0 disk_window=2), more than the profile's "
        "host.memory_bytes (1 byte): nothing simulated\n"
    ), err
    rc, out, err = run_cli(
        "simulate",
        "--no-png",
        "--prompt-len",
        "64",
        "--gen-len",
        "4",
        "--experts",
        "cpu",
        "--resident-layers",
        "0",
        "--set",
        "host.memory_bytes=50e9",
    )
    assert rc == 2 and "keeps 86.50 GiB in host memory" in err and "host.memory_bytes (46.57 GiB)" in err, err
    # with the KV cache in host memory the line says how much of it that is, and what leaves it room
    rc, out, err = run_cli(
        "simulate",
        "--no-png",
        "--model",
        "mixtral-8x22b",
        "--batch-size",
        "64",
        "--prompt-len",
        "8192",
        "--gen-len",
        "4",
        "--impl",
        "ideal",
    )
    # (9.00 GiB of it the staging window of the 7 layers whose experts are on disk: an auto n places
    # the weights before the KV cache's share is known)
    assert rc == 2 and len(err.splitlines()) == 1 and "keeps 346.08 GiB in host memory" in err, err
    assert (
        "(the KV cache of one batch is 112.05 GiB of it: every expert on disk (--experts disk), a smaller batch size"
    ) in err, err
    rc, out, err = run_cli(
        "simulate",
        "--no-png",
        "--model",
        "mixtral-8x22b",
        "--batch-size",
        "64",
        "--prompt-len",
        "8192",
        "--gen-len",
        "4",
        "--impl",
        "ideal",
        "--experts",
        "disk",
        "--set",
        "host.memory_bytes=100e9",
    )
    assert rc == 2 and "the KV cache of one batch is 112.05 GiB of it: a smaller batch size" in err, err
    m = get_model("mixtral-8x7b")
    split = storage_needed(m, Placement(disk_layers=10, resident_layers=2, kv="cpu"), 4, 3, 100, 10)
    assert split["disk"] == 10 * m.moe_layer_bytes()
    assert split["host"] == (
        m.layers_bytes()
        - 2 * m.layer_bytes()
        - 10 * m.moe_layer_bytes()
        + 2 * m.moe_layer_bytes()  # (the staging window: two layers' experts read from disk)
        + m.num_layers * m.kv_bytes(12, 110)
    )


@pytest.mark.parametrize(
    "field,value,message",
    [
        ("seed", None, "RunSpec.seed must be an integer from 0"),
        ("seed", -1, "seed"),
        ("seed", 1.5, "seed"),
        ("batch_size", True, "RunSpec.batch_size must be an integer from 1 to 2147483647"),
        ("warmup_sequences", None, "RunSpec.warmup_sequences"),
        ("num_batches", 0, "RunSpec.num_batches"),
        ("model", None, "RunSpec.model must be a string"),
        ("routing", 1, "RunSpec.routing must be a string"),
        ("trace", 3, "RunSpec.trace must be a path"),
        ("wrap", "yes", "RunSpec.wrap must be true or false"),
        ("options", None, "RunSpec.options must map names"),
        ("overrides", {1: 2}, "RunSpec.overrides must map names"),
        ("overrides", "gpu.memory_bytes=1", "RunSpec.overrides must map names"),
    ],
)
def test_a_run_spec_of_the_wrong_types_is_refused_in_one_line(field, value, message):
    """From a notebook: `seed=None` drew random routing and cached it under `seed: null`; the others
    were TypeErrors and AttributeErrors deep in the run."""
    from klotski_sim.runs.runner import RunSpec

    with pytest.raises(KlotskiError, match=message):
        RunSpec(**{**dict(model="tiny-mixtral", prompt_len=8, gen_len=2, batch_size=2, num_batches=2), field: value})


def test_a_run_spec_takes_numpy_integers_and_a_path_as_what_they_are(tmp_path):
    """`batch_size=np.int64(2)` failed in the trace cache's JSON; a Path for a profile file is its path."""
    from pathlib import Path

    from klotski_sim.runs.runner import RunSpec, run

    spec = RunSpec(
        model="tiny-mixtral",
        prompt_len=8,
        gen_len=2,
        batch_size=np.int64(2),
        num_batches=np.uint8(2),
        seed=np.int64(3),
        hardware=Path("klotski_sim/hardware/profiles/rtx3090.yaml"),
    )
    assert type(spec.batch_size) is int and type(spec.seed) is int and spec.hardware.endswith("rtx3090.yaml")
    assert run(spec).timeline.status == "ok"


@pytest.mark.parametrize(
    "args",
    [
        (
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
            "{loop}",
        ),
        ("trace", "import", "{loop}"),
        ("simulate", "--model", "tiny-mixtral", "--trace", "{loop}"),
    ],
    ids=["an output", "an input", "a trace"],
)
def test_a_path_through_a_link_that_loops_is_one_line(tmp_path, args):
    """A path that is a symbolic link to itself: pathlib's resolve() raised RuntimeError('Symlink loop
    from ...') on Python < 3.13, a traceback (the fault battery's `--out loop`)."""
    loop = tmp_path / "loop"
    loop.symlink_to(loop)
    rc, out, err = run_cli(*(a.format(loop=loop) for a in args))
    assert rc == 2 and err.count("\n") == 1 and "Traceback" not in err and str(loop) in err, err


@pytest.mark.parametrize(
    "args, flag, name",
    [
        (["trace", "stats", "traces/tiny-mixtral-recorded.npz", "--csv", "{out}"], "--csv", "stats.csv"),
        (["trace", "synth", "--model", "tiny-mixtral", "--sequences", "4", "--out", "{out}"], "", "t.npz"),  # (named
        # by the file alone: a trace's writer is told no flag)
    ],
)
def test_a_file_the_disk_cannot_hold_leaves_the_earlier_one_whole(tmp_path, args, flag, name):
    """Written in place, a full disk left a cut file that read back as a shorter one, beside a bare
    "[Errno 28]" line; now the earlier file is as it was, no temporary is left, and one line names
    the flag and the file."""
    from .conftest import run_on_a_full_disk

    out = tmp_path / name
    out.write_bytes(b"the earlier run's file\n")
    rc, _, err = run_on_a_full_disk("klotski_sim.cli.main", *[a.format(out=out) for a in args])
    assert rc == 2 and err == f"error: {flag + ' ' if flag else ''}{out}: cannot write (File too large)\n", err
    assert out.read_bytes() == b"the earlier run's file\n" and sorted(p.name for p in tmp_path.iterdir()) == [name]


def test_write_file_puts_a_file_in_place_whole_or_not_at_all(tmp_path):
    """A writer that fails half way (a full disk) leaves the target as it was and no temporary; one
    that succeeds replaces a link's target and keeps the link."""
    import errno

    from klotski_sim.files.outfiles import write_file
    from klotski_sim.util.errors import UsageError

    target = tmp_path / "f.txt"
    target.write_text("before")

    def half_then_full(temporary):
        temporary.write_text("half")
        raise OSError(errno.ENOSPC, "No space left on device")

    with pytest.raises(UsageError, match=r"^--x .*f\.txt: cannot write \(No space left on device\)$"):
        write_file(target, half_then_full, "--x")
    assert target.read_text() == "before" and [p.name for p in tmp_path.iterdir()] == ["f.txt"]
    (tmp_path / "link.txt").symlink_to(target)
    with pytest.raises(UsageError, match=r"link\.txt: is a symbolic link \(to .*f\.txt\); .*--follow-symlinks$"):
        write_file(tmp_path / "link.txt", lambda temporary: temporary.write_text("after"))
    assert target.read_text() == "before"
    from klotski_sim.files.outfiles import follow_symlinks

    follow_symlinks(True)
    try:
        write_file(tmp_path / "link.txt", lambda temporary: temporary.write_text("after"))
    finally:
        follow_symlinks(False)
    assert (tmp_path / "link.txt").is_symlink() and target.read_text() == "after"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["f.txt", "link.txt"]


def test_a_sweep_whose_folder_links_its_spec_yaml_to_the_spec_it_reads_is_refused(tmp_path):
    """DIR/spec.yaml, a link to the very spec given, was written through: the user's spec, comments
    and all, became the sweep's dump of it."""
    import yaml

    spec = tmp_path / "my.yaml"
    spec.write_text(
        "# my notes\n"
        + yaml.safe_dump(
            {
                "name": "t",
                "models": ["tiny-mixtral"],
                "policies": ["klotski"],
                "batch_sizes": [2],
                "prompt_lens": [8],
                "gen_lens": [2],
            }
        )
    )
    before = spec.read_text()
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "spec.yaml").symlink_to(spec)
    rc, out, err = run_cli("sweep", str(spec), "--out", str(tmp_path / "out"), "--no-progress")
    assert rc == 2 and err == (
        f"error: --out {tmp_path / 'out' / 'spec.yaml'}: is what this command reads ({spec}); "
        f"writing there would replace it\n"
    ), err
    assert spec.read_text() == before and sorted(p.name for p in (tmp_path / "out").iterdir()) == ["spec.yaml"]


@pytest.mark.parametrize("impl", ["as-published", "ideal"])
def test_every_built_in_compute_op_has_a_category_the_profile_check_knows(impl):
    """What a misspelt category is measured against: the built-in policies' compute categories."""
    from klotski_sim.core.schedule import COMPUTE_CATEGORIES
    from klotski_sim.policies import POLICIES, PolicyInput, build_schedule

    from .test_cpu_experts import cpu_profile
    from .test_pipelines import make_input

    base = make_input(placement=None)
    seen = set()
    built_in = [name for name, info in POLICIES.items() if info.build.__module__.startswith("klotski_sim.")]
    for name in built_in:  # (not those a test registered)
        for options in ({}, {"expert_cache": 2}):
            inp = PolicyInput(base.model, cpu_profile(), base.routing, base.placement, options, base.warmup, impl)
            seen |= {op.category for op in build_schedule(name, inp).ops if op.kind == "compute"}
    assert seen <= set(COMPUTE_CATEGORIES) and {"expert", "attention", "gate", "lm_head", "embed"} <= seen
