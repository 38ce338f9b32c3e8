"""Output token ids recovered from a capture's KV events (production captures).

What this file owns: ``StoreIndex``, the content of every ``BlockStored`` event of a bundle
(all endpoints / DP ranks together: a block hash is a function of the tokens only), and the
two lookups a production replay needs when requests were recorded without output ids
(SGLang's ``--export-metrics-to-file``):

* ``walk(tokens)``: how far a token sequence runs down the stored content tree, jumping a
  whole event run at a time (one dict lookup per run, a C-level slice compare per run), and
  the block hash it ends on -- for a prompt, ``h_L``, the hash of its last full page;
* ``finish_pages(h_L, tail, k, finish_ns)``: the request's finish store -- the event run whose
  first block's parent is ``h_L`` (also inside an event where tail merging appended it to the
  request's own prefill store, or put the next request's store after it), published at or
  after the request's recorded finish. Its ``token_ids`` are the prompt's partial tail page
  plus the output tokens SGLang inserted (all but the last output token at page size 1; all
  full pages at page size > 1). The rest of the output is never inserted, so it never
  changes a block hash or a cache hit.

Blocks are indexed by ``(parent hash, page tokens)``; event token lists are kept as
``array('q')`` (8 bytes a token, no int objects).
"""

from __future__ import annotations

from array import array
from bisect import bisect_left
from collections.abc import Iterable
from dataclasses import dataclass
from itertools import repeat
from typing import Any

#: a finish store is searched from this long before the recorded finish (clock granularity)
FINISH_SLACK_NS = 50_000_000
#: ... up to this long after it (publish points: next prefill result, 40th decode, idle)
FINISH_WINDOW_NS = 120_000_000_000
#: ... scanning at most this many events
FINISH_MAX_EVENTS = 4096


@dataclass(slots=True)
class StoredEvent:
    """One ``BlockStored`` event: publish time, parent, block hashes and tokens."""

    ts_ns: int
    parent: int | None
    hashes: list[int]
    tokens: array


class StoreIndex:
    """Every stored block of a capture, by content (see module docstring)."""

    def __init__(self, page_size: int) -> None:
        self.page_size = page_size
        self.events: list[StoredEvent] = []
        self._ts: list[int] = []
        self._child: dict[tuple[int | None, Any], tuple[int, int]] = {}

    # ------------------------------------------------------------------ building
    @classmethod
    def from_batches(cls, batches: Iterable[tuple[int, Any]], page_size: int) -> StoreIndex:
        """``batches``: ``(publish_ns, events)`` pairs (any order, all ranks)."""
        from kvcadence.capture.schema import BlockStored

        idx = cls(page_size)
        raw: list[tuple[int, int, Any]] = []
        for n, (ts, evs) in enumerate(batches):
            for e in evs:
                if isinstance(e, BlockStored) and e.block_hashes:
                    if e.block_size != page_size or len(e.token_ids) != page_size * len(
                        e.block_hashes
                    ):
                        continue  # bigram keys or another page size: not indexable
                    if e.token_ids and not isinstance(e.token_ids[0], int):
                        continue
                    raw.append((ts, n, e))
        raw.sort(key=lambda t: (t[0], t[1]))
        for ts, _, e in raw:
            idx._add(ts, e.parent_block_hash, list(e.block_hashes), e.token_ids)
        return idx

    @classmethod
    def from_reader(cls, reader: Any, page_size: int) -> StoreIndex:
        """From a ``BundleReader``'s event frames (payload ``ts``; ``recv_ns`` if it lacks one)."""
        from kvcadence.capture import wire
        from kvcadence.capture.bundle import event_payload

        def batches() -> Iterable[tuple[int, Any]]:
            for f in reader.events():
                try:
                    b = wire.decode_batch(event_payload(f))
                except Exception:  # noqa: BLE001 - a torn payload holds no usable store
                    continue
                ts = int(b.ts * 1e9) if b.ts and b.ts > 0 else f.recv_ns
                yield ts, b.events

        return cls.from_batches(batches(), page_size)

    def _add(self, ts: int, parent: int | None, hashes: list[int], tokens: list[int]) -> None:
        ps = self.page_size
        ei = len(self.events)
        toks = array("q", tokens)
        self.events.append(StoredEvent(ts, parent, hashes, toks))
        self._ts.append(ts)
        parents = [parent, *hashes[:-1]]
        if ps == 1:
            keys: Iterable[Any] = zip(parents, tokens, strict=True)
        else:
            pages = (hash(tuple(tokens[i : i + ps])) for i in range(0, len(tokens), ps))
            keys = zip(parents, pages, strict=True)
        # the latest occurrence wins: any occurrence of a block has the same content
        self._child.update(zip(keys, zip(repeat(ei), range(len(hashes))), strict=False))

    # ------------------------------------------------------------------ lookups
    def _page_key(self, tokens: list[int], p: int) -> Any:
        ps = self.page_size
        return tokens[p] if ps == 1 else hash(tuple(tokens[p * ps : (p + 1) * ps]))

    def walk(
        self,
        tokens: list[int],
        limit_pages: int | None = None,
        start: tuple[int | None, int] = (None, 0),
    ) -> tuple[int | None, int, list[tuple[int, int, int, int]]]:
        """Follow ``tokens`` down the stored content from ``start`` (a block hash and the
        pages of ``tokens`` it covers): ``(last hash, full pages matched, segments)``, a
        segment being ``(first page, event index, position, pages)``."""
        ps = self.page_size
        limit = len(tokens) // ps if limit_pages is None else min(limit_pages, len(tokens) // ps)
        h, p = start
        segs: list[tuple[int, int, int, int]] = []
        child, evs = self._child, self.events
        while p < limit:
            v = child.get((h, self._page_key(tokens, p)))
            if v is None:
                break
            ei, j = v
            ev = evs[ei]
            n = min(len(ev.hashes) - j, limit - p)
            m = _match_pages(ev.tokens, j * ps, tokens, p * ps, n, ps)
            if m == 0:
                break  # a page-key collision (ps > 1): tokens differ
            segs.append((p, ei, j, m))
            h = ev.hashes[j + m - 1]
            p += m
        return h, p, segs

    def finish_pages(
        self, h: int | None, tail: list[int], k: int, finish_ns: int
    ) -> tuple[array, int, bool] | None:
        """Tokens of up to ``k`` pages stored under block ``h`` (``None`` = the root) by the
        first event published from ``finish_ns`` on whose run below ``h`` starts with
        ``tail``, the hash of the last of those pages and whether that event also held other
        stores (tail merging); ``None`` when there is none in the search window."""
        ps = self.page_size
        evs = self._ts
        i = bisect_left(evs, finish_ns - FINISH_SLACK_NS)
        end = min(len(evs), i + FINISH_MAX_EVENTS)
        horizon = finish_ns + FINISH_WINDOW_NS
        want_tail = array("q", tail)
        for ei in range(i, end):
            ev = self.events[ei]
            if ev.ts_ns > horizon:
                break
            if ev.parent == h:
                j = 0
            else:
                try:
                    j = ev.hashes.index(h) + 1  # type: ignore[arg-type]
                except ValueError:
                    continue
                if j >= len(ev.hashes):
                    continue
            if tail and ev.tokens[j * ps : j * ps + len(tail)] != want_tail:
                continue
            m = min(k, len(ev.hashes) - j)
            merged = j > 0 or j + m < len(ev.hashes)
            return ev.tokens[j * ps : (j + m) * ps], ev.hashes[j + m - 1], merged
        return None


def _match_pages(ev_tokens: array, a: int, tokens: list[int], b: int, n: int, ps: int) -> int:
    """How many of ``n`` pages agree between ``ev_tokens[a:]`` and ``tokens[b:]``."""
    if ev_tokens[a : a + n * ps] == array("q", tokens[b : b + n * ps]):
        return n
    lo, hi = 0, n - 1  # page n differs somewhere: binary search the longest equal prefix
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if ev_tokens[a : a + mid * ps] == array("q", tokens[b : b + mid * ps]):
            lo = mid
        else:
            hi = mid - 1
    return lo
