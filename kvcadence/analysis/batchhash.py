"""Hashing one batch of request chains into SGLang's page hashes, for
``kvcadence.analysis.pages``.

What this file owns: ``hash_requests`` -- a batch's chains (flat uint32-able ids and row
offsets) to each row's page hashes (int64 bit patterns of the digests' first 8 bytes), the
rows hashed from the root in one ``wire.root_chains`` pass (shared among processes:
``kvcadence.analysis.hashpool``), the rows that extend an earlier chain (a session's previous
turn, or a recent request with the same first tokens: ``kvcadence.analysis.pagereuse``)
reading its digests (prefix-shared: ``pagereuse.Digests``) and hashing only their new pages.
"""

from __future__ import annotations

from typing import Any

from kvcadence.analysis.hashpool import ChainHasher
from kvcadence.analysis.pagereuse import (
    RECENT_ROWS,
    Carry,
    Digests,
    Recent,
    head_pages,
    longest_prefix,
)
from kvcadence.format import wire


def hash_requests(
    cv: Any,
    co: Any,
    ps: int,
    lane: list[Any],
    session: list[Any],
    last: Carry | None = None,
    hasher: ChainHasher | None = None,
    recent: Recent | None = None,
    starts: Any = None,
) -> tuple[Any, Any]:
    """(page offsets, int64 hashes) of every row's chain, given the flat chain tokens ``cv``
    (int64, whole pages only: ``_query``) and their row offsets ``co``; with ``starts``
    (numpy int64 a row) each row's pages from that page on only (a start past a row's pages:
    none of them), the others hashed as they must be (a next page chains from them) but not
    returned.

    The rows' pages are one uint32 buffer; the rows hashed
    from the root (most) are hashed in one ``wire.root_chains`` pass over it (no per-row
    call). Rows that reuse their session's previous row (a whole-page prefix of theirs) read
    its digests -- only those of the pages returned and their first new page's parent -- and
    hash only the new pages, each row's digests kept as its new pages' and its source's
    (``Digests``: what a later row or batch reuses); rows with tokens that are not plain uint32 are
    hashed from their Python lists (the wide / error path of ``wire``). ``last``: the
    ``Carry`` of the sessions' latest rows with pages from earlier batches (updated here);
    ``recent``: the ``Recent`` rows of earlier batches, for rows with no session to reuse
    (updated here). ``hasher``: shares the root-chain pass among
    processes (``kvcadence.analysis.hashpool``; default: this process alone)."""
    import sys
    from array import array

    import numpy as np

    n = len(co) - 1
    n_pages = np.diff(co) // ps
    page_off = np.zeros(n + 1, dtype=np.int64)
    np.cumsum(n_pages, out=page_off[1:])
    total = int(page_off[-1])
    if last is None:
        last = Carry()
    if recent is None:
        recent = Recent()
    if total == 0:
        return page_off, np.zeros(0, dtype=np.int64)
    first = None if starts is None else np.minimum(starts, n_pages)
    toks = cv
    plain = (toks >= 0) & (toks < (1 << 32))
    bad = np.zeros(n, dtype=bool)
    if array("I").itemsize != 4:  # pragma: no cover - no such platform in use
        bad[:] = True
    elif not plain.all():  # wide or invalid tokens: those rows go through Python lists
        bad[np.searchsorted(page_off * ps, np.flatnonzero(~plain), "right") - 1] = True
        toks = np.where(plain, toks, 0)
    step = 4 * ps
    buf = toks.astype("<u4").tobytes()  # uint32 little-endian: what SGLang hashes
    del toks, plain
    digests = np.empty((total, 32), dtype=np.uint8)

    # session reuse: a keyed row whose session's previous row is a whole-page prefix of it
    # (or it of that row) starts from that row's digests; a row with no such row (no lane or
    # session: every production capture; a session's first turn) starts from the longest
    # recent row with the same first pages that is a whole-page prefix of it (or it of that
    # row) -- ``Recent``: content, not keys
    start = np.zeros(n, dtype=np.int64)
    source: dict[int, Any] = {}  # row -> the row it reuses (int) or carried digests
    # key -> (pages, words, row) of its latest row in this batch
    ended: dict[tuple[Any, Any], tuple[int, bytes, int]] = {}
    # head -> this batch's latest row under it; each row's previous row under its head (-1:
    # none): the candidates as a chain of ints (no container a row)
    heads: dict[bytes, int] = {}
    prev_same = [-1] * n
    seen: list[int] = []  # the rows keyed under a head, in order
    npl, pol = n_pages.tolist(), page_off.tolist()
    head_bytes = step * head_pages(ps)
    carried = recent.by_head
    badl = bad.tolist() if bad.any() else None
    for r in np.flatnonzero(n_pages > 0).tolist():
        if badl is not None and badl[r]:
            continue
        k = npl[r]
        a = step * pol[r]
        if lane[r] is not None or session[r] is not None:
            key = (lane[r], session[r])
            words = buf[a : a + step * k]
            prev = ended.get(key) or last.get(key)
            if prev is not None:
                qk, qw, qsrc = prev
                if words.startswith(qw) if qk <= k else qw.startswith(words):
                    start[r] = min(qk, k)
                    source[r] = qsrc
            ended[key] = (k, words, r)
        head = buf[a : a + head_bytes]
        q = heads.get(head, -1)
        if r not in source and (q >= 0 or head in carried):
            best, src = longest_prefix(
                buf, a, k, step, pol, npl, prev_same, q, recent.candidates(head)
            )
            if src is not None:
                start[r] = best
                source[r] = src
        prev_same[r] = q
        heads[head] = r
        seen.append(r)

    # every row hashed from the root, in one pass
    fast = (n_pages > 0) & (start == 0) & ~bad
    sel = np.repeat(fast, n_pages)
    row_head = np.zeros(total, dtype=bool)  # a row's first page (its chain starts there)
    row_head[page_off[:-1][n_pages > 0]] = True
    hasher = hasher if hasher is not None else ChainHasher(1)
    if sel.all():
        got = hasher.digests(buf, ps, row_head)
    else:
        words_sel = np.frombuffer(buf, dtype=np.uint8).reshape(total, step)[sel].tobytes()
        got = hasher.digests(words_sel, ps, row_head[sel])
    if got:
        digests[sel] = np.frombuffer(got, dtype=np.uint8).reshape(-1, 32)
    del got

    # each row's digests as a later row reuses them: its new pages' own, the rest its
    # source's (``Digests``: no row's reused prefix copied)
    chains: dict[int, Digests] = {
        r: Digests(None, 0, digests[pol[r] : pol[r] + npl[r]].copy())
        for r in np.flatnonzero(fast).tolist()
    }
    # the rest, row by row, in row order (a reused row is complete before its reuser); of a
    # reused prefix only the pages returned (from ``first``) and the tail's parent are read
    for r in np.flatnonzero((n_pages > 0) & ~fast).tolist():
        a, k = pol[r], npl[r]
        if bad[r]:
            out = wire.block_digests(cv[co[r] : co[r + 1]].tolist(), ps)
            m, base = 0, None
        else:
            m = int(start[r])
            src = source[r]
            base = chains[src] if isinstance(src, int) else src
            lo = 0 if first is None else min(int(first[r]), m - 1)
            digests[a + lo : a + m] = base.get(lo, m)
            if m == k:
                chains[r] = Digests(base, m, np.empty((0, 32), dtype=np.uint8))
                continue
            tail = array("I")
            tail.frombytes(buf[step * (a + m) : step * (a + k)])
            if sys.byteorder == "big":  # pragma: no cover - buf is little-endian
                tail.byteswap()
            out = wire.block_digests(tail, ps, parent_digest=digests[a + m - 1].tobytes())
        new = np.frombuffer(b"".join(out), dtype=np.uint8).reshape(-1, 32)
        digests[a + k - len(out) : a + k] = new
        chains[r] = Digests(base, m, new)
    # what the next batch reuses: the rows' digests, the latest rows put last (least
    # recently used first out)
    for key, (k, words, r) in sorted(ended.items(), key=lambda kv: kv[1][2]):
        last.put(key, k, words, chains[r])
    for r in seen[-RECENT_ROWS:]:
        a, k = pol[r], npl[r]
        words = buf[step * a : step * (a + k)]
        recent.put(words[:head_bytes], k, words, chains[r])
    # a page's hash: its digest's first 8 bytes, big-endian (a gather of one word a row)
    words8 = digests.view(">i8")
    if first is None or not first.any():
        return page_off, words8[:, 0].astype(np.int64)
    off = np.zeros(n + 1, dtype=np.int64)
    np.cumsum(n_pages - first, out=off[1:])
    kept = np.concatenate(
        [
            np.arange(b - c, b)
            for b, c in zip(page_off[1:].tolist(), (n_pages - first).tolist(), strict=True)
            if c
        ]
        or [np.zeros(0, dtype=np.int64)]
    )
    return off, words8[kept, 0].astype(np.int64)
