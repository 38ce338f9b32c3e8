"""SGLang KV-event payload bytes and ZMQ frames: the one codec (decode any shape, encode any
version byte-identically), the vectors' canonical JSON form, and the block-hash functions
(re-exported from ``kvcadence.format.hashes``).

Decoding (``decode_batch``) accepts every shape seen on the wire:

* 0.5.20+ tagged maps (key order free, optional keys may be missing, unknown keys ignored);
* 0.5.10-0.5.17 tagged positional arrays (7-slot stores, 3-slot removes, nil slots) and
  0.5.5 arrays (6/2 slots); extra trailing slots are ignored (vLLM/Dynamo add e.g.
  ``lora_name``/``extra_keys`` there -- kvcadence does not interpret them);
* vLLM batches: the third batch element is read positionally whatever its name
  (``data_parallel_rank``); 32-byte **bytes** hashes become the int64 of their first 8 bytes,
  big-endian, two's complement -- exactly what SGLang's ``hash_str_to_int64`` does to a
  digest, so a vLLM sha256 digest and an SGLang event hash of the same digest compare equal.
  Any bytes hash of at least 8 bytes is accepted that way; shorter ones are a ``WireError``.

Every hash comes out as a signed int64 (``norm_hash``): signed and unsigned 64-bit wire forms
of one value decode equal. An event with an unknown tag does not fail the batch: it becomes
``UnknownEvent(tag, raw)`` (``count_unknown`` counts them). Bigram (EAGLE) ``token_ids``
elements ``[t, t+1]`` are kept as 2-element lists. Everything else that is malformed raises
``WireError`` with a msgspec-style path (``$[1][3].block_hashes[2]`` for map events,
``$[1][3][1][2]`` for positional ones). The batch must be an array of exactly 3 elements.

Fast path: one typed msgspec decode into the canonical structs (the 0.5.20+ map shape), else
one into the ``*V17`` array structs (0.5.5-0.5.17; converted to canonical), plus a C-speed range
check that normalises hashes >= 2**63; any validation failure falls back to an untyped decode
and a per-event dispatch (mixed shapes, unknown tags, bytes hashes, bigram tokens, ...).
Two decode-only variants for readers that need fewer Python objects (analysis ingest):
``decode_batch_view`` leaves stored token ids as raw msgpack, ``decode_batch_raw`` leaves
block hashes raw too (the caller checks them); both agree with ``decode_batch`` otherwise.

Encoding (``encode_batch``) mirrors each release's own structs: 0.5.22/0.5.23 maps, 0.5.20 maps
without ``lora_name``, 0.5.10/0.5.14/0.5.17 7/3-slot arrays (``*V17``), 0.5.5 6/2-slot arrays
(``*V05``); ``ts`` always float64. Hash ints are written exactly as held (a value >= 2**63 is
written as uint64), so ``batch_from_canonical`` + ``encode_batch`` reproduce the vectors byte
for byte. An ``UnknownEvent`` is re-emitted from its ``raw`` value only when that raw has the
target version's event shape (a map with the same ``"type"`` for map versions, an array
starting with the tag for array versions) -- the content round-trips, but the bytes are only
guaranteed identical for msgspec-produced input (msgspec writes ints/floats in its own forms);
otherwise encoding it raises ``WireError``.

Canonical form (``to_canonical``): ``{"ts", "events": [{"type", <fields>}], "attn_dp_rank"}``.
For map versions (the default) optional fields that are None are left out, as on the wire.
For array versions, pass ``version=`` to get that version's slot names with nil slots kept as
null (0.5.10-0.5.17: ``medium`` always present; 0.5.5: no ``medium`` key) -- the form the
vectors use. An unknown event is ``{"type": tag, "raw": raw}``.

ZMQ framing: live ``[topic, seq u64 BE, payload]``; a DEALER sends ``[b"", start_seq8]`` to the
replay ROUTER; replies as seen by the DEALER, **after the caller strips the one empty
delimiter frame**, are ``[topic, seq8, payload]`` (0.5.22+) or ``[seq8, payload]`` (older);
the end marker's seq frame is ``ff`` x 8. (The caller must strip the delimiter: with the default
empty topic a stripped 0.5.23 reply and an unstripped 0.5.20 reply look the same.)
"""

from __future__ import annotations

from typing import Any, Union

import msgspec

from kvcadence.errors import UsageError, WireError
from kvcadence.format.hashes import (
    I64_MAX,
    U64_MAX,
    block_digests,
    block_hashes,
    cache_salt_seed,
    digest_to_int64,
    namespace_seed,
    namespaced_block_hash,
    norm_hash,
    page_digest,
    u64,
)
from kvcadence.format.schema import (
    AllBlocksCleared,
    AllBlocksClearedArr,
    BlockRemoved,
    BlockRemovedRawView,
    BlockRemovedV05,
    BlockRemovedV17,
    BlockRemovedV17RawView,
    BlockStored,
    BlockStoredRawView,
    BlockStoredV05,
    BlockStoredV17,
    BlockStoredV17RawView,
    BlockStoredV17View,
    BlockStoredView,
    KVEventBatch,
    KVEventBatchRawView,
    KVEventBatchV05,
    KVEventBatchV17,
    KVEventBatchV17RawView,
    KVEventBatchV17View,
    KVEventBatchView,
    UnknownEvent,
)

# --------------------------------------------------------------------------------------
# Versions
# --------------------------------------------------------------------------------------

FAMILY_MAP = "map"  # 0.5.22+: tagged maps with lora_name
FAMILY_MAP20 = "map20"  # 0.5.20: tagged maps, no lora_name
FAMILY_ARRAY = "array"  # 0.5.10-0.5.17: 7/3-slot tagged arrays
FAMILY_ARRAY05 = "array05"  # 0.5.5: 6/2-slot tagged arrays

VERSION_FAMILY: dict[str, str] = {
    "0.5.5": FAMILY_ARRAY05,
    "0.5.10": FAMILY_ARRAY,
    "0.5.14": FAMILY_ARRAY,
    "0.5.17": FAMILY_ARRAY,
    "0.5.20": FAMILY_MAP20,
    "0.5.22": FAMILY_MAP,
    "0.5.23": FAMILY_MAP,
}
SUPPORTED_VERSIONS: tuple[str, ...] = tuple(VERSION_FAMILY)
DEFAULT_VERSION = "0.5.23"


def version_family(version: str) -> str:
    """The wire family of an SGLang release (``UsageError`` for a release kvcadence doesn't know)."""
    fam = VERSION_FAMILY.get(version)
    if fam is None:
        raise UsageError(
            f"unknown SGLang version {version!r} for the KV-event wire format "
            f"(known: {', '.join(SUPPORTED_VERSIONS)})"
        )
    return fam


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


def _tokens_ok(raw: msgspec.Raw) -> bool:
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
            if not _tokens_ok(ev.token_ids):
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
    payload: bytes | bytearray | memoryview | msgspec.Raw, *, checked: bool = False
) -> KVEventBatchRawView:
    """``decode_batch_view`` that leaves the block hashes undecoded too (analysis ingest's fast
    path): a ``BlockStored`` comes back as ``BlockStoredRawView``, a ``BlockRemoved`` as
    ``BlockRemovedRawView``, both with ``block_hashes`` as its msgpack array bytes (``Raw``).

    The typed fast path checks the envelope, tags, ``parent_block_hash`` (int64 range, in C),
    ``block_size``, ``lora_id`` and ``medium``, but nothing *inside* the two ``Raw`` fields:
    the caller must check that ``block_hashes`` is an array of ints and ``token_ids`` an array
    (``kvcadence.analysis.tokcols``: ``int_arrays(..., wrap_u64=True)`` and ``array_lengths``
    raise otherwise) and use ``decode_batch_view`` for the payload where either is not.
    Read that way, the hashes are exactly ``decode_batch``'s: a uint64 wire hash >= 2**63 is
    the signed int64 of the same 64 bits. Payloads the typed raw view cannot take (mixed
    shapes, unknown tags, bytes hashes, a parent hash >= 2**63, ...) go through
    ``decode_batch_view`` and come back converted, their hashes re-encoded as int64 arrays (valid
    by construction); malformed input raises ``WireError`` as there.

    ``checked=True``: no unchecked fast path: ``decode_batch_view``'s events (and verdict)
    converted, hashes re-encoded as int64 arrays -- every ``Raw`` field valid by
    construction (the reader's second pass where the caller's check refused a field).
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
            if _raw_tokens_ok(batch.events):
                return batch
            return decode_batch_raw(payload, checked=True)  # decode_batch names the error
        try:
            arr = _RAW_VIEW_ARRAY.decode(payload)
        except _RAW_FAILS:
            pass
        else:
            evs = [_from_array(e, *_RAW_ARRAY_TYPES) for e in arr.events]
            if _raw_tokens_ok(evs):
                return KVEventBatchRawView(arr.ts, evs, arr.attn_dp_rank)
    return decode_batch_raw(payload, checked=True)


def _raw_tokens_ok(evs: list[Any]) -> bool:
    for ev in evs:
        if type(ev) is BlockStoredRawView and not _tokens_ok(ev.token_ids):
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


# --------------------------------------------------------------------------------------
# Encoding
# --------------------------------------------------------------------------------------


def _unknown_raw(ev: UnknownEvent, fam: str, version: str) -> Any:
    raw = ev.raw
    if fam in (FAMILY_MAP, FAMILY_MAP20):
        if type(raw) is dict and raw.get("type") == ev.tag:
            return raw
    elif type(raw) is list and raw and raw[0] == ev.tag:
        return raw
    raise WireError(
        f"cannot encode unknown event {ev.tag!r} for SGLang {version}: its raw value is not "
        f"a {'map' if fam.startswith('map') else 'positional array'} event"
    )


def _to_v17(ev: Any, fam: str, version: str) -> Any:
    t = type(ev)
    if t is BlockStored:
        return BlockStoredV17(
            ev.block_hashes,
            ev.parent_block_hash,
            ev.token_ids,
            ev.block_size,
            ev.lora_id,
            ev.medium,
        )
    if t is BlockRemoved:
        return BlockRemovedV17(ev.block_hashes, ev.medium)
    if t is AllBlocksCleared:
        return AllBlocksClearedArr()
    if t is UnknownEvent:
        return _unknown_raw(ev, fam, version)
    raise WireError(f"not a KV event: {t.__name__}")


def _to_v05(ev: Any, fam: str, version: str) -> Any:
    t = type(ev)
    if t is BlockStored:
        return BlockStoredV05(
            ev.block_hashes, ev.parent_block_hash, ev.token_ids, ev.block_size, ev.lora_id
        )
    if t is BlockRemoved:
        return BlockRemovedV05(ev.block_hashes)
    if t is AllBlocksCleared:
        return AllBlocksClearedArr()
    if t is UnknownEvent:
        return _unknown_raw(ev, fam, version)
    raise WireError(f"not a KV event: {t.__name__}")


def _to_map(ev: Any, fam: str, version: str) -> Any:
    t = type(ev)
    if t is BlockStored:
        if fam == FAMILY_MAP20 and ev.lora_name is not None:
            return msgspec.structs.replace(ev, lora_name=None)
        return ev
    if t is BlockRemoved or t is AllBlocksCleared:
        return ev
    if t is UnknownEvent:
        return _unknown_raw(ev, fam, version)
    raise WireError(f"not a KV event: {t.__name__}")


def encode_batch(batch: KVEventBatch, version: str = DEFAULT_VERSION) -> bytes:
    """The payload bytes SGLang ``version`` publishes for ``batch`` (byte-identical)."""
    fam = version_family(version)
    ts = batch.ts
    if type(ts) is not float:
        try:
            ts = float(ts)
        except (TypeError, ValueError):
            raise WireError(f"batch ts must be a number, got {ts!r}") from None
    events = batch.events
    try:
        if fam == FAMILY_MAP:
            if type(batch.ts) is float and not any(type(e) is UnknownEvent for e in events):  # type: ignore[comparison-overlap]
                return _ENC.encode(batch)
            out: Any = KVEventBatch(
                ts, [_to_map(e, fam, version) for e in events], batch.attn_dp_rank
            )
        elif fam == FAMILY_MAP20:
            out = KVEventBatch(ts, [_to_map(e, fam, version) for e in events], batch.attn_dp_rank)
        elif fam == FAMILY_ARRAY:
            out = KVEventBatchV17(
                ts, [_to_v17(e, fam, version) for e in events], batch.attn_dp_rank
            )
        else:
            out = KVEventBatchV05(
                ts, [_to_v05(e, fam, version) for e in events], batch.attn_dp_rank
            )
        return _ENC.encode(out)
    except (OverflowError, TypeError) as exc:
        raise WireError(f"batch cannot be encoded for SGLang {version}: {exc}") from None


# --------------------------------------------------------------------------------------
# Canonical JSON form (the vectors' "decoded")
# --------------------------------------------------------------------------------------


def _canon_event(ev: Any, fam: str) -> dict[str, Any]:
    t = type(ev)
    if t is UnknownEvent:
        return {"type": ev.tag, "raw": ev.raw}
    if t is AllBlocksCleared:
        return {"type": _TAG_CLEARED}
    if fam == FAMILY_ARRAY or fam == FAMILY_ARRAY05:
        if t is BlockStored:
            d = {
                "type": _TAG_STORED,
                "block_hashes": ev.block_hashes,
                "parent_block_hash": ev.parent_block_hash,
                "token_ids": ev.token_ids,
                "block_size": ev.block_size,
                "lora_id": ev.lora_id,
            }
        else:
            d = {"type": _TAG_REMOVED, "block_hashes": ev.block_hashes}
        if fam == FAMILY_ARRAY:
            d["medium"] = ev.medium
        return d
    d = msgspec.to_builtins(ev)
    if fam == FAMILY_MAP20:
        d.pop("lora_name", None)
    return d  # type: ignore[no-any-return]


def to_canonical(batch: KVEventBatch, version: str | None = None) -> dict[str, Any]:
    """The vectors' ``decoded`` JSON form of a batch.

    ``version=None`` (or a map version) gives the map form: None-valued optional fields left
    out, required ``parent_block_hash``/``lora_id`` kept. An array version gives that
    version's positional slot names with nil slots as null (0.5.5: no ``medium``).
    """
    fam = FAMILY_MAP if version is None else version_family(version)
    return {
        "ts": batch.ts,
        "events": [_canon_event(ev, fam) for ev in batch.events],
        "attn_dp_rank": batch.attn_dp_rank,
    }


def batch_from_canonical(d: dict[str, Any]) -> KVEventBatch:
    """Inverse of ``to_canonical``: build canonical structs, keeping every int exactly as given
    (no hash normalisation, so encoding reproduces the original bytes)."""
    if type(d) is not dict:
        raise WireError(f"a canonical batch must be a dict, got {_kind(d)} - at `$`")
    ts = d.get("ts")
    if type(ts) is int:
        ts = float(ts)
    elif type(ts) is not float:
        raise WireError(f"ts must be a number, got {_kind(ts)} - at `$.ts`")
    events = d.get("events")
    if type(events) is not list:
        raise WireError(f"events must be a list, got {_kind(events)} - at `$.events`")
    rank = _opt_int(d.get("attn_dp_rank"), "attn_dp_rank", "$.attn_dp_rank")
    out = []
    for i, ev in enumerate(events):
        where = f"$.events[{i}]"
        if type(ev) is not dict:
            raise WireError(f"a canonical event must be a dict, got {_kind(ev)} - at `{where}`")
        tag = ev.get("type")
        if tag not in (_TAG_STORED, _TAG_REMOVED, _TAG_CLEARED) and type(tag) is str:
            raw = ev["raw"] if set(ev) == {"type", "raw"} else ev
            out.append(UnknownEvent(tag=tag, raw=raw))
        else:
            out.append(_event(ev, where, False))
    return KVEventBatch(ts=ts, events=out, attn_dp_rank=rank)  # type: ignore[arg-type]


# --------------------------------------------------------------------------------------
# ZMQ framing
# --------------------------------------------------------------------------------------

END_SEQ: int = -1
_END_FRAME = b"\xff" * 8


def _seq_bytes(seq: int) -> bytes:
    if type(seq) is not int or not (-1 <= seq <= U64_MAX):
        raise WireError(f"seq must be an int in 0..2**64-1 (or END_SEQ), got {seq!r}")
    if seq == END_SEQ:
        return _END_FRAME
    return seq.to_bytes(8, "big")


def _seq_from(frame: bytes, where: str) -> int:
    if len(frame) != 8:
        raise WireError(f"seq frame must be 8 bytes, got {len(frame)} - at {where}")
    return int.from_bytes(frame, "big")


def _topic_from(frame: bytes, where: str) -> str:
    try:
        return bytes(frame).decode("utf-8")
    except UnicodeDecodeError:
        raise WireError(f"topic frame is not UTF-8: {bytes(frame)[:32]!r} - at {where}") from None


def parse_live_message(frames: list[bytes]) -> tuple[str, int, bytes]:
    """A SUB-side message ``[topic, seq8 BE, payload]`` -> ``(topic, seq, payload)``."""
    if len(frames) != 3:
        raise WireError(f"a live KV-event message has 3 frames, got {len(frames)}")
    topic, seq, payload = frames
    return _topic_from(topic, "frame 0"), _seq_from(seq, "frame 1"), bytes(payload)


def parse_replay_reply(frames: list[bytes]) -> tuple[str | None, int, bytes] | None:
    """A replay reply as received by a DEALER with the empty delimiter already stripped:
    ``[topic, seq8, payload]`` (0.5.22+) or ``[seq8, payload]`` (older; topic None).
    Returns None for the end marker (seq frame ``ff`` x 8)."""
    n = len(frames)
    if n == 3:
        topic_frame, seq_frame, payload = frames
        if bytes(seq_frame) == _END_FRAME:
            return None
        topic: str | None = _topic_from(topic_frame, "frame 0")
        seq = _seq_from(seq_frame, "frame 1")
    elif n == 2:
        seq_frame, payload = frames
        if bytes(seq_frame) == _END_FRAME:
            return None
        topic = None
        seq = _seq_from(seq_frame, "frame 0")
    else:
        raise WireError(
            f"a replay reply has 3 frames [topic, seq, payload] or 2 [seq, payload] after the "
            f"empty delimiter, got {n}"
        )
    return topic, seq, bytes(payload)


def live_frames(topic: str, seq: int, payload: bytes) -> list[bytes]:
    """The frames a PUB socket sends: ``[topic, seq8 BE, payload]``."""
    return [topic.encode("utf-8"), _seq_bytes(seq), bytes(payload)]


def replay_request(start_seq: int) -> list[bytes]:
    """What a DEALER sends to the replay ROUTER: ``[b"", start_seq8 BE]``."""
    if start_seq == END_SEQ:
        raise WireError("replay start seq must be 0..2**64-1")
    return [b"", _seq_bytes(start_seq)]


def parse_replay_request(frames: list[bytes]) -> int:
    """A replay request as received by the ROUTER, identity frame stripped: exactly
    ``[b"", start_seq8 BE]`` (what a DEALER sends) -> the start seq (read unsigned, as
    SGLang does). Anything else (SGLang logs it and sends no reply) raises ``WireError``."""
    n = len(frames)
    if n != 2:
        raise WireError(
            f"a replay request has 2 frames [b'', start_seq] after the identity, got {n}"
        )
    delim, seq_frame = frames
    if len(delim) != 0:
        raise WireError(
            f"a replay request's frame 0 must be the empty delimiter, got {bytes(delim)[:32]!r}"
        )
    return _seq_from(seq_frame, "frame 1 (start seq)")


def replay_reply_frames(topic: str | None, seq: int, payload: bytes) -> list[bytes]:
    """What a 0.5.23 ROUTER sends after the identity frame: ``[b"", topic, seq8, payload]``;
    ``topic=None`` gives the older ``[b"", seq8, payload]``. ``seq=END_SEQ`` is the end marker
    (its payload is always empty)."""
    seq8 = _seq_bytes(seq)
    body = b"" if seq == END_SEQ else bytes(payload)
    if topic is None:
        return [b"", seq8, body]
    return [b"", topic.encode("utf-8"), seq8, body]


__all__ = [
    "SUPPORTED_VERSIONS",
    "DEFAULT_VERSION",
    "VERSION_FAMILY",
    "version_family",
    "decode_batch",
    "decode_batch_view",
    "decode_batch_raw",
    "encode_batch",
    "count_unknown",
    "to_canonical",
    "batch_from_canonical",
    "norm_hash",
    "u64",
    "block_hashes",
    "block_digests",
    "page_digest",
    "digest_to_int64",
    "cache_salt_seed",
    "namespace_seed",
    "namespaced_block_hash",
    "parse_live_message",
    "parse_replay_reply",
    "live_frames",
    "replay_request",
    "parse_replay_request",
    "replay_reply_frames",
    "END_SEQ",
]
