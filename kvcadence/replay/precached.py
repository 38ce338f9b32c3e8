"""Prefixes the worker had cached before the capture started, and their pre-load.

What this file owns: a capture attached to a worker that already served traffic holds the
worker's earlier messages only as far back as its replay buffer reaches (SGLang keeps the
last 10,000), so a prefix stored before that (a long-lived system prompt) is found cached by
the capture's requests but was never stored in it. The replay starts from an empty tree and
would replay those requests as misses that store the prefix.

* ``precached(index, cands)`` -- which records found such a prefix: the block a record's
  prefill attached to (``outputs.StoreIndex.prefill_run``'s base; for a prompt that stored
  nothing new, its last cached page) was stored on its rank by no event of the capture
  published before the record finished, nor soon after (a store is published at the next
  publish point, which can come after a quick request's finish: within
  ``outputs.FINISH_WINDOW_NS``). Every block above it is then older too (a
  child is stored after its parent, and a parent is evicted only after its children), so
  the record's whole cached prefix (``cached_tokens``, page floored) was in the tree when
  the capture attached. Vectorised: the candidates' hashes are looked up among the stored
  pages through ``unrecorded.matches`` (a low-bit sieve, one pass over the pages).
* ``precached_below(index, cands, cached_pages)`` -- the records ``precached`` did not flag
  whose block the capture stored, but below a prefix older than the capture (a recovered
  message, or a request the records lack, extended it): the block's first store is followed
  up store by store to a parent no earlier event of the capture stored (an orphan: the
  pages above it and itself were held before the capture) or to the root (nothing);
  memoised per event. ``production`` asks only when a stream of the capture lost its start
  (``outputs.StoreIndex.lost_start``).
* ``carriers(index, cands, cached_pages, arrivals, lost_start)`` -- both rules' prefixes,
  each with the one record that carries it to the replay (per prefix and rank: the first to
  arrive).
* ``OlderPages`` -- the tokens from the root through a page stored before the capture,
  read from the cached prefix of a record whose prompt passes through it: where a request
  the records lack (``unrecorded``) stored pages below a prefix older than the capture
  (corpus ``dp2-p8-attach-late-ring4-http-clients``: 6 such runs, 24 pages, each below a
  page on a record's cached prefix). The records' cached prefixes are hashed in arrival
  order, only when asked and only until the page is found, at most ``OLDER_MAX_PAGES``.
* ``PRECACHED_KEY`` -- the ``meta_info`` key of a completed record that carries that
  prefix's length in tokens (one record per prefix, the first to arrive, so the prefixes
  kept grow with the distinct ones); ``preloads(specs)`` reads them back, per rank, as the
  prefixes ``Scheduler.preload`` inserts into the simulated tree before the first pass,
  with no event (they were stored before the capture), the one used latest inserted first
  (oldest).

Only records are looked at (a rebuilt request's prompt above its store is known only as far
as ``OlderPages`` finds it).
"""

from __future__ import annotations

from array import array
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, cast

import numpy as np

from kvcadence.errors import WireError
from kvcadence.format.hashes import block_hashes
from kvcadence.format.namespace import salt_of
from kvcadence.replay.outputs import FINISH_WINDOW_NS
from kvcadence.replay.schedule import _arrival
from kvcadence.replay.sieve import matches
from kvcadence.replay.tokens import span
from kvcadence.replay.unrecorded import page_key, page_keys

#: ``meta_info`` key of a record whose cached prefix was stored before the capture: its
#: length in tokens (page aligned)
PRECACHED_KEY = "kvcadence_precached_tokens"


def precached(index: Any, cands: Sequence[tuple[int, int, int, int]]) -> list[int]:
    """Of ``cands`` -- ``(record, block hash, finish ns, rank)`` -- the records whose block no
    event of ``index`` stored on that rank before that time (+ ``FINISH_WINDOW_NS``), in
    ``cands``' order."""
    if not cands:
        return []
    multi = bool(index.frame_rank)
    keys = page_keys(index) if multi else index.hashes
    want = np.fromiter(
        (page_key(h, rk) if multi else h for _, h, _, rk in cands), np.int64, len(cands)
    )
    pos = matches(keys, want)
    finish = np.fromiter((c[2] for c in cands), np.int64, len(cands))
    flag = np.ones(len(cands), dtype=bool)  # no store of the block: before the capture
    if len(pos):
        offs = np.asarray(index.offs, dtype=np.int64)
        ev = np.searchsorted(offs, pos, side="right") - 1
        ts = np.asarray(index._ts, dtype=np.int64)[ev]
        found = keys[pos]
        order = np.lexsort((ts, found))  # by key, then time: each key's first is its earliest
        found, ts = found[order], ts[order]
        head = np.ones(len(found), dtype=bool)
        head[1:] = found[1:] != found[:-1]
        uniq, first = found[head], ts[head]
        at = np.searchsorted(uniq, want).clip(max=len(uniq) - 1)
        stored = uniq[at] == want
        flag = ~stored | (first[at] > finish + FINISH_WINDOW_NS)
    return [c[0] for c, f in zip(cands, flag.tolist(), strict=True) if f]


def precached_below(
    index: Any, cands: Sequence[tuple[int, int, int, int]], cached_pages: Sequence[int]
) -> list[tuple[int, int, int]]:
    """Of ``cands`` (``precached``'s, those it did not flag: their block was stored in the
    capture before they finished) with ``cached_pages[k]`` cached pages each, the records
    whose block's first store chains up, store by store, to a parent no earlier event of
    the capture stored on that rank (an *orphan*: stored before the capture -- a recovered
    message, or a request the records lack, extended a prefix older than the capture):
    ``(record, orphan hash, pages above it and itself)``, the pages of the record's cached
    prefix the worker held before the capture. A chain that starts at the root (parent
    None) was stored wholly in the capture: no such record."""
    if not cands:
        return []
    multi = bool(index.frame_rank)
    keys = page_keys(index) if multi else index.hashes
    offs = np.asarray(index.offs, dtype=np.int64)

    def first_positions(want: list[int]) -> dict[int, tuple[int, int]]:
        """key -> (event, offset) of its earliest store."""
        arr = np.fromiter(want, np.int64, len(want))
        pos = matches(keys, arr)  # ascending: the first of each key is its earliest
        ev = np.searchsorted(offs, pos, side="right") - 1
        out: dict[int, tuple[int, int]] = {}
        for k, e, q in zip(keys[pos].tolist(), ev.tolist(), pos.tolist(), strict=True):
            if k not in out:
                out[k] = (e, q - int(offs[e]))
        return out

    def key(h: int, ei: int) -> int:
        return page_key(h, index.rank_of(ei)) if multi else h

    parents = index.parents
    parent_keys = [key(p, ei) if p is not None else None for ei, p in enumerate(parents)]
    parent_at = first_positions([k for k in parent_keys if k is not None])
    # a capture that holds its streams from the start has no orphan: nothing to follow
    if not any(
        k is not None and ((up := parent_at.get(k)) is None or up[0] >= ei)
        for ei, k in enumerate(parent_keys)
    ):
        return []
    base_keys = [page_key(h, rk) if multi else h for _, h, _, rk in cands]
    base_at = first_positions(base_keys)
    # per event: (orphan parent hash or None for a chain from the root, pages between the
    # orphan and the event's first page)
    memo: dict[int, tuple[int | None, int]] = {}

    def resolve(e0: int) -> tuple[int | None, int]:
        path: list[tuple[int, int]] = []  # (event, offset of its parent in the next one up)
        e = e0
        got: tuple[int | None, int]
        while True:
            if e in memo:
                got = memo[e]
                break
            p = parents[e]
            if p is None:
                got = (None, 0)
                memo[e] = got
                break
            up = parent_at.get(cast("int", parent_keys[e]))
            if up is None or up[0] >= e:  # no store of the parent before this one
                got = (p, 0)
                memo[e] = got
                break
            path.append((e, up[1]))
            e = up[0]
        orphan, above = got
        for ev, j in reversed(path):  # the parent sits at ``j`` of the event above
            above += j + 1
            memo[ev] = (orphan, above)
        return memo[e0]

    out = []
    for (i, _, _, _), k, c in zip(cands, base_keys, cached_pages, strict=True):
        at = base_at.get(k)
        if at is None:
            continue
        orphan, above = resolve(at[0])
        pages = c - 1 - at[1] - above  # the base is page ``c - 1``: the event's first page
        if orphan is not None and 0 < pages < c:  # sits ``at[1]`` pages above it
            out.append((i, orphan, pages))
    return out


@dataclass
class Carriers:
    """``carriers``' answer: ``pages`` record -> the pages of the prefix it carries (one
    record a prefix and rank: the first to arrive, its first use, so what is kept grows with
    the distinct prefixes, not with the records that found them); how many records
    ``precached`` flagged and ``precached_below`` found."""

    pages: dict[int, int] = field(default_factory=dict)
    flagged: int = 0
    below: int = 0


def carriers(
    index: Any,
    cands: Sequence[tuple[int, int, int, int]],
    cached_pages: Sequence[int],
    arrivals: Sequence[int],
    lost_start: bool,
) -> Carriers:
    """The prefixes to pre-load, each with the record that carries it: of ``cands``
    (``precached``'s, with each one's cached pages and arrival), the whole cached prefix of
    those ``precached`` flags, and -- where a stream lost its start (``lost_start``) -- the
    part above a store of the capture that extended an older prefix for the others
    (``precached_below``)."""
    flagged = set(precached(index, cands))
    pre: list[tuple[int, int, int, int, int]] = []  # (record, last block, rank, pages, arrival)
    rest, rest_pages, rest_of = [], [], {}
    for c, n, at in zip(cands, cached_pages, arrivals, strict=True):
        if c[0] in flagged:
            pre.append((c[0], c[1], c[3], n, at))
        else:
            rest.append(c)
            rest_pages.append(n)
            rest_of[c[0]] = (c[3], at)
    below = precached_below(index, rest, rest_pages) if lost_start else []
    pre.extend((i, h, rest_of[i][0], n, rest_of[i][1]) for i, h, n in below)
    first: dict[tuple[int, int], tuple[int, int, int]] = {}  # (block, rank) -> carrier
    for i, h, rk, n, at in pre:
        got = first.get((h, rk))
        if got is None or at < got[0]:
            first[h, rk] = (at, i, n)
    return Carriers({i: n for _, i, n in first.values()}, len(flagged), len(below))


#: the most cached-prefix pages ``OlderPages`` hashes (about 1 us a page, and an entry of its
#: map: ~25 MB at most) looking for pages stored before the capture; past it, a page not
#: found yet stays unknown
OLDER_MAX_PAGES = 250_000
#: ``OlderPages``' map packs (record, page) into one int: the page in the low bits
_PAGE_BITS = 32


class OlderPages:
    """``older(h)``: the tokens from the root through page ``h`` (a block hash), stored before
    the capture, from the cached prefix of a record whose prompt passes through it (None:
    none found). ``order()``: the records' indices, the first looked at first (arrival
    order: the records nearest the capture's start carry what the worker held before it),
    called at the first ask (a capture with no such page pays nothing). Each
    record's cached prefix (``cached_tokens``, page floored) is hashed once, in its cache
    namespace's chain, when a page asked for is not among those hashed so far."""

    def __init__(
        self, records: Sequence[Any], order: Callable[[], Iterable[int]], page_size: int
    ) -> None:
        self._records = records
        self._order_of = order
        self._order: Iterator[int] | None = None
        self._ps = page_size
        self._at: dict[int, int] = {}  # hash -> record << _PAGE_BITS | page
        self.hashed = 0  # pages hashed so far

    def __call__(self, h: int) -> array | None:
        ps, at = self._ps, self._at
        got = at.get(h)
        if got is None and self._order is None:
            self._order = iter(self._order_of())
        order = self._order
        while got is None and order is not None and self.hashed < OLDER_MAX_PAGES:
            i = next(order, None)
            if i is None:
                break
            r = self._records[i]
            pages = (r.cached_tokens or 0) // ps
            if pages <= 0:
                continue
            try:
                hs = block_hashes(span(r.input_ids, 0, pages * ps), ps, salt_of(r.meta_info))
            except WireError:  # ids no hash takes: no page of it is known
                continue
            self.hashed += pages
            for k, x in enumerate(hs):
                at.setdefault(x, i << _PAGE_BITS | k)
            got = at.get(h)
        if got is None:
            return None
        i, k = got >> _PAGE_BITS, got & ((1 << _PAGE_BITS) - 1)
        return span(self._records[i].input_ids, 0, (k + 1) * ps)


def preloads(specs: Iterable[tuple[Any, Any]]) -> dict[Any, list[tuple[Any, Any]]]:
    """Per home (``(home, spec)`` pairs: whatever the caller maps a spec to, the fleet its
    rank's slot): the prefixes to pre-load (``PRECACHED_KEY`` of each spec's source
    record), as ``(token array, cache namespace)``, the one first used latest first (it
    goes in oldest)."""
    by: dict[Any, list[tuple[int, int, Any, int, Any]]] = {}
    for home, s in specs:
        src = s.source
        mi = getattr(src, "meta_info", None) if src is not None else None
        n = mi.get(PRECACHED_KEY) if isinstance(mi, dict) else None
        if type(n) is not int or n <= 0:
            continue
        at = _arrival(src)
        at = at if at is not None else 0
        by.setdefault(home, []).append((at, s.idx, s.input_ids, n, s.namespace))
    out: dict[Any, list[tuple[Any, Any]]] = {}
    for home, items in by.items():
        items.sort(key=lambda x: (x[0], x[1]), reverse=True)
        out[home] = [(span(prompt, 0, n), ns) for _, _, prompt, n, ns in items]
    return out
