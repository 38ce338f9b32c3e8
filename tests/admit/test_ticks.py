"""``kvcadence admit``: every budget and stop reason, load-back, CP limits, semantics, ticks."""

from __future__ import annotations

import pytest

from kvcadence.admit.fakes import FakeAllocator, FakeTreeCache
from kvcadence.admit.ticks import (
    NO_TOKEN,
    OTHER_CHUNK,
    OTHER_CP_BATCH,
    OTHER_CP_CACHED,
    OTHER_CP_EXTEND,
    OTHER_MAX_PREFILL,
    OTHER_MAX_RUNNING,
    AdmitConfig,
    QueuedRequest,
    run_admission,
)


def R(rid: str, l1: int = 0, l2: int = 0, ext: int = 100, mnt: int = 0, prio=None) -> QueuedRequest:
    return QueuedRequest(rid, l1, l2, ext, mnt, prio)


def run(specs, **kw):
    kw.setdefault("available_tokens", 100_000)
    return run_admission(specs, AdmitConfig(**kw))


def rids(tick) -> list[str]:
    return [a["rid"] for a in tick["accepted"]]


# --- the reference scenarios (docs/admit.md, observed on the real 0.5.23 PrefillAdder) -------


def test_reference_chunk_scenario_0523():
    res = run([R("a", 1024, 512, 300), R("b", ext=5000), R("c", ext=6000)])
    t0, t1 = res.ticks
    assert rids(t0) == ["a", "b", "c"]
    assert t0["stopped_on_rid"] == "c" and t0["stopped_result"] == OTHER_CHUNK
    assert t0["stopped_admitted"] is True  # admitted, then budget_state() said OTHER
    assert t0["accepted"][0]["prefix_len"] == 1536 and t0["accepted"][0]["loaded"] == 512
    assert t0["accepted"][2]["extend_len"] == 2816 and t0["accepted"][2]["chunked"]
    assert t0["log_hit_tokens"] == 1536 and t0["log_input_tokens"] == 8116
    assert t0["allocator_available_after_tick"] == 100_000 - 512
    assert t0["rem_chunk_tokens"] == 0
    # the chunk continues first in the next tick and finishes; nothing stopped that tick
    assert t1["accepted"][0]["continuation"] and t1["accepted"][0]["extend_len"] == 3184
    assert t1["stopped_result"] is None and t1["log_hit_tokens"] == 0
    assert res.unadmitted == []


def test_no_token_when_l2_counts_toward_memory():
    res = run([R("a", l2=4096, ext=100)], available_tokens=3000)
    assert len(res.ticks) == 1  # a tick that admits nothing ends the run
    t = res.ticks[0]
    assert t["accepted"] == [] and t["stopped_result"] == NO_TOKEN
    assert t["stopped_on_rid"] == "a" and not t["stopped_admitted"]
    assert t["load_back_events"] == []  # refused before any load
    assert res.unadmitted == ["a"]


def test_no_token_after_admission_stops_the_tick():
    # a fits (1 + 0 + 64 < 100) but is charged page-ceiled (64 + 64): budget_state() is
    # NO_TOKEN right after committing it
    res = run([R("a", ext=1), R("b", ext=1)], available_tokens=100)
    t = res.ticks[0]
    assert rids(t) == ["a"] and t["stopped_on_rid"] == "a"
    assert t["stopped_result"] == NO_TOKEN and t["stopped_admitted"]


# --- max_prefill_tokens (input cap) ---------------------------------------------------------


def test_input_cap_without_chunking_refuses_the_next_request():
    res = run(
        [R("a", ext=3000), R("b", ext=3000)], chunked_prefill_size=-1, max_prefill_tokens=4096
    )
    t = res.ticks[0]
    assert rids(t) == ["a"]
    assert t["stopped_on_rid"] == "b" and t["stopped_result"] == OTHER_MAX_PREFILL
    assert not t["stopped_admitted"]
    assert rids(res.ticks[1]) == ["b"]


def test_oversize_single_request_runs_alone_without_chunking():
    res = run(
        [R("big", ext=20000), R("b", ext=10)], chunked_prefill_size=0, max_prefill_tokens=16384
    )
    t = res.ticks[0]
    assert rids(t) == ["big"] and t["accepted"][0]["extend_len"] == 20000
    assert t["rem_input_tokens"] == 16384 - 20032
    assert t["stopped_on_rid"] == "big" and t["stopped_result"] == OTHER_MAX_PREFILL
    assert t["stopped_admitted"]


def test_precheck_stops_before_the_next_candidate_0523():
    # a uses the whole chunk budget exactly: CONTINUE is impossible, the verdict is OTHER
    # after admission; with a budget left > 0 the pre-check is what stops c
    res = run([R("a", ext=8192 - 64), R("b", ext=10), R("c", ext=10)], chunked_prefill_size=8192)
    t = res.ticks[0]
    assert rids(t) == ["a", "b"]
    assert t["stopped_on_rid"] == "b" and t["stopped_result"] == OTHER_CHUNK


# --- max running requests -------------------------------------------------------------------


def test_max_running_stops_before_evaluating():
    specs = [R(f"r{i}", ext=10) for i in range(4)]
    res = run(specs, max_running_requests=2)
    t0 = res.ticks[0]
    assert rids(t0) == ["r0", "r1"]
    assert t0["stopped_on_rid"] == "r2" and t0["stopped_result"] == OTHER_MAX_RUNNING
    assert t0["evaluated"] == 2 and not t0["stopped_admitted"]
    # running requests never finish by default: the next tick is full at once and stalls
    t1 = res.ticks[1]
    assert t1["accepted"] == [] and t1["stopped_result"] == OTHER_MAX_RUNNING
    assert len(res.ticks) == 2 and res.unadmitted == ["r2", "r3"]


def test_drain_frees_running_requests_between_ticks():
    specs = [R(f"r{i}", l1=64, ext=10, mnt=5) for i in range(4)]
    res = run(specs, max_running_requests=2, drain=True, available_tokens=10_000)
    assert [rids(t) for t in res.ticks] == [["r0", "r1"], ["r2", "r3"]]
    # everything is freed at the end: the initial free pool plus the requests' L1 prefixes
    assert res.ticks[-1]["allocator_available_after_alloc"] == 10_000 + 4 * 64


def test_running_requests_keep_kv_and_reserve_decode():
    res = run(
        [R("a", ext=1000, mnt=1000), R("b", ext=10)],
        available_tokens=5000,
        cp_max_batch_requests=1,
        page_size=1,
    )
    t0, t1 = res.ticks
    assert rids(t0) == ["a"] and rids(t1) == ["b"]
    # a's extend KV stays allocated; the next adder reserves min(max_new, 4096) * 0.7 for it
    assert t0["allocator_available_after_alloc"] == 4000
    assert t1["rem_total_tokens"] == pytest.approx(4000 - 700 - (10 + 1 + 0))


# --- CP shared-KV limits (kvcadence's model, not upstream) --------------------------------


def test_cp_total_extend_limit_page_aligned():
    res = run([R(f"r{i}", ext=2000) for i in range(3)], cp_max_total_extend_tokens=4096)
    t = res.ticks[0]
    assert rids(t) == ["r0", "r1"]
    assert t["cp_total_extend_tokens"] == 4096  # 2 x ceil_paged(2000, 64) = 2 x 2048
    assert t["stopped_on_rid"] == "r2" and t["stopped_result"] == OTHER_CP_EXTEND
    assert not t["stopped_admitted"] and t["evaluated"] == 2


def test_cp_page_aligned_accumulation_of_tiny_extends():
    res = run([R(f"r{i}", ext=1) for i in range(5)], cp_max_total_extend_tokens=128)
    t = res.ticks[0]
    assert rids(t) == ["r0", "r1"] and t["cp_total_extend_tokens"] == 128
    assert t["stopped_result"] == OTHER_CP_EXTEND


def test_cp_oversize_single_request_runs_alone():
    res = run(
        [R("big", ext=6000), R("b", ext=10)],
        cp_max_total_extend_tokens=4096,
        chunked_prefill_size=-1,
    )
    t0, t1 = res.ticks
    assert rids(t0) == ["big"] and t0["cp_total_extend_tokens"] == 6016
    assert t0["stopped_on_rid"] == "b" and t0["stopped_result"] == OTHER_CP_EXTEND
    assert rids(t1) == ["b"]  # no deadlock


def test_cp_total_cached_counts_l1_and_loaded_l2():
    specs = [R("a", l1=4096, ext=10), R("b", l2=4096, ext=10), R("c", l1=64, ext=10)]
    res = run(specs, cp_max_total_cached_tokens=8192)
    t = res.ticks[0]
    assert rids(t) == ["a", "b"] and t["cp_total_cached_tokens"] == 8192
    assert t["stopped_on_rid"] == "c" and t["stopped_result"] == OTHER_CP_CACHED


def test_cp_cached_under_threshold_l2_counts_as_extend():
    # l2=5 is below the load-back threshold: it will be recomputed, so it is extend, not cached
    res = run(
        [R("a", l1=64, ext=10), R("b", l2=5, ext=59)],
        cp_max_total_cached_tokens=64,
        cp_max_total_extend_tokens=128,
    )
    t = res.ticks[0]
    assert rids(t) == ["a", "b"]
    assert t["cp_total_cached_tokens"] == 64 and t["cp_total_extend_tokens"] == 128
    assert t["load_back_events"][0]["reason"] == "threshold"


def test_cp_batch_requests_limit():
    res = run([R(f"r{i}", ext=10) for i in range(5)], cp_max_batch_requests=2)
    assert [rids(t) for t in res.ticks] == [["r0", "r1"], ["r2", "r3"], ["r4"]]
    assert [t["stopped_result"] for t in res.ticks] == [OTHER_CP_BATCH, OTHER_CP_BATCH, None]


def test_cp_limits_count_the_continuing_chunk():
    res = run(
        [R("long", ext=10000), R("b", ext=1000)],
        chunked_prefill_size=8192,
        cp_max_total_extend_tokens=2048,
        max_prefill_tokens=16384,
    )
    t0, t1 = res.ticks[:2]
    assert rids(t0) == ["long"] and t0["accepted"][0]["chunked"]
    assert t1["accepted"][0]["continuation"] and t1["cp_total_extend_tokens"] == 1856
    assert t1["stopped_on_rid"] == "b" and t1["stopped_result"] == OTHER_CP_EXTEND


# --- L2 load-back ---------------------------------------------------------------------------


def test_load_back_success_consumes_page_aligned_slots():
    res = run([R("a", l1=128, l2=100, ext=50)], available_tokens=1000)
    t = res.ticks[0]
    (ev,) = t["load_back_events"]
    assert ev["success"] and ev["reason"] == "ok"
    assert (ev["requested"], ev["page_aligned"], ev["loaded"]) == (100, 128, 100)
    assert (ev["available_before"], ev["available_after"]) == (1000, 872)
    assert ev["quota"] == 1000  # own L1 is pinned: it never makes room for its own load
    a = t["accepted"][0]
    assert a["prefix_len"] == 228 and a["extend_len"] == 50 and a["loaded"] == 100
    assert t["log_hit_tokens"] == 228 and t["log_input_tokens"] == 50
    assert t["allocator_available_after_tick"] == 872


def test_load_back_below_threshold_is_recomputed():
    res = run([R("a", l1=64, l2=9, ext=50)])
    t = res.ticks[0]
    (ev,) = t["load_back_events"]
    assert not ev["success"] and ev["reason"] == "threshold" and ev["loaded"] == 0
    assert ev["available_after"] == ev["available_before"]
    a = t["accepted"][0]
    assert a["prefix_len"] == 64 and a["extend_len"] == 59 and a["loaded"] == 0
    assert t["log_hit_tokens"] == 64 and t["log_input_tokens"] == 59


def test_load_back_threshold_flag():
    res = run([R("a", l2=9, ext=50)], load_back_threshold=5)
    assert res.ticks[0]["load_back_events"][0]["success"]


def test_fake_tree_cache_load_back_without_room_fails_all_or_nothing():
    alloc = FakeAllocator(64, 100)
    tree = FakeTreeCache(alloc)
    tree.add_node("other", 64)
    assert tree.load_back("x", 200) == 0
    (ev,) = tree.events
    assert ev.reason == "no_space" and ev.quota == 164 and ev.page_aligned == 256
    assert alloc.free == 100 and tree.evictable_size() == 64  # nothing consumed or evicted


def test_load_back_evicts_whole_unlocked_nodes_from_the_back():
    specs = [R("a", l2=4096, ext=10), R("b", l1=1024, ext=10), R("c", l1=8192, ext=10)]
    res = run(specs, available_tokens=100, cp_max_batch_requests=1, drain=True)
    t0 = res.ticks[0]
    (ev,) = t0["load_back_events"]
    assert ev["success"] and ev["evicted_tokens"] == 8192
    assert t0["evictions"] == [{"rid": "c", "tokens": 8192}]
    assert ev["available_after"] == 100 + 8192 - 4096
    # c's L1 was evicted: it is recomputed later (prefix 0)
    first: dict = {}
    for t in res.ticks:
        for a in t["accepted"]:
            first.setdefault(a["rid"], a)
    assert first["c"]["prefix_len"] == 0 and first["c"]["chunked"]  # 8202 tokens to compute
    assert first["b"]["prefix_len"] == 1024
    assert res.unadmitted == []


# --- classic vs 0.5.23 ----------------------------------------------------------------------


def test_log_input_tokens_raw_vs_page_ceiled():
    new = run([R("a", ext=100)], semantics="0.5.23").ticks[0]
    old = run([R("a", ext=100)], semantics="classic").ticks[0]
    assert new["log_input_tokens"] == 100 and old["log_input_tokens"] == 128


def test_extra_page_per_request_only_in_0523():
    new = run([R("a", ext=100)], semantics="0.5.23").ticks[0]
    old = run([R("a", ext=100)], semantics="classic").ticks[0]
    assert old["rem_total_tokens"] - new["rem_total_tokens"] == 64


def test_input_cap_with_chunking_only_in_classic():
    specs = [R("a", ext=6000), R("b", ext=6000)]
    kw = dict(chunked_prefill_size=16384, max_prefill_tokens=8192)
    new = run(specs, semantics="0.5.23", **kw).ticks[0]
    old = run(specs, semantics="classic", **kw).ticks[0]
    assert rids(new) == ["a", "b"] and new["stopped_result"] == OTHER_MAX_PREFILL
    assert new["stopped_admitted"] and new["rem_input_tokens"] == 8192 - 2 * 6016
    assert rids(old) == ["a"] and old["stopped_on_rid"] == "b"
    assert old["stopped_result"] == OTHER_MAX_PREFILL and not old["stopped_admitted"]


def test_chunk_decided_before_vs_after_the_load():
    # 0.5.23 chooses the chunk assuming the L2 load: prefix + chunk ends on a page boundary;
    # classic loads first and takes the page-floored chunk budget as it is
    specs = [R("a", l2=100, ext=10000)]
    new = run(specs, semantics="0.5.23").ticks[0]["accepted"][0]
    old = run(specs, semantics="classic").ticks[0]["accepted"][0]
    assert new["prefix_len"] == old["prefix_len"] == 100
    assert new["extend_len"] == (100 + 8192) // 64 * 64 - 100 == 8156
    assert old["extend_len"] == 8192


def test_no_budget_precheck_in_classic():
    specs = [R("a", ext=8192 - 64), R("b", ext=10), R("c", ext=10)]
    old = run(specs, semantics="classic").ticks[0]
    # classic has no pre-check: the stop comes from add_one_req's own verdict
    assert old["stopped_result"] in (OTHER_CHUNK, OTHER_MAX_PREFILL)
    assert old["stopped_admitted"]


# --- queue and run mechanics ----------------------------------------------------------------


def test_priority_orders_the_queue():
    res = run([R("lo", ext=10, prio=1), R("hi", ext=10, prio=5), R("mid", ext=10, prio=3)])
    assert rids(res.ticks[0]) == ["hi", "mid", "lo"]


def test_duplicate_rids_are_refused():
    from kvcadence.errors import UsageError

    with pytest.raises(UsageError):
        run([R("a"), R("a")])


def test_bad_config_is_a_usage_error():
    from kvcadence.errors import UsageError

    with pytest.raises(UsageError):
        AdmitConfig(available_tokens=10, semantics="0.4")
    with pytest.raises(UsageError):
        AdmitConfig(available_tokens=10, cp_max_batch_requests=0)


def test_summary_counts_stops():
    res = run([R(f"r{i}", ext=10) for i in range(5)], cp_max_batch_requests=2)
    s = res.summary()
    assert s["stopped_results"] == {OTHER_CP_BATCH: 2, "queue_exhausted": 1}
    assert s["admitted_requests"] == 5 and "not end-to-end" in s["duration_note"]
