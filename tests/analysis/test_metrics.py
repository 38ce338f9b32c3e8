"""Golden metric values on small hand-made bundles with known answers."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvcadence.analysis import ingest, metrics, sql
from kvcadence.format.schema import UNRECORDED_SOURCE, Annotation, Gap, RequestRecord
from tests.analysis.helpers import T0, cleared, header, removed, stored, write_bundle

MS = 1_000_000


def _golden(tmp_path: Path) -> Path:
    reqs = [
        RequestRecord(
            rid="a",
            input_ids=[1, 2, 3],
            output_ids=[4, 5],
            cached_tokens=0,
            send_ns=T0 + 500 * MS,
            finish_ns=T0 + 2500 * MS,
        ),
        RequestRecord(
            rid="b",
            input_ids=[1, 2, 3, 4],
            output_ids=[6, 7, 8],
            cached_tokens=2,
            send_ns=T0 + 2600 * MS,
            finish_ns=T0 + 2900 * MS,
        ),
    ]
    return write_bundle(
        tmp_path / "g",
        [
            (0, [cleared()]),
            (1000, [stored([1, 2, 3]), stored([4])]),
            (2000, [removed([1, 2]), stored([5, 6], parent=4)]),
            (3000, [removed([3])]),
        ],
        reqs,
        hdr=header(page_size=1, max_tokens=10),
    )


@pytest.fixture(scope="module")
def golden(tmp_path_factory: pytest.TempPathFactory) -> metrics.BundleMetrics:
    return metrics.compute(ingest.ingest(_golden(tmp_path_factory.mktemp("golden"))))


def test_counts_and_per_request(golden: metrics.BundleMetrics) -> None:
    m = golden.metrics
    assert (m["messages"], m["events"]) == (4, 6)
    assert (m["stored_events"], m["removed_events"], m["cleared_events"]) == (3, 2, 1)
    assert m["requests"] == 2
    assert m["stored_events_per_request"] == 1.5
    assert m["removed_events_per_request"] == 1.0
    assert (m["total_stored_blocks"], m["total_removed_blocks"], m["total_stored_tokens"]) == (
        6,
        3,
        6,
    )
    assert m["share_single_block_stores"] == pytest.approx(1 / 3)
    assert m["span_s"] == 3.0
    assert m["events_per_second"] == 2.0
    assert m["stored_events_per_completion_token"] == pytest.approx(3 / 5)
    assert m["orphan_parent_events"] == 0


def test_distributions_linear_interpolation(golden: metrics.BundleMetrics) -> None:
    m = golden.metrics
    # stored sizes [3, 1, 2]; removed sizes [2, 1]
    assert m["blocks_per_stored_event.n"] == 3
    assert m["blocks_per_stored_event.mean"] == 2.0
    assert m["blocks_per_stored_event.median"] == 2.0
    assert m["blocks_per_stored_event.p90"] == pytest.approx(2.8)
    assert m["blocks_per_stored_event.p10"] == pytest.approx(1.2)
    assert (m["blocks_per_stored_event.min"], m["blocks_per_stored_event.max"]) == (1, 3)
    assert m["blocks_per_removed_event.median"] == 1.5
    assert m["blocks_per_removed_event.p99"] == pytest.approx(1.99)
    # events per message [1, 2, 2, 1]
    assert m["events_per_message.mean"] == 1.5
    assert m["events_per_message.median"] == 1.5


def test_composition_histograms_series(golden: metrics.BundleMetrics) -> None:
    m = golden.metrics
    assert m["message_composition.cleared"] == 1
    assert m["message_composition.stored_only"] == 1
    assert m["message_composition.removed_and_stored"] == 1
    assert m["message_composition.removed_only"] == 1
    h = golden.histograms["blocks_per_stored_event"]
    assert h["buckets"] == ["1", "2-8", "9-64", "65-1024", "1025-8192", ">8192"]
    assert h["events"] == [1, 2, 0, 0, 0, 0]
    assert h["blocks"] == [1, 5, 0, 0, 0, 0]
    assert golden.series["t_s"] == [0, 1, 2, 3]
    assert golden.series["events"] == [1, 2, 2, 1]
    assert golden.series["stored_blocks"] == [0, 4, 2, 0]


def test_removals_pool_pressure_and_window(golden: metrics.BundleMetrics) -> None:
    m = golden.metrics
    assert m["removal.pool_pages"] == 10
    assert (m["removal.capacity_events"], m["removal.flush_events"]) == (2, 0)
    # resident before the removals: 3+1 = 4, then 4-2+2 = 4
    assert m["removal.resident_blocks_at_removal.mean"] == 4.0
    assert m["removal.pool_pressure_at_removal.median"] == pytest.approx(0.4)
    assert golden.window["source"] == "from the first removal"
    assert m["window.start_s"] == 2.0 and m["window.end_s"] == 3.0
    assert m["window.events"] == 3
    assert m["window.requests_finished"] == 2  # a at 2.5 s, b at 2.9 s
    assert m["window.stored_events_per_request"] == 0.5
    assert m["window.removed_events_per_request"] == 1.0


def test_resident_blocks_restart_at_a_clear_mid_stream(tmp_path: Path) -> None:
    def resident(name: str, messages: list[tuple[int, list[object]]]) -> list[object]:
        b = write_bundle(tmp_path / name, messages, hdr=header(page_size=1, max_tokens=10))
        m = metrics.compute(ingest.ingest(b)).metrics
        assert m["removal.flush_events"] == 0
        return [m[f"removal.resident_blocks_at_removal.{k}"] for k in ("n", "min", "max")]

    # no clear: the running sum of the stream (3 before the first removal, 3 - 1 + 1 = 3)
    assert resident(
        "none",
        [
            (0, [stored([1, 2, 3])]),
            (1000, [removed([1])]),
            (2000, [stored([4])]),
            (3000, [removed([2])]),
        ],
    ) == [2, 3, 3]
    # a clear after stores: the count starts again from 0 (2 before the second removal, not 4)
    assert resident(
        "mid",
        [
            (0, [stored([1, 2, 3])]),
            (1000, [removed([1])]),
            (2000, [cleared()]),
            (3000, [stored([7, 8])]),
            (4000, [removed([7])]),
        ],
    ) == [2, 2, 3]


def test_resident_streamed_sum_equals_the_sorted_window(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # two interleaved streams, a clear mid-stream, batches of 2 events (sums carried over)
    b = write_bundle(
        tmp_path / "b",
        [
            (0, [stored([1, 2, 3])], 0),
            (100, [stored([11, 12])], 1),
            (1000, [removed([1])], 0),
            (1500, [cleared(), stored([14])], 1),
            (2000, [stored([4]), removed([2])], 0),
            (2500, [stored([13]), removed([13])], 1),
            (3000, [removed([3, 4])], 0),
            (3500, [removed([14, 12])], 1),
        ],
        hdr=header(page_size=1, max_tokens=10, ranks=2),
    )
    ing = ingest.ingest(b)
    monkeypatch.setattr(metrics, "_RESIDENT_ROWS", 2)
    con = sql.connect(ing)
    c = metrics._Ctx(con, False)
    assert metrics._resident_rows(c) is not None
    got = metrics._removals(c, 10)
    q = "SELECT event_id, n_blocks, resident, recv_ns, flush FROM _removals ORDER BY event_id"
    streamed = con.sql(q).fetchall()
    metrics._removals_sorted(c)
    window = con.sql(q).fetchall()
    assert streamed == window
    # stream 0: 3; 3 - 1 + 1; 3 - 1. stream 1 from its clear: 1 + 1; 1 + 1 - 1
    assert [r[2] for r in streamed] == [3, 3, 2, 2, 1]
    # events out of (seq, idx) order in the file: the SQL window instead, the same figures
    path = str(ing.path("events")).replace("'", "''")
    con.sql(f"CREATE OR REPLACE TEMP VIEW events AS FROM read_parquet('{path}') ORDER BY seq DESC")
    assert metrics._resident_rows(c) is None
    # (the same rows; a mean's last bit follows the order DuckDB sums them in)
    assert metrics._removals(c, 10) == pytest.approx(got, rel=1e-12)
    assert con.sql(q).fetchall() == window


def test_requests_metrics(golden: metrics.BundleMetrics) -> None:
    m = golden.metrics
    assert m["requests.total_prompt_tokens"] == 7
    assert m["requests.total_cached_tokens"] == 2
    assert m["requests.cache_hit_rate"] == pytest.approx(2 / 7)
    assert m["requests.prompt_tokens.median"] == 3.5
    # a removal message (2.0 s, 3.0 s) falls inside a's [0.5, 2.5] s; none inside b's [2.6, 2.9]
    assert m["requests.share_with_removal_in_flight"] == 0.5


def test_user_window_and_peer_variant(tmp_path: Path) -> None:
    ing = ingest.ingest(_golden(tmp_path))
    w = metrics.compute(ing, window=(0.5, 1.5)).metrics
    assert w["window.events"] == 2 and w["window.requests_finished"] == 0
    peer = metrics.compute(ing, peer_compatible=True)
    assert peer.variant == "peer-compatible"
    assert peer.metrics["messages"] == 3  # late start: no seq 0
    assert peer.metrics["cleared_events"] == 0
    # nearest rank: sorted[min(n-1, floor(q*n))] of [1, 2, 3]
    assert peer.metrics["blocks_per_stored_event.p90"] == 3.0
    assert peer.metrics["blocks_per_stored_event.median"] == 2.0


def test_quality_flush_and_orphans(tmp_path: Path) -> None:
    b = write_bundle(
        tmp_path / "q",
        [
            (0, [stored([10, 11], parent=99)]),  # parent never seen: orphan
            (100, [removed([10]), cleared()]),  # removal followed by a clear: flush
            (200, [stored([12])]),
        ],
        gaps=[Gap(endpoint=0, epoch=0, first_seq=3, last_seq=5, recovered=2)],
        hdr=header(max_tokens=None),
        start_seq=7,
    )
    m = metrics.compute(ingest.ingest(b)).metrics
    assert m["orphan_parent_events"] == 1
    assert (m["removal.flush_events"], m["removal.capacity_events"]) == (1, 0)
    assert m["removal.pool_pages"] is None
    assert m["quality.gap_records"] == 1
    assert (m["quality.missing_seqs"], m["quality.recovered"], m["quality.unrecovered"]) == (
        3,
        2,
        1,
    )
    assert m["quality.first_seq_zero"] == 0
    assert m["quality.clean_shutdown"] == 1


def test_flush_annotation_and_per_rank(tmp_path: Path) -> None:
    b = tmp_path / "r"
    write_bundle(
        b,
        [
            (0, [stored([1, 2])], 0),
            (0, [stored([3])], 1),
            (50, [removed([1])], 0),
            (60, [removed([3])], 1),
        ],
        [
            RequestRecord(rid="x", input_ids=[1], dp_rank=0),
            RequestRecord(rid="y", input_ids=[1], dp_rank=1),
        ],
        hdr=header(ranks=2),
    )
    from kvcadence.format.bundle import BundleWriter

    w = BundleWriter.append(b)
    w.write(Annotation(kind="flush_cache", recv_ns=T0 + 60 * MS))
    w.close()
    res = metrics.compute(ingest.ingest(b))
    assert res.metrics["removal.flush_events"] == 2  # both within 1 s of the flush note
    assert sorted(res.per_rank) == ["0", "1"]
    assert res.per_rank["0"]["stored_events_per_request"] == 1.0
    assert res.per_rank["1"]["blocks_per_stored_event.median"] == 1.0
    assert res.metrics["quality.epochs"] == 2


def test_per_rank_figures_count_only_the_captures_own_requests(tmp_path: Path) -> None:
    """A sim bundle with requests the replay rebuilt from the KV events (``source``
    kv-events) on three ranks: each rank's per-request figures count its own requests only
    (the rebuilt ones on it left out), as the totals do."""
    b = tmp_path / "s"
    write_bundle(
        b,
        [(0, [stored([1, 2])], 0), (0, [stored([3])], 1), (0, [stored([4]), stored([5])], 2)],
        [
            RequestRecord(rid="x", input_ids=[1], dp_rank=0),
            RequestRecord(rid="y", input_ids=[1], dp_rank=1),
            RequestRecord(rid="z", input_ids=[1], dp_rank=2),
            RequestRecord(rid="kv-events-0", input_ids=[1], dp_rank=2, source=UNRECORDED_SOURCE),
        ],
        hdr=header(ranks=3),
    )
    res = metrics.compute(ingest.ingest(b))
    assert res.metrics["requests"] == 3
    assert sorted(res.per_rank) == ["0", "1", "2"]
    assert [res.per_rank[r]["requests"] for r in "012"] == [1, 1, 1]
    assert [res.per_rank[r]["stored_events_per_request"] for r in "012"] == [1.0, 1.0, 2.0]


def test_every_metric_has_a_definition(golden: metrics.BundleMetrics) -> None:
    for name in golden.metrics:
        unit, definition = metrics.DEFS[name]
        assert unit and definition
