"""``kvcadence import``: JSONL frame dumps + request logs (+ /server_info JSON) -> a bundle.

Input formats (the real fixture ``sglang-0.5.23-agent-ps1`` is in exactly this form):

* frames JSONL, one object per ZMQ message: ``recv_ns`` (int), ``topic`` (str), ``seq``
  (int), ``payload_b64`` (str, base64 of the payload frame), optional ``endpoint`` (int,
  default 0) and ``via`` (``"live"``/``"replay"``; absent = ``VIA_IMPORT``).
* requests JSONL: ``rid``, ``input_ids``, optional ``output_ids``, ``send_ns``, ``finish_ns``,
  ``first_token_ns``, ``arrival_ns``, ``think_ns``, ``error``, ``lane``, ``session``, ``turn``,
  ``max_new_tokens`` and SGLang's ``meta_info`` (kept whole; ``prompt_tokens``,
  ``cached_tokens``, ``completion_tokens``, ``finish_reason.type``, ``dp_rank`` taken from it).
* server info JSON: the ``GET /server_info`` object (``version``, ``kv_events``,
  ``kv_events_config``, ...).

Every input is validated before the bundle is created: a bad line is one ``InputError``
naming ``file:line`` and the field, and no output is written. Integers are range-checked so
that every record encodes and every table ingests: ``recv_ns`` 0..2**63-1, ``seq``
0..2**63-1 (the recorder's ``seqtrack.MAX_SEQ``; analysis stores seqs as int64), ``endpoint``
0..2**63-1, token ids 0..2**63-1, the optional request ints -2**63..2**63-1, and every int
anywhere inside ``meta_info`` or the server info JSON -2**63..2**64-1 (what msgpack holds).
A new bundle is written into a hidden sibling directory and renamed into place only when it
is complete (``bundle.staged_bundle``); ``--append`` encodes every record before reopening
the bundle, so a bad request never touches it. Seq bookkeeping per endpoint:
``Epoch`` 0 at the first frame, a new ``Epoch`` when seq goes backwards, a ``Gap``
(``recovered=0``) for every missing range (including seqs before an epoch's first frame), an
exact repeat of the previous frame is dropped as a duplicate.
"""

from __future__ import annotations

import base64
import binascii
import json
import os
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import msgspec

from kvcadence import __version__
from kvcadence.capture.discovery import redact_paths
from kvcadence.capture.rids import refuse_duplicate_rids, refuse_known_rids
from kvcadence.capture.think import think_times
from kvcadence.errors import InputError, UsageError
from kvcadence.format.bundle import BundleWriter, check_encodable, encode_payload, staged_bundle
from kvcadence.format.schema import (
    FORMAT_MAJOR,
    FORMAT_MINOR,
    VIA_IMPORT,
    VIA_LIVE,
    VIA_REPLAY,
    EndpointInfo,
    Epoch,
    EventFrame,
    Gap,
    Header,
    RequestRecord,
)
from kvcadence.outguard import refuse_nonempty_dir

VIA_NAMES = {"live": VIA_LIVE, "replay": VIA_REPLAY}
U64_MAX = 2**64 - 1
I64_MIN = -(2**63)
I64_MAX = 2**63 - 1


@dataclass
class FrameLine:
    """One validated line of a frames JSONL file."""

    recv_ns: int
    topic: str
    seq: int
    payload: bytes
    endpoint: int
    via: int


@dataclass
class ImportSummary:
    """What ``import_bundle`` wrote (also stored in the Trailer's ``stats["import"]``)."""

    out: str
    frames: int = 0  # lines read from the frames file
    events_written: int = 0
    duplicates: int = 0
    bin_payloads: int = 0  # payloads that were not one msgpack value (kept as bin)
    gaps: int = 0
    missed_seqs: int = 0
    epochs: int = 0
    requests: int = 0
    endpoints: list[int] = field(default_factory=list)
    appended: bool = False


# --------------------------------------------------------------------------------------
# Line parsing
# --------------------------------------------------------------------------------------


def _kind(v: Any) -> str:
    if v is None:
        return "null"
    return {
        bool: "bool",
        int: "int",
        float: "float",
        str: "str",
        list: "array",
        dict: "object",
    }.get(type(v), type(v).__name__)


def _is_int(v: Any) -> bool:
    return type(v) is int


def _get(
    obj: dict[str, Any], key: str, where: str, kind: str, *, required: bool, default: Any = None
) -> Any:
    """Field ``key`` of ``obj`` checked against ``kind`` (int, str, int?, str?, ints, dict)."""
    if key not in obj:
        if required:
            raise InputError(f"{where}: field `{key}` is missing")
        return default
    v = obj[key]
    ok = {
        "int": _is_int(v),
        "int?": v is None or _is_int(v),
        "str": type(v) is str,
        "str?": v is None or type(v) is str,
        "dict": type(v) is dict,
        "ints": type(v) is list and all(_is_int(x) for x in v),
    }[kind]
    if not ok:
        want = {
            "int": "an int",
            "int?": "an int or null",
            "str": "a string",
            "str?": "a string or null",
            "dict": "an object",
            "ints": "an array of ints",
        }[kind]
        got = _kind(v)
        if kind == "ints" and type(v) is list:
            bad = next(i for i, x in enumerate(v) if not _is_int(x))
            got = f"{_kind(v[bad])} at index {bad}"
        raise InputError(f"{where}: field `{key}`: expected {want}, got {got}")
    return v


def _check_ints(value: Any, where: str, field_name: str) -> None:
    """Every int anywhere inside ``value`` (dicts, lists) fits msgpack (-2**63..2**64-1);
    ``InputError`` naming the path of the first one that does not. Iterative: a deeply
    nested object cannot exhaust the stack."""
    stack: list[tuple[str, Any]] = [(field_name, value)]
    while stack:
        path, v = stack.pop()
        t = type(v)
        if t is int:
            if not I64_MIN <= v <= U64_MAX:
                raise InputError(
                    f"{where}: field `{path}`: {v} is outside the 64-bit integer range "
                    f"[-2**63, 2**64-1]"
                )
        elif t is dict:
            stack.extend((f"{path}.{k}", x) for k, x in reversed(v.items()))
        elif t is list:
            stack.extend((f"{path}[{i}]", x) for i, x in reversed(list(enumerate(v))))


def _check_range(v: int | None, lo: int, hi: int, where: str, name: str, what: str) -> None:
    if v is not None and not lo <= v <= hi:
        raise InputError(f"{where}: field `{name}`: {v} is not {what}")


def _check_ids(ids: list[int], where: str, name: str) -> None:
    """Token ids are 0..2**63-1."""
    for i, x in enumerate(ids):
        if not 0 <= x <= I64_MAX:
            raise InputError(
                f"{where}: field `{name}`: {x} at index {i} is not a token id (0 .. 2**63-1)"
            )


_OPTIONAL_INTS = (
    "send_ns",
    "first_token_ns",
    "finish_ns",
    "arrival_ns",
    "think_ns",
    "lane",
    "session",
    "turn",
    "max_new_tokens",
    "prompt_tokens",
    "cached_tokens",
    "completion_tokens",
    "dp_rank",
)


def check_request_record(rec: RequestRecord, where: str) -> None:
    """The checks ``parse_request_line`` makes, on a ``RequestRecord`` built elsewhere
    (``capture import`` from SGLang logs): a string rid, token ids that are ints (not bools)
    in 0 .. 2**63-1, optional ints in the signed 64-bit range, every int of ``meta_info`` in
    -2**63 .. 2**64-1. ``InputError`` naming the record and field; a record that passes reads
    back as it was written."""
    if type(rec.rid) is not str:
        raise InputError(f"{where}: field `rid`: expected a string, got {_kind(rec.rid)}")
    for name in ("input_ids", "output_ids"):
        ids = getattr(rec, name)
        if type(ids) is not list:
            raise InputError(f"{where}: field `{name}`: expected an array of ints")
        bad = next((i for i, x in enumerate(ids) if not _is_int(x)), None)
        if bad is not None:
            raise InputError(
                f"{where}: field `{name}`: expected an array of ints, got "
                f"{_kind(ids[bad])} at index {bad}"
            )
        _check_ids(ids, where, name)
    for name in _OPTIONAL_INTS:
        v = getattr(rec, name)
        if v is not None and not _is_int(v):
            raise InputError(f"{where}: field `{name}`: expected an int or null, got {_kind(v)}")
        _check_range(v, I64_MIN, I64_MAX, where, name, "a signed 64-bit int")
    _check_ints(rec.meta_info, where, "meta_info")


def _lines(path: Path, what: str) -> Iterator[tuple[str, dict[str, Any]]]:
    """``(where, object)`` for each non-blank line of a JSONL file."""
    try:
        f = open(path, "rb")
    except FileNotFoundError:
        raise UsageError(f"{what} file not found: {path}") from None
    except OSError as exc:
        raise UsageError(f"cannot read {what} file {path}: {exc.strerror}") from None
    with f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            where = f"{path}:{lineno}"
            try:
                obj = msgspec.json.decode(line)
            except msgspec.DecodeError as exc:
                raise InputError(f"{where}: not valid JSON ({exc})") from None
            if type(obj) is not dict:
                raise InputError(f"{where}: expected a JSON object, got {_kind(obj)}")
            yield where, obj


def parse_frame_line(obj: dict[str, Any], where: str) -> FrameLine:
    """Validate one frames-JSONL object."""
    recv_ns = _get(obj, "recv_ns", where, "int", required=True)
    topic = _get(obj, "topic", where, "str", required=True)
    seq = _get(obj, "seq", where, "int", required=True)
    b64 = _get(obj, "payload_b64", where, "str", required=True)
    endpoint = _get(obj, "endpoint", where, "int", required=False, default=0)
    via_name = _get(obj, "via", where, "str?", required=False)
    if not 0 <= seq <= I64_MAX:
        raise InputError(
            f"{where}: field `seq`: {seq} is not a publisher seq (0 .. 2**63-1; "
            "ff x 8 is the replay end marker)"
        )
    if recv_ns < 0:
        raise InputError(f"{where}: field `recv_ns`: negative ({recv_ns})")
    _check_range(recv_ns, 0, I64_MAX, where, "recv_ns", "a time in ns (0 .. 2**63-1)")
    if endpoint < 0:
        raise InputError(f"{where}: field `endpoint`: negative ({endpoint})")
    _check_range(endpoint, 0, I64_MAX, where, "endpoint", "an endpoint id (0 .. 2**63-1)")
    if via_name is None:
        via = VIA_IMPORT
    elif via_name in VIA_NAMES:
        via = VIA_NAMES[via_name]
    else:
        raise InputError(f'{where}: field `via`: expected "live" or "replay", got {via_name!r}')
    try:
        payload = base64.b64decode(b64, validate=True)
    except (binascii.Error, ValueError) as exc:
        raise InputError(f"{where}: field `payload_b64`: not valid base64 ({exc})") from None
    return FrameLine(recv_ns, topic, seq, payload, endpoint, via)


def _finish_reason(v: Any, where: str) -> str | None:
    if v is None or type(v) is str:
        return v
    if type(v) is dict:
        t = v.get("type")
        if t is None or type(t) is str:
            return t
    raise InputError(
        f"{where}: field `meta_info.finish_reason`: expected an object with a string `type`, "
        f"a string or null, got {_kind(v)}"
    )


def parse_request_line(obj: dict[str, Any], where: str) -> RequestRecord:
    """Validate one requests-JSONL object into a ``RequestRecord`` (``think_ns`` as given)."""
    rid = _get(obj, "rid", where, "str", required=True)
    input_ids = _get(obj, "input_ids", where, "ints", required=True)
    output_ids = _get(obj, "output_ids", where, "ints", required=False, default=[])
    meta = _get(obj, "meta_info", where, "dict", required=False, default={})
    opt = {
        k: _get(obj, k, where, "int?", required=False)
        for k in (
            "send_ns",
            "finish_ns",
            "first_token_ns",
            "arrival_ns",
            "think_ns",
            "lane",
            "session",
            "turn",
            "max_new_tokens",
        )
    }
    error = _get(obj, "error", where, "str?", required=False)
    _check_ids(input_ids, where, "input_ids")
    _check_ids(output_ids, where, "output_ids")
    for k, v in opt.items():
        _check_range(v, I64_MIN, I64_MAX, where, k, "a signed 64-bit int")
    _check_ints(meta, where, "meta_info")

    def meta_int(key: str) -> int | None:
        v = meta.get(key)
        if v is None or _is_int(v):
            return v
        raise InputError(f"{where}: field `meta_info.{key}`: expected an int, got {_kind(v)}")

    completion = meta_int("completion_tokens")
    max_new = opt["max_new_tokens"]
    if max_new is None:
        max_new = completion if completion is not None else len(output_ids)
    return RequestRecord(
        rid=rid,
        input_ids=input_ids,
        output_ids=output_ids,
        send_ns=opt["send_ns"],
        first_token_ns=opt["first_token_ns"],
        finish_ns=opt["finish_ns"],
        lane=opt["lane"],
        session=opt["session"],
        turn=opt["turn"],
        max_new_tokens=max_new,
        prompt_tokens=meta_int("prompt_tokens"),
        cached_tokens=meta_int("cached_tokens"),
        completion_tokens=completion,
        finish_reason=_finish_reason(meta.get("finish_reason"), where),
        error=error,
        dp_rank=meta_int("dp_rank"),
        source="import",
        think_ns=opt["think_ns"],
        arrival_ns=opt["arrival_ns"],
        meta_info=meta,
    )


def read_requests(path: Path) -> list[RequestRecord]:
    """Every request of a requests JSONL file, ``think_ns`` derived for closed-loop lanes
    (unless the line gave it)."""
    lines = list(_lines(path, "requests"))
    recs = [parse_request_line(obj, where) for where, obj in lines]
    refuse_duplicate_rids(recs, str(path), [where for where, _ in lines])
    derived = think_times([(r.lane, r.send_ns, r.finish_ns) for r in recs])
    return [
        r if r.think_ns is not None or t is None else msgspec.structs.replace(r, think_ns=t)
        for r, t in zip(recs, derived, strict=True)
    ]


def read_server_info(path: Path) -> dict[str, Any]:
    try:
        text = path.read_bytes()
    except FileNotFoundError:
        raise UsageError(f"server info file not found: {path}") from None
    except OSError as exc:
        raise UsageError(f"cannot read server info file {path}: {exc.strerror}") from None
    try:
        info = msgspec.json.decode(text)
    except msgspec.DecodeError as exc:
        raise InputError(f"{path}: not valid JSON ({exc})") from None
    if type(info) is not dict:
        raise InputError(f"{path}: expected a JSON object, got {_kind(info)}")
    where = str(path)
    _get(info, "version", where, "str?", required=False)
    _check_ints(info, where, "server_info")
    if "kv_events_config" in info and type(info["kv_events_config"]) not in (str, dict):
        raise InputError(f"{where}: field `kv_events_config`: expected a string or an object")
    if info.get("kv_events") is not None:
        kv = _get(info, "kv_events", where, "dict", required=False)
        for key in ("endpoint_port_base", "dp_size", "replay_endpoint_port_base"):
            v = kv.get(key)
            if v is not None and not _is_int(v):
                raise InputError(
                    f"{where}: field `kv_events.{key}`: expected an int, got {_kind(v)}"
                )
    return info


def endpoints_from_server_info(info: dict[str, Any]) -> list[EndpointInfo]:
    """One ``EndpointInfo`` per DP-rank publisher advertised in ``/server_info``'s ``kv_events``."""
    kv = info.get("kv_events")
    if not isinstance(kv, dict) or kv.get("endpoint_port_base") is None:
        return []
    host = kv.get("endpoint_host") or "127.0.0.1"
    if host in ("*", "0.0.0.0"):
        host = "127.0.0.1"
    base = kv["endpoint_port_base"]
    rbase = kv.get("replay_endpoint_port_base")
    topic = kv.get("topic") or ""
    return [
        EndpointInfo(
            id=r,
            url=f"tcp://{host}:{base + r}",
            replay_url=f"tcp://{host}:{rbase + r}" if rbase is not None else None,
            dp_rank=r,
            topic=topic,
        )
        for r in range(int(kv.get("dp_size") or 1))
    ]


# --------------------------------------------------------------------------------------
# Seq bookkeeping
# --------------------------------------------------------------------------------------


class SeqBook:
    """Per-endpoint epochs and gaps of an imported stream (nothing is recovered on import)."""

    def __init__(self) -> None:
        self._state: dict[int, tuple[int, int, bytes, str]] = {}  # epoch, last seq, payload, topic

    def feed(self, fr: FrameLine) -> tuple[list[Gap | Epoch], int | None]:
        """Records to write before ``fr`` and its epoch (``None``: a duplicate, skip it)."""
        out: list[Gap | Epoch] = []
        st = self._state.get(fr.endpoint)
        if st is None:
            epoch = 0
            out.append(Epoch(fr.endpoint, 0, fr.seq, fr.recv_ns, "first frame"))
            out.extend(self._head_gap(fr, epoch))
        else:
            epoch, last, last_payload, last_topic = st
            if fr.seq == last and fr.payload == last_payload and fr.topic == last_topic:
                return [], None
            if fr.seq <= last:
                epoch += 1
                out.append(
                    Epoch(fr.endpoint, epoch, fr.seq, fr.recv_ns, "seq went backwards (restart)")
                )
                out.extend(self._head_gap(fr, epoch))
            elif fr.seq > last + 1:
                out.append(
                    Gap(
                        fr.endpoint, epoch, last + 1, fr.seq - 1, 0, "missing in import", fr.recv_ns
                    )
                )
        self._state[fr.endpoint] = (epoch, fr.seq, fr.payload, fr.topic)
        return out, epoch

    @staticmethod
    def _head_gap(fr: FrameLine, epoch: int) -> list[Gap]:
        if fr.seq == 0:
            return []
        return [Gap(fr.endpoint, epoch, 0, fr.seq - 1, 0, "before first frame", fr.recv_ns)]


# --------------------------------------------------------------------------------------
# The import
# --------------------------------------------------------------------------------------


def _scan_frames(path: Path) -> tuple[int, dict[int, str], int | None]:
    """Validate every line; return (count, endpoint -> first topic, first recv_ns)."""
    n, endpoints, first = 0, {}, None
    for where, obj in _lines(path, "frames"):
        fr = parse_frame_line(obj, where)
        n += 1
        endpoints.setdefault(fr.endpoint, fr.topic)
        if first is None or fr.recv_ns < first:
            first = fr.recv_ns
    return n, endpoints, first


def import_bundle(
    out: str | os.PathLike[str],
    *,
    frames: str | os.PathLike[str] | None = None,
    requests: str | os.PathLike[str] | None = None,
    server_info: str | os.PathLike[str] | None = None,
    sglang_version: str | None = None,
    command: list[str] | None = None,
    append: bool = False,
    segment_bytes: int = 256 << 20,
) -> ImportSummary:
    """Write (or, with ``append``, extend) the bundle ``out`` from dump files.

    All inputs are validated first; on bad input nothing is created or changed.
    """
    out_path = Path(out)
    summary = ImportSummary(out=str(out_path), appended=append)
    if append:
        if frames is not None or server_info is not None:
            raise UsageError("--append adds request records only (give --requests alone)")
        if requests is None:
            raise UsageError("--append needs --requests")
        reqs = read_requests(Path(requests))
        check_encodable(reqs)  # a record that cannot be written fails before the bundle opens
        refuse_known_rids(out_path, reqs)
        with BundleWriter.append(out_path, segment_bytes=segment_bytes) as w:
            for r in reqs:
                w.write(r)
            summary.requests = len(reqs)
            w.close(stats={"import": asdict(summary)})
        return summary

    if frames is None:
        raise UsageError("--frames is required (or --append with --requests)")
    refuse_nonempty_dir(out_path)
    frames_path = Path(frames)
    n_frames, ep_topics, first_recv = _scan_frames(frames_path)
    reqs = read_requests(Path(requests)) if requests is not None else []
    info = read_server_info(Path(server_info)) if server_info is not None else {}

    endpoints = endpoints_from_server_info(info)
    known = {e.id for e in endpoints}
    endpoints += [
        EndpointInfo(id=e, url="", dp_rank=e, topic=t)
        for e, t in sorted(ep_topics.items())
        if e not in known
    ]
    kv_cfg = info.get("kv_events_config")
    if isinstance(kv_cfg, dict):
        kv_cfg = json.dumps(kv_cfg, separators=(",", ":"))
    starts = [t for t in [first_recv, *(r.send_ns for r in reqs)] if t is not None]
    header = Header(
        format_major=FORMAT_MAJOR,
        format_minor=FORMAT_MINOR,
        source="real",
        kvcadence_version=__version__,
        sglang_version=sglang_version or info.get("version"),
        server_info=redact_paths(info),
        kv_events_config=kv_cfg,
        command=redact_paths(list(command) if command is not None else ["kvcadence", "import"]),
        start_ns=min(starts) if starts else time.time_ns(),
        endpoints=endpoints,
    )
    check_encodable([header])
    book = SeqBook()
    summary.endpoints = sorted(ep_topics)
    with (
        staged_bundle(out_path) as tmp,
        BundleWriter(tmp, header, segment_bytes=segment_bytes) as w,
    ):
        for where, obj in _lines(frames_path, "frames"):
            fr = parse_frame_line(obj, where)
            summary.frames += 1
            pre, epoch = book.feed(fr)
            for rec in pre:
                w.write(rec)
                if isinstance(rec, Gap):
                    summary.gaps += 1
                    summary.missed_seqs += rec.last_seq - rec.first_seq + 1
                else:
                    summary.epochs += 1
            if epoch is None:
                summary.duplicates += 1
                continue
            raw, is_bin = encode_payload(fr.payload)
            summary.bin_payloads += is_bin
            w.write(
                EventFrame(fr.endpoint, fr.seq, fr.recv_ns, fr.topic, fr.via, epoch, is_bin, raw)
            )
            summary.events_written += 1
        if summary.frames != n_frames:
            raise InputError(f"{frames_path}: changed while it was being imported")
        for r in reqs:
            w.write(r)
        summary.requests = len(reqs)
        w.close(stats={"import": asdict(summary)})
    return summary


__all__ = [
    "FrameLine",
    "ImportSummary",
    "SeqBook",
    "check_request_record",
    "endpoints_from_server_info",
    "import_bundle",
    "parse_frame_line",
    "parse_request_line",
    "read_requests",
    "read_server_info",
]
