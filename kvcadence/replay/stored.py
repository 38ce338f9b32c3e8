"""The stored events of a capture's event frames, decoded for ``outputs.StoreIndex``.

What this file owns: reading a frame's indexable ``BlockStored`` events -- this page size,
int token ids, one page of tokens per hash -- into ``StoreRows``, the columns
``StoreIndex._extend`` indexes: every store's hashes end to end as the bytes of 64-bit
msgpack ints (``packed``; one int64 array for all of them once the pass is done), every
store's token ids end to end as uint32, no object per store. Two routes, one result:

* ``schema.EventFrameIdsView`` (``frame_stores``): the common frame decoded with its payload in the reader's
  one decode (``BundleReader.events_and_notes(events_as=EventFrameIdsView)``): token ids into lists,
  hashes and removals left as bytes;
* any other frame (``payload_stores``): ``wire.decode_batch_raw`` of its payload, token ids
  decoded once; where they are not int arrays, ``decode_batch_raw``'s checked verdict
  (an event skipped, or the whole payload refused).
"""

from __future__ import annotations

from array import array
from typing import Any

import msgspec
import numpy as np

from kvcadence.format import wire
from kvcadence.format.hashes import norm_hash
from kvcadence.format.schema import (
    AllBlocksCleared,
    BlockStoredIdsView,
    BlockStoredRawView,
    BlockStoredV17RawView,
    Int64,
    KVEventBatchIdsView,
)
from kvcadence.replay.tokens import CODE, compact

#: an indexable store: (parent hash, hashes as ``packed`` bytes, pages, token ids, its
#: ``cache_salt``)
Store = tuple[int | None, bytes | memoryview, int, list[int], str | None]

_INTS = msgspec.msgpack.Decoder(list[int])
_I64S = msgspec.msgpack.Decoder(list[Int64])
_STORED_VIEWS = (BlockStoredRawView, BlockStoredV17RawView)
#: a 64-bit msgpack int: its type byte (0xcf uint64, 0xd3 int64), then 8 bytes big-endian
WIRE_I64 = np.dtype([("t", "u1"), ("v", ">i8")])
#: those two type bytes
I64_TYPES = b"\xcf\xd3"
#: bytes a token id takes in ``StoreRows.tbuf`` (``tokens.CODE``)
_ITEM = array(CODE).itemsize


def packed(hashes: list[int]) -> bytes:
    """``hashes`` (ints of 64 bits, either sign) as ``StoreRows`` holds them (``WIRE_I64``)."""
    out = np.empty(len(hashes), WIRE_I64)
    out["t"] = 0xD3
    out["v"] = [norm_hash(h) for h in hashes]
    return out.tobytes()


def _wire_shape(bb: bytes) -> tuple[int, int] | None:
    """``(header size, count)`` of the msgpack array ``bb`` when its elements take 9 bytes
    each (what 64-bit ints take), None otherwise."""
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
    return (h, n) if len(bb) - h == 9 * n else None


def _wire_hashes(raw: msgspec.Raw) -> tuple[bytes, int] | None:
    """``(elements, count)`` of a msgpack array of hashes when every element is a 64-bit
    int (``0xcf``/``0xd3`` and 8 bytes: SGLang's hashes but ~1 in 2**32): the elements'
    bytes, decoded later with every other event's (``StoreRows``); None when not so shaped
    (decode it as a list instead)."""
    bb = bytes(raw)
    shape = _wire_shape(bb)
    if shape is None or bb[shape[0] :: 9].translate(None, I64_TYPES):
        return None
    return bb[shape[0] :], shape[1]


class StoreRows:
    """The indexable stores of a pass over the events, as columns: ``StoreIndex._extend``'s
    input. Per store its publish time (``ts``), frame number, parent hash, page count and
    ``cache_salt``; the hashes of all of them end to end in ``hbuf`` (the 9-byte msgpack
    ints of ``packed``, type bytes unchecked: ``StoreIndex._extend`` checks them all at once),
    their tokens end to end in ``tbuf`` (uint32; a store whose ids are not has zeros there
    and its own ids in ``wide``, by its row). No object per store but its column entries: a
    capture's stores are many (120,000 for 60,000 requests at page size 1, where a bytes, a
    memoryview and an array per store, joined after the pass, took the inference's peak to
    +351 MB, against +291-313 MB so)."""

    __slots__ = ("frame", "hbuf", "pages", "parent", "salt", "tbuf", "ts", "wide")

    def __init__(self) -> None:
        self.ts: list[int] = []
        self.frame: list[int] = []
        self.parent: list[int | None] = []
        self.pages: list[int] = []
        self.salt: list[str | None] = []
        self.hbuf = bytearray()
        self.tbuf = bytearray()
        self.wide: dict[int, Any] = {}

    def __len__(self) -> int:
        return len(self.pages)

    def add(
        self,
        ts: int,
        n: int,
        parent: int | None,
        hashes: bytes | memoryview,
        pages: int,
        tokens: Any,
        salt: str | None,
    ) -> None:
        """One store: ``hashes`` as ``packed`` bytes (``pages`` of them), ``tokens`` its ids
        (``pages * page_size``; a list or ``tokens.compact``'s array)."""
        self._tokens(tokens)
        self.hbuf += hashes
        self.ts.append(ts)
        self.frame.append(n)
        self.parent.append(parent)
        self.pages.append(pages)
        self.salt.append(salt)

    def _tokens(self, tokens: Any) -> None:
        try:
            if type(tokens) is list:
                arr = array(CODE)
                arr.fromlist(tokens)
            elif type(tokens) is array and tokens.typecode == CODE:
                arr = tokens
            else:
                arr = array(CODE, tokens)
        except (OverflowError, TypeError):
            self.wide[len(self.pages)] = compact(tokens)
            self.tbuf += bytes(_ITEM * len(tokens))  # its room: zeros
            return
        self.tbuf += arr


def frame_stores(b: KVEventBatchIdsView, page_size: int, ts: int, n: int, rows: StoreRows) -> None:
    """``_stored``'s indexable stores of a ``schema.EventFrameIdsView`` payload, the same: its
    token ids are int arrays (``decode_batch_raw``'s check passes), so a store of another
    page size, or whose hashes are not ints, is skipped and the others kept. Each is added
    to ``rows`` (``ts``: the frame's publish time, ``n``: its number): its hashes' bytes and
    its ids copied into the rows' buffers while they are fresh (no object per store or token
    is kept, the frame's buffer is not kept alive).

    Hashes of 9 bytes each are passed on as their elements' bytes *unchecked*: their type
    bytes are checked with every other store's (``StoreIndex._extend``), and a store where
    one is not ``0xcf``/``0xd3`` is dropped then -- what decoding it would do here (a list
    of ``n`` ints in ``9 n`` bytes is ``n`` 64-bit ints: any other element fails)."""
    for e in b.events:
        if type(e) is not BlockStoredIdsView or e.block_size != page_size:
            continue
        raw = e.block_hashes
        mv = memoryview(raw)
        size = len(mv)
        # ``_wire_shape``'s usual cases inline: a fixarray or an array16 of 9-byte elements
        b0 = mv[0] if size else 0
        if 0x90 <= b0 <= 0x9F:
            h, pages = 1, b0 & 0x0F
        elif b0 == 0xDC and size >= 3:
            h, pages = 3, mv[1] << 8 | mv[2]
        else:
            h = pages = 0
        hb: bytes | memoryview
        if h and size - h == 9 * pages:
            hb = mv[h:]  # past the array header
        else:
            shape = _wire_shape(bytes(mv))
            if shape is not None:
                h, pages = shape
                hb = mv[h:]
            else:
                try:
                    hb, pages = _aspacked(raw)
                except (msgspec.DecodeError, msgspec.ValidationError):
                    continue
        tokens = e.token_ids
        if pages and len(tokens) == page_size * pages:
            rows.add(ts, n, e.parent_block_hash, hb, pages, tokens, e.cache_salt)


def _aspacked(raw: msgspec.Raw) -> tuple[bytes, int]:
    """A msgpack array of hashes not shaped as ``_wire_hashes`` reads, decoded as ints
    (int64; a uint64 as the int64 of the same bits): ``(_packed bytes, count)``."""
    try:  # SGLang's hashes are int64: checked in C, no pass over them here
        hashes = _I64S.decode(raw)
    except msgspec.ValidationError:  # a uint64 wire hash: the int64 of the same bits
        hashes = [norm_hash(h) for h in _INTS.decode(raw)]
    return packed(hashes), len(hashes)


def payload_stores(payload: bytes | memoryview, page_size: int) -> tuple[Any, list[Store], bool]:
    """``(batch, stores, has a clear)`` of an event payload (``_stored``; its checked
    verdict where the ids are not int arrays); raises where ``decode_batch_raw`` refuses
    the payload."""
    try:  # token ids decoded once, here; a refusal is decode_batch_raw's verdict
        return _stored(payload, page_size, False)
    except _Recheck:
        return _stored(payload, page_size, True)


class _Recheck(Exception):
    """A stored event's ids are not int arrays: ask ``decode_batch_raw`` for its verdict."""


def _stored(
    payload: bytes | memoryview, page_size: int, check: bool
) -> tuple[Any, list[Store], bool]:
    """``(batch, [(parent, hashes, pages, tokens, salt)], has a clear)``: the payload's raw view,
    its indexable ``BlockStored`` events (this page size, int ids, one page of tokens per
    hash; hashes as ``packed`` bytes, ``pages`` of them) and whether it holds an
    ``AllBlocksCleared``. ``check=False``: token ids unchecked by the decoder (decoded here
    once); ids that are not int arrays raise ``_Recheck``, and the caller decodes again with
    ``check=True`` -- ``decode_batch_raw``'s own check, raising where it refuses the payload,
    skipping the event (bigram keys) where not. So is a payload with another page size's
    stores (not indexed; rare). The result is that of checking, then decoding."""
    b = wire.decode_batch_raw(payload, check_tokens=check)
    out: list[Store] = []
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
            fast = _wire_hashes(e.block_hashes) or _aspacked(e.block_hashes)
            tokens = _INTS.decode(e.token_ids)
        except (msgspec.DecodeError, msgspec.ValidationError):
            if not check:
                raise _Recheck() from None
            continue
        hb, pages = fast
        if not pages or len(tokens) != page_size * pages:
            continue
        out.append((e.parent_block_hash, hb, pages, tokens, e.cache_salt))
    return b, out, clear
