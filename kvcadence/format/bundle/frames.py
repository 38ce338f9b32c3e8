"""Frames and records inside a segment: the frame header, record tags, payload storage, the
encode-error messages and the decoders the reader uses (with the resynchronisation pattern).

A frame is ``[u32 LE length][u32 LE CRC32 of body][body]``; a body is one ``BundleRecord``
encoded with msgspec (msgpack, array-like, the tag first). An EventFrame's payload is stored
as ``Raw`` when it is one complete msgpack value (``is_single_msgpack``), else bin-wrapped
(``payload_is_bin``); ``event_payload`` gives the exact bytes back.
"""

from __future__ import annotations

import functools
import re
import struct
import threading
from collections.abc import Iterable, Iterator, Sequence
from typing import Any, Union

import msgspec

from kvcadence.errors import (
    BundleError,
)
from kvcadence.format.schema import (
    Annotation,
    AnnotationRawView,
    BundleRecord,
    Epoch,
    EventFrame,
    Gap,
    Header,
    PackedRequest,
    PackedRequestRidView,
    RequestRecord,
    RequestRecordView,
    RequestRidView,
    SegmentStart,
    Trailer,
)

FRAME_HEADER = struct.Struct("<II")  # body length, CRC32 of body
FRAME_HEADER_SIZE = FRAME_HEADER.size  # 8
MIN_BODY = 2  # a fixarray header + an empty fixstr tag: nothing shorter is a record

#: record class -> tag written on disk (the first array element)
RECORD_TAGS: dict[type, str] = {
    cls: str(cls.__struct_config__.tag)
    for cls in (Header, EventFrame, RequestRecord, Gap, Epoch, Annotation, Trailer)
}
_TAG_CLASSES: dict[bytes, type] = {tag.encode(): cls for cls, tag in RECORD_TAGS.items()}

# A payload is stored as Raw only if it is one complete msgpack value that still parses with
# this many extra levels of nesting around it. A reader that meets msgspec's recursion limit
# on a frame (it decodes from a deeper call stack than the writer checked from) retries in a
# fresh thread, whose stack is shallower than this headroom: see ``_decode_fresh_stack``.
_DEPTH_HEADROOM = 32
_DEPTH_PAD = b"\x91" * _DEPTH_HEADROOM
# Payloads this short nest fewer levels than msgspec's limit under CPython's default
# recursion limit (1000) minus a reader's fresh-thread stack and the frame's own nesting:
# they need no padded check (most SGLang batches are shorter than this).
_SHALLOW_BYTES = 1000 - 2 * _DEPTH_HEADROOM
_RAW_DECODER = msgspec.msgpack.Decoder(msgspec.Raw)

# Where a frame may start when resynchronising: 8 bytes of frame header, then a msgpack
# array header followed by a str header (every record is a tagged array).
_RESYNC = re.compile(
    rb"(?s)[\x91-\x9f][\xa0-\xbf\xd9]|\xdc..[\xa0-\xbf\xd9]|\xdd....[\xa0-\xbf\xd9]"
)


_ENCODE_ERRORS = (TypeError, ValueError, OverflowError, RecursionError, msgspec.EncodeError)


def _describe(record: Any) -> str:
    """``request rid='r1'`` / ``event endpoint 0 seq 5`` / ``note kind='x'``: which record."""
    tag = RECORD_TAGS.get(type(record), type(record).__name__)
    if isinstance(record, RequestRecord):
        return f"{tag} record rid={record.rid!r}"
    if isinstance(record, EventFrame):
        return f"{tag} record endpoint {record.endpoint!r} seq {record.seq!r}"
    if isinstance(record, Annotation):
        return f"{tag} record kind={record.kind!r}"
    if isinstance(record, (Gap, Epoch)):
        return f"{tag} record endpoint {record.endpoint!r} epoch {record.epoch!r}"
    return f"{tag} record"


def _encode_error(record: Any, exc: BaseException) -> BundleError:
    msg = str(exc) or type(exc).__name__
    if isinstance(exc, OverflowError):
        msg = f"an integer is outside the int64/uint64 range ({msg})"
    elif isinstance(exc, RecursionError):
        msg = "nested too deeply"
    return BundleError(f"cannot encode {_describe(record)}: {msg}; nothing of it was written")


def check_encodable(records: Sequence[Any]) -> None:
    """Encode every record (nothing written): ``BundleError`` naming the first one msgpack
    cannot encode, ``TypeError`` for a value that is not a bundle record."""
    enc = msgspec.msgpack.Encoder()
    buf = bytearray()
    for rec in records:
        if type(rec) not in RECORD_TAGS:
            raise TypeError(f"not a bundle record: {type(rec).__name__}")
        try:
            enc.encode_into(rec, buf)
        except _ENCODE_ERRORS as exc:
            raise _encode_error(rec, exc) from exc


# --------------------------------------------------------------------------------------
# Payloads
# --------------------------------------------------------------------------------------


def is_single_msgpack(payload: bytes | bytearray | memoryview) -> bool:
    """True if ``payload`` is exactly one complete msgpack value (nothing before or after).

    Cost: one C-level skip-parse (msgspec decoding to ``Raw`` walks the structure without
    building objects, ~1 µs for a 700-byte KV batch, about an eighth of an untyped decode).
    A value nests at most as many levels as it has bytes, so a payload of at most
    ``_SHALLOW_BYTES`` can be read back from any stack (directly, or on the reader's fresh
    thread) and is checked as is; a longer one is checked with ``_DEPTH_HEADROOM`` extra
    levels of nesting around it (one copy). String contents are not UTF-8-checked (that is
    the wire decoder's job; the bytes are kept either way).
    """
    data = payload if type(payload) is bytes else bytes(payload)
    try:
        _RAW_DECODER.decode(data if len(data) <= _SHALLOW_BYTES else _DEPTH_PAD + data)
    except (msgspec.DecodeError, RecursionError):
        return False
    return True


def encode_payload(payload: bytes | bytearray | memoryview) -> tuple[msgspec.Raw, bool]:
    """``(Raw, payload_is_bin)`` for an EventFrame: Raw unchanged when ``payload`` is one
    msgpack value, otherwise a msgpack bin wrapping the exact bytes (``payload_is_bin``)."""
    data = payload if type(payload) is bytes else bytes(payload)
    if is_single_msgpack(data):
        return msgspec.Raw(data), False
    return msgspec.Raw(msgspec.msgpack.encode(data)), True


def _event_frames(
    items: Iterable[tuple[int, int, int, str, bytes | bytearray | memoryview, int, int]],
) -> Iterator[EventFrame]:
    """EventFrames of ``(endpoint, seq, recv_ns, topic, payload, via, epoch)`` tuples: the
    payload check of ``encode_payload`` inlined (the batch write path runs it per message)."""
    check = _RAW_DECODER.decode
    raw_of = msgspec.Raw
    for e, s, r, t, p, v, ep in items:
        data = p if type(p) is bytes else bytes(p)
        try:
            check(data if len(data) <= _SHALLOW_BYTES else _DEPTH_PAD + data)
        except (msgspec.DecodeError, RecursionError):
            yield EventFrame(e, s, r, t, v, ep, True, raw_of(msgspec.msgpack.encode(data)))
        else:
            yield EventFrame(e, s, r, t, v, ep, False, raw_of(data))


def event_payload(frame: EventFrame) -> bytes:
    """The exact payload bytes of ``frame`` as received (or simulated)."""
    if frame.payload_is_bin:
        return msgspec.msgpack.decode(frame.payload, type=bytes)
    return bytes(frame.payload)


def event_payload_view(frame: EventFrame) -> bytes | memoryview:
    """``event_payload`` without the copy: a read-only view of the payload bytes inside the
    buffer the frame was decoded from (bytes when the payload was stored bin-wrapped).
    For readers that decode the payload at once (analysis ingest)."""
    if frame.payload_is_bin:
        return msgspec.msgpack.decode(frame.payload, type=bytes)
    return memoryview(frame.payload)


# --------------------------------------------------------------------------------------
# Decoding (the reader's)
# --------------------------------------------------------------------------------------

#: the tag of ``PackedRequest`` (format 2.0's request layout; never yielded as it is)
PACKED_TAG = str(PackedRequest.__struct_config__.tag).encode()
#: the tags a reader asking for requests reads
REQUEST_TAGS = frozenset((b"request", PACKED_TAG))
_UNION = msgspec.msgpack.Decoder(Union[BundleRecord, PackedRequest])
_DECODERS: dict[bytes, msgspec.msgpack.Decoder[Any]] = {
    **{tag: msgspec.msgpack.Decoder(cls) for tag, cls in _TAG_CLASSES.items()},
    PACKED_TAG: msgspec.msgpack.Decoder(PackedRequest),
}
_ANY = msgspec.msgpack.Decoder()
# Decode-only views (``records(request_view=True)``): RequestRecord as RequestRecordView.
_UNION_VIEW = msgspec.msgpack.Decoder(
    Union[Header, EventFrame, RequestRecordView, PackedRequest, Gap, Epoch, Annotation, Trailer]
)
_VIEW_DECODERS: dict[bytes, msgspec.msgpack.Decoder[Any]] = {
    **_DECODERS,
    b"request": msgspec.msgpack.Decoder(RequestRecordView),
}
# events and notes with the notes' data undecoded (``BundleReader.events_and_notes``)
EVENTS_NOTES_RAW = msgspec.msgpack.Decoder(Union[EventFrame, AnnotationRawView])
NOTE_RAW = msgspec.msgpack.Decoder(AnnotationRawView)
#: what ``events_and_notes_decoder``'s function returns for a frame it skips unread
SKIPPED = object()
#: a note's first bytes after its array header (fixstr ``"note"``)
_NOTE_HEAD = b"\xa4note"
#: a format 2.0 packed request's (fixstr tag): skipped unread by ``events_and_notes``, as
#: the reader's slow path skips a known record nobody asked for (no exception on the way)
_PACKED_HEAD = bytes([0xA0 | len(PACKED_TAG)]) + PACKED_TAG
#: the first bytes of those two (a tag of any other length is neither)
_HEAD_BYTE = frozenset((_NOTE_HEAD[0], _PACKED_HEAD[0]))


#: an event frame's first bytes after its array header (fixstr ``"event"``)
_EVENT_HEAD = b"\xa5event"


def unread_events(body: memoryview) -> bool:
    """The predicate a read of requests only steps over frames by: True for an event frame
    (by its first bytes: most of a capture's frames, which such a read would CRC-check and
    try to decode only to skip them)."""
    return 0x91 <= body[0] <= 0x9F and body[1:7] == _EVENT_HEAD


def _note_kind(body: memoryview) -> bytes | None:
    """The ``kind`` bytes of a note frame (``["note", kind, ...]``, kind a fixstr or str8),
    or None when ``body`` is not shaped so (not a note, or one to decode to find out).
    ``body[1:6]`` is known to be ``_NOTE_HEAD``."""
    if len(body) < 7 or body[0] < 0x93:
        return None
    b = body[6]
    if 0xA0 <= b <= 0xBF:
        start, n = 7, b - 0xA0
    elif b == 0xD9 and len(body) > 7:
        start, n = 8, body[7]
    else:
        return None
    return bytes(body[start : start + n]) if start + n <= len(body) else None


def unread_frames(kinds: frozenset[str]) -> Any:
    """The predicate ``events_and_notes`` skips frames by: True for a note whose kind (read
    from its first bytes) is not in ``kinds`` and for a packed request (by its first
    bytes; the slow path would skip it undecoded). Looks at a frame's first bytes only."""
    wanted = frozenset(k.encode() for k in kinds)

    def unread(body: memoryview) -> bool:
        b0 = body[0]
        if 0x91 <= b0 <= 0x9F:
            if body[1] not in _HEAD_BYTE:  # another tag's length (an event frame): read
                return False
            head = bytes(body[1:6])
            if head == _NOTE_HEAD:
                k = _note_kind(body)
                return k is not None and k not in wanted
            return head == _PACKED_HEAD
        # a packed request has 24 fields: an array16 header
        return b0 == 0xDC and bytes(body[3:8]) == _PACKED_HEAD

    return unread


def events_and_notes_decoder(kinds: frozenset[str] | None, events_as: Any = None) -> Any:
    """The reader's fast path for ``events_and_notes``: an ``EventFrame`` or an
    ``AnnotationRawView``; a frame ``unread_frames(kinds)`` skips (a note of another kind,
    a packed request) comes back as ``SKIPPED``, undecoded and unchecked (``kinds`` None:
    every note decoded). ``events_as``: a struct type tried first (a caller's stricter
    ``EventFrame``, e.g. with its payload typed, decoded in the same pass); a frame it
    refuses decodes as usual."""
    decode: Any = EVENTS_NOTES_RAW.decode
    if events_as is not None:
        typed, plain = _events_as_decoder(events_as).decode, decode

        def either(body: memoryview) -> Any:
            try:
                return typed(body)
            except msgspec.DecodeError:  # ValidationError included
                return plain(body)

        decode = either
    if kinds is None:
        return decode
    unread = unread_frames(kinds)

    def fast(body: memoryview) -> Any:
        return SKIPPED if unread(body) else decode(body)

    return fast


@functools.cache
def _events_as_decoder(events_as: Any) -> msgspec.msgpack.Decoder[Any]:
    """``events_and_notes``'s decoder with ``events_as`` for the events."""
    return msgspec.msgpack.Decoder(Union[events_as, AnnotationRawView])


# requests only (``requests()``, ``iter_kinds("request")``): either layout
_REQUESTS = msgspec.msgpack.Decoder(Union[RequestRecord, PackedRequest])
_REQUESTS_VIEW = msgspec.msgpack.Decoder(Union[RequestRecordView, PackedRequest])
# their rids only (``request_rids``: ``views="rid"``; array-like structs ignore the rest)
_REQUEST_RIDS = msgspec.msgpack.Decoder(Union[RequestRidView, PackedRequestRidView])


def fast_decoder(wanted: frozenset[bytes] | None, views: bool | str) -> Any:
    """The reader's fast path: the decode function of the one decoder most frames need
    (the tag is peeked at only when it fails), or None when no single decoder fits
    ``wanted`` (None: every record; ``views``: requests as ``RequestRecordView``)."""
    if wanted is None:
        return (_UNION_VIEW if views else _UNION).decode
    if len(wanted) == 1:
        return (_VIEW_DECODERS if views else _DECODERS)[next(iter(wanted))].decode
    if wanted == REQUEST_TAGS:
        if views == "rid":
            return _REQUEST_RIDS.decode
        return (_REQUESTS_VIEW if views else _REQUESTS).decode
    if not views and len(wanted) > 1 and wanted <= _CLASSES_BY_TAG.keys():
        return _union_of(wanted).decode  # a frame of another kind fails on its tag
    return None


#: every record class a bundle can hold, by tag (format 2.0's packed requests included)
_CLASSES_BY_TAG: dict[bytes, type] = {**_TAG_CLASSES, PACKED_TAG: PackedRequest}


@functools.cache
def _union_of(tags: frozenset[bytes]) -> msgspec.msgpack.Decoder[Any]:
    """One decoder for the records of ``tags`` (``iter_kinds`` with several kinds)."""
    classes = tuple(_CLASSES_BY_TAG[t] for t in sorted(tags))
    return msgspec.msgpack.Decoder(Union[classes])


def _peek_tag(body: memoryview) -> bytes | None:
    """The tag bytes of a record body (array header, then str), or None if not that shape."""
    n = len(body)
    if n < MIN_BODY:
        return None
    b0 = body[0]
    if 0x91 <= b0 <= 0x9F:
        i = 1
    elif b0 == 0xDC:
        i = 3
    elif b0 == 0xDD:
        i = 5
    else:
        return None
    if i >= n:
        return None
    t = body[i]
    if 0xA0 <= t <= 0xBF:
        start, ln = i + 1, t & 0x1F
    elif t == 0xD9 and i + 1 < n:
        start, ln = i + 2, body[i + 1]
    else:
        return None
    if start + ln > n:
        return None
    return bytes(body[start : start + ln])


def _one_value(body: memoryview) -> bool:
    """``body`` is exactly one complete msgpack value (a C skip-parse, no objects built)."""
    try:
        _RAW_DECODER.decode(body)
    except (msgspec.DecodeError, RecursionError):
        return False
    return True


_APPEND_NOTE = msgspec.msgpack.Decoder(Annotation)
_SEGMENT_START = msgspec.msgpack.Decoder(SegmentStart)


def _is_append_note(body: memoryview) -> bool:
    """The frame is the ``Annotation(kind="append")`` a reopened bundle's segment starts
    with (the first record of a new writer session). Checked once per segment."""
    if _peek_tag(body) != b"note":
        return False
    try:
        return _APPEND_NOTE.decode(body).kind == "append"
    except (msgspec.DecodeError, RecursionError):
        return False


def _decode_fresh_stack(decoder: msgspec.msgpack.Decoder[Any], body: memoryview) -> Any:
    """``decoder.decode(body)``; on msgspec's recursion limit (a deeply nested payload read
    from a deeper call stack than the writer checked it from) retry on a fresh thread's
    shallow stack. Only pathological payloads ever take the retry."""
    try:
        return decoder.decode(body)
    except RecursionError:
        pass
    out: list[Any] = []

    def run() -> None:
        try:
            out.append(decoder.decode(body))
        except (msgspec.DecodeError, RecursionError) as exc:
            out.append(exc)

    t = threading.Thread(target=run, name="kvcb-deep-decode")
    t.start()
    t.join()
    if isinstance(out[0], BaseException):
        raise out[0]
    return out[0]
