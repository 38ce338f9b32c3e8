"""Out-of-core attribution (``attribute_sql``: DuckDB joins) equals the reference loop
(``attribute``) on hypothesis-generated streams, and the column path (``attribute_arrays``)
on ingested bundles: the vendored fixture and corpus captures."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import duckdb
import numpy as np
import pyarrow as pa
import pytest
from hypothesis import given, settings

from kvcadence.analysis import attribution as attr
from kvcadence.analysis import ingest
from kvcadence.analysis import pages as kpages
from kvcadence.analysis import sql as ksql
from kvcadence.analysis.attribution import Request
from tests.analysis.attribution_oracle import StoredEvent, attribute, columns_from_objects
from tests.analysis.test_attribution_fast import FIELDS, _u64_chain, scenario

CORPUS = Path(__file__).resolve().parents[1] / "replay" / "data" / "corpus"


def _plain(v: Any) -> Any:
    """numpy per-request columns as lists (``attribute_sql`` keeps them numpy)."""
    return v.tolist() if isinstance(v, np.ndarray) else v


def _connect(requests: list[Request], events: list[StoredEvent], ps: int, cut: bool = False) -> Any:
    """A DuckDB connection with ``requests`` / ``events`` / ``blocks`` / ``pages`` tables of
    the object inputs (hashes as uint64, as the Parquet cache holds them; ``cut``: each
    request's pages from its cached prefix on, as the report's cache keeps them)."""
    pages, rc, ec = columns_from_objects(requests, events, ps, cut)
    con = duckdb.connect(":memory:")
    n = len(requests)
    req = pa.table(
        {
            # request ids need not be positions: attribution orders by them
            "request_id": pa.array([10 + 3 * i for i in range(n)], pa.int64()),
            "rid": pa.array([r.rid for r in requests], pa.string()),
            "n_input": pa.array(rc.n_input, pa.int64()),
            "n_output": pa.array(rc.n_output, pa.int64()),
            "cached_tokens": pa.array(rc.cached_tokens, pa.int64()),
            "send_ns": pa.array(rc.send_ns, pa.int64()),
            "finish_ns": pa.array(rc.finish_ns, pa.int64()),
            "lane": pa.array(rc.lane, pa.int64()),
            "session": pa.array(rc.session, pa.int64()),
        }
    )
    ev = pa.table(
        {
            "event_id": pa.array(ec.event_id, pa.int64()),
            "kind": pa.array(["stored"] * len(ec.event_id), pa.string()),
            "recv_ns": pa.array(ec.recv_ns, pa.int64()),
            "n_blocks": pa.array(ec.n_blocks, pa.int32()),
        }
    )
    nb = ec.n_blocks
    b_ev = np.repeat(ec.event_id, nb)
    pos = np.arange(len(b_ev)) - np.repeat(np.cumsum(nb) - nb, nb)
    blocks = pa.table(
        {
            "event_id": pa.array(b_ev, pa.int64()),
            "kind": pa.array(["stored"] * len(b_ev), pa.string()),
            "pos": pa.array(pos, pa.int32()),
            "hash": pa.array(ec.hashes.view(np.uint64), pa.uint64()),
        }
    )
    counts = np.diff(pages.offsets)
    rid = np.repeat(np.arange(n, dtype=np.int64), counts)
    pg = pa.table(
        {
            "request_id": pa.array(rid, pa.int64()),
            "page": pa.array(
                np.arange(len(rid)) - pages.offsets[:-1][rid] + pages.starts[rid], pa.int32()
            ),
            "hash": pa.array(pages.hashes.view(np.uint64), pa.uint64()),
        }
    )
    for name, t in (("requests", req), ("events", ev), ("blocks", blocks), ("pages", pg)):
        con.register(f"_{name}", t)
        con.sql(f"CREATE TABLE {name} AS SELECT * FROM _{name}")
    return con, pages, rc, ec


def _check(requests: list[Request], events: list[StoredEvent], ps: int) -> Any:
    ref = attribute(requests, events, ps)
    con, pages, rc, ec = _connect(requests, events, ps)
    got, per, split = attr.attribute_sql(con, "SELECT * FROM pages", ps, any_prompt=True)
    for f in FIELDS:
        assert _plain(getattr(got, f)) == getattr(ref, f), f
    assert per.rid.to_pylist() == [r.rid for r in requests]
    assert got.requests_without_prefill_store == ref.requests_without_prefill_store
    assert split == attr.any_prompt_split_arrays(pages, rc, ec)
    # its scratch tables are gone
    left = con.sql(
        "SELECT table_name FROM duckdb_tables() WHERE starts_with(table_name, '_a_')"
    ).fetchall()
    assert left == []
    # the report's cache: each request's pages from its cached prefix on -- the same
    # attribution (no cached page is a candidate)
    con, _, _, _ = _connect(requests, events, ps, cut=True)
    got, _, _ = attr.attribute_sql(con, "SELECT * FROM pages", ps)
    for f in FIELDS:
        assert _plain(getattr(got, f)) == getattr(ref, f), (f, "cut")
    return ref


@settings(max_examples=80, deadline=None)
@given(scenario())
def test_property_sql_equals_reference(case: tuple[list[Request], list[StoredEvent], int]) -> None:
    _check(*case)


def test_golden_restore_after_eviction_and_empty() -> None:
    x = Request("x", [1, 2, 3], [9], 0, 0, 10, 0, 0)
    y = Request("y", [1, 2, 3], [9], 0, 100, 110, 0, 0)
    c = _u64_chain([1, 2, 3], 1)
    res = _check([x, y], [StoredEvent(0, 5, c), StoredEvent(1, 105, c)], 1)
    assert res.req_prompt_blocks == [3, 3]
    _check([], [StoredEvent(0, 0, [1, 2]), StoredEvent(1, 3, [])], 4)
    _check([Request("a", [1, 2, 3, 4], [5], 0, 0, 1)], [], 4)


def _bundles(fixture_bundle: Path) -> list[Path]:
    corpus = [CORPUS / name / "bundle" for name in ("p16-chunk256-evict", "lpm-long")]
    return [fixture_bundle, *corpus]


@pytest.mark.parametrize("which", [0, 1, 2])
def test_ingested_bundle_sql_equals_arrays(
    which: int, fixture_bundle: Path, tmp_path: Path
) -> None:
    bundle = _bundles(fixture_bundle)[which]
    assert bundle.exists(), f"{bundle} is vendored in the repository; it must be there"
    ing = ingest.ingest(bundle, tmp_path / "pq")
    con = ksql.connect(ing)
    for ps in (1, 16):
        rids, rc, ec = attr.load_columns(ing, con)
        pages = kpages.load(ing, con, ps)  # each request's pages from its cached prefix on
        every = kpages.load(ing, con, ps, full=True)
        assert pages.starts.any() and len(pages.hashes) < len(every.hashes)
        ref = attr.attribute_arrays(pages, rc, ec, ps)
        path = kpages.ensure_file(ing, con, ps)
        full = kpages.ensure_file(ing, con, ps, full=True)
        assert path is not None and full is not None and path != full
        got, per, _ = attr.attribute_sql(con, kpages.relation(path), ps)
        # every page: the same attribution (the cached pages are never a candidate), and
        # the peer split, which needs them
        got_full, _, split = attr.attribute_sql(con, kpages.relation(full), ps, any_prompt=True)
        for f in FIELDS:
            assert _plain(getattr(got, f)) == getattr(ref, f), (bundle.name, ps, f)
            assert _plain(getattr(got_full, f)) == getattr(ref, f), (bundle.name, ps, f)
        ref_full = attr.attribute_arrays(every, rc, ec, ps)
        for f in FIELDS:
            assert _plain(getattr(ref_full, f)) == _plain(getattr(ref, f)), (bundle.name, ps, f)
        assert per.rid.to_pylist() == rids
        assert per.cached_tokens.to_pylist() == rc.cached_tokens
        assert split == attr.any_prompt_split_arrays(every, rc, ec)
        assert ref.stored_blocks > 0


@pytest.mark.parametrize("peer", [False, True])
def test_metrics_sql_path_equals_in_memory_fallback(
    peer: bool, fixture_bundle: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The report's metrics are the same whether attribution runs in DuckDB (the page cache
    written) or in memory (a cache that cannot be written: ``ensure_file`` gives None)."""
    from kvcadence.analysis import metrics

    ing = ingest.ingest(fixture_bundle, tmp_path / "pq")
    sql_path = metrics.compute(ing, peer_compatible=peer)
    assert kpages.cache_path(ing, int(ing.info.get("page_size") or 1), full=peer).exists()
    monkeypatch.setattr(kpages, "ensure_file", lambda *a, **k: None)
    mem = metrics.compute(ing, peer_compatible=peer)
    attr_keys = [k for k in mem.metrics if k.startswith("attribution.")]
    assert len(attr_keys) > 10
    assert {k: sql_path.metrics[k] for k in attr_keys} == {k: mem.metrics[k] for k in attr_keys}
    assert sql_path.attribution_kinds == mem.attribution_kinds


def test_ensure_file_streams_the_same_pages(fixture_bundle: Path, tmp_path: Path) -> None:
    """``ensure_file`` writes the cache ``load`` would (and ``load`` then reads it back)."""
    ing = ingest.ingest(fixture_bundle, tmp_path / "pq")
    con = ksql.connect(ing)
    whole = kpages.compute(ing, con, 4)
    path = kpages.ensure_file(ing, con, 4)
    assert path == kpages.cache_path(ing, 4)
    got = kpages.load(ing, con, 4)
    assert np.array_equal(got.offsets, whole.offsets)
    assert np.array_equal(got.hashes, whole.hashes)
    assert kpages.ensure_file(ing, con, 4) == path  # present: reused
