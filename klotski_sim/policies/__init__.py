"""Policies: one file each, registered by name (see base.register)."""

from . import single_batch  # noqa: F401  (registers itself)
from .base import POLICIES, Placement, PolicyInput, build_schedule, get_policy, register

__all__ = ["POLICIES", "Placement", "PolicyInput", "build_schedule", "get_policy", "register"]
