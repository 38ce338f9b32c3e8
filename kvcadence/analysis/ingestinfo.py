"""What ``Ingested.info`` says besides the tables: the bundle header's facts
(``header_info``) and the read's counters and damage report (``read_info``).
"""

from __future__ import annotations

from typing import Any


def _int_or_none(v: Any) -> int | None:
    """A /server_info count as an int; None for anything that is not one (a damaged or
    hostile snapshot must not stop the tables from being built)."""
    if isinstance(v, bool) or not isinstance(v, (int, float, str)):
        return None
    try:
        return int(v)
    except (ValueError, OverflowError):
        return None


def header_info(header: Any) -> dict[str, Any]:
    """The header facts of ``Ingested.info`` (source, versions, page size, endpoints ...)."""
    si = dict(header.server_info or {})
    sim = header.sim_config or {}
    page_size = si.get("page_size", sim.get("page_size"))
    max_tokens = si.get("max_total_num_tokens", sim.get("max_total_num_tokens"))
    return {
        "source": header.source,
        "sglang_version": header.sglang_version or si.get("version"),
        "kvcadence_version": header.kvcadence_version,
        "format": [header.format_major, header.format_minor],
        "page_size": _int_or_none(page_size),
        "max_total_num_tokens": _int_or_none(max_tokens),
        "kv_events_config": header.kv_events_config,
        "start_ns": header.start_ns,
        "endpoints": [
            {"id": e.id, "url": e.url, "dp_rank": e.dp_rank, "topic": e.topic}
            for e in header.endpoints
        ],
        "server_info": si,
    }


def read_info(
    rep: Any, counts: Any, duplicates: int, undecodable: int, trailer: Any
) -> dict[str, Any]:
    """The ingest counters and the reader's report, for ``Ingested.info``; ``counts``: the
    record loop's totals (``batches``, ``unknown_events``, ``payload_bytes``)."""
    corrupt = list(getattr(rep, "corrupt", []) or [])
    return {
        "frames": counts.batches + duplicates,
        "messages": counts.batches,
        "duplicates": duplicates,
        "undecodable_payloads": undecodable,
        "unknown_events": counts.unknown_events,
        "payload_bytes": counts.payload_bytes,
        "torn_bytes": int(getattr(rep, "torn_bytes", 0) or 0),
        "corrupt_frames": len(corrupt),
        "corrupt": [list(c) if isinstance(c, (tuple, list)) else str(c) for c in corrupt],
        "unknown_records": _count(getattr(rep, "unknown_records", 0)),
        # lost segments (numbering holes, refused segment headers) and records a trailer
        # counts that were not read (docs/format.md section 4)
        "missing_segments": [
            list(m)
            for m in [
                *getattr(rep, "missing_segments", []),
                *getattr(rep, "refused_segments", []),
            ]
        ],
        "missing_records": _count(getattr(rep, "missing_records", 0)),
        "trailer": None
        if trailer is None
        else {
            "clean": bool(trailer.clean),
            "end_ns": trailer.end_ns,
            "counts": dict(trailer.counts),
        },
        "clean_shutdown": bool(getattr(rep, "clean_shutdown", False))
        if hasattr(rep, "clean_shutdown")
        else (bool(trailer.clean) if trailer is not None else False),
    }


def _count(x: Any) -> int:
    if isinstance(x, int):
        return x
    try:
        return len(x)
    except TypeError:
        return 0


__all__ = ["header_info", "read_info"]
