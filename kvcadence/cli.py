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
import re
import sys
import textwrap
import time
from collections.abc import Iterator, Sequence
from typing import NoReturn

from kvcadence import __version__
from kvcadence.errors import Interrupted, KvcadenceError, exit_code_table

# (stage, module) in the order they appear in --help.
COMMAND_MODULES: tuple[tuple[str, str], ...] = (
    ("capture", "kvcadence.capture.cli_bundle"),  # inspect, import
    ("capture", "kvcadence.capture.cli_live"),  # capture, drive
    ("harness", "kvcadence.harness.cli"),  # harness
    ("replay", "kvcadence.replay.cli"),  # replay
    ("admit", "kvcadence.admit.cli"),  # admit
    ("analysis", "kvcadence.analysis.cli"),  # ingest, sql, report, prefixes
    ("analysis", "kvcadence.analysis.cli_routing"),  # ranks
    ("analysis", "kvcadence.analysis.cli_evictions"),  # evictions
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

EPILOG = """\
examples:
  kvcadence demo                                   # the whole pipeline on the shipped sample
  kvcadence replay run.kvcb --out sim.kvcb         # simulate a capture
  kvcadence report run.kvcb sim.kvcb --out report/ # real vs sim, exit 3 when a gate fails
  kvcadence COMMAND --help                         # every flag of one command, with examples

"""


class HelpFormatter(argparse.HelpFormatter):
    """Fills prose paragraphs to the terminal width but keeps a paragraph whose lines are
    indented (examples, tables, lists) exactly as written. Every kvcadence parser uses it,
    so a description can be one long string and an epilog a block of example commands."""

    def _fill_text(self, text: str, width: int, indent: str) -> str:
        out = []
        for para in re.split(r"\n[ \t]*\n", text.strip("\n")):
            lines = para.splitlines()
            if any(line[:1].isspace() for line in lines):
                out.append("\n".join(indent + line for line in lines))
            else:
                flat = " ".join(line.strip() for line in lines)
                out.append(textwrap.fill(flat, width, initial_indent=indent,
                                         subsequent_indent=indent))  # fmt: skip
        return "\n\n".join(out)


class Parser(argparse.ArgumentParser):
    """argparse with the project's error shape: a bad flag or a missing argument is one
    ``kvcadence: error: ...`` line naming the command's ``--help`` (argparse printed the
    usage block first, and the top-level usage for a subcommand's unknown flag), exit 2.
    Every parser of the tree is one (subparsers take their parent's class)."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"kvcadence: error: {message} (see {self.prog} --help)\n")


def walk_parsers(
    parser: argparse.ArgumentParser, path: tuple[str, ...] = ("kvcadence",)
) -> Iterator[tuple[tuple[str, ...], argparse.ArgumentParser]]:
    """Every parser of the command tree with its command path, parents first."""
    yield path, parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, child in action.choices.items():
                yield from walk_parsers(child, (*path, name))


def build_parser(stages: Sequence[str] | None = None) -> argparse.ArgumentParser:
    """Build the parser with every registered command (or only those of ``stages``)."""
    prog, epilog = "kvcadence", EPILOG
    if stages is not None:  # ``python -m kvcadence.<stage>``: its own name, its own commands
        prog = "python -m kvcadence." + "/".join(stages)
        first = f"{prog} COMMAND --help"
        epilog = (
            "examples:\n"
            f"  {first}   # every flag of one command, with examples\n"
            f"  {'kvcadence --help':<{len(first)}}   # every command of every stage\n\n"
        )
    parser = Parser(
        prog=prog,
        description=DESCRIPTION,
        epilog=epilog + exit_code_table(),
        formatter_class=HelpFormatter,
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
    for _, p in walk_parsers(parser):
        p.formatter_class = HelpFormatter
        p.set_defaults(_prog=p.prog)  # the deepest parser's wins: whose --help to name
    return parser


def main(argv: Sequence[str] | None = None, stages: Sequence[str] | None = None) -> int:
    """Run one command; return its exit code (``kvcadence.errors.EXIT_CODES``)."""
    started = time.perf_counter()  # "wall" in a summary is the whole command from here
    parser = build_parser(stages)
    args, extra = parser.parse_known_args(argv)
    if extra:  # named against the command they were given to, not the top-level parser
        msg = f"unrecognized arguments: {' '.join(extra)}"
        parser.exit(2, f"kvcadence: error: {msg} (see {args._prog} --help)\n")
    args._started = started
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
    except KeyboardInterrupt as exc:
        # a note only from kvcadence's own Interrupted ("the unfinished output X was removed")
        why = f"; {exc}" if isinstance(exc, Interrupted) and exc.args else ""
        print(f"kvcadence: interrupted{why}", file=sys.stderr)
        return 130
    except RecursionError:
        # the last line of defence against hostile nesting (inputs are depth-checked on entry)
        print("kvcadence: error: input nested too deeply to process", file=sys.stderr)
        return 2
    except MemoryError:
        print("kvcadence: error: out of memory", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
