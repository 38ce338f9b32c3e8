"""A replay writing a sim bundle streams its published batches into it (none kept), with
the bytes of the run that kept them; a failed streamed run leaves no partial bundle."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvcadence.errors import ReplayError
from kvcadence.format.bundle import BundleReader, event_payload
from kvcadence.replay.events import EventQueue, Publisher
from kvcadence.replay.simbundle import SimBundleOut
from kvcadence.replay.simulator import replay_bundle, simulate, write_sim_bundle
from tests.replay.helpers import config, lane_chain, run

SAMPLE = Path(__file__).resolve().parents[2] / "examples" / "sglang-0.5.23-agent-ps1.kvcb"


def _files(d: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(d.iterdir())}


def _lanes() -> list:
    recs: list = []
    for lane in range(3):
        base = list(range(3 + lane * 50, 40 + lane * 50))
        recs += lane_chain(lane, [(base, 6), (base + [7] * 12, 5), (base + [7] * 30, 4)])
    return recs


def test_publisher_hands_each_batch_to_its_sink_and_keeps_none():
    got = []
    pub = Publisher("0.5.23", "GPU", anchor_ns=1000, sink=got.append)
    q = EventQueue()
    for t in range(3):
        q.record_store([10 + t], None, [1, 2], 2)
        pub.publish(q.take(), t * 5, t)
    pub.publish([], 99, 9)  # nothing queued: no message
    assert pub.batches == []
    assert [(b.seq, b.time_ns, b.pass_index) for b in got] == [
        (0, 1000, 0),
        (1, 1005, 1),
        (2, 1010, 2),
    ]
    assert pub.seq == 3 and pub.n_events == 3


def test_streamed_replay_writes_the_bytes_of_the_kept_batches(tmp_path):
    streamed = replay_bundle(SAMPLE, tmp_path / "s")
    kept = replay_bundle(SAMPLE, tmp_path / "k", keep_batches=True)
    assert streamed.batches == [] and len(kept.batches) > 100
    assert streamed.summary() | {"wall_s": 0} == kept.summary() | {"wall_s": 0}
    assert _files(tmp_path / "s") == _files(tmp_path / "k")
    frames = list(BundleReader(tmp_path / "s").events())
    assert [event_payload(f) for f in frames] == [b.payload for b in kept.batches]
    assert [(f.seq, f.recv_ns, f.pass_index) for f in frames] == [
        (b.seq, b.time_ns, b.pass_index) for b in kept.batches
    ]


def test_frames_are_written_while_the_run_goes_on(tmp_path):
    finished = [0]
    at_frame: list[int] = []

    class Watched(SimBundleOut):
        def frame(self, endpoint, b):
            at_frame.append(finished[0])
            super().frame(endpoint, b)

    def progress(n: int) -> None:
        finished[0] += n

    recs = _lanes()
    sim = Watched(tmp_path / "sim")
    res = simulate(recs, config(), out=sim, progress=progress)
    write_sim_bundle(sim, res, None)
    assert res.batches == [] and res.summary()["messages"] == len(at_frame) > 3
    assert at_frame[0] < len(recs) and at_frame[-1] <= len(recs)
    assert min(at_frame) < max(at_frame)  # written between requests finishing, not after
    mem = run(_lanes(), config())
    frames = list(BundleReader(tmp_path / "sim").events())
    assert [event_payload(f) for f in frames] == [b.payload for b in mem.batches]
    assert len(BundleReader(tmp_path / "sim").requests()) == len(recs)


@pytest.mark.parametrize("given_dir", [False, True])
def test_a_failed_streamed_run_leaves_no_partial_bundle(tmp_path, given_dir):
    out = tmp_path / "sim"
    if given_dir:
        out.mkdir()
    calls = [0]

    def progress(n: int) -> None:
        calls[0] += 1
        if calls[0] == 3:
            raise ReplayError("stop here")

    with pytest.raises(ReplayError, match="stop here"):
        simulate(_lanes(), config(), out=SimBundleOut(out), progress=progress)
    assert calls[0] == 3
    if given_dir:
        assert out.is_dir() and not any(out.iterdir())  # the empty directory given stays
    else:
        assert not out.exists()


def test_sim_bundle_records_are_written_from_arrays_as_the_replay_s_records(tmp_path, monkeypatch):
    """The sim bundle's writer gets each sim record with array ids (``SimRecords.arrays``: a
    long prompt is not made a list of ints to be packed back into bytes), and what it stores
    is the replay's records (``requests``, built with lists) exactly."""
    from array import array

    from kvcadence.format.bundle import compact

    res = run(_lanes(), config())
    packed_from: list[type] = []
    pack = compact.pack_u32

    def spy(ids):
        packed_from.append(type(ids))
        return pack(ids)

    monkeypatch.setattr(compact, "pack_u32", spy)
    write_sim_bundle(tmp_path / "sim", res, None)
    assert packed_from and set(packed_from) == {array}
    assert all(type(r.input_ids) is list for r in res.requests)
    assert BundleReader(tmp_path / "sim").requests() == list(res.requests)
