"""Invariants of ``kvcadence admit`` over random queues and budgets (hypothesis)."""

from __future__ import annotations

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvcadence.admit.ticks import (
    STOP_RESULTS,
    AdmitConfig,
    QueuedRequest,
    run_admission,
)
from kvcadence.replay.admission import ceil_paged


@st.composite
def queues(draw):
    n = draw(st.integers(1, 12))
    tokens = st.one_of(st.just(0), st.integers(0, 9000), st.sampled_from([5, 64, 1024, 4096]))
    return [
        QueuedRequest(
            f"r{i}",
            draw(tokens),
            draw(tokens),
            draw(st.integers(1, 9000)),
            draw(st.sampled_from([0, 1, 128, 5000])),
        )
        for i in range(n)
    ]


@st.composite
def configs(draw):
    return AdmitConfig(
        available_tokens=draw(st.sampled_from([500, 3000, 20000, 200000])),
        max_prefill_tokens=draw(st.sampled_from([2048, 16384])),
        chunked_prefill_size=draw(st.sampled_from([-1, 1000, 8192])),
        page_size=draw(st.sampled_from([1, 16, 64])),
        max_running_requests=draw(st.sampled_from([None, 2, 5])),
        new_token_ratio=draw(st.sampled_from([0.0, 0.7, 1.0])),
        semantics=draw(st.sampled_from(["0.5.23", "classic"])),
        cp_max_total_extend_tokens=draw(st.sampled_from([None, 4096, 20000])),
        cp_max_total_cached_tokens=draw(st.sampled_from([None, 8192])),
        cp_max_batch_requests=draw(st.sampled_from([None, 3])),
        drain=draw(st.booleans()),
    )


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(queues(), configs())
def test_admission_invariants(specs, cfg):
    res = run_admission(specs, cfg)
    by_rid = {s.rid: s for s in specs}
    first_seen: set[str] = set()
    progress: dict[str, int] = {}
    for t in res.ticks:
        assert t["stopped_result"] in (None, *STOP_RESULTS)
        assert t["allocator_available_after_tick"] >= 0
        assert t["allocator_available_after_alloc"] >= 0
        new = [a for a in t["accepted"] if not a["continuation"]]
        # each request is admitted new exactly once; continuations only after that
        for a in t["accepted"]:
            if a["continuation"]:
                assert a["rid"] in first_seen
                assert a["prefix_len"] == progress[a["rid"]]
            else:
                assert a["rid"] not in first_seen
                first_seen.add(a["rid"])
            spec = by_rid[a["rid"]]
            assert a["extend_len"] >= 1
            assert a["prefix_len"] + a["extend_len"] <= spec.fill_len
            assert a["loaded"] in (0, spec.l2)
            progress[a["rid"]] = a["prefix_len"] + a["extend_len"]
        # logged tokens: hits of new requests, computed tokens of everyone this tick
        assert t["log_hit_tokens"] == sum(a["prefix_len"] for a in new)
        raw = sum(a["extend_len"] for a in t["accepted"])
        paged = sum(ceil_paged(a["extend_len"], cfg.page_size) for a in t["accepted"])
        assert t["log_input_tokens"] == (raw if cfg.semantics == "0.5.23" else paged)
        # load-back: all or nothing, page-aligned, never more than was free + evictable
        for e in t["load_back_events"]:
            assert e["loaded"] in (0, e["requested"])
            assert e["page_aligned"] == ceil_paged(e["requested"], cfg.page_size)
            if e["success"]:
                assert e["available_after"] == (
                    e["available_before"] + e["evicted_tokens"] - e["page_aligned"]
                )
                assert e["page_aligned"] <= e["quota"]
        # CP limits hold for every batch of more than one request
        if len(t["accepted"]) > 1:
            if cfg.cp_max_batch_requests is not None:
                assert len(t["accepted"]) <= cfg.cp_max_batch_requests
            if cfg.cp_max_total_extend_tokens is not None:
                assert t["cp_total_extend_tokens"] <= cfg.cp_max_total_extend_tokens
            if cfg.cp_max_total_cached_tokens is not None:
                assert t["cp_total_cached_tokens"] <= cfg.cp_max_total_cached_tokens
        if cfg.max_running_requests is not None:
            assert len(t["accepted"]) <= cfg.max_running_requests
    # the run ends with a drained queue or a tick that admitted nothing
    last = res.ticks[-1]
    assert res.unadmitted == [] or last["accepted"] == [] or res.ticks == []
    # every request is finished, still chunking, or never admitted -- and nothing else
    finished = {rid for rid, end in progress.items() if end == by_rid[rid].fill_len}
    assert finished | set(res.unadmitted) == set(by_rid)
    assert not finished & set(res.unadmitted)


@settings(max_examples=60, deadline=None)
@given(queues(), configs())
def test_deterministic(specs, cfg):
    a = run_admission(specs, cfg).ticks
    b = run_admission(specs, cfg).ticks
    strip = [{k: v for k, v in t.items() if k != "duration_us"} for t in a]
    assert strip == [{k: v for k, v in t.items() if k != "duration_us"} for t in b]
