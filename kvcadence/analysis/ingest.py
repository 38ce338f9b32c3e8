"""Bundle -> Parquet: the ONE dict of Parquet table schemas and the column-wise ingest.

``ingest(bundle)`` reads a bundle through ``kvcadence.format.bundle.BundleReader`` (requests
as ``RequestRecordView``: token ids left as msgpack bytes, converted to int64 columns in numpy
chunks by ``kvcadence.analysis.tokcols``), decodes each KV-event payload once with
``kvcadence.format.wire.decode_batch_raw`` (block hashes and token ids left as msgpack
bytes, hashes converted in numpy chunks too; if any of those bytes does not check out, the
bundle is read again with ``decode_batch_raw(checked=True)``: ``decode_batch_view``'s verdicts),
flattens everything straight into ``array``/list columns (never keeping the decoded structs,
cyclic GC paused: keeping hundreds of thousands of decoded structs with lists makes
CPython's cyclic GC cut throughput 3-4x, docs/format.md), derives the rest with numpy and
writes one Parquet file per table with pyarrow (``write_options``):

``batches``  one row per ZMQ message (EventFrame), de-duplicated by (endpoint, epoch, seq)
``events``   one row per KV event inside a batch
``blocks``   one row per block hash of a Stored/Removed event
``requests`` one row per RequestRecord (every field; token ids as ``list<int64>`` columns)
``gaps``     one row per Gap record
``epochs``   one row per Epoch record
``notes``    one row per Annotation record

Hashes are ``uint64`` (the bit pattern of SGLang's signed int64, i.e. ``wire.u64``).
The tables are cached next to the bundle in ``<bundle>/.parquet/`` with a ``manifest.json``
holding a fingerprint of the bundle's files (names, sizes, mtimes); they are rebuilt when the
fingerprint changes. The manifest also carries what is not a table: header facts (source,
SGLang version, page size, pool size), the reader's report (torn bytes, corrupt frames,
unknown records), the trailer (clean shutdown) and ingest counters (duplicates, undecodable
payloads, unknown events).
"""

from __future__ import annotations

import json
import os
import shutil
import time
from array import array
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvcadence.errors import InputError, UsageError
from kvcadence.gcpause import gc_paused

INGEST_VERSION = 3
CACHE_DIRNAME = ".parquet"
MANIFEST = "manifest.json"

# Event kinds as stored in events.kind / blocks.kind.
KINDS: tuple[str, ...] = ("stored", "removed", "cleared", "unknown")
K_STORED, K_REMOVED, K_CLEARED, K_UNKNOWN = range(4)

# The ONE dict of Parquet table schemas: table -> [(column, arrow type name, description)].
# Arrow types are named as strings so this module imports nothing heavy at top level.
TABLES: dict[str, list[tuple[str, str, str]]] = {
    "batches": [
        ("batch_id", "int64", "row id (order of first appearance in the bundle)"),
        ("endpoint", "int32", "EventFrame.endpoint (publisher endpoint id)"),
        (
            "dp_rank",
            "int32",
            "DP rank of the endpoint (header endpoints; else attn_dp_rank; else 0)",
        ),
        ("epoch", "int32", "publisher epoch (restart counter) of the endpoint"),
        ("seq", "int64", "publisher sequence number"),
        ("recv_ns", "int64", "receive time, host ns (virtual ns in sim bundles)"),
        (
            "ts",
            "float64",
            "publish time from the payload (KVEventBatch.ts, s); null if undecodable",
        ),
        ("n_events", "int32", "events in the message"),
        ("n_stored", "int32", "BlockStored events in the message"),
        ("n_removed", "int32", "BlockRemoved events in the message"),
        ("n_cleared", "int32", "AllBlocksCleared events in the message"),
        ("n_unknown", "int32", "events with an unknown tag"),
        ("via", "int8", "0 live, 1 replay, 2 import, 3 sim"),
        ("pass_index", "int64", "scheduler pass (sim bundles), -1 otherwise"),
        ("payload_bytes", "int64", "payload length in bytes"),
        ("decode_ok", "bool", "payload decoded (false: counted as undecodable, no events)"),
    ],
    "events": [
        ("event_id", "int64", "row id"),
        ("batch_id", "int64", "batches.batch_id"),
        ("endpoint", "int32", "as batches"),
        ("dp_rank", "int32", "as batches"),
        ("epoch", "int32", "as batches"),
        ("seq", "int64", "as batches"),
        ("idx", "int32", "position of the event inside its message"),
        ("recv_ns", "int64", "the message's recv_ns"),
        ("kind", "dictionary<values=string, indices=int8>", "stored|removed|cleared|unknown"),
        ("medium", "string", "medium (GPU, CPU, ...) or null"),
        ("n_blocks", "int32", "len(block_hashes) (0 for clears/unknown)"),
        ("parent_hash", "uint64", "BlockStored.parent_block_hash or null"),
        ("first_hash", "uint64", "block_hashes[0] or null"),
        ("last_hash", "uint64", "block_hashes[-1] or null"),
        ("block_size", "int32", "BlockStored.block_size or null"),
        ("n_tokens", "int64", "len(BlockStored.token_ids) or null"),
        ("lora_id", "int64", "BlockStored.lora_id or null"),
        ("unknown_tag", "string", "tag of an unknown event, else null"),
    ],
    "blocks": [
        ("event_id", "int64", "events.event_id"),
        ("kind", "dictionary<values=string, indices=int8>", "stored|removed"),
        ("pos", "int32", "position of the hash in the event's block_hashes"),
        ("hash", "uint64", "block hash (uint64 bit pattern of SGLang's int64)"),
        ("n_tokens", "int32", "tokens in the block (stored events; null for removed)"),
    ],
    "requests": [
        ("request_id", "int64", "row id (bundle order)"),
        ("rid", "string", "request id"),
        ("input_ids", "list<item: int64>", "prompt token ids"),
        ("output_ids", "list<item: int64>", "generated token ids"),
        ("n_input", "int64", "len(input_ids)"),
        ("n_output", "int64", "len(output_ids)"),
        ("send_ns", "int64", "RequestRecord.send_ns"),
        ("first_token_ns", "int64", "RequestRecord.first_token_ns"),
        ("finish_ns", "int64", "RequestRecord.finish_ns"),
        ("lane", "int64", "closed-loop lane"),
        ("session", "int64", "session within the lane"),
        ("turn", "int64", "turn within the session"),
        ("max_new_tokens", "int64", "requested output length"),
        ("prompt_tokens", "int64", "server-reported prompt tokens"),
        ("cached_tokens", "int64", "server-reported cached tokens at admission"),
        ("completion_tokens", "int64", "server-reported completion tokens"),
        ("finish_reason", "string", "finish reason"),
        ("error", "string", "error text, if the request failed"),
        ("dp_rank", "int64", "DP rank that served it, if known"),
        ("source", "string", "driver | sglang-metrics | request-log | import | sim"),
        ("think_ns", "int64", "client pause before the request"),
        ("arrival_ns", "int64", "open-loop arrival time"),
        ("meta_info", "string", "SGLang meta_info as JSON text"),
    ],
    "gaps": [
        ("endpoint", "int32", "Gap.endpoint"),
        ("epoch", "int32", "Gap.epoch"),
        ("first_seq", "int64", "first missed seq"),
        ("last_seq", "int64", "last missed seq (inclusive)"),
        ("n_missing", "int64", "last_seq - first_seq + 1"),
        ("recovered", "int64", "seqs fetched through replay"),
        ("reason", "string", "Gap.reason"),
        ("recv_ns", "int64", "when the gap was noticed"),
    ],
    "epochs": [
        ("endpoint", "int32", "Epoch.endpoint"),
        ("epoch", "int32", "Epoch.epoch"),
        ("first_seq", "int64", "first seq of the epoch"),
        ("recv_ns", "int64", "when it started"),
        ("reason", "string", "why a new epoch was opened"),
    ],
    "notes": [
        ("kind", "string", "Annotation.kind"),
        ("recv_ns", "int64", "Annotation.recv_ns"),
        ("data", "string", "Annotation.data as JSON text"),
    ],
}


def arrow_schema(table: str) -> Any:
    """The pyarrow schema of ``table`` (built from ``TABLES``)."""
    import pyarrow as pa

    def typ(name: str) -> Any:
        simple = {
            "int8": pa.int8(),
            "int32": pa.int32(),
            "int64": pa.int64(),
            "uint64": pa.uint64(),
            "float64": pa.float64(),
            "bool": pa.bool_(),
            "string": pa.string(),
        }
        if name in simple:
            return simple[name]
        if name.startswith("dictionary"):
            return pa.dictionary(pa.int8(), pa.string())
        if name.startswith("list"):
            return pa.list_(pa.int64())
        raise AssertionError(name)

    return pa.schema([pa.field(col, typ(t)) for col, t, _ in TABLES[table]])


# Parquet writer settings. Measured on the 100k-event bench bundle: zstd with dictionary
# attempts on every column spent ~0.5 s writing (as long as the decode); LZ4 with dictionaries
# only on low-cardinality strings and DELTA_BINARY_PACKED on ids/positions/times/token ids
# writes ~2x faster. Hash columns stay PLAIN and uncompressed (random 64-bit values neither
# delta-pack nor compress).
_DELTA = {"int32", "int64"}
_NO_DELTA = {"dp_rank", "via"}
_DICT_COLS = {"kind", "medium", "source", "finish_reason", "reason", "unknown_tag"}


def write_options(table: str) -> dict[str, Any]:
    """``pyarrow.parquet.write_table`` keyword arguments for ``table``."""
    enc: dict[str, str] = {}
    for col, typ, _ in TABLES[table]:
        if typ in _DELTA and col not in _NO_DELTA:
            enc[col] = "DELTA_BINARY_PACKED"
        elif typ.startswith("list"):
            enc[f"{col}.list.element"] = "DELTA_BINARY_PACKED"
    dict_cols = [c for c, _, _ in TABLES[table] if c in _DICT_COLS]
    # random 64-bit hashes do not compress: LZ4 on them only costs time
    comp = {c: ("none" if t == "uint64" else "lz4") for c, t, _ in TABLES[table]}
    # min/max statistics of random hashes and of token ids prune nothing (every row group
    # spans almost the whole range); skipping them saves ~5% of the write
    stats = [c for c, t, _ in TABLES[table] if t != "uint64" and not t.startswith("list")]
    return {
        "compression": comp,
        "use_dictionary": dict_cols,
        "column_encoding": enc,
        "write_statistics": stats,
    }


@dataclass
class Ingested:
    """Where a bundle's tables are and what the manifest says about the bundle."""

    bundle: Path
    dir: Path
    manifest: dict[str, Any]
    rebuilt: bool

    def path(self, table: str) -> Path:
        return self.dir / f"{table}.parquet"

    @property
    def info(self) -> dict[str, Any]:
        return self.manifest["info"]


# --------------------------------------------------------------------------------------
# cache management
# --------------------------------------------------------------------------------------


def fingerprint(bundle: Path) -> list[list[Any]]:
    """Names, sizes and mtimes (ns) of the bundle's top-level files (dot-files excluded)."""
    out: list[list[Any]] = []
    for p in sorted(bundle.iterdir()):
        if p.name.startswith(".") or not p.is_file():
            continue
        st = p.stat()
        out.append([p.name, st.st_size, st.st_mtime_ns])
    return out


def _check_bundle(bundle: Path) -> None:
    if not bundle.exists():
        raise UsageError(f"bundle not found: {bundle}")
    if not bundle.is_dir():
        raise UsageError(f"not a bundle directory: {bundle}")


def _is_cache(path: Path) -> bool:
    """``path`` holds a manifest written by ``_build`` (so replacing it loses nothing)."""
    try:
        doc = json.loads((path / MANIFEST).read_text())
    except (OSError, ValueError):
        return False
    return isinstance(doc, dict) and "ingest_version" in doc


def check_cache_dir(path: str | os.PathLike[str], flag: str = "--out") -> Path:
    """A cache directory the caller named: new, empty, or an earlier cache (never anything else).

    ``_build`` replaces the whole directory, so a non-empty directory without our manifest
    (the user's own files, the bundle itself) is refused with a UsageError naming ``flag``.
    """
    from kvcadence.analysis.outpaths import check_out_dir

    p = check_out_dir(path, flag)
    if p.is_dir() and any(p.iterdir()) and not _is_cache(p):
        raise UsageError(
            f"{flag} {os.fspath(path)}: not a kvcadence Parquet cache (no {MANIFEST}) and not "
            "empty; refusing to replace it (name a new or empty directory)"
        )
    return p


def ingest(
    bundle: str | os.PathLike[str],
    out: str | os.PathLike[str] | None = None,
    *,
    force: bool = False,
) -> Ingested:
    """Make sure the Parquet tables of ``bundle`` are current; (re)build them if not.

    ``out`` overrides the cache directory (default ``<bundle>/.parquet``).
    """
    bundle = Path(bundle)
    _check_bundle(bundle)
    cache = check_cache_dir(out) if out is not None else bundle / CACHE_DIRNAME
    fp = fingerprint(bundle)
    man_path = cache / MANIFEST
    if not force and man_path.exists():
        try:
            manifest = json.loads(man_path.read_text())
        except (OSError, ValueError):
            manifest = None
        if (
            manifest
            and manifest.get("ingest_version") == INGEST_VERSION
            and manifest.get("fingerprint") == fp
            and all((cache / f"{t}.parquet").exists() for t in TABLES)
        ):
            return Ingested(bundle, cache, manifest, rebuilt=False)
    manifest = _build(bundle, cache, fp)
    return Ingested(bundle, cache, manifest, rebuilt=True)


def _build(bundle: Path, cache: Path, fp: list[list[Any]]) -> dict[str, Any]:
    import pyarrow.parquet as pq

    t0 = time.perf_counter()
    tables, info = build_tables(bundle)
    cache = Path(os.path.abspath(cache))  # "." / ".." have no usable name for the temp dir
    tmp = cache.with_name(f"{cache.name}.tmp-{os.getpid()}")
    try:
        if tmp.exists():
            shutil.rmtree(tmp)
        tmp.mkdir(parents=True)
        for name, table in tables.items():
            pq.write_table(table, tmp / f"{name}.parquet", **write_options(name))
        manifest = {
            "ingest_version": INGEST_VERSION,
            "bundle": str(bundle.resolve()),
            "fingerprint": fp,
            "built_s": round(time.perf_counter() - t0, 6),
            "info": info,
            "tables": {name: table.num_rows for name, table in tables.items()},
        }
        (tmp / MANIFEST).write_text(json.dumps(manifest, indent=1, default=str))
        if cache.exists():
            shutil.rmtree(cache)
        os.replace(tmp, cache)
    except PermissionError as exc:
        shutil.rmtree(tmp, ignore_errors=True)
        raise UsageError(
            f"cannot write the Parquet cache {cache}: {exc.strerror}; pass --out DIR"
        ) from None
    return manifest


# --------------------------------------------------------------------------------------
# column building
# --------------------------------------------------------------------------------------


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
        from numpy._core.multiarray import _set_madvise_hugepage
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
    from kvcadence.analysis.tokcols import NotInt64Arrays

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
        from kvcadence.analysis.tokcols import NotInt64Arrays, array_lengths, int_arrays

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
    from kvcadence.errors import BundleError, WireError
    from kvcadence.format import bundle as kbundle
    from kvcadence.format import schema as S
    from kvcadence.format import wire

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
    reqs = _RequestColumns(bundle, views)
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
    astuple = _astuple()
    kind_app, med_app = e_kind.append, e_medium.append
    sb_app, sp_app, sl_app = st_bs_raw.append, st_parent.append, st_lora.append
    b_app = b_rows.append
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
    info["payload_bytes"] = int(_np(b_bytes).sum())
    batch_cols = {
        "endpoint": b_endpoint,
        "rank": b_rank,
        "epoch": b_epoch,
        "seq": b_seq,
        "recv": b_recv,
        "nev": b_nev,
    }
    ev = _EventColumns(
        kinds,
        n_blocks,
        e_medium,
        (st_idx, st_parent, st_bs, st_ntok, st_lora),
        un_rows,
        hashes,
        b_nev,
    )
    tables = {
        "batches": _batches_table(batch_cols, ev, b_ts, b_via, b_pass, b_bytes, b_ok),
        "events": _events_table(ev, batch_cols),
        "blocks": _blocks_table(ev),
        "requests": _requests_table(reqs),
        "gaps": _gaps_table(gaps),
        "epochs": _epochs_table(epochs),
        "notes": _notes_table(notes),
    }
    return tables, info


def _astuple() -> Any:
    import msgspec

    return msgspec.structs.astuple


def _count(x: Any) -> int:
    if isinstance(x, int):
        return x
    try:
        return len(x)
    except TypeError:
        return 0


def _np(a: Any, dtype: str = "int64") -> Any:
    """An ``array`` (no copy) or numpy array as a numpy array of ``dtype``."""
    import numpy as np

    if isinstance(a, np.ndarray):
        return a.astype(dtype, copy=False)
    src = {"q": np.int64, "b": np.int8}[a.typecode]
    return np.frombuffer(a, dtype=src).astype(dtype, copy=False) if len(a) else np.zeros(0, dtype)


def _kind_array(codes: Any) -> Any:
    import pyarrow as pa

    return pa.DictionaryArray.from_arrays(
        pa.array(codes, type=pa.int8()), pa.array(list(KINDS), type=pa.string())
    )


class _EventColumns:
    """The per-event columns of one ingest plus the numpy arrays derived from them."""

    def __init__(
        self,
        kind: array,
        n_blocks: array,
        medium: list[str | None],
        stored: tuple[array, list[int | None], array, array, list[int | None]],
        unknown: list[tuple[int, str]],
        hashes: array,
        per_batch: array,
    ) -> None:
        import numpy as np

        self.n = len(kind)
        self.kind = _np(kind, "int8")
        self.n_blocks = _np(n_blocks)
        self.medium = medium
        self.hashes = _np(hashes)
        self.per_batch = _np(per_batch)
        nb = len(per_batch)
        self.batch_of = np.repeat(np.arange(nb, dtype=np.int64), self.per_batch)
        starts = np.zeros(nb + 1, dtype=np.int64)
        np.cumsum(self.per_batch, out=starts[1:])
        self.idx = np.arange(self.n, dtype=np.int64) - starts[:-1][self.batch_of]
        self.off = np.zeros(self.n + 1, dtype=np.int64)
        np.cumsum(self.n_blocks, out=self.off[1:])
        # stored-only fields, scattered to full-length columns with a null mask
        st_idx, self.st_parent, st_bs, st_ntok, self.st_lora = stored
        self.st_idx = _np(st_idx)
        self.st_bs = _np(st_bs)
        self.st_ntok = _np(st_ntok)
        self.unknown = unknown

    def counts_per_batch(self, code: int) -> Any:
        import numpy as np

        return np.bincount(self.batch_of[self.kind == code], minlength=len(self.per_batch)).astype(
            np.int32
        )

    def scatter(self, idx: Any, values: Any, typ: Any) -> Any:
        """A full-length arrow column: ``values`` (None = null) at rows ``idx``, null elsewhere."""
        import numpy as np
        import pyarrow as pa

        valid = np.ones(len(idx), dtype=bool)
        if not isinstance(values, np.ndarray):
            got = pa.array(values, type=pa.int64())
            if got.null_count:
                valid = got.is_valid().to_numpy(zero_copy_only=False)
            values = got.fill_null(0).to_numpy()
        full = np.zeros(self.n, dtype=np.int64)
        full[idx] = values
        mask = np.ones(self.n, dtype=bool)
        mask[idx[valid]] = False
        return pa.array(full, mask=mask).cast(typ)


def _batches_table(
    b: dict[str, array],
    ev: _EventColumns,
    ts: list[float | None],
    via: array,
    pidx: array,
    nbytes: array,
    ok: list[bool],
) -> Any:
    import numpy as np
    import pyarrow as pa

    n = len(b["seq"])
    cols = [
        pa.array(np.arange(n, dtype=np.int64)),
        pa.array(_np(b["endpoint"], "int32")),
        pa.array(_np(b["rank"], "int32")),
        pa.array(_np(b["epoch"], "int32")),
        pa.array(_np(b["seq"])),
        pa.array(_np(b["recv"])),
        pa.array(ts, type=pa.float64()),
        pa.array(_np(b["nev"], "int32")),
        pa.array(ev.counts_per_batch(K_STORED)),
        pa.array(ev.counts_per_batch(K_REMOVED)),
        pa.array(ev.counts_per_batch(K_CLEARED)),
        pa.array(ev.counts_per_batch(K_UNKNOWN)),
        pa.array(_np(via, "int8")),
        pa.array(_np(pidx)),
        pa.array(_np(nbytes)),
        pa.array(ok, type=pa.bool_()),
    ]
    return pa.Table.from_arrays(cols, schema=arrow_schema("batches"))


def _events_table(ev: _EventColumns, b: dict[str, array]) -> Any:
    import numpy as np
    import pyarrow as pa

    n = ev.n
    bo = ev.batch_of
    has = ev.n_blocks > 0
    nz = np.flatnonzero(has)
    first = ev.hashes[ev.off[:-1][nz]] if len(nz) else np.zeros(0, np.int64)
    last = ev.hashes[ev.off[1:][nz] - 1] if len(nz) else np.zeros(0, np.int64)
    un_idx = np.fromiter((r[0] for r in ev.unknown), np.int64, len(ev.unknown))
    tags: list[str | None] = [None] * n
    for i, tag in ev.unknown:
        tags[i] = tag
    arrays = [
        pa.array(np.arange(n, dtype=np.int64)),
        pa.array(bo),
        pa.array(_np(b["endpoint"], "int32")[bo]),
        pa.array(_np(b["rank"], "int32")[bo]),
        pa.array(_np(b["epoch"], "int32")[bo]),
        pa.array(_np(b["seq"])[bo]),
        pa.array(ev.idx.astype(np.int32)),
        pa.array(_np(b["recv"])[bo]),
        _kind_array(ev.kind),
        pa.array(ev.medium, type=pa.string()),
        pa.array(ev.n_blocks.astype(np.int32)),
        ev.scatter(ev.st_idx, ev.st_parent, pa.int64()).view(pa.uint64()),
        ev.scatter(nz, first, pa.int64()).view(pa.uint64()),
        ev.scatter(nz, last, pa.int64()).view(pa.uint64()),
        ev.scatter(ev.st_idx, ev.st_bs, pa.int32()),
        ev.scatter(ev.st_idx, ev.st_ntok, pa.int64()),
        ev.scatter(ev.st_idx, ev.st_lora, pa.int64()),
        pa.array(tags, type=pa.string()) if len(un_idx) else pa.nulls(n, pa.string()),
    ]
    return pa.Table.from_arrays(arrays, schema=arrow_schema("events"))


def _blocks_table(ev: _EventColumns) -> Any:
    """Long-form blocks: event id, kind, position, hash, tokens in the block (vectorised)."""
    import numpy as np
    import pyarrow as pa

    bs = np.zeros(ev.n, dtype=np.int64)
    nt = np.zeros(ev.n, dtype=np.int64)
    bs[ev.st_idx] = ev.st_bs
    nt[ev.st_idx] = ev.st_ntok
    # in place where possible: every temporary here is one int64 per block (5M+ at 1M events)
    event_of = np.repeat(np.arange(ev.n, dtype=np.int64), ev.n_blocks)
    pos = np.arange(len(event_of), dtype=np.int64)
    pos -= ev.off[:-1][event_of]
    pos32 = pos.astype(np.int32)
    kinds = ev.kind[event_of]
    not_stored = kinds != K_STORED
    bs_b = bs[event_of]
    tokens = nt[event_of]
    pos *= bs_b
    tokens -= pos  # nt - pos * bs
    del pos
    np.minimum(bs_b, tokens, out=tokens)
    del bs_b
    cols = [
        pa.array(event_of),
        _kind_array(kinds),
        pa.array(pos32),
        pa.array(ev.hashes).view(pa.uint64()),
        pa.array(tokens.astype(np.int32), mask=not_stored),
    ]
    return pa.Table.from_arrays(cols, schema=arrow_schema("blocks"))


def _id_lists(chunks: list[tuple[Any, Any]]) -> Any:
    """Chunks of (flat ids, per-row lengths) -> an arrow list<int64> column (one chunk each:
    no copy of the ids) and the row lengths (one int64 array)."""
    import numpy as np
    import pyarrow as pa

    arrays = []
    for flat, lens in chunks:
        off = np.zeros(len(lens) + 1, dtype=np.int64)
        np.cumsum(lens, out=off[1:])
        arrays.append(pa.ListArray.from_arrays(pa.array(off, type=pa.int32()), pa.array(flat)))
    lens = [n for _, n in chunks]
    return (
        pa.chunked_array(arrays, type=pa.list_(pa.int64())),
        np.concatenate(lens) if lens else np.zeros(0, np.int64),
    )


class _RequestColumns:
    """Request rows (``msgspec.structs.astuple`` of RequestRecord or RequestRecordView) ->
    columns, a chunk of rows at a time: the hot loop appends to ``rows`` and calls ``flush``
    once ``len(rows) >= batch``; the chunk is transposed while its rows are still in cache.

    Token ids: views -> ``tokcols.RawIdColumns`` (numpy from the raw msgpack; raises
    ``NotInt64Arrays`` if any id is not an int64); RequestRecord lists -> ``array('q')``
    (an id beyond int64 is an ``InputError`` naming the request).
    """

    def __init__(self, bundle: Path, views: bool) -> None:
        from kvcadence.analysis.tokcols import RawIdColumns
        from kvcadence.format.schema import RequestRecord, RequestRecordView

        for cls in (RequestRecord, RequestRecordView):
            if cls.__struct_fields__[:3] != ("rid", "input_ids", "output_ids"):
                raise AssertionError("RequestRecord field order changed")  # pragma: no cover
        self.bundle = bundle
        self.names = [f for f in RequestRecord.__struct_fields__ if f not in _ID_FIELDS]
        self.cols: list[list[Any]] = [[] for _ in self.names]
        self.rows: list[tuple[Any, ...]] = []
        self.raw_ids = RawIdColumns() if views else None
        self.batch = self.raw_ids.batch if self.raw_ids is not None else 4096
        self.lists: tuple[list[tuple[Any, Any]], list[tuple[Any, Any]]] = ([], [])

    def flush(self) -> None:
        if not self.rows:
            return
        cols = list(zip(*self.rows, strict=True))
        self.rows.clear()
        if self.raw_ids is not None:
            self.raw_ids.add_chunk(cols[1], cols[2])
            self.batch = self.raw_ids.batch
        else:
            for side, ids in ((0, cols[1]), (1, cols[2])):
                flat, lens = array("q"), array("q")
                for rid, x in zip(cols[0], ids, strict=True):
                    try:
                        flat.extend(x)
                    except OverflowError:
                        raise InputError(
                            f"{self.bundle}: request {rid!r}: a token id is outside the int64 range"
                        ) from None
                    lens.append(len(x))
                self.lists[side].append((_np(flat), _np(lens)))
        for dst, col in zip(self.cols, cols[:1] + cols[3:], strict=True):
            dst.extend(col)

    def token_ids(self) -> tuple[list[tuple[Any, Any]], list[tuple[Any, Any]]]:
        """(input chunks, output chunks), each chunk (flat int64 ids, int64 row lengths)."""
        return self.raw_ids.columns() if self.raw_ids is not None else self.lists


_ID_FIELDS = ("input_ids", "output_ids")


def _requests_table(reqs: _RequestColumns) -> Any:
    """The requests table from the request columns and their token ids."""
    import msgspec
    import numpy as np
    import pyarrow as pa

    cols = dict(zip(reqs.names, reqs.cols, strict=True))
    n = len(cols["rid"])

    def col(name: str, typ: Any) -> Any:
        return pa.array(cols[name], type=typ)

    inp_ids, out_ids = reqs.token_ids()
    if n:
        inp, n_in = _id_lists(inp_ids)
        out, n_out = _id_lists(out_ids)
    else:
        inp = out = pa.array([], type=pa.list_(pa.int64()))
        n_in = n_out = np.zeros(0, np.int64)
    enc = msgspec.json.encode
    # an empty meta_info (most request sources) is "{}" without an encode call per row
    meta = pa.array([enc(m).decode() if m else "{}" for m in cols["meta_info"]], type=pa.string())
    arrays = [
        pa.array(np.arange(n, dtype=np.int64)),
        col("rid", pa.string()),
        inp,
        out,
        pa.array(n_in),
        pa.array(n_out),
        col("send_ns", pa.int64()),
        col("first_token_ns", pa.int64()),
        col("finish_ns", pa.int64()),
        col("lane", pa.int64()),
        col("session", pa.int64()),
        col("turn", pa.int64()),
        col("max_new_tokens", pa.int64()),
        col("prompt_tokens", pa.int64()),
        col("cached_tokens", pa.int64()),
        col("completion_tokens", pa.int64()),
        col("finish_reason", pa.string()),
        col("error", pa.string()),
        col("dp_rank", pa.int64()),
        col("source", pa.string()),
        col("think_ns", pa.int64()),
        col("arrival_ns", pa.int64()),
        meta,
    ]
    return pa.Table.from_arrays(arrays, schema=arrow_schema("requests"))


def _gaps_table(gaps: list[Any]) -> Any:
    import pyarrow as pa

    data = {
        "endpoint": [g.endpoint for g in gaps],
        "epoch": [g.epoch for g in gaps],
        "first_seq": [g.first_seq for g in gaps],
        "last_seq": [g.last_seq for g in gaps],
        "n_missing": [g.last_seq - g.first_seq + 1 for g in gaps],
        "recovered": [g.recovered for g in gaps],
        "reason": [g.reason for g in gaps],
        "recv_ns": [g.recv_ns for g in gaps],
    }
    return pa.Table.from_pydict(data, schema=arrow_schema("gaps"))


def _epochs_table(epochs: list[Any]) -> Any:
    import pyarrow as pa

    data = {
        "endpoint": [e.endpoint for e in epochs],
        "epoch": [e.epoch for e in epochs],
        "first_seq": [e.first_seq for e in epochs],
        "recv_ns": [e.recv_ns for e in epochs],
        "reason": [e.reason for e in epochs],
    }
    return pa.Table.from_pydict(data, schema=arrow_schema("epochs"))


def _notes_table(notes: list[Any]) -> Any:
    import msgspec
    import pyarrow as pa

    data = {
        "kind": [n.kind for n in notes],
        "recv_ns": [n.recv_ns for n in notes],
        "data": [msgspec.json.encode(n.data).decode() for n in notes],
    }
    return pa.Table.from_pydict(data, schema=arrow_schema("notes"))


def describe_tables() -> str:
    """Markdown listing of every table and column (used by docs and ``kvcadence sql --help``)."""
    lines: list[str] = []
    for table, cols in TABLES.items():
        lines.append(f"### `{table}`\n")
        lines.append("| column | type | meaning |\n|---|---|---|")
        for c, t, d in cols:
            lines.append(f"| `{c}` | {t} | {d} |")
        lines.append("")
    return "\n".join(lines)


__all__ = [
    "TABLES",
    "KINDS",
    "INGEST_VERSION",
    "Ingested",
    "arrow_schema",
    "build_tables",
    "describe_tables",
    "fingerprint",
    "ingest",
    "InputError",
]
