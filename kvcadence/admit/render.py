"""The three output formats of ``kvcadence admit``: text (tick table), JSON and JSONL."""

from __future__ import annotations

import json
from typing import IO, Any

from kvcadence.admit.ticks import DURATION_NOTE, AdmitResult
from kvcadence.errors import UsageError


def _fmt_accepted(a: dict[str, Any]) -> str:
    tag = "+" if a["continuation"] else ""
    chunk = "*" if a["chunked"] else ""
    return (
        f"{tag}{a['rid']}{chunk}(l1={a['l1']},l2={a['l2']},ext={a['extend']},"
        f"loaded={a['loaded']},run={a['extend_len']})"
    )


def render_text(result: AdmitResult, out: IO[str]) -> None:
    """A readable block per tick, then the summary of which budget stopped how many ticks."""
    cfg = result.config
    out.write(
        f"kvcadence admit: {result.n_requests} requests, semantics {cfg['semantics']}, "
        f"page {cfg['page_size']}, available {cfg['available_tokens']}, "
        f"max_prefill {cfg['max_prefill_tokens']}, chunk {cfg['chunked_prefill_size']}\n"
    )
    out.write(
        "accepted: rid(l1,l2,ext,loaded,run=tokens computed this tick); "
        "+ = continuing chunk, * = chunked\n"
    )
    out.write(f"note: {DURATION_NOTE}\n\n")
    header = (
        f"{'tick':>4} {'acc':>4} {'stopped_result':<24} {'stopped_on':<12} {'hit':>8} "
        f"{'input':>8} {'cp_ext':>8} {'cp_cached':>9} {'avail':>9} {'lb ok/fail':>10} "
        f"{'dur_us':>9}"
    )
    out.write(header + "\n" + "-" * len(header) + "\n")
    for t in result.ticks:
        ok = sum(1 for e in t["load_back_events"] if e["success"])
        fail = len(t["load_back_events"]) - ok
        stopped = t["stopped_result"] or "-"
        if t["stopped_admitted"]:
            stopped += " (adm)"
        out.write(
            f"{t['tick']:>4} {len(t['accepted']):>4} {stopped:<24} "
            f"{(t['stopped_on_rid'] or '-'):<12} {t['log_hit_tokens']:>8} "
            f"{t['log_input_tokens']:>8} {t['cp_total_extend_tokens']:>8} "
            f"{t['cp_total_cached_tokens']:>9} {t['allocator_available_after_tick']:>9} "
            f"{f'{ok}/{fail}':>10} {t['duration_us']:>9.1f}\n"
        )
        out.write(
            "     accepted: " + (", ".join(_fmt_accepted(a) for a in t["accepted"]) or "-") + "\n"
        )
        for e in t["load_back_events"]:
            out.write(
                f"     load-back {e['rid']}: requested {e['requested']} paged "
                f"{e['page_aligned']} loaded {e['loaded']} quota {e['quota']} available "
                f"{e['available_before']}->{e['available_after']} {e['reason']}\n"
            )
    s = result.summary()
    out.write("\nsummary\n")
    out.write(
        f"  ticks {s['ticks']}, admitted {s['admitted_requests']}/{s['requests']}, "
        f"log_hit_tokens {s['log_hit_tokens']}, log_input_tokens {s['log_input_tokens']}, "
        f"load-backs {s['load_back_events']} ({s['load_back_failures']} failed)\n"
    )
    out.write("  ticks stopped by:\n")
    for key, n in s["stopped_results"].items():
        out.write(f"    {key:<26} {n}\n")
    if s["unadmitted"]:
        out.write(f"  never admitted: {', '.join(s['unadmitted'])}\n")
    out.write(
        f"  admission path {s['duration_us_total']} us total, "
        f"{s['duration_us_per_evaluated_request']} us per evaluated request "
        "(Python admission path only, not end-to-end latency)\n"
    )


def render(result: AdmitResult, fmt: str, out: IO[str]) -> None:
    if fmt == "text":
        render_text(result, out)
    elif fmt == "json":
        json.dump(result.to_json(), out, indent=1)
        out.write("\n")
    elif fmt == "jsonl":
        for t in result.ticks:
            out.write(json.dumps(t, separators=(",", ":")) + "\n")
    else:
        raise UsageError(f"unknown --output {fmt!r}")
