"""The metric catalogue: every metric's name, unit and definition (no computation).

``DEFS`` (one bundle, computed by ``kvcadence.analysis.metrics``), ``COMPARE_DEFS`` (one
real-vs-sim pair, computed by ``kvcadence.analysis.compare``: per-request agreement and,
``DISTANCES``, distances between distributions) and ``VISIBILITY_DEFS`` (event visibility,
computed by ``kvcadence.analysis.visibility``); ``CATALOGUES`` groups them as report.json
does. ``docs/metrics.md`` mirrors them and a test checks they agree. ``STATS``/``QUANT``
name the summary statistics of a distribution metric, ``BUCKETS`` the size-histogram buckets.
"""

from __future__ import annotations

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
_def(
    "requests.cache_hit_rate",
    "fraction",
    "Σ cached_tokens / Σ prompt tokens (prompt_tokens, else len(input_ids); format.hitrate)",
)
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


def unit(name: str) -> str:
    """Unit of a metric name (per-rank names are the same names)."""
    return DEFS[name][0] if name in DEFS else ""
