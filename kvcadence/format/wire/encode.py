"""SGLang releases and their wire families, encoding a batch as one release publishes it
(``encode_batch``, byte-identical), and the vectors' canonical JSON form (``to_canonical``,
``batch_from_canonical``)."""

from __future__ import annotations

from typing import Any

import msgspec

from kvcadence.errors import UsageError, WireError
from kvcadence.format.schema import (
    AllBlocksCleared,
    AllBlocksClearedArr,
    BlockRemoved,
    BlockRemovedV05,
    BlockRemovedV17,
    BlockStored,
    BlockStoredV05,
    BlockStoredV17,
    KVEventBatch,
    KVEventBatchV05,
    KVEventBatchV17,
    UnknownEvent,
)
from kvcadence.format.wire.decode import (
    _ENC,
    _TAG_CLEARED,
    _TAG_REMOVED,
    _TAG_STORED,
    _event,
    _kind,
    _opt_int,
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


__all__ = [
    "DEFAULT_VERSION",
    "SUPPORTED_VERSIONS",
    "VERSION_FAMILY",
    "batch_from_canonical",
    "encode_batch",
    "to_canonical",
    "version_family",
]
