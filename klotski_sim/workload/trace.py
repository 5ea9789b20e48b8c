"""Routing traces: which experts every token chose in every MoE layer, with provenance.

File format (`.npz`, as `numpy.savez_compressed` writes it but at deflate level 1, `npzfile.write_npz`;
see traces/README.md):

- `experts`     uint8 (<= 256 experts), int16 (<= 32,768) or int32 `[tokens, layers, top_k]` — expert ids,
  sequences concatenated
- `weights`     float16 `[tokens, layers, top_k]` — gate weights (optional)
- `seq_offsets` int64 `[sequences + 1]` — sequence i is rows `seq_offsets[i]:seq_offsets[i+1]`
- `prompt_lens` int32 `[sequences]` — the first `prompt_lens[i]` tokens of sequence i are prompt,
  the rest were generated
- `meta`        a JSON string: model, num_experts, top_k, num_layers, dataset, recorder, license,
  generator settings

Why npz: one compact file that numpy alone reads back (no pickle: loaded with
`allow_pickle=False`), ragged sequences without padding via offsets, and a dense block of ids (held
in memory in the type they are stored in) that replays with a single slice.
"""

from __future__ import annotations

import json
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Mapping

import numpy as np

from klotski_sim.files.mapped import in_chunks, release
from klotski_sim.files.npzfile import NPZ_READ_ERRORS, check_npz, write_npz
from klotski_sim.files.textfile import DuplicateKeyError, read_text, unique_json_keys
from klotski_sim.util.errors import KlotskiError, UsageError
from klotski_sim.workload.model import ModelSpec, preset_name
from klotski_sim.workload.routing import RoutingTable, RunShape, expert_id_type, repeats_an_expert

FORMAT = "klotski-routing-trace"
VERSION = 1
REQUIRED_META = ("model", "num_experts", "top_k", "num_layers")


_CHECKED_IDS = 1 << 23  # ids a trace's check looks at per pass (a bounded temporary however long the trace)
MAX_IMPORT_TOKENS = 1 << 20  # token positions per sequence in an imported log
MAX_IMPORT_INDEX = 1 << 14  # layers and expert ids in an imported log (expert ids held in int16 at most)


class TraceError(KlotskiError):
    """A trace that cannot be used; the message says what is wrong with which file."""


@dataclass(frozen=True)
class Trace:
    """A validated routing trace held in memory (see the module docstring for the layout)."""

    experts: np.ndarray
    seq_offsets: np.ndarray
    prompt_lens: np.ndarray
    meta: Mapping[str, Any] = field(default_factory=dict)
    weights: np.ndarray | None = None

    def __post_init__(self) -> None:
        for name in ("seq_offsets", "prompt_lens"):  # unsigned ones as int64: their differences never look negative
            values = getattr(self, name)
            if np.issubdtype(values.dtype, np.unsignedinteger):
                if values.size and values.max() >= 1 << 62:
                    raise TraceError(f"trace: {name} holds {int(values.max())}, beyond any trace's tokens")
                object.__setattr__(self, name, values.astype(np.int64))
        self.validate("trace")
        # ids held in their stored type (`expert_id_type`): a trace read from a file is not widened
        object.__setattr__(self, "experts", self.experts.astype(expert_id_type(self.num_experts), copy=False))

    # ---- shape ------------------------------------------------------------------------------
    @property
    def num_sequences(self) -> int:
        return len(self.seq_offsets) - 1

    @property
    def num_layers(self) -> int:
        return int(self.experts.shape[1])

    @property
    def top_k(self) -> int:
        return int(self.experts.shape[2])

    @property
    def num_experts(self) -> int:
        return int(self.meta["num_experts"])

    @property
    def lengths(self) -> np.ndarray:
        return np.diff(self.seq_offsets)

    def sequence(self, i: int) -> np.ndarray:
        """`[tokens, layers, top_k]` of sequence i."""
        return self.experts[self.seq_offsets[i] : self.seq_offsets[i + 1]]

    def subset(self, indices: Iterable[int]) -> "Trace":
        idx = list(indices)
        parts = [self.sequence(i) for i in idx]
        lengths = [len(p) for p in parts]
        weights = None
        if self.weights is not None:
            weights = (
                np.concatenate([self.weights[self.seq_offsets[i] : self.seq_offsets[i + 1]] for i in idx])
                if idx
                else self.weights[:0]
            )
        experts = np.concatenate(parts) if parts else self.experts[:0]
        for part in parts:  # (copied: a mapped trace's pages given back)
            release(part)
        return Trace(
            experts,
            np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64),
            self.prompt_lens[idx].copy(),
            dict(self.meta),
            weights,
        )

    # ---- checks -----------------------------------------------------------------------------
    def validate(self, where: str) -> None:
        missing = [k for k in REQUIRED_META if k not in self.meta]
        if missing:
            raise TraceError(f"{where}: metadata lacks {', '.join(missing)}")
        if not isinstance(self.meta["model"], str):  # (messages name it: null or a list is refused)
            raise TraceError(f"{where}: meta model must be a model's name, got {self.meta['model']!r:.60}")
        e, off, pl = self.experts, self.seq_offsets, self.prompt_lens
        if e.ndim != 3:
            raise TraceError(f"{where}: experts must be [tokens, layers, top_k], got shape {e.shape}")
        if not np.issubdtype(e.dtype, np.integer):
            raise TraceError(f"{where}: experts must be integers, got {e.dtype}")
        if e.shape[1] != int(self.meta["num_layers"]) or e.shape[2] != int(self.meta["top_k"]):
            raise TraceError(
                f"{where}: experts shape {e.shape} disagrees with metadata "
                f"(num_layers={self.meta['num_layers']}, top_k={self.meta['top_k']})"
            )
        if off.ndim != 1 or len(off) < 1 or off[0] != 0 or off[-1] != len(e) or np.any(np.diff(off) < 0):
            raise TraceError(
                f"{where}: seq_offsets must rise from 0 to the number of tokens ({len(e)}); "
                f"the file is truncated or inconsistent"
            )
        if pl.shape != (len(off) - 1,) or np.any(pl < 0) or np.any(pl > np.diff(off)):
            raise TraceError(f"{where}: prompt_lens must give one length per sequence, within its tokens")
        n_exp = int(self.meta["num_experts"])
        # (a block of tokens at a time: the repeat check's temporaries stay bounded, and a mapped
        # trace's pages are given back as the check moves on)
        for part in in_chunks(e, max(1, _CHECKED_IDS // max(1, e.shape[1] * e.shape[2]))):
            if part.size and (part.min() < 0 or part.max() >= n_exp):
                bad = int(part.max()) if part.max() >= n_exp else int(part.min())
                raise TraceError(f"{where}: expert id {bad} out of range for num_experts={n_exp}")
            if repeats_an_expert(part):
                raise TraceError(f"{where}: a token selects the same expert twice in one layer")
        if self.weights is not None:
            w = self.weights
            if w.shape != e.shape:
                raise TraceError(f"{where}: weights shape {w.shape} differs from experts {e.shape}")
            if w.dtype.kind != "f" or (w.size and not (np.isfinite(w).all() and w.min() >= 0)):
                raise TraceError(
                    f"{where}: weights must be finite non-negative gate probabilities, got {w.dtype}"
                    + ("" if w.dtype.kind != "f" else f" from {w.min()} to {w.max()}")
                )

    def check_model(self, model: ModelSpec, where: str = "trace") -> None:
        """A trace replays only on a model with the same experts, top-k and layer count."""
        problems = []
        if self.num_experts != model.num_experts:
            problems.append(f"{self.num_experts} experts vs {model.num_experts}")
        if self.top_k != model.top_k:
            problems.append(f"top-{self.top_k} vs top-{model.top_k}")
        if self.num_layers != model.num_layers:
            problems.append(f"{self.num_layers} layers vs {model.num_layers}")
        if problems:
            recorded = self.meta.get("model")  # (an imported log is labelled with the model it is checked against)
            of = "" if recorded == model.name else f" (recorded for {recorded!r})"
            raise TraceError(
                f"{where}: the trace{of} has another shape than model {model.name!r} (trace vs model: "
                f"{'; '.join(problems)})"
            )

    # ---- files ------------------------------------------------------------------------------
    def save(self, path: str | Path) -> None:
        """Write atomically (temp file + rename): an interrupted save never leaves half a trace."""
        arrays = dict(
            experts=self.experts,
            seq_offsets=self.seq_offsets.astype(np.int64),
            prompt_lens=self.prompt_lens.astype(np.int32),
            meta=np.array(json.dumps({"format": FORMAT, "version": VERSION, **self.meta})),
        )
        if self.weights is not None:
            arrays["weights"] = self.weights.astype(np.float16)
        write_npz(path, arrays)

    @staticmethod
    def load(path: str | Path) -> "Trace":
        path = Path(path)
        try:
            check_npz(path, "routing trace", TraceError)
            with np.load(path, allow_pickle=False) as z:
                names = set(z.files)
                missing = {"experts", "seq_offsets", "prompt_lens", "meta"} - names
                if missing:
                    raise TraceError(f"{path}: not a routing trace (missing {', '.join(sorted(missing))})")
                stored = z["meta"]
                if stored.ndim != 0 or stored.dtype.kind != "U":  # (two strings, or bytes: "truncated or corrupt")
                    raise TraceError(
                        f"{path}: meta must be one JSON string, got {stored.dtype} of shape {stored.shape}"
                    )
                meta = json.loads(str(stored), object_pairs_hook=unique_json_keys)  # (else the last of two wins)
                if not isinstance(meta, dict):
                    raise TraceError(f"{path}: meta must be a JSON object, got {type(meta).__name__}")
                arrays = {k: z[k] for k in ("seq_offsets", "prompt_lens")}
                for name in ("seq_offsets", "prompt_lens"):
                    if not np.issubdtype(arrays[name].dtype, np.integer) or arrays[name].ndim != 1:
                        raise TraceError(
                            f"{path}: {name} must be a 1-d integer array, got {arrays[name].dtype} "
                            f"of shape {arrays[name].shape}"
                        )
                for key in ("num_experts", "top_k", "num_layers"):
                    value = meta.get(key)
                    if not isinstance(value, int) or isinstance(value, bool) or not 1 <= value <= 1 << 16:
                        raise TraceError(f"{path}: meta {key} must be an integer from 1 to 65536, got {value!r}")
                # the large arrays last, each from an unpacked copy in the cache where it is large
                # (`cache.unpacked_array`: mapped, not held), else as numpy reads it
                arrays["experts"] = _large_array(path, z, "experts")
                weights = _large_array(path, z, "weights") if "weights" in names else None
        except (TraceError, UsageError):  # (UsageError: the cache's own setting, KLOTSKI_CACHE_MAX_GB)
            raise
        except FileNotFoundError:
            raise TraceError(f"{path}: no such trace file") from None
        except DuplicateKeyError as err:
            raise TraceError(f"{path}: its meta's {err} (JSON would keep the last)") from None
        except json.JSONDecodeError as err:  # (the meta alone: not the file "truncated or corrupt")
            raise TraceError(f"{path}: its meta is not valid JSON ({err})") from None
        except (*NPZ_READ_ERRORS, KeyError) as err:
            raise TraceError(f"{path}: cannot read trace, the file is truncated or corrupt ({err})") from None
        if meta.get("format") != FORMAT:
            raise TraceError(f"{path}: not a klotski routing trace (format {meta.get('format')!r})")
        if meta.get("version") != VERSION:
            raise TraceError(f"{path}: trace format version {meta.get('version')!r}, expected {VERSION}")
        meta = {k: v for k, v in meta.items() if k not in ("format", "version")}
        try:
            return Trace(arrays["experts"], arrays["seq_offsets"], arrays["prompt_lens"], meta, weights)
        except TraceError as err:
            raise TraceError(str(err).replace("trace:", f"{path}:", 1)) from None


def _large_array(path: Path, archive: Any, name: str) -> np.ndarray:
    """Array `name` of a trace file: an unpacked, mapped copy from the trace cache when the cache
    keeps one (a large array), else read from `archive` (the open `np.load`)."""
    from klotski_sim.files.disk_cache import unpacked_array

    unpacked = unpacked_array(path, name)
    return archive[name] if unpacked is None else unpacked


# ---- replay -------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Replay:
    """The routing a run replays, plus disjoint warm-up sequences for a prefetcher's pre-run."""

    routing: RoutingTable
    warmup: Trace
    evaluated: tuple[int, ...]
    wrapped: bool


def replay(
    trace: Trace,
    model: ModelSpec,
    shape: RunShape,
    *,
    warmup_sequences: int = 0,
    wrap: bool = False,
    where: str = "trace",
) -> Replay:
    """Cut the routing of n x bs sequences of P + G - 1 tokens out of `trace`.

    The first `warmup_sequences` sequences are reserved for warm-up and never evaluated. Only
    sequences with at least P + G - 1 tokens qualify; if too few do, this is an error unless
    `wrap` allows reusing them (said in the routing's source, never silently)."""
    trace.check_model(model, where)
    need_tokens = shape.tokens_per_sequence
    need_seqs = shape.num_sequences
    if warmup_sequences >= trace.num_sequences:
        raise TraceError(
            f"{where}: {warmup_sequences} warm-up sequences leave none of its {trace.num_sequences} to evaluate"
        )
    pool = [i for i in range(warmup_sequences, trace.num_sequences) if trace.lengths[i] >= need_tokens]
    if not pool:
        longest = int(trace.lengths[warmup_sequences:].max()) if trace.num_sequences > warmup_sequences else 0
        raise TraceError(
            f"{where}: no sequence has the {need_tokens} tokens a run with prompt {shape.prompt_len} "
            f"and {shape.gen_len} generated needs (longest: {longest}); lower --prompt-len/--gen-len"
        )
    if len(pool) < need_seqs and not wrap:
        raise TraceError(
            f"{where}: the run needs {need_seqs} sequences of >= {need_tokens} tokens "
            f"({shape.num_batches} batches x {shape.batch_size}), the trace has {len(pool)} after "
            f"{warmup_sequences} warm-up ones; pass --wrap to reuse sequences, or ask for fewer"
        )
    chosen = [pool[k % len(pool)] for k in range(need_seqs)]
    ids = _sequences_ids(trace, chosen, need_tokens).reshape(
        shape.num_batches, shape.batch_size, need_tokens, trace.num_layers, trace.top_k
    )
    wrapped = len(pool) < need_seqs
    # reusing sequences repeats their routing, which flatters any predictor: say by how much
    source = (
        f"{trace.meta.get('source', where)}"
        + (
            f" (WRAPPED: {len(pool)} distinct sequences for {need_seqs} needed, {len(pool) / need_seqs:.0%}; reused "
            f"routing inflates prefetch accuracy and throughput)"
            if wrapped
            else ""
        )
        + _recorded_for_another(trace, model)
    )
    routing = RoutingTable(
        ids, shape, model.num_experts, source, dense_layers=model.first_dense_layers, moe_step=model.moe_layer_step
    )
    return Replay(routing, trace.subset(range(warmup_sequences)), tuple(chosen), wrapped)


def _recorded_for_another(trace: Trace, model: ModelSpec) -> str:
    """What the routing's source says of a trace recorded for another model of the same shape (a
    tiny-olmoe trace replayed on tiny-qwen3-moe would run without a word): empty for the model's own, a
    version of it (`:L` layers, `@int4` experts route as it does) or a log of no known model."""
    recorded = trace.meta.get("model")
    if not isinstance(recorded, str) or recorded in ("", "unknown") or preset_name(recorded) == preset_name(model.name):
        return ""
    return (
        f" (ANOTHER MODEL: recorded for {recorded!r}, replayed on {model.name!r} of the same shape: the routing "
        f"is not this model's)"
    )


def _sequences_ids(trace: Trace, chosen: list[int], tokens: int) -> np.ndarray:
    """`[sequence, token, layer, slot]`: the first `tokens` ids of each chosen sequence. A view of
    the trace where the sequences follow one another and are equally long (a synthetic trace made
    for the run: a long prompt's routing is not held twice), else a copy."""
    first, count = (chosen[0], len(chosen)) if chosen else (0, 0)
    lengths = trace.lengths[first : first + count]
    if count and chosen == list(range(first, first + count)) and (lengths == lengths[0]).all():
        start, length = int(trace.seq_offsets[first]), int(lengths[0])
        block = trace.experts[start : start + count * length]
        return block.reshape(count, length, trace.num_layers, trace.top_k)[:, :tokens]
    rows = trace.seq_offsets[np.asarray(chosen)][:, None] + np.arange(tokens)[None, :]
    return trace.experts[rows]


# ---- import -------------------------------------------------------------------------------------
MAX_GATE_WEIGHT = 65504.0  # the largest float16, which a trace stores gate weights in (1e6 would be inf)


def _shown(value: Any, limit: int = 60) -> str:
    """A value from a log (a sequence id, a record's expert ids) as a message shows it: its repr,
    cut short (a log's ids can be thousands of characters, and a warning names one per sequence)."""
    text = repr(value)
    return text if len(text) <= limit else f"{text[: limit - 3]}..."


def import_jsonl(
    path: str | Path,
    *,
    num_experts: int | None = None,
    model: str = "unknown",
    prompt_len_field: str = "prompt_len",
    key_fields: tuple[str, ...] | None = None,
    holes: str = "cut",
    source: str | None = None,
    license: str | None = None,
    dataset: str | None = None,
    dense_layers: tuple[int, ...] = (),
) -> tuple[Trace, list[str]]:
    """Read a JSON-lines routing log, one record per token per layer, e.g.

        {"seq_id": 3, "token_idx": 17, "layer": 5, "experts": [1, 6], "gating_probs": [0.7, 0.3]}

    (`request_id`/`sequence_id`, `token_id`/`position`, `expert_ids`/`topk_ids`,
    `weights`/`topk_weights` are accepted too). Returns the trace and a list of problems found;
    missing (token, layer) entries are reported and never filled in: the sequence is cut before its
    first hole (`holes="cut"`) or keeps its longest run of complete tokens (`holes="longest"`).

    A sequence is identified by its id *and* `key_fields` (default: `dataset` when the records
    carry it), so integer ids from two datasets in one log never merge. `source`, `license` and
    `dataset` are the trace's provenance (recorded in its metadata). The model's `dense_layers` have
    no router: a record there is kept, a missing one filled with experts 0..k-1 (the routing of a
    dense layer is never read: `RoutingTable.counts`), not taken for a hole."""
    if holes not in ("cut", "longest"):
        raise TraceError(f"holes must be cut or longest, got {holes!r}")
    path = Path(path)
    alias = {
        "seq": ("seq_id", "sequence_id", "request_id", "seq", "req_id"),
        "tok": ("token_idx", "token_index", "position", "token_id", "pos"),
        "layer": ("layer", "layer_id", "layer_idx"),
        "experts": ("experts", "expert_ids", "topk_ids", "selected_experts"),
        "weights": ("gating_probs", "weights", "topk_weights", "gate_weights"),
    }

    def pick(rec: dict, key: str, lineno: int, required: bool = True) -> Any:
        for name in alias[key]:
            if name in rec:
                return rec[name]
        if required:
            raise TraceError(f"{path}:{lineno}: record has none of {alias[key]}")
        return None

    records: dict[Any, dict[tuple[int, int], tuple[list[int], list[float] | None]]] = {}
    first_line: dict[Any, int] = {}  # sequence -> the line it starts on (errors after parsing name it)
    max_id, max_id_line = -1, 0
    duplicates: list[str] = []
    prompt_lens: dict[Any, int] = {}
    top_k = None
    lines = read_text(path, "routing log", TraceError).splitlines()
    for lineno, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            rec = json.loads(line, object_pairs_hook=unique_json_keys)
        except ValueError as err:  # (JSONDecodeError, or a number too long for an int: 4300 digits)
            raise TraceError(f"{path}:{lineno}: not valid JSON ({getattr(err, 'msg', err)})") from None
        except RecursionError:
            raise TraceError(f"{path}:{lineno}: JSON nested too deeply for a routing record") from None
        if not isinstance(rec, dict):
            raise TraceError(f"{path}:{lineno}: expected a JSON object")
        seq, tok, layer = pick(rec, "seq", lineno), pick(rec, "tok", lineno), pick(rec, "layer", lineno)
        experts = pick(rec, "experts", lineno)
        weights = pick(rec, "weights", lineno, required=False)
        if (
            not isinstance(experts, list)
            or not experts
            or not all(isinstance(x, int) and not isinstance(x, bool) for x in experts)
        ):
            raise TraceError(f"{path}:{lineno}: experts must be a non-empty list of integers")
        if not all(0 <= x < MAX_IMPORT_INDEX for x in experts):
            raise TraceError(
                f"{path}:{lineno}: expert ids must be from 0 to {MAX_IMPORT_INDEX - 1}, got {_shown(experts)}"
            )
        if len(set(experts)) < len(experts):  # (found later, for the whole trace, without its line)
            raise TraceError(
                f"{path}:{lineno}: the token selects an expert twice ({_shown(experts)}); a router's "
                f"top-k experts are distinct"
            )
        if not isinstance(tok, int) or not isinstance(layer, int) or isinstance(tok, bool) or isinstance(layer, bool):
            raise TraceError(f"{path}:{lineno}: token index and layer must be integers")
        if not 0 <= tok < MAX_IMPORT_TOKENS or not 0 <= layer < MAX_IMPORT_INDEX:
            raise TraceError(
                f"{path}:{lineno}: token index must be from 0 to {MAX_IMPORT_TOKENS - 1} and layer "
                f"from 0 to {MAX_IMPORT_INDEX - 1}, got token {tok} layer {layer}"
            )
        if not isinstance(seq, (int, str)) or isinstance(seq, bool):
            raise TraceError(f"{path}:{lineno}: the sequence id must be an integer or a string, got {_shown(seq)}")
        if key_fields is None:  # decided on the first record: a dataset field namespaces the ids
            key_fields = ("dataset",) if "dataset" in rec else ()
        namespace = []
        for field_name in key_fields:
            value = rec.get(field_name)
            if not isinstance(value, (int, str)) or isinstance(value, bool):
                raise TraceError(
                    f"{path}:{lineno}: key field {field_name!r} must be an integer or a string in every "
                    f"record, got {value!r}"
                )
            namespace.append(value)
        seq = (*namespace, seq) if namespace else seq
        first_line.setdefault(seq, lineno)
        if max(experts) > max_id:
            max_id, max_id_line = max(experts), lineno
        if weights is not None and (
            not isinstance(weights, list)
            or len(weights) != len(experts)
            or not all(
                isinstance(w, (int, float)) and not isinstance(w, bool) and 0 <= w <= MAX_GATE_WEIGHT for w in weights
            )
        ):
            raise TraceError(
                f"{path}:{lineno}: gate weights must be a list of numbers from 0 to {MAX_GATE_WEIGHT} "
                f"(stored as float16), one per expert"
            )
        if top_k is None:
            top_k = len(experts)
        elif len(experts) != top_k:
            raise TraceError(f"{path}:{lineno}: {len(experts)} experts, earlier records had {top_k}")
        if prompt_len_field in rec:
            value = rec[prompt_len_field]
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise TraceError(f"{path}:{lineno}: {prompt_len_field} must be an integer >= 0, got {value!r}")
            if prompt_lens.setdefault(seq, value) != value:
                raise TraceError(
                    f"{path}:{lineno}: {prompt_len_field} {value} for sequence {_shown(seq)}, whose "
                    f"earlier records said {prompt_lens[seq]}"
                )
        table = records.setdefault(seq, {})
        if (tok, layer) in table:
            duplicates.append(
                f"{path}:{lineno}: sequence {_shown(seq)} token {tok} layer {layer} appears again; "
                f"the later record is kept"
            )
        table[(tok, layer)] = (experts, weights)
    if not records or top_k is None:  # (the first record sets top_k)
        raise TraceError(f"{path}: no records")
    num_layers = 1 + max(layer for seq in records.values() for (_, layer) in seq)
    n_exp = num_experts if num_experts is not None else max_id + 1
    if not 1 <= n_exp <= MAX_IMPORT_INDEX:  # (100,000 would write a trace that every reader refuses)
        raise TraceError(
            f"{path}: --num-experts {n_exp} must be from 1 to {MAX_IMPORT_INDEX}, as an imported log's expert ids are"
        )
    if max_id >= n_exp:
        raise TraceError(f"{path}:{max_id_line}: expert id {max_id} is out of range for --num-experts {n_exp}")
    problems: list[str] = duplicates[:20] + (
        [f"... and {len(duplicates) - 20} more duplicated records"] if len(duplicates) > 20 else []
    )
    experts_out, weights_out, lengths, plens = [], [], [], []
    weighted = sum(w is not None for seq in records.values() for _, w in seq.values())
    entries = sum(map(len, records.values()))
    has_weights = weighted == entries
    if 0 < weighted < entries:  # (said: a few records without them drop every weight)
        problems.append(f"{path}: {entries - weighted} of {entries} records have no gate weights; the trace keeps none")
    if dense_layers:  # (a DeepSeek log has no router records there: else every token is a hole at layer 0)
        filler = (list(range(top_k)), [1.0 / top_k] * top_k if has_weights else None)
        for table in records.values():
            for tok in {t for t, _ in table}:
                for layer in dense_layers:
                    table.setdefault((tok, layer), filler)
    for seq, table in records.items():
        max_tok = max(t for t, _ in table)
        if prompt_lens.get(seq, 0) > max_tok + 1:
            raise TraceError(
                f"{path}:{first_line[seq]}: sequence {_shown(seq)} has {prompt_len_field} "
                f"{prompt_lens[seq]} but only {max_tok + 1} tokens"
            )
        per_token = Counter(t for t, _ in table)
        # the first token with a layer missing (counting, not listing, the holes: a log of a few
        # records at absurd positions must not allocate their square)
        usable = next((t for t in range(max_tok + 1) if per_token.get(t, 0) < num_layers), max_tok + 1)
        start = 0
        missing = (max_tok + 1) * num_layers - len(table)
        if missing and holes == "longest":  # the longest run of complete tokens (complete ones are few)
            complete = sorted(t for t, c in per_token.items() if c == num_layers)
            best, run_start = (0, 0), None
            for i, t in enumerate(complete):
                if run_start is None or t != complete[i - 1] + 1:
                    run_start = t
                if t + 1 - run_start > best[1] - best[0]:
                    best = (run_start, t + 1)
            start, usable = best
        if missing:
            first_hole = next(t for t in range(max_tok + 1) if per_token.get(t, 0) < num_layers)
            layer = next(layer for layer in range(num_layers) if (first_hole, layer) not in table)
            kept = (
                f"kept its first {usable} tokens"
                if holes == "cut"
                else f"kept its longest complete run, tokens {start}-{usable - 1}"
            )
            problems.append(
                f"{path}:{first_line[seq]}: sequence {_shown(seq)}: {missing} missing (token, layer) "
                f"entries, first at token {first_hole} layer {layer}; {kept}"
            )
        if usable - start <= 0:
            continue
        span = range(start, usable)
        experts_out.append(np.array([[table[(t, layer)][0] for layer in range(num_layers)] for t in span]))
        if has_weights:
            weights_out.append(
                np.array([[table[(t, layer)][1] for layer in range(num_layers)] for t in span], dtype=np.float16)
            )
        lengths.append(usable - start)
        plens.append(max(0, min(prompt_lens.get(seq, usable), usable) - start))
    if not experts_out:  # (the warnings that say why are not printed when the import fails: the first, said here)
        hole = next((p.split(": ", 1)[1] for p in problems if "missing (token, layer)" in p), "")
        raise TraceError(f"{path}: no sequence has a complete first token" + (f" ({hole})" if hole else ""))
    meta = {
        "model": model,
        "num_experts": int(n_exp),
        "top_k": int(top_k),
        "num_layers": int(num_layers),
        "dataset": dataset or "unknown",
        "recorder": f"imported from {path.name} (JSON lines)",
        "license": license or "unknown",
        "source": source or f"import:{path.name}",
        "sequence_key": [*(key_fields or ()), "sequence id"],
    }
    if dense_layers:
        meta["dense_layers_filled"] = list(dense_layers)  # (experts 0..k-1 there: a dense layer routes nothing)
    trace = Trace(
        np.concatenate(experts_out),
        np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64),
        np.asarray(plens, dtype=np.int32),
        meta,
        np.concatenate(weights_out) if has_weights else None,
    )
    return trace, problems
