"""Benchmark of the bundle format: write, envelope-only read and full-decode read.

Writes N event frames (~700-byte realistic SGLang 0.5.23 payloads) plus some request
records, then reads them back three ways, each reported in MB/s of bundle bytes and as a ratio
to a baseline measured in the same run on the same payloads:

* write            vs raw ``file.write`` of the bare payloads (no framing, no CRC)
* envelope read    vs raw file read + ``msgspec.msgpack.decode`` (untyped) of each payload
* full decode      same baseline; records() + ``wire.decode_batch`` on every payload

Goals (one core): envelope read >= 150 MB/s, full decode >= 50 MB/s. Nothing decoded is kept
(docs/format.md: keeping hundreds of thousands of structs with lists wakes the cyclic
GC and costs 3-4x), so the numbers are steady-state throughput.

    .venv/bin/python bench/bench_bundle.py [--frames 200000] [--requests 2000] [--quick]
        [--json PATH]

``--quick``: 20,000 frames and 200 requests; ``--json``: the figures for ``bench/run`` (see
``bench/common.py``).
"""

from __future__ import annotations

import argparse
import os
import random
import shutil
import tempfile
import time
from pathlib import Path

import msgspec
from common import add_output_args, figure, goal, write_results

from kvcadence.format import wire
from kvcadence.format.bundle import BundleReader, BundleWriter, list_segments
from kvcadence.format.schema import (
    VIA_LIVE,
    BlockRemoved,
    BlockStored,
    EventFrame,
    Header,
    KVEventBatch,
    RequestRecord,
)


def make_payloads(n_distinct: int, rng: random.Random) -> list[bytes]:
    """Realistic batches: a BlockStored of ~50 pages (page size 1), sometimes a removal."""
    out = []
    for _ in range(n_distinct):
        n = rng.randint(38, 62)
        events: list[BlockStored | BlockRemoved] = []
        if rng.random() < 0.3:
            events.append(
                BlockRemoved(block_hashes=[rng.getrandbits(63) for _ in range(8)], medium="GPU")
            )
        events.append(
            BlockStored(
                block_hashes=[rng.getrandbits(64) - (1 << 63) for _ in range(n)],
                parent_block_hash=rng.getrandbits(63),
                token_ids=[rng.randint(3, 32000) for _ in range(n)],
                block_size=1,
                lora_id=None,
                medium="GPU",
            )
        )
        out.append(msgspec.msgpack.encode(KVEventBatch(time.time(), events, 0)))
    return out


def bundle_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in list_segments(path))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--frames", type=int, default=200_000)
    ap.add_argument("--requests", type=int, default=2_000)
    ap.add_argument("--dir", default=None, help="scratch directory (default: a temp dir)")
    add_output_args(ap, "20,000 frames and 200 requests (a smoke run)")
    args = ap.parse_args()
    if args.quick:
        args.frames, args.requests = 20_000, 200

    rng = random.Random(7)
    distinct = make_payloads(1000, rng)
    payloads = [distinct[i % len(distinct)] for i in range(args.frames)]
    avg = sum(map(len, payloads)) / len(payloads)
    reqs = [
        RequestRecord(
            rid=f"r{i}",
            input_ids=[rng.randint(3, 32000) for _ in range(400)],
            output_ids=[rng.randint(3, 32000) for _ in range(40)],
            send_ns=i,
            finish_ns=i + 1,
            lane=i % 4,
        )
        for i in range(args.requests)
    ]
    scratch = Path(args.dir or tempfile.mkdtemp(prefix="kvcb-bench-"))
    scratch.mkdir(parents=True, exist_ok=True)
    raw_path = scratch / "raw.bin"
    bpath = scratch / "bundle"
    try:
        # baseline write: the bare payload bytes
        t = time.perf_counter()
        with open(raw_path, "wb", buffering=1 << 20) as f:
            for p in payloads:
                f.write(p)
            f.flush()
            os.fsync(f.fileno())
        base_write = time.perf_counter() - t
        raw_mb = raw_path.stat().st_size / 1e6

        # bundle write
        t = time.perf_counter()
        with BundleWriter(bpath, Header(1, 0, "real", "bench")) as w:
            every = max(1, args.frames // max(1, args.requests))
            ri = 0
            for i, p in enumerate(payloads):
                w.write_event(
                    endpoint=0, seq=i, recv_ns=i, topic="kv", payload=p, via=VIA_LIVE, epoch=0
                )
                if i % every == 0 and ri < len(reqs):
                    w.write(reqs[ri])
                    ri += 1
        t_write = time.perf_counter() - t
        mb = bundle_bytes(bpath) / 1e6

        # baseline read: raw file read + untyped msgspec decode of each payload
        t = time.perf_counter()
        data = raw_path.read_bytes()
        mv = memoryview(data)
        dec = msgspec.msgpack.Decoder()
        off = 0
        for p in payloads:
            n = len(p)
            dec.decode(mv[off : off + n])
            off += n
        base_read = time.perf_counter() - t
        del mv, data

        # envelope-only read (payloads stay Raw)
        t = time.perf_counter()
        n_rec = 0
        for _ in BundleReader(bpath).records():
            n_rec += 1
        t_env = time.perf_counter() - t

        # events-only envelope read (requests skipped without decoding)
        t = time.perf_counter()
        n_ev = 0
        for _ in BundleReader(bpath).events():
            n_ev += 1
        t_events = time.perf_counter() - t

        # full decode: every record + wire.decode_batch of every payload
        t = time.perf_counter()
        decode = wire.decode_batch
        n_batches = 0
        for rec in BundleReader(bpath).records():
            if type(rec) is EventFrame:
                decode(memoryview(rec.payload))
                n_batches += 1
        t_full = time.perf_counter() - t
    finally:
        if args.dir is None:
            shutil.rmtree(scratch, ignore_errors=True)

    assert n_ev == args.frames and n_batches == args.frames
    base_w = raw_mb / base_write
    base_r = raw_mb / base_read
    rows = [
        ("baseline raw write", raw_mb / base_write, base_w, "bare payloads, MB of payload"),
        ("bundle write", mb / t_write, base_w, "frames + CRC + requests"),
        ("baseline read+untyped decode", base_r, base_r, "bare payloads"),
        ("envelope read records()", mb / t_env, base_r, f"{n_rec:,} records, goal >= 150"),
        ("envelope read events()", mb / t_events, base_r, f"{n_ev:,} events"),
        ("full decode", mb / t_full, base_r, "records() + wire.decode_batch, goal >= 50"),
    ]
    print(
        f"{args.frames:,} event frames (avg payload {avg:.0f} B) + {args.requests:,} requests; "
        f"bundle {mb:.1f} MB, raw payloads {raw_mb:.1f} MB"
    )
    print(f"{'path':<30} {'MB/s':>8} {'vs baseline':>12}  note")
    for name, rate, base, note in rows:
        print(f"{name:<30} {rate:8.1f} {rate / base:11.2f}x  {note}")
    raw_w, raw_r = "raw file.write of the bare payloads", "raw read + untyped msgpack decode"
    figs = [
        figure("bundle write", mb / t_write, "MB/s", baseline=base_w, baseline_name=raw_w),
        figure(
            "envelope read, records()",
            mb / t_env,
            "MB/s",
            baseline=base_r,
            baseline_name=raw_r,
            goal=goal("value", ">=", 150, ">= 150 MB/s on one core"),
        ),
        figure(
            "envelope read, events()", mb / t_events, "MB/s", baseline=base_r, baseline_name=raw_r
        ),  # fmt: skip
        figure(
            "full decode, records() + wire.decode_batch",
            mb / t_full,
            "MB/s",
            baseline=base_r,
            baseline_name=raw_r,
            goal=goal("value", ">=", 50, ">= 50 MB/s on one core"),
        ),
    ]
    write_results(
        args.json,
        "bundle",
        "Bundle write and read throughput (kvcadence.format.bundle)",
        figs,
        {"frames": args.frames, "requests": args.requests, "avg_payload_bytes": round(avg)},
        ["MB/s of bundle bytes (baselines: MB of bare payload bytes); one pass each"],
    )


if __name__ == "__main__":
    main()
