"""Where an array of stored block hashes holds one of a few wanted values.

What this file owns: ``matches(keys, want)``, the one membership pass over every stored page
that the production inference makes in several places (the anchors a prompt's prefill may
sit below, ``sessions``; the prefixes stored before the capture, ``precached``; the pages
the records claimed, ``unrecorded``). A page is compared with the wanted values only when
its low bits are one of theirs (a table of ``SIEVE_BITS`` flags: one gather per page, no
sort or binary search of all of them), the pages taken ``SLICE`` at a time: temporaries of a
few hundred KB, reused, where one the size of every hash would be fresh memory -- a page
fault per 4 KB (24M stored pages, a 9,000-request capture at page 1: 0.13 s warm, 2.9 s
the first time, against 0.09 s a slice at a time).
"""

from __future__ import annotations

from typing import Any

import numpy as np

#: the low bits of a hash that the table is indexed by, at least (2**20 flags, 1 MiB: a few
#: thousand wanted values among a million pages let few through; 2**16 let ~9 % of them
#: through for 6,000 wanted keys, 3x the time) ...
SIEVE_BITS = 20
#: ... and at most (16 MiB): a table of ``2**SIEVE_SPARE_BITS`` flags per wanted value
#: between the two, so that about 1 in 32 pages gets through whatever the number wanted. A
#: fixed 2**20 let ~11 % through for the ~120,000 anchors of a 60,000-request capture and
#: ~70 % for 1.2M (0.13 -> 0.09 s and 1.6 -> 0.85 s over its 9.4M stored pages)
SIEVE_MAX_BITS = 24
SIEVE_SPARE_BITS = 5
#: pages looked at a time
SLICE = 1 << 15


def table_bits(wanted: int) -> int:
    """The table's size (bits of a hash it is indexed by) for ``wanted`` values: at least
    ``2**SIEVE_SPARE_BITS`` flags per value, within ``SIEVE_BITS`` .. ``SIEVE_MAX_BITS``."""
    return min(max(SIEVE_BITS, wanted.bit_length() + SIEVE_SPARE_BITS), SIEVE_MAX_BITS)


def matches(keys: Any, want: Any) -> Any:
    """The positions (ascending, an int64 array) of ``keys`` (an int64 array, every stored
    page's hash or key) whose value is one of ``want`` (an int64 array, a few)."""
    if not len(keys) or not len(want):
        return np.zeros(0, np.int64)
    bits = table_bits(len(want))
    low = np.int64((1 << bits) - 1)
    table = np.zeros(1 << bits, dtype=bool)
    table[want & low] = True
    pos = np.concatenate(
        [
            np.flatnonzero(table[keys[lo : lo + SLICE] & low]) + lo
            for lo in range(0, len(keys), SLICE)
        ]
    )
    return pos[np.isin(keys[pos], want)]
