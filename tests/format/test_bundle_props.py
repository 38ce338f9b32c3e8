"""Property tests of the bundle format: random records round-trip; damaged files never crash
the reader and never make it yield a record that was not written."""

from __future__ import annotations

import tempfile
from pathlib import Path

import msgspec
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvcadence.errors import FormatVersionError, KvcadenceError, UsageError
from kvcadence.format.bundle import BundleReader, BundleWriter, event_payload, list_segments
from kvcadence.format.schema import (
    FORMAT_MAJOR,
    FORMAT_MINOR,
    Annotation,
    Epoch,
    EventFrame,
    Gap,
    Header,
    RequestRecord,
)

I64 = st.integers(min_value=-(2**63), max_value=2**63 - 1)
NAT = st.integers(min_value=0, max_value=2**63 - 1)
SMALL = st.integers(min_value=-1, max_value=1000)
TEXT = st.text(max_size=12)
JSONISH = st.recursive(
    st.none() | st.booleans() | I64 | st.floats(allow_nan=False) | TEXT,
    lambda kids: st.lists(kids, max_size=4) | st.dictionaries(TEXT, kids, max_size=4),
    max_leaves=10,
)
# payloads: valid SGLang-like msgpack, arbitrary msgpack values, and arbitrary bytes
PAYLOADS = st.one_of(
    st.builds(
        lambda ts, hs: msgspec.msgpack.encode(
            [ts, [{"type": "BlockStored", "block_hashes": hs, "parent_block_hash": None}], 0]
        ),
        st.floats(allow_nan=False),
        st.lists(I64, max_size=20),
    ),
    JSONISH.map(msgspec.msgpack.encode),
    st.binary(max_size=64),
)


@st.composite
def event_frames(draw: st.DrawFn) -> tuple[EventFrame, bytes]:
    payload = draw(PAYLOADS)
    frame = EventFrame(
        endpoint=draw(st.integers(0, 7)),
        seq=draw(NAT),
        recv_ns=draw(NAT),
        topic=draw(TEXT),
        via=draw(st.integers(0, 3)),
        epoch=draw(st.integers(0, 5)),
        payload_is_bin=False,
        payload=msgspec.Raw(b""),
        pass_index=draw(SMALL),
    )
    return frame, payload


OTHER = st.one_of(
    st.builds(
        RequestRecord,
        rid=TEXT,
        input_ids=st.lists(st.integers(0, 2**31), max_size=30),
        output_ids=st.lists(st.integers(0, 2**31), max_size=10),
        send_ns=st.none() | NAT,
        finish_ns=st.none() | NAT,
        lane=st.none() | SMALL,
        finish_reason=st.none() | TEXT,
        think_ns=st.none() | I64,
        meta_info=st.dictionaries(TEXT, JSONISH, max_size=3),
    ),
    st.builds(Gap, SMALL, SMALL, NAT, NAT, NAT, TEXT, NAT),
    st.builds(Epoch, SMALL, SMALL, NAT, NAT, TEXT),
    st.builds(Annotation, TEXT, NAT, st.dictionaries(TEXT, JSONISH, max_size=3)),
)
RECORDS = st.lists(st.one_of(event_frames(), OTHER), max_size=25)
HEADER = Header(FORMAT_MAJOR, FORMAT_MINOR, "real", "0.1.0", sglang_version="0.5.23")
SETTINGS = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def write(path: Path, items: list[object], segment_bytes: int) -> list[object]:
    """Write ``items``; return the records as the reader must see them (header included)."""
    written: list[object] = [HEADER]
    with BundleWriter(path, HEADER, segment_bytes=segment_bytes) as w:
        for item in items:
            if isinstance(item, tuple):
                frame, payload = item
                w.write_event(
                    endpoint=frame.endpoint,
                    seq=frame.seq,
                    recv_ns=frame.recv_ns,
                    topic=frame.topic,
                    payload=payload,
                    via=frame.via,
                    epoch=frame.epoch,
                    pass_index=frame.pass_index,
                )
                written.append(("event", frame.seq, frame.recv_ns, frame.topic, payload))
            else:
                w.write(item)  # type: ignore[arg-type]
                written.append(item)
    return written


def comparable(rec: object) -> object:
    if isinstance(rec, EventFrame):
        return ("event", rec.seq, rec.recv_ns, rec.topic, event_payload(rec))
    return rec


def is_subsequence(got: list[object], written: list[object]) -> bool:
    it = iter(written)
    return all(any(g == w for w in it) for g in got)


@SETTINGS
@given(items=RECORDS, segment_bytes=st.sampled_from([128, 1000, 1 << 20]))
def test_random_records_round_trip(items: list[object], segment_bytes: int) -> None:
    with tempfile.TemporaryDirectory() as d:
        path = Path(d) / "b"
        written = write(path, items, segment_bytes)
        r = BundleReader(path)
        got = [comparable(x) for x in r.records()]
        assert got[:-1] == written
        assert r.report.clean_shutdown and r.report.corrupt == [] and r.report.torn_bytes == 0


@SETTINGS
@given(items=RECORDS, data=st.data())
def test_truncation_yields_exactly_the_written_prefix(
    items: list[object], data: st.DataObject
) -> None:
    with tempfile.TemporaryDirectory() as d:
        path = Path(d) / "b"
        written = write(path, items, 1 << 20) + ["trailer"]
        seg = path / "seg-000000.kvcb"
        raw = seg.read_bytes()
        cut = data.draw(st.integers(0, len(raw)))
        seg.write_bytes(raw[:cut])
        r = BundleReader(path)
        got = [comparable(x) for x in r.records()]
        got = ["trailer" if type(x).__name__ == "Trailer" else x for x in got]
        assert got == written[: len(got)]
        assert r.report.corrupt == []


@SETTINGS
@given(items=RECORDS, data=st.data())
def test_bit_flips_never_yield_unwritten_records(items: list[object], data: st.DataObject) -> None:
    with tempfile.TemporaryDirectory() as d:
        path = Path(d) / "b"
        written = write(path, items, data.draw(st.sampled_from([200, 1 << 20])))
        segs = list_segments(path)
        flips = data.draw(st.lists(st.tuples(st.integers(0, len(segs) - 1), NAT), max_size=4))
        touched_head = False
        for si, off in flips:
            raw = bytearray(segs[si].read_bytes())
            pos = off % len(raw)
            raw[pos] ^= 1 << (off % 8)
            segs[si].write_bytes(bytes(raw))
            touched_head |= pos < 6
        try:
            r = BundleReader(path)
            got = [comparable(x) for x in r.records() if type(x).__name__ != "Trailer"]
        except KvcadenceError:
            assert touched_head  # magic or major damaged: refused with a clear error
            return
        assert is_subsequence(got, written)


@SETTINGS
@given(junk=st.binary(max_size=2000), header_first=st.booleans())
def test_random_bytes_never_crash(junk: bytes, header_first: bool) -> None:
    with tempfile.TemporaryDirectory() as d:
        path = Path(d) / "b"
        path.mkdir()
        head = b"KVCB" + FORMAT_MAJOR.to_bytes(2, "little") + b"\x00\x00"
        (path / "seg-000000.kvcb").write_bytes((head if header_first else b"") + junk)
        try:
            r = BundleReader(path)
        except (UsageError, FormatVersionError):
            assert not header_first
            return
        got = list(r.records())
        # junk can only contain a frame by a CRC32 collision plus a valid decode
        assert got == []
        rep = r.report
        assert rep.torn_bytes + rep.corrupt_bytes <= len(junk) + 8


@SETTINGS
@given(items=RECORDS, junk=st.binary(min_size=1, max_size=300), data=st.data())
def test_garbage_between_frames_is_skipped_exactly(
    items: list[object], junk: bytes, data: st.DataObject
) -> None:
    with tempfile.TemporaryDirectory() as d:
        path = Path(d) / "b"
        written = write(path, items, 1 << 20)
        seg = path / "seg-000000.kvcb"
        raw = seg.read_bytes()
        ends, pos = [], 8
        while pos < len(raw):
            pos += 8 + int.from_bytes(raw[pos : pos + 4], "little")
            ends.append(pos)
        at = data.draw(st.sampled_from(ends[:-1]))  # between two frames
        seg.write_bytes(raw[:at] + junk + raw[at:])
        r = BundleReader(path)
        got = [comparable(x) for x in r.records()]
        assert got[:-1] == written  # every record, nothing else
        assert r.report.corrupt == [("seg-000000.kvcb", at, len(junk))]
        assert r.report.torn_bytes == 0 and r.report.clean_shutdown
