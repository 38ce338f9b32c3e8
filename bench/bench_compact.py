"""Compact request storage benchmark (format 2.0): bundle bytes per request on an agent log.

The workload is ``bench/bench_replay.py``'s agent lanes with longer sessions (``agent_log``):
32 closed-loop lanes over 4 shared system prompts (200-800 tokens); each turn's prompt = the
previous prompt + its output (64-256 tokens) + a new user chunk (40-200 tokens), ~280 new
tokens a request; a session runs until its prompt would pass 6,000 tokens. It is written as a
requests JSONL log and imported with
``kvcadence import --frames <empty file> --requests log.jsonl`` (the production path). The
baseline, measured in the same run, is the same request records written in the full layout
(``BundleWriter(compact_requests=False)``: every prompt's ids as a msgpack int array, what
format 1.x stores). Figures per size (2,000 and 8,000 requests; ``--quick``: 500):

* bundle bytes per request, compact vs full (goal: <= 2,500 B/request);
* the writer's prefix index at the end (bytes per request, ``sys.getsizeof`` of its dict
  and keys, its runs and arrays), against the prompts' ids as uint32 (what keeping whole
  prompts would hold);
* writer CPU time per request (``BundleWriter.write`` of the request records), compact vs
  full (the prefix index looks each prompt's blocks up);
* read CPU time (one pass of ``BundleReader.iter_kinds("request")``: records with full
  ``input_ids``, not kept; best of 3, alternated), compact vs full (the resolver rebuilds
  every prompt from its blocks).

A second workload, one long-context agent session (a 70k-token prompt growing by 1,000
tokens a turn to ~100k, ids from a 150k vocabulary, 30 turns; ``--quick``: 10), gives the
same three figures for prompts of that size.

    .venv/bin/python bench/bench_compact.py [--requests N ...] [--lanes 32] [--quick]
        [--json PATH]

Measures only; nothing here changes the code measured.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import io
import random
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import msgspec
from common import add_output_args, figure, goal, write_results

from kvcadence.cli import main as cli_main
from kvcadence.format.bundle import BundleReader, BundleWriter, list_segments
from kvcadence.format.schema import Header, RequestRecord


def agent_log(n: int, lanes: int, seed: int = 7) -> list[RequestRecord]:
    """``n`` requests of ``lanes`` agent lanes (see the module docstring), lane by lane
    interleaved in time (request ``i`` of every lane before request ``i + 1`` of any)."""
    rng = random.Random(seed)
    systems = [[rng.randrange(3, 32000) for _ in range(rng.randint(200, 800))] for _ in range(4)]
    state: list[list[Any]] = [[None, -1, 0] for _ in range(lanes)]  # prompt, session, turn
    out: list[RequestRecord] = []
    t = 1_000_000.0
    while len(out) < n:
        for lane in range(lanes):
            if len(out) >= n:
                break
            st = state[lane]
            if st[0] is None or len(st[0]) > 6000:
                st[0] = list(rng.choice(systems)) + _chunk(rng, 40, 300)
                st[1] += 1
                st[2] = 0
            prompt = st[0]
            outs = _chunk(rng, 64, 256)
            out.append(
                RequestRecord(
                    rid=f"l{lane}-s{st[1]}-t{st[2]}",
                    input_ids=list(prompt),
                    output_ids=outs,
                    lane=lane,
                    session=st[1],
                    turn=st[2],
                    max_new_tokens=len(outs),
                    completion_tokens=len(outs),
                    finish_reason="length",
                    meta_info={"request_received_ts": t, "request_finished_ts": t + 0.2},
                )
            )
            t += 0.01
            st[0] = prompt + outs + _chunk(rng, 40, 200)
            st[2] += 1
    return out


def _chunk(rng: random.Random, lo: int, hi: int, vocab: int = 32000) -> list[int]:
    return [rng.randrange(3, vocab) for _ in range(rng.randint(lo, hi))]


def write_log(records: list[RequestRecord], path: Path) -> None:
    """The records as a requests JSONL log (``kvcadence import``'s input)."""
    enc = msgspec.json.Encoder()
    with open(path, "wb") as f:
        for r in records:
            d = {k: v for k, v in msgspec.structs.asdict(r).items() if v is not None}
            d.pop("source", None)
            f.write(enc.encode(d) + b"\n")


def bundle_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in list_segments(path))


def timed_write(records: list[RequestRecord], path: Path, compact: bool) -> tuple[float, int]:
    """(CPU seconds, bytes of the writer's prefix index at the end: its dict and keys,
    its runs and arrays, by ``sys.getsizeof``)."""
    header = Header(2, 0, "real", "bench")
    t = time.process_time()
    with BundleWriter(path, header, compact_requests=compact) as w:
        for r in records:
            w.write(r)
    cpu = time.process_time() - t
    index = w._index  # measured, not changed
    size = 0
    if index is not None:
        ids, runs = index._ids, index._runs
        size = sys.getsizeof(ids) + sum(sys.getsizeof(k) for k in ids)
        size += sys.getsizeof(runs) + sum(sys.getsizeof(r) for r in runs)
        size += sys.getsizeof(index._run_of) + sys.getsizeof(index._run_first)
    return cpu, size


def timed_read(path: Path) -> float:
    """CPU time of one pass over the requests (``iter_kinds("request")``: records with full
    ``input_ids``, none kept, as a streaming consumer reads them)."""
    gc.collect()
    t = time.process_time()
    for _ in BundleReader(path).iter_kinds("request"):
        pass
    return time.process_time() - t


def point(n: int, lanes: int, tmp: Path) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    records = agent_log(n, lanes)
    log, frames = tmp / f"log-{n}.jsonl", tmp / f"frames-{n}.jsonl"
    write_log(records, log)
    frames.write_bytes(b"")
    imported = tmp / f"imported-{n}"
    args = ["import", "--frames", str(frames), "--requests", str(log), "--out", str(imported)]
    with contextlib.redirect_stdout(io.StringIO()):
        rc = cli_main(args)
    if rc != 0:
        raise SystemExit(f"kvcadence import exited {rc}")
    reqs = BundleReader(imported).requests()  # the records import wrote (think_ns etc.)
    full = tmp / f"full-{n}"
    compact = tmp / f"compact-{n}"
    w_full, _ = timed_write(reqs, full, False)
    w_compact, index_bytes = timed_write(reqs, compact, True)
    if BundleReader(compact).requests() != reqs or BundleReader(full).requests() != reqs:
        raise SystemExit("round trip changed the records")
    reads: dict[bool, list[float]] = {False: [], True: []}
    for _ in range(3):  # alternated, best of 3
        reads[False].append(timed_read(full))
        reads[True].append(timed_read(compact))
    r_full, r_compact = min(reads[False]), min(reads[True])
    b_imp, b_full, b_compact = bundle_bytes(imported), bundle_bytes(full), bundle_bytes(compact)
    prompt = sum(len(r.input_ids) for r in reqs)
    print(
        f"{n} requests ({lanes} lanes, {prompt / n:,.0f} prompt tokens/request): "
        f"import {b_imp / n:,.0f} B/request; the same records written full "
        f"{b_full / n:,.0f} B/request, compact {b_compact / n:,.0f} B/request "
        f"({b_compact / b_full:.3f}x)"
    )
    print(
        f"  writer index {index_bytes / n:,.0f} B/request at the end "
        f"({index_bytes / (prompt * 4):.3f}x the prompts' ids as uint32)"
    )
    print(
        f"  write {w_compact / n * 1e6:,.0f} us/request compact vs {w_full / n * 1e6:,.0f} full "
        f"({w_compact / w_full:.2f}x); read {r_compact / n * 1e6:,.0f} vs "
        f"{r_full / n * 1e6:,.0f} us/request ({r_compact / r_full:.2f}x)"
    )
    figs = [
        figure(
            f"bundle bytes per request, {n} requests (kvcadence import)",
            b_imp / n,
            "B/request",
            baseline=b_full / n,
            baseline_name="the same records written in the full layout (format 1.x requests)",
            higher_is_better=False,
            goal=goal("value", "<=", 2500, "<= 2,500 B/request"),
            note=f"{prompt / n:,.0f} prompt tokens/request",
        ),
        figure(
            f"writer prefix index memory per request, {n} requests",
            index_bytes / n,
            "B/request",
            baseline=prompt * 4 / n,
            baseline_name="the prompts' ids as uint32 (what an index of whole prompts holds)",
            higher_is_better=False,
        ),
        figure(
            f"write CPU per request, {n} requests",
            w_compact / n * 1e6,
            "us/request",
            baseline=w_full / n * 1e6,
            baseline_name="write in the full layout",
            higher_is_better=False,
        ),
        figure(
            f"read CPU per request (iter_kinds('request'), best of 3), {n} requests",
            r_compact / n * 1e6,
            "us/request",
            baseline=r_full / n * 1e6,
            baseline_name="read of the full layout",
            higher_is_better=False,
        ),
    ]
    return figs, {"prompt_tokens_per_request": prompt / n}


def long_point(n: int, tmp: Path) -> list[dict[str, Any]]:
    """One long-context agent session: a 70k-token prompt that grows by its output (300
    tokens) and a 700-token user chunk a turn, ids from a 150k vocabulary; written directly
    (no import), compact vs full."""
    rng = random.Random(3)
    prompt = _chunk(rng, 70_000, 70_000, 150_000)
    reqs = []
    for i in range(n):
        out = _chunk(rng, 300, 300, 150_000)
        reqs.append(RequestRecord(f"r{i}", list(prompt), out, lane=0, turn=i))
        prompt = prompt + out + _chunk(rng, 700, 700, 150_000)
    w_full, _ = timed_write(reqs, tmp / "long-full", False)
    w_compact, _ = timed_write(reqs, tmp / "long-compact", True)
    if BundleReader(tmp / "long-compact").requests() != reqs:
        raise SystemExit("round trip changed the records")
    r_full = min(timed_read(tmp / "long-full") for _ in range(2))
    r_compact = min(timed_read(tmp / "long-compact") for _ in range(2))
    b_full, b_compact = bundle_bytes(tmp / "long-full"), bundle_bytes(tmp / "long-compact")
    print(
        f"long context ({n} turns, 70k-{len(prompt) // 1000}k tokens, ids < 150,000): "
        f"{b_full / n:,.0f} -> {b_compact / n:,.0f} B/request ({b_compact / b_full:.3f}x); "
        f"write {w_compact / n * 1e3:.2f} vs {w_full / n * 1e3:.2f} ms/request, read "
        f"{r_compact / n * 1e3:.2f} vs {r_full / n * 1e3:.2f} ms/request"
    )
    base = "the same records in the full layout"
    return [
        figure(
            f"long context: bundle bytes per request ({n} turns)",
            b_compact / n,
            "B/request",
            baseline=b_full / n,
            baseline_name=base,
            higher_is_better=False,
        ),
        figure(
            f"long context: write CPU per request ({n} turns)",
            w_compact / n * 1e3,
            "ms/request",
            baseline=w_full / n * 1e3,
            baseline_name=base,
            higher_is_better=False,
        ),
        figure(
            f"long context: read CPU per request ({n} turns)",
            r_compact / n * 1e3,
            "ms/request",
            baseline=r_full / n * 1e3,
            baseline_name=base,
            higher_is_better=False,
        ),
    ]


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--requests", type=int, nargs="+", default=[2000, 8000])
    ap.add_argument("--lanes", type=int, default=32)
    add_output_args(ap, "500 requests (a smoke run)")
    args = ap.parse_args()
    if args.quick:
        args.requests = [500]
    figs: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="kvc-bench-compact-") as d:
        for n in args.requests:
            f, _ = point(n, args.lanes, Path(d))
            figs.extend(f)
        figs.extend(long_point(10 if args.quick else 30, Path(d)))
    write_results(
        args.json,
        "compact",
        "Compact request storage (format 2.0): bundle bytes and CPU per request",
        figs,
        {"requests": args.requests, "lanes": args.lanes},
        ["CPU time (time.process_time), one pass each; baselines written in the same run"],
    )


if __name__ == "__main__":
    main()
