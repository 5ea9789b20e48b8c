"""Request workloads for serving: who asks for how many tokens, and when.

A workload is a tuple of requests, each with its prompt and output length and its arrival time:
*offline* (all at t = 0, as FluxMoE's throughput runs submit `B_cfg` requests at once: SERVING.md
"Testbeds and workloads") or *online* (Poisson arrivals at a rate, seeded; the first `warmup`
requests are served but left out of the metrics, as FluxMoE's 10 warm-up requests are).

Lengths come from the command line (fixed), from a user's file (CSV with a header
`prompt_len,output_len[,arrival_s]`, or JSON lines with those keys), or from a length distribution
(`klotski_sim/serving/data/*.json`, each with its source).
"""

from __future__ import annotations

import csv
import io
import json
import math
from dataclasses import dataclass, replace
from importlib import resources
from pathlib import Path

import numpy as np

from klotski_sim.files.textfile import read_text
from klotski_sim.util.errors import UsageError

MAX_REQUESTS = 1_000_000  # a file or a count beyond this is refused before anything is built
MAX_TOKENS = 1 << 24  # one request's prompt or output, in tokens (16M: far beyond any context window)


class WorkloadError(UsageError):
    """A workload that cannot be served as given (one line naming the file, line or flag)."""


@dataclass(frozen=True)
class Request:
    """One request: `prompt_len` tokens in, `output_len` tokens out, arriving at `arrival_s`."""

    id: int
    prompt_len: int
    output_len: int
    arrival_s: float = 0.0
    warmup: bool = False  # served, but not counted in the metrics

    @property
    def total_len(self) -> int:
        return self.prompt_len + self.output_len


@dataclass(frozen=True)
class Workload:
    """The requests of one serving run, in arrival order, and where they came from."""

    requests: tuple[Request, ...]
    source: str  # e.g. "fixed 52+1024", "sharegpt-like(seed=0)", "file requests.csv"
    arrivals: str = "offline"  # "offline" or "poisson(rate=10/s, seed=0)"

    def __post_init__(self) -> None:
        if not self.requests:
            raise WorkloadError(f"workload {self.source}: no requests")
        times = [r.arrival_s for r in self.requests]
        if any(b < a for a, b in zip(times, times[1:])):
            raise WorkloadError(f"workload {self.source}: requests must be in arrival order")

    @property
    def measured(self) -> tuple[Request, ...]:
        return tuple(r for r in self.requests if not r.warmup)

    def describe(self) -> str:
        prompts = [r.prompt_len for r in self.requests]
        outputs = [r.output_len for r in self.requests]
        return (
            f"{len(self.requests)} requests ({self.source}; {self.arrivals}), prompt {np.mean(prompts):.1f} tokens "
            f"mean (max {max(prompts)}), output {np.mean(outputs):.1f} mean (max {max(outputs)})"
        )


def _check_length(value: object, what: str, where: str, low: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= MAX_TOKENS:
        raise WorkloadError(f"{where}: {what} must be a whole number from {low} to {MAX_TOKENS:,}, got {value!r:.40}")
    return value


def _check_count(count: int, what: str) -> None:
    if isinstance(count, bool) or not isinstance(count, int) or not 1 <= count <= MAX_REQUESTS:
        raise WorkloadError(f"{what}: the number of requests must be from 1 to {MAX_REQUESTS:,}, got {count!r}")


def fixed_requests(count: int, prompt_len: int, output_len: int) -> Workload:
    """`count` equal requests, all at t = 0."""
    _check_count(count, "--requests")
    _check_length(prompt_len, "--prompt-len", "--prompt-len", 1)
    _check_length(output_len, "--output-len", "--output-len", 1)
    requests = tuple(Request(i, prompt_len, output_len) for i in range(count))
    return Workload(requests, f"fixed {prompt_len}+{output_len}")


@dataclass(frozen=True)
class LengthDistribution:
    """Prompt and output lengths as quantile tables (inverse-CDF sampling, linear between rows)."""

    name: str
    source: str
    prompt_quantiles: tuple[tuple[float, int], ...]  # (probability, tokens), probabilities rising 0..1
    output_quantiles: tuple[tuple[float, int], ...]

    def draw(self, count: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
        rng = np.random.default_rng(seed)
        return _inverse(self.prompt_quantiles, rng.random(count)), _inverse(self.output_quantiles, rng.random(count))


def _inverse(table: tuple[tuple[float, int], ...], u: np.ndarray) -> np.ndarray:
    probs = np.array([p for p, _ in table])
    values = np.array([v for _, v in table], dtype=float)
    return np.maximum(1, np.rint(np.interp(u, probs, values))).astype(int)


def _read_distribution(name: str, text: str) -> LengthDistribution:
    """A distribution file: {"name", "source", "prompt_quantiles": [[p, tokens], ...], "output_quantiles": ...}."""
    where = f"length distribution {name}"
    try:
        data = json.loads(text)
        tables = []
        for key in ("prompt_quantiles", "output_quantiles"):
            rows = tuple((float(p), int(v)) for p, v in data[key])
            probs = [p for p, _ in rows]
            if len(rows) < 2 or probs[0] != 0.0 or probs[-1] != 1.0 or any(b <= a for a, b in zip(probs, probs[1:])):
                raise WorkloadError(f"{where}: {key} must rise from probability 0 to 1")
            if any(b < a for a, b in zip([v for _, v in rows], [v for _, v in rows][1:])) or rows[0][1] < 1:
                raise WorkloadError(f"{where}: {key} must be lengths >= 1 that never fall")
            tables.append(rows)
        return LengthDistribution(str(data["name"]), str(data["source"]), tables[0], tables[1])
    except (ValueError, KeyError, TypeError) as err:
        raise WorkloadError(f"{where}: not a distribution file ({err})") from None


def builtin_distributions() -> dict[str, LengthDistribution]:
    """The shipped length distributions, by name (klotski_sim/serving/data/)."""
    out = {}
    for entry in sorted(resources.files("klotski_sim.serving").joinpath("data").iterdir(), key=lambda e: e.name):
        if entry.name.endswith(".json"):
            dist = _read_distribution(entry.name, entry.read_text(encoding="utf-8"))
            out[dist.name] = dist
    return out


def drawn_requests(count: int, distribution: str, seed: int, output_len: int | None = None) -> Workload:
    """`count` requests with lengths drawn from a shipped distribution; `output_len` fixes the
    outputs (FluxMoE's offline runs: ShareGPT prompts, a fixed output length)."""
    _check_count(count, "--requests")
    known = builtin_distributions()
    if distribution not in known:
        raise WorkloadError(f"--lengths {distribution}: unknown; distributions: {', '.join(known)}")
    dist = known[distribution]
    prompts, outputs = dist.draw(count, seed)
    if output_len is not None:
        _check_length(output_len, "--output-len", "--output-len", 1)
        outputs = np.full(count, output_len)
    requests = tuple(Request(i, int(p), int(o)) for i, (p, o) in enumerate(zip(prompts, outputs)))
    fixed = f", output fixed {output_len}" if output_len is not None else ""
    return Workload(requests, f"{distribution}(seed={seed}{fixed})")


def read_requests(path: str | Path) -> Workload:
    """Requests from a CSV file (header `prompt_len,output_len[,arrival_s]`) or JSON lines
    (`{"prompt_len": .., "output_len": .., "arrival_s": ..}` per line); a bad line is one error
    naming the file and line."""
    path = Path(path)
    text = read_text(path, "request file", WorkloadError, max_bytes=256 << 20)
    rows: list[tuple[int, dict]] = []
    if path.suffix.lower() in (".jsonl", ".json", ".ndjson"):
        for number, line in enumerate(text.splitlines(), 1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as err:
                raise WorkloadError(f"{path}:{number}: not JSON ({err.msg})") from None
            if not isinstance(record, dict):
                raise WorkloadError(f"{path}:{number}: expected an object with prompt_len and output_len")
            rows.append((number, record))
    else:
        reader = csv.DictReader(io.StringIO(text))
        missing = {"prompt_len", "output_len"} - set(reader.fieldnames or ())
        if missing:
            raise WorkloadError(f"{path}:1: the header must name prompt_len and output_len (missing {sorted(missing)})")
        for record in reader:
            if None in record or None in record.values():
                raise WorkloadError(f"{path}:{reader.line_num}: expected {len(reader.fieldnames or ())} fields")
            parsed: dict = {}
            for key, value in record.items():
                try:
                    parsed[key] = int(value) if key != "arrival_s" else float(value)
                except ValueError:
                    raise WorkloadError(f"{path}:{reader.line_num}: {key} {value!r:.40} is not a number") from None
            rows.append((reader.line_num, parsed))
    if len(rows) > MAX_REQUESTS:
        raise WorkloadError(f"{path}: {len(rows):,} requests; at most {MAX_REQUESTS:,}")
    requests: list[Request] = []
    timed = None
    for i, (number, record) in enumerate(rows):
        where = f"{path}:{number}"
        unknown = set(record) - {"prompt_len", "output_len", "arrival_s"}
        if unknown:
            raise WorkloadError(f"{where}: unknown field(s) {sorted(unknown)}")
        prompt = _check_length(record.get("prompt_len"), "prompt_len", where, 1)
        output = _check_length(record.get("output_len"), "output_len", where, 1)
        has_time = "arrival_s" in record
        if timed is None:
            timed = has_time
        elif timed != has_time:
            raise WorkloadError(f"{where}: give arrival_s on every line or on none")
        arrival = record.get("arrival_s", 0.0)
        if (
            isinstance(arrival, bool)
            or not isinstance(arrival, (int, float))
            or not math.isfinite(arrival)
            or arrival < 0
        ):
            raise WorkloadError(f"{where}: arrival_s must be a finite number of seconds >= 0, got {arrival!r:.40}")
        if requests and arrival < requests[-1].arrival_s:
            raise WorkloadError(f"{where}: arrival_s {arrival} is before the line above's ({requests[-1].arrival_s})")
        requests.append(Request(i, prompt, output, float(arrival)))
    if not requests:
        raise WorkloadError(f"{path}: no requests")
    return Workload(tuple(requests), f"file {path.name}", "from the file" if timed else "offline")


def with_poisson_arrivals(workload: Workload, rate: float, seed: int, warmup: int = 0) -> Workload:
    """The same requests arriving as a Poisson process of `rate` requests per second (seeded);
    the first `warmup` are served but not measured."""
    if isinstance(rate, bool) or not isinstance(rate, (int, float)) or not math.isfinite(rate) or rate <= 0:
        raise WorkloadError(f"--rate must be a positive number of requests per second, got {rate!r}")
    if not 0 <= warmup < len(workload.requests):
        raise WorkloadError(
            f"--warmup {warmup}: must be from 0 to {len(workload.requests) - 1} (one fewer than the requests)"
        )
    gaps = np.random.default_rng(seed).exponential(1.0 / rate, len(workload.requests))
    times = np.cumsum(gaps) - gaps[0]  # the first request at t = 0
    requests = tuple(
        replace(r, arrival_s=float(t), warmup=i < warmup) for i, (r, t) in enumerate(zip(workload.requests, times))
    )
    return Workload(requests, workload.source, f"poisson(rate={rate:g}/s, seed={seed}, warmup={warmup})")
