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

The result is cached as ``<cache>/request_pages-ps<N>.parquet`` (``request_id``, ``page``,
``hash`` uint64); the ingest cache rebuild (a new fingerprint) replaces the whole directory,
so a stale cache cannot survive a changed bundle.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvcadence.analysis import sql
from kvcadence.analysis.cache import Ingested
from kvcadence.format import wire

_I64_BITS = "int64"


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
    pages = compute(con, ps)
    _write(pages, path)
    return pages


def _write(pages: RequestPages, path: Path) -> None:
    import numpy as np
    import pyarrow as pa
    import pyarrow.parquet as pq

    counts = np.diff(pages.offsets)
    rid = np.repeat(np.arange(pages.n, dtype=np.int64), counts)
    page = np.arange(len(rid), dtype=np.int64) - pages.offsets[:-1][rid]
    table = pa.table(
        {
            "request_id": pa.array(rid),
            "page": pa.array(page.astype(np.int32)),
            "hash": pa.array(pages.hashes).view(pa.uint64()),
        }
    )
    tmp = path.with_name(f"{path.name}.tmp-{os.getpid()}")
    try:
        pq.write_table(table, tmp, compression="lz4")
        os.replace(tmp, path)
    except OSError:  # a read-only cache: just don't cache
        tmp.unlink(missing_ok=True)


def compute(con: Any, page_size: int) -> RequestPages:
    """Hash every request's chain (see module docstring) from a ``sql.connect`` connection."""
    import numpy as np

    ps = max(1, int(page_size))
    # no ORDER BY: the scan keeps file order (= request_id; DuckDB preserve_insertion_order),
    # and sorting 45M tokens' lists doubled the read; the order is checked instead
    t = sql.arrow(con, "SELECT request_id, input_ids, output_ids, lane, session FROM requests")
    rid = t.column("request_id").to_numpy()
    if len(rid) and not (rid[1:] > rid[:-1]).all():
        t = t.take(np.argsort(rid, kind="stable"))
    if t.num_rows == 0:
        return RequestPages(ps, np.zeros(1, dtype=np.int64), np.zeros(0, dtype=np.int64))
    iv, io = _flat(t.column("input_ids"))
    ov, oo = _flat(t.column("output_ids"))
    lane = t.column("lane").to_pylist()
    session = t.column("session").to_pylist()
    return RequestPages(ps, *hash_requests(iv, io, ov, oo, ps, lane, session))


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
    iv: Any, io: Any, ov: Any, oo: Any, ps: int, lane: list[Any], session: list[Any]
) -> tuple[Any, Any]:
    """(page offsets, int64 hashes) of every row's chain ``input + output[:-1]``, given the
    flat input/output token arrays and their offsets (see the module docstring)."""
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
    last: dict[tuple[Any, Any], tuple[int, Any]] = {}  # (lane, session) -> (row, tokens)
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
        if keyed[r]:
            key = (lane[r], session[r])
            prev = last.get(key)
            last[key] = (r, toks)
            if prev is not None:
                q, qt = prev
                m = min(npl[q], k)
                if m and qt[: m * ps] == toks[: m * ps]:  # a whole-prefix match (next turn)
                    start = m
                    digests[r] = digests[q][:m]
        if start == k:
            continue
        parent = digests[r][start - 1] if start else None
        got = block_digests(toks[start * ps :] if start else toks, ps, parent_digest=parent)
        if start:
            digests[r].extend(got)
        else:
            digests[r] = got
    joined = b"".join(chain.from_iterable(digests))
    hashes = np.frombuffer(joined, dtype=">i8")[::4].astype(np.int64)
    return page_off, hashes
