"""Bandwidth and timing summaries, as nccl-tests defines them (pure Python).

``algbw = S / t`` and ``busbw = algbw × factor`` where (nccl-tests ``doc/PERFORMANCE.md``):

* all-reduce: ``S`` = the dense buffer size, factor ``2(n−1)/n``;
* all-gather: ``S`` = the **total** gathered size (per-rank size × n, padding included),
  factor ``(n−1)/n``.

``goodput = useful prefix bytes / t`` (the prefix's own pages, never padding). Units: GB/s
= 1e9 bytes per second (as nccl-tests prints), times in milliseconds, sizes in MiB = 2**20.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence

MIB = float(1 << 20)

ALL_REDUCE = "all_reduce"
ALL_GATHER = "all_gather"


def bus_factor(collective: str, world: int) -> float:
    """nccl-tests bus-bandwidth factor for ``collective`` at ``world`` ranks."""
    if world < 1:
        raise ValueError(f"world size must be >= 1, got {world}")
    if collective == ALL_REDUCE:
        return 2.0 * (world - 1) / world
    if collective == ALL_GATHER:
        return (world - 1) / world
    raise ValueError(f"unknown collective {collective!r}")


def gbps(nbytes: float, ms: float | None) -> float | None:
    """``nbytes`` per ``ms`` milliseconds in GB/s (1e9 B/s); None when the time is unknown/zero."""
    if ms is None or ms <= 0:
        return None
    return nbytes / (ms * 1e-3) / 1e9


def algbw_gbps(s_bytes: float, ms: float | None) -> float | None:
    """nccl-tests algorithm bandwidth ``S / t``."""
    return gbps(s_bytes, ms)


def busbw_gbps(s_bytes: float, ms: float | None, collective: str, world: int) -> float | None:
    """nccl-tests bus bandwidth ``algbw × factor``."""
    alg = algbw_gbps(s_bytes, ms)
    return None if alg is None else alg * bus_factor(collective, world)


def summarize(per_rank_ms: Sequence[Sequence[float]]) -> dict[str, float]:
    """Timing summary over ranks: ``avg`` (all samples), ``p50``, ``min``, ``max_rank_avg``,
    and the spread ``p25``, ``p75``, ``max``.

    ``avg`` is the mean over every sample of every rank (each rank has the same number of
    repeats, so it is also the mean of the rank averages, like nccl-tests' default ``-a 1``);
    ``max_rank_avg`` is the slowest rank's average; the quantiles are over every sample
    (linear interpolation between closest ranks, numpy's default).
    """
    if not per_rank_ms or any(len(r) == 0 for r in per_rank_ms):
        raise ValueError("need at least one sample per rank")
    flat = sorted(x for r in per_rank_ms for x in r)
    return {
        "avg": statistics.fmean(flat),
        "p50": statistics.median(flat),
        "min": flat[0],
        "max_rank_avg": max(statistics.fmean(r) for r in per_rank_ms),
        "p25": quantile(flat, 0.25),
        "p75": quantile(flat, 0.75),
        "max": flat[-1],
    }


def quantile(sorted_values: Sequence[float], q: float) -> float:
    """The ``q`` quantile of ascending ``sorted_values``, interpolated linearly (numpy's)."""
    pos = q * (len(sorted_values) - 1)
    lo = int(pos)
    hi = min(lo + 1, len(sorted_values) - 1)
    return sorted_values[lo] + (sorted_values[hi] - sorted_values[lo]) * (pos - lo)
