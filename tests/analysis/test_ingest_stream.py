"""Streaming ingest: tables written in chunks (row groups) equal the tables built whole, and
de-duplication by runs of seqs answers as a set of (endpoint, epoch, seq) would."""

from __future__ import annotations

import random
from pathlib import Path

import pyarrow.parquet as pq
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvcadence.analysis import ingest, records
from kvcadence.analysis.seqset import SeenSeqs
from kvcadence.format import wire
from kvcadence.format.bundle import BundleWriter
from kvcadence.format.schema import Annotation, BlockStored, KVEventBatch, RequestRecord
from kvcadence.gcpause import gc_paused
from tests.analysis.helpers import T0, cleared, header, removed


def _mixed_bundle(path: Path, seed: int = 5) -> Path:
    """Messages of two endpoints with duplicates and out-of-order (replayed) seqs, clears,
    an unknown event, requests and notes interleaved (long and empty id lists)."""
    rng = random.Random(seed)
    seqs = [(ep, s) for ep in (0, 1) for s in range(700)]
    rng.shuffle(seqs[200:900])  # a stretch arrives out of order (gap recovery)
    seqs += rng.sample(seqs, 60)  # duplicates
    with BundleWriter(path, header(page_size=4)) as w:
        for i, (ep, seq) in enumerate(seqs):
            evs: list = []
            for _ in range(rng.randrange(0, 6)):
                hs = [rng.randrange(-(2**63), 2**63) for _ in range(rng.choice([0, 1, 3, 9]))]
                if rng.random() < 0.4:
                    evs.append(removed(hs))
                else:
                    toks = list(range(rng.randrange(0, 40)))
                    evs.append(BlockStored(hs, rng.choice([None, 7]), toks, 4, None, "GPU"))
            if seq % 97 == 3:
                evs.append(cleared())
            payload = wire.encode_batch(KVEventBatch(seq / 1000, evs, ep))
            if seq == 650 and ep == 1:
                import msgspec

                payload = msgspec.msgpack.encode([1.0, [{"type": "BlockUpdated"}], None])
            w.write_event(
                endpoint=ep, seq=seq, recv_ns=T0 + i, topic="", payload=payload, via=0, epoch=0
            )
            if i % 37 == 0:  # a note now and then (the sim's visibility kind, with data)
                w.write(Annotation("visibility", T0 + i, {"seq": seq, "t": [i, i + 1]}))
            if i % 5 == 0:
                n = rng.choice([0, 3, 50, 400])
                ids = [rng.randrange(2**20) for _ in range(n)]
                w.write(RequestRecord(rid=f"r{i}", input_ids=ids, output_ids=ids[: i % 9]))
    return path


def test_chunked_tables_equal_whole_tables(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Chunks of 50 events / 2,000 request ids (dozens of row groups, ids offset per chunk)
    give exactly the tables of one chunk, in memory and in the Parquet cache."""
    b = _mixed_bundle(tmp_path / "b")
    with gc_paused():
        whole, whole_info = records._build_tables(b, views=True, raw=True, ids=True)
    monkeypatch.setattr(records, "CHUNK_EVENTS", 50)
    monkeypatch.setattr(records, "CHUNK_REQUEST_IDS", 2000)
    monkeypatch.setattr(records, "CHUNK_NOTES", 3)
    with gc_paused():
        chunked, chunked_info = records._build_tables(b, views=True, raw=True, ids=True)
    assert chunked_info == whole_info
    assert whole_info["duplicates"] == 60 and whole_info["unknown_events"] == 1
    ing = ingest.ingest(b, ids=True)
    assert ing.manifest["tables"] == {name: t.num_rows for name, t in whole.items()}
    for name, table in whole.items():
        assert chunked[name].equals(table), name
        assert pq.read_table(ing.path(name)).equals(table), name
    assert pq.ParquetFile(ing.path("events")).metadata.num_row_groups > 20
    assert pq.ParquetFile(ing.path("requests")).metadata.num_row_groups >= 2
    assert pq.ParquetFile(ing.path("notes")).metadata.num_row_groups > 10
    assert whole["notes"].num_rows == 40  # 1,460 messages, one note in 37
    ev = whole["events"].to_pydict()
    assert ev["event_id"] == list(range(len(ev["event_id"])))
    assert whole["batches"].column("batch_id").to_pylist() == list(range(1400))


def test_chunks_bounded_by_payload_bytes_equal_whole_tables(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Chunks cut by payload bytes (a page-size-1 capture's few events of many blocks each),
    and raw arrays converted by bytes too: the tables of one chunk, in many row groups."""
    b = _mixed_bundle(tmp_path / "b")
    with gc_paused():
        whole, whole_info = records._build_tables(b, views=True, raw=True, ids=True)
    monkeypatch.setattr(records, "CHUNK_PAYLOAD_BYTES", 4000)
    monkeypatch.setattr(records, "RAW_PAYLOAD_BYTES", 700)
    with gc_paused():
        chunked, chunked_info = records._build_tables(b, views=True, raw=True, ids=True)
    assert chunked_info == whole_info
    for name, table in whole.items():
        assert chunked[name].equals(table), name
    ing = ingest.ingest(b, ids=True)
    assert pq.ParquetFile(ing.path("blocks")).metadata.num_row_groups > 20
    for name, table in whole.items():
        assert pq.read_table(ing.path(name)).equals(table), name


def test_retry_after_raw_check_failure_starts_the_files_over(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A bytes hash late in the bundle: the raw pass fails after chunks were written; the
    checked pass rewrites every table from the start (no rows of the failed pass remain)."""
    import msgspec

    b = _mixed_bundle(tmp_path / "b")
    bad = [1.0, [{"type": "BlockRemoved", "block_hashes": [b"\x00" * 7 + b"\x09"]}], 0]
    with BundleWriter.append(b) as w:
        w.write_event(
            endpoint=0,
            seq=5000,
            recv_ns=T0 + 10**6,
            topic="",
            payload=msgspec.msgpack.encode(bad),
            via=0,
            epoch=0,
        )
    monkeypatch.setattr(records, "CHUNK_EVENTS", 50)
    ing = ingest.ingest(b, ids=True)
    with gc_paused():
        lst, _ = records._build_tables(b, views=True, raw=False, ids=True)
    for name, table in lst.items():
        assert pq.read_table(ing.path(name)).equals(table), name
    assert pq.read_table(ing.path("blocks")).column("hash").to_pylist()[-1] == 9


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 2), st.integers(0, 1), st.integers(-3, 40))))
def test_seen_seqs_answers_as_a_set(keys: list[tuple[int, int, int]]) -> None:
    seen = SeenSeqs()
    ref: set[tuple[int, int, int]] = set()
    for key in keys:
        assert seen.add(*key) == (key not in ref)
        ref.add(key)
    for (ep, epoch), (starts, ends) in seen.runs.items():
        assert all(a <= b for a, b in zip(starts, ends, strict=True))
        assert all(e + 1 < s for e, s in zip(ends[:-1], starts[1:], strict=True))  # disjoint, apart
        got = {(ep, epoch, s) for a, b in zip(starts, ends, strict=True) for s in range(a, b + 1)}
        assert got == {k for k in ref if k[:2] == (ep, epoch)}


def test_seen_seqs_in_order_is_one_run() -> None:
    seen = SeenSeqs()
    for s in range(10_000):
        assert seen.add(0, 0, s)
    assert len(seen) == 1
