"""``kvcadence ranks``: per-rank figures, real vs sim per rank, routing what-if table.

What this file owns: the ``ranks`` command (argparse only; ``analysis.ranks`` does the work
and is imported inside ``run``):

* ``kvcadence ranks BUNDLE`` -- per-rank and total figures of one bundle;
* ``kvcadence ranks REAL --sim SIM`` -- real vs sim, rank by rank (delta per figure);
* ``kvcadence ranks REAL --what-if LABEL=SIM ...`` -- hit rate, events and blocks per
  request and evictions of several sim bundles side by side (one per routing policy),
  with the recorded hit rate next to each.

Registered by the lead in ``kvcadence/cli.py``'s ``COMMAND_MODULES``.
"""

from __future__ import annotations

import argparse
import json
from typing import Any


def register(sub: Any) -> None:
    p = sub.add_parser(
        "ranks",
        help="per-DP-rank figures, real vs sim per rank, routing what-if table",
        description=(
            "Per-rank cadence figures of a bundle; with --sim, real vs sim rank by rank; "
            "with --what-if LABEL=SIM_BUNDLE (repeatable), the routing what-if table."
        ),
        epilog="examples:\n"
        "  kvcadence ranks dp2.kvcb\n"
        "  kvcadence ranks dp2.kvcb --sim sim.kvcb\n"
        "  kvcadence ranks dp2.kvcb --what-if recorded=sim-rec.kvcb --what-if cache_aware=sim-ca.kvcb\n",
    )
    p.add_argument("bundle", help="the real (or any) bundle")
    p.add_argument("--sim", help="a sim bundle of the same capture to compare rank by rank")
    p.add_argument(
        "--what-if",
        action="append",
        default=[],
        metavar="LABEL=SIM_BUNDLE",
        help="a sim bundle of the same capture replayed under one routing policy, shown as "
        "row LABEL of the what-if table (repeatable)",
    )
    p.add_argument("--json", action="store_true", help="print one JSON document")
    p.set_defaults(_run=run)


_SHOW = (
    "requests",
    "messages",
    "stored_events_per_request",
    "removed_events_per_request",
    "stored_blocks_median",
    "removed_blocks_median",
    "removed_blocks_mean",
    "hit_rate",
)


def run(args: argparse.Namespace) -> int:
    from pathlib import Path

    from kvcadence.analysis import ranks
    from kvcadence.errors import UsageError

    for path in [args.bundle, args.sim] + [w.partition("=")[2] for w in args.what_if]:
        if path and not Path(path).exists():
            raise UsageError(f"{path}: no such bundle")
    out: dict[str, Any] = {}
    real = ranks.rank_figures(args.bundle)
    out["figures"] = {k: {f: v[f] for f in ranks.FIGURES} for k, v in real.items()}
    if args.sim:
        out["compare"] = ranks.compare_ranks(real, ranks.rank_figures(args.sim))
    if args.what_if:
        runs = []
        for w in args.what_if:
            label, sep, path = w.partition("=")
            if not sep or not label or not path:
                raise UsageError(f"--what-if {w!r}: expected LABEL=SIM_BUNDLE")
            runs.append((label, path))
        out["what_if"] = ranks.what_if_table(runs, args.bundle)
    if args.json:
        print(json.dumps(out, default=str, sort_keys=True))
        return 0
    rows = [{"rank": k, **v} for k, v in out["figures"].items()]
    print(ranks.format_rows(rows, ("rank",) + _SHOW))
    if "compare" in out:
        print()
        print(ranks.format_rows(out["compare"], ("rank", "figure", "real", "sim", "delta")))
    if "what_if" in out:
        print()
        print(
            ranks.format_rows(
                out["what_if"],
                (
                    "route",
                    "requests",
                    "hit_rate",
                    "recorded_hit_rate",
                    "events_per_request",
                    "stored_blocks_per_request",
                    "removed_blocks_per_request",
                    "evictions",
                ),
            )
        )
    return 0
