"""Resynchronising past damage is linear in the damaged span (a crafted 1 MiB
segment took 27.5 s, 64 MiB of garbage at a tail 52 s). Work is counted as bytes handed to
``zlib.crc32`` -- deterministic, unlike a timing -- and the records around the damage are
read back."""

from __future__ import annotations

import random
import struct
import zlib
from pathlib import Path

import msgspec
import pytest

from kvcadence.format.bundle import BundleReader, BundleWriter
from kvcadence.format.bundle.crcspan import SpanCrc
from kvcadence.format.schema import FORMAT_MAJOR, Header, RequestRecord

N = 256 << 10


def _claims_to_end(n: int) -> bytes:
    """A candidate frame every 10 bytes, each claiming a body that runs to the end."""
    junk = bytearray()
    while len(junk) < n:
        junk += struct.pack("<II", max(n - len(junk) - 8, 2), 0) + b"\x91\xa0"
    return bytes(junk[:n])


def _nested(n: int) -> bytes:
    """Frames nested in each other's bodies ([tag, bin(next frame)]): every candidate is one
    well-formed msgpack value of exactly its claimed length; only the CRCs are wrong."""
    inner = msgspec.msgpack.encode(["x"])
    parts = [struct.pack("<II", len(inner), 0) + inner]
    size = len(parts[0])
    heads = []
    while size < n:  # build outside-in without re-encoding: header + array + bin header
        bin_head = b"\xc6" + struct.pack(">I", size)
        body_len = 3 + len(bin_head) + size
        heads.append(struct.pack("<II", body_len, 0) + b"\x92\xa1x" + bin_head)
        size += 8 + 3 + len(bin_head)
    return b"".join(reversed(heads)) + parts[0]


def _random(n: int) -> bytes:
    return random.Random(1).randbytes(n)


@pytest.mark.parametrize("make", [_claims_to_end, _nested, _random])
def test_resync_work_is_linear_in_the_damage(tmp_path: Path, monkeypatch, make) -> None:
    junk = make(N)
    b = tmp_path / "b"
    w = BundleWriter(b, Header(FORMAT_MAJOR, 0, "real", "x"))
    w.write(RequestRecord("before", [1]))
    w.flush()
    w._file.write(junk)  # damage in the middle of the segment
    w.write(RequestRecord("after", [2]))
    w.close()
    crc_bytes = 0
    real_crc32 = zlib.crc32

    def counting(data, value=0):  # noqa: ANN001
        nonlocal crc_bytes
        crc_bytes += len(data)
        return real_crc32(data, value)

    monkeypatch.setattr(zlib, "crc32", counting)
    r = BundleReader(b)
    assert [q.rid for q in r.requests()] == ["before", "after"]
    assert r.report.corrupt_bytes == len(junk)
    # quadratic was ~N**2/20 bytes (~3.4 GB here); linear stays within a few times N
    assert crc_bytes < 40 * N, crc_bytes


def test_span_crc_equals_zlib() -> None:
    rng = random.Random(7)
    data = rng.randbytes(200_000)
    s = SpanCrc(data, 3_000)
    for _ in range(500):
        a = rng.randrange(3_000, 199_000)
        b = rng.randrange(a, 200_000)
        assert s.crc(a, b) == zlib.crc32(data[a:b])
    assert s.crc(10, 20_000) == zlib.crc32(data[10:20_000])  # before its start: direct
