"""`klotski-runtime calibrate --cpu-only` (klotski_runtime/cpu_probe.py): the host's cores and ISA read
from /proc/cpuinfo's text, its rates measured, and its spec line one that `advise --cpu` takes."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from klotski_runtime.cpu_probe import cpu_isa, probe_cpu, read_cpuinfo  # noqa: E402
from klotski_sim.hardware.host_cpu import parse_cpu  # noqa: E402

from .conftest import runtime_in_process  # noqa: E402

# two sockets of two cores with two threads each (hyper-threading: four logical CPUs a socket)
CPUINFO = "\n\n".join(
    f"processor\t: {i}\nphysical id\t: {i // 4}\ncore id\t\t: {i % 2}\nflags\t\t: fpu sse2 avx2 avx512f amx_tile"
    for i in range(8)
)


def test_cores_are_distinct_socket_and_core_pairs_and_the_isa_the_widest_flag():
    cores, flags = read_cpuinfo(CPUINFO)
    assert cores == 4 and cpu_isa(flags) == "amx"
    assert cpu_isa({"avx2", "avx512f"}) == "avx512" and cpu_isa({"avx2"}) == "avx2"


def test_the_probe_measures_positive_rates_and_its_line_is_an_advise_host():
    found = probe_cpu(array_bytes=64 << 20, rounds=2, threads=1)
    assert found.read_bytes_per_s > 0 and found.gemv_bytes_per_s > 0 and found.gemm_flops > 0
    host = parse_cpu(found.spec_line(), ram_gib=16)
    assert host.read_bandwidth == pytest.approx(round(found.read_bytes_per_s / 1e8) * 1e8, rel=1e-6)
    assert host.cores == found.cores and host.isa == found.isa


def test_the_command_prints_the_line_and_writes_it(tmp_path):
    out = tmp_path / "host.txt"
    code, text, err = runtime_in_process("calibrate", "--cpu-only", "--threads", "1", "--out", str(out))
    assert code == 0, err
    line = out.read_text().strip()
    assert f"--cpu {line}    (this host for klotski-sim advise" in text and parse_cpu(line)
    code, _, err = runtime_in_process("calibrate", "--cpu-only", "--model", "tiny-mixtral")
    assert code == 2 and "--cpu-only measures the host's CPU" in err
    code, _, err = runtime_in_process("calibrate", "--device", "cpu")
    assert code == 2 and "--out FILE" in err
