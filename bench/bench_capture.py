"""Capture benchmark: recorder throughput vs a bare pyzmq drain loop, and loss at a fixed rate.

In the same run, a test publisher (own process, SGLang framing, 0.5.23-encoded batches of
8-64 pages, replay ring) sends a stream that two subscribers receive at the same time:

* a bare pyzmq loop in this process (SUB, RCVHWM 0, Poller + NOBLOCK drain, count only);
* ``kvcadence capture`` in a subprocess (the real CLI: recorder, bundle writer, stats).

Phase 1 ("max"): the publisher sends as fast as it can -> messages/s of each receiver
(first to last message) and the ratio recorded / bare (goal >= 0.8).
Phase 2 ("rate"): 20k batches/s for ``--rate-seconds`` (default 2 s; ``--full`` = 10 s) ->
messages lost after replay recovery (goal: 0).

Phase 3 ("writer", in this process, no sockets): the bundle writer alone on the same payloads,
``write_event`` per message (the baseline) vs ``write_event_batch`` over bursts of
``--burst`` messages (what the capture loop does per SUB drain) -> CPU us per message.

The rates depend on how much CPU the three processes get (a 2-core box shared with other
work gives noisy ratios), so each phase also reports CPU time per message: the bare loop's
thread, and the capture loop's thread (``cpu_s`` in the Trailer; the deferred stats decode,
``decode_cpu_s``, shown apart). ``--runs N`` repeats everything and prints the medians.

Usage: ``python bench/bench_capture.py [--full] [--runs N] [--max-messages N]``. Prints a
table and a JSON line; exits 0 (numbers are for reading, not a gate).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from common import add_output_args, figure, goal, write_results

HERE = Path(__file__).resolve()


# ---------------------------------------------------------------------- publisher process


def publisher_main(args: argparse.Namespace) -> int:
    from kvcadence.testing.publisher import TestPublisher, payload_pool

    pool = payload_pool(512)
    with TestPublisher(buffer_steps=args.ring, sndhwm=100_000) as pub:
        print(json.dumps({"endpoint": pub.endpoint, "replay": pub.replay_endpoint}), flush=True)
        for line in sys.stdin:
            cmd = line.split()
            if not cmd or cmd[0] == "quit":
                break
            n, rate = int(cmd[1]), float(cmd[2])
            t0 = time.perf_counter()
            if rate <= 0:
                for i in range(n):
                    pub.publish(pool[i & 511])
            else:
                sent = 0
                while sent < n:
                    due = min(n, int((time.perf_counter() - t0) * rate) + 1)
                    while sent < due:
                        pub.publish(pool[sent & 511])
                        sent += 1
                    time.sleep(0.0005)
            dt = time.perf_counter() - t0
            print(json.dumps({"sent": n, "seconds": dt, "last_seq": pub.seq - 1}), flush=True)
    return 0


# ---------------------------------------------------------------------- receivers


def bare_drain(endpoint: str, expect: int, idle_s: float = 1.5) -> tuple[int, float, float]:
    """Count messages until ``expect`` arrived or ``idle_s`` without any;
    ``(n, seconds first to last, thread CPU seconds)``."""
    import zmq

    ctx = zmq.Context()
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.RCVHWM, 0)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.connect(endpoint)
    poller = zmq.Poller()
    poller.register(sub, zmq.POLLIN)
    n = 0
    first = last = 0.0
    cpu0 = time.thread_time()
    try:
        ready_signal.set()
        while n < expect:
            if not poller.poll(int(idle_s * 1000)):
                if n:
                    break
                continue
            while True:
                try:
                    sub.recv_multipart(zmq.NOBLOCK)
                except zmq.Again:
                    break
                n += 1
                last = time.perf_counter()
                if n == 1:
                    first = last
    finally:
        cpu = time.thread_time() - cpu0
        sub.close(0)
        ctx.term()
    return n, max(last - first, 1e-9), cpu


class _Ready:
    def __init__(self) -> None:
        import threading

        self.ev = threading.Event()

    def set(self) -> None:
        self.ev.set()


ready_signal = _Ready()


def start_capture(endpoint: str, replay: str, out: Path) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "kvcadence", "capture", "--endpoint", endpoint]
    cmd += ["--replay-endpoint", replay, "--out", str(out), "--quiet", "--no-initial-replay"]
    return subprocess.Popen(cmd, stderr=subprocess.PIPE, text=True)


def stop_capture(proc: subprocess.Popen) -> None:
    import signal

    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=120)
    if proc.returncode != 0:
        raise SystemExit(f"capture failed ({proc.returncode}): {err}")


def bundle_stats(out: Path) -> dict:
    from kvcadence.format.bundle import BundleReader
    from kvcadence.format.schema import VIA_LIVE, Trailer

    r = BundleReader(out)
    live_ns = []
    seqs = set()
    for f in r.events():
        seqs.add(f.seq)
        if f.via == VIA_LIVE:
            live_ns.append(f.recv_ns)
    trailer = [t for t in r.records() if isinstance(t, Trailer)]
    span = (max(live_ns) - min(live_ns)) / 1e9 if len(live_ns) > 1 else 1e-9
    return {
        "seqs": seqs,
        "live": len(live_ns),
        "span_s": span,
        "stats": trailer[-1].stats if trailer else {},
    }


def wait_until_connected(proc: subprocess.Popen, out: Path) -> None:
    from kvcadence.format.bundle import list_segments

    deadline = time.monotonic() + 60
    while not (out.exists() and list_segments(out)):
        if proc.poll() is not None or time.monotonic() > deadline:
            raise SystemExit("capture subprocess did not start")
        time.sleep(0.05)
    time.sleep(1.0)


# ---------------------------------------------------------------------- main


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--publisher", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--ring", type=int, default=250_000, help=argparse.SUPPRESS)
    ap.add_argument("--max-messages", type=int, default=60_000, help="phase 1 message count")
    ap.add_argument("--rate", type=float, default=20_000.0, help="phase 2 batches/s")
    ap.add_argument("--rate-seconds", type=float, default=2.0)
    ap.add_argument("--full", action="store_true", help="phase 2 for 10 s")
    ap.add_argument("--runs", type=int, default=1, help="repeat N times, print medians")
    ap.add_argument(
        "--burst",
        type=int,
        default=300,
        help="phase 3: messages per write_event_batch (300: about the recorder's 256 KiB burst)",
    )
    add_output_args(ap, "phase 1 with 15k messages, phase 2 for 1 s")
    args = ap.parse_args()
    if args.publisher:
        return publisher_main(args)
    if args.full:
        args.rate_seconds = 10.0
    if args.quick:
        args.max_messages, args.rate_seconds = 15_000, 1.0
    runs = [one_run(args) for _ in range(max(1, args.runs))]
    results = {phase: _median(runs, phase) for phase in runs[0]}
    wr = [writer_run(args.max_messages, args.burst) for _ in range(max(1, args.runs))]
    writer = {k: _median_of([w[k] for w in wr]) for k in wr[0]}
    print(
        f"{'phase':6} {'sent':>8} {'pub msg/s':>10} {'bare msg/s':>11} {'rec msg/s':>10} "
        f"{'ratio':>6} {'bare got':>9} {'rec live':>9} {'recovered':>9} {'lost':>5} "
        f"{'bare us/msg':>11} {'rec us/msg':>10} {'+decode':>8}"
    )
    label = f"median of {len(runs)} runs" if len(runs) > 1 else "1 run"
    for phase, r in results.items():
        print(
            f"{phase:6} {r['sent']:8.0f} {r['publisher_msgs_per_s']:10.0f} "
            f"{r['bare_msgs_per_s']:11.0f} {r['recorded_msgs_per_s']:10.0f} {r['ratio']:6.2f} "
            f"{r['bare_received']:9.0f} {r['recorded_live']:9.0f} "
            f"{r['recovered_by_replay']:9.0f} {r['lost_after_recovery']:5.0f} "
            f"{r['bare_cpu_us_per_msg']:11.2f} {r['recorded_cpu_us_per_msg']:10.2f} "
            f"{r['decode_cpu_us_per_msg']:8.2f}"
        )
    ratios = {p: [round(x[p]["ratio"], 3) for x in runs] for p in results}
    print(f"({label}; ratios per run: {ratios}; load {os.getloadavg()[0]:.1f})")
    print(
        f"writer {args.max_messages} msgs: write_event {writer['per_frame_us']:.2f} us/msg, "
        f"write_event_batch (bursts of {args.burst}) {writer['batch_us']:.2f} us/msg, "
        f"ratio {writer['batch_us'] / writer['per_frame_us']:.2f} "
        f"(per run: {[round(w['batch_us'] / w['per_frame_us'], 3) for w in wr]})"
    )
    print(
        json.dumps(
            {"bench": "capture", "runs": len(runs), "ratios": ratios, **results, "writer": writer}
        )
    )
    mx, rt = results["max"], results["rate"]
    write_results(
        args.json,
        "capture",
        "Capture: kvcadence capture vs a bare pyzmq drain loop on the same stream",
        [
            figure(
                "recorded messages/s at the publisher's max rate",
                mx["recorded_msgs_per_s"],
                "msg/s",
                baseline=mx["bare_msgs_per_s"],
                baseline_name="bare pyzmq SUB drain loop, same stream",
                goal=goal("ratio", ">=", 0.8, ">= 0.8x of bare"),
                note=f"lost after recovery {mx['lost_after_recovery']:.0f}",
            ),
            figure(
                f"recorded messages/s at {args.rate:.0f} batches/s for {args.rate_seconds:g} s",
                rt["recorded_msgs_per_s"],
                "msg/s",
                baseline=rt["bare_msgs_per_s"],
                baseline_name="bare pyzmq SUB drain loop, same stream",
                note=f"lost after recovery {rt['lost_after_recovery']:.0f} of {rt['sent']:.0f}"
                f" (goal 0); recovered by replay {rt['recovered_by_replay']:.0f}",
            ),
            figure(
                "recorder CPU per message (receive + write)",
                mx["recorded_cpu_us_per_msg"],
                "us",
                baseline=mx["bare_cpu_us_per_msg"],
                baseline_name="bare loop CPU per message",
                higher_is_better=False,
            ),
            figure(
                f"bundle writer CPU per message, write_event_batch (bursts of {args.burst})",
                writer["batch_us"],
                "us",
                baseline=writer["per_frame_us"],
                baseline_name="write_event per message, same payloads",
                higher_is_better=False,
            ),
        ],
        params={
            "max_messages": args.max_messages,
            "rate": args.rate,
            "rate_seconds": args.rate_seconds,
            "runs": len(runs),
            "burst": args.burst,
        },
    )
    return 0


def writer_run(n: int, burst: int) -> dict[str, float]:
    """Thread CPU us per message of the bundle writer: ``write_event`` per message vs
    ``write_event_batch`` over bursts (same payloads, same bytes on disk)."""
    from kvcadence.format.bundle import BundleWriter
    from kvcadence.format.schema import Header
    from kvcadence.testing.publisher import payload_pool

    pool = payload_pool(512)
    items = [(0, i, 1_000 + i, "kv-events", pool[i & 511], 0, 0) for i in range(n)]
    out: dict[str, float] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name in ("per_frame_us", "batch_us"):
            w = BundleWriter(Path(tmp) / name, Header(1, 0, "real", "bench"))
            t0 = time.thread_time()
            if name == "batch_us":
                for lo in range(0, n, burst):
                    w.write_event_batch(items[lo : lo + burst])
            else:
                put = w.write_event
                for e, s, r, t, p, v, ep in items:
                    put(endpoint=e, seq=s, recv_ns=r, topic=t, payload=p, via=v, epoch=ep)
            out[name] = 1e6 * (time.thread_time() - t0) / n
            w.close()
    return out


def _median_of(xs: list[float]) -> float:
    import statistics

    return statistics.median(xs)


def _median(runs: list[dict[str, dict]], phase: str) -> dict[str, float]:
    import statistics

    keys = runs[0][phase].keys()
    return {k: statistics.median(r[phase][k] for r in runs) for k in keys}


def one_run(args: argparse.Namespace) -> dict[str, dict]:
    """Both phases once; ``{phase: numbers}``."""
    import threading

    results: dict[str, dict] = {}
    for phase, n, rate in (
        ("max", args.max_messages, 0.0),
        ("rate", int(args.rate * args.rate_seconds), args.rate),
    ):
        # a fresh publisher per phase: seq starts at 0, like a worker the capture joins early
        pub = subprocess.Popen(
            [sys.executable, str(HERE), "--publisher", "--ring", str(args.ring)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            env=dict(os.environ),
        )
        assert pub.stdout is not None and pub.stdin is not None
        eps = json.loads(pub.stdout.readline())
        try:
            with tempfile.TemporaryDirectory() as tmp:
                out = Path(tmp) / "b"
                cap = start_capture(eps["endpoint"], eps["replay"], out)
                wait_until_connected(cap, out)
                bare: dict[str, float] = {}
                ready_signal.ev.clear()

                def run_bare(n: int = n, bare: dict = bare, eps: dict = eps) -> None:
                    got, secs, cpu = bare_drain(eps["endpoint"], n)
                    bare.update(n=got, s=secs, cpu=cpu)

                t = threading.Thread(target=run_bare)
                t.start()
                ready_signal.ev.wait(10)
                time.sleep(0.5)
                pub.stdin.write(f"go {n} {rate}\n")
                pub.stdin.flush()
                sent = json.loads(pub.stdout.readline())
                t.join()
                time.sleep(1.0)
                stop_capture(cap)
                bs = bundle_stats(out)
                first = sent["last_seq"] - n + 1
                want = set(range(first, sent["last_seq"] + 1))
                results[phase] = {
                    "sent": n,
                    "publisher_msgs_per_s": n / sent["seconds"],
                    "bare_received": int(bare["n"]),
                    "bare_msgs_per_s": bare["n"] / bare["s"],
                    "recorded_live": bs["live"],
                    "recorded_msgs_per_s": bs["live"] / bs["span_s"],
                    "recovered_by_replay": bs["stats"].get("recovered", 0),
                    "lost_after_recovery": len(want - bs["seqs"]),
                    "bare_cpu_us_per_msg": 1e6 * bare["cpu"] / max(1, bare["n"]),
                    "recorded_cpu_us_per_msg": 1e6
                    * (bs["stats"].get("cpu_s", 0.0) - bs["stats"].get("decode_cpu_s", 0.0))
                    / max(1, bs["live"]),
                    "decode_cpu_us_per_msg": 1e6
                    * bs["stats"].get("decode_cpu_s", 0.0)
                    / max(1, bs["live"]),
                }
                r = results[phase]
                r["ratio"] = r["recorded_msgs_per_s"] / r["bare_msgs_per_s"]
        finally:
            pub.stdin.write("quit\n")
            pub.stdin.flush()
            pub.wait(30)
    return results


if __name__ == "__main__":
    sys.exit(main())
