"""Request page hashes: SGLang's chained block hash of every full page of each request's token
chain, computed once per bundle and page size and cached next to the ingest tables.

A request's chain is ``input_ids + output_ids[:-1]`` (what SGLang caches at finish; see
``docs/metrics.md``), cut to whole pages, read from the bundle's request records as the
ingest read them (``chainsrc.bundle_batches``: a packed request's ids are the reader's uint32 arrays
rebuilt from the prefix it shares, not a token column of the Parquet cache, which shares
none: at production size that column was most of the cache); its page hashes come from
``kvcadence.format.wire`` (``root_chains`` / ``block_digests``: the one implementation of
SGLang's hash), fed with one uint32 buffer of a batch's pages built with numpy: the requests
hashed from the root are hashed in one pass over it, with no per-request Python call. A
request whose tokens are not all plain uint32 is hashed from its Python list (the wide /
error path of ``wire``). Consecutive requests of one ``(lane,
session)`` usually extend the previous turn: when the previous request's chain is a whole-page
prefix of this one, its digests are reused and only the new pages are hashed (chained from
the last shared digest), so a multi-turn agent capture costs one hash per distinct page. A
request with no such turn -- every request of a production capture (SGLang's metrics files
have no lanes or sessions), a session's first turn -- is matched by content instead: the
longest of the latest ``HEAD_CANDIDATES`` requests that start with the same ``HEAD_TOKENS``
tokens whose chain is a whole-page prefix of its own (or it of theirs), this batch's or
carried from earlier ones (``Recent``). Digests are a function of the tokens alone, so either
reuse gives the hashes hashing from the root would (production-like agent traffic, 300
requests of ~4.6k tokens at page size 1: 0.2 s against 1.3 s).

The requests are read a batch at a time (never every request's tokens: only the page
hashes, 8 bytes a page, are kept): ``BATCH_ROWS`` rows, fewer when the longest request
(``n_input + n_output``) would put more than ``BATCH_TOKENS`` token ids in a batch (100k-token
prompts: 167 rows, not 8,192 -- 3.3 GB of ids) or more than ``BATCH_PAGES`` pages (their
32-byte digests: at page size 1 a page a token), each batch's pages appended to the cache as
it is hashed; the session reuse carries over batches (``Carry``: each session's latest chain
and digests, the least recently used sessions dropped beyond ``CARRY_BYTES``, so it does not
grow with the capture's sessions). A batch's root chains are shared among processes, one per
CPU (``kvcadence.analysis.hashpool``).

What is kept: a request's pages from ``keep_from`` on -- its cached prefix's pages are left
out (``cached_tokens // page_size``: pages that were in the tree when it came, which it
cannot have stored; the attribution looks only at the pages past them), its last prompt page
always kept (the visibility's prompt end). A multi-turn capture's prompts repeat the
previous turn's context: at production size (3,000 agent requests, contexts up to 100k
tokens, page size 1) every page of every chain was 146M rows, a 1.17 GB cache per bundle and
6.2 GB peak for the report; the pages past the cached prefixes are a few percent of them.
``full=True`` keeps every page (the peer-compatible attribution's "a page of any prompt"
needs every prompt page; a separate cache file).

The result is cached as ``<cache>/request_pages-ps<N>.parquet`` (``request_id``, ``page``,
``hash`` uint64; ``-full`` before the suffix: every page); the ingest cache rebuild (a new
fingerprint) replaces the whole directory, so a stale cache cannot survive a changed bundle.
A cache written before the pages were cut (every page) is read as it is: a superset.
Read from the cache besides: ``page_ends`` (per request, its last prompt page's and last
chain page's hashes: the visibility's lookups) and ``chains`` (the drill-down's few requests,
every page, hashed for them alone).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvcadence.analysis import sql
from kvcadence.analysis.batchhash import hash_requests
from kvcadence.analysis.cache import Ingested
from kvcadence.analysis.chainsrc import (
    ORDERED,
    Unordered,
    bundle_batches,
    bundle_chains,
    parquet_batches,
)
from kvcadence.analysis.hashpool import ChainHasher
from kvcadence.analysis.pagereuse import Carry, Recent

_I64_BITS = "int64"
#: requests hashed per batch (their token ids are what a batch holds)
BATCH_ROWS = 8192
#: token ids one batch holds at most (the longest request decides the rows): 64 MB as uint32
BATCH_TOKENS = 1 << 24
#: pages one batch hashes at most: their 32-byte digests are 64 MB (at page size 1 a page is
#: a token, and the digests, not the ids, were most of a batch: 0.5 GB at ``BATCH_TOKENS``)
BATCH_PAGES = 1 << 21


def batch_rows(con: Any, page_size: int = 1) -> int:
    """Rows per batch: ``BATCH_ROWS``, fewer where the longest request's tokens times the
    rows would pass ``BATCH_TOKENS``, or its pages (at ``page_size``) ``BATCH_PAGES`` (read
    from the scalar length columns, not the ids)."""
    ((longest,),) = con.sql("SELECT coalesce(max(n_input + n_output), 0) FROM requests").fetchall()
    longest = max(int(longest), 1)
    pages = max(longest // max(1, int(page_size)), 1)
    return max(1, min(BATCH_ROWS, BATCH_TOKENS // longest, BATCH_PAGES // pages))


@dataclass
class RequestPages:
    """Page hashes of every request (request order = ``requests.request_id``), each from its
    first kept page (``keep_from``; 0 for every request when computed ``full``).

    ``hashes[offsets[r]:offsets[r + 1]]`` are request ``r``'s page hashes from page
    ``starts[r]`` on, as int64 bit patterns (``blocks.hash`` viewed as int64 compares equal).
    """

    page_size: int
    offsets: Any  # numpy int64, n + 1
    hashes: Any  # numpy int64
    starts: Any = None  # numpy int64, n (None: every request from page 0)

    def __post_init__(self) -> None:
        if self.starts is None:
            import numpy as np

            self.starts = np.zeros(len(self.offsets) - 1, dtype=np.int64)

    @property
    def n(self) -> int:
        return len(self.offsets) - 1

    def chain(self, r: int) -> list[int]:
        """Request ``r``'s page hashes from page ``starts[r]`` on."""
        chain: list[int] = self.hashes[self.offsets[r] : self.offsets[r + 1]].tolist()
        return chain


def cache_path(ing: Ingested, page_size: int, full: bool = False) -> Path:
    return ing.dir / f"request_pages-ps{int(page_size)}{'-full' if full else ''}.parquet"


def keep_from(con: Any, page_size: int) -> Any:
    """Per request (``request_id`` order, numpy int64): its first page the cache keeps --
    its cached prefix's page count (``cached_tokens // page_size``, 0 when unknown: the
    attribution's ``first``), at most its last prompt page (``n_input // page_size - 1``,
    kept for the visibility), never below 0."""
    import numpy as np

    ps = max(1, int(page_size))
    got = con.sql(
        f"SELECT greatest(least(floor(coalesce(cached_tokens, 0) / {ps})::BIGINT, "
        f"n_input // {ps} - 1), 0) FROM requests ORDER BY request_id"
    ).fetchnumpy()
    return np.asarray(next(iter(got.values())), dtype=np.int64)


def load(ing: Ingested, con: Any, page_size: int, full: bool = False) -> RequestPages:
    """The request page hashes of ``ing`` (from the cache, else computed and cached); every
    page of every request with ``full``, else each from its ``keep_from``."""
    import numpy as np
    import pyarrow.parquet as pq

    ps = max(1, int(page_size))
    path = cache_path(ing, ps, full)
    if path.exists():
        try:
            t = pq.read_table(path, columns=["request_id", "page", "hash"])
        except (OSError, ValueError):
            t = None
        if t is not None:
            rid = t.column("request_id").to_numpy()
            n = int(ing.manifest.get("tables", {}).get("requests", -1))
            if n >= 0:
                counts = np.bincount(rid, minlength=n)[:n]
                offsets = np.zeros(n + 1, dtype=np.int64)
                np.cumsum(counts, out=offsets[1:])
                page = t.column("page").to_numpy()
                starts = np.zeros(n, dtype=np.int64)
                some = counts > 0
                starts[some] = page[offsets[:-1][some]]
                hashes = t.column("hash").cast("uint64").to_numpy().view(np.int64)
                return RequestPages(ps, offsets, hashes, starts)
    tmp = path.with_name(f"{path.name}.tmp-{os.getpid()}")
    try:
        pages = compute(ing, con, ps, tmp, full=full)
    except OSError:  # a read-only cache: just don't cache
        tmp.unlink(missing_ok=True)
        return compute(ing, con, ps, full=full)
    try:
        os.replace(tmp, path)
    except OSError:
        tmp.unlink(missing_ok=True)
    return pages


def ensure_file(ing: Ingested, con: Any, page_size: int, full: bool = False) -> Path | None:
    """The cache file of ``ing``'s request page hashes (every page with ``full``, else each
    request's from its ``keep_from``), written (streamed: no page hash is kept in memory)
    when missing or unreadable; None when it cannot be written (a read-only cache: the
    caller falls back to ``load``)."""
    import pyarrow.parquet as pq

    ps = max(1, int(page_size))
    path = cache_path(ing, ps, full)
    if path.exists():
        try:
            pq.ParquetFile(path).close()
            return path
        except (OSError, ValueError):
            pass
    tmp = path.with_name(f"{path.name}.tmp-{os.getpid()}")
    try:
        compute(ing, con, ps, tmp, keep=False, full=full)
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
        # the ingest tables' policy (``tables.write_options``): ids delta-packed with LZ4, the
        # random 64-bit hashes PLAIN and uncompressed, no dictionaries -- pyarrow's default
        # dictionary attempt on the hash column was most of the write (0.7 of 0.8 cpu-s for
        # 2.6M pages) and made the file slower to read
        self.w = pq.ParquetWriter(
            path,
            schema,
            compression={"request_id": "lz4", "page": "lz4", "hash": "none"},
            use_dictionary=False,
            column_encoding={"request_id": "DELTA_BINARY_PACKED", "page": "DELTA_BINARY_PACKED"},
            write_statistics=["request_id", "page"],
        )

    def write(self, first_row: int, offsets: Any, hashes: Any, starts: Any) -> None:
        """Rows ``first_row``.. of a batch: their kept pages (``_kept``' offsets and hashes,
        each row's first at page ``starts``)."""
        import numpy as np
        import pyarrow as pa

        counts = np.diff(offsets)
        rid = np.repeat(np.arange(len(counts), dtype=np.int64), counts)
        page = np.arange(len(rid), dtype=np.int64) - offsets[:-1][rid] + starts[rid]
        rid += first_row
        cols = [pa.array(rid), pa.array(page.astype(np.int32)), pa.array(hashes).view(pa.uint64())]
        self.w.write_table(pa.Table.from_arrays(cols, schema=self.schema))

    def close(self) -> None:
        self.w.close()


def compute(
    ing: Ingested,
    con: Any,
    page_size: int,
    cache: Path | None = None,
    keep: bool = True,
    full: bool = False,
) -> RequestPages:
    """Hash every request's chain (see module docstring), read from the bundle
    (``chainsrc.bundle_batches``) ``batch_rows`` requests at a time; ``con``: a ``sql.connect``
    connection to ``ing``'s tables (the requests' lengths); ``cache``: also write the pages
    there (Parquet). Each request's pages from its ``keep_from`` (every page with ``full``).
    ``keep=False``: only write them (the result then holds the offsets and no hashes)."""
    import numpy as np

    ps = max(1, int(page_size))
    rows = batch_rows(con, ps)
    starts = None if full else keep_from(con, ps)
    for source in _sources(ing, con, ps, rows):
        writer = _PageWriter(cache) if cache is not None else None
        try:
            with ChainHasher() as hasher:
                got = _hash_batches(source(), ps, writer, keep, hasher, starts)
        except Unordered:
            continue
        finally:
            if writer is not None:
                writer.close()
        n = len(got[0]) - 1
        return RequestPages(ps, *got, np.zeros(n, np.int64) if starts is None else starts[:n])
    raise AssertionError("request_ids ordered by request_id are out of order")  # pragma: no cover


def _sources(ing: Ingested, con: Any, ps: int, rows: int) -> list[Callable[[], Iterator[Any]]]:
    """The chain sources to try in turn (``chainsrc``): where the cache holds the ids
    (``request_ids``: small requests, ``cache.IDS_BUDGET``) DuckDB reads them in C++, a batch
    at a time (no ORDER BY: the scan keeps file order, and sorting 45M tokens' lists doubled
    the read; the order is checked instead, and sorted on the rare scan that is not); else
    the bundle's records (``chainsrc.bundle_batches``)."""
    if ing.manifest.get("ids"):
        return [
            lambda: parquet_batches(con, ps, rows, ""),
            lambda: parquet_batches(con, ps, rows, ORDERED),
        ]
    return [lambda: bundle_batches(ing, con, ps, rows)]


def chains(ing: Ingested, con: Any, page_size: int, wanted: Iterable[int]) -> dict[int, Any]:
    """Every page hash (numpy int64) of the requests ``wanted`` (``request_id``s), hashed
    from their chains: the few requests a drill-down shows, whose cached pages the cache
    does not keep (no page of the others hashed; from the bundle, no chain of the others
    built: its requests read up to the last one wanted)."""
    import numpy as np

    want = sorted(set(wanted))
    out: dict[int, Any] = {}
    if not want:
        return out
    ps = max(1, int(page_size))
    if not ing.manifest.get("ids"):
        for r, cv in bundle_chains(ing, con, ps, want):
            off, h = hash_requests(cv, np.array([0, len(cv)], dtype=np.int64), ps, [None], [None])
            out[r] = h[off[0] : off[1]]
        return out
    for source in _sources(ing, con, ps, batch_rows(con, ps)):
        out.clear()
        at = 0
        try:
            for cv, co, _lane, _session in source():
                n = len(co) - 1
                lo, hi = np.searchsorted(want, [at, at + n])
                for r in want[lo:hi]:
                    k = r - at
                    off, h = hash_requests(
                        cv[co[k] : co[k + 1]], co[k : k + 2] - co[k], ps, [None], [None]
                    )
                    out[r] = h[off[0] : off[1]]
                at += n
        except Unordered:
            continue
        return out
    raise AssertionError("request_ids ordered by request_id are out of order")  # pragma: no cover


def _hash_batches(
    batches: Iterable[tuple[Any, ...]],
    ps: int,
    writer: _PageWriter | None,
    keep: bool = True,
    hasher: ChainHasher | None = None,
    starts: Any = None,
) -> tuple[Any, Any]:
    """(page offsets, hashes) of the requests in ``batches`` (``chainsrc``'), each request's
    from page ``starts[request]`` on (None: every page)."""
    import numpy as np

    counts: list[Any] = [np.zeros(1, dtype=np.int64)]
    hashes: list[Any] = []
    last = Carry()
    recent = Recent()
    rows = 0
    for cv, co, lane, session in batches:
        if len(co) <= 1:
            continue
        n = len(co) - 1
        mine = None if starts is None else starts[rows : rows + n]
        off, h = hash_requests(cv, co, ps, lane, session, last, hasher, recent, mine)
        # each row's first page returned (its start, at most its page count)
        first = np.zeros(n, np.int64) if mine is None else np.minimum(mine, np.diff(co) // ps)
        if writer is not None:
            writer.write(rows, off, h, first)
        counts.append(np.diff(off))
        if keep:
            hashes.append(h)
        rows += n
    offsets = np.cumsum(np.concatenate(counts))
    return offsets, (np.concatenate(hashes) if hashes else np.zeros(0, dtype=np.int64))


def page_ends(ing: Any, page_size: int) -> PageEnds | None:
    """Per request of the ingest ``ing`` (``request_id`` order = bundle order): the hash of
    its last full prompt page, of its chain's last page (``input_ids + output_ids[:-1]``) and
    the chain's page count, read from the request page-hash cache (``pages.ensure_file``,
    which the report's attribution wrote already): three int64 columns and the prompt page's
    presence, not a page hash per token. None where the cache cannot be written (the caller
    hashes the requests itself)."""
    ps = max(1, int(page_size))
    con = sql.connect(ing)
    try:
        path = ensure_file(ing, con, ps)
        if path is None:
            return None
        chain = f"((r.n_input + greatest(r.n_output - 1, 0)) // {ps})"
        got = con.sql(
            f"SELECT r.request_id, r.n_input, {chain} AS n_pages, "
            f"coalesce(max(CASE WHEN p.page = r.n_input // {ps} - 1 THEN p.hash END), 0) AS hp, "
            f"count(CASE WHEN p.page = r.n_input // {ps} - 1 THEN 1 END) AS has_p, "
            f"coalesce(max(CASE WHEN p.page = {chain} - 1 THEN p.hash END), 0) AS hl, "
            f"count(CASE WHEN p.page = {chain} - 1 THEN 1 END) AS has_l "
            f"FROM requests r LEFT JOIN ({relation(path)}) p "
            f"ON p.request_id = r.request_id "
            f"AND (p.page = r.n_input // {ps} - 1 OR p.page = {chain} - 1) "
            "GROUP BY ALL ORDER BY r.request_id"
        ).fetchnumpy()
    finally:
        con.close()
    return PageEnds(
        got["n_input"],
        got["n_pages"],
        got["hp"].astype("uint64").view("int64"),
        got["has_p"] > 0,
        got["hl"].astype("uint64").view("int64"),
        got["has_l"] > 0,
    )


@dataclass
class PageEnds:
    """``page_ends``' columns, one row a request (``row``: one request's)."""

    n_input: Any
    n_pages: Any
    prompt_hash: Any
    has_prompt: Any
    last_hash: Any
    has_last: Any

    def row(self, i: int, n_input: int) -> tuple[int | None, int | None, int] | None:
        """``(last prompt page hash, last chain page hash, pages)`` of request ``i``; None
        when the row is not that request (another length: the tables do not line up)."""
        if i >= len(self.n_input) or int(self.n_input[i]) != n_input:
            return None
        hp = int(self.prompt_hash[i]) if self.has_prompt[i] else None
        hl = int(self.last_hash[i]) if self.has_last[i] else None
        return hp, hl, int(self.n_pages[i])
