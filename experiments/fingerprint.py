"""Fingerprints of the schedules, timelines and summaries of 33 configurations, to show that a
speed-up changed nothing: every built-in policy under both presets at a small size, the default
Klotski run under both, and CPU attention, expert caches, int4 experts, DeepSeek, Qwen3, the L4
and H800 profiles, the KV cache in host memory, uniform routing and experts read from disk.

    python experiments/fingerprint.py OUT.json                  # write them
    python experiments/fingerprint.py OUT.json --against OLD.json  # and compare (exit 1 if any differ)

Run it at two revisions (`git worktree add`, then `PYTHONPATH=<worktree> python ...`) to compare them.

`--quick` (for tests): the same configurations at prompt 16, 2 generated tokens and at most 2
batches (n given, not planned), in seconds; compare its file with another `--quick` one only.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
from dataclasses import replace
from pathlib import Path

import numpy as np

from klotski_sim.runs.runner import RunSpec, run

SMALL = {"prompt_len": 64, "gen_len": 6}
POLICIES = (
    "single-batch",
    "multi-batch",
    "hot-prefetch",
    "klotski",
    "klotski-oracle",
    "flexgen",
    "fiddler",
    "llamacpp-moe",
    "klotski-hybrid",
)
CONFIGURATIONS = [
    RunSpec(policy=policy, impl=impl, num_batches=None, **SMALL)
    for impl in ("as-published", "ideal")
    for policy in POLICIES
] + [
    RunSpec(policy="klotski", impl="as-published", num_batches=None),
    RunSpec(policy="klotski", impl="ideal", num_batches=None),
    RunSpec(policy="klotski", num_batches=None, options={"attention_device": "cpu"}, **SMALL),
    RunSpec(policy="klotski", num_batches=4, options={"expert_cache": 16, "cache_policy": "hot-pinned"}, **SMALL),
    RunSpec(policy="klotski", num_batches=4, options={"expert_cache": 16, "cache_policy": "lru"}, **SMALL),
    RunSpec(model="mixtral-8x7b@int4", policy="fiddler", num_batches=4, **SMALL),
    RunSpec(model="deepseek-v2-lite", policy="klotski", num_batches=None, **SMALL),
    RunSpec(model="qwen3-30b-a3b", policy="klotski-hybrid", num_batches=None, impl="ideal", **SMALL),
    RunSpec(model="mixtral-8x7b", hardware="l4", policy="klotski", num_batches=None, **SMALL),
    RunSpec(model="mixtral-8x22b", hardware="h800", policy="flexgen", num_batches=None, **SMALL),
    RunSpec(policy="klotski", num_batches=3, kv="cpu", **SMALL),
    RunSpec(policy="klotski", num_batches=3, routing="uniform", **SMALL),
    # experts read from disk (through the host staging window), as a machine short of host memory runs them
    RunSpec(policy="klotski", num_batches=None, experts="disk", **SMALL),
    RunSpec(policy="single-batch", experts="disk", **SMALL),
    RunSpec(policy="flexgen", num_batches=None, experts="disk", impl="ideal", **SMALL),
]


def quick(spec: RunSpec) -> RunSpec:
    """`spec` at the smallest size: the planner would pick a hundred batches for so short a prompt."""
    return replace(spec, prompt_len=16, gen_len=2, num_batches=min(spec.num_batches or 2, 2))


def _digest(data: bytes) -> str:
    return hashlib.sha1(data).hexdigest()


def fingerprint(spec: RunSpec) -> dict[str, object]:
    """The schedule (its JSON), the timeline (every op's start, end and readiness) and the summary."""
    result = run(spec)
    timeline = result.timeline
    times = np.stack([np.asarray(timeline.columns[name], dtype=float) for name in ("start", "end", "ready")])
    summary = timeline.summary().to_dict()
    return {
        "schedule": _digest(json.dumps(result.schedule.to_json_dict(), sort_keys=True, default=str).encode()),
        "timeline": _digest(times.tobytes()),
        "summary": _digest(json.dumps(summary, sort_keys=True, default=str).encode()),
        "ops": len(result.schedule),
        "makespan_s": summary["makespan_s"],
    }


def _key(spec: RunSpec) -> str:
    """The configuration as a key; a field at the default that older revisions' RunSpec lacks
    (`gpus`: 1) is left out, so fingerprints made before it existed still compare."""
    fields = spec.to_dict()
    if fields.get("gpus") == 1:
        del fields["gpus"]
    return json.dumps(fields, sort_keys=True, default=str)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out", type=Path, help="where to write the fingerprints (JSON)")
    parser.add_argument("--against", type=Path, metavar="OLD.json", help="fingerprints to compare with")
    parser.add_argument("--quick", action="store_true", help="every configuration at the smallest size (seconds)")
    args = parser.parse_args()
    specs = [quick(spec) for spec in CONFIGURATIONS] if args.quick else CONFIGURATIONS
    prints = {_key(spec): fingerprint(spec) for spec in specs}
    args.out.write_text(json.dumps(prints, indent=1))
    print(f"{len(prints)} configurations fingerprinted -> {args.out}")
    if args.against is None:
        return
    try:
        old = json.loads(args.against.read_text())
    except (OSError, ValueError) as err:
        sys.exit(f"--against {args.against}: cannot read fingerprints ({err})")
    differ = [key for key in prints if old.get(key) != prints[key]]
    for key in differ:
        parts = [
            part
            for part in ("schedule", "timeline", "summary")
            if key not in old or old[key].get(part) != prints[key][part]
        ]
        print(f"differs ({', '.join(parts) or 'ops or makespan'}): {key}\n  old {old.get(key)}\n  new {prints[key]}")
    print(f"{len(prints)} configurations against {args.against}: {len(differ)} differ (schedule, timeline or summary)")
    if differ:
        sys.exit(1)


if __name__ == "__main__":
    main()
