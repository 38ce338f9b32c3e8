"""Output token ids recovered from a capture's KV events (production captures).

What this file owns: ``StoreIndex``, the content of every ``BlockStored`` event of a bundle
(all endpoints / DP ranks together: a block hash is a function of the tokens only), sorted
by publish time, and the lookups a production replay needs when requests were recorded
without output ids (SGLang's ``--export-metrics-to-file``):

* ``prefill_run(prompt, cached, ...)``: the request's own prefill store -- the run of
  ``prompt[cached:]``'s full pages (``cached`` = its recorded ``cached_tokens``) published
  between its receive and its finish, followed across chunks -- giving the hash of the
  prompt's last full page ``h_L`` and the block it attached to. A search of a few events
  near the request, not a walk of the whole prompt;
* (a prompt with no prefill store of its own -- fully cached -- is hashed instead:
  ``format.hashes.block_hashes``, SGLang's chained SHA-256);
* ``finish_pages(h_L, tail, k, finish_ns)``: the request's finish store -- the event run
  whose first block's parent is ``h_L`` (also inside an event where tail merging appended
  it to the request's own prefill store, or put the next request's store after it),
  published at or after the request's recorded finish. Its ``token_ids`` are the prompt's
  partial tail page plus the output tokens SGLang inserted (all but the last output token at
  page size 1; all full pages at page size > 1). The rest of the output is never inserted,
  so it never changes a block hash or a cache hit.

Memory: the decoded events' tokens (``storetokens.StoredTokens``: every event's ids end to
end in one buffer, 4 bytes a token, made from the decoded ints while they are fresh;
compared with the records' prompts as bytes, sliced into output ids) and every block hash in
one int64 array (``hashes``, decoded from the msgpack bytes of all events at once: a hash is
only ever looked at, never kept as a Python int), and two indexes of event numbers (by
parent hash, by first token: one int per event each) so that a lookup visits only its
candidates; a prefill store merged into another request's event is found by one search of
the window's page heads (``StoredTokens.heads``), not a walk of its events.

Why ~650 lines: one class, ``StoreIndex``, whose build (the one pass over the events, the
flush scan and the settings tally fed on the way) and lookups share its columns and windows.
"""

from __future__ import annotations

from array import array
from bisect import bisect_left, bisect_right
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from itertools import accumulate
from typing import Any

import numpy as np

from kvcadence.format import wire
from kvcadence.format.bundle import event_payload_view
from kvcadence.format.hashes import norm_hash
from kvcadence.format.schema import AnnotationRawView, BlockStored, EventFrameIdsView, seconds
from kvcadence.replay.config import DECODE_LOG_INTERVAL
from kvcadence.replay.flushes import NOTE_KINDS
from kvcadence.replay.stored import (
    I64_TYPES,
    WIRE_I64,
    StoreRows,
    frame_stores,
    packed,
    payload_stores,
)
from kvcadence.replay.storetokens import StoredTokens
from kvcadence.replay.tokens import as_list, compact, same_ids, span

#: a finish store is searched from this long before the recorded finish (clock granularity)
FINISH_SLACK_NS = 50_000_000
#: ... up to this long after it (publish points: next prefill result, 40th decode, idle)
FINISH_WINDOW_NS = 120_000_000_000
#: ... scanning at most this many events
FINISH_MAX_EVENTS = 4096


#: a request's search windows (``StoreIndex.windows``): the first event published from its
#: receive (less ``FINISH_SLACK_NS``), the first after its finish plus that slack, the first
#: from its finish less it, the first after its finish plus ``FINISH_WINDOW_NS``
Window = tuple[int, int, int, int]


@dataclass(slots=True)
class StoredEvent:
    """One ``BlockStored`` event: publish time, parent, where its block hashes are in
    ``StoreIndex.hashes`` (``off``, ``pages``) and its tokens (``StoreIndex.events``: a view
    of its columns)."""

    ts_ns: int
    parent: int | None
    off: int
    pages: int
    tokens: list[int]


class StoreIndex:
    """Every stored block of a capture, by content (see module docstring). One column per
    event field (event ``i``: ``_ts[i]``, ``parents[i]``, ``offs[i]``, ``pages[i]``,
    ``tokens[i]``), no object per event."""

    def __init__(self, page_size: int) -> None:
        self.page_size = page_size
        #: every event's block hashes, in event order (``offs``, ``pages``)
        self.hashes: np.ndarray = np.zeros(0, np.int64)
        self._ts: list[int] = []
        self.parents: list[int | None] = []
        #: each event's first position in ``hashes`` (a position's event: bisect)
        self.offs: list[int] = []
        self.pages: list[int] = []
        #: each event's token ids (``storetokens.StoredTokens``: one buffer, 4 bytes a token;
        #: ``tokens[e]`` / ``tokens.span(e, a, b)`` an ``array('I')``, compared with prompts)
        self.tokens = StoredTokens(page_size)
        #: event indices (ascending) by parent hash and by first token: the candidates the
        #: lookups would otherwise find by walking every event of their window
        self._by_parent: dict[int | None, list[int]] = {}
        self._by_first: dict[int, list[int]] = {}
        #: each event's frame number (``from_reader``'s count) and the DP rank of the frames
        #: of a rank other than 0 (``rank_of``)
        self.frame_of: list[int] = []
        self.frame_rank: dict[int, int] = {}
        #: per endpoint, the least seq of its first epoch's frames (``from_reader``): above 0,
        #: the capture lost that stream's start (``lost_start``)
        self.first_seq: dict[int, int] = {}
        #: the worker's ``chunked_prefill_size`` (the header's ``/server_info`` snapshot;
        #: None: chunking off or not stated)
        self.chunk_tokens: int | None = None
        #: the worker's ``--decode-log-interval`` (SGLang's default where the capture has no
        #: snapshot): a store made in a decode pass is published at the next prefill result
        #: or at the interval-th decode pass, whichever comes first
        self.decode_log_interval = DECODE_LOG_INTERVAL
        #: the ``cache_salt`` of each salted event (a salted namespace's store; none: absent)
        self.salts: dict[int, str] = {}

    @property
    def events(self) -> list[StoredEvent]:
        """Every event, in publish order (built on each call: a view for inspection)."""
        return [
            StoredEvent(ts, parent, off, pages, as_list(toks))
            for ts, parent, off, pages, toks in zip(
                self._ts, self.parents, self.offs, self.pages, self.tokens, strict=True
            )
        ]

    # ------------------------------------------------------------------ building
    @classmethod
    def from_batches(cls, batches: Iterable[tuple[int, Any]], page_size: int) -> StoreIndex:
        """``batches``: ``(publish_ns, events)`` pairs (any order, all ranks)."""
        idx = cls(page_size)
        rows = StoreRows()
        for n, (ts, evs) in enumerate(batches):
            for e in evs:
                if isinstance(e, BlockStored) and e.block_hashes:
                    if e.block_size != page_size or len(e.token_ids) != page_size * len(
                        e.block_hashes
                    ):
                        continue  # bigram keys or another page size: not indexable
                    if e.token_ids and not isinstance(e.token_ids[0], int):
                        continue
                    rows.add(
                        ts,
                        n,
                        None if e.parent_block_hash is None else norm_hash(e.parent_block_hash),
                        packed(e.block_hashes),  # int64, as the parent: SGLang's form
                        len(e.block_hashes),
                        e.token_ids,
                        e.cache_salt,
                    )
        idx._extend(rows)  # in publish order (stable: batch order within a time)
        return idx

    @classmethod
    def from_reader(
        cls, reader: Any, page_size: int, scan: Any = None, tally: Any = None
    ) -> StoreIndex:
        """From a ``BundleReader``'s event frames (payload ``ts``; ``recv_ns`` if it lacks
        one). Only ``BlockStored`` hashes and tokens are decoded, once: the common frame
        with its payload in one decode (``schema.EventFrameIdsView``: token ids into lists, hashes and
        removals left as bytes), any other through ``wire.decode_batch_raw`` (``stored.payload_stores``);
        each event's hashes' bytes and token ids copied into one buffer each as they come
        (``stored.StoreRows``), the hashes made one array once the pass is done. An event whose fields are not
        int arrays (bigram keys, damage) is skipped, a payload ``decode_batch_raw`` refuses
        holds nothing. ``scan`` (a ``flushes.FlushScan``) is fed every frame and annotation
        of the same pass (a frame with a clear is decoded fully first: a payload
        ``wire.decode_batch`` refuses is no flush); ``tally`` (a ``settings.EventTally``)
        every decoded batch."""
        idx = cls(page_size)
        chunk = (reader.header.server_info or {}).get("chunked_prefill_size")
        if type(chunk) is int and chunk > 0:
            idx.chunk_tokens = chunk
        interval = (reader.header.server_info or {}).get("decode_log_interval")
        if type(interval) is int and interval > 0:
            idx.decode_log_interval = interval
        rows = StoreRows()
        # notes: only the flush scan reads them, only two kinds (the others are not decoded)
        # event frames: the common payload decoded with the frame (``schema.EventFrameIdsView``)
        records = reader.events_and_notes(NOTE_KINDS if scan else (), events_as=EventFrameIdsView)
        # the endpoints of DP ranks other than 0 (a frame of another endpoint: its payload's)
        ep_rank = {e.id: e.dp_rank for e in reader.header.endpoints}
        frame_rank = idx.frame_rank
        first_seq = idx.first_seq
        for n, f in enumerate(records):
            t = type(f)
            if t is not AnnotationRawView and f.epoch == 0:
                least = first_seq.get(f.endpoint)
                if least is None or f.seq < least:
                    first_seq[f.endpoint] = f.seq
            if t is EventFrameIdsView:  # the common frame: no clear in it
                b = f.payload
                rank = ep_rank.get(f.endpoint)
                if rank is None:
                    rank = b.attn_dp_rank
                if rank:
                    frame_rank[n] = rank
                if scan is not None:
                    scan.frame(f, b.ts, ())
                if tally is not None:
                    tally.batch(b, f.endpoint)
                bts = seconds(b.ts)
                ts = f.recv_ns if bts is None else int(bts * 1e9)
                frame_stores(b, page_size, ts, n, rows)
                continue
            if t is AnnotationRawView:
                if scan is not None:
                    scan.note(f)
                continue
            payload = event_payload_view(f)  # decoded here and now: no copy
            try:
                b, got, clear = payload_stores(payload, page_size)
            except Exception:  # noqa: BLE001 - a torn payload holds no usable store
                continue
            if tally is not None:
                tally.batch(b, f.endpoint)
            rank = ep_rank.get(f.endpoint)
            if rank is None:
                rank = getattr(b, "attn_dp_rank", None)
            if rank:
                frame_rank[n] = rank
            if scan is not None:
                if clear:
                    try:
                        full = wire.decode_batch(payload)
                    except Exception:  # noqa: BLE001 - as recorded_flushes: not a flush
                        full = None
                    if full is not None:
                        scan.frame(f, full.ts, full.events)
                else:
                    scan.frame(f, b.ts, ())
            bts = seconds(b.ts)
            ts = f.recv_ns if bts is None else int(bts * 1e9)
            for parent, hashes, pages, tokens, salt in got:
                # into the rows' buffers while its ints are fresh: no int object is kept
                rows.add(ts, n, parent, hashes, pages, tokens, salt)
        idx._extend(rows)  # in publish order (stable: frame order within a time)
        return idx

    def _extend(self, rows: StoreRows) -> None:
        """Append the stores of ``rows`` in publish order (``ts``; stable: the rows' order
        within a time) and index them; a store whose hashes are not all 64-bit ints
        (``stored.frame_stores``' unchecked ones: every type byte is checked here at once)
        is left out. The rows' buffers are taken over or gathered, not copied per store."""
        n = len(rows)
        if not n:
            return
        first_ei = len(self.offs)
        off0 = len(self.hashes)
        pages = np.fromiter(rows.pages, np.int64, n)
        ends = np.cumsum(pages)
        packs = np.frombuffer(rows.hbuf, WIRE_I64)
        keep: np.ndarray | None = None
        if rows.hbuf[::9].translate(None, I64_TYPES):  # rare: some hash is not an int
            t = packs["t"]
            bad = np.flatnonzero((t != 0xCF) & (t != 0xD3))
            keep = np.ones(n, dtype=bool)
            keep[np.searchsorted(ends, bad, side="right")] = False
        ts = np.fromiter(rows.ts, np.int64, n)
        order: np.ndarray | None = None
        if keep is not None or (n > 1 and bool((ts[1:] < ts[:-1]).any())):
            sel = np.flatnonzero(keep) if keep is not None else np.arange(n)
            order = sel[np.argsort(ts[sel], kind="stable")]
            if not len(order):  # every store dropped
                return
        ps = self.page_size
        cols: tuple[list[Any], ...] = (rows.ts, rows.frame, rows.parent, rows.pages, rows.salt)
        if order is None:  # the usual pass: already in publish order, every hash an int
            more = packs["v"].astype(np.int64)
            tokens: Any = rows.tbuf
            wide = rows.wide
        else:
            at = order.tolist()
            cols = tuple([c[i] for i in at] for c in cols)
            page_at = _segments(ends - pages, pages, order)
            more = packs["v"][page_at].astype(np.int64)
            del page_at
            tokens = _gathered_tokens(rows.tbuf, (ends - pages) * ps, pages * ps, order)
            new_row = {old: k for k, old in enumerate(at)}
            wide = {new_row[r]: ids for r, ids in rows.wide.items() if r in new_row}
        del packs
        rows.hbuf = bytearray()  # let go: the hashes are in ``more`` now
        ts_c, frames, parents, n_pages, salts = cols
        # the first batch is the array itself (no copy of every hash)
        self.hashes = np.concatenate([self.hashes, more]) if off0 else more
        self._ts.extend(ts_c)
        self.frame_of.extend(frames)
        self.parents.extend(parents)
        self.pages.extend(n_pages)
        self.offs.extend(accumulate(n_pages[:-1], initial=off0))
        if any(salts):
            self.salts.update((ei, x) for ei, x in enumerate(salts, first_ei) if x is not None)
        by_parent, by_first = self._by_parent, self._by_first
        for ei, parent in enumerate(parents, first_ei):
            lst = by_parent.get(parent)
            if lst is None:
                by_parent[parent] = [ei]
            else:
                lst.append(ei)
        rows.tbuf = bytearray()
        self.tokens.extend_flat(tokens, n_pages, wide)
        del tokens
        for ei, first in enumerate(self.tokens.firsts(first_ei), first_ei):
            lst = by_first.get(first)
            if lst is None:
                by_first[first] = [ei]
            else:
                lst.append(ei)

    @property
    def lost_start(self) -> bool:
        """Some stream of the capture lost its start: the least seq of an endpoint's first
        epoch is above 0 (its earlier messages neither received live nor recovered; the
        order frames were written in does not matter). ``heldbefore.late_endpoints``' rule,
        read from this pass's frames instead of a pass for the gap records. False for an
        index not built ``from_reader`` (no seqs)."""
        return any(s > 0 for s in self.first_seq.values())

    def rank_of(self, ei: int) -> int:
        """The DP rank that published event ``ei`` (0 for a one-rank capture)."""
        return self.frame_rank.get(self.frame_of[ei], 0) if self.frame_rank else 0

    def ts_of(self, ei: int) -> int:
        """Event ``ei``'s publish time (ns)."""
        return self._ts[ei]

    def shift(self, by: Any) -> None:
        """Every event's publish time less its offset in ``by`` (a ``clocks.ClockMap``):
        onto the request records' clock, stretch by stretch."""
        firsts = [*by.firsts[1:], len(self._ts)]
        out: list[int] = []
        for k, off in enumerate(by.offsets):
            out.extend(t - off for t in self._ts[by.firsts[k] : firsts[k]])
        self._ts = out

    def hashes_of(self, ei: int) -> list[int]:
        """The block hashes of event ``ei``."""
        off = self.offs[ei]
        return self.hashes[off : off + self.pages[ei]].tolist()

    def hash_at(self, ei: int, j: int) -> int:
        """Block hash ``j`` of event ``ei``."""
        return self.hashes.item(self.offs[ei] + j)

    def _find(self, ei: int, h: int) -> int:
        """The position of hash ``h`` in event ``ei`` (its first), -1 if absent."""
        off = self.offs[ei]
        at = np.flatnonzero(self.hashes[off : off + self.pages[ei]] == h)
        return int(at[0]) if len(at) else -1

    # ------------------------------------------------------------------ lookups
    def windows(self, arrivals: Sequence[int], finishes: Sequence[int]) -> list[Window]:
        """The search windows of requests (receive, finish), for ``prefill_run`` and
        ``finish_pages``: every publish-time bisection they make, for all requests in one
        vectorised search (``Window``)."""
        if not len(arrivals):
            return []
        # (``fromiter``: ``np.array`` of a list of ints looks at each one's type first)
        ts = np.fromiter(self._ts, np.int64, len(self._ts))
        arr = np.fromiter(arrivals, np.int64, len(arrivals))
        fin = np.fromiter(finishes, np.int64, len(finishes))
        cols = (
            np.searchsorted(ts, arr - FINISH_SLACK_NS, "left"),
            np.searchsorted(ts, fin + FINISH_SLACK_NS, "right"),
            np.searchsorted(ts, fin - FINISH_SLACK_NS, "left"),
            np.searchsorted(ts, fin + FINISH_WINDOW_NS, "right"),
        )
        return list(zip(*(c.tolist() for c in cols), strict=True))

    def _until(self, i: int, right: int) -> int:
        """``bisect_right(ts, x, i, min(len(ts), i + FINISH_MAX_EVENTS))`` from ``right``, the
        unbounded ``bisect_right(ts, x)``."""
        hi = i + FINISH_MAX_EVENTS
        if hi > len(self._ts):
            hi = len(self._ts)
        return i if right < i else hi if right > hi else right

    def prefill_run(
        self,
        prompt: Sequence[int],
        cached: int,
        t0: int,
        t1: int,
        win: Window | None = None,
        length: int | None = None,
        rank: int | None = None,
    ) -> tuple[int, list[tuple[int, int, int, int]], int | None] | None:
        """The prefill store(s) of ``prompt[cached:]``'s full pages published in ``[t0, t1]``
        (receive .. finish): ``(hash of the last full page, segments ``(first page, event
        index, position, pages)``, the hash the first page attached to)``; ``None`` when not
        found (nothing new stored, another page size, or outside the window). ``win``:
        ``windows``' for (``t0``, ``t1``) when the caller has it; ``length``:
        ``len(prompt)``, when the caller has it. ``rank``: the DP rank that served the
        request (a multi-rank capture): that rank's stores only (another rank's store of the
        same pages -- parallel samples of one prompt routed to both -- is not its), every
        rank's when that finds none (a rank the record misstates)."""
        if rank is not None and self.frame_rank:
            got = self._prefill_run(prompt, cached, t0, t1, win, length, rank)
            if got is not None:
                return got
        return self._prefill_run(prompt, cached, t0, t1, win, length, None)

    def _prefill_run(
        self,
        prompt: Sequence[int],
        cached: int,
        t0: int,
        t1: int,
        win: Window | None,
        length: int | None,
        rank: int | None,
    ) -> tuple[int, list[tuple[int, int, int, int]], int | None] | None:
        """``prefill_run`` among ``rank``'s events (every rank's: None)."""
        ps = self.page_size
        pages = (len(prompt) if length is None else length) // ps
        start = cached // ps
        if start >= pages or cached < 0:
            return None
        ts = self._ts
        if win is None:
            i = bisect_left(ts, t0 - FINISH_SLACK_NS)
            end = bisect_right(ts, t1 + FINISH_SLACK_NS, i, min(len(ts), i + FINISH_MAX_EVENTS))
        else:
            i = win[0]
            end = self._until(i, win[1])
        # the pages looked for, as an array once (compared with the events' arrays)
        want = span(prompt, start * ps, pages * ps)
        found = self._first_chunk(want, start, pages, i, end, rank)
        if found is None:
            return None
        e0, j, n = found
        hashes, offs = self.hashes, self.offs
        base = self.parents[e0] if j == 0 else hashes.item(offs[e0] + j - 1)
        segs = [(start, e0, j, n)]
        cur = hashes.item(offs[e0] + j + n - 1)
        p = start + n
        if p >= pages:  # one chunk (the usual prompt)
            return cur, segs, base
        parents, n_pages, tokens = self.parents, self.pages, self.tokens
        for ei in range(e0 + 1, end):  # later chunks: chained below the last page found
            if p >= pages:
                break
            if rank is not None and self.rank_of(ei) != rank:
                continue
            if parents[ei] == cur:
                j = 0
            else:
                j = self._find(ei, cur) + 1
                if j == 0 or j >= n_pages[ei]:
                    continue
            n = min(n_pages[ei] - j, pages - p)
            a = (p - start) * ps
            if not tokens.same(ei, j * ps, (j + n) * ps, want[a : a + n * ps]):
                continue
            segs.append((p, ei, j, n))
            cur = hashes.item(offs[ei] + j + n - 1)
            p += n
        return (cur, segs, base) if p >= pages else None

    def _first_chunk(
        self, prompt: Sequence[int], start: int, pages: int, i: int, end: int, rank: int | None
    ) -> tuple[int, int, int] | None:
        """``(event, position, pages)`` of the first run of the pages ``start`` .. ``pages``
        (``prompt``: their tokens) among events ``[i, end)`` (of DP rank ``rank``; None:
        every rank's): at an event's start, or (tail merging: after another request's finish
        store) anywhere in an earlier event -- the earliest wins (a later event starting
        with them is a re-store after an eviction, e.g. the next turn's: live capture of
        driver traffic, a 110-page prefill merged below a 3-page finish store, whose pages
        the next turn stored again, was taken for an aborted request's)."""
        ps, n_pages, tokens = self.page_size, self.pages, self.tokens
        want = prompt[0]
        cands = self._by_first.get(want, ())  # the events of [i, end) starting with ``want``
        c = bisect_left(cands, i)
        left = pages - start
        found = None
        while c < len(cands) and cands[c] < end:
            ei = cands[c]
            c += 1
            if rank is not None and self.rank_of(ei) != rank:
                continue
            n = n_pages[ei] if n_pages[ei] < left else left
            if tokens.same(ei, 0, n * ps, prompt if n == left else prompt[: n * ps]):
                end, found = ei, (ei, 0, n)  # an earlier event may hold them after another's
                break
        if end <= i:
            return found
        # the pages of events [i, end) whose first token is ``want`` (``StoredTokens.heads``:
        # one C search over the window's page heads); an event's first page is a candidate
        # above already
        offs = self.offs
        for pos in tokens.heads(want, offs[i], offs[end - 1] + n_pages[end - 1]):
            ei = bisect_right(offs, pos, i, end) - 1
            j = pos - offs[ei]
            if j == 0 or (rank is not None and self.rank_of(ei) != rank):
                continue
            n = min(n_pages[ei] - j, left)
            if tokens.same(ei, j * ps, (j + n) * ps, prompt[: n * ps]):
                return ei, j, n
        return found

    def finish_pages(
        self,
        h: int | None,
        tail: Sequence[int],
        k: int,
        arrival_ns: int,
        finish_ns: int,
        at: tuple[int, int] | None = None,
        taken: dict[tuple[int, int], int] | None = None,
        win: Window | None = None,
        rank: int | None = None,
    ) -> tuple[array, int, bool, tuple[int, int], bool] | None:
        """The finish store below block ``h`` (``None`` = the root): the tokens of up to
        ``k`` pages of the first run below ``h`` that starts with ``tail``, the hash of its
        last page and whether its event also held other stores (tail merging); ``None``
        when the search window holds none.

        Searched, in this order: right after ``h`` in the request's own prefill event
        (``at`` = (event, position of ``h``): prefill and finish stores merged); then the
        first later event whose parent is ``h``; then (rare: merged after another store
        ending at ``h``) any event holding ``h`` from ``finish_ns`` on.

        ``taken``: runs ``(event, position)`` an earlier request already claimed (parallel
        samples of one prompt all chain below ``h``). The first unclaimed run wins; only when
        every run found is claimed is the first claimed one returned (identical outputs:
        the later sample inserted nothing new). The result also says where the run is
        (``(event, position)``) and whether a claimed run was met on the way (a tie).
        ``win``: ``windows``' for (``arrival_ns``, ``finish_ns``) when the caller has it.
        ``rank``: as ``prefill_run``'s (that rank's stores first, every rank's when it has
        none: samples of one prompt on two ranks each store their own run below ``h``)."""
        query = (h, tail, k, arrival_ns, finish_ns, at, taken, win)
        if rank is not None and self.frame_rank:
            got = self._finish_pages(query, rank)
            if got is not None:
                return got
        return self._finish_pages(query, None)

    def _finish_pages(
        self, query: tuple[Any, ...], rank: int | None
    ) -> tuple[array, int, bool, tuple[int, int], bool] | None:
        """``finish_pages`` (its arguments, ``query``) among ``rank``'s events (every rank's:
        None)."""
        h, tail, k, arrival_ns, finish_ns, at, taken, win = query
        ts = self._ts
        horizon = finish_ns + FINISH_WINDOW_NS
        claimed = taken or {}
        tail = compact(tail) if tail else tail  # compared with the events' arrays
        #: the first claimed run found: (tokens, last hash, merged, (event, position))
        shared: tuple[array, int, bool, tuple[int, int]] | None = None
        tie = False
        if at is not None:
            where = (at[0], at[1] + 1)
            # (``_run`` of a position past the event's end: None, the usual case)
            got = self._run(where[0], where[1], tail, k) if where[1] < self.pages[at[0]] else None
            if got is not None:
                if where not in claimed:
                    return got[0], got[1], got[2], where, False
                tie = True
                shared = (got[0], got[1], got[2], where)
            i = at[0] + 1
        elif win is None:
            i = bisect_left(ts, arrival_ns - FINISH_SLACK_NS)
        else:
            i = win[0]
        # the events below ``h`` among [i, i + FINISH_MAX_EVENTS) published by the horizon
        if win is None:
            stop = bisect_right(ts, horizon, i, min(len(ts), i + FINISH_MAX_EVENTS))
        else:
            stop = self._until(i, win[3])
        cands = self._by_parent.get(h, ())
        c = bisect_left(cands, i)
        while c < len(cands) and cands[c] < stop:
            if rank is not None and self.rank_of(cands[c]) != rank:
                c += 1
                continue
            where = (cands[c], 0)
            got = self._run(where[0], 0, tail, k)
            if got is not None:
                if where not in claimed:
                    return got[0], got[1], got[2], where, tie
                tie = True
                if shared is None:
                    shared = (got[0], got[1], got[2], where)
            c += 1
        # the events holding ``h`` among the FINISH_MAX_EVENTS from the finish, by the
        # horizon: one comparison over their hashes, then the first ``h`` of each event
        if win is None:
            i = bisect_left(ts, finish_ns - FINISH_SLACK_NS)
            stop = bisect_right(ts, horizon, i, min(len(ts), i + FINISH_MAX_EVENTS))
        else:
            i = win[2]
            stop = self._until(i, win[3])
        if h is not None and i < stop:
            offs = self.offs
            lo = offs[i]
            hi = offs[stop - 1] + self.pages[stop - 1]
            seen = -1
            for pos in (np.flatnonzero(self.hashes[lo:hi] == h) + lo).tolist():
                ei = bisect_right(offs, pos, i, stop) - 1
                if ei == seen or (rank is not None and self.rank_of(ei) != rank):
                    continue  # not the event's first ``h``, or another rank's
                seen = ei
                where = (ei, pos - offs[ei] + 1)
                got = self._run(where[0], where[1], tail, k)
                if got is not None:
                    if where not in claimed:
                        return got[0], got[1], got[2], where, tie
                    tie = True
                    if shared is None:
                        shared = (got[0], got[1], got[2], where)
        return None if shared is None else (shared[0], shared[1], shared[2], shared[3], True)

    def _run(self, ei: int, j: int, tail: Sequence[int], k: int) -> tuple[array, int, bool] | None:
        """Event ``ei``'s run from page ``j`` when it starts with ``tail``: the tokens of up to
        ``k`` pages, the hash of its last page, whether the event holds more (merged)."""
        pages = self.pages[ei]
        if j >= pages:
            return None
        ps = self.page_size
        m = pages - j
        if k < m:
            m = k
        toks = self.tokens.span(ei, j * ps, (j + m) * ps)
        if tail and not same_ids(toks[: len(tail)], tail):
            return None
        last = self.hashes.item(self.offs[ei] + j + m - 1)
        return toks, last, j > 0 or j + m < pages


def _segments(starts: np.ndarray, sizes: np.ndarray, order: np.ndarray) -> np.ndarray:
    """The positions of segments ``order`` (``starts[k] .. starts[k] + sizes[k]`` each) end to
    end, in that order (an int64 array)."""
    sz = sizes[order]
    if not len(sz):
        return np.zeros(0, np.int64)
    new_start = np.cumsum(sz) - sz
    return np.repeat(starts[order] - new_start, sz) + np.arange(int(sz.sum()), dtype=np.int64)


#: ``_gathered_tokens`` gathers this many stores at a time (bounded index temporaries)
_GATHER_ROWS = 4096


def _gathered_tokens(
    tbuf: bytearray, starts: np.ndarray, sizes: np.ndarray, order: np.ndarray
) -> bytearray:
    """The tokens of the stores ``order`` (``tbuf[starts[k] : starts[k] + sizes[k]]`` each)
    end to end, in that order: a few thousand stores at a time (an index per token of a
    few thousand stores, not of all of them)."""
    src = np.frombuffer(tbuf, dtype=np.uint32) if len(tbuf) else np.zeros(0, np.uint32)
    out = bytearray()
    for c in range(0, len(order), _GATHER_ROWS):
        part = order[c : c + _GATHER_ROWS]
        out += src[_segments(starts, sizes, part)].tobytes()
    return out
