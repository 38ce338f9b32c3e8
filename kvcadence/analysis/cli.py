"""Analysis commands: ``ingest``, ``sql``, ``report``, ``prefixes`` (registered by kvcadence.cli).

Only the standard library is imported here; every heavy import happens inside the run
functions, so ``kvcadence --help`` stays fast.
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path
from typing import Any


def register(sub: Any) -> None:
    """Add the analysis subcommands to the ``kvcadence`` subparsers."""
    p = sub.add_parser(
        "ingest",
        help="bundle -> Parquet tables (cached next to the bundle)",
        description="Write a bundle's Parquet tables (batches, events, blocks, requests, gaps, "
        "epochs, notes; request_ids while small, or with --ids). Cached in BUNDLE/.parquet and "
        "rebuilt when the bundle changes.",
        epilog="examples:\n  kvcadence ingest run.kvcb\n  kvcadence ingest run.kvcb --out tables/ --force\n",
    )
    p.add_argument("bundle", help="bundle directory")
    p.add_argument("--out", metavar="DIR", help="write the tables here instead of BUNDLE/.parquet")
    p.add_argument("--force", action="store_true", help="rebuild even if the cache is current")
    p.add_argument(
        "--ids",
        action="store_true",
        help="write request_ids (every request's token ids, no prefix shared) however big: "
        "without it, only while no bigger than the bundle (long prompts sharing prefixes are "
        "several times it); kvcadence sql builds it when a query names it",
    )
    p.set_defaults(_run=run_ingest)

    p = sub.add_parser(
        "sql",
        help="run DuckDB SQL over a bundle's tables",
        description="Run one DuckDB statement over views batches, events, blocks, requests, "
        "gaps, epochs, notes, and request_ids (the token ids: kept while small, else built the "
        "first time a query names it). docs/metrics.md lists the columns.",
        epilog="examples:\n"
        '  kvcadence sql run.kvcb "SELECT kind, count(*) AS n FROM events GROUP BY 1 ORDER BY 1"\n'
        '  kvcadence sql run.kvcb "SELECT * FROM requests" --format csv --out requests.csv\n'
        '  kvcadence sql run.kvcb "SELECT rid, input_ids FROM requests JOIN request_ids '
        'USING (request_id)"\n',
    )
    p.add_argument("bundle", help="bundle directory")
    p.add_argument("query", help='SQL, e.g. "SELECT kind, count(*) FROM events GROUP BY 1"')
    p.add_argument(
        "--format",
        choices=("table", "csv", "json", "parquet"),
        default="table",
        help="output format (default table; parquet needs --out)",
    )
    p.add_argument("--out", metavar="FILE", help="write the result here (required for parquet)")
    p.add_argument("--force", action="store_true", help="replace an existing --out file")
    p.add_argument(
        "--cache", metavar="DIR", help="Parquet cache directory (default BUNDLE/.parquet)"
    )
    p.set_defaults(_run=run_sql)

    p = sub.add_parser(
        "report",
        help="cadence report of one bundle, or real vs sim side by side with a CI gate",
        description="Write report.json, report.md, report.html and PNG plots into --out; with "
        "several bundles the first is the reference every other one is compared with. Each "
        "bundle is labelled by its header's source (real for a capture or import, sim for a "
        "replay; a label two bundles share is numbered: sim1, sim2). Exit 3 when a gate "
        "fails. docs/metrics.md lists the metrics, the labels and the gate syntax.",
        epilog="examples:\n"
        "  kvcadence report run.kvcb --out report-one/\n"
        "  kvcadence report run.kvcb sim.kvcb --out report/\n"
        "  kvcadence report run.kvcb sim.kvcb --out ci/ --no-default-gates \\\n"
        "      --gate stored_events_per_request=3% --gate requests.cached_tokens_equal_share=>=0.95\n",
    )
    p.add_argument(
        "bundles", nargs="+", metavar="BUNDLE", help="REFERENCE [COMPARED ...] bundle directories"
    )
    p.add_argument(
        "--out",
        required=True,
        metavar="DIR",
        help="report directory (created if missing; an earlier report's files in it are "
        "replaced, runs.jsonl gets one line per run)",
    )
    p.add_argument(
        "--gate",
        action="append",
        default=[],
        metavar="METRIC=TOL",
        help="tolerance: N%% relative, N absolute, >=N or <=N bound (repeatable)",
    )
    p.add_argument(
        "--no-default-gates", action="store_true", help="do not apply the default headline gates"
    )
    p.add_argument(
        "--window",
        metavar="START:END",
        help="steady-state window in seconds after the first message "
        "(default: from the first removal)",
    )
    p.add_argument(
        "--peer-compatible",
        action="store_true",
        help="the closest peer's definitions (labelled) instead of the defaults",
    )
    p.add_argument("--no-plots", action="store_true", help="skip the PNG plots")
    p.add_argument(
        "--quiet", action="store_true", help="no progress lines on stderr (gate lines stay)"
    )
    p.add_argument(
        "--no-extra-sections",
        action="store_true",
        help="skip the optional sections (aligned timelines, event visibility, per-rank "
        "figures, ...; each is otherwise included when its data are present)",
    )
    p.set_defaults(_run=run_report)

    p = sub.add_parser(
        "prefixes",
        help="prefix-size distribution (plain JSON) for the kernels stage",
        description="Cached tokens per request and stored run lengths as quantiles and a "
        "log2 weighted histogram (schema kvcadence.prefixes/1, docs/metrics.md).",
        epilog="examples:\n"
        "  kvcadence prefixes run.kvcb --out prefixes.json\n"
        "  kvcadence collectives --prefixes prefixes.json --backend gloo\n",
    )
    p.add_argument("bundle", help="bundle directory")
    p.add_argument("--out", required=True, metavar="FILE", help="prefixes.json to write")
    p.add_argument("--force", action="store_true", help="replace an existing --out file")
    p.add_argument(
        "--cache", metavar="DIR", help="Parquet cache directory (default BUNDLE/.parquet)"
    )
    p.set_defaults(_run=run_prefixes)


def run_ingest(args: argparse.Namespace) -> int:
    from kvcadence.analysis import ingest

    if args.out is not None:
        ingest.check_cache_dir(args.out, "--out")
    ing = ingest.ingest(args.bundle, args.out, force=args.force, ids=args.ids or None)
    state = "built" if ing.rebuilt else "up to date"
    rows = ", ".join(f"{t} {n}" for t, n in ing.manifest.get("tables", {}).items())
    print(f"{ing.dir}: {state} ({rows})")
    return 0


def _check_cache(args: argparse.Namespace) -> None:
    """``--cache DIR`` and ``KVCADENCE_THREADS``, checked before any work."""
    from kvcadence.analysis import ingest, sql

    sql.env_threads()
    if args.cache is not None:
        ingest.check_cache_dir(args.cache, "--cache")


def run_sql(args: argparse.Namespace) -> int:
    import polars as pl

    from kvcadence.analysis import ingest, sql
    from kvcadence.analysis.outpaths import check_out_file, write_atomic
    from kvcadence.errors import UsageError

    if args.format == "parquet" and not args.out:
        raise UsageError("--format parquet needs --out FILE")
    if args.out is not None:
        check_out_file(args.out, "--out", force=args.force)
    _check_cache(args)
    # the token ids' table for a query that names it, else as the cache has it (kept when
    # small: ``cache.IDS_BUDGET``)
    named = re.search(r"\brequest_ids\b", args.query, re.IGNORECASE) is not None
    ing = ingest.ingest(args.bundle, args.cache, ids=True if named else None)
    df = sql.query(sql.connect(ing), args.query)
    if args.format == "parquet":
        write_atomic(args.out, lambda tmp: df.write_parquet(tmp, compression="zstd"))
        return 0
    if args.format == "csv":
        text = df.write_csv()
    elif args.format == "json":
        text = df.write_json()
    else:
        with pl.Config(
            tbl_rows=-1,
            tbl_cols=-1,
            tbl_width_chars=200,
            fmt_str_lengths=200,
            tbl_hide_dataframe_shape=True,
        ):
            text = str(df)
    if args.out:
        body = text if text.endswith("\n") else text + "\n"
        write_atomic(args.out, lambda tmp: tmp.write_text(body, encoding="utf-8"))
    else:
        sys.stdout.write(text if text.endswith("\n") else text + "\n")
    return 0


def run_report(args: argparse.Namespace) -> int:
    from kvcadence.analysis import compare, metrics, report, sql
    from kvcadence.analysis.outpaths import check_out_dir
    from kvcadence.errors import UsageError

    # every input checked before any work (make_report checks gates and --out again)
    window = metrics.parse_window(args.window)
    compare.parse_gates(args.gate, len(args.bundles), default_gates=not args.no_default_gates)
    sql.env_threads()
    check_out_dir(args.out, "--out")
    for b in args.bundles:  # a typo in the last bundle fails now, not after the first's ingest
        if not Path(b).exists():
            raise UsageError(f"bundle not found: {b}")
        if not Path(b).is_dir():
            raise UsageError(f"not a bundle directory: {b}")
    from kvcadence.progress import Phases

    phases = Phases("report", quiet=args.quiet, started=getattr(args, "_started", None))
    res = report.make_report(
        args.bundles,
        args.out,
        gates=args.gate,
        default_gates=not args.no_default_gates,
        window=window,
        peer_compatible=args.peer_compatible,
        plots=not args.no_plots,
        extra_sections=not args.no_extra_sections,
        phases=phases,
    )
    if phases.spoke:  # a slow report: where the time went
        phases.say(f"done in {phases.wall():.1f} s ({phases.breakdown()})")
    print(res.summary_line())
    report.print_gate_lines(res.gate_results)
    return 0 if res.passed else 3


def run_prefixes(args: argparse.Namespace) -> int:
    from kvcadence.analysis import ingest, prefixes
    from kvcadence.analysis.outpaths import check_out_file

    check_out_file(args.out, "--out", make_parents=True, force=args.force)
    _check_cache(args)
    ing = ingest.ingest(args.bundle, args.cache)
    doc = prefixes.compute(ing)
    path = prefixes.write(doc, args.out)
    d = doc["distributions"]
    print(
        f"{path}: page_size {doc['page_size']}, cached_tokens n={d['cached_tokens']['n']}, "
        f"stored_run_tokens n={d['stored_run_tokens']['n']}"
    )
    return 0
