"""Fidelity across DP ranks on real SGLang 0.5.23 captures.

* the single-rank fixture (``dp_rank`` null = rank 0) through the fleet path gives exactly
  the single-rank replay (so its fidelity numbers hold unchanged);
* ``data/sglang-0.5.23-dp2-agent-ps1``: a real ``--dp-size 2`` capture (CPU worker, page 1,
  pool 3000 tokens per rank, 100 agent requests on 4 lanes, ``--enable-metrics``; see
  ``data/README.md``). With ``--route recorded`` (pace ``auto`` = ``recorded`` here), per
  rank: the same requests, identical stored-hash sets, stored and removed block totals
  within 2 %, ``cached_tokens`` equal for >= 95 % of requests, hit rate within 0.01, the
  run's span within 5 %, and event counts within 30 % (a regression guard);
* the cause of the fidelity-bar misses under the pass-time model alone (``pace="model"``): the
  recorded ranks were decided by a strict round robin over the *recorded* arrival order;
  per-request pass-time errors add up along each lane (±10–30 s), the simulated arrival
  order drifts, and the recorded ranks then no longer alternate (37 of 99 consecutive
  arrivals on the same rank vs 0 recorded): a rank idles twice as often as it did (9 vs 4
  and 5 vs 2 idle spells), each idle publish splits a finish store from the next turn's
  prefill store, and the pools fill at other moments (more, smaller removals). The
  recorded pace keeps the order (``test_dp2_recorded_pace_keeps_the_round_robin_order``);
* with the recorded pace every fidelity bar (``BARS``) holds on rank 1 and all but the
  median blocks per Stored event on rank 0 (-12.5 %: 89 vs 88 events, and the real
  sizes jump from 66 to 78 at the median, so one event more or less moves it by ~15 %);
  ``test_dp2_event_bars_per_rank`` stays a strict xfail that flags the day it holds.
  The miss is timing, not memory accounting
  (``test_dp2_rank0_miss_is_one_late_arrival_not_accounting``): at the prefills where the
  two streams part, the rank's pool (tree size, running requests' KV, free slots) is the
  real one; what differs is *which* leaves LRU eviction takes, because one request
  (``l1-s2-t0``) arrives 3.3 s late (its lane's previous turn finished two decode passes
  later on rank 1, after a 2.4 s prefill instead of before it), finishes after instead of
  before ``l3-s0-t4``, and so is newer in LRU order. Put at its recorded arrival, rank 0's
  first 24 removals equal the real ones hash for hash (9 otherwise);
* with ``--route cache_aware`` the simulated hit rate is reported next to the recorded one.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from kvcadence.analysis.ranks import compare_ranks, rank_figures
from kvcadence.capture.importer import import_bundle
from kvcadence.replay.fleet import Fleet, simulate_fleet, write_fleet_bundles
from kvcadence.replay.routing import make_router
from kvcadence.replay.simulator import replay_bundle
from kvcadence.replay.worker import load_worker

DP2 = Path(__file__).parent / "data" / "sglang-0.5.23-dp2-agent-ps1"

#: figure -> allowed |relative delta| per rank (the README's fidelity bars)
BARS = {
    "stored_events_per_request": 0.03,
    "stored_blocks_median": 0.03,
    "removed_events_per_request": 0.10,
    "removed_blocks_median": 0.10,
    "removed_blocks_mean": 0.10,
}


def test_single_rank_fixture_is_unchanged_through_the_fleet(fixture_dir, tmp_path):
    src = tmp_path / "real"
    import_bundle(
        src,
        frames=fixture_dir / "events.jsonl",
        requests=fixture_dir / "requests.jsonl",
        server_info=fixture_dir / "server_info.json",
        command=["test"],
    )
    single = replay_bundle(src, None)
    w = load_worker(src)
    assert w.dp_size == 1
    fleet = simulate_fleet([w], "recorded")
    assert [b.payload for b in fleet.slots[0].publisher.batches] == [
        b.payload for b in single.batches
    ]
    assert [r.cached_tokens for r in fleet.requests] == [r.cached_tokens for r in single.requests]


@pytest.fixture(scope="module")
def dp2(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("dp2")
    w = load_worker(DP2)
    out = {}
    for route, pace in (("recorded", "auto"), ("cache_aware", "auto"), ("model", "model")):
        res = simulate_fleet([w], "recorded" if route == "model" else route, pace=pace)
        (path,) = write_fleet_bundles(tmp / route, res)
        out[route] = (res, rank_figures(path), path)
    return w, rank_figures(DP2), out


def test_dp2_capture_has_two_ranks(dp2):
    w, real, _ = dp2
    assert w.dp_size == 2
    assert [c.max_total_tokens for c in w.rank_configs] == [3000, 3000]
    assert [c.attn_dp_rank for c in w.rank_configs] == [0, 1]
    assert real["0"]["requests"] + real["1"]["requests"] == real["all"]["requests"] == 100
    assert real["0"]["requests"] > 0 and real["1"]["requests"] > 0
    # capture side: one event stream per rank, each from seq 0; every record names its rank
    from kvcadence.format.bundle import BundleReader

    rd = BundleReader(DP2)
    assert [(e.id, e.dp_rank) for e in rd.header.endpoints] == [(0, 0), (1, 1)]
    first: dict[int, int] = {}
    for f in rd.events():
        first.setdefault(f.endpoint, f.seq)
    assert first == {0: 0, 1: 0}
    assert all(r.dp_rank in (0, 1) and r.meta_info["dp_rank"] == r.dp_rank for r in w.records)


def _rows(dp2, run: str = "recorded") -> dict:
    _w, real, runs = dp2
    return {(r["rank"], r["figure"]): r for r in compare_ranks(real, runs[run][1])}


def test_dp2_recorded_route_per_rank_fidelity(dp2):
    w, real, runs = dp2
    res, sim, _path = runs["recorded"]
    by = _rows(dp2)
    for rank in ("0", "1", "all"):
        assert sim[rank]["requests"] == real[rank]["requests"]
        assert abs(by[(rank, "stored_blocks")]["delta"]) <= 0.02
        assert abs(by[(rank, "removed_blocks")]["delta"]) <= 0.02
        assert by[(rank, "stored_hash_jaccard")]["sim"] == 1.0
        assert by[(rank, "cached_tokens_equal")]["sim"] >= 0.95
        assert abs(sim[rank]["hit_rate"] - real[rank]["hit_rate"]) <= 0.01
        for fig in ("stored_events_per_request", "removed_events_per_request", "messages"):
            assert abs(by[(rank, fig)]["delta"]) <= 0.30, by[(rank, fig)]
    # every request stayed on the rank that served it
    assert all(
        r.dp_rank == (s.source.dp_rank or 0) for r, s in zip(res.requests, res.specs, strict=True)
    )
    span = (max(r.finish_ns for r in w.records) - min(r.send_ns for r in w.records)) / 1e9
    assert abs(res.virtual_ns / 1e9 - span) / span <= 0.05


def _arrival_ranks(path) -> str:
    from kvcadence.format.bundle import BundleReader

    recs = BundleReader(path).requests()
    recs.sort(key=lambda r: r.meta_info["request_received_ts"])
    return "".join(str(r.dp_rank) for r in recs)


def _repeats(seq: str) -> int:
    return sum(1 for a, b in zip(seq, seq[1:], strict=False) if a == b)


def test_dp2_recorded_pace_keeps_the_round_robin_order(dp2):
    _w, _real, runs = dp2
    real = _arrival_ranks(DP2)
    assert _repeats(real) == 0  # round_robin: the recorded ranks alternate strictly
    paced = _repeats(_arrival_ranks(runs["recorded"][2]))
    model = _repeats(_arrival_ranks(runs["model"][2]))
    print(f"same-rank consecutive arrivals: real 0, recorded pace {paced}, model {model}")
    assert paced <= 12 < 30 <= model


def test_dp2_recorded_pace_event_bars(dp2):
    """Regression guard: the fidelity bars that hold with the recorded pace (all but rank
    0's median blocks per Stored event), and per rank the message count within 3 %."""
    by = _rows(dp2)
    model = _rows(dp2, "model")
    for rank in ("0", "1"):
        for fig, bar in BARS.items():
            if (rank, fig) == ("0", "stored_blocks_median"):
                continue
            assert abs(by[(rank, fig)]["delta"]) <= bar, (rank, fig, by[(rank, fig)])
        assert abs(by[(rank, "messages")]["delta"]) <= 0.03
    # the pass-time model alone misses (see the module docstring)
    assert (
        abs(model[("0", "stored_events_per_request")]["delta"]) > BARS["stored_events_per_request"]
    )


def test_dp2_recorded_pace_is_deterministic(dp2, tmp_path):
    w, _real, runs = dp2
    again = simulate_fleet([w], "recorded")
    for a, b in zip(runs["recorded"][0].slots, again.slots, strict=True):
        assert [x.payload for x in a.publisher.batches] == [x.payload for x in b.publisher.batches]
        assert [x.time_ns for x in a.publisher.batches] == [x.time_ns for x in b.publisher.batches]


@pytest.mark.xfail(
    strict=True,
    reason="rank 0's median blocks per Stored event: -12.5 % (72 -> 63): the real median "
    "is the midpoint of a gap 66 | 78 with no real event within 3 % of it, and 5 "
    "finish+next-prefill merge pairs differ (3 real-only, 2 sim-only; 88 vs 89 Stored "
    "events); pass timing (finish order / publish windows), not memory accounting and not "
    "a missing rule: see test_dp2_rank0_miss_is_one_late_arrival_not_accounting and "
    "test_dp_captures.py::test_page1_dp_median_misses_are_merge_noise",
)
def test_dp2_event_bars_per_rank(dp2):
    by = _rows(dp2)
    for rank in ("0", "1"):
        for fig, bar in BARS.items():
            d = by[(rank, fig)]["delta"]
            assert d is not None and abs(d) <= bar, (rank, fig, by[(rank, fig)])


def _removals_real(rank: int) -> list[tuple[int, ...]]:
    """Every BlockRemoved of ``rank`` in the real capture, in publish order."""
    from kvcadence.format import wire
    from kvcadence.format.bundle import BundleReader, event_payload
    from kvcadence.format.schema import BlockRemoved

    out = []
    for f in BundleReader(DP2).events():
        if f.endpoint == rank:
            for e in wire.decode_batch(event_payload(f)).events:
                if isinstance(e, BlockRemoved):
                    out.append(tuple(e.block_hashes))
    return out


def _removals_sim(res, rank: int) -> list[tuple[int, ...]]:
    from kvcadence.format import wire
    from kvcadence.format.schema import BlockRemoved

    out = []
    for b in res.slots[rank].publisher.batches:
        for e in wire.decode_batch(b.payload).events:
            if isinstance(e, BlockRemoved):
                out.append(tuple(e.block_hashes))
    return out


def _same_prefix(a: list, b: list) -> int:
    k = 0
    while k < min(len(a), len(b)) and a[k] == b[k]:
        k += 1
    return k


class _OnTimeFleet(Fleet):
    """A recorded-route replay where the named requests arrive at their recorded receive
    time instead of their (scaled) gap after the lane's previous turn finished."""

    def __init__(self, *a, rids: set[str], **kw) -> None:
        super().__init__(*a, **kw)
        self.on_time = {s.idx for s in self.specs if s.rid in rids}
        for s in self.specs:
            if s.idx in self.on_time:
                at = int(s.source.meta_info["request_received_ts"] * 1e9) - self.anchor_ns
                self._route(at, s.idx)

    def _known(self, at: int, idx: int) -> None:
        if idx not in self.on_time:
            super()._known(at, idx)


def test_dp2_rank0_miss_is_one_late_arrival_not_accounting(dp2):
    """Where rank 0's event stream first parts from the real one, and why.

    Its first 9 removals are the real ones hash for hash; the 10th is taken at
    ``l3-s2-t0``'s prefill, where the sim's pool equals the real one (tree 2852 tokens,
    running KV 22 vs ~23, 126 vs ~125 free; need 224) but evicts other leaves: real 124
    blocks (``l1-s2-t0``'s two nodes, then ``l3-s0-t4``'s finish node), sim 180
    (``l3-s0-t4``'s finish node and its parent). LRU order: ``l1-s2-t0`` finished before
    ``l3-s0-t4`` on the real worker, after it in the sim, because it arrived 3.3 s late
    (its lane's previous turn ``l1-s1-t2`` finished late on rank 1). From there the free
    headroom differs by 41-56 tokens: the sim evicts the 489-block node right after
    ``l3-s2-t1``'s prefill (splitting a finish + next-prefill merge) where the real worker
    evicted it 18 s later. With ``l1-s2-t0`` at its recorded arrival the first 24 removals
    are the real ones and that split is gone: eviction (whole LRU leaves, shortfall only)
    and the pool accounting are not what misses."""
    w, _real, runs = dp2
    real = _removals_real(0)
    base = _removals_sim(runs["recorded"][0], 0)
    k = _same_prefix(real, base)
    assert k == 9
    assert (len(real[k]), len(base[k])) == (124, 180)
    assert real[k][-38:] == base[k][:38]  # both take l3-s0-t4's finish node (38 blocks)
    fleet = _OnTimeFleet([w], make_router("recorded"), pace="auto", rids={"l1-s2-t0"})
    fixed = _removals_sim(fleet.run(), 0)
    assert _same_prefix(real, fixed) >= 24


def test_dp2_cache_aware_hit_rate_next_to_recorded(dp2):
    _w, real, runs = dp2
    rec_hit = real["all"]["hit_rate"]
    sim_rec = runs["recorded"][1]["all"]["hit_rate"]
    aware_res, aware, _path = runs["cache_aware"]
    aware_hit = aware["all"]["hit_rate"]
    print(
        f"hit rate: recorded {rec_hit:.3f}, sim recorded {sim_rec:.3f}, cache_aware {aware_hit:.3f}"
    )
    assert abs(sim_rec - rec_hit) <= 0.03
    assert aware_hit > sim_rec  # sessions follow their cache instead of alternating ranks
    moved = sum(
        1
        for r, s in zip(aware_res.requests, aware_res.specs, strict=True)
        if r.dp_rank != s.source.dp_rank
    )
    assert moved > 0


def test_replay_cli_pace_flag(dp2, tmp_path, capsys):
    import json

    from kvcadence.cli import main

    _w, _real, runs = dp2
    for pace, run in (("auto", "recorded"), ("model", "model")):
        out = tmp_path / pace
        assert main(["replay", str(DP2), "--out", str(out), "--pace", pace, "--json"]) == 0
        assert json.loads(capsys.readouterr().out)["messages"] == runs[run][0].summary()["messages"]
        assert rank_figures(out) == runs[run][1]
    with pytest.raises(SystemExit) as e:
        main(["replay", str(DP2), "--out", str(tmp_path / "x"), "--pace", "fast"])
    assert e.value.code == 2
