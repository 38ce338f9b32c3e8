"""Writing a simulation as a sim bundle: the one writer behind single-rank and fleet replays.

A sim bundle has the format of a capture (``Header.source == "sim"``): one ``EventFrame`` per
published batch (the exact payload bytes, ``via`` sim, ``pass_index`` set), the visibility
notes, one ``RequestRecord`` per simulated request, and a trailer whose stats hold the
replay's summary (wall time dropped: the bundle is deterministic).
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path
from typing import Any

from kvcadence import __version__
from kvcadence.format.bundle import BundleWriter
from kvcadence.format.schema import FORMAT_MAJOR, FORMAT_MINOR, VIA_SIM, EndpointInfo, Header
from kvcadence.outguard import refuse_nonempty_dir


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
