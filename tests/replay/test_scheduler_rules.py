"""Per-rule scheduler tests on small hand-built schedules (docs/sglang-sources.md)."""

from __future__ import annotations

import json

import pytest

from kvcadence.format.schema import BlockRemoved, BlockStored
from kvcadence.replay.radix import wire_hasher
from kvcadence.replay.schedule import build_schedule
from kvcadence.replay.scheduler import Scheduler

from .helpers import MS, check_stream, config, decoded, lane_chain, req, run, shape


def test_single_request_timeline_two_stores_finish_is_n_minus_1():
    r = run([req("a", list(range(3, 13)), 5)])
    assert shape(r) == [["C"], ["S10"], ["S4"]]
    log = r.scheduler.publish_log
    assert [x[0] for x in log] == ["startup", "prefill", "idle"]
    assert r.requests[0].cached_tokens == 0 and r.requests[0].completion_tokens == 5
    check_stream(r)


def test_max_new_tokens_one_stores_the_prompt_only():
    r = run([req("a", list(range(3, 13)), 1)])
    assert shape(r) == [["C"], ["S10"]]


def test_fully_cached_prompt_stores_nothing_and_reports_len_minus_1():
    prompt = list(range(3, 23))
    recs = lane_chain(0, [(prompt, 5), (prompt, 5)])
    recs[1].output_ids = list(recs[0].output_ids)
    r = run(recs)
    assert shape(r) == [["C"], ["S20"], ["S4"]]
    assert [x.cached_tokens for x in r.requests] == [0, 19]


@pytest.mark.parametrize(
    ("params", "cached"),
    [
        ({}, 19),  # no logprobs: the prompt less one token
        ({"return_logprob": True, "logprob_start_len": -1}, 19),  # the outputs' only
        ({"return_logprob": True, "logprob_start_len": 0}, 0),  # /v1/completions echo
        ({"return_logprob": True, "logprob_start_len": 7}, 7),
        ({"return_logprob": False, "logprob_start_len": 7}, 19),  # ignored without logprobs
    ],
)
def test_input_logprobs_cap_the_cached_prefix(params, cached):
    """SGLang 0.5.23 matches no more of a prompt in the cache than the position its input
    logprobs start at (``Req._compute_max_prefix_len``: ``logprob_start_len`` when
    ``return_logprob``); ``/v1/completions`` with ``echo`` and ``logprobs`` sends 0, so
    such a scoring request reuses nothing. The rest is computed again and its insert finds
    the pages in the tree (no new store)."""
    prompt = list(range(3, 23))
    recs = lane_chain(0, [(prompt, 5), (prompt, 5)])
    recs[1].output_ids = list(recs[0].output_ids)
    recs[1].meta_info["request_parameters"] = params
    r = run(recs)
    assert [x.cached_tokens for x in r.requests] == [0, cached]
    assert shape(r) == [["C"], ["S20"], ["S4"]]


def test_the_output_limit_is_capped_by_the_context_and_the_pool_when_received():
    """0.5.23 ``init_req_max_new_tokens``: ``max_new_tokens`` (unbounded when the request
    sent ``null``: an OpenAI client without ``max_tokens``; 128, ``SamplingParams``' default,
    when it left the key out) capped at ``max_req_len`` less the
    prompt less one and at the empty pool less the page-ceiled prompt and a page, less one:
    what admission reserves from. A record that does not say what was sent keeps its output
    length; a limit within both caps is kept."""
    prompt = list(range(3, 103))  # 100 tokens: 112 page-ceiled at page 16

    def sent(rid: str, sp: dict | None, n: int = 6) -> object:
        r = req(rid, prompt, n, arrival_ms=0)
        r.max_new_tokens = None if sp is None or sp.get("max_new_tokens") is None else n
        if sp is not None:
            r.meta_info["request_parameters"] = {"sampling_params": sp}
        return r

    recs = [
        sent("unsent", {"max_new_tokens": None, "temperature": 0}),  # OpenAI, no max_tokens
        sent("default", {"temperature": 0}),  # left out: SGLang's default, 128
        sent("huge", {"max_new_tokens": 5000}),
        sent("small", {"max_new_tokens": 6}),
        sent("unknown", None),  # not an SGLang line: nothing says what was sent
    ]
    recs[2].max_new_tokens = 5000
    ctx = config(page_size=16, max_total_tokens=2000, max_req_input_len=1019)
    got = {x.rid: x.max_new_tokens for x in run(recs, ctx).scheduler.reqs}
    # 1019 + 5 - 101
    assert got == {"unsent": 923, "default": 128, "huge": 923, "small": 6, "unknown": 6}
    pool = config(page_size=16, max_total_tokens=600)  # no max_req_input_len stated
    got = {x.rid: x.max_new_tokens for x in run(recs, pool).scheduler.reqs}
    # 600 - 112 - 17
    assert got == {"unsent": 471, "default": 128, "huge": 471, "small": 6, "unknown": 6}


def test_chunked_prefill_one_store_per_chunk_in_separate_messages():
    for overlap_off in (False, True):
        cfg = config(page_size=16, chunked_prefill_size=64, disable_overlap_schedule=overlap_off)
        r = run([req("a", list(range(3, 203)), 3)], cfg)
        # 200 tokens: chunks 64/64/64/8; 12 full pages; the output never fills a new page
        assert shape(r) == [["C"], ["S4"], ["S4"], ["S4"]]
        check_stream(r)


def test_finish_store_merges_with_the_same_sessions_next_prefill_store():
    long = [req("long", list(range(500, 600)), 200, lane=0)]
    t0 = list(range(3, 53))
    outs = [(7 * i + 50) % 997 + 3 for i in range(10)]
    chain = lane_chain(1, [(t0, 10), (t0 + outs + [9, 9, 9], 10)], gap_ms=2)
    r = run(long + chain)
    # turn 0's 9 output blocks and turn 1's 4 new prompt blocks form one chained event
    assert ["S13"] in shape(r)
    events = [e for batch in decoded(r) for e in batch if isinstance(e, BlockStored)]
    merged = next(e for e in events if len(e.block_hashes) == 13)
    first = next(e for e in events if len(e.block_hashes) == 50)
    assert merged.parent_block_hash == first.block_hashes[-1]
    assert r.requests[2].cached_tokens == 59
    check_stream(r)


def test_decode_publishes_fall_on_global_multiples_of_the_interval():
    long = [req("long", list(range(500, 600)), 200, lane=0)]
    t0 = list(range(3, 53))
    chain = lane_chain(1, [(t0, 10), (t0 + [1] * 20, 10)], gap_ms=2)
    for interval in (40, 7):
        r = run(long + chain, config(decode_log_interval=interval))
        decode_pubs = [x for x in r.scheduler.publish_log if x[0] == "decode"]
        assert decode_pubs, interval
        assert all(ct % interval == 0 for _, ct, _, _ in decode_pubs)
        # the counter is global: prefills in between did not reset it
        prefill_cts = [ct for reason, ct, _, _ in r.scheduler.publish_log if reason == "prefill"]
        assert any(ct % interval for ct in prefill_cts)


def test_overlap_puts_scheduling_removals_before_the_previous_prefill_store():
    a = req("a", list(range(3, 103)), 1, arrival_ms=0)
    b = req("b", list(range(200, 300)), 3, arrival_ms=500)
    overlap = run([a, b], config(max_total_tokens=200))
    assert shape(overlap) == [["C"], ["S100"], ["R100", "S100"], ["S2"]]
    normal = run([a, b], config(max_total_tokens=200, disable_overlap_schedule=True))
    assert shape(normal) == [["C"], ["S100"], ["S100"], ["R100", "S2"]]
    check_stream(overlap)
    check_stream(normal)


def test_retraction_releases_without_storing_and_requeues():
    def mk(rid, base):
        r = req(rid, list(range(base, base + 50)), 58)
        r.max_new_tokens, r.finish_reason = 60, "stop"
        return r

    a = mk("a", 3)
    b = mk("b", 300)
    b.meta_info["request_received_ts"] += 0.001
    r = run([a, b], config(max_total_tokens=200, schedule_conservativeness=0.1))
    assert r.stats.retractions >= 1
    assert all(x.completion_tokens == 58 and x.error is None for x in r.requests)
    assert sum(x.meta_info["num_retractions"] for x in r.requests) == r.stats.retractions
    assert any(isinstance(e, BlockRemoved) for batch in decoded(r) for e in batch)
    check_stream(r)


def _scheduler(records, cfg, aborts=()):
    schedule = build_schedule(records)
    s = Scheduler(cfg, schedule, wire_hasher())
    for rid, at_ms in aborts:
        s.request_abort(rid, int(at_ms * 1e6))
    return s


def test_abort_running_inserts_what_it_computed_abort_waiting_emits_nothing():
    a = req("a", list(range(3, 23)), 50)
    b = req("b", list(range(100, 130)), 5, arrival_ms=40)
    s = _scheduler([a, b], config(), aborts=[("a", 30), ("b", 40)])
    s.run()
    ra, rb = s.reqs
    assert ra.error == "aborted" and 1 < ra.output_len < 50
    assert rb.error == "aborted while waiting" and rb.output_len == 0
    stored = sum(
        len(e.block_hashes)
        for b_ in s.publisher.batches
        for e in __import__("kvcadence.format.wire", fromlist=["x"]).decode_batch(b_.payload).events
        if isinstance(e, BlockStored)
    )
    assert stored == 20 + ra.output_len - 1


def test_flush_clears_alone_and_resets_the_decode_counter():
    prompt = list(range(3, 53))
    a = req("a", prompt, 30, arrival_ms=0)
    b = req("b", prompt, 20, arrival_ms=1000)
    flush_ns = int((1_000_000 + 500) * 1e6)
    r = run([a, b], flush_abs_ns=[flush_ns])
    assert shape(r) == [["C"], ["S50"], ["S29"], ["C"], ["S50"], ["S19"]]
    assert r.requests[1].cached_tokens == 0
    assert r.scheduler.decode_ct == 19
    assert r.stats.flushes == 1


def test_skipping_decode_stretches_changes_nothing():
    long = [req("long", list(range(500, 600)), 300, lane=0)]
    chain = lane_chain(1, [(list(range(3, 53)), 37), (list(range(3, 53)) + [5] * 40, 21)])
    for off, sync in ((False, False), (True, False), (False, True)):
        kw = dict(disable_overlap_schedule=off, max_total_tokens=400, sync_forward=sync)
        a = run(long + chain, config(**kw))
        b = run(long + chain, config(skip_decode_stretches=False, **kw))
        assert a.stats.skipped_passes > 0 and b.stats.skipped_passes == 0
        assert [x.payload for x in a.batches] == [x.payload for x in b.batches]
        assert [x.time_ns for x in a.batches] == [x.time_ns for x in b.batches]
        assert a.requests == b.requests


def test_sync_forward_receives_only_after_the_running_forward():
    """CPU worker (``sync_forward``): the launch runs the forward, so a request arriving
    during it is received after it ends and scheduled before that batch's result is
    processed -- it cannot hit the prefix the running prefill is computing. GPU timing: the
    next iteration comes right after the launch, the request is received only after the
    result (and its store), and it hits."""
    shared = list(range(3, 67))
    a = req("a", shared + list(range(100, 140)), 4, arrival_ms=0)
    b = req("b", shared + list(range(200, 230)), 4, arrival_ms=1)
    gpu = run([a, b], config())
    cpu = run([a, b], config(sync_forward=True))
    assert [r.cached_tokens for r in gpu.requests] == [0, 64]
    assert [r.cached_tokens for r in cpu.requests] == [0, 0]
    # CPU: b's prefill is scheduled at the end of a's forward (10 ms) and a's prompt store
    # is published after b's forward (20 ms), b's after the next decode (25 ms); b computed
    # all 94 tokens, but its insert finds a's 64 in the tree (duplicates freed, no event)
    log = cpu.scheduler.publish_log
    assert [(x[0], x[3]) for x in log[1:3]] == [("prefill", 20 * MS), ("prefill", 25 * MS)]
    assert [(x[0], x[3]) for x in gpu.scheduler.publish_log[1:2]] == [("prefill", 10 * MS)]
    assert shape(cpu)[1:3] == shape(gpu)[1:3] == [["S104"], ["S30"]]
    check_stream(cpu)
    check_stream(gpu)


def test_client_gap_scaled_by_the_predecessors_simulated_over_recorded_latency():
    """The recorded gap is wall time on the real worker; it is replayed as the same share of
    the predecessor's service time (recorded e2e 200 ms, simulated 30 ms: a 100 ms gap
    becomes 15 ms). ``scale_client_gaps=False`` replays it as recorded."""
    t0 = req("l0-t0", list(range(3, 23)), 5, lane=0, arrival_ms=0)
    t0.meta_info["request_finished_ts"] = (1_000_000 + 200) / 1e3
    t1 = req("l0-t1", list(range(3, 23)) + [9] * 8, 3, lane=0, arrival_ms=300)
    for scale, want in ((True, None), (False, 1.0)):
        r = run([t0, t1], config(scale_client_gaps=scale))
        s0, s1 = r.scheduler.reqs
        e2e_sim = s0.finish_ns - s0.arrival_ns
        assert e2e_sim < 60 * MS
        got = (s1.arrival_ns - s0.finish_ns) / (100 * MS)
        assert got == pytest.approx(e2e_sim / (200 * MS) if scale else want, abs=1e-6)
        assert r.requests[1].think_ns == s1.spec.gap_ns


class _CountingStretches(Scheduler):
    """Counts the decode stretches taken through evictions (``kept`` >= 2)."""

    def _evict_through_stretch(self, m: int) -> tuple[int, int]:
        kept, stepped = super()._evict_through_stretch(m)
        self.evicting_stretches = getattr(self, "evicting_stretches", 0) + (kept >= 2)
        return kept, stepped


class _FittingStretchesOnly(Scheduler):
    """The stretch rule without evicting stretches: a stretch only when its allocations fit
    in the free slots (every pass that evicts is stepped)."""

    def _evict_through_stretch(self, m: int) -> tuple[int, int]:
        return 0, 0


def _sched_run(cls: type[Scheduler], records: list, cfg) -> Scheduler:
    s = cls(cfg, build_schedule(records), wire_hasher())
    s.run()
    return s


def _outcome(s: Scheduler) -> tuple:
    batches = [(b.payload, b.time_ns, b.pass_index) for b in s.publisher.batches]
    reqs = [
        (r.rid, r.state, r.output_len, r.cached_tokens, r.first_token_ns, r.finish_ns, r.error)
        for r in s.reqs
    ]
    return batches, reqs, s.stats.evictions, s.stats.retractions, s.stats.aborted


@pytest.mark.parametrize(
    "ps, overlap_off, sync",
    [(1, False, False), (4, False, False), (1, True, False), (1, False, True)],
)
def test_decode_stretches_that_evict_change_nothing(ps, overlap_off, sync):
    """Finished requests leave evictable leaves; long decodes then evict them pass by pass.
    A stretch over such passes evicts what each pass would, and books the ratio decay and
    the skipped passes as the stretches that need no eviction would have: the run equals
    stepping every pass, and equals the rule without evicting stretches bit for bit
    (stats and ``new_token_ratio`` included)."""
    recs = [req("long", list(range(3, 53)), 400)]
    recs += [
        req(f"o{i}", list(range(1000 + 100 * i, 1060 + 100 * i)), 6, arrival_ms=i) for i in range(6)
    ]
    kw = dict(page_size=ps, max_total_tokens=600, disable_overlap_schedule=overlap_off)
    cfg = config(sync_forward=sync, **kw)
    a = _sched_run(_CountingStretches, recs, cfg)
    b = _sched_run(_FittingStretchesOnly, recs, cfg)
    c = _sched_run(Scheduler, recs, config(sync_forward=sync, skip_decode_stretches=False, **kw))
    assert getattr(a, "evicting_stretches", 0) > 0 and a.stats.evictions > 0
    assert _outcome(a) == _outcome(b) == _outcome(c)
    assert a.stats == b.stats
    assert a.tracker.current == b.tracker.current
    assert a.stats.skipped_passes > 0 and c.stats.skipped_passes == 0


def test_page_decode_allocation_evicts_for_a_page_per_request():
    """Page > 1: besides ``check_decode_mem`` (a page per request at a page boundary), the
    decode allocation itself (0.5.23 ``alloc_paged_token_slots_decode``) evicts until one
    page per running request is free, every pass -- so a decode evicts as soon as the
    free pool drops under a page, not only at its next page boundary (corpus capture
    ``p16-chunk256-evict``: Removed events/request -7.7 % -> +1.5 % with this rule).
    Skipped decode stretches evict the same way (same bytes as stepping every pass)."""
    recs = [req("a", list(range(3, 43)), 4), req("b", list(range(100, 140)), 60, arrival_ms=50)]
    cfg = config(page_size=4, max_total_tokens=112, skip_decode_stretches=False)
    s = Scheduler(cfg, build_schedule(recs), wire_hasher())
    seen: list[int] = []  # b's KV length at each eviction call that freed something
    evict = s.tree.evict

    def spy(n: int) -> int:
        freed = evict(n)
        if freed:
            seen.extend(r.kv_len for r in s.running if r.spec.rid == "b")
        return freed

    s.tree.evict = spy
    s.run()
    # a's 10 prompt pages stay evictable; b's 40 + 60 tokens need 25 of the 28 pages: the
    # first eviction comes one pass after the pool's last page went to b (kv_len 4k + 1),
    # not at b's next page boundary (kv_len % 4 == 0)
    assert seen and seen[0] % 4 == 1, seen
    stepped = run(recs, cfg)
    skipped = run(recs, config(page_size=4, max_total_tokens=112))
    assert skipped.stats.skipped_passes > 0
    assert [b.payload for b in skipped.batches] == [b.payload for b in stepped.batches]
    assert [b.time_ns for b in skipped.batches] == [b.time_ns for b in stepped.batches]
    assert any(isinstance(e, BlockRemoved) for ev in decoded(stepped) for e in ev)


def test_page_prefill_allocation_evicts_for_the_extend_tokens_plus_a_page_per_request():
    """Page > 1: a prefill's allocation (0.5.23 ``alloc_paged_token_slots_extend``) evicts
    until ``extend_num_tokens + len(reqs) * page_size`` tokens are free: the batch's extend
    *tokens*, not its page-rounded extend. Two 41-token prompts at page 4 with 92 tokens
    free: 82 + 8 = 90 fits, so nothing is evicted (page-rounded, 88 + 8 = 96 would evict
    the cached 40-token prompt); the pages they take (2 x 44) fit in the 92."""
    a = req("a", list(range(3, 43)), 1)  # leaves a 40-token evictable leaf
    b = req("b", list(range(100, 141)), 1, arrival_ms=100)
    c = req("c", list(range(200, 241)), 1, arrival_ms=100)
    r = run([a, b, c], config(page_size=4, max_total_tokens=132))
    assert shape(r) == [["C"], ["S10"], ["S10", "S10"]]
    check_stream(r)


def _refresh_run(policy: str, n_fill: int, queue: list[str]) -> tuple[str, int]:
    """Two cached 40-token prompts, ``a`` (older) then ``b``; ``n_fill`` tiny requests after
    them (one ``calc_priority`` call each); then ``long`` decodes 150 tokens while ``queue``
    waits behind ``head`` (200 tokens, no room until ``long`` finishes): ``long``'s decode
    evicts one whole 40-token leaf. ``queue`` holds ``head``, ``w`` (``a``'s prompt + 10)
    and tiny ``q<i>``, arriving in that order within one 5 ms decode pass. Returns which prompt the
    first Removed event holds and ``w``'s cached tokens."""
    pa, pb = list(range(1000, 1040)), list(range(2000, 2040))
    recs = [req("a", pa, 1), req("b", pb, 1, arrival_ms=50)]
    recs += [
        req(f"f{i}", [7000 + 2 * i, 7001 + 2 * i], 1, arrival_ms=100 + 50 * i)
        for i in range(n_fill)
    ]
    t = 100 + 50 * n_fill
    recs.append(req("long", list(range(3000, 3040)), 150, arrival_ms=t))
    prompts = {"head": list(range(4000, 4200)), "w": pa + list(range(5000, 5010))}
    for i, rid in enumerate(queue):
        prompt = prompts.get(rid, [9000 + 2 * i, 9001 + 2 * i])
        recs.append(req(rid, prompt, 1, arrival_ms=t + 102 + i / 1000))
    r = run(recs, config(max_total_tokens=250 + 2 * n_fill, schedule_policy=policy))
    check_stream(r)
    hasher = wire_hasher()
    names = {tuple(hasher(None, p, 1)[1]): n for n, p in (("a", pa), ("b", pb))}
    removed = next(e for ev in decoded(r) for e in ev if isinstance(e, BlockRemoved))
    w = next(x for x in r.requests if x.rid == "w")
    return names.get(tuple(removed.block_hashes), "?"), w.cached_tokens


@pytest.mark.parametrize(
    "policy, n_fill, queue, evicted, w_cached",
    [
        # calls 0 (a), 1 (b), 2-30 (f0-f28), 31 (long): the queue's call is the 33rd
        ("fcfs", 29, ["head", "w"], "b", 40),
        # ... the 32nd: no refresh, LRU evicts a (older) and w misses
        ("fcfs", 28, ["head", "w"], "a", 0),
        # lpm counts no call until 129 wait (cache-agnostic beyond 128): w 2nd is touched
        ("lpm", 0, ["head", "w"] + [f"q{i}" for i in range(127)], "b", 40),
        # ... w 129th is not (only the first 128 are)
        ("lpm", 0, ["head"] + [f"q{i}" for i in range(127)] + ["w"], "a", 0),
    ],
)
def test_waiting_prefix_refresh_spares_what_the_queue_will_match(
    policy, n_fill, queue, evicted, w_cached
):
    """0.5.23 ``SchedulePolicy._touch_waiting_prefixes``: under a cache-agnostic active
    policy, every 32nd ``calc_priority`` call with a non-empty queue (the first included)
    touches the paths of the first 128 waiting requests, head last. ``w`` waits behind a
    head that does not fit; a refresh while it waits makes ``a`` (its prefix) newer than
    ``b``, so ``long``'s decode evicts ``b`` and ``w`` later hits ``a``'s 40 tokens."""
    assert _refresh_run(policy, n_fill, queue) == (evicted, w_cached)


@pytest.mark.parametrize("overlap_off", [True, False])
@pytest.mark.parametrize("b_arrival_ms, evicted", [(15, "b"), (150, "a")])
def test_finish_with_nothing_new_to_insert_still_touches_the_path(
    overlap_off, b_arrival_ms, evicted
):
    """0.5.23 ``checkpoint_into_tree`` inserts from the root even when the output filled no
    new page, refreshing the request's path. ``a`` (4 pages + 1, 15 out: nothing new at its
    finish) decodes while ``b`` (another 4 pages + 1) is prefilled after it and finishes
    first; ``c`` then needs one of the two 4-page leaves: ``b``'s goes, since ``a``'s
    finish touched its path last (the real worker did the same, 7 of 7 runs). When ``b``
    comes after ``a`` finished, ``a`` is older either way and goes."""
    pa, pb = list(range(100, 165)), list(range(300, 365))
    recs = [
        req("a", pa, 15),
        req("b", pb, 3, arrival_ms=b_arrival_ms),
        req("c", list(range(500, 597)), 1, arrival_ms=400),
    ]
    cfg = config(page_size=16, max_total_tokens=192, disable_overlap_schedule=overlap_off)
    r = run(recs, cfg)
    check_stream(r)
    fin = {x.rid: x.finish_ns for x in r.requests}
    assert (fin["b"] < fin["a"]) == (b_arrival_ms == 15)
    hasher = wire_hasher()
    names = {frozenset(hasher(None, p[:64], 16)[1]): n for n, p in (("a", pa), ("b", pb))}
    removed = [e for ev in decoded(r) for e in ev if isinstance(e, BlockRemoved)]
    assert [names.get(frozenset(e.block_hashes), "?") for e in removed] == [evicted]


def test_sent_ignore_eos_decides_the_reservation_not_the_finish_reason():
    """A request sent without ``ignore_eos`` that ran to its length reserves
    ``new_token_ratio`` of its remaining output (SGLang 0.5.23 ``PrefillAdder``); only the
    sent value tells it from an ``ignore_eos`` request (the inference cannot)."""
    recs = [req("a", list(range(3, 53)), 8), req("b", list(range(300, 350)), 8)]
    assert [s.ignore_eos for s in build_schedule(recs).requests] == [True, True]
    for r in recs:
        r.meta_info["request_parameters"] = {"sampling_params": {"ignore_eos": False}}
    assert [s.ignore_eos for s in build_schedule(recs).requests] == [False, False]
    recs[1].meta_info["request_parameters"]["sampling_params"]["ignore_eos"] = True
    recs[1].finish_reason = "stop"
    assert [s.ignore_eos for s in build_schedule(recs).requests] == [False, True]


def _long_outputs(ignore_eos: bool) -> list:
    out = []
    for i, rid in enumerate("abc"):
        r = req(rid, list(range(3 + 300 * i, 53 + 300 * i)), 58, arrival_ms=i * 0.5)
        r.meta_info["request_parameters"] = {"sampling_params": {"ignore_eos": ignore_eos}}
        out.append(r)
    return out


def test_ignore_eos_requests_are_never_retracted_ratio_requests_are():
    cfg = config(max_total_tokens=200, schedule_conservativeness=0.1)
    assert run(_long_outputs(True), cfg).stats.retractions == 0
    r = run(_long_outputs(False), cfg)
    assert r.stats.retractions >= 1
    assert all(x.completion_tokens == 58 and x.error is None for x in r.requests)
    check_stream(r)


def test_ratio_after_a_retraction_is_estimated_over_the_requests_that_stay(monkeypatch):
    """SGLang 0.5.23 ``retract_decode``: ``estimate_new_token_ratio_after_retract`` runs on
    the batch after ``filter_batch`` (the retracted requests gone), so the new ratio is
    ``(Σ out + 20 × n) / (Σ max_new + 1)`` over the requests that keep decoding."""
    from kvcadence.replay.admission import NewTokenRatioTracker
    from kvcadence.replay.request import RUNNING

    seen: list[tuple[list, float]] = []
    orig = NewTokenRatioTracker.on_retract

    def spy(self, batch):
        batch = list(batch)
        orig(self, batch)
        seen.append(([(x.state, x.output_len, x.max_new_tokens) for x in batch], self.current))

    monkeypatch.setattr(NewTokenRatioTracker, "on_retract", spy)
    r = run(_long_outputs(False), config(max_total_tokens=200, schedule_conservativeness=0.1))
    assert r.stats.retractions >= 1 and seen
    for batch, ratio in seen:
        assert batch and all(state == RUNNING for state, _, _ in batch)  # none retracted
        out = sum(o for _, o, _ in batch)
        mx = sum(m for _, _, m in batch)
        assert ratio == pytest.approx(min(1.0, (out + 20 * len(batch)) / (mx + 1)))


def _stops_at_eos(r, max_new: int):
    """``r`` was sent without ``ignore_eos`` and stopped at EOS before ``max_new``."""
    r.max_new_tokens, r.finish_reason = max_new, "stop"
    r.meta_info["request_parameters"] = {"sampling_params": {"ignore_eos": False}}
    return r


def test_overlap_decodes_a_request_stopping_at_eos_once_more_and_inserts_every_output():
    """SGLang 0.5.23's overlap loop launches the next decode batch before it processes the
    result that holds a request's EOS (only a finish by length is known ahead,
    ``_reqs_finishing_inflight``), so the EOS token's KV is computed and the finish inserts
    prompt + all outputs (``owned_kv_len``); the normal loop processes the result first:
    prompt + outputs − 1, as for a finish by length (corpus ``p1-retract-noeos``: every
    next turn after an EOS stop cached one token more than the rule before predicted)."""
    prompt = list(range(3, 53))
    for overlap_off, finish in ((False, "S10"), (True, "S9")):
        cfg = config(disable_overlap_schedule=overlap_off)
        stop = run([_stops_at_eos(req("a", prompt, 10), 20)], cfg)
        assert shape(stop) == [["C"], ["S50"], [finish]], overlap_off
        assert stop.requests[0].completion_tokens == 10
        check_stream(stop)
        by_length = run([req("a", prompt, 10)], cfg)
        assert shape(by_length) == [["C"], ["S50"], ["S9"]]


def test_overlap_short_step_with_a_request_finishing_in_flight_decodes_nothing_instead():
    """SGLang 0.5.23 ``update_running_batch`` (overlap loop): when the next decode step does
    not fit and a request's result in flight finishes it by length, the step is skipped
    (that result frees its KV) instead of retracting; before this rule the simulator found
    nothing to retract (the one other request is kept) and aborted both."""
    b = _stops_at_eos(req("b", list(range(300, 340)), 80), 82)
    a = req("a", list(range(3, 43)), 20, arrival_ms=100)
    r = run([b, a], config(max_total_tokens=137, schedule_conservativeness=0.1))
    assert r.stats.aborted == 0 and r.stats.retractions == 0
    assert [(x.error, x.completion_tokens) for x in r.requests] == [(None, 80), (None, 20)]
    check_stream(r)


def test_overlap_decodes_a_request_stopping_at_eos_with_its_first_token_once_more():
    """SGLang 0.5.23's overlap loop merges a prefill batch into the running batch before it
    processes the prefill's result (``get_next_batch_to_run``), and only a finish by length
    is known ahead (``_reqs_finishing_inflight``): a request whose first token is EOS is in
    the next decode batch, its token's KV computed, and its finish inserts prompt + that
    token (``owned_kv_len``); the normal loop, and a finish by length, insert the prompt."""
    prompt = list(range(3, 53))
    for overlap_off, finish in ((False, "S51"), (True, "S50")):
        cfg = config(disable_overlap_schedule=overlap_off)
        stop = run([_stops_at_eos(req("a", prompt, 1), 20)], cfg)
        assert shape(stop) == [["C"], [finish]], (overlap_off, shape(stop))
        assert stop.requests[0].completion_tokens == 1
        check_stream(stop)
        by_length = run([req("a", prompt, 1)], cfg)
        assert shape(by_length) == [["C"], ["S50"]], (overlap_off, shape(by_length))


@pytest.mark.parametrize("ps", [1, 16])
def test_reprefill_past_the_prompt_splits_the_leaf_at_the_prompt_end(ps):
    """0.5.23 ``checkpoint_into_tree``: when a checkpoint's key runs past the prompt from
    above its end (a retracted request readmitted after its prompt was evicted recomputes
    prompt + outputs in one prefill), the prompt's page-aligned key is inserted again, so
    the outputs are a leaf of their own and eviction drops them without the prompt (corpus
    ``p1-retract-noeos-nooverlap``: the real worker evicted such a re-prefill's outputs,
    then its prompt, as two leaves)."""
    prompt, n_out = 5 * ps, 4 * ps
    s = _scheduler([req("a", list(range(3, 3 + prompt)), n_out + 1)], config(page_size=ps))
    r = s.reqs[0]
    end = prompt + n_out
    # the readmitted request's prefill computed prompt + its outputs from the root
    r.alloc = s.private_total = end
    r.kv_len = end
    s._insert_upto(r, end)
    assert r.tree_len == end and s.private_total == 0
    s.tree.unlock(r.lock_handle)
    assert s.tree.evict(1) == n_out  # the outputs' leaf alone
    assert s.tree.peek_prefix_len(r.ids) == prompt  # the prompt stays cached
    assert s.tree.evict(1) == prompt


def test_max_running_requests_counts_the_continuing_chunk():
    """0.5.23 ``_get_new_batch_prefill_raw``: the batch is full once ``len(can_run_list)``
    -- the continuing chunk included (it is not in the running batch) -- reaches
    ``max_running_requests − running``; with 2, the pass that ends ``a``'s chunked prompt
    admits ``b`` and not ``c`` (all three waiting since the first pass)."""
    a = req("a", list(range(3, 153)), 4)  # 150 tokens: chunks 128 + 22
    b = req("b", list(range(300, 320)), 4)
    c = req("c", list(range(400, 420)), 4)
    for overlap_off in (False, True):
        cfg = config(
            chunked_prefill_size=128, max_running_requests=2, disable_overlap_schedule=overlap_off
        )
        r = run([a, b, c], cfg)
        done = {x.rid: x.meta_info["prefill_finished_time"] for x in r.requests}
        assert done["a"] == done["b"] < done["c"], (overlap_off, done, shape(r))
        check_stream(r)


def test_max_running_requests_read_from_the_schedulers_effective_value():
    """``/server_info`` ``internal_states`` carries the scheduler's own limit (the requested
    value capped by the pool, or the default SGLang derives): preferred to the request."""
    from kvcadence.replay.config import from_server_info

    info = {"max_running_requests": None, "max_total_num_tokens": 5000}
    states = [{"effective_max_running_requests_per_dp": 2048}]
    assert from_server_info({**info, "internal_states": states}).effective_max_running == 2048
    assert from_server_info({**info, "max_running_requests": 3}).effective_max_running == 3
    assert from_server_info(info).effective_max_running == 2500  # pool / 2


def _mixed_run(mixed: bool, **kw):
    """Three requests decoding 60 tokens each (20-token prompts: one prefill pass), then a
    200-token prompt in 64-token chunks."""
    running = [req(f"r{i}", list(range(100 * i + 3, 100 * i + 23)), 60) for i in range(3)]
    late = req("late", list(range(1000, 1200)), 4, arrival_ms=30.0)
    cfg = config(chunked_prefill_size=64, enable_mixed_chunk=mixed, **kw)
    return run([*running, late], cfg)


@pytest.mark.parametrize("overlap_off", [False, True], ids=["overlap", "normal"])
def test_mixed_chunk_prefill_decodes_the_running_requests_in_the_same_pass(overlap_off):
    """``--enable-mixed-chunk`` (0.5.23 ``mix_with_running``): each chunk of ``late`` also
    decodes the three running requests a token, and takes a token per running request off
    the chunk budget: 61-token chunks instead of 64. The rows insert nothing until they
    finish, and finish sooner than with their decode paused for each chunk."""
    off = _mixed_run(False, disable_overlap_schedule=overlap_off)
    on = _mixed_run(True, disable_overlap_schedule=overlap_off)
    assert off.stats.mixed_passes == 0 and on.stats.mixed_passes >= 3
    stores = {
        mode: [len(e.block_hashes) for b in decoded(r) for e in b if isinstance(e, BlockStored)]
        for mode, r in (("off", off), ("on", on))
    }
    assert stores["off"][:5] == [20, 20, 20, 64, 64]  # r0..r2's prompts, then late's chunks
    assert stores["on"][:5] == [20, 20, 20, 61, 61]
    assert on.stats.mixed_passes == 4  # late's four chunks (200 = 3 x 61 + 17)
    fin = {mode: {x.rid: x.finish_ns for x in r.requests} for mode, r in (("off", off), ("on", on))}
    assert all(fin["on"][f"r{i}"] < fin["off"][f"r{i}"] for i in range(3))
    assert [x.completion_tokens for x in on.requests] == [60, 60, 60, 4]
    check_stream(on)


@pytest.mark.parametrize("overlap_off", [False, True], ids=["overlap", "normal"])
def test_a_continuing_chunk_resumes_where_the_last_one_ended_not_at_a_page(overlap_off):
    """At page > 1 only a request's *first* chunk is floored to a page (0.5.23
    ``_select_prefill_admission``); a continuing chunk takes the whole budget
    (``add_chunked_req``: 128 less the 3 running requests mixed in = 125 tokens) and the
    next one resumes after it (``checkpoint_kv_cache``: ``prefix_len = extend_end``), the
    partial page staying the request's own. So chunks end at 112, 237, 362, 487, 600 and
    store 7, 7, 8, 8, 7 pages -- the pattern of the real 0.5.23 worker's mixed-chunk
    captures (corpus ``p16-chunk128-mixed-long``: 7, 7, 8, ...); resuming at the page
    floor stored 7, 7, 7, 7, 7, 2 in six passes."""
    running = [req(f"r{i}", list(range(100 * i + 3, 100 * i + 23)), 60) for i in range(3)]
    late = req("late", list(range(1000, 1600)), 4, arrival_ms=30.0)
    cfg = config(
        page_size=16,
        chunked_prefill_size=128,
        enable_mixed_chunk=True,
        disable_overlap_schedule=overlap_off,
    )
    r = run([*running, late], cfg)
    stores = [len(e.block_hashes) for b in decoded(r) for e in b if isinstance(e, BlockStored)]
    assert stores[:3] == [1, 1, 1]  # r0..r2's prompts (20 tokens: one full page each)
    # late's chunks: 600 tokens in five passes; without the overlap loop the last chunk's
    # store is queued with the one before it (checkpointed when the last pass is built)
    # and tail-merged into one event (8 + 7)
    assert stores[3:-3] == ([7, 7, 8, 15] if overlap_off else [7, 7, 8, 8, 7])
    assert r.stats.mixed_passes == 5
    check_stream(r)


def test_mixed_chunk_needs_chunked_prefill_and_is_read_from_the_snapshot():
    """0.5.23 ``is_mixed_chunk``: the flag does nothing without chunked prefill."""
    running = [req(f"r{i}", list(range(100 * i + 3, 100 * i + 23)), 60) for i in range(3)]
    late = req("late", list(range(1000, 1200)), 4, arrival_ms=30.0)
    on = run([*running, late], config(chunked_prefill_size=None, enable_mixed_chunk=True))
    assert on.stats.mixed_passes == 0
    from kvcadence.replay.config import from_server_info, unmodelled_settings

    snapshot = {"enable_mixed_chunk": True, "chunked_prefill_size": 256}
    cfg = from_server_info(snapshot)
    assert cfg.enable_mixed_chunk and cfg.chunked_prefill_size == 256
    assert not unmodelled_settings(snapshot)  # modelled: no warning line
    assert not from_server_info({"chunked_prefill_size": 256}).enable_mixed_chunk


def test_mixed_chunk_from_the_capture_and_overridden_on_the_command_line(tmp_path, capsys):
    """A capture of a ``--enable-mixed-chunk`` worker replays mixed (its summary counts the
    mixed passes) without a warning line; ``--no-mixed-chunk`` turns it off, and
    ``--enable-mixed-chunk`` turns it on for a capture of a worker without it."""
    import json
    from pathlib import Path

    from kvcadence.cli import main

    corpus = Path(__file__).parent / "data" / "corpus"
    mixed = corpus / "p16-chunk256-mixed" / "bundle"
    plain = corpus / "p16-chunk256-evict" / "bundle"

    def summary(src: Path, *flags: str) -> dict:
        out = tmp_path / f"sim{len(list(tmp_path.iterdir()))}"
        assert main(["replay", str(src), "--out", str(out), "--json", *flags]) == 0
        cap = capsys.readouterr()
        assert "warning" not in cap.err
        return json.loads(cap.out.strip().splitlines()[-1])

    assert summary(mixed)["mixed_passes"] > 0
    assert summary(mixed, "--no-mixed-chunk")["mixed_passes"] == 0
    assert summary(plain)["mixed_passes"] == 0
    assert summary(plain, "--enable-mixed-chunk")["mixed_passes"] > 0


def test_prefill_max_requests_caps_each_prefill_batch():
    """SGLang ``--prefill-max-requests N`` (``PrefillAdder.add_one_req``: no request past the
    N-th of a batch), read from the snapshot: four requests arriving together prefill in
    batches of at most two."""
    from kvcadence.replay.config import from_server_info

    recs = [req(f"r{i}", list(range(50 * i + 3, 50 * i + 23)), 3) for i in range(4)]
    free = run(recs)
    capped = run(recs, config(prefill_max_requests=2))
    assert free.stats.prefill_passes == 1 and capped.stats.prefill_passes == 2
    assert from_server_info({"prefill_max_requests": 2}).prefill_max_requests == 2
    assert from_server_info({"prefill_max_requests": None}).prefill_max_requests is None


def test_prefill_max_requests_flag_parses_and_refuses_nonsense():
    """``replay --prefill-max-requests N``: a positive count; 0 or text is a usage error (exit 2)."""
    import argparse

    from kvcadence.replay import cli as replay_cli

    sub = argparse.ArgumentParser().add_subparsers()
    replay_cli.register(sub)
    (parser,) = sub.choices.values()
    assert parser.parse_args(["x.kvcb", "--prefill-max-requests", "3"]).prefill_max_requests == 3
    assert parser.parse_args(["x.kvcb"]).prefill_max_requests is None  # the bundle's
    for bad in ("0", "-1", "two"):
        with pytest.raises(SystemExit) as exc:
            parser.parse_args(["x.kvcb", "--prefill-max-requests", bad])
        assert exc.value.code == 2


@pytest.mark.parametrize("policy, queue", [("lpm", ["c1", "b1"]), ("fcfs", ["b1", "c1"])])
def test_the_waiting_queue_keeps_the_order_its_policy_gave_it(policy, queue):
    """0.5.23 ``calc_priority`` sorts ``waiting_queue`` in place and admission filters it in
    that order, so the next call starts from the last computed order (an lpm tie, or the
    fcfs fallback beyond 128 waiting requests, keeps it). ``b1`` (unrelated) and ``c1``
    (``a``'s cached 40-token prompt + 100) arrive together while ``long`` decodes and neither
    fits: lpm puts ``c1`` first and the queue stays so; fcfs keeps arrival order (ties by
    rid)."""
    p = list(range(1000, 1040))
    recs = [
        req("a", p, 1),
        req("long", list(range(3000, 3100)), 200, arrival_ms=50),
        req("b1", list(range(5000, 5120)), 1, arrival_ms=60),
        req("c1", p + list(range(6000, 6100)), 1, arrival_ms=60),
    ]
    s = _scheduler(recs, config(schedule_policy=policy, max_total_tokens=420))
    s.start()
    while s.next_time < 200e6:
        s.step(200e6)
    assert [r.spec.rid for r in s.waiting] == queue


def _keyed(r, key: str):
    """``r`` sent with ``routing_key`` ``key`` (as SGLang's metrics line keeps it)."""
    import msgspec

    meta = {**(r.meta_info or {}), "request_parameters": {"routing_key": key}}
    return msgspec.structs.replace(r, meta_info=meta)


@pytest.mark.parametrize("policy, first", [("routing-key", "y"), ("fcfs", "x")])
def test_routing_key_admits_the_waiting_request_whose_key_runs_first(policy, first):
    """``--schedule-policy routing-key`` with the keys the records kept: ``long`` (key
    ``k1``) decodes; ``x`` (``k2``) and ``y`` (``k1``) arrive together, ``x`` first, and
    each prefill batch takes one request: ``y`` is prefilled first (fcfs: ``x``)."""
    recs = [
        _keyed(req("long", list(range(3000, 3020)), 60), "k1"),
        _keyed(req("x", list(range(4000, 4020)), 2, arrival_ms=30), "k2"),
        _keyed(req("y", list(range(5000, 5020)), 2, arrival_ms=30), "k1"),
    ]
    r = run(recs, config(schedule_policy=policy, prefill_max_requests=1))
    check_stream(r)
    entry = {x.rid: x.meta_info["forward_entry_time"] for x in r.requests}
    assert min(("x", "y"), key=entry.__getitem__) == first


def test_retraction_checks_evict_for_the_requests_that_stay():
    """SGLang 0.5.23 ``retract_decode``: ``while first_iter or not check_decode_mem(kept)``
    -- after the first release, each check evicts its shortfall before it decides (the
    release itself evicts only ``remaining × 20`` tokens). At page 64 the step of the two
    requests that stay needs two pages, more than the first release freed and evicted:
    the check evicts an unlocked leaf and they stay; without that eviction a second request
    was retracted."""
    from array import array

    from kvcadence.replay.evictiontrace import EvictionTrace

    cfg = config(page_size=64, max_total_tokens=64 * 12, chunked_prefill_size=None)
    recs = [req(rid, list(range(b, b + 64)), 100) for rid, b in (("a", 3), ("b", 300), ("c", 600))]
    s = _scheduler(recs, cfg)
    lines: list[str] = []
    s.trace_evictions(EvictionTrace(type("Sink", (), {"write": lambda _, x: lines.append(x)})()))
    s.start()
    for _ in range(100):  # the three admitted and decoding
        if len(s.running) == 3:
            break
        s.step()
    assert len(s.running) == 3
    s.tree.insert(array("I", range(5000, 5128)))  # two unlocked pages: evictable
    for r in s.running:  # each at a page boundary: the next step needs a page each
        r.kv_len = 128
        s.private_total += 64 - r.alloc
        r.alloc = 64
    s.private_total = cfg.max_total_tokens - s.tree.total_size  # nothing free
    assert s.available() == 0 and s.tree.evictable_size >= 128
    lines.clear()
    s._retract(s.t, list(s.running))
    assert len(s.running) == 2 and s.stats.retractions == 1 and s.stats.aborted == 0
    causes = [json.loads(x)["cause"] for x in lines]
    assert causes == ["check_decode"], causes  # the release freed 64 (>= 40): no eviction
    assert s.available() >= 128


@pytest.mark.parametrize("policy, order", [("lpm", "zxy"), ("fcfs", "yxz")])
def test_a_cache_aware_policy_ranks_by_a_whole_prompt_match_capped_at_len_minus_1(policy, order):
    """0.5.23 ``_compute_prefix_matches`` matches each waiting request's whole prompt
    (``match_kv_cache``, no ``max_prefix_len``; page floored) and ranks it by
    ``num_matched_prefix_tokens`` = that match capped at len - 1, *not* floored. At page
    16 with ``a``'s 160 tokens cached: ``z`` (``a`` and 20 more) ranks at 160, ``x``
    (``a`` again, cached whole) at 159, ``y`` (``a``'s first 150, then its own) at 144,
    so lpm admits z, x, y (one request a batch). Matched at len - 1 and floored, as
    admission matches, x tied y at 144 (y, the earlier, went first); ranked by the
    uncapped match, x tied z at 160. Admission still reports ``x`` 144 cached."""
    a = list(range(3, 163))
    recs = [
        req("a", a, 1, arrival_ms=0.0),
        req("big", list(range(1000, 3000)), 2, arrival_ms=50.0),  # busy while y, x, z arrive
        req("y", a[:150] + list(range(500, 520)), 2, arrival_ms=51.0),
        req("x", list(a), 2, arrival_ms=52.0),
        req("z", a + list(range(600, 620)), 2, arrival_ms=53.0),
    ]
    cfg = config(page_size=16, schedule_policy=policy, prefill_max_requests=1)
    r = run(recs, cfg)
    entry = {x.rid: x.meta_info["forward_entry_time"] for x in r.requests}
    assert "".join(sorted("xyz", key=entry.__getitem__)) == order
    assert {x.rid: x.cached_tokens for x in r.requests}["x"] == 144


def test_a_no_token_stop_beside_the_last_chunk_alone_does_not_hold_the_queue():
    """0.5.23 ``_get_new_batch_prefill_raw`` sets ``batch_is_full`` at a ``NO_TOKEN`` stop
    when the adder's list holds anything -- the continuing chunk too -- but the flag is
    the running batch object's: with no request running, the next iteration replaces that
    object by the prefill batch (``running_batch = last_batch``, its own flag unset) or,
    if nothing merges, resets it (an empty running batch). ``r0``'s 398 tokens prefill in
    64-token chunks in an 800-token pool; ``r1`` (337 tokens) does not fit beside the last
    chunk, and is admitted at the next pass, while ``r0`` decodes, not after ``r0``
    finishes."""
    recs = [
        req("r0", list(range(1000, 1398)), 23, arrival_ms=23.47),
        req("r1", list(range(5000, 5337)), 20, arrival_ms=44.43),
        req("r2", list(range(9000, 9370)), 9, arrival_ms=66.62),
    ]
    r = run(recs, config(page_size=16, chunked_prefill_size=64, max_total_tokens=800))
    by = {x.rid: x.meta_info for x in r.requests}
    assert by["r1"]["forward_entry_time"] < by["r0"]["request_finished_ts"]
    assert by["r1"]["forward_entry_time"] < by["r2"]["forward_entry_time"]
    assert [x.completion_tokens for x in r.requests] == [23, 20, 9]
