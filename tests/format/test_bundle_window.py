"""Reading through bounded windows (``SegmentWindow``): the records and the damage report of
any bundle -- clean, torn, bit-flipped, with garbage, over one or many segments -- are the
same whatever the window size, and the last segment is never read whole."""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvcadence.format.bundle import BundleReader, window
from tests.format.test_bundle_props import RECORDS, SETTINGS, comparable, write


def _read(path: Path, size: int | None, monkeypatch: Any = None) -> tuple[list[Any], Any]:
    saved = window.WINDOW, window._LAG
    if size is not None:
        window.WINDOW, window._LAG = size, size // 2
    try:
        r = BundleReader(path)
        got = [comparable(x) for x in r.records()]
        rep = r.report
        scans = [r.scan_segment(s) for s in r.segments]
    finally:
        window.WINDOW, window._LAG = saved
    return got, (rep, scans)


def _damage(path: Path, how: str, data: st.DataObject) -> None:
    segs = sorted(path.glob("seg-*.kvcb"))
    seg = data.draw(st.sampled_from(segs))
    raw = bytearray(seg.read_bytes())
    if len(raw) <= 9:
        return
    at = data.draw(st.integers(8, len(raw) - 1))
    if how == "flip":
        raw[at] ^= 1 << data.draw(st.integers(0, 7))
    elif how == "truncate":
        del raw[at:]
    elif how == "garbage":
        raw[at:at] = data.draw(st.binary(min_size=1, max_size=200))
    seg.write_bytes(bytes(raw))


@SETTINGS
@given(
    items=RECORDS,
    segment_bytes=st.sampled_from([256, 1000, 1 << 20]),
    how=st.sampled_from(["none", "flip", "truncate", "garbage"]),
    size=st.sampled_from([1, 7, 64, 300]),
    data=st.data(),
)
def test_any_window_reads_what_the_whole_segment_reads(
    items: list[object], segment_bytes: int, how: str, size: int, data: st.DataObject
) -> None:
    with tempfile.TemporaryDirectory() as d:
        path = Path(d) / "b"
        write(path, items, segment_bytes)
        if how != "none":
            _damage(path, how, data)
        try:
            want = _read(path, 1 << 30)  # one window: every segment whole
        except Exception as exc:  # a damaged header: the same error either way
            with pytest.raises(type(exc)):
                _read(path, size)
            return
        assert _read(path, size) == want


def test_the_last_segment_is_read_in_windows(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A ~1 MB last segment read with 64 KB windows: no read asks for more than a window
    plus a frame, and the records come back whole."""
    from kvcadence.format.bundle import BundleWriter
    from kvcadence.format.schema import RequestRecord
    from tests.format.test_bundle_props import HEADER

    with BundleWriter(tmp_path / "b", HEADER) as w:
        for i in range(4000):
            # no two prompts share a first token: nothing for format 2.0 to share
            w.write(RequestRecord(rid=f"r{i}", input_ids=[i * 1000 + j for j in range(i % 300)]))
    size = (tmp_path / "b" / "seg-000000.kvcb").stat().st_size
    assert size > 900 << 10
    reads: list[int] = []
    real_open = open

    class Spy:
        def __init__(self, f: Any) -> None:
            self.f = f

        def read(self, n: int = -1) -> bytes:
            reads.append(n)
            return self.f.read(n)

        def __getattr__(self, name: str) -> Any:
            return getattr(self.f, name)

    def spy_open(file: Any, mode: str = "r", *a: Any, **k: Any) -> Any:
        f = real_open(file, mode, *a, **k)
        return Spy(f) if str(file).endswith(".kvcb") and "b" in mode else f

    monkeypatch.setattr(window, "WINDOW", 64 << 10)
    monkeypatch.setattr(window, "open", spy_open, raising=False)
    r = BundleReader(tmp_path / "b")
    got = [x.rid for x in r.requests()]
    assert got == [f"r{i}" for i in range(4000)]
    assert reads and max(reads) <= (64 << 10) + 4096
    assert sum(reads) >= size - 8  # the whole segment, a window at a time
