"""Distance between the real and the sim distribution of one per-event quantity.

What this file owns: ``ks_statistic(a, b)``, the two-sample Kolmogorov–Smirnov statistic
``D = max over x of |F_a(x) − F_b(x)|`` of two samples (``F`` the empirical, right-continuous
CDF), evaluated at every distinct value of either sample, so it is exact for the small
integers blocks-per-event counts are (a median of 4 or 13 blocks moves a whole step when one
event changes; ``D`` moves by about 1/n). ``D`` lies in [0, 1]: 0 for equal distributions, 1
when every value of one sample lies below every value of the other. ``None`` when either
sample is empty. Used by ``analysis.compare`` (``*.ks`` comparison metrics) and
``analysis.ranks`` (per rank).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any


def ks_statistic(a: Iterable[float] | Any, b: Iterable[float] | Any) -> float | None:
    """Two-sample Kolmogorov–Smirnov statistic of ``a`` and ``b`` (see module docstring)."""
    import numpy as np

    xa = np.sort(np.asarray(list(a) if not hasattr(a, "__array__") else a, dtype=np.float64))
    xb = np.sort(np.asarray(list(b) if not hasattr(b, "__array__") else b, dtype=np.float64))
    if xa.size == 0 or xb.size == 0:
        return None
    if np.isnan(xa).any() or np.isnan(xb).any():
        raise ValueError("ks_statistic: the samples contain NaN")
    x = np.union1d(xa, xb)
    fa = np.searchsorted(xa, x, side="right") / xa.size
    fb = np.searchsorted(xb, x, side="right") / xb.size
    return float(np.max(np.abs(fa - fb)))
