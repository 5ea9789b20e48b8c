"""Synthetic routing traces, calibrated to what real MoE models show.

`calibrated` draws, for every sequence, token and layer, top-k experts from a generative model
with four knobs, each matched to a published or shipped measurement (klotski_sim/workload/data/):

1. *Per-layer popularity*: the layer's real expert shares (Mixtral: Fiddler's MMLU counts, 32
   layers x 8 experts; fine-grained models: OLMoE's counts at layers 0/7/15, other layers reuse
   the nearest measured shape under a seeded permutation).
2. *Request-level skew*: each sequence draws its own shares from a Dirichlet around the layer's
   (`concentration`), so one request is more skewed (max share 0.20-0.30) than a corpus (~0.16).
3. *Token-to-token stickiness*: a token keeps its predecessor's whole expert set
   (`stick_all`) or only its first choice (`stick_one`); otherwise it draws afresh.
4. *Layer-to-layer correlation*: a fresh draw in layer l adds `coupling` x a seeded random
   affinity between the token's first choice in layer l-1 and each expert, and
   `type_coupling` x an affinity between the token's latent type (one of `token_types`, fixed
   across layers) and each expert — the latter keeps layers 7 apart correlated, as measured
   (weak for Mixtral, strong for fine-grained models).

`calibrated:KEY=VALUE,...` adds what-ifs on top of the calibrated generator (`KNOBS`, each
off by default, so plain `calibrated` draws what it always drew):

- `domain=NAME`: the popularity measured on one domain of text instead of over all of them
  (Mixtral-like models: Fiddler's seven MMLU subjects; fine-grained ones: OLMoE's arxiv, book, c4,
  github, wikipedia; `code` and `math` name the nearest of them), or `domain=mixed`: each sequence
  draws one of those domains — the domain-specific popularity that workload-aware grouping and
  placement exploit (Bambhaniya et al., shared/docs/MULTIGPU.md).
- `decode_drift=R` (0..1): the share of a sequence's decode-time popularity drawn afresh instead of
  kept from its prompt. At 0 the generated tokens route by the same per-request shares as the
  prompt: the prefill-to-decode correlation the same paper reports as strong.
- `coupling=C`, `type_coupling=T`: the layer-to-layer correlation's two knobs (4. above) set
  instead of the calibrated ones (`COUPLED_MIXTRAL`: the values that match real Mixtral decode
  routing's coupling, which plain `calibrated` underestimates).
- `reuse=B`: a router biased by B (logit units) toward the experts the previous token chose in the
  same layer — the effect of ReMoE's reuse fine-tuning (+26% expert reuse, shared/docs/MULTIGPU.md),
  so cache hit rates under a reuse-biased router can be asked about. Tokens are then drawn one after
  another (each depends on its predecessor's final choice): slower, the same draws at B = 0.

`uniform` is the worst case Klotski admits; `zipf:<a>` is popularity ~ 1/rank^a only.
The same seed gives the identical file.
"""

from __future__ import annotations

import json
import os
import re
import threading
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import asdict, dataclass, replace
from functools import lru_cache, partial
from importlib import resources
from typing import Callable, Iterator

import numpy as np

from klotski_sim.util import run_size
from klotski_sim.util.errors import UsageError
from klotski_sim.util.machine import available_cores
from klotski_sim.workload.model import ModelSpec
from klotski_sim.workload.routing import RoutingTable, RunShape, expert_id_type, top_by_argmax
from klotski_sim.workload.trace import Trace, replay

ROUTINGS = ("calibrated", "uniform", "zipf:<a>", "skewed", "calibrated:KEY=VALUE,...")
KNOBS = ("domain", "decode_drift", "reuse", "coupling", "type_coupling")
MAX_COUPLING = 20.0  # logit units, as the reuse bias: beyond it a coupling decides the draw alone
# Real Mixtral-8x7B decode routing (issue 41's measurement of a public log of 577 decode tokens),
# in `trace stats`' names: `calibrated:coupling=0.8,type_coupling=3` (COUPLED_MIXTRAL) brings a
# synthetic trace of that size within 19% of each (experiments/calibrate_synth.py --coupled); plain
# `calibrated` is 62% and 44% short of the two MI figures.
REAL_MIXTRAL_DECODE = {
    "mi_next_excess_bits": 0.247,
    "mi_skip7_bits": 0.245,
    "max_share": 0.168,
    "stick_top1": 0.248,
    "stick_any": 0.623,
}
COUPLED_MIXTRAL = {"coupling": 0.8, "type_coupling": 3.0}
MIXED = "mixed"  # `domain=mixed`: each sequence draws one measured domain
MAX_REUSE_BIAS = 20.0  # logit units: e^20 makes the previous token's experts a certainty already
DEFAULT_ROUTING = "calibrated"  # what every command draws when it is not told


@dataclass(frozen=True)
class SynthParams:
    """Knobs of the generator (see the module docstring)."""

    concentration: float | None  # Dirichlet concentration of per-request shares; None = no request skew
    stick_all: float
    stick_one: float
    coupling: float  # previous layer's first choice -> this layer (adjacent-layer correlation)
    base: str  # "calibrated" | "uniform" | "zipf"
    zipf_a: float = 0.0
    type_coupling: float = 0.0  # a token's latent type -> every layer (long-range correlation)
    token_types: int = 16
    domain: str | None = None  # a measured domain's popularity, `mixed`, or None: every domain's
    decode_drift: float = 0.0  # share of the decode-time popularity drawn apart from the prompt's
    reuse_bias: float = 0.0  # logits added to the previous token's experts (ReMoE's effect)


# Fitted by experiments/calibrate_synth.py against the targets in the module docstring.
MIXTRAL_LIKE = SynthParams(
    concentration=3.0, stick_all=0.12, stick_one=0.07, coupling=0.3, base="calibrated", type_coupling=1.8
)
FINE_GRAINED = SynthParams(
    concentration=3.0, stick_all=0.12, stick_one=0.07, coupling=1.0, base="calibrated", type_coupling=3.0
)


def params_for(routing: str, model: ModelSpec) -> SynthParams:
    """Parse a routing name (`calibrated`, `uniform`, `zipf:1.2`, `skewed`,
    `calibrated:domain=code,reuse=1`) for a model."""
    if routing == "calibrated":
        return FINE_GRAINED if model.num_experts > 16 else MIXTRAL_LIKE
    if routing.startswith("calibrated:"):
        return _with_knobs(params_for("calibrated", model), routing, model)
    if routing == "uniform":
        return SynthParams(None, 0.0, 0.0, 0.0, "uniform")
    if routing == "skewed":  # a strongly skewed what-if: zipf 1.5 plus calibrated stickiness
        return SynthParams(None, MIXTRAL_LIKE.stick_all, MIXTRAL_LIKE.stick_one, 0.0, "zipf", 1.5)
    if routing.startswith("zipf:"):
        a = _routing_number(routing.split(":", 1)[1])
        if a is None:
            raise UsageError(f"--routing {routing}: zipf routing needs an exponent, e.g. zipf:1.2")
        if not 0 <= a <= 100:
            raise UsageError(f"--routing {routing}: the zipf exponent must be a number from 0 to 100")
        return SynthParams(None, 0.0, 0.0, 0.0, "zipf", a)
    knobs = " (its what-ifs go after calibrated: only)" if ":" in routing and "=" in routing else ""
    raise UsageError(f"--routing {routing}: unknown routing {routing!r}{knobs}; choose from {', '.join(ROUTINGS)}")


def _with_knobs(params: SynthParams, routing: str, model: ModelSpec) -> SynthParams:
    """`calibrated:KEY=VALUE,...`: the calibrated knobs with the what-ifs of `KNOBS` set."""
    given: dict[str, str] = {}
    for item in routing.split(":", 1)[1].split(","):
        key, eq, value = (part.strip() for part in item.partition("="))
        if not eq or not key or not value:
            raise UsageError(
                f"--routing {routing}: write its settings as KEY=VALUE, comma-separated (keys: {', '.join(KNOBS)})"
            )
        if key not in KNOBS:
            raise UsageError(f"--routing {routing}: unknown setting {key!r}; choose from {', '.join(KNOBS)}")
        if key in given:
            raise UsageError(f"--routing {routing}: {key} is given twice")
        given[key] = value
    domain = given.get("domain")
    if domain is not None:
        names = domain_names(model)
        domain = DOMAIN_ALIASES[_family(model)].get(domain, domain)
        if domain != MIXED and domain not in names:
            raise UsageError(
                f"--routing {routing}: no routing of domain {given['domain']!r} is measured for a model with "
                f"{model.num_experts} experts; measured: {', '.join(names)} (or mixed; code and math name "
                f"{DOMAIN_ALIASES[_family(model)]['code']} and {DOMAIN_ALIASES[_family(model)]['math']})"
            )
    drift = _knob_number(routing, "decode_drift", given.get("decode_drift", "0"), 1.0)
    bias = _knob_number(routing, "reuse", given.get("reuse", "0"), MAX_REUSE_BIAS)
    coupling = _knob_number(routing, "coupling", given.get("coupling", str(params.coupling)), MAX_COUPLING)
    type_coupling = _knob_number(
        routing, "type_coupling", given.get("type_coupling", str(params.type_coupling)), MAX_COUPLING
    )
    return replace(
        params, domain=domain, decode_drift=drift, reuse_bias=bias, coupling=coupling, type_coupling=type_coupling
    )


_DECIMAL = re.compile(r"[+-]?([0-9]+\.?[0-9]*|\.[0-9]+)([eE][+-]?[0-9]+)?")


def _routing_number(text: str) -> float | None:
    """A number in a routing name (zipf's exponent, a what-if's value): plain ASCII decimals only,
    None otherwise (float() also reads other scripts' digits, `1_0`, `inf` and `nan`)."""
    return float(text) if _DECIMAL.fullmatch(text.strip()) else None


def _knob_number(routing: str, key: str, text: str, most: float) -> float:
    value = _routing_number(text)
    if value is None:
        raise UsageError(f"--routing {routing}: {key} must be a number, got {text!r}")
    if not 0 <= value <= most:
        raise UsageError(f"--routing {routing}: {key} must be from 0 to {most:g}, got {text}")
    return value


@lru_cache(maxsize=None)
def _calibration(name: str) -> dict:
    ref = resources.files("klotski_sim.workload") / "data" / name
    return json.loads(ref.read_text())["data"]


# Which measured popularity a model's calibrated routing starts from: Mixtral-like models (8
# experts) Fiddler's per-layer MMLU counts, every other model OLMoE's (`_family`).
DOMAIN_ALIASES = {
    "mixtral": {"code": "college_computer_science", "math": "high_school_mathematics"},
    "olmoe": {"code": "github", "math": "arxiv"},  # (arxiv: LaTeX-heavy papers, the nearest to math measured)
}


def _family(model: ModelSpec) -> str:
    return "mixtral" if model.num_experts == 8 else "olmoe"


def mixtral_counts() -> dict[str, np.ndarray]:
    """Subject -> `[32, 8]` counts of Fiddler's Mixtral-8x7B (base) MMLU prefill."""
    subjects = _calibration("fiddler_mixtral_expert_popularity.json")["mixtral_8x7b_original"]
    return {name: np.asarray(s["expert_popularity"], dtype=float) for name, s in subjects.items()}


def mixtral_popularity() -> np.ndarray:
    """`[32, 8]` shares from Fiddler's Mixtral-8x7B (base) MMLU prefill counts, summed over subjects."""
    counts = np.sum(list(mixtral_counts().values()), axis=0)
    return counts / counts.sum(axis=1, keepdims=True)


_OLMOE_LAYERS = (0, 7, 15)


def olmoe_counts() -> dict[str, dict[int, np.ndarray]]:
    """Domain -> layer -> 64 counts of OLMoE-1B-7B's routing (layers 0, 7, 15)."""
    data = _calibration("olmoe_repo_routing_counts.json")["olmoe"]["expert_counts"]
    out: dict[str, dict[int, np.ndarray]] = {}
    for name, domain in data.items():
        out[name] = {}
        for pos, layer in enumerate(_OLMOE_LAYERS):
            counts = np.zeros(64)
            for e, c in domain[pos].items():
                counts[int(e)] += c
            out[name][layer] = counts
    return out


def olmoe_popularity() -> dict[int, np.ndarray]:
    """Layer -> 64 shares from OLMoE-1B-7B routing counts (layers 0, 7, 15), summed over domains."""
    by_domain = olmoe_counts()
    out = {}
    for layer in _OLMOE_LAYERS:
        counts = np.sum([domain[layer] for domain in by_domain.values()], axis=0)
        out[layer] = counts / counts.sum()
    return out


def domain_names(model: ModelSpec) -> tuple[str, ...]:
    """The domains whose routing was measured for models like this one."""
    return tuple(mixtral_counts() if _family(model) == "mixtral" else olmoe_counts())


def base_popularity(model: ModelSpec, params: SynthParams, rng: np.random.Generator) -> np.ndarray:
    """`[layers, experts]` corpus-level shares for the model (of its one domain, when the params
    name one; over every domain for `mixed`, as without)."""
    overall, by_domain = popularities(model, params, rng)
    return by_domain[params.domain] if params.domain not in (None, MIXED) else overall


def popularities(
    model: ModelSpec, params: SynthParams, rng: np.random.Generator
) -> tuple[np.ndarray, dict[str, np.ndarray]]:
    """`[layers, experts]` shares over every domain, and each measured domain's (only when the
    params name a domain), every domain's layer given the same hot experts: a model's expert is
    one expert whichever text it routes. The draws from `rng` are the same either way."""
    L, E = model.num_layers, model.num_experts
    if params.base == "uniform":
        return np.full((L, E), 1.0 / E), {}
    if params.base == "zipf":
        ranks = np.arange(1, E + 1, dtype=float) ** -params.zipf_a
        shares = ranks / ranks.sum()
        return np.stack([shares[rng.permutation(E)] for _ in range(L)]), {}
    wanted = params.domain is not None
    if E == 8:
        real = mixtral_popularity()
        src = np.rint(np.arange(L) * (len(real) - 1) / max(1, L - 1)).astype(int)
        subjects = mixtral_counts() if wanted else {}
        return real[src], {name: (c / c.sum(axis=1, keepdims=True))[src] for name, c in subjects.items()}
    measured = olmoe_popularity()
    domains = {name: {layer: c / c.sum() for layer, c in by_layer.items()} for name, by_layer in olmoe_counts().items()}
    out = np.empty((L, E))
    own = {name: np.empty((L, E)) for name in domains} if wanted else {}
    src_layers = np.array(sorted(measured))
    for layer in range(L):
        scaled = layer * 15 / max(1, L - 1)  # position in OLMoE's 16-layer stack
        nearest = int(src_layers[np.argmin(np.abs(src_layers - scaled))])
        order = np.argsort(-measured[nearest], kind="stable")  # (the overall shape's experts, hottest first)
        if E == 64 and L == 16 and layer in measured:
            out[layer] = measured[layer]
            for name in own:
                own[name][layer] = domains[name][layer]
            continue
        # resample the sorted shape to E experts, then give this layer its own hot experts (each
        # domain's shares in the overall shape's expert order, so a domain moves its experts' shares)
        perm = rng.permutation(E)
        for target, shares in ((out, measured[nearest]), *((own[n], domains[n][nearest]) for n in own)):
            shape = np.interp(np.linspace(0, 63, E), np.arange(64), shares[order])
            target[layer] = (shape / shape.sum())[perm]
    return out, own


# The most experts over which the generator's top-5 and more is a partition and a sort: numpy's
# partition takes 0.23-0.41 us a token's row of 64-128 float32 values, then 1.02-1.08 us over 160-256,
# where nine argmax passes take 0.51-0.69 us (top-7/top-9, numpy 2 on a 2-core machine).
_PARTITION_UP_TO = 128


def _top_sorted(values: np.ndarray, count: int) -> np.ndarray:
    """Indices of the `count` largest values along the last axis, largest first. `values`, the
    caller's own, is overwritten: it is the scratch space (struck out or negated in place, not
    copied: a copy of the generator's largest array, [sequences, tokens, experts], for every layer).

    Argmax passes (`routing.top_by_argmax`), ties to the lower index, up to top-4. Above, a
    partition and a sort (`_partition_sorted`) over up to `_PARTITION_UP_TO` experts; over more,
    the passes again, with the rows that hold a tie handed to the partition and sort, which break
    ties their own way: every draw is the same either way."""
    if count >= values.shape[-1]:
        return np.argsort(np.negative(values, out=values), axis=-1)
    if count <= 4:
        return top_by_argmax(values, count)
    if values.shape[-1] <= _PARTITION_UP_TO:
        return _partition_sorted(values, count)
    picked: list[np.ndarray] = []
    top = top_by_argmax(values, count, picked)
    # Only a row with two equal values among its `count` largest (or one equal to the next: which
    # is in is then a tie too) has more than one answer; one more pass finds the next largest.
    picked.append(np.max(values, axis=-1))
    tops = np.stack(picked, axis=-1)
    tied = np.nonzero(np.any(tops[..., 1:] == tops[..., :-1], axis=-1))
    if len(tied[0]):
        rows = values[tied]  # (a copy of those rows alone: their struck values put back)
        np.put_along_axis(rows, top[tied], tops[tied][..., :count], axis=-1)
        top[tied] = _partition_sorted(rows, count)
    return top


def _partition_sorted(values: np.ndarray, count: int) -> np.ndarray:
    """The `count` largest along the last axis, largest first, by a partition and a sort of the
    negated values (the generator's ties for top-5 and more, kept);
    `values` is overwritten."""
    negated = np.negative(values, out=values)  # (the very numbers -values would give: negation is exact)
    part = np.argpartition(negated, count - 1, axis=-1)[..., :count]
    order = np.argsort(np.take_along_axis(negated, part, axis=-1), axis=-1)
    return np.take_along_axis(part, order, axis=-1)


def _plus(base: np.ndarray, term: np.ndarray) -> np.ndarray:
    """`base + term` computed in the memory of `term`, a gather of the caller's own (of an
    affinity matrix scaled once: `(a * scale)[rows]` holds the numbers `a[rows] * scale` would),
    instead of another temporary."""
    np.add(term, base, out=term)
    return term


def _forward_fill_index(fresh: np.ndarray) -> np.ndarray:
    """For each position, the index of the latest position <= it where `fresh` is True (along
    the last axis; position 0 must be fresh)."""
    idx = np.where(fresh, np.arange(fresh.shape[-1]), 0)
    return np.maximum.accumulate(idx, axis=-1)


def check_routing_fits(model: ModelSpec, sequences: int, tokens: int, described: str) -> None:
    """The synthetic routing of `sequences` x `tokens` (the expert ids of every token, layer and
    slot, and the generator's working copies) must fit in host memory: refused with the numbers
    before anything is drawn, not a failed allocation. `described` names the sequences."""
    id_bytes = np.dtype(expert_id_type(model.num_experts)).itemsize
    need = 4 * sequences * tokens * model.num_layers * model.top_k * id_bytes
    try:
        have = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return
    if need > have:
        raise UsageError(
            f"the routing of {described} x {tokens} tokens would need about {need / 2**30:.1f} GiB of "
            f"host memory; this machine has {have / 2**30:.1f} GiB"
        )


# Sequences are drawn as many at a time as keep a chunk's [sequences, tokens, experts] working
# arrays (several of them, float64 and float32) near this many elements, at most 64 sequences and
# at least one. The chunk changes no draw (`_drawn_blocks`), only memory and speed. A bound in
# elements, not tokens: fine-grained models' arrays are 8-16 times Mixtral's per token (2^18 elements
# draw 16 x 8193 tokens of Qwen3-30B-A3B in 9.5 s and 134 MB, where 64 sequences or 2^17 tokens a
# chunk take 13.7 s and 546 MB; Mixtral's own within 3% either way).
_ELEMENTS_PER_CHUNK = 1 << 18


def synthesize(
    model: ModelSpec,
    sequences: int,
    prompt_len: int,
    gen_len: int,
    routing: str = DEFAULT_ROUTING,
    seed: int = 0,
    with_weights: bool = False,
    chunk: int | None = None,
) -> Trace:
    """A trace of `sequences` sequences of prompt_len + gen_len tokens each. Gate weights (the
    softmax of the drawn logits over the chosen experts) only on request: they triple the file.
    Sequences are drawn `chunk` at a time (`synthesized_blocks`), each chunk into its place.
    Sequence i is the same in every trace of the same model, routing, seed and lengths, however
    many sequences it holds and whatever the chunk (`_drawn_blocks`)."""
    stream = synthesized_blocks(model, sequences, prompt_len, gen_len, routing, seed, with_weights, chunk)
    experts = np.empty(stream.shape, dtype=stream.dtype)
    weights = np.empty(stream.shape, dtype=np.float16) if with_weights else None
    for _ in stream.drawn(into=(experts, weights)):
        pass
    return Trace(experts, stream.seq_offsets, stream.prompt_lens, stream.meta, weights)


@dataclass(frozen=True)
class TraceStream:
    """A synthetic trace as it is drawn: everything but its ids (and gate weights), which `drawn()`
    yields a chunk of sequences at a time, `[tokens, layers, top_k]` each, in order. Written to a
    file as they come (the trace cache), a long prompt's trace is never held whole."""

    shape: tuple[int, int, int]  # [tokens, layers, top_k] of the whole trace
    dtype: np.dtype
    seq_offsets: np.ndarray
    prompt_lens: np.ndarray
    meta: dict
    drawn: Callable[..., Iterator[tuple[np.ndarray, np.ndarray | None]]]  # `_drawn_blocks`, bound

    @property
    def blocks(self) -> Iterator[np.ndarray]:
        """The ids, a chunk of sequences at a time (each block its own array)."""
        return (ids for ids, _ in self.drawn())


def _described(params: SynthParams) -> dict:
    """The knobs a trace's meta records; the what-ifs only where set (a plain calibrated trace's
    file stays what it was before they existed)."""
    knobs = asdict(params)
    for name, off in (("domain", None), ("decode_drift", 0.0), ("reuse_bias", 0.0)):
        if knobs[name] == off:
            del knobs[name]
    return knobs


def synthesized_blocks(
    model: ModelSpec,
    sequences: int,
    prompt_len: int,
    gen_len: int,
    routing: str = DEFAULT_ROUTING,
    seed: int = 0,
    with_weights: bool = False,
    chunk: int | None = None,
) -> TraceStream:
    """The trace `synthesize` returns, as a stream of blocks: sequences are drawn `chunk` at a
    time (by default as many as `_ELEMENTS_PER_CHUNK` allows: 1 to 64).
    Nothing is drawn until `drawn()` is read."""
    if sequences < 1 or prompt_len < 1 or gen_len < 0:
        raise UsageError("sequences and prompt_len must be >= 1, gen_len >= 0")
    params = params_for(routing, model)
    L, E, k = model.num_layers, model.num_experts, model.top_k
    T = prompt_len + gen_len
    meta = {
        "model": model.name,
        "num_experts": E,
        "top_k": k,
        "num_layers": L,
        "dataset": "synthetic",
        "recorder": "klotski_sim.workload.trace_synth",
        "license": "Apache-2.0 (generated; calibration data Apache-2.0, see klotski_sim/workload/data/NOTICE)",
        "source": f"synth:{routing}(seed={seed})",
        "generator": {
            "routing": routing,
            "seed": seed,
            "sequences": sequences,
            "prompt_len": prompt_len,
            "gen_len": gen_len,
            "params": _described(params),
        },
    }
    return TraceStream(
        (sequences * T, L, k),
        np.dtype(expert_id_type(E)),
        np.arange(sequences + 1, dtype=np.int64) * T,
        np.full(sequences, prompt_len, dtype=np.int32),
        meta,
        partial(_drawn_blocks, model, params, sequences, T, seed, with_weights, chunk, prompt_len=prompt_len),
    )


def _drawn_blocks(
    model: ModelSpec,
    params: SynthParams,
    sequences: int,
    T: int,
    seed: int,
    with_weights: bool,
    chunk: int | None,
    into: tuple[np.ndarray, np.ndarray | None] | None = None,
    threads: int | None = None,
    prompt_len: int = 0,
) -> Iterator[tuple[np.ndarray, np.ndarray | None]]:
    """The generator's draws, a chunk of sequences at a time: `([S * T, L, k] ids, weights or None)`,
    drawn into their rows of `into` (the whole trace's ids and weights) when given.

    Each kind of draw has a random stream of its own (a sequence's shares; its tokens' types; each
    layer's Gumbel noise; each layer's stickiness), read sequence after sequence in order: a
    sequence's numbers then depend on the sequences before it alone, not on how many follow or how
    many are drawn at once. (With one stream for every draw, a run of 1 batch and one of 17 would
    replay different routing for the same first batch, and a hardware number that changes the
    planner's n would change every sequence's routing with it.)

    Chunks are drawn by `threads` threads (by default `draw_threads`), each stream still read
    chunk after chunk (`_Turns`): numpy lets go of the interpreter inside its calls over a chunk's
    arrays, so two cores draw DeepSeek-V3's default routing in 16.4 s where one takes 29.8, and the
    same numbers (docs/performance.md)."""
    rng = np.random.default_rng(seed)
    L, E, k = model.num_layers, model.num_experts, model.top_k
    chunk = chunk or max(1, min(64, _ELEMENTS_PER_CHUNK // (T * E)))
    overall, by_domain = popularities(model, params, rng)
    base = by_domain[params.domain] if params.domain not in (None, MIXED) else overall
    # the affinities times their coupling, once (the same numbers as scaling each gather of them)
    affinity = rng.standard_normal((L, E, E)) * params.coupling
    type_affinity = rng.standard_normal((L, params.token_types, E)) * params.type_coupling
    # (the what-ifs' streams come after every stream plain `calibrated` reads: those stay as they were)
    streams = [np.random.default_rng(child) for child in np.random.SeedSequence(seed).spawn(4 + 2 * L)]
    shares_rng, types_rng, gumbel_rngs, stick_rngs = (
        streams[0],
        streams[1],
        streams[2 : 2 + L],
        streams[2 + L : 2 + 2 * L],
    )
    domains_rng, drift_rng = streams[2 + 2 * L :]
    domain_bases = np.stack(list(by_domain.values())) if params.domain == MIXED else None
    turns = _Turns(1 + L)  # (0: the shares' and types' streams; 1 + layer: that layer's two)

    def drawn(number: int, lo: int) -> tuple[np.ndarray, np.ndarray | None]:
        """Chunk `number`, whose first sequence is `lo`."""
        S = min(chunk, sequences - lo)
        if into is None:
            experts = np.empty((S, T, L, k), dtype=expert_id_type(E))
            weights = np.empty((S, T, L, k), dtype=np.float16) if with_weights else None
        else:
            experts = into[0][lo * T : (lo + S) * T].reshape(S, T, L, k)
            weights = None if into[1] is None else into[1][lo * T : (lo + S) * T].reshape(S, T, L, k)
        with turns.of(0, number):
            # (from uniform doubles: `integers` draws two values from each 64-bit number and drops an
            # odd call's last half, so a chunk's size would move the next chunk's types)
            seq_base = (
                domain_bases[(domains_rng.random(S) * len(domain_bases)).astype(np.intp)]
                if domain_bases is not None
                else base
            )
            alpha = (
                np.broadcast_to(np.maximum(params.concentration * E * seq_base, 1e-3), (S, L, E))
                if params.concentration
                else None
            )
            g = shares_rng.standard_gamma(alpha) if alpha is not None else None
            token_type = (types_rng.random((S, T)) * params.token_types).astype(np.intp)
            fresh = drift_rng.standard_gamma(alpha) if alpha is not None and params.decode_drift else None
        seq_shares = g / g.sum(axis=-1, keepdims=True) if g is not None else np.broadcast_to(seq_base, (S, L, E))
        log_shares = np.log(np.maximum(seq_shares, 1e-12))
        log_decode_shares = None
        if fresh is not None:  # the generated tokens' shares: part the prompt's, part drawn apart
            drift = params.decode_drift
            decode_shares = (1 - drift) * seq_shares + drift * fresh / fresh.sum(axis=-1, keepdims=True)
            log_decode_shares = np.log(np.maximum(decode_shares, 1e-12))
        prev_first = None
        for layer in range(L):
            # [S, T, E] arrays, computed in place where the values are the same (each of them 1-2 MB,
            # or one sequence's when that is more: `_ELEMENTS_PER_CHUNK`)
            logits = np.broadcast_to(log_shares[:, None, layer, :], (S, T, E)).astype(np.float32)
            if log_decode_shares is not None:
                logits[:, prompt_len:] = log_decode_shares[:, None, layer, :]
            if prev_first is not None and params.coupling:
                logits = _plus(logits, affinity[layer][prev_first])
            if params.type_coupling:
                logits = _plus(logits, type_affinity[layer][token_type])
            with turns.of(1 + layer, number):
                gumbel = gumbel_rngs[layer].random((S, T, E), dtype=np.float32)
                u = stick_rngs[layer].random((S, T))
            np.maximum(gumbel, 1e-30, out=gumbel)
            np.log(gumbel, out=gumbel)
            np.negative(gumbel, out=gumbel)
            np.log(gumbel, out=gumbel)  # log(-log(u)): minus Gumbel noise
            noisy = np.subtract(logits, gumbel, out=None if weights is not None else logits)  # (weights read logits)
            del gumbel
            mode_all = u < params.stick_all
            mode_one = (u >= params.stick_all) & (u < params.stick_all + params.stick_one)
            mode_all[:, 0] = mode_one[:, 0] = False
            if params.reuse_bias:
                chosen = _chosen_token_by_token(noisy, mode_all, mode_one, k, params.reuse_bias)
                first = chosen[..., 0]
                _keep(experts, weights, logits, chosen, layer)
                prev_first = first
                continue
            ranking = _top_sorted(noisy, k + 1)  # Gumbel-top-k = sampling without replacement
            # first choice: drawn, or (stick_all) the predecessor's
            source = _forward_fill_index(~mode_all)  # each token's latest own draw (itself, unless it sticks)
            first = np.take_along_axis(ranking[..., 0], source, axis=1)
            # other slots: drawn (the ranking after its first); with stick_one the predecessor's
            # first choice comes first among them
            prev_first = np.concatenate([first[:, :1], first[:, :-1]], axis=1)
            cand = np.concatenate([prev_first[..., None], ranking[..., 1:]], axis=-1)  # [S, T, k+1]
            valid = cand != first[..., None]
            ones = np.nonzero(mode_one)  # (a few tokens: only theirs can exclude the predecessor's choice)
            valid[ones + (slice(1, None),)] &= cand[ones + (slice(1, None),)] != prev_first[ones][:, None]
            valid[..., 0] &= mode_one
            if k == 2:  # the first valid candidate
                order = np.argmax(valid, axis=-1)[..., None]
            else:
                order = np.argsort(~valid, axis=-1, kind="stable")[..., : k - 1]
            rest_own = np.take_along_axis(cand, order, axis=-1)
            rest = np.take_along_axis(rest_own, source[..., None], axis=1)
            chosen = np.concatenate([first[..., None], rest], axis=-1)
            _keep(experts, weights, logits, chosen, layer)
            prev_first = first
        return experts.reshape(S * T, L, k), None if weights is None else weights.reshape(S * T, L, k)

    starts = range(0, sequences, chunk)
    threads = min(len(starts), threads or draw_threads(chunk * T * E))
    if threads <= 1:
        for number, lo in enumerate(starts):
            yield drawn(number, lo)
        return
    with ThreadPoolExecutor(threads, thread_name_prefix="klotski-draw") as pool:
        pending: deque[Future[tuple[np.ndarray, np.ndarray | None]]] = deque()
        try:
            for number, lo in enumerate(starts):
                if len(pending) == threads:  # (as many chunks drawn at once as threads: bounded memory)
                    yield pending.popleft().result()
                pending.append(pool.submit(drawn, number, lo))
            while pending:
                yield pending.popleft().result()
        finally:  # (stopped early, or a chunk's error said: the chunks after it stop at their next turn)
            turns.give_up()


def _keep(experts: np.ndarray, weights: np.ndarray | None, logits: np.ndarray, chosen: np.ndarray, layer: int) -> None:
    """A layer's choices into the chunk's ids, with their gate weights when asked for: the softmax
    of the (unbiased) logits over the chosen experts, renormalised."""
    experts[:, :, layer, :] = chosen
    if weights is not None:
        sel = np.take_along_axis(logits, chosen.astype(np.int64), axis=-1)
        w = np.exp(sel - sel.max(axis=-1, keepdims=True))
        weights[:, :, layer, :] = w / w.sum(axis=-1, keepdims=True)


def _chosen_token_by_token(
    noisy: np.ndarray, mode_all: np.ndarray, mode_one: np.ndarray, k: int, bias: float
) -> np.ndarray:
    """`[S, T, k]` choices of a layer, a token at a time, each token's noisy logits raised by
    `bias` on the experts its predecessor chose (a reuse-biased router). The same stickiness as
    the vectorised draw: a `stick_all` token repeats its predecessor's set, a `stick_one` token
    puts its predecessor's first choice right after its own; at `bias` 0 it gives that draw's very
    choices (tests/test_routing_knobs.py), token by token."""
    S, T, _ = noisy.shape
    chosen = np.empty((S, T, k), dtype=np.intp)
    rows = np.arange(S)[:, None]
    for t in range(T):
        scores = noisy[:, t].copy()
        if t:
            scores[rows, chosen[:, t - 1]] += np.float32(bias)
        ranking = _top_sorted(scores, k + 1)  # [S, k + 1]
        own_first = ranking[:, 0]
        prev_first = chosen[:, t - 1, 0] if t else own_first
        cand = np.concatenate([prev_first[:, None], ranking[:, 1:]], axis=-1)
        valid = cand != own_first[:, None]
        one = mode_one[:, t]
        valid[one, 1:] &= cand[one, 1:] != prev_first[one, None]
        valid[:, 0] &= one
        order = np.argsort(~valid, axis=-1, kind="stable")[:, : k - 1]
        own = np.concatenate([own_first[:, None], np.take_along_axis(cand, order, axis=-1)], axis=-1)
        chosen[:, t] = np.where(mode_all[:, t, None], chosen[:, t - 1], own) if t else own
    return chosen


# The most threads a draw uses (`draw_threads`): the streams are read in chunk order, so a thread
# more waits more.
MAX_DRAW_THREADS = 4
# The most elements of [sequences, tokens, experts] working arrays that a draw's threads hold at
# once. A chunk holds _ELEMENTS_PER_CHUNK, or one sequence's tokens x experts when that is more:
# a long prompt's. Each thread more holds about 26 bytes an element more: DeepSeek-V3 at a 16k-token
# prompt (4.2M elements a chunk) takes 444 MB in two threads, 333 MB in one.
# 9 x 2^20 elements, about 245 MB, keep that prompt to two threads and a 32k-token one to one.
_ELEMENTS_IN_FLIGHT = 9 << 20


def draw_threads(chunk_elements: int = 0) -> int:
    """Threads for a synthetic draw of chunks of `chunk_elements` working elements each: this
    process's cores, shared with the other worker processes of its pool (a sweep's workers draw one
    routing each at a time), at most MAX_DRAW_THREADS and as many as _ELEMENTS_IN_FLIGHT hold."""
    return max(
        1, min(MAX_DRAW_THREADS, available_cores() // run_size.sharing(), _ELEMENTS_IN_FLIGHT // max(1, chunk_elements))
    )


class _DrawAbandoned(Exception):
    """The draw was stopped (by its reader, or an earlier chunk's error): this chunk's turn will never come."""


class _Turns:
    """Each group of random streams read chunk after chunk, whichever thread draws the chunk: the
    draw of `of(group, number)` waits until chunk `number - 1` has drawn from that group."""

    def __init__(self, groups: int) -> None:
        self._next = [0] * groups
        self._changed = threading.Condition()
        self._abandoned = False

    @contextmanager
    def of(self, group: int, number: int) -> Iterator[None]:
        with self._changed:
            self._changed.wait_for(lambda: self._next[group] == number or self._abandoned)
            if self._abandoned:
                raise _DrawAbandoned
        yield  # (the streams are this chunk's alone until it moves them on)
        with self._changed:
            self._next[group] = number + 1
            self._changed.notify_all()

    def give_up(self) -> None:
        """No chunk waits for a turn any more (the draw was stopped, or failed)."""
        with self._changed:
            self._abandoned = True
            self._changed.notify_all()


def synthetic_routing(model: ModelSpec, shape: RunShape, routing: str = DEFAULT_ROUTING, seed: int = 0) -> RoutingTable:
    """The routing of one run straight from the generator (tests, benchmarks, notebooks)."""
    trace = synthesize(model, shape.num_sequences, shape.prompt_len, shape.gen_len, routing, seed)
    return replay(trace, model, shape, where=f"synthetic {routing}").routing
