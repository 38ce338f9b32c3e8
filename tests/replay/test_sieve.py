"""``replay.sieve.matches``: the positions of the wanted values, as a plain membership test
gives them, whatever the slice and the table size (hypothesis)."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from kvcadence.replay import sieve

_I64 = st.integers(-(1 << 63), (1 << 63) - 1)


@settings(max_examples=200, deadline=None)
@given(
    st.lists(_I64, max_size=300),
    st.lists(_I64, max_size=20),
    st.integers(0, 30),
    st.sampled_from([1, 3, 64, 1 << 15]),
    st.sampled_from([1, 4, 20]),
)
def test_matches_is_a_membership_test(
    keys: list[int], extra: list[int], picked: int, size: int, bits: int
) -> None:
    arr = np.array(keys, np.int64)
    # wanted: some of the keys (repeats and low-bit twins among them) and values maybe absent
    want = np.array(keys[:picked] + extra + [k ^ (1 << 40) for k in keys[:3]], np.int64)
    saved = sieve.SLICE, sieve.SIEVE_BITS, sieve.SIEVE_MAX_BITS
    # a table of ``bits`` bits whatever the number wanted (collisions in a tiny one)
    sieve.SLICE, sieve.SIEVE_BITS, sieve.SIEVE_MAX_BITS = size, bits, bits
    try:
        got = sieve.matches(arr, want)
    finally:
        sieve.SLICE, sieve.SIEVE_BITS, sieve.SIEVE_MAX_BITS = saved
    assert got.dtype == np.int64
    assert got.tolist() == np.flatnonzero(np.isin(arr, want)).tolist()


def test_the_table_grows_with_the_values_wanted() -> None:
    """At least 32 flags per wanted value (about 1 page in 32 let through whatever the
    number wanted) between the least and the most table size; never past either."""
    for n in (0, 1, 1000, 30_000, 120_000, 500_000, 1_200_000, 10**8):
        bits = sieve.table_bits(n)
        assert sieve.SIEVE_BITS <= bits <= sieve.SIEVE_MAX_BITS
        if bits < sieve.SIEVE_MAX_BITS:
            assert 1 << bits >= 32 * n
    assert sieve.table_bits(1_000) == sieve.SIEVE_BITS  # a few thousand: the least table
    assert sieve.table_bits(120_000) == 22  # a 60,000-request capture's anchors
    assert sieve.table_bits(10**8) == sieve.SIEVE_MAX_BITS
