"""Root chains hashed across worker processes give the bytes of one in-process pass."""

from __future__ import annotations

import random

import numpy as np
import pytest

from kvcadence.analysis import hashpool
from kvcadence.format import wire


@pytest.mark.parametrize("ps", [1, 16])
def test_pool_equals_one_pass(monkeypatch: pytest.MonkeyPatch, ps: int) -> None:
    rng = random.Random(ps)
    lens = [rng.randrange(1, 9) for _ in range(300)]
    first = np.zeros(sum(lens), dtype=bool)
    first[np.cumsum([0, *lens[:-1]])] = True
    words = np.array([rng.randrange(1 << 32) for _ in range(sum(lens) * ps)], "<u4").tobytes()
    want = hashpool.digest_bytes(words, ps, first.astype(np.uint8).tobytes())
    at = 0
    for n in lens:  # chain by chain: wire's own hashes
        toks = np.frombuffer(words[4 * ps * at : 4 * ps * (at + n)], "<u4").tolist()
        assert want[32 * at : 32 * (at + n)] == b"".join(wire.block_digests(toks, ps))
        at += n
    monkeypatch.setattr(hashpool, "MIN_PAGES", 10)
    with hashpool.ChainHasher(3) as h:
        assert h.digests(words, ps, first) == want
        assert h._pool is not None  # really shared
    with hashpool.ChainHasher(1) as h:
        assert h.digests(words, ps, first) == want
        assert h._pool is None
