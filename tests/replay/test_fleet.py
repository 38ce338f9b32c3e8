"""Fleet replay: N ranks (and workers) in one virtual clock.

* one rank + recorded routing is byte-identical to the single-rank simulator;
* independent ranks (no lane crosses ranks) give exactly what each rank alone gives;
* decode-stretch skipping never changes the output, also with lanes crossing ranks and
  dynamic routing (the cross-rank sentinel is exact);
* every rank has its own pool, radix cache and seq; records keep their serving rank;
* the sim bundles have one endpoint per rank, seq from 0 per endpoint; several workers give
  several bundles.
"""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvcadence.errors import InputError, UsageError
from kvcadence.format import wire
from kvcadence.format.bundle import BundleReader, BundleWriter, event_payload
from kvcadence.format.schema import AllBlocksCleared, BlockStored, EndpointInfo, Header
from kvcadence.replay.fleet import simulate_fleet, write_fleet_bundles
from kvcadence.replay.worker import WorkerInput, dp_size_of, load_worker
from tests.replay.helpers import config, lane_chain, req, run


def ranked(rec, rank: int | None):
    rec.dp_rank = rank
    return rec


def worker(records, n_ranks: int = 2, name: str = "w", **kw) -> WorkerInput:
    return WorkerInput(name, records, [config(**kw) for _ in range(n_ranks)])


def payloads(batches) -> list[bytes]:
    return [b.payload for b in batches]


SYS = list(range(100, 160))


def two_rank_records() -> list:
    recs = []
    for lane in range(4):
        turns = [(SYS + [lane * 50 + i for i in range(20)], 6), ([], 5), ([], 4)]
        prompt = turns[0][0]
        chain = []
        for i, (_p, n) in enumerate(turns):
            chain.append((prompt, n))
            prompt = prompt + [(7 * j + len(prompt)) % 997 + 3 for j in range(n)] + [900 + i]
        for r in lane_chain(lane, chain, gap_ms=2.0):
            recs.append(ranked(r, lane % 2))
    return recs


def test_one_rank_recorded_is_byte_identical_to_single_simulator():
    recs = two_rank_records()
    for r in recs:
        r.dp_rank = None  # the fixture's null rank means rank 0
    single = run(copy.deepcopy(recs), config(max_total_tokens=400))
    fleet = simulate_fleet([worker(recs, 1, max_total_tokens=400)], "recorded")
    assert payloads(fleet.slots[0].publisher.batches) == payloads(single.batches)
    assert [r.cached_tokens for r in fleet.requests] == [r.cached_tokens for r in single.requests]
    assert all(r.dp_rank == 0 for r in fleet.requests)


def test_the_single_rank_replay_serves_every_recorded_rank_as_its_configs_rank():
    # a DP capture replayed as one rank (the API's replay_bundle): whatever rank recorded a
    # request, the one rank serves it under its config's attn_dp_rank, no meta rank
    recs = two_rank_records()
    assert {r.dp_rank for r in recs} == {0, 1}
    res = run(copy.deepcopy(recs), config(max_total_tokens=400, attn_dp_rank=1))
    assert len(res.requests) == len(recs) and {r.dp_rank for r in res.requests} == {1}
    assert not any("dp_rank" in r.meta_info for r in res.requests)
    assert res.batches
    assert {wire.decode_batch(b.payload).attn_dp_rank for b in res.batches} == {1}
    # the fleet replays that worker per recorded rank instead: it refuses a one-rank
    # worker of several ranks
    w = worker(recs, 2)
    w.one_rank = True
    with pytest.raises(UsageError, match="one-rank worker has 2 rank configs"):
        simulate_fleet([w], "recorded")


@pytest.mark.parametrize("role", ["prefill", "decode"])
def test_one_rank_fleet_equals_single_simulator_for_pd_roles(role):
    # prefill: one new token per request, the lane's next turn after the decode elsewhere;
    # decode: every request (first turns and later ones) waits for its KV transfer
    recs = two_rank_records()
    for i, r in enumerate(recs):
        r.dp_rank = None
        base = 1_000 + i * 0.001
        r.meta_info.update(prefill_finished_time=base + 0.004, request_finished_ts=base + 0.09)
    kw = {"max_total_tokens": 400, "role": role, "decode_radix_cache": role == "decode"}
    single = run(copy.deepcopy(recs), config(**kw))
    fleet = simulate_fleet([worker(copy.deepcopy(recs), 1, **kw)], "recorded")
    assert single.batches  # not vacuous: the roles publish events
    assert payloads(fleet.slots[0].publisher.batches) == payloads(single.batches)
    assert [b.time_ns for b in fleet.slots[0].publisher.batches] == [
        b.time_ns for b in single.batches
    ]
    got = [(r.rid, r.completion_tokens, r.cached_tokens, r.finish_ns) for r in fleet.requests]
    want = [(r.rid, r.completion_tokens, r.cached_tokens, r.finish_ns) for r in single.requests]
    assert got == want
    if role == "prefill":
        assert all(r.completion_tokens == 1 for r in fleet.requests)


def test_independent_ranks_equal_separate_simulations():
    recs = two_rank_records()  # lanes 0, 2 on rank 0; lanes 1, 3 on rank 1
    fleet = simulate_fleet([worker(recs, 2, max_total_tokens=300)], "recorded")
    for rank in (0, 1):
        mine = [copy.deepcopy(r) for r in recs if r.dp_rank == rank]
        alone = run(mine, config(max_total_tokens=300, attn_dp_rank=rank))
        got = fleet.slots[rank].publisher.batches
        assert payloads(got) == payloads(alone.batches)
        assert [b.seq for b in got] == list(range(len(got)))
    assert [r.dp_rank for r in fleet.requests] == [
        r.dp_rank for r in sorted(recs, key=lambda r: r.meta_info["request_received_ts"])
    ]


def test_each_rank_has_its_own_cache_and_seq():
    prompt = list(range(10, 50))
    recs = [
        ranked(req("a", prompt, 3, arrival_ms=0), 0),
        ranked(req("b", prompt + [7], 3, arrival_ms=200), 1),  # same prefix, other rank
        ranked(req("c", prompt + [8], 3, arrival_ms=400), 0),  # same prefix, same rank
    ]
    res = simulate_fleet([worker(recs, 2)], "recorded")
    by_rid = {r.rid: r for r in res.requests}
    assert by_rid["b"].cached_tokens == 0
    assert by_rid["c"].cached_tokens == len(prompt)
    assert (by_rid["a"].dp_rank, by_rid["b"].dp_rank, by_rid["c"].dp_rank) == (0, 1, 0)
    for sl in res.slots:
        first = wire.decode_batch(sl.publisher.batches[0].payload)
        assert isinstance(first.events[0], AllBlocksCleared)
        assert first.attn_dp_rank == sl.rank
        assert [b.seq for b in sl.publisher.batches] == list(range(len(sl.publisher.batches)))


def test_pool_is_per_rank():
    # each prompt fills most of one rank's pool: two ranks hold both without eviction
    recs = [
        ranked(req("a", list(range(3, 163)), 2, arrival_ms=0), 0),
        ranked(req("b", list(range(200, 360)), 2, arrival_ms=0), 1),
        ranked(req("c", list(range(3, 163)) + [5], 2, arrival_ms=100), 0),
    ]
    res = simulate_fleet([worker(recs, 2, max_total_tokens=200)], "recorded")
    assert sum(sl.sched.stats.evictions for sl in res.slots) == 0
    assert {r.rid: r.cached_tokens for r in res.requests}["c"] == 160
    one = simulate_fleet([worker([ranked(r, 0) for r in recs], 1, max_total_tokens=200)])
    assert one.slots[0].sched.stats.evictions > 0


def test_cross_rank_lane_loses_its_cache_unless_routed_by_cache():
    recs = two_rank_records()
    for r in recs:  # every lane alternates ranks turn by turn
        r.dp_rank = int(r.rid.rsplit("t", 1)[1]) % 2
    rec = simulate_fleet([worker(recs, 2)], "recorded")
    aware = simulate_fleet([worker(recs, 2)], "cache_aware")

    def hit(res) -> float:
        return sum(r.cached_tokens or 0 for r in res.requests) / sum(
            r.prompt_tokens for r in res.requests
        )

    assert hit(aware) > hit(rec)
    later = [r for r in aware.requests if not r.rid.endswith("t0")]
    firsts = {r.lane: r.dp_rank for r in aware.requests if r.rid.endswith("t0")}
    assert all(r.dp_rank == firsts[r.lane] for r in later)  # sessions stick to their cache


def _lane_workload(draw_lanes: list[list[tuple[int, int, int]]]) -> list:
    recs = []
    for lane, turns in enumerate(draw_lanes):
        prompt = [3 + lane] * 5
        chain = []
        ranks = []
        for i, (grow, n_out, rank) in enumerate(turns):
            prompt = prompt + [(11 * i + 13 * lane + j) % 1000 + 3 for j in range(grow)]
            chain.append((prompt, n_out))
            prompt = prompt + [(7 * j + len(prompt)) % 997 + 3 for j in range(n_out)]
            ranks.append(rank)
        for r, rank in zip(lane_chain(lane, chain, gap_ms=1.0 + lane), ranks, strict=True):
            recs.append(ranked(r, rank))
    return recs


lanes_st = st.lists(
    st.lists(
        st.tuples(st.integers(1, 40), st.integers(1, 90), st.integers(0, 1)),
        min_size=1,
        max_size=4,
    ),
    min_size=1,
    max_size=4,
)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    lanes=lanes_st,
    route=st.sampled_from(["recorded", "round_robin", "shortest_queue", "cache_aware"]),
    pool=st.sampled_from([150, 400, 5000]),
    overlap=st.booleans(),
)
def test_stretch_skipping_never_changes_the_output(lanes, route, pool, overlap):
    recs = _lane_workload(lanes)
    kw = dict(max_total_tokens=pool, disable_overlap_schedule=not overlap, decode_log_interval=8)
    on = simulate_fleet([worker(copy.deepcopy(recs), 2, **kw)], route)
    off = simulate_fleet([worker(copy.deepcopy(recs), 2, skip_decode_stretches=False, **kw)], route)
    for a, b in zip(on.slots, off.slots, strict=True):
        assert payloads(a.publisher.batches) == payloads(b.publisher.batches)
        assert [x.time_ns for x in a.publisher.batches] == [x.time_ns for x in b.publisher.batches]
    assert on.serving == off.serving
    assert [r.finish_ns for r in on.requests] == [r.finish_ns for r in off.requests]


def _write_source(path: Path, recs: list, dp: int, pool: int = 300) -> None:
    eps = [EndpointInfo(r, f"tcp://127.0.0.1:{5557 + r}", None, r, "kv-events") for r in range(dp)]
    info = {"page_size": 1, "max_total_num_tokens": pool, "dp_size": dp, "version": "0.5.23"}
    header = Header(1, 0, "real", "test", "0.5.23", info, None, [], 0, eps)
    with BundleWriter(path, header) as w:
        for r in recs:
            w.write(r)
        w.close()


def test_sim_bundle_has_one_endpoint_per_rank(tmp_path):
    recs = two_rank_records()
    _write_source(tmp_path / "src", recs, 2)
    w = load_worker(tmp_path / "src")
    assert w.dp_size == 2 and [c.max_total_tokens for c in w.rank_configs] == [300, 300]
    res = simulate_fleet([w], "recorded")
    (path,) = write_fleet_bundles(tmp_path / "sim", res)
    rd = BundleReader(path)
    assert rd.header.source == "sim" and [e.dp_rank for e in rd.header.endpoints] == [0, 1]
    seqs: dict[int, list[int]] = {0: [], 1: []}
    stored: dict[int, int] = {0: 0, 1: 0}
    for f in rd.events():
        seqs[f.endpoint].append(f.seq)
        batch = wire.decode_batch(event_payload(f))
        assert batch.attn_dp_rank == f.endpoint
        stored[f.endpoint] += sum(isinstance(e, BlockStored) for e in batch.events)
    assert all(s == list(range(len(s))) and s for s in seqs.values())
    assert stored[0] > 0 and stored[1] > 0
    reqs = rd.requests()
    assert len(reqs) == len(recs)
    assert {r.rid: r.dp_rank for r in reqs} == {r.rid: r.dp_rank for r in recs}
    assert all(r.meta_info["dp_rank"] == r.dp_rank for r in reqs)


def test_several_workers_write_several_bundles(tmp_path):
    recs = two_rank_records()
    a = [copy.deepcopy(r) for r in recs]
    b = [copy.deepcopy(r) for r in recs if r.dp_rank == 0]
    _write_source(tmp_path / "wa", a, 2)
    _write_source(tmp_path / "wb", b, 1)
    ws = [load_worker(tmp_path / "wa"), load_worker(tmp_path / "wb")]
    res = simulate_fleet(ws, "recorded")
    assert [(s.worker, s.rank) for s in res.slots] == [(0, 0), (0, 1), (1, 0)]
    paths = write_fleet_bundles(tmp_path / "out", res)
    assert [p.name for p in paths] == ["wa", "wb"]
    assert len(BundleReader(paths[0]).requests()) == len(a)
    assert len(BundleReader(paths[1]).requests()) == len(b)
    assert len(BundleReader(paths[1]).header.endpoints) == 1
    # the same workload on worker b's single rank equals worker a's rank 0 (same clock)
    assert payloads(res.slots[2].publisher.batches) == payloads(res.slots[0].publisher.batches)
    rr = simulate_fleet(ws, "round_robin")
    assert {rr.slots[s].worker for s in rr.serving} == {0, 1}  # routing spans workers


def test_recorded_rank_beyond_dp_size_is_an_input_error():
    recs = [ranked(req("a", [1, 2, 3], 2), 3)]
    with pytest.raises(InputError, match="dp rank 3"):
        simulate_fleet([worker(recs, 2)], "recorded")


def test_dp_size_from_header_endpoints_and_records():
    class H:
        server_info = {"kv_events": {"dp_size": 2}}
        endpoints: list = []

    assert dp_size_of(H(), []) == 2
    assert dp_size_of(H(), [ranked(req("a", [1], 1), 3)]) == 4
    H.server_info = {}
    assert dp_size_of(H(), [ranked(req("a", [1], 1), None)]) == 1


@pytest.mark.parametrize(
    ("n_ranks", "route"), [(1, "recorded"), (1, "round_robin"), (2, "recorded")]
)
def test_progress_counts_every_request_once(n_ranks, route):
    # one rank under a static router steps alone; a dynamic router or two ranks take the
    # general loop: either way every finished request is reported once
    recs = two_rank_records()
    for r in recs:
        r.dp_rank = r.dp_rank if n_ranks > 1 else None
    got: list[int] = []
    res = simulate_fleet([worker(recs, n_ranks)], route, progress=got.append)
    assert all(n > 0 for n in got) and sum(got) == len(res.requests) == len(recs)
    if n_ranks == 1 and route == "recorded":
        got.clear()
        single = run(copy.deepcopy(recs), config(), progress=got.append)
        assert sum(got) == len(single.requests) and len(got) > 1


def test_one_rank_recorded_pace_is_the_single_rank_replays():
    """A real single-rank capture (per-phase timings) on its recorded pace: the fleet of one
    (``load_worker``, ``pace="recorded"``) publishes exactly what ``kvcadence replay --pace
    recorded`` (``simulate(..., pace="recorded")``) does, and not what the model's pace does."""
    from kvcadence.replay.loading import load_for_replay
    from kvcadence.replay.simulator import simulate
    from kvcadence.replay.worker import effective_config

    src = Path(__file__).parent / "data" / "corpus" / "p1-lanes8" / "bundle"
    reader = BundleReader(src)
    records, _, _ = load_for_replay(reader)
    cfg = effective_config(reader.header.server_info, records)
    single = {
        p: simulate(records, copy.deepcopy(cfg), pace=p, source_header=reader.header)
        for p in ("model", "recorded")
    }
    fleet = simulate_fleet([load_worker(src)], "recorded", pace="recorded")
    assert payloads(fleet.slots[0].publisher.batches) == payloads(single["recorded"].batches)
    assert payloads(single["model"].batches) != payloads(single["recorded"].batches)
    assert single["recorded"].summary()["pace"] == "recorded"


def test_auto_pace_paces_a_queued_rank_only_under_recorded_routing():
    """``pace="auto"`` on a one-rank worker whose requests queued (``p4-mrr3``: a median
    wait of 1.3 s, ``pace.queued``): the recorded pace under ``recorded`` routing (the
    single-rank replay's), the model's under another router, which serves the rank other
    requests than those whose recorded times the pace aims at."""
    from kvcadence.replay.pace import PacedTimer

    src = Path(__file__).parent / "data" / "corpus" / "p4-mrr3" / "bundle"
    for route, want in (("recorded", True), ("round_robin", False)):
        fleet = simulate_fleet([load_worker(src)], route, pace="auto")
        assert (type(fleet.slots[0].sched.timer) is PacedTimer) is want, route
