"""Vectorised msgpack int arrays -> numpy: the requests' token ids without Python ints.

Ingest reads ``RequestRecord.input_ids``/``output_ids`` as ``msgspec.Raw`` (through
``BundleReader.records(request_view=True)``, the bundle module's view decoder) and hands the
raw msgpack arrays here in chunks. ``int_arrays`` turns a chunk into one flat ``int64`` numpy
array plus per-array lengths, in numpy passes instead of one Python int per token:

1. the array headers (fixarray / array16 / array32) give each array's element count;
2. the element start offsets are found one element index ``k`` at a time for all arrays at
   once (arrays sorted longest first, so the arrays still going at ``k`` are a prefix): the
   next start is ``start + width(type byte)``. Arrays longer than what is worth a numpy call
   per element (the few longest, see ``_MIN_ACTIVE``) are decoded by msgspec instead;
3. every element's value is read in one pass: 8 big-endian bytes at the start (fixints) or
   just after the type byte, shifted right to the element's width and sign-extended for
   the signed encodings (a branch-free ``(x ^ m) - m``).

Every msgpack int encoding is handled: positive/negative fixint, uint8/16/32/64, int8..64.
Anything else -- an element that is not an int, a value above the int64 range (uint64
>= 2**63), a Raw that is not an array -- raises ``NotInt64Arrays``: the caller then reads the
records the ordinary way (msgspec ``list[int]``), so its behaviour on such bundles is exactly
that of the ordinary path. The answer always equals ``msgspec`` decoding each array as
``list[int]`` (property-tested in ``tests/analysis/test_tokcols.py``).

Format 2.0 bundles store requests packed (uint32 ids): ingest reads those with
``records(request_view="u32")`` and gets the reader's ``array('I')`` per request, which
``id_arrays`` turns into the same columns with one join and one cast.

Ingest uses the same conversion for the KV events' block hashes (``wire.decode_batch_raw``
leaves them as msgpack bytes) with ``wrap_u64=True`` (a uint64 >= 2**63 is the int64 of the
same bits, as ``wire`` normalises hashes); arrays whose elements are all 9-byte ints (random
64-bit hashes) skip step 2. ``array_lengths`` reads only the headers (stored events' token
counts).
"""

from __future__ import annotations

from array import array
from collections.abc import Sequence
from typing import Any

from kvcadence.format.bundle.compact import msgpack_uint_array
from kvcadence.format.wire import tokens_ok

# Below this many arrays still running at element index k, the per-k numpy calls cost more
# than msgspec decoding the remaining (longest) arrays whole.
_MIN_ACTIVE = 64
_I64_MAX = (1 << 63) - 1
_TWO64 = 1 << 64
_PAD = 16  # zero bytes after the joined arrays: 8-byte reads past the last element stay inside
_PADDING = bytes(_PAD)


class NotInt64Arrays(ValueError):
    """A raw value is not a msgpack array of ints that fit in int64."""


_TABLES: tuple[Any, ...] | None = None


def _tables() -> tuple[Any, ...]:
    """Per type byte: width, skip (bytes before the value), shift, sign mask, class."""
    global _TABLES
    if _TABLES is None:
        import numpy as np

        width = np.zeros(256, np.int64)  # 0 = not an int: the walk stops on it
        skip = np.ones(256, np.uint8)
        shift = np.zeros(256, np.uint8)
        sign = np.zeros(256, np.uint64)
        # 0 not an int, 1 non-negative (no sign extension), 2 uint64 (range-checked),
        # 3 signed encodings and negative fixints (sign-extended)
        klass = np.zeros(256, np.uint8)
        fix = [*range(0x00, 0x80), *range(0xE0, 0x100)]
        width[fix] = 1
        skip[fix] = 0
        shift[fix] = 56
        sign[fix] = 1 << 7  # a fixint read as a signed byte is its value
        klass[0x00:0x80] = 1
        klass[0xE0:0x100] = 3
        for t, n, signed in (
            (0xCC, 1, False),
            (0xCD, 2, False),
            (0xCE, 4, False),
            (0xCF, 8, False),
            (0xD0, 1, True),
            (0xD1, 2, True),
            (0xD2, 4, True),
            (0xD3, 8, True),
        ):
            width[t] = n + 1
            shift[t] = 64 - 8 * n
            sign[t] = (1 << (8 * n - 1)) if signed else 0
            klass[t] = 3 if signed else 2 if t == 0xCF else 1
        _TABLES = (width, skip, shift, sign, klass)
    return _TABLES


def _headers(buf: Any, st: Any) -> tuple[Any, Any]:
    """Element counts and header sizes of the msgpack arrays starting at offsets ``st`` of
    ``buf`` (uint8, padded); raises ``NotInt64Arrays`` where a value is not an array."""
    import numpy as np

    m = len(st)
    b0 = buf[st]
    n = (b0 & 0x0F).astype(np.int64)
    h = np.ones(m, np.int64)
    fixarr = (b0 & 0xF0) == 0x90
    if not fixarr.all():
        a16 = b0 == 0xDC
        a32 = b0 == 0xDD
        if not (fixarr | a16 | a32).all():
            raise NotInt64Arrays("not a msgpack array")
        s = st[a16]
        n[a16] = (buf[s + 1].astype(np.int64) << 8) | buf[s + 2]
        h[a16] = 3
        s = st[a32]
        n[a32] = (
            (buf[s + 1].astype(np.int64) << 24)
            | (buf[s + 2].astype(np.int64) << 16)
            | (buf[s + 3].astype(np.int64) << 8)
            | buf[s + 4]
        )
        h[a32] = 5
    return n, h


def _joined(raws: Sequence[Any]) -> tuple[int, Any, Any, Any]:
    """(bytes of the raws, the raws joined + ``_PAD`` zero bytes as uint8, their start offsets,
    their byte lengths). One join, padding included: a second multi-MB copy to append the
    padding cost ~4x the join itself (fresh memory, measured on 16k-array chunks)."""
    import numpy as np

    m = len(raws)
    buf = np.frombuffer(b"".join([*raws, _PADDING]), np.uint8)
    lens = np.fromiter(map(len, raws), np.int64, m)
    st = np.zeros(m, np.int64)
    np.cumsum(lens[:-1], out=st[1:])
    if int(lens.min()) < 1:
        raise NotInt64Arrays("empty raw value")
    return len(buf) - _PAD, buf, st, lens


def array_lengths(raws: Sequence[Any]) -> Any:
    """Element counts (int64 numpy) of ``raws``, bytes-like msgpack arrays, read from their
    headers only (a bigram ``[t, t+1]`` element counts as one); raises ``NotInt64Arrays``
    where a raw value is not an array. The elements are not looked at."""
    import numpy as np

    if not len(raws):
        return np.zeros(0, np.int64)
    _, buf, st, _ = _joined(raws)
    return _headers(buf, st)[0]


def _all_wide(buf: Any, first: Any, body: Any, n: Any, off: Any) -> Any:
    """Element starts when every element is a 9-byte int (int64 / uint64: what random 64-bit
    hashes encode as), else None. Elements are at most 9 bytes, so bodies of exactly 9 bytes
    per element can only be that; the type byte at every 9-byte stride is then checked, which
    makes the walk exact by induction (element k starts at 9k iff elements < k are 9 wide)."""
    import numpy as np

    if not np.array_equal(body, 9 * n):
        return None
    total = int(off[-1])
    starts = np.repeat(first - 9 * off[:-1], n)
    starts += 9 * np.arange(total, dtype=np.int64)
    t = buf[starts]
    if not ((t == 0xCF) | (t == 0xD3)).all():
        return None  # not all 9-byte ints: the general walk decides
    return starts


def _values(buf: Any, starts: Any, wrap_u64: bool) -> Any:
    """The int64 values of the ints starting at ``starts`` (step 3 of ``int_arrays``)."""
    import numpy as np

    width, skip, shift, sign, klass = _tables()
    t = buf[starts]
    cls = klass[t]
    if int(cls.min()) == 0:
        raise NotInt64Arrays("element is not an int")
    # 8 bytes at every value start (unaligned), big-endian: read native, then byte-swap
    at = np.ndarray((len(buf) - 8,), dtype=np.uint64, buffer=buf, strides=(1,))
    x = at[starts + skip[t]]
    if np.little_endian:
        x.byteswap(inplace=True)
    x >>= shift[t]
    worst = int(cls.max())
    if worst == 3:  # some signed encoding: sign-extend (a no-op where the mask is 0)
        msk = sign[t]
        x ^= msk
        x -= msk
    vals = x.view(np.int64)
    if worst >= 2 and not wrap_u64 and (vals[cls == 2] < 0).any():
        raise NotInt64Arrays("int above the int64 range")
    return vals


def _walk(buf: Any, ns: Any, pos: Any, starts: Any = None, dst: Any = None) -> tuple[int, int]:
    """Step 2 of ``int_arrays``: advance ``pos`` (the element starts of arrays sorted longest
    first, ``ns`` their element counts) one element index ``k`` at a time over the arrays
    still running, while at least ``_MIN_ACTIVE`` are; with ``starts``/``dst``, record every
    element's start at ``starts[dst]`` (``dst`` advanced in place). An element that is not an
    int has width 0: its array's position stops there. Returns ``(k, tail)``: the walk
    stopped at element index ``k``, the first ``tail`` arrays not walked to their end."""
    import numpy as np

    width = _tables()[0]
    active = len(ns) - np.cumsum(np.bincount(ns))  # active[k]: arrays with more than k elements
    k = 0
    kmax = int(ns[0]) if len(ns) else 0
    # the arrays' own methods: np.take / np.put add a Python-level wrapper call each
    wtake, btake = width.take, buf.take
    put = starts.put if starts is not None else None
    while k < kmax:
        a = int(active[k])
        if a < _MIN_ACTIVE:
            break
        p = pos[:a]
        if put is not None:
            d = dst[:a]
            put(d, p)
            d += 1
        p += wtake(btake(p))
        k += 1
    return k, int(active[k]) if len(ns) else 0


def token_counts(raws: Sequence[Any]) -> Any:
    """Element counts (int64 numpy) of stored events' raw ``token_ids`` arrays, checked as
    ``decode_batch`` checks them (ints, or ``[int, int]`` pairs, which count as one):
    ``int_arrays``' element walk without reading any value, for every array whose elements
    are all ints; the few longest arrays and any the walk stopped in (a pair, or not a token)
    get ``wire.tokens_ok``. Raises ``NotInt64Arrays`` where a raw value is not an array or
    not valid token ids (the caller then has the payload decoded the checked way)."""
    import numpy as np

    if not len(raws):
        return np.zeros(0, np.int64)
    _, buf, st, lens = _joined(raws)
    n, h = _headers(buf, st)
    order = np.argsort(-n, kind="stable")
    pos = (st + h)[order]
    ends = (st + lens)[order]
    _, n_tail = _walk(buf, n[order], pos)
    stopped = np.flatnonzero(pos[n_tail:] != ends[n_tail:]) + n_tail
    for i in (*order[:n_tail].tolist(), *order[stopped].tolist()):
        if not tokens_ok(raws[i]):
            raise NotInt64Arrays("token ids that are not ints or [int, int] pairs")
    return n


def int_arrays(raws: Sequence[Any], *, wrap_u64: bool = False) -> tuple[Any, Any]:
    """``raws`` (bytes-like msgpack arrays of ints) -> (flat int64 values, int64 lengths).

    Equal to ``np.concatenate([msgspec.msgpack.decode(r, type=list[int]) for r in raws])``
    and ``[len(...) for ...]``; raises ``NotInt64Arrays`` where that would fail or an int is
    outside int64. ``wrap_u64``: a uint64 value >= 2**63 is taken as the int64 of the same 64
    bits (``value - 2**64``: how SGLang's signed hashes read back) instead of refused.
    """
    import msgspec
    import numpy as np

    m = len(raws)
    if m == 0:
        return np.zeros(0, np.int64), np.zeros(0, np.int64)
    size, buf, st, lens = _joined(raws)
    # 1. headers
    n, h = _headers(buf, st)
    off = np.zeros(m + 1, np.int64)
    np.cumsum(n, out=off[1:])
    total = int(off[-1])
    if total == 0:
        if not np.array_equal(h, lens):
            raise NotInt64Arrays("trailing bytes after an empty array")
        return np.zeros(0, np.int64), n
    starts = _all_wide(buf, st + h, lens - h, n, off)
    if starts is not None:
        return _values(buf, starts, wrap_u64), n
    # 2. element starts, element index k at a time over the arrays still running
    order = np.argsort(-n, kind="stable")
    pos = (st + h)[order]
    ends = (st + lens)[order]
    starts = np.empty(total, np.int64)
    k, n_tail = _walk(buf, n[order], pos, starts, off[:-1][order])
    tail = order[:n_tail]  # the longest arrays, not walked to their end
    if not np.array_equal(pos[len(tail) :], ends[len(tail) :]):
        raise NotInt64Arrays("element is not an int")  # the walk stopped on a non-int
    pad = size  # a zero byte (fixint 0), overwritten below
    for i in tail.tolist():
        starts[off[i] + k : off[i + 1]] = pad
    # 3. values
    vals = _values(buf, starts, wrap_u64)
    if len(tail):
        dec = msgspec.msgpack.Decoder(list[int])
        for i in tail.tolist():
            try:
                ints = dec.decode(raws[i])
                if wrap_u64:
                    ints = [v - _TWO64 if v > _I64_MAX else v for v in ints]
                got = np.array(ints, dtype=np.int64)
            except (msgspec.DecodeError, OverflowError) as exc:
                raise NotInt64Arrays(str(exc)) from None
            if len(got) != n[i]:
                raise NotInt64Arrays("array length")  # pragma: no cover (Raw is one value)
            vals[off[i] : off[i + 1]] = got
    return vals, n


def id_arrays(values: Sequence[Any]) -> tuple[Any, Any]:
    """``int_arrays`` of a request id column whose values are raw msgpack arrays or, for
    format 2.0's packed requests (``BundleReader.records(request_view="u32")``), the
    ``array('I')`` the reader rebuilt: a column of arrays only is one join and one numpy
    cast (no msgpack in between); a mixed one (a packed bundle's few requests stored
    whole) has its arrays encoded as msgpack (``compact.msgpack_uint_array``) and goes
    through ``int_arrays``."""
    import numpy as np

    m = len(values)
    kinds = set(map(type, values))  # one C-level pass: arrays only, none or some
    if array not in kinds:
        return int_arrays(values)
    if len(kinds) > 1:
        mixed = [msgpack_uint_array(v) if type(v) is array else v for v in values]
        return int_arrays(mixed)
    lens = np.fromiter(map(len, values), np.int64, m)
    vals = np.frombuffer(b"".join(values), np.uint32).astype(np.int64)
    return vals, lens


class RawIdColumns:
    """Two token-id columns (a request's input and output ids) converted from raw msgpack
    arrays a chunk of rows at a time (``add_chunk``): chunks of about ``chunk_bytes`` stay in
    cache (measured best around 2 MB on the 1M-event bench bundle), and the raw bytes, which
    pin the bundle's buffers, are released as they are converted. ``batch`` is how many rows
    the caller should gather for the next chunk (it adapts to the rows' measured size, so no
    per-row byte counting is needed).
    """

    def __init__(self, chunk_bytes: int = 2 << 20) -> None:
        self.chunk_bytes = chunk_bytes
        self.batch = 64
        self._parts: tuple[list[Any], list[Any]] = ([], [])
        self._lens: tuple[list[Any], list[Any]] = ([], [])

    def add(self, inp: Any, out: Any) -> None:
        """Convert one row (a chunk of one; ``add_chunk`` is the fast way)."""
        self.add_chunk([inp], [out])

    def add_chunk(self, inputs: Sequence[Any], outputs: Sequence[Any]) -> int:
        """Convert one chunk: the raw input and output ids of the same rows; returns how
        many ids it held."""
        rows = len(inputs)
        if not rows:
            return 0
        nvals = 0
        for raw, parts, lens in zip((inputs, outputs), self._parts, self._lens, strict=True):
            vals, n = id_arrays(raw)
            parts.append(vals)
            lens.append(n)
            nvals += len(vals)
        # next chunk: about chunk_bytes of msgpack (~3 bytes per token id) worth of rows
        per_row = max(1, nvals // rows) * 3
        self.batch = max(16, min(1 << 16, self.chunk_bytes // per_row))
        return nvals

    def clear(self) -> None:
        """Drop the converted chunks (their table was written)."""
        for lst in (*self._parts, *self._lens):
            lst.clear()

    def columns(self) -> tuple[list[tuple[Any, Any]], list[tuple[Any, Any]]]:
        """(input chunks, output chunks); a chunk is (int64 values, int64 lengths). Kept in
        chunks: concatenating would copy every token id once more."""
        (pi, po), (li, lo) = self._parts, self._lens
        return list(zip(pi, li, strict=True)), list(zip(po, lo, strict=True))


__all__ = [
    "NotInt64Arrays",
    "RawIdColumns",
    "array_lengths",
    "id_arrays",
    "int_arrays",
    "token_counts",
]
