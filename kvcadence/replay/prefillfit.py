"""The prefill pass's fitted model: its features per request and the choice of its terms.

What this file owns: the features ``timing.calibrate`` fits a prefill batch's duration
against -- the passes a prompt runs (``passes``: one a ``chunked_prefill_size`` piece), the
prefix tokens its passes attend to (``attended``), its sequence lengths after each pass,
squared (``squared``) -- and ``fit_prefill``, which picks the terms: a base a pass and a cost
a new token always (non-negative least squares), then the attended prefix where it passes a
partial F test (``PREFIX_MIN_F``) and leaves a typical batch's own work above nothing
(``OWN_MIN_SHARE``), or instead the squared sequences where they lower the residuals of
the model chosen so far by the same statistic (docs/simulator.md, "Time").

Why a squared term: SGLang's torch-native attention backend (a CPU worker's,
``_run_sdpa_forward_extend``) pads an extend's queries to the whole sequence, so a pass
computes the sequence x sequence score matrix however few tokens are new (~500 new tokens
took 0.35, 1.45 and 5.0 s on 12k, 30k and 60k cached ones on the real worker).
"""

from __future__ import annotations

from collections.abc import Sequence
from statistics import median

from kvcadence.replay.fitting import fit_line, fit_nonneg, rss

#: the prefill fit takes a third term only when it lowers the residual sum of squares by at
#: least this partial F statistic ((RSS without − RSS with) / (RSS with / (batches − 3));
#: 10 is p < 0.002 from 30 batches on): a term that explains nothing on a capture would
#: only move its replay (docs/simulator.md, "Time")
PREFIX_MIN_F = 10.0
#: the prefix term is refused when a typical batch's own work is at most this share of it
OWN_MIN_SHARE = 1e-6


def passes(uncached: int, chunk: int | None) -> int:
    """Prefill passes of a prompt with ``uncached`` new tokens: one a ``chunk``-token piece
    (SGLang runs a chunked prompt's pieces in consecutive passes; one when not chunked)."""
    if not chunk or uncached <= chunk:
        return 1
    return -(-uncached // chunk)


def attended(cached: int, uncached: int, chunk: int | None) -> int:
    """Prefix tokens a request's prefill attends to, summed over its passes: the cached
    prefix; a prompt chunked into ``chunk``-token pieces runs one pass per piece, each
    attending to the cached prefix plus the pieces before it (``passes`` of them)."""
    n = passes(uncached, chunk)
    return n * cached + (chunk or 0) * n * (n - 1) // 2


def squared(cached: int, uncached: int, chunk: int | None) -> int:
    """A request's sequence lengths after each of its prefill passes, squared and summed:
    ``cached + uncached`` squared, or with ``chunk`` the cached prefix plus the pieces up to
    and including each pass's (``passes`` of them)."""
    n = passes(uncached, chunk)
    if n == 1 or not chunk:
        return (cached + uncached) ** 2
    return sum((cached + min(k * chunk, uncached)) ** 2 for k in range(1, n + 1))


def explains(rss2: float, rss3: float, n: int) -> bool:
    """A three-term fit of ``n`` batches lowers the residual sum of squares from ``rss2``
    (the model without its third term, or another three-term one) to ``rss3`` by a partial F
    statistic of at least ``PREFIX_MIN_F``."""
    return (rss2 - rss3) * (n - 3) >= PREFIX_MIN_F * rss3


def fit_prefill(
    npasses: Sequence[float],
    tokens: Sequence[float],
    prefix: Sequence[float],
    sq: Sequence[float],
    ys: Sequence[float],
) -> tuple[float, float, float, float]:
    """``(base, per token, per prefix token, per squared sequence token)`` of the batches'
    durations ``ys`` (at least 3) given their passes, new tokens, attended prefix tokens and
    squared sequences: the terms other than base and per token are 0 where not taken."""
    xs, ys, npasses = list(tokens), list(ys), list(npasses)
    # the base: once a pass (a batch of unchunked prompts runs one: ``fit_line``, the
    # two-parameter fit exactly)
    chunked = any(k > 1 for k in npasses)
    a, b = fit_nonneg([npasses, xs], ys) if chunked else fit_line(xs, ys)
    c = q = 0.0
    if len(xs) <= 3:
        return a, b, c, q
    rss2 = best = rss(ys, [npasses, xs], [a, b])
    pre = list(prefix)
    if any(pre):
        a3, b3, c3 = fit_nonneg([npasses, xs, pre], ys)
        rss3 = rss(ys, [npasses, xs, pre], [a3, b3, c3])
        # the prefix term only where it explains the durations (partial F test), never alone
        # (base and per-token ~0: nothing cached would prefill in no time)
        own = a3 * median(npasses) + b3 * median(xs)  # a typical batch's own work
        if c3 > 0 and own > OWN_MIN_SHARE * median(ys) and explains(rss2, rss3, len(xs)):
            a, b, c, best = a3, b3, c3, rss3
    # or the squared sequences (every prompt pays for its own: alone is no harm), only where
    # they lower the residuals of the model so far by the same statistic: short prompts'
    # durations, convex for other reasons, keep their model (on the corpus of 2026-12-06 the
    # captures of 10k-62k-token prompts take it, those of 4k-14k ones (on one DP rank of
    # one) and one whose chats grow to 7k with long answers; none of short prompts)
    sqs = list(sq)
    a3, b3, q3 = fit_nonneg([npasses, xs, sqs], ys)
    rss3 = rss(ys, [npasses, xs, sqs], [a3, b3, q3])
    if q3 > 0 and explains(best, rss3, len(xs)):
        a, b, c, q = a3, b3, 0.0, q3
    return a, b, c, q
