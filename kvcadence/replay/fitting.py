"""Least-squares fits with non-negative coefficients, for the pass-time calibration.

What this file owns: ``fit_line`` (``y = a + b x``, the two-parameter fit the calibration
has always used, closed form), ``fit_nonneg`` (several regressors: the best non-negative
unconstrained fit over subsets of the columns, numpy ``lstsq``; exact for the pass model's
few regressors) and ``rss``. Pure arithmetic: deterministic.
"""

from __future__ import annotations

import numpy as np


def fit_nonneg(cols: list[list[float]], ys: list[float]) -> list[float]:
    """Non-negative least squares ``y = Σ c_j · cols[j]`` (``c_j >= 0``): the best of the
    unconstrained fits over every subset of the columns whose coefficients are all
    non-negative (exact for the few regressors of the pass model)."""
    k = len(cols)
    a = np.asarray(cols, dtype=np.float64).T.reshape(len(ys), k)
    y = np.asarray(ys, dtype=np.float64)
    best, best_res = [0.0] * k, float(y @ y)
    for mask in range(1, 1 << k):
        idx = [j for j in range(k) if mask >> j & 1]
        sub = a[:, idx]
        coef = np.linalg.lstsq(sub, y, rcond=None)[0]
        if (coef < 0).any():
            continue
        r = y - sub @ coef
        res = float(r @ r)
        if res < best_res * (1 - 1e-12):
            best_res = res
            best = [0.0] * k
            for j, c in zip(idx, coef.tolist(), strict=True):
                best[j] = c
    return best


def rss(ys: list[float], cols: list[list[float]], coefs: list[float]) -> float:
    """Residual sum of squares of ``y = Σ coefs[j] · cols[j]``."""
    a = np.asarray(cols, dtype=np.float64).reshape(len(cols), len(ys))
    r = np.asarray(ys, dtype=np.float64) - np.asarray(coefs, dtype=np.float64) @ a
    return float(r @ r)


def fit_line(xs: list[float], ys: list[float]) -> tuple[float, float]:
    """Least squares y = a + b x with a, b >= 0."""
    n = len(xs)
    if n == 0:
        return 0.0, 0.0
    mx = sum(xs) / n
    my = sum(ys) / n
    sxx = sum((x - mx) ** 2 for x in xs)
    if sxx <= 0:
        return max(my, 0.0), 0.0
    b = sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=False)) / sxx
    a = my - b * mx
    if b < 0:
        return max(my, 0.0), 0.0
    if a < 0:
        b = sum(x * y for x, y in zip(xs, ys, strict=False)) / max(sum(x * x for x in xs), 1e-12)
        return 0.0, max(b, 0.0)
    return a, b
