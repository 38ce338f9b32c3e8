"""Request page hashes: SGLang's chained block hash of every full page of each request's token
chain, computed once per bundle and page size and cached next to the ingest tables.

A request's chain is ``input_ids + output_ids[:-1]`` (what SGLang caches at finish; see
``docs/metrics.md``); its page hashes come from ``kvcadence.format.wire``'s
``block_digests`` (the one implementation of SGLang's hash), fed with uint32 token buffers
built in bulk with numpy. A request whose tokens are not all plain uint32 is hashed from its
Python list (the wide / error path of ``wire``). Consecutive requests of one ``(lane,
session)`` usually extend the previous turn: when the previous request's chain is a whole-page
prefix of this one, its digests are reused and only the new pages are hashed (chained from
the last shared digest), so a multi-turn agent capture costs one hash per distinct page.

The requests are read ``BATCH_ROWS`` rows at a time (never the whole token columns: only
the page hashes, 8 bytes a page, are kept), each batch's pages appended to the cache as it
is hashed; the session reuse carries over batches (``hash_requests``'s ``last``).

The result is cached as ``<cache>/request_pages-ps<N>.parquet`` (``request_id``, ``page``,
``hash`` uint64); the ingest cache rebuild (a new fingerprint) replaces the whole directory,
so a stale cache cannot survive a changed bundle.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvcadence.analysis.cache import Ingested
from kvcadence.format import wire

_I64_BITS = "int64"
#: requests hashed per batch (their token ids are what a batch holds)
BATCH_ROWS = 8192


@dataclass
class RequestPages:
    """Page hashes of every request (request order = ``requests.request_id``).

    ``hashes[offsets[r]:offsets[r + 1]]`` are request ``r``'s page hashes as int64 bit
    patterns (``blocks.hash`` viewed as int64 compares equal).
    """

    page_size: int
    offsets: Any  # numpy int64, n + 1
    hashes: Any  # numpy int64

    @property
    def n(self) -> int:
        return len(self.offsets) - 1

    def chain(self, r: int) -> list[int]:
        chain: list[int] = self.hashes[self.offsets[r] : self.offsets[r + 1]].tolist()
        return chain


def cache_path(ing: Ingested, page_size: int) -> Path:
    return ing.dir / f"request_pages-ps{int(page_size)}.parquet"


def load(ing: Ingested, con: Any, page_size: int) -> RequestPages:
    """The request page hashes of ``ing`` (from the cache, else computed and cached)."""
    import numpy as np
    import pyarrow.parquet as pq

    ps = max(1, int(page_size))
    path = cache_path(ing, ps)
    if path.exists():
        try:
            t = pq.read_table(path, columns=["request_id", "hash"])
        except (OSError, ValueError):
            t = None
        if t is not None:
            rid = t.column("request_id").to_numpy()
            n = int(ing.manifest.get("tables", {}).get("requests", -1))
            if n >= 0:
                offsets = np.zeros(n + 1, dtype=np.int64)
                np.cumsum(np.bincount(rid, minlength=n)[:n], out=offsets[1:])
                hashes = t.column("hash").cast("uint64").to_numpy().view(np.int64)
                return RequestPages(ps, offsets, hashes)
    tmp = path.with_name(f"{path.name}.tmp-{os.getpid()}")
    try:
        pages = compute(con, ps, tmp)
    except OSError:  # a read-only cache: just don't cache
        tmp.unlink(missing_ok=True)
        return compute(con, ps)
    try:
        os.replace(tmp, path)
    except OSError:
        tmp.unlink(missing_ok=True)
    return pages


def ensure_file(ing: Ingested, con: Any, page_size: int) -> Path | None:
    """The cache file of ``ing``'s request page hashes, written (streamed: no page hash is
    kept in memory) when missing or unreadable; None when it cannot be written (a read-only
    cache: the caller falls back to ``load``)."""
    import pyarrow.parquet as pq

    ps = max(1, int(page_size))
    path = cache_path(ing, ps)
    if path.exists():
        try:
            pq.ParquetFile(path).close()
            return path
        except (OSError, ValueError):
            pass
    tmp = path.with_name(f"{path.name}.tmp-{os.getpid()}")
    try:
        compute(con, ps, tmp, keep=False)
        os.replace(tmp, path)
    except OSError:
        tmp.unlink(missing_ok=True)
        return None
    return path


def relation(path: Path) -> str:
    """A DuckDB relation (``SELECT``) over the cache file ``path``."""
    return "SELECT request_id, page, hash FROM read_parquet('{}')".format(
        str(path).replace("'", "''")
    )


class _PageWriter:
    """The cache file, a batch of requests' pages at a time (``request_id``, ``page``,
    ``hash``)."""

    def __init__(self, path: Path) -> None:
        import pyarrow as pa
        import pyarrow.parquet as pq

        schema = pa.schema(
            [("request_id", pa.int64()), ("page", pa.int32()), ("hash", pa.uint64())]
        )
        self.schema = schema
        self.w = pq.ParquetWriter(path, schema, compression="lz4")

    def write(self, first_row: int, offsets: Any, hashes: Any) -> None:
        import numpy as np
        import pyarrow as pa

        counts = np.diff(offsets)
        rid = np.repeat(np.arange(len(counts), dtype=np.int64), counts)
        page = np.arange(len(rid), dtype=np.int64) - offsets[:-1][rid]
        rid += first_row
        cols = [pa.array(rid), pa.array(page.astype(np.int32)), pa.array(hashes).view(pa.uint64())]
        self.w.write_table(pa.Table.from_arrays(cols, schema=self.schema))

    def close(self) -> None:
        self.w.close()


_QUERY = "SELECT request_id, input_ids, output_ids, lane, session FROM requests"


def compute(con: Any, page_size: int, cache: Path | None = None, keep: bool = True) -> RequestPages:
    """Hash every request's chain (see module docstring) from a ``sql.connect`` connection,
    ``BATCH_ROWS`` requests at a time; ``cache``: also write the pages there (Parquet).
    ``keep=False``: only write them (the result then holds the offsets and no hashes)."""

    ps = max(1, int(page_size))
    # no ORDER BY: the scan keeps file order (= request_id; DuckDB preserve_insertion_order),
    # and sorting 45M tokens' lists doubled the read; the order is checked instead (DuckDB
    # sorts, out of core, if it ever is not)
    for query in (_QUERY, _QUERY + " ORDER BY request_id"):
        writer = _PageWriter(cache) if cache is not None else None
        try:
            got = _hash_batches(con.sql(query).to_arrow_reader(BATCH_ROWS), ps, writer, keep)
        finally:
            if writer is not None:
                writer.close()
        if got is not None:
            return RequestPages(ps, *got)
    raise AssertionError("requests ordered by request_id are out of order")  # pragma: no cover


def _hash_batches(
    batches: Any, ps: int, writer: _PageWriter | None, keep: bool = True
) -> tuple[Any, Any] | None:
    """(page offsets, hashes) of the requests in ``batches``; None if their request ids are
    not increasing (the caller reads them sorted)."""
    import numpy as np

    counts: list[Any] = [np.zeros(1, dtype=np.int64)]
    hashes: list[Any] = []
    last: dict[tuple[Any, Any], tuple[int, Any, list[bytes]]] = {}
    prev_rid = -1
    rows = 0
    for b in batches:
        if b.num_rows == 0:
            continue
        rid = b.column("request_id").to_numpy()
        if rid[0] <= prev_rid or not (rid[1:] > rid[:-1]).all():
            return None
        prev_rid = int(rid[-1])
        iv, io = _flat(b.column("input_ids"))
        ov, oo = _flat(b.column("output_ids"))
        lane = b.column("lane").to_pylist()
        session = b.column("session").to_pylist()
        off, h = hash_requests(iv, io, ov, oo, ps, lane, session, last)
        if writer is not None:
            writer.write(rows, off, h)
        counts.append(np.diff(off))
        if keep:
            hashes.append(h)
        rows += b.num_rows
    offsets = np.cumsum(np.concatenate(counts))
    return offsets, (np.concatenate(hashes) if hashes else np.zeros(0, dtype=np.int64))


def _flat(col: Any) -> tuple[Any, Any]:
    """A list<int64> column (Array or ChunkedArray, no nulls) as (flat int64 values, offsets
    from 0), with one copy of the values (no ``combine_chunks``)."""
    import numpy as np
    import pyarrow.compute as pc

    lens = pc.list_value_length(col).to_numpy(zero_copy_only=False).astype(np.int64)
    off = np.zeros(len(lens) + 1, dtype=np.int64)
    np.cumsum(lens, out=off[1:])
    vals = pc.list_flatten(col)
    vals = vals.to_numpy() if hasattr(vals, "chunks") else vals.to_numpy(zero_copy_only=False)
    return np.asarray(vals, dtype=np.int64), off


def hash_requests(
    iv: Any,
    io: Any,
    ov: Any,
    oo: Any,
    ps: int,
    lane: list[Any],
    session: list[Any],
    last: dict[tuple[Any, Any], tuple[int, Any, list[bytes]]] | None = None,
) -> tuple[Any, Any]:
    """(page offsets, int64 hashes) of every row's chain ``input + output[:-1]``, given the
    flat input/output token arrays and their offsets (see the module docstring).
    ``last``: ``(lane, session)`` -> (pages, tokens, digests) of the session's latest row
    with pages, carried from batch to batch (updated here)."""
    from array import array
    from itertools import chain

    import numpy as np

    n = len(io) - 1
    n_in = np.diff(io)
    n_out = np.maximum(np.diff(oo) - 1, 0)
    n_pages = (n_in + n_out) // ps
    page_off = np.zeros(n + 1, dtype=np.int64)
    np.cumsum(n_pages, out=page_off[1:])

    def u32(vals: Any, offs: Any) -> tuple[memoryview, list[bool]]:
        bad = np.zeros(n, dtype=bool)
        if len(vals) and (vals.min() < 0 or vals.max() >= 1 << 32):
            plain = (vals >= 0) & (vals < (1 << 32))
            # wide or invalid tokens: those rows go through Python lists
            bad[np.searchsorted(offs, np.flatnonzero(~plain), "right") - 1] = True
            vals = np.where(plain, vals, 0)
        # uint32 in native order (what array("I") holds), as raw bytes: 4 per token
        return memoryview(vals.astype(np.uint32)).cast("B"), bad.tolist()

    in_mv, in_bad = u32(iv, io)
    out_mv, out_bad = u32(ov, oo)
    wide = array("I").itemsize != 4  # pragma: no branch - no such platform in use
    digests: list[list[bytes]] = [[] for _ in range(n)]
    iol, ool, nil, npl = io.tolist(), oo.tolist(), n_in.tolist(), n_pages.tolist()
    keyed = [la is not None or se is not None for la, se in zip(lane, session, strict=True)]
    if last is None:
        last = {}
    block_digests = wire.block_digests
    for r in np.flatnonzero(n_pages).tolist():
        k = npl[r]
        nt = k * ps
        ni = nil[r]
        if wide or in_bad[r] or out_bad[r]:
            toks: Any = (iv[iol[r] : iol[r] + ni].tolist() + ov[ool[r] : ool[r + 1]].tolist())[:nt]
        else:
            toks = array("I")
            a = iol[r]
            toks.frombytes(in_mv[4 * a : 4 * (a + min(ni, nt))])
            if nt > ni:
                b = ool[r]
                toks.frombytes(out_mv[4 * b : 4 * (b + nt - ni)])
        start = 0  # leading pages shared with the session's previous row
        key = None
        if keyed[r]:
            key = (lane[r], session[r])
            prev = last.get(key)
            if prev is not None:
                qk, qt, qd = prev
                m = min(qk, k)
                if m and qt[: m * ps] == toks[: m * ps]:  # a whole-prefix match (next turn)
                    start = m
                    digests[r] = qd[:m]
        if start < k:
            parent = digests[r][start - 1] if start else None
            got = block_digests(toks[start * ps :] if start else toks, ps, parent_digest=parent)
            if start:
                digests[r].extend(got)
            else:
                digests[r] = got
        if key is not None:
            last[key] = (k, toks, digests[r])
    joined = b"".join(chain.from_iterable(digests))
    hashes = np.frombuffer(joined, dtype=">i8")[::4].astype(np.int64)
    return page_off, hashes
