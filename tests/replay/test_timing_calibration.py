"""Schedule times and the pass-time calibration: server-side receive / finish times from
``meta_info`` (``response_sent_to_client_ts − e2e_latency`` when ``request_received_ts`` is
missing), a latency-based calibration when per-phase timings are missing, and the
synchronous-forward (CPU worker) correction of prefill durations."""

from __future__ import annotations

import pytest

from kvcadence.capture.schema import RequestRecord
from kvcadence.replay.config import TimingParams
from kvcadence.replay.schedule import build_schedule
from kvcadence.replay.timing import calibrate

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
