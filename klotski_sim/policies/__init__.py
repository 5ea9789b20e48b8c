"""Policies: one file each, registered by name (see base.register)."""

from klotski_sim.policies import fiddler, flexgen, klotski, single_batch  # noqa: F401  (each registers itself)
from klotski_sim.policies.base import (
    POLICIES,
    OpEmitter,
    Placement,
    PolicyInput,
    PolicyTraits,
    build_schedule,
    get_policy,
    register,
)

# The ablation ladder, rung by rung (README and `klotski-sim compare`).
LADDER = ("single-batch", "multi-batch", "hot-prefetch", "klotski")

__all__ = [
    "LADDER",
    "POLICIES",
    "OpEmitter",
    "Placement",
    "PolicyInput",
    "PolicyTraits",
    "build_schedule",
    "get_policy",
    "register",
]
