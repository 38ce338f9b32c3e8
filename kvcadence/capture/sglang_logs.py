"""SGLang's own request logs -> ``RequestRecord``s (passive capture of real user traffic).

Two formats SGLang 0.5.23 writes itself:

* ``--export-metrics-to-file --export-metrics-to-file-dir DIR``: hourly files
  ``sglang-request-metrics-YYYYmmdd_HH.log``, one JSON line per finished request:
  ``request_parameters`` (a JSON *string* of the request: ``rid``, ``input_ids`` or ``text``,
  ``sampling_params``, ...) plus every ``meta_info`` key (``id``, ``prompt_tokens``,
  ``cached_tokens``, ``completion_tokens``, ``finish_reason``, ``request_received_ts``,
  ``first_token_latency``, ``request_finished_ts``, ...; float seconds). No output ids.
* ``--log-requests --log-requests-format json``: JSON lines ``{"timestamp": ISO8601,
  "event": "request.received" | "request.finished", "rid", "obj", "out"}``; a received and a
  finished line are paired by ``rid``. With ``--log-requests-level`` below 2 there are no ids.

Pickled dumps (``/configure_logging`` ``dump_requests_folder``, ``--crash-dump-folder``) are
refused: unpickling runs arbitrary code. Malformed lines raise ``InputError`` naming
file:line.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from kvcadence.errors import InputError
from kvcadence.format.schema import RequestRecord

_EPOCH = datetime(1970, 1, 1, tzinfo=timezone.utc)
PICKLE_SUFFIXES = (".pkl", ".pickle", ".pk")
METRICS_GLOB = "sglang-request-metrics-*.log"


def refuse_pickle(path: Path) -> None:
    """Raise ``InputError`` if ``path`` is (or looks like) a pickle."""
    head = b""
    try:
        with open(path, "rb") as fh:
            head = fh.read(2)
    except OSError as exc:
        raise InputError(f"{path}: cannot read ({exc})") from exc
    if path.suffix.lower() in PICKLE_SUFFIXES or (len(head) == 2 and head[0] == 0x80):
        raise InputError(
            f"{path}: refusing to read a pickled request dump -- unpickling runs arbitrary "
            "code from the file. Re-run the worker with --export-metrics-to-file or "
            "--log-requests --log-requests-format json and import those instead"
        )


def _lines(path: Path) -> Iterator[tuple[int, dict[str, Any]]]:
    refuse_pickle(path)
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise InputError(f"{path}: cannot read as UTF-8 text ({exc})") from exc
    for i, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            d = json.loads(line)
        except json.JSONDecodeError as exc:
            raise InputError(f"{path}:{i}: not a JSON line ({exc.msg})") from exc
        if not isinstance(d, dict):
            raise InputError(f"{path}:{i}: expected a JSON object")
        yield i, d


def _ns(seconds: Any) -> int | None:
    return int(seconds * 1e9) if isinstance(seconds, (int, float)) and seconds > 0 else None


def _int(v: Any) -> int | None:
    return v if isinstance(v, int) and not isinstance(v, bool) else None


def _ids(v: Any, where: str, name: str) -> list[int]:
    if v is None:
        return []
    if isinstance(v, list) and v and isinstance(v[0], list):
        if len(v) != 1:
            raise InputError(f"{where}: batched {name} ({len(v)} prompts in one request)")
        v = v[0]
    if not isinstance(v, list):
        raise InputError(f"{where}: {name} must be a list of integers")
    for i, t in enumerate(v):  # as `kvcadence import` checks them: ints (not bools), 0..2**63-1
        if type(t) is not int:
            raise InputError(f"{where}: {name} must be a list of integers ({t!r} at index {i})")
        if not 0 <= t <= _TOKEN_MAX:
            raise InputError(f"{where}: {name}: {t} at index {i} is not a token id (0 .. 2**63-1)")
    return list(v)


_TOKEN_MAX = 2**63 - 1


def _finish_reason(fr: Any) -> str | None:
    if isinstance(fr, dict):
        return None if fr.get("type") is None else str(fr["type"])
    return None if fr is None else str(fr)


def metrics_files(path: Path) -> list[Path]:
    """The metrics files under ``path`` (a file, or a directory of hourly files)."""
    if path.is_dir():
        for p in sorted(path.iterdir()):
            if p.suffix.lower() in PICKLE_SUFFIXES:
                refuse_pickle(p)
        files = sorted(path.glob(METRICS_GLOB))
        if not files:
            raise InputError(f"{path}: no {METRICS_GLOB} files (SGLang --export-metrics-to-file)")
        return files
    if not path.exists():
        raise InputError(f"{path}: no such file or directory")
    return [path]


def read_metrics(path: str | Path) -> list[RequestRecord]:
    """Records from ``--export-metrics-to-file`` output (file or directory)."""
    out = []
    for f in metrics_files(Path(path)):
        for i, d in _lines(f):
            out.append(metrics_record(d, f"{f}:{i}"))
    return out


def metrics_record(d: dict[str, Any], where: str) -> RequestRecord:
    """One ``--export-metrics-to-file`` line -> ``RequestRecord`` (source ``sglang-metrics``)."""
    raw = d.get("request_parameters")
    if isinstance(raw, str):
        try:
            params = json.loads(raw)
        except json.JSONDecodeError as exc:
            raise InputError(f"{where}: request_parameters is not JSON ({exc.msg})") from exc
    elif isinstance(raw, dict):
        params = raw
    else:
        raise InputError(f"{where}: missing request_parameters (not an SGLang metrics line?)")
    if not isinstance(params, dict):
        raise InputError(f"{where}: request_parameters must be a JSON object")
    rid = params.get("rid") or d.get("id")
    if isinstance(rid, list):
        rid = rid[0] if len(rid) == 1 else None
    if not isinstance(rid, str):
        raise InputError(f"{where}: no request id (rid / id)")
    sp = params.get("sampling_params") or {}
    meta = {k: v for k, v in d.items() if k != "request_parameters"}
    recv = meta.get("request_received_ts")
    ftl = meta.get("first_token_latency")
    first = _ns(recv + ftl) if isinstance(recv, float) and isinstance(ftl, float) else None
    meta["request_parameters"] = {k: v for k, v in params.items() if k != "input_ids"}
    return RequestRecord(
        rid=rid,
        input_ids=_ids(params.get("input_ids"), where, "input_ids"),
        output_ids=[],
        send_ns=_ns(recv),
        first_token_ns=first,
        finish_ns=_ns(meta.get("request_finished_ts") or meta.get("response_sent_to_client_ts")),
        max_new_tokens=_int(sp.get("max_new_tokens")) if isinstance(sp, dict) else None,
        prompt_tokens=_int(meta.get("prompt_tokens")),
        cached_tokens=_int(meta.get("cached_tokens")),
        completion_tokens=_int(meta.get("completion_tokens")),
        finish_reason=_finish_reason(meta.get("finish_reason")),
        dp_rank=_int(meta.get("dp_rank")),
        source="sglang-metrics",
        meta_info=meta,
    )


def _iso_ns(ts: Any, where: str) -> int | None:
    if ts is None:
        return None
    if isinstance(ts, (int, float)):
        return int(ts * 1e9)
    try:
        dt = datetime.fromisoformat(str(ts).replace("Z", "+00:00"))
    except ValueError as exc:
        raise InputError(f"{where}: bad timestamp {ts!r}") from exc
    if dt.tzinfo is None:
        dt = dt.replace(tzinfo=timezone.utc)
    d = dt - _EPOCH  # exact integer arithmetic (a float timestamp loses microseconds)
    return (d.days * 86_400 + d.seconds) * 1_000_000_000 + d.microseconds * 1_000


def _obj(v: Any, where: str, name: str) -> dict[str, Any]:
    if v is None:
        return {}
    if isinstance(v, str):
        try:
            v = json.loads(v)
        except json.JSONDecodeError:
            return {"repr": v}
    if not isinstance(v, dict):
        raise InputError(f"{where}: {name} must be a JSON object")
    return v


def read_request_log(path: str | Path) -> list[RequestRecord]:
    """Records from ``--log-requests --log-requests-format json`` output (file or dir)."""
    p = Path(path)
    files = sorted(q for q in p.iterdir() if q.is_file()) if p.is_dir() else [p]
    if not p.exists():
        raise InputError(f"{p}: no such file or directory")
    received: dict[str, tuple[int | None, dict[str, Any]]] = {}
    out: list[RequestRecord] = []
    for f in files:
        for i, d in _lines(f):
            where = f"{f}:{i}"
            event = d.get("event")
            rid = d.get("rid")
            if event not in ("request.received", "request.finished"):
                continue  # other log events (e.g. aborts) carry no request record
            if not isinstance(rid, str):
                raise InputError(f"{where}: {event} line without a string rid")
            ts = _iso_ns(d.get("timestamp"), where)
            obj = _obj(d.get("obj"), where, "obj")
            if event == "request.received":
                received[rid] = (ts, obj)
                continue
            sent_ns, obj0 = received.pop(rid, (None, {}))
            obj = obj or obj0
            outd = _obj(d.get("out"), where, "out")
            meta: Any = outd.get("meta_info") if isinstance(outd.get("meta_info"), dict) else {}
            sp: Any = (
                obj.get("sampling_params") if isinstance(obj.get("sampling_params"), dict) else {}
            )
            recv = meta.get("request_received_ts")
            ftl = meta.get("first_token_latency")
            first = _ns(recv + ftl) if isinstance(recv, float) and isinstance(ftl, float) else None
            out.append(
                RequestRecord(
                    rid=rid,
                    input_ids=_ids(obj.get("input_ids"), where, "obj.input_ids"),
                    output_ids=_ids(outd.get("output_ids"), where, "out.output_ids"),
                    send_ns=sent_ns,
                    first_token_ns=first,
                    finish_ns=ts,
                    max_new_tokens=_int(sp.get("max_new_tokens")),
                    prompt_tokens=_int(meta.get("prompt_tokens")),
                    cached_tokens=_int(meta.get("cached_tokens")),
                    completion_tokens=_int(meta.get("completion_tokens")),
                    finish_reason=_finish_reason(meta.get("finish_reason")),
                    dp_rank=_int(meta.get("dp_rank")),
                    source="request-log",
                    meta_info=dict(meta),
                )
            )
    for rid, (ts, obj) in received.items():  # received but never finished (still running)
        out.append(
            RequestRecord(
                rid=rid,
                input_ids=_ids(obj.get("input_ids"), str(p), "obj.input_ids"),
                send_ns=ts,
                source="request-log",
                error="no request.finished line",
            )
        )
    return out
