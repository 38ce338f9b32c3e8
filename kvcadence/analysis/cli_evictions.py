"""``kvcadence evictions``: a real worker's eviction trace against a replay's.

What this file owns: the ``evictions`` command (argparse only; ``analysis.evictions`` does
the work and is imported inside ``run``). The traces come from ``kvcadence harness start
--trace-evictions`` (the real worker) and ``kvcadence replay --trace-evictions`` (the
simulated one). Registered in ``kvcadence/cli.py``'s ``COMMAND_MODULES``.
"""

from __future__ import annotations

import argparse
import json
from typing import Any


def register(sub: Any) -> None:
    p = sub.add_parser(
        "evictions",
        help="compare two eviction traces (a real worker's and a replay's)",
        description=(
            "Compare the eviction calls of a real worker (harness start --trace-evictions) "
            "and of its replay (replay --trace-evictions): calls and tokens freed by cause "
            "(prefill, decode, check_decode, retract), how many stopped at their target and "
            "how many found nothing left to evict (a retraction follows), the decode "
            "allocations' demand per request, and the prefill batches of the same requests in "
            "both traces with how many asked for the same demand (docs/simulator.md, "
            '"Eviction traces").'
        ),
        epilog="examples:\n"
        "  kvcadence harness start --page-size 16 --max-total-tokens 4800 "
        "--trace-evictions real.jsonl\n"
        "  kvcadence drive --server URL --workload agent:lanes=6 --out run.kvcb\n"
        "  kvcadence replay run.kvcb --out sim.kvcb --trace-evictions sim.jsonl\n"
        "  kvcadence evictions real.jsonl sim.jsonl --bundles run.kvcb sim.kvcb\n",
    )
    p.add_argument("real", help="the real worker's trace (JSON lines)")
    p.add_argument("sim", help="the replay's trace (JSON lines)")
    p.add_argument(
        "--bundles",
        nargs=2,
        metavar=("CAPTURE", "SIM"),
        default=None,
        help="the capture and its replay: the prefill batches whose requests found the same "
        "cached prefix in both are compared apart (a different demand there is a different "
        "allocation rule, elsewhere a different cache); the differences listed are theirs",
    )
    p.add_argument("--json", action="store_true", help="print one JSON document")
    p.set_defaults(_run=run)


def run(args: argparse.Namespace) -> int:
    from kvcadence.analysis.evictions import compare, render

    doc = compare(args.real, args.sim, tuple(args.bundles) if args.bundles else None)
    print(json.dumps(doc, indent=1) if args.json else render(doc))
    return 0
