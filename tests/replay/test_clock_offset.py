"""A capture whose request records' clock is 54.9 s behind its event stream's
(``data/clock-offset-touch``, see its README): the replay places recorded flushes and
searches stores by time, so it reads the offset between the two clocks from the prefill
stores (``replay.clocks``) and puts the events on the records' clock; on the captures whose
clocks agree (the whole corpus) the offset is 0 and nothing changes."""

from __future__ import annotations

from itertools import pairwise
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvcadence.cli import main
from kvcadence.format import wire
from kvcadence.format.bundle import BundleReader
from kvcadence.format.schema import AllBlocksCleared, BlockRemoved
from kvcadence.replay.clocks import ClockMap, best_covered, records_clock, records_offset
from kvcadence.replay.flushes import recorded_flushes
from kvcadence.replay.outputs import StoreIndex
from kvcadence.replay.production import records_for_replay
from kvcadence.replay.schedule import _arrival, _finish
from kvcadence.replay.settings import capture_settings

BUNDLE = Path(__file__).parent / "data" / "clock-offset-touch" / "bundle"
CORPUS = Path(__file__).parent / "data" / "corpus"


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


def test_flushes_between_the_trials_despite_the_offset(tmp_path, capsys):
    """Before: the four flushes came after every request and the pool evicted 10 times."""
    sim = tmp_path / "sim"
    assert main(["replay", str(BUNDLE), "--out", str(sim)]) == 0
    assert "the event stream's clock +55." in capsys.readouterr().out
    kinds = _kinds(sim)
    assert kinds.count("removed") == 4 == kinds.count("clear") - 1  # the start-up clear too
    assert kinds.index("clear", 1) < kinds.index("removed")  # a flush before the first trial
    _, rep, flushes = records_for_replay(BundleReader(BUNDLE))
    assert 54.5 < rep["clock_offset_s"] < 56.0
    first = min(_arrival(r) for r in BundleReader(BUNDLE).requests())
    assert flushes is not None and flushes[0].recv_ns < first  # on the records' clock


#: the corpus capture during which the box's wall clock stepped (twice: ``test_corpus.py``
#: ``test_a_wall_clock_step_during_the_capture_is_followed``)
STEPPED = "p16-tight-bench-serving-gsp"


@pytest.mark.parametrize(
    "name", sorted(p.name for p in CORPUS.iterdir() if p.is_dir() and p.name != STEPPED)
)
def test_no_offset_where_the_clocks_agree(name):
    rd = BundleReader(CORPUS / name / "bundle")
    recs = rd.requests()
    index = StoreIndex.from_reader(rd, capture_settings(rd).page_size)
    assert records_offset(index, recs) == 0
    assert not records_clock(index, recs)  # nor a step


def test_the_stepped_capture_s_stretches():
    """One offset for the whole capture (+16.7 s, the last stretch's, which most requests
    share) against the three stretches it has: 0, +1.2 s from event 18, +16.7 s from event
    44 (each where the publish times jump by at least the change, nearest it)."""
    rd = BundleReader(CORPUS / STEPPED / "bundle")
    recs = rd.requests()
    index = StoreIndex.from_reader(rd, capture_settings(rd).page_size)
    assert 16.5e9 < records_offset(index, recs) < 17e9
    m = records_clock(index, recs)
    assert m.firsts == (0, 18, 44) and m.offsets[0] == 0
    assert 1.1e9 < m.offsets[1] < 1.3e9 and 16.5e9 < m.offsets[2] < 17e9
    ts = index._ts
    assert ts[44] - ts[43] > 15e9 and m.offsets[1] < ts[18] - ts[17] < 1.6e9
    # the nearer jump two events before is shorter than the step: no step went there
    assert abs(ts[16] - ts[15] - m.offsets[1]) < abs(ts[18] - ts[17] - m.offsets[1])
    assert ts[16] - ts[15] < m.offsets[1]


@given(
    st.lists(st.tuples(st.integers(0, 10**9), st.integers(0, 10**8)), min_size=1, max_size=30),
    st.integers(-(10**11), 10**11),
)
def test_the_best_covered_range_holds_every_window_of_a_true_offset(windows, true_offset):
    """Windows that all contain ``true_offset`` (and nothing else shifts them): the range
    found is covered by all of them, so it holds the offset's neighbourhood."""
    spans = [(true_offset - d, true_offset + w) for w, d in windows]
    lo, hi, n = best_covered(spans)
    assert n == len(spans) and lo <= true_offset <= hi
    assert all(a <= lo and hi <= b for a, b in spans)


def test_a_sample_of_the_requests_tells_the_same_and_too_few_tell_nothing(monkeypatch):
    from kvcadence.replay import clocks

    rd = BundleReader(BUNDLE)
    recs = rd.requests()
    index = StoreIndex.from_reader(rd, capture_settings(rd).page_size)
    full = records_offset(index, recs)
    monkeypatch.setattr(clocks, "MAX_LOOKED", 6)  # every other request
    assert abs(records_offset(index, recs) - full) < 0.5e9 and full > 54e9
    monkeypatch.setattr(clocks, "MAX_LOOKED", 3)  # 3 requests: fewer than MIN_SAMPLES
    assert records_offset(index, recs) == 0


def test_records_outside_the_stores_span_are_counted_on_the_records_clock():
    """``outside_stores``: a record that finished before the first store, or was received
    after the last (1 s of slack), is counted; on the touch capture, whose records are
    54.9 s behind its events, none is once the offset is taken off -- every one before it."""
    from kvcadence.format.schema import RequestRecord
    from kvcadence.replay.clocks import OUTSIDE_SLACK_NS, outside_stores

    class Index:
        _ts = [100 * 10**9, 150 * 10**9, 200 * 10**9]

    s = 10**9
    recs = [
        RequestRecord(rid="early", input_ids=[1], send_ns=10 * s, finish_ns=98 * s),
        RequestRecord(rid="edge", input_ids=[1], send_ns=10 * s, finish_ns=99 * s + 1),
        RequestRecord(rid="in", input_ids=[1], send_ns=120 * s, finish_ns=130 * s),
        RequestRecord(rid="late", input_ids=[1], send_ns=201 * s + 1, finish_ns=230 * s),
        RequestRecord(rid="untimed", input_ids=[1]),
    ]
    times = [(_arrival(r), _finish(r)) for r in recs]
    assert OUTSIDE_SLACK_NS == s
    assert outside_stores(Index(), times) == (1, 1)
    Index._ts = []
    assert outside_stores(Index(), times) == (0, 0)
    # the touch capture: every record before its (unshifted) stores, none once shifted
    reader = BundleReader(BUNDLE)
    ps = capture_settings(reader).page_size
    index = StoreIndex.from_reader(reader, ps)
    recs = reader.requests()
    times = [(_arrival(r), _finish(r)) for r in recs]
    assert outside_stores(index, times) == (len(recs), 0)
    index.shift(ClockMap(offsets=(records_offset(index, recs),)))
    assert outside_stores(index, times) == (0, 0)
    _, report, _ = records_for_replay(BundleReader(BUNDLE))
    assert (report["records_before_capture"], report["records_after_capture"]) == (0, 0)


def test_requests_that_asked_for_prompt_logprobs_are_not_looked_at():
    """A request whose match was capped by its input logprobs (``return_logprob``,
    ``logprob_start_len`` >= 0) may find its first uncached page stored long before by
    another request: it gives no interval. Marked so, the touch capture's requests leave
    too few to tell (0); their outputs' logprobs alone (``-1``) cap nothing."""
    import msgspec

    rd = BundleReader(BUNDLE)
    recs = rd.requests()
    index = StoreIndex.from_reader(rd, capture_settings(rd).page_size)

    def asked(start: int) -> list:
        return [
            msgspec.structs.replace(
                r,
                meta_info={
                    **(r.meta_info or {}),
                    "request_parameters": {"return_logprob": True, "logprob_start_len": start},
                },
            )
            for r in recs
        ]

    assert records_offset(index, asked(-1)) == records_offset(index, recs) > 54e9
    assert records_offset(index, asked(0)) == 0


def _spans(offsets: list[float], width: float = 1.0) -> list[tuple[int, tuple[int, int]]]:
    """One request a store, in publish order: its range of offsets (s), ``width`` wide
    around ``offsets[k]``."""
    return [
        (k, (int((o - width / 2) * 1e9), int((o + width / 2) * 1e9))) for k, o in enumerate(offsets)
    ]


def test_a_step_of_the_offset_starts_a_stretch_and_an_outlier_does_not():
    from kvcadence.replay.clocks import STEP_CONFIRM, _stretches

    assert len(_stretches(_spans([0.0] * 30))) == 1
    # 16 s from the 20th store on: two stretches, cut there
    two = _stretches(_spans([0.0] * 20 + [16.0] * 20))
    assert [len(s) for s in two] == [20, 20] and two[1][0][0] == 20
    # a few stores out of line (fewer than STEP_CONFIRM in a row) stay in their stretch
    odd = [0.0] * 10 + [5.0] * (STEP_CONFIRM - 1) + [0.0] * 10
    assert [len(s) for s in _stretches(_spans(odd))] == [len(odd)]


def test_a_clock_map_offsets_events_and_times_by_stretch():
    from kvcadence.format.schema import UNRECORDED_SOURCE, RequestRecord
    from kvcadence.replay.clocks import ClockMap, scheduler_stamps_on_records_clock

    m = ClockMap(firsts=(0, 3), starts=(0, 10_000), offsets=(0, 5_000))
    assert bool(m) and not ClockMap()
    assert [m.of_event(e) for e in range(5)] == [0, 0, 0, 5_000, 5_000]
    assert (m.of_time(9_999), m.of_time(10_000)) == (0, 5_000)
    assert m.report() == [{"at_event": 3, "offset_s": 0.0}]
    idx = StoreIndex(16)
    idx._ts = [1_000, 2_000, 3_000, 14_000, 15_000]
    idx.shift(m)
    assert idx._ts == [1_000, 2_000, 3_000, 9_000, 10_000]
    # the scheduler's stamps of a metrics record move with the events, a rebuilt
    # request's (on the records' clock already) and the tokenizer's stamps do not
    big = ClockMap(firsts=(0, 1), starts=(0, 10**18), offsets=(0, 16 * 10**9))
    mi = {
        "request_received_ts": 1e9 + 1.0,
        "forward_entry_time": 1e9 + 17.5,
        "prefill_finished_time": 1e9 + 17.6,
        "request_finished_ts": 1e9 + 3.0,
    }
    rec = RequestRecord(rid="a", input_ids=[1, 2], meta_info=mi, source="sglang-metrics")
    lost = RequestRecord(rid="b", input_ids=[1, 2], meta_info=mi, source=UNRECORDED_SOURCE)
    moved, kept = scheduler_stamps_on_records_clock([rec, lost], big)
    assert moved.meta_info["forward_entry_time"] == pytest.approx(1e9 + 1.5)
    assert moved.meta_info["prefill_finished_time"] == pytest.approx(1e9 + 1.6)
    assert moved.meta_info["request_finished_ts"] == mi["request_finished_ts"]
    assert kept is lost and scheduler_stamps_on_records_clock([rec], ClockMap())[0] is rec


@pytest.mark.parametrize(
    ("gaps", "step", "at"),
    [
        # forward, +1.2 s: the 0.96 s jump is the nearest, but a step there would put the
        # next message before the last; the 1.52 s one keeps them in order
        ([0.1, 0.1, 0.96, 0.67, 1.52, 0.1], 1.2, 5),
        # forward, and every jump is shorter than the change (an offset estimated a little
        # high): the nearest, as before
        ([0.1, 0.5, 0.9, 0.1], 1.2, 3),
        # backward, -2 s: the publish times go back there
        ([0.1, 0.3, -1.8, 0.2, 0.1], -2.0, 3),
    ],
)
def test_a_step_goes_where_the_publish_times_stay_in_order(monkeypatch, gaps, step, at):
    """``records_clock`` puts a step between the two stretches' stores where the jump of
    the publish times is at least the change (the messages went out in order, so the
    mapped times must stay so), nearest the change among those; none: nearest the change."""
    from kvcadence.replay import clocks

    s = 10**9
    ts = [0]
    for g in gaps:
        ts.append(ts[-1] + round(g * s))
    n = len(ts)

    class Index:
        _ts = ts + [ts[-1] + (k + 1) * s // 10 for k in range(8)]

    # events 0-1 in the first stretch (offset 0), the 8 after ``ts`` in the second (the
    # step); those between tell nothing (no request's store found uniquely)
    first = (-s // 10, s // 10)
    second = (round(step * s) - s // 10, round(step * s) + s // 10)
    spans = [(0, first), (1, first)] * 3 + [(n + k, second) for k in range(8)]
    monkeypatch.setattr(clocks, "_spans", lambda index, records: sorted(spans))
    m = records_clock(Index(), [])
    assert m.firsts[1] == at and m.offsets[1] == round(step * s)
    if any(round(g * s) >= round(step * s) for g in gaps[1:]):
        mapped = [t - m.of_event(e) for e, t in enumerate(Index._ts)]
        assert all(a <= b for a, b in pairwise(mapped))
