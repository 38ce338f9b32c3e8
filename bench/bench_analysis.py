"""Analysis benchmark: ingest MB/s and report wall time on a synthetic bundle.

Writes a synthetic SGLang-like bundle (BundleWriter + wire.encode_batch; page size 16, each
request a prefill store, a finish store and, later, removals; 4 events per message), then
measures in the same run:

* baseline: read every EventFrame (BundleReader.events) + untyped msgpack decode of each
  payload -- the floor any ingest must pay;
* ingest:  kvcadence.analysis.ingest (decode + column building + Parquet), in MB/s of
  segment bytes, and its ratio to the baseline;
* report:  kvcadence.analysis.report.make_report on the ingested bundle (Parquet cache warm,
  so the number excludes ingest), with DuckDB/Polars at one thread.

The whole process is pinned to one CPU (``sched_setaffinity``) so "one core" is literal.

Goals: ingest >= 50 MB/s; report on 1M events <= 10 s on one core.
Usage: ``python bench/bench_analysis.py [--events N] [--dir DIR [--reuse]] [--skip-report]
[--quick] [--json PATH]`` (default 1M events, the size the goals name; ``--quick``: 20k;
``--json``: the figures for ``bench/run``, see ``bench/common.py``; the report goal is
attached only at >= 1M events).
"""

from __future__ import annotations

import argparse
import os
import random
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from common import add_output_args, figure, goal, write_results

os.environ.setdefault("KVCADENCE_THREADS", "1")
os.environ.setdefault("POLARS_MAX_THREADS", "1")
os.environ.setdefault("OMP_NUM_THREADS", "1")


def pin_one_core() -> str:
    """Run the whole benchmark on one CPU (Linux); say which."""
    if not hasattr(os, "sched_setaffinity"):
        return "not pinned (no sched_setaffinity)"
    cpu = min(os.sched_getaffinity(0))
    os.sched_setaffinity(0, {cpu})
    return f"pinned to CPU {cpu}"


def build(path: Path, n_events: int, seed: int = 7) -> tuple[int, int]:
    """Write the synthetic bundle; return (events, requests)."""
    from kvcadence.format import wire
    from kvcadence.format.bundle import BundleWriter
    from kvcadence.format.schema import (
        BlockRemoved,
        BlockStored,
        EndpointInfo,
        Header,
        KVEventBatch,
        RequestRecord,
    )

    rng = random.Random(seed)
    ps = 16
    hdr = Header(
        1,
        0,
        "real",
        "bench",
        "0.5.23",
        {"version": "0.5.23", "page_size": ps, "max_total_num_tokens": 1 << 20},
        endpoints=[EndpointInfo(0, "tcp://127.0.0.1:5557", None, 0, "")],
    )
    t = 1_800_000_000_000_000_000
    seq = 0
    events: list = []
    resident: list[list[int]] = []
    n_ev = n_req = 0
    with BundleWriter(path, hdr) as w:

        def flush(force: bool = False) -> None:
            nonlocal seq, events, t
            while len(events) >= 4 or (force and events):
                batch, events = events[:4], events[4:]
                t += 2_000_000
                w.write_event(
                    endpoint=0,
                    seq=seq,
                    recv_ns=t,
                    topic="",
                    payload=wire.encode_batch(KVEventBatch(t / 1e9, batch, 0)),
                    via=0,
                    epoch=0,
                )
                seq += 1

        while n_ev < n_events:
            prompt = [rng.randrange(3, 30000) for _ in range(rng.randrange(32, 160))]
            out = [rng.randrange(3, 30000) for _ in range(rng.randrange(8, 64))]
            hs = wire.block_hashes(prompt + out[:-1], ps)
            pp = len(prompt) // ps
            send = t
            events.append(BlockStored(hs[:pp], None, prompt[: pp * ps], ps, None, "GPU"))
            n_ev += 1
            if len(hs) > pp:
                events.append(
                    BlockStored(
                        hs[pp:],
                        hs[pp - 1] if pp else None,
                        (prompt + out[:-1])[pp * ps : len(hs) * ps],
                        ps,
                        None,
                        "GPU",
                    )
                )
                n_ev += 1
            resident.append(hs)
            if len(resident) > 64:
                victim = resident.pop(0)
                events.append(BlockRemoved(victim[::-1], "GPU"))
                n_ev += 1
            flush()
            w.write(
                RequestRecord(
                    rid=f"r{n_req}",
                    input_ids=prompt,
                    output_ids=out,
                    send_ns=send,
                    finish_ns=t + 1_000_000,
                    cached_tokens=0,
                )
            )
            n_req += 1
        flush(force=True)
    return n_ev, n_req


class Timed:
    """Wall and CPU seconds of one call (CPU = this process, all threads; on a shared box
    the CPU time is what the same run takes on an idle core)."""

    def __init__(self, wall: float, cpu: float) -> None:
        self.wall, self.cpu = wall, cpu

    def __str__(self) -> str:
        return f"{self.wall:.2f} s wall, {self.cpu:.2f} s cpu"


def timed(fn: Any) -> Timed:
    t0, c0 = time.perf_counter(), time.process_time()
    fn()
    return Timed(time.perf_counter() - t0, time.process_time() - c0)


def seg_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.glob("seg-*.kvcb"))


def baseline(path: Path) -> float:
    import msgspec

    from kvcadence.format.bundle import BundleReader, event_payload

    dec = msgspec.msgpack.Decoder()
    t0 = time.perf_counter()
    n = 0
    for fr in BundleReader(path).events():
        n += len(dec.decode(event_payload(fr))[1])
    return time.perf_counter() - t0


TITLE = "Analysis: ingest and report on a synthetic bundle"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--events", type=int, default=1_000_000)
    ap.add_argument("--dir", help="work directory (default: a temp dir, removed afterwards)")
    ap.add_argument(
        "--reuse",
        action="store_true",
        help="reuse DIR/bundle when it was written for the same --events (skips generation)",
    )
    ap.add_argument("--skip-report", action="store_true", help="measure ingest only")
    add_output_args(ap, "20k events")
    args = ap.parse_args(argv)
    if args.quick:
        args.events = 20_000
    print(f"one core: {pin_one_core()}; DuckDB/Polars/OpenMP threads = 1")
    from kvcadence.analysis import ingest, report

    work = Path(args.dir) if args.dir else Path(tempfile.mkdtemp(prefix="kvc-bench-"))
    try:
        b = work / "bundle"
        stamp = work / "bundle.events"
        t0 = time.perf_counter()
        if args.reuse and stamp.exists() and stamp.read_text().split()[0] == str(args.events):
            n_ev, n_req = (int(x) for x in stamp.read_text().split()[1:3])
        else:
            if b.exists():
                shutil.rmtree(b)
            n_ev, n_req = build(b, args.events)
            work.mkdir(parents=True, exist_ok=True)
            stamp.write_text(f"{args.events} {n_ev} {n_req}\n")
        gen_s = time.perf_counter() - t0
        size = seg_bytes(b)
        print(
            f"bundle: {n_ev} events, {n_req} requests, {size / 1e6:.1f} MB "
            f"(written in {gen_s:.1f} s)"
        )
        mb = size / 1e6
        import numpy  # noqa: F401  (imports are not throughput: load them before timing)
        import pyarrow.parquet  # noqa: F401

        base = timed(lambda: baseline(b))
        ing_t = timed(lambda: ingest.ingest(b, work / "pq", force=True))
        ing = ingest.ingest(b, work / "pq")
        print(f"baseline read + untyped decode: {base} = {mb / base.cpu:.1f} MB/cpu-s")
        print(
            f"ingest: {ing_t} = {mb / ing_t.wall:.1f} MB/s wall, {mb / ing_t.cpu:.1f} MB/cpu-s "
            f"({ing_t.cpu / base.cpu:.2f}x baseline cpu; goal >= 50 MB/s)"
        )
        figures = [
            figure(
                "ingest (decode + columns + Parquet), one core",
                mb / ing_t.cpu,
                "MB/cpu-s",
                baseline=mb / base.cpu,
                baseline_name="read every EventFrame + untyped msgpack decode",
                goal=goal("value", ">=", 50, ">= 50 MB/s"),
                note=f"{n_ev} events, {mb:.0f} MB",
            )
        ]
        params = {"events": n_ev, "requests": n_req, "bundle_mb": round(mb, 1)}
        if args.skip_report:
            write_results(args.json, "analysis", TITLE, figures, params)
            return 0
        for f in ing.dir.glob("request_pages-*.parquet"):
            f.unlink()  # the first report after ingest computes the request page hashes
        first = timed(
            lambda: report.make_report([str(b)], work / "report", cache_dirs=[str(ing.dir)])
        )
        again = timed(
            lambda: report.make_report([str(b)], work / "report", cache_dirs=[str(ing.dir)])
        )
        print(
            f"report, first after ingest (hashes request pages; includes importing polars, "
            f"duckdb, matplotlib): {first}; goal <= 10 s at 1M events on one core"
        )
        print(f"report again (page hashes cached): {again}")
        figures.append(
            figure(
                f"report on {n_ev} events (first after ingest), one core",
                first.cpu,
                "cpu-s",
                baseline=base.cpu,
                baseline_name="read + untyped decode of the same bundle",
                higher_is_better=False,
                goal=goal("value", "<=", 10, "<= 10 s at 1M events") if n_ev >= 1_000_000 else None,
                note="excludes ingest; includes importing polars/duckdb/matplotlib",
            )
        )
        write_results(args.json, "analysis", TITLE, figures, params)
    finally:
        if not args.dir:
            shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
