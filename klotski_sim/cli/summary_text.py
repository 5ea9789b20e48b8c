"""A simulated run's summary as the commands print it."""

from __future__ import annotations

import re
import sys
from typing import Any

from klotski_sim.core.timeline import OutOfMemory, Summary
from klotski_sim.util.units import duration_text, duration_unit, memory_text


def _device_name(resource: str, on_cpu: bool) -> str:
    """In a CPU run the `gpu` resource is the CPU's compute thread."""
    return "cpu-compute" if on_cpu and resource == "gpu" else resource


def warn_of_routing(source: str) -> None:
    """What a replayed trace's source says the run should not be read without (trace.replay)."""
    for said in re.findall(r"\(((?:WRAPPED|ANOTHER MODEL): [^()]*)\)", source):
        print(f"warning: {said}", file=sys.stderr)


def format_summary(s: Summary) -> str:
    if s.num_ops == 0 and s.oom:  # refused by the memory check: nothing ran
        return "\n".join(
            [
                f"policy      {s.policy}   model {s.model}   hardware {s.hardware}   impl {s.impl}",
                f"workload    n={s.num_batches} x bs={s.batch_size}, prompt {s.prompt_len}, generate "
                f"{s.gen_len} ({s.generated_tokens} tokens)",
                f"status      {s.status}  ({_oom_text(s.oom)})",
            ]
        )
    on_cpu = s.source == "measured" and s.hardware.startswith("cpu")
    device = "CPU" if on_cpu else "GPU"  # a CPU run's "device" is the CPU and its memory host memory
    finished = s.status == "ok"
    # (a run of one generated token has no decode step, nor has one stopped before its first: a "0.0 ms"
    # decode step would read as a measurement)
    decode = (
        f"decode step {duration_text(s.decode_step_s)}, MoE block {duration_text(s.moe_block_s)}"
        if s.decode_s > 0
        else "no decode step"
    )
    # the run's times in the makespan's unit, a tiny run's in ms (0.43 ms of bubbles, not `0.000 s`); a
    # time that would show under two digits there in its own (a long run's 50 us of inter-layer bubbles)
    unit = duration_unit(s.makespan_s)

    def t(seconds: float) -> str:
        return duration_text(seconds, unit)

    lines = [
        f"policy      {s.policy}   model {s.model}   hardware {s.hardware}   impl {s.impl}",
        f"workload    n={s.num_batches} x bs={s.batch_size}, prompt {s.prompt_len}, generate {s.gen_len} "
        f"({s.generated_tokens} tokens)",
        f"status      {s.status}" + (f"  ({_oom_text(s.oom)})" if s.oom else ""),
        # (the two parts add up to the makespan; a batch's own prefill latency is another figure, set after
        # the semicolon so that it does not read as a part)
        f"makespan    {t(s.makespan_s)}   ({'' if finished else 'until it stopped: '}prefill "
        f"{t(s.makespan_s - s.decode_s)} + decode {t(s.decode_s)}; a batch's prefill {t(s.prefill_s)}, {decode})",
        (
            f"throughput  {s.throughput_tok_s:.3f} generated tok/s end to end   "
            + (
                f"{s.decode_throughput_tok_s:.3f} tok/s decode only"
                if s.decode_s > 0
                else "no decode throughput: no decode step"
            )
        )
        if finished
        else "throughput  - (the run did not finish)",
        f"{device} busy    {t(s.gpu_busy_s)}   bubbles {t(s.bubble_s)} "
        f"(inter-layer {t(s.bubble_inter_s)}, intra-layer {t(s.bubble_intra_s)})   "
        f"host blocked {t(s.host_blocked_s)}",
        f"bound       {t(s.lower_bound_s)} on {_device_name(s.lower_bound_resource, on_cpu)}   "
        f"efficiency {f'{s.efficiency:.1%}' if finished else '- (the run did not finish)'}",
        f"peak {'host' if on_cpu else 'GPU'}    {memory_text(s.peak_gpu_bytes)}"
        f"{' (the CPU runtime device store, in host memory)' if on_cpu else ''}   ops {s.num_ops}"
        f"{'' if finished else ' in the schedule (the run stopped before them all)'}",
        "utilisation " + "  ".join(f"{_device_name(r, on_cpu)} {u:.1%}" for r, u in s.utilization.items()),
    ]
    if s.bubble_by_cause:
        lines.append(
            "bubbles by cause "
            + "  ".join(f"{c} {t(v)}" for c, v in sorted(s.bubble_by_cause.items(), key=lambda kv: -kv[1]))
        )
    cache = s.extra.get("expert_cache")
    if cache and s.status == "ok":
        lines.append(
            f"expert cache {cache['slots']} slots ({cache['policy']}): hit rate {cache['hit_rate']:.1%} "
            f"({cache['hits']} hits, {cache['misses']} misses)"
        )
    if "expert_placement" in s.extra:
        placed = s.extra["expert_placement"]
        lines.append(
            f"experts     {placed.get('gpu', 0)} on resident weights, {placed.get('cpu', 0)} on the CPU, "
            f"{placed.get('transfer', 0)} copied over PCIe"
        )
    elif "cpu_experts" in s.extra:
        lines.append(f"experts     {s.extra['cpu_experts']} cold expert ops on the CPU")
    return "\n".join(lines)


def _oom_text(oom: dict[str, Any]) -> str:
    return OutOfMemory.from_dict(oom).describe()


# ---- subcommands ----------------------------------------------------------------------------
