"""The decode pass's fit: base, per request and, where the contexts are long, per context token.

What this file owns: ``fit_decode``, the choice of the decode pass model from each
request's mean pass over its decode window (``timing.calibrate`` computes the windows):
``base + per request × the requests alive in the window`` (``fitting.fit_line``), with a
third term ``per context token × the context they held`` (``intervals.Context``,
time-averaged) when it is given, or when the capture's contexts are long enough for it to be
a term of its own and it explains the windows (the prefill fit's partial F test,
``prefillfit.PREFIX_MIN_F``).

Why only long contexts (``CTX_MIN_TOKENS`` a running request, median over the windows): a
decode pass reads every running request's KV, so its cost grows with the context, but at
the few hundred to ~2k tokens a request of most captures that read is a small part of a pass
(the CPU worker's own ``Decode batch`` lines put it near 0.1-0.9 us a context token: well
under a millisecond a request, against 4-20 ms passes), so the window regression there fits
the box's noise -- it passed the F test on 30 of the 76 short captures of 2026-12-04 at
0.5-150 us a token, and the corpus held fewer bars with it fitted (docs/simulator.md, "A
decode term per context token"). At production sizes it is most of the pass: on the CPU
worker one request decoding at 7k, 14k and 22k tokens took 11, 18 and 24 ms a pass, and a
replay without the term decoded four 20k-token chats twice as fast as the worker, evicting
a chat's answer leaf a pass ahead of the turn above it (corpus
``p16-tight70k-chunk4096-ctx27k-http-clients-cancel``: Removed events/request +21.6 % ->
+2.7 %).
"""

from __future__ import annotations

from collections.abc import Sequence
from statistics import median

from kvcadence.replay.fitting import fit_line, fit_nonneg, rss
from kvcadence.replay.prefillfit import explains

#: the context term is fitted only where the requests alive in a decode window held at
#: least this many tokens each (median over the windows)
CTX_MIN_TOKENS = 4096


def fit_decode(
    conc: Sequence[float], ctx: Sequence[float], ys: Sequence[float], given: float = 0.0
) -> tuple[float, float, float]:
    """``(base, per request, per context token)`` of the decode windows' mean passes ``ys``
    given the requests alive in each window (``conc``) and the context they held (``ctx``,
    summed over them, time-averaged). ``given`` (> 0): the per-context-token cost as set
    (``--decode-per-ctx-token``): each window's share of it comes off first and base and
    per request are fitted to the rest; else the term is fitted only where the contexts are
    long (``CTX_MIN_TOKENS``) and it passes the partial F test, and is 0 otherwise."""
    ys = list(ys)
    if given > 0:
        rest = [y - given * x for y, x in zip(ys, ctx, strict=True)]
        a, b = _line(conc, rest)
        return a, b, given
    a, b = _line(conc, ys)
    n = len(ys)
    per_req = [x / max(k, 1.0) for x, k in zip(ctx, conc, strict=True)]
    if n <= 3 or median(per_req) < CTX_MIN_TOKENS:
        return a, b, 0.0
    ones = [1.0] * n
    cols = [ones, list(conc), list(ctx)]
    coef = fit_nonneg(cols, ys)
    rss2, rss3 = rss(ys, cols[:2], [a, b]), rss(ys, cols, coef)
    # (a gain below the float noise of the windows' squares is none: flat passes fit both
    # ways to rounding)
    if coef[2] <= 0 or rss2 - rss3 <= 1e-9 * sum(y * y for y in ys) or not explains(rss2, rss3, n):
        return a, b, 0.0
    return coef[0], coef[1], coef[2]


def _line(conc: Sequence[float], ys: list[float]) -> tuple[float, float]:
    """``fit_line``, or the median pass flat where its typical pass is not positive."""
    a, b = fit_line(list(conc), ys)
    if a + b * median(conc) <= 0:
        return max(median(ys), 0.0), 0.0
    return a, b
