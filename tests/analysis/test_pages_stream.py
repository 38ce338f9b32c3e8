"""Request page hashes hashed a batch of requests at a time: the same hashes and the same
cache file as one batch, session reuse carried across batches, and every page equal to
``wire.block_hashes`` of the request's chain."""

from __future__ import annotations

import random
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from kvcadence.analysis import ingest, pagereuse, sql
from kvcadence.analysis import pages as kpages
from kvcadence.format import wire
from kvcadence.format.schema import RequestRecord
from tests.analysis.helpers import cleared, header, write_bundle


def _sessions_bundle(path: Path) -> tuple[Path, list[list[int]]]:
    """Agent-like lanes: each turn's prompt extends the previous turn's chain; 3 lanes
    interleaved, some sessions restarting, some requests with no lane."""
    rng = random.Random(4)
    reqs, chains = [], []
    ctx: dict[int, list[int]] = {}
    for i in range(300):
        lane = rng.choice([0, 1, 2, None])
        if lane is None or rng.random() < 0.1:
            prompt = [rng.randrange(50_000) for _ in range(rng.randrange(0, 40))]
            session = None if lane is None else i
        else:
            prompt = ctx.get(lane, []) + [rng.randrange(50_000) for _ in range(rng.randrange(9))]
            session = 7
        out = [rng.randrange(50_000) for _ in range(rng.randrange(0, 6))]
        if lane is not None:
            ctx[lane] = prompt + out[:-1]
        reqs.append(
            RequestRecord(rid=f"r{i}", input_ids=prompt, output_ids=out, lane=lane, session=session)
        )
        chains.append(prompt + out[:-1])
    return write_bundle(path, [(0, [cleared()])], reqs, hdr=header(page_size=4)), chains


@pytest.mark.parametrize("rows", [1, 7, 64])
def test_batches_equal_one_batch(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, rows: int
) -> None:
    b, chains = _sessions_bundle(tmp_path / "b")
    ing = ingest.ingest(b)
    whole = kpages.compute(sql.connect(ing), 4)
    monkeypatch.setattr(kpages, "BATCH_ROWS", rows)
    got = kpages.load(ing, sql.connect(ing), 4)
    assert np.array_equal(got.offsets, whole.offsets)
    assert np.array_equal(got.hashes, whole.hashes)
    for r, chain in enumerate(chains):
        assert got.chain(r) == wire.block_hashes(chain, 4)
    cached = pq.read_table(kpages.cache_path(ing, 4)).to_pydict()
    assert cached["hash"] == [wire.u64(h) for h in whole.hashes.tolist()]
    assert cached["request_id"] == np.repeat(np.arange(300), np.diff(whole.offsets)).tolist()
    again = kpages.load(ing, sql.connect(ing), 4)  # from the cache
    assert np.array_equal(again.hashes, whole.hashes)


@pytest.mark.parametrize("limit", [0, 600])
def test_a_bounded_session_carry_gives_the_same_hashes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, limit: int
) -> None:
    """Sessions dropped from the carry (``CARRY_BYTES``; 0: only the latest one kept) are
    hashed from the root on their next turn: the same hashes; the carry stays in bounds."""
    b, chains = _sessions_bundle(tmp_path / "b")
    ing = ingest.ingest(b)
    whole = kpages.compute(sql.connect(ing), 4)
    monkeypatch.setattr(kpages, "BATCH_ROWS", 5)
    monkeypatch.setattr(pagereuse, "CARRY_BYTES", limit)
    seen: list[tuple[int, int]] = []
    put = kpages.Carry.put

    def spy(self: kpages.Carry, *a: object) -> None:
        put(self, *a)  # type: ignore[arg-type]
        seen.append((len(self.items), self.bytes))

    monkeypatch.setattr(kpages.Carry, "put", spy)
    got = kpages.compute(sql.connect(ing), 4)
    assert np.array_equal(got.offsets, whole.offsets)
    assert np.array_equal(got.hashes, whole.hashes)
    for r, chain in enumerate(chains):
        assert got.chain(r) == wire.block_hashes(chain, 4)
    assert seen and all(n == 1 or used <= limit for n, used in seen)
    if limit == 0:
        assert max(n for n, _ in seen) == 1
    else:
        assert max(n for n, _ in seen) > 1  # several sessions fit in 600 bytes


def test_batch_rows_bounded_by_the_longest_request_pages(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """At a small page size the digests (32 bytes a page) bound a batch: ``BATCH_PAGES``."""
    b, _ = _sessions_bundle(tmp_path / "b")
    con = sql.connect(ingest.ingest(b))
    ((longest,),) = con.sql("SELECT max(n_input + n_output) FROM requests").fetchall()
    assert longest >= 16
    monkeypatch.setattr(kpages, "BATCH_PAGES", 3 * longest)
    assert kpages.batch_rows(con, 1) == 3  # at page size 1 a page is a token
    assert kpages.batch_rows(con, 4) == 3 * longest // (longest // 4) >= 12
    monkeypatch.setattr(kpages, "BATCH_PAGES", 1)
    assert kpages.batch_rows(con, 1) == 1  # never 0


def test_batch_rows_bounded_by_the_longest_request_tokens(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Long prompts make fewer rows a batch (``BATCH_TOKENS`` ids at most), never 0; the
    hashes are those of one batch."""
    b, chains = _sessions_bundle(tmp_path / "b")
    ing = ingest.ingest(b)
    con = sql.connect(ing)
    whole = kpages.compute(con, 4)
    assert kpages.batch_rows(con) == kpages.BATCH_ROWS  # short requests: the row cap
    longest = max(len(r) for r in chains) + 1
    monkeypatch.setattr(kpages, "BATCH_TOKENS", 3 * longest)
    assert kpages.batch_rows(con) in (2, 3)  # the longest request has n_input + n_output ids
    monkeypatch.setattr(kpages, "BATCH_TOKENS", 1)
    assert kpages.batch_rows(con) == 1
    got = kpages.compute(sql.connect(ing), 4)
    assert np.array_equal(got.offsets, whole.offsets)
    assert np.array_equal(got.hashes, whole.hashes)


def test_out_of_order_batches_are_refused() -> None:
    import pyarrow as pa

    def batch(ids: list[int]) -> pa.RecordBatch:
        n = len(ids)
        return pa.RecordBatch.from_pydict(
            {
                "request_id": pa.array(ids, pa.int64()),
                "chain": pa.array([[1, 2]] * n, pa.list_(pa.int64())),
                "lane": pa.array([None] * n, pa.int64()),
                "session": pa.array([None] * n, pa.int64()),
            }
        )

    assert kpages._hash_batches([batch([0, 1]), batch([2])], 1, None) is not None
    assert kpages._hash_batches([batch([0, 2]), batch([1])], 1, None) is None
    assert kpages._hash_batches([batch([1, 0])], 1, None) is None


def _production_chains(seed: int, n: int, sessions: int, ps: int) -> list[list[int]]:
    """Interleaved agent sessions without lanes or sessions (a production capture's records):
    each turn's chain extends its session's previous chain; all share a system prompt."""
    rng = random.Random(seed)
    system = [rng.randrange(1, 50_000) for _ in range(3 * ps + 17)]
    ctx: dict[int, list[int]] = {}
    chains = []
    for _ in range(n):
        s = rng.randrange(sessions)
        base = ctx.get(s, system)
        chain = base + [rng.randrange(1, 50_000) for _ in range(rng.randrange(1, 3 * ps))]
        ctx[s] = chain
        chains.append(chain[: len(chain) // ps * ps])
    return chains


def _hashed_pages(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Count the pages ``hash_requests`` hashes (the root pass and the per-row tails)."""
    from kvcadence.analysis import hashpool

    seen = [0]
    digests = hashpool.ChainHasher.digests
    block_digests = kpages.wire.block_digests

    def root(self: hashpool.ChainHasher, words: bytes, ps: int, first: object) -> object:
        seen[0] += len(words) // (4 * ps)
        return digests(self, words, ps, first)

    def tail(tokens: object, ps: int, *a: object, **k: object) -> object:
        seen[0] += len(tokens) // ps  # type: ignore[arg-type]
        return block_digests(tokens, ps, *a, **k)  # type: ignore[arg-type]

    monkeypatch.setattr(hashpool.ChainHasher, "digests", root)
    monkeypatch.setattr(kpages.wire, "block_digests", tail)
    return seen


@pytest.mark.parametrize("ps", [1, 4, 16])
def test_rows_without_sessions_reuse_the_longest_prefix_by_content(
    monkeypatch: pytest.MonkeyPatch, ps: int
) -> None:
    """A production capture's rows (no lane, no session): each turn reuses the digests of the
    earlier row its chain extends, found by content; the hashes are ``wire``'s, and every
    distinct page is hashed once but the ones no earlier row starts alike with."""
    chains = _production_chains(5, 120, 7, ps)
    seen = _hashed_pages(monkeypatch)
    cv, co = kpages._flat(pa.chunked_array([pa.array(chains, type=pa.list_(pa.int64()))]))
    page_off, hashes = kpages.hash_requests(cv, co, ps, [None] * 120, [None] * 120)
    for r, chain in enumerate(chains):
        assert hashes[page_off[r] : page_off[r + 1]].tolist() == wire.block_hashes(chain, ps)
    distinct = len(set(hashes.tolist()))
    assert distinct <= seen[0] < distinct + 7 * len(chains[0]) // ps  # the first turns
    assert seen[0] < int(page_off[-1]) / 3  # against hashing every row from the root


def test_content_reuse_across_batches_and_its_bound(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Rows without sessions reuse rows of earlier batches (``Recent``) with the same hashes;
    with the carry bounded to nothing, the same hashes again (hashed from the root)."""
    chains = _production_chains(6, 90, 4, 4)
    reqs = [RequestRecord(rid=f"r{i}", input_ids=c, output_ids=[]) for i, c in enumerate(chains)]
    b = write_bundle(tmp_path / "b", [(0, [cleared()])], reqs, hdr=header(page_size=4))
    ing = ingest.ingest(b)
    monkeypatch.setattr(kpages, "BATCH_ROWS", 5)
    for limit in (None, 0):
        if limit is not None:
            monkeypatch.setattr(pagereuse, "CARRY_BYTES", limit)
        seen = _hashed_pages(monkeypatch)
        got = kpages.compute(sql.connect(ing), 4)
        for r, chain in enumerate(chains):
            assert got.chain(r) == wire.block_hashes(chain, 4)
        if limit is None:
            reused = seen[0]
        else:
            assert seen[0] > reused  # nothing carried: each batch's first turns from the root
    total = int(got.offsets[-1])
    assert reused < total / 3


def test_recent_stays_in_its_bounds(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(pagereuse, "HEAD_CANDIDATES", 3)
    rec = pagereuse.Recent(limit=200)
    for i in range(50):
        head = b"h%d" % (i % 2)
        rec.put(head, 1, b"w" * 10, np.zeros(4, dtype=np.uint8))
        assert rec.bytes <= 200 and len(rec.items) <= 14
        assert all(len(ids) <= 3 for ids in rec.by_head.values())
        assert sum(len(ids) for ids in rec.by_head.values()) == len(rec.items)
    assert [k for k, _, _ in rec.candidates(b"h1")] == [1, 1, 1]
