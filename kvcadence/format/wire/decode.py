"""Decoding SGLang KV-event payloads of any shape into the canonical structs
(``decode_batch``) and the two decode-only variants for analysis ingest (``decode_batch_view``,
``decode_batch_raw``). See ``kvcadence.format.wire`` for the accepted shapes and the fast and
slow paths; every variant reaches the same verdict on a payload.

Why ~520 lines: the decoders (canonical, view, raw and the raw one's fast path alone) are one
piece -- they share the typed fast-path decoders and the per-event slow path, and each must
give the others' verdict on every payload; split, each would import the others' privates.
"""

from __future__ import annotations

from typing import Any, Union

import msgspec

from kvcadence.errors import WireError
from kvcadence.format.hashes import (
    I64_MAX,
    U64_MAX,
    digest_to_int64,
)
from kvcadence.format.schema import (
    AllBlocksCleared,
    BlockRemoved,
    BlockRemovedRawView,
    BlockRemovedV17,
    BlockRemovedV17RawView,
    BlockStored,
    BlockStoredRawView,
    BlockStoredV17,
    BlockStoredV17RawView,
    BlockStoredV17View,
    BlockStoredView,
    KVEventBatch,
    KVEventBatchRawView,
    KVEventBatchV17,
    KVEventBatchV17RawView,
    KVEventBatchV17View,
    KVEventBatchView,
    UnknownEvent,
)

# --------------------------------------------------------------------------------------
# Decoding
# --------------------------------------------------------------------------------------

_FAST = msgspec.msgpack.Decoder(KVEventBatch)
_FAST_ARRAY = msgspec.msgpack.Decoder(KVEventBatchV17)
_ANY = msgspec.msgpack.Decoder()
_ENC = msgspec.msgpack.Encoder()
_TWO64 = 1 << 64

_TAG_STORED = "BlockStored"
_TAG_REMOVED = "BlockRemoved"
_TAG_CLEARED = "AllBlocksCleared"


def _kind(v: Any) -> str:
    """A short msgpack-ish name of a decoded value's type, for error messages."""
    if v is None:
        return "nil"
    if isinstance(v, bool):
        return "bool"
    if isinstance(v, int):
        return "int"
    if isinstance(v, float):
        return "float"
    if isinstance(v, str):
        return "str"
    if isinstance(v, (bytes, bytearray, memoryview)):
        return "bin"
    if isinstance(v, (list, tuple)):
        return "array"
    if isinstance(v, dict):
        return "map"
    return type(v).__name__


def _buffer(payload: Any) -> bytes | memoryview:
    """``payload`` as bytes or a memoryview (bytearray, memoryview, msgspec.Raw, ...)."""
    if type(payload) is bytes:
        return payload
    try:
        return memoryview(payload)
    except TypeError:
        raise WireError(f"payload must be bytes-like, got {type(payload).__name__}") from None


def decode_batch(payload: bytes | bytearray | memoryview | msgspec.Raw) -> KVEventBatch:
    """Decode one KV-event payload of any SGLang/vLLM shape into canonical structs.

    Hashes come out as signed int64; unknown event tags become ``UnknownEvent``; malformed
    input raises ``WireError`` naming what and where.
    """
    payload = _buffer(payload)
    if payload[:1] == b"\x93":  # fixarray(3): the only shape the typed fast path may take
        try:
            batch = _FAST.decode(payload)
        except (msgspec.ValidationError, msgspec.DecodeError, RecursionError):
            pass
        else:
            _normalise_fast(batch)
            return batch
        try:  # 0.5.5-0.5.17 positional arrays (V17 slots; a 0.5.5 array lacks only medium)
            arr = _FAST_ARRAY.decode(payload)
        except (msgspec.ValidationError, msgspec.DecodeError, RecursionError):
            pass
        else:
            batch = KVEventBatch(arr.ts, [_from_array(e) for e in arr.events], arr.attn_dp_rank)
            _normalise_fast(batch)
            return batch
    return _decode_slow(payload)


_VIEW = msgspec.msgpack.Decoder(KVEventBatchView)
_VIEW_ARRAY = msgspec.msgpack.Decoder(KVEventBatchV17View)
_RAW_ARRAY_HEADS = frozenset([*range(0x90, 0xA0), 0xDC, 0xDD])


def decode_batch_view(payload: bytes | bytearray | memoryview | msgspec.Raw) -> KVEventBatchView:
    """``decode_batch`` for readers that need no token ids (analysis ingest): the same events,
    hashes (signed int64) and errors, except that a ``BlockStored`` comes back as a
    ``BlockStoredView`` whose ``token_ids`` is the msgpack array left undecoded (``Raw``;
    ``n_tokens`` is its length) and whose extra keys are skipped. Token ids are not
    validated element by element on the fast path (they are checked to be an array).
    Anything the typed view cannot take (mixed shapes, unknown tags, bytes hashes, ...) goes
    through ``decode_batch`` and is converted, so the two never disagree on hashes or counts.
    """
    payload = _buffer(payload)
    if payload[:1] == b"\x93":
        for dec in (_VIEW, _VIEW_ARRAY):
            try:
                batch = dec.decode(payload)
            except (msgspec.ValidationError, msgspec.DecodeError, RecursionError):
                continue
            evs = batch.events
            if dec is _VIEW_ARRAY:
                evs = [_from_array(e, BlockStoredV17View, BlockStoredView) for e in evs]
                batch = KVEventBatchView(batch.ts, evs, batch.attn_dp_rank)  # type: ignore[arg-type]
            if _view_checked(evs):
                return batch  # type: ignore[return-value]  # converted above
            break  # token_ids not an array: let decode_batch name the error
    full = decode_batch(payload)
    return KVEventBatchView(
        full.ts, [_view_from_canonical(e) for e in full.events], full.attn_dp_rank
    )


# ``decode_batch``'s token rule (``_tokens``): ints, or [int, int] bigrams -- checked in C on
# the views' undecoded token arrays, so every decoder gives the same verdict on a payload
# (inspect, report and sql disagreed on payloads with bad token ids).
_TOKENS_CHECK = msgspec.msgpack.Decoder(list[Union[int, tuple[int, int]]])


def tokens_ok(raw: msgspec.Raw | bytes | memoryview) -> bool:
    """``raw`` is an array ``decode_batch`` accepts as ``token_ids``."""
    try:
        _TOKENS_CHECK.decode(raw)
    except (msgspec.ValidationError, msgspec.DecodeError, RecursionError):
        return False
    return True


def _view_checked(evs: list[Any]) -> bool:
    """Check stored token_ids are what ``decode_batch`` accepts and map hashes >= 2**63 to
    signed int64, in place."""
    for ev in evs:
        t = type(ev)
        if t is AllBlocksCleared:
            continue
        hs = ev.block_hashes
        if hs and max(hs) > I64_MAX:
            ev.block_hashes = [h - _TWO64 if h > I64_MAX else h for h in hs]
        if t is BlockStoredView:
            if not tokens_ok(ev.token_ids):
                return False
            p = ev.parent_block_hash
            if p is not None and p > I64_MAX:
                ev.parent_block_hash = p - _TWO64
    return True


def _view_from_canonical(ev: Any) -> Any:
    if type(ev) is BlockStored:
        return BlockStoredView(
            ev.block_hashes,
            ev.parent_block_hash,
            msgspec.Raw(_ENC.encode(ev.token_ids)),
            ev.block_size,
            ev.lora_id,
            ev.medium,
        )
    return ev


_RAW_VIEW = msgspec.msgpack.Decoder(KVEventBatchRawView)
_RAW_VIEW_ARRAY = msgspec.msgpack.Decoder(KVEventBatchV17RawView)
_RAW_FAILS = (msgspec.ValidationError, msgspec.DecodeError, RecursionError)
_RAW_ARRAY_TYPES = (
    BlockStoredV17RawView,
    BlockStoredRawView,
    BlockRemovedV17RawView,
    BlockRemovedRawView,
)


def decode_batch_raw(
    payload: bytes | bytearray | memoryview | msgspec.Raw,
    *,
    checked: bool = False,
    check_tokens: bool = True,
) -> KVEventBatchRawView:
    """``decode_batch_view`` that leaves the block hashes undecoded too (analysis ingest's fast
    path): a ``BlockStored`` comes back as ``BlockStoredRawView``, a ``BlockRemoved`` as
    ``BlockRemovedRawView``, both with ``block_hashes`` as its msgpack array bytes (``Raw``).

    The typed fast path checks the envelope, tags, ``parent_block_hash`` (int64 range, in C),
    ``block_size``, ``lora_id`` and ``medium``, but nothing *inside* the two ``Raw`` fields:
    the caller must check that ``block_hashes`` is an array of ints (and ``token_ids`` what
    ``tokens_ok`` accepts, with ``check_tokens=False``; ``kvcadence.analysis.tokcols``:
    ``int_arrays(..., wrap_u64=True)`` and ``token_counts`` raise otherwise) and use
    ``decode_batch_view`` for the payload where either is not.
    Read that way, the hashes are exactly ``decode_batch``'s: a uint64 wire hash >= 2**63 is
    the signed int64 of the same 64 bits. Payloads the typed raw view cannot take (mixed
    shapes, unknown tags, bytes hashes, a parent hash >= 2**63, ...) go through
    ``decode_batch_view`` and come back converted, their hashes re-encoded as int64 arrays (valid
    by construction); malformed input raises ``WireError`` as there.

    ``checked=True``: no unchecked fast path: ``decode_batch_view``'s events (and verdict)
    converted, hashes re-encoded as int64 arrays -- every ``Raw`` field valid by
    construction (the reader's second pass where the caller's check refused a field).

    ``check_tokens=False``: the typed fast path skips its check of the ``token_ids`` arrays
    (which decodes them), for a caller that decodes or checks them itself (replay's stores,
    ingest's ``tokcols.token_counts``); where its own check fails it calls again with the
    default to get this function's verdict.
    """
    payload = _buffer(payload)
    if checked:
        v = decode_batch_view(payload)
        return KVEventBatchRawView(v.ts, [_raw_from_view(e) for e in v.events], v.attn_dp_rank)
    if payload[:1] == b"\x93":
        try:
            batch = _RAW_VIEW.decode(payload)
        except _RAW_FAILS:
            pass
        else:
            if not check_tokens or _raw_tokens_ok(batch.events):
                return batch
            return decode_batch_raw(payload, checked=True)  # decode_batch names the error
        try:
            arr = _RAW_VIEW_ARRAY.decode(payload)
        except _RAW_FAILS:
            pass
        else:
            evs = [_from_array(e, *_RAW_ARRAY_TYPES) for e in arr.events]
            if not check_tokens or _raw_tokens_ok(evs):
                return KVEventBatchRawView(arr.ts, evs, arr.attn_dp_rank)
    return decode_batch_raw(payload, checked=True)


def decode_batch_raw_fast(
    payload: bytes | bytearray | memoryview | msgspec.Raw,
) -> KVEventBatchRawView | None:
    """``decode_batch_raw(payload, check_tokens=False)``'s typed fast path alone, for a caller
    that decodes hundreds of thousands of payloads (analysis ingest): the batch where that
    path takes ``payload`` (bytes-like or a ``msgspec.Raw``), which is then exactly what
    ``decode_batch_raw`` returns; None where it does not (the caller then calls
    ``decode_batch_raw`` for its verdict). Nothing is checked that the fast path does not."""
    try:
        batch = _RAW_VIEW.decode(payload)
    except _RAW_FAILS:
        return None
    # decoded: an array of 2 or 3 elements; only a fixarray of 3 (0x93) takes the path
    return batch if memoryview(payload)[0] == 0x93 else None


def _raw_tokens_ok(evs: list[Any]) -> bool:
    for ev in evs:
        if type(ev) is BlockStoredRawView and not tokens_ok(ev.token_ids):
            return False
    return True


def _raw_from_view(ev: Any) -> Any:
    t = type(ev)
    if t is BlockStoredView:
        return BlockStoredRawView(
            msgspec.Raw(_ENC.encode(ev.block_hashes)),
            ev.parent_block_hash,
            ev.token_ids,
            ev.block_size,
            ev.lora_id,
            ev.medium,
        )
    if t is BlockRemoved:
        return BlockRemovedRawView(msgspec.Raw(_ENC.encode(ev.block_hashes)), ev.medium)
    return ev


def _from_array(
    ev: Any,
    stored_v17: type = BlockStoredV17,
    stored: type = BlockStored,
    removed_v17: type = BlockRemovedV17,
    removed: type = BlockRemoved,
) -> Any:
    """A positional (0.5.5-0.5.17) event as its map-shaped counterpart: canonical structs by
    default, the view / raw-view structs for ``decode_batch_view`` / ``decode_batch_raw``."""
    t = type(ev)
    if t is stored_v17:
        return stored(
            ev.block_hashes,
            ev.parent_block_hash,
            ev.token_ids,
            ev.block_size,
            ev.lora_id,
            ev.medium,
        )
    if t is removed_v17:
        return removed(ev.block_hashes, ev.medium)
    return AllBlocksCleared()


def _normalise_fast(batch: KVEventBatch) -> None:
    """Map uint64 hashes >= 2**63 (vLLM-style producers) to their signed int64 form."""
    for ev in batch.events:
        if type(ev) is AllBlocksCleared:
            continue
        hs = ev.block_hashes  # type: ignore[union-attr]  # not AllBlocksCleared
        if hs and max(hs) > I64_MAX:
            ev.block_hashes = [h - _TWO64 if h > I64_MAX else h for h in hs]  # type: ignore[union-attr]
        if type(ev) is BlockStored:
            p = ev.parent_block_hash
            if p is not None and p > I64_MAX:
                ev.parent_block_hash = p - _TWO64


def _decode_slow(payload: bytes | bytearray | memoryview) -> KVEventBatch:
    try:
        obj = _ANY.decode(payload)
    except msgspec.DecodeError as exc:
        raise WireError(f"payload is not one msgpack value: {exc}") from None
    except (ValueError, TypeError, RecursionError, OverflowError) as exc:
        raise WireError(f"payload could not be decoded as msgpack: {exc}") from None
    if type(obj) is not list or len(obj) != 3:
        n = f" of {len(obj)}" if isinstance(obj, list) else ""
        raise WireError(
            f"a KV-event batch must be an array of 3 [ts, events, attn_dp_rank], "
            f"got {_kind(obj)}{n} - at `$`"
        )
    ts, events, rank = obj
    if type(ts) is int:
        ts = float(ts)
    elif type(ts) is not float:
        raise WireError(f"ts must be a number, got {_kind(ts)} - at `$[0]`")
    if type(events) is not list:
        raise WireError(f"events must be an array, got {_kind(events)} - at `$[1]`")
    if rank is not None and type(rank) is not int:
        raise WireError(f"attn_dp_rank must be an int or nil, got {_kind(rank)} - at `$[2]`")
    out = [_event(ev, f"$[1][{i}]", True) for i, ev in enumerate(events)]
    return KVEventBatch(ts=ts, events=out, attn_dp_rank=rank)


def _hash(h: Any, where: str, normalise: bool) -> int:
    t = type(h)
    if t is int:
        if normalise:
            if h > I64_MAX:
                if h > U64_MAX:
                    raise WireError(f"hash {h} does not fit in 64 bits - at `{where}`")
                return h - _TWO64  # type: ignore[no-any-return]
            if h < -(1 << 63):
                raise WireError(f"hash {h} does not fit in 64 bits - at `{where}`")
        return h  # type: ignore[no-any-return]  # checked int above
    if t is bytes or t is bytearray:
        if len(h) < 8:
            raise WireError(f"a bytes hash needs at least 8 bytes, got {len(h)} - at `{where}`")
        return digest_to_int64(h)
    raise WireError(f"a block hash must be an int or bytes, got {_kind(h)} - at `{where}`")


def _hashes(v: Any, where: str, normalise: bool) -> list[int]:
    if type(v) is not list:
        raise WireError(f"block_hashes must be an array, got {_kind(v)} - at `{where}`")
    if all(type(h) is int for h in v):
        if not v or not normalise or (max(v) <= I64_MAX and min(v) >= -(1 << 63)):
            return v
    return [_hash(h, f"{where}[{j}]", normalise) for j, h in enumerate(v)]


def _parent(v: Any, where: str, normalise: bool) -> int | None:
    if v is None:
        return None
    return _hash(v, where, normalise)


def _tokens(v: Any, where: str) -> list[int]:
    if type(v) is not list:
        raise WireError(f"token_ids must be an array, got {_kind(v)} - at `{where}`")
    if all(type(t) is int for t in v):
        return v
    for j, t in enumerate(v):
        if type(t) is int:
            continue
        if type(t) is list and len(t) == 2 and type(t[0]) is int and type(t[1]) is int:
            continue  # bigram (EAGLE) key: [t_i, t_i+1]
        raise WireError(
            f"a token id must be an int (or an [int, int] bigram), got {_kind(t)} "
            f"- at `{where}[{j}]`"
        )
    return v


def _int(v: Any, name: str, where: str) -> int:
    if type(v) is not int:
        raise WireError(f"{name} must be an int, got {_kind(v)} - at `{where}`")
    return v


def _opt_int(v: Any, name: str, where: str) -> int | None:
    if v is not None and type(v) is not int:
        raise WireError(f"{name} must be an int or nil, got {_kind(v)} - at `{where}`")
    return v


def _opt_str(v: Any, name: str, where: str) -> str | None:
    if v is not None and type(v) is not str:
        raise WireError(f"{name} must be a str or nil, got {_kind(v)} - at `{where}`")
    return v


_MISSING = object()


def _req(ev: dict[str, Any], key: str, where: str) -> Any:
    v = ev.get(key, _MISSING)
    if v is _MISSING:
        raise WireError(f"{ev.get('type')} has no `{key}` key - at `{where}`")
    return v


def _event(ev: Any, where: str, normalise: bool) -> Any:
    """One event of any shape (map or positional array) -> canonical struct."""
    t = type(ev)
    if t is dict:
        tag = ev.get("type", _MISSING)
        if tag is _MISSING:
            raise WireError(f"event map has no `type` key - at `{where}`")
        if type(tag) is not str:
            raise WireError(f"event `type` must be a str, got {_kind(tag)} - at `{where}.type`")
        if tag == _TAG_STORED:
            return BlockStored(
                block_hashes=_hashes(
                    _req(ev, "block_hashes", where), f"{where}.block_hashes", normalise
                ),
                parent_block_hash=_parent(
                    ev.get("parent_block_hash"), f"{where}.parent_block_hash", normalise
                ),
                token_ids=_tokens(_req(ev, "token_ids", where), f"{where}.token_ids"),
                block_size=_int(_req(ev, "block_size", where), "block_size", f"{where}.block_size"),
                lora_id=_opt_int(ev.get("lora_id"), "lora_id", f"{where}.lora_id"),
                medium=_opt_str(ev.get("medium"), "medium", f"{where}.medium"),
                cache_salt=_opt_str(ev.get("cache_salt"), "cache_salt", f"{where}.cache_salt"),
                session_id=_opt_str(ev.get("session_id"), "session_id", f"{where}.session_id"),
                lora_name=_opt_str(ev.get("lora_name"), "lora_name", f"{where}.lora_name"),
            )
        if tag == _TAG_REMOVED:
            return BlockRemoved(
                block_hashes=_hashes(
                    _req(ev, "block_hashes", where), f"{where}.block_hashes", normalise
                ),
                medium=_opt_str(ev.get("medium"), "medium", f"{where}.medium"),
            )
        if tag == _TAG_CLEARED:
            return AllBlocksCleared()
        return UnknownEvent(tag=tag, raw=ev)
    if t is list:
        if not ev:
            raise WireError(f"array event is empty (no tag) - at `{where}`")
        tag = ev[0]
        if type(tag) is not str:
            raise WireError(f"array event tag must be a str, got {_kind(tag)} - at `{where}[0]`")
        n = len(ev)
        if tag == _TAG_STORED:
            if n < 6:
                raise WireError(
                    f"BlockStored array has {n} slots, needs at least 6 "
                    f"(tag, block_hashes, parent_block_hash, token_ids, block_size, lora_id) "
                    f"- at `{where}`"
                )
            return BlockStored(
                block_hashes=_hashes(ev[1], f"{where}[1]", normalise),
                parent_block_hash=_parent(ev[2], f"{where}[2]", normalise),
                token_ids=_tokens(ev[3], f"{where}[3]"),
                block_size=_int(ev[4], "block_size", f"{where}[4]"),
                lora_id=_opt_int(ev[5], "lora_id", f"{where}[5]"),
                medium=_opt_str(ev[6], "medium", f"{where}[6]") if n > 6 else None,
            )
        if tag == _TAG_REMOVED:
            if n < 2:
                raise WireError(f"BlockRemoved array has no block_hashes slot - at `{where}`")
            return BlockRemoved(
                block_hashes=_hashes(ev[1], f"{where}[1]", normalise),
                medium=_opt_str(ev[2], "medium", f"{where}[2]") if n > 2 else None,
            )
        if tag == _TAG_CLEARED:
            return AllBlocksCleared()
        return UnknownEvent(tag=tag, raw=ev)
    raise WireError(f"an event must be a map or an array, got {_kind(ev)} - at `{where}`")


def count_unknown(batch: KVEventBatch) -> int:
    """How many events of ``batch`` had a tag kvcadence does not know (``UnknownEvent``)."""
    return sum(1 for ev in batch.events if type(ev) is UnknownEvent)  # type: ignore[comparison-overlap, misc]


__all__ = [
    "count_unknown",
    "decode_batch",
    "decode_batch_raw",
    "decode_batch_raw_fast",
    "decode_batch_view",
    "tokens_ok",
]
