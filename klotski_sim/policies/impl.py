"""Implementation choices: *how* a schedule is carried out, as explicit policy options.

Where bubbles come from depends as much on how a schedule is implemented as on the schedule
itself, so every choice below is a policy option that the simulator and the runtime both honour:

- `expert_ops`      `batched`: one op per expert over the tokens of all n batches;
                    `per-batch`: one op per expert and batch (the expert's weights are read from
                    GPU memory again for every batch).
- `cold_order`      order in which the on-demand (cold) expert loads revealed by one batch's gate are
                    issued: `first-use` (the order the batch's tokens first select them — what a loop
                    over the routed ids does), `expert-id`, or `most-tokens-first` (Johnson's rule
                    for a load-then-compute flow shop with equal loads: the longest compute first).
- `sync`            host synchronisations: `none`; `per-sublayer` (the host waits after every
                    attention, gate and MoE sub-layer); `per-expert` (`per-sublayer` plus a wait after
                    every expert op, as a `.tolist()` on the routing does).
- `copy_memory_weights`, `copy_memory_kv`
                    `pinned` or `pageable` host memory behind weight / KV-cache copies; pageable
                    copies run at the link's pageable bandwidth and block the host thread.
- `attention_impl`  `fused` (one attention kernel reading K/V once) or `eager` (transformers'
                    eager path: repeat_kv materialises the KV heads, QK^T, fp32 softmax and AV
                    as separate kernels) — costed from the bytes and FLOPs each moves.
- `moe_load`        for policies that load whole MoE layers: `layer-ahead` (with the rest of the
                    next layer, during this layer's compute) or `at-gate` (issued when the gate
                    sub-layer starts, as a loop without an expert predictor does).

Presets (`--impl`): `as-published` (what each system's public code does; every choice is cited in
docs/implementations.md), `ideal` (the best implementation of the same schedule) and `v0.1`
(what klotski 0.1 simulated, kept so that older figures reproduce).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

from klotski_sim.policies.options import OptionSpec, option, specs_of
from klotski_sim.util.errors import UsageError

PRESET_NAMES = ("as-published", "ideal", "v0.1")

# The best implementation of any schedule: nothing is re-read, no host waits, pinned copies,
# fused attention, whole layers loaded as early as their buffers allow.
IDEAL: dict[str, str] = {
    "expert_ops": "batched",
    "cold_order": "most-tokens-first",
    "sync": "none",
    "copy_memory_weights": "pinned",
    "copy_memory_kv": "pinned",
    "attention_impl": "fused",
    "moe_load": "layer-ahead",
}

# What klotski 0.1 simulated for every policy.
V0_1: dict[str, str] = dict(IDEAL, cold_order="expert-id")


@dataclass(frozen=True)
class Impl:
    """The implementation choices of one schedule (see the module docstring)."""

    expert_ops: str = option(
        "batched",
        "batched: one op per expert over all n batches' tokens; per-batch: one per expert and batch",
        choices=("batched", "per-batch"),
    )
    cold_order: str = option(
        "expert-id",
        "order of a batch's on-demand expert loads: as its tokens first use them, by id, or longest compute first",
        choices=("first-use", "expert-id", "most-tokens-first"),
    )
    sync: str = option(
        "none",
        "host waits: none; after every sub-layer; after every sub-layer and expert op (a .tolist())",
        choices=("none", "per-sublayer", "per-expert"),
    )
    copy_memory_weights: str = option(
        "pinned",
        "host memory behind weight copies (pageable: slower link, blocks the host)",
        choices=("pinned", "pageable"),
    )
    copy_memory_kv: str = option(
        "pinned",
        "host memory behind KV-cache copies (pageable: slower link, blocks the host)",
        choices=("pinned", "pageable"),
    )
    attention_impl: str = option(
        "fused", "fused: one kernel reads K/V once; eager: transformers' separate kernels", choices=("fused", "eager")
    )
    moe_load: str = option(
        "layer-ahead",
        "whole-MoE-layer loads: with the next layer's rest (layer-ahead) or when the gate starts (at-gate)",
        choices=("layer-ahead", "at-gate"),
    )

    def __post_init__(self) -> None:
        for spec in IMPL_SPECS.values():  # (defined below the class; read when an Impl is made)
            spec.check("", getattr(self, spec.name))

    @classmethod
    def from_options(cls, options: Mapping[str, Any]) -> "Impl":
        """The implementation options among a policy's options (the others are the policy's own)."""
        return cls(**{k: v for k, v in options.items() if k in IMPL_CHOICES})

    @property
    def per_batch_experts(self) -> bool:
        return self.expert_ops == "per-batch"

    @property
    def sync_sublayers(self) -> bool:
        return self.sync in ("per-sublayer", "per-expert")

    @property
    def sync_experts(self) -> bool:
        return self.sync == "per-expert"


IMPL_SPECS: dict[str, OptionSpec] = {spec.name: spec for spec in specs_of(Impl)}
IMPL_CHOICES: dict[str, tuple[str, ...]] = {name: spec.choices for name, spec in IMPL_SPECS.items()}


def preset_options(preset: str, supported: tuple[str, ...], as_published: Mapping[str, str]) -> dict[str, str]:
    """The option values a preset gives a policy that honours the `supported` options."""
    if preset not in PRESET_NAMES:
        raise UsageError(f"unknown implementation preset {preset!r}; presets: {', '.join(PRESET_NAMES)}")
    table = {"as-published": as_published, "ideal": IDEAL, "v0.1": V0_1}[preset]
    missing = [k for k in supported if k not in table]
    if missing:
        raise UsageError(f"preset {preset!r} does not set {missing}")
    return {k: table[k] for k in supported}
