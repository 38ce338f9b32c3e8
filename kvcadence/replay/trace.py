"""Offline traces: ``kvcadence replay --trace FILE`` -- SGLang's KV-event stream for a trace,
no capture and no GPU.

What this file owns: reading a trace file into ``RequestRecord``s the simulator replays,
and the replay of those records into a sim bundle (the same format as any replay). Two
formats, told apart by the first line (or ``--trace-format``):

* **mooncake** -- ``{"timestamp": ms, "input_length": N, "output_length": M, "hash_ids":
  [...]}`` per line. Token ids come from ``format.mooncake.HashIdTokens`` -- the mapping
  ``kvcadence drive --workload mooncake:...`` sends to a real worker, so requests that share
  hash ids share prompt blocks, and a drive capture of the same trace (same
  ``block_tokens``) has the same prompts. Open loop: each request arrives at its
  ``timestamp`` (relative to the first line's, divided by ``speedup``); no sessions, no
  lanes. rid ``mc-{i}`` (``i`` = index among the non-blank lines, as drive names them).
* **requests** -- the requests JSONL of ``kvcadence import --requests``
  (``format.jsonl.parse_request_line``: ``rid``, ``input_ids``, optional times, lanes,
  ``max_new_tokens``, ``meta_info``...). Each line needs an arrival time (``arrival_ns``,
  ``send_ns`` or ``meta_info.request_received_ts``) and an output length
  (``max_new_tokens``, ``output_ids`` or ``meta_info.completion_tokens``); lines with a
  ``lane`` replay closed loop, as an imported bundle would.

The file is read one line at a time (a 10^5-line trace is never held as text or JSON); a bad
line is one ``InputError`` naming ``file:line`` (exit 2) before anything is written. Server
settings come from ``server_info`` (a ``/server_info`` JSON) and the CLI overrides; the sim
bundle's header keeps that ``server_info`` with the simulated settings written over it
(``trace_server_info``), and its Trailer's ``stats["replay"]["trace"]`` says which file and
format were replayed.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import msgspec

from kvcadence.errors import InputError, UsageError
from kvcadence.format.jsonl import jsonl_lines, parse_request_line
from kvcadence.format.mooncake import HashIdTokens, parse_mooncake_line
from kvcadence.format.schema import (
    FORMAT_MAJOR,
    FORMAT_MINOR,
    Header,
    RequestRecord,
    meta_duration,
    meta_seconds,
)
from kvcadence.outguard import refuse_nonempty_dir
from kvcadence.progress import NoPhases
from kvcadence.replay.config import SimConfig
from kvcadence.replay.simbundle import SimBundleOut
from kvcadence.replay.simulator import SimResult, simulate, write_sim_bundle
from kvcadence.replay.worker import effective_config

TRACE_FORMATS = ("mooncake", "requests")
_MOONCAKE_KEYS = ("hash_ids", "input_length", "output_length", "timestamp")
_REQUESTS_KEYS = ("rid", "input_ids")


@dataclass
class TraceInfo:
    """What was read from a trace (kept in the sim bundle's Trailer)."""

    path: str
    format: str
    requests: int = 0
    #: mooncake: the mapping's parameters, distinct hash ids, and requests whose prompt is
    #: longer than their blocks (padded with tokens of their own)
    block_tokens: int | None = None
    hash_ids: int | None = None
    padded_requests: int | None = None
    closed_loop_requests: int | None = None  # requests: lines with a lane
    extra: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        d = {k: v for k, v in asdict(self).items() if v is not None and k != "extra"}
        d.update(self.extra)
        return d


def detect_format(path: Path) -> str:
    """``mooncake`` or ``requests`` from the first non-blank line of ``path``."""
    for where, obj in jsonl_lines(path, "trace"):
        if any(k in obj for k in _REQUESTS_KEYS):
            return "requests"
        if any(k in obj for k in _MOONCAKE_KEYS):
            return "mooncake"
        raise InputError(
            f"{where}: cannot tell the trace format: a Mooncake line has "
            f"{', '.join(_MOONCAKE_KEYS)}; a requests line rid and input_ids "
            "(or give --trace-format)"
        )
    raise InputError(f"{path}: the trace has no lines")


def read_mooncake(
    path: Path,
    *,
    block_tokens: int = 16,
    seed: int = 0,
    vocab: int = 1024,
    speedup: float = 1.0,
    limit: int = 0,
) -> tuple[list[RequestRecord], TraceInfo]:
    """The requests of a Mooncake trace (see the module docstring)."""
    if block_tokens < 1:
        raise UsageError(f"--block-tokens must be >= 1 (got {block_tokens})")
    if speedup <= 0:
        raise UsageError(f"--trace-speedup must be > 0 (got {speedup})")
    tokens = HashIdTokens(block_tokens, seed, vocab)
    recs: list[RequestRecord] = []
    t0: float | None = None
    padded = 0
    for i, (where, obj) in enumerate(jsonl_lines(path, "trace")):
        if limit and i >= limit:
            break
        line = parse_mooncake_line(obj, where)
        t0 = line.timestamp_ms if t0 is None else t0
        arrival = int((line.timestamp_ms - t0) * 1e6 / speedup)  # drive's offset
        if not -(2**63) < arrival < 2**63:  # a nanosecond offset the replay's clock holds
            raise InputError(
                f"{where}: timestamp {line.timestamp_ms!r} ms is {line.timestamp_ms - t0:.0f} ms "
                f"from the first line's: past what a nanosecond clock holds at "
                f"--trace-speedup {speedup}"
            )
        ids = tokens.prompt(line.hash_ids, line.input_length, i)
        padded += len(line.hash_ids) * block_tokens < line.input_length
        recs.append(
            RequestRecord(
                rid=f"mc-{i}",
                input_ids=ids,
                send_ns=arrival,
                max_new_tokens=line.output_length,
                source="trace",
                arrival_ns=arrival,
                meta_info={"hash_ids": len(line.hash_ids)},
            )
        )
    _shift_to_zero(recs)
    info = TraceInfo(
        str(path),
        "mooncake",
        len(recs),
        block_tokens=block_tokens,
        hash_ids=len(tokens),
        padded_requests=padded,
    )
    if speedup != 1.0:
        info.extra["speedup"] = speedup
    return recs, info


def _shift_to_zero(recs: list[RequestRecord]) -> None:
    """Arrival offsets start at 0 (a line earlier than the first one would be negative)."""
    low = min((r.arrival_ns for r in recs if r.arrival_ns is not None), default=0)
    if low < 0:
        for r in recs:
            if r.arrival_ns is not None:
                r.arrival_ns -= low
            if r.send_ns is not None:
                r.send_ns -= low


def read_requests_trace(path: Path, *, limit: int = 0) -> tuple[list[RequestRecord], TraceInfo]:
    """The requests of a requests JSONL (``import --requests``'s format), each line checked
    by the importer's parser plus what a replay needs (see the module docstring)."""
    recs: list[RequestRecord] = []
    seen: dict[str, str] = {}
    lanes = 0
    for i, (where, obj) in enumerate(jsonl_lines(path, "trace")):
        if limit and i >= limit:
            break
        r = parse_request_line(obj, where)
        first = seen.setdefault(r.rid, where)
        if first != where:
            raise InputError(f"{where}: field `rid`: {r.rid!r} is already the rid of {first}")
        if not r.input_ids:
            raise InputError(f"{where}: field `input_ids`: empty (nothing to replay)")
        mi = r.meta_info
        received = meta_seconds(mi, "request_received_ts") is not None or (
            meta_seconds(mi, "response_sent_to_client_ts") is not None
            and meta_duration(mi, "e2e_latency") is not None
        )
        if r.arrival_ns is None and r.send_ns is None and not received:
            raise InputError(
                f"{where}: no arrival time (give `arrival_ns`, `send_ns` or "
                "`meta_info.request_received_ts`)"
            )
        if r.error is None and not r.max_new_tokens and not r.output_ids:
            raise InputError(
                f"{where}: no output length (give `max_new_tokens`, `output_ids` or "
                "`meta_info.completion_tokens`)"
            )
        lanes += r.lane is not None
        recs.append(msgspec.structs.replace(r, source="trace"))
    info = TraceInfo(str(path), "requests", len(recs), closed_loop_requests=lanes)
    return recs, info


def read_trace(
    path: str | Path,
    fmt: str | None = None,
    *,
    block_tokens: int = 16,
    speedup: float = 1.0,
    limit: int = 0,
) -> tuple[list[RequestRecord], TraceInfo]:
    """Read trace ``path`` (``fmt`` None or ``auto``: detected from its first line)."""
    p = Path(path)
    if p.is_dir():
        raise UsageError(f"--trace {p}: a directory (a trace is a JSONL file; a bundle is BUNDLE)")
    if limit < 0:
        raise UsageError(f"--trace-limit must be >= 0 (got {limit})")
    if fmt in (None, "auto"):
        fmt = detect_format(p)
    if fmt == "mooncake":
        recs, info = read_mooncake(p, block_tokens=block_tokens, speedup=speedup, limit=limit)
    elif fmt == "requests":
        if speedup != 1.0:
            raise UsageError("--trace-speedup applies to Mooncake traces only")
        recs, info = read_requests_trace(p, limit=limit)
    else:
        raise UsageError(f"--trace-format {fmt!r}: choose from auto, {', '.join(TRACE_FORMATS)}")
    if not recs:
        raise InputError(f"{p}: the trace has no requests")
    return recs, info


def trace_server_info(server_info: dict[str, Any], cfg: SimConfig) -> dict[str, Any]:
    """The sim bundle's ``/server_info`` of a trace replay: the given ``--server-info`` JSON
    (if any) with the simulated worker's settings written over it under SGLang's names, so
    that ``report``, ``admit --bundle`` and a second ``replay`` of the sim bundle read the
    settings this replay ran with."""
    info = dict(server_info)
    info.update(
        page_size=cfg.page_size,
        max_total_num_tokens=cfg.max_total_tokens,
        chunked_prefill_size=cfg.chunked_prefill_size or -1,
        max_prefill_tokens=cfg.max_prefill_tokens,
        decode_log_interval=cfg.decode_log_interval,
        schedule_policy=cfg.schedule_policy,
        schedule_conservativeness=cfg.schedule_conservativeness,
        disable_overlap_schedule=cfg.disable_overlap_schedule,
        version=cfg.sglang_version,
    )
    if cfg.max_running_requests is not None:
        info["max_running_requests"] = cfg.max_running_requests
    return info


def trace_header(server_info: dict[str, Any], path: str | Path) -> Header:
    """The stand-in source header of a trace replay (what ``write_sim_bundle`` copies:
    ``server_info``, ``kv_events_config``)."""
    kv_cfg = server_info.get("kv_events_config")
    if isinstance(kv_cfg, dict):
        kv_cfg = msgspec.json.encode(kv_cfg).decode()
    return Header(
        format_major=FORMAT_MAJOR,
        format_minor=FORMAT_MINOR,
        source="trace",
        kvcadence_version="",
        sglang_version=server_info.get("version"),
        server_info=server_info,
        kv_events_config=kv_cfg if isinstance(kv_cfg, str) else None,
        command=["kvcadence", "replay", "--trace", str(path)],
        start_ns=0,
        endpoints=[],
    )


def trace_config(
    records: list[RequestRecord],
    info: TraceInfo,
    server_info: dict[str, Any],
    overrides: dict[str, Any],
    *,
    sglang_version: str | None = None,
    calibrate_timing: bool = True,
) -> SimConfig:
    """``SimConfig`` of a trace replay: ``server_info``, then ``overrides``. The pass-time
    model is calibrated only from a requests trace that carries SGLang's timings (a Mooncake
    trace has none: the built-in model)."""
    return effective_config(
        server_info,
        records,
        overrides,
        sglang_version=sglang_version or server_info.get("version"),
        calibrate_timing=calibrate_timing and info.format == "requests",
    )


def replay_trace(
    records: list[RequestRecord],
    info: TraceInfo,
    cfg: SimConfig,
    out: str | Path | None,
    *,
    server_info: dict[str, Any] | None = None,
    progress: Callable[[int], None] | None = None,
    phases: Any = None,
    keep_batches: bool = False,
) -> SimResult:
    """Simulate the trace's ``records`` under ``cfg``; write the sim bundle to ``out``
    (skipped when None): its frames as they are published, or after the run from
    ``SimResult.batches`` with ``keep_batches`` (the same bytes)."""
    phases = phases or NoPhases()
    out_path = Path(out) if out is not None else None
    sink = SimBundleOut(out_path) if out_path is not None and not keep_batches else None
    if out_path is not None:
        refuse_nonempty_dir(out_path)
    header = trace_header(trace_server_info(server_info or {}, cfg), info.path)
    with phases.phase("simulate", f"simulating {len(records)} requests"):
        result = simulate(records, cfg, progress=progress, out=sink, source_header=header)
    result.extra["trace"] = info.to_dict()
    if out_path is not None:
        with phases.phase("write", f"writing {out_path}"):
            write_sim_bundle(sink or out_path, result, header)  # finishes a streamed one
    return result


__all__ = [
    "TRACE_FORMATS",
    "TraceInfo",
    "detect_format",
    "read_mooncake",
    "read_requests_trace",
    "read_trace",
    "replay_trace",
    "trace_config",
    "trace_header",
    "trace_server_info",
]
