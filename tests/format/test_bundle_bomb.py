"""Expansion bombs in compact request storage (format 2.0): a packed request may expand to at
most ``bounds.MAX_REQUEST_TOKENS`` ids, and a crafted reference is one error line, never an
allocation without bound.

* a prefix length past the limit is refused before any chain is walked or copied;
* many tiny records naming one long chain (the bomb's shape) stop at the first that
  would expand past the limit: one ``InputError`` line, exit 2 at the CLI;
* a chain longer than the prefix length says is refused without walking it to its end;
* any crafted field values make the resolver return at most the limit, or refuse;
* the writer stores a request longer than the limit whole, so what it writes reads back.
"""

from __future__ import annotations

import zlib
from array import array
from pathlib import Path

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvcadence.cli import main
from kvcadence.errors import InputError
from kvcadence.format.bounds import MAX_REQUEST_TOKENS
from kvcadence.format.bundle import (
    FRAME_HEADER,
    FRAME_HEADER_SIZE,
    SEGMENT_HEADER_SIZE,
    BundleReader,
    BundleWriter,
    compact,
    list_segments,
)
from kvcadence.format.bundle.compact import BLOCK, BadReference, LostPrefix, PrefixResolver
from kvcadence.format.schema import FORMAT_MAJOR, Header, PackedRequest, RequestRecord
from tests.test_hostile_inputs import one_error_line

_ANY = msgspec.msgpack.Decoder()
_PACKED = msgspec.msgpack.Decoder(PackedRequest)


def _write(path: Path, reqs: list[RequestRecord]) -> Path:
    h = Header(format_major=FORMAT_MAJOR, format_minor=0, source="real", kvcadence_version="t")
    with BundleWriter(path, h) as w:
        for r in reqs:
            w.write(r)
    return path


def _packed_frames(seg: Path) -> list[tuple[int, bytes]]:
    data = seg.read_bytes()
    out, pos = [], SEGMENT_HEADER_SIZE
    while pos + FRAME_HEADER_SIZE <= len(data):
        n, _ = FRAME_HEADER.unpack_from(data, pos)
        body = data[pos + FRAME_HEADER_SIZE : pos + FRAME_HEADER_SIZE + n]
        if _ANY.decode(body)[0] == "preq":
            out.append((pos, body))
        pos += FRAME_HEADER_SIZE + n
    return out


def _rewrite(path: Path, index: int, **changes: object) -> None:
    """Hand-craft the ``index``-th packed request of segment 0 (its CRC redone)."""
    seg = list_segments(path)[0]
    data = seg.read_bytes()
    pos, body = _packed_frames(seg)[index]
    new = msgspec.msgpack.encode(msgspec.structs.replace(_PACKED.decode(body), **changes))
    frame = FRAME_HEADER.pack(len(new), zlib.crc32(new)) + new
    seg.write_bytes(data[:pos] + frame + data[pos + FRAME_HEADER_SIZE + len(body) :])


def _bomb(path: Path, blocks: int, copies: int) -> Path:
    """One request of ``blocks`` full blocks, then ``copies`` requests each naming its whole
    chain plus one token: a few bytes each, ``blocks * 32 + 1`` ids each."""
    p0 = [(7 * i) % 30_000 for i in range(blocks * BLOCK)]
    reqs = [RequestRecord("seed", p0, [])]
    reqs += [RequestRecord(f"c{i}", p0 + [i], []) for i in range(copies)]
    return _write(path, reqs)


def test_a_prefix_length_past_the_limit_is_refused_before_anything_is_walked(tmp_path, capsys):
    path = _bomb(tmp_path / "b", 2, 1)
    huge = (MAX_REQUEST_TOKENS // BLOCK + 1) * BLOCK
    _rewrite(path, 1, prefix_len=huge)
    with pytest.raises(InputError, match="rid='c0'") as exc:
        BundleReader(path).requests()
    msg = str(exc.value)
    assert f"expands to {huge + 1} token ids" in msg and "MAX_REQUEST_TOKENS" in msg
    assert main(["inspect", str(path)]) == 2
    assert "expands to" in one_error_line(capsys.readouterr().err)


def test_tiny_records_naming_one_long_chain_stop_at_the_limit(tmp_path, capsys, monkeypatch):
    # the real limit needs 16 MB of stored ids to reach; the same shape at a limit of 1,280:
    # the seed's chain (1,280 ids) is within it, each tiny record naming it (+1 id) is not
    path = _bomb(tmp_path / "b", 40, 200)  # 200 records of ~40 bytes, 1,281 ids each
    assert list_segments(path)[0].stat().st_size < 20_000
    assert [r.rid for r in BundleReader(path).requests()][:2] == ["seed", "c0"]
    monkeypatch.setattr(compact, "MAX_REQUEST_TOKENS", 40 * BLOCK)
    with pytest.raises(InputError, match="rid='c0'.*expands to 1281 token ids"):
        BundleReader(path).requests()
    for argv in (["inspect", str(path)], ["sql", str(path), "SELECT count(*) FROM requests"]):
        assert main(argv) == 2
        assert "more than the 1280 a request may hold" in one_error_line(capsys.readouterr().err)


def test_a_chain_longer_than_its_prefix_length_is_refused(tmp_path):
    path = _bomb(tmp_path / "b", 40, 1)
    _rewrite(path, 1, prefix_len=BLOCK)  # names block 39: a chain of 40 blocks
    with pytest.raises(InputError, match="prefix length 32 but block 39 ends a longer chain"):
        BundleReader(path).requests()


def test_a_request_longer_than_the_limit_is_stored_whole_and_reads_back(tmp_path, monkeypatch):
    monkeypatch.setattr(compact, "MAX_REQUEST_TOKENS", 100)
    short = RequestRecord("short", list(range(64)), [1, 2])
    long = RequestRecord("long", list(range(64)) + [5] * 40, [3])  # 105 ids
    path = _write(tmp_path / "b", [short, long])
    tags = [_ANY.decode(b)[0] for _, b in _packed_frames(list_segments(path)[0])]
    assert tags == ["preq"]  # only the short one is packed
    assert BundleReader(path).requests() == [short, long]


_FIELDS = st.fixed_dictionaries(
    {
        "base": st.integers(-2, 400),
        "ref": st.integers(-3, 400),
        "prefix_len": st.integers(-BLOCK, 12 * BLOCK),
        "tail": st.integers(0, 3 * BLOCK),
        "out": st.integers(0, 2 * BLOCK),
    }
)


@settings(max_examples=300, deadline=None)
@given(st.lists(_FIELDS, min_size=1, max_size=30), st.integers(64, 400))
def test_crafted_references_expand_to_at_most_the_limit_or_are_refused(recs, limit):
    res = PrefixResolver()
    saved = compact.MAX_REQUEST_TOKENS
    compact.MAX_REQUEST_TOKENS = limit
    try:
        for f in recs:
            res.max_blocks = max(res.max_blocks, len(res.offset)) + 4
            rec = PackedRequest(
                "x",
                f["base"],
                f["ref"],
                f["prefix_len"],
                array("I", [3] * f["tail"]).tobytes(),
                array("I", [4] * f["out"]).tobytes(),
            )
            try:
                inp, out = res.resolve(rec)
            except (BadReference, LostPrefix):
                continue
            assert len(inp) + len(out) <= limit
            assert len(inp) == f["prefix_len"] + f["tail"]
            assert len(res.store) == BLOCK * sum(1 for o in res.offset if o >= 0)
    finally:
        compact.MAX_REQUEST_TOKENS = saved
