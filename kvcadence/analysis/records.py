"""The record loop: one pass over a bundle's records into columns (``build_tables``).

Reads a bundle through ``kvcadence.format.bundle.BundleReader`` (requests as
``RequestRecordView``: token ids left as msgpack bytes, converted to int64 columns in numpy
chunks by ``kvcadence.analysis.tokcols``), decodes each KV-event payload once with
``kvcadence.format.wire.decode_batch_raw`` (block hashes and token ids left as msgpack bytes,
hashes converted in numpy chunks too; if any of those bytes does not check out, the bundle is
read again with ``decode_batch_raw(checked=True)``: ``decode_batch_view``'s verdicts), and
flattens everything straight into ``array``/list columns (never keeping the decoded structs,
cyclic GC paused: keeping hundreds of thousands of decoded structs with lists makes CPython's
cyclic GC cut throughput 3-4x, docs/format.md). The loop stays one function on purpose: per
event it only appends, and a helper call per event or message would cost more than the
appends. ``kvcadence.analysis.columns`` turns the columns into pyarrow tables (numpy).
"""

from __future__ import annotations

from array import array
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
    requests_table,
)
from kvcadence.analysis.tables import K_CLEARED, K_REMOVED, K_STORED, K_UNKNOWN
from kvcadence.analysis.tokcols import NotInt64Arrays, array_lengths, int_arrays
from kvcadence.errors import BundleError, UsageError, WireError
from kvcadence.format import bundle as kbundle
from kvcadence.format import schema as S
from kvcadence.format import wire
from kvcadence.gcpause import gc_paused


def _header_info(header: Any) -> dict[str, Any]:
    si = dict(header.server_info or {})
    sim = header.sim_config or {}
    page_size = si.get("page_size", sim.get("page_size"))
    max_tokens = si.get("max_total_num_tokens", sim.get("max_total_num_tokens"))
    return {
        "source": header.source,
        "sglang_version": header.sglang_version or si.get("version"),
        "kvcadence_version": header.kvcadence_version,
        "format": [header.format_major, header.format_minor],
        "page_size": int(page_size) if page_size is not None else None,
        "max_total_num_tokens": int(max_tokens) if max_tokens is not None else None,
        "kv_events_config": header.kv_events_config,
        "start_ns": header.start_ns,
        "endpoints": [
            {"id": e.id, "url": e.url, "dp_rank": e.dp_rank, "topic": e.topic}
            for e in header.endpoints
        ],
        "server_info": si,
    }


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


def build_tables(bundle: Path) -> tuple[dict[str, Any], dict[str, Any]]:
    """Read ``bundle`` once; return ({table name: pyarrow.Table}, info dict).

    The cyclic GC is paused throughout (the GC trap, docs/format.md), and so is
    numpy's huge-page advice (``_small_pages``).
    """
    views = raw = True
    with gc_paused(), _small_pages():
        while True:
            try:
                return _build_tables(bundle, views=views, raw=raw)
            except _RawCheckFailed:
                # some event's hashes are not ints, or its token ids not an array: read the
                # payloads checked (decode_batch_view's verdicts: converted, or undecodable)
                raw = False
            except NotInt64Arrays:
                # some request's ids are not int64s: read the ordinary way (same verdicts as
                # every other reader: such a record is an undecodable frame, or an InputError)
                views = False


class _RawCheckFailed(Exception):
    """A ``decode_batch_raw`` event whose raw hashes / token ids did not check out."""


class _RawEvents:
    """The raw hash and token-id arrays of ``decode_batch_raw`` events, converted to numpy a
    chunk at a time (``flush``) while their bytes are still in cache: hashes with
    ``tokcols.int_arrays(wrap_u64=True)`` (flat int64 + per-event counts), token ids with
    ``tokcols.array_lengths`` (per stored event). Raises ``_RawCheckFailed`` where a hash is
    not an int or token ids are not an array (the caller then reads the bundle again)."""

    def __init__(self) -> None:
        self.hashes: list[Any] = []  # raw block_hashes of stored/removed events, event order
        self.tokens: list[Any] = []  # raw token_ids of stored events, event order
        self.parts: tuple[list[Any], list[Any], list[Any]] = ([], [], [])

    def flush(self) -> None:
        try:
            vals, counts = int_arrays(self.hashes, wrap_u64=True)
            ntok = array_lengths(self.tokens)
        except NotInt64Arrays:
            raise _RawCheckFailed from None
        self.hashes.clear()
        self.tokens.clear()
        for dst, part in zip(self.parts, (vals, counts, ntok), strict=True):
            dst.append(part)

    def columns(self) -> tuple[Any, Any, Any]:
        """(flat int64 hashes, hashes per stored/removed event, tokens per stored event)."""
        import numpy as np

        self.flush()
        return tuple(np.concatenate(p) for p in self.parts)  # type: ignore[return-value]


def _build_tables(
    bundle: Path, *, views: bool, raw: bool = False
) -> tuple[dict[str, Any], dict[str, Any]]:
    """``build_tables`` proper.

    One pass over the records. Payloads are decoded with ``wire.decode_batch_raw`` (block
    hashes and token ids left as msgpack bytes) and flattened at once: per event its kind
    code and medium, per stored event its block size, parent hash and lora id, the raw
    arrays gathered by ``_RawEvents`` and converted to numpy a chunk at a time. Everything
    derivable (event/batch ids, positions, block and token counts, per-message kind counts,
    first/last hashes, block token counts) is computed afterwards with numpy.
    ``raw=False``: ``decode_batch_raw(checked=True)`` (``decode_batch_view``'s events and
    verdicts, every raw field valid by construction); with ``raw=True`` a raw field that
    does not check out raises ``_RawCheckFailed``.
    ``views``: requests are read as ``RequestRecordView`` and their token ids converted in
    numpy chunks by ``tokcols`` (raises ``NotInt64Arrays`` if they are not all int64s);
    otherwise as ``RequestRecord`` with the ids extended into ``array('q')``.
    """
    try:
        reader = kbundle.BundleReader(bundle)
    except BundleError:
        raise
    except FileNotFoundError as exc:
        raise UsageError(f"not a bundle: {bundle}: {exc}") from None

    header = reader.header
    info = _header_info(header)
    ep_rank = {e.id: e.dp_rank for e in header.endpoints}

    # batches (one entry per de-duplicated message)
    # (endpoint, rank, epoch, seq, recv_ns, n_events, via, pass_index, payload bytes, ts,
    # decode_ok): one tuple per message, transposed at the end (cheaper than eleven appends)
    b_rows: list[tuple[Any, ...]] = []
    # events: kind code and medium per event (list appends, cheaper than array appends)
    e_kind: list[int] = []
    e_medium: list[str | None] = []
    # stored-only fields as they come (parent hash, lora id may be None); the stored events'
    # rows, block and token counts and every hash are derived in numpy (``_RawEvents``)
    st_bs_raw: list[int] = []
    st_parent: list[int | None] = []
    st_lora: list[int | None] = []
    un_rows: list[tuple[int, str]] = []
    reqs = RequestColumns(bundle, views)
    req_rows, req_app = reqs.rows, reqs.rows.append
    gaps: list[Any] = []
    epochs: list[Any] = []
    notes: list[Any] = []
    trailer: Any = None

    seen: set[tuple[int, int, int]] = set()
    duplicates = 0
    undecodable = 0

    EventFrame = S.EventFrame
    Request = S.RequestRecordView if views else S.RequestRecord
    Stored, Removed, Cleared = S.BlockStoredRawView, S.BlockRemovedRawView, S.AllBlocksCleared
    decode = wire.decode_batch_raw
    checked = not raw
    raws = _RawEvents()
    raw_hashes = raws.hashes
    hr_app, tr_app = raw_hashes.append, raws.tokens.append
    payload_of = kbundle.event_payload_view
    astuple = msgspec.structs.astuple
    kind_app, med_app = e_kind.append, e_medium.append
    sb_app, sp_app, sl_app = st_bs_raw.append, st_parent.append, st_lora.append
    b_app = b_rows.append
    # annotated, not cast: the loop dispatches on type(rec) / type(ev) itself
    rec: Any
    batch: Any
    ev: Any
    for rec in reader.records(request_view=views):
        t = type(rec)
        if t is EventFrame:
            key = (rec.endpoint, rec.epoch, rec.seq)
            if key in seen:
                duplicates += 1
                continue
            seen.add(key)
            # the payload as stored (Raw, no copy; decoded at once, then dropped) unless it
            # was stored bin-wrapped
            payload = payload_of(rec) if rec.payload_is_bin else rec.payload
            try:
                batch = decode(payload, checked=checked)
            except WireError:
                evs: list[Any] = []
                ts: float | None = None
                ok = False
                undecodable += 1
                batch = None
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
                    un_rows.append((len(e_kind), str(getattr(ev, "tag", te.__name__))))
                    kind_app(K_UNKNOWN)
                    med_app(None)
            if len(raw_hashes) >= 16384:
                raws.flush()
            rank = ep_rank.get(rec.endpoint)
            if rank is None:
                rank = batch.attn_dp_rank if batch is not None else None
                rank = rank if rank is not None else 0
            b_app(
                (
                    rec.endpoint,
                    rank,
                    rec.epoch,
                    rec.seq,
                    rec.recv_ns,
                    len(evs),
                    rec.via,
                    rec.pass_index,
                    len(payload),
                    ts,
                    ok,
                )
            )
        elif t is Request:
            req_app(astuple(rec))
            if len(req_rows) >= reqs.batch:
                reqs.flush()
        elif t is S.Gap:
            gaps.append(rec)
        elif t is S.Epoch:
            epochs.append(rec)
        elif t is S.Annotation:
            notes.append(rec)
        elif t is S.Trailer:
            trailer = rec

    import numpy as np

    kinds = array("b", e_kind)
    del e_kind
    hashes, per_event, st_ntok = raws.columns()
    kind_np = np.frombuffer(kinds, np.int8)
    n_blocks = np.zeros(len(kinds), np.int64)
    n_blocks[kind_np <= K_REMOVED] = per_event  # one raw hash array per such event
    st_idx = np.flatnonzero(kind_np == K_STORED)
    st_bs = array("q", st_bs_raw)
    del st_bs_raw
    unknown_events = len(un_rows)
    rep = reader.report
    corrupt = list(getattr(rep, "corrupt", []) or [])
    info.update(
        {
            "frames": len(b_rows) + duplicates,
            "messages": len(b_rows),
            "duplicates": duplicates,
            "undecodable_payloads": undecodable,
            "unknown_events": unknown_events,
            "payload_bytes": 0,  # below, from the batches' payload_bytes column
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
    )
    if info["page_size"] is None and st_bs:
        sizes = list(st_bs)
        info["page_size"] = max(set(sizes), key=sizes.count)

    reqs.flush()
    b_cols = list(zip(*b_rows, strict=True)) or [()] * 11
    del b_rows
    b_ts, b_ok = list(b_cols[9]), list(b_cols[10])
    b_endpoint, b_rank, b_epoch, b_seq, b_recv, b_nev, b_via, b_pass, b_bytes = (
        array("q", c) for c in b_cols[:9]
    )
    del b_cols
    info["payload_bytes"] = int(as_numpy(b_bytes).sum())
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
        e_medium,
        (st_idx, st_parent, st_bs, st_ntok, st_lora),
        un_rows,
        hashes,
        b_nev,
    )
    tables = {
        "batches": batches_table(batch_cols, ev, b_ts, b_via, b_pass, b_bytes, b_ok),
        "events": events_table(ev, batch_cols),
        "blocks": blocks_table(ev),
        "requests": requests_table(reqs),
        "gaps": gaps_table(gaps),
        "epochs": epochs_table(epochs),
        "notes": notes_table(notes),
    }
    return tables, info


def _count(x: Any) -> int:
    if isinstance(x, int):
        return x
    try:
        return len(x)
    except TypeError:
        return 0
