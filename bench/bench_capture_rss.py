"""Capture memory benchmark: peak RSS of ``kvcadence capture`` over a long stream, time
compressed.

The scale question: does the capture recorder's memory stay flat over hours of a live
worker's KV events (5,000 messages/s, i.e. 18M messages an hour)? Each point is one fresh
``kvcadence capture`` child (the real CLI: SUB socket, seq tracker, recorder, bundle writer
with segment rotation, ``--segment-mb``); its peak RSS is the child's ``ru_maxrss`` from
``os.wait4``. This process is the worker: the test publisher of ``kvcadence.testing`` (PUB +
replay ROUTER on loopback) sending SGLang 0.5.23 batches (a BlockStored of 8-64 pages with
``--page-size`` token ids a page, by default 1 like SGLang's; 30 % of them after a
BlockRemoved; a pool of 512 distinct payloads) as fast as the recorder keeps up: at most
``--window`` messages ahead of what the recorder has written to disk, so the SUB queue never
grows and the time compression never shows up as memory. Closed segments (every one but the newest) are checked while the stream
runs -- every frame's CRC, the event frames' seqs 0, 1, 2, ... in order, no ``Gap`` -- and
deleted, so the disk holds a few segments whatever the stream's length; the last one is
checked after the capture stopped (its ``Trailer``: 0 gaps).

Points (the first is the baseline of the others; the goal: RSS(long) <= 1.2 x RSS(short)):

* a floor: ``--floor-messages`` (1,000), the capture process with next to no stream;
* 300,000 messages (1 minute at 5k msg/s) and 3,000,000 (10 minutes); ``--full`` adds
  18,000,000 (1 hour). ``--messages N ...`` replaces them.

Figures: peak RSS of each point (against the floor, then against the first point), recorded
messages/s of the longest (against the first: no slowdown over the hours) and messages lost
per point (sent - recorded in seq order; goal 0). The RSS sampled from ``/proc`` at each
tenth of a stream goes in the note (and, for a stream of 1M messages or more, on stdout as
it is sampled). Bundles are written under ``--dir`` (default: a temporary directory) and
removed.

    .venv/bin/python bench/bench_capture_rss.py [--quick] [--full] [--messages N ...]
        [--page-size 1] [--segment-mb 64] [--window 8000] [--dir DIR] [--json PATH]

``--quick``: floor 1,000, points 20,000 / 100,000 (a smoke run).

Measured on 2026-12-01 (2 cores shared with other work, load average 8-25): the default
points, 3 runs: 137.6 MB at 1 min, 147.1 MB at 10 min (1.07x; 1.04-1.13), 0 lost; ``--full``
once (300,000 and 18,000,000 messages, 38 min): 140.0 MB at 1 min, 165.8 MB at 1 h (1.18x;
the RSS sampled at each tenth of the hour stayed within 130-148 MB), 8,258 msg/s recorded,
0 of 18M lost, 198 segments (12.7 GB) checked. Before ``capture.backlog`` bounded the stats
decode unconditionally, one run with ``--page-size 16`` on the loaded machine grew without a
plateau (321 MB at 100,000 messages, +2.5 KB a message; later runs of the old code, less
starved of CPU, stayed flat); with it, 156 MB, flat.
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import zlib
from pathlib import Path
from typing import Any, Union

from common import add_output_args, figure, goal, write_results

LIVE_RATE = 5000  # messages/s of the live worker the stream stands for
MB = 1 << 20


# ------------------------------------------------------------------------ checking segments
class SegmentChecker:
    """Reads the capture's segments as they close, checks every frame and the seq order,
    and (``delete``) removes each checked segment but the newest."""

    def __init__(self, bundle: Path, delete: bool = True) -> None:
        import msgspec

        from kvcadence.format.schema import (
            Annotation,
            Epoch,
            EventFrame,
            Gap,
            Header,
            RequestRecord,
            SegmentStart,
            Trailer,
        )

        self._types = (EventFrame, Gap, Epoch, Trailer)
        self._dec = msgspec.msgpack.Decoder(
            Union[Header, SegmentStart, EventFrame, RequestRecord, Gap, Epoch, Annotation, Trailer]
        )
        self.bundle = bundle
        self.delete = delete
        self.checked: set[str] = set()
        self.checked_bytes = 0  # bytes of the segments checked (and deleted)
        self.segments = 0
        self.frames = 0
        self.next_seq = 0
        self.out_of_order = 0
        self.gaps = 0
        self.epochs = 0
        self.bad_frames = 0
        self.torn_bytes = 0
        self.first_ns = 0
        self.last_ns = 0
        self.trailer: Any = None

    def on_disk_bytes(self) -> int:
        """Bytes the capture has written so far (checked segments included)."""
        from kvcadence.format.bundle import list_segments

        total = self.checked_bytes
        for seg in list_segments(self.bundle):
            if seg.name not in self.checked:
                try:
                    total += seg.stat().st_size
                except FileNotFoundError:
                    pass
        return total

    def step(self) -> bool:
        """Check (and delete) one closed segment; False when none is waiting."""
        from kvcadence.format.bundle import list_segments

        segs = list_segments(self.bundle)
        for seg in segs[:-1]:  # a segment is closed (fsynced) once the next one exists
            if seg.name not in self.checked:
                self._check(seg)
                return True
        return False

    def finish(self) -> None:
        """After the capture stopped: check the segments left."""
        from kvcadence.format.bundle import list_segments

        for seg in list_segments(self.bundle):
            if seg.name not in self.checked:
                self._check(seg)

    def _check(self, seg: Path) -> None:
        from kvcadence.format.bundle import FRAME_HEADER, FRAME_HEADER_SIZE, SEGMENT_HEADER_SIZE

        event, gap, epoch, trailer = self._types
        decode = self._dec.decode
        data = seg.read_bytes()
        mv = memoryview(data)
        pos, end = SEGMENT_HEADER_SIZE, len(data)
        while pos < end:
            if pos + FRAME_HEADER_SIZE > end:
                self.torn_bytes += end - pos
                break
            n, crc = FRAME_HEADER.unpack_from(data, pos)
            body = mv[pos + FRAME_HEADER_SIZE : pos + FRAME_HEADER_SIZE + n]
            if len(body) < n:
                self.torn_bytes += end - pos
                break
            if zlib.crc32(body) != crc:
                self.bad_frames += 1
                break
            rec = decode(body)
            t = type(rec)
            if t is event:
                self.frames += 1
                if rec.seq != self.next_seq:
                    self.out_of_order += 1
                self.next_seq = rec.seq + 1
                self.last_ns = rec.recv_ns
                if not self.first_ns:
                    self.first_ns = rec.recv_ns
            elif t is gap:
                self.gaps += 1
            elif t is epoch:
                self.epochs += 1
            elif t is trailer:
                self.trailer = rec
            pos += FRAME_HEADER_SIZE + n
        del body, mv
        self.checked.add(seg.name)
        self.checked_bytes += end
        self.segments += 1
        if self.delete:
            seg.unlink()


# ------------------------------------------------------------------------ one point
def frame_bytes(pool: list[bytes]) -> float:
    """Mean bytes on disk of one event frame of this pool (seqs of 5-byte msgpack ints, the
    bulk of a long stream): what turns the bundle's size into messages written."""
    import msgspec

    from kvcadence.format.bundle import FRAME_HEADER_SIZE
    from kvcadence.format.schema import EventFrame

    enc = msgspec.msgpack.Encoder()
    now = time.time_ns()
    sizes = [
        len(enc.encode(EventFrame(0, 1 << 20, now, "kv-events", 0, 0, False, msgspec.Raw(p))))
        for p in pool
    ]
    return FRAME_HEADER_SIZE + sum(sizes) / len(sizes)


def rss_now(pid: int) -> float | None:
    """Current RSS of ``pid`` in MB (Linux /proc), None elsewhere."""
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) / 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def run_point(n: int, args: argparse.Namespace, pool: list[bytes], work: Path) -> dict[str, Any]:
    """One fresh capture child recording ``n`` messages; its peak RSS and the checks."""
    from kvcadence.format.bundle import list_segments
    from kvcadence.testing.publisher import TestPublisher

    out = work / f"b{n}"
    per_frame = frame_bytes(pool)
    mask = len(pool) - 1
    assert len(pool) & mask == 0, "pool size must be a power of two"
    checker = SegmentChecker(out)
    samples: list[tuple[int, float]] = []
    t_start = time.perf_counter()
    with TestPublisher(buffer_steps=10_000, sndhwm=0) as pub:
        cmd = [sys.executable, "-m", "kvcadence", "capture", "--endpoint", pub.endpoint]
        cmd += ["--replay-endpoint", str(pub.replay_endpoint), "--out", str(out), "--quiet"]
        cmd += ["--no-initial-replay", "--segment-mb", f"{args.segment_mb:g}"]
        proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        try:
            deadline = time.monotonic() + 60
            while not (out.exists() and list_segments(out)):
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise SystemExit(f"bench_capture_rss: capture did not start: {cmd}")
                time.sleep(0.05)
            time.sleep(1.0)  # the SUB's subscription reaches the PUB

            def written() -> float:
                return checker.on_disk_bytes() / per_frame

            publish = pub.publish
            tenth = max(1, n // 10)
            next_sample = tenth
            sent = 0
            t0 = time.perf_counter()
            while sent < n:
                stop = min(n, sent + 256)
                for i in range(sent, stop):
                    publish(pool[i & mask])
                sent = stop
                while sent - written() > args.window:
                    if not checker.step():
                        time.sleep(0.001)
                if sent >= next_sample:
                    rss = rss_now(proc.pid)
                    if rss is not None:
                        samples.append((sent, rss))
                        if n >= 1_000_000:
                            print(f"    {sent:>11,} sent: RSS {rss:.0f} MB", flush=True)
                    next_sample += tenth
            send_s = time.perf_counter() - t0
            # the recorder writes the rest: wait until the bundle holds them all or stops
            # growing for a second (the size -> messages estimate is only close)
            deadline = time.monotonic() + 120
            seen, still = -1, time.monotonic()
            while time.monotonic() < deadline:
                size = checker.on_disk_bytes()
                if size / per_frame >= n:
                    break
                if size != seen:
                    seen, still = size, time.monotonic()
                elif time.monotonic() - still > 1.0:
                    break
                if not checker.step():
                    time.sleep(0.01)
            time.sleep(0.3)
        finally:
            proc.send_signal(signal.SIGTERM)
            _, status, usage = os.wait4(proc.pid, 0)
            proc.returncode = os.waitstatus_to_exitcode(status)
            err = proc.stderr.read() if proc.stderr else ""
            if proc.stderr:
                proc.stderr.close()
    if proc.returncode != 0:
        raise SystemExit(f"bench_capture_rss: capture failed ({proc.returncode}):\n{err}")
    checker.finish()
    shutil.rmtree(out, ignore_errors=True)
    stats = checker.trailer.stats if checker.trailer is not None else {}
    span = max(checker.last_ns - checker.first_ns, 1) / 1e9
    res = {
        "messages": n,
        "rss_mb": usage.ru_maxrss / 1024,  # KiB on Linux
        "samples": samples,
        "frames": checker.frames,
        "lost": max(0, n - checker.frames) + checker.out_of_order,
        "out_of_order": checker.out_of_order,
        "gap_records": checker.gaps,
        "epochs": checker.epochs,
        "bad_frames": checker.bad_frames,
        "torn_bytes": checker.torn_bytes,
        "segments": checker.segments,
        "bundle_mb": checker.checked_bytes / MB,
        "trailer_gaps": stats.get("gaps", -1),
        "trailer_written": stats.get("written", -1),
        "cpu_us_per_msg": 1e6 * stats.get("cpu_s", 0.0) / max(1, checker.frames),
        "msgs_per_s": checker.frames / span,
        "send_s": send_s,
        "wall_s": time.perf_counter() - t_start,
    }
    print(
        f"  {n:>11,} messages: peak RSS {res['rss_mb']:7.1f} MB  {res['msgs_per_s']:8,.0f} msg/s  "
        f"lost {res['lost']}  gaps {res['gap_records']}/{res['trailer_gaps']}  "
        f"{res['segments']} segments ({res['bundle_mb']:,.0f} MB)  "
        f"RSS at each tenth {[round(r) for _, r in samples]} MB  {res['wall_s']:.0f} s",
        flush=True,
    )
    return res


# ------------------------------------------------------------------------ figures
def label(n: int) -> str:
    """The live time a stream of ``n`` messages stands for at 5k msg/s: '1 min', '1 h'."""
    s = n / LIVE_RATE
    if s >= 3600:
        return f"{s / 3600:.3g} h"
    if s >= 60:
        return f"{s / 60:.3g} min"
    return f"{s:.3g} s"


def figures_of(floor: dict[str, Any], points: list[dict[str, Any]]) -> list[dict[str, Any]]:
    figs: list[dict[str, Any]] = []
    first = points[0]
    for i, p in enumerate(points):
        n = p["messages"]
        tenths = " / ".join(f"{r:.0f}" for _, r in p["samples"])
        figs.append(
            figure(
                f"capture peak RSS, {label(n)} stream ({n:,} messages)",
                p["rss_mb"],
                "MB",
                baseline=first["rss_mb"] if i else floor["rss_mb"],
                baseline_name=f"the {label(first['messages'])} stream"
                if i
                else f"the floor: a capture of {floor['messages']:,} messages",
                higher_is_better=False,
                goal=goal("ratio", "<=", 1.2, f"<= 1.2x the {label(first['messages'])} stream")
                if i
                else None,
                note=f"RSS at each tenth of the stream: {tenths} MB; "
                f"{p['bundle_mb']:,.0f} MB of bundle in {p['segments']} segments",
            )
        )
    last = points[-1]
    figs.append(
        figure(
            f"recorded messages/s, {label(last['messages'])} stream",
            last["msgs_per_s"],
            "msg/s",
            baseline=first["msgs_per_s"],
            baseline_name=f"the {label(first['messages'])} stream",
            note=f"{last['msgs_per_s'] / LIVE_RATE:.1f}x the live {LIVE_RATE:,} msg/s; "
            f"capture CPU {last['cpu_us_per_msg']:.1f} us/message",
        )
    )
    for p in points:
        n = p["messages"]
        figs.append(
            figure(
                f"messages lost, {label(n)} stream",
                p["lost"],
                "messages",
                baseline=n,
                baseline_name="messages sent",
                higher_is_better=False,
                goal=goal("value", "<=", 0, "0 lost"),
                note=f"{p['frames']:,} event frames in seq order ({p['out_of_order']} out of "
                f"order), {p['gap_records']} Gap records, Trailer gaps {p['trailer_gaps']}, "
                f"{p['bad_frames']} bad frames, {p['torn_bytes']} torn bytes",
            )
        )
    return figs


def main() -> int:
    ap = argparse.ArgumentParser(
        description=__doc__.splitlines()[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--full", action="store_true", help="add the 1-hour stream (18M messages)")
    ap.add_argument("--messages", type=int, nargs="+", metavar="N",
                    help="stream lengths instead of the defaults (the first is the baseline)")  # fmt: skip
    ap.add_argument("--floor-messages", type=int, default=1000, metavar="N")
    ap.add_argument(
        "--page-size", type=int, default=1, help="token ids per page (default 1, SGLang's)"
    )
    ap.add_argument("--segment-mb", type=float, default=64.0, help="capture --segment-mb")
    ap.add_argument("--window", type=int, default=8000,
                    help="most messages the publisher runs ahead of the bundle on disk")  # fmt: skip
    ap.add_argument("--dir", type=Path, help="where to write the bundles (default: a tmp dir)")
    add_output_args(ap, "floor 1,000, streams of 20,000 and 100,000 messages")
    args = ap.parse_args()
    sizes = [20_000, 100_000] if args.quick else [300_000, 3_000_000]
    if args.full:
        sizes.append(18_000_000)
    sizes = args.messages or sizes
    from kvcadence.testing.publisher import payload_pool

    pool = payload_pool(512, page_size=args.page_size)
    work = Path(tempfile.mkdtemp(prefix="kvc-caprss-", dir=args.dir))
    try:
        print("capture RSS:", flush=True)
        floor = run_point(args.floor_messages, args, pool, work)
        points = [run_point(n, args, pool, work) for n in sizes]
    finally:
        shutil.rmtree(work, ignore_errors=True)
    figs = figures_of(floor, points)
    for f in figs:
        ratio = "–" if f["ratio"] is None else f"{f['ratio']:.3g}x"
        print(f"{f['name']}: {f['value']:,.1f} {f['unit']} = {ratio} {f['baseline_name']}")
    write_results(
        args.json,
        "capture_rss",
        "Capture memory over a long stream (time compressed)",
        figs,
        {
            "messages": sizes,
            "floor_messages": args.floor_messages,
            "page_size": args.page_size,
            "segment_mb": args.segment_mb,
            "window": args.window,
            "payload_bytes": round(sum(map(len, pool)) / len(pool)),
        },
        [
            "peak RSS of a fresh `kvcadence capture` child per point (os.wait4 ru_maxrss)",
            f"a stream of N messages stands for N / {LIVE_RATE:,} s of a live worker; it is "
            "sent as fast as the recorder writes (at most `window` messages ahead of the disk)",
            "closed segments are checked (CRC, seq order, no Gap) and deleted during the run",
        ],
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
