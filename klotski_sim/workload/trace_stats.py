"""Statistics of a routing trace: the properties an expert-aware schedule lives on.

Per layer: popularity (shares, max, min, entropy), skew within one request, token-to-token
stickiness and reuse, how alike a request's prompt and generated tokens route (prefill-to-decode
correlation), layer-to-layer mutual information and next-layer top-1 predictability, and — the
quantity Klotski depends on — how much of a group of n x bs tokens the group's top-k experts
handle, and how many distinct experts such a group activates (what has to be loaded).
"""

from __future__ import annotations

import numpy as np

from klotski_sim.util.lazy import pd  # (imported when first used: klotski_sim/util/lazy.py)
from klotski_sim.workload.trace import Trace, TraceError

GROUP_BATCH_SIZE = 16
GROUP_NS = (1, 4, 16)
SHUFFLES = 3  # permutations averaged for the MI baseline
TOKEN_SETS = ("all", "prompt", "generated")


def token_subset(trace: Trace, tokens: str) -> Trace:
    """The trace restricted to its prompt tokens, its generated tokens, or all of them (prefill and
    decode route differently: a prompt's tokens are seen at once, generated ones one by one)."""
    if tokens == "all":
        return trace
    if tokens not in TOKEN_SETS:
        raise TraceError(f"--tokens must be one of {', '.join(TOKEN_SETS)}, got {tokens!r}")
    rows, lengths = [], []
    for i in range(trace.num_sequences):
        start, end, prompt = int(trace.seq_offsets[i]), int(trace.seq_offsets[i + 1]), int(trace.prompt_lens[i])
        lo, hi = (start, start + prompt) if tokens == "prompt" else (start + prompt, end)
        if hi > lo:
            rows.append(np.arange(lo, hi))
            lengths.append(hi - lo)
    if not rows:
        raise TraceError(f"--tokens {tokens}: the trace holds no {tokens} tokens")
    idx = np.concatenate(rows)
    offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
    prompt_lens = np.array(lengths if tokens == "prompt" else [0] * len(lengths), dtype=np.int32)
    return Trace(
        trace.experts[idx],
        offsets,
        prompt_lens,
        {**trace.meta, "tokens": tokens},
        trace.weights[idx] if trace.weights is not None else None,
    )


def popularity(trace: Trace) -> pd.DataFrame:
    """`[layer x expert]` share of all top-k selections."""
    E, L = trace.num_experts, trace.num_layers
    flat = trace.experts.astype(np.int64) + (np.arange(L) * E)[None, :, None]
    counts = np.bincount(flat.ravel(), minlength=L * E).reshape(L, E)
    total = counts.sum(axis=1, keepdims=True)
    return pd.DataFrame(
        counts / np.maximum(total, 1), index=pd.RangeIndex(L, name="layer"), columns=[f"e{e}" for e in range(E)]
    )


def _entropy_bits(p: np.ndarray) -> np.ndarray:
    with np.errstate(divide="ignore", invalid="ignore"):
        return -np.nansum(np.where(p > 0, p * np.log2(p), 0.0), axis=-1)


def _shuffled_mi_bits(a: np.ndarray, b: np.ndarray, E: int, seed: int = 0) -> float:
    """The plug-in MI of `a` against shuffled `b`: what independent choices read at this sample
    size (the plug-in estimate is biased upwards by about (E-1)^2 / (2 n ln 2) bits)."""
    rng = np.random.default_rng(seed)
    return float(np.mean([_mutual_information_bits(a, rng.permutation(b), E)[0] for _ in range(SHUFFLES)]))


_DENSE_JOINT_CELLS = 1 << 22  # up to 2048 experts a joint table is held whole (32 MB); beyond, only its used cells


def _mutual_information_bits(a: np.ndarray, b: np.ndarray, E: int) -> tuple[float, float]:
    """Plug-in MI (bits) between two expert-id arrays, and the accuracy of the best a -> b map."""
    if E * E > _DENSE_JOINT_CELLS:  # (a trace may declare 65,536 experts: a dense table would take 32 GiB)
        return _mutual_information_bits_sparse(a, b, E)
    joint = np.bincount(a.astype(np.int64) * E + b, minlength=E * E).reshape(E, E).astype(float)
    n = joint.sum()
    if n == 0:
        return float("nan"), float("nan")
    p = joint / n
    pa, pb = p.sum(axis=1, keepdims=True), p.sum(axis=0, keepdims=True)
    with np.errstate(divide="ignore", invalid="ignore"):
        mi = np.nansum(np.where(p > 0, p * np.log2(p / (pa * pb)), 0.0))
    return float(mi), float(p.max(axis=1).sum())


def _mutual_information_bits_sparse(a: np.ndarray, b: np.ndarray, E: int) -> tuple[float, float]:
    """`_mutual_information_bits` over the joint table's used cells only (the same terms)."""
    cells, counts = np.unique(a.astype(np.int64) * E + b, return_counts=True)
    n = counts.sum()
    if n == 0:
        return float("nan"), float("nan")
    p = counts / n
    row, col = cells // E, cells % E
    pa = np.bincount(row, weights=p, minlength=E)
    pb = np.bincount(col, weights=p, minlength=E)
    mi = float(np.sum(p * np.log2(p / (pa[row] * pb[col]))))
    starts = np.flatnonzero(np.concatenate(([True], row[1:] != row[:-1])))  # (cells sorted: rows in runs)
    return mi, float(np.maximum.reduceat(p, starts).sum())


def _prefill_decode_similarity(trace: Trace) -> list[tuple[float, float]]:
    """Per layer: the mean cosine similarity between each request's expert shares over its prompt
    and over its generated tokens, and the same against the next request's generated tokens (what
    unrelated requests read at these sizes). The gap is the prefill-to-decode correlation that
    placing a request by its prompt's routing lives on; NaN without requests that have both."""
    E, L = trace.num_experts, trace.num_layers
    off, prompt = trace.seq_offsets, trace.prompt_lens.astype(np.int64)
    both = np.flatnonzero((prompt > 0) & (np.diff(off) > prompt))
    if len(both) < 2:
        return [(float("nan"), float("nan"))] * L
    out = []
    group = max(1, _DENSE_JOINT_CELLS * 4 // E)  # (requests a pass: bounded counts, however many experts)
    for layer in range(L):
        sims, others = [], []
        for lo in range(0, len(both), group):
            chosen = both[lo : lo + group]
            shares = []
            for start, end in (
                (off[chosen], off[chosen] + prompt[chosen]),
                (off[chosen] + prompt[chosen], off[chosen + 1]),
            ):
                lengths = end - start
                before = np.cumsum(lengths) - lengths  # (each request's first row among these tokens)
                token = np.repeat(start - before, lengths) + np.arange(lengths.sum())
                owner = np.repeat(np.arange(len(chosen)), lengths)
                flat = owner[:, None] * E + trace.experts[token, layer, :]
                counts = np.bincount(flat.ravel(), minlength=len(chosen) * E).reshape(-1, E).astype(float)
                shares.append(counts / np.linalg.norm(counts, axis=1, keepdims=True))
            sims.append((shares[0] * shares[1]).sum(axis=1))
            others.append((shares[0] * np.roll(shares[1], 1, axis=0)).sum(axis=1))
        out.append((float(np.concatenate(sims).mean()), float(np.concatenate(others).mean())))
    return out


def layer_stats(
    trace: Trace, group_batch_size: int = GROUP_BATCH_SIZE, group_ns: tuple[int, ...] = GROUP_NS
) -> pd.DataFrame:
    """One row per layer; see the module docstring for the columns."""
    if len(trace.experts) == 0:
        raise TraceError("the trace holds no tokens: there is nothing to measure")
    E, L, k = trace.num_experts, trace.num_layers, trace.top_k
    ex = trace.experts
    shares = popularity(trace).to_numpy()
    off = trace.seq_offsets
    # consecutive pairs within one sequence
    same_seq = np.ones(len(ex), dtype=bool)
    same_seq[off[:-1]] = False  # the first token of each sequence has no predecessor
    cur = np.flatnonzero(same_seq)
    prev = cur - 1
    first = ex[:, :, 0]

    # per-request max share (mean over sequences)
    seq_of_token = np.repeat(np.arange(trace.num_sequences), np.diff(off))
    req_max = np.zeros(L)
    lengths = np.diff(off)
    if trace.num_sequences:
        # (sequences counted a group at a time: at most 2^24 counts at once, however many experts)
        group = max(1, _DENSE_JOINT_CELLS * 4 // E)
        for layer in range(L):
            shares_of_max = []
            for lo in range(0, trace.num_sequences, group):
                span = slice(off[lo], off[min(lo + group, trace.num_sequences)])
                flat = (seq_of_token[span] - lo)[:, None] * E + ex[span, layer, :]
                counts = np.bincount(flat.ravel(), minlength=min(group, trace.num_sequences - lo) * E).reshape(-1, E)
                tot = counts.sum(axis=1)
                ok = tot > 0
                shares_of_max.append(counts[ok].max(axis=1) / tot[ok])
            share = np.concatenate(shares_of_max)
            req_max[layer] = float(share.mean()) if len(share) else np.nan

    pd_similarity = _prefill_decode_similarity(trace)
    rows = []
    for layer in range(L):
        row: dict[str, float] = {
            "max_share": shares[layer].max(),
            "topk_share": np.sort(shares[layer])[-k:].sum(),
            "min_share": shares[layer].min(),
            "entropy_bits": float(_entropy_bits(shares[layer])),
            "request_max_share": req_max[layer],
        }
        if len(cur):
            row["stick_top1"] = float((first[cur, layer] == first[prev, layer]).mean())
            a, b = ex[cur, layer, :], ex[prev, layer, :]
            reused = (a[:, :, None] == b[:, None, :]).any(axis=2)  # [token, slot]: also its predecessor's
            row["stick_any"] = float(reused.any(axis=1).mean())
            row["reuse_share"] = float(reused.mean())  # what a cache of the previous token's experts hits
        else:
            row["stick_top1"] = row["stick_any"] = row["reuse_share"] = float("nan")
        row["pd_sim"], row["pd_sim_other"] = pd_similarity[layer]
        if layer + 1 < L:
            mi, acc = _mutual_information_bits(first[:, layer], first[:, layer + 1], E)
            baseline = _shuffled_mi_bits(first[:, layer], first[:, layer + 1], E, seed=layer)
        else:
            mi, acc, baseline = float("nan"), float("nan"), float("nan")
        row["mi_next_bits"] = mi
        row["mi_next_shuffled_bits"] = baseline  # independence at this sample size
        row["mi_next_excess_bits"] = mi - baseline  # the information beyond the small-sample bias
        row["next_top1_acc"] = acc
        # the shipped real measurements pair layers 7 apart (0-7, 7-15)
        row["mi_skip7_bits"] = (
            _mutual_information_bits(first[:, layer], first[:, layer + 7], E)[0] if layer + 7 < L else float("nan")
        )
        rows.append(row)
    df = pd.DataFrame(rows, index=pd.RangeIndex(L, name="layer"))

    # groups of n x bs sequences at the same token position: the longest sequences first, so one
    # short sequence does not truncate every group
    longest = np.argsort(-lengths, kind="stable")
    for n in group_ns:
        size = n * group_batch_size
        groups = trace.num_sequences // size
        chosen = np.sort(longest[: groups * size])
        usable = int(lengths[chosen].min()) if groups else 0
        if groups == 0 or usable == 0:
            df[f"hot_share_n{n}"] = np.nan
            df[f"active_n{n}"] = np.nan
            continue
        idx = off[chosen, None] + np.arange(usable)[None, :]  # [seqs, positions]
        sel = ex[idx]  # [seqs, pos, L, k]
        sel = sel.reshape(groups, size, usable, L, k).transpose(0, 2, 3, 1, 4).reshape(groups * usable * L, size * k)
        base = (np.arange(len(sel)) * E)[:, None]
        counts = np.bincount((sel.astype(np.int64) + base).ravel(), minlength=len(sel) * E).reshape(-1, E)
        top = np.sort(counts, axis=1)[:, -k:].sum(axis=1) / (size * k)
        active = (counts > 0).sum(axis=1)
        df[f"hot_share_n{n}"] = top.reshape(groups, usable, L).mean(axis=(0, 1))
        df[f"active_n{n}"] = active.reshape(groups, usable, L).mean(axis=(0, 1))
    return df


def summary(trace: Trace) -> dict[str, float]:
    """Layer means of the statistics, plus sizes: the numbers a note or a test quotes."""
    df = layer_stats(trace)
    out = {col: float(df[col].mean()) for col in df.columns}
    out["max_share_max"] = float(df["max_share"].max())
    out["sequences"] = trace.num_sequences
    out["tokens"] = int(len(trace.experts))
    return out


def format_stats(trace: Trace, df: pd.DataFrame | None = None) -> str:
    df = layer_stats(trace) if df is None else df
    m = trace.meta
    lines = [
        f"trace: model {m.get('model')} ({trace.num_experts} experts, top-{trace.top_k}, {trace.num_layers} "
        f"layers); {trace.num_sequences} sequences, {len(trace.experts)} tokens "
        f"(lengths {int(trace.lengths.min())}-{int(trace.lengths.max())})",
        f"source: {m.get('source', '?')}; recorder: {m.get('recorder', '?')}; dataset: {m.get('dataset', '?')}",
    ]
    random_top1 = 1 / trace.num_experts
    # a uniform router spreads each layer's choices evenly: every expert's share is 1/E
    lines.append(
        f"uniform routing would give: max_share {1 / trace.num_experts:.3f}, "
        f"stick_top1 {random_top1:.3f}, reuse_share {trace.top_k / trace.num_experts:.3f}, pd_sim ~ pd_sim_other, "
        f"mi_next_bits = mi_next_shuffled_bits (its small-sample bias), so mi_next_excess_bits ~ 0"
    )
    if m.get("tokens", "all") != "all":
        lines.append(f"tokens: {m['tokens']} only")
    for n in GROUP_NS:
        need = n * GROUP_BATCH_SIZE
        if trace.num_sequences < need:
            lines.append(
                f"hot_share_n{n}, active_n{n}: not measured — a group of n = {n} batches of "
                f"{GROUP_BATCH_SIZE} needs {need} sequences, the trace has {trace.num_sequences}"
            )
    shown = df if len(df) <= 16 else df.iloc[np.unique(np.linspace(0, len(df) - 1, 8).astype(int))]
    table = pd.concat([shown, df.mean().to_frame("mean").T])
    with pd.option_context("display.width", 200, "display.max_columns", 30, "display.float_format", "{:.3f}".format):
        lines.append(table.to_string())
    return "\n".join(lines)
