"""Writing a simulation as a sim bundle: the one writer behind single-rank and fleet replays.

A sim bundle has the format of a capture (``Header.source == "sim"``): one ``EventFrame`` per
published batch (the exact payload bytes, ``via`` sim, ``pass_index`` set), the visibility
notes, one ``RequestRecord`` per simulated request (``sim_request_record``: the one builder
of a sim record, for every replay), and a trailer whose stats hold the replay's summary
(wall time dropped: the bundle is deterministic).
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path
from typing import Any

from kvcadence import __version__
from kvcadence.format.bundle import BundleWriter
from kvcadence.format.schema import (
    FORMAT_MAJOR,
    FORMAT_MINOR,
    VIA_SIM,
    EndpointInfo,
    Header,
    RequestRecord,
)
from kvcadence.outguard import refuse_nonempty_dir
from kvcadence.replay.request import ABORTED, SimReq
from kvcadence.replay.tokens import as_list


def sim_header(
    source_header: Any,
    *,
    sglang_version: str,
    command: list[str],
    start_ns: int,
    endpoints: list[EndpointInfo],
    sim_config: dict[str, Any],
) -> Header:
    """The header of a sim bundle replayed from a bundle with ``source_header``."""
    return Header(
        format_major=FORMAT_MAJOR,
        format_minor=FORMAT_MINOR,
        source="sim",
        kvcadence_version=__version__,
        sglang_version=sglang_version,
        server_info=dict(getattr(source_header, "server_info", {}) or {}),
        kv_events_config=getattr(source_header, "kv_events_config", None),
        command=command,
        start_ns=start_ns,
        endpoints=endpoints,
        sim_config=sim_config,
    )


def write_sim(
    out: str | Path,
    header: Header,
    frames: Iterable[tuple[int, Any]],
    notes: Iterable[Any],
    records: Iterable[Any],
    summary: dict[str, Any],
    end_ns: int,
) -> None:
    """Write a sim bundle at ``out`` (must not exist or be empty): ``frames`` are
    ``(endpoint, PublishedBatch)`` in publish order, then the notes and the records."""
    out_path = Path(out)
    refuse_nonempty_dir(out_path)
    summary = dict(summary)
    summary.pop("wall_s", None)  # keep the bundle deterministic
    topics = {e.id: e.topic for e in header.endpoints}
    with BundleWriter(out_path, header) as w:
        for endpoint, b in frames:
            w.write_event(
                endpoint=endpoint,
                seq=b.seq,
                recv_ns=b.time_ns,
                topic=topics[endpoint],
                payload=b.payload,
                via=VIA_SIM,
                epoch=0,
                pass_index=b.pass_index,
            )
        for note in notes:
            w.write(note)
        for rec in records:
            w.write(rec)
        w.close(stats={"replay": summary}, end_ns=end_ns)


def sim_request_record(
    r: SimReq,
    anchor_ns: int,
    rank: int | None = None,
    worker: str | None = None,
    *,
    rank_in_meta: bool = False,
) -> Any:
    """The sim ``RequestRecord`` of one simulated request (virtual times anchored at
    ``anchor_ns``), served by DP ``rank``. ``rank_in_meta``: also ``meta_info["dp_rank"]``
    (a fleet replay); ``worker``: ``meta_info["worker"]`` (a fleet of several workers)."""

    s = r.spec
    arr, entry, first, fin = r.arrival_ns, r.entry_ns, r.first_token_ns, r.finish_ns
    meta: dict[str, Any] = {
        "prompt_tokens": r.input_len,
        "completion_tokens": r.output_len,
        "cached_tokens": r.cached_tokens,
        "num_retractions": r.retractions,
        "request_received_ts": None if arr is None else (anchor_ns + arr) / 1e9,
        "forward_entry_time": None if entry is None else (anchor_ns + entry) / 1e9,
        "prefill_finished_time": None if first is None else (anchor_ns + first) / 1e9,
        "request_finished_ts": None if fin is None else (anchor_ns + fin) / 1e9,
    }
    if rank_in_meta:
        meta["dp_rank"] = rank
    if worker is not None:
        meta["worker"] = worker
    return RequestRecord(
        rid=s.rid,
        input_ids=as_list(s.input_ids),
        output_ids=list(s.output_ids[: r.output_len]),
        send_ns=anchor_ns + r.arrival_ns,
        first_token_ns=None if r.first_token_ns is None else anchor_ns + r.first_token_ns,
        finish_ns=None if r.finish_ns is None else anchor_ns + r.finish_ns,
        lane=s.lane,
        session=s.session,
        turn=s.turn,
        max_new_tokens=s.max_new_tokens,
        prompt_tokens=r.input_len,
        cached_tokens=r.cached_tokens if r.prefilled_once else None,
        completion_tokens=r.output_len,
        finish_reason="abort" if r.state == ABORTED else "length",
        error=r.error,
        dp_rank=rank,
        source="sim",
        think_ns=s.gap_ns if s.pred is not None else None,
        arrival_ns=None if s.pred is not None else anchor_ns + (s.arrival_ns or 0),
        meta_info=meta,
    )
