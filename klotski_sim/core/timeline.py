"""The Timeline (the second contract): one row per executed op, and everything derived from it.

The simulator and the runtime both produce a Timeline with the same columns
(`op_id, stream, resource, start, end` + the op's tags), so every metric below (throughput,
bubbles, utilisation, lower bound, efficiency) means the same thing for a simulated and a
measured run.

Bubbles are the idle gaps of the GPU between its first and its last op. Each gap is attributed
to the op that ends it: before an expert op it is *intra-layer* (waiting for an expert inside the
MoE layer), otherwise *inter-layer* (waiting for attention/gate weights or KV). Its *cause* is the
category of the op whose completion made that op ready (the last dependency to arrive).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field, fields
from functools import cached_property
from operator import attrgetter, itemgetter
from typing import TYPE_CHECKING, Any, Collection, Iterator, Mapping, Sequence

import numpy as np

from klotski_sim.core.schedule import Op, gc_paused
from klotski_sim.names import base_resource, resource_rank
from klotski_sim.util.grouping import factorize, group_sums, is_missing
from klotski_sim.util.lazy import pd  # (imported when first used: klotski_sim/util/lazy.py; a summary never imports it)
from klotski_sim.util.units import memory_text

if TYPE_CHECKING:
    from klotski_sim.core.schedule import Schedule

INTRA_LAYER_CATEGORIES = frozenset({"expert"})
_BATCH_TEXT: dict[tuple[int, ...], str] = {(): ""}


def _batch_text(batches: tuple[int, ...]) -> str:
    """ "0,1,2" for a batches tuple, memoised: the same few tuples recur across thousands of ops."""
    text = _BATCH_TEXT[batches] = ",".join(map(str, batches))
    return text


def _batch_ids(text: Any) -> list[str]:
    """The batches of a `batches` text ("0,1"; "" or missing: none, "-1"); a number where a
    timeline was read back from CSV, whose reader takes a lone batch's "3" for 3.0."""
    if isinstance(text, str):
        return text.split(",") if text else ["-1"]
    if isinstance(text, (int, float, np.number)) and text == text:
        return [str(int(text))]
    return ["-1"]


MEMORY_CHECK = "<memory check>"  # the op_id of a refusal by the memory check, before any op was built


@dataclass(frozen=True)
class OutOfMemory:
    """Why a run stopped: starting `op_id` would have needed `needed_bytes` of GPU memory."""

    op_id: str
    time: float
    needed_bytes: int
    available_bytes: int
    in_use_bytes: int
    detail: str = ""  # what the needed bytes are made of (the memory check says)

    def describe(self) -> str:
        """Where the run ran out and the numbers, in one line (what both CLIs print)."""
        where = "the memory check (nothing built)" if self.op_id == MEMORY_CHECK else f"starting {self.op_id}"
        return (
            f"out of GPU memory at {where}: needs {memory_text(self.needed_bytes)}, "
            f"{memory_text(self.available_bytes)} available" + (f" ({self.detail})" if self.detail else "")
        )

    @staticmethod
    def from_dict(data: Mapping[str, Any]) -> "OutOfMemory":
        """From its dict form (a summary's `oom`, a timeline file's meta)."""
        return OutOfMemory(**{f.name: data[f.name] for f in fields(OutOfMemory) if f.name in data})


@dataclass(frozen=True)
class Summary:
    """The headline numbers of one run (what `summary.json` holds)."""

    policy: str
    model: str
    hardware: str
    batch_size: int
    num_batches: int
    prompt_len: int
    gen_len: int
    status: str
    source: str
    makespan_s: float
    throughput_tok_s: float  # generated tokens / makespan (prefill included): the papers' end-to-end figure
    decode_throughput_tok_s: float  # tokens generated after the first / decode time (Klotski's and FlexGen's code)
    prefill_s: float  # a batch's prefill latency (its step 0), mean over batches: not a part of the makespan
    decode_s: float  # makespan minus the prefill windows
    decode_step_s: float
    moe_block_s: float  # one layer of one decode step over all n batches (mean)
    gpu_busy_s: float
    host_blocked_s: float  # the host thread waiting on syncs and pageable copies
    bubble_s: float
    bubble_inter_s: float
    bubble_intra_s: float
    lower_bound_s: float
    lower_bound_resource: str
    efficiency: float
    peak_gpu_bytes: int
    num_ops: int
    generated_tokens: int
    impl: str = ""
    utilization: dict[str, float] = field(default_factory=dict)
    bubble_by_cause: dict[str, float] = field(default_factory=dict)
    oom: dict[str, Any] | None = None
    extra: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


class Timeline:
    """Executed ops as columns (numpy arrays); `df` gives the pandas view."""

    def __init__(
        self,
        columns: Mapping[str, np.ndarray],
        meta: Mapping[str, Any],
        memory: tuple[np.ndarray, np.ndarray] | None = None,
    ) -> None:
        """`columns` may be a `ScheduleColumns`: then each column is only assembled when first read."""
        self.columns: Mapping[str, np.ndarray] = columns if isinstance(columns, ScheduleColumns) else dict(columns)
        self.meta = dict(meta)
        self.memory = memory if memory is not None else (np.zeros(0), np.zeros(0))
        self._memo: dict[str, Any] = {}  # bubbles, summary, codes: derived once (a Timeline never changes)

    def detach(self, keep: Collection[str] | None = None) -> None:
        """Assemble the columns now and let go of the schedule they are read from (a schedule
        holds a few times the memory of its timeline). With `keep`, only those columns (and
        `end`) stay, of the timeline and of its bubbles once found: all a caller that has the
        summary and will only draw needs (a comparison of six 300k-op timelines keeps a third of
        the memory, and its workers send that much back)."""
        if keep is None:
            if isinstance(self.columns, ScheduleColumns):
                self.columns = self.columns.materialize()
            return
        if "bubbles" in self._memo:
            names, columns = self._memo["bubbles"]
            self._memo["bubbles"] = (
                [name for name in names if name in keep],
                None if columns is None else {k: v for k, v in columns.items() if k in keep},
            )
        elif "gaps" in self._memo:  # (a summary found the gaps: their kept columns, while the columns are here)
            self._memo["bubbles"] = self._bubble_columns(keep)
        self._memo.pop("gaps", None)  # (every gap's arrays: as large as the columns it is asked to drop)
        for name in [key[len("codes:") :] for key in self._memo if key.startswith("codes:")]:
            if name not in keep:
                del self._memo["codes:" + name]
        kept = {name: self.columns[name] for name in list(self.columns) if name in keep or name == "end"}
        self.columns = CompactColumns(
            kept, {name: self.codes(name) for name, column in kept.items() if column.dtype == object}
        )

    # ---- construction -----------------------------------------------------------------------
    @classmethod
    def from_schedule(
        cls,
        schedule: "Schedule",
        start: Sequence[float],
        end: Sequence[float],
        *,
        ready: Sequence[float] | None = None,
        blocked_by: Sequence[int] | None = None,
        status: str = "ok",
        oom: OutOfMemory | None = None,
        peak_gpu_bytes: int = 0,
        memory_trace: Sequence[tuple[float, int]] = (),
        capacities: Mapping[str, int] | None = None,
        source: str = "simulated",
        extra_meta: Mapping[str, Any] | None = None,
    ) -> "Timeline":
        """Build from per-op start/end times aligned with `schedule.ops` (NaN = never ran)."""
        meta = dict(schedule.meta)
        meta.update(
            status=status,
            source=source,
            num_ops=len(schedule.ops),
            peak_gpu_bytes=int(peak_gpu_bytes),
            capacities=dict(capacities or {}),
            oom=asdict(oom) if oom else None,
        )
        meta.update(extra_meta or {})
        if memory_trace:  # (a pass per column: transposing the engine's 200k pairs with zip takes 3-6x as long)
            count = len(memory_trace)
            memory = (
                np.fromiter(map(itemgetter(0), memory_trace), dtype=float, count=count),
                np.fromiter(map(itemgetter(1), memory_trace), dtype=np.int64, count=count),
            )
        else:
            memory = None
        return cls(ScheduleColumns(schedule, start, end, ready, blocked_by), meta, memory)

    # ---- views ------------------------------------------------------------------------------
    def __len__(self) -> int:
        return len(self.columns["end"])

    @cached_property
    def df(self) -> pd.DataFrame:
        return pd.DataFrame(dict(self.columns))

    @property
    def status(self) -> str:
        return str(self.meta.get("status", "ok"))

    @property
    def makespan(self) -> float:
        return float(self.columns["end"].max()) if len(self) else 0.0

    def streams(self) -> list[str]:
        """Streams in a stable display order: compute first, then as first seen."""
        seen = self.codes("stream")[1]
        return sorted(seen, key=lambda s: (s != "compute", seen.index(s)))

    def codes(self, name: str) -> tuple[np.ndarray, list[Any]]:
        """A text column (stream, resource, category) as integer codes into its distinct values,
        those in order of first appearance. Derived once: comparing codes costs a tenth of
        comparing the strings of 300k rows, and a summary or a figure compares them many times."""
        key = "codes:" + name
        if key not in self._memo:
            codes, values = factorize(self.columns[name])
            # (in the smallest type that holds them: a figure keeps the codes of six 300k-row timelines)
            self._memo[key] = (codes.astype(np.min_scalar_type(max(len(values) - 1, 0))), values)
        return self._memo[key]

    def rows_where(self, name: str, value: Any) -> np.ndarray:
        """Which rows have `value` in the text column `name` (a boolean mask)."""
        codes, values = self.codes(name)
        return codes == values.index(value) if value in values else np.zeros(len(codes), dtype=bool)

    def ranks(self) -> list[int]:
        """The ranks of a run on several GPUs (each with resources of its own, `gpu@1`); [] for one GPU."""
        return sorted({resource_rank(str(r)) for r in self.codes("resource")[1]} - {-1})

    def rank_view(self, rank: int) -> "Timeline":
        """Rank `rank`'s ops alone, its resources named as one GPU's (`gpu@1` -> `gpu`): every metric
        of a one-GPU timeline (bubbles, utilisation, lower bound) then means the same for that rank.
        A rank's GPU waits for the others through its own collectives, so a gap a slower rank caused
        shows as `alltoall`; a blocker on another rank's resources is left out (cause `unknown`)."""
        codes, resources = self.codes("resource")
        mine = [k for k, r in enumerate(resources) if resource_rank(str(r)) == rank]
        if not mine:
            raise KeyError(f"rank {rank}: the timeline's ranks are {self.ranks()}")
        rows = np.flatnonzero(np.isin(codes, mine))
        columns = {name: np.asarray(self.columns[name])[rows] for name in self.columns}
        columns["resource"] = _objects([base_resource(str(r)) for r in columns["resource"]])
        ids = set(columns["op_id"].tolist())
        blocked = columns["blocked_by"]
        columns["blocked_by"] = _objects([b if b in ids else "" for b in blocked.tolist()])
        meta = dict(self.meta)
        peaks = meta.get("rank_peak_gpu_bytes") or []
        meta.update(
            rank=rank,
            num_ops=len(rows),
            peak_gpu_bytes=int(peaks[rank]) if rank < len(peaks) else 0,
            gpu_capacity_bytes=int(meta.get("gpu_capacity_bytes", 0)) // max(1, len(self.ranks())),
            capacities={base_resource(r): u for r, u in dict(meta.get("capacities") or {}).items()},
        )
        return Timeline(columns, meta)

    # ---- metrics ----------------------------------------------------------------------------
    def busy_seconds(self) -> dict[str, float]:
        """Per resource, the time at least one unit was busy (union of intervals)."""
        codes, resources = self.codes("resource")
        start, end = self.columns["start"], self.columns["end"]
        return {str(r): _union_length(start[codes == k], end[codes == k]) for k, r in enumerate(resources)}

    def work_seconds(self) -> dict[str, float]:
        """Per resource, the summed op durations divided by its units: its own lower bound."""
        caps = self.meta.get("capacities", {})
        dur = self.columns["end"] - self.columns["start"]
        codes, resources = self.codes("resource")
        return {str(r): float(dur[codes == k].sum()) / max(1, int(caps.get(r, 1))) for k, r in enumerate(resources)}

    def bubbles(self) -> pd.DataFrame:
        """Idle gaps on the GPU between its first and last op, one row each, with the op that
        ends the gap, its layer/step, the kind (inter/intra) and the cause."""
        if "bubbles" not in self._memo:
            self._memo["bubbles"] = self._bubble_columns()
        names, columns = self._memo["bubbles"]
        return pd.DataFrame(columns) if columns is not None else pd.DataFrame(columns=names)  # (a copy: the
        # caller may change it)

    def _bubble_columns(self, only: Collection[str] | None = None) -> tuple[list[str], dict[str, np.ndarray] | None]:
        """The names of the bubbles' columns (those in `only`, when given) and the columns (None:
        no bubble). Kept as arrays, not a frame: a worker process sends its timeline back with
        them, and unpickling a frame would import pandas in compare's main process on the way (0.15 s
        while a worker waits for its next run: the main process hands runs out)."""
        names = [name for name in BUBBLE_COLUMNS if only is None or name in only]
        gaps = self._gaps()
        if gaps is None:
            return names, None
        c, nxt = self.columns, gaps["next"]
        tags = {"next_op": "op_id", "step": "step", "layer": "layer", "batch": "batch"}  # bubble column -> op column
        return names, {name: c[tags[name]][nxt] if name in tags else gaps[name] for name in names}

    def _gaps(self) -> dict[str, np.ndarray] | None:
        """The GPU's idle gaps between its first and last op (None: there are none): where each
        starts and ends, its kind, the row of the op that ends it (`next`), that op's category and
        the cause (the category of the op whose end made it ready). What a summary needs of the
        bubbles, without the op ids and tags of `bubbles()` (at 300k ops those columns cost more
        than the rest of the summary)."""
        if "gaps" in self._memo:
            return self._memo["gaps"]
        c = self.columns
        idx = np.flatnonzero(self.rows_where("resource", "gpu"))
        gaps = None
        if len(idx) >= 2:
            order = idx[np.lexsort((c["end"][idx], c["start"][idx]))]
            starts, ends = c["start"][order], c["end"][order]
            running_end = np.maximum.accumulate(ends)
            gap = starts[1:] - running_end[:-1]
            where = np.flatnonzero(gap > 1e-12)
            if len(where):
                nxt = order[where + 1]
                if isinstance(c, ScheduleColumns):  # the engine's own op indices: no look-up of op ids
                    blocker = c.blocker_rows()[nxt]
                else:  # -1: none (or not in the timeline)
                    blocker = pd.Index(c["op_id"]).get_indexer(c["blocked_by"][nxt])
                cats = c["category"][nxt]
                gaps = {
                    "start": running_end[where],
                    "end": starts[where + 1],
                    "duration": gap[where],
                    "kind": np.where(np.isin(cats, list(INTRA_LAYER_CATEGORIES)), "intra", "inter"),
                    "next": nxt,
                    "next_category": cats,
                    "cause": np.where(blocker >= 0, c["category"][blocker], "unknown"),
                }
        self._memo["gaps"] = gaps
        return gaps

    def _bubble_seconds(self) -> tuple[float, float, float, dict[str, float]]:
        """The GPU's idle seconds: in all, between layers, inside a layer, and by cause (causes in
        name order): the totals by numpy's sum, each cause's correctly rounded (klotski_sim/util/grouping.py)."""
        gaps = self._gaps()
        if gaps is None:
            return 0.0, 0.0, 0.0, {}
        duration = gaps["duration"]
        # causes numbered in name order: the few distinct ones found by hashing and sorted alone
        # (np.unique would sort the 150k gaps' causes as fixed-width strings: 28 ms of a 230 ms summary)
        found_codes, found = factorize(gaps["cause"])
        causes: np.ndarray | list[str]
        if any(map(is_missing, found)):
            # a missing cause (a timeline made by hand): named as str() names it
            causes, cause_codes = np.unique(gaps["cause"].astype(str), return_inverse=True)
        else:
            by_name = sorted(range(len(found)), key=lambda k: str(found[k]))
            causes = [str(found[k]) for k in by_name]
            rank = np.empty(len(found), dtype=np.intp)
            rank[by_name] = np.arange(len(found))
            cause_codes = rank[found_codes]
        by_cause, _ = group_sums(duration, cause_codes, len(causes))
        inter = gaps["kind"] == "inter"
        return (
            float(duration.sum()),
            float(duration[inter].sum()),
            float(duration[~inter].sum()),
            {str(cause): total for cause, total in zip(causes, by_cause)},
        )

    def step_latencies(self) -> pd.Series:
        """Per step, the mean over batches of the time between the end of a batch's previous step
        and the end of this one: the latency a sequence sees per generated token (step 0 = prefill)."""
        steps, means = self._step_latency_means()
        if not len(steps):
            return pd.Series(dtype=float)
        return pd.Series(means, index=pd.Index(steps, name="step"), name="end")

    def _step_latency_means(self) -> tuple[np.ndarray, np.ndarray]:
        """`step_latencies` as arrays: the steps (ascending) and their mean latencies (what a
        summary reads of them, without pandas)."""
        c = self.columns
        mask = self.rows_where("resource", "gpu") & (c["step"] >= 0)
        steps, texts, op_ends = c["step"][mask], c["batches"][mask], c["end"][mask]
        ends: dict[tuple[int, int], float] = {}
        if len(steps):
            num_steps = int(steps.max()) + 1
            # group ops by the batches they touch (a handful of distinct sets): per set, the last
            # end of each step, then shared with every batch of the set
            codes, uniques = factorize(texts)
            last = np.full((len(uniques), num_steps), -np.inf)
            np.maximum.at(last, (codes, steps), op_ends)
            for text, row in zip(uniques, last):
                for b in _batch_ids(text):
                    for step in np.flatnonzero(row > -np.inf):
                        key = (int(b), int(step))
                        if row[step] > ends.get(key, -math.inf):
                            ends[key] = float(row[step])
        if not ends:
            return np.zeros(0, dtype=np.int64), np.zeros(0)
        keys = sorted(ends)  # (batch, step): each batch's steps in order
        batch = np.fromiter((b for b, _ in keys), dtype=np.int64, count=len(keys))
        key_step = np.fromiter((s for _, s in keys), dtype=np.int64, count=len(keys))
        end = np.fromiter(map(ends.__getitem__, keys), dtype=float, count=len(keys))
        first = np.concatenate(([True], batch[1:] != batch[:-1]))
        latency = np.where(first, end, end - np.concatenate(([np.nan], end[:-1])))  # (a batch's first: its end)
        found, step_codes = np.unique(key_step, return_inverse=True)
        sums, counts = group_sums(latency, step_codes, len(found))
        return found, np.array(sums) / np.array(counts)

    def prefill_seconds(self) -> float:
        """Wall time spent in prefill: from the start to the first GPU op, and for each batch from
        its first to its last step-0 GPU op (overlapping windows counted once). What is left of the
        makespan is decode time, as Klotski's and FlexGen's code time it (iterations 1..G-1)."""
        c = self.columns
        gpu = self.rows_where("resource", "gpu")
        if not gpu.any():
            return 0.0
        starts, ends = [0.0], [float(c["start"][gpu].min())]
        pre = gpu & (c["step"] == 0)
        if pre.any():  # per distinct batch set: its first start and last end
            codes, uniques = factorize(c["batches"][pre])
            first, last = np.full(len(uniques), np.inf), np.full(len(uniques), -np.inf)
            np.minimum.at(first, codes, c["start"][pre])
            np.maximum.at(last, codes, c["end"][pre])
            starts += first.tolist()
            ends += last.tolist()
        return _union_length(np.asarray(starts), np.asarray(ends))  # (in any order: a union)

    def moe_block_seconds(self) -> float:
        """Mean time of one MoE block — one layer of one decode step over every batch in flight:
        the time between the ends of consecutive runs of GPU ops of one (step, layer)."""
        c = self.columns
        mask = self.rows_where("resource", "gpu") & (c["layer"] >= 0)
        if not mask.any():
            return 0.0
        order = np.argsort(c["start"][mask], kind="stable")
        steps, layers = c["step"][mask][order], c["layer"][mask][order]
        ends = c["end"][mask][order]
        new = np.concatenate(([True], (steps[1:] != steps[:-1]) | (layers[1:] != layers[:-1])))
        firsts = np.flatnonzero(new)
        block_end = np.maximum.reduceat(ends, firsts)  # (blocks are runs of rows: a reduction per run)
        block_step = steps[firsts]
        spans = np.diff(block_end)
        decode = block_step[1:] >= 1
        return float(spans[decode].mean()) if decode.any() else 0.0

    def summary(self) -> Summary:
        if "summary" not in self._memo:
            self._memo["summary"] = self._summarize()
        return self._memo["summary"]

    def _summarize(self) -> Summary:
        m = self.meta
        busy = self.busy_seconds()
        work = self.work_seconds()
        makespan = self.makespan
        bubble_s, inter_s, intra_s, by_cause = self._bubble_seconds()
        # the host's busy time is mostly waiting for other resources: not a bound of its own
        devices = {r: w for r, w in work.items() if r != "host"}
        bound_resource, bound = max(devices.items(), key=lambda kv: kv[1]) if devices else ("", 0.0)
        steps, step_means = self._step_latency_means()
        decode = step_means[steps >= 1]
        generated = int(m.get("generated_tokens", 0))
        ok = self.status == "ok"
        prefill_total = self.prefill_seconds()
        # (no op of a decode step ran — a run of one generated token, or one stopped in its prefill: no decode time,
        # though a copy still in flight may follow the prefill's last GPU op)
        decoded = len(self) > 0 and bool((self.columns["step"] >= 1).any())
        decode_s = max(0.0, makespan - prefill_total) if decoded else 0.0
        sequences = int(m.get("batch_size", 0)) * int(m.get("num_batches", 0))
        decode_tokens = max(0, generated - sequences)
        return Summary(
            policy=str(m.get("policy", "")),
            model=str(m.get("model", "")),
            hardware=str(m.get("hardware", "")),
            batch_size=int(m.get("batch_size", 0)),
            num_batches=int(m.get("num_batches", 0)),
            prompt_len=int(m.get("prompt_len", 0)),
            gen_len=int(m.get("gen_len", 0)),
            status=self.status,
            source=str(m.get("source", "")),
            makespan_s=makespan,
            throughput_tok_s=generated / makespan if ok and makespan > 0 else 0.0,
            decode_throughput_tok_s=decode_tokens / decode_s if ok and decode_s > 0 else 0.0,
            prefill_s=float(step_means[0]) if len(steps) and steps[0] == 0 else 0.0,
            decode_s=decode_s,
            decode_step_s=float(decode.sum() / len(decode)) if len(decode) else 0.0,  # (as pandas' mean)
            moe_block_s=self.moe_block_seconds(),
            gpu_busy_s=busy.get("gpu", 0.0),
            host_blocked_s=busy.get("host", 0.0),
            bubble_s=bubble_s,
            bubble_inter_s=inter_s,
            bubble_intra_s=intra_s,
            lower_bound_s=bound,
            lower_bound_resource=bound_resource,
            efficiency=bound / makespan if makespan > 0 else 0.0,
            peak_gpu_bytes=int(m.get("peak_gpu_bytes", 0)),
            num_ops=int(m.get("num_ops", len(self))),
            generated_tokens=generated,
            impl=str(m.get("impl", "")),
            utilization={r: (b / makespan if makespan > 0 else 0.0) for r, b in busy.items()},
            bubble_by_cause=by_cause,
            oom=m.get("oom"),
            extra={
                k: m[k]
                for k in (
                    "trace",
                    "routing",
                    "placement",
                    "prefetch",
                    "overlap",
                    "emulated_links",
                    "options",
                    "expert_cache",
                    "cpu_experts",
                    "expert_placement",
                    "gpu_expert_slots",
                    "cache",
                )
                if k in m
            },
        )


BUBBLE_COLUMNS = ("start", "end", "duration", "kind", "next_op", "next_category", "cause", "step", "layer", "batch")
COLUMN_NAMES = (
    "op_id",
    "stream",
    "resource",
    "start",
    "end",
    "ready",
    "blocked_by",
    "kind",
    "category",
    "step",
    "phase",
    "layer",
    "batch",
    "batches",
    "expert",
    "tokens",
    "bytes",
    "flops",
)
# the columns the figures (klotski_sim.report.plot) read: all a comparison keeps of its timelines
FIGURE_COLUMNS = ("stream", "resource", "start", "end", "category", "step", "layer")
_FIELD_OF = {
    "op_id": "id",
    "stream": "stream",
    "kind": "kind",
    "category": "category",
    "step": "step",
    "phase": "phase",
    "layer": "layer",
    "expert": "expert",
    "tokens": "tokens",
    "bytes": "bytes",
    "flops": "flops",
}  # column -> Op field, for the columns that are an op field as it is
_NUMERIC = {
    "step": np.int64,
    "layer": np.int64,
    "expert": np.int64,
    "tokens": np.int64,
    "bytes": np.int64,
    "flops": np.float64,
}


class ScheduleColumns(Mapping[str, np.ndarray]):
    """Timeline columns joined from the ops of a schedule and the times of a run, each assembled
    the first time it is read: a summary reads eleven of the eighteen, and at 300k ops each one
    costs tens of milliseconds. Pickling (a worker process handing its timeline back) sends
    every column, without the schedule."""

    def __init__(
        self,
        schedule: "Schedule",
        start: Sequence[float],
        end: Sequence[float],
        ready: Sequence[float] | None,
        blocked_by: Sequence[int] | None,
    ) -> None:
        start_arr = np.asarray(start, dtype=float)
        self._ran = np.flatnonzero(~np.isnan(start_arr))
        ops = schedule.ops
        self._all_ran = len(self._ran) == len(ops)
        self._ops = ops if self._all_ran else [ops[i] for i in self._ran]
        self._every_op = ops
        self._kept_columns = schedule.kept_columns()  # (not the schedule: its graph would stay alive with it)
        self._resource_of = schedule.streams
        self._times = (start_arr, end, ready, blocked_by)
        self._built: dict[str, np.ndarray] = {}

    def __getitem__(self, name: str) -> np.ndarray:
        column = self._built.get(name)
        if column is None:
            if name not in COLUMN_NAMES:
                raise KeyError(name)
            with gc_paused():  # hundreds of thousands of small objects, no cycles
                column = self._built[name] = self._make(name)
        return column

    def __iter__(self) -> Iterator[str]:
        return iter(COLUMN_NAMES)

    def __len__(self) -> int:
        return len(COLUMN_NAMES)

    def __reduce__(self) -> tuple[Any, ...]:
        return dict, (self.materialize(),)

    def materialize(self) -> dict[str, np.ndarray]:
        """Every column (one C-level transpose of the ops when most are still to be made)."""
        missing = [name for name in COLUMN_NAMES if name not in self._built]
        if len(missing) > len(COLUMN_NAMES) // 2 and len(self._ops):
            with gc_paused():
                fields = dict(zip(Op._fields, zip(*self._ops)))
                for name in missing:
                    self._built[name] = self._make(name, fields)
        return {name: self[name] for name in COLUMN_NAMES}

    def blocker_rows(self) -> np.ndarray:
        """Per row, the row of the op whose end made it ready (-1: none, or it never ran)."""
        start, end, ready, blocked_by = self._times
        if blocked_by is None:
            return np.full(len(self._ran), -1, dtype=np.int64)
        row_of_op = np.full(len(self._every_op) + 1, -1, dtype=np.int64)  # [-1] (no blocker) stays -1
        row_of_op[self._ran] = np.arange(len(self._ran))
        return row_of_op[np.asarray(blocked_by, dtype=np.int64)[self._ran]]

    def _field(self, name: str, fields: Mapping[str, Sequence[Any]] | None) -> Sequence[Any]:
        if fields is not None:
            return fields[name]
        kept = self._kept_columns.get(name) if self._all_ran else None  # (the schedule's, where its check kept one)
        return kept if kept is not None else list(map(attrgetter(name), self._ops))

    def _make(self, name: str, fields: Mapping[str, Sequence[Any]] | None = None) -> np.ndarray:
        ran = self._ran
        start, end, ready, blocked_by = self._times
        if name in _NUMERIC:
            return np.array(self._field(_FIELD_OF[name], fields), dtype=_NUMERIC[name])
        if name in _FIELD_OF:
            return _objects(self._field(_FIELD_OF[name], fields))
        if name == "resource":
            return _objects(list(map(self._resource_of.__getitem__, self._field("stream", fields))))
        if name == "start":
            return start[ran]
        if name == "end":
            return np.asarray(end, dtype=float)[ran]
        if name == "ready":
            return np.asarray(ready, dtype=float)[ran] if ready is not None else np.full(len(ran), np.nan)
        if name == "blocked_by":
            blocked = np.full(len(ran), "", dtype=object)
            if blocked_by is not None:
                b = np.asarray(blocked_by, dtype=np.int64)[ran]
                has = np.flatnonzero(b >= 0)
                ids = self["op_id"] if self._all_ran else _objects([op.id for op in self._every_op])
                blocked[has] = ids[b[has]]
            return blocked
        # (the same few batches tuples recur across thousands of ops: each distinct one is looked at once)
        batches = self._field("batches", fields)
        if name == "batch":
            single = {bt: bt[0] if len(bt) == 1 else -1 for bt in set(batches)}
            return np.fromiter(map(single.__getitem__, batches), dtype=np.int64, count=len(batches))
        memo = _BATCH_TEXT  # name == "batches"
        for bt in set(batches).difference(memo):
            _batch_text(bt)
        return _objects(list(map(memo.__getitem__, batches)))


class CompactColumns(Mapping[str, np.ndarray]):
    """The columns a detached timeline keeps, held small: a text column as codes into its distinct
    values (`Timeline.codes`), an integer column in the smallest type that holds its values; each
    read back in its own type. A comparison keeps six 300k-op timelines for its figure, which
    compares codes and reads two float columns: as object and int64 arrays they take 114 MB, which
    each worker would send back through a pipe."""

    def __init__(self, columns: Mapping[str, np.ndarray], coded: Mapping[str, tuple[np.ndarray, list[Any]]]) -> None:
        self.coded = dict(coded)  # name -> (codes, distinct values)
        self._plain: dict[str, np.ndarray] = {}
        self._narrowed: dict[str, tuple[np.ndarray, np.dtype]] = {}
        for name, column in columns.items():
            if name in self.coded:
                continue
            small = (
                np.result_type(np.min_scalar_type(int(column.min())), np.min_scalar_type(int(column.max())))
                if column.dtype.kind == "i" and len(column)
                else column.dtype
            )
            if small.kind in "iu" and small.itemsize < column.dtype.itemsize:  # (never a float: it could round)
                self._narrowed[name] = (column.astype(small), column.dtype)
            else:
                self._plain[name] = column
        self._names = list(columns)

    def __getitem__(self, name: str) -> np.ndarray:
        if name in self._plain:
            return self._plain[name]
        if name in self._narrowed:
            column, dtype = self._narrowed[name]
            return column.astype(dtype)
        codes, values = self.coded[name]  # (a KeyError for a column not kept, as a dict's)
        return _objects(values)[codes]

    def __iter__(self) -> Iterator[str]:
        return iter(self._names)

    def __len__(self) -> int:
        return len(self._names)


def _objects(values: Sequence[Any]) -> np.ndarray:
    out = np.empty(len(values), dtype=object)
    out[:] = values
    return out


def merge_intervals(starts: np.ndarray, ends: np.ndarray, tolerance: float = 0.0) -> tuple[np.ndarray, np.ndarray]:
    """Overlapping intervals (and those less than `tolerance` apart) merged into one, in start
    order: the union of busy time, or a lane of bars a plot can draw in one go."""
    if len(starts) < 2:
        return np.asarray(starts, dtype=float), np.asarray(ends, dtype=float)
    order = np.argsort(starts, kind="stable")
    s, e = starts[order], ends[order]
    running = np.maximum.accumulate(e)
    # a new merged interval begins where an interval starts after everything before it ended
    new = np.concatenate(([True], s[1:] > running[:-1] + tolerance))
    firsts = np.flatnonzero(new)
    return s[firsts], np.maximum.reduceat(e, firsts)  # (each run's latest end: a reduction per run, not `at`)


def _union_length(starts: np.ndarray, ends: np.ndarray) -> float:
    merged_start, merged_end = merge_intervals(starts, ends)
    return float((merged_end - merged_start).sum())


def jsonable(value: Any) -> Any:
    if isinstance(value, dict):
        return {str(k): jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [jsonable(v) for v in value]
    if isinstance(value, (np.integer,)):
        return int(value)
    if isinstance(value, (np.floating,)):
        return float(value)
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value
