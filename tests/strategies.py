"""Shared hypothesis strategies: token lists, 64-bit hashes, canonical KV events and batches.

Import from any test (``from tests.strategies import canonical_batches``). Every strategy
builds the canonical structs of ``kvcadence.format.schema``; ``family`` restricts the fields
to what one SGLang wire family carries, so ``decode(encode(b, version)) == b`` holds for it:

* ``"map"`` (0.5.22/0.5.23): every field;
* ``"map20"`` (0.5.20): no ``lora_name``;
* ``"array"`` (0.5.10-0.5.17): no ``cache_salt``/``session_id``/``lora_name``;
* ``"array05"`` (0.5.5): additionally no ``medium``.
"""

from __future__ import annotations

from hypothesis import strategies as st

from kvcadence.format.schema import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEventBatch,
)

I64_MIN = -(1 << 63)
I64_MAX = (1 << 63) - 1

FAMILIES = ("map", "map20", "array", "array05")
#: one representative SGLang release per wire family
FAMILY_VERSION = {"map": "0.5.23", "map20": "0.5.20", "array": "0.5.14", "array05": "0.5.5"}

MEDIA = ("GPU", "CPU_PINNED", "DISK", "EXTERNAL")


def hashes64() -> st.SearchStrategy[int]:
    """Signed int64 block hashes, biased towards the msgpack integer-form boundaries."""
    edges = st.sampled_from(
        [0, 1, 127, 128, -1, -32, -33, 255, 65535, 65536, 2**32 - 1, 2**32, -(2**31) - 1]
        + [I64_MIN, I64_MAX]
    )
    return st.one_of(edges, st.integers(I64_MIN, I64_MAX))


def u64_hashes() -> st.SearchStrategy[int]:
    """Any 64-bit hash in either form: signed int64 or unsigned uint64 (vLLM-style)."""
    return st.integers(I64_MIN, (1 << 64) - 1)


def token_ids(min_size: int = 0, max_size: int = 64, wide: bool = False) -> st.SearchStrategy:
    """Token id lists: mostly vocabulary-sized, with uint32 edges; ``wide`` adds ids >= 2**32."""
    small = st.integers(0, 200_000)
    edge = st.sampled_from([0, 2**32 - 1, 2**31])
    elems = st.one_of(small, edge)
    if wide:
        elems = st.one_of(small, edge, st.integers(2**32, I64_MAX))
    return st.lists(elems, min_size=min_size, max_size=max_size)


_opt_text = st.one_of(st.none(), st.text(max_size=12))


@st.composite
def block_stored(draw, family: str = "map") -> BlockStored:
    """A ``BlockStored`` carrying only the fields ``family`` can put on the wire."""
    block_size = draw(st.integers(1, 4))
    n_pages = draw(st.integers(0, 8))
    tokens = draw(token_ids(n_pages * block_size, n_pages * block_size))
    medium = None if family == "array05" else draw(st.one_of(st.none(), st.sampled_from(MEDIA)))
    maps = family in ("map", "map20")
    return BlockStored(
        block_hashes=draw(st.lists(hashes64(), min_size=n_pages, max_size=n_pages)),
        parent_block_hash=draw(st.one_of(st.none(), hashes64())),
        token_ids=tokens,
        block_size=block_size,
        lora_id=draw(st.one_of(st.none(), st.integers(0, 1000))),
        medium=medium,
        cache_salt=draw(_opt_text) if maps else None,
        session_id=draw(_opt_text) if maps else None,
        lora_name=draw(_opt_text) if family == "map" else None,
    )


@st.composite
def block_removed(draw, family: str = "map") -> BlockRemoved:
    """A ``BlockRemoved`` (no ``medium`` for 0.5.5)."""
    medium = None if family == "array05" else draw(st.one_of(st.none(), st.sampled_from(MEDIA)))
    return BlockRemoved(block_hashes=draw(st.lists(hashes64(), max_size=16)), medium=medium)


def events(family: str = "map") -> st.SearchStrategy:
    """Any known canonical event of ``family``."""
    return st.one_of(block_stored(family), block_removed(family), st.just(AllBlocksCleared()))


@st.composite
def canonical_batches(draw, family: str = "map", max_events: int = 6) -> KVEventBatch:
    """A canonical ``KVEventBatch`` (finite ts, rank None or small int)."""
    ts = draw(st.floats(allow_nan=False, allow_infinity=False, width=64))
    evs = draw(st.lists(events(family), max_size=max_events))
    rank = draw(st.one_of(st.none(), st.integers(0, 64)))
    return KVEventBatch(ts=ts, events=evs, attn_dp_rank=rank)


@st.composite
def family_batches(draw, max_events: int = 6) -> tuple[str, KVEventBatch]:
    """``(version, batch)`` for a random wire family."""
    family = draw(st.sampled_from(FAMILIES))
    return FAMILY_VERSION[family], draw(canonical_batches(family, max_events))


__all__ = [
    "FAMILIES",
    "FAMILY_VERSION",
    "hashes64",
    "u64_hashes",
    "token_ids",
    "block_stored",
    "block_removed",
    "events",
    "canonical_batches",
    "family_batches",
]
