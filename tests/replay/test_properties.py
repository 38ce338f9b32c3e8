"""Hypothesis properties over random multi-lane schedules: the published stream is always a
valid SGLang stream (stored - removed = resident at every publish, no removal of a block never
stored, every store's parent resident or None), the simulation is deterministic, and
skipping decode stretches is a pure optimisation."""

from __future__ import annotations

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from .helpers import check_stream, config, req, run


@st.composite
def workloads(draw):
    n_lanes = draw(st.integers(1, 4))
    prefixes = [
        [draw(st.integers(3, 40)) for _ in range(draw(st.integers(1, 24)))] for _ in range(2)
    ]
    records = []
    for lane in range(n_lanes):
        prompt = list(prefixes[draw(st.integers(0, 1))])
        t = draw(st.integers(0, 30))
        for turn in range(draw(st.integers(1, 4))):
            prompt = prompt + [draw(st.integers(3, 40)) for _ in range(draw(st.integers(1, 20)))]
            n_out = draw(st.integers(1, 25))
            r = req(f"l{lane}-t{turn}", prompt, n_out, lane=lane, arrival_ms=t)
            gap = draw(st.integers(0, 40))
            r.meta_info["request_finished_ts"] = (1_000_000 + t) / 1e3
            records.append(r)
            t += gap
            prompt = prompt + list(r.output_ids)
    return records


settings_ = settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@settings_
@given(
    records=workloads(),
    ps=st.sampled_from([1, 4]),
    pool=st.integers(150, 600),
    overlap_off=st.booleans(),
    chunk=st.sampled_from([None, 32]),
    policy=st.sampled_from(["fcfs", "lpm", "dfs-weight", "lof"]),
    interval=st.sampled_from([3, 40]),
    sync=st.booleans(),
)
def test_stream_invariants_and_determinism(
    records, ps, pool, overlap_off, chunk, policy, interval, sync
):
    cfg = dict(
        sync_forward=sync,
        page_size=ps,
        max_total_tokens=pool,
        chunked_prefill_size=chunk,
        disable_overlap_schedule=overlap_off,
        schedule_policy=policy,
        decode_log_interval=interval,
    )
    a = run(records, config(**cfg))
    check_stream(a)
    assert len(a.requests) == len(records)
    for r in a.requests:
        assert r.error is not None or r.completion_tokens == len(r.output_ids)
    again = run(records, config(**cfg))
    assert [b.payload for b in again.batches] == [b.payload for b in a.batches]
    slow = run(records, config(skip_decode_stretches=False, **cfg))
    assert [(b.payload, b.time_ns, b.pass_index) for b in slow.batches] == [
        (b.payload, b.time_ns, b.pass_index) for b in a.batches
    ]
    assert slow.requests == a.requests
