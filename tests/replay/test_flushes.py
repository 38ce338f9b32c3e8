"""Recorded ``/flush_cache`` replayed in request order (``replay.flushes``).

Synthetic captures of closed-loop lanes in phases separated by a flush, recorded the way
``drive --flush-at`` records them (the lanes wait until nothing is in flight, the worker
flushes, the lanes go on); the recorded worker is slower than the pass-time model, so the
recorded flush time falls, on the simulated clock, after the next phase has started. What a
correct replay gives is known exactly: each phase replayed alone from an empty cache, the
phases' streams joined by one ``AllBlocksCleared``. Checked:

* one flush, two flushes, and a DP capture (one clear per rank, each rank's stream; two
  flushes per rank under recorded, round-robin and cache-aware routing);
* the sim's clear lies after every request that finished before it and before every one that
  came after it (publish time and the blocks stored on either side);
* Removed counts are the phases' own (the old rule, the recorded time mapped onto the
  simulated clock, published the clear only once the next phase's requests were running,
  with more Removed events);
* the clears are read back from a bundle per rank, skipping each rank's startup clear; a
  requests-only capture falls back to the driver's ``flush_cache`` annotations;
* records that contradict themselves (a request before the flush whose predecessor comes
  after it) still flush once, when the rank would otherwise stop;
* an open-loop request after a flush the simulation reaches early arrives at its recorded
  offset from the simulated flush, not at its recorded time (single rank; DP 2 under every
  route).
"""

from __future__ import annotations

import copy
from pathlib import Path

import pytest

from kvcadence.format import wire
from kvcadence.format.bundle import BundleReader, BundleWriter, event_payload
from kvcadence.format.schema import (
    AllBlocksCleared,
    Annotation,
    BlockRemoved,
    BlockStored,
    EndpointInfo,
    Header,
)
from kvcadence.replay.fleet import simulate_fleet, write_fleet_bundles
from kvcadence.replay.flushes import RecordedFlush, recorded_flushes
from kvcadence.replay.radix import wire_hasher
from kvcadence.replay.schedule import build_schedule
from kvcadence.replay.scheduler import Scheduler
from kvcadence.replay.worker import WorkerInput, load_worker

from .helpers import MS, check_stream, config, decoded, req, run

T0_MS = 1_000_000.0  # the helpers' recorded clock origin (ms)


def phased(
    n_lanes: int,
    turns: int,
    phases: int,
    *,
    n_out: int = 20,
    dur_ms: float = 250.0,
    gap_ms: float = 20.0,
    rank_of_lane=None,
) -> tuple[list, list[int], list[list[str]]]:
    """Records of ``n_lanes`` lanes, ``turns`` turns per phase, a flush between phases.

    Each request is recorded taking ``dur_ms`` (the pass-time model makes it ~110 ms);
    after a phase the last request finished, 300 ms later the clear was received, 500 ms
    after that the lanes went on. Returns (records, flush receive times in ns, rids per
    phase)."""
    recs: list = []
    flushes: list[int] = []
    groups: list[list[str]] = []
    t = 0.0
    prompts = {
        lane: list(range(100, 160)) + [200 + 10 * lane + i for i in range(10)]
        for lane in range(n_lanes)
    }
    for ph in range(phases):
        group = []
        for turn in range(turns):
            for lane in range(n_lanes):
                arr = t + 3 * lane
                r = req(f"p{ph}-l{lane}-t{turn}", prompts[lane], n_out, lane=lane, arrival_ms=arr)
                r.meta_info["request_finished_ts"] = (T0_MS + arr + dur_ms) / 1e3
                if rank_of_lane is not None:
                    r.dp_rank = rank_of_lane(lane)
                recs.append(r)
                group.append(r.rid)
                prompts[lane] = prompts[lane] + list(r.output_ids) + [900 + turn]
            t += dur_ms + gap_ms + 3 * n_lanes
        groups.append(group)
        if ph < phases - 1:
            t += 300.0
            flushes.append(int((T0_MS + t) * MS))
            t += 500.0
    return recs, flushes, groups


def only(recs: list, rids: list[str]) -> list:
    keep = set(rids)
    return [copy.deepcopy(r) for r in recs if r.rid in keep]


def joined(parts: list[list[list]]) -> list[list]:
    """Phase streams (each from its own startup clear) joined by one clear each."""
    out = list(parts[0])
    for p in parts[1:]:
        assert p[0] == [AllBlocksCleared()]
        out += p
    return out


def clear_positions(stream: list[list]) -> list[int]:
    return [i for i, ev in enumerate(stream) if any(isinstance(e, AllBlocksCleared) for e in ev)]


def stored_before_clear(stream: list[list]) -> int:
    """BlockStored events published before the first mid-run clear."""
    return sum(
        isinstance(e, BlockStored) for ev in stream[: clear_positions(stream)[1]] for e in ev
    )


def removed(stream: list[list]) -> int:
    return sum(isinstance(e, BlockRemoved) for ev in stream for e in ev)


def old_rule(recs: list, cfg, flushes: list[int]) -> list[list]:
    """The replaced rule: each flush at its receive time mapped onto the simulated clock
    (still what a ``Scheduler`` does with the schedule's ``flush_times_ns`` and no plan)."""
    s = Scheduler(cfg, build_schedule(copy.deepcopy(recs), flush_abs_ns=flushes), wire_hasher())
    s.run()
    return [wire.decode_batch(b.payload).events for b in s.publisher.batches]


def check_order(result, flushes_sim_ns: list[int], groups: list[list[str]]) -> None:
    """Every request of phase k finished at or before the k-th clear and every request of
    phase k + 1 arrived at or after it; the pages each one stored lie on its side."""
    by = {r.rid: r for r in result.requests}
    anchor = result.schedule.anchor_ns
    for k, t_clear in enumerate(flushes_sim_ns):
        assert max(by[rid].finish_ns for rid in groups[k]) - anchor <= t_clear
        assert min(by[rid].send_ns for rid in groups[k + 1]) - anchor >= t_clear
    stream = decoded(result)
    cuts = clear_positions(stream)[1:]
    for k, cut in enumerate(cuts):
        before = {
            h
            for ev in stream[:cut]
            for e in ev
            if isinstance(e, BlockStored)
            for h in e.block_hashes
        }
        after = {
            h
            for ev in stream[cut:]
            for e in ev
            if isinstance(e, BlockStored)
            for h in e.block_hashes
        }
        for rid in groups[k]:
            prompt = by[rid].input_ids
            assert set(wire.block_hashes(prompt, 1)) <= before, rid
        for rid in groups[k + 1]:
            # the cache was empty: every page of a later prompt was stored after the clear
            assert set(wire.block_hashes(by[rid].input_ids, 1)) <= after, rid


def test_one_flush_sits_between_the_requests_it_separated():
    recs, flushes, groups = phased(6, 3, 2)
    cfg = config(max_total_tokens=450)
    res = run(copy.deepcopy(recs), cfg, flush_abs_ns=flushes)
    stream = decoded(res)
    check_stream(res)
    assert res.stats.flushes == 1
    parts = [decoded(run(only(recs, g), cfg)) for g in groups]
    assert stream == joined(parts)
    sim_clear = [t for (why, _c, _p, t) in res.scheduler.publish_log if why == "flush"]
    check_order(res, sim_clear, groups)
    # timing: the clear came as long after the last request before it as recorded, each
    # lane's next turn as long after the clear as recorded (500 ms + its stagger)
    by = {r.rid: r for r in res.requests}
    anchor = res.schedule.anchor_ns
    last_before = max(by[rid].finish_ns for rid in groups[0]) - anchor
    rec_fin = max(r.meta_info["request_finished_ts"] for r in recs if r.rid in set(groups[0]))
    rec_delay = flushes[0] - round(rec_fin * 1e9)
    assert rec_delay == 323 * MS  # the last request's stagger and gap, then 300 ms
    assert sim_clear == [last_before + rec_delay]
    firsts = [by[f"p1-l{lane}-t0"].send_ns - anchor for lane in range(6)]
    assert firsts == [sim_clear[0] + (500 + 3 * lane) * MS for lane in range(6)]
    # the first prefill after the clear found nothing cached; later ones hit what the
    # second phase stored again
    after = [r for r in res.requests if r.rid in set(groups[1])]
    assert after[0].cached_tokens == 0 and max(r.cached_tokens for r in after) > 0
    assert [r.cached_tokens for r in after] == [
        r.cached_tokens for r in run(only(recs, groups[1]), cfg).requests
    ]
    # Removed events are the phases' own; the old rule flushed once the second phase had
    # stored its pages (the last of its requests were running) and published more of them
    assert removed(stream) == sum(removed(p) for p in parts)
    old = old_rule(recs, cfg, flushes)
    assert (
        stored_before_clear(old)
        > stored_before_clear(stream)
        == stored_before_clear(parts[0] + [[AllBlocksCleared()]])
    )
    assert removed(old) > removed(stream)


def test_two_flushes_in_order():
    recs, flushes, groups = phased(4, 3, 3)
    cfg = config(max_total_tokens=400)
    res = run(copy.deepcopy(recs), cfg, flush_abs_ns=flushes)
    check_stream(res)
    assert res.stats.flushes == 2
    stream = decoded(res)
    parts = [decoded(run(only(recs, g), cfg)) for g in groups]
    assert stream == joined(parts)
    sim_clears = [t for (why, _c, _p, t) in res.scheduler.publish_log if why == "flush"]
    assert len(sim_clears) == 2 and sim_clears[0] < sim_clears[1]
    check_order(res, sim_clears, groups)
    assert removed(stream) == sum(removed(p) for p in parts)
    old = old_rule(recs, cfg, flushes)
    assert clear_positions(old) != clear_positions(stream)


def with_open_loop_after(recs: list, flush_ns: int, after_ms: float, rank: int = 0) -> list:
    """``recs`` plus one open-loop request (no lane) recorded ``after_ms`` after the clear
    at ``flush_ns``, taking 250 ms like the others."""
    arr = (flush_ns / MS - T0_MS) + after_ms
    r = req("open", list(range(500, 540)), 20, arrival_ms=arr)
    r.meta_info["request_finished_ts"] = (T0_MS + arr + 250.0) / 1e3
    r.dp_rank = rank
    return [*copy.deepcopy(recs), r]


def test_open_loop_request_after_a_flush_reached_early_comes_at_its_offset_from_it():
    # the recorded worker was slower than the model: the simulation flushes well before
    # the recorded clear. The worker was idle at the flush, so the recorded timeline after
    # it starts at the simulated flush: the open-loop request arrives 650 ms after it, as
    # it was recorded 650 ms after the clear -- not at its recorded time, much later (the
    # old rule), when the lanes' next turns (anchored the same way) are long over
    recs, flushes, groups = phased(4, 3, 2)
    recs = with_open_loop_after(recs, flushes[0], 650.0)
    res = run(recs, config(max_total_tokens=400), flush_abs_ns=flushes)
    check_stream(res)
    (t_clear,) = [t for (why, _c, _p, t) in res.scheduler.publish_log if why == "flush"]
    by = {r.rid: r for r in res.requests}
    anchor = res.schedule.anchor_ns
    recorded_at = round(recs[-1].meta_info["request_received_ts"] * 1e9) - anchor
    assert t_clear + 650 * MS < recorded_at - 200 * MS  # the flush was reached early
    assert by["open"].send_ns - anchor == t_clear + 650 * MS
    assert by["p1-l0-t0"].send_ns - anchor == t_clear + 500 * MS
    check_order(res, [t_clear], [groups[0], [*groups[1], "open"]])


@pytest.mark.parametrize("route", ["recorded", "round_robin", "cache_aware"])
def test_dp_open_loop_request_after_a_flush_comes_at_its_offset_under_every_route(route):
    # the same on a DP worker: the request is held in its recorded rank's plan (a dynamic
    # router routes it only when it arrives), then on the rank it is routed to
    recs, flushes, groups = phased(4, 3, 2, rank_of_lane=lambda lane: lane % 2)
    recs = with_open_loop_after(recs, flushes[0], 650.0, rank=1)
    w = _dp_worker(recs, flushes, [0, 1])
    res = simulate_fleet([w], route)
    clears = [t for sl in res.slots for (why, _c, _p, t) in sl.sched.publish_log if why == "flush"]
    assert len(clears) == 2
    by = {r.rid: r for r in res.requests}
    recorded_at = round(recs[-1].meta_info["request_received_ts"] * 1e9) - res.anchor_ns
    assert max(clears) + 650 * MS < recorded_at - 200 * MS
    assert by["open"].send_ns - res.anchor_ns in {t + 650 * MS for t in clears}


def _dp_worker(recs: list, flushes: list[int], ranks: list[int | None] | None = None):
    flush_abs = [f for f in flushes for _ in range(2)] if ranks is not None else flushes
    return WorkerInput(
        "w", recs, [config(max_total_tokens=400) for _ in range(2)], flush_abs, flush_ranks=ranks
    )


def test_dp_flush_per_rank_sits_between_that_ranks_requests():
    recs, flushes, groups = phased(4, 3, 2, rank_of_lane=lambda lane: lane % 2)
    # each rank's stream carried its own clear, rank 1's a little later
    per_rank = [flushes[0], flushes[0] + 2 * MS]
    w = WorkerInput(
        "w",
        copy.deepcopy(recs),
        [config(max_total_tokens=400) for _ in range(2)],
        per_rank,
        flush_ranks=[0, 1],
    )
    res = simulate_fleet([w], "recorded", pace="model")
    ref = [
        simulate_fleet(
            [WorkerInput("w", only(recs, g), [config(max_total_tokens=400) for _ in range(2)])],
            "recorded",
            pace="model",
        )
        for g in groups
    ]
    by = {r.rid: r for r in res.requests}
    for rank in (0, 1):
        sched = res.slots[rank].sched
        assert sched.stats.flushes == 1
        stream = [wire.decode_batch(b.payload).events for b in sched.publisher.batches]
        parts = [
            [wire.decode_batch(b.payload).events for b in r.slots[rank].publisher.batches]
            for r in ref
        ]
        assert stream == joined(parts)
        assert removed(stream) == sum(removed(p) for p in parts)
        (t_clear,) = [t for (why, _c, _p, t) in sched.publish_log if why == "flush"]
        # after every request that finished before it (on either rank), before every
        # request of its rank that came after it
        assert max(by[rid].finish_ns for rid in groups[0]) - res.anchor_ns <= t_clear
        mine = [rid for rid in groups[1] if by[rid].dp_rank == rank]
        assert mine and min(by[rid].send_ns for rid in mine) - res.anchor_ns >= t_clear


def test_flushes_read_back_per_rank_and_replayed_from_a_bundle(tmp_path: Path):
    recs, flushes, groups = phased(4, 2, 2, rank_of_lane=lambda lane: lane % 2)
    w = WorkerInput(
        "w",
        copy.deepcopy(recs),
        [config(max_total_tokens=400) for _ in range(2)],
        [flushes[0], flushes[0]],
        flush_ranks=[0, 1],
    )
    res = simulate_fleet([w], "recorded", pace="model")
    (path,) = write_fleet_bundles(tmp_path / "sim", res)
    got = recorded_flushes(BundleReader(path))
    want = []
    for rank in (0, 1):
        pub = res.slots[rank].publisher
        for b in pub.batches[1:]:
            if wire.decode_batch(b.payload).events == [AllBlocksCleared()]:
                want.append(RecordedFlush(b.time_ns, rank, b.seq))
    assert len(want) == 2 and sorted(got, key=lambda f: f.rank or 0) == want
    # the sim bundle replayed as a capture: one clear per rank, between the phases again
    again = simulate_fleet([load_worker(path)], "recorded", pace="model")
    by = {r.rid: r for r in again.requests}
    for rank in (0, 1):
        sched = again.slots[rank].sched
        (t_clear,) = [t for (why, _c, _p, t) in sched.publish_log if why == "flush"]
        assert max(by[rid].finish_ns for rid in groups[0]) - again.anchor_ns <= t_clear
        assert min(by[rid].send_ns for rid in groups[1]) - again.anchor_ns >= t_clear


def test_requests_only_capture_uses_the_drivers_flush_annotation(tmp_path: Path):
    recs, flushes, groups = phased(2, 2, 2)
    eps = [EndpointInfo(0, "tcp://127.0.0.1:5557", None, 0, "kv-events")]
    info = {"page_size": 1, "max_total_num_tokens": 400, "version": "0.5.23"}
    header = Header(1, 0, "real", "test", "0.5.23", info, None, [], 0, eps)
    t = flushes[0]
    with BundleWriter(tmp_path / "b", header) as bw:
        for r in recs:
            bw.write(r)
        for kind, ok, at in (("flush_cache", False, t - 50 * MS), ("flush_cache", True, t)):
            data = {"ok": ok, "send_ns": at - MS, "finish_ns": at}
            bw.write(Annotation(kind=kind, recv_ns=at - MS, data=data))
        bw.close()
    assert recorded_flushes(BundleReader(tmp_path / "b")) == [RecordedFlush(t)]
    w = load_worker(tmp_path / "b")
    assert w.flush_abs_ns == [t] and w.flush_ranks == [None]


def test_contradictory_records_still_flush_once():
    # b follows a on its lane, yet b is recorded finished before the flush and a after it:
    # a waits for the flush, the flush for b, b for a -- performed when nothing else can run
    a = req("a", list(range(3, 40)), 5, lane=0, arrival_ms=0)
    a.meta_info["request_finished_ts"] = (T0_MS + 900) / 1e3
    b = req("b", list(range(3, 40)) + list(a.output_ids) + [7], 5, lane=0, arrival_ms=10)
    b.meta_info["request_finished_ts"] = (T0_MS + 20) / 1e3
    flush = int((T0_MS + 500) * MS)
    res = run([copy.deepcopy(a), copy.deepcopy(b)], config(), flush_abs_ns=[flush])
    assert res.stats.flushes == 1
    assert all(r.completion_tokens == 5 for r in res.requests)
    check_stream(res)
    w = WorkerInput("w", [copy.deepcopy(a), copy.deepcopy(b)], [config()], [flush])
    fl = simulate_fleet([w], "recorded")
    assert fl.slots[0].sched.stats.flushes == 1
    assert all(r.completion_tokens == 5 for r in fl.requests)


def test_replay_cli_reads_the_clear_of_a_single_rank_bundle(tmp_path: Path):
    from kvcadence.cli import main
    from kvcadence.replay.simulator import write_sim_bundle

    recs, flushes, groups = phased(3, 2, 2)
    src = tmp_path / "src"
    write_sim_bundle(src, run(copy.deepcopy(recs), config(), flush_abs_ns=flushes), None)
    (clear,) = recorded_flushes(BundleReader(src))
    assert clear.rank == 0 and clear.seq is not None and clear.seq > 0
    assert main(["replay", str(src), "--out", str(tmp_path / "sim")]) == 0
    reader = BundleReader(tmp_path / "sim")
    frames = list(reader.events())
    clears = [
        f
        for f in frames
        if wire.decode_batch(event_payload(f)).events == [AllBlocksCleared()] and f.seq > 0
    ]
    assert len(clears) == 1
    by = {r.rid: r for r in reader.requests()}
    assert max(by[rid].finish_ns for rid in groups[0]) <= clears[0].recv_ns
    assert min(by[rid].send_ns for rid in groups[1]) >= clears[0].recv_ns


def test_a_clear_recovered_late_is_placed_at_its_publish_time(tmp_path: Path):
    from kvcadence.format.schema import VIA_LIVE, VIA_REPLAY, KVEventBatch

    eps = [EndpointInfo(0, "tcp://127.0.0.1:5557", None, 0, "kv-events")]
    header = Header(1, 0, "real", "test", "0.5.23", {"page_size": 1}, None, [], 0, eps)
    store = BlockStored(
        block_hashes=[11], parent_block_hash=None, token_ids=[5], block_size=1, lora_id=None
    )
    base = 1_700_000_000 * 10**9  # publish times (server clock); received 3 ms later
    frames = [  # (seq, publish ns, received ns, events, via)
        (0, base, base + 3 * MS, [AllBlocksCleared()], VIA_LIVE),
        (1, base + 100 * MS, base + 103 * MS, [store], VIA_LIVE),
        (3, base + 900 * MS, base + 903 * MS, [store], VIA_LIVE),
        # seq 2 was missed live and fetched from the replay socket after seq 3 came
        (2, base + 500 * MS, base + 950 * MS, [AllBlocksCleared()], VIA_REPLAY),
        (4, base + 1200 * MS, base + 1203 * MS, [AllBlocksCleared()], VIA_LIVE),
    ]
    with BundleWriter(tmp_path / "b", header) as bw:
        for seq, pub, recv, events, via in frames:
            payload = wire.encode_batch(KVEventBatch(pub / 1e9, events, 0))
            bw.write_event(
                endpoint=0, seq=seq, recv_ns=recv, topic="kv-events", payload=payload, via=via,
                epoch=0,
            )  # fmt: skip
        bw.close()
    got = recorded_flushes(BundleReader(tmp_path / "b"))
    assert [(f.seq, f.rank) for f in got] == [(2, 0), (4, 0)]
    # the recovered clear: its publish time + the live messages' 3 ms; the live one as received
    assert got[0].recv_ns == pytest.approx(base + 503 * MS, abs=1000)
    assert got[1].recv_ns == base + 1203 * MS


@pytest.mark.parametrize("route", ["recorded", "round_robin", "cache_aware"])
def test_dp_two_flushes_per_rank_under_every_route(route):
    recs, flushes, groups = phased(4, 3, 3, rank_of_lane=lambda lane: lane % 2)
    w = WorkerInput(
        "w",
        copy.deepcopy(recs),
        [config(max_total_tokens=400) for _ in range(2)],
        [flushes[0], flushes[0] + MS, flushes[1], flushes[1] + MS],
        flush_ranks=[0, 1, 0, 1],
    )
    res = simulate_fleet([w], route)  # default pace (recorded for recorded routing)
    by = {r.rid: r for r in res.requests}
    served = {r.rid: s for r, s in zip(res.requests, res.serving, strict=True)}
    assert all(r.completion_tokens == 20 for r in res.requests)
    for sl in res.slots:
        clears = [t for (why, _c, _p, t) in sl.sched.publish_log if why == "flush"]
        assert len(clears) == 2 and sl.sched.stats.flushes == 2
        for k, t_clear in enumerate(clears):
            assert max(by[rid].finish_ns for rid in groups[k]) - res.anchor_ns <= t_clear
            mine = [rid for rid in groups[k + 1] if served[rid] == sl.index]
            assert all(by[rid].send_ns - res.anchor_ns >= t_clear for rid in mine)


def _scan_decoding_every_frame(reader: BundleReader) -> list[RecordedFlush]:
    """The oracle: every record read, every event payload decoded whole."""
    from kvcadence.format.schema import EventFrame
    from kvcadence.replay.flushes import FlushScan

    scan = FlushScan(reader.header)
    for rec in reader.records():
        if isinstance(rec, EventFrame):
            try:
                batch = wire.decode_batch(event_payload(rec))
            except Exception:
                continue
            scan.frame(rec, batch.ts, batch.events)
        elif isinstance(rec, Annotation):
            scan.note(rec)
    return scan.result()


_DATA = Path(__file__).parent / "data"
_REAL = sorted(
    [*(_DATA / "corpus").glob("*/bundle"), *_DATA.glob("sglang-0.5.23-dp2-*")],
    key=str,
)


@pytest.mark.parametrize(
    "src", _REAL, ids=lambda p: p.parent.name if p.name == "bundle" else p.name
)
def test_recorded_flushes_of_real_captures_equal_decoding_every_frame(src, monkeypatch):
    """The scan steps over request records and decodes whole only the payloads that carry
    the clear's tag bytes: on every real capture it finds what decoding everything finds."""
    want = _scan_decoding_every_frame(BundleReader(src))
    tagged = sum(b"AllBlocksCleared" in event_payload(f) for f in BundleReader(src).events())
    whole = []
    decode = wire.decode_batch
    monkeypatch.setattr(wire, "decode_batch", lambda p: whole.append(1) or decode(p))
    assert recorded_flushes(BundleReader(src)) == want
    assert len(whole) == tagged
    # a capture holding a publisher's seq 0 holds its start-up clear (a late attach whose
    # replay ring no longer had it, ``p16-attach-late-ring4-http-clients``, holds none)
    if any(f.seq == 0 for f in BundleReader(src).events()):
        assert tagged > 0


def test_recorded_flushes_reads_array_shaped_and_odd_payloads(tmp_path):
    """A 0.5.5-0.5.17 array-shaped clear is found; a payload whose events are not valid but
    that holds no clear's tag only times the endpoint; one whose ts is not a number is
    decoded whole (and, malformed, is not a flush)."""
    import msgspec

    from kvcadence.format.schema import VIA_LIVE, KVEventBatch

    eps = [EndpointInfo(0, "tcp://127.0.0.1:5557", None, 0, "kv-events")]
    header = Header(1, 0, "real", "test", "0.5.23", {"page_size": 1}, None, [], 0, eps)
    base = 1_700_000_000 * 10**9
    arr_clear = msgspec.msgpack.encode([base / 1e9 + 0.2, [["AllBlocksCleared"]], 0])
    odd_events = msgspec.msgpack.encode([base / 1e9 + 0.3, [["NoSuchEvent", 1]], 0])
    bad_ts = msgspec.msgpack.encode(["x", [["AllBlocksCleared"]], 0])
    store = wire.encode_batch(KVEventBatch(base / 1e9, [BlockStored([1], None, [5], 1, None)], 0))
    frames = [(0, store), (1, arr_clear), (2, odd_events), (3, bad_ts)]
    with BundleWriter(tmp_path / "b", header) as bw:
        for seq, payload in frames:
            bw.write_event(
                endpoint=0, seq=seq, recv_ns=base + (seq + 1) * MS, topic="kv-events",
                payload=payload, via=VIA_LIVE, epoch=0,
            )  # fmt: skip
    got = recorded_flushes(BundleReader(tmp_path / "b"))
    assert [(f.seq, f.recv_ns) for f in got] == [(1, base + 2 * MS)]
    assert got == _scan_decoding_every_frame(BundleReader(tmp_path / "b"))


def test_a_request_finished_a_few_ms_around_a_clear_is_before_it(tmp_path):
    """``data/flush-clock-noise`` (a real capture, see its README): each trial's last
    request finished 6 ms before the next clear, 1 ms after it once the events were moved
    by the 7 ms clock offset read from the stores. Received before the clear and finished
    within ``FLUSH_FINISH_SLACK_NS`` after it, it is over before the flush, and the replay
    has the worker's events in the worker's order (it flushed before ``c`` and evicted the
    previous trial's ``c`` instead)."""
    from kvcadence.cli import main
    from kvcadence.format import wire
    from kvcadence.format.schema import AllBlocksCleared, BlockRemoved, BlockStored

    src = Path(__file__).parent / "data" / "flush-clock-noise" / "bundle"

    def shape(path):
        out = []
        for f in BundleReader(path).events():
            for e in wire.decode_batch(f.payload).events:
                if isinstance(e, AllBlocksCleared):
                    out.append("clear")
                elif isinstance(e, (BlockStored, BlockRemoved)):
                    out.append(f"{type(e).__name__[5]}{len(e.block_hashes)}")
        return out

    sim = tmp_path / "sim"
    assert main(["replay", str(src), "--out", str(sim), "--quiet"]) == 0
    trial = ["S4", "S4", "R4", "S6"]
    assert shape(src)[1:] == ["clear", *trial] * 4 == shape(sim)[1:]
