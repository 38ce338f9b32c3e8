"""Every cadence metric of one bundle: name, unit, definition and the DuckDB SQL computing it.

This module holds every metric catalogue (name -> (unit, definition)): ``DEFS`` (one
bundle), ``COMPARE_DEFS`` (one real-vs-sim pair, computed by ``compare``: per-request
agreement and, ``DISTANCES``, distances between distributions) and
``VISIBILITY_DEFS`` (event visibility, computed by ``visibility``); ``docs/metrics.md``
mirrors them and a test checks they agree. ``compute(ingested)`` returns a ``BundleMetrics`` whose ``metrics`` is
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
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from kvcadence.analysis import attribution as attr
from kvcadence.analysis.ingest import Ingested
from kvcadence.errors import UsageError

STATS: tuple[str, ...] = ("n", "mean", "median", "p10", "p90", "p99", "min", "max")
QUANT = {"median": 0.5, "p10": 0.1, "p90": 0.9, "p99": 0.99}
BUCKETS: tuple[tuple[str, int, int | None], ...] = (
    ("1", 1, 1),
    ("2-8", 2, 8),
    ("9-64", 9, 64),
    ("65-1024", 65, 1024),
    ("1025-8192", 1025, 8192),
    (">8192", 8193, None),
)

DEFS: dict[str, tuple[str, str]] = {}


def _def(name: str, unit: str, definition: str) -> None:
    DEFS[name] = (unit, definition)


def _def_dist(name: str, unit: str, definition: str) -> None:
    for s in STATS:
        u = "count" if s == "n" else unit
        what = {
            "n": "number of samples",
            "mean": "arithmetic mean",
            "median": "50th percentile (linear interpolation)",
            "p10": "10th percentile (linear interpolation)",
            "p90": "90th percentile (linear interpolation)",
            "p99": "99th percentile (linear interpolation)",
            "min": "minimum",
            "max": "maximum",
        }[s]
        _def(f"{name}.{s}", u, f"{what} of {definition}")


# --- messages and events -------------------------------------------------------------
_def("messages", "messages", "distinct (endpoint, epoch, seq) ZMQ messages (batches rows)")
_def("events", "events", "KV events in those messages (every kind)")
_def("stored_events", "events", "BlockStored events")
_def("removed_events", "events", "BlockRemoved events")
_def("cleared_events", "events", "AllBlocksCleared events (the startup clear included)")
_def("unknown_events", "events", "events with an unknown tag")
_def("requests", "requests", "RequestRecords in the bundle")
_def("stored_events_per_request", "events/request", "stored_events / requests")
_def("removed_events_per_request", "events/request", "removed_events / requests")
_def_dist("events_per_message", "events/message", "batches.n_events over messages")
_def("message_composition.stored_only", "messages", "messages with Stored but no Removed/Cleared")
_def("message_composition.removed_only", "messages", "messages with Removed but no Stored/Cleared")
_def(
    "message_composition.removed_and_stored",
    "messages",
    "messages with both Removed and Stored and no Cleared",
)
_def("message_composition.cleared", "messages", "messages containing an AllBlocksCleared")
_def_dist("blocks_per_stored_event", "blocks/event", "len(block_hashes) over BlockStored events")
_def_dist("blocks_per_removed_event", "blocks/event", "len(block_hashes) over BlockRemoved events")
_def(
    "share_single_block_stores",
    "fraction",
    "BlockStored events with exactly 1 block / stored_events",
)
_def("total_stored_blocks", "blocks", "sum of len(block_hashes) over BlockStored events")
_def("total_removed_blocks", "blocks", "sum of len(block_hashes) over BlockRemoved events")
_def("total_stored_tokens", "tokens", "sum of len(token_ids) over BlockStored events")
_def("span_s", "s", "(last recv_ns - first recv_ns) / 1e9 over messages")
_def("events_per_second", "events/s", "events / span_s")
_def("messages_per_second", "messages/s", "messages / span_s")
_def("stored_blocks_per_second", "blocks/s", "total_stored_blocks / span_s")
_def("removed_blocks_per_second", "blocks/s", "total_removed_blocks / span_s")
_def(
    "stored_events_per_completion_token",
    "events/token",
    "stored_events / sum of len(output_ids) over requests",
)
_def(
    "orphan_parent_events",
    "events",
    "BlockStored events whose parent_block_hash is set but was never stored earlier in the same "
    "(endpoint, epoch) (a tell-tale of lost messages or a late start)",
)
# --- requests ------------------------------------------------------------------------
_def_dist("requests.prompt_tokens", "tokens", "len(input_ids) over requests")
_def_dist("requests.output_tokens", "tokens", "len(output_ids) over requests")
_def_dist("requests.cached_tokens", "tokens", "cached_tokens over requests that report it")
_def("requests.total_prompt_tokens", "tokens", "sum of len(input_ids)")
_def("requests.total_output_tokens", "tokens", "sum of len(output_ids)")
_def("requests.total_cached_tokens", "tokens", "sum of cached_tokens")
_def("requests.cache_hit_rate", "fraction", "total_cached_tokens / total_prompt_tokens")
_def(
    "requests.prompt_pages_per_request",
    "pages/request",
    "mean of len(input_ids) // page_size (pages a prefix match looks up)",
)
_def(
    "requests.share_with_removal_in_flight",
    "fraction",
    "requests during whose [send_ns, finish_ns] a message with a BlockRemoved arrived / requests",
)
# --- attribution ---------------------------------------------------------------------
_def("attribution.stored_blocks", "blocks", "stored blocks considered (= total_stored_blocks)")
_def("attribution.matched_blocks", "blocks", "stored blocks matched to a request's page hashes")
_def("attribution.unmatched_blocks", "blocks", "stored blocks matching no request (not guessed)")
_def("attribution.unmatched_events", "events", "BlockStored events with any unmatched block")
_def(
    "attribution.prompt_blocks",
    "blocks",
    "matched blocks at a page index < len(input_ids) // page_size of the storing request",
)
_def("attribution.output_blocks", "blocks", "matched blocks past the storing request's prompt")
_def(
    "attribution.expected_output_blocks",
    "blocks",
    "sum over requests with output of pages(prompt + output - 1) - pages(prompt), pages = "
    "tokens // page_size",
)
_def(
    "attribution.output_blocks_per_completion_token",
    "blocks/token",
    "output_blocks / requests.total_output_tokens",
)
_def(
    "attribution.events_spanning_requests_same_session",
    "events",
    "BlockStored events holding runs of several requests of one (lane, session)",
)
_def(
    "attribution.events_spanning_requests_other",
    "events",
    "BlockStored events holding runs of requests of different sessions",
)
_def(
    "attribution.requests_without_prefill_store",
    "requests",
    "requests none of whose prompt pages appear in a BlockStored event",
)
_def_dist(
    "attribution.stored_events_per_request",
    "events/request",
    "per request, BlockStored events holding at least one of its runs",
)
_def_dist(
    "attribution.prefill_store_events_per_request",
    "events/request",
    "per request, BlockStored events holding a run of its prompt pages",
)
_def_dist(
    "attribution.finish_store_events_per_request",
    "events/request",
    "per request, BlockStored events holding a run of its output pages",
)
# --- removals ------------------------------------------------------------------------
_def("removal.pool_pages", "pages", "header max_total_num_tokens // page_size (null if unknown)")
_def(
    "removal.flush_events",
    "events",
    "BlockRemoved events followed by an AllBlocksCleared in the same message, or within 1 s of "
    "a 'flush' annotation",
)
_def("removal.capacity_events", "events", "all other BlockRemoved events (capacity eviction)")
_def("removal.flush_blocks", "blocks", "blocks of flush removals")
_def("removal.capacity_blocks", "blocks", "blocks of capacity removals")
_def_dist(
    "removal.resident_blocks_at_removal",
    "blocks",
    "resident blocks just before each capacity removal (stored - removed blocks since the last "
    "clear of the endpoint/epoch, in seq order)",
)
_def_dist(
    "removal.pool_pressure_at_removal",
    "fraction",
    "resident_blocks_at_removal / removal.pool_pages",
)
# --- window --------------------------------------------------------------------------
_def("window.start_s", "s", "window start, seconds after the first message")
_def("window.end_s", "s", "window end, seconds after the first message")
_def("window.events", "events", "events of messages received inside the window")
_def("window.requests_finished", "requests", "requests with finish_ns inside the window")
_def(
    "window.stored_events_per_request",
    "events/request",
    "BlockStored events in the window / window.requests_finished",
)
_def(
    "window.removed_events_per_request",
    "events/request",
    "BlockRemoved events in the window / window.requests_finished",
)
_def("window.median_blocks_per_stored_event", "blocks/event", "median over window stores")
_def("window.median_blocks_per_removed_event", "blocks/event", "median over window removals")
_def("window.events_per_second", "events/s", "window.events / window length")
# --- data quality --------------------------------------------------------------------
_def("quality.frames", "frames", "EventFrames read (duplicates included)")
_def("quality.duplicates", "frames", "EventFrames dropped as duplicate (endpoint, epoch, seq)")
_def("quality.gap_records", "gaps", "Gap records written by the recorder")
_def("quality.missing_seqs", "messages", "seqs covered by Gap records")
_def("quality.recovered", "messages", "seqs of those gaps fetched through replay")
_def("quality.unrecovered", "messages", "missing_seqs - recovered")
_def(
    "quality.seq_holes",
    "messages",
    "per (endpoint, epoch): last seq - first seq + 1 - distinct seqs seen, summed",
)
_def(
    "quality.gap_breaks",
    "breaks",
    "per endpoint, places in arrival order where seq != previous seq + 1 (peer-style count)",
)
_def("quality.epochs", "epochs", "distinct (endpoint, epoch) pairs among messages")
_def("quality.epoch_records", "epochs", "Epoch records (publisher restarts seen)")
_def("quality.torn_bytes", "bytes", "bytes dropped from torn segment tails")
_def("quality.corrupt_frames", "frames", "frames that failed their length/CRC check")
_def(
    "quality.missing_segments",
    "segments",
    "segments lost: holes in the numbering, empty/non-file middle segments, refused headers",
)
_def(
    "quality.missing_records",
    "records",
    "records the writer sessions' Trailers count that were not read",
)
_def("quality.unknown_records", "records", "bundle records with an unknown tag")
_def(
    "quality.duplicate_rids",
    "requests",
    "request records whose rid an earlier record has (kept, and counted per request)",
)
_def("quality.unknown_events", "events", "KV events with an unknown tag")
_def("quality.undecodable_payloads", "messages", "payloads wire.decode_batch rejected")
_def("quality.clean_shutdown", "bool", "1 if the last writer session wrote a clean Trailer")
_def("quality.first_seq_zero", "bool", "1 if every endpoint's first epoch starts at seq 0")


# --- real vs sim: one value per (real, sim) pair, computed by kvcadence.analysis.compare ---
COMPARE_DEFS: dict[str, tuple[str, str]] = {
    "requests.matched": ("requests", "rids present in both bundles"),
    "requests.only_real": ("requests", "rids only in the real bundle"),
    "requests.only_sim": ("requests", "rids only in the sim bundle"),
    "requests.cached_tokens_equal_share": (
        "fraction",
        "matched requests with equal cached_tokens / matched requests",
    ),
    "requests.stored_events_equal_share": (
        "fraction",
        "matched requests with the same attributed stored-event count / matched requests",
    ),
    "requests.cached_tokens_mean_abs_diff": (
        "tokens",
        "mean |cached_tokens(sim) - cached_tokens(real)| over matched requests",
    ),
    "blocks_per_stored_event.ks": (
        "fraction",
        "two-sample Kolmogorov-Smirnov statistic of len(block_hashes) over BlockStored events, "
        "real vs sim: max over x of |F_real(x) - F_sim(x)| (empirical CDFs)",
    ),
    "blocks_per_removed_event.ks": (
        "fraction",
        "two-sample Kolmogorov-Smirnov statistic of len(block_hashes) over BlockRemoved events, "
        "real vs sim: max over x of |F_real(x) - F_sim(x)| (empirical CDFs)",
    ),
}
#: the ``COMPARE_DEFS`` names that compare two distributions (report.json
#: ``comparisons[].distributions``); the others compare requests (``comparisons[].requests``)
DISTANCES: tuple[str, ...] = ("blocks_per_stored_event.ks", "blocks_per_removed_event.ks")

# --- event visibility (report.json ``visibility``), computed by analysis.visibility -------
# Distributions (``n, mean, p50, p90, p99, max``; numpy's linear percentiles) and counts.
VISIBILITY_DEFS: dict[str, tuple[str, str]] = {
    "blocks.n": ("blocks", "stored blocks with a per-block visibility note (sim bundles)"),
    "blocks.passes": ("scheduler passes", "publish pass - computing pass, per block"),
    "blocks.seconds": ("virtual s", "publish time - end of the computing pass, per block"),
    "blocks.prefill.passes": (
        "scheduler passes",
        "blocks.passes of blocks computed by a prefill pass",
    ),
    "blocks.prefill.seconds": ("virtual s", "blocks.seconds of blocks computed by a prefill pass"),
    "blocks.decode.passes": (
        "scheduler passes",
        "blocks.passes of blocks computed by a decode pass",
    ),
    "blocks.decode.seconds": ("virtual s", "blocks.seconds of blocks computed by a decode pass"),
    "blocks.by_reason": (
        "blocks",
        "blocks per publish reason (prefill result, decode interval, idle, command, ...)",
    ),
    "blocks.note_mismatches": (
        "frames",
        "frames whose visibility note does not match their stored blocks",
    ),
    "requests.prompt_delay_s": (
        "s",
        "recv_ns of the first message storing the request's deepest new prompt page - "
        "prefill_finished_time",
    ),
    "requests.finish_delay_s": (
        "s",
        "recv_ns of the first message storing the request's deepest output page - "
        "request_finished_ts",
    ),
    "requests.prompt_matched": ("requests", "requests whose prompt store was found"),
    "requests.prompt_unmatched": ("requests", "requests with new prompt pages but no store found"),
    "requests.finish_matched": ("requests", "requests whose output store was found"),
    "requests.finish_unmatched": ("requests", "requests with output pages but no store found"),
}

#: every catalogue, by the report.json part its names appear in (docs/metrics.md lists all)
CATALOGUES: dict[str, dict[str, tuple[str, str]]] = {
    "metrics": DEFS,
    "comparisons.requests": {k: v for k, v in COMPARE_DEFS.items() if k not in DISTANCES},
    "comparisons.distributions": {k: COMPARE_DEFS[k] for k in DISTANCES},
    "visibility": VISIBILITY_DEFS,
}

HISTOGRAMS = ("blocks_per_stored_event", "blocks_per_removed_event")


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


def unit(name: str) -> str:
    """Unit of a metric name (per-rank names are the same names)."""
    return DEFS[name][0] if name in DEFS else ""


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
        from kvcadence.analysis import sql as ksql

        return ksql.one(self.con, sql)

    def rows(self, sql: str) -> list[tuple[Any, ...]]:
        from kvcadence.analysis import sql as ksql

        return ksql.rows(self.con, sql)

    def dist(self, expr: str, frm: str) -> dict[str, Any]:
        """n/mean/median/p10/p90/p99/min/max of ``expr`` over ``frm`` (a FROM ... WHERE ...)."""
        if self.peer:
            q = [
                f"list_sort(list({expr}))[least(count({expr}) - 1, "
                f"floor({v} * count({expr})))::BIGINT + 1]::DOUBLE"
                for v in QUANT.values()
            ]
        else:
            q = [f"quantile_cont({expr}, {v})::DOUBLE" for v in QUANT.values()]
        sql = (
            f"SELECT count({expr}), avg({expr})::DOUBLE, {', '.join(q)}, min({expr}), "
            f"max({expr}) {frm}"
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
    m["requests.cache_hit_rate"] = _div(tc, tp)
    m["requests.prompt_pages_per_request"] = pages
    # the first removal message at or after send_ns (ASOF) arrived before finish_ns?
    n_req, with_rm = c.one(
        "SELECT count(*), count(*) FILTER (b.t <= r.finish_ns) FROM "
        "(SELECT send_ns, finish_ns FROM requests) r ASOF LEFT JOIN "
        "(SELECT recv_ns AS t FROM batches WHERE n_removed > 0) b ON b.t >= r.send_ns"
    )
    m["requests.share_with_removal_in_flight"] = _div(with_rm, n_req)
    return m


def _removals(c: _Ctx, pool_pages: int | None) -> dict[str, Any]:
    m: dict[str, Any] = {"removal.pool_pages": pool_pages}
    c.con.sql(
        """
        CREATE OR REPLACE TEMP TABLE _removals AS
        WITH o AS (
          SELECT *, sum(CASE WHEN kind = 'cleared' THEN 1 ELSE 0 END) OVER (
              PARTITION BY endpoint, epoch ORDER BY seq, idx ROWS UNBOUNDED PRECEDING) AS seg
          FROM events),
        r AS (
          SELECT *, coalesce(sum(CASE kind WHEN 'stored' THEN n_blocks
                                        WHEN 'removed' THEN -n_blocks ELSE 0 END) OVER (
              PARTITION BY endpoint, epoch, seg ORDER BY seq, idx
              ROWS BETWEEN UNBOUNDED PRECEDING AND 1 PRECEDING), 0) AS resident
          FROM o)
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
    )
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

    from kvcadence.analysis import pages as kpages

    rids, req, events = attr.load_columns(ing, c.con, scope)
    pages = kpages.load(ing, c.con, page_size)
    a = attr.attribute_arrays(pages, req, events, page_size)
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
    if c.peer:
        split = attr.any_prompt_split_arrays(pages, req, events)
        m["attribution.prompt_blocks"] = split["prompt_blocks"]
        m["attribution.output_blocks"] = split["output_blocks"]
        m["attribution.output_blocks_per_completion_token"] = _div(
            split["output_blocks"], n_out_tokens
        )
    per_req = pl.DataFrame(
        {
            "rid": rids,
            "cached_tokens": req.cached_tokens,
            "prompt_tokens": req.n_input,
            "output_tokens": req.n_output,
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
    for name, col in (
        ("attribution.stored_events_per_request", "stored_events"),
        ("attribution.prefill_store_events_per_request", "prefill_events"),
        ("attribution.finish_store_events_per_request", "finish_events"),
    ):
        c.con.register("_per_req", per_req.to_arrow())
        _put_dist(m, name, c.dist(col, "FROM _per_req"))
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

    from kvcadence.analysis import sql

    con = con if con is not None else sql.connect(ing, materialize=("batches", "events"))
    c = _Ctx(con, peer_compatible)
    _prepare(c)
    info = ing.info
    page_size = int(info.get("page_size") or 1)
    max_tokens = info.get("max_total_num_tokens")
    pool_pages = int(max_tokens) // page_size if max_tokens else None
    scope = "seq <> 0" if peer_compatible else "TRUE"

    (n_requests,) = c.one("SELECT count(*) FROM requests")
    (t0, t_end) = c.one("SELECT min(recv_ns), max(recv_ns) FROM batches")
    t0 = int(t0 or 0)
    t_end = int(t_end or 0)

    metrics: dict[str, Any] = {}
    metrics.update(_quality(c, info))
    metrics.update(_core(c, scope, "TRUE", int(n_requests)))
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
    (req_ranks,) = c.one("SELECT count(*) FILTER (dp_rank IS NOT NULL) FROM requests")
    for r in ranks:
        if int(req_ranks) == int(n_requests) and n_requests:
            (nr,) = c.one(f"SELECT count(*) FROM requests WHERE dp_rank = {r}")
            req_scope = f"dp_rank = {r}"
        elif len(ranks) == 1:
            nr, req_scope = n_requests, "TRUE"
        else:
            nr, req_scope = 0, "FALSE"
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
    from kvcadence.analysis import sql

    t = sql.arrow(c.con, sql_text)
    return t.column(0).to_numpy()


def _clean(v: Any) -> Any:
    if isinstance(v, bool):
        return int(v)
    if hasattr(v, "item"):  # numpy / decimal scalars
        v = v.item()
    if isinstance(v, float) and v != v:  # NaN
        return None
    return v
