"""The record loop: one pass over a bundle's records into chunks of columns, handed to a sink
as they fill (``write_tables``: Parquet row groups written while the bundle is read, memory
bounded by a chunk; ``build_tables``: the same tables in memory).

Reads a bundle through ``kvcadence.format.bundle.BundleReader`` (requests as
``RequestRecordView``: token ids left as msgpack bytes, or, packed in format 2.0, as
``RequestRecordU32View``: the reader's ``array('I')``; converted to int64 columns in numpy
chunks by ``kvcadence.analysis.tokcols``), decodes each KV-event payload once with
``kvcadence.format.wire.decode_batch_raw`` (its typed fast path alone,
``decode_batch_raw_fast``, tried first: the same batch for the common payload without the
full call; block hashes and token ids left as msgpack bytes,
unchecked: hashes converted and token ids checked and counted in numpy chunks too; if any of
those bytes does not check out, the bundle is read again with ``decode_batch_raw(checked=True)``: ``decode_batch_view``'s verdicts), and
flattens everything straight into ``array``/list columns (never keeping the decoded structs,
cyclic GC paused: keeping hundreds of thousands of decoded structs with lists makes CPython's
cyclic GC cut throughput 3-4x, docs/format.md). The loop stays one function on purpose: per
event it only appends, and a helper call per event or message would cost more than the
appends. ``kvcadence.analysis.columns`` turns each chunk's columns into pyarrow tables
(numpy), ``kvcadence.analysis.sinks`` takes them; messages are de-duplicated by
``kvcadence.analysis.seqset`` (runs of seqs, not a set of every message).

Why one module past 500 lines: the loop and the three chunk holders it feeds (events,
notes, requests: each written when its rows, ids or payload bytes reach a bound, so the
peak is a chunk's, not the capture's) share its counters and its one pass; split, each
would take the loop's state as arguments.
"""

from __future__ import annotations

from array import array
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import msgspec

from kvcadence.analysis.columns import (
    EventColumns,
    RequestColumns,
    as_numpy,
    batches_table,
    blocks_table,
    epochs_table,
    events_table,
    gaps_table,
    notes_table,
    request_ids_table,
    requests_table,
)
from kvcadence.analysis.ingestinfo import header_info, read_info
from kvcadence.analysis.seqset import SeenSeqs
from kvcadence.analysis.sinks import MemorySink, ParquetSink
from kvcadence.analysis.tables import K_CLEARED, K_REMOVED, K_STORED, K_UNKNOWN
from kvcadence.analysis.tokcols import NotInt64Arrays, int_arrays, token_counts
from kvcadence.errors import BundleError, UsageError, WireError
from kvcadence.format import bundle as kbundle
from kvcadence.format import schema as S
from kvcadence.format import wire
from kvcadence.gcpause import gc_paused


@contextmanager
def _small_pages() -> Iterator[None]:
    """numpy's transparent-huge-page advice off while the columns are built.

    numpy asks the kernel for huge pages on every allocation of 4 MB or more; the kernel
    then zeroes (and, under ``defrag=madvise``, compacts memory for) 2 MB at a time. Ingest
    makes many large short-lived arrays: measured on the 1M-event bench bundle, the advice
    cost ~0.6 cpu-s of system time and bought nothing. Process-wide (numpy has one switch),
    restored afterwards; a no-op where numpy lacks the switch.
    """
    try:
        from numpy._core.multiarray import (  # type: ignore[attr-defined]
            _set_madvise_hugepage,
        )
    except ImportError:  # pragma: no cover (numpy < 2)
        yield
        return
    was = _set_madvise_hugepage(False)
    try:
        yield
    finally:
        _set_madvise_hugepage(was)


@contextmanager
def _system_pool() -> Iterator[None]:
    """pyarrow allocating from the system allocator (malloc) while ingest runs.

    pyarrow's default pool (mimalloc in the wheels) faulted its fresh memory in at a much
    higher kernel cost: measured on the bench bundles (one ingest per fresh process, as
    ``kvcadence ingest`` runs it, alternated, one core, loaded box), system time 0.20-0.66
    cpu-s with mimalloc against 0.15-0.21 with the system pool at 200k events (7 pairs),
    0.75-1.26 against 0.59-0.83 at 1M (5 pairs); user time equal within the noise. In one
    process (warm, 4 ABBA pairs at 1M): system 0.51 -> 0.29 cpu-s, user 9.53 -> 9.13.
    Process-wide (pyarrow has one default pool), restored afterwards; buffers remember their
    pool, so tables made inside are freed correctly after it.
    """
    import pyarrow as pa

    was = pa.default_memory_pool()
    pa.set_memory_pool(pa.system_memory_pool())
    try:
        yield
    finally:
        pa.set_memory_pool(was)


#: events gathered before a chunk of the batches/events/blocks tables is written (a row
#: group each): what ingest holds is a chunk, never the bundle. The peak RSS is the base plus
#: the largest chunk's transients, so the chunk decides both the peak and how much it drifts
#: with the bundle's size (more chunks, more chances of a bad coincidence with the reader's
#: window and the heap): at 2^17 events / 2^22 ids the 1M-event bench bundle peaked at ~300 MB
#: (111 MB bundle: ~280), at 2^15 / 2^20 at ~245 MB for both, with the same CPU (within the
#: noise of three interleaved runs) and the same report time on the smaller row groups
CHUNK_EVENTS = 1 << 15
#: ... or payload bytes, whichever comes first: an event at page size 1 holds a block a
#: token (a 1,500-token prefill store is 1,500 hashes and ids), so 2^15 of them were every
#: event of a production-shaped capture (25,600 events, 22M blocks: 2.5 GB of ingest peak
#: at 9,000 requests of contexts up to 100k tokens, growing with the capture)
CHUNK_PAYLOAD_BYTES = 1 << 26
#: ... and the raw arrays (views pinning the payloads) are converted every this many
#: events or payload bytes
RAW_EVENTS = 16384
RAW_PAYLOAD_BYTES = 1 << 23
#: notes gathered before a chunk of the notes table is written: a sim bundle's visibility
#: note a message holds a receive time a stored block (9,000 requests of contexts up to 100k
#: tokens at page size 1: 11,458 notes, 323 MB as JSON, 2.3 GB of ingest peak held whole)
CHUNK_NOTES = 256
#: request token ids gathered before a chunk of the requests table is written
CHUNK_REQUEST_IDS = 1 << 20


def build_tables(bundle: Path, *, ids: bool = False) -> tuple[dict[str, Any], dict[str, Any]]:
    """Read ``bundle`` once; return ({table name: pyarrow.Table}, info dict), in memory
    (``ids``: ``request_ids`` too, ``tables.ON_DEMAND``).

    ``write_tables`` is the streaming form (what ingest uses).
    """
    return _run(bundle, MemorySink(ids))


def write_tables(
    bundle: Path, directory: Path, *, ids: bool = False, ids_budget: int | None = None
) -> tuple[dict[str, int], dict[str, Any]]:
    """Read ``bundle`` once, writing its tables as ``<directory>/<table>.parquet`` row groups
    while the records are decoded; return ({table: rows}, info dict). ``ids``: the
    ``request_ids`` table too (``tables.ON_DEMAND``), dropped once it holds more than
    ``ids_budget`` token ids (None: never; the rows then lack it)."""
    sink = ParquetSink(directory, ids, ids_budget)
    try:
        return _run(bundle, sink)
    except BaseException:
        sink.abort()
        raise


def _run(bundle: Path, sink: Any) -> tuple[Any, dict[str, Any]]:
    """The record loop into ``sink`` (retried from the start, ``sink`` emptied, when a raw
    fast path does not check out); returns ``(sink.close(), info)``.

    The cyclic GC is paused throughout (the GC trap, docs/format.md), and so is
    numpy's huge-page advice (``_small_pages``); pyarrow allocates from the system pool
    (``_system_pool``).
    """
    views = raw = True
    with gc_paused(), _small_pages(), _system_pool():
        while True:
            try:
                info = _build_tables(bundle, views=views, raw=raw, sink=sink)[1]
            except _RawCheckFailed:
                # some event's hashes are not ints, or its token ids not valid: read the
                # payloads checked (decode_batch_view's verdicts: converted, or undecodable)
                raw = False
            except NotInt64Arrays:
                # some request's ids are not int64s: read the ordinary way (same verdicts as
                # every other reader: such a record is an undecodable frame, or an InputError)
                views = False
            else:
                return sink.close(), info
            sink.abort()


class _RawCheckFailed(Exception):
    """A ``decode_batch_raw`` event whose raw hashes / token ids did not check out."""


class _RawEvents:
    """The raw hash and token-id arrays of ``decode_batch_raw`` events, converted to numpy a
    chunk at a time (``flush``) while their bytes are still in cache: hashes with
    ``tokcols.int_arrays(wrap_u64=True)`` (flat int64 + per-event counts), token ids with
    ``tokcols.token_counts`` (per stored event; checked as ``decode_batch`` checks them).
    Raises ``_RawCheckFailed`` where a hash is not an int or token ids are not valid (the
    caller then reads the bundle again)."""

    def __init__(self) -> None:
        self.hashes: list[Any] = []  # raw block_hashes of stored/removed events, event order
        self.tokens: list[Any] = []  # raw token_ids of stored events, event order
        self.parts: tuple[list[Any], list[Any], list[Any]] = ([], [], [])

    def flush(self) -> None:
        try:
            vals, counts = int_arrays(self.hashes, wrap_u64=True)
            ntok = token_counts(self.tokens)
        except NotInt64Arrays:
            raise _RawCheckFailed from None
        self.hashes.clear()
        self.tokens.clear()
        for dst, part in zip(self.parts, (vals, counts, ntok), strict=True):
            dst.append(part)

    def columns(self) -> tuple[Any, Any, Any]:
        """(flat int64 hashes, hashes per stored/removed event, tokens per stored event) of
        the events since the last call."""
        import numpy as np

        self.flush()
        out = tuple(np.concatenate(p) for p in self.parts)
        for p in self.parts:
            p.clear()
        return out  # type: ignore[return-value]


class _NoteChunks:
    """The notes table, written ``CHUNK_NOTES`` notes at a time (``close``: the rest, or an
    empty table when there were none)."""

    def __init__(self, sink: Any) -> None:
        self.sink = sink
        self.rows: list[Any] = []
        self.written = False

    def add(self, rec: Any) -> None:
        self.rows.append(rec)
        if len(self.rows) >= CHUNK_NOTES:
            self.write()

    def write(self) -> None:
        self.sink.write("notes", notes_table(self.rows))
        self.rows.clear()
        self.written = True

    def close(self) -> None:
        if self.rows or not self.written:
            self.write()


class _EventChunk:
    """The messages and events of one chunk as the record loop gathers them (lists it
    appends to, cleared in place by ``write``), and the totals over the chunks written."""

    def __init__(self, sink: Any) -> None:
        self.sink = sink
        # (endpoint, rank, epoch, seq, recv_ns, n_events, via, pass_index, payload bytes, ts,
        # decode_ok): one tuple per message, transposed per chunk (cheaper than eleven appends)
        self.b_rows: list[tuple[Any, ...]] = []
        # events: kind code and medium per event (list appends, cheaper than array appends)
        self.kind: list[int] = []
        self.medium: list[str | None] = []
        # stored-only fields as they come (parent hash, lora id may be None); the stored
        # events' rows, block and token counts and every hash are derived in numpy
        self.st_bs: list[int] = []
        self.st_parent: list[int | None] = []
        self.st_lora: list[int | None] = []
        self.unknown: list[tuple[int, str]] = []  # (event index in the chunk, tag)
        self.raws = _RawEvents()
        self.batches = 0  # rows written so far (the next chunk's first batch / event id)
        self.events = 0
        self.unknown_events = 0
        self.payload_bytes = 0
        self.block_sizes: Counter[int] = Counter()

    def write(self) -> None:
        """Turn the chunk into rows of batches, events and blocks, hand them to the sink."""
        import numpy as np

        if not self.b_rows:
            return
        kinds = array("b", self.kind)
        self.kind.clear()
        hashes, per_event, st_ntok = self.raws.columns()
        kind_np = np.frombuffer(kinds, np.int8)
        n_blocks = np.zeros(len(kinds), np.int64)
        n_blocks[kind_np <= K_REMOVED] = per_event  # one raw hash array per such event
        st_idx = np.flatnonzero(kind_np == K_STORED)
        st_bs = array("q", self.st_bs)
        self.block_sizes.update(self.st_bs)
        b_cols = list(zip(*self.b_rows, strict=True))
        b_ts, b_ok = list(b_cols[9]), list(b_cols[10])
        b_endpoint, b_rank, b_epoch, b_seq, b_recv, b_nev, b_via, b_pass, b_bytes = (
            array("q", c) for c in b_cols[:9]
        )
        del b_cols
        self.payload_bytes += int(as_numpy(b_bytes).sum())
        batch_cols = {
            "endpoint": b_endpoint,
            "rank": b_rank,
            "epoch": b_epoch,
            "seq": b_seq,
            "recv": b_recv,
            "nev": b_nev,
        }
        ev = EventColumns(
            kinds,
            n_blocks,
            list(self.medium),
            (st_idx, list(self.st_parent), st_bs, st_ntok, list(self.st_lora)),
            list(self.unknown),
            hashes,
            b_nev,
        )
        b0, e0 = self.batches, self.events
        self.sink.write(
            "batches", batches_table(batch_cols, ev, b_ts, b_via, b_pass, b_bytes, b_ok, b0)
        )
        self.sink.write("events", events_table(ev, batch_cols, e0, b0))
        self.sink.write("blocks", blocks_table(ev, e0))
        self.batches += len(self.b_rows)
        self.events += ev.n
        self.unknown_events += len(self.unknown)
        for lst in (self.b_rows, self.medium, self.st_bs, self.st_parent, self.st_lora):
            lst.clear()
        self.unknown.clear()


def _build_tables(
    bundle: Path, *, views: bool, raw: bool = False, sink: Any = None, ids: bool = False
) -> tuple[dict[str, Any], dict[str, Any]]:
    """``_run``'s one attempt: the record loop into ``sink`` (a ``MemorySink`` when None,
    with ``request_ids`` where ``ids``,
    whose tables are returned; with a sink of the caller's the first item is ``{}`` and the
    caller closes it).

    One pass over the records. Payloads are decoded with ``wire.decode_batch_raw`` (block
    hashes and token ids left as msgpack bytes; ``wire.decode_batch_raw_fast`` first, which
    gives the same batch where it applies) and flattened at once: per event its kind
    code and medium, per stored event its block size, parent hash and lora id, the raw
    arrays gathered by ``_RawEvents`` and converted to numpy a chunk at a time. Every
    ``CHUNK_EVENTS`` events the chunk's rows are computed with numpy (event/batch ids,
    positions, block and token counts, per-message kind counts, first/last hashes, block
    token counts) and handed to the sink (``_EventChunk.write``); requests likewise every
    ``CHUNK_REQUEST_IDS`` token ids. Messages are de-duplicated by ``seqset.SeenSeqs``.
    ``raw=False``: ``decode_batch_raw(checked=True)`` (``decode_batch_view``'s events and
    verdicts, every raw field valid by construction); with ``raw=True`` a raw field that
    does not check out raises ``_RawCheckFailed``.
    ``views``: requests are read as ``RequestRecordView`` (packed ones as
    ``RequestRecordU32View``) and their token ids converted in numpy chunks by ``tokcols``
    (raises ``NotInt64Arrays`` if they are not all int64s);
    otherwise as ``RequestRecord`` with the ids extended into ``array('q')``.
    """
    own = sink is None
    if own:
        sink = MemorySink(ids)
    reader = open_reader(bundle)
    header = reader.header
    info = header_info(header)
    ep_rank = {e.id: e.dp_rank for e in header.endpoints}

    chunk = _EventChunk(sink)
    reqs = RequestColumns(bundle, views)
    req_rows, req_app = reqs.rows, reqs.rows.append
    req_base = 0
    gaps: list[Any] = []
    epochs: list[Any] = []
    notes = _NoteChunks(sink)
    note_add = notes.add
    trailer: Any = None

    seen = SeenSeqs()
    seen_runs, seen_add = seen.runs, seen.add
    duplicates = 0
    undecodable = 0

    EventFrame = S.EventFrame
    Request = S.RequestRecordView if views else S.RequestRecord
    # packed (format 2.0) requests: ids as the reader's array('I') (never seen without views)
    Packed = S.RequestRecordU32View
    Stored, Removed, Cleared = S.BlockStoredRawView, S.BlockRemovedRawView, S.AllBlocksCleared
    decode = wire.decode_batch_raw
    decode_fast = wire.decode_batch_raw_fast
    checked = not raw
    raws = chunk.raws
    raw_bytes = chunk_bytes = 0  # payload bytes since the last raw flush / chunk write
    raw_hashes = raws.hashes
    hr_app, tr_app = raw_hashes.append, raws.tokens.append
    payload_of = kbundle.event_payload_view
    astuple = msgspec.structs.astuple
    e_kind = chunk.kind
    kind_app, med_app = e_kind.append, chunk.medium.append
    sb_app, sp_app, sl_app = chunk.st_bs.append, chunk.st_parent.append, chunk.st_lora.append
    un_app = chunk.unknown.append
    b_app = chunk.b_rows.append
    # annotated, not cast: the loop dispatches on type(rec) / type(ev) itself
    rec: Any
    batch: Any
    ev: Any
    for rec in reader.records(request_view="u32" if views else False):
        t = type(rec)
        if t is EventFrame:
            seq = rec.seq
            runs = seen_runs.get((rec.endpoint, rec.epoch))
            if runs is not None and seq == runs[1][-1] + 1:
                runs[1][-1] = seq  # the next message of its run (SeenSeqs.add's usual case)
            elif not seen_add(rec.endpoint, rec.epoch, seq):
                duplicates += 1
                continue
            # the payload as stored (Raw, no copy; decoded at once, then dropped) unless it
            # was stored bin-wrapped
            payload = payload_of(rec) if rec.payload_is_bin else rec.payload
            # decode_batch_raw's typed fast path first (what it would return, one call less
            # per message); token ids are checked a chunk at a time (``_RawEvents.flush``)
            batch = None if checked else decode_fast(payload)
            if batch is None:
                try:
                    batch = decode(payload, checked=checked, check_tokens=False)
                except WireError:
                    batch = None
            if batch is None:
                evs: list[Any] = []
                ts: float | None = None
                ok = False
                undecodable += 1
            else:
                evs, ts, ok = batch.events, batch.ts, True
            # per event only its kind, medium and fields as they are
            for ev in evs:
                te = type(ev)
                if te is Stored:
                    kind_app(K_STORED)
                    hr_app(ev.block_hashes)
                    tr_app(ev.token_ids)
                    sp_app(ev.parent_block_hash)
                    sb_app(ev.block_size)
                    sl_app(ev.lora_id)
                    med_app(ev.medium)
                elif te is Removed:
                    kind_app(K_REMOVED)
                    hr_app(ev.block_hashes)
                    med_app(ev.medium)
                elif te is Cleared:
                    kind_app(K_CLEARED)
                    med_app(None)
                else:
                    un_app((len(e_kind), str(getattr(ev, "tag", te.__name__))))
                    kind_app(K_UNKNOWN)
                    med_app(None)
            raw_bytes += len(payload)
            if len(raw_hashes) >= RAW_EVENTS or raw_bytes >= RAW_PAYLOAD_BYTES:
                raws.flush()
                chunk_bytes += raw_bytes
                raw_bytes = 0
            rank = ep_rank.get(rec.endpoint)
            if rank is None:
                rank = batch.attn_dp_rank if batch is not None else None
                rank = rank if rank is not None else 0
            b_app(
                (
                    rec.endpoint,
                    rank,
                    rec.epoch,
                    seq,
                    rec.recv_ns,
                    len(evs),
                    rec.via,
                    rec.pass_index,
                    len(payload),
                    ts,
                    ok,
                )
            )
            if len(e_kind) >= CHUNK_EVENTS or chunk_bytes >= CHUNK_PAYLOAD_BYTES:
                chunk.write()
                chunk_bytes = raw_bytes = 0
        elif t is Packed or t is Request:
            req_app(astuple(rec))
            if len(req_rows) >= reqs.batch:
                reqs.flush()
                if reqs.pending_ids >= CHUNK_REQUEST_IDS:
                    req_base = _write_requests(reqs, sink, req_base)
        elif t is S.Gap:
            gaps.append(rec)
        elif t is S.Epoch:
            epochs.append(rec)
        elif t is S.Annotation:
            note_add(rec)
        elif t is S.Trailer:
            trailer = rec

    chunk.write()
    reqs.flush()
    if reqs.pending_rows or not req_base:
        _write_requests(reqs, sink, req_base)
    info.update(read_info(reader.report, chunk, duplicates, undecodable, trailer))
    if info["page_size"] is None and chunk.block_sizes:
        sizes = chunk.block_sizes
        info["page_size"] = max(set(sizes), key=sizes.__getitem__)
    sink.write("gaps", gaps_table(gaps))
    sink.write("epochs", epochs_table(epochs))
    notes.close()
    return (sink.close() if own else {}), info


def open_reader(bundle: Path) -> kbundle.BundleReader:
    """The bundle's reader, as the ingest reads it (one that is not there: a ``UsageError``)."""
    try:
        return kbundle.BundleReader(bundle)
    except BundleError:
        raise
    except FileNotFoundError as exc:
        raise UsageError(f"not a bundle: {bundle}: {exc}") from None


def _write_requests(reqs: RequestColumns, sink: Any, base: int) -> int:
    """Hand the converted request rows to ``sink`` (request ids from ``base``); returns the
    next chunk's first request id."""
    n = reqs.pending_rows
    sink.write("requests", requests_table(reqs, base))
    if "request_ids" in sink.tables:  # (``tables.ON_DEMAND``: only when asked for)
        sink.write_ids(request_ids_table(reqs, base), reqs.pending_ids)
    reqs.reset()
    return base + n
