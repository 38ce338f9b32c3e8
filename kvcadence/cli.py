"""The ``kvcadence`` command line: one argparse parser, one subcommand per job.

Each stage owns a small command module that registers its subcommands; this file only
collects them, runs the chosen one and turns ``KvcadenceError`` into one error line and an
exit code (see ``kvcadence.errors``). Command modules must import heavy libraries (zmq,
polars, duckdb, torch, matplotlib) inside their run functions, never at module level, so
``kvcadence --help`` stays fast.

Contract for a command module: ``register(sub)`` where ``sub`` is the subparsers action;
it adds parsers and calls ``parser.set_defaults(_run=func)`` with ``func(args) -> int``.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence

from kvcadence import __version__
from kvcadence.errors import KvcadenceError

# (stage, module) in the order they appear in --help.
COMMAND_MODULES: tuple[tuple[str, str], ...] = (
    ("capture", "kvcadence.capture.cli_bundle"),  # inspect, import
    ("capture", "kvcadence.capture.cli_live"),  # capture, drive, harness
    ("replay", "kvcadence.replay.cli"),  # replay
    ("admit", "kvcadence.admit.cli"),  # admit
    ("analysis", "kvcadence.analysis.cli"),  # ingest, sql, report, prefixes
    ("analysis", "kvcadence.analysis.cli_routing"),  # ranks
    ("kernels", "kvcadence.kernels.cli"),  # collectives
    ("demo", "kvcadence.demo"),  # demo
)

DESCRIPTION = """\
kvcadence: does a simulator reproduce what a real SGLang worker publishes?

  capture   record a live worker's KV events + request schedule into a bundle
  replay    push the same schedule through a simulated SGLang scheduler
  admit     SGLang's offline admission benchmark (PrefillAdder tick by tick)
  analysis  real vs simulated cadence reports (DuckDB/Polars over Parquet)
  kernels   replay observed prefix sizes through torch.distributed collectives
"""


def build_parser(stages: Sequence[str] | None = None) -> argparse.ArgumentParser:
    """Build the parser with every registered command (or only those of ``stages``)."""
    parser = argparse.ArgumentParser(
        prog="kvcadence",
        description=DESCRIPTION,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--version", action="version", version=f"kvcadence {__version__}")
    sub = parser.add_subparsers(title="commands", metavar="COMMAND")
    for stage, module_name in COMMAND_MODULES:
        if stages is not None and stage not in stages:
            continue
        try:
            module = importlib.import_module(module_name)
        except ModuleNotFoundError as exc:
            if exc.name == module_name:
                continue  # stage not built yet
            raise
        module.register(sub)
    return parser


def main(argv: Sequence[str] | None = None, stages: Sequence[str] | None = None) -> int:
    """Run one command; return its exit code (0 ok, 1 error, 2 usage, 3 gate failed)."""
    parser = build_parser(stages)
    args = parser.parse_args(argv)
    run = getattr(args, "_run", None)
    if run is None:
        parser.print_help()
        return 2
    try:
        return int(run(args) or 0)
    except KvcadenceError as exc:
        print(f"kvcadence: error: {exc}", file=sys.stderr)
        return exc.exit_code
    except BrokenPipeError:
        return 0
    except OSError as exc:
        # A path the user named cannot be read or written (exists, is a directory, missing
        # parent, permission, disk full): one line, no traceback.
        where = f"{exc.filename}: " if exc.filename else ""
        print(f"kvcadence: error: {where}{exc.strerror or exc}", file=sys.stderr)
        return 2 if exc.filename else 1
    except KeyboardInterrupt:
        print("kvcadence: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
