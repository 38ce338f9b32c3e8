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
``decode_batch_raw_fast`` is ``decode_batch_raw``'s typed fast path alone (None where it does
not apply), for a caller that pays for the full call only on the payloads it refuses.
``tokens_ok`` is ``decode_batch``'s rule for one raw ``token_ids`` array (ints, or
``[int, int]`` pairs), for a caller that checks them itself (``check_tokens=False``).

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

The package's public face: import from ``kvcadence.format.wire``. Inside: ``decode``
(decoding, views), ``encode`` (versions, encoding, canonical form) and ``framing`` (ZMQ
frames); the hash functions live in ``kvcadence.format.hashes``.
"""

from __future__ import annotations

from kvcadence.errors import WireError
from kvcadence.format.hashes import (
    block_digests,
    block_hashes,
    cache_salt_seed,
    digest_to_int64,
    joined_digests_to_int64,
    namespace_seed,
    namespaced_block_hash,
    norm_hash,
    page_digest,
    root_chains,
    u64,
)
from kvcadence.format.wire.decode import (
    count_unknown,
    decode_batch,
    decode_batch_raw,
    decode_batch_raw_fast,
    decode_batch_view,
    tokens_ok,
)
from kvcadence.format.wire.encode import (
    DEFAULT_VERSION,
    FAMILY_ARRAY,
    FAMILY_ARRAY05,
    FAMILY_MAP,
    FAMILY_MAP20,
    SUPPORTED_VERSIONS,
    VERSION_FAMILY,
    batch_from_canonical,
    encode_batch,
    to_canonical,
    version_family,
)
from kvcadence.format.wire.framing import (
    END_SEQ,
    live_frames,
    parse_live_message,
    parse_replay_reply,
    parse_replay_request,
    replay_reply_frames,
    replay_request,
)

__all__ = [
    "FAMILY_ARRAY",
    "FAMILY_ARRAY05",
    "FAMILY_MAP",
    "FAMILY_MAP20",
    "WireError",
    "SUPPORTED_VERSIONS",
    "DEFAULT_VERSION",
    "VERSION_FAMILY",
    "version_family",
    "decode_batch",
    "decode_batch_view",
    "decode_batch_raw",
    "decode_batch_raw_fast",
    "tokens_ok",
    "encode_batch",
    "count_unknown",
    "to_canonical",
    "batch_from_canonical",
    "norm_hash",
    "u64",
    "block_hashes",
    "block_digests",
    "root_chains",
    "page_digest",
    "digest_to_int64",
    "joined_digests_to_int64",
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
