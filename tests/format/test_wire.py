"""Golden and behaviour tests of ``kvcadence.format.wire``: payload codec, canonical form,
block hashes and ZMQ framing, against the SGLang vectors and the real 0.5.23 capture."""

from __future__ import annotations

import base64
import json
from pathlib import Path

import msgspec
import pytest

from kvcadence.errors import UsageError, WireError
from kvcadence.format import wire
from kvcadence.format.schema import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEventBatch,
    UnknownEvent,
)
from kvcadence.format.wire import (
    END_SEQ,
    batch_from_canonical,
    block_digests,
    block_hashes,
    cache_salt_seed,
    count_unknown,
    decode_batch,
    digest_to_int64,
    encode_batch,
    joined_digests_to_int64,
    live_frames,
    namespace_seed,
    namespaced_block_hash,
    norm_hash,
    page_digest,
    parse_live_message,
    parse_replay_reply,
    replay_reply_frames,
    replay_request,
    to_canonical,
    u64,
)


@pytest.fixture(scope="module")
def vectors(vectors_path: Path) -> dict[str, list[dict]]:
    """The golden vectors by kind (read through the shared ``vectors_path`` fixture)."""
    by_kind: dict[str, list[dict]] = {}
    for v in json.loads(vectors_path.read_text()):
        by_kind.setdefault(v["kind"], []).append(v)
    return by_kind


def test_vectors_present(vectors: dict[str, list[dict]]) -> None:
    assert set(vectors) == {"batch", "zmq_frames", "block_hash", "namespaced_hash"}
    assert len(vectors["batch"]) >= 8 and len(vectors["zmq_frames"]) >= 3
    assert len(vectors["block_hash"]) >= 6 and len(vectors["namespaced_hash"]) >= 4


def _normalised(obj):
    """The vector's ``decoded`` with hash values >= 2**63 as negative int64 (decode_batch
    normalises every hash to SGLang's signed form; the vectors keep the wire's uint64)."""
    if isinstance(obj, dict):
        out = {}
        for k, v in obj.items():
            if k == "block_hashes":
                out[k] = [norm_hash(h) for h in v]
            elif k == "parent_block_hash" and v is not None:
                out[k] = norm_hash(v)
            else:
                out[k] = _normalised(v)
        return out
    if isinstance(obj, list):
        return [_normalised(v) for v in obj]
    return obj


# --------------------------------------------------------------------------------------
# golden batch vectors
# --------------------------------------------------------------------------------------


def test_batch_vectors_decode_to_canonical(vectors: dict[str, list[dict]]) -> None:
    for vec in vectors["batch"]:
        payload = bytes.fromhex(vec["payload_hex"])
        batch = decode_batch(payload)
        # array versions: the vector names that version's slots (0.5.5 has no medium key);
        # expectations are hash-normalised (values >= 2**63 compared as negative int64)
        got = to_canonical(batch, version=vec["sglang_version"])
        assert got == _normalised(vec["decoded"]), vec["name"]
        assert count_unknown(batch) == 0, vec["name"]
        # memoryview input decodes the same
        assert decode_batch(memoryview(payload)) == batch, vec["name"]


def test_batch_vectors_encode_byte_identical(vectors: dict[str, list[dict]]) -> None:
    checked = 0
    for vec in vectors["batch"]:
        batch = batch_from_canonical(vec["decoded"])  # ints kept exactly as given
        for version in [vec["sglang_version"], *vec.get("byte_identical_in", [])]:
            got = encode_batch(batch, version=version).hex()
            assert got == vec["payload_hex"], (vec["name"], version)
            checked += 1
    assert checked >= 14


def test_decoded_vectors_reencode_byte_identical(vectors: dict[str, list[dict]]) -> None:
    # decode -> encode needs no canonical detour, except where the vector holds uint64
    # hashes >= 2**63 (normalised to int64 on decode, so written back as 0xd3)
    for vec in vectors["batch"]:
        if vec["name"] == "v0523_remove_integer_encodings":
            continue
        payload = bytes.fromhex(vec["payload_hex"])
        assert encode_batch(decode_batch(payload), vec["sglang_version"]) == payload, vec["name"]


def test_batch_vectors_generic_msgpack(vectors: dict[str, list[dict]]) -> None:
    # the untyped decode of our own encoding matches the vector's plain msgpack view
    for vec in vectors["batch"]:
        out = encode_batch(batch_from_canonical(vec["decoded"]), version=vec["sglang_version"])
        assert msgspec.msgpack.decode(out) == vec["generic_msgpack"], vec["name"]


def _named(vectors: dict[str, list[dict]], name: str) -> dict:
    return next(v for vs in vectors.values() for v in vs if v["name"] == name)


def test_map_vector_decoded_shape_is_canonical_structs(vectors: dict[str, list[dict]]) -> None:
    vec = _named(vectors, "v0523_map_store_remove_clear")
    batch = decode_batch(bytes.fromhex(vec["payload_hex"]))
    assert batch == KVEventBatch(
        ts=1.5,
        events=[
            BlockStored(
                block_hashes=[-3488128144981237669, 5674439469042975057],
                parent_block_hash=None,
                token_ids=[1, 2, 3, 4, 5, 6, 7, 8],
                block_size=4,
                lora_id=None,
                medium="GPU",
            ),
            BlockRemoved(block_hashes=[5674439469042975057], medium="GPU"),
            AllBlocksCleared(),
        ],
        attn_dp_rank=0,
    )


def test_integer_edge_vector_normalises_uint64(vectors: dict[str, list[dict]]) -> None:
    vec = _named(vectors, "v0523_remove_integer_encodings")
    (ev,) = decode_batch(bytes.fromhex(vec["payload_hex"])).events
    assert ev.block_hashes[-2:] == [-(2**63), -1]  # 2**63 and 2**64-1 on the wire (0xcf)
    assert all(-(2**63) <= h < 2**63 for h in ev.block_hashes)


def test_same_content_in_every_family_decodes_equal(vectors: dict[str, list[dict]]) -> None:
    by_name = {v["name"]: bytes.fromhex(v["payload_hex"]) for v in vectors["batch"]}
    m = decode_batch(by_name["v0523_map_store_remove_clear"])
    a = decode_batch(by_name["v0514_array_store_remove_clear"])
    o = decode_batch(by_name["v055_array_store6_remove2_clear"])
    assert m == a
    # 0.5.5 carries no medium
    assert o.events[0] == msgspec.structs.replace(m.events[0], medium=None)
    assert o.events[1] == BlockRemoved(block_hashes=m.events[1].block_hashes)


def test_encode_reference_doc_hex(vectors: dict[str, list[dict]]) -> None:
    batch = decode_batch(
        bytes.fromhex(_named(vectors, "v0523_map_store_remove_clear")["payload_hex"])
    )
    assert encode_batch(batch, "0.5.17").hex() == (
        "93cb3ff80000000000009397ab426c6f636b53746f72656492d3cf97adeedb59e05bcf4ebfa8a1f3c34151"
        "c098010203040506070804c0a347505593ac426c6f636b52656d6f76656491cf4ebfa8a1f3c34151a347"
        "505591b0416c6c426c6f636b73436c656172656400"
    )
    assert encode_batch(batch, "0.5.5").hex() == (
        "93cb3ff80000000000009396ab426c6f636b53746f72656492d3cf97adeedb59e05bcf4ebfa8a1f3c34151"
        "c098010203040506070804c092ac426c6f636b52656d6f76656491cf4ebfa8a1f3c3415191b0416c6c42"
        "6c6f636b73436c656172656400"
    )


# --------------------------------------------------------------------------------------
# encoding rules
# --------------------------------------------------------------------------------------


def _store(**kw) -> BlockStored:
    base = dict(block_hashes=[1], parent_block_hash=2, token_ids=[3], block_size=1, lora_id=None)
    base.update(kw)
    return BlockStored(**base)


def test_encode_0520_drops_lora_name_0523_keeps_it() -> None:
    ev = _store(medium="GPU", cache_salt="s", session_id="x", lora_name="ad")
    batch = KVEventBatch(1.5, [ev], 0)
    d23 = msgspec.msgpack.decode(encode_batch(batch, "0.5.23"))
    d20 = msgspec.msgpack.decode(encode_batch(batch, "0.5.20"))
    assert d23[1][0]["lora_name"] == "ad"
    assert "lora_name" not in d20[1][0]
    assert d20[1][0]["session_id"] == "x" and d20[1][0]["cache_salt"] == "s"
    assert batch.events[0].lora_name == "ad"  # the caller's batch is untouched


def test_encode_array_versions_slot_counts() -> None:
    batch = KVEventBatch(
        1.5, [_store(medium="GPU", cache_salt="s"), BlockRemoved([5], "GPU"), AllBlocksCleared()]
    )
    a17 = msgspec.msgpack.decode(encode_batch(batch, "0.5.10"))
    a05 = msgspec.msgpack.decode(encode_batch(batch, "0.5.5"))
    assert [len(e) for e in a17[1]] == [7, 3, 1]
    assert [len(e) for e in a05[1]] == [6, 2, 1]
    assert a17[1][0] == ["BlockStored", [1], 2, [3], 1, None, "GPU"]
    assert a17[2] is None  # attn_dp_rank None is a nil slot


def test_encode_ts_always_float64() -> None:
    out = encode_batch(KVEventBatch(ts=2, events=[]), "0.5.23")  # type: ignore[arg-type]
    assert out.hex() == "93cb400000000000000090c0"
    assert encode_batch(KVEventBatch(ts=0.0, events=[], attn_dp_rank=0), "0.5.5")[1] == 0xCB


@pytest.mark.parametrize("version", ["0.5.21", "", "0.5.23.post1", "latest"])
def test_encode_unknown_version_is_usage_error(version: str) -> None:
    with pytest.raises(UsageError, match="unknown SGLang version"):
        encode_batch(KVEventBatch(1.0, []), version=version)


def test_encode_hash_out_of_64_bits_is_wire_error() -> None:
    with pytest.raises(WireError, match="cannot be encoded"):
        encode_batch(KVEventBatch(1.0, [BlockRemoved([1 << 64])]))


def test_encode_unknown_event_reemits_compatible_raw_only() -> None:
    raw_map = {"type": "BlockUpdated", "block_hashes": [1], "x": 2}
    batch = KVEventBatch(1.0, [UnknownEvent("BlockUpdated", raw_map), AllBlocksCleared()], 0)
    for version in ("0.5.23", "0.5.20"):
        back = decode_batch(encode_batch(batch, version))
        assert back.events[0] == UnknownEvent("BlockUpdated", raw_map)
    with pytest.raises(WireError, match="cannot encode unknown event 'BlockUpdated'"):
        encode_batch(batch, "0.5.14")
    raw_arr = ["BlockUpdated", [1], None]
    arr = KVEventBatch(1.0, [UnknownEvent("BlockUpdated", raw_arr)], 0)
    assert decode_batch(encode_batch(arr, "0.5.14")).events[0] == UnknownEvent(
        "BlockUpdated", raw_arr
    )
    with pytest.raises(WireError):
        encode_batch(arr, "0.5.23")


# --------------------------------------------------------------------------------------
# decoding: tolerated shapes
# --------------------------------------------------------------------------------------


def _pl(obj) -> bytes:
    return msgspec.msgpack.encode(obj)


def test_decode_map_key_order_unknown_keys_missing_optionals() -> None:
    ev = {
        "token_ids": [7],
        "zzz_future": {"a": [1, 2]},
        "block_size": 1,
        "type": "BlockStored",
        "block_hashes": [9],
    }
    (got,) = decode_batch(_pl([1.0, [ev], 0])).events
    assert got == BlockStored([9], None, [7], 1, None)


def test_decode_vllm_batch_bytes_hashes_and_extra_fields() -> None:
    d1 = bytes(range(32))
    d2 = bytes(range(255, 223, -1))
    ev = {
        "type": "BlockStored",
        "block_hashes": [d1, d2],
        "parent_block_hash": d2,
        "token_ids": [1, 2],
        "block_size": 1,
        "lora_id": None,
        "medium": "GPU",
        "lora_name": None,
        "extra_keys": [["mm", 1], None],
        "group_idx": 0,
        "kv_cache_spec_kind": "full_attention",
        "kv_cache_spec_sliding_window": None,
    }
    batch = decode_batch(_pl([3.0, [ev, {"type": "BlockRemoved", "block_hashes": [d1]}], 2]))
    want1 = int.from_bytes(d1[:8], "big", signed=True)
    want2 = int.from_bytes(d2[:8], "big", signed=True)
    assert want2 < 0  # the big-endian top bit makes it negative, as hash_str_to_int64 does
    assert batch.events[0].block_hashes == [want1, want2]
    assert batch.events[0].parent_block_hash == want2
    assert batch.events[1].block_hashes == [want1]
    assert batch.attn_dp_rank == 2  # vLLM's data_parallel_rank, read positionally


def test_decode_bytes_hash_equals_digest_int() -> None:
    (digest,) = block_digests([1, 2, 3, 4], 4)
    ev = decode_batch(_pl([0.0, [["BlockRemoved", [digest]]], 0])).events[0]
    assert ev.block_hashes == block_hashes([1, 2, 3, 4], 4) == [-3488128144981237669]


def test_decode_dynamo_style_long_arrays_ignore_trailing_slots() -> None:
    store = ["BlockStored", [1, 2], None, [5, 6], 1, None, "GPU", "lora-a", [["k"]], "tail"]
    rem = ["BlockRemoved", [2], "CPU_PINNED", "tail", 9]
    batch = decode_batch(_pl([1.0, [store, rem, ["AllBlocksCleared", 1]], 0]))
    assert batch.events == [
        BlockStored([1, 2], None, [5, 6], 1, None, "GPU"),
        BlockRemoved([2], "CPU_PINNED"),
        AllBlocksCleared(),
    ]


def test_decode_mixed_map_and_array_events() -> None:
    batch = decode_batch(
        _pl([1.0, [["BlockRemoved", [1]], {"type": "BlockRemoved", "block_hashes": [2]}], 0])
    )
    assert batch.events == [BlockRemoved([1]), BlockRemoved([2])]


def test_decode_bigram_token_pairs_kept() -> None:
    ev = {
        "type": "BlockStored",
        "block_hashes": [1],
        "parent_block_hash": None,
        "token_ids": [[5, 6], [6, 7]],
        "block_size": 2,
        "lora_id": None,
    }
    (got,) = decode_batch(_pl([1.0, [ev], 0])).events
    assert got.token_ids == [[5, 6], [6, 7]]


def test_decode_accepts_any_buffer() -> None:
    payload = _pl([1.0, [["BlockRemoved", [1]]], 0])
    want = decode_batch(payload)
    assert decode_batch(bytearray(payload)) == want
    assert decode_batch(msgspec.Raw(payload)) == want
    with pytest.raises(WireError, match="bytes-like"):
        decode_batch("not bytes")  # type: ignore[arg-type]


def test_decode_int_ts_becomes_float() -> None:
    batch = decode_batch(_pl([7, [], None]))
    assert batch.ts == 7.0 and type(batch.ts) is float


def test_unknown_tags_are_kept_and_counted() -> None:
    raw_map = {"type": "BlockUpdated", "block_hashes": [1]}
    raw_arr = ["Ignored", 1, 2]
    payload = _pl(
        [1.0, [raw_map, ["BlockRemoved", [3], None], raw_arr, {"type": "AllBlocksCleared"}], 0]
    )
    batch = decode_batch(payload)
    assert count_unknown(batch) == 2
    assert batch.events[0] == UnknownEvent("BlockUpdated", raw_map)
    assert batch.events[1] == BlockRemoved([3])
    assert batch.events[2] == UnknownEvent("Ignored", raw_arr)
    assert batch.events[3] == AllBlocksCleared()
    canon = to_canonical(batch)
    assert canon["events"][0] == {"type": "BlockUpdated", "raw": raw_map}
    assert batch_from_canonical(canon) == batch


def test_signed_and_unsigned_forms_decode_equal() -> None:
    h = -3488128144981237669
    signed = decode_batch(_pl([1.0, [{"type": "BlockRemoved", "block_hashes": [h]}], 0]))
    unsigned = decode_batch(_pl([1.0, [{"type": "BlockRemoved", "block_hashes": [h + 2**64]}], 0]))
    assert signed == unsigned
    assert u64(h) == h + 2**64 and norm_hash(h + 2**64) == h and norm_hash(h) == h


@pytest.mark.parametrize("slots", [6, 7])
def test_array_shapes_normalise_uint64_hashes(slots: int) -> None:
    store = ["BlockStored", [2**64 - 1, 5], 2**63, [1, 2], 1, None, "GPU"][:slots]
    rem = ["BlockRemoved", [2**64 - 2], "GPU"][: slots - 4]
    batch = decode_batch(_pl([1.0, [store, rem], 0]))
    medium = "GPU" if slots == 7 else None
    assert batch.events == [
        BlockStored([-1, 5], -(2**63), [1, 2], 1, None, medium),
        BlockRemoved([-2], medium),
    ]


def test_norm_hash_rejects_more_than_64_bits() -> None:
    for bad in (2**64, -(2**63) - 1):
        with pytest.raises(WireError):
            norm_hash(bad)


# --------------------------------------------------------------------------------------
# decoding: malformed payloads name what and where
# --------------------------------------------------------------------------------------

_STORE = {
    "type": "BlockStored",
    "block_hashes": [1],
    "parent_block_hash": None,
    "token_ids": [1],
    "block_size": 1,
    "lora_id": None,
}


def _with(**kw) -> dict:
    d = dict(_STORE)
    d.update(kw)
    return {k: v for k, v in d.items() if v is not ...}


MALFORMED = [
    ("not-msgpack", b"\xc1", r"not one msgpack value"),
    ("truncated", bytes.fromhex("93cb3ff8000000"), r"not one msgpack value"),
    ("trailing-bytes", _pl([1.0, [], 0]) + b"\x00", r"not one msgpack value"),
    ("map-batch", _pl({"ts": 1.0}), r"array of 3 .* got map - at `\$`"),
    ("two-elements", _pl([1.0, []]), r"got array of 2 - at `\$`"),
    ("four-elements", _pl([1.0, [], 0, 1]), r"got array of 4 - at `\$`"),
    ("ts-str", _pl(["x", [], 0]), r"ts must be a number, got str - at `\$\[0\]`"),
    ("ts-nil", _pl([None, [], 0]), r"ts must be a number, got nil - at `\$\[0\]`"),
    ("events-map", _pl([1.0, {}, 0]), r"events must be an array, got map - at `\$\[1\]`"),
    ("rank-str", _pl([1.0, [], "0"]), r"attn_dp_rank .* got str - at `\$\[2\]`"),
    ("event-int", _pl([1.0, [5], 0]), r"map or an array, got int - at `\$\[1\]\[0\]`"),
    ("event-no-type", _pl([1.0, [{"block_hashes": [1]}], 0]), r"no `type` key - at `\$\[1\]\[0\]`"),
    ("event-type-int", _pl([1.0, [{"type": 3}], 0]), r"got int - at `\$\[1\]\[0\]\.type`"),
    ("event-empty-array", _pl([1.0, [[]], 0]), r"empty \(no tag\) - at `\$\[1\]\[0\]`"),
    (
        "array-tag-int",
        _pl([1.0, [[1, 2]], 0]),
        r"tag must be a str, got int - at `\$\[1\]\[0\]\[0\]`",
    ),
    (
        "store-no-hashes",
        _pl([1.0, [_with(block_hashes=...)], 0]),
        r"BlockStored has no `block_hashes` key - at `\$\[1\]\[0\]`",
    ),
    (
        "remove-no-hashes",
        _pl([1.0, [{"type": "BlockRemoved"}], 0]),
        r"BlockRemoved has no `block_hashes` key",
    ),
    (
        "hash-str",
        _pl(
            [
                1.0,
                [{"type": "AllBlocksCleared"}, _STORE, _STORE, _with(block_hashes=[1, 2, "3"])],
                0,
            ]
        ),
        r"must be an int or bytes, got str - at `\$\[1\]\[3\]\.block_hashes\[2\]`",
    ),
    (
        "hash-float",
        _pl([1.0, [["BlockRemoved", [1, 2.5]]], 0]),
        r"got float - at `\$\[1\]\[0\]\[1\]\[1\]`",
    ),
    (
        "hash-short-bytes",
        _pl([1.0, [["BlockRemoved", [b"1234567"]]], 0]),
        r"at least 8 bytes, got 7 - at `\$\[1\]\[0\]\[1\]\[0\]`",
    ),
    (
        "hashes-not-list",
        _pl([1.0, [_with(block_hashes=5)], 0]),
        r"block_hashes must be an array, got int - at `\$\[1\]\[0\]\.block_hashes`",
    ),
    (
        "parent-str",
        _pl([1.0, [_with(parent_block_hash="p")], 0]),
        r"got str - at `\$\[1\]\[0\]\.parent_block_hash`",
    ),
    ("token-str", _pl([1.0, [_with(token_ids=[1, "a"])], 0]), r"at `\$\[1\]\[0\]\.token_ids\[1\]`"),
    (
        "block-size-nil",
        _pl([1.0, [_with(block_size=None)], 0]),
        r"block_size must be an int, got nil",
    ),
    ("medium-int", _pl([1.0, [_with(medium=3)], 0]), r"medium must be a str or nil, got int"),
    (
        "array-store-5-slots",
        _pl([1.0, [["BlockStored", [1], None, [1], 1]], 0]),
        r"BlockStored array has 5 slots, needs at least 6",
    ),
    ("array-remove-1-slot", _pl([1.0, [["BlockRemoved"]], 0]), r"no block_hashes slot"),
    ("bool-hash", _pl([1.0, [["BlockRemoved", [True]]], 0]), r"got bool"),
]


@pytest.mark.parametrize(
    "payload,pattern", [m[1:] for m in MALFORMED], ids=[m[0] for m in MALFORMED]
)
def test_malformed_payload_raises_wire_error(payload: bytes, pattern: str) -> None:
    with pytest.raises(WireError, match=pattern):
        decode_batch(payload)


def test_absurdly_deep_nesting_is_wire_error() -> None:
    # valid msgpack, but nested deeper than msgspec recurses: in an ignored unknown key (the
    # typed fast path skips it) and as the events themselves
    pre = _pl([1.0, [{"type": "BlockRemoved", "block_hashes": [1], "x": 0}], 0])
    i = pre.index(b"\xa1x") + 2
    deep_key = pre[:i] + b"\x91" * 100_000 + b"\xc0" + pre[i + 1 :]
    for payload in (deep_key, b"\x93\xcb" + bytes(8) + b"\x91" * 100_000):
        with pytest.raises(WireError, match="recursion"):
            decode_batch(payload)


def test_batch_from_canonical_errors() -> None:
    with pytest.raises(WireError, match=r"at `\$\.events\[0\]\.block_hashes\[0\]`"):
        batch_from_canonical(
            {"ts": 1.0, "events": [{"type": "BlockRemoved", "block_hashes": ["x"]}]}
        )
    with pytest.raises(WireError, match=r"\$\.ts"):
        batch_from_canonical({"events": []})


# --------------------------------------------------------------------------------------
# block hashes
# --------------------------------------------------------------------------------------


def test_block_hash_vectors(vectors: dict[str, list[dict]]) -> None:
    for vec in vectors["block_hash"]:
        name = vec["name"]
        parent = bytes.fromhex(vec["parent_digest_hex"]) if vec["parent_digest_hex"] else None
        salt = vec["cache_salt"]
        args = (vec["tokens"], vec["page_size"], salt, parent)
        assert block_hashes(*args) == vec["expected_hash"], name
        digests = block_digests(*args)
        assert [d.hex() for d in digests] == vec["expected_digest_hex"], name
        assert [digest_to_int64(d) for d in digests] == vec["expected_hash"], name
        joined = joined_digests_to_int64(b"".join(digests))
        assert joined.typecode == "q" and joined.tolist() == vec["expected_hash"], name
        # page_digest one page at a time gives the same chain
        prev = parent
        if prev is None and salt is not None:
            prev = cache_salt_seed(salt)
        ps = vec["page_size"]
        for i, want in enumerate(vec["expected_digest_hex"]):
            prev = page_digest(prev, vec["tokens"][i * ps : (i + 1) * ps])
            assert prev.hex() == want, (name, i)


def test_namespaced_hash_vectors(vectors: dict[str, list[dict]]) -> None:
    for vec in vectors["namespaced_hash"]:
        seed = namespace_seed(vec["extra_key"], vec["cache_salt"])
        assert seed is not None and seed.hex() == vec["namespace_seed_hex"], vec["name"]
        want = vec["expected_namespaced_hash"]
        assert namespaced_block_hash(vec["block_hash"], seed) == want, vec["name"]
        # the unsigned form of the same hash maps the same way
        assert namespaced_block_hash(u64(vec["block_hash"]), seed) == want, vec["name"]


def test_namespace_seed_none_is_identity() -> None:
    assert namespace_seed(None, None) is None
    assert namespaced_block_hash(2**64 - 1, None) == -1


def test_cache_salt_seed_reference_value() -> None:
    assert cache_salt_seed("abc").hex() == (
        "bbb78f32dc71cdab8bed096274873ba88907e9ede9e49fcc13eb800c0eb56f7e"
    )


def test_only_full_pages_hashed() -> None:
    assert block_hashes([1, 2, 3, 4, 5, 6, 7], 4) == [-3488128144981237669]
    assert block_hashes([1, 2, 3], 4) == []
    assert block_digests([], 1) == []


def test_hash_inputs_validated() -> None:
    with pytest.raises(WireError, match="non-negative int64"):
        block_hashes([1, -2, 3, 4], 4)
    with pytest.raises(WireError, match="non-negative int64"):
        block_hashes([2**63], 1)
    with pytest.raises(WireError, match="not an integer"):
        block_hashes([1.5], 1)
    with pytest.raises(WireError, match="page size"):
        block_hashes([1], 0)
    with pytest.raises(WireError, match="32"):
        block_hashes([1], 1, parent_digest=b"\x00" * 31)


def test_wide_page_only_where_needed() -> None:
    # page 0 narrow, page 1 wide: each page picks its own form
    toks = [1, 2, 3, 4, 1, 2**32 + 5, 3, 4]
    hs = block_hashes(toks, 4)
    assert hs[0] == -3488128144981237669
    d0 = block_digests(toks, 4)[0]
    assert hs[1] == digest_to_int64(page_digest(d0, [1, 2**32 + 5, 3, 4]))
    assert block_hashes([1, 2**32 + 5, 3, 4], 4) == [7706011424615126513]


def test_bigram_pairs_hash_both_words() -> None:
    import hashlib

    pairs = [[5, 6], [6, 7]]
    want = hashlib.sha256(b"".join(w.to_bytes(4, "little") for p in pairs for w in p)).digest()
    assert block_digests(pairs, 2) == [want]
    assert block_hashes(pairs, 2) == [digest_to_int64(want)]


def test_block_hashes_accept_array_input() -> None:
    from array import array

    assert block_hashes(array("q", [7, 8, 9]), 1) == [
        -1702009526849766914,
        903318264012984157,
        -8265893088400908305,
    ]


# --------------------------------------------------------------------------------------
# ZMQ framing
# --------------------------------------------------------------------------------------


def _hx(frames: list[str]) -> list[bytes]:
    return [bytes.fromhex(f) for f in frames]


def test_live_frames_vectors(vectors: dict[str, list[dict]]) -> None:
    for vec in vectors["zmq_frames"]:
        for msg in vec["live_messages"]:
            frames = _hx(msg["frames_hex"])
            topic, seq, payload = parse_live_message(frames)
            assert (topic, seq) == ("kv", msg["seq"]), vec["name"]
            assert live_frames(topic, seq, payload) == frames, vec["name"]
            batch = decode_batch(payload)
            assert batch.attn_dp_rank == 0
            assert batch.events[0] in (
                AllBlocksCleared(),
                BlockRemoved([5674439469042975057], "GPU"),
                BlockRemoved([5674439469042975057]),
            )
            if "decoded" in msg:
                assert to_canonical(batch) == _normalised(msg["decoded"]), vec["name"]


def test_replay_frames_vectors(vectors: dict[str, list[dict]]) -> None:
    versions = set()
    for vec in vectors["zmq_frames"]:
        versions.add(vec["sglang_version"])
        assert replay_request(1) == _hx(vec["replay_request_dealer_frames_hex"])
        new_layout = vec["sglang_version"] in ("0.5.22", "0.5.23")
        *replies, end = [_hx(r) for r in vec["replay_reply_dealer_frames_hex"]]
        assert replies
        for frames in replies:
            assert frames[0] == b""  # DEALER view: empty delimiter first
            topic, seq, payload = parse_replay_reply(frames[1:])
            assert topic == ("kv" if new_layout else None), vec["name"]
            assert seq == 1
            ev = decode_batch(payload).events[0]
            assert ev.block_hashes == [5674439469042975057], vec["name"]
            assert replay_reply_frames(topic, seq, payload) == frames, vec["name"]
        assert parse_replay_reply(end[1:]) is None, vec["name"]
        assert replay_reply_frames("" if new_layout else None, END_SEQ, b"") == end, vec["name"]
    assert versions == {"0.5.5", "0.5.20", "0.5.23"}


def test_framing_errors() -> None:
    with pytest.raises(WireError, match="3 frames, got 2"):
        parse_live_message([b"kv", b"\x00" * 8])
    with pytest.raises(WireError, match="8 bytes, got 7"):
        parse_live_message([b"kv", b"\x00" * 7, b""])
    with pytest.raises(WireError, match="8 bytes, got 9"):
        parse_live_message([b"kv", b"\x00" * 9, b""])
    with pytest.raises(WireError, match="not UTF-8"):
        parse_live_message([b"\xff\xfe", b"\x00" * 8, b""])
    with pytest.raises(WireError, match="got 4"):
        parse_replay_reply([b"", b"kv", b"\x00" * 8, b""])
    with pytest.raises(WireError, match="got 1"):
        parse_replay_reply([b"\x00" * 8])
    with pytest.raises(WireError, match="8 bytes, got 3"):
        parse_replay_reply([b"abc", b""])
    with pytest.raises(WireError):
        replay_request(-5)
    with pytest.raises(WireError):
        live_frames("kv", 2**64, b"")


def test_seq_is_unsigned_big_endian() -> None:
    frames = live_frames("", 2**64 - 2, b"p")
    assert frames == [b"", b"\xff" * 7 + b"\xfe", b"p"]
    assert parse_live_message(frames) == ("", 2**64 - 2, b"p")
    assert parse_replay_reply([b"\x00" * 7 + b"\x05", b"x"]) == (None, 5, b"x")
    assert replay_request(0) == [b"", b"\x00" * 8]


# --------------------------------------------------------------------------------------
# the real SGLang 0.5.23 capture
# --------------------------------------------------------------------------------------


def _fixture_payloads(fixture_dir: Path) -> list[bytes]:
    lines = (fixture_dir / "events.jsonl").read_text().splitlines()
    return [base64.b64decode(json.loads(line)["payload_b64"]) for line in lines if line]


def test_real_capture_decodes_and_reencodes_byte_identical(fixture_dir: Path) -> None:
    payloads = _fixture_payloads(fixture_dir)
    assert len(payloads) > 100
    kinds: set[type] = set()
    for p in payloads:
        batch = decode_batch(p)
        assert count_unknown(batch) == 0
        kinds.update(type(e) for e in batch.events)
        assert encode_batch(batch, "0.5.23") == p
        assert encode_batch(batch_from_canonical(to_canonical(batch)), "0.5.23") == p
    assert kinds == {BlockStored, BlockRemoved, AllBlocksCleared}


def test_real_capture_hashes_recompute_along_the_chain(fixture_dir: Path) -> None:
    """Every BlockStored of the real capture: its hashes are the chained page hashes of its
    token_ids, continued from its parent's digest (which an earlier store published)."""
    digest_of: dict[int, bytes] = {}
    checked = 0
    for p in _fixture_payloads(fixture_dir):
        for ev in decode_batch(p).events:
            if type(ev) is not BlockStored:
                continue
            parent = None if ev.parent_block_hash is None else digest_of[ev.parent_block_hash]
            digests = block_digests(ev.token_ids, ev.block_size, parent_digest=parent)
            assert [digest_to_int64(d) for d in digests] == ev.block_hashes
            assert (
                block_hashes(ev.token_ids, ev.block_size, parent_digest=parent) == ev.block_hashes
            )
            digest_of.update(zip(ev.block_hashes, digests, strict=True))
            checked += 1
    assert checked > 100


def test_public_api_matches_architecture() -> None:
    for name in (
        "decode_batch encode_batch to_canonical batch_from_canonical norm_hash u64 block_hashes "
        "block_digests page_digest digest_to_int64 cache_salt_seed namespace_seed "
        "namespaced_block_hash parse_live_message parse_replay_reply live_frames "
        "replay_request replay_reply_frames END_SEQ"
    ).split():
        assert name in wire.__all__ and hasattr(wire, name)
    assert END_SEQ == -1


def _plain_chain(tokens, page_size: int, prior: bytes = b"") -> list[bytes]:
    """Independent reference: one hashlib call per full page, narrow or wide words."""
    import hashlib

    out = []
    for start in range(0, len(tokens) - page_size + 1, page_size):
        page = tokens[start : start + page_size]
        if any(t >= 2**32 for t in page):
            data = b"\xff" + b"".join(t.to_bytes(8, "little") for t in page)
        else:
            data = b"".join(t.to_bytes(4, "little") for t in page)
        prior = hashlib.sha256(prior + data).digest()
        out.append(prior)
    return out


@pytest.mark.parametrize("page_size", [1, 2, 5, 6, 8, 16, 64])
def test_every_fast_path_matches_a_plain_chain(page_size: int) -> None:
    # page sizes on both sides of the one-SHA-block boundary (32 + 4 * page <= 55 bytes),
    # root / parent / salt priors, list and tuple input, a trailing partial page, and a wide
    # token late in the stream (the fast path must restart from the prior, not mid-chain)
    import random

    rng = random.Random(page_size)
    toks = [rng.randrange(0, 2**32) for _ in range(page_size * 9 + page_size // 2)]
    parent = _plain_chain([7] * page_size, page_size)[0]
    salt_seed = cache_salt_seed("s")
    wide = toks[: page_size * 6] + [2**32 + 1] + toks[page_size * 6 + 1 :]
    for tokens in (toks, tuple(toks), wide, toks[:page_size], toks[: page_size - 1]):
        for kw, prior in (
            ({}, b""),
            ({"parent_digest": parent}, parent),
            ({"parent_digest": bytearray(parent)}, parent),
            ({"cache_salt": "s"}, salt_seed),
        ):
            want = _plain_chain(list(tokens), page_size, prior)
            assert block_digests(tokens, page_size, **kw) == want, (page_size, kw)
            assert block_hashes(tokens, page_size, **kw) == [digest_to_int64(d) for d in want]
            prev = prior or None
            for i, d in enumerate(want):
                prev = page_digest(prev, tokens[i * page_size : (i + 1) * page_size])
                assert prev == d


def test_invalid_token_late_in_a_fast_path_raises() -> None:
    for page_size in (1, 4, 16):
        toks = list(range(page_size * 5))
        toks[-2] = -1
        with pytest.raises(WireError, match="non-negative int64"):
            block_digests(toks, page_size)
        toks[-2] = "7"
        with pytest.raises(WireError, match="not an integer"):
            block_hashes(toks, page_size, parent_digest=b"\x01" * 32)


def test_joined_digests_to_int64_refuses_a_partial_digest() -> None:
    d = block_digests([1, 2, 3], 1)
    assert joined_digests_to_int64(b"".join(d)).tolist() == block_hashes([1, 2, 3], 1)
    with pytest.raises(WireError):
        joined_digests_to_int64(b"".join(d)[:-8])
