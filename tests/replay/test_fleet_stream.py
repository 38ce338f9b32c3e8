"""A fleet replay writes its sim bundles as the ranks publish (``replay.fleetout``).

* streamed bundles have the bytes of the run that kept every rank's batches, for any
  workload, routing and number of ranks and workers;
* the merge writes (publish time, rank, seq) order whatever the interleaving of the ranks'
  publishes, holding only what a rank may still overtake; a batch below what was written
  is an error, not a silently different order;
* a DP capture's replay holds a handful of batches, not its history;
* a failed run leaves no partial output.
"""

from __future__ import annotations

import copy
import tempfile
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvcadence.errors import ReplayError
from kvcadence.replay.events import PublishedBatch
from kvcadence.replay.fleet import simulate_fleet, write_fleet_bundles
from kvcadence.replay.fleetout import FleetOut, RankMerge
from kvcadence.replay.routing import make_router
from kvcadence.replay.worker import WorkerInput, load_worker
from tests.replay.helpers import config, lane_chain

DATA = Path(__file__).resolve().parent / "data"
S404 = DATA / "sglang-0.5.23-dp2-agent-s404"


def _tree(d: Path) -> dict[str, bytes]:
    return {str(p.relative_to(d)): p.read_bytes() for p in sorted(d.rglob("*")) if p.is_file()}


def _records(lanes: int, seed: int, n_ranks: int) -> list:
    recs = []
    for lane in range(lanes):
        base = [3 + (seed * 31 + lane * 17 + i) % 400 for i in range(20 + (lane * 7) % 30)]
        turns = [(base, 3 + (lane + seed) % 5), (base + [9] * (5 + lane), 2 + lane % 3)]
        for r in lane_chain(lane, turns, gap_ms=0.5 + lane % 3):
            r.dp_rank = (lane + seed) % n_ranks
            recs.append(r)
    return recs


def _workers(n_workers: int, n_ranks: int, lanes: int, pool: int) -> list[WorkerInput]:
    return [
        WorkerInput(
            f"w{i}",
            _records(lanes, i, n_ranks),
            [config(max_total_tokens=pool) for _ in range(n_ranks)],
        )
        for i in range(n_workers)
    ]


@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    n_workers=st.integers(1, 2),
    n_ranks=st.integers(1, 3),
    lanes=st.integers(1, 6),
    pool=st.sampled_from([120, 400, 10_000]),
    route=st.sampled_from(["recorded", "round_robin", "shortest_queue", "cache_aware"]),
)
def test_streamed_fleet_bundles_have_the_bytes_of_the_kept_batches(
    n_workers, n_ranks, lanes, pool, route
):
    workers = _workers(n_workers, n_ranks, lanes, pool)
    with tempfile.TemporaryDirectory() as tmp:
        t = Path(tmp)
        kept = simulate_fleet(copy.deepcopy(workers), route)
        write_fleet_bundles(t / "kept", kept)
        out = FleetOut(t / "streamed")
        streamed = simulate_fleet(copy.deepcopy(workers), route, out=out, event_log=False)
        out.finish(streamed)
        assert all(sl.publisher.batches == [] for sl in streamed.slots)
        assert _tree(t / "streamed") == _tree(t / "kept")


class _Frames:
    """A ``SimBundleOut`` stand-in: the frames as written."""

    def __init__(self) -> None:
        self.got: list[tuple[int, int, int]] = []

    def frame(self, rank: int, b: PublishedBatch) -> None:
        self.got.append((b.time_ns, rank, b.seq))


@settings(max_examples=60, deadline=None)
@given(
    st.lists(st.lists(st.integers(0, 5), max_size=12), min_size=1, max_size=4),
    st.randoms(use_true_random=False),
)
def test_merge_writes_publish_order_for_any_interleaving(steps, rnd):
    # each rank publishes at nondecreasing times (cumulative steps); the ranks' publishes
    # interleave at random; the floor given is the earliest next publish of any rank
    streams = []
    for r, st_ in enumerate(steps):
        t, seq = 0, []
        for i, d in enumerate(st_):
            t += d
            seq.append((t, r, i))
        streams.append(seq)
    out = _Frames()
    merge = RankMerge(out, range(len(streams)))  # type: ignore[arg-type]
    pos = [0] * len(streams)
    while True:
        live = [r for r in range(len(streams)) if pos[r] < len(streams[r])]
        if not live:
            break
        merge.advance(min(streams[r][pos[r]][0] for r in live))
        r = rnd.choice(live)
        t, _, i = streams[r][pos[r]]
        pos[r] += 1
        merge.push(r, PublishedBatch(i, t, 0, b"", 1))
    merge.close()
    assert out.got == sorted(x for s in streams for x in s)


def test_a_batch_below_what_was_written_is_an_error():
    out = _Frames()
    merge = RankMerge(out, [0, 1])  # type: ignore[arg-type]
    merge.push(0, PublishedBatch(0, 10, 0, b"", 1))
    merge.push(1, PublishedBatch(0, 20, 0, b"", 1))
    merge.push(0, PublishedBatch(1, 30, 0, b"", 1))  # no rank publishes before 20 now
    assert out.got == [(10, 0, 0)]
    with pytest.raises(ReplayError, match="publish order"):
        merge.push(1, PublishedBatch(1, 15, 0, b"", 1))


def test_dp_capture_replay_holds_a_handful_of_batches(tmp_path):
    out = FleetOut(tmp_path / "sim")
    res = simulate_fleet([load_worker(S404)], "recorded", out=out, event_log=False)
    out.finish(res)
    (merge,) = out.merges
    assert res.summary()["messages"] > 300
    assert merge.held_max <= 8


class _Failing:
    """``round_robin`` that fails on its ``n``-th request."""

    name = "round_robin"
    static = True

    def __init__(self, n: int) -> None:
        self.inner = make_router("round_robin")
        self.n = n

    def route(self, fleet, idx, at):
        self.n -= 1
        if self.n < 0:
            raise ReplayError("router failed")
        return self.inner.route(fleet, idx, at)


@pytest.mark.parametrize("n_workers", [1, 2])
def test_a_failed_streamed_run_leaves_no_output(tmp_path, n_workers):
    workers = _workers(n_workers, 2, 6, 10_000)
    out = FleetOut(tmp_path / "sim")
    with pytest.raises(ReplayError, match="router failed"):
        simulate_fleet(workers, _Failing(8), out=out, event_log=False)
    assert not (tmp_path / "sim").exists()
    (tmp_path / "empty").mkdir()  # an empty directory given stays, empty
    out = FleetOut(tmp_path / "empty")
    with pytest.raises(ReplayError):
        simulate_fleet(_workers(n_workers, 2, 6, 10_000), _Failing(8), out=out)
    assert list((tmp_path / "empty").iterdir()) == []
