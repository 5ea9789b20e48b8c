"""One fit shared by calibration and the published component benchmarks: a transfer or an operator
that streams bytes at a rate after a fixed start, `seconds = fixed + bytes / rate`."""

from __future__ import annotations

from typing import Sequence

import numpy as np


def rate_and_fixed(sizes: Sequence[float], seconds: Sequence[float]) -> tuple[float, float]:
    """The least-squares line through (bytes, seconds): (bytes/s, fixed seconds), the rate kept
    finite and the fixed part not negative (a noisy fit can dip below 0)."""
    slope, intercept = np.polyfit(np.asarray(sizes, float), np.asarray(seconds, float), 1)
    return 1.0 / max(float(slope), 1e-15), max(0.0, float(intercept))
