"""SGLang block hashes (0.5.10+): the chained per-page SHA-256 and its event int64 form.

Owns the hash half of ``kvcadence.format.wire`` (which re-exports everything here; import it
from there). Algorithm, from ``srt/mem_cache/utils.py`` / ``cpp_utils/hash_binding.cpp``:

* page *i*: ``digest_i = sha256(digest_{i-1} || page words)``; no prior digest for the first
  page of a root chain; each token is a **uint32 little-endian** word;
* a page holding any token >= 2**32 is hashed "wide": ``prior || 0xff || tokens as uint64 LE``;
  tokens must be non-negative int64 (anything else raises ``WireError``);
* bigram (EAGLE) keys -- tokens given as ``[t, t+1]`` pairs -- hash both words of every pair;
* only full pages are hashed (a trailing partial page is never inserted, never published);
* the event value is ``hash_str_to_int64``: first 8 digest bytes, big-endian, two's complement;
* ``cache_salt`` seeds the chain with ``sha256(b"sglang-cache-salt-v1\\0" + salt)`` (SGLang
  tests ``cache_salt is not None``, so ``""`` is a salt of its own here too);
* LoRA / dynamo namespacing post-maps finished hashes (``namespace_seed`` /
  ``namespaced_block_hash``).

0.5.5 used Python's process-seeded ``hash(tuple(page))``; those hashes cannot be recomputed.
"""

from __future__ import annotations

import importlib
import operator
import struct
import sys
from array import array
from collections.abc import Callable, Sequence
from hashlib import sha256
from typing import Any

from kvcadence.errors import WireError

I64_MIN = -(1 << 63)
I64_MAX = (1 << 63) - 1
U64_MAX = (1 << 64) - 1
_TWO64 = 1 << 64

_SALT_PREFIX = b"sglang-cache-salt-v1\x00"
_NAMESPACE_PREFIX = b"sglang-kv-event-namespace-v1"

_be_i64: Callable[..., tuple[int]] = struct.Struct(">q").unpack_from
_WIDE_MARK = b"\xff"
_PACK_U32 = struct.Struct("<I").pack
#: ``prior digest || one uint32 LE token`` in one call (page size 1, chained pages)
_PACK_PRIOR_U32 = struct.Struct("<32sI").pack

# array typecode with 4-byte unsigned items (``I`` everywhere that matters; ``L`` as a guard)
_U32_CODE = "I" if array("I").itemsize == 4 else "L"
_LITTLE = sys.byteorder == "little"
_SWAP = not _LITTLE

_pack_cache: dict[int, struct.Struct] = {}
_pages_cache: dict[int, struct.Struct] = {}

#: SHA-256 inputs up to this many bytes fit one compression block (64 - 1 - 8)
_ONE_BLOCK = 55


def _small_sha256() -> Callable[[bytes], Any]:  # a hashlib-style constructor
    """CPython's own (HACL*/libtomcrypt) SHA-256: for one-block inputs its per-call cost is
    lower than OpenSSL's EVP setup (~30 ns of ~330 per page-size-1 page); OpenSSL's SHA-NI
    wins from the second block. Known-answer checked; ``hashlib.sha256`` when absent."""
    for name in ("_sha2", "_sha256"):  # 3.12+, <= 3.11
        try:
            ctor: Callable[[bytes], Any] = importlib.import_module(name).sha256
        except (ImportError, AttributeError):
            continue
        try:
            if ctor(b"abc" * 12).digest() == sha256(b"abc" * 12).digest():
                return ctor
        except Exception:  # noqa: BLE001 - any failure: use hashlib
            continue
    return sha256


_sha256_small = _small_sha256()


def norm_hash(h: int) -> int:
    """Signed int64 form of a 64-bit hash (``2**64 - 1`` -> ``-1``); SGLang's own form."""
    if h > I64_MAX:
        if h > U64_MAX:
            raise WireError(f"hash {h} does not fit in 64 bits")
        return h - _TWO64
    if h < I64_MIN:
        raise WireError(f"hash {h} does not fit in 64 bits")
    return h


def u64(h: int) -> int:
    """Unsigned form of a 64-bit hash (what Parquet ``UInt64`` columns store)."""
    return norm_hash(h) & U64_MAX


def digest_to_int64(digest: bytes) -> int:
    """SGLang's ``hash_str_to_int64``: the first 8 digest bytes, big-endian, signed."""
    if len(digest) < 8:
        raise WireError(f"digest has {len(digest)} bytes, need at least 8")
    return _be_i64(digest)[0]


def _digests_to_int64(digests: list[bytes]) -> list[int]:
    """``digest_to_int64`` of many 32-byte digests at once (one C pass, no per-page call)."""
    if len(digests) < 4:
        be = _be_i64
        return [be(d)[0] for d in digests]
    return joined_digests_to_int64(b"".join(digests)).tolist()


def joined_digests_to_int64(joined: bytes) -> array[int]:
    """``digest_to_int64`` of every 32-byte digest in ``joined`` (digests back to back), as
    an ``array('q')``: one C pass, and no int object per page (an array is 8 bytes a hash,
    and the cyclic GC never walks its items)."""
    if len(joined) % 32:
        raise WireError(f"joined digests have {len(joined)} bytes, not a multiple of 32")
    words = array("q", joined)[::4]  # each digest's first 8 bytes
    if _LITTLE:
        words.byteswap()
    return words


def cache_salt_seed(salt: str) -> bytes:
    """The prior digest that starts a salted chain: ``sha256(b"sglang-cache-salt-v1\\0" + salt)``."""
    return sha256(_SALT_PREFIX + salt.encode("utf-8")).digest()


def _u32_struct(n: int) -> struct.Struct:
    s = _pack_cache.get(n)
    if s is None:
        s = _pack_cache[n] = struct.Struct(f"<{n}I")
    return s


def _pages_struct(step: int) -> struct.Struct:
    """``{step}s``: ``iter_unpack`` cuts a packed buffer into pages in C."""
    s = _pages_cache.get(step)
    if s is None:
        s = _pages_cache[step] = struct.Struct(f"{step}s")
    return s


def _flatten_pairs(page: Sequence[Any]) -> list[int]:
    words: list[int] = []
    for item in page:
        if isinstance(item, (list, tuple)):
            words.extend(item)
        else:
            words.append(item)
    return words


def _page_words(page: Sequence[Any]) -> bytes:
    """The bytes SGLang hashes for one page (after the prior digest)."""
    if page and isinstance(page[0], (list, tuple)):
        page = _flatten_pairs(page)
    try:
        return _u32_struct(len(page)).pack(*page)
    except struct.error:
        pass
    words = []
    for t in page:
        try:
            t = operator.index(t)
        except TypeError:
            raise WireError(f"token id {t!r} is not an integer") from None
        if t < 0 or t > I64_MAX:
            raise WireError(f"token id {t} is not a non-negative int64")
        words.append(t)
    return _WIDE_MARK + struct.pack(f"<{len(words)}Q", *words)


def page_digest(prev_digest: bytes | None, page_tokens: Sequence[Any]) -> bytes:
    """``sha256(prev_digest || page words)``: one page's 32-byte digest (prev None = root)."""
    try:  # plain uint32 tokens: one C call packs and validates the page
        words = _u32_struct(len(page_tokens)).pack(*page_tokens)
    except struct.error:  # bigram pairs, wide or invalid tokens
        words = _page_words(page_tokens)
    if prev_digest:
        if type(prev_digest) is not bytes:
            prev_digest = bytes(prev_digest)
        words = prev_digest + words
    return (_sha256_small if len(words) <= _ONE_BLOCK else sha256)(words).digest()


def _prior(cache_salt: str | None, parent_digest: bytes | None) -> bytes:
    if parent_digest is not None:
        prior = bytes(parent_digest)
        if len(prior) != 32:
            raise WireError(f"parent digest has {len(prior)} bytes, expected 32")
        return prior
    if cache_salt is not None:
        return cache_salt_seed(cache_salt)
    return b""


def _check_page_size(page_size: int) -> None:
    if type(page_size) is not int or page_size < 1:
        raise WireError(f"page size must be a positive integer, got {page_size!r}")


def _chain(prev: bytes, token_ids: Sequence[Any], page_size: int) -> list[bytes]:
    """The digest chain over the full pages of ``token_ids`` from ``prev`` (b"" = root).

    The fast paths validate every token once, in C, as a side effect of packing it (uint32
    struct/array packing refuses negatives, >= 2**32, non-integers and bigram pairs); any
    refusal drops the whole call to the per-page path, which hashes wide pages and raises
    ``WireError`` for invalid tokens.
    """
    n = len(token_ids)
    n_tok = n - n % page_size
    if n_tok == 0:
        return []
    root = prev  # the comprehensions below rebind ``prev``
    if page_size == 1:
        sha = _sha256_small  # 36-byte inputs: one block
        try:
            if prev:
                pack = _PACK_PRIOR_U32
                return [prev := sha(pack(prev, t)).digest() for t in token_ids]  # noqa: F841
            it = iter(token_ids)
            prev = sha(_PACK_U32(next(it))).digest()
            out = [prev]
            if n > 1:
                pack = _PACK_PRIOR_U32
                out += [prev := sha(pack(prev, t)).digest() for t in it]
            return out
        except struct.error:
            pass
    else:
        buf = None
        if not (token_ids and isinstance(token_ids[0], (list, tuple))):
            try:
                arr = array(_U32_CODE, token_ids if n_tok == n else token_ids[:n_tok])
            except (OverflowError, TypeError):
                pass
            else:
                if _SWAP:
                    arr.byteswap()
                buf = arr.tobytes()
        if buf is not None:
            step = 4 * page_size
            sha = _sha256_small if 32 + step <= _ONE_BLOCK else sha256
            pages = _pages_struct(step).iter_unpack(buf)
            return [prev := sha(prev + page).digest() for (page,) in pages]  # noqa: F841
    out = []
    prev = root
    for start in range(0, n_tok, page_size):
        prev = sha256(prev + _page_words(token_ids[start : start + page_size])).digest()
        out.append(prev)
    return out


def block_digests(
    token_ids: Sequence[Any],
    page_size: int,
    cache_salt: str | None = None,
    parent_digest: bytes | None = None,
) -> list[bytes]:
    """The 32-byte digest of every full page of ``token_ids`` (chained from ``parent_digest``,
    else from the ``cache_salt`` seed, else from the root)."""
    _check_page_size(page_size)
    return _chain(_prior(cache_salt, parent_digest), token_ids, page_size)


def root_chains(words: bytes, page_size: int, first: Sequence[int]) -> list[bytes]:
    """The digests of many root chains of plain tokens packed back to back, in one pass:
    ``words`` holds whole pages of uint32 little-endian words (``4 * page_size`` bytes a page),
    ``first[i]`` is true where page ``i`` starts a chain (hashed from the root). Chain by
    chain the same digests as ``block_digests`` (no per-chain call: many short chains cost one
    hash call a page)."""
    _check_page_size(page_size)
    step = 4 * page_size
    sha = _sha256_small if 32 + step <= _ONE_BLOCK else sha256
    pages = _pages_struct(step).iter_unpack(words)
    prev = b""
    return [
        prev := sha(page if f else prev + page).digest()  # noqa: F841
        for (page,), f in zip(pages, first, strict=True)
    ]


def block_hashes(
    token_ids: Sequence[Any],
    page_size: int,
    cache_salt: str | None = None,
    parent_digest: bytes | None = None,
) -> list[int]:
    """SGLang's event hashes (signed int64) of every full page of ``token_ids``.

    Chains from ``parent_digest`` (the 32-byte digest of the parent's last page) when given,
    else from ``cache_salt_seed(cache_salt)`` when a salt is given, else from the root.
    """
    _check_page_size(page_size)
    return _digests_to_int64(_chain(_prior(cache_salt, parent_digest), token_ids, page_size))


def _part(value: str | None) -> bytes:
    if value is None:
        return b"\x00"
    raw = value.encode("utf-8")
    return b"\x01" + len(raw).to_bytes(8, "little") + raw


def namespace_seed(extra_key: str | None, cache_salt: str | None) -> bytes | None:
    """``kv_event_namespace_seed``: ``sha256(b"sglang-kv-event-namespace-v1" + part(extra_key)
    + part(cache_salt))``; None (no mapping) when both are None."""
    if extra_key is None and cache_salt is None:
        return None
    return sha256(_NAMESPACE_PREFIX + _part(extra_key) + _part(cache_salt)).digest()


def namespaced_block_hash(h: int, seed: bytes | None) -> int:
    """Post-map one event hash into a namespace: ``int64_be(sha256(seed + h_be8)[:8])``.

    ``seed=None`` means no namespace: the hash comes back unchanged (as signed int64).
    """
    h = norm_hash(h)
    if seed is None:
        return h
    return _be_i64(sha256(bytes(seed) + h.to_bytes(8, "big", signed=True)).digest())[0]


__all__ = [
    "I64_MIN",
    "I64_MAX",
    "U64_MAX",
    "norm_hash",
    "u64",
    "digest_to_int64",
    "cache_salt_seed",
    "page_digest",
    "block_digests",
    "root_chains",
    "block_hashes",
    "namespace_seed",
    "namespaced_block_hash",
]
