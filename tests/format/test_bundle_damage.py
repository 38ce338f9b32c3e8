"""Damaged multi-segment bundles: a missing, emptied, replaced or dangling middle
segment and a damaged segment header are reported, and cost that segment, not the bundle."""

from __future__ import annotations

import json
import os
import struct
import time
from pathlib import Path

import msgspec
import pytest

from kvcadence.cli import main
from kvcadence.errors import BundleError
from kvcadence.format.bundle import BundleReader, BundleWriter, list_segments
from kvcadence.format.schema import (
    FORMAT_MAJOR,
    VIA_LIVE,
    EndpointInfo,
    EventFrame,
    Header,
    RequestRecord,
)

BATCH = msgspec.msgpack.encode([1.5, [{"type": "AllBlocksCleared"}], 0])
N_EVENTS, N_REQUESTS = 134, 120


def _header() -> Header:
    return Header(
        format_major=FORMAT_MAJOR,
        format_minor=0,
        source="real",
        kvcadence_version="0.1.0",
        start_ns=time.time_ns(),  # two recordings differ (and so do their identities)
        endpoints=[EndpointInfo(0, "tcp://127.0.0.1:5557", None, 0, "kv")],
    )


def _event(seq: int) -> EventFrame:
    return EventFrame(0, seq, 1000 + seq, "kv", VIA_LIVE, 0, False, msgspec.Raw(BATCH), -1)


def _multi_segment(path: Path) -> list[Path]:
    """134 events and 120 requests over several small segments, closed cleanly."""
    w = BundleWriter(path, _header(), segment_bytes=2048)
    for i in range(N_EVENTS):
        w.write(_event(i))
        if i < N_REQUESTS:
            w.write(RequestRecord(rid=f"r{i}", input_ids=[1, 2, 3]))
    w.close()
    segs = list_segments(path)
    assert len(segs) >= 5
    return segs


def _inspect_cli(path: Path, capsys, *extra: str) -> tuple[int, dict, str]:
    rc = main(["inspect", str(path), "--json", *extra])
    out, err = capsys.readouterr()
    return rc, json.loads(out), err


def test_whole_bundle_reads_clean_with_no_shortfall(tmp_path: Path, capsys) -> None:
    _multi_segment(tmp_path / "b")
    r = BundleReader(tmp_path / "b")
    assert len(r.requests()) == N_REQUESTS
    rep = r.report
    assert rep.shortfall == [] and rep.missing_segments == [] and not rep.damaged
    rc, s, _ = _inspect_cli(tmp_path / "b", capsys, "--strict")
    assert rc == 0 and s["damaged"] is False and s["missing_records"] == 0


def _delete(seg: Path) -> None:
    seg.unlink()


def _empty(seg: Path) -> None:
    seg.write_bytes(b"")


def _directory(seg: Path) -> None:
    seg.unlink()
    seg.mkdir()


def _dangling(seg: Path) -> None:
    seg.unlink()
    os.symlink(seg.parent / "nowhere.kvcb", seg)


@pytest.mark.parametrize("damage", [_delete, _empty, _directory, _dangling])
def test_lost_middle_segment_is_reported_and_fails_strict(tmp_path: Path, capsys, damage) -> None:
    segs = _multi_segment(tmp_path / "b")
    mid = segs[len(segs) // 2]
    damage(mid)
    r = BundleReader(tmp_path / "b")
    got = len(r.requests())
    assert got < N_REQUESTS  # the segment held some
    rep = r.report
    assert [m[0] for m in rep.missing_segments] == [mid.name]
    # the trailer's counts (header + events + requests + a SegmentStart per later segment)
    # against what was read
    ((where, want, read),) = rep.shortfall
    assert where == segs[-1].name and want == 1 + N_EVENTS + N_REQUESTS + len(segs) - 1
    assert read < want
    assert rep.missing_records == want - read and rep.damaged
    assert rep.clean_shutdown  # the trailer itself is fine: the shortfall is what says so
    rc, s, err = _inspect_cli(tmp_path / "b", capsys)
    assert rc == 0 and s["damaged"] and s["missing_records"] == want - read
    assert s["missing_segments"][0]["segment"] == mid.name
    rc, _, err = _inspect_cli(tmp_path / "b", capsys, "--strict")
    assert rc == 1 and err.count("\n") == 1 and mid.name in err
    assert main(["inspect", str(tmp_path / "b")]) == 0
    text = capsys.readouterr().out
    assert "LOST" in text and mid.name in text and "records missing" in text
    with pytest.raises(BundleError, match=mid.name):
        BundleReader(tmp_path / "b", strict=True)


def test_missing_records_without_a_missing_segment_are_a_shortfall(tmp_path: Path) -> None:
    """Frames cut out of the middle of a segment (no hole in the numbering, no corrupt
    bytes left behind): only the trailer's counts can tell."""
    path = tmp_path / "b"
    w = BundleWriter(path, _header())
    for i in range(10):
        w.write(_event(i))
    w.close()
    (seg,) = list_segments(path)
    data = seg.read_bytes()
    pos, ends = 8, []
    while pos < len(data):
        (n,) = struct.unpack_from("<I", data, pos)
        pos += 8 + n
        ends.append(pos)
    seg.write_bytes(data[: ends[3]] + data[ends[5] :])  # frames 4 and 5 (events 3, 4) gone
    r = BundleReader(path)
    assert [e.seq for e in r.events()] == [0, 1, 2, 5, 6, 7, 8, 9]
    assert r.report.shortfall == [(seg.name, 11, 9)] and r.report.corrupt == []


@pytest.mark.parametrize("how", ["magic", "major"])
def test_damaged_segment_header_costs_that_segment_only(tmp_path: Path, capsys, how) -> None:
    segs = _multi_segment(tmp_path / "b")
    mid = segs[2]
    data = bytearray(mid.read_bytes())
    if how == "magic":
        data[0:4] = b"XXXX"
    else:
        struct.pack_into("<H", data, 4, FORMAT_MAJOR + 1)
    mid.write_bytes(bytes(data))
    r = BundleReader(tmp_path / "b")
    assert [n for n, _ in r.refused_segments] == [mid.name]
    seqs = [e.seq for e in r.events()]
    assert 0 < len(seqs) < N_EVENTS and seqs[0] == 0 and seqs[-1] == N_EVENTS - 1
    rep = r.report
    assert rep.refused_segments and rep.shortfall and rep.damaged
    rc, s, _ = _inspect_cli(tmp_path / "b", capsys)
    assert rc == 0 and s["refused_segments"][0]["segment"] == mid.name
    assert s["messages"] == len(seqs)
    rc, _, err = _inspect_cli(tmp_path / "b", capsys, "--strict")
    assert rc == 1 and mid.name in err
    with pytest.raises(BundleError, match=mid.name):
        BundleReader(tmp_path / "b", strict=True)
    # the other commands read it too (report/sql ingest goes through the same reader)
    assert main(["sql", str(tmp_path / "b"), "SELECT count(*) AS n FROM batches"]) == 0
    assert str(len(seqs)) in capsys.readouterr().out


def test_append_refuses_a_bundle_whose_last_segment_is_refused(tmp_path: Path) -> None:
    segs = _multi_segment(tmp_path / "b")
    data = bytearray(segs[-1].read_bytes())
    data[0:4] = b"XXXX"
    segs[-1].write_bytes(bytes(data))
    before = segs[-2].read_bytes()
    with pytest.raises(BundleError, match="cannot append"):
        BundleWriter.append(tmp_path / "b")
    assert segs[-2].read_bytes() == before


def test_report_data_quality_names_the_lost_segment(tmp_path: Path) -> None:
    from kvcadence.analysis import report

    segs = _multi_segment(tmp_path / "b")
    segs[len(segs) // 2].unlink()
    report.make_report(
        [str(tmp_path / "b")], tmp_path / "r", cache_dirs=[str(tmp_path / "c")], plots=False
    )
    doc = json.loads((tmp_path / "r" / "report.json").read_text())
    q = doc["bundles"][0]["quality"]
    assert q["quality.missing_segments"]["value"] == 1
    assert q["quality.missing_records"]["value"] > 0
    md = (tmp_path / "r" / "report.md").read_text()
    assert "quality.missing_records" in md.split("## Headline metrics")[0]


def test_every_later_segment_names_its_bundle(tmp_path: Path) -> None:
    from kvcadence.format.bundle import bundle_identity
    from kvcadence.format.schema import SegmentStart

    segs = _multi_segment(tmp_path / "b")
    r = BundleReader(tmp_path / "b")
    assert r.bundle_id == bundle_identity(msgspec.msgpack.encode(r.header))
    for i, seg in enumerate(segs[1:], start=1):
        data = seg.read_bytes()
        (n,) = struct.unpack_from("<I", data, 8)
        start = msgspec.msgpack.decode(data[16 : 16 + n], type=SegmentStart)
        assert (start.bundle_id, start.index) == (r.bundle_id, i)
    assert not any(isinstance(x, SegmentStart) for x in r.records())  # never yielded


@pytest.mark.parametrize("what", ["later segment", "first segment"])
def test_segment_of_another_bundle_is_refused_and_reported(tmp_path: Path, capsys, what) -> None:
    """Regression: a segment spliced in from another bundle was merged silently (two
    headers, 255 messages under one stream)."""
    segs = _multi_segment(tmp_path / "b")
    other = _multi_segment(tmp_path / "other")  # same content, another start: another id
    assert BundleReader(tmp_path / "b").bundle_id != BundleReader(tmp_path / "other").bundle_id
    victim = segs[2]
    donor = other[2] if what == "later segment" else other[0]
    victim.write_bytes(donor.read_bytes())
    r = BundleReader(tmp_path / "b")
    seqs = [e.seq for e in r.events()]
    assert len(seqs) == len(set(seqs))  # nothing of the other bundle merged in
    headers = [x for x in r.records() if isinstance(x, Header)]
    assert len(headers) == 1
    rep = r.report
    assert [n for n, _ in rep.refused_segments] == [victim.name]
    assert "another bundle" in rep.refused_segments[0][1]
    assert rep.shortfall and rep.damaged  # its own records are missing
    rc, s, _ = _inspect_cli(tmp_path / "b", capsys, "--strict")
    assert rc == 1 and s["refused_segments"][0]["segment"] == victim.name
    with pytest.raises(BundleError, match="another bundle"):
        list(BundleReader(tmp_path / "b", strict=True).records())


def test_appended_segments_carry_the_identity_too(tmp_path: Path) -> None:
    _multi_segment(tmp_path / "b")
    w = BundleWriter.append(tmp_path / "b")
    w.write(RequestRecord(rid="late", input_ids=[1]))
    w.close()
    r = BundleReader(tmp_path / "b")
    assert len(r.requests()) == N_REQUESTS + 1
    assert not r.report.damaged and r.report.refused_segments == []
