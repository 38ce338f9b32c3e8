"""``is_bundle`` and ``copy_bundle``: copies are bytes, a repair never reaches the source;
the demo copies the sample instead of linking it."""

from __future__ import annotations

import os

import pytest

from kvcadence.format.bundle import (
    BundleWriter,
    copy_bundle,
    is_bundle,
    list_segments,
)
from kvcadence.testing.publisher import payload_pool
from tests.capture.helpers import small_bundle

POOL = payload_pool(8)
BIG = 1 << 40


# ------------------------------------------------------------------ 6. bundle copies


def test_is_bundle(tmp_path):
    b = small_bundle(tmp_path / "b")
    assert is_bundle(b)
    assert not is_bundle(tmp_path / "missing") and not is_bundle(b / "seg-000000.kvcb")
    fake = tmp_path / "fake"
    fake.mkdir()
    assert not is_bundle(fake)
    (fake / "seg-000000.kvcb").write_bytes(b"NOPE0000")
    assert is_bundle(fake) and not is_bundle(fake, strict=True)  # segment files, wrong magic
    assert is_bundle(b, strict=True)
    (fake / "seg-000000.kvcb").unlink()
    (fake / "seg-x.kvcb").write_bytes(b"KVCB")  # not a segment name
    assert not is_bundle(fake)


def test_copy_bundle_copies_bytes_and_a_repair_never_reaches_the_source(tmp_path):
    src = small_bundle(tmp_path / "src")
    segs = list_segments(src)
    assert len(segs) > 1
    # a torn tail on the source's last segment, as a crash leaves it
    with open(segs[-1], "ab") as f:
        f.write(b"\x07\x00\x00\x00torn")
    before = {p.name: p.read_bytes() for p in segs}
    dst = tmp_path / "dst"
    copies = copy_bundle(src, dst)
    assert [p.name for p in copies] == [p.name for p in segs]
    for a, b in zip(segs, copies, strict=True):
        assert a.read_bytes() == b.read_bytes()
        assert os.stat(b).st_ino != os.stat(a).st_ino and os.stat(a).st_nlink == 1
    w = BundleWriter.append(dst)  # truncates the copy's torn tail in place
    assert w.append_report is not None and w.append_report.dropped_bytes == 8
    w.close()
    assert {p.name: p.read_bytes() for p in list_segments(src)} == before
    with pytest.raises(Exception, match="not empty; refusing to overwrite"):
        copy_bundle(src, dst)


def test_demo_copies_the_sample_instead_of_linking_it(tmp_path):
    from kvcadence import demo

    src = small_bundle(tmp_path / "src")
    demo._copy_bundle(src, tmp_path / "out" / "real.kvcb")
    for seg in list_segments(src):
        assert os.stat(seg).st_nlink == 1
    assert demo._is_bundle(tmp_path / "out" / "real.kvcb")
    assert not demo._is_bundle(tmp_path / "out")
