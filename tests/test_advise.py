"""`klotski-sim advise` (klotski_sim/advise/): llama.cpp's placement memory against the buffer sizes
its own logs printed, speeds monotone where they must be, the advised command in llama.cpp's flag
names, and the CLI end to end with its refusals in one line."""

from __future__ import annotations

import json
import shlex
from dataclasses import replace
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from klotski_sim.advise.costs import gpu_node_seconds, llama_cpp_costs
from klotski_sim.advise.llamacpp import LlamaCppFlags, kv_bytes_per_cell, memory, speed
from klotski_sim.advise.search import advise
from klotski_sim.hardware.host_cpu import parse_cpu
from klotski_sim.hardware.profile import load_profile
from klotski_sim.util.errors import UsageError
from klotski_sim.workload.gguf import gguf_sizes
from klotski_sim.workload.model import get_model

from .conftest import run_cli

MIB = 2**20
QWEN = get_model("qwen3-30b-a3b")
QWEN_Q4 = gguf_sizes(QWEN, "Q4_K_M")


def test_layer_offload_holds_what_llama_cpp_printed():
    """ggml-org/llama.cpp#13729 (b5466, Qwen3-30B-A3B-Q4_K_M.gguf, "offloaded 30/49 layers to GPU"):
    `CUDA0 model buffer size = 10750.86 MiB`, `CPU_Mapped model buffer size = 6940.48 MiB`."""
    held = memory(QWEN, QWEN_Q4, LlamaCppFlags(n_gpu_layers=30))
    assert held.gpu_weights / MIB == pytest.approx(10750.86, abs=0.01)
    assert held.host_weights / MIB == pytest.approx(6940.48, abs=0.01)


def test_an_mla_cache_is_its_latent_and_rope_key_in_the_cache_type():
    """ikawrakow/ik_llama.cpp PR #259 (DeepSeek-R1, 61 blocks, 32768 cells, q8_0 c^KV):
    `CUDA0 KV buffer size = 1166.65 MiB`."""
    deepseek = get_model("deepseek-v3")
    assert kv_bytes_per_cell(deepseek, "Q8_0") * 32768 * deepseek.num_layers / MIB == pytest.approx(1166.63, abs=0.05)


def test_n_cpu_moe_moves_experts_only_and_counts_blocks():
    everything = memory(QWEN, QWEN_Q4, LlamaCppFlags())
    ten = memory(QWEN, QWEN_Q4, LlamaCppFlags(n_cpu_moe=10))
    moved = sum(QWEN_Q4.experts[:10])
    assert everything.gpu - ten.gpu == pytest.approx(moved) and ten.host - everything.host == pytest.approx(moved)
    assert ten.gpu_kv == everything.gpu_kv  # (the KV cache stays with its block)
    deepseek = get_model("deepseek-v3")  # (its first 3 blocks are dense: --n-cpu-moe 3 moves nothing)
    sizes = gguf_sizes(deepseek, "Q4_K_M")
    assert memory(deepseek, sizes, LlamaCppFlags(n_cpu_moe=3)).gpu == memory(deepseek, sizes, LlamaCppFlags()).gpu


HOST = parse_cpu("ryzen-9-7950x", 128)
GPU = load_profile("rtx4090")


@settings(max_examples=25, deadline=None)
@given(st.integers(0, QWEN.num_layers - 1), st.floats(20.0, 400.0))
def test_generation_is_faster_with_more_bandwidth_and_with_more_blocks_experts_on_the_gpu(n, gb_s):
    costs = llama_cpp_costs(GPU, HOST)
    slow = replace(HOST, measured_bandwidth=gb_s * 1e9)
    fast = replace(HOST, measured_bandwidth=gb_s * 1.5e9)
    flags = LlamaCppFlags(n_cpu_moe=n + 1)
    assert (
        speed(QWEN, QWEN_Q4, flags, GPU, fast, costs).generation_tok_s
        >= speed(QWEN, QWEN_Q4, flags, GPU, slow, costs).generation_tok_s
    )
    fewer_on_cpu = replace(flags, n_cpu_moe=n)
    assert (
        speed(QWEN, QWEN_Q4, fewer_on_cpu, GPU, slow, costs).generation_tok_s
        >= speed(QWEN, QWEN_Q4, flags, GPU, slow, costs).generation_tok_s
    )


def test_the_costs_come_from_their_components():
    # (PR #6766's two cards leave 4.2 and 5.0 us a node beyond LLaMA-2-7B's weight reads)
    assert 3e-6 < gpu_node_seconds() < 6e-6
    costs = llama_cpp_costs(GPU, HOST)
    assert costs.cpu_node_s == pytest.approx(1039.47e-9)
    assert costs.split_s == pytest.approx(GPU.gpu.host_sync_latency_s + GPU.links.pcie_h2d.latency_s)


# llama.cpp's flag names (common/arg.cpp; llama-bench's own parser)
SERVER_FLAGS = {"-m", "-ngl", "--n-cpu-moe", "-c", "-fa", "-ub", "-b", "-ctk", "-ctv", "-t", "--no-op-offload"}
BENCH_FLAGS = {"-m", "-ngl", "--n-cpu-moe", "-p", "-n", "-ub", "-fa", "-ctk", "-ctv", "-t"}


@pytest.mark.parametrize("tool,known", [("llama-server", SERVER_FLAGS), ("llama-bench", BENCH_FLAGS)])
def test_the_advised_command_uses_llama_cpps_flag_names(tool, known):
    flags = LlamaCppFlags(n_cpu_moe=12, cache_type="Q8_0", threads=8, op_offload=False)
    words = shlex.split(flags.command("m.gguf", tool))
    assert words[0] == tool
    used = {w for w in words[1:] if w.startswith("-")}
    assert used <= known


def test_advise_picks_the_fastest_placement_that_fits_and_says_why_not_fewer():
    small_gpu = load_profile("rtx2080")
    found = advise(QWEN, QWEN_Q4, small_gpu, HOST, llama_cpp_costs(small_gpu, HOST), LlamaCppFlags())
    best = found.best
    assert best.speed is not None and best.memory.gpu <= small_gpu.gpu.usable_bytes
    fitting = [o for o in found.options if o.speed is not None]
    assert best.speed.generation_tok_s == max(o.speed.generation_tok_s for o in fitting if o.speed)
    before = found.options[found.options.index(best) - 1]
    assert before.speed is None and "GPU would hold" in before.refused
    assert "GPU would hold" in found.why_not_more()


def test_a_model_that_fits_nowhere_is_refused_with_the_numbers():
    tiny_host = parse_cpu("cores=8,isa=avx2,channels=2,mts=3200,ram=16")
    deepseek = get_model("deepseek-v3")
    with pytest.raises(UsageError, match=r"fits no placement .* GiB"):
        advise(
            deepseek, gguf_sizes(deepseek, "Q4_K_M"), GPU, tiny_host, llama_cpp_costs(GPU, tiny_host), LlamaCppFlags()
        )


def test_the_cli_prints_the_table_the_best_and_its_command():
    code, out, err = run_cli(
        "advise", "--model", "qwen3-30b-a3b@Q4_K_M", "--gpu", "rtx2080,rtx4090", "--cpu", "ryzen-9-7950x", "--ram", "64"
    )
    assert code == 0, err
    assert "<- best" in out and "llama-server -m qwen3-30b-a3b-Q4_K_M.gguf" in out and "best of each" in out
    assert "17.28 GiB" in out  # (the file's size)


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--model", "qwen3-30b-a3b"], "--model qwen3-30b-a3b: give MODEL@TYPE"),
        (["--model", "nope@Q4_K_M"], "nope"),
        (["--gpu", "rtx9999"], "--gpu"),
        (["--cpu", "cores=8,isa=sse2,channels=2,mts=3200"], "isa=sse2"),
        (["--cpu", "cores=8,channels=2,mts=3200"], "missing isa"),
        (["--cpu", "cores=x,isa=avx2,channels=2,mts=3200"], "cores='x' is not a number"),
        (["--cpu", "ryzen-9-7950x", "--ram", "0"], "--ram"),
        (["--cpu", "no-such-cpu"], "not a preset"),
    ],
)
def test_bad_input_is_one_line_naming_the_flag(args, message):
    base = {"--model": "qwen3-30b-a3b@Q4_K_M", "--gpu": "rtx4090", "--cpu": "ryzen-9-7950x", "--ram": "64"}
    given_flags = dict(zip(args[::2], args[1::2]))
    merged = {**base, **given_flags}
    argv = ["advise"] + [x for kv in merged.items() for x in kv]
    code, out, err = run_cli(*argv)
    assert code == 2 and message in err, (code, err)
    assert len(err.strip().splitlines()) == 1


def test_ktransformers_keeps_every_routed_expert_on_the_cpu_once_per_numa_node():
    from klotski_sim.advise.ktransformers import kt_option

    deepseek = get_model("deepseek-v3")
    sizes = gguf_sizes(deepseek, "Q4_K_M")
    one, two = parse_cpu("xeon-gold-6454s", 1024), parse_cpu("2x-xeon-gold-6454s", 1024)
    single = kt_option(deepseek, sizes, GPU, one, llama_cpp_costs(GPU, one), 4096, "m.gguf")
    dual = kt_option(deepseek, sizes, GPU, two, llama_cpp_costs(GPU, two), 4096, "m.gguf")
    assert single.decode_s and dual.decode_s and dual.generation_tok_s > single.generation_tok_s
    assert dual.host_bytes - sizes.token_embd == pytest.approx(2 * (single.host_bytes - sizes.token_embd))
    assert single.gpu_bytes < GPU.gpu.usable_bytes and "USE_NUMA=1" in dual.command and "--cpu_infer 65" in dual.command
    small = parse_cpu("xeon-gold-6454s", 256)
    assert "host would hold" in kt_option(deepseek, sizes, GPU, small, llama_cpp_costs(GPU, small), 4096, "m").refused


def test_ktransformers_operator_call_is_the_fixed_part_of_its_own_benchmark():
    """The line through KTransformers' operator benchmark (time a layer against bytes read) holds all
    nine weight types within 5%; its fixed part is charged once a MoE block, its slope is left to
    the host's read rate."""
    from klotski_sim.advise.ktransformers import (
        OPERATOR_BENCH,
        OPERATOR_BENCH_WEIGHTS,
        OPERATOR_CALL_S,
        _operator_fit,
        decode_parts,
    )

    rate, fixed = _operator_fit()
    assert fixed == OPERATOR_CALL_S and 1.3e-4 < fixed < 1.7e-4 and 2.2e11 < rate < 2.6e11
    for name, bytes_per_weight, seconds in OPERATOR_BENCH:
        assert fixed + bytes_per_weight * OPERATOR_BENCH_WEIGHTS / rate == pytest.approx(seconds, rel=0.05), name
    deepseek = get_model("deepseek-v3")
    sizes = gguf_sizes(deepseek, "Q4_K_M")
    host = parse_cpu("xeon-gold-6454s", 1024)
    costs = llama_cpp_costs(GPU, host)
    one = decode_parts(deepseek, sizes, GPU, host, costs, 64)["cpu experts (shared ones beside them)"]
    k = deepseek.top_k
    reads = sum(k * sizes.expert_bytes(layer) / host.read_bandwidth for layer in deepseek.moe_layers)
    assert one == pytest.approx(reads + len(deepseek.moe_layers) * (2 * costs.split_s + OPERATOR_CALL_S))


def test_llama_cpp_reads_its_one_copy_at_one_numa_nodes_rate():
    two = parse_cpu("2x-xeon-gold-6454s", 1024)
    one = replace(two, numa=1)
    flags = LlamaCppFlags(n_cpu_moe=QWEN.num_layers)
    parts_two = speed(QWEN, QWEN_Q4, flags, GPU, two, llama_cpp_costs(GPU, two)).parts
    parts_one = speed(QWEN, QWEN_Q4, flags, GPU, one, llama_cpp_costs(GPU, one)).parts
    assert parts_two["cpu bytes"] == pytest.approx(2 * parts_one["cpu bytes"])


@pytest.mark.parametrize(
    ("pattern", "blocks"),
    [
        # carteakey/lllms docs/bench-results.md: "keeps blk 0-4 fully in VRAM ... spills blk 5-36 experts to CPU"
        (r"blk\.(5|[6-9]|[0-9][0-9]|[0-9][0-9][0-9])\.ffn_(up|down|gate)_(ch|)exps=CPU", set(range(5, 36))),
        ("exps=CPU", set(range(36))),  # (ik_llama.cpp PR #829's -ot exps=CPU)
        (r"\.ffn_.*_exps.=CPU", set(range(36))),
        (r"blk\.1[0-9]\.ffn_.*_exps=CUDA0,exps=CPU", set(range(36)) - set(range(10, 20))),  # (the first match wins)
    ],
)
def test_an_override_keeps_the_blocks_its_pattern_names_on_the_cpu(pattern, blocks):
    from klotski_sim.advise.llamacpp import override_blocks

    assert override_blocks(get_model("gpt-oss-120b"), pattern) == blocks


@pytest.mark.parametrize(
    ("pattern", "message"),
    [
        (r"blk\.3\.ffn_up_exps=CPU", "some of block 3's expert tensors"),
        (r"blk\.3\.=CPU", "non-expert tensors"),
        ("(=CPU", "not a regular expression"),
        ("exps", "not PATTERN=BUFFER"),
        (r"(.*.*)*$x=CPU", "backtracks without end"),  # (catastrophic backtracking: stopped, not hung)
    ],
)
def test_an_override_advise_cannot_price_is_refused_in_one_line(pattern, message):
    code, _, err = run_cli("advise", "--model", "qwen3-30b-a3b@Q4_K_M", "--gpu", "rtx4090", "--cpu", "ryzen-9-7950x",
                           "--ram", "64", "--ot", pattern)  # fmt: skip
    assert code == 2 and message in err and len(err.strip().splitlines()) == 1


def test_a_prompt_the_cpu_would_compute_is_not_priced():
    flags = LlamaCppFlags(n_cpu_moe=10, op_offload=False)
    costs = llama_cpp_costs(GPU, HOST)
    assert speed(QWEN, QWEN_Q4, flags, GPU, HOST, costs).prompt_tok_s is None
    small = speed(QWEN, QWEN_Q4, LlamaCppFlags(n_cpu_moe=10, ubatch=31), GPU, HOST, costs)
    assert small.prompt_tok_s is None and small.generation_tok_s > 0
    # (every block's experts on the GPU: nothing for the CPU to compute, any ubatch)
    assert speed(QWEN, QWEN_Q4, LlamaCppFlags(ubatch=16), GPU, HOST, costs).prompt_tok_s
    code, _, err = run_cli("advise", "--model", "qwen3-30b-a3b@Q4_K_M", "--gpu", "rtx2080", "--cpu", "ryzen-9-7950x",
                           "--ram", "64", "--no-op-offload", "--goal", "prompt")  # fmt: skip
    assert code == 2 and "--goal prompt: with --no-op-offload the CPU computes" in err


def test_gpus_add_up_over_repeated_flags_and_hosts_are_each_given_once():
    code, out, err = run_cli("advise", "--model", "qwen3-30b-a3b@Q4_K_M", "--gpu", "rtx2080", "--gpu", "rtx4090",
                             "--cpu", "ryzen-9-7950x", "--ram", "64")  # fmt: skip
    assert code == 0 and "RTX 2080" in out and "RTX 4090" in out, err
    for args, message in (
        (["--gpu", "rtx2080", "--gpu", "rtx2080"], "rtx2080 is given twice"),
        (["--cpu", "ryzen-9-7950x", "--cpu", "ryzen-9-7950x"], "given twice"),
        (["--cpu", "ryzen-9-7950x,i9-10900x"], "repeat --cpu"),
        (["--prompt-len", "4000", "--gen-len", "200"], "more than the context (--ctx 4096)"),
        (["--ram", "1e9"], "--ram"),
        (["--cpu", "cores=8,isa=avx2,channels=2,mts=3200,bw=500"], "above the channels' peak"),
    ):
        base = {"--model": "qwen3-30b-a3b@Q4_K_M", "--gpu": "rtx4090", "--cpu": "ryzen-9-7950x", "--ram": "64"}
        flags = [x for k, v in base.items() if k not in args for x in (k, v)]
        code, _, err = run_cli("advise", *flags, *args)
        assert code == 2 and message in err and len(err.strip().splitlines()) == 1, (args, err)


def test_fitting_nowhere_names_the_closest_placement_and_what_is_short():
    code, out, err = run_cli("advise", "--model", "qwen3-30b-a3b@Q4_K_M", "--gpu", "rtx3090", "--cpu", "ryzen-9-7950x",
                             "--ram", "64", "--ctx", "262144")  # fmt: skip
    assert code == 3, err
    assert "the closest, --n-cpu-moe 48" in out and "the GPU is short" in out


# ---- what a user types: any --cpu description or --model text is priced or refused in one line --------------
CPU_FIELDS = st.sampled_from(["cores", "isa", "channels", "mts", "numa", "ram", "bw", "name", "x", ""])
CPU_VALUES = st.one_of(
    st.integers(-3, 100000).map(str), st.floats(allow_nan=True, allow_infinity=True).map(str),
    st.sampled_from(["avx2", "avx512", "amx", "sse", "", "1e9", "nan", "=", ","]), st.text(max_size=6),
)  # fmt: skip


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(CPU_FIELDS, CPU_VALUES), min_size=1, max_size=6))
def test_any_cpu_description_is_priced_or_refused_in_one_line(pairs):
    text = ",".join(f"{k}={v}" for k, v in pairs)
    code, out, err = run_cli(
        "advise", "--model", "qwen3-30b-a3b@Q4_K_M", "--gpu", "rtx4090", "--cpu", text, "--ram", "64"
    )
    assert code in (0, 2, 3), err
    assert code == 0 or code == 3 or (len(err.strip().splitlines()) == 1 and err.startswith("error: ")), err


@settings(max_examples=40, deadline=None)
@given(st.text(max_size=24))
def test_any_model_text_is_priced_or_refused_in_one_line(text):
    code, _, err = run_cli("advise", "--model", text, "--gpu", "rtx4090", "--cpu", "ryzen-9-7950x", "--ram", "64")
    assert code in (0, 2, 3), err
    assert code != 2 or (len(err.strip().splitlines()) == 1 and err.startswith("error: ")), err


def test_the_json_holds_every_row_the_table_prices(tmp_path):
    out = tmp_path / "advice.json"
    code, text, err = run_cli("advise", "--model", "qwen3-30b-a3b@Q4_K_M", "--gpu", "rtx2080", "--cpu", "ryzen-9-7950x",
                              "--ram", "64", "--json", str(out))  # fmt: skip
    assert code == 0, err
    report = json.loads(out.read_text())
    (run,) = report["runs"]
    assert len(run["options"]) == QWEN.num_layers + 1 and report["file_bytes"] == QWEN_Q4.total
    best = run["options"][run["best"]]
    assert f"--n-cpu-moe {run['best']}: {best['generation_tok_s']:.1f} tok/s generated" in text
    assert all(o["generation_tok_s"] is None for o in run["options"] if o["refused"])
    link = tmp_path / "link.json"
    link.symlink_to(tmp_path / "elsewhere.json")
    code, _, err = run_cli("advise", "--model", "qwen3-30b-a3b@Q4_K_M", "--gpu", "rtx2080", "--cpu", "ryzen-9-7950x",
                           "--ram", "64", "--json", str(link))  # fmt: skip
    assert code == 2 and "--json" in err and not (tmp_path / "elsewhere.json").exists()


def test_few_cores_make_the_cpu_experts_compute_bound_type_by_type():
    assert all(sum(b for _, b in by_type) == e for by_type, e in zip(QWEN_Q4.expert_type_bytes, QWEN_Q4.experts))
    assert {t for t, _ in QWEN_Q4.expert_type_bytes[0]} == {"Q4_K", "Q6_K"}  # (down in Q6_K where use_more_bits)
    flags = LlamaCppFlags(n_cpu_moe=QWEN.num_layers)
    rates = []
    for cores in (1, 2, 4, 16):
        host = parse_cpu(f"cores={cores},isa=avx512,channels=2,mts=6000,ram=64")
        rates.append(speed(QWEN, QWEN_Q4, flags, GPU, host, llama_cpp_costs(GPU, host)).generation_tok_s)
    assert rates[0] < rates[1] < rates[2] == rates[3]  # (four Zen 4 threads outrun dual-channel DDR5)
    # MXFP4 has no measured thread rate: gpt-oss's experts on one core are priced by DRAM alone
    oss = get_model("gpt-oss-20b")
    sizes = gguf_sizes(oss, "MXFP4_MOE")
    one, many = (parse_cpu(f"cores={c},isa=avx512,channels=2,mts=6000,ram=64") for c in (1, 16))
    every = LlamaCppFlags(n_cpu_moe=oss.num_layers)
    assert speed(oss, sizes, every, GPU, one, llama_cpp_costs(GPU, one)).parts["cpu bytes"] == pytest.approx(
        speed(oss, sizes, every, GPU, many, llama_cpp_costs(GPU, many)).parts["cpu bytes"]
    )


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--ot", r"blk\.0\.ffn_.*_exps=CUDA1"], "buffer 'CUDA1'"),
        (["--ot", "blk\\.1\\.ffn_.*_exps=CPU\n"], "control character"),
        (["--ot", "(" * 500 + ")" * 500 + "=CPU"], "nested too deeply"),
        (["--ot", "a" * 5000 + "=CPU"], "at most 4,096"),
        (["--cpu", "cores=1,isa=avx2,channels=1,mts=800,numa=16"], "more NUMA nodes"),
        (["--cpu", "cores=8,isa=avx2,channels=2,mts=3200,name="], "name= must be printable"),
        (["--ram", "2"], "no more than the 4 GiB advise leaves"),
        (["--gpu", "klotski_sim/hardware/profiles/rtx4090.yaml", "--json", "klotski_sim/hardware/profiles/rtx4090.yaml"],
         "--json"),
    ],
)  # fmt: skip
def test_what_a_hostile_battery_found_is_refused_in_one_line(args, message):
    base = {"--model": "qwen3-30b-a3b@Q4_K_M", "--gpu": "rtx4090", "--cpu": "ryzen-9-7950x", "--ram": "64"}
    given = dict(zip(args[::2], args[1::2]))
    argv = [x for k, v in {**base, **given}.items() for x in (k, v)]
    code, _, err = run_cli("advise", *argv)
    assert code == 2 and message in err and len(err.strip().splitlines()) == 1, err


def test_repeated_ot_flags_add_up_and_a_descriptions_ram_comes_first():
    code, out, err = run_cli("advise", "--model", "qwen3-30b-a3b@Q4_K_M", "--gpu", "rtx4090", "--cpu", "ryzen-9-7950x",
                             "--ram", "64", "--ot", r"blk\.1\.ffn_.*_exps=CPU", "--ot", r"blk\.2\.ffn_.*_exps=CPU")  # fmt: skip
    assert code == 0 and "your -ot (2 blocks' experts on the CPU)" in out, err
    assert parse_cpu("cores=16,isa=avx512,channels=2,mts=6000,ram=64", ram_gib=8).ram_bytes == 64 * 2**30


@pytest.mark.parametrize(
    "text", ["[" * 100000 + "]" * 100000, '{"model_type": "mixtral", "vocab_size": ' + "9" * 5000 + "}"]
)
def test_a_model_config_nested_too_deeply_or_with_a_huge_number_is_one_line(tmp_path, text):
    path = tmp_path / "config.json"
    path.write_text(text)
    code, _, err = run_cli("advise", "--model", f"{path}@Q4_K_M", "--gpu", "rtx4090", "--cpu", "ryzen-9-7950x",
                           "--ram", "64")  # fmt: skip
    assert code == 2 and "not a JSON config" in err and len(err.strip().splitlines()) == 1, err


def test_an_over_long_output_name_and_a_profile_named_twice_are_one_line(tmp_path):
    profile = tmp_path / "p.yaml"
    profile.write_text((Path(__file__).parents[1] / "klotski_sim/hardware/profiles/rtx4090.yaml").read_text())
    base = ["advise", "--model", "tiny-mixtral@Q4_K_M", "--cpu", "i9-10900x", "--ram", "64"]
    code, _, err = run_cli(*base, "--gpu", "rtx4090", "--json", str(tmp_path / ("a" * 300 + ".json")))
    assert code == 2 and err.startswith("error: --json ") and "too long" in err and len(err.splitlines()) == 1
    code, _, err = run_cli(*base, "--gpu", f"{profile},{tmp_path}/../{tmp_path.name}/p.yaml")
    assert code == 2 and "is given twice" in err, err
