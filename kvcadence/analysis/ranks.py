"""Per-rank figures, real-vs-sim per rank, and the routing what-if table.

What this file owns (DuckDB over a bundle's Parquet tables, ``analysis.cache``):

* ``rank_figures(bundle)`` -- per DP rank (``batches.dp_rank``; requests by ``dp_rank``,
  else ``meta_info.dp_rank``, else rank 0) and in total: requests, messages, Stored/Removed
  events per request, blocks per Stored/Removed event (median, mean), stored/removed
  blocks, cache hit rate (``request_totals``: the one formula of ``format.hitrate``), the
  set of stored block hashes and each request's ``cached_tokens``. Messages are
  de-duplicated by (endpoint, epoch, seq) at ingest; the startup ``AllBlocksCleared``
  counts as an event, as everywhere in the project;
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
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from kvcadence.analysis import sql as ksql
from kvcadence.analysis.cache import Ingested, ingest
from kvcadence.analysis.distance import ks_statistic
from kvcadence.errors import InputError, UsageError
from kvcadence.format.bundle import BundleReader
from kvcadence.format.hitrate import CACHED_SQL, PROMPT_SQL, hit_rate
from kvcadence.format.schema import UNRECORDED_SOURCE

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


def rank_figures(source: str | Path | Ingested, con: Any = None) -> dict[str, dict[str, Any]]:
    """``{"0": {...}, "1": {...}, "all": {...}}`` for one bundle (see module docstring).

    ``source`` is an ingested bundle or a bundle directory (ingested first: its Parquet cache
    next to it, or a temporary one where the bundle's directory is read-only); ``con`` an
    open DuckDB connection over its tables (``sql.connect``), to reuse one.
    """
    if isinstance(source, Ingested):
        return _rank_figures(source, con)
    try:
        return _rank_figures(ingest(source), con)
    except UsageError:
        if not Path(source).is_dir():
            raise
        with tempfile.TemporaryDirectory(prefix="kvcadence-ranks-") as tmp:
            return _rank_figures(ingest(source, Path(tmp) / "pq"), con)


def request_totals(con: Any, where: str = "TRUE") -> tuple[int, int, int, float | None]:
    """(requests, prompt tokens, cached tokens, hit rate) of the ``requests`` rows matching
    ``where`` (SQL): the one place analysis computes a hit rate (``format.hitrate``)."""
    n, prompt, cached = ksql.one(
        con,
        f"SELECT count(*), coalesce(sum({PROMPT_SQL}), 0), coalesce(sum({CACHED_SQL}), 0) "
        f"FROM requests WHERE {where}",
    )
    return int(n), int(prompt), int(cached), hit_rate(int(cached), int(prompt))


#: the requests of the capture itself: not those a replay rebuilt from the KV events
#: (``replay.unrecorded``), which the real side's records lack
OWN_REQUESTS_SQL = f"source IS DISTINCT FROM '{UNRECORDED_SOURCE}'"

#: the DP rank that served a request (``format.schema.served_rank`` over the table)
REQUEST_RANK_SQL = "coalesce(dp_rank, TRY_CAST(json_extract(meta_info, '$.dp_rank') AS BIGINT), 0)"


#: requests whose recorded ``meta_info.dp_rank`` is not a non-negative integer
_BAD_RANK_SQL = (
    "SELECT rid, json_extract(meta_info, '$.dp_rank')::VARCHAR FROM requests "
    "WHERE dp_rank IS NULL AND json_extract(meta_info, '$.dp_rank') IS NOT NULL "
    "AND json_type(json_extract(meta_info, '$.dp_rank')) <> 'NULL' "
    "AND (json_type(json_extract(meta_info, '$.dp_rank')) NOT IN ('BIGINT', 'UBIGINT') "
    "OR TRY_CAST(json_extract(meta_info, '$.dp_rank') AS BIGINT) < 0) LIMIT 1"
)


def check_request_ranks(con: Any) -> None:
    """``InputError`` naming the first request whose ``meta_info.dp_rank`` is not a
    non-negative integer (``served_rank``'s rule: a bad rank is never read as rank 0)."""
    bad = ksql.rows(con, _BAD_RANK_SQL)
    if bad:
        rid, value = bad[0]
        raise InputError(f"request {rid!r}: dp_rank {value} is not a non-negative integer")


def _rank_figures(ing: Ingested, con: Any) -> dict[str, dict[str, Any]]:
    con = con if con is not None else ksql.connect(ing)
    check_request_ranks(con)
    ranks = sorted(
        {int(r) for (r,) in ksql.rows(con, "SELECT DISTINCT dp_rank FROM batches")}
        | {int(r) for (r,) in ksql.rows(con, f"SELECT DISTINCT {REQUEST_RANK_SQL} FROM requests")}
    )
    out: dict[str, dict[str, Any]] = {}
    total: dict[str, Any] = {
        "messages": 0,
        "stored": [],
        "removed": [],
        "cleared": 0,
        "hashes": set(),
        "requests": [0, 0, 0],
        "cached": {},
    }
    for rank in ranks:
        (msgs,) = ksql.one(con, f"SELECT count(*) FROM batches WHERE dp_rank = {rank}")
        sizes: dict[str, list[int]] = {"stored": [], "removed": []}
        cleared = 0
        for kind, n_blocks in ksql.rows(
            con,
            f"SELECT kind::VARCHAR, n_blocks FROM events WHERE dp_rank = {rank} ORDER BY event_id",
        ):
            if kind in sizes:
                sizes[kind].append(int(n_blocks))
            elif kind == "cleared":
                cleared += 1
        hashes = set(
            ksql.arrow(
                con,
                "SELECT DISTINCT b.hash FROM blocks b JOIN events e USING (event_id) "
                f"WHERE b.kind = 'stored' AND e.dp_rank = {rank}",
            )
            .column(0)
            .to_pylist()
        )
        # the capture's own requests: not those a replay rebuilt from the KV events
        where = f"{REQUEST_RANK_SQL} = {rank} AND {OWN_REQUESTS_SQL}"
        n, prompt, cached, _ = request_totals(con, where)
        per_req = dict(
            ksql.rows(
                con, f"SELECT rid, cached_tokens FROM requests WHERE {where} ORDER BY request_id"
            )
        )
        a: dict[str, Any] = {
            "messages": int(msgs),
            "stored": sizes["stored"],
            "removed": sizes["removed"],
            "cleared": cleared,
            "hashes": hashes,
            "requests": [n, prompt, cached],
            "cached": per_req,
        }
        out[str(rank)] = _figures(a)
        total["messages"] += a["messages"]
        total["stored"] += a["stored"]
        total["removed"] += a["removed"]
        total["cleared"] += a["cleared"]
        total["hashes"] |= {(rank, h) for h in hashes}
        total["requests"] = [x + y for x, y in zip(total["requests"], a["requests"], strict=True)]
        total["cached"].update(per_req)
    out["all"] = _figures(total)
    return out


def _figures(a: dict[str, Any]) -> dict[str, Any]:
    n, prompt, cached = a["requests"]
    d = max(n, 1)
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
        "hit_rate": hit_rate(cached, prompt),
        "_hashes": a["hashes"],
        "_cached": a["cached"],
        "_stored": list(stored),
        "_removed": list(removed),
    }


def _delta(real: Any, sim: Any) -> float | None:
    if real is None or sim is None:
        return None
    if real == 0:
        return 0.0 if sim == 0 else None
    return float((sim - real) / real)


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


def what_if_table(
    runs: Sequence[tuple[str, str | Path]], real: str | Path | None = None
) -> list[dict[str, Any]]:
    """One row per (label, sim bundle); ``real`` adds the recorded hit rate column."""
    rec_hit = rank_figures(real)["all"]["hit_rate"] if real is not None else None
    rows = []
    for label, path in runs:
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
