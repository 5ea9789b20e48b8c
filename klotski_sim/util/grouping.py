"""Grouping a timeline's rows without pandas: codes of a text column, and sums and means per group.

A summary needs only these two of pandas' tools, and importing pandas takes 0.2 s of a single
`klotski-sim simulate` (0.55 s in all on a tiny model). `factorize` numbers values in order of first
appearance, as `pandas.factorize(sort=False, use_na_sentinel=False)` does. The sums per group are
correctly rounded (`math.fsum`); pandas' groupby sums are not one method: its version 3 adds a
group's values one by one where the groups are sorted (`ufunc.reduceat`) and compensated (Kahan)
otherwise, so a summary's figures would move in their last digit with the order of its rows and
with the pandas installed. fsum's depend on neither.
"""

from __future__ import annotations

import math
from typing import Any, Sequence

import numpy as np


def is_missing(value: Any) -> bool:
    """None or a NaN: what pandas counts as a missing value in a text column."""
    return value is None or (isinstance(value, float) and value != value)


def factorize(values: np.ndarray | Sequence[Any]) -> tuple[np.ndarray, list[Any]]:
    """Integer codes of `values` into their distinct values, those in order of first appearance."""
    items = values.tolist() if isinstance(values, np.ndarray) else list(values)
    distinct = list(dict.fromkeys(items))
    # a missing value (a timeline made by hand, or read from a file with gaps): pandas counts every
    # NaN and None as one value (a NaN), where a dict tells NaN objects apart
    if any(map(is_missing, distinct)):
        from klotski_sim.util.lazy import pd

        codes, uniques = pd.factorize(np.asarray(values, dtype=object), sort=False, use_na_sentinel=False)
        return codes, uniques.tolist()
    number = {v: k for k, v in enumerate(distinct)}
    return np.fromiter(map(number.__getitem__, items), dtype=np.intp, count=len(items)), distinct


def group_sums(values: np.ndarray, codes: np.ndarray, groups: int) -> tuple[list[float], list[int]]:
    """Per group 0..groups-1: the sum of its values, correctly rounded (`math.fsum`: whatever their
    order), and how many it has (NaNs left out, as pandas leaves them out)."""
    kept = ~np.isnan(values)
    values, codes = values[kept], codes[kept]
    order = np.argsort(codes)  # (each group's values together: fsum does not mind their order)
    bounds = np.searchsorted(codes[order], np.arange(groups + 1)).tolist()
    ordered = values[order].tolist()
    return [math.fsum(ordered[lo:hi]) for lo, hi in zip(bounds, bounds[1:])], np.diff(bounds).tolist()
