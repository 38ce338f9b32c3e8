"""The stored events of a capture's event frames, decoded for ``outputs.StoreIndex``.

What this file owns: reading a frame's indexable ``BlockStored`` events -- this page size,
int token ids, one page of tokens per hash -- as ``(parent, hashes, pages, tokens)``, the
hashes as the bytes of 64-bit msgpack ints (``packed``) that ``unpacked`` turns into one
int64 array for every event at once. Two routes, one result:

* ``schema.EventFrameIdsView`` (``frame_stores``): the common frame decoded with its payload in the reader's
  one decode (``BundleReader.events_and_notes(events_as=EventFrameIdsView)``): token ids into lists,
  hashes and removals left as bytes;
* any other frame (``payload_stores``): ``wire.decode_batch_raw`` of its payload, token ids
  decoded once; where they are not int arrays, ``decode_batch_raw``'s checked verdict
  (an event skipped, or the whole payload refused).
"""

from __future__ import annotations

from array import array
from collections.abc import Sequence
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
_WIRE_I64 = np.dtype([("t", "u1"), ("v", ">i8")])
#: those two type bytes
_I64_TYPES = b"\xcf\xd3"


def packed(hashes: list[int]) -> bytes:
    """``hashes`` (ints of 64 bits, either sign) as ``unpacked`` reads them."""
    out = np.empty(len(hashes), _WIRE_I64)
    out["t"] = 0xD3
    out["v"] = [norm_hash(h) for h in hashes]
    return out.tobytes()


def unpacked(buf: bytes) -> np.ndarray:
    """The int64 array of ``buf``'s 64-bit msgpack ints (``_wire_hashes``, ``packed``: a
    uint64 one as the int64 of the same bits, SGLang's form, as ``norm_hash``)."""
    return np.frombuffer(buf, _WIRE_I64)["v"].astype(np.int64)


#: ``unpacked_all`` joins this many bytes of hashes at a time
_JOIN_BYTES = 9 << 15


def unpacked_all(
    parts: Sequence[bytes | memoryview], count: int, bad: list[int] | None = None
) -> np.ndarray:
    """``unpacked(b"".join(parts))`` (``count`` hashes in all) without the joined copy of
    every hash: joined a few hundred KB at a time into the result (a temporary that size is
    reused; one the size of all of them would be fresh memory, a page fault per 4 KB).
    ``bad``: where given, the positions whose 9 bytes are not a 64-bit msgpack int (type
    byte neither ``0xcf`` nor ``0xd3``: ``frame_stores``' unchecked hashes) are appended."""
    out = np.empty(count, np.int64)
    at = i = 0
    while i < len(parts):
        j, size = i, 0
        while j < len(parts) and size < _JOIN_BYTES:
            size += len(parts[j])
            j += 1
        joined = b"".join(parts[i:j])
        wire = np.frombuffer(joined, _WIRE_I64)
        # some type byte is not (``translate`` deletes by a table: no search per byte)
        if bad is not None and joined[::9].translate(None, _I64_TYPES):
            t = wire["t"]
            bad.extend((np.flatnonzero((t != 0xCF) & (t != 0xD3)) + at).tolist())
        out[at : at + len(wire)] = wire["v"]
        at += len(wire)
        i = j
    assert at == count
    return out


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
    bytes, decoded later with every other event's (``unpacked``); None when not so shaped
    (decode it as a list instead)."""
    bb = bytes(raw)
    shape = _wire_shape(bb)
    if shape is None or bb[shape[0] :: 9].translate(None, _I64_TYPES):
        return None
    return bb[shape[0] :], shape[1]


def frame_stores(b: KVEventBatchIdsView, page_size: int, ts: int, n: int, append: Any) -> None:
    """``_stored``'s indexable stores of a ``schema.EventFrameIdsView`` payload, the same: its token ids
    are int arrays (``decode_batch_raw``'s check passes), so a store of another page size,
    or whose hashes are not ints, is skipped and the others kept. Each is handed to
    ``append`` as the index's row ``(ts, n, parent, hashes, pages, tokens, salt)`` (``ts``: the
    frame's publish time, ``n``: its number; ``tokens`` made ``tokens.compact``'s array while
    its ints are fresh: no int object per token is kept).

    Hashes of 9 bytes each are passed on as their elements' bytes *unchecked*: their type
    bytes are checked with every other event's (``unpacked_all(bad=...)``), and a store
    where one is not ``0xcf``/``0xd3`` is dropped then -- what decoding it would do here (a
    list of ``n`` ints in ``9 n`` bytes is ``n`` 64-bit ints: any other element fails)."""
    for e in b.events:
        if type(e) is not BlockStoredIdsView or e.block_size != page_size:
            continue
        bb = bytes(e.block_hashes)  # a copy: the frame's buffer is not kept alive
        # ``_wire_shape``'s usual cases inline: a fixarray or an array16 of 9-byte elements
        b0 = bb[0]
        if 0x90 <= b0 <= 0x9F:
            h, pages = 1, b0 & 0x0F
        elif b0 == 0xDC and len(bb) >= 3:
            h, pages = 3, bb[1] << 8 | bb[2]
        else:
            h = pages = 0
        hb: bytes | memoryview
        if h and len(bb) - h == 9 * pages:
            hb = memoryview(bb)[h:]  # past the array header
        else:
            shape = _wire_shape(bb)
            if shape is not None:
                h, pages = shape
                hb = memoryview(bb)[h:]
            else:
                try:
                    hb, pages = _aspacked(e.block_hashes)
                except (msgspec.DecodeError, msgspec.ValidationError):
                    continue
        tokens = e.token_ids
        if pages and len(tokens) == page_size * pages:
            arr = array(CODE)
            try:
                arr.fromlist(tokens)  # ``tokens.compact``'s usual case, inline
            except (OverflowError, TypeError):
                arr = compact(tokens)
            append((ts, n, e.parent_block_hash, hb, pages, arr, e.cache_salt))


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
