"""A capture whose request records' clock is 54.9 s behind its event stream's
(``data/clock-offset-touch``, see its README): the replay places recorded flushes and
searches stores by time, so it needs the offset between the two clocks. Not estimated yet:
a strict xfail naming what the replay does today."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvcadence.cli import main
from kvcadence.format import wire
from kvcadence.format.bundle import BundleReader
from kvcadence.format.schema import AllBlocksCleared, BlockRemoved
from kvcadence.replay.flushes import recorded_flushes
from kvcadence.replay.schedule import _arrival, _finish

BUNDLE = Path(__file__).parent / "data" / "clock-offset-touch" / "bundle"


def _kinds(path: Path) -> list[str]:
    out = []
    for f in BundleReader(path).events():
        for e in wire.decode_batch(f.payload).events:
            if isinstance(e, AllBlocksCleared):
                out.append("clear")
            elif isinstance(e, BlockRemoved):
                out.append("removed")
    return out


def test_the_records_clock_is_behind_the_events():
    """What the capture holds: its four mid-run flushes come 55 s after the last recorded
    finish on the records' clock, though each sat between two trials."""
    rd = BundleReader(BUNDLE)
    recs = rd.requests()
    last_finish = max(_finish(r) for r in recs)
    flushes = recorded_flushes(rd)
    assert len(recs) == 12 and len(flushes) == 4
    assert min(f.recv_ns for f in flushes) - last_finish > 40e9
    first = min(_arrival(r) for r in recs)
    assert _kinds(BUNDLE).count("removed") == 4 and first < last_finish


@pytest.mark.xfail(
    strict=True,
    reason="the replay does not estimate the offset between the records' and the events' "
    "clocks: its four flushes come after every request and its pool evicts 10 times, not 4",
)
def test_flushes_between_the_trials_despite_the_offset(tmp_path):
    sim = tmp_path / "sim"
    assert main(["replay", str(BUNDLE), "--out", str(sim), "--quiet"]) == 0
    kinds = _kinds(sim)
    assert kinds.count("removed") == 4
    assert kinds.index("clear", 1) < len(kinds) - 4  # a flush before the last trial
