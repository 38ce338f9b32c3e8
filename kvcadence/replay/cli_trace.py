"""``kvcadence replay --trace FILE``: the offline-trace flags and their run (no capture).

What this file owns: the flags ``--trace``, ``--trace-format``, ``--server-info``,
``--block-tokens``, ``--trace-speedup``, ``--trace-limit`` added to the ``replay`` parser
(``add_trace_args``) and ``run_trace(args, overrides, phases)``, which ``replay.cli.run``
calls when ``--trace`` is given: read the trace (``replay.trace``), build the simulator's
settings from ``--server-info`` and the flags, simulate, write the sim bundle. Imports only
the standard library at module level.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

from kvcadence.argtypes import positive_float

TRACE_FORMAT_CHOICES = ("auto", "mooncake", "requests")  # = replay.trace.TRACE_FORMATS + auto
#: fleet flags that need bundles (their defaults: not asked for)
_FLEET_FLAGS: tuple[tuple[str, Any], ...] = (
    ("route", None),
    ("sweep", []),
    ("each", False),
    ("align_workers", False),
)


def add_trace_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group(
        "offline traces (no capture: give --trace FILE instead of BUNDLE; docs/simulator.md)"
    )
    g.add_argument(
        "--trace",
        metavar="FILE",
        help="replay a trace file instead of a bundle: a Mooncake-format JSONL (timestamp, "
        "input_length, output_length, hash_ids) or a requests JSONL (import --requests' "
        "format); server settings from --server-info and the flags above",
    )
    g.add_argument(
        "--trace-format",
        choices=TRACE_FORMAT_CHOICES,
        default="auto",
        dest="trace_format",
        help="the trace's format (default auto: told from the first line)",
    )
    g.add_argument(
        "--server-info",
        metavar="FILE",
        dest="server_info",
        help="a /server_info JSON of the worker to simulate (page_size, max_total_num_tokens, "
        "chunked_prefill_size, version, ...); flags override it; without it the simulator's "
        "defaults (page size 1, 100000-token pool, SGLang 0.5.23)",
    )
    g.add_argument(
        "--block-tokens",
        type=int,
        default=16,
        dest="block_tokens",
        metavar="N",
        help="Mooncake: tokens per hash id, as drive's mooncake block_tokens (default 16; "
        "the public Mooncake traces use 512)",
    )
    g.add_argument(
        "--trace-speedup",
        type=positive_float,
        default=1.0,
        dest="trace_speedup",
        metavar="X",
        help="Mooncake: divide the timestamps by X (default 1: the trace's own pace)",
    )
    g.add_argument(
        "--trace-limit",
        type=int,
        default=0,
        dest="trace_limit",
        metavar="N",
        help="replay only the first N requests of the trace (default 0: all)",
    )


def run_trace(args: argparse.Namespace, overrides: dict[str, Any], phases: Any) -> tuple[Any, Any]:
    """Replay ``args.trace``; ``(SimResult, SimConfig)``. ``UsageError`` for flags that need
    a bundle; ``InputError`` (``file:line``) for a bad trace line."""
    from pathlib import Path

    from kvcadence.errors import UsageError
    from kvcadence.format.jsonl import read_server_info
    from kvcadence.progress import request_bar
    from kvcadence.replay.trace import read_trace, replay_trace, trace_config

    if args.bundle:
        raise UsageError("replay: give BUNDLE or --trace FILE, not both")
    for name, default in _FLEET_FLAGS:
        if getattr(args, name, default) != default:
            flag = "--" + name.replace("_", "-")
            raise UsageError(f"replay --trace simulates one worker; {flag} needs bundles")
    path = Path(args.trace)
    if not path.exists():
        raise UsageError(f"--trace {path}: no such file")
    info_json = read_server_info(Path(args.server_info)) if args.server_info else {}
    with phases.phase("load", f"reading {path}"):
        records, info = read_trace(
            path,
            args.trace_format,
            block_tokens=args.block_tokens,
            speedup=args.trace_speedup,
            limit=args.trace_limit,
        )
    cfg = trace_config(
        records,
        info,
        info_json,
        overrides,
        sglang_version=args.sglang_version,
        calibrate_timing=not args.no_calibrate,
    )
    if info.padded_requests and not args.quiet:
        print(
            f"replay: {info.padded_requests} of {info.requests} requests have more input "
            f"tokens than hash ids x {args.block_tokens}; the rest of each prompt is unique "
            "(no prefix sharing there). Mooncake's public traces use --block-tokens 512",
            file=sys.stderr,
        )
    with request_bar(len(records), quiet=args.quiet) as progress:
        result = replay_trace(
            records,
            info,
            cfg,
            args.out,
            server_info=info_json,
            progress=progress,
            phases=phases,
            keep_batches=bool(args.publish),  # published live after the run
        )
    return result, cfg
