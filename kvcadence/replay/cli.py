"""``kvcadence replay``: push a bundle's request schedule through the simulated worker.

What this file owns: the ``replay`` subcommand's flags (every simulator setting
overridable), the progress bar (tqdm, only on a TTY), the closing summary, and the optional
live publishing (``--publish``, via ``replay.publish``). Imports only the standard library at
module level; the simulator and its dependencies load inside ``run``.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from kvcadence.argtypes import nonneg_float, nonneg_int, positive_int
from kvcadence.outguard import (
    refuse_nonempty_dir,
    removed_on_failure,
    replaced_with_force,
    term_as_interrupt,
)


def _bool_flag(
    p: argparse.ArgumentParser,
    name: str,
    dest: str,
    help_on: str,
    help_off: str,
    *,
    on: str | None = None,
    off: str | None = None,
) -> None:
    """``--NAME`` (``dest`` True) / ``--no-NAME`` (False), either flag's name replaceable
    (``on`` / ``off``: SGLang's own spellings); neither given: None (the bundle's)."""
    g = p.add_mutually_exclusive_group()
    g.add_argument(on or f"--{name}", dest=dest, action="store_const", const=True, help=help_on)
    g.add_argument(
        off or f"--no-{name}", dest=dest, action="store_const", const=False, help=help_off
    )


def register(sub: Any) -> None:
    p = sub.add_parser(
        "replay",
        help="simulate SGLang's scheduler, radix cache and KV-event cadence from a bundle",
        description=(
            "Replay BUNDLE's request schedule through a simulated SGLang worker and write a "
            "sim bundle (source=sim). Settings come from the bundle's /server_info snapshot "
            "(a capture without one: page size and KV pool read from its events, said on "
            "stderr); every one can be overridden. The pass-time model is calibrated from the capture. "
            "With --trace FILE instead of BUNDLE: an offline trace (Mooncake format or a "
            "requests JSONL), no capture needed. "
            "docs/simulator.md describes the model; docs/fleet.md DP ranks and sweeps."
        ),
        epilog="examples:\n"
        "  kvcadence replay run.kvcb --out sim.kvcb\n"
        "  kvcadence replay run.kvcb --out sim-p64.kvcb --page-size 64 --chunked-prefill-size 2048\n"
        "  kvcadence replay run.kvcb --publish tcp://127.0.0.1:5557 "
        "--replay-endpoint tcp://127.0.0.1:5558 --speed 1\n"
        "  kvcadence replay dp2.kvcb --sweep route=recorded,cache_aware --out sweep/\n"
        "  kvcadence replay --trace examples/mooncake-sample.jsonl --page-size 16 "
        "--max-total-tokens 20000 --out mc-sim.kvcb   # an offline trace, no capture\n",
    )
    p.add_argument("bundle", nargs="*",
                   help="source bundle(s): a capture or an import; several = several workers "
                   "(none with --trace)")  # fmt: skip
    p.add_argument("--out", help="sim bundle to write (a new or empty directory)")
    p.add_argument("--force", action="store_true",
                   help="replace an existing --out that a replay wrote (a sim bundle, a fleet "
                   "or --sweep directory; never a capture or the input); the old one is kept "
                   "until the new one is written")  # fmt: skip
    p.add_argument("--page-size", type=int, dest="page_size",
                   help="tokens per KV page (SGLang --page-size; default: the bundle's)")  # fmt: skip
    p.add_argument("--max-total-tokens", type=int, dest="max_total_tokens",
                   help="KV pool size in tokens (default: the bundle's max_total_num_tokens)")  # fmt: skip
    p.add_argument("--chunked-prefill-size", type=int, dest="chunked_prefill_size",
                   help="prefill chunk in tokens, <= 0 disables chunked prefill (SGLang --chunked-prefill-size; default: the bundle's)")  # fmt: skip
    p.add_argument("--max-prefill-tokens", type=int, dest="max_prefill_tokens",
                   help="prefill token budget per batch (SGLang --max-prefill-tokens; default: the bundle's)")  # fmt: skip
    p.add_argument("--max-running-requests", type=int, dest="max_running_requests",
                   help="cap on running requests (SGLang --max-running-requests; default: the bundle's)")  # fmt: skip
    p.add_argument("--prefill-max-requests", type=positive_int, dest="prefill_max_requests",
                   help="the most requests of one prefill batch (SGLang --prefill-max-requests; default: the bundle's, else no cap)")  # fmt: skip
    p.add_argument("--decode-log-interval", type=int, dest="decode_log_interval",
                   help="publish KV events every N-th decode result (SGLang --decode-log-interval; default: the bundle's)")  # fmt: skip
    p.add_argument(
        "--schedule-policy",
        # config.POLICIES (not imported here): cache-agnostic, then cache-aware
        choices=("fcfs", "lof", "random", "routing-key")
        + ("lpm", "dfs-weight", "hrrn", "shortest-prefill-first"),
        dest="schedule_policy",
        help="waiting-queue order (SGLang --schedule-policy; default: the bundle's)",
    )
    p.add_argument(
        "--radix-eviction-policy",
        choices=("lru", "lfu", "slru", "priority"),  # radix.EVICTION_POLICIES (not imported here)
        dest="eviction_policy",
        help="the radix tree's eviction order (SGLang --radix-eviction-policy; default: the bundle's)",
    )
    p.add_argument("--schedule-conservativeness", type=nonneg_float, dest="schedule_conservativeness",
                   help="scales the decode-token reservation (SGLang's option, default 1.0)")  # fmt: skip
    _bool_flag(
        p,
        "disable-overlap-schedule",
        "disable_overlap_schedule",
        "simulate the normal (non-overlap) event loop (default: as the bundle's worker ran)",
        "simulate the overlap event loop (SGLang's default)",
        off="--overlap-schedule",
    )
    _bool_flag(
        p,
        "mixed-chunk",
        "enable_mixed_chunk",
        "mixed chunked prefill: a prefill pass also decodes the running requests (SGLang "
        "--enable-mixed-chunk; needs chunked prefill; default: as the bundle's worker ran)",
        "prefill passes without the running requests' decode (SGLang's default)",
        on="--enable-mixed-chunk",
    )
    _bool_flag(
        p,
        "priority-scheduling",
        "enable_priority_scheduling",
        "order the waiting queue by each request's priority first and let a request preempt "
        "less important running ones (SGLang --enable-priority-scheduling; fcfs and lof "
        "only; default: as the bundle's worker ran)",
        "no priority scheduling (SGLang's default)",
        on="--enable-priority-scheduling",
    )
    _bool_flag(
        p,
        "priority-preemption",
        "disable_priority_preemption",
        "priority scheduling without preemption (SGLang --disable-priority-preemption; "
        "default: as the bundle's worker ran)",
        "priority scheduling with preemption (SGLang's default once it is on)",
        on="--disable-priority-preemption",
        off="--priority-preemption",
    )
    _bool_flag(
        p,
        "low-priority-values-first",
        "schedule_low_priority_values_first",
        "a lower priority value is more important (SGLang "
        "--schedule-low-priority-values-first; default: as the bundle's worker ran)",
        "a higher priority value is more important (SGLang's default)",
        on="--schedule-low-priority-values-first",
        off="--schedule-high-priority-values-first",
    )
    p.add_argument("--prefill-decode-interval", type=nonneg_int, dest="prefill_decode_interval",
                   metavar="N", help="decode rounds after each prefill batch before the next "
                   "prefill (SGLang's option; 0: off; default: the bundle's)")  # fmt: skip
    p.add_argument("--prefill-decode-interval-min-bs", type=nonneg_int,
                   dest="prefill_decode_interval_min_bs", metavar="N",
                   help="apply --prefill-decode-interval only while at least N requests run "
                   "(SGLang's option; default: the bundle's, else 0)")  # fmt: skip
    p.add_argument("--scheduler-recv-interval", type=positive_int, dest="scheduler_recv_interval",
                   metavar="N", help="receive new requests every N-th iteration after decode "
                   "ones (SGLang's option; default: the bundle's, else 1)")  # fmt: skip
    p.add_argument("--min-free-slots-delay", type=int, dest="min_free_slots_delay", metavar="N",
                   help="hold fresh prefills while fewer than N running-request slots are free "
                   "(SGLang's option, capped by --max-running-requests; <= 1: off; default: "
                   "the bundle's)")  # fmt: skip
    p.add_argument("--retraction-policy", choices=("length", "priority"), dest="retraction_policy",
                   help="which running request a decode short of memory retracts first: fewest "
                   "outputs (length) or the least important (priority; needs priority "
                   "scheduling) (SGLang's option; default: the bundle's, else length)")  # fmt: skip
    p.add_argument("--priority-scheduling-preemption-threshold", type=int,
                   dest="priority_threshold", metavar="N",
                   help="the priority gap a request must exceed to preempt a running one "
                   "(SGLang's option; default: the bundle's, else 10)")  # fmt: skip
    p.add_argument("--sglang-version", dest="sglang_version",
                   help="event granularity and wire encoding (0.5.20+ coalesced maps; 0.5.17, "
                   "0.5.14, 0.5.10 per-page arrays); default: the bundle's")  # fmt: skip
    t = p.add_argument_group("pass-time model (seconds; default: calibrated from the capture)")
    t.add_argument("--prefill-base", type=nonneg_float, dest="prefill_base_s", metavar="S",
                   help="fixed time of a prefill pass")  # fmt: skip
    t.add_argument("--prefill-per-token", type=nonneg_float, dest="prefill_per_token_s", metavar="S",
                   help="prefill time per extended (computed) token")  # fmt: skip
    t.add_argument("--prefill-per-req", type=nonneg_float, dest="prefill_per_req_s", metavar="S",
                   help="prefill time per request in the batch")  # fmt: skip
    t.add_argument("--prefill-per-prefix-token", type=nonneg_float,
                   dest="prefill_per_prefix_token_s", metavar="S",
                   help="prefill time per prefix token a request of the batch attends to "
                   "(its cached prefix plus earlier chunks)")  # fmt: skip
    t.add_argument("--prefill-per-seq-sq", type=nonneg_float,
                   dest="prefill_per_seq_sq_s", metavar="S",
                   help="prefill time per squared sequence length of each request of the "
                   "batch (its KV length after the pass; SGLang's torch-native attention, a "
                   "CPU worker's, computes every position's row)")  # fmt: skip
    t.add_argument("--decode-base", type=nonneg_float, dest="decode_base_s", metavar="S",
                   help="fixed time of a decode pass")  # fmt: skip
    t.add_argument("--decode-per-req", type=nonneg_float, dest="decode_per_req_s", metavar="S",
                   help="decode time per running request")  # fmt: skip
    t.add_argument("--decode-per-ctx-token", type=nonneg_float,
                   dest="decode_per_ctx_token_s", metavar="S",
                   help="decode time per context token the batch attends to (each running "
                   "request's prompt plus outputs so far; default: calibrated where the "
                   "running requests hold 4096+ tokens each, else 0)")  # fmt: skip
    t.add_argument("--default-gap", type=nonneg_float, dest="default_gap_s", metavar="S",
                   help="client gap when a request has none recorded")  # fmt: skip
    t.add_argument("--no-calibrate", action="store_true", help="use the built-in timing defaults")
    d = p.add_argument_group("PD disaggregation (default: the bundle's disaggregation_mode)")
    d.add_argument("--role", choices=("prefill", "decode", "both"), dest="role",
                   help="simulate a prefill-only or decode-only worker (default both)")  # fmt: skip
    _bool_flag(
        d,
        "decode-radix-cache",
        "decode_radix_cache",
        "--role decode: the worker enabled its decode radix cache (inserts at finish)",
        "--role decode: no radix cache (no KV events)",
    )
    d.add_argument("--transfer-base", type=nonneg_float, dest="transfer_base_s",
                   help="KV transfer time per request, s (default: from the capture, else 0.002)")  # fmt: skip
    d.add_argument("--transfer-per-token", type=nonneg_float, dest="transfer_per_token_s",
                   help="KV transfer time per prompt token, s")  # fmt: skip
    _bool_flag(
        p,
        "visibility",
        "track_visibility",
        "record per-block computed/published pass and time in the sim bundle (default)",
        "do not record visibility notes",
    )
    _bool_flag(
        p,
        "skip-decode-stretches",
        "skip_decode_stretches",
        "advance decode stretches at once (default; output is identical)",
        "simulate every decode pass one by one",
    )
    _bool_flag(
        p,
        "sync-forward",
        "sync_forward",
        "the forward runs inside the launch (a --device cpu worker): receive and process the "
        "previous result after it ends",
        "GPU overlap timing (default)",
    )
    _bool_flag(
        p,
        "scale-client-gaps",
        "scale_client_gaps",
        "scale each recorded client gap by the predecessor's simulated / recorded latency "
        "(default)",
        "replay recorded client gaps as they are",
    )
    pub = p.add_argument_group("live publishing (SGLang framing, loopback)")
    pub.add_argument("--publish", metavar="tcp://127.0.0.1:PORT", help="PUB endpoint to bind")
    pub.add_argument("--replay-endpoint", metavar="tcp://127.0.0.1:PORT",
                     help="ROUTER replay endpoint to bind")  # fmt: skip
    pub.add_argument("--speed", type=nonneg_float, default=0.0,
                     help="pace messages at virtual time / SPEED (0 = as fast as possible)")  # fmt: skip
    pub.add_argument("--linger", type=nonneg_float, default=2.0,
                     help="seconds to keep serving replay requests after the last message "
                     "(default 2; requests are also served while publishing)")  # fmt: skip
    p.add_argument("--trace-evictions", metavar="FILE", dest="trace_evictions", default=None,
                   help="write a JSON line to FILE (a new file) for every eviction the "
                   "simulated worker makes: cause, tokens asked for, available before and "
                   "after, the batch's rids -- the shape `harness start --trace-evictions` "
                   "gives a real worker's (one rank; decode stretches are stepped)")  # fmt: skip
    p.add_argument("--json", action="store_true", help="print the summary as JSON")
    p.add_argument(
        "--quiet",
        action="store_true",
        help="no phase lines (loading, simulating, writing) or progress bar on stderr",
    )
    from kvcadence.format.texttokens import add_tokenizer_option  # text prompts' ids
    from kvcadence.replay.cli_fleet import add_fleet_args  # DP ranks / workers / sweeps
    from kvcadence.replay.cli_trace import add_trace_args  # offline traces

    add_tokenizer_option(p)
    add_fleet_args(p)
    add_trace_args(p)
    # no partial sim bundle on a full disk, on Ctrl-C or on SIGTERM
    p.set_defaults(
        _run=replaced_with_force(removed_on_failure(term_as_interrupt(run)), _replay_output)
    )


def _replay_output(path: Path, args: argparse.Namespace) -> str | None:
    """What ``--force`` may replace (``simbundle.replaceable``), ``args``' inputs kept."""
    from kvcadence.replay.simbundle import replaceable

    return replaceable(path, [*(args.bundle or []), *filter(None, [getattr(args, "trace", None)])])


_FORCE_HINT = "--force replaces a replay's own output"  # said when --out is refused


def run(args: argparse.Namespace) -> int:
    from kvcadence.errors import UsageError
    from kvcadence.replay.cli_fleet import maybe_run_fleet, needs_fleet, replay_pace
    from kvcadence.replay.config import CLI_OVERRIDES
    from kvcadence.replay.simulator import replay_bundle
    from kvcadence.replay.worker import effective_config

    tracing = getattr(args, "trace_evictions", None)
    if tracing and Path(tracing).exists():
        raise UsageError(f"replay: --trace-evictions {tracing}: exists (not overwritten)")
    if args.out:  # refused before any work (a fleet's, a sweep's output too)
        refuse_nonempty_dir(args.out, hint=_FORCE_HINT)
    if getattr(args, "trace", None) is None:
        if not args.bundle:
            raise UsageError("replay: give BUNDLE (a capture or an import) or --trace FILE")
        if tracing and needs_fleet(args, list(args.bundle)):
            raise UsageError("replay: --trace-evictions traces one rank's replay, not a fleet")
        rc = maybe_run_fleet(args)  # several ranks / workers / --route / --sweep
        if rc is not None:
            return rc
    elif tracing:
        raise UsageError("replay: --trace-evictions replays a bundle, not --trace FILE")
    if args.out is None and args.publish is None:
        raise UsageError("replay: give --out SIM_BUNDLE and/or --publish ENDPOINT")
    if args.speed < 0:
        raise UsageError("--speed must be >= 0")
    if args.linger < 0:
        raise UsageError("--linger must be >= 0")
    overrides = {k: getattr(args, k) for k in CLI_OVERRIDES}
    from kvcadence.format.bundle import BundleReader
    from kvcadence.progress import Phases, request_bar

    phases = Phases("replay", quiet=args.quiet, started=getattr(args, "_started", None))
    if getattr(args, "trace", None) is not None:
        from kvcadence.replay.cli_trace import run_trace

        result, cfg = run_trace(args, overrides, phases)
        args._out_complete = True  # written whole: an interrupted --publish keeps it
        return _finish(args, result, cfg, phases, None)
    src = Path(args.bundle)
    if not src.exists():
        raise UsageError(f"{src}: no such bundle")
    from kvcadence.format.texttokens import load_tokenizer
    from kvcadence.replay.loading import load_for_replay
    from kvcadence.replay.settings import capture_settings, namespace_note

    reader = BundleReader(src)  # (a bad --tokenizer fails before any record is read)
    records, inferred, flushes = load_for_replay(reader, phases, load_tokenizer(args.tokenizer))
    _warn_if_damaged(src, reader, len(records))
    settings = capture_settings(reader)
    if settings.note and not args.quiet:
        print(f"replay: warning: {src}: {settings.note}", file=sys.stderr)
    ns_note = namespace_note(records)
    if ns_note and not args.quiet:
        print(f"replay: warning: {src}: {ns_note}", file=sys.stderr)
    calibration: dict[str, Any] = {}
    cfg = effective_config(
        settings.server_info,
        records,
        overrides,
        sglang_version=args.sglang_version or reader.header.sglang_version,
        calibrate_timing=not args.no_calibrate,
        calibration=calibration,
    )
    with request_bar(len(records), quiet=args.quiet) as progress, _trace_file(tracing) as trace:
        result = replay_bundle(
            src,
            args.out,
            cfg,
            progress=progress,
            phases=phases,
            loaded=(reader.header, records),
            inferred=inferred,
            flushes=flushes,
            keep_batches=bool(args.publish),  # published live after the run
            pace=replay_pace(args),
            eviction_trace=trace,
        )
    if trace is not None and not args.quiet:
        print(f"replay: {trace.count} evictions traced -> {tracing}", file=sys.stderr)
    args._out_complete = True  # written whole: an interrupted --publish keeps it
    return _finish(args, result, cfg, phases, inferred, (calibration, overrides))


@contextlib.contextmanager
def _trace_file(path: str | None) -> Iterator[Any]:
    """``--trace-evictions``' ``EvictionTrace`` on a new file (exclusive create: another
    process's file is never appended to), or None."""
    if not path:
        yield None
        return
    from kvcadence.errors import UsageError
    from kvcadence.replay.evictiontrace import EvictionTrace

    try:
        fh = open(path, "x", encoding="utf-8")  # noqa: SIM115 - closed below
    except OSError as exc:
        raise UsageError(f"replay: --trace-evictions {path}: {exc.strerror}") from None
    with fh:
        yield EvictionTrace(fh)


def _warn_if_damaged(src: Any, reader: Any, n_requests: int) -> None:
    """One stderr line when the input bundle lost data or has no clean end (a capture cut off,
    a truncated copy): the replay runs on what was readable, and says so instead of passing
    a partial schedule off as the whole capture (``inspect`` details the damage)."""
    rep = reader.report
    if not rep.damaged and rep.clean_shutdown:
        return
    what = []
    if rep.torn_bytes:
        what.append(f"torn tail of {rep.torn_bytes} bytes")
    if rep.corrupt:
        what.append(f"{rep.corrupt_bytes} corrupt bytes")
    if rep.missing_segments or rep.refused_segments:
        what.append(f"{len(rep.missing_segments) + len(rep.refused_segments)} segments lost")
    if rep.shortfall:
        what.append(f"{rep.missing_records} records missing")
    if not rep.clean_shutdown:
        what.append("no clean end (Trailer)")
    print(
        f"replay: warning: {src} is damaged or incomplete ({', '.join(what)}): replaying "
        f"the {n_requests} requests that could be read (kvcadence inspect {src})",
        file=sys.stderr,
    )


def _finish(
    args: argparse.Namespace,
    result: Any,
    cfg: Any,
    phases: Any,
    inferred: Any,
    timing: tuple[dict[str, Any], dict[str, Any]] | None = None,
) -> int:
    """Publish (``--publish``), print the summary, exit status of a single-worker replay.
    ``timing``: a bundle's replay, ``(calibration report, overrides)``: its pass-time model
    and where it came from are said (``timing.model_line``; JSON ``timing``, ``calibration``)."""
    from kvcadence.replay.simulator import check_some_ran
    from kvcadence.replay.timing import given_terms

    summary = result.summary()
    given = given_terms(cfg.timing, timing[1]) if timing is not None else []
    if timing is not None:
        summary["timing"] = dataclasses.asdict(cfg.timing)
        summary["calibration"] = {**timing[0], "given": given}
    summary["simulate_s"] = summary.pop("wall_s")
    if args.publish:
        from kvcadence.replay.publish import publish_batches

        pub_stats: dict[str, int] = {}
        with phases.phase(
            "publish", f"publishing {len(result.batches)} messages on {args.publish}"
        ):
            sent = publish_batches(
                result.batches,
                args.publish,
                topic=cfg.topic,
                replay_endpoint=args.replay_endpoint,
                speed=args.speed,
                linger_s=args.linger,
                stats=pub_stats,
            )
        summary["published"] = sent
        summary.update(pub_stats)
    # "wall" is the whole command (imports, load, simulate, write, publish), with its phases
    summary["wall_s"] = round(phases.wall(), 3)
    summary["phases_s"] = {k: round(v, 3) for k, v in phases.times.items()}
    if args.json:
        print(json.dumps(summary, sort_keys=True))
    else:
        where = f" -> {args.out}" if args.out else ""
        print(
            f"replayed {summary['requests']} requests{where}: {summary['passes']} passes "
            f"({summary['prefill_passes']} prefill"
            + (f", {summary['mixed_passes']} of them mixed" if summary["mixed_passes"] else "")
            + f", {summary['decode_passes']} decode), "
            f"{summary['events']} events in {summary['messages']} messages, "
            f"{summary['evictions']} evictions, {summary['retractions']} retractions, "
            + (f"{summary['preemptions']} preemptions, " if summary.get("preemptions") else "")
            + f"{summary['aborted']} aborted; "
            + _held_before(summary.get("held_before_tokens"))
            + f"virtual {summary['virtual_s']:.3f} s, wall {summary['wall_s']:.2f} s "
            f"({phases.breakdown()})"
        )
        if timing is not None:
            from kvcadence.replay.timing import model_line

            print(model_line(cfg.timing, timing[0], given, calibrated=not args.no_calibrate))
        if inferred:
            from kvcadence.replay.inferred import report_text

            # the run's own (the replay's retractions added to the capture's)
            print(report_text(summary.get("inferred") or inferred))
    check_some_ran(result.requests)
    return 0


def _held_before(tokens: int | None) -> str:
    """The summary's held-before clause (``inferred.held_before_text``); empty when none."""
    if not tokens:
        return ""
    from kvcadence.replay.inferred import held_before_text

    return f"{held_before_text(tokens)}; "
