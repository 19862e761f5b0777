"""The one percentile the benchmark scripts report, so that every p50/p95 they print means the
same thing. Latency is reported as p50/p95 over many turns and runs, never as a single run: one
turn's voice-to-voice moves by tens of milliseconds from run to run.

    from benchmarks._stats import percentile
    percentile([120.0, 95.0, 180.0], 95)   # 174.0
"""

from __future__ import annotations

import math
from collections.abc import Iterable

import numpy as np

__all__ = ["percentile"]


def percentile(values: Iterable[float], q: float) -> float:
    """The ``q``-th percentile (0-100) of ``values``, linearly interpolated between the closest
    ranks (numpy's default, ``statistics.quantiles(method="inclusive")``); NaN for no values."""
    a = np.fromiter(values, dtype=float)
    return float(np.percentile(a, q)) if a.size else math.nan
