"""Bundle -> Parquet: the ONE dict of Parquet table schemas and the column-wise ingest.

``ingest(bundle)`` reads a bundle through ``kvcadence.capture.bundle.BundleReader``, decodes
each KV-event payload once with ``kvcadence.capture.wire.decode_batch``, flattens everything
straight into ``array('q')``/list columns (never keeping the decoded structs: the GC trap of
engineering-notes §2.4) and writes one Parquet file per table with pyarrow:

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

import gc
import json
import os
import shutil
import time
from array import array
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvcadence.errors import InputError, UsageError

INGEST_VERSION = 1
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
    cache = Path(out) if out is not None else bundle / CACHE_DIRNAME
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
    tmp = cache.with_name(f"{cache.name}.tmp-{os.getpid()}")
    try:
        if tmp.exists():
            shutil.rmtree(tmp)
        tmp.mkdir(parents=True)
        for name, table in tables.items():
            pq.write_table(table, tmp / f"{name}.parquet", compression="zstd")
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


def build_tables(bundle: Path) -> tuple[dict[str, Any], dict[str, Any]]:
    """Read ``bundle`` once; return ({table name: pyarrow.Table}, info dict)."""
    from kvcadence.capture import bundle as kbundle
    from kvcadence.capture import schema as S
    from kvcadence.capture import wire
    from kvcadence.errors import BundleError, WireError

    try:
        reader = kbundle.BundleReader(bundle)
    except BundleError:
        raise
    except FileNotFoundError as exc:
        raise UsageError(f"not a bundle: {bundle}: {exc}") from None

    header = reader.header
    info = _header_info(header)
    ep_rank = {e.id: e.dp_rank for e in header.endpoints}

    # batches
    b_endpoint, b_rank, b_epoch, b_seq, b_recv = (array("q") for _ in range(5))
    b_ts: list[float | None] = []
    b_nev, b_nst, b_nrm, b_ncl, b_nun = (array("q") for _ in range(5))
    b_via, b_pass, b_bytes = array("q"), array("q"), array("q")
    b_ok: list[bool] = []
    # events: one tuple per event, transposed once at the end (far cheaper than 12 appends)
    ev_rows: list[tuple[Any, ...]] = []
    # blocks: every hash of every event, flat; offsets come from the n_blocks column
    k_hash = array("q")
    requests: list[Any] = []
    gaps: list[Any] = []
    epochs: list[Any] = []
    notes: list[Any] = []
    trailer: Any = None

    seen: set[tuple[int, int, int]] = set()
    duplicates = 0
    undecodable = 0
    unknown_events = 0
    n_frames = 0
    payload_total = 0

    Stored, Removed, Cleared = S.BlockStored, S.BlockRemoved, S.AllBlocksCleared
    decode = wire.decode_batch
    payload_of = kbundle.event_payload
    gc_was = gc.isenabled()
    gc.disable()
    try:
        for rec in reader.records():
            if isinstance(rec, S.EventFrame):
                n_frames += 1
                key = (rec.endpoint, rec.epoch, rec.seq)
                if key in seen:
                    duplicates += 1
                    continue
                seen.add(key)
                payload = payload_of(rec)
                payload_total += len(payload)
                batch_id = len(b_seq)
                try:
                    batch = decode(payload)
                    evs = batch.events
                    ts: float | None = batch.ts
                    ok = True
                except WireError:
                    evs, ts, ok = [], None, False
                    undecodable += 1
                    batch = None
                rank = ep_rank.get(rec.endpoint)
                if rank is None:
                    rank = batch.attn_dp_rank if batch is not None else None
                    rank = rank if rank is not None else 0
                nst = nrm = ncl = nun = 0
                add_row = ev_rows.append
                for idx, ev in enumerate(evs):
                    t = type(ev)
                    if t is Stored:
                        nst += 1
                        hs = ev.block_hashes
                        n = len(hs)
                        add_row(
                            (
                                batch_id,
                                idx,
                                K_STORED,
                                ev.medium,
                                ev.parent_block_hash,
                                ev.block_size,
                                len(ev.token_ids),
                                ev.lora_id,
                                None,
                                n,
                                hs[0] if n else None,
                                hs[-1] if n else None,
                            )
                        )
                        k_hash.extend(hs)
                    elif t is Removed:
                        nrm += 1
                        hs = ev.block_hashes
                        n = len(hs)
                        add_row(
                            (
                                batch_id,
                                idx,
                                K_REMOVED,
                                ev.medium,
                                None,
                                None,
                                None,
                                None,
                                None,
                                n,
                                hs[0] if n else None,
                                hs[-1] if n else None,
                            )
                        )
                        k_hash.extend(hs)
                    elif t is Cleared:
                        ncl += 1
                        add_row(
                            (
                                batch_id,
                                idx,
                                K_CLEARED,
                                None,
                                None,
                                None,
                                None,
                                None,
                                None,
                                0,
                                None,
                                None,
                            )
                        )
                    else:
                        nun += 1
                        tag = str(getattr(ev, "tag", type(ev).__name__))
                        add_row(
                            (
                                batch_id,
                                idx,
                                K_UNKNOWN,
                                None,
                                None,
                                None,
                                None,
                                None,
                                tag,
                                0,
                                None,
                                None,
                            )
                        )
                nev = len(evs)
                unknown_events += nun
                b_endpoint.append(rec.endpoint)
                b_rank.append(rank)
                b_epoch.append(rec.epoch)
                b_seq.append(rec.seq)
                b_recv.append(rec.recv_ns)
                b_ts.append(ts)
                b_nev.append(nev)
                b_nst.append(nst)
                b_nrm.append(nrm)
                b_ncl.append(ncl)
                b_nun.append(nun)
                b_via.append(rec.via)
                b_pass.append(rec.pass_index)
                b_bytes.append(len(payload))
                b_ok.append(ok)
            elif isinstance(rec, S.RequestRecord):
                requests.append(rec)
            elif isinstance(rec, S.Gap):
                gaps.append(rec)
            elif isinstance(rec, S.Epoch):
                epochs.append(rec)
            elif isinstance(rec, S.Annotation):
                notes.append(rec)
            elif isinstance(rec, S.Trailer):
                trailer = rec
    finally:
        if gc_was:
            gc.enable()

    rep = reader.report
    corrupt = list(getattr(rep, "corrupt", []) or [])
    info.update(
        {
            "frames": n_frames,
            "messages": len(b_seq),
            "duplicates": duplicates,
            "undecodable_payloads": undecodable,
            "unknown_events": unknown_events,
            "payload_bytes": payload_total,
            "torn_bytes": int(getattr(rep, "torn_bytes", 0) or 0),
            "corrupt_frames": len(corrupt),
            "corrupt": [list(c) if isinstance(c, (tuple, list)) else str(c) for c in corrupt],
            "unknown_records": _count(getattr(rep, "unknown_records", 0)),
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
    if info["page_size"] is None:
        sizes = [r[5] for r in ev_rows if r[5] is not None]
        info["page_size"] = max(set(sizes), key=sizes.count) if sizes else None

    tables = {
        "batches": _batches_table(
            b_endpoint,
            b_rank,
            b_epoch,
            b_seq,
            b_recv,
            b_ts,
            b_nev,
            b_nst,
            b_nrm,
            b_ncl,
            b_nun,
            b_via,
            b_pass,
            b_bytes,
            b_ok,
        ),
        "events": _events_table(ev_rows, b_endpoint, b_rank, b_epoch, b_seq, b_recv, b_nev),
        "blocks": _blocks_table(k_hash, ev_rows),
        "requests": _requests_table(requests),
        "gaps": _gaps_table(gaps),
        "epochs": _epochs_table(epochs),
        "notes": _notes_table(notes),
    }
    if not len(b_seq) and not requests:
        # An empty bundle is legal (nothing captured); the tables are simply empty.
        pass
    return tables, info


def _count(x: Any) -> int:
    if isinstance(x, int):
        return x
    try:
        return len(x)
    except TypeError:
        return 0


def _np(a: array, dtype: str = "int64") -> Any:
    import numpy as np

    return np.frombuffer(a, dtype=np.int64 if a.typecode == "q" else np.int8).astype(
        dtype, copy=False
    )


def _hashes(values: list[int | None]) -> Any:
    """Signed int64 Python ints (or None) -> uint64 arrow array (same bits = wire.u64)."""
    import pyarrow as pa

    return pa.array(values, type=pa.int64()).view(pa.uint64())


def _kind_array(codes: Any) -> Any:
    import pyarrow as pa

    return pa.DictionaryArray.from_arrays(
        pa.array(codes, type=pa.int8()), pa.array(list(KINDS), type=pa.string())
    )


def _batches_table(
    endpoint, rank, epoch, seq, recv, ts, nev, nst, nrm, ncl, nun, via, pidx, nbytes, ok
) -> Any:  # noqa: ANN001
    import pyarrow as pa

    n = len(seq)
    cols = [
        pa.array(range(n), type=pa.int64()),
        pa.array(_np(endpoint, "int32")),
        pa.array(_np(rank, "int32")),
        pa.array(_np(epoch, "int32")),
        pa.array(_np(seq)),
        pa.array(_np(recv)),
        pa.array(ts, type=pa.float64()),
        pa.array(_np(nev, "int32")),
        pa.array(_np(nst, "int32")),
        pa.array(_np(nrm, "int32")),
        pa.array(_np(ncl, "int32")),
        pa.array(_np(nun, "int32")),
        pa.array(_np(via, "int8")),
        pa.array(_np(pidx)),
        pa.array(_np(nbytes)),
        pa.array(ok, type=pa.bool_()),
    ]
    return pa.Table.from_arrays(cols, schema=arrow_schema("batches"))


def _events_table(
    rows: list[tuple[Any, ...]],
    endpoint: array,
    rank: array,
    epoch: array,
    seq: array,
    recv: array,
    nev: array,
) -> Any:
    import numpy as np
    import pyarrow as pa

    n = len(rows)
    cols = list(zip(*rows, strict=False)) if n else [()] * 12
    per = _np(nev)

    def rep(a: array, dtype: str = "int64") -> Any:
        return pa.array(np.repeat(_np(a), per).astype(dtype, copy=False))

    arrays = [
        pa.array(np.arange(n, dtype=np.int64)),
        pa.array(np.fromiter(cols[0], np.int64, n)),
        rep(endpoint, "int32"),
        rep(rank, "int32"),
        rep(epoch, "int32"),
        rep(seq),
        pa.array(np.fromiter(cols[1], np.int32, n)),
        rep(recv),
        _kind_array(np.fromiter(cols[2], np.int8, n)),
        pa.array(cols[3], type=pa.string()),
        pa.array(np.fromiter(cols[9], np.int32, n)),
        _hashes(cols[4]),
        _hashes(cols[10]),
        _hashes(cols[11]),
        pa.array(cols[5], type=pa.int32()),
        pa.array(cols[6], type=pa.int64()),
        pa.array(cols[7], type=pa.int64()),
        pa.array(cols[8], type=pa.string()),
    ]
    return pa.Table.from_arrays(arrays, schema=arrow_schema("events"))


def _blocks_table(hashes: array, rows: list[tuple[Any, ...]]) -> Any:
    """Long-form blocks: event id, kind, position, hash, tokens in the block (vectorised)."""
    import numpy as np
    import pyarrow as pa

    n = len(rows)
    counts = np.fromiter((r[9] for r in rows), np.int64, n)
    kind = np.fromiter((r[2] for r in rows), np.int8, n)
    bs = np.fromiter((r[5] or 0 for r in rows), np.int64, n)
    nt = np.fromiter((r[6] or 0 for r in rows), np.int64, n)
    off = np.zeros(n + 1, dtype=np.int64)
    np.cumsum(counts, out=off[1:])
    event_of = np.repeat(np.arange(n, dtype=np.int64), counts)
    pos = np.arange(len(event_of), dtype=np.int64) - off[:-1][event_of]
    kinds = kind[event_of]
    stored = kinds == K_STORED
    bs_b = bs[event_of]
    tokens = np.minimum(bs_b, nt[event_of] - pos * bs_b)
    cols = [
        pa.array(event_of),
        _kind_array(kinds),
        pa.array(pos.astype(np.int32)),
        pa.array(_np(hashes)).view(pa.uint64()),
        pa.array(tokens.astype(np.int32), mask=~stored),
    ]
    return pa.Table.from_arrays(cols, schema=arrow_schema("blocks"))


def _requests_table(reqs: list[Any]) -> Any:
    import msgspec
    import numpy as np
    import pyarrow as pa

    def ids_col(attr: str) -> tuple[Any, array]:
        flat = array("q")
        off = array("q", [0])
        lens = array("q")
        for r in reqs:
            ids = getattr(r, attr)
            flat.extend(ids)
            off.append(len(flat))
            lens.append(len(ids))
        values = pa.array(_np(flat))
        return pa.ListArray.from_arrays(pa.array(_np(off), type=pa.int32()), values), lens

    inp, n_in = ids_col("input_ids")
    out, n_out = ids_col("output_ids")

    def col(attr: str, typ: Any) -> Any:
        return pa.array([getattr(r, attr) for r in reqs], type=typ)

    enc = msgspec.json.Encoder()
    cols = [
        pa.array(np.arange(len(reqs), dtype=np.int64)),
        col("rid", pa.string()),
        inp,
        out,
        pa.array(_np(n_in)),
        pa.array(_np(n_out)),
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
        pa.array([enc.encode(r.meta_info).decode() for r in reqs], type=pa.string()),
    ]
    return pa.Table.from_arrays(cols, schema=arrow_schema("requests"))


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
