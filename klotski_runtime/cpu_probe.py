"""`klotski-runtime calibrate --cpu-only`: this host's CPU as `advise --cpu` takes it, measured in
well under a minute — its cores and vector ISA (read from /proc/cpuinfo), its installed memory
(/proc/meminfo), and what it streams from DRAM and computes:

- read bandwidth: a sum over an array far larger than the caches, all threads; the fastest of
  interleaved rounds (a shared machine's other load only ever slows a round: the minimum is the
  machine's own figure, as `calibrate`'s probes take it);
- matrix-vector bytes/s: a float32 weight matrix times a vector, what a decode step's expert does,
  by weight bytes read;
- matrix-matrix FLOP/s: a float32 GEMM, what a prompt's expert does.

The read bandwidth is the `bw=` of the spec line it prints; the other two are printed beside it
for the user to compare (llama.cpp's quantised kernels are not torch's, so they are not used as
ggml's rates)."""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch

from klotski_sim.util.machine import available_cores

from .threads import cpu_threads


@dataclass(frozen=True)
class CpuProbe:
    """What was read and measured of this host."""

    cores: int  # physical cores this process may use
    isa: str  # amx | avx512 | avx2 (the widest the CPU has)
    ram_gib: float
    read_bytes_per_s: float
    gemv_bytes_per_s: float
    gemm_flops: float
    threads: int

    def spec_line(self) -> str:
        """The host as `klotski-sim advise --cpu` takes it."""
        return f"cores={self.cores},isa={self.isa},bw={self.read_bytes_per_s / 1e9:.1f},ram={self.ram_gib:.0f}"


def cpu_isa(flags: set[str]) -> str:
    """The widest of the ISAs advise knows that the CPU's flags show."""
    if "amx_tile" in flags:
        return "amx"
    if "avx512f" in flags:
        return "avx512"
    return "avx2"


def read_cpuinfo(text: str) -> tuple[int, set[str]]:
    """Physical cores (distinct physical id / core id pairs) and the flags of /proc/cpuinfo's text."""
    cores: set[tuple[str, str]] = set()
    flags: set[str] = set()
    physical = core = ""
    for line in text.splitlines():
        key, _, value = line.partition(":")
        key, value = key.strip(), value.strip()
        if key == "physical id":
            physical = value
        elif key == "core id":
            core = value
            cores.add((physical, core))
        elif key == "flags" and not flags:
            flags = set(value.split())
    return len(cores), flags


def _fastest(work: Callable[[], None], rounds: int) -> float:
    """Seconds of the fastest of `rounds` runs of `work` (after one warm-up)."""
    work()
    best = float("inf")
    for _ in range(rounds):
        start = time.perf_counter()
        work()
        best = min(best, time.perf_counter() - start)
    return best


def probe_cpu(array_bytes: int = 1 << 30, rounds: int = 5, threads: int | None = None) -> CpuProbe:
    """Read, measure and return this host's CPU (module docstring)."""
    try:
        cores, flags = read_cpuinfo(Path("/proc/cpuinfo").read_text())
    except OSError:
        cores, flags = 0, set()
    usable = available_cores()
    cores = min(cores, usable) if cores else usable
    try:
        total_kb = next(
            int(line.split()[1])
            for line in Path("/proc/meminfo").read_text().splitlines()
            if line.startswith("MemTotal:")
        )
    except (OSError, StopIteration, ValueError):
        total_kb = 0
    threads = threads or cores
    with cpu_threads(threads):
        big = torch.ones(array_bytes // 4, dtype=torch.float32)
        read_s = _fastest(lambda: big.sum().item(), rounds)
        big = torch.empty(0)  # (the array freed before the next probe allocates)
        weights, vector = torch.rand(8192, 8192), torch.rand(8192)
        gemv_s = _fastest(lambda: torch.mv(weights, vector), rounds)
        a, b = torch.rand(1024, 1024), torch.rand(1024, 1024)
        gemm_s = _fastest(lambda: torch.mm(a, b), rounds)
    return CpuProbe(
        cores=cores,
        isa=cpu_isa(flags),
        ram_gib=total_kb / 2**20,
        read_bytes_per_s=array_bytes / read_s,
        gemv_bytes_per_s=8192 * 8192 * 4 / gemv_s,
        gemm_flops=2 * 1024**3 / gemm_s,
        threads=threads,
    )
