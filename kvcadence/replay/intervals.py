"""Interval counts for the timing calibration (``replay.timing``), by bisection over sorted
times instead of pairwise.

What this file owns: ``overlaps`` (per request span: the spans alive in it and those received
inside it), ``Alive`` (how many rows overlap a window), ``Inside`` (the prefill time that
falls inside a window, the same float as the direct sum) and ``Context`` (the context the
requests alive in a window hold, time-averaged over it: prefix sums of each request's
linear KV growth). The pairwise counts they replace
were O(n^2): 40.6 s of calibration at 16,000 requests, hours at 10^5; these are O(n log n)
and give the same numbers (tests/replay/test_timing_calibration.py checks them against the
pairwise definitions with hypothesis).
"""

from __future__ import annotations

from bisect import bisect_left, bisect_right
from typing import Any


class Alive:
    """``alive(a, b)`` = ``sum(1 for s, f in zip(starts, finishes) if s < b and f > a)``
    for ``a < b``, by bisection (the per-phase calibration's concurrency, which was most of
    its 40.6 s at 16,000 requests when counted pairwise). The rows with ``start < finish`` are
    those started before ``b`` less those finished by ``a``; the others (``finish <=
    start``: none in a sane capture) are counted one by one."""

    def __init__(self, starts: list[float], finishes: list[float]) -> None:
        ok = [(st, f) for st, f in zip(starts, finishes, strict=True) if st < f]
        self.starts = sorted(st for st, _ in ok)
        self.finishes = sorted(f for _, f in ok)
        self.odd = [(st, f) for st, f in zip(starts, finishes, strict=True) if not st < f]

    def __call__(self, a: float, b: float) -> int:
        n = bisect_left(self.starts, b) - bisect_right(self.finishes, a)
        return n + sum(1 for st, f in self.odd if st < b and f > a)


class Inside:
    """``inside(a, b)`` = ``sum(d for e, d in ends if a < e <= b)``, the same float (the
    same terms added in the same order): the ends with ``a < e <= b`` are a run of them
    sorted by ``e``, added in their list order."""

    def __init__(self, ends: list[tuple[Any, ...]]) -> None:
        self.order = sorted(range(len(ends)), key=lambda i: ends[i][0])
        self.es = [ends[i][0] for i in self.order]
        self.ds = [ends[i][1] for i in range(len(ends))]
        self.in_order = all(i == k for k, i in enumerate(self.order))

    def __call__(self, a: float, b: float) -> float:
        lo, hi = bisect_right(self.es, a), bisect_right(self.es, b)
        if self.in_order:
            return sum(self.ds[lo:hi])
        return sum(self.ds[i] for i in sorted(self.order[lo:hi]))


def overlaps(spans: list[tuple[float, float, int, int]]) -> tuple[list[int], list[int]]:
    """Per span ``(rx, fin, ...)`` (``rx < fin``): how many spans overlap it (``r.rx < fin``
    and ``r.fin > rx``, itself included) and how many were received inside it (``rx <
    r.rx < fin``). Counted by bisection over the sorted times (the spans alive in it are
    those received before ``fin`` less those finished by ``rx``): O(n log n), where the
    pairwise count was O(n^2) -- 11 s of a 6,000-request replay's 28 s, hours at 10^5."""
    rxs = sorted(s[0] for s in spans)
    fins = sorted(s[1] for s in spans)
    alive = [bisect_left(rxs, fin) - bisect_right(fins, rx) for rx, fin, _, _ in spans]
    arrivals = [bisect_left(rxs, fin) - bisect_right(rxs, rx) for rx, fin, _, _ in spans]
    return alive, arrivals


class Context:
    """``ctx(a, b)`` (``a < b``) = the mean over ``[a, b]`` of ``Σ_j kv_j(t)``, where row ``j``
    (``start < finish``; others are left out) holds ``kv_j(t) = prompt_j + outputs_j × (t −
    start_j) / (finish_j − start_j)`` tokens while ``start_j < t < finish_j`` (its prompt,
    then an output at a time, evenly over its decode window), none outside it: the context
    the decode passes of a window attend to, on average. ``G(t) = ∫_{-∞}^{t} Σ_j kv_j``
    is a quadratic in ``t`` per row, summed by prefix sums over the rows started before
    ``t`` less those finished by it (each then adds its whole integral): O(log n) a window.
    Times are taken relative to the earliest start (squares of epoch seconds would lose
    the window's own digits)."""

    def __init__(
        self,
        starts: list[float],
        finishes: list[float],
        prompts: list[float],
        outputs: list[float],
    ) -> None:
        rows = [
            (st, f, p, n)
            for st, f, p, n in zip(starts, finishes, prompts, outputs, strict=True)
            if st < f
        ]
        self.t0 = min((r[0] for r in rows), default=0.0)
        coef = []  # (start, finish, t² coefficient, t coefficient, constant, whole integral)
        for st, f, p, n in rows:
            st, f = st - self.t0, f - self.t0
            q = n / (f - st)  # outputs a second
            coef.append(
                (st, f, q / 2, p - q * st, q * st * st / 2 - p * st, (p + n / 2) * (f - st))
            )
        by_start = sorted(coef, key=lambda c: c[0])
        by_finish = sorted(coef, key=lambda c: c[1])
        self.starts = [c[0] for c in by_start]
        self.finishes = [c[1] for c in by_finish]
        self.s_sums = _prefix_sums([c[2:5] for c in by_start], 3)
        self.f_sums = _prefix_sums([(*c[2:5], c[5]) for c in by_finish], 4)

    def _g(self, t: float) -> float:
        t -= self.t0
        a, b, c = self.s_sums[bisect_left(self.starts, t)]
        fa, fb, fc, whole = self.f_sums[bisect_right(self.finishes, t)]
        return (a - fa) * t * t + (b - fb) * t + (c - fc) + whole

    def __call__(self, a: float, b: float) -> float:
        return (self._g(b) - self._g(a)) / (b - a)


def _prefix_sums(rows: list[tuple[float, ...]], width: int) -> list[tuple[float, ...]]:
    """``out[k]`` = the columnwise sums of ``rows[:k]`` (``width`` columns)."""
    acc = [0.0] * width
    out = [tuple(acc)]
    for r in rows:
        acc = [x + y for x, y in zip(acc, r, strict=True)]
        out.append(tuple(acc))
    return out
