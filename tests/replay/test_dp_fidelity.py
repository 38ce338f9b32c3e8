"""Fidelity across DP ranks on real SGLang 0.5.23 captures.

* the single-rank fixture (``dp_rank`` null = rank 0) through the fleet path gives exactly
  the single-rank replay (so its issue-4 fidelity numbers hold unchanged);
* ``data/sglang-0.5.23-dp2-agent-ps1``: a real ``--dp-size 2`` capture (CPU worker, page 1,
  pool 3000 tokens per rank, 100 agent requests on 4 lanes, ``--enable-metrics``; see
  ``data/README.md``). With ``--route recorded``, per rank: the same requests, identical
  stored-hash sets, stored and removed block totals within 2 %, ``cached_tokens``
  equal for >= 95 % of requests, hit rate within 0.01, the run's span within 5 % (the CPU-aware pass-time calibration lands at -3.4 % on this capture), and event
  counts within 30 % (a regression guard). The replay issue's tighter event bars (``BARS``)
  do **not** hold on rank 0 of this capture (recorded on a heavily shared 2-core box; 28 vs
  36 removal events): ``test_dp2_issue4_event_bars_per_rank`` is a strict xfail that
  flags the day they do;
* with ``--route cache_aware`` the simulated hit rate is reported next to the recorded one.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from kvcadence.analysis.ranks import compare_ranks, rank_figures
from kvcadence.capture.importer import import_bundle
from kvcadence.replay.fleet import load_worker, simulate_fleet, write_fleet_bundles
from kvcadence.replay.simulator import replay_bundle

DP2 = Path(__file__).parent / "data" / "sglang-0.5.23-dp2-agent-ps1"

#: figure -> allowed |relative delta| per rank (issue 4's bars)
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
    for route in ("recorded", "cache_aware"):
        res = simulate_fleet([w], route)
        (path,) = write_fleet_bundles(tmp / route, res)
        out[route] = (res, rank_figures(path))
    return w, rank_figures(DP2), out


def test_dp2_capture_has_two_ranks(dp2):
    w, real, _ = dp2
    assert w.dp_size == 2
    assert [c.max_total_tokens for c in w.rank_configs] == [3000, 3000]
    assert [c.attn_dp_rank for c in w.rank_configs] == [0, 1]
    assert real["0"]["requests"] + real["1"]["requests"] == real["all"]["requests"] == 100
    assert real["0"]["requests"] > 0 and real["1"]["requests"] > 0
    # capture side: one event stream per rank, each from seq 0; every record names its rank
    from kvcadence.capture.bundle import BundleReader

    rd = BundleReader(DP2)
    assert [(e.id, e.dp_rank) for e in rd.header.endpoints] == [(0, 0), (1, 1)]
    first: dict[int, int] = {}
    for f in rd.events():
        first.setdefault(f.endpoint, f.seq)
    assert first == {0: 0, 1: 0}
    assert all(r.dp_rank in (0, 1) and r.meta_info["dp_rank"] == r.dp_rank for r in w.records)


def _rows(dp2) -> dict:
    _w, real, runs = dp2
    return {(r["rank"], r["figure"]): r for r in compare_ranks(real, runs["recorded"][1])}


def test_dp2_recorded_route_per_rank_fidelity(dp2):
    w, real, runs = dp2
    res, sim = runs["recorded"]
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


@pytest.mark.xfail(strict=True, reason="rank 0 of the dp2 capture misses the issue-4 bars")
def test_dp2_issue4_event_bars_per_rank(dp2):
    by = _rows(dp2)
    for rank in ("0", "1"):
        for fig, bar in BARS.items():
            d = by[(rank, fig)]["delta"]
            assert d is not None and abs(d) <= bar, (rank, fig, by[(rank, fig)])


def test_dp2_cache_aware_hit_rate_next_to_recorded(dp2):
    _w, real, runs = dp2
    rec_hit = real["all"]["hit_rate"]
    sim_rec = runs["recorded"][1]["all"]["hit_rate"]
    aware_res, aware = runs["cache_aware"]
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
