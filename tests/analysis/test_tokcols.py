"""``tokcols.int_arrays``: raw msgpack int arrays -> int64 numpy, equal to msgspec's decoding.

Every msgpack int encoding (minimal as msgspec writes it, and the wider ones other writers
may use), every array header, the tail path for long arrays, and the refusals (non-ints,
uint64 above int64) -- property-tested against ``msgspec.msgpack.decode(..., list[int])``.
"""

from __future__ import annotations

import struct

import msgspec
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvcadence.analysis.tokcols import (
    NotInt64Arrays,
    RawIdColumns,
    array_lengths,
    id_arrays,
    int_arrays,
    token_counts,
)
from kvcadence.format.wire import tokens_ok

I64 = st.integers(-(2**63), 2**63 - 1)
TOKENS = st.one_of(st.integers(0, 300), st.integers(0, 200_000), I64)


def _encodings(v: int) -> list[bytes]:
    """Every msgpack encoding of ``v`` (minimal and wider)."""
    out = []
    if 0 <= v <= 0x7F or -32 <= v < 0:
        out.append(struct.pack(">b", v) if v < 0 else bytes([v]))
    for tag, fmt, lo, hi in (
        (0xCC, ">B", 0, 2**8 - 1),
        (0xCD, ">H", 0, 2**16 - 1),
        (0xCE, ">I", 0, 2**32 - 1),
        (0xCF, ">Q", 0, 2**64 - 1),
        (0xD0, ">b", -(2**7), 2**7 - 1),
        (0xD1, ">h", -(2**15), 2**15 - 1),
        (0xD2, ">i", -(2**31), 2**31 - 1),
        (0xD3, ">q", -(2**63), 2**63 - 1),
    ):
        if lo <= v <= hi:
            out.append(bytes([tag]) + struct.pack(fmt, v))
    return out


def _header(n: int, wide: int) -> bytes:
    if n <= 15 and wide == 0:
        return bytes([0x90 | n])
    if n <= 0xFFFF and wide <= 1:
        return b"\xdc" + struct.pack(">H", n)
    return b"\xdd" + struct.pack(">I", n)


@st.composite
def raw_arrays(draw: st.DrawFn, values: st.SearchStrategy[int] = TOKENS) -> tuple[bytes, list]:
    """(raw msgpack array bytes with randomly chosen int encodings, the ints)."""
    vals = draw(st.lists(values, max_size=40))
    parts = [_header(len(vals), draw(st.integers(0, 2)))]
    for v in vals:
        encs = _encodings(v)
        parts.append(encs[draw(st.integers(0, len(encs) - 1))])
    return b"".join(parts), vals


def _reference(raws: list[bytes]) -> tuple[np.ndarray, np.ndarray]:
    lists = [msgspec.msgpack.decode(r, type=list[int]) for r in raws]
    flat = [v for lst in lists for v in lst]
    return np.array(flat, dtype=np.int64), np.array([len(x) for x in lists], dtype=np.int64)


def _check(raws: list[bytes]) -> None:
    vals, lens = int_arrays(raws)
    ref_vals, ref_lens = _reference(raws)
    assert vals.dtype == np.int64 and lens.dtype == np.int64
    assert np.array_equal(lens, ref_lens)
    assert np.array_equal(vals, ref_vals)


@settings(max_examples=200, deadline=None)
@given(st.lists(raw_arrays(), max_size=30))
def test_equals_msgspec_for_every_encoding(arrays: list[tuple[bytes, list]]) -> None:
    raws = [r for r, _ in arrays]
    _check(raws)
    vals, _ = int_arrays(raws)
    assert vals.tolist() == [v for _, vs in arrays for v in vs]


@settings(max_examples=50, deadline=None)
@given(st.lists(st.lists(TOKENS, max_size=300), min_size=1, max_size=200))
def test_equals_msgspec_on_msgspec_encoded_ids(lists: list[list[int]]) -> None:
    """What bundles hold: msgspec's own (minimal) encoding, many arrays (walk + tail)."""
    _check([msgspec.msgpack.encode(x) for x in lists])


def test_long_arrays_take_the_tail_path() -> None:
    rng = np.random.default_rng(1)
    lists = [rng.integers(-(2**40), 2**40, size=n).tolist() for n in rng.integers(0, 50, 300)]
    lists += [rng.integers(0, 200_000, size=5000).tolist() for _ in range(3)]  # > _MIN_ACTIVE
    lists.append(list(range(-40, 70_000)))  # array32 header, every width
    _check([msgspec.msgpack.encode(x) for x in lists])


def test_empty_inputs() -> None:
    vals, lens = int_arrays([])
    assert len(vals) == 0 and len(lens) == 0
    _check([b"\x90", b"\xdc\x00\x00", b"\xdd\x00\x00\x00\x00"])


def test_raw_objects_accepted() -> None:
    raws = [msgspec.Raw(msgspec.msgpack.encode([1, -2, 2**40])), memoryview(b"\x91\x05")]
    vals, lens = int_arrays(raws)
    assert vals.tolist() == [1, -2, 2**40, 5] and lens.tolist() == [3, 1]


@pytest.mark.parametrize(
    "bad",
    [
        [1, 2.5, 3],
        [1, None],
        ["a"],
        [[1, 2]],
        [True],
        [1, {"a": 1}],
    ],
)
@pytest.mark.parametrize("where", ["walk", "tail"])
def test_non_ints_refused(bad: list, where: str) -> None:
    good = [msgspec.msgpack.encode([7] * (3 if where == "walk" else 1))] * 100
    raw = msgspec.msgpack.encode([1] * (200 if where == "tail" else 0) + bad)
    with pytest.raises(msgspec.ValidationError):
        msgspec.msgpack.decode(raw, type=list[int])
    with pytest.raises(NotInt64Arrays):
        int_arrays([*good, raw])


@pytest.mark.parametrize("n", [1, 200])
def test_uint64_above_int64_refused(n: int) -> None:
    raw = _header(n, 1) + b"\x05" * (n - 1) + b"\xcf" + struct.pack(">Q", 2**63)
    assert msgspec.msgpack.decode(raw, type=list[int])[-1] == 2**63  # msgspec takes it...
    with pytest.raises(NotInt64Arrays):  # ...an int64 column cannot
        int_arrays([msgspec.msgpack.encode([1, 2])] * 100 + [raw])
    top = b"\x91\xcf" + struct.pack(">Q", 2**63 - 1)
    assert int_arrays([top])[0].tolist() == [2**63 - 1]


@pytest.mark.parametrize("raw", [b"\xc0", b"\x05", b"\xa1a", b"\x81\x01\x02"])
def test_not_an_array_refused(raw: bytes) -> None:
    with pytest.raises(NotInt64Arrays):
        int_arrays([b"\x90", raw])


@settings(max_examples=30, deadline=None)
@given(
    st.lists(st.tuples(st.lists(TOKENS, max_size=60), st.lists(TOKENS, max_size=20))),
    st.integers(1, 4096),
)
def test_raw_id_columns_chunks(rows: list[tuple[list, list]], chunk: int) -> None:
    cols = RawIdColumns(chunk_bytes=chunk)
    for a, b in rows:
        cols.add(msgspec.Raw(msgspec.msgpack.encode(a)), msgspec.Raw(msgspec.msgpack.encode(b)))
    inp, out = cols.columns()
    for side, chunks in ((0, inp), (1, out)):
        flat = [v for vals, _ in chunks for v in vals.tolist()]
        lens = [n for _, ns in chunks for n in ns.tolist()]
        assert flat == [v for r in rows for v in r[side]]
        assert lens == [len(r[side]) for r in rows]


# -- wrap_u64 (block hashes), the 9-byte fast path, array_lengths ---------------------------

U64 = st.integers(0, 2**64 - 1)
HASHES = st.one_of(I64, U64, st.integers(-(2**31), 2**32))


def _wrapped(v: int) -> int:
    return v - 2**64 if v >= 2**63 else v


@settings(max_examples=150, deadline=None)
@given(st.lists(raw_arrays(HASHES), max_size=30))
def test_wrap_u64_is_the_int64_of_the_same_bits(arrays: list[tuple[bytes, list]]) -> None:
    vals, lens = int_arrays([r for r, _ in arrays], wrap_u64=True)
    assert vals.tolist() == [_wrapped(v) for _, vs in arrays for v in vs]
    assert lens.tolist() == [len(vs) for _, vs in arrays]


@settings(max_examples=60, deadline=None)
@given(st.lists(st.lists(st.one_of(I64, U64), max_size=25), min_size=1, max_size=150))
def test_random_hashes_msgspec_encoded(lists: list[list[int]]) -> None:
    """What SGLang hash arrays look like (mostly 9-byte ints: the fast path), walk + tail."""
    raws = [msgspec.msgpack.encode(x) for x in lists]
    vals, lens = int_arrays(raws, wrap_u64=True)
    assert vals.tolist() == [_wrapped(v) for x in lists for v in x]
    assert lens.tolist() == [len(x) for x in lists]


def test_nine_byte_fast_path_and_its_near_misses() -> None:
    rng = np.random.default_rng(5)
    wide = [rng.integers(-(2**63), -(2**40), size=n).tolist() for n in rng.integers(0, 12, 400)]
    raws = [msgspec.msgpack.encode(x) for x in wide]
    vals, lens = int_arrays(raws)  # all int64 (0xd3): 9 bytes per element
    assert vals.tolist() == [v for x in wide for v in x]
    # 9 bytes per element that are not all 9-byte ints: a str8 of 7 chars, or a 1-byte and a
    # 17-byte element side by side, or a float64 (9 bytes, not an int)
    odd = [
        b"\x91\xd9\x07abcdefg",
        b"\x92\x01\xd9\x0fabcdefghijklmno",
        b"\x91\xcb" + struct.pack(">d", 1.5),
    ]
    for raw in odd:
        with pytest.raises(NotInt64Arrays):
            int_arrays([*raws, raw], wrap_u64=True)
    # uint64 >= 2**63 in 9 bytes: refused unless wrapped
    big = b"\x92\xcf" + struct.pack(">Q", 2**64 - 3) + b"\xd3" + struct.pack(">q", -7)
    with pytest.raises(NotInt64Arrays):
        int_arrays([*raws, big])
    assert int_arrays([big], wrap_u64=True)[0].tolist() == [-3, -7]


def test_wrap_u64_in_the_tail_path() -> None:
    lists = [[2**64 - 1, 5] * 150] + [[1, 2]] * 100  # one array longer than the walk goes
    vals, lens = int_arrays([msgspec.msgpack.encode(x) for x in lists], wrap_u64=True)
    assert vals.tolist() == [_wrapped(v) for x in lists for v in x]


@settings(max_examples=60, deadline=None)
@given(st.lists(st.lists(st.one_of(TOKENS, st.lists(TOKENS, max_size=2)), max_size=70_000 // 2000)))
def test_array_lengths_reads_headers_only(lists: list[list]) -> None:
    raws = [msgspec.Raw(msgspec.msgpack.encode(x)) for x in lists]
    assert array_lengths(raws).tolist() == [len(x) for x in lists]


def test_array_lengths_every_header_and_refusals() -> None:
    raws = [msgspec.msgpack.encode(list(range(n))) for n in (0, 15, 16, 300, 70_000)]
    assert array_lengths(raws).tolist() == [0, 15, 16, 300, 70_000]
    assert array_lengths([]).tolist() == []
    for bad in (b"\xc0", b"\x05", b"\xa1a", b"\x81\x01\x02"):
        with pytest.raises(NotInt64Arrays):
            array_lengths([raws[0], bad])


@settings(max_examples=40, deadline=None)
@given(
    st.lists(
        st.tuples(st.lists(st.integers(0, 2**32 - 1), max_size=40), st.booleans()), max_size=30
    )
)
def test_id_arrays_of_uint32_arrays_and_mixed_columns(rows: list[tuple[list, bool]]) -> None:
    """Packed requests' ``array('I')`` ids (alone or mixed with raw msgpack arrays) give the
    columns ``int_arrays`` gives for the same ids as msgpack."""
    from array import array

    values = [
        array("I", ids) if u32 else msgspec.Raw(msgspec.msgpack.encode(ids)) for ids, u32 in rows
    ]
    vals, lens = id_arrays(values)
    assert vals.dtype == np.int64 and lens.dtype == np.int64
    assert vals.tolist() == [v for ids, _ in rows for v in ids]
    assert lens.tolist() == [len(ids) for ids, _ in rows]
    only = [array("I", ids) for ids, _ in rows]
    want = int_arrays([msgspec.msgpack.encode(ids) for ids, _ in rows])
    got = id_arrays(only)
    assert np.array_equal(got[0], want[0]) and np.array_equal(got[1], want[1])


# token_ids elements: ints in any encoding (mostly), [t, t+1] pairs, and what is not a token
_INT_ELEM = st.integers(0, 200_000).flatmap(lambda v: st.sampled_from(_encodings(v)))
_PAIR_ELEM = st.integers(0, 200_000).map(lambda v: msgspec.msgpack.encode([v, v + 1]))
_NOT_TOKEN = st.sampled_from(
    [b"\xc0", b"\xa1x", b"\xcb" + bytes(8), b"\x93\x01\x02\x03", b"\x90", b"\x92\x01\xa1x"]
)
_TOKEN_ELEMS = st.integers(0, 399).flatmap(
    lambda i: _INT_ELEM if i < 396 else _PAIR_ELEM if i < 398 else _NOT_TOKEN
)


@st.composite
def token_arrays(draw: st.DrawFn) -> bytes:
    n = draw(st.sampled_from([0, 1, 5, 30, 90, 200]))
    elems = draw(st.lists(_TOKEN_ELEMS, min_size=n, max_size=n))
    return _header(n, draw(st.integers(0, 2))) + b"".join(elems)


@settings(max_examples=150, deadline=None)
@given(st.lists(token_arrays(), min_size=1, max_size=200), st.integers(0, 3))
def test_token_counts_gives_the_verdict_of_tokens_ok(raws: list[bytes], pad: int) -> None:
    """Counts from the headers when every array is what ``wire.tokens_ok`` accepts (a pair
    counts as one), ``NotInt64Arrays`` when one is not: the walk (many arrays), the tail
    (the longest ones) and the arrays it stops in (pairs, non-tokens) give one verdict."""
    if pad:  # 100 longer int-only arrays: the drawn ones are walked to their end (no tail)
        raws = [msgspec.msgpack.encode(list(range(k % 7, 300 * pad))) for k in range(100)] + raws
    if all(tokens_ok(r) for r in raws):
        assert token_counts(raws).tolist() == [len(msgspec.msgpack.decode(r)) for r in raws]
    else:
        with pytest.raises(NotInt64Arrays):
            token_counts(raws)


def test_token_counts_walks_int_arrays_and_checks_the_rest() -> None:
    ints = [msgspec.msgpack.encode(list(range(k, k + 40))) for k in range(0, 300_000, 3000)]
    assert token_counts(ints).tolist() == [40] * len(ints)
    assert token_counts([]).tolist() == []
    pairs = [*ints, msgspec.msgpack.encode([[7, 8], 9])]
    assert token_counts(pairs).tolist()[-1] == 2
    for bad in ([1, "a"], [1.5], [[1, 2, 3]], "x", [None]):
        with pytest.raises(NotInt64Arrays):
            token_counts([*ints, msgspec.msgpack.encode(bad)])
    long_bad = msgspec.msgpack.encode([*range(500), "z"])  # longer than the walk goes
    with pytest.raises(NotInt64Arrays):
        token_counts([*ints, long_bad])
