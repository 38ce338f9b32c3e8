"""Writing a simulation as a sim bundle: the one writer behind single-rank and fleet replays.

A sim bundle has the format of a capture (``Header.source == "sim"``): one ``EventFrame`` per
published batch (the exact payload bytes, ``via`` sim, ``pass_index`` set), the visibility
notes, one ``RequestRecord`` per simulated request (``sim_request_record``: the one builder
of a sim record, for every replay), and a trailer whose stats hold the replay's summary
(wall time dropped: the bundle is deterministic). ``replaceable(path, inputs)``: whether
an existing output is one a replay wrote (what ``replay --force`` may replace).
"""

from __future__ import annotations

import shutil
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

from kvcadence import __version__
from kvcadence.errors import BundleError, KvcadenceError
from kvcadence.format.bundle import BundleReader, BundleWriter
from kvcadence.format.bundle.segments import SEGMENT_GLOB
from kvcadence.format.schema import (
    FORMAT_MAJOR,
    FORMAT_MINOR,
    VIA_SIM,
    EndpointInfo,
    Header,
    RequestRecord,
)
from kvcadence.format.schema import UNRECORDED_SOURCE as SOURCE
from kvcadence.outguard import _write_failure, refuse_nonempty_dir
from kvcadence.replay.request import ABORTED, SimReq
from kvcadence.replay.simrecords import SimRecords
from kvcadence.replay.tokens import as_list, compact, span


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


class SimBundleOut:
    """A sim bundle written as the replay runs: opened with its header (``open``), one
    frame per published batch as it is published (``frame``: a ``Publisher`` sink), then
    the visibility notes, the records and the trailer (``finish``) -- the bytes
    ``write_sim`` writes from the same content. ``abandon`` (a failed run) closes it and
    removes what it wrote, so a failed replay leaves no partial bundle."""

    def __init__(self, out: str | Path) -> None:
        self.path = Path(out)
        refuse_nonempty_dir(self.path)
        self._existed = self.path.is_dir()
        self._writer: BundleWriter | None = None
        self._topics: dict[int, str] = {}

    @property
    def opened(self) -> bool:
        return self._writer is not None

    def open(self, header: Header) -> None:
        self._topics = {e.id: e.topic for e in header.endpoints}
        self._writer = BundleWriter(self.path, header)

    def frame(self, endpoint: int, b: Any) -> None:
        """Write ``PublishedBatch`` ``b`` as an ``EventFrame`` of ``endpoint``."""
        assert self._writer is not None, "SimBundleOut.open first"
        self._writer.write_event(
            endpoint=endpoint,
            seq=b.seq,
            recv_ns=b.time_ns,
            topic=self._topics[endpoint],
            payload=b.payload,
            via=VIA_SIM,
            epoch=0,
            pass_index=b.pass_index,
        )

    def sink(self, endpoint: int) -> Callable[[Any], None]:
        """A ``Publisher`` sink writing its batches as ``endpoint``'s frames."""
        return lambda b: self.frame(endpoint, b)

    def finish(
        self, notes: Iterable[Any], records: Iterable[Any], summary: dict[str, Any], end_ns: int
    ) -> None:
        """The notes, the records and the trailer (``summary`` without ``wall_s``: the
        bundle is deterministic); closes the bundle (abandoned if that fails)."""
        w = self._writer
        assert w is not None, "SimBundleOut.open first"
        try:
            summary = dict(summary)
            summary.pop("wall_s", None)
            for note in notes:
                w.write(note)
            if isinstance(records, SimRecords):  # ids as arrays: packed without a list
                records = records.arrays()
            for rec in records:
                w.write(rec)
            w.close(stats={"replay": summary}, end_ns=end_ns)
        except BaseException as exc:
            self.abandon(exc)
            raise

    def abandon(self, exc: BaseException) -> None:
        """Close an unfinished bundle after ``exc`` (its error in the trailer stats, as a
        ``BundleWriter`` context does). A failure to write is left to the command's
        ``outguard.removed_on_failure`` (it removes the output and says so); any other
        (the simulation failed) removes what was written here (an empty directory given
        stays)."""
        w, self._writer = self._writer, None
        if w is None or w.closed:
            return
        try:
            w.close(clean=False, stats={"error": f"{type(exc).__name__}: {exc}"})
        except BundleError:
            pass  # keep the original exception
        if not _write_failure(exc):
            shutil.rmtree(self.path, ignore_errors=True)
            if self._existed:
                self.path.mkdir(parents=True, exist_ok=True)


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
    sim = SimBundleOut(out)
    sim.open(header)
    try:
        for endpoint, b in frames:
            sim.frame(endpoint, b)
    except BaseException as exc:
        sim.abandon(exc)
        raise
    sim.finish(notes, records, summary, end_ns)


def sim_request_record(
    r: SimReq,
    anchor_ns: int,
    rank: int | None = None,
    worker: str | None = None,
    *,
    rank_in_meta: bool = False,
    arrays: bool = False,
) -> Any:
    """The sim ``RequestRecord`` of one simulated request (virtual times anchored at
    ``anchor_ns``), served by DP ``rank``. ``rank_in_meta``: also ``meta_info["dp_rank"]``
    (a fleet replay); ``worker``: ``meta_info["worker"]`` (a fleet of several workers);
    ``arrays``: its ids as ``tokens.compact``'s arrays, not lists (for the bundle writer,
    which packs them: ``BundleWriter`` takes either)."""

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
    inp: Any
    out: Any
    if arrays:
        inp, out = span(s.input_ids, 0, len(s.input_ids)), compact(s.output_ids[: r.output_len])
    else:
        inp, out = as_list(s.input_ids), list(s.output_ids[: r.output_len])
    return RequestRecord(
        rid=s.rid,
        input_ids=inp,
        output_ids=out,
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
        source=SOURCE if s.source.source == SOURCE else "sim",
        think_ns=s.gap_ns if s.pred is not None else None,
        arrival_ns=None if s.pred is not None else anchor_ns + (s.arrival_ns or 0),
        meta_info=meta,
    )


def replaceable(path: Path, inputs: Iterable[str | Path]) -> str | None:
    """None when ``path`` (an existing, non-empty directory) is what a replay writes, so
    ``replay --force`` may replace it: a sim bundle (``Header.source == "sim"``), a directory
    of them (a fleet of several workers) or a ``--sweep`` dataset (its ``_sweep.json``); else
    why not. Never one of ``inputs`` (the replay's own), nor a directory holding one."""
    real = path.resolve()
    for src in inputs:
        s = Path(src).resolve()
        if s == real or real in s.parents:
            return "it holds this replay's input"
    if (path / "_sweep.json").is_file():
        return None
    bundles = [path] if any(path.glob(SEGMENT_GLOB)) else sorted(path.iterdir())
    for b in bundles:
        try:
            sim = b.is_dir() and BundleReader(b).header.source == "sim"
        except (KvcadenceError, OSError):
            sim = False
        if not sim:
            shown = "it" if b == path else b.name
            return f"{shown} is not a sim bundle (a capture, or not a bundle)"
    return None
