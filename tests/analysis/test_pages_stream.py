"""Request page hashes hashed a batch of requests at a time: the same hashes and the same
cache file as one batch, session reuse carried across batches, and every page equal to
``wire.block_hashes`` of the request's chain."""

from __future__ import annotations

import random
from pathlib import Path

import msgspec
import numpy as np
import pyarrow.parquet as pq
import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvcadence.analysis import chainsrc, ingest, pagereuse, sql
from kvcadence.analysis import pages as kpages
from kvcadence.format import wire
from kvcadence.format.bundle import BundleReader
from kvcadence.format.schema import RequestRecord
from tests.analysis.helpers import cleared, header, write_bundle


def _sessions_bundle(path: Path, cached: bool = False) -> tuple[Path, list[list[int]]]:
    """Agent-like lanes: each turn's prompt extends the previous turn's chain; 3 lanes
    interleaved, some sessions restarting, some requests with no lane; with ``cached``
    each request's ``cached_tokens`` drawn up to its prompt's length (some None)."""
    rng = random.Random(4)
    crng = random.Random(5)
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
        c = crng.choice([None, crng.randint(0, len(prompt))]) if cached else None
        rec = RequestRecord(rid=f"r{i}", input_ids=prompt, output_ids=out, lane=lane)
        reqs.append(msgspec.structs.replace(rec, session=session, cached_tokens=c))
        chains.append(prompt + out[:-1])
    return write_bundle(path, [(0, [cleared()])], reqs, hdr=header(page_size=4)), chains


@pytest.mark.parametrize("ids", [True, False], ids=["request_ids", "bundle"])
@pytest.mark.parametrize("rows", [1, 7, 64])
def test_batches_equal_one_batch(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, rows: int, ids: bool
) -> None:
    """Either source of the chains -- the cache's ``request_ids`` (DuckDB) or the bundle's
    records -- gives every page ``wire.block_hashes`` of its chain, whatever the batch."""
    b, chains = _sessions_bundle(tmp_path / "b")
    ing = ingest.ingest(b, ids=ids)
    assert ing.manifest["ids"] is ids
    whole = kpages.compute(ing, sql.connect(ing), 4)
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
    whole = kpages.compute(ing, sql.connect(ing), 4)
    monkeypatch.setattr(kpages, "BATCH_ROWS", 5)
    monkeypatch.setattr(pagereuse, "CARRY_BYTES", limit)
    seen: list[tuple[int, int]] = []
    put = kpages.Carry.put

    def spy(self: kpages.Carry, *a: object) -> None:
        put(self, *a)  # type: ignore[arg-type]
        seen.append((len(self.items), self.bytes))

    monkeypatch.setattr(kpages.Carry, "put", spy)
    got = kpages.compute(ing, sql.connect(ing), 4)
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
    whole = kpages.compute(ing, con, 4)
    assert kpages.batch_rows(con) == kpages.BATCH_ROWS  # short requests: the row cap
    longest = max(len(r) for r in chains) + 1
    monkeypatch.setattr(kpages, "BATCH_TOKENS", 3 * longest)
    assert kpages.batch_rows(con) in (2, 3)  # the longest request has n_input + n_output ids
    monkeypatch.setattr(kpages, "BATCH_TOKENS", 1)
    assert kpages.batch_rows(con) == 1
    got = kpages.compute(ing, sql.connect(ing), 4)
    assert np.array_equal(got.offsets, whole.offsets)
    assert np.array_equal(got.hashes, whole.hashes)


@pytest.mark.parametrize("ids", [True, False], ids=["request_ids", "bundle"])
@pytest.mark.parametrize("compact", [True, False])
def test_chains_are_read_from_the_bundle_packed_or_whole(
    tmp_path: Path, compact: bool, ids: bool
) -> None:
    """The chains come from the bundle's request records, not from a token column: packed
    requests (format 2.0: uint32 arrays rebuilt from their shared prefix) and requests
    stored whole (lists; one with an id past uint32, hashed by ``wire``'s wide path) give
    every page ``wire.block_hashes`` of its chain, whatever the batch size."""
    from kvcadence.format.bundle import BundleWriter

    _, chains = _sessions_bundle(tmp_path / "a")
    reqs = list(BundleReader(tmp_path / "a").requests())
    wide = RequestRecord(rid="wide", input_ids=[1, 2, 3, 1 << 40, 5, 6, 7, 8], output_ids=[9, 9])
    path = tmp_path / "b"
    with BundleWriter(path, header(page_size=4), compact_requests=compact) as w:
        for r in [*reqs[:150], wide, *reqs[150:]]:  # a wide record between plain ones
            w.write(r)
    ing = ingest.ingest(path, ids=ids)
    assert ing.manifest["ids"] is ids
    for rows in (1, 64):
        kpages.BATCH_ROWS, saved = rows, kpages.BATCH_ROWS
        try:
            got = kpages.compute(ing, sql.connect(ing), 4)
        finally:
            kpages.BATCH_ROWS = saved
        for r, chain in enumerate([*chains[:150], [*wide.input_ids, 9], *chains[150:]]):
            assert got.chain(r) == wire.block_hashes(chain, 4), r


def test_requests_appended_after_the_ingest_are_left_out(tmp_path: Path) -> None:
    """A live capture appends requests while a report runs: the page hashes cover the
    ingested requests only, as the tables do; a bundle whose requests are not the ingested
    ones any more is one clear error."""
    import dataclasses

    from kvcadence.errors import BundleError
    from kvcadence.format.bundle import BundleWriter

    b, chains = _sessions_bundle(tmp_path / "b")
    ing = ingest.ingest(b, ids=False)  # the chains from the bundle
    con = sql.connect(ing)
    before = kpages.compute(ing, con, 4)
    w = BundleWriter.append(b)
    w.write(RequestRecord(rid="late", input_ids=list(range(40)), output_ids=[1, 2]))
    w.close()
    after = kpages.compute(ing, con, 4)
    assert np.array_equal(after.offsets, before.offsets)
    assert np.array_equal(after.hashes, before.hashes)
    other = write_bundle(tmp_path / "o", [(0, [cleared()])], [], hdr=header(page_size=4))
    with pytest.raises(BundleError, match="changed since its tables were built"):
        kpages.compute(dataclasses.replace(ing, bundle=other), con, 4)
    # the drill-down's chains too: the appended request is not one of the tables', and a
    # bundle without those requests is refused
    got = kpages.chains(ing, con, 4, [0, 299])
    assert [got[r].tolist() for r in (0, 299)] == [
        wire.block_hashes(chains[r], 4) for r in (0, 299)
    ]
    with pytest.raises(BundleError, match="changed since its tables were built"):
        kpages.chains(dataclasses.replace(ing, bundle=other), con, 4, [3])


def test_an_unordered_request_ids_scan_is_read_sorted() -> None:
    """``request_ids`` scanned out of request order is refused (the caller reads it with
    ``ORDER BY``), and the sorted read gives each request its own chain."""
    import duckdb

    con = duckdb.connect()
    con.sql(
        "CREATE TABLE requests AS SELECT * FROM (VALUES (0, NULL::BIGINT, NULL::BIGINT), "
        "(1, 7, 2)) t(request_id, lane, session)"
    )
    con.sql(
        "CREATE TABLE request_ids AS SELECT * FROM (VALUES (1, [1, 2], [3, 9]), "
        "(0, [4, 5], [6])) t(request_id, input_ids, output_ids)"
    )
    with pytest.raises(chainsrc.Unordered):
        list(chainsrc.parquet_batches(con, 1, 10, ""))
    ((cv, co, lanes, sessions),) = chainsrc.parquet_batches(con, 1, 10, chainsrc.ORDERED)
    assert cv.tolist() == [4, 5, 1, 2, 3] and co.tolist() == [0, 2, 5]
    assert lanes == [None, 7] and sessions == [None, 2]


@pytest.mark.parametrize("rows", [1, 7, 8192])
@pytest.mark.parametrize("ids", [True, False], ids=["request_ids", "bundle"])
def test_the_cache_keeps_each_request_from_its_cached_prefix(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, ids: bool, rows: int
) -> None:
    """The report's page cache keeps a request's pages from its cached prefix on (at most
    from its last prompt page); ``full`` keeps every page, in a file of its own; ``chains``
    hashes every page of the requests asked for -- in batches of any size (a reused
    prefix read from its source's prefix-shared digests, carried across batches)."""
    monkeypatch.setattr(kpages, "BATCH_ROWS", rows)
    b, chains = _sessions_bundle(tmp_path / "b", cached=True)
    ing = ingest.ingest(b, ids=ids)
    con = sql.connect(ing)
    recs = BundleReader(b).requests()
    want = [max(0, min((r.cached_tokens or 0) // 4, len(r.input_ids) // 4 - 1)) for r in recs]
    assert kpages.keep_from(con, 4).tolist() == want
    assert any(w > 0 for w in want)
    path = kpages.ensure_file(ing, con, 4)
    full = kpages.ensure_file(ing, con, 4, full=True)
    assert path == kpages.cache_path(ing, 4) and full == kpages.cache_path(ing, 4, full=True)
    cut, every = kpages.load(ing, con, 4), kpages.load(ing, con, 4, full=True)
    t = pq.read_table(path).to_pydict()
    rows = 0
    for r, chain in enumerate(chains):
        hs = wire.block_hashes(chain, 4)
        assert every.chain(r) == hs and every.starts[r] == 0
        first = min(want[r], len(hs))
        assert cut.chain(r) == hs[first:]
        if len(hs) > first:
            assert cut.starts[r] == first
        k = len(hs) - first
        assert t["request_id"][rows : rows + k] == [r] * k
        assert t["page"][rows : rows + k] == list(range(first, len(hs)))
        rows += k
    assert rows == len(t["hash"]) < len(pq.read_table(full)) == len(every.hashes)
    again = kpages.compute(ing, con, 4)  # computed, not read: the same
    assert np.array_equal(again.hashes, cut.hashes)
    assert np.array_equal(again.offsets, cut.offsets)
    picked = [3, 150, 299]
    got = kpages.chains(ing, con, 4, picked)
    assert sorted(got) == picked
    for r in picked:
        assert got[r].tolist() == wire.block_hashes(chains[r], 4)


@given(st.lists(st.tuples(st.integers(0, 6), st.integers(0, 5)), min_size=1, max_size=8))
def test_prefix_shared_digests_read_as_the_flat_chain(links: list[tuple[int, int]]) -> None:
    """A chain of ``Digests`` (each reusing part of the one before and adding its own pages)
    reads back, for any page range, as the flat digests of its pages."""
    rng = np.random.default_rng(len(links))
    flat = rng.integers(0, 256, (0, 32), dtype=np.uint8)
    node = None
    for keep, add in links:
        m = min(keep, len(flat))
        own = rng.integers(0, 256, (add, 32), dtype=np.uint8)
        node = pagereuse.Digests(node if m else None, m, own)
        flat = np.concatenate([flat[:m], own])
        assert node.pages == len(flat) and node.nbytes == 32 * len(flat)
        for lo in range(len(flat) + 1):
            for hi in range(lo, len(flat) + 1):
                assert np.array_equal(node.get(lo, hi), flat[lo:hi])
    with pytest.raises(ValueError):
        pagereuse.Digests(None, 2, flat[:0]).get(0, 2)
