"""SGLang's own request logs -> ``RequestRecord``s (passive capture of real user traffic).

Two formats SGLang 0.5.23 writes itself:

* ``--export-metrics-to-file --export-metrics-to-file-dir DIR``: hourly files
  ``sglang-request-metrics-YYYYmmdd_HH.log``, one JSON line per finished request:
  ``request_parameters`` (a JSON *string* of the request: ``rid``, ``input_ids`` or ``text``,
  ``sampling_params``, ...) plus every ``meta_info`` key (``id``, ``prompt_tokens``,
  ``cached_tokens``, ``completion_tokens``, ``finish_reason``, ``request_received_ts``,
  ``first_token_latency``, ``request_finished_ts``, ...; float seconds). No output ids.
  An hourly file rotated and compressed (``...log.gz``) is read as well (not followed live).
* ``--log-requests --log-requests-format json``: JSON lines ``{"timestamp": ISO8601,
  "event": "request.received" | "request.finished", "rid", "obj", "out"}``; a received and a
  finished line are paired by ``rid`` (``RequestLogPairer``); the request's ``obj`` but its
  ids is kept as ``meta_info["request_parameters"]``, as a metrics line's (sampling params,
  routing key, cache namespace). With ``--log-requests-level`` below 2 there are no ids.
  SGLang's log formatter puts ``[YYYY-mm-dd HH:MM:SS] `` before
  each line, and the stdout target mixes them with the server's other log lines: the prefix
  is stripped and lines that hold no JSON object are skipped (``request_log_json``). Its
  timestamps are the worker's local time without a zone (``datetime.now().isoformat()``);
  a timestamp without a zone is read as this machine's local time.

``MetricsExport`` / ``JsonRequestLog`` read a log as it is when made (each file's size
taken then), a line at a time, any number of times: memory is one record (plus, for the
request log, the requests in flight), not the log. ``read_metrics`` / ``read_request_log``
are the same in a list, for small logs.

Pickled dumps (``/configure_logging`` ``dump_requests_folder``, ``--crash-dump-folder``) are
refused: unpickling runs arbitrary code. Malformed lines raise ``InputError`` naming
file:line.
"""

from __future__ import annotations

import gzip
import json
import zlib
from collections.abc import Iterator
from datetime import datetime, timezone
from pathlib import Path
from typing import Annotated, Any

import msgspec

from kvcadence.errors import InputError
from kvcadence.format.bounds import json_loads
from kvcadence.format.schema import MAX_SECONDS, RequestRecord, seconds

_EPOCH = datetime(1970, 1, 1, tzinfo=timezone.utc)
PICKLE_SUFFIXES = (".pkl", ".pickle", ".pk")
METRICS_GLOB = "sglang-request-metrics-*.log"
#: an hourly file rotated and compressed (``logrotate``'s ``compress``, ``gzip FILE``):
#: read by ``capture import`` (never followed live: a compressed file is complete)
METRICS_GZ_GLOB = "sglang-request-metrics-*.log.gz"


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


def _lines(
    path: Path, request_log: bool = False, limit: int | None = None
) -> Iterator[tuple[int, dict[str, Any]]]:
    """``(line number, JSON object)`` of each line of ``path``, read a line at a time (never
    the whole file); with ``limit``, only its first ``limit`` bytes (a file a live worker
    appends to, as it was when its size was taken); ``*.gz``: decompressed, whole."""
    refuse_pickle(path)
    gz = path.name.endswith(".gz")
    if gz:  # a compressed file is complete (no live appends); its size is not its text's
        limit = None
    try:
        fh: Any = gzip.open(path, "rb") if gz else open(path, "rb")
    except OSError as exc:
        raise InputError(f"{path}: cannot read ({exc})") from exc
    with fh:
        left = limit
        for i, raw in enumerate(_read_lines(fh, path, gz), 1):
            if left is not None:
                if left <= 0:
                    return
                raw = raw[:left]
                left -= len(raw)
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as exc:
                raise InputError(f"{path}:{i}: cannot read as UTF-8 text ({exc})") from exc
            if request_log:
                d = request_log_json(line, f"{path}:{i}")
                if d is not None:
                    yield i, d
                continue
            if not line.strip():
                continue
            yield i, json_line(line, f"{path}:{i}")


def _read_lines(fh: Any, path: Path, gz: bool) -> Iterator[bytes]:
    """``fh``'s lines; a read that fails midway (a damaged compressed file: bad magic, CRC,
    cut short) is one ``InputError``."""
    try:
        yield from fh
    except (OSError, EOFError, zlib.error) as exc:
        raise InputError(f"{path}: cannot read{' as gzip' if gz else ''} ({exc})") from exc


#: what a metrics line / a request-log JSON object starts with (``json.dumps`` key order):
#: a line that does not parse is retried from the last one (a worker killed in the middle
#: of a line, restarted, and appending to the same file)
METRICS_LEAD = '{"request_parameters"'
REQUEST_LOG_LEAD = '{"timestamp"'


def json_line(line: str, where: str, lead: str | None = None) -> dict[str, Any]:
    """One JSON-object line (``InputError`` naming ``where`` otherwise). With ``lead``, a
    line that does not parse is retried from the last ``lead`` after its start (the rest of
    a line torn by a restart); the result then has the key ``"_torn"`` set to True."""
    try:
        d = json_loads(line)
    except json.JSONDecodeError as exc:
        k = line.rfind(lead, 1) if lead else -1
        if k < 0:
            raise InputError(f"{where}: not a JSON line ({exc.msg})") from exc
        try:
            d = json_loads(line[k:])
        except json.JSONDecodeError:
            raise InputError(f"{where}: not a JSON line ({exc.msg})") from exc
        if isinstance(d, dict):
            d["_torn"] = True
    if not isinstance(d, dict):
        raise InputError(f"{where}: expected a JSON object")
    return d


def request_log_json(line: str, where: str) -> dict[str, Any] | None:
    """The JSON object of one request-log line (its ``[date time] `` prefix stripped), or
    None for a line that holds none (the server's other log output)."""
    s = line.strip()
    if s.startswith("[") and not s.startswith("[{"):
        end = s.find("] ")
        s = s[end + 2 :].lstrip() if end > 0 else s
    if not s.startswith("{"):
        return None
    return json_line(s, where, REQUEST_LOG_LEAD)


def _ns(v: Any) -> int | None:
    """Seconds -> ns; None unless a time (``format.schema.seconds``: ``Infinity``, ``NaN``,
    ``1e300`` and negative times are no timestamp)."""
    s = seconds(v)
    return None if s is None else int(s * 1e9)


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
    try:
        return msgspec.convert(v, _TOKEN_LIST)  # checked (and copied) in C
    except msgspec.ValidationError:
        pass  # the first bad id is named below
    for i, t in enumerate(v):  # as `kvcadence import` checks them: ints (not bools), 0..2**63-1
        if type(t) is not int:
            raise InputError(f"{where}: {name} must be a list of integers ({t!r} at index {i})")
        if not 0 <= t <= _TOKEN_MAX:
            raise InputError(f"{where}: {name}: {t} at index {i} is not a token id (0 .. 2**63-1)")
    return list(v)


_TOKEN_MAX = 2**63 - 1
#: what ``_ids`` accepts: ints (not bools) in 0 .. 2**63-1
_TOKEN_LIST = list[Annotated[int, msgspec.Meta(ge=0, le=_TOKEN_MAX)]]


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
        files = sorted([*path.glob(METRICS_GLOB), *path.glob(METRICS_GZ_GLOB)])
        if not files:
            raise InputError(f"{path}: no {METRICS_GLOB} files (SGLang --export-metrics-to-file)")
        names = {f.name for f in files}
        both = sorted(n for n in names if n + ".gz" in names)
        if both:  # the same hour twice: its records would be read twice
            raise InputError(
                f"{path}: {both[0]} and {both[0]}.gz are both there (the same hour, plain and "
                "compressed): keep one"
            )
        return files
    if not path.exists():
        raise InputError(f"{path}: no such file or directory")
    return [path]


def _sizes(files: list[Path]) -> list[tuple[Path, int]]:
    out = []
    for f in files:
        try:
            out.append((f, f.stat().st_size))
        except OSError as exc:
            raise InputError(f"{f}: cannot read ({exc})") from exc
    return out


class MetricsExport:
    """The records of ``--export-metrics-to-file`` output (a file or a directory of hourly
    files) as it is when made: each file's size is taken then, and every iteration reads
    those bytes (lines a live worker appends later are not read), a line at a time. It can
    be iterated any number of times (validate, then write); memory: one record."""

    def __init__(self, path: str | Path) -> None:
        self.files = _sizes(metrics_files(Path(path)))

    def __iter__(self) -> Iterator[RequestRecord]:
        for f, size in self.files:
            for i, d in _lines(f, limit=size):
                yield metrics_record(d, f"{f}:{i}")


def read_metrics(path: str | Path) -> list[RequestRecord]:
    """Records from ``--export-metrics-to-file`` output (file or directory), in a list (a
    small log; ``MetricsExport`` streams)."""
    return list(MetricsExport(path))


def metrics_record(d: dict[str, Any], where: str) -> RequestRecord:
    """One ``--export-metrics-to-file`` line -> ``RequestRecord`` (source ``sglang-metrics``)."""
    raw = d.get("request_parameters")
    if isinstance(raw, str):
        try:
            params = json_loads(raw)
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
        if isinstance(ts, bool) or not 0 <= ts < MAX_SECONDS:  # Infinity, NaN, 1e300
            raise InputError(f"{where}: bad timestamp {ts!r}")
        return int(ts * 1e9)
    try:
        dt = datetime.fromisoformat(str(ts).replace("Z", "+00:00"))
    except ValueError as exc:
        raise InputError(f"{where}: bad timestamp {ts!r}") from exc
    if dt.tzinfo is None:
        dt = dt.astimezone()  # SGLang writes datetime.now().isoformat(): local, no zone
    d = dt - _EPOCH  # exact integer arithmetic (a float timestamp loses microseconds)
    ns = (d.days * 86_400 + d.seconds) * 1_000_000_000 + d.microseconds * 1_000
    if not 0 <= ns < 2**63:  # before 1970 or after 2262: no int64 ns timestamp
        raise InputError(f"{where}: timestamp {ts!r} is outside 1970..2262")
    return ns


def _obj(v: Any, where: str, name: str) -> dict[str, Any]:
    if v is None:
        return {}
    if isinstance(v, str):
        try:
            v = json_loads(v)
        except json.JSONDecodeError:
            return {"repr": v}
    if not isinstance(v, dict):
        raise InputError(f"{where}: {name} must be a JSON object")
    return v


class RequestLogPairer:
    """Pairs ``request.received`` and ``request.finished`` lines by rid into records.

    ``feed(d, where)`` returns the record a finished line completes (or None);
    ``unfinished(where)`` the requests received and never finished, as records with
    ``error`` set. Memory: one entry per request in flight."""

    def __init__(self) -> None:
        self.received: dict[str, tuple[int | None, dict[str, Any], str]] = {}

    def feed(self, d: dict[str, Any], where: str) -> RequestRecord | None:
        event = d.get("event")
        rid = d.get("rid")
        if event not in ("request.received", "request.finished"):
            return None  # other log events (e.g. aborts) carry no request record
        if not isinstance(rid, str):
            raise InputError(f"{where}: {event} line without a string rid")
        ts = _iso_ns(d.get("timestamp"), where)
        obj = _obj(d.get("obj"), where, "obj")
        if event == "request.received":
            self.received[rid] = (ts, obj, where)
            return None
        sent_ns, obj0, _ = self.received.pop(rid, (None, {}, where))
        obj = obj or obj0
        outd = _obj(d.get("out"), where, "out")
        meta: Any = outd.get("meta_info") if isinstance(outd.get("meta_info"), dict) else {}
        sp: Any = obj.get("sampling_params") if isinstance(obj.get("sampling_params"), dict) else {}
        recv = meta.get("request_received_ts")
        ftl = meta.get("first_token_latency")
        first = _ns(recv + ftl) if isinstance(recv, float) and isinstance(ftl, float) else None
        meta = dict(meta)
        if obj:  # what the request was sent with, as the metrics line keeps it (no ids)
            meta["request_parameters"] = {k: v for k, v in obj.items() if k != "input_ids"}
        return RequestRecord(
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
            meta_info=meta,
        )

    def unfinished(self) -> list[RequestRecord]:
        """Requests received but never finished (still running), as error records."""
        out = [
            RequestRecord(
                rid=rid,
                input_ids=_ids(obj.get("input_ids"), where, "obj.input_ids"),
                send_ns=ts,
                source="request-log",
                error="no request.finished line",
            )
            for rid, (ts, obj, where) in self.received.items()
        ]
        self.received.clear()
        return out


class JsonRequestLog:
    """The records of ``--log-requests --log-requests-format json`` output (a file, or every
    file of a directory) as it is when made (sizes taken then, as ``MetricsExport``): each
    iteration pairs the lines a line at a time and yields every finished request as its
    ``request.finished`` line is read, then the ones never finished (error records).
    Memory: the requests in flight."""

    def __init__(self, path: str | Path) -> None:
        p = Path(path)
        if not p.exists():
            raise InputError(f"{p}: no such file or directory")
        files = sorted(q for q in p.iterdir() if q.is_file()) if p.is_dir() else [p]
        self.files = _sizes(files)

    def __iter__(self) -> Iterator[RequestRecord]:
        pairer = RequestLogPairer()
        for f, size in self.files:
            for i, d in _lines(f, request_log=True, limit=size):
                rec = pairer.feed(d, f"{f}:{i}")
                if rec is not None:
                    yield rec
        yield from pairer.unfinished()


def read_request_log(path: str | Path) -> list[RequestRecord]:
    """Records from ``--log-requests --log-requests-format json`` output (file or dir), in
    a list (a small log; ``JsonRequestLog`` streams)."""
    return list(JsonRequestLog(path))
