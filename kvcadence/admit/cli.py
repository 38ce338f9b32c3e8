"""``kvcadence admit``: the offline PrefillAdder admission benchmark (command registration).

Registers the ``admit`` subcommand with ``kvcadence.cli``. Imports only the standard library
and argparse at top level; the work lives in ``kvcadence.admit.ticks`` (tick loop, fakes,
outputs) and ``kvcadence.admit.inputs`` (synthetic grid, requests JSONL, bundle),
imported when the command runs.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

from kvcadence.argtypes import nonneg_float, nonneg_int, positive_int
from kvcadence.errors import UsageError

DESCRIPTION = """\
How does SGLang's PrefillAdder form prefill batches from a waiting queue, tick by tick, and
which budget stops each batch? Each request has an L1 (device radix) hit, an L2 (HiCache host)
hit and an extend length; an L2 hit is loaded back (all or nothing, page-aligned, consuming the
fake allocator's free tokens) or recomputed. Ticks repeat until the queue is empty or a tick
admits nothing. stopped_result: NO_TOKEN, OTHER:max_prefill, OTHER:chunk, OTHER:max_running,
OTHER:cp_total_extend, OTHER:cp_total_cached, OTHER:cp_batch_requests. duration_us is the
Python admission path only, not end-to-end latency.
"""

EPILOG = """\
examples:
  kvcadence admit --synthetic-grid --l1-cached-tokens 0,4096 --l2-cached-tokens 0,4096 \\
    --extend-tokens 128,2048 --available-tokens 20000 --max-prefill-tokens 16384 \\
    --cp-max-total-extend-tokens 65536 --cp-max-batch-requests 8 --output text
  kvcadence admit --requests-jsonl admission.jsonl --available-tokens 200000 \\
    --cp-max-total-extend-tokens 65536 --cp-max-total-cached-tokens 131072 --output json
  kvcadence admit --bundle run.kvcb --output text
  kvcadence admit --bundle run.kvcb --available-tokens 500 --chunked-prefill-size 256

With --bundle, --page-size, --chunked-prefill-size, --available-tokens (the KV pool),
--max-prefill-tokens and --max-running-requests default to the capture's /server_info
(the flags still override); the text output names where each came from.
"""

#: built-in defaults of the budget flags (used when neither a flag nor a bundle gives one)
DEFAULTS = {
    "page_size": 64,
    "chunked_prefill_size": 8192,
    "max_prefill_tokens": 16384,
    "max_running_requests": None,
}


def register(sub: Any) -> None:
    p = sub.add_parser(
        "admit",
        help="offline PrefillAdder admission benchmark (L1/L2/extend mixes, budgets, CP limits)",
        description=DESCRIPTION,
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    src = p.add_argument_group("waiting queue (exactly one source)")
    one = src.add_mutually_exclusive_group(required=True)
    one.add_argument(
        "--synthetic-grid",
        action="store_true",
        help="the Cartesian product of --l1-cached-tokens x --l2-cached-tokens x --extend-tokens",
    )
    one.add_argument(
        "--requests-jsonl",
        metavar="FILE",
        help='one request per line: {"rid":"r0","l1_cached_tokens":40320,'
        '"l2_cached_tokens":0,"extend_tokens":128} (+ optional max_new_tokens, priority)',
    )
    one.add_argument(
        "--bundle",
        metavar="B",
        help="a capture bundle: each request's cached tokens at admission (L1 = cached_tokens, "
        "L2 = the host part when SGLang reported one), extend = prompt - cached; the budgets "
        "default to its /server_info",
    )
    src.add_argument(
        "--l1-cached-tokens",
        default="0",
        metavar="LIST",
        help="grid: L1 (device) cached tokens, comma list (default 0)",
    )
    src.add_argument(
        "--l2-cached-tokens",
        default="0",
        metavar="LIST",
        help="grid: L2 (host) cached tokens, comma list (default 0)",
    )
    src.add_argument(
        "--extend-tokens",
        default="128",
        metavar="LIST",
        help="grid: tokens to prefill beyond the cached ones, comma list (default 128)",
    )
    src.add_argument(
        "--repeat",
        type=positive_int,
        default=1,
        metavar="N",
        help="repeat the grid N times (default 1)",
    )
    src.add_argument(
        "--max-new-tokens",
        type=nonneg_int,
        default=None,
        help="max_new_tokens of requests that do not set it (default 128)",
    )

    b = p.add_argument_group("budgets (SGLang's scheduler arguments)")
    b.add_argument(
        "--available-tokens",
        type=nonneg_int,
        default=None,
        metavar="N",
        help="free KV slots of the fake allocator (the waiting requests' L1 prefixes are "
        "resident on top of this, evictable until admitted); required unless --bundle "
        "records the KV pool (max_total_num_tokens)",
    )
    b.add_argument(
        "--max-prefill-tokens",
        type=nonneg_int,
        default=None,
        metavar="N",
        help="prefill token budget per tick (default: the bundle's, else 16384)",
    )
    b.add_argument(
        "--chunked-prefill-size",
        type=int,
        default=None,
        metavar="N",
        help="chunk budget per tick; -1 or 0 disables chunking (default: the bundle's, else 8192)",
    )
    b.add_argument(
        "--page-size",
        type=positive_int,
        default=None,
        metavar="N",
        help="tokens per KV page (default: the bundle's, else 64)",
    )
    b.add_argument(
        "--max-running-requests",
        type=positive_int,
        default=None,
        metavar="N",
        help="scheduler cap: stop when the batch reaches max_running - running (default: the "
        "bundle's, else none)",
    )
    b.add_argument(
        "--new-token-ratio",
        type=nonneg_float,
        default=0.7,
        help="decode reservation ratio for running requests (default 0.7, SGLang's initial)",
    )
    b.add_argument(
        "--semantics",
        choices=("classic", "0.5.23"),
        default="0.5.23",
        help="PrefillAdder generation (default 0.5.23): 0.5.23 (extra page per request, input cap only without "
        "chunking, raw log_input_tokens, chunk decided before the L2 load) or classic "
        "(0.5.6-0.5.9: input cap also with chunking, page-ceiled log_input_tokens, load first)",
    )
    b.add_argument(
        "--load-back-threshold",
        type=nonneg_int,
        default=10,
        help="an L2 hit below this many tokens is not loaded back (default 10, as SGLang)",
    )

    cp = p.add_argument_group(
        "CP shared-KV prefill limits",
        "kvcadence's model of the CP shared-KV branch's scheduler rules -- NOT upstream "
        "SGLang (upstream has no such budgets). Only for batches of more than one request: "
        "accepted requests' tokens accumulate page-aligned; a request that would exceed a "
        "limit stops the batch when it is not empty; a single request over a limit runs alone.",
    )
    cp.add_argument("--cp-max-total-extend-tokens", type=positive_int, default=None, metavar="N",
                    help="limit on the batch's page-aligned extend tokens (default: none)")  # fmt: skip
    cp.add_argument("--cp-max-total-cached-tokens", type=positive_int, default=None, metavar="N",
                    help="limit on the batch's page-aligned cached tokens (default: none)")  # fmt: skip
    cp.add_argument("--cp-max-batch-requests", type=positive_int, default=None, metavar="N",
                    help="limit on the requests in one batch (default: none)")  # fmt: skip

    o = p.add_argument_group("run and output")
    o.add_argument(
        "--drain",
        action="store_true",
        help="running requests finish between ticks and free their KV (default: they keep it)",
    )
    o.add_argument("--max-ticks", type=positive_int, default=100_000, metavar="N",
                   help="stop after N ticks (default 100000)")  # fmt: skip
    o.add_argument("--output", choices=("text", "json", "jsonl"), default="text",
                   help="text (a table per tick), json (one document) or jsonl (a line per "
                   "tick) (default text)")  # fmt: skip
    o.add_argument("--out", metavar="FILE", help="write the output here instead of stdout")
    o.add_argument("--force", action="store_true", help="replace an existing --out file")
    p.set_defaults(_run=run)


def run(args: argparse.Namespace) -> int:
    from kvcadence.admit.inputs import (
        parse_int_list,
        read_requests_jsonl,
        requests_from_bundle,
        synthetic_grid,
    )
    from kvcadence.admit.render import render
    from kvcadence.admit.ticks import DEFAULT_MAX_NEW_TOKENS, AdmitConfig, run_admission

    if args.out:  # checked before any work: never replaced without --force, never in a bundle
        from kvcadence.outguard import refuse_out_file

        refuse_out_file(args.out, "--out", force=args.force)
    mnt = DEFAULT_MAX_NEW_TOKENS if args.max_new_tokens is None else args.max_new_tokens
    if args.synthetic_grid:
        specs = synthetic_grid(
            parse_int_list(args.l1_cached_tokens, "--l1-cached-tokens"),
            parse_int_list(args.l2_cached_tokens, "--l2-cached-tokens"),
            parse_int_list(args.extend_tokens, "--extend-tokens"),
            repeat=args.repeat,
            max_new_tokens=mnt,
        )
    elif args.requests_jsonl:
        specs = read_requests_jsonl(args.requests_jsonl, max_new_tokens=mnt)
    else:
        specs = requests_from_bundle(args.bundle, max_new_tokens=mnt)
    if args.new_token_ratio != args.new_token_ratio:  # NaN
        raise UsageError("--new-token-ratio must be a number")
    budgets = resolve_budgets(args)
    cfg = AdmitConfig(
        available_tokens=budgets["available_tokens"],
        max_prefill_tokens=budgets["max_prefill_tokens"],
        chunked_prefill_size=budgets["chunked_prefill_size"],
        page_size=budgets["page_size"],
        max_running_requests=budgets["max_running_requests"],
        new_token_ratio=args.new_token_ratio,
        semantics=args.semantics,
        cp_max_total_extend_tokens=args.cp_max_total_extend_tokens,
        cp_max_total_cached_tokens=args.cp_max_total_cached_tokens,
        cp_max_batch_requests=args.cp_max_batch_requests,
        drain=args.drain,
        load_back_threshold=args.load_back_threshold,
        max_ticks=args.max_ticks,
    )
    result = run_admission(specs, cfg)
    if args.bundle and args.output == "text":
        print(f"admit: settings {_origin_line(args, budgets)}", file=sys.stderr)
    if args.out:
        try:
            with open(args.out, "w", encoding="utf-8") as fh:
                render(result, args.output, fh)
        except OSError as exc:
            raise UsageError(f"--out {args.out}: {exc.strerror or exc}") from None
    else:
        render(result, args.output, sys.stdout)
    return 0


def resolve_budgets(args: argparse.Namespace) -> dict[str, Any]:
    """The budget settings: a flag when given, else (``--bundle``) the capture's
    ``/server_info``, else ``DEFAULTS``. ``UsageError`` when no KV pool is known."""
    from_bundle: dict[str, int] = {}
    if args.bundle:
        from kvcadence.admit.inputs import bundle_settings

        from_bundle = bundle_settings(args.bundle)
    out: dict[str, Any] = {}
    for dest in ("available_tokens", *DEFAULTS):
        flag = getattr(args, dest)
        out[dest] = flag if flag is not None else from_bundle.get(dest, DEFAULTS.get(dest))
    if out["available_tokens"] is None:
        where = (
            f"{args.bundle} records no KV pool (max_total_num_tokens)"
            if args.bundle
            else "no --bundle"
        )
        raise UsageError(f"admit needs --available-tokens N ({where})")
    args._from_bundle = {k for k in from_bundle if getattr(args, k) is None}
    return out


def _origin_line(args: argparse.Namespace, budgets: dict[str, Any]) -> str:
    """``page 1 (bundle), chunk 4096 (bundle), pool 500 (flag), ...``."""
    names = {
        "page_size": "page",
        "chunked_prefill_size": "chunk",
        "available_tokens": "pool",
        "max_prefill_tokens": "max_prefill",
        "max_running_requests": "max_running",
    }
    used: set[str] = getattr(args, "_from_bundle", set())
    parts = []
    for dest, name in names.items():
        origin = (
            "bundle" if dest in used else ("flag" if getattr(args, dest) is not None else "default")
        )
        parts.append(f"{name} {budgets[dest]} ({origin})")
    return ", ".join(parts)
