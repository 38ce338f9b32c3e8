"""Admission benchmark: per-request admission cost of kvcadence vs the REAL SGLang PrefillAdder.

The same queues (random L1 / L2 / extend mixes under a few budget sets, no CP limits) run
through ``kvcadence admit``'s tick loop with ``kvcadence.replay.admission.PrefillAdder`` here,
and through the real ``sglang.srt.managers.schedule_policy.PrefillAdder`` (0.5.23) with the
same fakes inside the SGLang venv (``sglang_adder_driver.py``, one subprocess). Both time only
the admission loop (adder construction, continuing chunk, queue scan); the cost is that time
divided by the number of ``add_one_req`` calls. Both runs are checked to produce identical
ticks first. Prints the ratio kvcadence / SGLang (goal <= 0.5).

    .venv/bin/python bench/bench_admit.py [--queues 40] [--repeats 5] [--seed 11] [--quick]
        [--json PATH]

(``--quick``: 8 queues, 2 repeats; ``--json``: the figures for ``bench/run``, see
``bench/common.py``.)
"""

from __future__ import annotations

import argparse
import random
import sys
import time

from common import add_output_args, figure, goal, write_results

from kvcadence.admit.real import compare, run_real_many, sglang_available
from kvcadence.admit.ticks import AdmitConfig, QueuedRequest, run_admission

CONFIGS = [
    AdmitConfig(available_tokens=400_000),
    AdmitConfig(available_tokens=60_000, page_size=16, chunked_prefill_size=-1),
    AdmitConfig(available_tokens=200_000, page_size=1, max_running_requests=64, drain=True),
]


def queues(n: int, seed: int) -> list[list[QueuedRequest]]:
    rng = random.Random(seed)
    out = []
    for q in range(n):
        size = rng.randint(16, 96)
        out.append(
            [
                QueuedRequest(
                    f"q{q}r{i}",
                    rng.choice([0, 0, 1024, 4096, rng.randrange(0, 8192)]),
                    rng.choice([0, 0, 0, 512, 4096, rng.randrange(0, 8192)]),
                    rng.choice([16, 128, 512, rng.randrange(1, 4096)]),
                    rng.choice([1, 64, 256]),
                )
                for i in range(size)
            ]
        )
    return out


def kvcadence_cost(cases, repeats: int) -> tuple[int, int]:
    total_ns = 0
    evaluated = 0
    for _ in range(repeats):
        for cfg, qs in cases:
            for q in qs:
                res = run_admission(q, cfg, clock=time.perf_counter_ns)
                total_ns += int(sum(t["duration_us"] for t in res.ticks) * 1000)
                evaluated += sum(t["evaluated"] for t in res.ticks)
    return total_ns, evaluated


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--queues", type=int, default=40)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--seed", type=int, default=11)
    add_output_args(ap, "8 queues, 2 repeats")
    args = ap.parse_args()
    if args.quick:
        args.queues, args.repeats = 8, 2
    ok, why = sglang_available()
    if not ok:
        print(f"bench_admit: skipped: {why}", file=sys.stderr)
        return 0
    qs = queues(args.queues, args.seed)
    cases = [(cfg, qs) for cfg in CONFIGS]
    t0 = time.perf_counter()
    reals = run_real_many(cases, timing_repeats=args.repeats)
    wall_real = time.perf_counter() - t0
    # same ticks first (otherwise the costs would not be comparable)
    for (cfg, q_list), real in zip(cases, reals, strict=True):
        for q, theirs in zip(q_list, real["results"], strict=True):
            diffs = compare(run_admission(q, cfg), theirs, cfg)
            if diffs:
                print("bench_admit: kvcadence and SGLang differ:", diffs[0], file=sys.stderr)
                return 1
    kv_ns, kv_n = kvcadence_cost(cases, args.repeats)
    sg_ns = sum(r["timing"]["admission_ns"] for r in reals)
    sg_n = sum(r["timing"]["evaluated"] for r in reals)
    if kv_n != sg_n:
        print(f"bench_admit: evaluated counts differ ({kv_n} vs {sg_n})", file=sys.stderr)
        return 1
    kv_us = kv_ns / kv_n / 1000
    sg_us = sg_ns / sg_n / 1000
    ratio = kv_us / sg_us
    n_req = sum(len(q) for q in qs) * len(CONFIGS)
    print(
        f"queues {len(qs)} x configs {len(CONFIGS)} ({n_req} requests), repeats {args.repeats}, "
        f"add_one_req calls {kv_n}; ticks identical to SGLang 0.5.23"
    )
    print(f"kvcadence PrefillAdder admission: {kv_us:8.2f} us per evaluated request")
    print(
        f"SGLang    PrefillAdder admission: {sg_us:8.2f} us per evaluated request "
        f"(subprocess wall incl. import {wall_real:.1f} s)"
    )
    verdict = "meets" if ratio <= 0.5 else "MISSES"
    print(f"ratio kvcadence / SGLang: {ratio:.3f}  ({verdict} the goal <= 0.5)")
    write_results(
        args.json,
        "admit",
        "Admission: kvcadence PrefillAdder model vs the real SGLang 0.5.23 PrefillAdder",
        [
            figure(
                "admission cost per evaluated request",
                kv_us,
                "us",
                baseline=sg_us,
                baseline_name="real sglang 0.5.23 PrefillAdder, same queues and fakes",
                higher_is_better=False,
                goal=goal("ratio", "<=", 0.5, "<= 0.5x of SGLang's"),
                note=f"{kv_n} add_one_req calls; ticks identical to SGLang",
            )
        ],
        params={"queues": len(qs), "configs": len(CONFIGS), "repeats": args.repeats},
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
