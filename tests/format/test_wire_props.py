"""Property tests of ``kvcadence.format.wire``: round trips per wire family, hash-form
equivalence, chain continuation, and that hostile bytes only ever raise ``WireError``."""

from __future__ import annotations

import hashlib
import struct

import msgspec
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from kvcadence.errors import WireError
from kvcadence.format.schema import BlockRemoved, BlockStored, KVEventBatch, UnknownEvent
from kvcadence.format.wire import (
    batch_from_canonical,
    block_digests,
    block_hashes,
    decode_batch,
    digest_to_int64,
    encode_batch,
    norm_hash,
    to_canonical,
    u64,
)
from kvcadence.format.wire import decode as wire_decode
from tests.strategies import (
    FAMILY_VERSION,
    canonical_batches,
    family_batches,
    hashes64,
    token_ids,
    u64_hashes,
)

FAST = settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])


# --------------------------------------------------------------------------------------
# round trips
# --------------------------------------------------------------------------------------


@FAST
@given(family_batches())
def test_roundtrip_each_family(vb: tuple[str, KVEventBatch]) -> None:
    """decode(encode(b, version)) == b on the fields that version carries (the strategy only
    fills those)."""
    version, batch = vb
    payload = encode_batch(batch, version)
    assert decode_batch(payload) == batch
    # and encoding is a pure function of the batch: re-encoding the decode is byte-identical
    assert encode_batch(decode_batch(payload), version) == payload


@FAST
@given(canonical_batches("map"))
def test_every_version_decodes_to_its_projection(batch: KVEventBatch) -> None:
    """A full 0.5.23 batch encoded for an older version decodes to the fields it keeps."""
    for version, drop in (
        ("0.5.20", {"lora_name"}),
        ("0.5.17", {"lora_name", "cache_salt", "session_id"}),
        ("0.5.5", {"lora_name", "cache_salt", "session_id", "medium"}),
    ):
        got = decode_batch(encode_batch(batch, version))
        want = [
            msgspec.structs.replace(e, **dict.fromkeys(drop & set(e.__struct_fields__)))
            for e in batch.events
        ]
        assert got.events == want
        assert got.attn_dp_rank == batch.attn_dp_rank and got.ts == batch.ts


@FAST
@given(family_batches())
def test_canonical_roundtrip(vb: tuple[str, KVEventBatch]) -> None:
    version, batch = vb
    assert batch_from_canonical(to_canonical(batch)) == batch
    assert batch_from_canonical(to_canonical(batch, version)) == batch


@FAST
@given(canonical_batches("map"))
def test_map_payload_is_one_msgpack_triple_with_float64_ts(batch: KVEventBatch) -> None:
    payload = encode_batch(batch)
    assert payload[0] == 0x93 and payload[1] == 0xCB
    assert struct.unpack(">d", payload[2:10])[0] == batch.ts


# --------------------------------------------------------------------------------------
# hash forms
# --------------------------------------------------------------------------------------


@FAST
@given(st.lists(hashes64(), min_size=1, max_size=20), st.one_of(st.none(), hashes64()))
def test_signed_and_unsigned_encodings_decode_equal(hs: list[int], parent: int | None) -> None:
    def payload(form) -> bytes:
        store = {
            "type": "BlockStored",
            "block_hashes": [form(h) for h in hs],
            "parent_block_hash": None if parent is None else form(parent),
            "token_ids": list(range(len(hs))),
            "block_size": 1,
            "lora_id": None,
        }
        rem = ["BlockRemoved", [form(h) for h in hs], "GPU"]
        return msgspec.msgpack.encode([1.0, [store, rem], 0])

    signed, unsigned = payload(lambda h: h), payload(u64)
    a, b = decode_batch(signed), decode_batch(unsigned)
    assert a == b
    assert a.events[0].block_hashes == hs and a.events[1].block_hashes == hs
    assert a.events[0].parent_block_hash == parent


@FAST
@given(u64_hashes())
def test_norm_hash_u64_inverse(h: int) -> None:
    s = norm_hash(h)
    assert -(2**63) <= s < 2**63
    assert u64(s) == h % 2**64
    assert norm_hash(u64(h)) == s


@FAST
@given(st.lists(st.binary(min_size=8, max_size=40), min_size=1, max_size=5))
def test_bytes_hashes_take_first_8_bytes_big_endian(ds: list[bytes]) -> None:
    got = decode_batch(msgspec.msgpack.encode([0.0, [["BlockRemoved", ds]], 0]))
    assert got.events[0].block_hashes == [int.from_bytes(d[:8], "big", signed=True) for d in ds]


# --------------------------------------------------------------------------------------
# block hashes
# --------------------------------------------------------------------------------------


def _reference_hashes(tokens: list[int], page_size: int, prior: bytes = b"") -> list[int]:
    """Independent plain reimplementation of SGLang's chained page hash."""
    out = []
    for start in range(0, len(tokens) - page_size + 1, page_size):
        page = tokens[start : start + page_size]
        if any(t >= 2**32 for t in page):
            data = b"\xff" + b"".join(t.to_bytes(8, "little") for t in page)
        else:
            data = b"".join(t.to_bytes(4, "little") for t in page)
        prior = hashlib.sha256(prior + data).digest()
        out.append(int.from_bytes(prior[:8], "big", signed=True))
    return out


@FAST
@given(token_ids(max_size=40, wide=True), st.integers(1, 5))
@example([1, 2**32 + 5, 3, 4], 4)
@example([1, 2, 3, 2**32 + 5, 3, 4], 1)
def test_block_hashes_match_reference(tokens: list[int], page_size: int) -> None:
    want = _reference_hashes(tokens, page_size)
    assert block_hashes(tokens, page_size) == want
    assert [digest_to_int64(d) for d in block_digests(tokens, page_size)] == want


@FAST
@given(token_ids(max_size=40, wide=True), token_ids(max_size=40), st.integers(1, 4))
def test_chain_continues_from_parent_digest(a: list[int], b: list[int], page_size: int) -> None:
    """Hashing a+b in one go == hashing a, then b chained from a's last digest (page-aligned)."""
    a = a[: len(a) // page_size * page_size]
    whole = block_hashes(a + b, page_size)
    first = block_digests(a, page_size)
    parent = first[-1] if first else None
    assert whole == [digest_to_int64(d) for d in first] + block_hashes(
        b, page_size, parent_digest=parent
    )


@FAST
@given(st.text(max_size=10), token_ids(min_size=1, max_size=12))
def test_cache_salt_separates_namespaces(salt: str, tokens: list[int]) -> None:
    salted = block_hashes(tokens, 1, cache_salt=salt)
    assert salted != block_hashes(tokens, 1)
    assert len(salted) == len(tokens)


# --------------------------------------------------------------------------------------
# hostile input: only WireError, never anything else
# --------------------------------------------------------------------------------------


def _decode_or_wire_error(data: bytes) -> KVEventBatch | None:
    try:
        batch = decode_batch(data)
    except WireError:
        return None
    assert isinstance(batch, KVEventBatch)
    for ev in batch.events:
        if type(ev) in (BlockStored, BlockRemoved):
            assert all(-(2**63) <= h < 2**63 for h in ev.block_hashes)
        elif type(ev) is UnknownEvent:
            assert isinstance(ev.tag, str)
    return batch


@settings(max_examples=400, deadline=None)
@given(st.binary(max_size=200))
def test_random_bytes_only_wire_error(data: bytes) -> None:
    _decode_or_wire_error(data)


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=120))
def test_random_bytes_behind_batch_header_only_wire_error(tail: bytes) -> None:
    # reach deeper than the first byte: a valid [ts, fixarray(n) ...] prefix, random rest
    _decode_or_wire_error(b"\x93\xcb" + b"\x00" * 8 + tail)


@FAST
@given(family_batches(), st.data())
def test_truncations_only_wire_error(vb: tuple[str, KVEventBatch], data) -> None:
    version, batch = vb
    payload = encode_batch(batch, version)
    cut = data.draw(st.integers(0, len(payload) - 1))
    assert _decode_or_wire_error(payload[:cut]) is None  # a cut payload is never one value


@settings(max_examples=150, deadline=None)
@given(family_batches(), st.data())
def test_bit_flips_only_wire_error(vb: tuple[str, KVEventBatch], data) -> None:
    version, batch = vb
    payload = bytearray(encode_batch(batch, version))
    for _ in range(data.draw(st.integers(1, 3))):
        pos = data.draw(st.integers(0, len(payload) - 1))
        payload[pos] ^= 1 << data.draw(st.integers(0, 7))
    _decode_or_wire_error(bytes(payload))


_KEYS = st.one_of(
    st.text(max_size=6),
    st.sampled_from(
        ["type", "block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id"]
        + ["medium", "cache_salt", "session_id", "lora_name"]
    ),
)


@FAST
@given(
    st.recursive(
        st.one_of(
            st.none(),
            st.booleans(),
            st.integers(-(2**63), 2**64 - 1),
            st.floats(allow_nan=False),
            st.text(max_size=5),
            st.binary(max_size=9),
            st.sampled_from(["BlockStored", "BlockRemoved", "AllBlocksCleared", "type"]),
        ),
        lambda kids: st.one_of(
            st.lists(kids, max_size=6), st.dictionaries(_KEYS, kids, max_size=6)
        ),
        max_leaves=30,
    )
)
def test_random_msgpack_structures_only_wire_error(obj) -> None:
    _decode_or_wire_error(msgspec.msgpack.encode([1.0, [obj], 0]))
    _decode_or_wire_error(msgspec.msgpack.encode([1.0, obj, 0]))
    _decode_or_wire_error(msgspec.msgpack.encode(obj))


def test_family_versions_cover_every_family() -> None:
    assert set(FAMILY_VERSION.values()) == {"0.5.23", "0.5.20", "0.5.14", "0.5.5"}


@FAST
@given(family_batches())
def test_fast_path_and_fallback_agree(vb: tuple[str, KVEventBatch]) -> None:
    """The typed fast path (maps) and the untyped per-event fallback decode alike."""
    version, batch = vb
    payload = encode_batch(batch, version)
    assert wire_decode._decode_slow(payload) == decode_batch(payload) == batch
