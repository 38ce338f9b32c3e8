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

Every input is validated before the bundle appears: a bad line is one ``InputError``
naming ``file:line`` and the field, and no output is written. The requests JSONL is read as a
stream (``RequestLog``: a light pass for rids, lanes and times, then each record parsed,
validated and written in turn; no list of every prompt), so a bad request line may be found
while the staged bundle is written, which is then removed. Integers are range-checked so
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
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import msgspec

from kvcadence import __version__
from kvcadence.capture.discovery import redact_paths
from kvcadence.capture.rids import UniqueRids, refuse_known_rids
from kvcadence.capture.think import think_times
from kvcadence.errors import InputError, UsageError
from kvcadence.format.bundle import BundleWriter, check_encodable, encode_payload, staged_bundle
from kvcadence.format.jsonl import (  # the line parsers, shared with ``replay --trace``
    I64_MAX,
    check_range,
    check_request_record,
    get_field,
    jsonl_lines,
    jsonl_raw_lines,
    parse_request_line,
    read_server_info,
)
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


def parse_frame_line(obj: dict[str, Any], where: str) -> FrameLine:
    """Validate one frames-JSONL object."""
    recv_ns = get_field(obj, "recv_ns", where, "int", required=True)
    topic = get_field(obj, "topic", where, "str", required=True)
    seq = get_field(obj, "seq", where, "int", required=True)
    b64 = get_field(obj, "payload_b64", where, "str", required=True)
    endpoint = get_field(obj, "endpoint", where, "int", required=False, default=0)
    via_name = get_field(obj, "via", where, "str?", required=False)
    if not 0 <= seq <= I64_MAX:
        raise InputError(
            f"{where}: field `seq`: {seq} is not a publisher seq (0 .. 2**63-1; "
            "ff x 8 is the replay end marker)"
        )
    if recv_ns < 0:
        raise InputError(f"{where}: field `recv_ns`: negative ({recv_ns})")
    check_range(recv_ns, 0, I64_MAX, where, "recv_ns", "a time in ns (0 .. 2**63-1)")
    if endpoint < 0:
        raise InputError(f"{where}: field `endpoint`: negative ({endpoint})")
    check_range(endpoint, 0, I64_MAX, where, "endpoint", "an endpoint id (0 .. 2**63-1)")
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


class _Times(msgspec.Struct):
    """What the first pass over a requests JSONL reads of a line (the rest, token ids
    included, is skipped by the decoder, not built): loose types, checked by the second."""

    rid: Any = None
    lane: Any = None
    send_ns: Any = None
    finish_ns: Any = None


_TIMES = msgspec.json.Decoder(_Times)


def _int(v: Any) -> int | None:
    return v if type(v) is int else None


class RequestLog:
    """A requests JSONL file's records, read as a stream in two passes. Made: one light pass
    (each line's ``rid``, ``lane``, ``send_ns``, ``finish_ns`` only): rids unique, ``think_ns``
    derived for closed-loop lanes, the earliest ``send_ns``. Iterated: every line parsed and
    validated (``parse_request_line``), one record at a time, its derived ``think_ns`` set
    unless the line gave one. What is held is a few numbers and the rid per request, never
    every prompt as a list of ints. A bad line is found by the iteration (a new bundle is
    staged, so nothing is left; ``--append`` iterates once before it opens the bundle); a
    file that changes between the passes is an ``InputError``."""

    def __init__(self, path: Path) -> None:
        self.path = path
        seen = UniqueRids(str(path))
        rows: list[tuple[int | None, int | None, int | None]] = []
        self._rids: list[Any] = []
        self.first_send_ns: int | None = None
        for where, line in jsonl_raw_lines(path, "requests"):
            try:
                t = _TIMES.decode(line)
            except (msgspec.DecodeError, RecursionError):
                t = _Times()  # the iteration reports the line
            if type(t.rid) is str:
                seen.add(t.rid, where)
            self._rids.append(t.rid)
            send = _int(t.send_ns)
            rows.append((_int(t.lane), send, _int(t.finish_ns)))
            if send is not None and (self.first_send_ns is None or send < self.first_send_ns):
                self.first_send_ns = send
        #: per request: the derived think time (a line's own ``think_ns`` wins when read)
        self._think = think_times(rows)

    def __len__(self) -> int:
        return len(self._rids)

    def __iter__(self) -> Iterator[RequestRecord]:
        n = 0
        for where, obj in jsonl_lines(self.path, "requests"):
            r = parse_request_line(obj, where)
            if n >= len(self._rids) or r.rid != self._rids[n]:
                raise InputError(f"{self.path}: changed while it was being imported")
            t = self._think[n]
            n += 1
            yield (
                r if r.think_ns is not None or t is None else msgspec.structs.replace(r, think_ns=t)
            )
        if n != len(self._rids):
            raise InputError(f"{self.path}: changed while it was being imported")


def read_requests(path: Path) -> RequestLog:
    """Every request of a requests JSONL file (``RequestLog``: scanned now, parsed and
    validated one at a time when iterated), ``think_ns`` derived for closed-loop lanes."""
    return RequestLog(path)


def _encodable(records: Iterable[RequestRecord]) -> Iterator[RequestRecord]:
    """``records``, each checked to encode (``check_encodable``) as it passes."""
    for r in records:
        check_encodable([r])
        yield r


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
    n, first = 0, None
    endpoints: dict[int, str] = {}
    for where, obj in jsonl_lines(path, "frames"):
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
    redact: Mapping[str, str] | None = None,
) -> ImportSummary:
    """Write (or, with ``append``, extend) the bundle ``out`` from dump files; ``redact``:
    more paths the header must not name (``discovery.header_redactions``).

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
        # a record that cannot be written, or whose rid the bundle holds, fails before the
        # bundle opens (one more pass over the file, a record at a time)
        refuse_known_rids(out_path, _encodable(reqs))
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
    log = read_requests(Path(requests)) if requests is not None else None
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
    first_send = None if log is None else log.first_send_ns
    starts = [t for t in (first_recv, first_send) if t is not None]
    header = Header(
        format_major=FORMAT_MAJOR,
        format_minor=FORMAT_MINOR,
        source="real",
        kvcadence_version=__version__,
        sglang_version=sglang_version or info.get("version"),
        server_info=redact_paths(info, (), redact),
        kv_events_config=kv_cfg,
        command=redact_paths(
            list(command) if command is not None else ["kvcadence", "import"], (), redact
        ),
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
        for where, obj in jsonl_lines(frames_path, "frames"):
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
        for r in log or ():
            w.write(r)
        summary.requests = 0 if log is None else len(log)
        w.close(stats={"import": asdict(summary)})
    return summary


__all__ = [
    "FrameLine",
    "RequestLog",
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
