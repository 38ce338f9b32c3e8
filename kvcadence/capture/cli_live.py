"""Commands ``capture`` (+ ``capture import``) and ``drive`` (``harness`` is ``kvcadence.harness.cli``).

* ``kvcadence capture (--server URL | --endpoint URL [--replay-endpoint URL] ...) --out B``
  records a live worker's KV events into bundle ``B`` until SIGINT/SIGTERM, ``--duration`` or
  ``--until-idle``.
* ``kvcadence capture import --sglang-metrics DIR_OR_FILE --sglang-request-log FILE B`` adds
  ``RequestRecord``s from SGLang's own request logs to ``B`` (created when missing).
* ``kvcadence drive --server URL --workload SPEC --out B`` sends a workload and records the
  requests and (unless ``--no-capture``) the worker's KV events into the same bundle.

Only the standard library is imported here; everything else is imported by the run
functions.

Why ~630 lines: the argparse surface of two commands (capture, drive) and their run
functions; the work is in the library modules.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import sys
import textwrap
import threading
import time
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

from kvcadence.argtypes import nonneg_float, positive_float
from kvcadence.capture import cli_tail
from kvcadence.errors import InputError, UsageError


def register(sub: Any) -> None:
    _register_capture(sub)
    _register_drive(sub)


# ---------------------------------------------------------------------- shared options


def _add_endpoint_opts(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("KV-event endpoints (default: discovered from --server)")
    g.add_argument(
        "--endpoint",
        action="append",
        default=[],
        metavar="URL",
        help="publisher PUB endpoint, e.g. tcp://127.0.0.1:5557 (repeat for each DP rank)",
    )
    g.add_argument(
        "--replay-endpoint",
        action="append",
        default=[],
        metavar="URL",
        help="replay ROUTER of the i-th --endpoint ('none' for none)",
    )
    g.add_argument("--topic", default="", help="topic prefix to subscribe to (default: all)")
    g.add_argument(
        "--replay-timeout",
        type=positive_float,
        default=2.0,
        metavar="S",
        help="give up a replay after S seconds without a reply (default 2)",
    )
    g.add_argument(
        "--no-initial-replay",
        action="store_true",
        help="do not fetch the publisher's replay ring from seq 0 at start",
    )
    g.add_argument(
        "--from-now",
        action="store_true",
        help="record from the first live message on: no initial replay, and a first seq "
        "above 0 starts the recording instead of being a gap to recover. Without it the "
        "capture recovers what the worker's replay ring still holds of its history (the "
        "replay rebuilds those requests from their stores; --sglang-backlog reads their "
        "records too)",
    )
    g.add_argument(
        "--segment-mb", type=positive_float, default=256.0, help="segment size in MB (default 256)"
    )


def _register_capture(sub: Any) -> None:
    p = sub.add_parser(
        "capture",
        help="record a live SGLang worker's KV events into a bundle",
        description=(
            "Record every KV-event batch a live SGLang worker publishes (ZMQ SUB per DP "
            "rank, replay recovery of gaps) into bundle --out. Stops on SIGINT/SIGTERM, "
            "--duration or --until-idle, writing a Trailer. Sub-mode 'import' adds SGLang's "
            "own request logs to a bundle. Exit 4 when nothing was recorded."
        ),
        epilog="examples:\n"
        "  kvcadence capture --server http://127.0.0.1:30000 --out run.kvcb --until-idle 3\n"
        "  kvcadence capture --endpoint tcp://127.0.0.1:5557 --replay-endpoint "
        "tcp://127.0.0.1:5558 \\\n"
        "      --out live.kvcb --duration 60\n"
        "  kvcadence capture --server http://127.0.0.1:30000 --sglang-metrics METRICS_DIR "
        "--out prod.kvcb\n"
        "  kvcadence capture import --sglang-metrics METRICS_DIR run.kvcb\n",
    )
    p.add_argument("--server", metavar="URL", help="SGLang server for /server_info discovery")
    p.add_argument("--out", metavar="BUNDLE", help="bundle directory to create")
    p.add_argument("--duration", type=positive_float, metavar="S", help="stop after S seconds")
    p.add_argument(
        "--until-idle",
        type=positive_float,
        metavar="S",
        help="stop after S seconds without messages (counted from start-up when nothing arrives)",
    )
    p.add_argument("--quiet", action="store_true", help="no status line, no summary")
    _add_endpoint_opts(p)
    add_redact_option(p)
    cli_tail.add_options(p)
    p.set_defaults(_run=run_capture)
    modes = p.add_subparsers(title="modes", metavar="MODE", dest="capture_mode")
    imp = modes.add_parser(
        "import",
        help="add SGLang's own request logs (metrics export / JSON request log) to a bundle",
        description=(
            "Convert SGLang's --export-metrics-to-file lines and/or --log-requests "
            "--log-requests-format json lines into RequestRecords appended to BUNDLE "
            "(created when missing). Each file is read as it is when the command starts "
            "(lines a live worker appends later are left for the next import), a line at a "
            "time: each record is validated as it is written, and a bad one leaves BUNDLE as it "
            "was (a new one is not created, an append is undone); the logs "
            "are never held in memory. Into a bundle that holds KV events only the records "
            "of the capture's own stretch are imported (a metrics directory holds every hour "
            "the worker served): those that finished before its first KV event or were "
            "received after its last are left out and counted (--all-records keeps them). "
            "Pickled dumps are refused."
        ),
        epilog="examples:\n"
        "  kvcadence capture import --sglang-metrics METRICS_DIR run.kvcb\n"
        "  kvcadence capture import --sglang-request-log server.log --quiet requests.kvcb\n",
    )
    imp.add_argument("bundle", metavar="BUNDLE", help="bundle to append to (created when missing)")
    imp.add_argument(
        "--sglang-metrics",
        metavar="DIR_OR_FILE",
        action="append",
        default=[],
        help="SGLang's --export-metrics-to-file output: the directory or one file (repeatable)",
    )
    imp.add_argument(
        "--sglang-request-log",
        metavar="FILE",
        action="append",
        default=[],
        help="a log written with --log-requests --log-requests-format json (repeatable)",
    )
    imp.add_argument(
        "--all-records",
        action="store_true",
        help="import every record, also those outside the bundle's KV events (by default a "
        "record that finished before the capture's first KV event or was received after its "
        "last is left out, and counted: it published nothing the capture holds)",
    )
    from kvcadence.format.texttokens import add_tokenizer_option

    add_tokenizer_option(imp)
    imp.add_argument("--quiet", action="store_true", help="no summary line on stderr")
    add_redact_option(imp)
    imp.set_defaults(_run=run_capture_import)


def _register_drive(sub: Any) -> None:
    p = sub.add_parser(
        "drive",
        help="send a workload to a worker and record requests + KV events",
        description=(
            "Send a workload to SGLang's POST /generate (input_ids, temperature 0, "
            "ignore_eos unless --no-ignore-eos) and record one RequestRecord per request, capturing the worker's KV "
            "events into the same bundle. SPEC: agent[:k=v,...] | mooncake:path=FILE[,...] | "
            'admission:path=FILE[,...] | @spec.json (a JSON object with "kind" and the keys). '
            "docs/drive.md describes each key."
        ),
        epilog=_drive_epilog(),
    )
    p.add_argument(
        "--server",
        required=True,
        metavar="URL",
        help="the SGLang server, e.g. http://127.0.0.1:30000",
    )
    p.add_argument(
        "--workload",
        required=True,
        metavar="SPEC",
        help="KIND[:key=value,...] or @spec.json; the keys of each KIND are listed below",
    )
    p.add_argument(
        "--out", required=True, metavar="BUNDLE", help="bundle directory to create (new or empty)"
    )
    p.add_argument("--lanes", type=int, help="override the workload's lanes")
    p.add_argument("--requests", type=int, help="override the agent workload's request count")
    p.add_argument("--seed", type=int, help="override the workload seed")
    p.add_argument("--no-capture", action="store_true", help="record requests only")
    p.add_argument(
        "--settle",
        type=nonneg_float,
        default=2.0,
        metavar="S",
        help="after the last request, keep capturing until S s without events (default 2)",
    )
    p.add_argument(
        "--timeout",
        type=positive_float,
        default=600.0,
        metavar="S",
        help="per-request HTTP timeout, s (default 600)",
    )
    p.add_argument(
        "--flush-at",
        type=int,
        action="append",
        default=[],
        metavar="N",
        help="after N requests were sent, let them finish, POST /flush_cache (recorded as an "
        "Annotation) and go on (repeatable)",
    )
    p.add_argument(
        "--rid-prefix",
        default="",
        metavar="P",
        help="prefix every request id with P (default: none)",
    )
    p.add_argument(
        "--no-ignore-eos",
        action="store_true",
        help="send ignore_eos false: a request may stop at EOS, and SGLang's admission "
        "reserves only new_token_ratio of its remaining output (with ignore_eos, all of "
        "it), so long outputs in a small pool can be retracted",
    )
    p.add_argument("--quiet", action="store_true", help="no progress bar, no summary lines")
    _add_endpoint_opts(p)
    add_redact_option(p)
    p.set_defaults(_run=run_drive)


def _drive_epilog() -> str:
    """Examples plus every workload KIND's keys with their defaults (from the dataclasses)."""
    from kvcadence.capture.workloads import workload_keys  # standard library only

    lines = [
        "examples:",
        "  kvcadence drive --server http://127.0.0.1:30000 "
        "--workload agent:lanes=4,requests=120,seed=101 --out run.kvcb",
        "  kvcadence drive --server URL --workload mooncake:path=trace.jsonl,speedup=4 --out mc.kvcb",
        "  kvcadence drive --server URL --workload admission:path=mix.jsonl,page_size=64 "
        "--out adm.kvcb",
        "",
        "workload keys (KIND: key=default ...):",
    ]
    for kind, keys in workload_keys().items():
        text = " ".join(f"{k}={v!r}" if isinstance(v, str) else f"{k}={v}" for k, v in keys)
        lines.append(
            textwrap.fill(text, 88, initial_indent=f"  {kind}: ", subsequent_indent="    ")
        )
    return "\n".join(lines) + "\n"


# ---------------------------------------------------------------------- helpers


@contextlib.contextmanager
def _stop_on_signals(stop: threading.Event) -> Iterator[None]:
    """SIGINT/SIGTERM only set ``stop`` (the loop drains and writes the Trailer)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    old = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}

    def handler(signum: int, frame: Any) -> None:
        stop.set()

    for s in old:
        signal.signal(s, handler)
    try:
        yield
    finally:
        for s, h in old.items():
            signal.signal(s, h)


def _endpoints(args: argparse.Namespace) -> tuple[list[Any], dict[str, Any] | None]:
    from kvcadence.capture import discovery

    info = None
    if args.server:
        info = discovery.fetch_server_info(args.server)
    if args.endpoint:
        eps = discovery.explicit_endpoints(args.endpoint, args.replay_endpoint, args.topic)
    elif info is not None:
        eps = discovery.endpoints_from_server_info(info, args.server)
        if args.topic:
            eps = [type(e)(e.id, e.url, e.replay_url, e.dp_rank, args.topic) for e in eps]
    else:
        raise UsageError("give --server URL (discovery) or at least one --endpoint URL")
    if args.replay_endpoint and not args.endpoint:
        raise UsageError("--replay-endpoint needs a matching --endpoint")
    return eps, info


def _open_writer(out: str, header: Any, segment_mb: float) -> Any:
    from kvcadence.format.bundle import BundleWriter

    if segment_mb <= 0:
        raise UsageError("--segment-mb must be > 0")
    return BundleWriter(out, header, segment_bytes=max(64, int(segment_mb * (1 << 20))))


def _make_recorder(args: argparse.Namespace, eps: list[Any], **kw: Any) -> Any:
    """A ``Recorder`` with its sockets connected and no writer yet (``attach`` it once the
    bundle is opened: a socket error must not leave a bundle behind)."""
    from kvcadence.capture.recorder import NO_TRAFFIC_WARN_S, Recorder, StatusLine

    status = None if args.quiet else StatusLine()
    return Recorder(
        None,
        eps,
        replay_timeout_s=args.replay_timeout,
        initial_replay=not args.no_initial_replay,
        from_now=from_now(args),
        status=status,
        warn_idle_s=None if args.quiet else NO_TRAFFIC_WARN_S,
        **kw,
    )


def from_now(args: argparse.Namespace) -> bool:
    """``--from-now``: record from the first live message on. Not the default when tailing
    SGLang's request files: the history the worker's replay ring still holds comes in with
    the initial replay, and the replay rebuilds its requests (they have no records) from
    their stores, so the simulated tree starts where the worker's was (docs/production.md,
    "Attaching to a worker that already served traffic")."""
    return bool(getattr(args, "from_now", False))


def add_redact_option(p: argparse.ArgumentParser) -> None:
    """``--redact PATH`` (repeatable) on a command that writes a bundle header
    (``discovery.header_redactions``)."""
    p.add_argument(
        "--redact",
        action="append",
        metavar="PATH",
        help="also scrub PATH (a model or tokenizer directory, say) from the bundle header's "
        "server_info and command line: it becomes <redacted> (repeatable; the home, temp and "
        "harness directories are always scrubbed)",
    )


def command_line() -> list[str]:
    """The command line recorded in a header: ``["kvcadence", <args>]`` (never the path of
    the interpreter's script; paths in the args are scrubbed by ``make_header``)."""
    return ["kvcadence", *sys.argv[1:]]


# ---------------------------------------------------------------------- capture


def run_capture(args: argparse.Namespace) -> int:
    from kvcadence.capture import discovery
    from kvcadence.capture.recorder import summary_text

    if not args.out:
        raise UsageError("capture needs --out BUNDLE")
    for name in ("duration", "until_idle"):
        v = getattr(args, name)
        if v is not None and v <= 0:
            raise UsageError(f"--{name.replace('_', '-')} must be > 0")
    if args.segment_mb <= 0:
        raise UsageError("--segment-mb must be > 0")
    eps, info = _endpoints(args)
    header = discovery.make_header(
        eps,
        server_info=info,
        command=command_line(),
        workdirs=discovery.harness_workdirs(args.server, info),
        more=discovery.header_redactions(args.redact, args.server),
    )
    logs = cli_tail.open_tail(args, info)  # bad log paths fail before anything opens
    rec = _make_recorder(args, eps, duration_s=args.duration, until_idle_s=args.until_idle)
    try:
        writer = _open_writer(args.out, header, args.segment_mb)
    except BaseException:
        rec.close()
        raise
    rec.attach(writer)
    stop = threading.Event()
    try:
        if logs is not None:
            logs.attach(rec)
        with _stop_on_signals(stop):
            stats = rec.run(stop)
    finally:
        if logs is not None:
            logs.abort()
    if not args.quiet:
        print(summary_text(stats, args.out), file=sys.stderr)
    cli_tail.print_summary(logs, args.out, args.quiet)
    if stats.written == 0:
        check_recorded(stats, eps, args.out)
    return 0


def check_recorded(stats: Any, eps: list[Any], out: str) -> None:
    """``NothingCaptured`` (exit 4, one line on stderr even with ``--quiet``) when a capture
    wrote no KV-event message: the bundle exists but holds nothing to replay."""
    from kvcadence.errors import NothingCaptured

    if stats.written:
        return
    where = ", ".join(e.url for e in eps) or "no endpoint"
    raise NothingCaptured(
        f"capture recorded 0 KV-event messages from {where} ({stats.stop_reason or 'stopped'}); "
        f"{out} holds no events. Check --endpoint/--server and that the worker runs with "
        "--kv-events-config"
    )


def run_capture_import(args: argparse.Namespace) -> int:
    from kvcadence.capture import sglang_logs
    from kvcadence.capture.discovery import header_redactions, make_header
    from kvcadence.capture.importer import check_request_record
    from kvcadence.capture.rids import UniqueRids, bundle_rids, known_rid
    from kvcadence.capture.window import RecordWindow, event_window
    from kvcadence.format.bundle import BundleWriter, check_encodable, staged_bundle
    from kvcadence.format.schema import RequestRecord

    if not args.sglang_metrics and not args.sglang_request_log:
        raise UsageError("capture import needs --sglang-metrics and/or --sglang-request-log")
    from kvcadence.format.texttokens import load_tokenizer

    more = header_redactions(args.redact)
    tok = load_tokenizer(args.tokenizer)  # a bad directory fails before anything is read
    # each log as it is now (sizes taken: a live worker's later lines are not read), read
    # once, a line at a time, each record validated as it is written -- never every record
    # in memory; a bad one undoes the whole import (below)
    logs: list[Iterable[RequestRecord]] = [
        *map(sglang_logs.MetricsExport, args.sglang_metrics),
        *map(sglang_logs.JsonRequestLog, args.sglang_request_log),
    ]
    out = Path(args.bundle)
    n = 0
    created = not (out.exists() and any(out.iterdir()))
    # a bundle with KV events keeps the records of its own stretch of the worker's life
    # (``capture.window``: a metrics directory holds every hour the worker served)
    span = None if created or args.all_records else event_window(out)
    window = None if span is None else RecordWindow(*span)

    def validated(known: set[str]) -> Iterator[RequestRecord]:
        nonlocal n
        seen = UniqueRids("capture import")  # e.g. metrics and request log together
        for log in logs:
            for rec0 in log:  # validated as `kvcadence import` validates
                rec = rec0 if tok is None else tok.complete(rec0)
                check_request_record(rec, f"{rec.source} record rid {rec.rid!r}")
                check_encodable([rec])  # a record that cannot be written fails here
                seen.add(rec.rid)
                if rec.rid in known:  # never a request twice
                    raise known_rid(out, rec.rid)
                n += 1
                if window is None or window.keep(rec):
                    yield rec

    if created:  # all or nothing: staged, moved into place once every record is written
        with (
            staged_bundle(out) as tmp,
            BundleWriter(
                tmp, make_header([], server_info=None, command=command_line(), more=more)
            ) as w,
        ):
            for rec in validated(set()):
                w.write(rec)
    else:
        w = BundleWriter.append(out)  # locked: the rids read next stay the bundle's
        try:
            for rec in validated(bundle_rids(out)):
                w.write(rec)
            if window is not None and window.left_out and not window.kept:
                raise InputError(f"capture import: {window.refusal(n)}")
        except BaseException:
            w.discard()  # all or nothing: the segments this import opened are removed
            raise
        w.close()
    if not args.quiet:
        # a new bundle holds requests only: said, so a mistyped capture name is seen at once
        new = " (a new bundle: no KV events, no server info)" if created else ""
        kept = n if window is None else window.kept
        said = "" if window is None else window.said()
        toks = f"; {tok.summary()}" if tok is not None and tok.summary() else ""
        print(f"capture import: {kept} request records -> {out}{new}{said}{toks}", file=sys.stderr)
    return 0


# ---------------------------------------------------------------------- drive


def run_drive(args: argparse.Namespace) -> int:
    from kvcadence.capture import discovery
    from kvcadence.capture.driver import Driver
    from kvcadence.capture.recorder import summary_text
    from kvcadence.capture.workloads import build_workload
    from kvcadence.format.schema import Annotation

    wl = build_workload(args.workload, lanes=args.lanes, requests=args.requests, seed=args.seed)
    opts = _drive_opts(args)  # bad options fail before anything is created
    stop = threading.Event()
    info = discovery.fetch_server_info(args.server)
    eps: list[Any] = []
    if not args.no_capture:
        eps, _ = (
            _endpoints(args)
            if args.endpoint
            else (discovery.endpoints_from_server_info(info, args.server), None)
        )
    workdirs = discovery.harness_workdirs(args.server, info)
    more = discovery.header_redactions(args.redact, args.server)
    header = discovery.make_header(
        eps, server_info=info, command=command_line(), workdirs=workdirs, more=more
    )
    if args.segment_mb <= 0:
        raise UsageError("--segment-mb must be > 0")
    rec = None if args.no_capture else _make_recorder(args, eps)
    try:
        writer = _open_writer(args.out, header, args.segment_mb)
    except BaseException:
        if rec is not None:
            rec.close()
        raise
    note = Annotation(
        kind="workload",
        recv_ns=time.time_ns(),
        data=discovery.redact_paths(wl.describe(), workdirs, more),
    )
    progress = None if args.quiet or not sys.stderr.isatty() else _progress_bar(wl)
    host = [_host_note("start")]
    if args.no_capture:
        writer.write(note)
        writer.write(host[0])
        try:
            with _stop_on_signals(stop):
                drv = Driver(args.server, wl, writer.write, stop=stop, progress=None, **opts)
                dst = drv.run()
            host.append(_host_note("end"))
            writer.write(host[1])
        finally:
            writer.close(clean=not stop.is_set())
        _drive_summary(args, dst, None, host)
        return 0

    rec_stop = threading.Event()
    assert rec is not None
    rec.attach(writer)
    rec.status = None  # the driver's progress bar owns the terminal
    rec.submit(note)
    rec.submit(host[0])
    result: dict[str, Any] = {}

    def record() -> None:
        try:
            result["stats"] = rec.run(rec_stop)
        except BaseException as exc:  # noqa: BLE001 - re-raised in the main thread
            result["error"] = exc
            stop.set()

    t = threading.Thread(target=record, name="kv-capture")
    t.start()
    rec.ready.wait(10)
    time.sleep(0.3)  # let SUB subscriptions reach the publisher (slow joiner)
    try:
        with _stop_on_signals(stop):
            drv = Driver(args.server, wl, rec.submit, stop=stop, progress=progress, **opts)
            dst = drv.run()
            # the last finish stores are published when the worker goes idle
            deadline = time.monotonic() + max(args.settle, 0) * 10
            while not stop.is_set() and time.monotonic() < deadline:
                last = rec.stats.last_msg_ns
                idle = (time.time_ns() - last) / 1e9 if last else args.settle
                if idle >= args.settle:
                    break
                time.sleep(0.1)
            host.append(_host_note("end"))
            rec.submit(host[1])
    finally:
        rec_stop.set()
        t.join()
        if progress is not None:
            progress.close()
    if "error" in result:
        raise result["error"]
    _drive_summary(args, dst, result.get("stats"), host)
    if not args.quiet:
        print(summary_text(result["stats"], args.out), file=sys.stderr)
    return 0


def _drive_opts(args: argparse.Namespace) -> dict[str, Any]:
    if any(n < 1 for n in args.flush_at):
        raise UsageError("--flush-at N needs N >= 1 (flush after the first N requests)")
    return {
        "timeout_s": args.timeout,
        "flush_at": args.flush_at,
        "rid_prefix": args.rid_prefix,
        "ignore_eos": not args.no_ignore_eos,
    }


def _progress_bar(wl: Any) -> Any:
    from tqdm import tqdm

    total = getattr(wl, "requests", None)
    bar = tqdm(total=total, unit="req", desc="drive", leave=False)

    def cb(rec: Any) -> None:
        bar.update(1)

    cb.close = bar.close  # type: ignore[attr-defined]
    return cb


def _host_note(at: str) -> Any:
    """A ``host`` note: this box's CPUs and load average (1, 5, 15 min) at the run's
    ``start`` or ``end``. A CPU worker on a loaded box paces differently and its frontend
    (tokenizer, detokenizer) starves, delaying arrivals by what no record holds
    (docs/drive.md, "A quiet box"); the note keeps the evidence with the capture."""
    from kvcadence.format.schema import Annotation

    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    try:
        load: list[float] | None = [round(v, 2) for v in os.getloadavg()]
    except OSError:  # pragma: no cover - a platform without a load average
        load = None
    return Annotation(
        kind="host", recv_ns=time.time_ns(), data={"at": at, "cpus": cpus, "load_avg": load}
    )


def _drive_summary(args: argparse.Namespace, dst: Any, cst: Any, host: list[Any]) -> None:
    if args.quiet:
        return
    hit = dst.cached_tokens / dst.prompt_tokens if dst.prompt_tokens else 0.0
    loads = [h.data["load_avg"][0] for h in host if h.data["load_avg"]]
    print(
        f"drive: {dst.sent} requests ({dst.errors} errors) in {dst.wall_s:.1f} s, "
        f"{dst.prompt_tokens} prompt / {dst.cached_tokens} cached ({hit:.1%}) / "
        f"{dst.completion_tokens} completion tokens"
        + (f", {dst.flushes} cache flushes ({dst.flush_failures} refused)" if args.flush_at else "")
        + (
            f"; load average {' -> '.join(f'{v:.2f}' for v in loads)} on "
            f"{host[0].data['cpus']} CPUs"
            if loads
            else ""
        ),
        file=sys.stderr,
    )
