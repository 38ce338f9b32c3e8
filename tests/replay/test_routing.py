"""Routing policies: recorded, round_robin, shortest_queue, cache_aware (published events
only), and the router-side block index."""

from __future__ import annotations

import copy

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvcadence.errors import UsageError
from kvcadence.replay.events import CLEAR, REMOVE, STORE, QueuedEvent
from kvcadence.replay.fleet import Fleet, simulate_fleet
from kvcadence.replay.routing import (
    ROUTES,
    CacheAwareRouter,
    PublishedIndex,
    make_router,
)
from tests.replay.helpers import req
from tests.replay.test_fleet import _lane_workload, lanes_st, ranked, worker


def test_make_router_names_and_unknown():
    for name in ROUTES:
        assert make_router(name).name == name
    assert make_router("cache-aware").name == "cache_aware"
    with pytest.raises(UsageError, match="unknown routing policy"):
        make_router("random")


def test_round_robin_alternates_strictly_in_arrival_order():
    recs = [ranked(req(f"r{i}", [i + 3] * 5, 2, arrival_ms=10 * i), 0) for i in range(7)]
    res = simulate_fleet([worker(recs, 3)], "round_robin")
    assert [res.slots[s].rank for s in res.serving] == [0, 1, 2, 0, 1, 2, 0]


def test_shortest_queue_avoids_the_busy_rank():
    # two long requests arrive together, then one short one a bit later
    recs = [
        ranked(req("long0", list(range(3, 60)), 200, arrival_ms=0), 0),
        ranked(req("long1", list(range(70, 130)), 200, arrival_ms=0), 0),
        ranked(req("short", list(range(140, 150)), 3, arrival_ms=50), 0),
    ]
    res = simulate_fleet([worker(recs, 3)], "shortest_queue")
    ranks = {r.rid: r.dp_rank for r in res.requests}
    assert ranks["long0"] != ranks["long1"]
    assert ranks["short"] not in (ranks["long0"], ranks["long1"])


def test_published_index_applies_only_batches_published_by_then():
    log = [
        (100, [QueuedEvent(STORE, [1, 2, 3], None, [5, 6, 7], 1)]),
        (200, [QueuedEvent(REMOVE, [3])]),
        (300, [QueuedEvent(CLEAR, []), QueuedEvent(STORE, [9], None, [1], 1)]),
    ]
    ix = PublishedIndex()
    assert ix.advance(log, 99) == 0 and ix.match([1, 2]) == 0
    assert ix.advance(log, 100) == 1 and ix.match([1, 2, 3, 4]) == 3
    assert ix.match([1, 4, 2]) == 1  # leading blocks only
    ix.advance(log, 250)
    assert ix.match([1, 2, 3]) == 2
    ix.advance(log, 10**9)
    assert ix.blocks == {9}


def test_cache_aware_does_not_see_unpublished_blocks():
    """b arrives while a's prefill is still running (nothing published yet): the router sees
    no prefix anywhere. c arrives after a's prefill result was published and is routed by
    the prefix it can now see."""
    prompt = list(range(10, 110))
    recs = [
        ranked(req("a", prompt, 50, arrival_ms=0), 0),
        ranked(req("b", prompt + [1], 3, arrival_ms=5), 0),  # a's prefill takes 10 ms
        ranked(req("c", prompt + [2], 3, arrival_ms=300), 0),
    ]
    router = CacheAwareRouter()
    res = Fleet([worker(recs, 2)], router).run()
    idx = {s.rid: s.idx for s in res.specs}
    seen = {i: (slot, m) for i, slot, m in router.decisions}
    assert seen[idx["b"]][1] == 0
    slot_a = res.serving[idx["a"]]
    assert seen[idx["c"]] == (slot_a, len(prompt))
    assert router.stats["prefix_routed"] == 1 and router.stats["tie_routed"] == 2


def test_cache_aware_follows_the_published_prefix():
    prompt = list(range(10, 110))
    recs = [
        ranked(req("a", prompt, 3, arrival_ms=0), 0),
        ranked(req("x", list(range(300, 340)), 3, arrival_ms=0), 0),
        ranked(req("c", prompt + [2], 3, arrival_ms=200), 0),
    ]
    res = simulate_fleet([worker(recs, 2)], "cache_aware")
    ranks = {r.rid: r.dp_rank for r in res.requests}
    assert ranks["c"] == ranks["a"] != ranks["x"]
    assert {r.rid: r.cached_tokens for r in res.requests}["c"] == len(prompt)


@settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(lanes=lanes_st, pool=st.sampled_from([120, 400, 5000]))
def test_router_index_ends_equal_to_each_rank_tree(lanes, pool):
    """After the run every batch is published: the router's index of each rank equals the
    set of block hashes resident in that rank's radix tree."""
    recs = _lane_workload(lanes)
    router = CacheAwareRouter()
    fleet = Fleet([worker(copy.deepcopy(recs), 2, max_total_tokens=pool)], router)
    res = fleet.run()
    for sl in res.slots:
        ix = router.indexes[sl.index] if sl.index < len(router.indexes) else PublishedIndex()
        ix.advance(sl.publisher.log, 2**62)
        assert ix.blocks == sl.sched.tree.resident_hashes()
    assert router.stats["routed"] == len(recs)


@pytest.mark.parametrize("route", ["recorded", "cache_aware"])
def test_event_log_is_kept_only_when_asked_or_read_by_the_router(route):
    prompt = list(range(10, 110))
    recs = [
        ranked(req("a", prompt, 3, arrival_ms=0), 0),
        ranked(req("x", list(range(300, 340)), 3, arrival_ms=0), 1),
        ranked(req("c", prompt + [2], 3, arrival_ms=200), 1),
    ]
    kept = simulate_fleet([worker(copy.deepcopy(recs), 2)], route)
    lean = simulate_fleet([worker(copy.deepcopy(recs), 2)], route, event_log=False)
    assert all(sl.publisher.log for sl in kept.slots)  # the default keeps it (the sweep's)
    logged = [bool(sl.publisher.log) for sl in lean.slots]
    assert logged == ([True, True] if route == "cache_aware" else [False, False])
    # the log only watches: routing and bytes are the same either way
    assert lean.serving == kept.serving
    for a, b in zip(lean.slots, kept.slots, strict=True):
        assert [x.payload for x in a.publisher.batches] == [x.payload for x in b.publisher.batches]
