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
  ``capture.hashes.block_hashes``, SGLang's chained SHA-256);
* ``finish_pages(h_L, tail, k, finish_ns)``: the request's finish store -- the event run
  whose first block's parent is ``h_L`` (also inside an event where tail merging appended
  it to the request's own prefill store, or put the next request's store after it),
  published at or after the request's recorded finish. Its ``token_ids`` are the prompt's
  partial tail page plus the output tokens SGLang inserted (all but the last output token at
  page size 1; all full pages at page size > 1). The rest of the output is never inserted,
  so it never changes a block hash or a cache hit.

Memory: the decoded events' tokens (lists: they are compared with the records' prompts and
become output ids) and every block hash in one int64 array (``hashes``, decoded from the
msgpack bytes of all events at once: a hash is only ever looked at, never kept as a Python
int), and two indexes of event numbers (by parent hash, by first token: one int per event
each) so that a lookup visits only its candidates.
"""

from __future__ import annotations

from bisect import bisect_left, bisect_right
from collections.abc import Iterable
from dataclasses import dataclass
from operator import itemgetter
from typing import Any, Union

import msgspec
import numpy as np

from kvcadence.format import wire
from kvcadence.format.bundle import event_payload_view
from kvcadence.format.hashes import norm_hash
from kvcadence.format.schema import (
    AllBlocksCleared,
    AnnotationRawView,
    BlockRemovedRawView,
    BlockStored,
    BlockStoredRawView,
    BlockStoredV17RawView,
    BundleRecordBase,
    Int64,
    KVCacheEvent,
)
from kvcadence.replay.flushes import NOTE_KINDS

#: a finish store is searched from this long before the recorded finish (clock granularity)
FINISH_SLACK_NS = 50_000_000
#: ... up to this long after it (publish points: next prefill result, 40th decode, idle)
FINISH_WINDOW_NS = 120_000_000_000
#: ... scanning at most this many events
FINISH_MAX_EVENTS = 4096


@dataclass(slots=True)
class StoredEvent:
    """One ``BlockStored`` event: publish time, parent, where its block hashes are in
    ``StoreIndex.hashes`` (``off``, ``pages``) and its tokens."""

    ts_ns: int
    parent: int | None
    off: int
    pages: int
    tokens: list[int]


class StoreIndex:
    """Every stored block of a capture, by content (see module docstring)."""

    def __init__(self, page_size: int) -> None:
        self.page_size = page_size
        self.events: list[StoredEvent] = []
        #: every event's block hashes, in event order (``StoredEvent.off``, ``pages``)
        self.hashes: np.ndarray = np.zeros(0, np.int64)
        self._ts: list[int] = []
        self._offs: list[int] = []  # each event's ``off`` (a position's event: bisect)
        #: event indices (ascending) by parent hash and by first token: the candidates the
        #: lookups would otherwise find by walking every event of their window
        self._by_parent: dict[int | None, list[int]] = {}
        self._by_first: dict[int, list[int]] = {}

    # ------------------------------------------------------------------ building
    @classmethod
    def from_batches(cls, batches: Iterable[tuple[int, Any]], page_size: int) -> StoreIndex:
        """``batches``: ``(publish_ns, events)`` pairs (any order, all ranks)."""
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
        idx._extend(
            [
                (
                    ts,
                    None if e.parent_block_hash is None else norm_hash(e.parent_block_hash),
                    _packed(e.block_hashes),  # int64, as the parent: SGLang's form
                    len(e.block_hashes),
                    e.token_ids,
                )
                for ts, _, e in raw
            ]
        )
        return idx

    @classmethod
    def from_reader(cls, reader: Any, page_size: int, scan: Any = None) -> StoreIndex:
        """From a ``BundleReader``'s event frames (payload ``ts``; ``recv_ns`` if it lacks
        one). Only ``BlockStored`` hashes and tokens are decoded, once
        (``wire.decode_batch_raw``: removals stay undecoded bytes; the hashes of all events
        together, into one array); an event whose fields are not int arrays (bigram keys,
        damage) is skipped, a payload ``decode_batch_raw`` refuses holds nothing. ``scan``
        (a ``flushes.FlushScan``) is fed every frame and annotation of the same pass (a
        frame with a clear is decoded fully first: a payload ``wire.decode_batch`` refuses
        is no flush)."""
        idx = cls(page_size)
        raw: list[tuple[int, int, int | None, bytes, int, list[int]]] = []
        # notes: only the flush scan reads them, only two kinds (the others are not decoded)
        # event frames: the common payload decoded with the frame (``_FrameIds``)
        records = reader.events_and_notes(NOTE_KINDS if scan else (), events_as=_FrameIds)
        for n, f in enumerate(records):
            t = type(f)
            if t is AnnotationRawView:
                if scan is not None:
                    scan.note(f)
                continue
            if t is _FrameIds:
                b = f.payload
                got = _stored_ids(b, page_size)
                clear = False
            else:
                payload = event_payload_view(f)  # decoded here and now: no copy
                try:
                    try:  # token ids decoded once, here; a refusal is decode_batch_raw's verdict
                        b, got, clear = _stored(payload, page_size, False)
                    except _Recheck:
                        b, got, clear = _stored(payload, page_size, True)
                except Exception:  # noqa: BLE001 - a torn payload holds no usable store
                    continue
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
            ts = int(b.ts * 1e9) if b.ts and b.ts > 0 else f.recv_ns
            for parent, hashes, pages, tokens in got:
                raw.append((ts, n, parent, hashes, pages, tokens))
        raw.sort(key=itemgetter(0, 1))
        idx._extend([(r[0], r[2], r[3], r[4], r[5]) for r in raw])
        return idx

    def _extend(self, rows: list[tuple[int, int | None, bytes, int, list[int]]]) -> None:
        """Append events ``(ts, parent, hashes as _packed bytes, pages, tokens)``, in publish
        order, and index them."""
        base = len(self.events)
        off = len(self.hashes)
        events = self.events
        for ts, parent, _, pages, tokens in rows:
            events.append(StoredEvent(ts, parent, off, pages, tokens))
            off += pages
        self.hashes = np.concatenate([self.hashes, _unpacked(b"".join([r[2] for r in rows]))])
        self._ts.extend([r[0] for r in rows])
        self._offs.extend([ev.off for ev in events[base:]])
        by_parent, by_first = self._by_parent, self._by_first
        for ei, (_, parent, _, _, tokens) in enumerate(rows, base):
            lst = by_parent.get(parent)
            if lst is None:
                by_parent[parent] = [ei]
            else:
                lst.append(ei)
            first = tokens[0]
            lst = by_first.get(first)
            if lst is None:
                by_first[first] = [ei]
            else:
                lst.append(ei)

    def hashes_of(self, ei: int) -> list[int]:
        """The block hashes of event ``ei``."""
        ev = self.events[ei]
        return self.hashes[ev.off : ev.off + ev.pages].tolist()

    def hash_at(self, ei: int, j: int) -> int:
        """Block hash ``j`` of event ``ei``."""
        return int(self.hashes[self.events[ei].off + j])

    def _find(self, ei: int, h: int) -> int:
        """The position of hash ``h`` in event ``ei`` (its first), -1 if absent."""
        ev = self.events[ei]
        at = np.flatnonzero(self.hashes[ev.off : ev.off + ev.pages] == h)
        return int(at[0]) if len(at) else -1

    # ------------------------------------------------------------------ lookups
    def prefill_run(
        self, prompt: list[int], cached: int, t0: int, t1: int
    ) -> tuple[int, list[tuple[int, int, int, int]], int | None] | None:
        """The prefill store(s) of ``prompt[cached:]``'s full pages published in ``[t0, t1]``
        (receive .. finish): ``(hash of the last full page, segments ``(first page, event
        index, position, pages)``, the hash the first page attached to)``; ``None`` when not
        found (nothing new stored, another page size, or outside the window)."""
        ps = self.page_size
        pages = len(prompt) // ps
        start = cached // ps
        if start >= pages or cached < 0:
            return None
        ts = self._ts
        i = bisect_left(ts, t0 - FINISH_SLACK_NS)
        end = bisect_right(ts, t1 + FINISH_SLACK_NS, i, min(len(ts), i + FINISH_MAX_EVENTS))
        found = self._first_chunk(prompt, start, pages, i, end)
        if found is None:
            return None
        e0, j, n = found
        ev = self.events[e0]
        base = ev.parent if j == 0 else self.hash_at(e0, j - 1)
        segs = [(start, e0, j, n)]
        cur = self.hash_at(e0, j + n - 1)
        p = start + n
        for ei in range(e0 + 1, end):  # later chunks: chained below the last page found
            if p >= pages:
                break
            ev = self.events[ei]
            if ev.parent == cur:
                j = 0
            else:
                j = self._find(ei, cur) + 1
                if j == 0 or j >= ev.pages:
                    continue
            n = min(ev.pages - j, pages - p)
            if ev.tokens[j * ps : (j + n) * ps] != prompt[p * ps : (p + n) * ps]:
                continue
            segs.append((p, ei, j, n))
            cur = self.hash_at(ei, j + n - 1)
            p += n
        return (cur, segs, base) if p >= pages else None

    def _first_chunk(
        self, prompt: list[int], start: int, pages: int, i: int, end: int
    ) -> tuple[int, int, int] | None:
        """``(event, position, pages)`` of the first run of ``prompt``'s pages from
        ``start`` among events ``[i, end)``: at an event's start first, then (tail merging:
        after another request's finish store) anywhere in it."""
        ps, evs = self.page_size, self.events
        want = prompt[start * ps]
        cands = self._by_first.get(want, ())  # the events of [i, end) starting with ``want``
        c = bisect_left(cands, i)
        while c < len(cands) and cands[c] < end:
            ev = evs[cands[c]]
            n = min(ev.pages, pages - start)
            if ev.tokens[: n * ps] == prompt[start * ps : (start + n) * ps]:
                return cands[c], 0, n
            c += 1
        for ei in range(i, end):
            toks = evs[ei].tokens
            k = 1
            while True:
                try:
                    k = toks.index(want, k)
                except ValueError:
                    break
                if k % ps == 0:
                    j = k // ps
                    n = min(evs[ei].pages - j, pages - start)
                    if toks[k : k + n * ps] == prompt[start * ps : (start + n) * ps]:
                        return ei, j, n
                k += 1
        return None

    def finish_pages(
        self,
        h: int | None,
        tail: list[int],
        k: int,
        arrival_ns: int,
        finish_ns: int,
        at: tuple[int, int] | None = None,
        taken: dict[tuple[int, int], int] | None = None,
    ) -> tuple[list[int], int, bool, tuple[int, int], bool] | None:
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
        (``(event, position)``) and whether a claimed run was met on the way (a tie)."""
        ps = self.page_size
        evs, ts = self.events, self._ts
        horizon = finish_ns + FINISH_WINDOW_NS
        claimed = taken or {}
        shared: tuple[list[int], int, bool, tuple[int, int], bool] | None = None
        tie = False

        def run(ei: int, j: int) -> tuple[list[int], int, bool, tuple[int, int], bool] | None:
            nonlocal shared, tie
            ev = evs[ei]
            if j >= ev.pages or (tail and ev.tokens[j * ps : j * ps + len(tail)] != tail):
                return None
            m = min(k, ev.pages - j)
            merged = j > 0 or j + m < ev.pages
            got = (
                ev.tokens[j * ps : (j + m) * ps],
                self.hash_at(ei, j + m - 1),
                merged,
                (ei, j),
                tie,
            )
            if (ei, j) in claimed:
                tie = True
                if shared is None:
                    shared = got
                return None
            return got[0], got[1], got[2], got[3], tie

        if at is not None:
            got = run(at[0], at[1] + 1)
            if got is not None:
                return got
            i = at[0] + 1
        else:
            i = bisect_left(ts, arrival_ns - FINISH_SLACK_NS)
        # the events below ``h`` among [i, i + FINISH_MAX_EVENTS) published by the horizon
        stop = bisect_right(ts, horizon, i, min(len(ts), i + FINISH_MAX_EVENTS))
        cands = self._by_parent.get(h, ())
        c = bisect_left(cands, i)
        while c < len(cands) and cands[c] < stop:
            got = run(cands[c], 0)
            if got is not None:
                return got
            c += 1
        # the events holding ``h`` among the FINISH_MAX_EVENTS from the finish, by the
        # horizon: one comparison over their hashes, then the first ``h`` of each event
        i = bisect_left(ts, finish_ns - FINISH_SLACK_NS)
        stop = bisect_right(ts, horizon, i, min(len(ts), i + FINISH_MAX_EVENTS))
        if h is not None and i < stop:
            lo = evs[i].off
            hi = evs[stop - 1].off + evs[stop - 1].pages
            seen = -1
            for pos in (np.flatnonzero(self.hashes[lo:hi] == h) + lo).tolist():
                ei = bisect_right(self._offs, pos, i, stop) - 1
                if ei == seen:
                    continue  # not the event's first ``h``
                seen = ei
                got = run(ei, pos - evs[ei].off + 1)
                if got is not None:
                    return got
        return None if shared is None else (shared[0], shared[1], shared[2], shared[3], True)


_INTS = msgspec.msgpack.Decoder(list[int])
_I64S = msgspec.msgpack.Decoder(list[Int64])
_STORED_VIEWS = (BlockStoredRawView, BlockStoredV17RawView)
#: a 64-bit msgpack int: its type byte (0xcf uint64, 0xd3 int64), then 8 bytes big-endian
_WIRE_I64 = np.dtype([("t", "u1"), ("v", ">i8")])


def _packed(hashes: list[int]) -> bytes:
    """``hashes`` (ints of 64 bits, either sign) as ``_unpacked`` reads them."""
    out = np.empty(len(hashes), _WIRE_I64)
    out["t"] = 0xD3
    out["v"] = [norm_hash(h) for h in hashes]
    return out.tobytes()


def _unpacked(buf: bytes) -> np.ndarray:
    """The int64 array of ``buf``'s 64-bit msgpack ints (``_wire_hashes``, ``_packed``: a
    uint64 one as the int64 of the same bits, SGLang's form, as ``norm_hash``)."""
    return np.frombuffer(buf, _WIRE_I64)["v"].astype(np.int64)


def _wire_hashes(raw: msgspec.Raw) -> tuple[bytes, int] | None:
    """``(elements, count)`` of a msgpack array of hashes when every element is a 64-bit
    int (``0xcf``/``0xd3`` and 8 bytes: SGLang's hashes but ~1 in 2**32): the elements'
    bytes, decoded later with every other event's (``_unpacked``); None when not so shaped
    (decode it as a list instead)."""
    bb = bytes(raw)
    if not bb:
        return None
    b0 = bb[0]
    if 0x90 <= b0 <= 0x9F:
        h, n = 1, b0 & 0x0F
    elif b0 == 0xDC and len(bb) >= 3:
        h, n = 3, bb[1] << 8 | bb[2]
    elif b0 == 0xDD and len(bb) >= 5:
        h, n = 5, int.from_bytes(bb[1:5], "big")
    else:
        return None
    if len(bb) - h != 9 * n or bb[h::9].strip(b"\xcf\xd3"):
        return None
    return bb[h:], n


class _StoredIds(KVCacheEvent, tag="BlockStored"):
    """``BlockStoredRawView`` with its token ids decoded in the frame's one decode (not
    skipped as ``Raw``, then decoded). Typed as the view otherwise."""

    block_hashes: msgspec.Raw
    parent_block_hash: Int64 | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None = None
    cache_salt: str | None = None
    session_id: str | None = None
    lora_name: str | None = None


class _BatchIds(msgspec.Struct, array_like=True, gc=False):
    """``KVEventBatchRawView`` with ``_StoredIds`` for its stores; no clear (a frame with
    one is decoded fully for the flush scan anyway) and ``attn_dp_rank`` present (a
    2-element batch is not ``decode_batch_raw``'s typed view: its checked path decides)."""

    ts: float
    events: list[Union[_StoredIds, BlockRemovedRawView]]
    attn_dp_rank: int | None


class _FrameIds(BundleRecordBase, tag="event"):
    """``EventFrame`` with the common payload decoded in the frame's decode (one pass over
    its ids, not a ``Raw`` skip and a second decode): map-shaped stores and removals.
    Where this decodes, ``wire.decode_batch_raw``'s typed view of the payload does too,
    with the same events and token ids that its check accepts (msgpack encoders write a
    3-element array as ``0x93``, what that view asks for). A frame it refuses
    (``payload_is_bin``, a clear, 0.5.17 arrays, ids that are not ints, ...) comes as
    ``EventFrame`` and takes ``_stored``."""

    endpoint: int
    seq: int
    recv_ns: int
    topic: str
    via: int
    epoch: int
    payload_is_bin: bool
    payload: _BatchIds
    pass_index: int = -1


def _stored_ids(b: _BatchIds, page_size: int) -> list[tuple[int | None, bytes, int, list[int]]]:
    """``_stored``'s indexable stores of a ``_FrameIds`` payload, the same: its token ids
    are int arrays (``decode_batch_raw``'s check passes), so a store of another page size,
    or whose hashes are not ints, is skipped and the others kept."""
    out: list[tuple[int | None, bytes, int, list[int]]] = []
    for e in b.events:
        if type(e) is not _StoredIds or e.block_size != page_size:
            continue
        hashes = _wire_hashes(e.block_hashes)
        if hashes is None:
            try:
                hashes = _as_packed(e.block_hashes)
            except (msgspec.DecodeError, msgspec.ValidationError):
                continue
        hb, pages = hashes
        if pages and len(e.token_ids) == page_size * pages:
            out.append((e.parent_block_hash, hb, pages, e.token_ids))
    return out


def _as_packed(raw: msgspec.Raw) -> tuple[bytes, int]:
    """A msgpack array of hashes not shaped as ``_wire_hashes`` reads, decoded as ints
    (int64; a uint64 as the int64 of the same bits): ``(_packed bytes, count)``."""
    try:  # SGLang's hashes are int64: checked in C, no pass over them here
        hashes = _I64S.decode(raw)
    except msgspec.ValidationError:  # a uint64 wire hash: the int64 of the same bits
        hashes = [norm_hash(h) for h in _INTS.decode(raw)]
    return _packed(hashes), len(hashes)


class _Recheck(Exception):
    """A stored event's ids are not int arrays: ask ``decode_batch_raw`` for its verdict."""


def _stored(
    payload: bytes | memoryview, page_size: int, check: bool
) -> tuple[Any, list[tuple[int | None, bytes, int, list[int]]], bool]:
    """``(batch, [(parent, hashes, pages, tokens)], has a clear)``: the payload's raw view,
    its indexable ``BlockStored`` events (this page size, int ids, one page of tokens per
    hash; hashes as ``_packed`` bytes, ``pages`` of them) and whether it holds an
    ``AllBlocksCleared``. ``check=False``: token ids unchecked by the decoder (decoded here
    once); ids that are not int arrays raise ``_Recheck``, and the caller decodes again with
    ``check=True`` -- ``decode_batch_raw``'s own check, raising where it refuses the payload,
    skipping the event (bigram keys) where not. So is a payload with another page size's
    stores (not indexed; rare). The result is that of checking, then decoding."""
    b = wire.decode_batch_raw(payload, check_tokens=check)
    out: list[tuple[int | None, bytes, int, list[int]]] = []
    clear = False
    e: Any
    for e in b.events:
        if type(e) not in _STORED_VIEWS:
            clear = clear or type(e) is AllBlocksCleared
            continue
        if e.block_size != page_size:  # not indexed; its ids are still part of the verdict
            if not check:
                raise _Recheck()
            continue
        try:
            fast = _wire_hashes(e.block_hashes) or _as_packed(e.block_hashes)
            tokens = _INTS.decode(e.token_ids)
        except (msgspec.DecodeError, msgspec.ValidationError):
            if not check:
                raise _Recheck() from None
            continue
        hb, pages = fast
        if not pages or len(tokens) != page_size * pages:
            continue
        out.append((e.parent_block_hash, hb, pages, tokens))
    return b, out, clear
