"""``kvcadence replay`` across DP ranks, workers and parameter points (flags + dispatch).

What this file owns: the flags ``--route``, ``--sweep``, ``--jobs``, ``--each``,
``--align-workers``, ``--pace``, ``--executor`` added to the ``replay`` parser
(``add_fleet_args``), and
``maybe_run_fleet(args)``, which ``replay.cli.run`` calls first: it runs the fleet replay
(``replay.fleet``) when several bundles are given, a ``--route`` is asked for, the bundle
was captured from a ``--dp-size N > 1`` worker, or a sweep (``replay.sweep``) is asked for;
otherwise it returns ``None`` and the single-rank replay proceeds unchanged, paced as
``replay_pace(args)`` says (``auto``: recorded when its requests queued).
Imports only the standard library at module level.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from collections.abc import Sized
from typing import Any

from kvcadence.argtypes import positive_int

ROUTE_CHOICES = ("recorded", "round_robin", "shortest_queue", "cache_aware")
PACE_CHOICES = ("auto", "recorded", "model")  # = replay.fleet.PACES (not imported: stdlib only)
EXECUTOR_CHOICES = ("process", "ray")  # = replay.executors.EXECUTORS


def add_fleet_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("DP ranks, several workers, sweeps")
    g.add_argument(
        "--route",
        choices=ROUTE_CHOICES,
        help="route requests over the simulated ranks (of all bundles): the recorded rank "
        "(default for a multi-rank capture), round_robin, shortest_queue, or cache_aware "
        "(longest prefix in the ranks' *published* events; ties: fewest waiting tokens)",
    )
    g.add_argument(
        "--sweep",
        action="append",
        default=[],
        metavar="KEY=V1,V2,...",
        help="replay every point of the cartesian product of these settings (any override "
        "above, or route) in parallel processes; --out is then a Parquet dataset directory "
        "partitioned by worker/rank/route/KEY",
    )
    g.add_argument(
        "--jobs",
        type=positive_int,
        help="parallel processes for --sweep (default: CPUs); with --executor ray: the "
        "private instance's CPUs, or the tasks in flight on a RAY_ADDRESS cluster (default: all)",
    )
    g.add_argument(
        "--executor",
        choices=EXECUTOR_CHOICES,
        default="process",
        help="where --sweep jobs run: 'process' (default) = a local process pool; 'ray' = Ray "
        "tasks (pip install 'kvcadence[ray]') on the cluster at $RAY_ADDRESS, or, when "
        "RAY_ADDRESS is unset, on a private Ray instance started for this run on 127.0.0.1 "
        "(--jobs CPUs, no dashboard) and stopped at its end; every node must read the bundles "
        "at the same path; the same Parquet dataset either way (docs/fleet.md)",
    )
    g.add_argument(
        "--each",
        action="store_true",
        help="with several bundles and --sweep: replay each bundle on its own (not as a fleet)",
    )
    g.add_argument(
        "--align-workers",
        action="store_true",
        help="start every bundle's schedule at virtual time 0 (default: recorded wall clock)",
    )
    g.add_argument(
        "--pace",
        choices=PACE_CHOICES,
        default="auto",
        help="pass times of the simulated ranks: 'recorded' keeps each rank on the pace its "
        "requests' outputs were recorded at (the pass-time model clamped to 0.5-2x; a "
        "single-rank replay too; requests without per-phase timings keep the model), 'model' "
        "uses the pass-time model alone; 'auto' (default) = recorded under --route recorded "
        "with a calibrated pass-time model for a multi-rank worker and for one rank whose "
        "requests queued (a median wait of 1 s or more from receive to first forward); "
        "else model",
    )


def _overrides(args: argparse.Namespace) -> dict[str, Any]:
    from kvcadence.replay.config import CLI_OVERRIDES

    return {k: getattr(args, k, None) for k in CLI_OVERRIDES}


def replay_pace(args: argparse.Namespace) -> str:
    """``--pace``; ``auto`` becomes ``model`` under ``--no-calibrate`` (the built-in pass
    times are no base for the recorded pace)."""
    pace = getattr(args, "pace", None) or "auto"
    return "model" if pace == "auto" and getattr(args, "no_calibrate", False) else pace


def needs_fleet(args: argparse.Namespace, bundles: list[str]) -> bool:
    """Whether ``args`` ask for the fleet replay: several bundles, ``--route``, ``--sweep``
    or a bundle of several DP ranks."""
    if len(bundles) > 1 or getattr(args, "route", None) or getattr(args, "sweep", None):
        return True
    from pathlib import Path

    from kvcadence.format.bundle import BundleReader
    from kvcadence.replay.worker import bundle_dp_size

    p = Path(bundles[0])
    if not p.exists():
        return False  # the single-rank path reports it
    return bundle_dp_size(BundleReader(p))[0] > 1  # streamed


def maybe_run_fleet(args: argparse.Namespace) -> int | None:
    """Run the fleet / sweep replay if ``args`` ask for it; else normalise ``args.bundle``."""
    bundles = args.bundle if isinstance(args.bundle, list) else [args.bundle]
    for name, default in (
        ("route", None),
        ("sweep", []),
        ("jobs", None),
        ("each", False),
        ("pace", "auto"),
        ("executor", "process"),
    ):
        if not hasattr(args, name):
            setattr(args, name, default)
    if not hasattr(args, "align_workers"):
        args.align_workers = False
    if args.executor != "process" and not args.sweep:
        from kvcadence.errors import UsageError

        raise UsageError(
            f"replay: --executor {args.executor} runs --sweep jobs; a replay without --sweep "
            "is one simulation (give a one-point sweep, e.g. --sweep route=recorded)"
        )
    if not needs_fleet(args, bundles):
        args.bundle = bundles[0]
        return None
    from kvcadence.errors import UsageError

    if args.publish:
        raise UsageError(
            "replay: live --publish simulates one rank; use --out for several ranks/workers"
        )
    if args.out is None:
        raise UsageError("replay: give --out (a sim bundle, or a directory for several workers)")
    if args.sweep:
        return _run_sweep(args, bundles)
    return _run_fleet(args, bundles)


def _run_fleet(args: argparse.Namespace, bundles: list[str]) -> int:
    from kvcadence.progress import Phases
    from kvcadence.replay.fleet import simulate_fleet
    from kvcadence.replay.fleetout import FleetOut
    from kvcadence.replay.settings import namespace_note
    from kvcadence.replay.worker import load_worker

    quiet = getattr(args, "quiet", False)
    phases = Phases("replay", quiet=quiet, started=getattr(args, "_started", None))
    from kvcadence.format.texttokens import load_tokenizer

    ov = _overrides(args)
    out = FleetOut(args.out)  # refused before any work when it exists and is not empty
    tok = load_tokenizer(getattr(args, "tokenizer", None))
    with phases.phase("load", f"loading {', '.join(bundles)}"):
        workers = [
            load_worker(
                b,
                ov,
                sglang_version=args.sglang_version,
                calibrate_timing=not args.no_calibrate,
                tokenizer=tok,
            )
            for b in bundles
        ]
    for w in workers:
        if w.settings_note and not quiet:
            print(f"replay: warning: {w.path}: {w.settings_note}", file=sys.stderr)
        ns_note = namespace_note(w.records)
        if ns_note and not quiet:
            print(f"replay: warning: {w.path}: {ns_note}", file=sys.stderr)
    total = sum(len(w.records) for w in workers if isinstance(w.records, Sized))  # lists here
    bar = None
    progress = None
    if not quiet and sys.stderr.isatty() and total >= 200:
        from tqdm import tqdm

        bar = tqdm(total=total, unit="req", desc="replay", file=sys.stderr)
        progress = bar.update
    try:
        with phases.phase("simulate", f"simulating {total} requests"):
            result = simulate_fleet(
                workers,
                args.route or "recorded",
                align_workers=args.align_workers,
                progress=progress,
                pace=replay_pace(args),
                event_log=False,  # only the bundles are written (cache_aware keeps its own)
                out=out,  # every rank's batches written as they are published
            )
    finally:
        if bar is not None:
            bar.close()
    from kvcadence.replay.simulator import check_some_ran

    with phases.phase("write", f"writing {args.out}"):
        paths = out.finish(result)
    args._out_complete = True  # written whole: a closed stdout (``| head``) keeps it
    summary = result.summary()
    summary["simulate_s"] = summary.pop("wall_s")
    summary["wall_s"] = round(phases.wall(), 3)  # the whole command
    summary["phases_s"] = {k: round(v, 3) for k, v in phases.times.items()}
    summary["out"] = [str(p) for p in paths]
    summary["aborted"] = sum(p["aborted"] for p in summary["per_rank"])
    from kvcadence.replay.timing import given_terms, model_line

    timings = []
    for w in workers:
        cals = w.calibrations
        if len(cals) != len(w.rank_configs):  # not read by ``load_worker``: not known
            cals = [{} for _ in w.rank_configs]
        for cfg, cal in zip(w.rank_configs, cals, strict=True):
            timings.append((w, cfg, cal, given_terms(cfg.timing, ov)))
    summary["timing"] = [
        {
            "worker": w.name,
            "rank": cfg.attn_dp_rank,
            "timing": dataclasses.asdict(cfg.timing),
            "calibration": {**cal, "given": given},
        }
        for w, cfg, cal, given in timings
    ]
    if args.json:
        print(json.dumps(summary, sort_keys=True))
    else:
        print(
            f"replayed {summary['requests']} requests on {summary['ranks']} rank(s) of "
            f"{summary['workers']} worker(s), route {summary['route']} -> "
            f"{', '.join(summary['out'])}: {summary['events']} events in "
            f"{summary['messages']} messages, {summary['evictions']} evictions, "
            f"{summary['aborted']} aborted; virtual {summary['virtual_s']:.3f} s, "
            f"wall {summary['wall_s']:.2f} s ({phases.breakdown()})"
        )
        from kvcadence.replay.inferred import held_before_text

        for p in summary["per_rank"]:
            print(
                f"  {p['worker']} rank {p['rank']}: {p['requests']} requests, "
                f"{p['messages']} messages, {p['events']} events, {p['evictions']} evictions, "
                f"{p['aborted']} aborted"
                + (
                    f", {held_before_text(p['held_before_tokens'])}"
                    if p.get("held_before_tokens")
                    else ""
                )
            )
        for w, cfg, cal, given in timings:  # each rank's pass-time model, as calibrated
            text = model_line(cfg.timing, cal, given, calibrated=not args.no_calibrate)
            print(f"  {w.name} rank {cfg.attn_dp_rank}: {text}")
        for w in workers:  # production captures: what was inferred, as the single replay says
            if w.inferred:
                from kvcadence.replay.inferred import report_text

                print(f"  {w.name}: {report_text(w.inferred)}")
    check_some_ran(result.requests)
    return 0


def _run_sweep(args: argparse.Namespace, bundles: list[str]) -> int:
    import time

    from kvcadence.replay.sweep import run_sweep
    from kvcadence.replay.sweeppoints import parse_sweep, point_label

    points = parse_sweep(args.sweep)
    t0 = time.perf_counter()
    quiet = args.json

    def done(res: dict[str, Any]) -> None:
        if not quiet:
            print(
                f"  job {res['job']} {point_label(res['point'])}: {res['requests']} requests "
                f"in {res['job_wall_s']:.2f} s",
                file=sys.stderr,
            )

    results = run_sweep(
        bundles,
        points,
        args.out,
        overrides=_overrides(args),
        route=args.route or "recorded",
        each=args.each,
        jobs=args.jobs,
        sglang_version=args.sglang_version,
        calibrate=not args.no_calibrate,
        align_workers=args.align_workers,
        on_done=done,
        pace=replay_pace(args),
        executor=args.executor,
        tokenizer=getattr(args, "tokenizer", None),
    )
    args._out_complete = True  # the dataset is whole: a closed stdout keeps it
    wall = time.perf_counter() - t0
    table = [what_if_row(r) for r in results]
    if args.json:
        print(json.dumps({"jobs": table, "wall_s": round(wall, 3), "out": args.out}))
        return 0
    print(format_what_if(table))
    n_req = sum(r["requests"] for r in results)
    print(
        f"{len(results)} job(s), {n_req} requests replayed in {wall:.2f} s "
        f"({n_req / wall:.0f} requests/s) -> {args.out}"
    )
    return 0


def what_if_row(res: dict[str, Any]) -> dict[str, Any]:
    """One line of the what-if table from a job summary (``replay.sweep.run_job``)."""
    from kvcadence.format import hitrate

    t = res["totals"]
    n = max(t["requests"], 1)
    return {
        "job": res["job"],
        "point": res["point"],
        "bundles": res["bundles"],
        "requests": t["requests"],
        "hit_rate": hitrate.hit_rate(t["cached_tokens"], t["prompt_tokens"]) or 0.0,
        "recorded_hit_rate": hitrate.hit_rate(t["recorded_cached_tokens"], t["prompt_tokens"])
        or 0.0,
        "events_per_request": t["events"] / n,
        "stored_events_per_request": t["stored_events"] / n,
        "removed_events_per_request": t["removed_events"] / n,
        "stored_blocks_per_request": t["stored_blocks"] / n,
        "removed_blocks_per_request": t["removed_blocks"] / n,
        "evictions": res["evictions"],
        "messages": t["messages"],
        "off_recorded_rank": t["off_recorded_rank"],
    }


def format_what_if(rows: list[dict[str, Any]]) -> str:
    from kvcadence.replay.sweeppoints import point_label

    several = len({tuple(r["bundles"]) for r in rows}) > 1  # --each: one job per bundle
    labels = []
    for r in rows:
        label = point_label(r["point"])
        if several:
            label = f"{r['bundles'][0].rstrip('/').rsplit('/', 1)[-1]}:{label}"
        labels.append(label)
    w = max([40, *(len(label) for label in labels)])  # a point is never cut short
    head = (
        f"{'point':<{w}} {'req':>5} {'hit':>6} {'real hit':>8} {'ev/req':>7} {'St/req':>7} "
        f"{'Rm/req':>7} {'blk St/req':>10} {'blk Rm/req':>10} {'evict':>6} {'moved':>6}"
    )
    lines = [head, "-" * len(head)]
    for r, label in zip(rows, labels, strict=True):
        lines.append(
            f"{label:<{w}} {r['requests']:>5} {r['hit_rate']:>6.3f} "
            f"{r['recorded_hit_rate']:>8.3f} {r['events_per_request']:>7.3f} "
            f"{r['stored_events_per_request']:>7.3f} {r['removed_events_per_request']:>7.3f} "
            f"{r['stored_blocks_per_request']:>10.1f} {r['removed_blocks_per_request']:>10.1f} "
            f"{r['evictions']:>6} {r['off_recorded_rank']:>6}"
        )
    return "\n".join(lines)
