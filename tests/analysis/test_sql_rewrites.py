"""The linear-time SQL of ``metrics`` equals the original correlated-subquery definitions.

``orphan_parent_events`` (first-store join instead of NOT EXISTS), the removal-in-flight share
(ASOF join instead of EXISTS ... BETWEEN), flush classification (per-batch last clear + ASOF
on flush notes) and the size histograms (one GROUP BY) are checked against the original
queries, kept here as the reference, on random bundles.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvcadence.analysis import ingest, metrics, sql
from kvcadence.format.bundle import BundleWriter
from kvcadence.format.schema import Annotation, RequestRecord
from tests.analysis.helpers import T0, cleared, header, removed, stored, write_bundle

MS = 1_000_000

REF_ORPHANS = (
    "SELECT count(*) FROM events e WHERE e.kind = 'stored' AND e.parent_hash IS NOT NULL "
    "AND NOT EXISTS (SELECT 1 FROM blocks b JOIN events s "
    "ON b.event_id = s.event_id WHERE b.kind = 'stored' AND b.hash = e.parent_hash "
    "AND s.endpoint = e.endpoint AND s.epoch = e.epoch "
    "AND (s.seq < e.seq OR (s.seq = e.seq AND s.idx < e.idx)))"
)
REF_IN_FLIGHT = (
    "SELECT count(*), count(*) FILTER (EXISTS (SELECT 1 FROM batches b WHERE b.n_removed > 0 "
    "AND b.recv_ns BETWEEN r.send_ns AND r.finish_ns)) FROM requests r"
)
REF_FLUSH = """
    SELECT count(*) FILTER (flush), count(*) FILTER (NOT flush) FROM (
      SELECT (EXISTS (SELECT 1 FROM events c WHERE c.batch_id = r.batch_id
                       AND c.kind = 'cleared' AND c.idx > r.idx)
              OR EXISTS (SELECT 1 FROM notes n WHERE n.kind ILIKE '%flush%'
                       AND abs(n.recv_ns - r.recv_ns) <= 1000000000)) AS flush
      FROM events r WHERE kind = 'removed')
"""

_ev = st.one_of(
    st.builds(
        lambda hs, p: stored(hs, parent=p),
        st.lists(st.integers(1, 12), min_size=1, max_size=3),
        st.none() | st.integers(1, 12),
    ),
    st.builds(removed, st.lists(st.integers(1, 12), min_size=1, max_size=3)),
    st.just(cleared()),
)


@settings(
    max_examples=12,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(
    msgs=st.lists(
        st.tuples(st.integers(0, 3000), st.lists(_ev, min_size=1, max_size=4), st.integers(0, 1)),
        min_size=1,
        max_size=12,
    ),
    reqs=st.lists(
        st.tuples(st.none() | st.integers(0, 3000), st.none() | st.integers(0, 3000)),
        max_size=6,
    ),
    notes=st.lists(st.integers(0, 4000), max_size=2),
)
def test_rewrites_equal_reference(
    tmp_path_factory: Any, msgs: list[Any], reqs: list[Any], notes: list[int]
) -> None:
    path: Path = tmp_path_factory.mktemp("rw") / "b"
    msgs = sorted(msgs, key=lambda m: m[0])  # arrival order = time order
    write_bundle(
        path,
        msgs,
        [
            RequestRecord(
                rid=f"r{i}",
                input_ids=[1, 2],
                output_ids=[3],
                send_ns=None if s is None else T0 + s * MS,
                finish_ns=None if f is None else T0 + f * MS,
            )
            for i, (s, f) in enumerate(reqs)
        ],
        hdr=header(ranks=2),
    )
    if notes:
        w = BundleWriter.append(path)
        for t in notes:
            w.write(Annotation(kind="flush_cache", recv_ns=T0 + t * MS))
        w.close()
    ing = ingest.ingest(path)
    m = metrics.compute(ing)
    con = sql.connect(ing)
    assert m.metrics["orphan_parent_events"] == sql.one(con, REF_ORPHANS)[0]
    n, with_rm = sql.one(con, REF_IN_FLIGHT)
    assert m.metrics["requests.share_with_removal_in_flight"] == (with_rm / n if n else None)
    fe, ce = sql.one(con, REF_FLUSH)
    assert (m.metrics["removal.flush_events"], m.metrics["removal.capacity_events"]) == (fe, ce)
    for name, kind in (
        ("blocks_per_stored_event", "stored"),
        ("blocks_per_removed_event", "removed"),
    ):
        h = m.histograms[name]
        for bucket, (_, lo, hi) in zip(h["buckets"], metrics.BUCKETS, strict=True):
            cond = f"n_blocks >= {lo}" + (f" AND n_blocks <= {hi}" if hi is not None else "")
            want = sql.one(
                con,
                f"SELECT count(*), coalesce(sum(n_blocks), 0) FROM events "
                f"WHERE kind = '{kind}' AND {cond}",
            )
            i = h["buckets"].index(bucket)
            assert (h["events"][i], h["blocks"][i]) == tuple(int(x) for x in want)
