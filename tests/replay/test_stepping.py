"""The scheduler's public stepping API and the one replay driver over it.

* a driver that routes every request itself (shared ``requests=``, ``add_arrival``,
  releasing lanes from ``on_finish``) reproduces ``Scheduler.run`` byte for byte;
  ``on_finish`` is called once per request, at its finish time;
* ``step``'s ``horizon`` bounds a skipped decode stretch like a known arrival: an arrival
  handed over at the horizon gives exactly the bytes of knowing it from the start;
* fleet bundles carry each rank's visibility notes;
* the design: a single-rank replay is a fleet of one -- ``replay_bundle`` / ``simulate``
  run ``Fleet`` once on one rank, and its sim bundle is the one-rank fleet's bundle byte
  for byte but for what names the single rank (header endpoint ``sim://``, ``sim_config``
  without ``route`` / ``dp_size`` / ``ranks``, the command, no ``meta_info["dp_rank"]``).
"""

from __future__ import annotations

import copy

import msgspec
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvcadence.errors import ReplayError
from kvcadence.format.bundle import BundleReader
from kvcadence.format.schema import Annotation
from kvcadence.replay.events import Publisher
from kvcadence.replay.fleet import Fleet, simulate_fleet, write_fleet_bundles
from kvcadence.replay.radix import wire_hasher
from kvcadence.replay.request import SimReq
from kvcadence.replay.schedule import Schedule, build_schedule
from kvcadence.replay.scheduler import Scheduler
from kvcadence.replay.simulator import replay_bundle
from kvcadence.replay.worker import load_worker
from tests.replay.helpers import config, req, run
from tests.replay.test_fleet import _write_source, two_rank_records


def _payloads(batches) -> list[bytes]:
    return [b.payload for b in batches]


def _driven(records, cfg, *, horizon_at: dict[int, int] | None = None):
    """Replay ``records`` with an outside driver over the stepping API. ``horizon_at``:
    open-loop arrivals (idx -> ns) handed over only when the clock reaches them."""
    sch = build_schedule(records, default_gap_ns=int(cfg.timing.default_gap_s * 1e9))
    reqs = [SimReq(s) for s in sch.requests]
    succ: dict[int, list[int]] = {}
    for s in sch.requests:
        if s.pred is not None:
            succ.setdefault(s.pred, []).append(s.idx)
    finished: list[tuple[int, int]] = []

    def on_finish(r: SimReq, t: int) -> None:
        finished.append((r.idx, t))
        for nxt in succ.get(r.idx, ()):
            sched.add_arrival(t + reqs[nxt].spec.gap_ns, nxt)

    pub = Publisher(cfg.sglang_version, cfg.medium, cfg.attn_dp_rank, sch.anchor_ns)
    sched = Scheduler(cfg, Schedule([], sch.anchor_ns, []), wire_hasher(), publisher=pub,
                      requests=reqs, on_finish=on_finish)  # fmt: skip
    sched.start()
    later = dict(horizon_at or {})
    for s in sch.requests:
        if s.pred is None and s.idx not in later:
            sched.add_arrival(s.arrival_ns or 0, s.idx)
    pending = sorted((at, idx) for idx, at in later.items())
    while True:
        horizon = pending[0][0] if pending else float("inf")
        if pending and sched.next_time >= horizon:
            at, idx = pending.pop(0)
            sched.add_arrival(at, idx)
            continue
        if not sched.step(horizon) and not pending:
            break
    stats = sched.finish_run()
    return pub.batches, reqs, finished, stats


def _lanes() -> list:
    recs = two_rank_records()
    for r in recs:
        r.dp_rank = None
    return recs


def _run_alone(records, cfg):
    """``Scheduler.run`` on its own schedule (no driver): batches and statistics."""
    sch = build_schedule(records, default_gap_ns=int(cfg.timing.default_gap_s * 1e9))
    sched = Scheduler(cfg, sch, wire_hasher())
    stats = sched.run()
    return sched.publisher.batches, stats


def test_outside_driver_reproduces_run_and_sees_every_finish():
    recs = _lanes()
    alone, alone_stats = _run_alone(copy.deepcopy(recs), config(max_total_tokens=300))
    batches, reqs, finished, stats = _driven(copy.deepcopy(recs), config(max_total_tokens=300))
    assert alone and _payloads(batches) == _payloads(alone)
    assert [b.time_ns for b in batches] == [b.time_ns for b in alone]
    assert stats.passes == alone_stats.passes and stats.virtual_ns == alone_stats.virtual_ns
    # the single-rank replay (a fleet of one) too
    single = run(copy.deepcopy(recs), config(max_total_tokens=300))
    assert _payloads(single.batches) == _payloads(alone)
    assert single.stats.passes == alone_stats.passes
    assert sorted(i for i, _ in finished) == list(range(len(reqs)))  # once each
    assert all(reqs[i].finish_ns == t for i, t in finished)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    late_ms=st.integers(min_value=1, max_value=400),
    n_out=st.integers(min_value=2, max_value=120),
    overlap=st.booleans(),
)
def test_horizon_stops_a_stretch_like_a_known_arrival(late_ms, n_out, overlap):
    recs = [
        req("a", list(range(3, 40)), n_out, arrival_ms=0),
        req("b", list(range(3, 30)) + [7, 8], 5, arrival_ms=late_ms),
    ]
    kw = dict(max_total_tokens=500, disable_overlap_schedule=not overlap)
    known = run(copy.deepcopy(recs), config(**kw))
    sch = build_schedule(copy.deepcopy(recs), default_gap_ns=1_000_000)
    late = {s.idx: s.arrival_ns for s in sch.requests if s.rid == "b"}
    batches, *_ = _driven(copy.deepcopy(recs), config(**kw), horizon_at=late)
    assert _payloads(batches) == _payloads(known.batches)
    assert [b.time_ns for b in batches] == [b.time_ns for b in known.batches]


def test_start_twice_is_refused():
    recs = _lanes()
    cfg = config()
    sch = build_schedule(recs, default_gap_ns=1_000_000)
    sched = Scheduler(cfg, sch, wire_hasher())
    sched.start()
    try:
        sched.start()
    except ReplayError as exc:
        assert "already started" in str(exc)
    else:
        raise AssertionError("second start accepted")


def _notes(path) -> list[Annotation]:
    return [
        r
        for r in BundleReader(path).records()
        if isinstance(r, Annotation) and r.kind == "visibility"
    ]


def test_fleet_bundles_carry_each_ranks_visibility_notes(tmp_path):
    recs = two_rank_records()
    _write_source(tmp_path / "src", recs, 2)
    res = simulate_fleet([load_worker(tmp_path / "src")], "recorded")
    (path,) = write_fleet_bundles(tmp_path / "sim", res)
    notes = _notes(path)
    stored_frames = {(f.endpoint, f.seq) for f in BundleReader(path).events()}
    by_ep = {0: 0, 1: 0}
    for n in notes:
        ep = n.data["endpoint"]
        by_ep[ep] += 1
        assert (ep, n.data["seq"]) in stored_frames
        assert len(n.data["computed_pass"]) == len(n.data["computed_ns"]) > 0
        assert all(c <= n.recv_ns for c in n.data["computed_ns"])
    assert by_ep[0] > 0 and by_ep[1] > 0
    # --no-visibility: none
    off = simulate_fleet([load_worker(tmp_path / "src", {"track_visibility": False})])
    (path_off,) = write_fleet_bundles(tmp_path / "sim-off", off)
    assert _notes(path_off) == []


def test_single_rank_replay_is_a_fleet_of_one(tmp_path, monkeypatch):
    recs = _lanes()
    _write_source(tmp_path / "src", recs, 1)
    ranks_run: list[int] = []
    fleet_run = Fleet.run

    def counted(self, progress=None):
        ranks_run.append(len(self.slots))
        return fleet_run(self, progress)

    monkeypatch.setattr(Fleet, "run", counted)
    replay_bundle(tmp_path / "src", tmp_path / "single")
    assert ranks_run == [1]  # the one driver, on one rank
    res = simulate_fleet([load_worker(tmp_path / "src")], "recorded")
    (path,) = write_fleet_bundles(tmp_path / "fleet", res)
    single, fleet = BundleReader(tmp_path / "single"), BundleReader(path)
    enc = msgspec.msgpack.encode
    frames = [enc(f) for f in single.events()]
    assert frames and [enc(f) for f in fleet.events()] == frames
    assert _notes(path) and [enc(n) for n in _notes(path)] == [
        enc(n) for n in _notes(tmp_path / "single")
    ]
    fleet_recs = fleet.requests()
    assert all(r.meta_info.pop("dp_rank") == 0 for r in fleet_recs)
    assert [enc(r) for r in fleet_recs] == [enc(r) for r in single.requests()]
    # the headers differ exactly in what names the single rank / the fleet
    sh, fh = single.header, fleet.header
    assert [(e.id, e.url, e.dp_rank) for e in sh.endpoints] == [(0, "sim://", 0)]
    assert [(e.id, e.url, e.dp_rank) for e in fh.endpoints] == [(0, "sim://rank0", 0)]
    assert sh.command == ["kvcadence", "replay"]
    assert fh.command == ["kvcadence", "replay", "--route", "recorded"]
    extra = {k: fh.sim_config.pop(k) for k in ("route", "dp_size", "ranks")}
    assert extra["route"] == "recorded" and extra["dp_size"] == 1
    assert extra["ranks"] == [sh.sim_config] and fh.sim_config == sh.sim_config
    same = ("endpoints", "command", "sim_config")
    assert msgspec.structs.replace(fh, **{k: getattr(sh, k) for k in same}) == sh
