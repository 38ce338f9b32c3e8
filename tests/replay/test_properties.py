"""Hypothesis properties over random multi-lane schedules: the published stream is always a
valid SGLang stream (stored - removed = resident at every publish, no removal of a block never
stored, every store's parent resident or None), the simulation is deterministic, and
skipping decode stretches is a pure optimisation."""

from __future__ import annotations

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvcadence.replay.radix import wire_hasher
from kvcadence.replay.schedule import build_schedule
from kvcadence.replay.scheduler import Scheduler

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
    ctx=st.sampled_from([0.0, 7e-6]),
)
def test_stream_invariants_and_determinism(
    records, ps, pool, overlap_off, chunk, policy, interval, sync, ctx
):
    """Every stream is well formed and deterministic; decode stretches (also where a pass
    grows with its context, ``ctx``) publish what stepping every pass does, at the same times."""
    cfg = dict(
        decode_per_ctx_token_s=ctx,
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


@st.composite
def decode_heavy(draw):
    """Open-loop requests with long decodes (some not ignoring EOS) for small pools."""
    records = []
    for i in range(draw(st.integers(2, 6))):
        prompt = [draw(st.integers(3, 40)) for _ in range(draw(st.integers(1, 30)))] + [1000 + i]
        r = req(f"r{i}", prompt, draw(st.integers(1, 150)), arrival_ms=draw(st.integers(0, 200)))
        if draw(st.booleans()):
            r.finish_reason = "stop"
            r.max_new_tokens = r.completion_tokens + draw(st.integers(1, 100))
        records.append(r)
    return records


class _FittingStretchesOnly(Scheduler):
    """Stretches only where their allocations fit in the free slots (no evicting stretch)."""

    def _evict_through_stretch(self, m: int) -> tuple[int, int]:
        return 0, 0


@settings_
@given(
    records=st.one_of(workloads(), decode_heavy()),
    ps=st.sampled_from([1, 4]),
    pool=st.integers(100, 600),
    overlap_off=st.booleans(),
    interval=st.sampled_from([3, 40]),
    sync=st.booleans(),
    ctx=st.sampled_from([0.0, 7e-6]),
)
def test_evicting_stretches_book_as_stepping(records, ps, pool, overlap_off, interval, sync, ctx):
    """Under tight pools (decode passes that evict, aborts) a run with decode stretches
    that evict equals the rule without them in every output, statistic and the final
    ``new_token_ratio``; and stepping every pass publishes the same."""
    cfg_kw = dict(
        decode_per_ctx_token_s=ctx,
        sync_forward=sync,
        page_size=ps,
        max_total_tokens=pool,
        disable_overlap_schedule=overlap_off,
        decode_log_interval=interval,
    )
    cfg = config(**cfg_kw)
    runs = []
    for cls in (Scheduler, _FittingStretchesOnly):
        s = cls(cfg, build_schedule(records), wire_hasher())
        s.run()
        runs.append(s)
    a, b = runs
    assert [(x.payload, x.time_ns, x.pass_index) for x in a.publisher.batches] == [
        (x.payload, x.time_ns, x.pass_index) for x in b.publisher.batches
    ]
    assert [(r.state, r.output_len, r.cached_tokens, r.finish_ns) for r in a.reqs] == [
        (r.state, r.output_len, r.cached_tokens, r.finish_ns) for r in b.reqs
    ]
    assert a.stats == b.stats
    assert a.tracker.current == b.tracker.current
    slow = run(records, config(skip_decode_stretches=False, **cfg_kw))
    assert [x.payload for x in slow.batches] == [x.payload for x in a.publisher.batches]
