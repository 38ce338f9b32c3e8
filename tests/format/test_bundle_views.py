"""Bundle reader fast paths: ``records(request_view=True)``, ``event_payload_view``, the
header read without reading segment 0 whole, and memory-mapped (non-last) segments -- each
must give exactly what the ordinary path gives, on clean, multi-segment and damaged bundles."""

from __future__ import annotations

import zlib
from pathlib import Path
from typing import Any

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvcadence.errors import BundleError, CorruptFrameError
from kvcadence.format import bundle as kb
from kvcadence.format.bundle import BundleReader, BundleWriter, event_payload, event_payload_view
from kvcadence.format.schema import (
    FORMAT_MAJOR,
    FORMAT_MINOR,
    Annotation,
    EndpointInfo,
    EventFrame,
    Gap,
    Header,
    RequestRecord,
    RequestRecordView,
)

BATCH = msgspec.msgpack.encode(
    [1795963124.5, [{"type": "BlockRemoved", "block_hashes": [-5, 7], "medium": "GPU"}], 0]
)
IDS = st.lists(st.integers(-(2**63), 2**63 - 1), max_size=50)


def _header() -> Header:
    return Header(
        format_major=FORMAT_MAJOR,
        format_minor=FORMAT_MINOR,
        source="real",
        kvcadence_version="test",
        sglang_version="0.5.23",
        server_info={"page_size": 1},
        endpoints=[EndpointInfo(0, "tcp://127.0.0.1:5557", None, 0, "kv")],
    )


def _request(i: int, inp: list[int], out: list[int]) -> RequestRecord:
    return RequestRecord(
        rid=f"r{i}",
        input_ids=inp,
        output_ids=out,
        send_ns=i,
        cached_tokens=i % 3,
        finish_reason="length",
        meta_info={"k": [i, "x"]},
    )


def _write(
    path: Path,
    requests: list[RequestRecord],
    segment_bytes: int = 256 << 20,
    compact: bool = True,
) -> Path:
    with BundleWriter(path, _header(), segment_bytes=segment_bytes, compact_requests=compact) as w:
        for i, r in enumerate(requests):
            w.write_event(endpoint=0, seq=i, recv_ns=i, topic="kv", payload=BATCH, via=0, epoch=0)
            w.write(r)
            if i % 5 == 0:
                w.write(Gap(0, 0, i, i, 0, "test", i))
            if i % 7 == 0:
                w.write(Annotation("note", i, {"i": i}))
        w.write_event(  # a payload that is not one msgpack value: stored bin-wrapped
            endpoint=0, seq=10**6, recv_ns=0, topic="kv", payload=b"\xc1raw", via=0, epoch=0
        )
    return path


def _as_ordinary(rec: Any) -> Any:
    """A RequestRecordView turned back into the RequestRecord it was decoded from."""
    if type(rec) is not RequestRecordView:
        return rec
    fields = msgspec.structs.asdict(rec)
    for k in ("input_ids", "output_ids"):
        fields[k] = msgspec.msgpack.decode(fields[k], type=list[int])
    return RequestRecord(**fields)


def _same_reads(path: Path) -> None:
    plain = BundleReader(path)
    views = BundleReader(path)
    want = list(plain.records())
    got = list(views.records(request_view=True))
    assert [_as_ordinary(r) for r in got] == want
    assert views.report == plain.report
    assert BundleReader(path).requests() == [r for r in want if type(r) is RequestRecord]


@settings(max_examples=25, deadline=None)
@given(st.lists(st.tuples(IDS, IDS), max_size=12), st.sampled_from([300, 1000, 256 << 20]))
def test_request_views_equal_ordinary_records(
    tmp_path_factory: pytest.TempPathFactory, ids: list[tuple[list[int], list[int]]], seg: int
) -> None:
    """Same records (views decode back to the same RequestRecords), same report, on one
    segment and on many small ones (all but the last memory-mapped)."""
    path = _write(
        tmp_path_factory.mktemp("b") / "b", [_request(i, a, b) for i, (a, b) in enumerate(ids)], seg
    )
    _same_reads(path)


def test_view_of_an_old_short_request_record_gets_the_defaults(tmp_path: Path) -> None:
    """A request written without the trailing fields (older writer) decodes with defaults."""
    body = msgspec.msgpack.encode(["request", "old", [1, 2]])
    view = msgspec.msgpack.decode(body, type=RequestRecordView)
    assert bytes(view.output_ids) == msgspec.msgpack.encode([])
    assert view.source == "driver" and view.meta_info == {}
    full = msgspec.msgpack.decode(body, type=RequestRecord)
    assert _as_ordinary(view) == full


def test_event_payload_view_equals_event_payload(tmp_path: Path) -> None:
    path = _write(tmp_path / "b", [_request(0, [1], [])])
    frames = list(BundleReader(path).events())
    assert any(f.payload_is_bin for f in frames) and any(not f.payload_is_bin for f in frames)
    for f in frames:
        assert bytes(event_payload_view(f)) == event_payload(f)


def _corrupt(seg: Path, offset: int) -> None:
    data = bytearray(seg.read_bytes())
    data[offset] ^= 0xFF
    seg.write_bytes(bytes(data))


@pytest.mark.parametrize("where", ["header frame", "later frame"])
def test_damaged_non_last_segment_reads_the_same_mapped(tmp_path: Path, where: str) -> None:
    """Corruption inside a memory-mapped segment: same resync, same report as reading it."""
    path = _write(tmp_path / "b", [_request(i, [i] * 40, [i]) for i in range(30)], 600)
    segs = kb.list_segments(path)
    assert len(segs) >= 3
    target = segs[0] if where == "header frame" else segs[1]
    _corrupt(target, kb.SEGMENT_HEADER_SIZE + kb.FRAME_HEADER_SIZE + 3)
    _same_reads_unmapped(path)


def _same_reads_unmapped(path: Path) -> None:
    """What a reader that maps nothing sees == what the mapping reader sees."""

    class NoMap(BundleReader):
        def _walk(self, seg: Path, report: Any, mapped: bool = False, unread: Any = None) -> Any:
            return super()._walk(seg, report, False, unread)

    plain = NoMap(path)
    want = list(plain.records())
    fast = BundleReader(path)
    assert list(fast.records()) == want
    assert fast.report == plain.report
    assert fast.report.corrupt


def test_header_read_without_the_whole_segment(tmp_path: Path) -> None:
    path = _write(tmp_path / "b", [_request(0, [1], [])])
    seg = kb.list_segments(path)[0]
    assert BundleReader._first_frame(seg) is not None
    assert BundleReader(path).header == _header()


@pytest.mark.parametrize("damage", ["crc", "length", "torn"])
def test_header_after_a_damaged_first_frame_falls_back_to_the_walk(
    tmp_path: Path, damage: str
) -> None:
    """A first frame that does not check out: the header is whatever the full walk finds
    (the next valid frame; a BundleError if that is not a header), strict raises."""
    path = _write(tmp_path / "b", [_request(0, [1], [])])
    seg = kb.list_segments(path)[0]
    data = bytearray(seg.read_bytes())
    if damage == "crc":
        data[kb.SEGMENT_HEADER_SIZE + 4] ^= 0xFF
    elif damage == "length":
        data[kb.SEGMENT_HEADER_SIZE : kb.SEGMENT_HEADER_SIZE + 4] = (10**9).to_bytes(4, "little")
    else:
        data = data[: kb.SEGMENT_HEADER_SIZE + 5]
    seg.write_bytes(bytes(data))
    assert BundleReader._first_frame(seg) is None
    with pytest.raises(BundleError, match="no readable header"):
        _ = BundleReader(path).header
    if damage != "torn":
        with pytest.raises(CorruptFrameError):
            _ = BundleReader(path, strict=True).header


def test_header_found_after_a_leading_corrupt_frame(tmp_path: Path) -> None:
    """Garbage frame before the header frame: the walk resyncs to the header, as before."""
    path = _write(tmp_path / "b", [_request(0, [1], [])])
    seg = kb.list_segments(path)[0]
    data = seg.read_bytes()
    junk = b"\x92\xa4junk\x01"
    frame = kb.FRAME_HEADER.pack(len(junk), zlib.crc32(junk) ^ 1) + junk
    h = kb.SEGMENT_HEADER_SIZE
    seg.write_bytes(data[:h] + frame + data[h:])
    assert BundleReader._first_frame(seg) is None
    assert BundleReader(path).header == _header()


@pytest.mark.parametrize("compact", [True, False])
def test_records_decoded_from_a_mapped_segment_outlive_the_reader(
    tmp_path: Path, compact: bool
) -> None:
    reqs = [_request(i, [i] * 40, [i]) for i in range(30)]
    path = _write(tmp_path / "b", reqs, 600, compact)
    reader = BundleReader(path)
    frames = [r for r in reader.records(request_view=True) if type(r) is EventFrame]
    views = [r for r in BundleReader(path).records(request_view=True) if type(r) is not EventFrame]
    del reader
    assert all(bytes(event_payload_view(f)) in (BATCH, b"\xc1raw") for f in frames)
    ids = [bytes(v.input_ids) for v in views if type(v) is RequestRecordView]
    if compact:  # built by the resolver: each id a msgpack uint32
        assert [msgspec.msgpack.decode(b) for b in ids] == [[i] * 40 for i in range(30)]
        assert all(b[3] == 0xCE for b in ids)
    else:  # the stored msgpack arrays, views into the mapped segment
        assert ids == [msgspec.msgpack.encode([i] * 40) for i in range(30)]


def test_a_segment_that_cannot_be_mapped_is_read(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = _write(tmp_path / "b", [_request(i, [i] * 40, [i]) for i in range(30)], 600)
    want = list(BundleReader(path).records())

    def refuse(*a: Any, **k: Any) -> Any:
        raise OSError("no mmap here")

    monkeypatch.setattr(kb.segments.mmap, "mmap", refuse)
    reader = BundleReader(path)
    assert list(reader.records()) == want
    assert not reader.report.corrupt


def test_request_view_mirrors_request_record() -> None:
    """Same fields in the same order, same tag and defaults (ids aside): a field added to
    RequestRecord must be added to the view too, or views would misread newer records."""
    assert RequestRecordView.__struct_fields__ == RequestRecord.__struct_fields__
    assert RequestRecordView.__struct_config__.tag == RequestRecord.__struct_config__.tag
    plain = msgspec.structs.asdict(RequestRecord(rid="x", input_ids=[]))
    view = msgspec.structs.asdict(
        msgspec.msgpack.decode(b"\x93\xa7request\xa1x\x90", type=RequestRecordView)
    )
    for k in ("input_ids", "output_ids"):
        assert msgspec.msgpack.decode(view.pop(k), type=list[int]) == plain.pop(k)
    assert view == plain


def test_records_reports_a_known_record_that_does_not_decode(tmp_path: Path) -> None:
    """A CRC-valid ``request`` frame with a body that is not a RequestRecord is reported as
    corrupt by ``records()`` exactly as by ``requests()`` (it used to vanish silently)."""
    path = _write(tmp_path / "b", [_request(i, [i, i + 1], [i]) for i in range(3)])
    seg = kb.list_segments(path)[-1]
    body = msgspec.msgpack.encode(["request", 7, "not a token list"])
    at = seg.stat().st_size
    with seg.open("ab") as f:
        f.write(kb.FRAME_HEADER.pack(len(body), zlib.crc32(body)) + body)
    size = kb.FRAME_HEADER_SIZE + len(body)
    for view in (False, True):
        everything = BundleReader(path)
        recs = list(everything.records(request_view=view))
        assert sum(type(r).__name__.startswith("RequestRecord") for r in recs) == 3
        assert everything.report.corrupt == [(seg.name, at, size)]
    only = BundleReader(path)
    assert len(only.requests()) == 3
    assert only.report.corrupt == [(seg.name, at, size)]
