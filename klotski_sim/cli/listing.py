"""`klotski-sim models`, `policies` and `profiles`: what is built in."""

from __future__ import annotations

import argparse
import json
from dataclasses import asdict
from typing import Any, Sequence

from klotski_sim.hardware.profile import builtin_profile_names, load_profile
from klotski_sim.policies import POLICIES, get_policy
from klotski_sim.policies.options import specs_of
from klotski_sim.serving.policies import SERVING_POLICIES
from klotski_sim.util.units import GIB
from klotski_sim.workload.model import PRESETS


def cmd_models(args: argparse.Namespace) -> int:
    print(
        f"{'name':20} {'layers':>6} {'experts':>7} {'top-k':>5} {'hidden':>6} {'ffn':>6} "
        f"{'expert MB':>9} {'layer MB':>9} {'total GB':>8}"
    )
    for m in PRESETS.values():
        print(
            f"{m.name:20} {m.num_layers:6} {m.num_experts:7} {m.top_k:5} {m.hidden_size:6} {m.ffn_size:6} "
            f"{m.expert_bytes() / 1e6:9.1f} {m.layer_bytes() / 1e6:9.1f} {m.total_bytes() / 1e9:8.1f}"
        )
    print(
        "NAME:L keeps the first L layers; NAME@int4 (int8, int3, int2; :gG group size, :fp32 scales) quantises "
        "the routed experts, e.g. mixtral-8x7b@int4:g16:fp32 (Klotski's port)"
    )
    return 0


def _as_option_value(value: Any) -> str:
    """A value as --option KEY=VALUE takes it (JSON, strings bare)."""
    return value if isinstance(value, str) else json.dumps(value)


def cmd_policies(args: argparse.Namespace) -> int:
    """The policies, or one policy's options: what `--option` takes, generated from the options' specs."""
    if args.name is None:
        width = max(len(name) for name in (*POLICIES, *SERVING_POLICIES))
        for info in POLICIES.values():
            print(f"{info.name:{width}}  {info.description}")
        print("serving policies (klotski-sim serve):")
        for cls in SERVING_POLICIES.values():
            print(f"{cls.name:{width}}  {cls.description}")
        print("klotski-sim policies NAME lists a policy's options (--option KEY=VALUE; serve: POLICY.KEY=VALUE)")
        return 0
    if args.name in SERVING_POLICIES:
        cls = SERVING_POLICIES[args.name]
        print(f"{cls.name}: {cls.description} (serving: klotski-sim serve --option {cls.name}.KEY=VALUE)")
        serving_rows = [(s.name, s.accepts(), _as_option_value(s.default), s.help) for s in specs_of(cls.Options)]
        _table(("option", "accepts", "default", "meaning"), serving_rows)
        return 0
    info = get_policy(args.name)
    traits = [name for name, value in asdict(info.traits).items() if value is True]
    print(f"{info.name}: {info.description}")
    print(f"buffering: {info.traits.buffering}" + (f"; traits: {', '.join(traits)}" if traits else ""))
    presets = {name: info.preset(name) for name in ("as-published", "ideal")}
    rows = [
        (
            spec.name,
            spec.accepts(),
            *(_as_option_value(presets[p].get(spec.name, spec.default)) for p in presets),
            spec.help,
        )
        for spec in info.option_specs().values()
    ]
    _table(("option", "accepts", "as-published", "ideal", "meaning"), rows)
    return 0


def _table(head: tuple[str, ...], rows: Sequence[tuple[str, ...]]) -> None:
    """Columns padded to their widest cell; the last (the meaning) as it is."""
    if not rows:
        print("(no options)")
        return
    last = len(head) - 1
    widths = [max(len(str(row[i])) for row in (head, *rows)) for i in range(last)]
    for row in (head, *rows):
        print("  ".join(f"{cell:{w}}" for cell, w in zip(row[:last], widths)) + "  " + row[last])


def cmd_profiles(args: argparse.Namespace) -> int:
    print(
        f"{'name':10} {'GPU':26} {'mem GiB':>7} {'TFLOP/s':>7} {'HBM GB/s':>8} {'H2D GB/s':>8} "
        f"{'NVMe GB/s':>9} {'host GB':>7}  CPU compute (CPU-expert policies)"
    )
    for name in builtin_profile_names():
        p = load_profile(name)
        cpu = (
            f"{p.cpu.cores} cores, {p.cpu.flop_rate / 1e12:.1f} TFLOP/s {p.cpu.compute_dtype}, "
            f"{p.cpu.memory_bandwidth / 1e9:.0f} GB/s"
            if p.cpu
            else "-"
        )
        print(
            f"{name:10} {p.gpu.name[:26]:26} {p.gpu.memory_bytes / GIB:7.1f} {p.gpu.peak_flops / 1e12:7.0f} "
            f"{p.gpu.memory_bandwidth / 1e9:8.0f} {p.links.pcie_h2d.bandwidth / 1e9:8.1f} "
            f"{p.links.nvme.bandwidth / 1e9:9.1f} {p.host.memory_bytes / 1e9:7.0f}  {cpu}"
        )
    return 0
