"""Sweep benchmark: a what-if sweep of a production capture, its bundle read once per process.

A sweep (``kvcadence replay --sweep``, ``replay.sweep.run_sweep``) runs one job per point; on
a production capture every job used to read the bundle and infer its outputs and sessions
again (``replay.production``), the same for every point. Each process now reads a bundle
once for all its jobs (``replay.bundlecache``). Measured on the production benchmark's
workload (``bench_production``: ``bench_replay.workload``, page 1, an evicting pool, copied
as the production capture of it): ``run_sweep`` of ``--points`` pool sizes in this process
(``jobs=1``: one process runs every job, as each process of a pool runs its share), CPU
time, the least of ``--repeat`` interleaved runs:

* the figure: the sweep as it runs (its bundle read by the first job, taken by the others);
* baseline: the same sweep with every job reading the bundle itself
  (``bundlecache.MAX_BUNDLES`` 0: nothing kept), what a sweep cost before.

Both sweeps write the same dataset (checked: every job's totals and per-rank figures).

    .venv/bin/python bench/bench_sweep.py [--requests 6000] [--points 4] [--repeat 3]
        [--quick] [--json PATH]
"""

from __future__ import annotations

import argparse
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

from bench_production import bench_config, capture_copy
from bench_replay import workload
from common import add_output_args, figure, goal, write_results

from kvcadence.replay import bundlecache
from kvcadence.replay.simulator import simulate, write_sim_bundle
from kvcadence.replay.sweep import run_sweep


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--requests", type=int, default=6000)
    ap.add_argument("--lanes", type=int, default=16)
    ap.add_argument("--pool", type=int, default=60_000)
    ap.add_argument("--points", type=int, default=4, help="pool sizes swept (jobs)")
    ap.add_argument("--repeat", type=int, default=3, help="runs of each sweep (the least)")
    add_output_args(ap, "600 requests, 3 points, one run (a smoke run)")
    args = ap.parse_args()
    if args.quick:
        args.requests, args.points, args.repeat = 600, 3, 1
    cfg = bench_config(args.pool)
    points = [{"max_total_tokens": args.pool * (4 + k) // 4} for k in range(args.points)]
    tmp = Path(tempfile.mkdtemp(prefix="kvc-bench-sweep-"))
    best: dict[str, float] = {}
    done: dict[str, Any] = {}
    kept = bundlecache.MAX_BUNDLES

    def sweep(key: str, keep: int, run: int) -> None:
        bundlecache.MAX_BUNDLES = keep
        out = tmp / f"{key}-{run}"
        c = time.process_time()
        res = run_sweep([tmp / "prod"], points, out, jobs=1)
        best[key] = min(best.get(key, float("inf")), time.process_time() - c)
        done[key] = [(r["totals"], r["per_rank"]) for r in res]
        shutil.rmtree(out)

    try:
        sim = tmp / "sim"
        write_sim_bundle(sim, simulate(workload(args.requests, args.lanes), cfg), None)
        capture_copy(sim, tmp / "prod", cfg, metrics_only=True)
        shutil.rmtree(sim)
        for run in range(args.repeat):  # interleaved: a busy spell hits both alike
            sweep("read per job", 0, run)
            sweep("read once", kept, run)
    finally:
        bundlecache.MAX_BUNDLES = kept
        shutil.rmtree(tmp, ignore_errors=True)
    if done["read once"] != done["read per job"]:
        raise SystemExit("the two sweeps disagree: a job changed what the jobs share")
    once, each = best["read once"], best["read per job"]
    print(
        f"{args.points}-point sweep of a {args.requests}-request production capture: "
        f"{once:.2f} s CPU with its bundle read once against {each:.2f} s read by every job "
        f"({once / each:.2f}x; {(each - once) / max(args.points - 1, 1):.2f} s saved a job "
        "after the first)"
    )
    write_results(
        args.json,
        "sweep",
        "A what-if sweep of a production capture: its bundle read once per process",
        [
            figure(
                f"{args.points}-point sweep CPU, production capture ({args.requests} requests)",
                once,
                "s",
                baseline=each,
                baseline_name="the same sweep, every job reading the bundle",
                higher_is_better=False,
                goal=goal("ratio", "<=", 0.85, "<= 0.85 x reading the bundle in every job"),
                note=f"{(each - once) / max(args.points - 1, 1):.2f} s saved a job after the "
                "first (records read, outputs and sessions inferred)",
            )
        ],
        params={
            "requests": args.requests,
            "lanes": args.lanes,
            "pool": args.pool,
            "points": args.points,
            "repeat": args.repeat,
        },
    )


if __name__ == "__main__":
    main()
