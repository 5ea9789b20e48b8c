"""Why a CPU expert runs slower inside a GPU run than in calibration: the thread that issues GPU work.

The CUDA executor's issuing thread waits for GPU work in CUDA event synchronisations, which spin on a
core. A CPU expert's bf16 GEMM runs on an OpenMP team of torch's threads; a team as large as the core
count shares one core with the spinning thread, and every parallel region waits for its slowest
member. This times one Mixtral-8x7B-shaped expert on the host CPU (16 tokens, bf16) with torch's
threads at every core and at every core but one, alone and beside a thread spinning in
`torch.cuda.Event.synchronize` on a long GPU kernel (without a GPU: a Python thread spinning on a
core, which is what the event wait amounts to for the CPU). Ratios are measured in one run.

    python experiments/cpu_expert_contention.py [--tokens 16] [--repeats 7] [--quick]
"""

from __future__ import annotations

import argparse
import statistics
import threading
import time

import torch

from klotski_runtime import kernels
from klotski_sim.util.machine import available_cores

HIDDEN, FFN = 4096, 14336  # Mixtral-8x7B's expert (KLOTSKI.md, model table)


def spinning_waiter(stop: threading.Event) -> None:
    """Waits on GPU work the way the executor's issuing thread does, until `stop`."""
    if not torch.cuda.is_available():
        while not stop.is_set():
            pass
        return
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    while not stop.is_set():
        for _ in range(20):
            a = a @ a * 1e-4  # ~ms of GPU work per product
        done = torch.cuda.Event()
        done.record()
        done.synchronize()


def time_expert(weights: tuple[torch.Tensor, ...], x: torch.Tensor, repeats: int) -> float:
    kernels.expert(x, weights)  # warm-up
    samples = []
    for _ in range(repeats):
        t = time.perf_counter()
        kernels.expert(x, weights)
        samples.append(time.perf_counter() - t)
    return statistics.median(samples)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--quick", action="store_true", help="an expert 1/8 the size, 3 repeats: a check")
    args = parser.parse_args()
    hidden, ffn = (HIDDEN // 8, FFN // 8) if args.quick else (HIDDEN, FFN)
    repeats = 3 if args.quick else args.repeats
    cores = available_cores()
    dt = torch.bfloat16
    weights = (
        torch.randn(ffn, hidden, dtype=dt) * 0.02,
        torch.randn(ffn, hidden, dtype=dt) * 0.02,
        torch.randn(hidden, ffn, dtype=dt) * 0.02,
    )
    x = torch.randn(args.tokens, hidden, dtype=dt)
    rows = []
    for threads in sorted({cores, max(1, cores - 1)}, reverse=True):
        torch.set_num_threads(threads)
        alone = time_expert(weights, x, repeats)
        stop = threading.Event()
        waiter = threading.Thread(target=spinning_waiter, args=(stop,), daemon=True)
        waiter.start()
        time.sleep(0.5)
        busy = time_expert(weights, x, repeats)
        stop.set()
        waiter.join()
        rows.append((threads, alone, busy))
    shape = "1/8 of Mixtral-8x7B's" if args.quick else "Mixtral-8x7B"
    waiter = "a CUDA event wait" if torch.cuda.is_available() else "a Python busy loop (no GPU)"
    print(
        f"CPU expert, {args.tokens} tokens, {shape} shapes, bf16; {cores} cores; median of {repeats}; waiter: {waiter}"
    )
    print(f"{'torch threads':>14} {'alone ms':>9} {'beside a spinning waiter ms':>28} {'ratio':>6}")
    for threads, alone, busy in rows:
        print(f"{threads:>14} {alone * 1e3:>9.2f} {busy * 1e3:>28.2f} {busy / alone:>6.2f}")


if __name__ == "__main__":
    main()
