"""Compact request storage (format 2.0, ``PackedRequest``): the bytes on disk, the round
trip, old bundles, bad references and damage."""

from __future__ import annotations

import json
import shutil
import struct
import zlib
from array import array
from pathlib import Path

import msgspec
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvcadence.cli import main
from kvcadence.errors import CorruptFrameError, InputError
from kvcadence.format.bundle import (
    FRAME_HEADER,
    FRAME_HEADER_SIZE,
    SEGMENT_HEADER_SIZE,
    BundleReader,
    BundleWriter,
    list_segments,
)
from kvcadence.format.bundle.compact import BLOCK, msgpack_uint_array
from kvcadence.format.schema import (
    FORMAT_MAJOR,
    Header,
    PackedRequest,
    RequestRecord,
    RequestRecordU32View,
    RequestRecordView,
)

CORPUS = Path(__file__).resolve().parents[1] / "replay" / "data" / "corpus"
SAMPLE = Path(__file__).resolve().parents[2] / "examples" / "sglang-0.5.23-agent-ps1.kvcb"
_ANY = msgspec.msgpack.Decoder()
_PACKED = msgspec.msgpack.Decoder(PackedRequest)


def _header() -> Header:
    return Header(format_major=FORMAT_MAJOR, format_minor=0, source="real", kvcadence_version="t")


def _write(path: Path, reqs: list[RequestRecord], **kw: object) -> Path:
    w = BundleWriter(path, _header(), **kw)  # type: ignore[arg-type]
    for r in reqs:
        w.write(r)
    w.close(end_ns=0)
    return path


def _frames(seg: Path) -> list[tuple[int, bytes]]:
    """(offset, body) of every frame of a segment written without damage."""
    data = seg.read_bytes()
    out = []
    pos = SEGMENT_HEADER_SIZE
    while pos + FRAME_HEADER_SIZE <= len(data):
        n, _ = FRAME_HEADER.unpack_from(data, pos)
        out.append((pos, data[pos + FRAME_HEADER_SIZE : pos + FRAME_HEADER_SIZE + n]))
        pos += FRAME_HEADER_SIZE + n
    return out


def _tag(body: bytes) -> str:
    return str(_ANY.decode(body)[0])


def _family() -> list[RequestRecord]:
    """Two agent turns: the second prompt = the first + its output + a new chunk."""
    p0 = list(range(40))
    o0 = [100, 101]
    p1 = p0 + o0 + [7] * 30
    return [
        RequestRecord("r0", p0, o0, lane=0, turn=0),
        RequestRecord("r1", p1, [5], lane=0, turn=1, meta_info={"k": 1}),
    ]


# -- the bytes on disk -----------------------------------------------------------------


def test_golden_bytes_of_two_requests_sharing_a_prefix(tmp_path: Path) -> None:
    path = _write(tmp_path / "b", _family())
    seg = list_segments(path)[0]
    data = seg.read_bytes()
    assert data[:8] == b"KVCB" + struct.pack("<HH", 2, 0)
    frames = _frames(seg)
    assert [_tag(b) for _, b in frames] == ["header", "preq", "preq", "trailer"]
    r0, r1 = frames[1][1], frames[2][1]
    tail0 = struct.pack("<40I", *range(40))
    out0 = struct.pack("<2I", 100, 101)
    # r0 stands alone: base 0, ref -1, prefix 0; its 42-token sequence adds block 0
    assert r0 == (
        b"\xdc\x00\x18\xa4preq\xa2r0\x00\xff\x00"
        + b"\xc4\xa0"
        + tail0
        + b"\xc4\x08"
        + out0
        + b"\xc0\xc0\xc0\x00\xc0\x00" + b"\xc0" * 7 + b"\xa6driver\xc0\xc0\x80"
    )  # fmt: skip
    # r1 starts with block 0 (32 ids): base 1, ref 0, prefix 32, its own 40 ids after it
    tail1 = struct.pack("<40I", *range(32, 40), 100, 101, *[7] * 30)
    assert r1 == (
        b"\xdc\x00\x18\xa4preq\xa2r1\x01\x00\x20"
        + b"\xc4\xa0"
        + tail1
        + b"\xc4\x04"
        + struct.pack("<I", 5)
        + b"\xc0\xc0\xc0\x00\xc0\x01" + b"\xc0" * 7 + b"\xa6driver\xc0\xc0\x81\xa1k\x01"
    )  # fmt: skip
    assert BundleReader(path).requests() == _family()
    # the trailer counts them as requests
    assert _ANY.decode(frames[3][1])[3] == {"header": 1, "request": 2}


def test_msgpack_uint_array_is_the_msgpack_of_the_ids() -> None:
    from array import array

    for n in (0, 1, 15, 16, 65535, 65536, 70000):
        ids = [(i * 2654435761) % (1 << 32) for i in range(n)]
        raw = msgpack_uint_array(array("I", ids))
        assert msgspec.msgpack.decode(raw) == ids


# -- the round trip --------------------------------------------------------------------


@st.composite
def families(draw: st.DrawFn) -> list[RequestRecord]:
    """Prompt families: each prompt is an earlier prompt (+ its output, sometimes cut
    anywhere) + new ids, or a fresh one; ids from a tiny alphabet (accidental matches) or
    the full uint32 range, sometimes beyond it (stored in the full layout)."""
    big = draw(st.booleans())
    hi = (1 << 32) - 1 if big else 3
    ids = st.integers(0, hi)
    n = draw(st.integers(1, 12))
    out: list[RequestRecord] = []
    seqs: list[list[int]] = []
    for i in range(n):
        if seqs and draw(st.booleans()):
            base = draw(st.sampled_from(seqs))
            cut = draw(st.integers(0, len(base)))
            prompt = base[: cut if draw(st.booleans()) else len(base)]
        else:
            prompt = []
        prompt = prompt + draw(st.lists(ids, max_size=3 * BLOCK))
        if draw(st.integers(0, 9)) == 0:
            prompt.append(1 << 40)  # beyond uint32: this record is stored in full
        output = draw(st.lists(ids, max_size=BLOCK + 5))
        out.append(RequestRecord(f"r{i}", prompt, output, lane=i % 3, turn=i))
        seqs.append(prompt + output)
    return out


@given(
    reqs=families(),
    segment_bytes=st.sampled_from([256 << 20, 600, 2000]),
)
@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
def test_round_trip_of_prompt_families(
    tmp_path_factory: pytest.TempPathFactory, reqs: list[RequestRecord], segment_bytes: int
) -> None:
    path = _write(tmp_path_factory.mktemp("p") / "b", reqs, segment_bytes=segment_bytes)
    reader = BundleReader(path)
    assert reader.requests() == reqs
    assert list(reader.iter_kinds("request")) == reqs
    assert not reader.report.damaged
    assert [r for r in reader.records() if type(r) is RequestRecord] == reqs
    views = [r for r in reader.records(request_view=True) if type(r) is RequestRecordView]
    assert [
        (v.rid, msgspec.msgpack.decode(v.input_ids), msgspec.msgpack.decode(v.output_ids))
        for v in views
    ] == [(r.rid, r.input_ids, r.output_ids) for r in reqs]
    # "u32": packed requests as the reader's uint32 arrays, the rest as views, in order
    kinds = (RequestRecordView, RequestRecordU32View)
    u32 = [r for r in reader.records(request_view="u32") if type(r) in kinds]
    assert [
        (v.rid, list(v.input_ids), list(v.output_ids))
        if type(v) is RequestRecordU32View
        else (v.rid, msgspec.msgpack.decode(v.input_ids), msgspec.msgpack.decode(v.output_ids))
        for v in u32
    ] == [(r.rid, r.input_ids, r.output_ids) for r in reqs]
    assert all(type(v.input_ids) is array for v in u32 if type(v) is RequestRecordU32View)
    assert [msgspec.structs.astuple(v)[3:] for v in u32] == [
        msgspec.structs.astuple(r)[3:] for r in reqs
    ]
    # ``request_arrays``: the same records, a packed request's ids the reader's arrays (never
    # made lists), one stored in full (an id beyond uint32) as written
    arrs = list(reader.request_arrays())
    assert [(a.rid, list(a.input_ids), list(a.output_ids)) for a in arrs] == [
        (r.rid, r.input_ids, r.output_ids) for r in reqs
    ]
    assert [msgspec.structs.astuple(a)[3:] for a in arrs] == [
        msgspec.structs.astuple(r)[3:] for r in reqs
    ]
    packed_ones = [type(v) is RequestRecordU32View for v in u32]
    assert [type(a.input_ids) is array and type(a.output_ids) is array for a in arrs] == packed_ones
    assert all(type(a.input_ids) is list for a, p in zip(arrs, packed_ones, strict=True) if not p)
    # references never leave their segment; every segment's first request stands alone
    for seg in list_segments(path):
        packed = [_PACKED.decode(b) for _, b in _frames(seg) if _tag(b) == "preq"]
        known = 0
        for p in packed:
            assert p.base == known and p.ref < p.base
            full = (p.prefix_len + (len(p.input_tail) + len(p.output)) // 4) // BLOCK
            known += full - p.prefix_len // BLOCK
        if packed:
            assert packed[0].ref == -1


def test_compact_bundle_is_smaller_and_sharing_pays(tmp_path: Path) -> None:
    prompt = list(range(1000, 1000 + 64 * BLOCK))
    reqs = []
    for i in range(20):
        out = [i] * 50
        reqs.append(RequestRecord(f"r{i}", list(prompt), out))
        prompt = prompt + out + [70000 + i] * 40
    full = _write(tmp_path / "full", reqs, compact_requests=False)
    compact = _write(tmp_path / "compact", reqs)
    size = [sum(p.stat().st_size for p in list_segments(b)) for b in (full, compact)]
    assert size[1] * 8 < size[0]
    r = BundleReader(compact)
    assert r.requests() == reqs == BundleReader(full).requests()
    assert r.report.packed_requests == 20
    assert r.report.packed_ids == sum(len(x.input_ids) + len(x.output_ids) for x in reqs)
    assert r.report.packed_bytes < 4 * r.report.packed_ids // 10
    assert BundleReader(full).report.packed_requests == 0


# -- older bundles ---------------------------------------------------------------------


def _major(bundle: Path) -> set[bytes]:
    return {s.read_bytes()[4:6] for s in list_segments(bundle)}


def _corpus_bundles(major: int | None = 1) -> list[Path]:
    """The corpus bundles written in format ``major`` (None: all); the captures recorded
    before format 2.0 are 1.x, the later ones 2.0."""
    found = sorted(CORPUS.glob("*/bundle"))
    assert found, "the vendored corpus is missing"
    if major is None:
        return found
    return [b for b in found if _major(b) == {bytes([major, 0])}]


def test_corpus_has_both_formats() -> None:
    """Seven corpus captures predate format 2.0, later ones are 2.0: both readers stay tested."""
    ones, twos = _corpus_bundles(1), _corpus_bundles(2)
    assert len(ones) >= 7 and len(twos) >= 1
    assert len(ones) + len(twos) == len(_corpus_bundles(None))
    for b in twos:  # every request of a 2.0 bundle is a packed one
        r = BundleReader(b)
        n = len(r.requests())  # (the read fills ``report``)
        assert r.report.packed_requests == n > 0, b


@pytest.mark.parametrize(
    "bundle", [*_corpus_bundles(), SAMPLE], ids=lambda p: p.parent.name if p != SAMPLE else "sample"
)
def test_old_format_bundles_read_unchanged(bundle: Path, tmp_path: Path) -> None:
    """The vendored 1.x bundles: every request frame reads as its stored record (decoded
    directly), and written again in 2.0 they read back identical, smaller."""
    segs = list_segments(bundle)
    assert _major(bundle) == {b"\x01\x00"}  # major 1
    dec = msgspec.msgpack.Decoder(RequestRecord)
    direct = [dec.decode(b) for s in segs for _, b in _frames(s) if _tag(b) == "request"]
    reader = BundleReader(bundle)
    reqs = reader.requests()
    assert reqs == direct and len(reqs) > 0
    assert reader.report.packed_requests == 0
    again = _write(tmp_path / "b2", reqs)
    assert BundleReader(again).requests() == reqs
    old = sum(len(b) for s in segs for _, b in _frames(s) if _tag(b) == "request")
    new = sum(len(b) for s in list_segments(again) for _, b in _frames(s) if _tag(b) == "preq")
    assert new < old


def test_append_keeps_a_1x_bundle_1x(tmp_path: Path) -> None:
    src = _corpus_bundles()[0]
    path = tmp_path / "b"
    shutil.copytree(src, path)
    before = BundleReader(path).requests()
    w = BundleWriter.append(path)
    fam = _family()
    for r in fam:
        w.write(r)
    w.close()
    last = list_segments(path)[-1]
    assert last.read_bytes()[4:8] == struct.pack("<HH", 1, 1)
    assert {_tag(b) for _, b in _frames(last)} == {"segment", "note", "request", "trailer"}
    assert BundleReader(path).requests() == before + fam


def test_append_to_a_2x_bundle_starts_a_fresh_index(tmp_path: Path) -> None:
    fam = _family()
    path = _write(tmp_path / "b", fam[:1])
    w = BundleWriter.append(path)
    w.write(fam[1])
    w.close()
    last = list_segments(path)[-1]
    packed = [_PACKED.decode(b) for _, b in _frames(last) if _tag(b) == "preq"]
    assert [(p.base, p.ref, p.prefix_len) for p in packed] == [(0, -1, 0)]
    assert BundleReader(path).requests() == fam


def test_ids_beyond_uint32_are_stored_in_full(tmp_path: Path) -> None:
    reqs = [
        RequestRecord("a", [1, 2, 1 << 33], [3]),
        RequestRecord("b", [1, 2, 3], [(1 << 63) - 1]),
        RequestRecord("c", list(range(50)), []),
    ]
    path = _write(tmp_path / "b", reqs)
    tags = [_tag(b) for _, b in _frames(list_segments(path)[0])]
    assert tags == ["header", "request", "request", "preq", "trailer"]
    assert BundleReader(path).requests() == reqs


def test_writer_refuses_a_packed_record_from_outside(tmp_path: Path) -> None:
    w = BundleWriter(tmp_path / "b", _header())
    with pytest.raises(TypeError, match="not a bundle record"):
        w.write(PackedRequest("x", 0, -1, 0, b"", b""))  # type: ignore[arg-type]
    w.close()


# -- bad references and damage ---------------------------------------------------------


def _rewrite_packed(path: Path, index: int, **changes: object) -> None:
    """Replace field values of the ``index``-th packed request of segment 0 (CRC redone)."""
    seg = list_segments(path)[0]
    data = seg.read_bytes()
    frames = [(p, b) for p, b in _frames(seg) if _tag(b) == "preq"]
    pos, body = frames[index]
    rec = msgspec.structs.replace(_PACKED.decode(body), **changes)
    new = msgspec.msgpack.encode(rec)
    frame = FRAME_HEADER.pack(len(new), zlib.crc32(new)) + new
    seg.write_bytes(data[:pos] + frame + data[pos + FRAME_HEADER_SIZE + len(body) :])


@pytest.mark.parametrize(
    ("changes", "why"),
    [
        ({"ref": 5}, "reference to block 5, which is not before block 1"),
        ({"base": 0}, "its first block is numbered 0, 1 were read before it"),
        ({"base": 10**12, "ref": -1, "prefix_len": 0}, "more than the bytes before it can hold"),
        ({"prefix_len": 64}, "prefix length 64 but block 0 ends a chain of 32 tokens"),
        ({"prefix_len": 33}, "prefix length 33 is not a multiple of 32"),
        ({"output": b"\x01\x02\x03"}, "output is 3 bytes, not a whole number of uint32 ids"),
    ],
)
def test_a_bad_reference_is_one_input_error_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], changes: dict[str, object], why: str
) -> None:
    path = _write(tmp_path / "b", _family())
    _rewrite_packed(path, 1, **changes)
    with pytest.raises(InputError, match="rid='r1'") as exc:
        BundleReader(path).requests()
    assert why in str(exc.value) and "\n" not in str(exc.value)
    for argv in (["inspect", str(path)], ["sql", str(path), "SELECT count(*) FROM requests"]):
        assert main(argv) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and err.startswith("kvcadence: error: ")
        assert why in err and "Traceback" not in err


def test_a_request_whose_prefix_was_lost_counts_as_corrupt(tmp_path: Path) -> None:
    fam = _family()
    extra = RequestRecord("r2", [9] * 10, [])
    path = _write(tmp_path / "b", [*fam, extra])
    seg = list_segments(path)[0]
    data = bytearray(seg.read_bytes())
    pos, body = [(p, b) for p, b in _frames(seg) if _tag(b) == "preq"][0]
    data[pos + FRAME_HEADER_SIZE + 20] ^= 0xFF  # r0's body: its CRC fails
    seg.write_bytes(bytes(data))
    reader = BundleReader(path)
    assert reader.requests() == [extra]  # r1 needs r0's block 0: lost with it
    rep = reader.report
    assert [c[1] for c in rep.corrupt] == [pos, pos + FRAME_HEADER_SIZE + len(body)]
    assert rep.damaged
    with pytest.raises(CorruptFrameError):
        BundleReader(path, strict=True).requests()


def test_a_torn_last_segment_keeps_every_request_before_the_tear(tmp_path: Path) -> None:
    prompt: list[int] = []
    reqs = []
    for i in range(40):
        prompt = (prompt if i % 8 else []) + list(range(i * 100, i * 100 + 45))
        reqs.append(RequestRecord(f"r{i}", list(prompt), [i] * 7))
    path = _write(tmp_path / "b", reqs, segment_bytes=3000)
    segs = list_segments(path)
    assert len(segs) > 4
    while not any(_tag(b) == "preq" for _, b in _frames(segs[-1])):
        segs.pop().unlink()  # a crash before these were written
    last = segs[-1]
    packed = [(p, b) for p, b in _frames(last) if _tag(b) == "preq"]
    assert len(packed) >= 2 and _PACKED.decode(packed[-1][1]).ref >= 0
    pos, body = packed[-1]
    last.write_bytes(last.read_bytes()[: pos + FRAME_HEADER_SIZE + len(body) // 2])
    reader = BundleReader(path)
    got = reader.requests()
    assert len(got) >= len(reqs) - 2 and got == reqs[: len(got)]
    assert reader.report.torn_bytes > 0 and reader.report.corrupt == []
    # a lost middle segment costs its own requests only: references stay in a segment
    in_seg1 = {_PACKED.decode(b).rid for _, b in _frames(segs[1]) if _tag(b) == "preq"}
    segs[1].unlink()
    kept = BundleReader(path).requests()
    assert in_seg1 and {r.rid for r in got} - {r.rid for r in kept} == in_seg1
    assert kept == [r for r in got if r.rid not in in_seg1]


def test_analysis_tables_are_the_same_for_both_layouts(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Ingest reads packed requests through the view path: the requests table (the ids'
    counts) and the ids (``request_ids``) are the ones the full layout gives."""
    prompt = list(range(70000, 70000 + 3 * BLOCK + 5))
    reqs = []
    for i in range(12):
        out = [i, 65536 + i, 127]
        reqs.append(RequestRecord(f"r{i:02d}", list(prompt), out, lane=i % 2, turn=i))
        prompt = prompt + out + [200 + i] * 17
    docs = []
    for compact in (False, True):
        path = _write(tmp_path / f"b{compact}", reqs, compact_requests=compact)
        q = (
            "SELECT request_id, n_input, n_output, input_ids, output_ids FROM requests "
            "JOIN request_ids USING (request_id) ORDER BY 1"
        )
        assert (
            main(
                ["sql", str(path), q, "--format", "json", "--cache", str(tmp_path / f"c{compact}")]
            )
            == 0
        )
        docs.append(capsys.readouterr().out)
    assert docs[0] == docs[1]
    rows = json.loads(docs[1])
    assert [(r["input_ids"], r["output_ids"]) for r in rows] == [
        (r.input_ids, r.output_ids) for r in reqs
    ]
    assert [r["n_input"] for r in rows] == [len(r.input_ids) for r in reqs]


def _packed_rids(path: Path) -> list[str]:
    return [
        _PACKED.decode(b).rid
        for s in list_segments(path)
        for _, b in _frames(s)
        if _tag(b) == "preq"
    ]


def test_every_request_writer_stores_packed_requests(tmp_path: Path, fixture_dir: Path) -> None:
    """``import`` (new and ``--append``) and ``capture import --sglang-metrics`` write
    through ``BundleWriter``: their requests are stored packed and read back whole."""
    truth = [json.loads(x) for x in (fixture_dir / "requests.jsonl").read_text().splitlines()]
    b = tmp_path / "imported"
    argv = ["import", "--frames", str(fixture_dir / "events.jsonl")]
    argv += ["--requests", str(fixture_dir / "requests.jsonl"), "--out", str(b)]
    assert main(argv) == 0
    got = BundleReader(b).requests()
    assert [(r.rid, r.input_ids, r.output_ids) for r in got] == [
        (t["rid"], t["input_ids"], t.get("output_ids", [])) for t in truth
    ]
    assert _packed_rids(b) == [t["rid"] for t in truth]
    more = tmp_path / "more.jsonl"
    more.write_text(json.dumps({"rid": "x", "input_ids": truth[-1]["input_ids"] + [5]}) + "\n")
    assert main(["import", "--append", "--requests", str(more), "--out", str(b)]) == 0
    assert _packed_rids(b)[-1] == "x"
    assert BundleReader(b).requests()[-1].input_ids == truth[-1]["input_ids"] + [5]
    m = tmp_path / "metrics"
    metrics = str(fixture_dir / "sglang-metrics")
    assert main(["capture", "import", "--quiet", "--sglang-metrics", metrics, str(m)]) == 0
    reqs = BundleReader(m).requests()
    assert len(reqs) == 120 and sorted(_packed_rids(m)) == sorted(r.rid for r in reqs)
    by_rid = {t["rid"]: t["input_ids"] for t in truth}
    assert all(r.input_ids == by_rid[r.rid] for r in reqs)


def test_the_longest_shared_prefix_is_found_across_runs_and_branches(tmp_path: Path) -> None:
    """The writer follows a block's run with slice comparisons and falls back to the dict
    where the run ends or diverges: every prompt gets its longest block-aligned prefix."""
    a = list(range(100, 100 + 50 * BLOCK))  # one run of 50 blocks
    b = a[: 37 * BLOCK] + [1] * (5 * BLOCK)  # diverges inside a's run: a branch
    c = b + [2] * (3 * BLOCK)  # follows b's run (which starts at block 37)
    d = a[: 20 * BLOCK] + [3]  # a prefix of a's run, then a partial block
    e = a + [4] * BLOCK  # a's run to its end, then a new block
    reqs = [RequestRecord(f"r{i}", p, []) for i, p in enumerate([a, b, c, d, e])]
    path = _write(tmp_path / "b", reqs)
    packed = [_PACKED.decode(x) for _, x in _frames(list_segments(path)[0]) if _tag(x) == "preq"]
    assert [p.prefix_len // BLOCK for p in packed] == [0, 37, 42, 20, 50]
    assert [p.ref for p in packed] == [-1, 36, 54, 19, 49]
    assert BundleReader(path).requests() == reqs


def test_the_writer_starts_a_segment_when_its_index_is_full(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from kvcadence.format.bundle import compact

    monkeypatch.setattr(compact, "MAX_BLOCKS", 6)
    prompt: list[int] = []
    reqs = []
    for i in range(12):
        prompt = prompt + [i] * BLOCK
        reqs.append(RequestRecord(f"r{i}", list(prompt), [7] * 3))
    path = _write(tmp_path / "b", reqs)
    segs = list_segments(path)
    assert len(segs) >= 3
    for seg in segs:
        packed = [_PACKED.decode(b) for _, b in _frames(seg) if _tag(b) == "preq"]
        if packed:
            assert packed[0].ref == -1 and packed[-1].base < 6
    assert BundleReader(path).requests() == reqs


def test_packed_request_carries_every_request_field_in_order() -> None:
    """``compact`` copies the fields after the ids positionally: the layouts must agree."""
    tail = PackedRequest.__struct_fields__[6:]
    assert tail == RequestRecord.__struct_fields__[3:] == RequestRecordView.__struct_fields__[3:]
    packed, full = PackedRequest.__struct_defaults__, RequestRecord.__struct_defaults__[1:]
    assert len(packed) == len(full)
    assert [repr(d) for d in packed] == [repr(d) for d in full]  # factories print alike
    p, r = PackedRequest("x", 0, -1, 0, b"", b""), RequestRecord("x", [])
    assert msgspec.structs.astuple(p)[6:] == msgspec.structs.astuple(r)[3:]


def test_events_and_notes_skip_packed_requests_by_their_first_bytes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A packed request (24 fields: an array16 header) is skipped unread by
    ``events_and_notes``, as its fast path means: no decode tried, no slow path."""
    from kvcadence.format.bundle import reader as reader_mod

    b = _write(tmp_path / "b", _family())
    seg = list_segments(b)[0]
    body = next(x for _, x in _frames(seg) if _tag(x) == "preq")
    assert body[0] == 0xDC  # what the skip reads
    slow: list[str] = []  # the tags of the frames the slow path was asked to decode
    monkeypatch.setattr(
        reader_mod.BundleReader, "_decode_slow", lambda *a: slow.append(_tag(bytes(a[4])))
    )
    assert list(BundleReader(b).events_and_notes(())) == []
    assert "preq" not in slow  # (the header and trailer are always looked at)


def test_events_and_notes_step_over_unread_frames_without_their_crc(tmp_path: Path) -> None:
    """The frames ``events_and_notes(kinds)`` skips (notes of other kinds, packed requests)
    are stepped over by their length, their CRC not checked: damage inside one is not
    reported (counted in ``report.unread``); the same damage is where every frame is
    checked (``records()``, a strict reader)."""
    from kvcadence.format.schema import Annotation

    w = BundleWriter(tmp_path / "b", _header())
    for r in _family():
        w.write(r)
    w.write(Annotation(kind="visibility", recv_ns=1, data={"x": list(range(20))}))
    w.write_event(
        endpoint=0, seq=0, recv_ns=2, topic="kv-events", payload=b"\x93\x01\x90\xc0", via=0, epoch=0
    )
    w.close(end_ns=0)
    b = tmp_path / "b"
    want = list(BundleReader(b).events_and_notes(()))
    assert len(want) == 1  # the event
    (seg,) = list_segments(b)
    note_at = next(pos for pos, x in _frames(seg) if b"visibility" in x)
    data = bytearray(seg.read_bytes())
    data[note_at + FRAME_HEADER_SIZE + 30] ^= 0xFF  # inside the note's data
    seg.write_bytes(bytes(data))
    rd = BundleReader(b)
    assert list(rd.events_and_notes(())) == want
    assert not rd.report.corrupt and not rd.report.damaged
    assert rd.report.unread == 1 + sum(1 for _, x in _frames(seg) if _tag(x) == "preq")
    rd = BundleReader(b)
    list(rd.records())
    assert rd.report.corrupt  # every frame's CRC checked
    with pytest.raises(CorruptFrameError):
        list(BundleReader(b, strict=True).events_and_notes(()))


def test_a_read_of_requests_steps_over_event_frames_unread(tmp_path: Path) -> None:
    """Reading requests only (``requests()``, ``request_arrays()``, ``request_rids()``),
    the event frames -- most of a capture -- are stepped over by their first bytes, their
    CRC not checked and no decode tried: damage inside one is not reported there (counted
    in ``report.unread``); every frame is checked where all are read, or strictly."""
    w = BundleWriter(tmp_path / "b", _header())
    w.write_event(
        endpoint=0, seq=0, recv_ns=1, topic="kv-events", payload=b"\x93\x01\x90\xc0", via=0, epoch=0
    )
    for r in _family():
        w.write(r)
    for seq in (1, 2):
        w.write_event(
            endpoint=0, seq=seq, recv_ns=2, topic="kv-events", payload=b"\x93\x01\x90\xc0", via=0,
            epoch=0,
        )  # fmt: skip
    w.close(end_ns=0)
    b = tmp_path / "b"
    want = [r.rid for r in BundleReader(b).requests()]
    assert want == [r.rid for r in _family()]
    (seg,) = list_segments(b)
    events = [pos for pos, x in _frames(seg) if _tag(x) == "event"]
    assert len(events) == 3
    data = bytearray(seg.read_bytes())
    data[events[-1] + FRAME_HEADER_SIZE + 12] ^= 0xFF  # inside the last event frame
    seg.write_bytes(bytes(data))
    for read in ("requests", "request_arrays", "request_rids"):
        rd = BundleReader(b)
        got = list(getattr(rd, read)())
        assert [x if type(x) is str else x.rid for x in got] == want, read
        assert not rd.report.corrupt and not rd.report.damaged, read
        # (a segment's first frame is always read: the first event frame is after the header)
        assert rd.report.unread == 3, read
    rd = BundleReader(b)
    list(rd.records())
    assert rd.report.corrupt  # every frame's CRC checked
    with pytest.raises(CorruptFrameError):
        list(BundleReader(b, strict=True).requests())


@pytest.mark.parametrize("compact", [True, False])
def test_request_ids_given_as_arrays_are_written_as_lists_are(
    tmp_path: Path, compact: bool
) -> None:
    """A ``RequestRecord`` whose ids are ``array``s (what a replay writes: packed as they
    are, no int object made) is stored exactly as the same record with lists: packed, in a
    1.x bundle (``compact_requests=False``), and stored whole (an id beyond uint32, ``q``)."""
    prompt = [7] * (3 * BLOCK) + [1, 2, 3]
    reqs = [
        RequestRecord("a", prompt, [4, 5], lane=0, turn=0),
        RequestRecord("b", [*prompt, 4, 5, 6], [8], lane=0, turn=1),
        RequestRecord("w", [1 << 40, 3], [2], lane=1, turn=0),
    ]

    def as_arrays(r: RequestRecord) -> RequestRecord:
        code = "q" if max(r.input_ids) >= 1 << 32 else "I"
        return msgspec.structs.replace(
            r, input_ids=array(code, r.input_ids), output_ids=array("I", r.output_ids)
        )

    def stored(path: Path) -> list[tuple[str, object]]:
        rd = BundleReader(path)
        return [(type(r).__name__, r) for r in rd.records(request_view="u32")]

    lists = _write(tmp_path / "l", reqs, compact_requests=compact)
    arrays = _write(tmp_path / "a", [as_arrays(r) for r in reqs], compact_requests=compact)
    assert BundleReader(arrays).requests() == reqs
    kinds = [k for k, _ in stored(arrays)]
    assert kinds == [k for k, _ in stored(lists)]
    assert kinds.count("RequestRecordU32View") == (2 if compact else 0)
