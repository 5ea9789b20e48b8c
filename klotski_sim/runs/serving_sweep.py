"""Serving axes of a sweep: a spec with a `serving:` section runs `klotski-sim serve`'s configurations
instead of offline schedules, on the same pool or Dask cluster, resumable the same way
(klotski_sim/runs/sweep.py). Its `policies` are serving policies, its `options` theirs.

    name: residency
    models: [mixtral-8x7b]
    hardware: [h20]
    policies: [vllm-o, fluxmoe]
    prompt_lens: [52]
    seeds: [0]
    options:                          # a serving policy's options (every policy in the grid takes them)
      pageable_layers: [8, 16, 32]
    serving:
      requests: [32, 256]             # B_cfg
      output_lens: [1024, 4096]
      lengths: [fixed]                # or a shipped distribution (sharegpt4-sarathi): prompts drawn from it
      rates: [offline]                # or requests per second (Poisson, seeded)
      max_num_seqs: [256]
      max_num_batched_tokens: [8192]
      gpu_memory_utilization: [0.9]
"""

from __future__ import annotations

import math
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, StrictFloat, StrictInt, StrictStr, field_validator

from klotski_sim.util.argtypes import first_repeat
from klotski_sim.util.errors import UsageError

# offline axes a serving grid does not have (their defaults are left as they are)
OFFLINE_ONLY = ("batch_sizes", "num_batches", "gen_lens", "routings", "kv", "experts", "impls", "resident_layers")


class ServingGrid(BaseModel):
    """The serving axes (module docstring)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    requests: list[StrictInt] = Field(default_factory=lambda: [32], min_length=1)
    output_lens: list[StrictInt] = Field(default_factory=lambda: [1024], min_length=1)
    lengths: list[StrictStr] = Field(default_factory=lambda: ["fixed"], min_length=1)
    rates: list[StrictInt | StrictFloat | StrictStr] = Field(default_factory=lambda: ["offline"], min_length=1)  # type: ignore[arg-type]
    warmup: StrictInt = 0
    max_num_seqs: list[StrictInt] = Field(default_factory=lambda: [256], min_length=1)
    max_num_batched_tokens: list[StrictInt] = Field(default_factory=lambda: [8192], min_length=1)
    gpu_memory_utilization: list[StrictInt | StrictFloat] = Field(default_factory=lambda: [0.9], min_length=1)

    @field_validator("requests", "output_lens", "max_num_seqs", "max_num_batched_tokens")
    @classmethod
    def _counts(cls, values: list[int]) -> list[int]:
        bad = [v for v in values if not 1 <= v <= 1 << 24]
        if bad:
            raise UsageError(f"values must be whole numbers from 1 to {1 << 24:,}, got {bad[0]!r}")
        return _once(values)

    @field_validator("rates")
    @classmethod
    def _rates(cls, values: list[Any]) -> list[Any]:
        for v in values:
            if v != "offline" and (isinstance(v, str) or not math.isfinite(v) or v <= 0):
                raise UsageError(f"rates are 'offline' or requests per second > 0, got {v!r}")
        return _once(values)

    @field_validator("gpu_memory_utilization")
    @classmethod
    def _share(cls, values: list[float]) -> list[float]:
        bad = [v for v in values if not 0 < v <= 1]
        if bad:
            raise UsageError(f"a share of the GPU's memory, above 0 and at most 1, got {bad[0]!r}")
        return _once(values)

    @field_validator("lengths")
    @classmethod
    def _lengths(cls, values: list[str]) -> list[str]:
        from klotski_sim.serving.requests import builtin_distributions

        known = ["fixed", *builtin_distributions()]
        bad = [v for v in values if v not in known]
        if bad:
            raise UsageError(f"lengths: {bad[0]!r} is not one of {', '.join(known)}")
        return _once(values)

    def axes(self) -> tuple[list[Any], ...]:  # (in serving_configs' order)
        return (
            self.requests,
            self.output_lens,
            self.lengths,
            self.rates,
            self.max_num_seqs,
            self.max_num_batched_tokens,
            self.gpu_memory_utilization,
        )


def _once(values: list[Any]) -> list[Any]:
    twice = first_repeat(values)
    if twice is not None:
        raise UsageError(f"{twice!r} is given twice")
    return values


def check_serving_spec(spec: Any) -> list[str]:
    """The problems of a serving grid's policies, options and offline axes (empty: none)."""
    from klotski_sim.serving.policies import SERVING_POLICIES
    from klotski_sim.serving.policies.base import resolve_serving_options

    problems = []
    defaults = type(spec)(policies=spec.policies)
    for axis in OFFLINE_ONLY:
        if getattr(spec, axis) != getattr(defaults, axis):
            problems.append(f"{axis}: an offline axis; a serving grid (serving:) does not take it")
    if spec.policy_files:
        problems.append("policy_files: offline policies; a serving grid runs serving policies")
    for p in spec.policies:
        if p not in SERVING_POLICIES:
            problems.append(f"unknown serving policy {p!r}; serving policies: {', '.join(SERVING_POLICIES)}")
            continue
        for key, values in spec.options.items():
            for value in values:
                try:
                    resolve_serving_options(p, {key: value})
                except UsageError as err:
                    problems.append(f"options.{key}: {err}")
    if spec.serving.warmup and spec.serving.rates == ["offline"]:
        problems.append("serving.warmup needs rates (an offline workload measures every request)")
    return problems


def serving_configs(spec: Any) -> list[dict[str, Any]]:
    """The serving grid's configurations (without ids)."""
    import itertools

    fields, option_keys = list(spec.overrides), list(spec.options)
    configs = []
    for model, hardware, policy, prompt, seed, *rest in itertools.product(
        spec.models,
        spec.hardware,
        spec.policies,
        spec.prompt_lens,
        spec.seeds,
        *spec.serving.axes(),
        *(spec.overrides[f] for f in fields),
        *(spec.options[k] for k in option_keys),
    ):
        requests, output, lengths, rate, seqs, tokens, utilisation = rest[:7]
        values = rest[7:]
        configs.append(
            {
                "kind": "serving",
                "model": model,
                "hardware": hardware,
                "policy": policy,
                "prompt_len": prompt,
                "seed": seed,
                "requests": requests,
                "output_len": output,
                "lengths": lengths,
                "rate": rate,
                "warmup": spec.serving.warmup,
                "max_num_seqs": seqs,
                "max_num_batched_tokens": tokens,
                "gpu_memory_utilization": utilisation,
                "overrides": dict(zip(fields, values[: len(fields)])),
                "options": dict(zip(option_keys, values[len(fields) :])),
            }
        )
    return configs


def run_serving_config(cfg: dict[str, Any], row: dict[str, Any]) -> None:
    """Serve one configuration into `row` (its metrics as `m.*`, status `ok`; a policy that cannot
    serve it: status `refused` with the reason)."""
    from klotski_sim.hardware.profile import load_profile, with_overrides
    from klotski_sim.serving.batcher import BatchingConfig, ServingRefusal
    from klotski_sim.serving.requests import drawn_requests, fixed_requests, with_poisson_arrivals
    from klotski_sim.serving.run import ServeSpec, serve
    from klotski_sim.workload.model import get_model

    model = get_model(cfg["model"])
    profile = load_profile(cfg["hardware"])
    if cfg["overrides"]:
        profile = with_overrides(profile, cfg["overrides"])
    if cfg["lengths"] == "fixed":
        workload = fixed_requests(cfg["requests"], cfg["prompt_len"], cfg["output_len"])
    else:
        workload = drawn_requests(cfg["requests"], cfg["lengths"], cfg["seed"], cfg["output_len"])
    if cfg["rate"] != "offline":
        workload = with_poisson_arrivals(workload, float(cfg["rate"]), cfg["seed"], cfg["warmup"])
    batching = BatchingConfig(cfg["max_num_seqs"], cfg["max_num_batched_tokens"])
    spec = ServeSpec(
        model, profile, cfg["policy"], workload, batching, cfg["gpu_memory_utilization"], cfg["options"], cfg["seed"]
    )
    try:
        result = serve(spec, keep=False)  # (a row holds metrics: the ops are dropped as they are timed)
    except ServingRefusal as err:
        row["status"], row["error"] = "refused", str(err)
        return
    m = result.metrics
    row.update(
        {
            "m.throughput_tok_s": m.throughput_tok_s,
            "m.ttft_mean_s": m.ttft_s.mean,
            "m.ttft_p99_s": m.ttft_s.p99,
            "m.tpot_mean_s": m.tpot_s.mean,
            "m.tpot_p99_s": m.tpot_s.p99,
            "m.latency_mean_s": m.latency_s.mean,
            "m.latency_p99_s": m.latency_s.p99,
            "m.mean_active": m.mean_active,
            "m.preemptions": m.preemptions,
            "m.kv_blocks": result.memory.num_blocks,
            "m.iterations": m.iterations,
            "m.duration_s": m.duration_s,
            "m.offloaded_layers": len(result.residency.offloaded_layers),
        }
    )
    row["status"], row["error"] = "ok", ""
