"""Prompt vs output attribution of stored blocks, by recomputing each request's page hashes.

Rule (docs/metrics.md, attribution): every request's token chain is ``input_ids +
output_ids[:-1]`` (what SGLang caches at finish); its page hashes come from
``kvcadence.format.wire.block_hashes`` at the bundle's page size. A request can only have
*stored* pages at or past its ``cached_tokens`` (the rest were already in the tree at
admission). Each ``BlockStored`` event's hashes are split greedily into runs of consecutive
pages of one request's chain; a run is then split at that request's own prompt/output
boundary: pages wholly inside the prompt (index < ``len(input_ids) // page_size``) are
``prefill`` (prompt) pages, later pages are ``finish`` (output) pages. Blocks that match no
request are counted as unmatched, never guessed.

When a hash is a candidate of several requests (a shared prefix re-stored after an eviction)
the pick is, in order: a page not yet attributed, then the request whose [send, finish]
interval is closest in time to the message, then the earliest request.

The peer-compatible variant (``any_prompt=True``) labels a stored block "prompt" when its hash
is a page of *any* request's prompt (Dynamo's definition), else "output".

Two implementations of the one rule, both checked against the readable per-event reference
loop on random inputs (``tests/analysis/attribution_oracle.py``, with the tests):
``attribute_sql`` (the report's path: DuckDB joins of the stored blocks against the request
page cache of ``kvcadence.analysis.pages``, read as Parquet) and ``attribute_arrays`` (numpy
columns from ``load_columns`` + the page hashes in memory; the path when the page cache cannot
be written, and the tests' second witness).

Why one module of both (and over 500 lines): they share the rule's pieces (``Attribution``,
the event labels, the request distance, the slow per-event loop's run splitting), and the
equality tests compare them field by field. Why out of core: the column path holds every
stored block's hash and every request's page hashes plus their sort temporaries (about
0.7 GB at 1M events, growing linearly with the capture); ``attribute_sql`` leaves those to
DuckDB, which spills past its memory limit, and reads into Python only the per-request
counts and the few events whose hashes have several candidate pages.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from kvcadence.analysis import sql

_U64 = (1 << 64) - 1


@dataclass
class Request:
    """What attribution needs of one request."""

    rid: str
    input_ids: list[int]
    output_ids: list[int]
    cached_tokens: int | None = None
    send_ns: int | None = None
    finish_ns: int | None = None
    lane: int | None = None
    session: int | None = None


@dataclass
class Attribution:
    """Result: totals, per-event labels and per-request counts."""

    page_size: int
    stored_blocks: int = 0
    matched_blocks: int = 0
    unmatched_blocks: int = 0
    unmatched_events: int = 0
    prompt_blocks: int = 0
    output_blocks: int = 0
    expected_output_blocks: int = 0
    event_kinds: dict[str, int] = field(default_factory=dict)
    events_spanning_same_session: int = 0
    events_spanning_other: int = 0
    # per request (index-aligned with the requests given): lists, or numpy int64 arrays from
    # ``attribute_sql`` (Python ints cost ~4x the memory at millions of requests)
    req_prompt_blocks: Any = field(default_factory=list)
    req_output_blocks: Any = field(default_factory=list)
    req_stored_events: Any = field(default_factory=list)
    req_prefill_events: Any = field(default_factory=list)
    req_finish_events: Any = field(default_factory=list)
    # per event: event_id -> (prompt blocks, output blocks, unmatched blocks)
    per_event: dict[int, tuple[int, int, int]] = field(default_factory=dict)

    @property
    def requests_without_prefill_store(self) -> int:
        ev = self.req_prefill_events
        if hasattr(ev, "dtype"):
            return int((ev == 0).sum())
        return sum(1 for n in ev if n == 0)


def _distance(req: Request, t: int) -> int:
    lo, hi = req.send_ns, req.finish_ns
    if lo is None and hi is None:
        return 0
    if lo is None:
        lo = hi
    if hi is None:
        hi = lo
    assert lo is not None and hi is not None
    if t < lo:
        return lo - t
    if t > hi:
        return t - hi
    return 0


# --------------------------------------------------------------------------------------
# Column-wise attribution (the report's path): the same rule over numpy arrays
# --------------------------------------------------------------------------------------
#
# The reference loop (tests/analysis/attribution_oracle.py) walks every event in Python.
# ``attribute_arrays`` gives identical results (tests check it on random inputs) by splitting the events:
#
# * a *fast* event has no hash with more than one candidate page: each block then maps to
#   its one (request, page) or to nothing, and the greedy runs of the reference loop are exactly
#   the maximal stretches of one request's consecutive pages (a run extending past a block
#   means that block's hash is the next page of the same chain, which is then its only
#   candidate). Everything is counted with numpy (bincount / unique), no per-event Python.
# * a *slow* event (some hash shared by several candidate pages: a prefix re-stored after an
#   eviction) runs the original loop, in (recv_ns, event_id) order, with "already
#   attributed" meaning consumed by an earlier slow event or by a fast event that comes
#   earlier in that order.


@dataclass
class RequestColumns:
    """Per-request inputs of ``attribute_arrays`` (index = request order)."""

    n_input: Any  # numpy int64: len(input_ids)
    n_output: Any  # numpy int64: len(output_ids)
    cached_tokens: list[int | None]
    send_ns: list[int | None]
    finish_ns: list[int | None]
    lane: list[int | None]
    session: list[int | None]


@dataclass
class EventColumns:
    """BlockStored events (any order) and their hashes (int64 bit patterns), flat."""

    event_id: Any  # numpy int64
    recv_ns: Any  # numpy int64
    n_blocks: Any  # numpy int64
    hashes: Any  # numpy int64, concatenated in the order of event_id


_LABEL_KINDS = ("finish", "prefill", "unmatched")
_SPAN = ("", " (same session)", " (other sessions)")


def _lookup(sorted_h: Any, h: Any) -> tuple[Any, Any]:
    """For each ``h``: (first index of it in ``sorted_h``, how many times it occurs there).

    The needles are sorted first: numpy's binary search over sorted keys is cache friendly
    (measured 0.4 s instead of 2 s for 2.6M hashes into 2.6M candidates).
    """
    import numpy as np

    n = len(sorted_h)
    left = np.zeros(len(h), dtype=np.int64)
    cnt = np.zeros(len(h), dtype=np.int64)
    if n == 0 or len(h) == 0:
        return left, cnt
    starts = np.empty(n, dtype=bool)
    starts[:1] = True
    np.not_equal(sorted_h[1:], sorted_h[:-1], out=starts[1:])
    run_id = np.cumsum(starts) - 1
    first = np.flatnonzero(starts)
    run_len = np.diff(np.append(first, n))
    order = np.argsort(h, kind="stable")
    hs = h[order]
    pos = np.searchsorted(sorted_h, hs, "left")
    pc = np.minimum(pos, n - 1)
    found = sorted_h[pc] == hs
    left[order] = pos
    cnt[order] = np.where(found, run_len[run_id[pc]], 0)
    return left, cnt


def _label(finish: bool, prefill: bool, unmatched: bool, span: int) -> str:
    parts = [k for k, on in zip(_LABEL_KINDS, (finish, prefill, unmatched), strict=True) if on]
    return (" | ".join(parts) if parts else "empty") + _SPAN[span]


def attribute_arrays(
    pages: Any, req: RequestColumns, ev: EventColumns, page_size: int
) -> Attribution:
    """The attribution rule over columns; ``pages`` is a ``kvcadence.analysis.pages.RequestPages``
    (each request's pages from its ``starts``: at most its cached prefix, where candidates
    begin).

    ``per_event`` is left empty (the test oracle gives per-event labels).
    """
    import numpy as np

    ps = max(1, int(page_size))
    res = Attribution(page_size=ps)
    nreq = len(req.n_input)
    ne = len(ev.event_id)
    n_pages = np.diff(pages.offsets)
    pp = req.n_input // ps
    first = np.array([(c or 0) // ps for c in req.cached_tokens], dtype=np.int64)
    has_out = req.n_output > 0
    # a request's chain pages, from its lengths (the pages held may start past page 0)
    chain_pages = (req.n_input + np.maximum(req.n_output - 1, 0)) // ps
    res.expected_output_blocks = int((chain_pages - pp)[has_out].sum())

    # candidate pages (p >= cached pages), sorted by (hash, request, page)
    total = int(pages.offsets[-1])
    r_of_g = np.repeat(np.arange(nreq, dtype=np.int64), n_pages)
    p_of_g = np.arange(total, dtype=np.int64) - (pages.offsets[:-1] - pages.starts)[r_of_g]
    cand_g = np.flatnonzero(p_of_g >= first[r_of_g])
    cand_h = pages.hashes[cand_g]
    order = np.argsort(cand_h, kind="stable")
    cand_g = cand_g[order]
    cand_h = cand_h[order]

    h = ev.hashes
    nb = ev.n_blocks.astype(np.int64)
    ev_of_b = np.repeat(np.arange(ne, dtype=np.int64), nb)
    left, cnt = _lookup(cand_h, h)
    slow_ev = np.zeros(ne, dtype=bool)
    slow_ev[ev_of_b[cnt > 1]] = True
    fast_b = ~slow_ev[ev_of_b]
    matched = fast_b & (cnt == 1)
    unm_b = fast_b & (cnt == 0)

    g_b = cand_g[left[matched]]
    e_b = ev_of_b[matched]
    r_b = r_of_g[g_b]
    prompt_b = p_of_g[g_b] < pp[r_b]

    ev_prompt = np.bincount(e_b[prompt_b], minlength=ne)
    ev_output = np.bincount(e_b[~prompt_b], minlength=ne)
    ev_unm = np.bincount(ev_of_b[unm_b], minlength=ne)
    req_prompt = np.bincount(r_b[prompt_b], minlength=nreq)
    req_output = np.bincount(r_b[~prompt_b], minlength=nreq)

    # (event, request) pairs of fast events: e_b is sorted and a request's blocks of one event
    # are mostly adjacent, so the keys are nearly sorted and a stable (tim)sort is ~linear
    key = e_b * max(1, nreq) + r_b
    perm = np.argsort(key, kind="stable")
    skey = key[perm]
    new_pair = np.empty(len(skey), dtype=bool)
    new_pair[:1] = True
    np.not_equal(skey[1:], skey[:-1], out=new_pair[1:])
    inv = np.empty(len(skey), dtype=np.int64)
    inv[perm] = np.cumsum(new_pair) - 1
    ukey = skey[new_pair]
    pair_e = ukey // max(1, nreq)
    pair_r = ukey % max(1, nreq)
    pair_prompt = np.bincount(inv, weights=prompt_b, minlength=len(ukey)) > 0
    pair_output = np.bincount(inv, weights=~prompt_b, minlength=len(ukey)) > 0
    req_events = np.bincount(pair_r, minlength=nreq)
    req_prefill = np.bincount(pair_r[pair_prompt], minlength=nreq)
    req_finish = np.bincount(pair_r[pair_output], minlength=nreq)
    ev_nreq = np.bincount(pair_e, minlength=ne)

    # session id per request: equal ids = same (lane, session) with neither missing
    sid = np.empty(nreq, dtype=np.int64)
    codes: dict[tuple[int, int], int] = {}
    for r, (la, se) in enumerate(zip(req.lane, req.session, strict=True)):
        sid[r] = -1 - r if la is None or se is None else codes.setdefault((la, se), len(codes))
    span = np.zeros(ne, dtype=np.int8)
    multi = ev_nreq > 1
    if multi.any():
        s_pair = sid[pair_r]
        starts: Any = np.flatnonzero(np.r_[True, pair_e[1:] != pair_e[:-1]]) if len(pair_e) else []
        lo = np.minimum.reduceat(s_pair, starts) if len(pair_e) else np.zeros(0, np.int64)
        hi = np.maximum.reduceat(s_pair, starts) if len(pair_e) else np.zeros(0, np.int64)
        ev_with = pair_e[starts] if len(pair_e) else np.zeros(0, np.int64)
        same = (lo == hi) & (lo >= 0)
        span[ev_with] = np.where(same, 1, 2)
        span[~multi] = 0

    fast = ~slow_ev
    code = (
        (ev_output > 0).astype(np.int64) * 1
        + (ev_prompt > 0) * 2
        + (ev_unm > 0) * 4
        + span.astype(np.int64) * 8
    )
    kinds: dict[str, int] = {}
    for c, k in enumerate(np.bincount(code[fast], minlength=24).tolist()):
        if k:
            label = _label(bool(c & 1), bool(c & 2), bool(c & 4), c >> 3)
            kinds[label] = kinds.get(label, 0) + k

    stored = int(nb.sum())
    res.stored_blocks = stored
    res.prompt_blocks = int(prompt_b.sum())
    res.output_blocks = int(len(prompt_b) - res.prompt_blocks)
    res.unmatched_blocks = int(unm_b.sum())
    res.matched_blocks = int(matched.sum())
    res.unmatched_events = int(((ev_unm > 0) & fast).sum())
    res.events_spanning_same_session = int(((span == 1) & fast).sum())
    res.events_spanning_other = int(((span == 2) & fast).sum())

    acc = _SlowAcc(req_prompt, req_output, req_events, req_prefill, req_finish)
    if slow_ev.any():
        cands = _Candidates(cand_g, cand_h, r_of_g, p_of_g)
        _slow_events(res, acc, kinds, pages, req, ev, slow_ev, fast_b, cands, g_b, e_b, nb)
    res.req_prompt_blocks = acc.prompt.tolist()
    res.req_output_blocks = acc.output.tolist()
    res.req_stored_events = acc.events.tolist()
    res.req_prefill_events = acc.prefill.tolist()
    res.req_finish_events = acc.finish.tolist()
    res.event_kinds = kinds
    return res


@dataclass
class _SlowAcc:
    prompt: Any
    output: Any
    events: Any
    prefill: Any
    finish: Any


@dataclass
class _Candidates:
    g: Any  # global page ids sorted by (hash, request, page)
    h: Any  # their hashes
    r_of_g: Any
    p_of_g: Any


def _slow_events(
    res: Attribution,
    acc: _SlowAcc,
    kinds: dict[str, int],
    pages: Any,
    req: RequestColumns,
    ev: EventColumns,
    slow_ev: Any,
    fast_b: Any,
    cands: _Candidates,
    g_b: Any,
    e_b: Any,
    nb: Any,
) -> None:
    """The original per-event loop for events with ambiguous hashes (see the section note)."""
    import numpy as np

    ne = len(ev.event_id)
    # processing order of every event: (recv_ns, event_id)
    order = np.lexsort((ev.event_id, ev.recv_ns))
    rank = np.empty(ne, dtype=np.int64)
    rank[order] = np.arange(ne)
    # earliest fast event (by rank) that attributed each page
    first_fast = np.full(int(pages.offsets[-1]), np.iinfo(np.int64).max, dtype=np.int64)
    np.minimum.at(first_fast, g_b, rank[e_b])

    off = np.zeros(ne + 1, dtype=np.int64)
    np.cumsum(nb, out=off[1:])
    # a page's position in ``pages.hashes``: its request's offset less the pages before its start
    pstart = (pages.offsets[:-1] - pages.starts).tolist()
    starts = pages.starts.tolist()
    pp = (req.n_input // res.page_size).tolist()
    rq = [
        Request("", [], [], None, s, f, la, se)
        for s, f, la, se in zip(req.send_ns, req.finish_ns, req.lane, req.session, strict=True)
    ]
    consumed = np.zeros(len(pages.hashes), dtype=bool)  # per page: a slow event took it
    cg, ch, r_of_g, p_of_g = cands.g, cands.h, cands.r_of_g, cands.p_of_g

    for e in sorted(np.flatnonzero(slow_ev).tolist(), key=lambda i: int(rank[i])):
        my_rank = int(rank[e])
        t_ev = int(ev.recv_ns[e])
        hs = ev.hashes[off[e] : off[e + 1]]
        # each block's candidates: ``cg[lo[i]:hi[i]]`` (one search for the event's blocks)
        lo = np.searchsorted(ch, hs, "left").tolist()
        hi = np.searchsorted(ch, hs, "right").tolist()

        def pick(
            i: int, lo: list[int] = lo, hi: list[int] = hi, my_rank: int = my_rank, t_ev: int = t_ev
        ) -> tuple[int, int] | None:
            a, b = lo[i], hi[i]
            if a == b:
                return None
            if b - a == 1:
                g = int(cg[a])
                return int(r_of_g[g]), int(p_of_g[g])

            def key(g: int) -> tuple[bool, int, int]:
                used = bool(consumed[g]) or int(first_fast[g]) < my_rank
                return (used, _distance(rq[int(r_of_g[g])], t_ev), int(r_of_g[g]))

            g = min(cg[a:b].tolist(), key=key)
            return int(r_of_g[g]), int(p_of_g[g])

        def chain_of(r: int) -> tuple[int, Any]:
            return starts[r], pages.hashes[pages.offsets[r] : pages.offsets[r + 1]]

        def consume(r: int, p: int, m: int) -> None:
            g = pstart[r] + p
            consumed[g : g + m] = True

        walked = _walk_event(hs, pick, chain_of, consume, pp, acc)
        _tally_event(res, acc, kinds, len(hs), walked, rq)


def _walk_event(
    hs: Any,
    pick: Callable[[int], tuple[int, int] | None],
    chain_of: Callable[[int], tuple[int, Any]],
    consume: Callable[[int, int, int], None],
    pp: Any,
    acc: Any,
) -> tuple[list[tuple[int, str]], int, int, int]:
    """Attribute one stored event's block hashes ``hs`` (a numpy array; the slow path of
    both implementations): at each block ``i``, ``pick(i)`` the (request, page) it continues
    (None: unmatched), extend the run while the request's page chain (``chain_of``: its
    first page's number and the page hashes from it, a numpy array, which start at most at a
    candidate) agrees -- one comparison of the two runs, not a step per block --, ``consume``
    the pages, and split the run into prompt pages (below ``pp[request]``) and output pages,
    added to ``acc``. Returns (runs as (request, "prefill" | "finish"), unmatched blocks,
    prompt blocks, output blocks)."""
    import numpy as np

    n = len(hs)
    i = unmatched = ev_prompt = ev_output = 0
    runs: list[tuple[int, str]] = []
    while i < n:
        cand = pick(i)
        if cand is None:
            unmatched += 1
            i += 1
            continue
        r, p = cand
        base, ch = chain_of(r)
        q = p - base  # the page's place in ``ch`` (its hash is ``hs[i]``: the candidate's)
        limit = min(n - i, len(ch) - q)
        m = 1
        if limit > 1:
            differ = np.flatnonzero(hs[i + 1 : i + limit] != ch[q + 1 : q + limit])
            m = 1 + int(differ[0]) if len(differ) else limit
        consume(r, p, m)
        n_prompt = max(0, min(p + m, pp[r]) - p)
        n_output = m - n_prompt
        if n_prompt:
            runs.append((r, "prefill"))
            acc.prompt[r] += n_prompt
            ev_prompt += n_prompt
        if n_output:
            runs.append((r, "finish"))
            acc.output[r] += n_output
            ev_output += n_output
        i += m
    return runs, unmatched, ev_prompt, ev_output


def _tally_event(
    res: Attribution,
    acc: Any,
    kinds: dict[str, int],
    n: int,
    walked: tuple[list[tuple[int, str]], int, int, int],
    reqs: Any,
) -> None:
    """Add one walked event (``_walk_event``) of ``n`` blocks to the totals, the per-request
    event/prefill/finish counts and its kind (``reqs[r]``: lane and session of request r)."""
    runs, unmatched, ev_prompt, ev_output = walked
    res.matched_blocks += n - unmatched
    res.unmatched_blocks += unmatched
    res.prompt_blocks += ev_prompt
    res.output_blocks += ev_output
    if unmatched:
        res.unmatched_events += 1
    rset = sorted({r for r, _ in runs})
    for r in rset:
        acc.events[r] += 1
    for r in {r for r, k in runs if k == "prefill"}:
        acc.prefill[r] += 1
    for r in {r for r, k in runs if k == "finish"}:
        acc.finish[r] += 1
    span = 0
    if len(rset) > 1:
        sessions = {(reqs[r].lane, reqs[r].session) for r in rset}
        same = len(sessions) == 1 and None not in next(iter(sessions))
        span = 1 if same else 2
        if same:
            res.events_spanning_same_session += 1
        else:
            res.events_spanning_other += 1
    kset = {k for _, k in runs}
    label = _label("finish" in kset, "prefill" in kset, bool(unmatched), span)
    kinds[label] = kinds.get(label, 0) + 1


def load_columns(
    ing: Any, con: Any, scope: str = "TRUE"
) -> tuple[Any, RequestColumns, EventColumns]:
    """(rids, RequestColumns, EventColumns) of an ingested bundle; events limited to ``scope``
    (a predicate on ``events``). Hashes are read from ``blocks.parquet`` in file order
    (= event_id, pos) and viewed as int64."""
    import numpy as np

    t = sql.arrow(
        con,
        "SELECT rid, n_input, n_output, cached_tokens, send_ns, finish_ns, lane, session "
        "FROM requests ORDER BY request_id",
    )
    rc = RequestColumns(
        n_input=t.column("n_input").to_numpy().astype(np.int64),
        n_output=t.column("n_output").to_numpy().astype(np.int64),
        cached_tokens=t.column("cached_tokens").to_pylist(),
        send_ns=t.column("send_ns").to_pylist(),
        finish_ns=t.column("finish_ns").to_pylist(),
        lane=t.column("lane").to_pylist(),
        session=t.column("session").to_pylist(),
    )
    # no ORDER BY: scans keep file order (event_id; blocks by event_id, pos), checked below
    e = sql.arrow(
        con, f"SELECT event_id, recv_ns, n_blocks FROM events WHERE kind = 'stored' AND {scope}"
    )
    ids = e.column("event_id").to_numpy().astype(np.int64)
    b = sql.arrow(con, "SELECT event_id, hash FROM blocks WHERE kind = 'stored'")
    b_ev = b.column("event_id").to_numpy()
    hashes = b.column("hash").to_numpy().view(np.int64)
    if (len(ids) > 1 and not (ids[1:] > ids[:-1]).all()) or (
        len(b_ev) > 1 and not (b_ev[1:] >= b_ev[:-1]).all()
    ):  # pragma: no cover - DuckDB preserves insertion order for plain scans
        raise AssertionError("stored events/blocks not in event_id order")
    if scope != "TRUE":
        keep = np.isin(b_ev, ids)
        hashes = hashes[keep]
    ec = EventColumns(
        event_id=ids,
        recv_ns=e.column("recv_ns").to_numpy().astype(np.int64),
        n_blocks=e.column("n_blocks").to_numpy().astype(np.int64),
        hashes=np.ascontiguousarray(hashes),
    )
    return t.column("rid").to_pylist(), rc, ec


def any_prompt_split_arrays(pages: Any, req: RequestColumns, ev: EventColumns) -> dict[str, int]:
    """``any_prompt_split`` over columns: prompt iff the hash is a prompt page of any request
    (``pages``: every page, ``pages.load(full=True)``)."""
    import numpy as np

    n_pages = np.diff(pages.offsets)
    r_of_g = np.repeat(np.arange(len(n_pages), dtype=np.int64), n_pages)
    p_of_g = np.arange(len(r_of_g), dtype=np.int64) - (pages.offsets[:-1] - pages.starts)[r_of_g]
    prompt = pages.hashes[p_of_g < (req.n_input // pages.page_size)[r_of_g]]
    n_prompt = int(np.isin(ev.hashes, prompt).sum())
    return {"prompt_blocks": n_prompt, "output_blocks": int(len(ev.hashes)) - n_prompt}


# --------------------------------------------------------------------------------------
# Out-of-core attribution (the report's path): the same rule as DuckDB joins
# --------------------------------------------------------------------------------------
#
# ``attribute_sql`` gives what ``attribute_arrays`` gives (tests check both against the
# reference loop) without holding every stored block's hash or every request's page hashes
# in Python: the fast events (no hash with several candidate pages) are counted by DuckDB
# (a join of the stored blocks against the candidate pages of the request page cache, then
# GROUP BYs), which spills past its memory limit. Only the slow events, their candidate
# pages and the chains of the requests those candidates belong to are read into Python,
# where the per-event loop runs as before. A candidate page of an ambiguous hash is never
# attributed by a fast event (a fast block's hash has exactly one candidate), so the slow
# loop's "already attributed" is exactly "consumed by an earlier slow event".


@dataclass
class PerRequest:
    """Per-request columns of ``attribute_sql`` (request_id order), numpy int64 unless said."""

    rid: Any  # pyarrow string array
    cached_tokens: Any  # pyarrow int64 array (nullable)
    n_input: Any
    n_output: Any


def attribute_sql(
    con: Any, pages_sql: str, page_size: int, scope: str = "TRUE", any_prompt: bool = False
) -> tuple[Attribution, PerRequest, dict[str, int] | None]:
    """The attribution rule over ``con``'s ``requests`` / ``events`` / ``blocks`` and the
    request page hashes in ``pages_sql`` (a relation: ``request_id`` = request position in
    ``request_id`` order, ``page``, ``hash`` of the same type as ``blocks.hash``; each
    request's pages from at most its cached prefix on, ``pages.ensure_file``); events
    limited to ``scope`` (a predicate on ``events``). ``per_event`` is left empty. With
    ``any_prompt`` also the peer split (``any_prompt_split_arrays``): ``pages_sql`` must then
    hold every page (``pages.ensure_file(full=True)``), the cached ones too."""
    ps = max(1, int(page_size))
    res = Attribution(page_size=ps)
    tmp = "_a_req _a_hc _a_er _a_slow _a_sbl _a_cand_slow _a_chain".split()
    views = ("_a_ev", "_a_pair")
    try:
        pos = _position(con)
        # no rids nor cached tokens (``_per_request_sql`` reads them from ``requests``): this
        # table and ``_a_hc`` live through the joins below, within DuckDB's memory limit
        con.sql(
            f"CREATE OR REPLACE TEMP TABLE _a_req AS SELECT {pos} AS r, n_input, n_output, "
            f"floor(coalesce(cached_tokens, 0) / {ps})::BIGINT AS first, "
            f"floor(n_input / {ps})::BIGINT AS pp, send_ns, finish_ns, lane, session "
            "FROM requests"
        )
        # n: candidate pages of the hash, capped at 2 (only 0, 1 and "several" matter); rp:
        # the candidate's request * 2 + 1 if a prompt page (read only where n = 1: one
        # integer min, not two any_value states -- ~25 % of this statement)
        con.sql(
            "CREATE OR REPLACE TEMP TABLE _a_hc AS SELECT pg.hash AS h, "
            "least(count(*), 2)::UTINYINT AS n, "
            "min(pg.request_id * 2 + (pg.page < q.pp)::BIGINT) AS rp "
            f"FROM ({pages_sql}) pg JOIN _a_req q ON q.r = pg.request_id "
            "WHERE pg.page >= q.first GROUP BY pg.hash"
        )
        # views, not tables: what DuckDB holds (within its memory limit) while it joins and
        # groups the blocks is only ``_a_req``, ``_a_hc`` (dropped once matched) and ``_a_er``
        con.sql(
            "CREATE OR REPLACE TEMP VIEW _a_ev AS SELECT event_id, recv_ns, n_blocks "
            f"FROM events WHERE kind = 'stored' AND ({scope})"
        )
        # the stored blocks, matched and counted per (event, candidate request) as they are
        # read: one row per event and request (r NULL: its unmatched blocks), never a row per
        # block (a table of every block was most of this function's memory and time)
        con.sql(
            "CREATE OR REPLACE TEMP TABLE _a_er AS SELECT b.e, c.rp // 2 AS r, "
            "count(*) FILTER (WHERE c.n = 1 AND c.rp % 2 = 1) AS pb, "
            "count(*) FILTER (WHERE c.n = 1 AND c.rp % 2 = 0) AS ob, "
            "count(*) FILTER (WHERE c.n IS NULL) AS ub, bool_or(c.n > 1) AS slow "
            f"FROM ({_stored_blocks(scope)}) b LEFT JOIN _a_hc c ON c.h = b.h GROUP BY ALL"
        )
        con.sql("DROP TABLE _a_hc")
        # slow events: any block with several candidate pages
        con.sql("CREATE OR REPLACE TEMP TABLE _a_slow AS SELECT DISTINCT e FROM _a_er WHERE slow")
        # the fast events' (event, request) counts (in a fast event a matched block has one
        # candidate page: a row with r set counts only such blocks)
        con.sql(
            "CREATE OR REPLACE TEMP VIEW _a_pair AS SELECT e, r, pb, ob, ub FROM _a_er "
            "ANTI JOIN _a_slow USING (e)"
        )
        _fast_sql(con, res)
        per = _per_request_sql(con, res, pos)
        acc = _SlowAcc(*per[1:])
        _slow_sql(con, pages_sql, scope, res, acc)
        res.req_prompt_blocks, res.req_output_blocks = acc.prompt, acc.output
        res.req_stored_events, res.req_prefill_events = acc.events, acc.prefill
        res.req_finish_events = acc.finish
        # a request's pages are its chain's whole pages: counted from its lengths (the page
        # cache holds exactly these), not by reading the cache again
        (exp,) = sql.one(
            con,
            f"SELECT coalesce(sum((n_input + n_output - 1) // {ps} - pp), 0) FROM _a_req "
            "WHERE n_output > 0",
        )
        res.expected_output_blocks = int(exp)
        split = None
        if any_prompt:
            n_prompt, n_all = sql.one(
                con,
                "SELECT count(*) FILTER (WHERE h IN (SELECT pg.hash FROM "
                f"({pages_sql}) pg JOIN _a_req q ON q.r = pg.request_id WHERE pg.page < q.pp)),"
                f" count(*) FROM ({_stored_blocks(scope)})",
            )
            split = {"prompt_blocks": int(n_prompt), "output_blocks": int(n_all - n_prompt)}
        return res, per[0], split
    finally:
        for v in views:
            con.sql(f"DROP VIEW IF EXISTS {v}")
        for t in tmp:
            con.sql(f"DROP TABLE IF EXISTS {t}")


def _position(con: Any) -> str:
    """A request's position in ``request_id`` order, as SQL over ``requests``: the id itself
    when the ids are ``0..n-1`` in file order (what ingest writes: no window, which cost
    ~0.15 cpu-s at 1M events), else a ``row_number`` window."""
    import numpy as np

    ids = sql.arrow(con, "SELECT request_id FROM requests").column(0).to_numpy()
    if np.array_equal(ids, np.arange(len(ids), dtype=ids.dtype)):
        return "request_id"
    return "(row_number() OVER (ORDER BY request_id)) - 1"


def _stored_blocks(scope: str) -> str:
    """The stored blocks of the events in ``_a_ev`` (``e``, ``pos``, ``h``)."""
    # a block's kind is its event's: without a scope every stored block is in _a_ev
    in_scope = "" if scope == "TRUE" else "SEMI JOIN _a_ev ON _a_ev.event_id = b.event_id "
    return (
        f"SELECT b.event_id AS e, b.pos, b.hash AS h FROM blocks b {in_scope}"
        "WHERE b.kind = 'stored'"
    )


def _fast_sql(con: Any, res: Attribution) -> None:
    """Totals and event kinds of the fast events (all of them counted in SQL)."""
    (stored,) = sql.one(con, "SELECT coalesce(sum(n_blocks), 0) FROM _a_ev")
    res.stored_blocks = int(stored)
    prompt, output, unm = sql.one(
        con,
        "SELECT coalesce(sum(pb), 0), coalesce(sum(ob), 0), coalesce(sum(ub), 0) FROM _a_pair",
    )
    res.prompt_blocks, res.output_blocks = int(prompt), int(output)
    res.unmatched_blocks = int(unm)
    res.matched_blocks = res.prompt_blocks + res.output_blocks
    got = sql.rows(
        con,
        # per fast event, in one pass over its (event, request) rows: its labels and request
        # count; then, for the events of several requests only (few), whether those requests
        # share one (lane, session), all keyed: min = max of both (a count(DISTINCT (lane,
        # session)) per event: 24 s of CPU for this query at 10M events, 16 s this way; the
        # join to the requests for every event instead of the few: 0.85 vs 0.5 cpu-s at 2M)
        "WITH pe AS (SELECT e, bool_or(pb > 0) AS pre, bool_or(ob > 0) AS fin, "
        "bool_or(ub > 0) AS unm, count(r) AS nreq FROM _a_pair GROUP BY e), "
        "ms AS (SELECT p.e, min(q.lane) = max(q.lane) AND min(q.session) = max(q.session) "
        "AS one_ses, bool_and(q.lane IS NOT NULL AND q.session IS NOT NULL) AS keyed "
        "FROM _a_pair p JOIN _a_req q ON q.r = p.r "
        "WHERE p.e IN (SELECT e FROM pe WHERE nreq > 1) GROUP BY p.e) "
        "SELECT coalesce(pe.fin, false), coalesce(pe.pre, false), coalesce(pe.unm, false), "
        "CASE WHEN coalesce(pe.nreq, 0) <= 1 THEN 0 WHEN ms.one_ses AND ms.keyed THEN 1 "
        "ELSE 2 END AS span, count(*) FROM _a_ev ev ANTI JOIN _a_slow s ON s.e = ev.event_id "
        "LEFT JOIN pe ON pe.e = ev.event_id LEFT JOIN ms ON ms.e = ev.event_id "
        "GROUP BY ALL",
    )
    kinds: dict[str, int] = {}
    for fin, pre, unm_ev, span, k in got:
        label = _label(bool(fin), bool(pre), bool(unm_ev), int(span))
        kinds[label] = kinds.get(label, 0) + int(k)
        if unm_ev:
            res.unmatched_events += int(k)
        if span == 1:
            res.events_spanning_same_session += int(k)
        elif span == 2:
            res.events_spanning_other += int(k)
    res.event_kinds = kinds


def _per_request_sql(
    con: Any, res: Attribution, pos: str
) -> tuple[PerRequest, Any, Any, Any, Any, Any]:
    """Per-request inputs and the fast events' per-request counts (request_id order; ``pos``:
    a request's position, ``_position``)."""
    import numpy as np

    # the counts are grouped in SQL and scattered by position here; the inputs are read in
    # request_id order (a plain scan when the positions are the ids, ``_position``): a join
    # of the two and an ORDER BY over every request's row was twice the work (0.5 vs 0.3
    # cpu-s at 2M events)
    order = "" if pos == "request_id" else " ORDER BY request_id"
    t = sql.arrow(con, f"SELECT rid, cached_tokens, n_input, n_output FROM requests{order}")
    c = sql.arrow(
        con,
        "SELECT r, sum(pb)::BIGINT AS pb, sum(ob)::BIGINT AS ob, count(*) AS ne, "
        "count(*) FILTER (WHERE pb > 0) AS np, count(*) FILTER (WHERE ob > 0) AS nf "
        "FROM _a_pair WHERE r IS NOT NULL GROUP BY r",
    )
    n = t.num_rows
    at = c.column("r").to_numpy().astype(np.int64)

    def counts(name: str) -> Any:
        out = np.zeros(n, dtype=np.int64)
        out[at] = c.column(name).to_numpy()
        return out

    per = PerRequest(
        rid=t.column("rid").combine_chunks(),
        cached_tokens=t.column("cached_tokens").combine_chunks(),
        n_input=t.column("n_input").to_numpy().astype(np.int64),
        n_output=t.column("n_output").to_numpy().astype(np.int64),
    )
    return per, counts("pb"), counts("ob"), counts("ne"), counts("np"), counts("nf")


def _starts(sorted_ids: Any) -> Any:
    """The first position of each run of equal values in ``sorted_ids`` (a sorted numpy
    array): ``np.unique(return_index=True)``'s without its sort."""
    import numpy as np

    if not len(sorted_ids):
        return np.zeros(0, dtype=np.int64)
    return np.flatnonzero(np.r_[True, sorted_ids[1:] != sorted_ids[:-1]])


def _slow_sql(con: Any, pages_sql: str, scope: str, res: Attribution, acc: _SlowAcc) -> None:
    """The per-event loop of ``_slow_events`` over the slow events only, read from SQL:
    their hashes, the candidate pages of those hashes and the chains of their requests."""
    import numpy as np

    ev = sql.rows(
        con,
        "SELECT ev.event_id, ev.recv_ns FROM _a_ev ev SEMI JOIN _a_slow s ON s.e = ev.event_id "
        "ORDER BY ev.recv_ns, ev.event_id",
    )
    if not ev:
        return
    con.sql(
        "CREATE OR REPLACE TEMP TABLE _a_sbl AS SELECT b.* FROM "
        f"({_stored_blocks(scope)}) b SEMI JOIN _a_slow s ON s.e = b.e"
    )
    # the candidate pages of the slow blocks' hashes, numbered in (hash, request, page) order
    con.sql(
        "CREATE OR REPLACE TEMP TABLE _a_cand_slow AS SELECT pg.hash, pg.request_id, pg.page, "
        "row_number() OVER (ORDER BY pg.hash, pg.request_id, pg.page) - 1 AS k "
        f"FROM ({pages_sql}) pg JOIN _a_req q ON q.r = pg.request_id WHERE pg.page >= q.first "
        "AND pg.hash IN (SELECT h FROM _a_sbl)"
    )
    con.sql(
        "CREATE OR REPLACE TEMP TABLE _a_chain AS SELECT request_id, page, hash "
        f"FROM ({pages_sql}) WHERE request_id IN (SELECT DISTINCT request_id FROM _a_cand_slow)"
    )
    # numpy columns, not a Python object per block, candidate or chain page: under eviction
    # pressure most events are slow (a re-prefilled conversation's pages are candidates of
    # every turn that stored them), millions of rows at production size. Each block with
    # its candidates' rows ``lo .. lo + n`` (a hash join in DuckDB: a binary search of
    # every block's hash among millions of candidates was most of this function's time)
    blk = sql.arrow(
        con,
        "SELECT b.e, b.h, coalesce(g.lo, 0) AS lo, coalesce(g.n, 0) AS n FROM _a_sbl b "
        "LEFT JOIN (SELECT hash, min(k) AS lo, count(*) AS n FROM _a_cand_slow GROUP BY hash) g "
        "ON g.hash = b.h ORDER BY b.e, b.pos",
    )
    b_e = blk.column("e").to_numpy()
    b_h = blk.column("h").to_numpy()
    b_lo = blk.column("lo").to_numpy().astype(np.int64)
    b_hi = b_lo + blk.column("n").to_numpy().astype(np.int64)
    del blk
    at = _starts(b_e)
    span_of = dict(
        zip(
            b_e[at].tolist(),
            zip(at.tolist(), [*at[1:].tolist(), len(b_e)], strict=True),
            strict=True,
        )
    )
    # each candidate request's chain: its pages from its first kept page on, in page order
    ch = sql.arrow(con, "SELECT request_id, page, hash FROM _a_chain ORDER BY request_id, page")
    c_r = ch.column("request_id").to_numpy().astype(np.int64)
    c_p = ch.column("page").to_numpy().astype(np.int64)
    c_h = ch.column("hash").to_numpy()
    del ch
    r_at = _starts(c_r)
    rids = c_r[r_at]
    r_end = np.append(r_at[1:], len(c_r))
    first_page = c_p[r_at]
    local = {r: k for k, r in enumerate(rids.tolist())}
    bounds = list(zip(first_page.tolist(), r_at.tolist(), r_end.tolist(), strict=True))
    # the candidate pages in their numbering
    cand = sql.arrow(con, "SELECT request_id, page FROM _a_cand_slow ORDER BY k")
    k_r = cand.column("request_id").to_numpy().astype(np.int64)
    k_p = cand.column("page").to_numpy().astype(np.int64)
    del cand
    consumed = np.zeros(len(c_r), dtype=bool)  # per chain page: a slow event took it
    reqs: dict[int, Request] = {}
    pp: dict[int, int] = {}
    for r, s, f, la, se, ppr in sql.rows(
        con,
        "SELECT q.r, q.send_ns, q.finish_ns, q.lane, q.session, q.pp FROM _a_req q "
        "SEMI JOIN (SELECT DISTINCT request_id FROM _a_cand_slow) c ON c.request_id = q.r",
    ):
        reqs[r] = Request("", [], [], None, s, f, la, se)
        pp[r] = int(ppr)

    def chain_of(r: int) -> tuple[int, Any]:
        first, lo, hi = bounds[local[r]]
        return first, c_h[lo:hi]

    def consume(r: int, p: int, m: int) -> None:
        first, lo, _ = bounds[local[r]]
        consumed[lo + p - first : lo + p - first + m] = True

    for e, t_ev in ev:
        a, b = span_of.get(e, (0, 0))
        hs = b_h[a:b]
        lo = b_lo[a:b].tolist()  # each block's candidates: rows ``lo[i]:hi[i]``
        hi = b_hi[a:b].tolist()

        def pick(
            i: int, lo: list[int] = lo, hi: list[int] = hi, t_ev: int = t_ev
        ) -> tuple[int, int] | None:
            a, b = lo[i], hi[i]
            if a == b:
                return None
            if b - a == 1:
                return int(k_r[a]), int(k_p[a])

            def key(c: int) -> tuple[bool, int, int]:
                r = int(k_r[c])
                first, at, _ = bounds[local[r]]  # the page's row in the chains
                return (bool(consumed[at + int(k_p[c]) - first]), _distance(reqs[r], t_ev), r)

            c = min(range(a, b), key=key)
            return int(k_r[c]), int(k_p[c])

        walked = _walk_event(hs, pick, chain_of, consume, pp, acc)
        _tally_event(res, acc, res.event_kinds, len(hs), walked, reqs)
