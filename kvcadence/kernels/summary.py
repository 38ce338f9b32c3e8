"""Distribution-weighted cost and crossover detection over per-case results (pure Python).

Given result records (one per payload × size × path) and the weights of ``prefixes.json``:

* expected cost of a path = Σ weight(size) × time(size, path); a 0-token prefix (no shared
  pages) costs 0 on every path but keeps its weight;
* the winner at a size is the path with the smallest time; consecutive sizes with the same
  winner form a range, and a change of winner between two measured sizes is a crossover.

The time used is the record's ``time_source`` average: ``gpu_ms_avg`` for ``cuda_event``,
``cpu_ms_avg`` (host wall time) for ``wall``.

Noise: each record also carries the spread of its repeats (``*_ms_p25``, ``_p50``,
``_p75``). The headline winner is named only when it is outside the spread: the path with
the smallest weighted median cost (Σ weight × p50) wins when its band (Σ weight × p25 to
Σ weight × p75) lies below every other path's band; otherwise the summary says "no clear
winner" (``winner`` null) and lists the paths within the spread. Each size range says
whether its fastest path was clear at every size in it (``clear``). Records without the
spread (older results) count as points at their average.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from typing import Any


def row_time_ms(row: Mapping[str, Any]) -> float:
    """The time a result record is compared by (see the module docstring)."""
    key = "gpu_ms_avg" if row.get("time_source") == "cuda_event" else "cpu_ms_avg"
    value = row.get(key)
    if value is None:
        raise ValueError(f"result has no {key}")
    return float(value)


def times_by_size(rows: Iterable[Mapping[str, Any]]) -> dict[int, dict[str, float]]:
    """``{prefix_tokens: {path: ms}}`` for one payload's result records."""
    out: dict[int, dict[str, float]] = {}
    for row in rows:
        out.setdefault(int(row["prefix_tokens"]), {})[str(row["path"])] = row_time_ms(row)
    return out


Spread = tuple[float, float, float]  # (p25, p50, p75) in ms


def row_spread_ms(row: Mapping[str, Any]) -> Spread:
    """``(p25, p50, p75)`` of a result record's time source (a point at its average when the
    record has no spread)."""
    prefix = "gpu_ms_" if row.get("time_source") == "cuda_event" else "cpu_ms_"
    mid = row.get(prefix + "p50")
    mid = row_time_ms(row) if mid is None else float(mid)
    lo, hi = row.get(prefix + "p25"), row.get(prefix + "p75")
    if lo is None or hi is None:
        return (mid, mid, mid)
    return (float(lo), mid, float(hi))


def spreads_by_size(rows: Iterable[Mapping[str, Any]]) -> dict[int, dict[str, Spread]]:
    """``{prefix_tokens: {path: (p25, p50, p75)}}`` for one payload's result records."""
    out: dict[int, dict[str, Spread]] = {}
    for row in rows:
        out.setdefault(int(row["prefix_tokens"]), {})[str(row["path"])] = row_spread_ms(row)
    return out


def verdict(spread: Mapping[str, Spread]) -> dict[str, Any]:
    """``{"winner", "leader", "within_spread"}``: the leader has the smallest median (ties:
    first name sorted); it is the winner only when no other path's band reaches into its
    own (``other p25 > leader p75``), else ``winner`` is None and ``within_spread`` lists
    the paths that overlap it."""
    leader = min(sorted(spread), key=lambda p: spread[p][1])
    tied = [p for p in sorted(spread) if p != leader and spread[p][0] <= spread[leader][2]]
    return {"winner": None if tied else leader, "leader": leader, "within_spread": tied}


def expected_spread(
    spreads: Mapping[int, Mapping[str, Spread]], weights: Mapping[int, float], paths: Sequence[str]
) -> dict[str, Spread]:
    """``(Σ w × p25, Σ w × p50, Σ w × p75)`` per path over the positive sizes."""
    out: dict[str, Spread] = {}
    for path in paths:
        parts: list[list[float]] = [[], [], []]
        for size, w in weights.items():
            if size <= 0:
                continue
            if size not in spreads or path not in spreads[size]:
                raise ValueError(f"no measurement for {path} at {size} tokens")
            for i, v in enumerate(spreads[size][path]):
                parts[i].append(w * v)
        lo, mid, hi = (math.fsum(p) for p in parts)
        out[path] = (lo, mid, hi)
    return out


def winners(times: Mapping[int, Mapping[str, float]]) -> list[tuple[int, str]]:
    """``(size, fastest path)`` ascending by size; ties go to the path named first (sorted)."""
    out = []
    for size in sorted(times):
        by_path = times[size]
        if by_path:
            out.append((size, min(sorted(by_path), key=lambda p: by_path[p])))
    return out


def ranges(
    wins: Sequence[tuple[int, str]], weights: Mapping[int, float] | None = None
) -> list[dict[str, Any]]:
    """Merge consecutive sizes with the same winner: ``{path, from_tokens, to_tokens, weight}``."""
    out: list[dict[str, Any]] = []
    for size, path in wins:
        w = (weights or {}).get(size, 0.0)
        if out and out[-1]["path"] == path:
            out[-1]["to_tokens"] = size
            out[-1]["weight"] += w
        else:
            out.append({"path": path, "from_tokens": size, "to_tokens": size, "weight": w})
    if weights is None:
        for r in out:
            del r["weight"]
    return out


def crossovers(wins: Sequence[tuple[int, str]]) -> list[dict[str, Any]]:
    """Where the winner changes: between ``below_tokens`` (last size of the old winner) and
    ``above_tokens`` (first size of the new one)."""
    out = []
    for (a, pa), (b, pb) in zip(wins, wins[1:], strict=False):
        if pa != pb:
            out.append({"below_tokens": a, "above_tokens": b, "from_path": pa, "to_path": pb})
    return out


def expected_cost(
    times: Mapping[int, Mapping[str, float]], weights: Mapping[int, float], paths: Sequence[str]
) -> dict[str, float]:
    """Σ weight × time per path; every positive weighted size must have been measured."""
    out: dict[str, float] = {}
    for path in paths:
        terms = []
        for size, w in weights.items():
            if size <= 0:
                continue
            if size not in times or path not in times[size]:
                raise ValueError(f"no measurement for {path} at {size} tokens")
            terms.append(w * times[size][path])
        out[path] = math.fsum(terms)
    return out


def prefix_summary(
    rows: Sequence[Mapping[str, Any]],
    weights: Mapping[int, float],
    paths: Sequence[str],
    extra: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """The summary record for one payload's results under a prefix distribution."""
    if not rows:
        raise ValueError("no results to summarise")
    times = times_by_size(rows)
    cost = expected_cost(times, weights, paths)
    wins = winners(times)
    spreads = spreads_by_size(rows)
    band = expected_spread(spreads, weights, paths)
    call = verdict(band)
    unclear = {size for size, by in spreads.items() if by and verdict(by)["winner"] is None}
    size_ranges = ranges(wins, weights)
    sizes = [s for s, _ in wins]
    for r in size_ranges:
        span = [s for s in sizes if r["from_tokens"] <= s <= r["to_tokens"]]
        r["clear"] = not any(s in unclear for s in span)
    dense = cost.get("dense_all_reduce")
    first = rows[0]
    out: dict[str, Any] = {
        "record": "summary",
        "payload": first["payload"],
        "world_size": first["world_size"],
        "backend": first["backend"],
        "dtype": first["dtype"],
        "time_source": first["time_source"],
        "paths": list(paths),
        "expected_ms": cost,
        "expected_vs_dense": (
            {p: (c / dense if dense else None) for p, c in cost.items()}
            if dense is not None
            else None
        ),
        "expected_ms_p50": {p: b[1] for p, b in band.items()},
        "expected_ms_spread": {p: [b[0], b[2]] for p, b in band.items()},
        "winner": call["winner"],
        "leader": call["leader"],
        "within_spread": call["within_spread"],
        "repeat": first.get("repeat"),
        "zero_prefix_weight": math.fsum(w for s, w in weights.items() if s <= 0),
        "ranges": size_ranges,
        "crossovers": crossovers(wins),
    }
    if extra:
        out.update(extra)
    return out
