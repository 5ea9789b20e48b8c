"""The serving policies; importing this package registers the built-in ones."""

from klotski_sim.serving.policies import fluxmoe, ktransformers, vllm, vllm_o  # noqa: F401  (registers them)
from klotski_sim.serving.policies.base import SERVING_POLICIES, ServingPolicy, get_serving_policy, serving_policy

__all__ = ["SERVING_POLICIES", "ServingPolicy", "get_serving_policy", "serving_policy"]
