"""Distribution-weighted cost and crossover detection over per-case results (pure Python).

Given result records (one per payload × size × path) and the weights of ``prefixes.json``:

* expected cost of a path = Σ weight(size) × time(size, path); a 0-token prefix (no shared
  pages) costs 0 on every path but keeps its weight;
* the winner at a size is the path with the smallest time; consecutive sizes with the same
  winner form a range, and a change of winner between two measured sizes is a crossover.

The time used is the record's ``time_source`` average: ``gpu_ms_avg`` for ``cuda_event``,
``cpu_ms_avg`` (host wall time) for ``wall``.
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
    winner = min(sorted(cost), key=lambda p: cost[p])
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
        "winner": winner,
        "zero_prefix_weight": math.fsum(w for s, w in weights.items() if s <= 0),
        "ranges": ranges(wins, weights),
        "crossovers": crossovers(wins),
    }
    if extra:
        out.update(extra)
    return out
