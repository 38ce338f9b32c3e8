"""Schedule times and the pass-time calibration: server-side receive / finish times from
``meta_info`` (``response_sent_to_client_ts − e2e_latency`` when ``request_received_ts`` is
missing), a latency-based calibration when per-phase timings are missing, the
synchronous-forward (CPU worker) correction of prefill durations, the attended-prefix term of
the prefill pass and its squared-sequence term (calibrated, charged by ``PassTimer`` and the
scheduler), and the recorded
pace of a rank (``recorded_token_times``, ``PacedTimer``)."""

from __future__ import annotations

from collections.abc import Callable

import msgspec
import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvcadence.format.schema import RequestRecord
from kvcadence.replay.config import TimingParams
from kvcadence.replay.intervals import Alive, Inside, overlaps
from kvcadence.replay.pace import (
    PACE_MAX_FACTOR,
    PACE_MIN_FACTOR,
    PacedTimer,
    recorded_token_times,
)
from kvcadence.replay.schedule import build_schedule
from kvcadence.replay.timing import PassTimer, calibrate

from .helpers import lane_chain

T0 = 1_800_000_000.0


def rec(rid, lane, send_s, recv_s, sent_s, n_out=10, prompt=50, **meta) -> RequestRecord:
    """A record with client-side times (send/finish) and only the server's e2e latency and
    response time (what a driver capture without per-phase timings carries)."""
    mi = {"e2e_latency": sent_s - recv_s, "response_sent_to_client_ts": T0 + sent_s, **meta}
    return RequestRecord(
        rid=rid,
        input_ids=list(range(3, 3 + prompt)),
        output_ids=[5] * n_out,
        lane=lane,
        send_ns=int((T0 + send_s) * 1e9),
        finish_ns=int((T0 + sent_s + 0.2) * 1e9),  # the client reads the response late
        max_new_tokens=n_out,
        completion_tokens=n_out,
        prompt_tokens=prompt,
        cached_tokens=0,
        finish_reason="length",
        meta_info=mi,
    )


def test_server_side_receive_orders_arrivals_and_sets_the_gap():
    # sent a, b, c; the server received a, c, b
    a = rec("a", 0, 0.000, 0.003, 1.0)
    b = rec("b", 1, 0.001, 0.009, 2.0)
    c = rec("c", 2, 0.002, 0.005, 3.0)
    a2 = rec("a2", 0, 1.3, 1.035, 4.0)  # lane 0's next turn, received 35 ms after a's response
    sch = build_schedule([a, b, c, a2])
    assert [s.rid for s in sch.requests] == ["a", "c", "b", "a2"]
    assert sch.requests[0].arrival_ns == 0
    assert sch.requests[1].arrival_ns == pytest.approx(2_000_000, abs=1_000)
    assert sch.requests[2].arrival_ns == pytest.approx(6_000_000, abs=1_000)
    nxt = sch.requests[3]
    assert nxt.pred == 0
    assert nxt.gap_ns == pytest.approx(35_000_000, abs=1_000)  # not the client's 100 ms
    assert sch.requests[0].e2e_ns == pytest.approx(997_000_000, abs=1_000)


def test_request_received_ts_still_wins():
    r = rec("a", 0, 0.0, 0.003, 1.0, request_received_ts=T0 + 0.004)
    sch = build_schedule([r, rec("b", 1, 0.0, 0.0, 1.0)])
    assert sch.requests[1].rid == "a"
    assert sch.requests[1].arrival_ns == pytest.approx(4_000_000, abs=1_000)


def test_latency_calibration_when_phase_timings_are_missing():
    """Four lanes, one 1 s request of 10 outputs at a time each, lane j started j ms after
    lane 0: a latency spans 9 + 1 decode passes plus the prefills of the lanes received
    after it (3 - j; each ``rho`` decode passes, the default model's prefill / decode
    ratio); one pass is their mean (equal concurrency), prefill costs scale with it."""
    recs = []
    for lane in range(4):
        for i in range(5):
            start = i * 1.05 + lane * 0.001
            recs.append(rec(f"l{lane}-{i}", lane, start, start, start + 1.0, n_out=10))
    d = TimingParams()
    rho = (d.prefill_base_s + 50 * d.prefill_per_token_s) / (
        d.decode_base_s + 4 * d.decode_per_req_s
    )
    p = calibrate(recs)
    one = p.decode_base_s + 4 * p.decode_per_req_s
    assert one == pytest.approx(sum(1 / (10 + j * rho) for j in range(4)) / 4, rel=1e-6)
    scale = one / (d.decode_base_s + 4 * d.decode_per_req_s)
    assert p.prefill_base_s == pytest.approx(d.prefill_base_s * scale, rel=1e-6)
    assert p.prefill_per_token_s == pytest.approx(d.prefill_per_token_s * scale, rel=1e-6)
    assert p.default_gap_s == pytest.approx(0.05, abs=1e-6)
    few = calibrate(recs[:15])  # fewer than 16 requests: the default pass times stay
    assert (few.decode_base_s, few.prefill_base_s) == (d.decode_base_s, d.prefill_base_s)
    sync = calibrate(recs, sync_forward=True)  # the prefill forward and the one after it
    assert sync.decode_base_s + 4 * sync.decode_per_req_s == pytest.approx(
        sum(1 / (11 + j * rho) for j in range(4)) / 4, rel=1e-6
    )


def phase_rec(rid, entry, finished, done, uncached, n_out=11) -> RequestRecord:
    mi = {
        "request_received_ts": entry - 0.001,
        "forward_entry_time": entry,
        "prefill_finished_time": finished,
        "request_finished_ts": done,
    }
    return RequestRecord(
        rid=rid,
        input_ids=list(range(3, 3 + uncached)),
        output_ids=[5] * n_out,
        completion_tokens=n_out,
        prompt_tokens=uncached,
        cached_tokens=0,
        meta_info=mi,
    )


def test_calibration_reports_what_it_read():
    """``calibrate(report=...)``: the per-phase timings of how many requests (and how many
    retracted or preempted ones it left out), else receive and finish times, else none."""
    rep: dict = {}
    recs = _prefix_capture(0.0)
    r = recs[0]
    back = msgspec.structs.replace(r, meta_info={**(r.meta_info or {}), "num_retractions": 2})
    calibrate([back, *recs[1:]], report=rep)
    assert rep == {"source": "phases", "requests": 23, "left_out": 1}
    lat = [rec(f"q{i}", 0, i * 1.05, i * 1.05, i * 1.05 + 1.0) for i in range(16)]
    rep = {}
    calibrate(lat, report=rep)
    assert rep == {"source": "latency", "requests": 16}
    rep = {}
    calibrate(lat[:15], report=rep)
    assert rep == {"source": "none", "requests": 15}


def test_sync_forward_calibration_takes_the_next_forward_out_of_prefill_times():
    """A CPU worker's ``prefill_finished_time − forward_entry_time`` spans the prefill
    forward *and* the next one: consecutive prefill batches give the forward itself
    (next entry − entry); otherwise one decode pass is subtracted."""
    decode = 0.004
    entries, durs = [], []
    t = 100.0
    for i in range(8):
        d = 0.010 + 1e-5 * 100 * (i + 1)  # true prefill forward
        entries.append(t)
        durs.append(d)
        t += d if i % 2 == 0 else d + decode + 0.05  # even batches: a prefill follows
    recs = []
    for i, (e, d) in enumerate(zip(entries, durs, strict=True)):
        nxt = durs[i + 1] if i % 2 == 0 else decode  # the forward after this one
        done = e + d + nxt + 10 * decode
        recs.append(phase_rec(f"p{i}", e, e + d + nxt, done, 100 * (i + 1)))
    gpu = calibrate(recs)
    cpu = calibrate(recs, sync_forward=True)
    assert cpu.prefill_per_token_s == pytest.approx(1e-5, rel=0.05)
    assert cpu.prefill_base_s == pytest.approx(0.010, rel=0.1)
    assert gpu.prefill_base_s > cpu.prefill_base_s + 0.003  # includes the next forward


def test_gpu_overlap_calibration_starts_a_prefill_where_the_forward_before_it_ended():
    """On a GPU the overlap loop forms a batch (``forward_entry_time``) while the forward
    before it runs and records its result when its own forward ends: the recorded span
    holds that earlier forward. After a prefill batch (consecutive prefills) the forward
    starts at that batch's result; after a decode pass (requests decoding at the entry)
    one decode pass after the entry; on an idle worker at the entry."""
    decode = 0.004
    recs = []
    t = 100.0
    prev_end: float | None = None
    for i in range(12):
        d = 0.010 + 1e-5 * 100 * (i + 1)  # true prefill forward
        kind = i % 3  # 0: after a prefill, 1: after a decode pass, 2: idle before it
        if kind == 0 and prev_end is not None:
            entry, start = t, prev_end  # formed while the previous prefill ran
        elif kind == 1:
            entry, start = t, t + decode  # formed while a decode pass ran
        else:
            entry = start = t + 0.5  # idle: launched at once
        end = start + d
        if kind == 1:  # the request whose decode pass ran: launched alone on an idle worker
            e0 = t - 0.2
            recs.append(phase_rec(f"d{i}", e0, e0 + 0.010 + 5e-5, end + 0.01, 5, n_out=40))
        recs.append(phase_rec(f"p{i}", entry, end, end + 10 * decode, 100 * (i + 1)))
        prev_end = end
        t = end - 0.001 if kind == 2 else end + 0.3  # the next batch formed before this ends
    gpu = calibrate(recs, overlap=True)
    assert gpu.prefill_per_token_s == pytest.approx(1e-5, rel=0.1)
    assert gpu.prefill_base_s == pytest.approx(0.010, rel=0.15)
    # the recorded span read as the forward itself: a typical batch (600 tokens, 16 ms)
    # gets part of the forwards before it
    read_as_own = calibrate(recs)
    assert read_as_own.prefill_base_s + 600 * read_as_own.prefill_per_token_s > 0.016 + 0.001


def test_a_simulated_gpu_capture_calibrates_back_to_its_own_pass_times():
    """The simulator records an overlap-loop GPU capture's timings (a batch formed while the
    forward before it runs): replayed as a capture with a GPU snapshot, the calibration
    finds the prefill pass times that made it (until 2026-12-06 it took the forward before
    each batch for part of it: 28.7 ms + 22.2 us/token for 12 ms + 20 us/token at 128
    clients, a decode pass of 1.8 ms for 4-14 ms)."""
    import random

    from kvcadence.replay.config import SimConfig
    from kvcadence.replay.simulator import simulate
    from kvcadence.replay.worker import effective_config

    rng = random.Random(3)
    system = [rng.randrange(3, 30000) for _ in range(200)]
    work = [
        r
        for lane in range(12)
        for r in lane_chain(
            lane,
            [
                (system + [rng.randrange(3, 30000) for _ in range(rng.randint(50, 600))], n)
                for n in (rng.randint(8, 40) for _ in range(6))
            ],
            gap_ms=1.0,
        )
    ]
    true = TimingParams(
        prefill_base_s=0.012, prefill_per_token_s=2e-5, decode_base_s=0.004, decode_per_req_s=0.0
    )
    cfg = SimConfig(page_size=1, max_total_tokens=20000, timing=true).validate()
    recs = simulate(work, cfg).requests
    gpu = effective_config({"device": "cuda", "page_size": 1}, recs).timing
    assert gpu.prefill_base_s == pytest.approx(0.012, rel=0.1)
    assert gpu.prefill_per_token_s == pytest.approx(2e-5, rel=0.1)
    assert gpu.decode_base_s + 4 * gpu.decode_per_req_s == pytest.approx(0.004, rel=0.15)
    spans_own = calibrate(recs)  # read as the forward itself: a decode pass too long
    assert spans_own.prefill_base_s > 0.012 + 0.003


def test_a_chunked_prompts_prefill_pays_the_base_once_a_pass():
    """A prompt prefilled in ``chunked_prefill_size`` pieces runs one pass a piece, each
    paying the base: its first forward entry to its prefill's end spans them all. The
    calibration counts the passes (``prefillfit.passes``); a fit of one base a batch put the later
    passes' bases on the tokens, and the replay, paying the base every pass, ran chunked
    prompts about twice as long as the worker (a page-2 capture with 64-token chunks:
    7.25 ms + 117 us/token fitted, 33.1 s replayed against 26.2 s real; 8.0 ms a pass since,
    26.0 s). Simulated with known pass times and 64-token chunks, the records calibrate back
    to them."""
    import random

    from kvcadence.replay.config import SimConfig
    from kvcadence.replay.simulator import simulate
    from kvcadence.replay.worker import effective_config

    rng = random.Random(5)
    # one client: each prompt prefilled alone, ceil(tokens / 64) passes
    turns = [
        ([rng.randrange(3, 30000) for _ in range(rng.randint(40, 700))], 12) for _ in range(24)
    ]
    work = lane_chain(0, turns, gap_ms=1.0)
    true = TimingParams(
        prefill_base_s=0.008, prefill_per_token_s=2e-5, decode_base_s=0.004, decode_per_req_s=0.0
    )
    cfg = SimConfig(
        page_size=1, max_total_tokens=50000, chunked_prefill_size=64, timing=true
    ).validate()
    recs = simulate(work, cfg).requests
    info = {"device": "cuda", "page_size": 1, "chunked_prefill_size": 64}
    fit = effective_config(info, recs).timing
    assert fit.prefill_base_s == pytest.approx(0.008, rel=1e-3)
    assert fit.prefill_per_token_s == pytest.approx(2e-5, rel=1e-3)
    # one base a batch (the rule before): the bases of the later pieces land on the tokens
    once = effective_config({**info, "chunked_prefill_size": None}, recs).timing
    assert once.prefill_per_token_s > 2 * 2e-5


def test_prefill_times_span_the_previous_forward_on_an_overlap_loop_gpu_worker():
    from kvcadence.replay.worker import spans_previous_forward

    assert spans_previous_forward({"device": "cuda"})
    assert spans_previous_forward(None)  # SGLang's defaults: a GPU, the overlap loop
    assert not spans_previous_forward({"device": "cuda", "disable_overlap_schedule": True})
    assert not spans_previous_forward({"device": "cpu"})  # the next forward instead


def test_cpu_worker_normal_loop_prefill_times_are_its_own_forward():
    """Only the overlap loop processes a prefill result after the next forward: a CPU
    worker recorded with ``--disable-overlap-schedule`` (the normal loop: run the batch,
    process its result) has ``prefill_finished_time`` at the end of its own forward, so the
    calibration takes nothing out (``effective_config`` reads the recorded loop from
    ``/server_info``, whatever loop the overrides simulate)."""
    from kvcadence.replay.worker import effective_config

    decode = 0.02
    recs = []
    t = 100.0
    for i in range(8):
        d = 0.030 + 1e-4 * 100 * (i + 1)  # the prefill forward, result processed at once
        recs.append(phase_rec(f"p{i}", t, t + d, t + d + 10 * decode, 100 * (i + 1)))
        t += d + 12 * decode
    normal = {"device": "cpu", "disable_overlap_schedule": True}
    overlap = {"device": "cpu", "disable_overlap_schedule": False}
    cal = effective_config(normal, recs).timing
    assert cal.prefill_per_token_s == pytest.approx(1e-4, rel=0.05)
    assert cal.prefill_base_s == pytest.approx(0.030, rel=0.1)
    # the same records read as an overlap-loop CPU capture lose one decode pass each
    assert effective_config(overlap, recs).timing.prefill_base_s < 0.030 - decode / 2
    # simulating the other loop does not change how the records are read
    other = effective_config(normal, recs, {"disable_overlap_schedule": False}).timing
    assert other.prefill_base_s == cal.prefill_base_s


def phased(rid, fe, pf, fin, n) -> RequestRecord:
    """A record with per-phase timings (seconds after ``T0``)."""
    mi = {
        "forward_entry_time": T0 + fe,
        "prefill_finished_time": T0 + pf,
        "request_finished_ts": T0 + fin,
        "request_received_ts": T0 + fe,
    }
    return RequestRecord(
        rid=rid,
        input_ids=[3] * 20,
        output_ids=[5] * n,
        send_ns=int((T0 + fe) * 1e9),
        max_new_tokens=n,
        completion_tokens=n,
        prompt_tokens=20,
        cached_tokens=0,
        finish_reason="length",
        meta_info=mi,
    )


P = TimingParams(decode_base_s=0.1, decode_per_req_s=0.0)


def test_recorded_token_times_end_exactly_and_never_go_back():
    recs = [phased("a", 0.0, 0.5, 10.5, 21), phased("b", 1.0, 1.5, 4.5, 7)]
    out = recorded_token_times(recs, P)
    assert sorted(out) == [0, 1]
    for i, r in enumerate(recs):
        ts = out[i]
        assert len(ts) == r.completion_tokens
        assert ts[0] == pytest.approx(r.meta_info["prefill_finished_time"])
        assert ts[-1] == pytest.approx(r.meta_info["request_finished_ts"])
        assert all(x <= y for x, y in zip(ts, ts[1:], strict=False))


def test_a_request_follows_its_ranks_speed_not_its_own_average():
    # b runs 20 passes in [0.5, 2.5] (fast: 0.1 s), then a alone from 2.5 to 10.5 (slow);
    # a spans both: 40 outputs, 20 of them inside b's window (they share every pass)
    a = phased("a", 0.0, 0.5, 10.5, 41)
    b = phased("b", 0.0, 0.5, 2.5, 21)
    ts = recorded_token_times([a, b], P)[0]
    # linear interpolation would put a's 21st output at 5.5 s; the rank's pace at ~2.5 s
    assert ts[20] - T0 == pytest.approx(2.5, abs=0.3)
    assert ts[-1] - T0 == pytest.approx(10.5)


def test_sync_forward_starts_a_prefills_outputs_where_the_next_forward_entered():
    """A CPU worker under the overlap loop records a prefill's result after the *next*
    forward: its first output is aimed at that forward's recorded start when the records
    show it (the next prefill batch entered before the result was recorded), else at the
    recorded ``prefill_finished_time``; the later outputs keep their times."""
    recs = [
        phased("a", 0.0, 0.5, 4.5, 9),  # b's prefill entered the forward at 0.3 s
        phased("b", 0.3, 0.9, 5.0, 9),  # next prefill (c) enters after 0.9 s
        phased("c", 2.0, 2.4, 6.0, 9),  # the last batch
    ]
    gpu = recorded_token_times(recs, P)
    cpu = recorded_token_times(recs, P, sync_forward=True)
    assert cpu[0][0] == pytest.approx(T0 + 0.3)
    assert cpu[1][0] == gpu[1][0] == pytest.approx(T0 + 0.9)
    assert cpu[2][0] == gpu[2][0] == pytest.approx(T0 + 2.4)
    assert all(cpu[i][1:] == gpu[i][1:] for i in range(3))


def test_prefill_times_span_the_next_forward_only_on_an_overlap_loop_cpu_worker():
    from kvcadence.replay.worker import spans_next_forward

    assert spans_next_forward({"device": "cpu"})
    assert not spans_next_forward({"device": "cpu", "disable_overlap_schedule": True})
    assert not spans_next_forward({"device": "cuda"})
    assert not spans_next_forward(None)


def test_a_retracted_request_has_no_recorded_pace_and_sets_none():
    """A request retracted or preempted on the way (``num_retractions`` > 0) waited inside
    its first-prefill-to-finish window: when its outputs were recorded is not known, so it
    gets no recorded times (a paced pass does not aim at it) and its window does not slow
    the rank's fitted pass rate."""
    a = phased("a", 0.0, 0.5, 10.5, 41)
    b = phased("b", 0.0, 0.5, 2.5, 21)
    slow = phased("w", 0.0, 0.5, 10.5, 21)  # 20 outputs over 10 s: mostly waiting
    ret = msgspec.structs.replace(slow, meta_info={**slow.meta_info, "num_retractions": 1})
    alone = recorded_token_times([a, b], P)
    out = recorded_token_times([a, b, ret], P)
    assert sorted(out) == [0, 1]
    assert out[0] == pytest.approx(alone[0]) and out[1] == pytest.approx(alone[1])
    # counted, its window would pull the rank's pace down (a's 21st output later)
    kept = recorded_token_times([a, b, slow], P)
    assert sorted(kept) == [0, 1, 2] and kept[0][20] > out[0][20] + 0.1


def test_records_without_phase_timings_have_no_recorded_pace():
    r = phased("a", 0.0, 0.5, 10.5, 21)
    r.meta_info = {"e2e_latency": 3.0}
    assert recorded_token_times([r], P) == {}


class _Sched:
    """The scheduler state a ``PacedTimer`` reads."""

    def __init__(self, running, t=0, gpu_free=0, last=None, pending=()):
        self.running = running
        self.t = t
        self.gpu_free = gpu_free
        self.last = last
        self.pending_merge = list(pending)


class _Req:
    def __init__(self, idx, output_len):
        self.idx = idx
        self.output_len = output_len


def test_paced_decode_aims_at_the_recorded_output_within_the_clamp():
    base = PassTimer(P).decode_ns(1)  # 0.1 s
    times = {0: [1.0 + 0.12 * j for j in range(10)]}  # recorded: 0.12 s per output
    r = _Req(0, output_len=3)  # outputs 1..3 processed, the next one is the 4th
    sched = _Sched([r], t=int(1.26e9), gpu_free=int(1.26e9))
    timer = PacedTimer(P, sched, times, origin_ns=0)
    # the 4th output was recorded at 1.36 s: the pass launched at 1.26 s takes 0.1 s
    assert timer.decode_ns(1) == pytest.approx(int(0.1e9), abs=2)
    # a drifted rank (0.5 s late) catches up at the fastest allowed pace
    sched.t = sched.gpu_free = int(1.76e9)
    assert timer.decode_ns(1) == int(base * PACE_MIN_FACTOR)
    # far ahead of the record: waits at most the slowest allowed pace
    sched.t = sched.gpu_free = 0
    assert timer.decode_ns(1) == int(base * PACE_MAX_FACTOR)
    # no recorded request running: the model's pass time
    assert PacedTimer(P, _Sched([_Req(7, 0)]), times, 0).decode_ns(1) == base


def test_paced_timer_applies_its_clamp():
    """``PacedTimer(clamp=(lo, hi))`` (``simulate_fleet(pace_clamp=...)``) bounds a paced
    pass to [lo, hi] × the model's; without it [``PACE_MIN_FACTOR``, ``PACE_MAX_FACTOR``]."""
    base = PassTimer(P).decode_ns(1)
    times = {0: [1.0 + 0.12 * j for j in range(10)]}
    late = _Sched([_Req(0, output_len=3)], t=int(3e9), gpu_free=int(3e9))  # far behind
    early = _Sched([_Req(0, output_len=3)])  # far ahead
    assert PacedTimer(P, late, times, 0).clamp == (PACE_MIN_FACTOR, PACE_MAX_FACTOR)
    assert PacedTimer(P, late, times, 0, clamp=(0.25, 4.0)).decode_ns(1) == int(base * 0.25)
    assert PacedTimer(P, early, times, 0, clamp=(0.25, 4.0)).decode_ns(1) == int(base * 4.0)
    assert PacedTimer(P, early, times, 0, clamp=(1.0, 1.0)).decode_ns(1) == base
    for bad in ((0.0, 2.0), (1.5, 2.0), (0.5, 0.9)):
        with pytest.raises(ValueError, match="pace clamp"):
            PacedTimer(P, late, times, 0, clamp=bad)


def test_paced_prefill_aims_at_the_recorded_prefill_result():
    times = {0: [2.0, 2.1, 2.2]}
    sched = _Sched([], t=int(1.5e9), gpu_free=int(1.5e9), pending=[_Req(0, 0)])
    timer = PacedTimer(P, sched, times, origin_ns=int(0.5e9))  # scheduler 0 = wall 0.5 s
    model = PassTimer(P).prefill_ns(20, 1)
    # recorded at 2.0 s wall = 1.5 s scheduler time = now: as fast as allowed
    assert timer.prefill_ns(20, 1) == int(model * PACE_MIN_FACTOR)
    sched.t = sched.gpu_free = int(1.5e9) - model  # one model pass early: the model time
    assert timer.prefill_ns(20, 1) == model


def _pace_change_capture() -> list[RequestRecord]:
    """One rank serving one request at a time whose host slowed down mid-way: 20 requests
    of 21 outputs, received 0.5 s after the previous one finished, decoding 0.04 s a pass
    for the first ten and 0.10 s a pass for the last ten (prefill 0.05 s)."""
    recs, t = [], 0.0
    for k in range(20):
        step = 0.04 if k < 10 else 0.10
        r = phased(f"r{k}", t, t + 0.05, t + 0.05 + 20 * step, 21)
        r.input_ids = [3 + k] * 20  # no prefix shared between requests
        recs.append(r)
        t += 0.05 + 20 * step + 0.5
    return recs


def test_single_rank_replay_follows_a_pace_change_the_model_cannot():
    """``simulate(..., pace="recorded")`` (``kvcadence replay --pace recorded``): each
    request of a capture whose decode passes went from 0.04 s to 0.10 s half-way lasts as
    recorded; the calibrated model (one pass time for the whole capture) misses one half."""
    from kvcadence.replay.simulator import simulate
    from kvcadence.replay.worker import effective_config

    recs = _pace_change_capture()
    cfg = effective_config({}, recs)
    errors = {}
    for pace in ("model", "recorded"):
        res = simulate(recs, effective_config({}, recs), pace=pace)
        assert ("pace" in res.summary()) == (pace == "recorded")
        errors[pace] = [
            abs(
                (s.meta_info["request_finished_ts"] - s.meta_info["request_received_ts"])
                - (r.meta_info["request_finished_ts"] - r.meta_info["request_received_ts"])
            )
            / (r.meta_info["request_finished_ts"] - r.meta_info["request_received_ts"])
            for r, s in zip(recs, sorted(res.requests, key=lambda x: int(x.rid[1:])), strict=True)
        ]
    decode = cfg.timing.decode_base_s + cfg.timing.decode_per_req_s
    assert 0.04 < decode < 0.10  # one pass time for both halves
    assert max(errors["recorded"]) < 0.05, errors["recorded"]
    assert max(errors["model"][:10]) > 0.3 or max(errors["model"][10:]) > 0.3, errors["model"]


def test_replay_hands_its_pace_clamp_to_the_paced_timer():
    """``simulate(..., pace_clamp=)`` (the fleet's ``pace_clamp``) is the clamp the rank's
    ``PacedTimer`` applies; by default the module's."""
    from kvcadence.replay.simulator import simulate
    from kvcadence.replay.worker import effective_config

    recs = _pace_change_capture()
    for clamp, want in ((None, (PACE_MIN_FACTOR, PACE_MAX_FACTOR)), ((0.25, 4.0), (0.25, 4.0))):
        res = simulate(recs, effective_config({}, recs), pace="recorded", pace_clamp=clamp)
        assert isinstance(res.scheduler.timer, PacedTimer)
        assert res.scheduler.timer.clamp == want


def prefix_rec(rid, entry, dur, uncached, cached) -> RequestRecord:
    """A request prefilled alone (GPU timing: ``prefill_finished_time`` ends its forward)
    with ``cached`` prompt tokens already in the cache."""
    r = phase_rec(rid, entry, entry + dur, entry + dur + 1.0, uncached + cached)
    return msgspec.structs.replace(r, cached_tokens=cached)


def _capture(
    extra: Callable[[int, int, int | None], float], cached_step: int, chunk: int | None
) -> list[RequestRecord]:
    """Batches of one request each, durations base 10 ms a pass + 20 µs per new token +
    ``extra(cached, new, chunk)`` (with ``chunk``: one pass a ``chunk``-token piece,
    ``prefillfit.passes``), cached prefixes of 0-4 ``cached_step``s; 2 s apart so no two
    batches overlap."""
    from kvcadence.replay.prefillfit import passes

    recs = []
    for i in range(24):
        new = 50 + 137 * (i % 7)
        cached = cached_step * (i % 5)
        dur = 0.010 * passes(new, chunk) + 2e-5 * new + extra(cached, new, chunk)
        recs.append(prefix_rec(f"q{i}", 100.0 + 2 * i, dur, new, cached))
    return recs


def _prefix_capture(per_prefix: float, chunk: int | None = None) -> list[RequestRecord]:
    """``_capture`` plus ``per_prefix`` per attended prefix token (each chunk attending to
    the pieces before it too, ``prefillfit.attended``), on cached prefixes of 0-1600."""
    from kvcadence.replay.prefillfit import attended

    return _capture(lambda c, n, k: per_prefix * attended(c, n, k), 400, chunk)


def test_calibration_recovers_the_attended_prefix_coefficient():
    p = calibrate(_prefix_capture(5e-6))
    assert p.prefill_per_prefix_token_s == pytest.approx(5e-6, rel=1e-6)
    assert p.prefill_per_token_s == pytest.approx(2e-5, rel=1e-6)
    assert p.prefill_base_s == pytest.approx(0.010, rel=1e-6)
    # a chunked prompt attends to its earlier pieces as well: given the chunk size the fit
    # counts them and recovers the same cost
    chunked = calibrate(_prefix_capture(5e-6, chunk=256), chunk_tokens=256)
    assert chunked.prefill_per_prefix_token_s == pytest.approx(5e-6, rel=1e-6)
    assert chunked.prefill_base_s == pytest.approx(0.010, rel=1e-6)  # a pass's, not a prompt's
    # durations that do not follow the prefix: no term, the two-parameter fit exactly
    flat = calibrate(_prefix_capture(0.0))
    assert flat.prefill_per_prefix_token_s == 0.0
    assert flat.prefill_per_token_s == pytest.approx(2e-5, rel=1e-6)


def _squared_capture(per_sq: float, chunk: int | None = None) -> list[RequestRecord]:
    """``_capture`` plus ``per_sq`` per squared sequence token (SGLang's torch-native
    attention: an extend's queries padded to the whole sequence, ``prefillfit.squared``),
    on cached prefixes of 0-24k tokens."""
    from kvcadence.replay.prefillfit import squared

    return _capture(lambda c, n, k: per_sq * squared(c, n, k), 6000, chunk)


def test_calibration_recovers_the_squared_sequence_coefficient():
    """Prefill passes that cost each request's sequence length squared (a CPU worker's
    torch-native attention computes every position's row of the score matrix, however few
    tokens are new: measured on the real worker, 0.35 / 1.45 / 5.0 s for ~500 new tokens on
    12k / 30k / 60k cached ones) are fitted with that term, not the linear prefix one."""
    p = calibrate(_squared_capture(1.3e-9))
    assert p.prefill_per_seq_sq_s == pytest.approx(1.3e-9, rel=1e-6)
    assert p.prefill_per_prefix_token_s == 0.0
    assert p.prefill_per_token_s == pytest.approx(2e-5, rel=1e-4)
    assert p.prefill_base_s == pytest.approx(0.010, rel=1e-4)
    # chunked: each piece's pass pays its own sequence so far
    chunked = calibrate(_squared_capture(1.3e-9, chunk=256), chunk_tokens=256)
    assert chunked.prefill_per_seq_sq_s == pytest.approx(1.3e-9, rel=1e-6)
    assert chunked.prefill_base_s == pytest.approx(0.010, rel=1e-4)
    # durations that follow the attended prefix linearly keep the prefix term
    linear = calibrate(_prefix_capture(5e-6))
    assert linear.prefill_per_seq_sq_s == 0.0
    assert linear.prefill_per_prefix_token_s == pytest.approx(5e-6, rel=1e-6)


def test_squared_term_may_take_the_whole_prefill():
    """Unlike the prefix term, the squared sequences may carry every prefill's time alone:
    a prompt with nothing cached still pays its own length squared, so no prefill is free
    and the configuration replays."""
    from kvcadence.replay.config import SimConfig

    recs = []
    for i in range(24):
        new = 50 + 137 * (i % 7)
        cached = 6000 * (1 + i % 5)
        recs.append(prefix_rec(f"q{i}", 100.0 + 2 * i, 1.3e-9 * (cached + new) ** 2, new, cached))
    p = calibrate(recs)
    assert p.prefill_per_seq_sq_s == pytest.approx(1.3e-9, rel=1e-3)
    assert p.prefill_per_prefix_token_s == 0.0
    SimConfig(timing=p).validate()  # replayable
    assert PassTimer(p).prefill_ns(200, 1, 0, 200 * 200) > 1


def test_a_preempted_requests_prefill_span_is_no_prefill_time():
    """SGLang keeps a request's first ``forward_entry_time`` and first
    ``prefill_finished_time``; a preempted request's may span its wait in the queue
    (seconds, where the others' prefills take tens of ms). Such requests
    (``num_retractions`` > 0) stay out of the prefill fit: it recovers the others' cost."""
    recs = _prefix_capture(0.0)
    waited = []
    for i in range(6):
        r = prefix_rec(f"w{i}", 101.0 + 2 * i, 1.5, 300, 0)  # 1.5 s "prefill", alone
        waited.append(
            msgspec.structs.replace(r, meta_info={**(r.meta_info or {}), "num_retractions": 1})
        )
    fit = calibrate(recs + waited)
    assert fit.prefill_per_token_s == pytest.approx(2e-5, rel=1e-6)
    assert fit.prefill_base_s == pytest.approx(0.010, rel=1e-6)
    # counted, the same spans make the prefill pass seconds
    kept = [
        msgspec.structs.replace(w, meta_info={**(w.meta_info or {}), "num_retractions": 0})
        for w in waited
    ]
    assert calibrate(recs + kept).prefill_base_s > 0.1


def test_prefix_term_needs_to_explain_the_durations():
    """A prefix coefficient that lowers the residuals by less than ``PREFIX_MIN_F`` (noise
    that happens to correlate with the cached prefix) is not taken."""
    recs = _prefix_capture(0.0)
    noisy = [
        msgspec.structs.replace(
            r,
            meta_info={
                **r.meta_info,
                "prefill_finished_time": r.meta_info["prefill_finished_time"]
                + (0.02 if i % 2 else -0.02)
                + 1e-8 * (r.cached_tokens or 0),
            },
        )
        for i, r in enumerate(recs)
    ]
    assert calibrate(noisy).prefill_per_prefix_token_s == 0.0


def test_prefix_term_never_takes_the_whole_prefill():
    """Durations that follow the attended prefix alone (every prefill below a long cached
    prompt, as on a capture of 6k-12k-token system prompts) would be fitted with base and
    per-token cost 0: a prompt with nothing cached prefilled in no time, a configuration
    ``validate`` refuses ("pass times must be positive": such a capture could not be
    replayed). The two-term fit is kept then."""
    from kvcadence.replay.config import SimConfig

    recs = []
    for i in range(24):
        new = 50 + 137 * (i % 7)
        cached = 6000 + 1500 * (i % 5)
        recs.append(prefix_rec(f"q{i}", 100.0 + 2 * i, 5e-5 * cached, new, cached))
    p = calibrate(recs)
    assert p.prefill_per_prefix_token_s == 0.0
    assert p.prefill_base_s + p.prefill_per_token_s > 0
    SimConfig(timing=p).validate()  # replayable


def test_pass_timer_charges_the_attended_prefix():
    t = PassTimer(TimingParams(prefill_base_s=0.01, prefill_per_token_s=2e-5,
                               prefill_per_prefix_token_s=5e-6))  # fmt: skip
    assert t.prefill_ns(100, 1, 1000) == int(0.01e9 + 100 * 2e-5 * 1e9 + 1000 * 5e-6 * 1e9)
    # the default (0): today's model, whatever the prefix
    d = PassTimer(TimingParams())
    assert d.prefill_ns(100, 1, 10_000) == d.prefill_ns(100, 1)
    # the paced timer's model (what it falls back to and clamps around) includes the term
    sched = _Sched([], pending=[_Req(7, 0)])  # no recorded times: the model's pass time
    paced = PacedTimer(t.p, sched, {}, 0)
    assert paced.prefill_ns(100, 1, 1000) == t.prefill_ns(100, 1, 1000)
    # and the squared sequences, where set
    q = PassTimer(TimingParams(prefill_base_s=0.01, prefill_per_seq_sq_s=1e-9))
    assert q.prefill_ns(100, 1, 1000, 1100**2) == pytest.approx(
        0.01e9 + 3e-5 * 100 * 1e9 + 1100**2, abs=2
    )
    assert PacedTimer(q.p, sched, {}, 0).prefill_ns(100, 1, 1000, 1100**2) == q.prefill_ns(
        100, 1, 1000, 1100**2
    )


@pytest.mark.parametrize(
    ("term", "coef", "alone_ns", "later_ns"),
    [
        # a chunk attends to the pieces before it: 0, 64, 128 and 192 tokens; a later
        # request to its cached prefix
        ("prefill_per_prefix_token_s", 1e-3, (0 + 64 + 128 + 192) * 1e6, lambda c: c * 1e6),
        # a chunk pays its sequence so far squared: 64, 128, 192 and 200; a later request its
        # whole sequence, cached part included (150 + 2)
        (
            "prefill_per_seq_sq_s",
            1e-6,
            (64**2 + 128**2 + 192**2 + 200**2) * 1e3,
            lambda c: 152**2 * 1e3,
        ),
    ],  # fmt: skip
    ids=["attended-prefix", "squared-sequence"],
)
def test_scheduler_charges_each_pass_its_prefix_term(term, coef, alone_ns, later_ns):
    """The replay's prefill passes pay the calibrated prefix term: a prompt chunked into
    64-token pieces (ending at 64 / 128 / 192 / 200 tokens), and a later request (after the
    first finished) on its cached prefix, where the last pass decides the end."""
    import dataclasses

    from .helpers import config, req, run

    first = list(range(3, 203))
    cfg = config(chunked_prefill_size=64)
    costly_cfg = dataclasses.replace(cfg, timing=dataclasses.replace(cfg.timing, **{term: coef}))
    alone = [req("a", first, 1)]
    extra = run(alone, costly_cfg).stats.virtual_ns - run(alone, cfg).stats.virtual_ns
    assert extra == pytest.approx(alone_ns, abs=10)
    recs = [*alone, req("b", first[:150] + [900, 901], 1, arrival_ms=10_000)]
    plain, costly = run(recs, cfg), run(recs, costly_cfg)
    cached = costly.requests[1].cached_tokens
    assert cached == plain.requests[1].cached_tokens and 0 < cached <= 150
    later = costly.stats.virtual_ns - plain.stats.virtual_ns
    assert later == pytest.approx(later_ns(cached), abs=10)


#: (receive, positive duration) pairs on a coarse grid, so that ties of every kind occur
_SPANS = st.lists(
    st.tuples(
        st.integers(0, 20).map(lambda x: x / 4),
        st.sampled_from([1e-9, 0.25, 0.5, 1.0, 3.0]),
    ),
    min_size=1,
    max_size=40,
)


@given(_SPANS)
def test_overlaps_counts_as_the_pairwise_definition(pairs):
    """The latency calibration's concurrency and arrival counts, by bisection, are the
    pairwise counts it replaced (O(n^2): hours at 10^5 requests), ties included."""
    spans = [(rx, rx + d, 3, 5) for rx, d in pairs]
    alive, arrivals = overlaps(spans)
    assert alive == [sum(1 for r in spans if r[0] < fin and r[1] > rx) for rx, fin, *_ in spans]
    assert arrivals == [sum(1 for r in spans if rx < r[0] < fin) for rx, fin, *_ in spans]


_TIMES = st.integers(0, 24).map(lambda x: x / 8)


@given(st.lists(st.tuples(_TIMES, _TIMES), max_size=40), _TIMES, _TIMES)
def test_alive_counts_as_the_pairwise_definition(rows, a, d):
    """The per-phase calibration's concurrency (rows that may end before they start, ties)."""
    b = a + d + 0.125  # a < b, as the calibration asks it
    alive = Alive([r[0] for r in rows], [r[1] for r in rows])
    assert alive(a, b) == sum(1 for st_, f in rows if st_ < b and f > a)


@given(st.lists(st.tuples(_TIMES, st.floats(0.001, 1.0)), max_size=40), _TIMES, _TIMES)
def test_inside_is_the_same_float_as_the_direct_sum(ends, a, d):
    """The decode-window time taken by prefill batches: bit for bit the generator's sum
    (same terms, same order), whether or not the ends are sorted."""
    b = a + d
    assert Inside(ends)(a, b) == sum(x for e, x in ends if a < e <= b)
    ordered = sorted(ends, key=lambda t: t[0])
    assert Inside(ordered)(a, b) == sum(x for e, x in ordered if a < e <= b)


def _context_capture(per_ctx: float, scale: int = 1) -> list[RequestRecord]:
    """Decode windows of one or two requests at a time (a pair prefilled together, same
    outputs), 5 s apart: a pass takes 4 ms + 1 ms a request + ``per_ctx`` a context token
    (each request's prompt + outputs so far: over its window, on average, prompt + half
    its outputs); prompts of 300-3600 tokens, ``scale`` times that."""
    recs = []
    for i in range(24):
        entry = 100.0 + 5 * i
        pf = entry + 0.02
        n = 20 + 7 * (i % 5)
        prompts = [scale * (300 + 900 * (i % 4))] + (
            [scale * (1500 + 400 * (i % 3))] if i % 3 else []
        )
        ctx = sum(prompts) + len(prompts) * n / 2
        per = 0.004 + 0.001 * len(prompts) + per_ctx * ctx
        for k, p in enumerate(prompts):
            recs.append(phase_rec(f"q{i}-{k}", entry, pf, pf + (n - 1) * per, p, n_out=n))
    return recs


def test_decode_context_term_is_given_and_the_rest_fitted_around_it():
    """At short contexts (a few thousand tokens a request) the per-context-token decode
    cost is not fitted (calibration leaves it 0); given (``--decode-per-ctx-token``), each
    request's share of it -- the context its window's passes attended to, on average --
    comes off its passes first, and base and per request are fitted to the rest: exactly,
    on passes that follow that model. Through ``effective_config`` (the replay's path) the
    override reaches the fit."""
    from kvcadence.replay.worker import effective_config

    recs = _context_capture(2e-6)
    assert calibrate(recs).decode_per_ctx_token_s == 0.0  # not fitted
    given = calibrate(recs, TimingParams(decode_per_ctx_token_s=2e-6))
    assert given.decode_per_ctx_token_s == 2e-6
    assert given.decode_base_s == pytest.approx(0.004, rel=1e-6)
    assert given.decode_per_req_s == pytest.approx(0.001, rel=1e-6)
    cfg = effective_config({}, recs, {"decode_per_ctx_token_s": 2e-6})
    assert cfg.timing.decode_base_s == pytest.approx(0.004, rel=1e-6)
    # flat passes: without the term, base + per request is the pass
    flat = calibrate(_context_capture(0.0))
    assert flat.decode_base_s + flat.decode_per_req_s == pytest.approx(0.005, rel=1e-6)


def test_decode_context_term_is_fitted_where_the_contexts_are_long():
    """Production-size contexts (3k-36k tokens a request, ``decodefit.CTX_MIN_TOKENS``):
    the calibration finds the per-context-token cost itself, with base and per request,
    exactly on passes that follow that model; flat passes at the same sizes keep it 0
    (nothing to explain), and one given stays as given."""
    recs = _context_capture(3e-7, scale=10)
    got = calibrate(recs)
    assert got.decode_per_ctx_token_s == pytest.approx(3e-7, rel=1e-6)
    assert got.decode_base_s == pytest.approx(0.004, rel=1e-5)
    assert got.decode_per_req_s == pytest.approx(0.001, rel=1e-5)
    flat = calibrate(_context_capture(0.0, scale=10))
    assert flat.decode_per_ctx_token_s == 0.0
    assert flat.decode_base_s + flat.decode_per_req_s == pytest.approx(0.005, rel=1e-6)
    given = calibrate(recs, TimingParams(decode_per_ctx_token_s=1e-7))
    assert given.decode_per_ctx_token_s == 1e-7


def test_decode_context_term_needs_to_explain_the_windows():
    """``decodefit.fit_decode`` on long contexts: noise the context does not explain (a
    pass that does not follow it) gets no term, and a context term that would be negative
    is none; short contexts get none whatever the passes."""
    from kvcadence.replay.decodefit import CTX_MIN_TOKENS, fit_decode

    conc = [1.0, 2.0, 1.0, 2.0, 3.0, 1.0, 2.0, 3.0] * 4
    ctx = [k * (CTX_MIN_TOKENS + 500.0 * (i % 5)) for i, k in enumerate(conc)]
    wobble = [0.0003 * ((7 * i) % 5 - 2) for i in range(len(conc))]
    flat = [0.01 + 0.002 * k + w for k, w in zip(conc, wobble, strict=True)]
    assert fit_decode(conc, ctx, flat)[2] == 0.0
    falling = [0.05 + 0.002 * k - 1e-6 * x for k, x in zip(conc, ctx, strict=True)]
    assert fit_decode(conc, ctx, falling)[2] == 0.0
    rising = [0.01 + 0.002 * k + 5e-7 * x for k, x in zip(conc, ctx, strict=True)]
    assert fit_decode(conc, ctx, rising)[2] == pytest.approx(5e-7, rel=1e-6)
    short = [x / 10 for x in ctx]
    assert (
        fit_decode(
            conc, short, [0.01 + 0.002 * k + 5e-6 * x for k, x in zip(conc, short, strict=True)]
        )[2]
        == 0.0
    )


def test_a_retracted_requests_window_is_no_decode_time():
    """A request retracted or preempted mid-run (``meta_info.num_retractions``) waited
    inside its first-prefill-to-finish window: those windows stay out of the decode fit,
    which recovers the passes of the requests that ran straight through."""
    recs = _context_capture(0.0)
    waited = []  # alone, 2.4 s from first prefill to finish: mostly waiting
    for i in range(0, 24, 3):
        entry = 100.0 + 5 * i + 2.5
        r = phase_rec(f"w{i}", entry, entry + 0.02, entry + 2.4, 400)
        mi = {**(r.meta_info or {}), "num_retractions": 1 + i % 2}
        waited.append(msgspec.structs.replace(r, meta_info=mi))
    fit = calibrate(recs + waited)
    assert fit.decode_base_s + fit.decode_per_req_s == pytest.approx(0.005, rel=1e-6)
    # the same windows counted as decode time pull the fit far off
    kept = [
        msgspec.structs.replace(w, meta_info={**(w.meta_info or {}), "num_retractions": 0})
        for w in waited
    ]
    off = calibrate(recs + kept)
    assert off.decode_base_s + off.decode_per_req_s > 0.01


def test_context_is_the_time_averaged_kv_of_the_requests_alive():
    """``intervals.Context`` against its definition, summed row by row."""
    from kvcadence.replay.intervals import Context

    rows = [(10.0, 14.0, 100, 40), (12.0, 13.0, 50, 0), (20.0, 20.0, 9, 9)]  # last: empty span
    ctx = Context(*(list(c) for c in zip(*rows, strict=True)))

    def direct(a: float, b: float) -> float:
        tot = 0.0
        for s, f, p, n in rows:
            x, y = max(a, s), min(b, f)
            if s < f and y > x:
                q = n / (f - s)
                tot += p * (y - x) + q * ((y - s) ** 2 - (x - s) ** 2) / 2
        return tot / (b - a)

    for a, b in ((9.0, 15.0), (11.0, 12.5), (13.5, 30.0), (0.0, 1.0), (10.0, 14.0)):
        assert ctx(a, b) == pytest.approx(direct(a, b), rel=1e-12, abs=1e-12)
    assert ctx(10.0, 14.0) == pytest.approx(120.0 + 50 / 4)  # 100 + 40/2, and 50 for 1 s of 4


def test_pass_timer_and_scheduler_charge_the_decode_context():
    """A decode pass pays per context token (each running request's KV length, this
    pass's input token included); the default (0) is the context-free model. In the
    replay, a request's decode passes lengthen as its outputs grow: outputs 2-4 of a
    100-token prompt take 3 passes after its prefill, attending to 101, 102 and 103 tokens
    (the prompt and the outputs before the one computed): 5 ms + 1 µs × each."""
    import dataclasses

    from .helpers import config, req, run

    t = PassTimer(TimingParams(decode_base_s=0.004, decode_per_req_s=0.001,
                               decode_per_ctx_token_s=2e-6))  # fmt: skip
    assert t.decode_ns(2, 3000) == int(0.004e9 + 2 * 0.001e9 + 3000 * 2e-6 * 1e9)
    d = PassTimer(TimingParams())
    assert d.decode_ns(2, 10_000) == d.decode_ns(2)
    sched = _Sched([])  # the paced timer's model includes the term
    assert PacedTimer(t.p, sched, {}, 0).decode_ns(2, 3000) == t.decode_ns(2, 3000)
    prompt = list(range(3, 103))
    for skip in (True, False):
        cfg = config(decode_per_ctx_token_s=1e-6, skip_decode_stretches=skip,
                     disable_overlap_schedule=True)  # fmt: skip
        flat = dataclasses.replace(cfg, timing=dataclasses.replace(cfg.timing,
                                                                   decode_per_ctx_token_s=0.0))  # fmt: skip
        grown = run([req("a", prompt, 4)], cfg).requests[0].meta_info
        base = run([req("a", prompt, 4)], flat).requests[0].meta_info
        extra = (grown["request_finished_ts"] - grown["prefill_finished_time"]) - (
            base["request_finished_ts"] - base["prefill_finished_time"]
        )
        assert extra == pytest.approx((101 + 102 + 103) * 1e-6, abs=3e-9)
