"""``wire.decode_batch_view`` and ``wire.decode_batch_raw`` (the analysis fast paths) agree
with ``wire.decode_batch``; ``wire.decode_batch_raw_fast`` is ``decode_batch_raw`` or None.

Golden vectors (every shape), the real 0.5.23 capture, hypothesis-generated batches, and the
fallback paths (unknown tags, uint64 hashes, bytes hashes, bigram tokens, malformed input).
"""

from __future__ import annotations

import base64
import json
from pathlib import Path
from typing import Any

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvcadence.analysis.tokcols import NotInt64Arrays, array_lengths, int_arrays
from kvcadence.errors import WireError
from kvcadence.format import wire
from kvcadence.format.schema import (
    AllBlocksCleared,
    BlockRemoved,
    BlockRemovedRawView,
    BlockStored,
    BlockStoredRawView,
    BlockStoredView,
    KVEventBatch,
    UnknownEvent,
)
from kvcadence.format.wire import decode as wire_decode

#: a 0.5.20+ batch whose one BlockStored has token_ids that are not an array
BAD_TOKENS = msgspec.msgpack.encode(
    [
        1.0,
        [
            {
                "type": "BlockStored",
                "block_hashes": [1],
                "parent_block_hash": None,
                "token_ids": "not an array",
                "block_size": 1,
                "lora_id": None,
            }
        ],
        None,
    ]
)


def _summary(batch: Any) -> list[tuple[Any, ...]]:
    """What ingest reads of a batch, comparable between the full and the view decode."""
    out: list[tuple[Any, ...]] = [(batch.ts, batch.attn_dp_rank)]
    for ev in batch.events:
        t = type(ev)
        if t in (BlockStored, BlockStoredView):
            n = len(ev.token_ids) if t is BlockStored else ev.n_tokens
            out.append(
                (
                    "stored",
                    list(ev.block_hashes),
                    ev.parent_block_hash,
                    n,
                    ev.block_size,
                    ev.lora_id,
                    ev.medium,
                )
            )
        elif t is BlockRemoved:
            out.append(("removed", list(ev.block_hashes), ev.medium))
        elif t is AllBlocksCleared:
            out.append(("cleared",))
        else:
            assert t is UnknownEvent
            out.append(("unknown", ev.tag))
    return out


def _same(payload: bytes) -> list[tuple[Any, ...]]:
    full = _summary(wire.decode_batch(payload))
    view = _summary(wire.decode_batch_view(payload))
    assert view == full
    return view


def test_golden_vectors_agree(vectors_path: Path) -> None:
    seen = 0
    for v in json.loads(vectors_path.read_text()):
        if v["kind"] != "batch":
            continue
        got = _same(bytes.fromhex(v["payload_hex"]))
        assert len(got) == 1 + len(v["decoded"]["events"])
        seen += 1
    assert seen >= 8


def test_real_capture_agrees_and_skips_token_decoding(fixture_dir: Path) -> None:
    n_stored = 0
    for line in (fixture_dir / "events.jsonl").read_text().splitlines():
        payload = base64.b64decode(json.loads(line)["payload_b64"])
        _same(payload)
        for ev in wire.decode_batch_view(payload).events:
            if type(ev) is BlockStoredView:
                assert isinstance(ev.token_ids, msgspec.Raw)
                n_stored += 1
    assert n_stored > 10


def test_uint64_hashes_become_signed() -> None:
    big = (1 << 64) - 5
    raw = msgspec.msgpack.encode(
        [
            2.0,
            [
                {
                    "type": "BlockStored",
                    "block_hashes": [big, 3],
                    "parent_block_hash": big,
                    "token_ids": [1, 2],
                    "block_size": 1,
                    "lora_id": None,
                },
                {"type": "BlockRemoved", "block_hashes": [big]},
            ],
            0,
        ]
    )
    got = _same(raw)
    assert got[1][1] == [-5, 3] and got[1][2] == -5 and got[2][1] == [-5]


def test_fallbacks_unknown_tag_bytes_hash_bigram_and_long_arrays() -> None:
    ev_unknown = {"type": "BlockUpdated", "x": 1}
    ev_bytes = {"type": "BlockRemoved", "block_hashes": [b"\x00" * 7 + b"\x09" + b"\x00" * 24]}
    ev_bigram = {
        "type": "BlockStored",
        "block_hashes": [1],
        "parent_block_hash": None,
        "token_ids": [[1, 2], [2, 3]],
        "block_size": 2,
        "lora_id": None,
    }
    ev_long = {
        "type": "BlockStored",
        "block_hashes": list(range(20)),
        "parent_block_hash": None,
        "token_ids": list(range(70_000)),  # array32 header
        "block_size": 3500,
        "lora_id": 7,
        "medium": "CPU",
    }
    ev_mid = dict(ev_long, token_ids=list(range(300)))  # array16 header
    raw = msgspec.msgpack.encode([1.0, [ev_unknown, ev_bytes, ev_bigram, ev_long, ev_mid], None])
    got = _same(raw)
    assert got[1] == ("unknown", "BlockUpdated")
    assert got[2] == ("removed", [9], None)
    assert got[3][3] == 2 and got[4][3] == 70_000 and got[5][3] == 300
    # the same events without the unknown/bytes ones take the typed fast path
    fast = msgspec.msgpack.encode([1.0, [ev_bigram, ev_long, ev_mid], None])
    assert [e[3] for e in _same(fast)[1:]] == [2, 70_000, 300]


def test_old_array_shapes_agree() -> None:
    for version in ("0.5.5", "0.5.14"):
        batch = KVEventBatch(
            3.0,
            [
                AllBlocksCleared(),
                BlockStored([11, -12], 10, [1, 2, 3, 4], 2, None, "GPU"),
                BlockRemoved([11], "GPU"),
            ],
            1,
        )
        got = _same(wire.encode_batch(batch, version))
        assert got[2][1] == [11, -12] and got[2][3] == 4


@pytest.mark.parametrize(
    "payload",
    [
        b"",
        b"\xc1",
        msgspec.msgpack.encode([1.0, [], None, 4]),
        msgspec.msgpack.encode({"ts": 1.0}),
        BAD_TOKENS,
    ],
)
def test_malformed_payloads_raise_like_decode_batch(payload: bytes) -> None:
    with pytest.raises(WireError):
        wire.decode_batch(payload)
    with pytest.raises(WireError):
        wire.decode_batch_view(payload)


_i64 = st.integers(-(1 << 63), (1 << 64) - 1)
_stored = st.builds(
    BlockStored,
    block_hashes=st.lists(_i64, max_size=6),
    parent_block_hash=st.none() | _i64,
    token_ids=st.lists(st.integers(0, (1 << 32) - 1), max_size=40),
    block_size=st.integers(1, 64),
    lora_id=st.none() | st.integers(0, 9),
    medium=st.none() | st.sampled_from(["GPU", "CPU"]),
    cache_salt=st.none() | st.just("s"),
)
_removed = st.builds(
    BlockRemoved, block_hashes=st.lists(_i64, max_size=6), medium=st.none() | st.just("GPU")
)
_batch = st.builds(
    KVEventBatch,
    ts=st.floats(0, 2e9, allow_nan=False),
    events=st.lists(st.one_of(_stored, _removed, st.just(AllBlocksCleared())), max_size=8),
    attn_dp_rank=st.none() | st.integers(0, 7),
)


@settings(max_examples=150, deadline=None)
@given(_batch, st.sampled_from(["0.5.23", "0.5.20", "0.5.14", "0.5.5"]))
def test_property_view_equals_full_decode(batch: KVEventBatch, version: str) -> None:
    _same(wire.encode_batch(batch, version))


# -- decode_batch_raw: hashes too left as msgpack bytes (ingest's fast path) ---------------


def _raw_summary(batch: Any) -> list[tuple[Any, ...]]:
    """``_summary`` of a ``decode_batch_raw`` batch, its Raw fields read the way ingest reads
    them (``int_arrays(wrap_u64=True)``, ``array_lengths``); raises ``NotInt64Arrays`` where
    ingest's check fails."""
    out: list[tuple[Any, ...]] = [(batch.ts, batch.attn_dp_rank)]
    for ev in batch.events:
        t = type(ev)
        if t in (BlockStoredRawView, BlockRemovedRawView):
            assert isinstance(ev.block_hashes, msgspec.Raw)
            hs = int_arrays([ev.block_hashes], wrap_u64=True)[0].tolist()
        if t is BlockStoredRawView:
            assert isinstance(ev.token_ids, msgspec.Raw)
            n = int(array_lengths([ev.token_ids])[0])
            row = ("stored", hs, ev.parent_block_hash, n, ev.block_size, ev.lora_id, ev.medium)
            out.append(row)
        elif t is BlockRemovedRawView:
            out.append(("removed", hs, ev.medium))
        elif t is AllBlocksCleared:
            out.append(("cleared",))
        else:
            assert t is UnknownEvent
            out.append(("unknown", ev.tag))
    return out


def _same_raw(payload: bytes) -> list[tuple[Any, ...]]:
    full = _summary(wire.decode_batch(payload))
    for arg in (payload, memoryview(payload), msgspec.Raw(payload)):
        assert _raw_summary(wire.decode_batch_raw(arg)) == full
    return full


def test_raw_golden_vectors_agree(vectors_path: Path) -> None:
    seen = 0
    for v in json.loads(vectors_path.read_text()):
        if v["kind"] == "batch":
            _same_raw(bytes.fromhex(v["payload_hex"]))
            seen += 1
    assert seen >= 8


def test_raw_real_capture_agrees_on_the_typed_path(fixture_dir: Path) -> None:
    n_stored = 0
    for line in (fixture_dir / "events.jsonl").read_text().splitlines():
        payload = base64.b64decode(json.loads(line)["payload_b64"])
        _same_raw(payload)
        assert wire_decode._RAW_VIEW.decode(payload) is not None  # no fallback on real 0.5.23 data
        n_stored += sum(
            type(e) is BlockStoredRawView for e in wire.decode_batch_raw(payload).events
        )
    assert n_stored > 10


def test_raw_uint64_hashes_and_parent() -> None:
    big = (1 << 64) - 5
    ev = {
        "type": "BlockStored",
        "block_hashes": [big, 3],
        "parent_block_hash": 4,
        "token_ids": [1, 2],
        "block_size": 1,
        "lora_id": None,
    }
    fast = msgspec.msgpack.encode([2.0, [ev, {"type": "BlockRemoved", "block_hashes": [big]}], 0])
    got = _same_raw(fast)  # typed path: the uint64 hash is read as its int64 bits
    assert got[1][1] == [-5, 3] and got[2][1] == [-5]
    slow = msgspec.msgpack.encode([2.0, [dict(ev, parent_block_hash=big)], 0])
    got = _same_raw(slow)  # parent >= 2**63 fails the typed range check: canonical path
    assert got[1][2] == -5
    assert type(wire.decode_batch_raw(slow).events[0]) is BlockStoredRawView


def test_raw_fallbacks_unknown_tag_bytes_hash_bigram_long_arrays() -> None:
    ev_unknown = {"type": "BlockUpdated", "x": 1}
    ev_bytes = {"type": "BlockRemoved", "block_hashes": [b"\x00" * 7 + b"\x09" + b"\x00" * 24]}
    ev_bigram = {
        "type": "BlockStored",
        "block_hashes": [1],
        "parent_block_hash": None,
        "token_ids": [[1, 2], [2, 3]],
        "block_size": 2,
        "lora_id": None,
    }
    ev_long = dict(ev_bigram, block_hashes=list(range(20)), token_ids=list(range(70_000)))
    mixed = msgspec.msgpack.encode([1.0, [ev_unknown, ev_bytes, ev_bigram, ev_long], None])
    got = _same_raw(mixed)  # unknown tag: canonical path, hashes re-encoded
    assert got[1] == ("unknown", "BlockUpdated") and got[2] == ("removed", [9], None)
    assert got[3][3] == 2 and got[4][3] == 70_000


def test_raw_typed_path_leaves_invalid_raw_fields_to_the_caller() -> None:
    """What the typed path does not check, ingest's numpy check refuses (and ingest then
    reads the bundle with ``decode_batch_view``, whose verdict is decode_batch's)."""
    ev = {
        "type": "BlockRemoved",
        "block_hashes": [b"\x00" * 7 + b"\x09" + b"\x00" * 24],  # bytes hash
    }
    payload = msgspec.msgpack.encode([1.0, [ev], None])
    raw = wire.decode_batch_raw(payload)
    assert type(raw.events[0]) is BlockRemovedRawView
    with pytest.raises(NotInt64Arrays):
        int_arrays([raw.events[0].block_hashes], wrap_u64=True)
    assert _summary(wire.decode_batch_view(payload))[1] == ("removed", [9], None)
    # token ids are checked by every decoder (one verdict): not left to the caller
    with pytest.raises(WireError):
        wire.decode_batch_raw(BAD_TOKENS)
    with pytest.raises(WireError):
        wire.decode_batch_view(BAD_TOKENS)
    # ... unless the caller decodes them itself (``check_tokens=False``: replay/outputs)
    unchecked = wire.decode_batch_raw(BAD_TOKENS, check_tokens=False)
    assert type(unchecked.events[0]) is BlockStoredRawView


@pytest.mark.parametrize(
    "payload",
    [b"", b"\xc1", msgspec.msgpack.encode([1.0, [], None, 4]), msgspec.msgpack.encode({"a": 1})],
)
def test_raw_malformed_payloads_raise_like_decode_batch(payload: bytes) -> None:
    with pytest.raises(WireError):
        wire.decode_batch(payload)
    with pytest.raises(WireError):
        wire.decode_batch_raw(payload)


@settings(max_examples=150, deadline=None)
@given(_batch, st.sampled_from(["0.5.23", "0.5.20", "0.5.14", "0.5.5"]))
def test_property_raw_equals_full_decode(batch: KVEventBatch, version: str) -> None:
    payload = wire.encode_batch(batch, version)
    _same_raw(payload)
    # valid token ids: the unchecked fast path returns what the checked one does
    assert wire.decode_batch_raw(payload, check_tokens=False) == wire.decode_batch_raw(payload)


def _fast_or_none(payload: bytes) -> Any:
    """``decode_batch_raw_fast`` of ``payload`` (as bytes, memoryview and Raw): None, or
    exactly what ``decode_batch_raw(..., check_tokens=False)`` returns."""
    got = [wire.decode_batch_raw_fast(a) for a in (payload, memoryview(payload))]
    got.append(wire.decode_batch_raw_fast(msgspec.Raw(payload)))
    assert len({g is None for g in got}) == 1
    if got[0] is not None:
        for g in got:
            assert g == wire.decode_batch_raw(payload, check_tokens=False)
    return got[0]


def test_raw_fast_path_alone_is_decode_batch_raw_or_none() -> None:
    ev = {"type": "BlockRemoved", "block_hashes": [1, 2]}
    three = msgspec.msgpack.encode([1.0, [ev], None])
    assert _fast_or_none(three) is not None
    assert _fast_or_none(BAD_TOKENS) is not None  # token ids are the caller's to check
    # a 2-element batch decodes into the view (attn_dp_rank has a default), but only a
    # fixarray of 3 takes decode_batch_raw's fast path: that one refuses it
    two = msgspec.msgpack.encode([1.0, [ev]])
    assert _fast_or_none(two) is None
    with pytest.raises(WireError):
        wire.decode_batch_raw(two)
    # the same 3 elements behind an array16 header: not the fast path's either
    assert _fast_or_none(b"\xdc\x00\x03" + three[1:]) is None
    unknown = msgspec.msgpack.encode([1.0, [{"type": "BlockUpdated", "x": 1}], None])
    for payload in (b"", b"\xc1", unknown, msgspec.msgpack.encode({"a": 1})):
        assert _fast_or_none(payload) is None


@settings(max_examples=100, deadline=None)
@given(_batch, st.sampled_from(["0.5.23", "0.5.20", "0.5.14", "0.5.5"]))
def test_property_raw_fast_path_agrees(batch: KVEventBatch, version: str) -> None:
    _fast_or_none(wire.encode_batch(batch, version))
