"""Per-rank figures, real-vs-sim per rank, and the routing what-if table.

What this file owns (pure functions; bundles are read through ``format.bundle`` and
payloads decoded through ``format.wire``):

* ``rank_figures(bundle)`` -- per DP rank (endpoint ``dp_rank``; requests by ``dp_rank``,
  null = rank 0) and in total: requests, messages, Stored/Removed events per request,
  blocks per Stored/Removed event (median, mean), stored/removed blocks, cache hit rate
  (Σ cached_tokens / Σ prompt_tokens), the set of stored block hashes and each request's
  ``cached_tokens``. Messages are de-duplicated by (endpoint, epoch, seq); the startup
  ``AllBlocksCleared`` counts as an event, as everywhere in the project;
* ``compare_ranks(real, sim)`` -- one row per rank (and ``all``) with real, sim and the
  relative delta of each figure, the stored-hash overlap, the share of requests whose
  ``cached_tokens`` agree and the Kolmogorov–Smirnov distance between the real and sim
  blocks-per-Stored / per-Removed distributions (``stored_blocks_ks``, ``removed_blocks_ks``:
  real 0, sim and delta = the distance; ``analysis.distance``);
* ``what_if_table(runs)`` -- rows ``{route, hit_rate, recorded_hit_rate, events/blocks per
  request, evictions}`` for several sim bundles of the same capture (one per routing
  policy), side by side;
* ``format_rows(rows, columns)`` -- a plain-text table.

Definitions follow ``analysis.metrics`` (per request = count / requests of that rank;
medians interpolate linearly).
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from kvcadence.analysis.distance import ks_statistic
from kvcadence.format.schema import served_rank

FIGURES = (
    "requests",
    "messages",
    "stored_events_per_request",
    "removed_events_per_request",
    "events_per_request",
    "stored_blocks_median",
    "stored_blocks_mean",
    "removed_blocks_median",
    "removed_blocks_mean",
    "stored_blocks",
    "removed_blocks",
    "stored_blocks_per_request",
    "removed_blocks_per_request",
    "hit_rate",
)


def _median(xs: list[int]) -> float | None:
    return float(statistics.median(xs)) if xs else None


def _mean(xs: list[int]) -> float | None:
    return float(statistics.fmean(xs)) if xs else None


def rank_figures(bundle: str | Path) -> dict[str, dict[str, Any]]:
    """``{"0": {...}, "1": {...}, "all": {...}}`` for one bundle (see module docstring)."""
    from kvcadence.format import wire
    from kvcadence.format.bundle import BundleReader, event_payload
    from kvcadence.format.schema import AllBlocksCleared, BlockRemoved, BlockStored

    reader = BundleReader(Path(bundle))
    ep_rank = {e.id: int(e.dp_rank) for e in reader.header.endpoints}
    acc: dict[int, dict[str, Any]] = {}

    def slot(rank: int) -> dict[str, Any]:
        if rank not in acc:
            acc[rank] = {
                "messages": 0,
                "stored": [],
                "removed": [],
                "cleared": 0,
                "hashes": set(),
                "requests": [],
            }
        return acc[rank]

    seen: set[tuple[int, int, int]] = set()
    for f in reader.events():
        key = (f.endpoint, f.epoch, f.seq)
        if key in seen:
            continue
        seen.add(key)
        a = slot(ep_rank.get(f.endpoint, f.endpoint))
        a["messages"] += 1
        try:
            batch = wire.decode_batch(event_payload(f))
        except Exception:  # noqa: BLE001 - undecodable payloads are counted by inspect
            continue
        for e in batch.events:
            if isinstance(e, BlockStored):
                a["stored"].append(len(e.block_hashes))
                a["hashes"].update(e.block_hashes)
            elif isinstance(e, BlockRemoved):
                a["removed"].append(len(e.block_hashes))
            elif isinstance(e, AllBlocksCleared):
                a["cleared"] += 1
    for rec in reader.requests():
        slot(served_rank(rec))["requests"].append(rec)
    out: dict[str, dict[str, Any]] = {}
    total = {
        "messages": 0,
        "stored": [],
        "removed": [],
        "cleared": 0,
        "hashes": set(),
        "requests": [],
    }
    for rank in sorted(acc):
        a = acc[rank]
        out[str(rank)] = _figures(a)
        total["messages"] += a["messages"]
        total["stored"] += a["stored"]
        total["removed"] += a["removed"]
        total["cleared"] += a["cleared"]
        total["hashes"] |= {(rank, h) for h in a["hashes"]}
        total["requests"] += a["requests"]
    out["all"] = _figures(total)
    return out


def _figures(a: dict[str, Any]) -> dict[str, Any]:
    reqs = a["requests"]
    n = len(reqs)
    d = max(n, 1)
    prompt = sum(r.prompt_tokens or len(r.input_ids) for r in reqs)
    cached = sum(r.cached_tokens or 0 for r in reqs)
    stored, removed = a["stored"], a["removed"]
    return {
        "requests": n,
        "messages": a["messages"],
        "stored_events_per_request": len(stored) / d,
        "removed_events_per_request": len(removed) / d,
        "events_per_request": (len(stored) + len(removed) + a["cleared"]) / d,
        "stored_blocks_median": _median(stored),
        "stored_blocks_mean": _mean(stored),
        "removed_blocks_median": _median(removed),
        "removed_blocks_mean": _mean(removed),
        "stored_blocks": sum(stored),
        "removed_blocks": sum(removed),
        "stored_blocks_per_request": sum(stored) / d,
        "removed_blocks_per_request": sum(removed) / d,
        "hit_rate": cached / prompt if prompt else None,
        "_hashes": a["hashes"],
        "_cached": {r.rid: r.cached_tokens for r in reqs},
        "_stored": list(stored),
        "_removed": list(removed),
    }


def _delta(real: Any, sim: Any) -> float | None:
    if real is None or sim is None:
        return None
    if real == 0:
        return 0.0 if sim == 0 else None
    return (sim - real) / real


def compare_ranks(
    real: dict[str, dict[str, Any]], sim: dict[str, dict[str, Any]]
) -> list[dict[str, Any]]:
    """Rows ``{rank, figure, real, sim, delta}`` plus ``hash_overlap`` / ``cached_equal``."""
    rows: list[dict[str, Any]] = []
    for rank in [k for k in real if k != "all"] + ["all"]:
        r = real.get(rank)
        s = sim.get(rank)
        if r is None or s is None:
            continue
        for fig in FIGURES:
            rows.append(
                {
                    "rank": rank,
                    "figure": fig,
                    "real": r[fig],
                    "sim": s[fig],
                    "delta": _delta(r[fig], s[fig]),
                }
            )
        union = r["_hashes"] | s["_hashes"]
        overlap = len(r["_hashes"] & s["_hashes"]) / len(union) if union else 1.0
        rows.append(
            {
                "rank": rank,
                "figure": "stored_hash_jaccard",
                "real": 1.0,
                "sim": overlap,
                "delta": overlap - 1.0,
            }  # fmt: skip
        )
        # cached_tokens agreement over all requests (by rid, wherever sim served them)
        rc = real["all"]["_cached"] if rank == "all" else r["_cached"]
        sc = sim["all"]["_cached"]
        both = [rid for rid in rc if rid in sc and rc[rid] is not None]
        eq = sum(1 for rid in both if rc[rid] == sc[rid]) / len(both) if both else None
        rows.append({"rank": rank, "figure": "cached_tokens_equal", "real": 1.0, "sim": eq,
                     "delta": None if eq is None else eq - 1.0})  # fmt: skip
        for fig, key in (("stored_blocks_ks", "_stored"), ("removed_blocks_ks", "_removed")):
            d = ks_statistic(r[key], s[key])
            rows.append({"rank": rank, "figure": fig, "real": 0.0, "sim": d, "delta": d})
    return rows


def what_if_table(runs: Sequence[tuple[str, str | Path]], real: str | Path | None = None) -> list:
    """One row per (label, sim bundle); ``real`` adds the recorded hit rate column."""
    rec_hit = rank_figures(real)["all"]["hit_rate"] if real is not None else None
    rows = []
    for label, path in runs:
        from kvcadence.format.bundle import BundleReader

        f = rank_figures(path)
        a = f["all"]
        trailer_stats: dict[str, Any] = {}
        for rec in BundleReader(Path(path)).iter_kinds("trailer"):
            trailer_stats = dict(getattr(rec, "stats", None) or {})
        evictions = (trailer_stats.get("replay") or {}).get("evictions")
        rows.append(
            {
                "route": label,
                "requests": a["requests"],
                "hit_rate": a["hit_rate"],
                "recorded_hit_rate": rec_hit,
                "events_per_request": a["events_per_request"],
                "stored_events_per_request": a["stored_events_per_request"],
                "removed_events_per_request": a["removed_events_per_request"],
                "stored_blocks_per_request": a["stored_blocks_per_request"],
                "removed_blocks_per_request": a["removed_blocks_per_request"],
                "evictions": evictions,
                "per_rank_requests": {k: v["requests"] for k, v in f.items() if k != "all"},
            }
        )
    return rows


def format_rows(rows: list[dict[str, Any]], columns: Sequence[str]) -> str:
    """Plain-text table of ``rows`` (floats with 4 significant decimals)."""

    def cell(v: Any) -> str:
        if v is None:
            return "-"
        if isinstance(v, float):
            return f"{v:.4g}" if abs(v) < 1000 else f"{v:.0f}"
        return str(v)

    table = [[c for c in columns]] + [[cell(r.get(c)) for c in columns] for r in rows]
    widths = [max(len(row[i]) for row in table) for i in range(len(columns))]
    lines = ["  ".join(v.rjust(w) for v, w in zip(row, widths, strict=True)) for row in table]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)
