"""Bundle bytes on disk: segment files, CRC-checked frames, the writer and the reader.

This module is the only code that reads or writes bundle bytes (record layouts live in
``kvcadence.format.schema``; the format is specified in ``docs/format.md``).

A bundle is a directory of segment files ``seg-000000.kvcb``, ``seg-000001.kvcb``, ... Each
segment starts with an 8-byte header ``b"KVCB" + u16 LE major + u16 LE minor`` followed by
frames ``[u32 LE length][u32 LE CRC32 of body][body]``; a body is one ``BundleRecord``
encoded with msgspec (msgpack, array-like, the tag first). The ``Header`` record is the first
frame of segment 0; a cleanly closed writer session ends with a ``Trailer``.

Crash safety: the writer flushes its file buffer at least every ``flush_interval_s`` and
fsyncs on rotation and close, so a crash loses at most that window and leaves a *torn tail*
(a partial frame, or zeros) which the reader treats as normal. A frame whose length or CRC
does not check out in the middle of a segment is reported and skipped: the reader scans
forward for the next offset where length, CRC and decoding all validate, and never yields a
record that was not written.

Whole bundles as files are handled here too: ``is_bundle`` (a directory of segment files;
``strict``: segment 0 also starts with the magic), ``copy_bundle`` (copies the segment
files, never hard-links them: appending repairs a bundle's last segment in place, which must
never reach the original), and ``staged_bundle`` (write a new bundle into a hidden sibling
directory and rename it into place only when everything succeeded). A record msgpack cannot
encode (an int outside the int64/uint64 range, an unsupported type, nesting too deep) is a
``BundleError`` naming the record, and nothing of it is written; ``check_encodable`` runs
that check ahead of time.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import mmap
import os
import re
import shutil
import struct
import threading
import time
import zlib
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Union

import msgspec

from kvcadence import __version__
from kvcadence.errors import (
    BundleError,
    CorruptFrameError,
    FormatVersionError,
    UsageError,
)
from kvcadence.format.crcspan import SpanCrc
from kvcadence.format.lock import BundleLock
from kvcadence.format.schema import (
    FORMAT_MAJOR,
    FORMAT_MINOR,
    Annotation,
    BundleRecord,
    Epoch,
    EventFrame,
    Gap,
    Header,
    ReadRecord,
    RequestRecord,
    RequestRecordView,
    SegmentStart,
    Trailer,
)
from kvcadence.format.segments import survey_segments
from kvcadence.outguard import refuse_nonempty_dir

MAGIC = b"KVCB"
SEGMENT_HEADER = struct.Struct("<4sHH")  # magic, major, minor
FRAME_HEADER = struct.Struct("<II")  # body length, CRC32 of body
SEGMENT_HEADER_SIZE = SEGMENT_HEADER.size  # 8
FRAME_HEADER_SIZE = FRAME_HEADER.size  # 8
MIN_BODY = 2  # a fixarray header + an empty fixstr tag: nothing shorter is a record
SEGMENT_GLOB = "seg-*.kvcb"
_SEGMENT_NAME = re.compile(r"^seg-(\d{6,})\.kvcb$")

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
# ``write_events`` hands its joined frames to the file at least every this many bytes.
_BATCH_CHUNK = 1 << 20

# Where a frame may start when resynchronising: 8 bytes of frame header, then a msgpack
# array header followed by a str header (every record is a tagged array).
_RESYNC = re.compile(
    rb"(?s)[\x91-\x9f][\xa0-\xbf\xd9]|\xdc..[\xa0-\xbf\xd9]|\xdd....[\xa0-\xbf\xd9]"
)


def bundle_identity(header_body: bytes | memoryview) -> str:
    """A bundle's identity: a 64-bit BLAKE2b digest (hex) of its Header record's body (the
    header holds the start time, the command and the server info, so two recordings differ).
    Every segment after segment 0 names it in its ``SegmentStart`` record (format 1.1)."""
    return hashlib.blake2b(header_body, digest_size=8).hexdigest()


def segment_name(index: int) -> str:
    """File name of segment ``index`` (``seg-000000.kvcb``)."""
    return f"seg-{index:06d}.kvcb"


def list_segments(path: str | os.PathLike[str]) -> list[Path]:
    """Segment files of a bundle directory in index order."""
    found = []
    for p in Path(path).glob(SEGMENT_GLOB):
        m = _SEGMENT_NAME.match(p.name)
        if m and p.is_file():
            found.append((int(m.group(1)), p))
    return [p for _, p in sorted(found)]


def is_bundle(path: str | os.PathLike[str], *, strict: bool = False) -> bool:
    """True if ``path`` is a bundle directory: it holds segment files (``seg-NNNNNN.kvcb``).
    Damage inside them is the reader's to report (``BundleReader``, ``inspect``); with
    ``strict`` the first segment must also start with the bundle magic."""
    p = Path(path)
    if not p.is_dir():
        return False
    segs = list_segments(p)
    if not segs:
        return False
    if not strict:
        return True
    try:
        with open(segs[0], "rb") as f:
            head = f.read(len(MAGIC))
    except OSError:
        return False
    return head == MAGIC


def copy_bundle(src: str | os.PathLike[str], dst: str | os.PathLike[str]) -> list[Path]:
    """Copy the segment files of bundle ``src`` into the new directory ``dst`` (created; an
    existing empty one is used) and return the copies. Always a byte copy, never a (hard)
    link: ``BundleWriter.append`` truncates a bundle's last segment in place, and that must
    not reach the original. Other files of ``src`` (caches, reports) are not copied."""
    s, d = Path(src), Path(dst)
    if not is_bundle(s):
        raise UsageError(f"{s}: not a bundle (no seg-*.kvcb segment files)")
    refuse_nonempty_dir(d)
    out = []
    try:
        d.mkdir(parents=True, exist_ok=True)
        for seg in list_segments(s):
            target = d / seg.name
            shutil.copyfile(seg, target)
            out.append(target)
    except OSError as exc:
        raise BundleError(f"cannot copy bundle {s} to {d}: {exc}") from exc
    return out


@contextlib.contextmanager
def staged_bundle(path: str | os.PathLike[str]) -> Iterator[Path]:
    """Write a new bundle all-or-nothing: yields a hidden sibling directory of ``path`` to
    write into; on success it is renamed to ``path`` (which must not exist, or be an empty
    directory), on any exception it is removed and ``path`` is left as it was."""
    final = refuse_nonempty_dir(path)
    try:
        final.parent.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise BundleError(f"cannot create {final.parent}: {exc}") from exc
    tmp = final.parent / f".{final.name}.partial-{os.getpid()}-{time.monotonic_ns()}"
    try:
        yield tmp
        try:
            if final.is_dir():
                final.rmdir()  # empty (checked above): rename replaces it
            os.rename(tmp, final)
        except OSError as exc:
            msg = f"cannot move the finished bundle into place at {final}: {exc}"
            raise BundleError(msg) from exc
        with contextlib.suppress(OSError):
            fd = os.open(final.parent, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


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
# Writer
# --------------------------------------------------------------------------------------


@dataclass
class AppendReport:
    """What ``BundleWriter.append`` found and dropped before continuing a bundle."""

    segment: str  # the segment that was validated and truncated
    kept_bytes: int  # its size after truncation
    dropped_bytes: int  # torn / corrupt tail bytes removed
    corrupt: list[tuple[str, int, int]] = field(default_factory=list)  # kept: (seg, off, len)
    removed_segment: bool = False  # the segment had no valid segment header and was removed


_NEW_BUNDLE_HINT = "choose a new path, or append to a bundle"


class BundleWriter:
    """Write a bundle directory: frames into rolling segments, flushed and fsynced.

    Usable as a context manager (closes cleanly on normal exit, ``clean=False`` on an
    exception). Every ``OSError`` while writing becomes a ``BundleError``; segments closed
    before the failure stay intact and the failed one ends in a torn tail.
    """

    _lock: BundleLock | None
    bundle_id: str | None

    def __init__(
        self,
        path: str | os.PathLike[str],
        header: Header,
        *,
        segment_bytes: int = 256 << 20,
        flush_interval_s: float = 0.2,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.path = refuse_nonempty_dir(path, hint=_NEW_BUNDLE_HINT)
        self._setup(segment_bytes, flush_interval_s, clock)
        try:
            self.path.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise BundleError(f"cannot create bundle directory {self.path}: {exc}") from exc
        self._lock = BundleLock(self.path)  # one writer per bundle (UsageError otherwise)
        try:
            refuse_nonempty_dir(path, hint=_NEW_BUNDLE_HINT)  # did a writer just finish here?
            self.header = msgspec.structs.replace(
                header, format_major=FORMAT_MAJOR, format_minor=FORMAT_MINOR
            )
            self._open_segment(0)
            self.write(self.header)
            self.bundle_id = bundle_identity(self._enc.encode(self.header))
        except BaseException:
            self._lock.release()
            raise

    def _setup(
        self, segment_bytes: int, flush_interval_s: float, clock: Callable[[], float]
    ) -> None:
        if segment_bytes < 64:
            raise UsageError(f"segment_bytes must be at least 64, got {segment_bytes}")
        self.segment_bytes = segment_bytes
        self.flush_interval_s = flush_interval_s
        self._clock = clock
        self._enc = msgspec.msgpack.Encoder()
        self._buf = bytearray(4096)
        self._file: Any = None
        self._seg_index = -1
        self._seg_size = 0
        self._seg_frames = 0
        self._last_flush = clock()
        self._dirty_at: float | None = None  # clock() of the oldest record not yet flushed
        self._failed: BaseException | None = None
        self._closed = False
        self.counts: dict[str, int] = {}
        self.bytes_written = 0
        self.append_report: AppendReport | None = None
        self._lock = None
        self.bundle_id = None  # set once the header is known (SegmentStart)

    # -- opening -----------------------------------------------------------------------

    @classmethod
    def append(
        cls,
        path: str | os.PathLike[str],
        *,
        segment_bytes: int = 256 << 20,
        flush_interval_s: float = 0.2,
        clock: Callable[[], float] = time.monotonic,
    ) -> BundleWriter:
        """Reopen an existing bundle to add records.

        The last segment is validated and truncated to the end of its last good frame (what
        was dropped is in ``append_report`` and in an ``Annotation(kind="append")`` written
        first); writing continues in a new segment. The header is read, never rewritten.
        """
        if not Path(path).is_dir():
            BundleReader(path)  # the reader's one-line UsageError for a missing / non-bundle
        lock = BundleLock(path)  # before anything is read or repaired: one writer per bundle
        try:
            return cls._append_locked(path, lock, segment_bytes, flush_interval_s, clock)
        except BaseException:
            lock.release()
            raise

    @classmethod
    def _append_locked(
        cls,
        path: str | os.PathLike[str],
        lock: BundleLock,
        segment_bytes: int,
        flush_interval_s: float,
        clock: Callable[[], float],
    ) -> BundleWriter:
        reader = BundleReader(path)
        header = reader.header  # BundleError when unreadable: nothing to continue
        segments = reader.segments
        last = segments[-1]
        if reader.refused_segments and reader.refused_segments[-1][0] > last.name:
            name, why = reader.refused_segments[-1]
            raise BundleError(f"{reader.path}: cannot append: its last segment {name} is {why}")
        scan = reader.scan_segment(last)
        self = cls.__new__(cls)
        self.path = reader.path
        self._setup(segment_bytes, flush_interval_s, clock)
        self._lock = lock
        self.header = header
        self.bundle_id = reader.bundle_id
        size = last.stat().st_size
        try:
            if scan.header_ok:
                if scan.good_end < size:
                    with open(last, "r+b") as f:
                        f.truncate(scan.good_end)
                        f.flush()
                        os.fsync(f.fileno())
                report = AppendReport(last.name, scan.good_end, size - scan.good_end, scan.corrupt)
                next_index = _segment_index(last) + 1
            else:  # shorter than a segment header: it holds nothing
                last.unlink()
                report = AppendReport(last.name, 0, size, [], removed_segment=True)
                next_index = _segment_index(last)
        except OSError as exc:
            raise BundleError(f"cannot truncate {last}: {exc}") from exc
        self.append_report = report
        self._open_segment(next_index)
        self.write(
            Annotation(
                kind="append",
                recv_ns=time.time_ns(),
                data={
                    "segment": report.segment,
                    "kept_bytes": report.kept_bytes,
                    "dropped_bytes": report.dropped_bytes,
                    "corrupt_frames": len(report.corrupt),
                    "kvcadence_version": __version__,
                },
            )
        )
        return self

    def _open_segment(self, index: int) -> None:
        seg = self.path / segment_name(index)
        start = b""  # every segment after the first starts with the bundle's identity
        if index > 0 and self.bundle_id is not None:
            body = self._enc.encode(SegmentStart(self.bundle_id, index))
            start = FRAME_HEADER.pack(len(body), zlib.crc32(body)) + body
        try:
            f = open(seg, "xb", buffering=1 << 20)  # never clobber an existing segment
            try:
                f.write(SEGMENT_HEADER.pack(MAGIC, FORMAT_MAJOR, FORMAT_MINOR) + start)
            except BaseException:
                f.close()
                raise
        except FileExistsError as exc:
            raise BundleError(f"{seg}: segment already exists; refusing to overwrite") from exc
        except OSError as exc:
            self._fail(exc, f"cannot create segment {seg}")
        self._file = f
        self._seg_index = index
        self._seg_size = SEGMENT_HEADER_SIZE + len(start)
        self._seg_frames = 0  # the SegmentStart frame never makes a big frame rotate again
        self.bytes_written += SEGMENT_HEADER_SIZE + len(start)
        if start:
            self.counts["segment"] = self.counts.get("segment", 0) + 1

    @property
    def segment_path(self) -> Path:
        """The segment currently being written."""
        return self.path / segment_name(self._seg_index)

    # -- writing -----------------------------------------------------------------------

    def write(self, record: BundleRecord) -> None:
        """Append one record (any ``BundleRecord``)."""
        self._check_writable()
        tag = RECORD_TAGS.get(type(record))
        if tag is None:
            raise TypeError(f"not a bundle record: {type(record).__name__}")
        buf = self._buf
        try:
            self._enc.encode_into(record, buf, FRAME_HEADER_SIZE)
        except _ENCODE_ERRORS as exc:
            raise _encode_error(record, exc) from exc
        n = len(buf) - FRAME_HEADER_SIZE
        with memoryview(buf) as mv:
            crc = zlib.crc32(mv[FRAME_HEADER_SIZE:])
        FRAME_HEADER.pack_into(buf, 0, n, crc)
        size = n + FRAME_HEADER_SIZE
        if self._seg_frames and self._seg_size + size > self.segment_bytes:
            self._rotate()
        try:
            self._file.write(buf)
        except OSError as exc:
            self._fail(exc, f"cannot write to {self.segment_path}")
        self._seg_size += size
        self._seg_frames += 1
        self.bytes_written += size
        self.counts[tag] = self.counts.get(tag, 0) + 1
        if self._dirty_at is None:
            self._dirty_at = self._clock()
        if len(buf) > 16 << 20:
            self._buf = bytearray(4096)
        if self._clock() - self._last_flush >= self.flush_interval_s:
            self.flush()

    def write_event(
        self,
        *,
        endpoint: int,
        seq: int,
        recv_ns: int,
        topic: str,
        payload: bytes | bytearray | memoryview,
        via: int,
        epoch: int,
        pass_index: int = -1,
    ) -> None:
        """Append one ZMQ message of KV events; ``payload`` is stored byte-exact."""
        raw, is_bin = encode_payload(payload)
        self.write(EventFrame(endpoint, seq, recv_ns, topic, via, epoch, is_bin, raw, pass_index))

    def write_events(self, frames: Iterable[EventFrame]) -> None:
        """Append many ``EventFrame``s with one file write per burst (per segment touched).

        The bytes on disk are exactly those of ``write(frame)`` for each frame in order: same
        framing and CRC, same rotation points (a frame that would overflow the segment starts
        the next one; a frame larger than ``segment_bytes`` gets one of its own). Frames are
        joined into one buffer (handed to the file every ``_BATCH_CHUNK`` = 1 MiB at most); the
        flush interval is checked once, after the batch. A frame that is not an ``EventFrame``
        (``TypeError``) or cannot be encoded (``BundleError`` naming it) stops the batch: the
        frames before it are written, it and the rest are not (as with one ``write`` per
        frame).
        """
        self._check_writable()
        enc = self._enc.encode
        pack = FRAME_HEADER.pack
        crc32 = zlib.crc32
        limit = self.segment_bytes
        parts: list[bytes] = []
        put = parts.append
        k = pending = 0  # frames / bytes in ``parts``
        seg_size, seg_frames = self._seg_size, self._seg_frames
        try:
            for rec in frames:
                if type(rec) is not EventFrame:
                    raise TypeError(f"not an EventFrame: {type(rec).__name__}")
                try:
                    body = enc(rec)
                except _ENCODE_ERRORS as exc:
                    raise _encode_error(rec, exc) from exc
                size = len(body) + FRAME_HEADER_SIZE
                if (seg_frames or k) and seg_size + pending + size > limit:
                    if k:
                        batch, n = parts[:], k
                        parts.clear()
                        k = pending = 0
                        self._emit(batch, n)
                    self._rotate()
                    seg_size, seg_frames = self._seg_size, self._seg_frames
                put(pack(len(body), crc32(body)))
                put(body)
                pending += size
                k += 1
                if pending >= _BATCH_CHUNK:
                    batch, n = parts[:], k
                    parts.clear()
                    k = pending = 0
                    self._emit(batch, n)
                    seg_size, seg_frames = self._seg_size, self._seg_frames
        except BaseException:
            if k and self._failed is None:  # an encode/type error: keep what came before
                self._emit(parts, k)
            raise
        if k:
            self._emit(parts, k)
        if self._clock() - self._last_flush >= self.flush_interval_s:
            self.flush()

    def write_event_batch(
        self,
        items: Iterable[tuple[int, int, int, str, bytes | bytearray | memoryview, int, int]],
    ) -> None:
        """``write_event`` for many messages at once: ``items`` are tuples
        ``(endpoint, seq, recv_ns, topic, payload, via, epoch)`` (payloads stored byte-exact,
        ``pass_index`` -1); written with ``write_events`` (one file write per burst)."""
        self.write_events(_event_frames(items))

    def _check_writable(self) -> None:
        if self._closed:
            raise BundleError(f"{self.path}: writer is closed")
        if self._failed is not None:
            raise BundleError(f"{self.path}: writer failed earlier ({self._failed})")

    def _emit(self, parts: list[bytes], frames: int) -> None:
        """Write ``frames`` joined event frames to the current segment and count them."""
        data = b"".join(parts)
        try:
            self._file.write(data)
        except OSError as exc:
            self._fail(exc, f"cannot write to {self.segment_path}")
        size = len(data)
        self._seg_size += size
        self._seg_frames += frames
        self.bytes_written += size
        self.counts["event"] = self.counts.get("event", 0) + frames
        if self._dirty_at is None:
            self._dirty_at = self._clock()

    def flush(self) -> None:
        """Hand buffered frames to the OS (readers see them); the capture loop calls this
        when idle. Not an fsync: rotation and ``close`` fsync."""
        self._last_flush = self._clock()
        self._dirty_at = None
        if self._file is None or self._failed is not None:
            return
        try:
            self._file.flush()
        except OSError as exc:
            self._fail(exc, f"cannot flush {self.segment_path}")

    def flush_pending(self, max_age_s: float = 0.0) -> bool:
        """``flush()`` if a record written ``max_age_s`` or more ago is still in the file
        buffer (cheap when nothing is pending); True if it flushed. The capture loop calls
        it on every turn, so received data reaches the OS within the flush interval even
        when no further write comes to trigger the write-time check."""
        at = self._dirty_at
        if at is None or self._clock() - at < max_age_s:
            return False
        self.flush()
        return True

    def _sync_close(self) -> None:
        f = self._file
        self._file = None
        try:
            f.flush()
            os.fsync(f.fileno())
        finally:
            f.close()

    def _sync_dir(self) -> None:
        try:
            fd = os.open(self.path, os.O_RDONLY)
        except OSError:
            return
        try:
            os.fsync(fd)
        except OSError:
            pass  # some filesystems refuse fsync on a directory
        finally:
            os.close(fd)

    def _rotate(self) -> None:
        try:
            self._sync_close()
        except OSError as exc:
            self._fail(exc, f"cannot close segment {self.segment_path}")
        self._open_segment(self._seg_index + 1)
        self._sync_dir()

    def _fail(self, exc: OSError, what: str) -> None:
        self._failed = exc
        reason = "disk full" if exc.errno in (errno.ENOSPC, errno.EFBIG, errno.EDQUOT) else ""
        f, self._file = self._file, None
        if f is not None:
            try:
                f.close()
            except OSError:
                pass  # the buffer cannot be written either; the segment keeps a torn tail
        detail = f"{reason}: {exc}" if reason else str(exc)
        raise BundleError(
            f"{what}: {detail} (segments closed before stay intact; this one ends in a torn tail)"
        ) from exc

    def close(
        self,
        *,
        clean: bool = True,
        stats: dict[str, Any] | None = None,
        end_ns: int | None = None,
    ) -> None:
        """Write the ``Trailer`` (counts of this session's records by tag), flush, fsync."""
        if self._closed:
            return
        if self._failed is not None:
            self._closed = True
            self._release_lock()
            return
        trailer = Trailer(
            end_ns=time.time_ns() if end_ns is None else end_ns,
            clean=clean,
            counts=dict(self.counts),
            stats=stats or {},
        )
        try:
            self.write(trailer)
        except BundleError:
            if self._failed is not None:  # the disk failed: the writer is done
                self._closed = True
                self._release_lock()
            raise  # else (a record it cannot encode) the writer stays open, as before
        self._closed = True
        try:
            self._sync_close()
        except OSError as exc:
            self._fail(exc, f"cannot close segment {self.segment_path}")
        finally:
            self._release_lock()
        self._sync_dir()

    def _release_lock(self) -> None:
        if self._lock is not None:
            self._lock.release()
            self._lock = None

    @property
    def closed(self) -> bool:
        return self._closed

    def __enter__(self) -> BundleWriter:
        return self

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        if exc_type is None:
            self.close()
            return
        try:
            self.close(clean=False, stats={"error": f"{exc_type.__name__}: {exc}"})
        except BundleError:
            pass  # keep the original exception


def _segment_index(seg: Path) -> int:
    m = _SEGMENT_NAME.match(seg.name)
    assert m is not None
    return int(m.group(1))


# --------------------------------------------------------------------------------------
# Reader
# --------------------------------------------------------------------------------------


@dataclass
class ReadReport:
    """What a full pass over a bundle found (filled by ``BundleReader`` while it reads)."""

    segments: int = 0
    bytes: int = 0  # total size of the segment files
    frames: int = 0  # valid frames (records + unknown records)
    format_minor: int = 0  # highest minor version among the segments
    torn_bytes: int = 0  # bytes after the last good frame of each segment (normal on crash)
    torn: list[tuple[str, int]] = field(default_factory=list)  # (segment, offset) per torn tail
    corrupt: list[tuple[str, int, int]] = field(default_factory=list)  # (segment, offset, len)
    unknown_records: int = 0  # frames with a tag this version does not know (newer minor)
    unknown_tags: dict[str, int] = field(default_factory=dict)
    trailer_seen: bool = False
    clean_shutdown: bool = False  # the last record is a Trailer with clean=True
    # segments lost from the numbering: (name, why) -- see ``segment_survey``
    missing_segments: list[tuple[str, str]] = field(default_factory=list)
    # segments whose segment header was refused (bad magic, unknown major): (name, why)
    refused_segments: list[tuple[str, str]] = field(default_factory=list)
    # writer sessions whose Trailer counts more records than were read:
    # (segment of the trailer, records the trailer counts, records read)
    shortfall: list[tuple[str, int, int]] = field(default_factory=list)

    @property
    def corrupt_bytes(self) -> int:
        return sum(n for _, _, n in self.corrupt)

    @property
    def missing_records(self) -> int:
        """Records the trailers count that this pass did not read."""
        return sum(want - got for _, want, got in self.shortfall)

    @property
    def damaged(self) -> bool:
        """Anything was lost: a missing or refused segment, a shortfall against a trailer's
        counts, corrupt frames or a torn tail."""
        return bool(
            self.missing_segments
            or self.refused_segments
            or self.shortfall
            or self.corrupt
            or self.torn_bytes
        )

    def as_dict(self) -> dict[str, Any]:
        return {
            "segments": self.segments,
            "bytes": self.bytes,
            "frames": self.frames,
            "format_minor": self.format_minor,
            "torn_bytes": self.torn_bytes,
            "torn": [list(t) for t in self.torn],
            "corrupt": [list(c) for c in self.corrupt],
            "corrupt_bytes": self.corrupt_bytes,
            "unknown_records": self.unknown_records,
            "unknown_tags": dict(self.unknown_tags),
            "trailer_seen": self.trailer_seen,
            "clean_shutdown": self.clean_shutdown,
            "missing_segments": [list(m) for m in self.missing_segments],
            "refused_segments": [list(m) for m in self.refused_segments],
            "shortfall": [list(m) for m in self.shortfall],
            "missing_records": self.missing_records,
        }


@dataclass
class SegmentScan:
    """Validation of one segment (used by ``append``)."""

    header_ok: bool
    good_end: int  # offset just past the last good frame
    corrupt: list[tuple[str, int, int]]
    torn_bytes: int


_UNION = msgspec.msgpack.Decoder(BundleRecord)
_DECODERS: dict[bytes, msgspec.msgpack.Decoder[Any]] = {
    tag: msgspec.msgpack.Decoder(cls) for tag, cls in _TAG_CLASSES.items()
}
_ANY = msgspec.msgpack.Decoder()
# Decode-only views (``records(request_view=True)``): RequestRecord as RequestRecordView.
_UNION_VIEW = msgspec.msgpack.Decoder(
    Union[Header, EventFrame, RequestRecordView, Gap, Epoch, Annotation, Trailer]
)
_VIEW_DECODERS: dict[bytes, msgspec.msgpack.Decoder[Any]] = {
    **_DECODERS,
    b"request": msgspec.msgpack.Decoder(RequestRecordView),
}


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


_KEEP_ALL = None


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


def _segment_data(seg: Path) -> bytes | mmap.mmap:
    """A read-only memory map of a *complete* segment (not the bundle's last one).

    Reading a 256 MB segment copies it into fresh memory (a page fault per 4 KB); mapping
    it uses the page cache as is (measured: ~0.15 cpu-s less per 256 MB). Records decoded
    from it keep the map alive (``Raw`` fields are views into it). Only segments before the
    last are mapped: nothing ever changes a segment once the writer has moved past it,
    while ``BundleWriter.append`` truncates a torn *last* segment in place, which would make
    a live map of it fault (SIGBUS) instead of raising. Empty files, and files that cannot be
    mapped, are read normally.
    """
    with open(seg, "rb") as f:
        if os.fstat(f.fileno()).st_size == 0:
            return b""
        try:
            return mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        except (OSError, ValueError):  # a file system that cannot map: read it
            return f.read()


class BundleReader:
    """Read a bundle directory written by ``BundleWriter`` (any minor version of this major).

    Iteration is lazy and restartable; each full pass refreshes ``report``. ``strict=True``
    raises ``CorruptFrameError`` at the first corrupt frame instead of skipping it (a torn
    tail is never an error).
    """

    def __init__(self, path: str | os.PathLike[str], *, strict: bool = False) -> None:
        self.path = Path(path)
        self.strict = strict
        if not self.path.exists():
            raise UsageError(f"{self.path}: no such bundle")
        if not self.path.is_dir():
            raise UsageError(f"{self.path}: not a bundle (expected a directory of seg-*.kvcb)")
        # the numbering check: holes, directories / dangling links, empty middle segments
        segments, self.missing_segments = survey_segments(self.path)
        if not segments:
            raise UsageError(f"{self.path}: not a bundle (no seg-*.kvcb segment files)")
        if self.missing_segments and strict:
            name, why = self.missing_segments[0]
            raise BundleError(f"{self.path}: segment {name} is {why}")
        self._minors: dict[Path, int] = {}
        #: segments whose segment header is refused (bad magic, unknown major): not read
        self.refused_segments: list[tuple[str, str]] = []
        self.segments: list[Path] = []
        for i, seg in enumerate(segments):
            try:
                with open(seg, "rb") as f:
                    head = f.read(SEGMENT_HEADER_SIZE)
            except OSError as exc:
                raise BundleError(f"cannot read {seg}: {exc}") from exc
            if len(head) < SEGMENT_HEADER_SIZE:
                self.segments.append(seg)
                continue  # torn at birth: counted as torn bytes when read
            magic, major, minor = SEGMENT_HEADER.unpack(head)
            refused = None
            if magic != MAGIC:
                if i == 0:
                    raise UsageError(f"{self.path}: not a kvcadence bundle ({seg.name}: bad magic)")
                refused = f"not a kvcadence segment (bad magic {magic!r})"
            elif major != FORMAT_MAJOR:
                msg = (
                    f"bundle format {major}.{minor} is not readable by kvcadence "
                    f"{__version__} (reads format {FORMAT_MAJOR}.x)"
                )
                if i == 0:
                    raise FormatVersionError(f"{seg}: {msg}; upgrade kvcadence")
                refused = msg
            if refused is not None:
                # one damaged segment costs that segment, not the bundle (strict: an error)
                if strict:
                    raise BundleError(f"{seg}: {refused}")
                self.refused_segments.append((seg.name, refused))
                continue
            self.segments.append(seg)
            self._minors[seg] = minor
        self._header: Header | None = None
        self._header_body: bytes | None = None
        self._report: ReadReport | None = None

    # -- the frame walk ----------------------------------------------------------------

    def _valid_at(
        self,
        data: bytes | mmap.mmap,
        mv: memoryview,
        pos: int,
        full: bool,
        spans: SpanCrc | None = None,
    ) -> int:
        """Body length of a frame at ``pos`` whose length and CRC check out (and, when
        ``full``, whose body decodes), else -1. ``spans``: CRCs of long bodies in O(log n)
        (resynchronisation, where candidate bodies overlap)."""
        n = len(data)
        if pos + FRAME_HEADER_SIZE > n:
            return -1
        length: int
        crc: int
        length, crc = FRAME_HEADER.unpack_from(data, pos)
        start = pos + FRAME_HEADER_SIZE
        if length < MIN_BODY or start + length > n:
            return -1
        body = mv[start : start + length]
        if full:
            # Resynchronising: before the CRC (whose cost is the *claimed* length, so checking
            # every candidate first made a crafted or garbage span quadratic), the body must
            # be tag-shaped and exactly one msgpack value -- a skip-parse in C whose cost is
            # the value's real extent, which for garbage ends within a few bytes.
            tag = _peek_tag(body)
            if tag is None or not _one_value(body):
                return -1
        if (zlib.crc32(body) if spans is None else spans.crc(start, start + length)) != crc:
            return -1
        if full and tag is not None:
            dec = _DECODERS.get(tag)
            try:
                if dec is not None:
                    _decode_fresh_stack(dec, body)
                else:
                    value = _ANY.decode(body)
                    if not (isinstance(value, list) and value and isinstance(value[0], str)):
                        return -1
            except (msgspec.DecodeError, RecursionError):
                return -1
        return length

    def _resync(self, data: bytes | mmap.mmap, mv: memoryview, pos: int) -> int:
        """Next offset > ``pos`` where a fully valid frame starts, or -1."""
        search = pos + 1 + FRAME_HEADER_SIZE
        spans = SpanCrc(mv, pos)  # linear in the span however the candidates overlap
        while True:
            m = _RESYNC.search(data, search)
            if m is None:
                return -1
            cand = m.start() - FRAME_HEADER_SIZE
            if self._valid_at(data, mv, cand, True, spans) >= 0:
                return cand
            search = m.start() + 1

    def _walk(
        self, seg: Path, report: ReadReport, mapped: bool = False
    ) -> Iterator[tuple[int, memoryview]]:
        """Yield ``(offset, body)`` of each frame of ``seg`` whose length and CRC check out;
        resynchronise past corrupt spans; count a torn tail. Fills ``report``.
        ``mapped``: memory-map the segment instead of reading it (see ``_segment_data``)."""
        try:
            data = _segment_data(seg) if mapped else seg.read_bytes()
        except OSError as exc:
            raise BundleError(f"cannot read {seg}: {exc}") from exc
        n = len(data)
        report.segments += 1
        report.bytes += n
        if n < SEGMENT_HEADER_SIZE:
            if n:
                report.torn_bytes += n
                report.torn.append((seg.name, 0))
            return
        report.format_minor = max(report.format_minor, self._minors.get(seg, 0))
        mv = memoryview(data)
        pos = SEGMENT_HEADER_SIZE
        unpack = FRAME_HEADER.unpack_from
        crc32 = zlib.crc32
        while pos < n:
            start = pos + FRAME_HEADER_SIZE
            if start <= n:
                length, crc = unpack(data, pos)
                end = start + length
                if length >= MIN_BODY and end <= n:
                    body = mv[start:end]
                    if crc32(body) == crc:
                        report.frames += 1
                        yield pos, body
                        pos = end
                        continue
            nxt = self._resync(data, mv, pos)
            if nxt < 0:
                report.torn_bytes += n - pos
                report.torn.append((seg.name, pos))
                return
            self._corrupt(report, seg, pos, nxt - pos, "corrupt frame")
            pos = nxt

    def _corrupt(self, report: ReadReport, seg: Path, pos: int, size: int, what: str) -> None:
        if self.strict:
            raise CorruptFrameError(
                f"{seg.name}: {what} at offset {pos} ({size} bytes skipped to the next valid frame)"
            )
        report.corrupt.append((seg.name, pos, size))

    def _odd(self, report: ReadReport, seg: Path, pos: int, body: memoryview) -> None:
        """A CRC-valid frame the fast path could not decode: an unknown record type (newer
        minor; counted) or a body that is not a valid record (reported as corrupt)."""
        tag = _peek_tag(body)
        if tag is not None and tag not in _DECODERS:
            name = tag.decode("utf-8", "replace")
            report.unknown_records += 1
            report.unknown_tags[name] = report.unknown_tags.get(name, 0) + 1
            return
        report.frames -= 1
        self._corrupt(report, seg, pos, FRAME_HEADER_SIZE + len(body), "undecodable record")

    def _iter(self, wanted: frozenset[bytes] | None, views: bool = False) -> Iterator[ReadRecord]:
        """Decode the frames of every segment; yield the records whose tag is ``wanted``
        (all when None). Trailers are always looked at (for ``clean_shutdown``). ``views``:
        request frames decode as ``RequestRecordView`` (every other record as usual)."""
        report = ReadReport(
            missing_segments=list(self.missing_segments),
            refused_segments=list(self.refused_segments),
        )
        clean = False  # the last frame read is a Trailer(clean=True)
        sess0 = 0  # report.frames when the current writer session began
        try:
            expect_id: str | None = self.bundle_id
        except BundleError:
            expect_id = None  # no header: nothing to compare segments with
        decoders = _VIEW_DECODERS if views else _DECODERS
        # Fast path: try the one decoder most frames need; peek at the tag only on failure.
        if wanted is None:
            fast = (_UNION_VIEW if views else _UNION).decode
        elif len(wanted) == 1:
            fast = decoders[next(iter(wanted))].decode
        else:
            fast = None
        last = len(self.segments) - 1
        for i, seg in enumerate(self.segments):
            seg_first = True
            for pos, body in self._walk(seg, report, mapped=i < last):
                if seg_first:
                    seg_first = False
                    if pos == SEGMENT_HEADER_SIZE:
                        what, why = self._first_record_check(seg, body, expect_id)
                        if what == "start":
                            continue  # the segment is this bundle's: never yielded
                        if what == "foreign":
                            if self.strict:
                                raise BundleError(f"{seg}: {why}")
                            report.refused_segments.append((seg.name, why))
                            report.frames -= 1
                            break  # nothing of it is read
                        if what == "append":
                            sess0 = report.frames - 1  # a new writer session starts here
                if fast is not None:
                    try:
                        rec = fast(body)
                    except (msgspec.DecodeError, RecursionError):
                        pass
                    else:
                        if type(rec) is Trailer:
                            report.trailer_seen = True
                            clean = rec.clean
                            sess0 = self._session_end(report, seg, rec, sess0)
                        else:
                            clean = False
                        yield rec
                        continue
                clean = False
                tag = _peek_tag(body)
                if tag is None or tag not in _DECODERS:
                    self._odd(report, seg, pos, body)
                    continue
                if tag != b"trailer" and wanted is not None and tag not in wanted:
                    continue  # a known record nobody asked for: not decoded
                try:
                    rec = _decode_fresh_stack(decoders[tag], body)
                except (msgspec.DecodeError, RecursionError):
                    self._odd(report, seg, pos, body)
                    continue
                if type(rec) is Trailer:
                    report.trailer_seen = True
                    clean = rec.clean
                    sess0 = self._session_end(report, seg, rec, sess0)
                if wanted is None or tag in wanted:
                    yield rec
        report.clean_shutdown = clean
        if self.strict and report.shortfall:
            name, want, got = report.shortfall[0]
            raise BundleError(
                f"{self.path}: the trailer in {name} counts {want} records, {got} were read"
            )
        self._report = report

    @staticmethod
    def _session_end(report: ReadReport, seg: Path, trailer: Trailer, sess0: int) -> int:
        """A Trailer ends a writer session: compare its counts with the records read since
        the session began (a shortfall is a lost segment or frames); returns the next
        session's start."""
        counts = trailer.counts
        want = sum(v for v in counts.values() if isinstance(v, int)) if counts else 0
        got = report.frames - sess0 - 1
        if got < want:
            report.shortfall.append((seg.name, want, got))
        return report.frames

    def records(self, *, request_view: bool = False) -> Iterator[ReadRecord]:
        """Every record in order (unknown record types are skipped and counted).

        ``request_view=True``: requests come as ``RequestRecordView`` (token ids left as
        msgpack bytes, ``msgspec.Raw``), which decodes several times faster. The ids are not
        checked element by element, so a request frame whose ids are not ints (which the
        ordinary pass reports as an undecodable record) is yielded; a caller that needs the
        ordinary pass's exact verdict checks the ids and reads again without views if not.
        """
        return self._iter(_KEEP_ALL, request_view)

    def events(self) -> Iterator[EventFrame]:
        """Only the ``EventFrame``s (payload left as ``Raw``: envelope-only decoding)."""
        return self._iter(frozenset((b"event",)))  # type: ignore[return-value]

    def requests(self) -> list[RequestRecord]:
        """Every ``RequestRecord`` in order."""
        return list(self._iter(frozenset((b"request",))))  # type: ignore[arg-type]

    def iter_kinds(self, *tags: str) -> Iterator[BundleRecord]:
        """Only the records whose tag is in ``tags`` (e.g. ``"gap", "epoch"``)."""
        return self._iter(frozenset(t.encode() for t in tags))  # type: ignore[return-value]

    @property
    def report(self) -> ReadReport:
        """The report of the last complete pass (runs an envelope-only pass if none ran)."""
        if self._report is None:
            for _ in self._iter(frozenset()):
                pass
        assert self._report is not None
        return self._report

    @staticmethod
    def _first_frame(seg: Path) -> memoryview | None:
        """The body of the frame right after the segment header when its length and CRC
        check out -- what ``_walk`` yields first -- read without reading the whole segment
        (segment 0 is up to ``segment_bytes`` long); None otherwise (the caller walks)."""
        head_size = SEGMENT_HEADER_SIZE + FRAME_HEADER_SIZE
        try:
            with open(seg, "rb") as f:
                size = os.fstat(f.fileno()).st_size
                head = f.read(head_size)
                if len(head) < head_size:
                    return None
                length, crc = FRAME_HEADER.unpack_from(head, SEGMENT_HEADER_SIZE)
                if length < MIN_BODY or head_size + length > size:
                    return None
                body = f.read(length)
        except OSError:
            return None
        if len(body) != length or zlib.crc32(body) != crc:
            return None
        return memoryview(body)

    @property
    def header(self) -> Header:
        """The ``Header`` record (first frame of segment 0)."""
        if self._header is None:
            first = self._first_frame(self.segments[0])
            if first is not None:
                bodies: Iterable[memoryview] = (first,)
            else:  # torn or corrupt at the start: the walk resynchronises (or raises)
                bodies = (body for _, body in self._walk(self.segments[0], ReadReport()))
            for body in bodies:
                if _peek_tag(body) == b"header":
                    try:
                        self._header = _DECODERS[b"header"].decode(body)
                        self._header_body = bytes(body)
                    except msgspec.DecodeError:
                        pass
                break
            if self._header is None:
                raise BundleError(
                    f"{self.path}: no readable header record in {self.segments[0].name}"
                )
        return self._header

    @property
    def bundle_id(self) -> str:
        """``bundle_identity`` of this bundle's Header record (``BundleError`` without one)."""
        _ = self.header
        assert self._header_body is not None
        return bundle_identity(self._header_body)

    def _first_record_check(
        self, seg: Path, body: memoryview, expect_id: str | None
    ) -> tuple[str, str]:
        """What the first frame of a segment says: ``("start", "")`` a SegmentStart of this
        bundle (not yielded), ``("foreign", why)`` the segment is not this bundle's,
        ``("append", "")`` an append note (a new writer session), else ``("", "")``."""
        tag = _peek_tag(body)
        index = _segment_index(seg)
        if tag == b"segment":
            try:
                ss = _SEGMENT_START.decode(body)
            except (msgspec.DecodeError, RecursionError):
                return "", ""  # an odd record: the ordinary path reports it
            if expect_id is not None and ss.bundle_id != expect_id:
                return "foreign", (
                    f"a segment of another bundle (bundle {ss.bundle_id}, this one is {expect_id})"
                )
            if ss.index != index:
                return "foreign", f"segment {ss.index} of this bundle under another name"
            return "start", ""
        if tag == b"header" and index > 0:
            return "foreign", "starts with a Header record: the first segment of another bundle"
        if tag == b"note" and _is_append_note(body):
            return "append", ""
        return "", ""

    def scan_segment(self, seg: Path) -> SegmentScan:
        """Validate one segment: where its last good frame ends, what is corrupt or torn."""
        report = ReadReport()
        good_end = SEGMENT_HEADER_SIZE
        saved, self.strict = self.strict, False
        try:
            for pos, body in self._walk(seg, report):
                good_end = pos + FRAME_HEADER_SIZE + len(body)
        finally:
            self.strict = saved
        header_ok = report.bytes >= SEGMENT_HEADER_SIZE
        corrupt = [c for c in report.corrupt if c[1] < good_end]
        return SegmentScan(header_ok, good_end if header_ok else 0, corrupt, report.torn_bytes)


__all__ = [
    "MAGIC",
    "RECORD_TAGS",
    "AppendReport",
    "BundleReader",
    "BundleWriter",
    "ReadReport",
    "bundle_identity",
    "SegmentScan",
    "check_encodable",
    "copy_bundle",
    "encode_payload",
    "event_payload",
    "event_payload_view",
    "is_bundle",
    "is_single_msgpack",
    "list_segments",
    "segment_name",
    "staged_bundle",
]
