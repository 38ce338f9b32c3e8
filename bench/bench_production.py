"""Production-capture inference benchmark: what completing records without output ids and
lanes costs next to the replay itself (goal: at most 10 % of the replay's time).

The replay benchmark's workload (``bench_replay.workload``: closed-loop agent sessions,
page size 1, an evicting pool) is simulated once and written as a bundle (its events stand
for a real capture's); a copy keeps only what SGLang's ``--export-metrics-to-file`` holds
(no output ids, no lanes/sessions/turns, rids replaced). Measured, CPU time, on one core:

* the inference (``replay.production.records_for_replay`` minus reading the request
  records, which every replay does): decode the stored events, index them, recover the
  outputs, infer sessions and clients -- less the flush scan
  (``replay.flushes.recorded_flushes``) that the same pass replaces in a production replay;
* baseline: replaying the original bundle (driver records) with ``replay_bundle``.

    .venv/bin/python bench/bench_production.py [--requests 6000] [--quick] [--json PATH]
"""

from __future__ import annotations

import argparse
import random
import shutil
import tempfile
import time
from pathlib import Path

import msgspec
from bench_replay import workload
from common import add_output_args, figure, goal, write_results

from kvcadence.format.bundle import BundleReader, BundleWriter
from kvcadence.format.schema import Header, RequestRecord, Trailer
from kvcadence.replay.config import SimConfig, TimingParams
from kvcadence.replay.flushes import recorded_flushes
from kvcadence.replay.production import records_for_replay
from kvcadence.replay.simulator import replay_bundle, simulate, write_sim_bundle


def production_copy(src: Path, dst: Path) -> None:
    """``src`` with its request records stripped to SGLang's metrics-file fields."""
    rng = random.Random(15)
    rd = BundleReader(src)
    with BundleWriter(dst, rd.header) as w:
        for rec in rd.records():
            if isinstance(rec, (Header, Trailer)):
                continue
            if isinstance(rec, RequestRecord):
                rec = msgspec.structs.replace(
                    rec,
                    rid=f"{rng.getrandbits(128):032x}",
                    output_ids=[],
                    lane=None,
                    session=None,
                    turn=None,
                    think_ns=None,
                    arrival_ns=None,
                    source="sglang-metrics",
                )
            w.write(rec)


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--requests", type=int, default=6000)
    ap.add_argument("--lanes", type=int, default=16)
    ap.add_argument("--pool", type=int, default=60_000)
    add_output_args(ap, "600 requests (a smoke run)")
    args = ap.parse_args()
    if args.quick:
        args.requests = 600
    cfg = SimConfig(
        page_size=1,
        max_total_tokens=args.pool,
        chunked_prefill_size=8192,
        timing=TimingParams(
            prefill_base_s=0.012,
            prefill_per_token_s=2e-5,
            decode_base_s=0.004,
            decode_per_req_s=8e-5,
        ),  # fmt: skip
    ).validate()
    tmp = Path(tempfile.mkdtemp(prefix="kvc-bench-prod-"))
    try:
        real, prod = tmp / "real", tmp / "prod"
        write_sim_bundle(real, simulate(workload(args.requests, args.lanes), cfg), None)
        production_copy(real, prod)
        c = time.process_time()
        replay_bundle(real, None, cfg)
        replay_cpu = time.process_time() - c
        c = time.process_time()
        recs = BundleReader(prod).requests()
        read_cpu = time.process_time() - c
        c = time.process_time()
        _, rep, _ = records_for_replay(BundleReader(prod), recs)
        gross_cpu = time.process_time() - c
        c = time.process_time()
        recorded_flushes(BundleReader(prod))
        scan_cpu = time.process_time() - c
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    infer_cpu = gross_cpu - scan_cpu
    share = infer_cpu / replay_cpu
    print(
        f"{args.requests} requests: inference {gross_cpu:.3f} s CPU, less the flush scan its "
        f"pass replaces ({scan_cpu:.3f} s) = {infer_cpu:.3f} s (reading the records "
        f"{read_cpu:.3f} s, not counted); replay of the driver bundle {replay_cpu:.3f} s: "
        f"{share * 100:.1f} %; outputs from events {rep['outputs_from_events']}, synthetic "
        f"{sum(rep['outputs_synthetic'].values())}, sessions {rep['sessions']}"
    )
    write_results(
        args.json,
        "production",
        "Production-capture inference (outputs, sessions) vs the replay",
        [
            figure(
                "inference CPU per request (outputs + sessions from the events, net)",
                infer_cpu / args.requests * 1e6,
                "us",
                baseline=replay_cpu / args.requests * 1e6,
                baseline_name="replay CPU per request (driver records)",
                higher_is_better=False,
                goal=goal("ratio", "<=", 0.10, "<= 10 % of the replay's time"),
            )
        ],
        params={"requests": args.requests, "lanes": args.lanes, "pool": args.pool},
    )


if __name__ == "__main__":
    main()
