"""`klotski-sim optimize`: the best way to run one model on one machine, searched over policy x
implementation preset x batch size x n x KV placement x expert dtype x expert-cache size x
resident layers (by default as many as the memory left at each n allows).

An exhaustive search of that grid, run on the sweep machinery (process pool, resumable, one
Parquet row per configuration). It is pruned the way the planner bounds a run: a configuration
whose memory floor (resident weights, activations and KV cache, before any schedule) exceeds the
GPU is refused without building anything, in well under a second; the planner picks n where n is
`auto` (the default; `--num-batches auto,4,16` searches given values too). Why not an
optimisation library: the grid is a few hundred points of a discrete, non-smooth objective
(out-of-memory cliffs, policy switches), each evaluation takes seconds, and
an exhaustive grid is reproducible and resumable; above `--budget` points a seeded sample of the
grid is evaluated, and said so. Results: the Pareto front of throughput against per-token
latency (the decode step: how long each sequence waits for its next token), and the winner —
the highest throughput within `--max-token-latency` — as a `klotski-sim simulate` command that
reproduces its numbers.
"""

from __future__ import annotations

import random
import shlex
from dataclasses import dataclass
from typing import Any, Sequence

from klotski_sim.hardware.profile import load_profile
from klotski_sim.policies import POLICIES
from klotski_sim.runs.sweep import SweepSpec, check_spec, expand
from klotski_sim.util.argtypes import first_repeat
from klotski_sim.util.errors import UsageError
from klotski_sim.util.lazy import pd  # (imported when first used: klotski_sim/util/lazy.py)
from klotski_sim.workload.model import get_model

DEFAULT_BATCH_SIZES = (4, 16, 64)
DEFAULT_EXPERT_DTYPES = ("bf16", "int4")
DEFAULT_KV = ("auto",)


@dataclass(frozen=True)
class Search:
    """What `optimize` searches, and its limits."""

    model: str
    hardware: str
    prompt_len: int = 512
    gen_len: int = 32
    policies: tuple[str, ...] = ()
    impls: tuple[str, ...] = ("as-published", "ideal")
    batch_sizes: tuple[int, ...] = DEFAULT_BATCH_SIZES
    num_batches: tuple[int | str, ...] = ("auto",)  # n: the planner's (auto) and/or given values
    expert_dtypes: tuple[str, ...] = DEFAULT_EXPERT_DTYPES
    kv: tuple[str, ...] = DEFAULT_KV
    cache_sizes: tuple[int, ...] = (0,)  # experts kept on the GPU across steps (option expert_cache)
    resident_layers: tuple[int | str, ...] = ("auto",)
    max_token_latency_s: float | None = None
    budget: int = 400
    seed: int = 0

    def policy_names(self) -> tuple[str, ...]:
        """The chosen policies, or every registered one this profile can run (CPU-expert
        policies need a `cpu:` section)."""
        profile = load_profile(self.hardware)
        if self.policies:  # (else one the profile cannot run is tried in every configuration, each failing)
            for name in self.policies:
                if name in POLICIES:
                    POLICIES[name].require_machine(profile, f"--policies {name}: policy {name!r}")
            return self.policies
        return tuple(p for p, info in POLICIES.items() if profile.cpu is not None or not info.traits.needs_cpu)

    def models(self) -> list[str]:
        get_model(self.model)  # a bad name is refused before anything runs
        return [self.model if d == "bf16" else f"{self.model}@{d}" for d in self.expert_dtypes]

    def spec(self) -> SweepSpec:
        # resident layers `auto` is the planner's use of the spare memory: at a given n, `fill` does the same
        resident = list(dict.fromkeys("fill" if r == "auto" else r for r in self.resident_layers))
        spec = SweepSpec(
            name=f"optimize-{self.model}-{self.hardware}",
            models=self.models(),
            hardware=[self.hardware],
            policies=list(self.policy_names()),
            batch_sizes=list(self.batch_sizes),
            num_batches=list(self.num_batches),
            prompt_lens=[self.prompt_len],
            gen_lens=[self.gen_len],
            kv=list(self.kv),
            impls=list(self.impls),
            resident_layers=resident,
            seeds=[self.seed],
            options={"expert_cache": list(self.cache_sizes)} if set(self.cache_sizes) != {0} else {},
        )
        check_spec(spec, "optimize")
        return spec

    def selected_ids(self, spec: SweepSpec) -> tuple[list[str], int]:
        """The configurations to evaluate (all, or a seeded sample of `budget`), and the grid size.
        A policy with one batch in flight by definition runs at n auto only (more batches would
        only queue behind it)."""
        configs = [c for c in expand(spec) if c["num_batches"] == "auto" or not POLICIES[c["policy"]].traits.one_batch]
        ids = [c["id"] for c in configs]
        if len(ids) <= self.budget:
            return ids, len(ids)
        return sorted(random.Random(self.seed).sample(ids, self.budget)), len(ids)

    def one_batch_left_out(self) -> list[str]:
        """The policies `selected_ids` leaves out altogether: one batch in flight by definition,
        and no `auto` among the n searched."""
        if "auto" in self.num_batches:
            return []
        return [p for p in self.policy_names() if POLICIES[p].traits.one_batch]


def pareto_front(df: pd.DataFrame) -> pd.DataFrame:
    """The configurations no other one beats on both throughput (higher) and per-token latency
    (lower), sorted by latency."""
    rows = df.sort_values(["m.decode_step_s", "m.throughput_tok_s"], ascending=[True, False])
    front, best = [], -1.0
    for idx, r in rows.iterrows():
        if r["m.throughput_tok_s"] > best:
            front.append(idx)
            best = r["m.throughput_tok_s"]
    return rows.loc[front]


def winner(df: pd.DataFrame, max_latency_s: float | None) -> pd.Series | None:
    ok = df if max_latency_s is None else df[df["m.decode_step_s"] <= max_latency_s]
    if ok.empty:
        return None
    return ok.sort_values(["m.throughput_tok_s", "m.decode_step_s"], ascending=[False, True]).iloc[0]


def simulate_command(row: pd.Series | dict[str, Any], policy_files: Sequence[str] = ()) -> str:
    """The `klotski-sim simulate` command that reproduces one row (shell-quoted: a path may hold spaces)."""
    files = "".join(f" --policy-file {shlex.quote(f)}" for f in policy_files)
    cache = row.get("opt.expert_cache")
    if cache is not None and not pd.isna(cache) and int(cache):
        files += f" --option expert_cache={int(cache)}"
    resident = row.get("resident_layers")
    if resident is not None and not pd.isna(resident):
        files += f" --resident-layers {resident if resident == 'fill' else int(resident)}"
    seed = row.get("seed")
    if seed is not None and not pd.isna(seed) and int(seed):
        files += f" --seed {int(seed)}"
    return (
        f"klotski-sim simulate --model {shlex.quote(row['model'])} --hardware {shlex.quote(row['hardware'])} "
        f"--policy {shlex.quote(row['policy'])} "
        f"--impl {row['impl']} --batch-size {int(row['batch_size'])} --num-batches {row['num_batches']} "
        f"--kv {row['kv']} --prompt-len {int(row['prompt_len'])} --gen-len {int(row['gen_len'])}{files}"
    )


def ok_rows(df: pd.DataFrame) -> pd.DataFrame:
    """Finished runs only (out-of-memory and refused configurations are not candidates)."""
    if df.empty or "m.throughput_tok_s" not in df.columns:  # (no run got as far as a metric)
        return df.iloc[0:0]
    return df[(df["status"] == "ok") & (df["m.throughput_tok_s"] > 0)]


def check_search(s: Search) -> None:
    if s.budget < 1:
        raise UsageError(f"--budget must be >= 1, got {s.budget}")
    if s.max_token_latency_s is not None and not s.max_token_latency_s > 0:
        raise UsageError(f"--max-token-latency must be > 0 seconds, got {s.max_token_latency_s}")
    for flag, values in (
        ("--policies", s.policies),
        ("--impl", s.impls),
        ("--batch-sizes", s.batch_sizes),
        ("--num-batches", s.num_batches),
        ("--expert-dtypes", s.expert_dtypes),
        ("--kv", s.kv),
        ("--cache-sizes", s.cache_sizes),
        ("--resident-layers", s.resident_layers),
    ):
        twice = first_repeat(values)
        if twice is not None:
            raise UsageError(f"{flag}: {twice} is given twice")
    for d in s.expert_dtypes:
        if d != "bf16":
            get_model(f"{s.model}@{d}")  # refuses a bad dtype with its own message
    model = get_model(s.model)
    experts = model.routed_experts
    too_many = [c for c in s.cache_sizes if c > experts]
    if too_many:
        raise UsageError(f"--cache-sizes {too_many[0]}: {s.model} has {experts} routed experts to cache")
