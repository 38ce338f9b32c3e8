"""Every cadence metric of one bundle: the DuckDB SQL computing it.

The catalogue (name -> (unit, definition): ``DEFS``, ``COMPARE_DEFS``, ``VISIBILITY_DEFS``,
``CATALOGUES``) lives in ``kvcadence.analysis.catalogue``; this module re-exports its names
for users of ``kvcadence.analysis.metrics``. ``compute(ingested) returns a ``BundleMetrics`` whose ``metrics`` is
a flat ``{name: value}`` dict over the whole capture (every name is in ``DEFS``), plus per DP
rank figures, size histograms, the events-per-second series, the steady-state window, the
data-quality block, per-request rows (for real-vs-sim diffs) and raw samples for plots.

Definitions follow ``docs/metrics.md`` (conventions): messages de-duplicated by (endpoint,
epoch, seq) at ingest; every event counted, the startup ``AllBlocksCleared`` included;
"per request" = count / number of requests in the bundle; percentiles interpolate linearly
between closest ranks (numpy's default; DuckDB ``quantile_cont``). ``peer_compatible=True``
switches to the closest peer's definitions (late-start scope without seq 0, nearest-rank
percentiles, break-style gaps, any-prompt attribution, warm-up window); the result is
labelled ``variant = "peer-compatible"``.

Why ~800 lines: the computation of every metric family over the same DuckDB connection;
the catalogue is ``analysis.catalogue``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from kvcadence.analysis import attribution as attr
from kvcadence.analysis import pages as kpages
from kvcadence.analysis import sql as ksql
from kvcadence.analysis.cache import Ingested
from kvcadence.analysis.catalogue import (
    BUCKETS,
    CATALOGUES,
    COMPARE_DEFS,
    DEFS,
    DISTANCES,
    HISTOGRAMS,
    QUANT,
    STATS,
    VISIBILITY_DEFS,
    unit,
)
from kvcadence.analysis.ranks import OWN_REQUESTS_SQL, request_totals
from kvcadence.errors import UsageError

__all__ = [
    "BUCKETS",
    "CATALOGUES",
    "COMPARE_DEFS",
    "DEFS",
    "DISTANCES",
    "HISTOGRAMS",
    "QUANT",
    "STATS",
    "VISIBILITY_DEFS",
    "BundleMetrics",
    "compute",
    "parse_window",
    "unit",
]


@dataclass
class BundleMetrics:
    """All numbers of one bundle (see module docstring)."""

    inputs: dict[str, Any]
    variant: str
    metrics: dict[str, Any]
    per_rank: dict[str, dict[str, Any]]
    histograms: dict[str, dict[str, list[Any]]]
    series: dict[str, list[Any]]
    window: dict[str, Any]
    attribution_kinds: dict[str, int]
    per_request: Any  # polars DataFrame
    samples: dict[str, Any] = field(default_factory=dict)  # name -> float64 numpy array

    def quality(self) -> dict[str, Any]:
        return {k: v for k, v in self.metrics.items() if k.startswith("quality.")}


# --------------------------------------------------------------------------------------


def _f(x: Any) -> Any:
    if x is None:
        return None
    if isinstance(x, bool):
        return int(x)
    if isinstance(x, int):
        return x
    try:
        xf = float(x)
    except (TypeError, ValueError):
        return x
    return int(xf) if xf.is_integer() and abs(xf) < 2**53 and not isinstance(x, float) else xf


def _div(a: Any, b: Any) -> float | None:
    if a is None or not b:
        return None
    return float(a) / float(b)


class _Ctx:
    def __init__(self, con: Any, peer: bool) -> None:
        self.con = con
        self.peer = peer

    def one(self, sql: str) -> tuple[Any, ...]:
        return ksql.one(self.con, sql)

    def rows(self, sql: str) -> list[tuple[Any, ...]]:
        return ksql.rows(self.con, sql)

    def dist(self, expr: str, frm: str) -> dict[str, Any]:
        """n/mean/median/p10/p90/p99/min/max of ``expr`` over ``frm`` (a FROM ... WHERE ...)."""
        if self.peer:
            q = [
                f"list_sort(list({expr}))[least(count({expr}) - 1, "
                f"floor({v} * count({expr})))::BIGINT + 1]::DOUBLE"
                for v in QUANT.values()
            ]
            sql = (
                f"SELECT count({expr}), avg({expr})::DOUBLE, {', '.join(q)}, min({expr}), "
                f"max({expr}) {frm}"
            )
        else:
            # one quantile_cont of the list of fractions: one state (a copy of the values and
            # one sort) instead of one per fraction, the same values (0.35 vs 0.75 cpu-s over
            # 6.6M events' n_blocks)
            fr = ", ".join(str(v) for v in QUANT.values())
            q = [f"q[{i + 1}]::DOUBLE" for i in range(len(QUANT))]
            sql = (
                f"SELECT n, mean, {', '.join(q)}, lo, hi FROM (SELECT count({expr}) AS n, "
                f"avg({expr})::DOUBLE AS mean, quantile_cont({expr}, [{fr}]) AS q, "
                f"min({expr}) AS lo, max({expr}) AS hi {frm})"
            )
        row = self.one(sql)
        n, mean, med, p10, p90, p99, lo, hi = row
        if not n:
            return {
                "n": 0,
                "mean": None,
                "median": None,
                "p10": None,
                "p90": None,
                "p99": None,
                "min": None,
                "max": None,
            }
        return {
            "n": int(n),
            "mean": float(mean),
            "median": float(med),
            "p10": float(p10),
            "p90": float(p90),
            "p99": float(p99),
            "min": _f(lo),
            "max": _f(hi),
        }


def _put_dist(out: dict[str, Any], name: str, d: dict[str, Any]) -> None:
    for k, v in d.items():
        out[f"{name}.{k}"] = v


def _core(c: _Ctx, scope: str, req_scope: str, n_requests: int) -> dict[str, Any]:
    """Per-scope message/event metrics; ``scope`` is a SQL predicate on batches/events."""
    m: dict[str, Any] = {}
    (msgs, t_lo, t_hi) = c.one(
        f"SELECT count(*), min(recv_ns), max(recv_ns) FROM batches WHERE {scope}"
    )
    m["messages"] = int(msgs)
    row = c.one(
        "SELECT count(*), count(*) FILTER (kind = 'stored'), count(*) FILTER (kind = 'removed'), "
        "count(*) FILTER (kind = 'cleared'), count(*) FILTER (kind = 'unknown'), "
        "coalesce(sum(n_blocks) FILTER (kind = 'stored'), 0), "
        "coalesce(sum(n_blocks) FILTER (kind = 'removed'), 0), "
        "coalesce(sum(n_tokens) FILTER (kind = 'stored'), 0), "
        "count(*) FILTER (kind = 'stored' AND n_blocks = 1) "
        f"FROM events WHERE {scope}"
    )
    ev, st, rm, cl, un, sblk, rblk, stok, single = (int(x) for x in row)
    m.update(
        events=ev,
        stored_events=st,
        removed_events=rm,
        cleared_events=cl,
        unknown_events=un,
        requests=n_requests,
        stored_events_per_request=_div(st, n_requests),
        removed_events_per_request=_div(rm, n_requests),
    )
    _put_dist(m, "events_per_message", c.dist("n_events", f"FROM batches WHERE {scope}"))
    comp = c.one(
        "SELECT count(*) FILTER (n_cleared = 0 AND n_stored > 0 AND n_removed = 0), "
        "count(*) FILTER (n_cleared = 0 AND n_removed > 0 AND n_stored = 0), "
        "count(*) FILTER (n_cleared = 0 AND n_removed > 0 AND n_stored > 0), "
        f"count(*) FILTER (n_cleared > 0) FROM batches WHERE {scope}"
    )
    for k, v in zip(
        ("stored_only", "removed_only", "removed_and_stored", "cleared"), comp, strict=False
    ):
        m[f"message_composition.{k}"] = int(v)
    _put_dist(
        m,
        "blocks_per_stored_event",
        c.dist("n_blocks", f"FROM events WHERE kind = 'stored' AND {scope}"),
    )
    _put_dist(
        m,
        "blocks_per_removed_event",
        c.dist("n_blocks", f"FROM events WHERE kind = 'removed' AND {scope}"),
    )
    m["share_single_block_stores"] = _div(single, st)
    m["total_stored_blocks"] = sblk
    m["total_removed_blocks"] = rblk
    m["total_stored_tokens"] = stok
    span = (t_hi - t_lo) / 1e9 if msgs else None
    m["span_s"] = span
    m["events_per_second"] = _div(ev, span)
    m["messages_per_second"] = _div(msgs, span)
    m["stored_blocks_per_second"] = _div(sblk, span)
    m["removed_blocks_per_second"] = _div(rblk, span)
    (out_tokens,) = c.one(f"SELECT coalesce(sum(n_output), 0) FROM requests WHERE {req_scope}")
    m["stored_events_per_completion_token"] = _div(st, out_tokens)
    # orphans: the parent's first store in the same (endpoint, epoch) is not earlier in
    # (seq, idx) order (``_first_store`` is built once per bundle by ``_prepare``)
    (orphans,) = c.one(
        "SELECT count(*) FROM (SELECT endpoint, epoch, parent_hash, seq, idx FROM events "
        f"WHERE kind = 'stored' AND parent_hash IS NOT NULL AND {scope}) e "
        "LEFT JOIN _first_store f ON f.endpoint = e.endpoint AND f.epoch = e.epoch "
        "AND f.hash = e.parent_hash "
        f"WHERE f.pos IS NULL OR f.pos >= {_POS.format(t='e')}"
    )
    m["orphan_parent_events"] = int(orphans)
    return m


# (seq, idx) as one orderable number: idx < 2**32 always (an int32 column)
_POS = "({t}.seq::HUGEINT * 4294967296 + {t}.idx)"


def _prepare(c: _Ctx) -> None:
    """Per-bundle helper tables: the first store, per (endpoint, epoch), of every hash that is
    some event's parent (the only hashes the orphan check looks up)."""
    c.con.sql(
        "CREATE OR REPLACE TEMP TABLE _first_store AS "
        f"SELECT s.endpoint, s.epoch, b.hash, min({_POS.format(t='s')}) AS pos "
        "FROM blocks b JOIN events s ON b.event_id = s.event_id "
        "WHERE b.kind = 'stored' AND b.hash IN (SELECT parent_hash FROM events "
        "WHERE kind = 'stored' AND parent_hash IS NOT NULL) GROUP BY s.endpoint, s.epoch, b.hash"
    )


def _histograms(c: _Ctx, scope: str) -> dict[str, dict[str, list[Any]]]:
    cases = " ".join(
        f"WHEN n_blocks >= {lo}"
        + (f" AND n_blocks <= {hi}" if hi is not None else "")
        + f" THEN {i}"
        for i, (_, lo, hi) in enumerate(BUCKETS)
    )
    got = c.rows(
        f"SELECT kind::VARCHAR, CASE {cases} END AS bucket, count(*), sum(n_blocks) FROM events "
        f"WHERE kind IN ('stored', 'removed') AND {scope} GROUP BY ALL"
    )
    counts = {(k, b): (int(n), int(s)) for k, b, n, s in got if b is not None}
    out: dict[str, dict[str, list[Any]]] = {}
    for name, kind in (
        ("blocks_per_stored_event", "stored"),
        ("blocks_per_removed_event", "removed"),
    ):
        cells = [counts.get((kind, i), (0, 0)) for i in range(len(BUCKETS))]
        out[name] = {
            "buckets": [b[0] for b in BUCKETS],
            "events": [n for n, _ in cells],
            "blocks": [s for _, s in cells],
        }
    return out


def _series(c: _Ctx, scope: str, t0: int) -> dict[str, list[Any]]:
    rows = c.rows(
        f"SELECT floor((recv_ns - {t0}) / 1e9)::BIGINT AS s, "
        "count(*) FILTER (kind = 'stored'), count(*) FILTER (kind = 'removed'), "
        "count(*) FILTER (kind = 'cleared'), count(*), "
        "coalesce(sum(n_blocks) FILTER (kind = 'stored'), 0), "
        "coalesce(sum(n_blocks) FILTER (kind = 'removed'), 0) "
        f"FROM events WHERE {scope} GROUP BY s ORDER BY s"
    )
    keys = ("t_s", "stored", "removed", "cleared", "events", "stored_blocks", "removed_blocks")
    out: dict[str, list[Any]] = {k: [] for k in keys}
    for r in rows:
        for k, v in zip(keys, r, strict=False):
            out[k].append(int(v))
    out["unit"] = ["events/s (1 s bins from the first message)"]
    return out


def _requests(c: _Ctx, page_size: int) -> dict[str, Any]:
    m: dict[str, Any] = {}
    _put_dist(m, "requests.prompt_tokens", c.dist("n_input", "FROM requests"))
    _put_dist(m, "requests.output_tokens", c.dist("n_output", "FROM requests"))
    _put_dist(m, "requests.cached_tokens", c.dist("cached_tokens", "FROM requests"))
    tp, to, tc, pages = c.one(
        "SELECT coalesce(sum(n_input), 0), coalesce(sum(n_output), 0), "
        f"coalesce(sum(cached_tokens), 0), avg(n_input // {max(1, page_size)})::DOUBLE "
        "FROM requests"
    )
    m["requests.total_prompt_tokens"] = int(tp)
    m["requests.total_output_tokens"] = int(to)
    m["requests.total_cached_tokens"] = int(tc)
    m["requests.cache_hit_rate"] = request_totals(c.con)[3]
    m["requests.prompt_pages_per_request"] = pages
    # the first removal message at or after send_ns (ASOF) arrived before finish_ns?
    n_req, with_rm = c.one(
        "SELECT count(*), count(*) FILTER (b.t <= r.finish_ns) FROM "
        "(SELECT send_ns, finish_ns FROM requests) r ASOF LEFT JOIN "
        "(SELECT recv_ns AS t FROM batches WHERE n_removed > 0) b ON b.t >= r.send_ns"
    )
    m["requests.share_with_removal_in_flight"] = _div(with_rm, n_req)
    return m


#: events read per batch by ``_resident_rows``
_RESIDENT_ROWS = 1 << 18


def _resident_rows(c: _Ctx) -> Any:
    """The removed events with the blocks resident before each, as a pyarrow table in
    (endpoint, epoch, seq, idx) order (``event_id``, ``n_blocks``, ``resident``, ``recv_ns``,
    ``batch_id``, ``idx``), or None.

    Resident blocks before an event: the running sum of its (endpoint, epoch)'s stored minus
    removed blocks since the stream's last clear, in (seq, idx) order. Ingest writes the
    events in that order within each stream, so the sum is one streamed pass over the file
    (numpy, a batch at a time; three numbers carried per stream) instead of DuckDB's window
    sort of every event (one partition: a single-threaded sort that spilled at 10M events).
    None when some stream's events are not in (seq, idx) order in the file: the caller then
    sorts in SQL (``_removals_sorted``)."""
    import numpy as np
    import pyarrow as pa

    carry: dict[int, tuple[int, int, int]] = {}  # stream -> (last seq, last idx, resident)
    keep = ("event_id", "n_blocks", "recv_ns", "batch_id", "idx")
    parts: dict[str, list[Any]] = {k: [] for k in (*keep, "resident", "stream")}
    reader = c.con.sql(
        "SELECT (endpoint::BIGINT << 32) | (epoch::BIGINT & 4294967295) AS stream, seq, idx, "
        "CASE kind WHEN 'stored' THEN n_blocks WHEN 'removed' THEN -n_blocks ELSE 0 END::BIGINT "
        "AS d, kind = 'cleared' AS clear, kind = 'removed' AS rm, event_id, n_blocks, recv_ns, "
        "batch_id FROM events"
    ).to_arrow_reader(_RESIDENT_ROWS)
    for b in reader:
        if b.num_rows == 0:
            continue
        stream = b.column("stream").to_numpy()
        seq = b.column("seq").to_numpy()
        idx = b.column("idx").to_numpy()
        d = b.column("d").to_numpy()
        clear = b.column("clear").to_numpy(zero_copy_only=False)
        resident = np.empty(len(d), dtype=np.int64)
        one = bool((stream == stream[0]).all())
        for s in [int(stream[0])] if one else np.unique(stream).tolist():
            at: Any = slice(None) if one else np.flatnonzero(stream == s)
            sq, ix, dd, cl = seq[at], idx[at], d[at], clear[at]
            last_seq, last_idx, r0 = carry.get(s, (None, None, 0))
            if last_seq is not None:
                sq, ix = np.r_[last_seq, sq], np.r_[last_idx, ix]
            ds = np.diff(sq)
            if not ((ds > 0) | ((ds == 0) & (np.diff(ix) > 0))).all():
                return None
            if last_seq is not None:
                sq, ix = sq[1:], ix[1:]
            excl = np.cumsum(dd) - dd  # the stream's blocks before each row, this batch
            if cl.any():  # a clear restarts the sum (the clear's own row: 0)
                lc = np.maximum.accumulate(np.where(cl, np.arange(len(dd)), -1))
                got = np.where(lc >= 0, excl - excl[np.maximum(lc, 0)], r0 + excl)
            else:
                got = r0 + excl
            resident[at] = got
            carry[s] = (int(sq[-1]), int(ix[-1]), int(got[-1] + dd[-1]))
        rm = b.column("rm").to_numpy(zero_copy_only=False)
        for k in keep:
            parts[k].append(b.column(k).to_numpy()[rm])
        parts["resident"].append(resident[rm])
        parts["stream"].append(stream[rm])
    if not parts["event_id"]:
        return None  # no events: the SQL path (nothing to sort)
    stream = np.concatenate(parts.pop("stream"))
    cols = {k: np.concatenate(parts.pop(k)) for k in list(parts)}
    if len(stream) and (stream != stream[0]).any():  # streams in (endpoint, epoch) order
        order = np.argsort(stream, kind="stable")
        cols = {k: v[order] for k, v in cols.items()}
    return pa.table(cols)


#: the removal rows of ``_removals`` from ``r`` (the events with their ``resident``): each
#: removal is a flush when its batch clears after it or a flush note is within 1 s
_FLUSH_SQL = """
        SELECT r.event_id, r.n_blocks, r.resident, r.recv_ns,
          (coalesce(c.last_clear > r.idx, false)
           OR coalesce(n.t <= r.recv_ns + 1000000000, false)) AS flush
        FROM (SELECT *, recv_ns - 1000000000 AS lo FROM r WHERE kind = 'removed') r
        LEFT JOIN (SELECT batch_id, max(idx) AS last_clear FROM events
                   WHERE kind = 'cleared' GROUP BY batch_id) c ON c.batch_id = r.batch_id
        -- the first flush note at or after recv_ns - 1 s (ASOF) is within recv_ns + 1 s?
        ASOF LEFT JOIN (SELECT recv_ns AS t FROM notes WHERE kind ILIKE '%flush%') n
          ON n.t >= r.lo
        """


def _removals(c: _Ctx, pool_pages: int | None) -> dict[str, Any]:
    m: dict[str, Any] = {"removal.pool_pages": pool_pages}
    rows = _resident_rows(c)
    if rows is not None:
        c.con.register("_resident_rows", rows)
        try:
            # the removed rows in the window's output order: the same floating-point sums
            # below (HUGEINT: the type of the window's sum)
            c.con.sql(
                "CREATE OR REPLACE TEMP TABLE _removals AS WITH r AS (SELECT event_id, n_blocks, "
                "resident::HUGEINT AS resident, recv_ns, batch_id, idx, 'removed' AS kind "
                "FROM _resident_rows) " + _FLUSH_SQL
            )
        finally:
            c.con.unregister("_resident_rows")
    else:
        _removals_sorted(c)
    fe, fb, ce, cb = c.one(
        "SELECT count(*) FILTER (flush), coalesce(sum(n_blocks) FILTER (flush), 0), "
        "count(*) FILTER (NOT flush), coalesce(sum(n_blocks) FILTER (NOT flush), 0) FROM _removals"
    )
    m.update(
        {
            "removal.flush_events": int(fe),
            "removal.flush_blocks": int(fb),
            "removal.capacity_events": int(ce),
            "removal.capacity_blocks": int(cb),
        }
    )
    _put_dist(
        m,
        "removal.resident_blocks_at_removal",
        c.dist("resident", "FROM _removals WHERE NOT flush"),
    )
    if pool_pages:
        _put_dist(
            m,
            "removal.pool_pressure_at_removal",
            c.dist(f"resident / {float(pool_pages)}", "FROM _removals WHERE NOT flush"),
        )
    else:
        _put_dist(
            m,
            "removal.pool_pressure_at_removal",
            c.dist("NULL::DOUBLE", "FROM _removals WHERE FALSE"),
        )
    return m


def _removals_sorted(c: _Ctx) -> None:
    """``_removals`` by DuckDB's window over the events sorted by (seq, idx) per stream."""
    # resident blocks before each event: the running sum of its (endpoint, epoch) since the
    # last clear. When no clear follows a store or removal of its stream (no clears; the
    # startup clear) that is the running sum of the whole stream: one window pass, not two
    (late_clears,) = c.one(
        "SELECT count(*) FROM (SELECT max(pos) FILTER (kind = 'cleared') AS clear, "
        "min(pos) FILTER (kind IN ('stored', 'removed')) AS change FROM "
        f"(SELECT endpoint, epoch, kind, {_POS.format(t='events')} AS pos FROM events) "
        "GROUP BY endpoint, epoch) WHERE clear > change"
    )
    seg = (
        "0 AS seg"
        if not late_clears
        else "sum(CASE WHEN kind = 'cleared' THEN 1 ELSE 0 END) OVER ("
        "PARTITION BY endpoint, epoch ORDER BY seq, idx ROWS UNBOUNDED PRECEDING) AS seg"
    )
    c.con.sql(
        f"""
        CREATE OR REPLACE TEMP TABLE _removals AS
        WITH o AS (SELECT *, {seg} FROM events),
        r AS (
          SELECT *, coalesce(sum(CASE kind WHEN 'stored' THEN n_blocks
                                        WHEN 'removed' THEN -n_blocks ELSE 0 END) OVER (
              PARTITION BY endpoint, epoch, seg ORDER BY seq, idx
              ROWS BETWEEN UNBOUNDED PRECEDING AND 1 PRECEDING), 0) AS resident
          FROM o)
        {_FLUSH_SQL}"""
    )


def _quality(c: _Ctx, info: dict[str, Any]) -> dict[str, Any]:
    m: dict[str, Any] = {}
    n_gaps, missing, recovered = c.one(
        "SELECT count(*), coalesce(sum(n_missing), 0), coalesce(sum(recovered), 0) FROM gaps"
    )
    (holes,) = c.one(
        "SELECT coalesce(sum(hi - lo + 1 - n), 0) FROM (SELECT max(seq) hi, min(seq) lo, "
        "count(DISTINCT seq) n FROM batches GROUP BY endpoint, epoch)"
    )
    (breaks,) = c.one(
        "SELECT count(*) FROM (SELECT seq, lag(seq) OVER (PARTITION BY endpoint ORDER BY batch_id) "
        "AS prev FROM batches) WHERE prev IS NOT NULL AND seq <> prev + 1"
    )
    (epochs,) = c.one("SELECT count(*) FROM (SELECT DISTINCT endpoint, epoch FROM batches)")
    (epoch_recs,) = c.one("SELECT count(*) FROM epochs")
    # request records kept apart, never merged, but counted: each one counts in per-request
    # metrics (the importers refuse them; an older bundle may hold some)
    (dup_rids,) = c.one("SELECT count(*) - count(DISTINCT rid) FROM requests")
    (first_zero,) = c.one(
        "SELECT coalesce(bool_and(first_seq = 0), false) FROM (SELECT endpoint, min(seq) first_seq "
        "FROM batches WHERE epoch = (SELECT min(epoch) FROM batches b2 WHERE b2.endpoint = "
        "batches.endpoint) GROUP BY endpoint)"
    )
    m["quality.frames"] = int(info.get("frames", 0))
    m["quality.duplicates"] = int(info.get("duplicates", 0))
    m["quality.gap_records"] = int(n_gaps)
    m["quality.missing_seqs"] = int(missing)
    m["quality.recovered"] = int(recovered)
    m["quality.unrecovered"] = int(missing) - int(recovered)
    m["quality.seq_holes"] = int(holes)
    m["quality.gap_breaks"] = int(breaks)
    m["quality.epochs"] = int(epochs)
    m["quality.epoch_records"] = int(epoch_recs)
    m["quality.torn_bytes"] = int(info.get("torn_bytes", 0))
    m["quality.corrupt_frames"] = int(info.get("corrupt_frames", 0))
    m["quality.missing_segments"] = len(info.get("missing_segments") or [])
    m["quality.missing_records"] = int(info.get("missing_records", 0))
    m["quality.duplicate_rids"] = int(dup_rids)
    m["quality.unknown_records"] = int(info.get("unknown_records", 0))
    m["quality.unknown_events"] = int(info.get("unknown_events", 0))
    m["quality.undecodable_payloads"] = int(info.get("undecodable_payloads", 0))
    m["quality.clean_shutdown"] = int(bool(info.get("clean_shutdown")))
    m["quality.first_seq_zero"] = int(bool(first_zero))
    return m


def _attribution(
    c: _Ctx, ing: Ingested, page_size: int, n_out_tokens: int, scope: str
) -> tuple[dict[str, Any], dict[str, int], Any]:
    import polars as pl

    split: dict[str, int] | None = None
    # the peer split ("a page of any prompt") needs every page, the cached ones too
    path = kpages.ensure_file(ing, c.con, page_size, full=c.peer)
    if path is not None:  # out of core: DuckDB joins over the page cache (the usual path)
        a, per, split = attr.attribute_sql(
            c.con, kpages.relation(path), page_size, scope, any_prompt=c.peer
        )
        rids, cached, n_in, n_out = per.rid, per.cached_tokens, per.n_input, per.n_output
    else:  # a read-only cache: the page hashes in memory
        rids, req, events = attr.load_columns(ing, c.con, scope)
        pages = kpages.load(ing, c.con, page_size, full=c.peer)
        a = attr.attribute_arrays(pages, req, events, page_size)
        cached, n_in, n_out = req.cached_tokens, req.n_input, req.n_output
        if c.peer:
            split = attr.any_prompt_split_arrays(pages, req, events)
    m: dict[str, Any] = {
        "attribution.stored_blocks": a.stored_blocks,
        "attribution.matched_blocks": a.matched_blocks,
        "attribution.unmatched_blocks": a.unmatched_blocks,
        "attribution.unmatched_events": a.unmatched_events,
        "attribution.prompt_blocks": a.prompt_blocks,
        "attribution.output_blocks": a.output_blocks,
        "attribution.expected_output_blocks": a.expected_output_blocks,
        "attribution.output_blocks_per_completion_token": _div(a.output_blocks, n_out_tokens),
        "attribution.events_spanning_requests_same_session": a.events_spanning_same_session,
        "attribution.events_spanning_requests_other": a.events_spanning_other,
        "attribution.requests_without_prefill_store": a.requests_without_prefill_store,
    }
    if split is not None:
        m["attribution.prompt_blocks"] = split["prompt_blocks"]
        m["attribution.output_blocks"] = split["output_blocks"]
        m["attribution.output_blocks_per_completion_token"] = _div(
            split["output_blocks"], n_out_tokens
        )
    per_req = pl.DataFrame(
        {
            "rid": rids,
            "cached_tokens": cached,
            "prompt_tokens": n_in,
            "output_tokens": n_out,
            "stored_events": a.req_stored_events,
            "prefill_events": a.req_prefill_events,
            "finish_events": a.req_finish_events,
            "prompt_blocks": a.req_prompt_blocks,
            "output_blocks": a.req_output_blocks,
        },
        schema={
            "rid": pl.String,
            "cached_tokens": pl.Int64,
            "prompt_tokens": pl.Int64,
            "output_tokens": pl.Int64,
            "stored_events": pl.Int64,
            "prefill_events": pl.Int64,
            "finish_events": pl.Int64,
            "prompt_blocks": pl.Int64,
            "output_blocks": pl.Int64,
        },
    )
    dists = (
        ("attribution.stored_events_per_request", "stored_events"),
        ("attribution.prefill_store_events_per_request", "prefill_events"),
        ("attribution.finish_store_events_per_request", "finish_events"),
    )
    # the three count columns only, registered once (not the rids: a copy of every rid
    # string per registration)
    c.con.register("_per_req", per_req.select([col for _, col in dists]).to_arrow())
    try:
        for name, col in dists:
            _put_dist(m, name, c.dist(col, "FROM _per_req"))
    finally:
        c.con.unregister("_per_req")
    return m, dict(sorted(a.event_kinds.items())), per_req


def parse_window(text: str | None) -> tuple[float, float] | None:
    """``START:END`` seconds after the first message (either side may be empty).

    An empty START is 0, an empty END the last message. Values must be finite, START >= 0 and
    START < END; anything else is a UsageError naming ``--window``.
    """
    if text is None:
        return None
    form = f"--window must be START:END in seconds after the first message, got {text!r}"
    lo_s, sep, hi_s = text.partition(":")
    if not sep:
        raise UsageError(form)
    try:
        lo = float(lo_s) if lo_s.strip() else 0.0
        hi = float(hi_s) if hi_s.strip() else None
    except ValueError:
        raise UsageError(form) from None
    if not math.isfinite(lo) or (hi is not None and not math.isfinite(hi)):
        raise UsageError(
            f"--window {text}: START and END must be finite numbers (leave END "
            "empty for 'to the last message')"
        )
    if lo < 0:
        raise UsageError(f"--window {text}: START must be >= 0 (seconds after the first message)")
    if hi is not None and lo >= hi:
        raise UsageError(f"--window {text}: START must be before END")
    return (lo, float("inf") if hi is None else hi)


def _window(c: _Ctx, t0: int, t_end: int, user: tuple[float, float] | None) -> dict[str, Any]:
    if user is not None:
        lo_ns = t0 + int(user[0] * 1e9)
        hi_ns = t_end if user[1] == float("inf") else t0 + int(user[1] * 1e9)
        source = "user"
    else:
        (first_rm,) = c.one("SELECT min(recv_ns) FROM events WHERE kind = 'removed'")
        if first_rm is None:
            lo_ns, hi_ns, source = t0, t_end, "whole capture (no removals)"
        else:
            lo_ns, hi_ns, source = int(first_rm), t_end, "from the first removal"
    scope = f"recv_ns BETWEEN {lo_ns} AND {hi_ns}"
    ev, st, rm = c.one(
        "SELECT count(*), count(*) FILTER (kind = 'stored'), count(*) FILTER (kind = 'removed') "
        f"FROM events WHERE {scope}"
    )
    (nreq,) = c.one(f"SELECT count(*) FROM requests WHERE finish_ns BETWEEN {lo_ns} AND {hi_ns}")
    med_s = c.dist("n_blocks", f"FROM events WHERE kind = 'stored' AND {scope}")["median"]
    med_r = c.dist("n_blocks", f"FROM events WHERE kind = 'removed' AND {scope}")["median"]
    length = (hi_ns - lo_ns) / 1e9
    return {
        "source": source,
        "metrics": {
            "window.start_s": (lo_ns - t0) / 1e9,
            "window.end_s": (hi_ns - t0) / 1e9,
            "window.events": int(ev),
            "window.requests_finished": int(nreq),
            "window.stored_events_per_request": _div(st, nreq),
            "window.removed_events_per_request": _div(rm, nreq),
            "window.median_blocks_per_stored_event": med_s,
            "window.median_blocks_per_removed_event": med_r,
            "window.events_per_second": _div(ev, length),
        },
    }


def compute(
    ing: Ingested,
    *,
    window: tuple[float, float] | None = None,
    peer_compatible: bool = False,
    con: Any = None,
) -> BundleMetrics:
    """Every metric of one ingested bundle."""
    import polars as pl

    # every table a Parquet view: loading batches/events into DuckDB cost ~130 MB at 1M events
    # and measured no faster (bench_memory's report, 2026-12-01)
    con = con if con is not None else ksql.connect(ing)
    c = _Ctx(con, peer_compatible)
    _prepare(c)
    info = ing.info
    page_size = int(info.get("page_size") or 1)
    max_tokens = info.get("max_total_num_tokens")
    pool_pages = int(max_tokens) // page_size if max_tokens else None
    scope = "seq <> 0" if peer_compatible else "TRUE"

    # the capture's own requests: not those a replay rebuilt from the KV events
    (n_requests,) = c.one(f"SELECT count(*) FILTER ({OWN_REQUESTS_SQL}) FROM requests")
    (t0, t_end) = c.one("SELECT min(recv_ns), max(recv_ns) FROM batches")
    t0 = int(t0 or 0)
    t_end = int(t_end or 0)

    metrics: dict[str, Any] = {}
    metrics.update(_quality(c, info))
    core = _core(c, scope, "TRUE", int(n_requests))
    metrics.update(core)
    metrics.update(_requests(c, page_size))
    am, kinds, per_req = _attribution(
        c, ing, page_size, metrics["requests.total_output_tokens"], scope
    )
    metrics.update(am)
    metrics.update(_removals(c, pool_pages))
    user_window = window
    win = _window(c, t0, t_end, user_window)
    metrics.update(win["metrics"])
    if peer_compatible:
        # peer: per request = events after the warm-up cut / requests finished after it
        metrics["stored_events_per_request"] = win["metrics"]["window.stored_events_per_request"]
        metrics["removed_events_per_request"] = win["metrics"]["window.removed_events_per_request"]

    # per DP rank (+ totals are ``metrics``)
    per_rank: dict[str, dict[str, Any]] = {}
    ranks = [int(r) for (r,) in c.rows("SELECT DISTINCT dp_rank FROM batches ORDER BY 1")]
    (req_ranks,) = c.one(
        f"SELECT count(*) FILTER (dp_rank IS NOT NULL AND {OWN_REQUESTS_SQL}) FROM requests"
    )
    for r in ranks:
        if int(req_ranks) == int(n_requests) and n_requests:
            req_scope = f"dp_rank = {r} AND {OWN_REQUESTS_SQL}"
            (nr,) = c.one(f"SELECT count(*) FROM requests WHERE {req_scope}")
        elif len(ranks) == 1:
            nr, req_scope = n_requests, "TRUE"
        else:
            nr, req_scope = 0, "FALSE"
        if len(ranks) == 1 and int(nr) == int(n_requests):
            # the one rank of every batch (events are ranked as their batch) and request:
            # its figures are the whole capture's
            per_rank[str(r)] = dict(core)
        else:
            per_rank[str(r)] = _core(c, f"dp_rank = {r} AND {scope}", req_scope, int(nr))

    samples = {
        "blocks_per_stored_event": _column(
            c, f"SELECT n_blocks::DOUBLE FROM events WHERE kind = 'stored' AND {scope}"
        ),
        "blocks_per_removed_event": _column(
            c, f"SELECT n_blocks::DOUBLE FROM events WHERE kind = 'removed' AND {scope}"
        ),
        "stored_events_per_request": per_req["stored_events"].cast(pl.Float64).to_numpy(),
    }
    metrics = {k: _clean(v) for k, v in metrics.items()}
    missing = [k for k in metrics if k not in DEFS]
    if missing:  # pragma: no cover - guarded by tests
        raise AssertionError(f"metrics without a definition: {missing}")
    inputs = {
        "bundle": str(ing.bundle),
        "source": info.get("source"),
        "sglang_version": info.get("sglang_version"),
        "page_size": page_size,
        "max_total_num_tokens": max_tokens,
        "kv_events_config": info.get("kv_events_config"),
        "dp_ranks": ranks,
    }
    return BundleMetrics(
        inputs=inputs,
        variant="peer-compatible" if peer_compatible else "default",
        metrics=metrics,
        per_rank={r: {k: _clean(v) for k, v in d.items()} for r, d in per_rank.items()},
        histograms=_histograms(c, scope),
        series=_series(c, scope, t0),
        window={"source": win["source"]},
        attribution_kinds=kinds,
        per_request=per_req,
        samples=samples,
    )


def _column(c: _Ctx, sql_text: str) -> Any:
    """The one column of ``sql_text`` as a float64 numpy array (no Python floats)."""

    t = ksql.arrow(c.con, sql_text)
    return t.column(0).to_numpy()


def _clean(v: Any) -> Any:
    if isinstance(v, bool):
        return int(v)
    if hasattr(v, "item"):  # numpy / decimal scalars
        v = v.item()
    if isinstance(v, float) and v != v:  # NaN
        return None
    return v
