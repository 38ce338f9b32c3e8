"""Fleet replay and sweep benchmark: N ranks in one clock, routing policies, parallel sweeps.

Workload: ``bench_replay.workload`` (closed-loop multi-turn agent lanes, page size 1), its
lanes spread over 2 DP ranks (recorded rank = lane % 2), pool per rank = half the
single-rank pool. Reported, each against a baseline measured in the same run:

* fleet (2 ranks, ``recorded``) requests/s (CPU) vs the single-rank replay of the same
  requests (``simulate``: the same driver with one rank, the whole pool): the cost of the
  lock-step clock over several ranks;
* ``cache_aware`` vs ``recorded`` (the router index and prompt hashing);
* a sweep of 4 points with ``--jobs`` processes vs the same 4 points one after another
  in this process (wall time; on the 2-core box at most ~2x).

    .venv/bin/python bench/bench_fleet.py [--requests 2000] [--jobs 2] [--quick] [--json PATH]
"""

from __future__ import annotations

import argparse
import copy
import tempfile
import time
from pathlib import Path

from bench_replay import workload
from common import add_output_args, figure, write_results

from kvcadence.replay.config import SimConfig, TimingParams
from kvcadence.replay.fleet import simulate_fleet
from kvcadence.replay.simulator import simulate
from kvcadence.replay.worker import WorkerInput


def cfg(pool: int, rank: int = 0) -> SimConfig:
    c = SimConfig(
        page_size=1,
        max_total_tokens=pool,
        chunked_prefill_size=8192,
        attn_dp_rank=rank,
        timing=TimingParams(
            prefill_base_s=0.012,
            prefill_per_token_s=2e-5,
            decode_base_s=0.004,
            decode_per_req_s=8e-5,
        ),
    )
    if hasattr(c, "track_visibility"):
        c.track_visibility = False  # both sides without the visibility log: time the clock
    return c.validate()


def cpu(fn):
    c = time.process_time()
    out = fn()
    return out, time.process_time() - c


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--requests", type=int, default=2000)
    ap.add_argument("--lanes", type=int, default=16)
    ap.add_argument("--pool", type=int, default=60_000)
    ap.add_argument("--jobs", type=int, default=2)
    add_output_args(ap, "400 requests (a smoke run)")
    args = ap.parse_args()
    if args.quick:
        args.requests = 400
    recs = workload(args.requests, args.lanes)
    for r in recs:
        r.dp_rank = r.lane % 2
    n = len(recs)
    single, t_single = cpu(lambda: simulate(copy.deepcopy(recs), cfg(args.pool)))
    w = WorkerInput("bench", recs, [cfg(args.pool // 2, 0), cfg(args.pool // 2, 1)])
    rec, t_rec = cpu(lambda: simulate_fleet([w], "recorded"))
    aware, t_aware = cpu(lambda: simulate_fleet([w], "cache_aware"))

    def hit(res) -> float:
        reqs = res.requests
        return sum(r.cached_tokens or 0 for r in reqs) / sum(r.prompt_tokens for r in reqs)

    print(f"{n} requests, {args.lanes} lanes, pool {args.pool} (2 ranks: {args.pool // 2} each)")
    print(f"single rank simulate : {t_single:.3f} s CPU = {n / t_single:,.0f} req/s")
    print(
        f"fleet 2 ranks recorded: {t_rec:.3f} s CPU = {n / t_rec:,.0f} req/s "
        f"(ratio {t_single / t_rec:.2f} of single-rank speed), hit {hit(rec):.3f}"
    )
    print(
        f"fleet cache_aware     : {t_aware:.3f} s CPU = {n / t_aware:,.0f} req/s "
        f"(ratio {t_rec / t_aware:.2f} of recorded), hit {hit(aware):.3f}"
    )
    # sweep: write a source bundle, then 4 points serially in-process vs parallel processes
    from kvcadence.format.bundle import BundleWriter
    from kvcadence.format.schema import EndpointInfo, Header
    from kvcadence.replay.sweep import run_job, run_sweep
    from kvcadence.replay.sweeppoints import parse_sweep

    with tempfile.TemporaryDirectory() as tmp:
        src = Path(tmp) / "src"
        info = {"page_size": 1, "max_total_num_tokens": args.pool // 2, "dp_size": 2}
        eps = [EndpointInfo(i, "", None, i, "kv-events") for i in range(2)]
        with BundleWriter(
            src, Header(1, 0, "real", "bench", "0.5.23", info, None, [], 0, eps)
        ) as bw:
            for r in recs:
                bw.write(r)
            bw.close()
        points = parse_sweep(["route=recorded,round_robin,shortest_queue,cache_aware"])
        t = time.perf_counter()
        for i, p in enumerate(points):
            run_job({"job": i, "bundles": [str(src)], "point": p, "out": str(Path(tmp) / "serial")})
        serial = time.perf_counter() - t
        t = time.perf_counter()
        run_sweep([src], points, Path(tmp) / "par", jobs=args.jobs)
        par = time.perf_counter() - t
    total = n * len(points)
    print(
        f"sweep {len(points)} points: serial {serial:.2f} s ({total / serial:,.0f} req/s), "
        f"{args.jobs} processes {par:.2f} s ({total / par:,.0f} req/s), speed-up {serial / par:.2f}x"
    )
    write_results(
        args.json,
        "fleet",
        "Fleet replay (2 DP ranks) and parallel sweeps",
        [
            figure(
                "fleet 2 ranks recorded, requests/s (CPU)",
                n / t_rec,
                "requests/s",
                baseline=n / t_single,
                baseline_name="single-rank simulate of the same requests",
            ),
            figure(
                "fleet cache_aware, requests/s (CPU)",
                n / t_aware,
                "requests/s",
                baseline=n / t_rec,
                baseline_name="fleet recorded",
            ),
            figure(
                f"sweep of 4 routes with {args.jobs} processes, requests/s (wall)",
                total / par,
                "requests/s",
                baseline=total / serial,
                baseline_name="the same 4 points one after another in one process",
            ),
        ],
        {"requests": n, "lanes": args.lanes, "pool_tokens": args.pool, "jobs": args.jobs},
        ["CPU time for the simulations, wall time for the sweep"],
    )


if __name__ == "__main__":
    main()
