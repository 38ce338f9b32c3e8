"""``kvcadence demo``: the whole pipeline in one command, on the embedded real capture.

This file owns the demo: which steps run (inspect -> replay -> report -> prefixes ->
collectives -> admit, optionally preceded by a live capture from the project's CPU harness),
the checks that everything a step needs is there before it runs, the demo's output directory
layout, the per-step logs and timings, and the closing summary (``summary.json`` and the
printed text). Every step is a normal kvcadence command run in-process through
``kvcadence.cli.main``; the demo adds no analysis of its own: the summary numbers are read
from the files those commands write (``report/report.json``, ``collectives.jsonl``,
``admit.json``).

Top level imports only the standard library (the CLI imports this module for ``--help``).

Why ~750 lines: the demo is a script of steps, each with its command line, digest of its
output and summary row; split per step it would read worse.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import json
import os
import shutil
import sys
import time
import traceback
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvcadence.argtypes import positive_float

EXAMPLE_NAME = "sglang-0.5.23-agent-ps1.kvcb"
MARKER = ".kvcadence-demo"
DEFAULT_OUT = "out/demo"
# live capture: the same worker settings and workload as the embedded example, fewer requests
LIVE_PAGE_SIZE = 1
LIVE_POOL_TOKENS = 2000
LIVE_WORKLOAD = "agent:lanes=4,requests={n},seed=101,max_prompt=800"
# what the demo writes into --out (a rerun into the same directory replaces exactly these)
OUTPUTS = (
    "real.kvcb",
    "sim.kvcb",
    "report",
    "prefixes.json",
    "collectives.jsonl",
    "admit.json",
    "summary.json",
    "logs",
    "worker",
)

HEADLINE = (
    ("Stored events / request", "stored_events_per_request"),
    ("median blocks / Stored", "blocks_per_stored_event.median"),
    ("Removed events / request", "removed_events_per_request"),
    ("median blocks / Removed", "blocks_per_removed_event.median"),
)

HELP = "run the whole pipeline on the embedded real SGLang capture and summarise it"


def register(sub: Any) -> None:
    p = sub.add_parser(
        "demo",
        help=HELP,
        description=(
            "Run inspect -> replay -> report (real vs sim) -> prefixes -> collectives (gloo, "
            "world 2) -> admit on a real SGLang 0.5.23 capture (default: the sample bundle "
            "shipped with kvcadence), then print the headline cadence metrics real vs sim, the "
            "winning collective path per size range, admission's stop reasons and where the "
            "report is. Each step's output goes to DIR/logs/."
        ),
        epilog="examples:\n"
        "  kvcadence demo\n"
        "  kvcadence demo --out out/my-demo --bundle run.kvcb --keep-going\n"
        "  kvcadence demo --live --requests 16   # needs 'kvcadence harness setup' first\n",
    )
    p.add_argument(
        "--out",
        default=DEFAULT_OUT,
        metavar="DIR",
        help=f"output directory (default {DEFAULT_OUT})",
    )
    p.add_argument(
        "--bundle", metavar="B", help="a capture bundle to use instead of the embedded sample"
    )
    p.add_argument(
        "--live",
        action="store_true",
        help="record a fresh capture first from a real SGLang worker started by the CPU "
        "harness (kvcadence harness setup)",
    )
    p.add_argument(
        "--requests",
        type=int,
        default=40,
        metavar="N",
        help="--live: requests of the agent workload to drive (default 40)",
    )
    p.add_argument(
        "--ready-timeout",
        type=positive_float,
        default=None,
        metavar="SECONDS",
        help="--live: how long 'kvcadence harness start' waits for the worker to come up "
        "(default: that command's --ready-timeout default; raise it on a loaded box)",
    )
    p.add_argument(
        "--keep-going",
        action="store_true",
        help="run every step that can run even when one fails or a piece is missing",
    )
    p.set_defaults(_run=run_demo)


# ------------------------------------------------------------------------ the plan


@dataclass
class Step:
    """One pipeline step: a kvcadence command line and what it needs."""

    name: str
    argv: list[str] | Callable[[], list[str]]
    command: str  # the kvcadence subcommand it runs (must be registered)
    needs: tuple[str, ...] = ()  # steps that must have succeeded
    needs_torch: bool = False
    ok_codes: tuple[int, ...] = (0,)
    digest: Callable[[Path], list[str]] | None = None
    status: str = "pending"  # pending | ok | failed | skipped
    rc: int = 0
    seconds: float = 0.0
    note: str = ""


@dataclass
class Layout:
    """Where every output of the demo goes."""

    out: Path
    real: Path = field(init=False)
    sim: Path = field(init=False)
    report: Path = field(init=False)
    prefixes: Path = field(init=False)
    collectives: Path = field(init=False)
    admit: Path = field(init=False)
    summary: Path = field(init=False)
    logs: Path = field(init=False)
    worker: Path = field(init=False)

    def __post_init__(self) -> None:
        o = self.out
        self.real, self.sim, self.report = o / "real.kvcb", o / "sim.kvcb", o / "report"
        self.prefixes, self.collectives = o / "prefixes.json", o / "collectives.jsonl"
        self.admit, self.summary = o / "admit.json", o / "summary.json"
        self.logs, self.worker = o / "logs", o / "worker"


def default_bundle() -> Path:
    """The embedded sample: ``kvcadence/_data/`` of an installed wheel (the build copies it
    there, see pyproject.toml), else ``examples/`` of the checkout this package runs from."""
    here = Path(__file__).resolve().parent
    packaged = here / "_data" / EXAMPLE_NAME
    if packaged.is_dir():
        return packaged
    return here.parent / "examples" / EXAMPLE_NAME


def _usage(msg: str) -> Exception:
    from kvcadence.errors import UsageError

    return UsageError(msg)


def _is_bundle(path: Path) -> bool:
    from kvcadence.format.bundle import is_bundle

    return is_bundle(path)


def _available_commands() -> set[str]:
    from kvcadence.cli import build_parser

    parser = build_parser()
    for action in parser._actions:  # noqa: SLF001 - argparse keeps subparsers here
        if isinstance(action, argparse._SubParsersAction):  # noqa: SLF001
            return set(action.choices)
    return set()


def _prepare_out(out: Path) -> None:
    """Create ``out``; a previous demo output is replaced, anything else is refused."""
    if out.exists() and not out.is_dir():
        raise _usage(f"--out {out}: exists and is not a directory")
    if out.is_dir() and any(out.iterdir()):
        if not (out / MARKER).is_file():
            raise _usage(
                f"--out {out}: directory is not empty and was not written by kvcadence demo; "
                "choose a new or empty directory"
            )
        for name in OUTPUTS:
            p = out / name
            if p.is_dir() and not p.is_symlink():
                shutil.rmtree(p)
            elif p.exists() or p.is_symlink():
                p.unlink()
    out.mkdir(parents=True, exist_ok=True)
    (out / MARKER).write_text("written by `kvcadence demo`; rerunning it replaces its outputs\n")


def _copy_bundle(src: Path, dst: Path) -> None:
    """Give the demo its own copy of ``src`` (segments only), so caches land in --out. A byte
    copy, never a link: a repair of the copy (``BundleWriter.append`` truncates a torn last
    segment in place) must never reach the committed sample in ``examples/``."""
    from kvcadence.format.bundle import copy_bundle

    copy_bundle(src, dst)


def _server_settings(bundle: Path) -> dict[str, Any]:
    """The worker settings recorded in the capture header (``/server_info``), if any."""
    from kvcadence.format.bundle import BundleReader

    info = BundleReader(bundle).header.server_info or {}
    snap = info.get("kvcadence_snapshot") if isinstance(info, dict) else None
    merged: dict[str, Any] = dict(info) if isinstance(info, dict) else {}
    if isinstance(snap, dict):
        merged.update({k: v for k, v in snap.items() if v is not None})
    return merged


# ------------------------------------------------------------------------ running a step


@contextlib.contextmanager
def _output_to(path: Path) -> Iterator[None]:
    """Send this process's stdout/stderr (and its children's, e.g. torchrun) to ``path``."""
    sys.stdout.flush()
    sys.stderr.flush()
    with open(path, "w", buffering=1, encoding="utf-8") as log:
        saved = (os.dup(1), os.dup(2))
        old = (sys.stdout, sys.stderr)
        os.dup2(log.fileno(), 1)
        os.dup2(log.fileno(), 2)
        sys.stdout = sys.stderr = log
        try:
            yield
        finally:
            log.flush()
            sys.stdout, sys.stderr = old
            os.dup2(saved[0], 1)
            os.dup2(saved[1], 2)
            os.close(saved[0])
            os.close(saved[1])


def _run_cli(argv: list[str], log: Path) -> int:
    """``kvcadence.cli.main(argv)`` with its output in ``log``; never raises."""
    from kvcadence.cli import main

    with _output_to(log):
        try:
            return int(main(argv) or 0)
        except SystemExit as exc:  # argparse rejected the flags
            return exc.code if isinstance(exc.code, int) else 2
        except Exception:  # a bug in a stage: keep the traceback in the log, not on screen
            traceback.print_exc()
            return 1


def _error_line(log: Path) -> str:
    """The most telling line of a failed step's log."""
    try:
        lines = [ln.strip() for ln in log.read_text(errors="replace").splitlines() if ln.strip()]
    except OSError:
        return ""
    for ln in reversed(lines):
        if ln.startswith(("kvcadence: error:", "kvcadence ")) or "error" in ln.lower():
            return ln
    return lines[-1] if lines else ""


def _say(msg: str = "") -> None:
    print(msg, flush=True)


def _rel(path: Path) -> str:
    try:
        return str(path.resolve().relative_to(Path.cwd().resolve()))
    except ValueError:
        return str(path)


# ------------------------------------------------------------------------ digests


def _grep(log: Path, prefixes: Sequence[str], limit: int = 6) -> list[str]:
    try:
        lines = log.read_text(errors="replace").splitlines()
    except OSError:
        return []
    return [ln for ln in lines if ln.startswith(tuple(prefixes))][:limit]


def _digest_inspect(log: Path) -> list[str]:
    return _grep(log, ("format", "events", "blocks", "requests", "gaps", "clean shutdown"))


def _digest_replay(log: Path) -> list[str]:
    return _grep(log, ("replayed",))


def _digest_report(log: Path) -> list[str]:
    # the report's own progress lines ("report: drawing plots ...", "report: done in") stay
    # in the log, out of the digest
    lines = _grep(log, ("GATE", "report:"), limit=50)
    return [ln for ln in lines if not ln.endswith(" ...") and " done in " not in ln][:6]


def _digest_prefixes(log: Path) -> list[str]:
    return [ln for ln in _grep(log, ("",), limit=50) if "cached_tokens n=" in ln][:2]


def _digest_collectives(log: Path) -> list[str]:
    return _grep(log, ("winner under the distribution", "== expected cost"))


# ------------------------------------------------------------------------ summary


def _metric(bundle: dict[str, Any], name: str) -> float | None:
    m = bundle.get("metrics", {}).get(name)
    if isinstance(m, dict):
        return m.get("value")
    return m


def _fmt(v: float | None) -> str:
    if v is None:
        return "-"
    return f"{v:.4g}"


def summarize(lay: Layout) -> dict[str, Any]:
    """Collect the headline numbers from the files the steps wrote (missing parts = None)."""
    out: dict[str, Any] = {"report_html": None, "cadence": None, "collectives": None}
    out["admit"] = None
    rj = lay.report / "report.json"
    if rj.is_file():
        rep = json.loads(rj.read_text())
        bundles = {b["label"]: b for b in rep.get("bundles", [])}
        labels = [b["label"] for b in rep.get("bundles", [])]
        real = bundles.get(labels[0]) if labels else None
        sim = bundles.get(labels[1]) if len(labels) > 1 else None
        rows = []
        for title, key in HEADLINE:
            rv = _metric(real, key) if real else None
            sv = _metric(sim, key) if sim else None
            rel = (sv - rv) / abs(rv) if rv not in (None, 0) and sv is not None else None
            rows.append({"metric": key, "title": title, "real": rv, "sim": sv, "rel_delta": rel})
        agree = None
        for comp in rep.get("comparisons", []):
            reqs = comp.get("requests", {})
            share = reqs.get("requests.cached_tokens_equal_share", {}).get("value")
            matched = reqs.get("requests.matched", {}).get("value")
            agree = {"share": share, "matched": matched}
            if share is not None and matched is not None:
                agree["equal"] = round(share * matched)
            break
        gates = rep.get("gates", [])
        out["cadence"] = {
            "real_label": labels[0] if labels else None,
            "sim_label": labels[1] if len(labels) > 1 else None,
            "requests": _metric(real, "requests") if real else None,
            "headline": rows,
            "cached_tokens_agreement": agree,
            "gate_passed": rep.get("gate_passed"),
            "gates": [
                {"metric": g.get("metric"), "ok": g.get("ok"), "detail": g.get("detail")}
                for g in gates
            ],
        }
        if (lay.report / "report.html").is_file():
            out["report_html"] = str(lay.report / "report.html")
    if lay.collectives.is_file():
        summaries = []
        for line in lay.collectives.read_text().splitlines():
            try:
                rec = json.loads(line)
            except ValueError:
                continue
            if rec.get("record") == "summary":
                summaries.append(
                    {
                        "payload": rec.get("payload"),
                        "winner": rec.get("winner"),
                        "leader": rec.get("leader"),
                        "within_spread": rec.get("within_spread", []),
                        "repeat": rec.get("repeat"),
                        "expected_vs_dense": rec.get("expected_vs_dense", {}).get(
                            rec.get("winner") or rec.get("leader")
                        ),
                        "ranges": rec.get("ranges", []),
                        "backend": rec.get("backend"),
                        "world_size": rec.get("world_size"),
                        "page_size": rec.get("page_size"),
                    }
                )
        out["collectives"] = summaries or None
    if lay.admit.is_file():
        doc = json.loads(lay.admit.read_text())
        s, cfg = doc.get("summary", {}), doc.get("config", {})
        out["admit"] = {
            "requests": s.get("requests"),
            "admitted": s.get("admitted_requests"),
            "ticks": s.get("ticks"),
            "stopped_results": s.get("stopped_results", {}),
            "available_tokens": cfg.get("available_tokens"),
            "page_size": cfg.get("page_size"),
        }
    return out


def _short_path(name: str | None) -> str:
    return (name or "?").replace("packed_all_gather_", "packed_ag_")


def summary_lines(s: dict[str, Any]) -> list[str]:
    """The printed summary (every number from ``summarize``)."""
    lines: list[str] = []
    cad = s.get("cadence")
    if cad:
        n = cad.get("requests")
        lines.append(
            f"cadence, real capture vs replay ({n:.0f} requests):"
            if n is not None
            else "cadence, real capture vs replay:"
        )
        lines.append(f"  {'metric':<26}{'real':>10}{'sim':>10}{'delta':>10}")
        for row in cad["headline"]:
            rel = row["rel_delta"]
            d = "-" if rel is None else f"{rel * 100:+.1f}%"
            lines.append(
                f"  {row['title']:<26}{_fmt(row['real']):>10}{_fmt(row['sim']):>10}{d:>10}"
            )
        ag = cad.get("cached_tokens_agreement")
        if ag and ag.get("share") is not None:
            lines.append(
                f"  {'cached_tokens equal':<26}{ag.get('equal', '?')}/{ag.get('matched', '?')} "
                f"requests ({ag['share'] * 100:.1f}%)"
            )
        gates = cad.get("gates") or []
        if gates:
            failed = [g for g in gates if not g.get("ok")]
            lines.append(
                f"  gates: {len(gates) - len(failed)}/{len(gates)} passed"
                + "".join(f"\n    FAILED {g['metric']}: {g['detail']}" for g in failed)
            )
    col = s.get("collectives")
    if col:
        c0 = col[0]
        lines.append(
            f"collectives ({c0.get('backend')}, world {c0.get('world_size')}, page "
            f"{c0.get('page_size')}, sizes from the capture's cached_tokens; CPU wall time, "
            "shape only):"
        )
        for c in col:
            ratio = c.get("expected_vs_dense")
            r = f" ({ratio:.2f}x dense)" if isinstance(ratio, (int, float)) else ""
            if c.get("winner") or "leader" not in c:
                lines.append(
                    f"  {c['payload']}: winner under the distribution {_short_path(c['winner'])}{r}"
                )
            else:  # the fastest median is inside the others' spread: say so, name no winner
                tied = ", ".join(_short_path(p) for p in c.get("within_spread") or [])
                lines.append(
                    f"  {c['payload']}: no clear winner ({_short_path(c['leader'])} fastest "
                    f"median{r}, {tied} within its p25-p75 spread over {c.get('repeat')} repeats)"
                )
            ranges = c.get("ranges", [])
            weighted = [rg for rg in ranges if rg.get("weight", 0) > 0]
            for rg in weighted:
                lo, hi = rg.get("from_tokens"), rg.get("to_tokens")
                span = f"{lo}" if lo == hi else f"{lo}-{hi}"
                noise = "" if rg.get("clear", True) else "  (within the spread)"
                lines.append(
                    f"    {span + ' tokens':<18}{_short_path(rg.get('path')):<24}"
                    f"{rg.get('weight', 0) * 100:4.0f}% of requests{noise}"
                )
            if len(weighted) < len(ranges):
                lines.append(
                    f"    (+{len(ranges) - len(weighted)} measured sizes holding no request; "
                    "all in collectives.jsonl)"
                )
    ad = s.get("admit")
    if ad:
        stops = ", ".join(f"{k} {v}" for k, v in sorted(ad["stopped_results"].items()))
        lines.append(
            f"admit (the capture's {ad['requests']} requests queued at once, "
            f"{ad['available_tokens']} free tokens, page {ad['page_size']}): "
            f"{ad['admitted']}/{ad['requests']} admitted in {ad['ticks']} ticks; "
            f"ticks stopped by: {stops or '-'}"
        )
    if s.get("report_html"):
        lines.append(f"report: {_rel(Path(s['report_html']))}  (report.md, report.json, PNGs)")
    return lines


# ------------------------------------------------------------------------ the command


def _plan(lay: Layout, settings: Callable[[], dict[str, Any]]) -> list[Step]:
    def admit_argv() -> list[str]:
        st = settings()
        argv = ["admit", "--bundle", str(lay.real), "--output", "json", "--out", str(lay.admit)]
        pool = st.get("max_total_num_tokens")
        argv += ["--available-tokens", str(int(pool) if pool else 20000)]
        for flag, key in (
            ("--page-size", "page_size"),
            ("--chunked-prefill-size", "chunked_prefill_size"),
            ("--max-prefill-tokens", "max_prefill_tokens"),
        ):
            if isinstance(st.get(key), int):
                argv += [flag, str(st[key])]
        return argv

    return [
        Step("inspect", ["inspect", str(lay.real)], "inspect", digest=_digest_inspect),
        Step(
            "replay",
            ["replay", str(lay.real), "--out", str(lay.sim)],
            "replay",
            digest=_digest_replay,
        ),
        Step(
            "report",
            ["report", str(lay.real), str(lay.sim), "--out", str(lay.report)],
            "report",
            needs=("replay",),
            ok_codes=(0, 3),  # 3 = a gate failed: the report is written, the summary says so
            digest=_digest_report,
        ),
        Step(
            "prefixes",
            ["prefixes", str(lay.real), "--out", str(lay.prefixes)],
            "prefixes",
            digest=_digest_prefixes,
        ),
        Step(
            "collectives",
            [
                "collectives",
                "--nproc-per-node",
                "2",
                "--backend",
                "gloo",
                "--prefixes",
                str(lay.prefixes),
                "--prefix-dist",
                "cached_tokens",
                "--page-size",
                "64",
                "--warmup",
                "2",
                "--repeat",
                "20",  # enough for the p25-p75 spread that decides "winner" vs "no clear winner"
                "--out",
                str(lay.collectives),
            ],  # fmt: skip
            "collectives",
            needs=("prefixes",),
            needs_torch=True,
            digest=_digest_collectives,
        ),
        Step("admit", admit_argv, "admit"),
    ]


def _missing(step: Step, commands: set[str]) -> str | None:
    if step.command not in commands:
        return (
            f"the `kvcadence {step.command}` command is not installed in this kvcadence "
            "(update the checkout and reinstall: `make demo`)"
        )
    if step.needs_torch and importlib.util.find_spec("torch") is None:
        return "torch is not installed (pip install 'kvcadence[kernels]', or run `make demo`)"
    return None


def _live_check(args: argparse.Namespace, commands: set[str]) -> None:
    """Refuse ``--live`` (exit 2, one line) when the harness or live stage is missing."""
    for cmd in ("harness", "drive"):
        if cmd not in commands:
            raise _usage(
                f"--live needs `kvcadence {cmd}` (the live capture stage), which is not installed"
                " in this kvcadence; update the checkout and reinstall"
            )
    from kvcadence.harness import worker as harness

    st = harness.status()
    if not (st.get("venv_ready") and st.get("model_ready")):
        raise _usage(
            "--live needs the real-SGLang CPU harness, which is not set up: run "
            f"`kvcadence harness setup` (builds {st.get('venv')} and a tiny model; needs network)"
        )
    if args.requests < 1:
        raise _usage("--requests must be >= 1")


def _live_capture(args: argparse.Namespace, lay: Layout) -> None:
    """Start the CPU harness worker, drive the agent workload into ``lay.real``, stop it."""
    t0 = time.monotonic()
    _say("[live] start a real SGLang 0.5.23 CPU worker (kvcadence harness start)")
    log = lay.logs / "00-harness-start.log"
    rc = _run_cli(
        [
            "harness",
            "start",
            "--page-size",
            str(LIVE_PAGE_SIZE),
            "--max-total-tokens",
            str(LIVE_POOL_TOKENS),
            "--workdir",
            str(lay.worker),
            *([] if args.ready_timeout is None else ["--ready-timeout", str(args.ready_timeout)]),
        ],  # fmt: skip
        log,
    )
    if rc != 0:
        raise _usage(f"harness start failed (exit {rc}): {_error_line(log)}; log: {_rel(log)}")
    url = None
    for line in log.read_text(errors="replace").splitlines():
        if line.startswith("{"):
            with contextlib.suppress(ValueError):
                url = json.loads(line).get("url") or url
    try:
        if not url:
            raise _usage(f"harness start printed no worker URL; log: {_rel(log)}")
        _say(f"       worker {url} up in {time.monotonic() - t0:.1f} s")
        spec = LIVE_WORKLOAD.format(n=args.requests)
        _say(f"[live] drive {spec} and capture its KV events -> {_rel(lay.real)}")
        t1 = time.monotonic()
        dlog = lay.logs / "00-drive.log"
        rc = _run_cli(
            ["drive", "--server", url, "--workload", spec, "--out", str(lay.real), "--quiet"],
            dlog,
        )
        if rc != 0:
            from kvcadence.errors import CaptureError

            raise CaptureError(f"drive failed (exit {rc}): {_error_line(dlog)}; log: {_rel(dlog)}")
        _say(f"       recorded in {time.monotonic() - t1:.1f} s")
    finally:
        _run_cli(["harness", "stop"], lay.logs / "00-harness-stop.log")


def run_demo(args: argparse.Namespace) -> int:
    t_start = time.monotonic()
    commands = _available_commands()
    lay = Layout(Path(args.out))

    if args.live and args.bundle:
        raise _usage("--live records its own capture; do not combine it with --bundle")
    src: Path | None = None
    if args.live:
        _live_check(args, commands)
    else:
        if args.bundle:
            src = Path(args.bundle)
            if not _is_bundle(src):
                raise _usage(f"--bundle {src}: not a kvcadence bundle (no seg-*.kvcb files)")
        else:
            src = default_bundle()
            if not _is_bundle(src):
                raise _usage(
                    f"the sample bundle {EXAMPLE_NAME} is missing (it ships inside the wheel "
                    "as kvcadence/_data/ and in a source checkout's examples/): reinstall "
                    "kvcadence, run `make demo` in a checkout, or pass --bundle B"
                )

    plan = _plan(lay, lambda: _server_settings(lay.real))
    missing = {s.name: m for s in plan if (m := _missing(s, commands))}
    if missing and not args.keep_going:
        name, why = next(iter(missing.items()))
        raise _usage(f"cannot run the demo's {name} step: {why} (or use --keep-going)")

    _prepare_out(lay.out)
    lay.logs.mkdir()
    if args.live:
        _live_capture(args, lay)
        what = "a fresh capture from the harness worker"
    else:
        assert src is not None
        _copy_bundle(src, lay.real)
        what = f"{_rel(src)}" + (
            " (the embedded real SGLang 0.5.23 capture)" if not args.bundle else ""
        )
    _say(f"kvcadence demo: {what} -> {_rel(lay.out)}")

    done: dict[str, bool] = {}
    total = len(plan)
    for i, step in enumerate(plan, 1):
        argv = step.argv() if callable(step.argv) else step.argv
        shown = " ".join(_rel(Path(a)) if os.sep in a else a for a in argv)
        _say(f"\n[{i}/{total}] {step.name}: kvcadence {shown}")
        blocked = missing.get(step.name) or next(
            (f"needs the {n} step, which did not succeed" for n in step.needs if not done.get(n)),
            None,
        )
        if blocked:
            step.status, step.note = "skipped", blocked
            done[step.name] = False
            _say(f"      SKIPPED: {blocked}")
            continue
        log = lay.logs / f"{i:02d}-{step.name}.log"
        t0 = time.monotonic()
        step.rc = _run_cli(argv, log)
        step.seconds = time.monotonic() - t0
        ok = step.rc in step.ok_codes
        done[step.name] = ok
        for line in step.digest(log) if step.digest else []:
            _say(f"      {line}")
        if ok:
            step.status = "ok"
            extra = " (a gate failed: see the summary)" if step.rc == 3 else ""
            _say(f"      ok in {step.seconds:.1f} s{extra}")
        else:
            step.status = "failed"
            step.note = _error_line(log)
            _say(f"      FAILED (exit {step.rc}) in {step.seconds:.1f} s: {step.note}")
            _say(f"      log: {_rel(log)}")
            if not args.keep_going:
                break
    for step in plan:
        if step.status == "pending":
            step.status, step.note = "skipped", "an earlier step failed"

    summary = summarize(lay)
    summary["steps"] = [
        {"name": s.name, "status": s.status, "rc": s.rc, "seconds": round(s.seconds, 3)}
        | ({"note": s.note} if s.note else {})
        for s in plan
    ]
    summary["seconds"] = round(time.monotonic() - t_start, 3)
    lay.summary.write_text(json.dumps(summary, indent=2) + "\n")

    _say("\n== summary ==")
    for line in summary_lines(summary):
        _say(line)
    bad = [s for s in plan if s.status != "ok"]
    _say(
        f"steps: {total - len(bad)}/{total} ok"
        + ("" if not bad else " -- " + ", ".join(f"{s.name} {s.status}" for s in bad))
        + f"; total {summary['seconds']:.1f} s; summary.json and logs/ in {_rel(lay.out)}"
    )
    if not bad:
        return 0
    failed = [s for s in bad if s.status == "failed"]
    if failed:
        return failed[0].rc or 1
    return 2
