"""Bundle writer/reader: round trips, torn tails, corruption, versions, append, flush, disk full."""

from __future__ import annotations

import struct
import subprocess
import sys
import textwrap
import zlib
from pathlib import Path

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvcadence.errors import (
    BundleError,
    CorruptFrameError,
    FormatVersionError,
    UsageError,
)
from kvcadence.format.bundle import (
    RECORD_TAGS,
    BundleReader,
    BundleWriter,
    event_payload,
    is_single_msgpack,
    list_segments,
)
from kvcadence.format.schema import (
    FORMAT_MAJOR,
    FORMAT_MINOR,
    VIA_LIVE,
    VIA_REPLAY,
    Annotation,
    EndpointInfo,
    Epoch,
    EventFrame,
    Gap,
    Header,
    RequestRecord,
    Trailer,
)

BATCH = msgspec.msgpack.encode(
    [1795963124.5, [{"type": "BlockRemoved", "block_hashes": [-5, 7], "medium": "GPU"}], 0]
)


def make_header(**kw: object) -> Header:
    base: dict[str, object] = dict(
        format_major=FORMAT_MAJOR,
        format_minor=FORMAT_MINOR,
        source="real",
        kvcadence_version="0.1.0",
        sglang_version="0.5.23",
        server_info={"page_size": 1, "kv_events": {"dp_size": 1}},
        kv_events_config='{"publisher":"zmq"}',
        command=["kvcadence", "capture"],
        start_ns=123,
        endpoints=[EndpointInfo(0, "tcp://127.0.0.1:5557", "tcp://127.0.0.1:5558", 0, "kv")],
        sim_config=None,
    )
    base.update(kw)
    return Header(**base)  # type: ignore[arg-type]


def event(seq: int, payload: bytes = BATCH, **kw: object) -> EventFrame:
    base: dict[str, object] = dict(
        endpoint=0,
        seq=seq,
        recv_ns=1_000 + seq,
        topic="kv-events",
        via=VIA_LIVE,
        epoch=0,
        payload_is_bin=False,
        payload=msgspec.Raw(payload),
        pass_index=-1,
    )
    base.update(kw)
    return EventFrame(**base)  # type: ignore[arg-type]


def all_kinds() -> list[object]:
    """One record of every type with every field away from its default."""
    return [
        event(0),
        event(1, via=VIA_REPLAY, endpoint=2, epoch=1, pass_index=7, topic=""),
        RequestRecord(
            rid="l0-s0-t0",
            input_ids=[1, 2, 3],
            output_ids=[4, 5],
            send_ns=10,
            first_token_ns=11,
            finish_ns=12,
            lane=0,
            session=1,
            turn=2,
            max_new_tokens=2,
            prompt_tokens=3,
            cached_tokens=1,
            completion_tokens=2,
            finish_reason="length",
            error="boom",
            dp_rank=0,
            source="import",
            think_ns=5,
            arrival_ns=9,
            meta_info={"id": "l0-s0-t0", "finish_reason": {"type": "length"}, "x": [1.5, None]},
        ),
        Gap(0, 0, 5, 9, 2, "hwm", 77),
        Epoch(0, 1, 0, 88, "seq went backwards"),
        Annotation("flush_cache", 99, {"ok": True}),
    ]


def write_bundle(path: Path, records: list[object], **kw: object) -> BundleWriter:
    w = BundleWriter(path, make_header(), **kw)  # type: ignore[arg-type]
    for r in records:
        w.write(r)  # type: ignore[arg-type]
    w.close(stats={"n": len(records)})
    return w


def frame_ends(data: bytes) -> list[int]:
    """Offsets just past each frame, computed from the bytes (independent of the reader)."""
    ends, pos = [], 8
    while pos + 8 <= len(data):
        (length,) = struct.unpack_from("<I", data, pos)
        pos += 8 + length
        ends.append(pos)
    assert pos == len(data)
    return ends


def frame_bytes(body: bytes) -> bytes:
    return struct.pack("<II", len(body), zlib.crc32(body)) + body


# --------------------------------------------------------------------------------------


def test_round_trip_every_record_type(tmp_path: Path) -> None:
    recs = all_kinds()
    write_bundle(tmp_path / "b", recs)
    r = BundleReader(tmp_path / "b")
    got = list(r.records())
    assert isinstance(got[0], Header) and got[0] == make_header()
    assert r.header == make_header()
    assert got[1:-1] == recs
    tr = got[-1]
    assert isinstance(tr, Trailer) and tr.clean and tr.stats == {"n": len(recs)}
    assert tr.counts == {"header": 1, "event": 2, "request": 1, "gap": 1, "epoch": 1, "note": 1}
    assert r.report.clean_shutdown and r.report.trailer_seen
    assert r.report.frames == len(recs) + 2
    assert (r.report.torn_bytes, r.report.corrupt, r.report.unknown_records) == (0, [], 0)
    assert [e.seq for e in r.events()] == [0, 1]
    assert [q.rid for q in r.requests()] == ["l0-s0-t0"]
    assert [type(x).__name__ for x in r.iter_kinds("gap", "epoch")] == ["Gap", "Epoch"]
    # several kinds (one union decoder, others skipped on their tag): the records, in order
    for kinds in (("event", "note"), ("request", "event", "note", "trailer"), ("header", "gap")):
        want = [x for x in r.records() if RECORD_TAGS[type(x)] in kinds]
        assert list(r.iter_kinds(*kinds)) == want, kinds
    assert r.report.clean_shutdown and r.report.frames == len(recs) + 2


def test_segment_layout_on_disk(tmp_path: Path) -> None:
    write_bundle(tmp_path / "b", [event(0)])
    data = (tmp_path / "b" / "seg-000000.kvcb").read_bytes()
    assert data[:8] == b"KVCB" + struct.pack("<HH", FORMAT_MAJOR, FORMAT_MINOR)
    length, crc = struct.unpack_from("<II", data, 8)
    body = data[16 : 16 + length]
    assert zlib.crc32(body) == crc
    assert msgspec.msgpack.decode(body)[0] == "header"
    # the event payload is inserted unchanged inside its frame
    assert BATCH in data


@pytest.mark.parametrize(
    "payload",
    [BATCH, b"\xc0", b"", b"\x93\x01", b"\x01\x02", b"\xc1", b"\x91" * 5000 + b"\x01", b"\xff\x00"],
)
def test_payload_bytes_are_exact(tmp_path: Path, payload: bytes) -> None:
    w = BundleWriter(tmp_path / "b", make_header())
    w.write_event(endpoint=0, seq=0, recv_ns=1, topic="t", payload=payload, via=VIA_LIVE, epoch=0)
    w.close()
    (ev,) = BundleReader(tmp_path / "b").events()
    assert event_payload(ev) == payload
    assert ev.payload_is_bin == (not is_single_msgpack(payload))


def test_is_single_msgpack() -> None:
    assert is_single_msgpack(BATCH) and is_single_msgpack(b"\xc0")
    assert not is_single_msgpack(BATCH + b"\x00")  # trailing bytes
    assert not is_single_msgpack(BATCH[:-1])  # truncated
    assert not is_single_msgpack(b"")
    assert not is_single_msgpack(b"\x91" * 5000 + b"\x01")  # too deep to be safe: kept as bin


def test_deep_payload_read_from_a_deeper_stack(tmp_path: Path) -> None:
    # the deepest payload the writer accepts as Raw from this stack
    lo, hi = 1, 2000
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if is_single_msgpack(b"\x91" * mid + b"\x01"):
            lo = mid
        else:
            hi = mid - 1
    payload = b"\x91" * (lo - 10) + b"\x01"  # write_event checks from a few frames deeper
    w = BundleWriter(tmp_path / "b", make_header())
    w.write_event(endpoint=0, seq=0, recv_ns=1, topic="t", payload=payload, via=VIA_LIVE, epoch=0)
    w.close()

    def read_deeper(n: int) -> list[EventFrame]:
        if n:
            return read_deeper(n - 1)
        return list(BundleReader(tmp_path / "b").events())

    for depth in (0, 100):  # 100 frames deeper: msgspec hits the limit, the reader retries
        (ev,) = read_deeper(depth)
        assert not ev.payload_is_bin and event_payload(ev) == payload


def test_torn_tail_at_every_offset(tmp_path: Path) -> None:
    recs = all_kinds()
    write_bundle(tmp_path / "full", recs)
    data = (tmp_path / "full" / "seg-000000.kvcb").read_bytes()
    ends = frame_ends(data)
    everything = list(BundleReader(tmp_path / "full").records())
    assert len(everything) == len(ends)
    cut_dir = tmp_path / "cut"
    cut_dir.mkdir()
    seg = cut_dir / "seg-000000.kvcb"
    for cut in range(len(data) + 1):
        seg.write_bytes(data[:cut])
        r = BundleReader(cut_dir)
        got = list(r.records())
        k = sum(1 for e in ends if e <= cut)
        assert got == everything[:k], cut
        last_end = ends[k - 1] if k else min(cut, 8)
        assert r.report.torn_bytes == (cut - last_end if cut >= 8 else cut), cut
        assert r.report.corrupt == []
        assert r.report.clean_shutdown == (cut == len(data))


def test_zero_filled_tail(tmp_path: Path) -> None:
    recs = all_kinds()
    write_bundle(tmp_path / "b", recs)
    seg = tmp_path / "b" / "seg-000000.kvcb"
    data = seg.read_bytes()
    # a crash leaves the last frame half written and the file extended with zeros
    ends = frame_ends(data)
    cut = ends[-2] + 5
    seg.write_bytes(data[:cut] + bytes(4096))
    r = BundleReader(tmp_path / "b")
    got = list(r.records())
    assert got[1:] == recs
    assert r.report.torn_bytes == 5 + 4096 and r.report.corrupt == []
    assert not r.report.clean_shutdown and not r.report.trailer_seen


@pytest.mark.parametrize("where", ["body", "crc", "length"])
def test_corrupt_frame_in_the_middle_resyncs(tmp_path: Path, where: str) -> None:
    recs = [event(i) for i in range(10)]
    write_bundle(tmp_path / "b", recs)
    seg = tmp_path / "b" / "seg-000000.kvcb"
    data = bytearray(seg.read_bytes())
    ends = frame_ends(bytes(data))
    start = ends[4]  # frame of event(4) (frame 0 is the header)
    offset = {"body": start + 20, "crc": start + 5, "length": start + 1}[where]
    data[offset] ^= 0x40
    seg.write_bytes(bytes(data))
    r = BundleReader(tmp_path / "b")
    got = [x for x in r.records() if isinstance(x, EventFrame)]
    assert got == recs[:4] + recs[5:]
    assert r.report.corrupt == [("seg-000000.kvcb", start, ends[5] - start)]
    assert r.report.torn_bytes == 0 and r.report.clean_shutdown
    with pytest.raises(CorruptFrameError, match="offset"):
        list(BundleReader(tmp_path / "b", strict=True).records())


def test_unknown_record_tag_and_extra_fields_from_a_newer_minor(tmp_path: Path) -> None:
    write_bundle(tmp_path / "b", [event(0), event(1)])
    seg = tmp_path / "b" / "seg-000000.kvcb"
    data = seg.read_bytes()
    ends = frame_ends(data)
    future = frame_bytes(msgspec.msgpack.encode(["future", 1, {"x": 2}]))
    newer_gap = frame_bytes(msgspec.msgpack.encode(["gap", 0, 0, 1, 2, 0, "r", 5, "new field"]))
    head = b"KVCB" + struct.pack("<HH", FORMAT_MAJOR, 7)
    seg.write_bytes(head + data[8 : ends[1]] + future + newer_gap + data[ends[1] :])
    r = BundleReader(tmp_path / "b")
    got = list(r.records())
    assert [type(x).__name__ for x in got] == [
        "Header",
        "EventFrame",
        "Gap",
        "EventFrame",
        "Trailer",
    ]
    assert got[2] == Gap(0, 0, 1, 2, 0, "r", 5)
    assert r.report.unknown_records == 1 and r.report.unknown_tags == {"future": 1}
    assert r.report.format_minor == 7 and r.report.corrupt == []
    # the envelope-only path counts it too
    r2 = BundleReader(tmp_path / "b")
    assert len(list(r2.events())) == 2 and r2.report.unknown_records == 1


def test_unknown_major_is_refused(tmp_path: Path) -> None:
    write_bundle(tmp_path / "b", [event(0)])
    seg = tmp_path / "b" / "seg-000000.kvcb"
    data = bytearray(seg.read_bytes())
    struct.pack_into("<H", data, 4, FORMAT_MAJOR + 1)
    seg.write_bytes(bytes(data))
    with pytest.raises(
        FormatVersionError, match=rf"format {FORMAT_MAJOR + 1}\.{FORMAT_MINOR} is not readable"
    ):
        BundleReader(tmp_path / "b")


def test_not_a_bundle(tmp_path: Path) -> None:
    with pytest.raises(UsageError, match="no such bundle"):
        BundleReader(tmp_path / "missing")
    (tmp_path / "empty").mkdir()
    with pytest.raises(UsageError, match="no seg"):
        BundleReader(tmp_path / "empty")
    (tmp_path / "file").write_text("x")
    with pytest.raises(UsageError, match="not a bundle"):
        BundleReader(tmp_path / "file")
    (tmp_path / "bad").mkdir()
    (tmp_path / "bad" / "seg-000000.kvcb").write_bytes(b"NOPE\x01\x00\x00\x00")
    with pytest.raises(UsageError, match="bad magic"):
        BundleReader(tmp_path / "bad")


def test_header_missing(tmp_path: Path) -> None:
    (tmp_path / "b").mkdir()
    (tmp_path / "b" / "seg-000000.kvcb").write_bytes(b"KVCB\x01\x00")
    r = BundleReader(tmp_path / "b")
    assert list(r.records()) == [] and r.report.torn_bytes == 6
    with pytest.raises(BundleError, match="no readable header"):
        _ = r.header


def test_writer_never_clobbers(tmp_path: Path) -> None:
    write_bundle(tmp_path / "b", [event(0)])
    before = (tmp_path / "b" / "seg-000000.kvcb").read_bytes()
    with pytest.raises(UsageError, match="not empty"):
        BundleWriter(tmp_path / "b", make_header())
    assert (tmp_path / "b" / "seg-000000.kvcb").read_bytes() == before
    (tmp_path / "f").write_text("x")
    with pytest.raises(UsageError, match="not a directory"):
        BundleWriter(tmp_path / "f", make_header())
    (tmp_path / "e").mkdir()  # an empty directory is fine
    BundleWriter(tmp_path / "e", make_header()).close()


def test_writer_after_close_and_context_manager(tmp_path: Path) -> None:
    with BundleWriter(tmp_path / "b", make_header()) as w:
        w.write(event(0))
    assert w.closed
    with pytest.raises(BundleError, match="closed"):
        w.write(event(1))
    with pytest.raises(RuntimeError), BundleWriter(tmp_path / "c", make_header()) as w2:
        w2.write(event(0))
        raise RuntimeError("crash in the capture loop")
    r = BundleReader(tmp_path / "c")
    tr = list(r.records())[-1]
    assert isinstance(tr, Trailer) and not tr.clean and "crash" in tr.stats["error"]
    assert r.report.trailer_seen and not r.report.clean_shutdown


def test_writing_a_non_record_writes_nothing(tmp_path: Path) -> None:
    w = BundleWriter(tmp_path / "b", make_header())
    with pytest.raises(TypeError, match="not a bundle record"):
        w.write({"seq": 1})  # type: ignore[arg-type]
    w.write(event(0))
    w.close()
    r = BundleReader(tmp_path / "b")
    assert [type(x).__name__ for x in r.records()] == ["Header", "EventFrame", "Trailer"]
    assert r.report.corrupt == [] and r.report.clean_shutdown


def test_segments_roll_by_size(tmp_path: Path) -> None:
    recs = [event(i) for i in range(40)]
    write_bundle(tmp_path / "b", recs, segment_bytes=500)
    segs = list_segments(tmp_path / "b")
    assert len(segs) > 5
    assert all(s.stat().st_size <= 500 for s in segs)
    r = BundleReader(tmp_path / "b")
    got = list(r.records())
    assert got[1:-1] == recs and r.report.segments == len(segs) and r.report.clean_shutdown
    # a frame larger than a segment gets a segment of its own
    big = RequestRecord("big", list(range(400)))
    write_bundle(tmp_path / "c", [event(0), big, event(1)], segment_bytes=300)
    assert [type(x).__name__ for x in BundleReader(tmp_path / "c").records()] == [
        "Header",
        "EventFrame",
        "RequestRecord",
        "EventFrame",
        "Trailer",
    ]


def test_append_truncates_a_torn_tail_and_continues(tmp_path: Path) -> None:
    path = tmp_path / "b"
    w = BundleWriter(path, make_header(), segment_bytes=400)
    for i in range(12):
        w.write(event(i))
    w.flush()
    # crash: no trailer; the last segment ends in half a frame and zeros
    last = list_segments(path)[-1]
    data = last.read_bytes()
    (length,) = struct.unpack_from("<I", data, 8)
    good = data[: 8 + 8 + length]
    last.write_bytes(good + data[16 + length : 16 + length + 9] + bytes(30))
    w._file.close()  # the crashed process wrote nothing more (its buffer was flushed)
    w._file = None
    w._release_lock()  # and its bundle lock went with it (the kernel drops it at exit)
    before = [x for x in BundleReader(path).records()]
    a = BundleWriter.append(path)
    assert a.append_report is not None
    assert a.append_report.segment == last.name and a.append_report.dropped_bytes == 39
    assert last.stat().st_size == len(good)
    a.write(event(100))
    a.write(RequestRecord("late", [1]))
    a.close()
    r = BundleReader(path)
    got = list(r.records())
    assert got[: len(before)] == before
    note = got[len(before)]
    assert isinstance(note, Annotation) and note.kind == "append"
    assert note.data["dropped_bytes"] == 39
    assert got[len(before) + 1 :][:2] == [event(100), RequestRecord("late", [1])]
    assert r.report.torn_bytes == 0 and r.report.corrupt == [] and r.report.clean_shutdown
    assert r.header == make_header()


def test_append_to_clean_bundle_and_partial_segment_header(tmp_path: Path) -> None:
    path = tmp_path / "b"
    write_bundle(path, [event(0)])
    a = BundleWriter.append(path)
    assert a.append_report is not None and a.append_report.dropped_bytes == 0
    a.close()
    # a crash right after creating a segment leaves < 8 bytes: removed, index reused
    (path / "seg-000002.kvcb").write_bytes(b"KVC")
    b = BundleWriter.append(path)
    assert b.append_report is not None and b.append_report.removed_segment
    assert b.segment_path.name == "seg-000002.kvcb"
    b.close()
    r = BundleReader(path)
    kinds = [type(x).__name__ for x in r.records()]
    assert kinds == ["Header", "EventFrame", "Trailer", "Annotation", "Trailer"] + [
        "Annotation",
        "Trailer",
    ]
    assert r.report.clean_shutdown and r.report.torn_bytes == 0
    with pytest.raises(UsageError):
        BundleWriter.append(tmp_path / "nothing")


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_flush_interval_makes_records_visible_without_close(tmp_path: Path) -> None:
    clock = FakeClock()
    path = tmp_path / "b"
    w = BundleWriter(path, make_header(), flush_interval_s=0.2, clock=clock)
    w.write(event(0))
    clock.now = 0.1
    w.write(event(1))
    # still in the writer's buffer: a reader sees nothing yet (a torn-at-birth segment)
    assert list(BundleReader(path).events()) == []
    clock.now = 0.21
    w.write(event(2))  # the interval has passed: this write flushes
    assert [e.seq for e in BundleReader(path).events()] == [0, 1, 2]
    w.write(event(3))
    w.flush()  # what the capture loop calls when idle
    r = BundleReader(path)
    assert [e.seq for e in r.events()] == [0, 1, 2, 3]
    assert not r.report.clean_shutdown and r.report.torn_bytes == 0
    w.close()


class ENOSPCFile:
    """Wraps a segment file; every write after ``budget`` bytes fails like a full disk."""

    def __init__(self, f: object, budget: int) -> None:
        self.f = f
        self.budget = budget

    def write(self, b: bytes) -> int:
        if len(b) > self.budget:
            n = self.budget
            self.f.write(bytes(b)[:n])  # type: ignore[attr-defined]
            self.budget = 0
            self.f.flush()  # type: ignore[attr-defined]
            raise OSError(28, "No space left on device")
        self.budget -= len(b)
        return self.f.write(b)  # type: ignore[attr-defined,no-any-return]

    def __getattr__(self, name: str) -> object:
        return getattr(self.f, name)


def test_disk_full_raises_and_keeps_closed_segments(tmp_path: Path) -> None:
    path = tmp_path / "b"
    w = BundleWriter(path, make_header(), segment_bytes=300)
    for i in range(6):
        w.write(event(i))
    w._file = ENOSPCFile(w._file, 30)
    with pytest.raises(BundleError, match="disk full"):
        for i in range(6, 20):
            w.write(event(i))
    with pytest.raises(BundleError, match="failed earlier"):
        w.write(event(99))
    w.close()  # no exception: nothing more can be written
    r = BundleReader(path)
    seqs = [e.seq for e in r.events()]
    assert seqs == list(range(len(seqs))) and len(seqs) >= 6
    assert r.report.corrupt == [] and r.report.torn_bytes > 0


def test_disk_full_with_a_real_file_size_limit(tmp_path: Path) -> None:
    script = textwrap.dedent(
        """
        import resource, signal, sys
        import msgspec
        from kvcadence.format.bundle import BundleWriter
        from kvcadence.format.schema import Header, RequestRecord
        from kvcadence.errors import BundleError
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (6000, 6000))
        w = BundleWriter(sys.argv[1], Header(1, 0, "real", "t"), segment_bytes=4000,
                         flush_interval_s=0)
        try:
            for i in range(100):
                w.write(RequestRecord(f"r{i}", list(range(60 * (i % 3 + 1)))))
            w.write(RequestRecord("huge", list(range(5000))))
        except BundleError as exc:
            print("ERR", exc)
            sys.exit(5)
        """
    )
    proc = subprocess.run(
        [sys.executable, "-c", script, str(tmp_path / "b")],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 5, proc.stderr
    assert "disk full" in proc.stdout
    r = BundleReader(tmp_path / "b")
    reqs = r.requests()
    assert [q.rid for q in reqs] == [f"r{i}" for i in range(100)]
    segs = list_segments(tmp_path / "b")
    assert segs[-1].stat().st_size <= 6000 and r.report.corrupt == []
    # the last segment holds its segment header and SegmentStart frame, then the torn tail
    (start_len,) = struct.unpack_from("<I", segs[-1].read_bytes(), 8)
    assert r.report.torn_bytes == segs[-1].stat().st_size - 16 - start_len


# ---------------------------------------------------------------------- batched writes

_MSGPACK_PAYLOADS = st.one_of(
    st.sampled_from([BATCH, msgspec.msgpack.encode([1.0, [], None]), b"\xc0"]),
    st.binary(min_size=0, max_size=300).map(msgspec.msgpack.encode),  # valid: a bin value
)
_ANY_PAYLOADS = st.one_of(
    _MSGPACK_PAYLOADS,
    st.binary(min_size=0, max_size=80),  # mostly not one msgpack value: stored as bin
    st.just(b"\x91" * 2000 + b"\x01"),  # deep: stored as bin
)


def _items(payloads: list[bytes], first_seq: int = 0) -> list[tuple]:
    return [
        (i % 3, first_seq + i, 10_000 + i, "kv-events" if i % 4 else "", p, VIA_LIVE, i % 2)
        for i, p in enumerate(payloads)
    ]


def _segment_bytes(path: Path) -> list[tuple[str, bytes]]:
    return [(s.name, s.read_bytes()) for s in list_segments(path)]


@settings(max_examples=60, deadline=None)
@given(
    payloads=st.lists(_ANY_PAYLOADS, min_size=0, max_size=40),
    cuts=st.lists(st.integers(0, 40), max_size=6),
    segment_bytes=st.sampled_from([64, 200, 700, 4096, 256 << 20]),
    notes_at=st.sets(st.integers(0, 40), max_size=3),
)
def test_batched_writes_are_byte_identical_to_per_frame_writes(
    payloads: list[bytes], cuts: list[int], segment_bytes: int, notes_at: set[int]
) -> None:
    """write_event_batch over any split of the stream (other records between batches) writes
    the same segments, byte for byte, as write_event per message: framing, CRC, rotation
    points (frames larger than a segment included), bin payloads, and the trailer's counts."""
    import tempfile

    items = _items(payloads)
    bounds = sorted({0, len(items), *(c for c in cuts if c <= len(items)), *notes_at})
    bounds = [b for b in bounds if b <= len(items)]
    with tempfile.TemporaryDirectory() as tmp:
        one, many = Path(tmp) / "one", Path(tmp) / "many"
        w1 = BundleWriter(one, make_header(), segment_bytes=segment_bytes)
        w2 = BundleWriter(many, make_header(), segment_bytes=segment_bytes)
        for lo, hi in zip(bounds, bounds[1:], strict=False):
            if lo in notes_at:
                w1.write(Annotation("x", lo))
                w2.write(Annotation("x", lo))
            for e, s, r, t, p, v, ep in items[lo:hi]:
                w1.write_event(endpoint=e, seq=s, recv_ns=r, topic=t, payload=p, via=v, epoch=ep)
            w2.write_event_batch(items[lo:hi])
        assert w1.counts == w2.counts and w1.bytes_written == w2.bytes_written
        w1.close(end_ns=5)
        w2.close(end_ns=5)
        assert _segment_bytes(one) == _segment_bytes(many)
        got = [(f.endpoint, f.seq, event_payload(f)) for f in BundleReader(many).events()]
        assert got == [(e, s, p) for e, s, _, _, p, _, _ in items]


def test_write_events_takes_event_frames_and_write_event_batch_bytes_like(tmp_path: Path) -> None:
    frames = [event(i) for i in range(5)]
    w = BundleWriter(tmp_path / "a", make_header())
    w.write_events(frames)
    w.write_events([])  # nothing: no frame, no error
    w.write_event_batch([(0, 5, 1, "t", memoryview(BATCH), VIA_LIVE, 0)])
    w.write_event_batch([(0, 6, 1, "t", bytearray(b"\xc1"), VIA_LIVE, 0)])  # never valid
    w.close()
    got = list(BundleReader(tmp_path / "a").events())
    assert got[:5] == frames
    assert event_payload(got[5]) == BATCH and not got[5].payload_is_bin
    assert event_payload(got[6]) == b"\xc1" and got[6].payload_is_bin


def test_a_bad_frame_stops_the_batch_after_writing_the_ones_before(tmp_path: Path) -> None:
    w = BundleWriter(tmp_path / "b", make_header())
    with pytest.raises(TypeError, match="not an EventFrame"):
        w.write_events([event(0), event(1), Annotation("x", 1), event(2)])  # type: ignore[list-item]
    bad_topic = (0, 3, 1, object(), BATCH, VIA_LIVE, 0)  # msgpack cannot encode it
    good = (0, 2, 1, "t", BATCH, VIA_LIVE, 0)
    with pytest.raises(BundleError, match="event record endpoint 0 seq 3.*object"):
        w.write_event_batch([good, bad_topic])  # type: ignore[list-item]
    w.write_event_batch([(0, 4, 1, "t", BATCH, VIA_LIVE, 0)])  # still usable
    w.close()
    r = BundleReader(tmp_path / "b")
    assert [e.seq for e in r.events()] == [0, 1, 2, 4]
    assert r.report.corrupt == [] and r.report.clean_shutdown
    assert w.counts["event"] == 4
    with pytest.raises(BundleError, match="closed"):
        w.write_events([event(9)])


def test_batched_write_torn_tail_and_append(tmp_path: Path) -> None:
    """A crash in the middle of a batch leaves the same torn tail as per-frame writes: the
    reader yields exactly the frames that were whole, and append continues after them."""
    path = tmp_path / "full"
    w = BundleWriter(path, make_header(), flush_interval_s=0.0)
    w.write_event_batch(_items([BATCH] * 6))
    w.write_event_batch(_items([BATCH] * 4, first_seq=6))
    data = (path / "seg-000000.kvcb").read_bytes()  # flushed (interval 0), not closed
    w.close()
    ends = frame_ends(data)
    assert len(ends) == 11  # header + 10 events
    cut_dir = tmp_path / "cut"
    cut_dir.mkdir()
    seg = cut_dir / "seg-000000.kvcb"
    for cut in range(ends[5] - 3, len(data) + 1):  # inside the second batch and its frames
        seg.write_bytes(data[:cut])
        r = BundleReader(cut_dir)
        k = sum(1 for e in ends if e <= cut)
        assert [e.seq for e in r.events()] == list(range(k - 1)), cut
        assert r.report.torn_bytes == cut - ends[k - 1] and r.report.corrupt == []
    seg.write_bytes(data[: ends[7] + 5])  # 7 events, 5 bytes of the 8th
    a = BundleWriter.append(cut_dir, segment_bytes=300)
    assert a.append_report is not None and a.append_report.dropped_bytes == 5
    a.write_event_batch(_items([BATCH] * 8, first_seq=7))  # rolls segments as it goes
    a.close()
    r = BundleReader(cut_dir)
    assert [e.seq for e in r.events()] == list(range(15))
    assert r.report.torn_bytes == 0 and r.report.corrupt == [] and r.report.clean_shutdown
    assert len(list_segments(cut_dir)) > 2
    assert all(s.stat().st_size <= 300 for s in list_segments(cut_dir)[1:])


def test_batched_write_checks_the_flush_interval_once_per_batch(tmp_path: Path) -> None:
    clock = FakeClock()
    path = tmp_path / "b"
    w = BundleWriter(path, make_header(), flush_interval_s=0.2, clock=clock)
    w.write_event_batch(_items([BATCH] * 3))
    clock.now = 0.1
    w.write_event_batch(_items([BATCH] * 3, first_seq=3))
    assert list(BundleReader(path).events()) == []  # still buffered
    clock.now = 0.21
    w.write_event_batch(_items([BATCH] * 2, first_seq=6))  # interval passed: flushed
    assert [e.seq for e in BundleReader(path).events()] == list(range(8))
    w.close()


def test_batched_write_disk_full_keeps_closed_segments(tmp_path: Path) -> None:
    path = tmp_path / "b"
    w = BundleWriter(path, make_header(), segment_bytes=300)
    w.write_event_batch(_items([BATCH] * 6))
    w._file = ENOSPCFile(w._file, 30)
    with pytest.raises(BundleError, match="disk full"):
        w.write_event_batch(_items([BATCH] * 14, first_seq=6))
    with pytest.raises(BundleError, match="failed earlier"):
        w.write_event_batch(_items([BATCH], first_seq=99))
    w.close()
    r = BundleReader(path)
    seqs = [e.seq for e in r.events()]
    assert seqs == list(range(len(seqs))) and len(seqs) >= 6
    assert r.report.corrupt == [] and r.report.torn_bytes > 0


def test_discard_undoes_an_append_across_segment_rotations(tmp_path):
    """``BundleWriter.discard``: every segment an append opened is removed (several here:
    tiny segments rotate at each record); the bundle reads as before, byte for byte, and a
    later append continues from it. A new bundle's writer refuses it."""
    b = tmp_path / "b"
    with BundleWriter(b, make_header()) as w:
        for i in range(3):
            w.write(RequestRecord(rid=f"a{i}", input_ids=[1, 2, i]))
    before = {p.name: p.read_bytes() for p in list_segments(b)}
    w = BundleWriter.append(b, segment_bytes=64)
    for i in range(5):
        w.write(RequestRecord(rid=f"b{i}", input_ids=[3, 4, i]))
    assert len(list_segments(b)) > len(before) + 2  # it rotated
    w.discard()
    w.discard()  # once undone, again is a no-op
    assert {p.name: p.read_bytes() for p in list_segments(b)} == before
    assert [r.rid for r in BundleReader(b).requests()] == ["a0", "a1", "a2"]
    with BundleWriter.append(b) as w2:  # the lock was released
        w2.write(RequestRecord(rid="c", input_ids=[5]))
    assert [r.rid for r in BundleReader(b).requests()] == ["a0", "a1", "a2", "c"]
    with BundleWriter(tmp_path / "new", make_header()) as w3, pytest.raises(TypeError):
        w3.discard()
