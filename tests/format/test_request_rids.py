"""``BundleReader.request_rids``: the rids of a bundle's requests read without their ids
(the duplicate checks of ``import --append`` and ``capture import``), the same as reading
every record, on real captures (packed format 2.0 requests, DP, several segments)."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvcadence.format.bundle import BundleReader, BundleWriter
from kvcadence.format.schema import RequestRecord, RequestRecordView

DATA = Path(__file__).parent.parent / "replay" / "data"
BUNDLES = [
    DATA / "corpus" / "p1-lanes8" / "bundle",
    DATA / "corpus" / "dp2-p4-flush" / "bundle",
    DATA / "corpus" / "http-clients-p16" / "bundle",
]


def _slow(path: Path) -> list[str]:
    return [r.rid for r in BundleReader(path).records(request_view=True)
            if type(r) is RequestRecordView]  # fmt: skip


@pytest.mark.parametrize("path", BUNDLES, ids=lambda p: p.parent.name)
def test_the_rids_of_every_request_in_order(path):
    got = list(BundleReader(path).request_rids())
    assert got == _slow(path) and len(got) >= 200


def test_across_segments_and_both_layouts(tmp_path):
    """Packed and full request records (a 1.x-style writer's), several segments."""
    from tests.format.test_bundle import make_header

    b = tmp_path / "b"
    with BundleWriter(b, make_header(), segment_bytes=256) as w:
        for i in range(40):
            w.write(RequestRecord(rid=f"p{i}", input_ids=list(range(i, i + 70))))
    with BundleWriter(tmp_path / "full", make_header(), compact_requests=False) as w:
        for i in range(5):
            w.write(RequestRecord(rid=f"f{i}", input_ids=[i]))
    assert list(BundleReader(b).request_rids()) == [f"p{i}" for i in range(40)] == _slow(b)
    assert list(BundleReader(tmp_path / "full").request_rids()) == [f"f{i}" for i in range(5)]
    assert len(list(b.glob("seg-*"))) > 3
