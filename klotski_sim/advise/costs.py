"""llama.cpp's fixed costs, each derived from a component measurement — never from the MoE runs
that docs/fidelity-llamacpp.md checks the predictions against.

- A CPU graph node: one `ggml_barrier` of the thread pool (ggml-cpu.c runs one after every node
  that is not a view). ggml's `test-barrier` benchmark, a tiny Q4_0 matmul per node, 8 threads:
  1039.47 ns a node on an i9-13900K (ggml-org/llama.cpp PR #9461), 3039-3159 ns on an EPYC
  (PR #9598). Desktops take the first, servers (8 memory channels and more) the second.
- A split (the hidden state handed between the GPU and the CPU backend): a blocking
  synchronise after a small kernel plus one copy's launch, the profile's `gpu.host_sync_latency_s`
  and `links.pcie_h2d.latency_s`.
- A GPU graph node in decode: what a dense model's decode takes beyond reading its weights, per
  node. LLaMA-2-7B q4_0 `./main` tg with CUDA graphs (PR #6766, JohannesGaessler's table):
  146.81 tok/s on an RTX 4090, 128.27 on an RTX 3090. Its weights (6.74e9 parameters in Q4_0's 4.5
  bits) read at each profile's effective bandwidth leave 2.68 and 3.24 ms a token over its
  643 nodes (32 blocks of ATTENTION_NODES + DENSE_NODES, and the head's 3): 4.2 and 5.0 us a node;
  their mean.
- What one CPU thread processes of each weight type in decode (its vec_dot, compute-bound: below the
  thread count that saturates DRAM): a Ryzen-7950X's mainline llama.cpp (build 3441) tg128 of
  LLaMA-3-8B at 2 threads, file size x tok/s over 2 (ikawrakow/ik_llama.cpp README @25ade245, its
  per-type thread sweep): Q8_0 20.0, Q6_K 23.1, Q5_K 19.4, Q4_K 20.9, Q3_K 14.6, Q2_K 15.7, Q4_0 13.8,
  Q5_0 13.9, IQ4_XS 16.7, IQ4_NL 12.0, IQ2_XXS 5.9, F16 27.2 GiB/s. One Zen 4 core's figures, taken
  for every host's cores (an older or AVX2-only core is slower); no MXFP4 figure was found, so MXFP4
  is priced by DRAM alone.
"""

from __future__ import annotations

from functools import cache

from klotski_sim.advise.llamacpp import ATTENTION_NODES, DENSE_NODES, LlamaCppCosts
from klotski_sim.hardware.host_cpu import HostCpu
from klotski_sim.hardware.profile import HardwareProfile, load_profile
from klotski_sim.workload.gguf import GGML_TYPES

BARRIER_DESKTOP_S = 1039.47e-9  # PR #9461, i9-13900K, 8 threads
BARRIER_SERVER_S = 3039.05e-9  # PR #9598, EPYC, 8 threads (the threadpool build's row)
SERVER_CHANNELS = 8

LLAMA2_7B_PARAMS = 6.74e9  # the LLaMA 2 paper's 7B (llama-bench prints 6.74 B)
LLAMA2_7B_NODES = 32 * (ATTENTION_NODES + DENSE_NODES) + 3
CUDA_GRAPHS_TG = {"rtx4090": 146.81, "rtx3090": 128.27}  # PR #6766, tok/s with CUDA graphs


# bytes of weights one thread's vec_dot processes a second, by ggml type (module docstring)
CPU_THREAD_RATES = {
    name: gib * 2**30
    for name, gib in (
        ("Q8_0", 20.0), ("Q6_K", 23.1), ("Q5_K", 19.4), ("Q4_K", 20.9), ("Q3_K", 14.6), ("Q2_K", 15.7),
        ("Q4_0", 13.8), ("Q5_0", 13.9), ("IQ4_XS", 16.7), ("IQ4_NL", 12.0), ("IQ2_XXS", 5.9), ("F16", 27.2),
    )
}  # fmt: skip


@cache
def gpu_node_seconds() -> float:
    """Per GPU node: the two cards' gap beyond the weights' reads, over the nodes, averaged."""
    weights = LLAMA2_7B_PARAMS * GGML_TYPES["Q4_0"].bits_per_weight / 8
    gaps = []
    for name, tok_s in CUDA_GRAPHS_TG.items():
        gpu = load_profile(name).gpu
        gaps.append((1 / tok_s - weights / (gpu.memory_bandwidth * gpu.memory_efficiency)) / LLAMA2_7B_NODES)
    return sum(gaps) / len(gaps)


def llama_cpp_costs(gpu: HardwareProfile, host: HostCpu) -> LlamaCppCosts:
    """The fixed costs of llama.cpp on this GPU and host (module docstring)."""
    server = host.channels >= SERVER_CHANNELS
    return LlamaCppCosts(
        cpu_node_s=BARRIER_SERVER_S if server else BARRIER_DESKTOP_S,
        split_s=gpu.gpu.host_sync_latency_s + gpu.links.pcie_h2d.latency_s,
        gpu_node_s=gpu_node_seconds(),
        cpu_thread_rates=CPU_THREAD_RATES,
        sources=(
            "CPU node: ggml test-barrier, PR #9598 (EPYC)"
            if server
            else "CPU node: ggml test-barrier, PR #9461 (i9-13900K)",
            f"split: {gpu.name}'s gpu.host_sync_latency_s + links.pcie_h2d.latency_s",
            "GPU node: LLaMA-2-7B q4_0 with CUDA graphs, PR #6766",
            "CPU thread rates by type: a Ryzen-7950X's llama.cpp thread sweep (ik_llama.cpp README)",
        ),
    )
