"""Registers the bundle commands ``kvcadence inspect`` and ``kvcadence import``.

Standard library only at module level: the work is imported inside the run functions
(``kvcadence.capture.inspect`` / ``kvcadence.capture.importer``), so ``kvcadence --help``
stays cheap.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from kvcadence.capture.cli_live import add_redact_option

NO_HEADER = "no header (damaged or not a kvcadence bundle)"


def register(sub: Any) -> None:
    """Add ``inspect`` and ``import`` to the ``kvcadence`` subparsers."""
    p = sub.add_parser(
        "inspect",
        help="summarise a bundle: record/event counts, seqs, gaps, damage",
        description=(
            "Summarise a bundle: counts by record type and KV-event type, stored/removed "
            "blocks, seq ranges per endpoint and epoch, gaps, torn/corrupt bytes, requests, "
            "time span and whether the writer shut down cleanly."
        ),
        epilog="examples:\n"
        "  kvcadence inspect examples/sglang-0.5.23-agent-ps1.kvcb\n"
        "  kvcadence inspect run.kvcb --json | jq .events\n",
    )
    p.add_argument("bundle", help="bundle directory (seg-*.kvcb files)")
    p.add_argument("--json", action="store_true", help="print one JSON document (stable keys)")
    p.add_argument(
        "--strict",
        action="store_true",
        help="exit 1 when anything was lost: a missing, empty or refused segment, fewer "
        "records than a trailer counts, corrupt frames, a torn tail",
    )
    p.set_defaults(_run=run_inspect)

    p = sub.add_parser(
        "import",
        help="convert JSONL frame dumps + request logs into a bundle",
        description=(
            "Convert a JSONL dump of ZMQ KV-event messages (recv_ns, topic, seq, payload_b64, "
            "[endpoint], [via]) and a JSONL request log into a bundle. Every input is "
            "validated before anything is written; a bad line exits 2 naming file:line:field."
        ),
        epilog="examples:\n"
        "  kvcadence import --frames frames.jsonl --requests requests.jsonl \\\n"
        "      --server-info server_info.json --out run.kvcb\n"
        "  kvcadence import --requests more.jsonl --out run.kvcb --append\n",
    )
    p.add_argument("--frames", metavar="FRAMES.jsonl", help="one JSON object per ZMQ message")
    p.add_argument("--requests", metavar="REQUESTS.jsonl", help="one JSON object per request")
    p.add_argument("--server-info", metavar="JSON", help="the worker's GET /server_info JSON")
    p.add_argument("--sglang-version", metavar="V", help="override the SGLang version")
    p.add_argument("--out", required=True, metavar="BUNDLE", help="bundle directory to create")
    p.add_argument(
        "--append",
        action="store_true",
        help="add the --requests records to the existing bundle --out (new segment)",
    )
    add_redact_option(p)
    p.set_defaults(_run=run_import)


def run_inspect(args: argparse.Namespace) -> int:
    from kvcadence.capture.inspect import format_text, inspect_bundle

    summary = inspect_bundle(args.bundle)
    if args.json:
        json.dump(summary, sys.stdout, indent=2)
        sys.stdout.write("\n")
    else:
        print(format_text(summary))
    if not summary["header_ok"]:
        # the damage report above is still worth having; the exit says it is not a sound bundle
        print(f"kvcadence: error: {args.bundle}: {NO_HEADER}", file=sys.stderr)
        return 1
    if args.strict and summary["damaged"]:
        from kvcadence.capture.inspect import damage_lines

        what = damage_lines(summary) or [
            f"{summary['corrupt_bytes']} corrupt bytes, {summary['torn_bytes']} torn bytes"
        ]
        print(f"kvcadence: error: {args.bundle}: damaged: {what[0]}", file=sys.stderr)
        return 1
    return 0


def run_import(args: argparse.Namespace) -> int:
    from kvcadence.capture.discovery import header_redactions
    from kvcadence.capture.importer import import_bundle

    s = import_bundle(
        args.out,
        frames=args.frames,
        requests=args.requests,
        server_info=args.server_info,
        sglang_version=args.sglang_version,
        command=["kvcadence", *sys.argv[1:]],
        append=args.append,
        redact=header_redactions(args.redact),
    )
    if s.appended:
        print(f"appended {s.requests} requests to {s.out}")
    else:
        print(
            f"imported {s.events_written} messages ({s.duplicates} duplicates dropped, "
            f"{s.gaps} gaps / {s.missed_seqs} missed seqs, {s.epochs} epochs) and "
            f"{s.requests} requests into {s.out}"
        )
    return 0


__all__ = ["register", "run_import", "run_inspect"]
