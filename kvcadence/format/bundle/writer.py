"""``BundleWriter``: frames into rolling segments, flushed and fsynced; ``append`` reopens a
bundle (validating and truncating its last segment first).

Crash safety: the writer flushes its file buffer at least every ``flush_interval_s`` and
fsyncs on rotation and close, so a crash loses at most that window and leaves a *torn tail*
(a partial frame, or zeros) which the reader treats as normal. A record msgpack cannot
encode is a ``BundleError`` naming the record, and nothing of it is written. Request records
are stored compact (format 2.0, ``compact.PrefixIndex``: one index per segment).

Why ~600 lines: one class, ``BundleWriter``, whose open/append/rollover/flush/close/discard paths
share the segment state and the failure rules (the compact request path among them: its
references must not cross a rotation).
"""

from __future__ import annotations

import contextlib
import errno
import os
import threading
import time
import zlib
from array import array
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgspec

from kvcadence import __version__
from kvcadence.errors import (
    BundleError,
    UsageError,
)
from kvcadence.format.bundle import compact
from kvcadence.format.bundle.compact import PrefixIndex
from kvcadence.format.bundle.frames import (
    _ENCODE_ERRORS,
    FRAME_HEADER,
    FRAME_HEADER_SIZE,
    RECORD_TAGS,
    _encode_error,
    _event_frames,
    encode_payload,
)
from kvcadence.format.bundle.lock import BundleLock
from kvcadence.format.bundle.reader import BundleReader
from kvcadence.format.bundle.segments import (
    MAGIC,
    SEGMENT_HEADER,
    SEGMENT_HEADER_SIZE,
    _segment_index,
    bundle_identity,
    segment_name,
)
from kvcadence.format.schema import (
    FORMAT_MAJOR,
    FORMAT_MINOR,
    LEGACY_VERSION,
    Annotation,
    BundleRecord,
    EventFrame,
    Header,
    RequestRecord,
    SegmentStart,
    Trailer,
)
from kvcadence.outguard import refuse_nonempty_dir

# ``write_events`` hands its joined frames to the file at least every this many bytes.
_BATCH_CHUNK = 1 << 20


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
        compact_requests: bool = True,
    ) -> None:
        self.path = refuse_nonempty_dir(path, hint=_NEW_BUNDLE_HINT)
        self._setup(segment_bytes, flush_interval_s, clock)
        self._compact = compact_requests
        try:
            self.path.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            if exc.errno in (errno.EACCES, errno.EPERM, errno.EROFS, errno.ENOTDIR, errno.EEXIST):
                # the path the user named cannot be a directory here (a file system that
                # refuses even root, e.g. /sys): an input error, exit 2, like the up-front check
                raise UsageError(
                    f"{self.path}: cannot create the bundle directory ({exc.strerror})"
                ) from exc
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
        self._write_lock = threading.RLock()
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
        self._first_new: int | None = None  # an appending writer's first segment (discard)
        self._lock = None
        self.bundle_id = None  # set once the header is known (SegmentStart)
        self._version = (FORMAT_MAJOR, FORMAT_MINOR)  # of the segments this writer opens
        # requests as PackedRequest (format 2.x; ``compact_requests=False``: as
        # RequestRecord, which 2.x reads too -- the benchmark's baseline)
        self._compact = True
        self._index: PrefixIndex | None = None  # the current segment's blocks (compact)

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
        if header.format_major < FORMAT_MAJOR:
            # a 1.x bundle stays 1.x (its readers read all of it): full RequestRecords
            self._version = LEGACY_VERSION
            self._compact = False
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
        self._first_new = next_index
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
                f.write(SEGMENT_HEADER.pack(MAGIC, *self._version) + start)
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
        # references never leave a segment: each one starts a fresh block index
        self._index = PrefixIndex() if self._compact else None
        self.bytes_written += SEGMENT_HEADER_SIZE + len(start)
        if start:
            self.counts["segment"] = self.counts.get("segment", 0) + 1

    @property
    def segment_path(self) -> Path:
        """The segment currently being written."""
        return self.path / segment_name(self._seg_index)

    # -- writing -----------------------------------------------------------------------

    def write(self, record: BundleRecord) -> None:
        """Append one record (any ``BundleRecord``). A ``RequestRecord`` is stored as a
        ``PackedRequest`` (format 2.0: prefix shared with earlier requests of the segment,
        packed ids) unless its ids do not fit a uint32 or the bundle is a 1.x bundle. Its ids
        may be lists or ``array``s (a replay's: packed as they are, no int object made)."""
        with self._write_lock:  # a packed request's block numbers follow the order on disk
            self._write(record)

    def _write(self, record: BundleRecord) -> None:
        self._check_writable()
        tag = RECORD_TAGS.get(type(record))
        if tag is None:
            raise TypeError(f"not a bundle record: {type(record).__name__}")
        if self._index is not None and type(record) is RequestRecord:
            if self._index.blocks >= compact.MAX_BLOCKS and self._seg_frames:
                self._rotate()  # bounds the index (writer and reader) whatever the run length
            packed = self._index.pack(record)
            if packed is not None:
                stored, commit = packed
                size = self._encode(stored, record)
                if self._seg_frames and self._seg_size + size > self.segment_bytes:
                    self._rotate()  # a fresh index: pack again against it
                    repacked = self._index.pack(record)
                    assert repacked is not None  # the ids fitted a moment ago
                    stored, commit = repacked
                    size = self._encode(stored, record)
                self._put(size, tag)
                commit()  # its blocks exist once its frame is written
                return
        if type(record) is RequestRecord:
            record = _listed(record)  # stored whole: array ids (a replay's) as lists
        size = self._encode(record, record)
        if self._seg_frames and self._seg_size + size > self.segment_bytes:
            self._rotate()
        self._put(size, tag)

    def _encode(self, stored: Any, record: Any) -> int:
        """Frame ``stored`` in ``self._buf`` (length, CRC, body); the frame's size. An encode
        error names ``record`` (what the caller wrote)."""
        buf = self._buf
        try:
            self._enc.encode_into(stored, buf, FRAME_HEADER_SIZE)
        except _ENCODE_ERRORS as exc:
            raise _encode_error(record, exc) from exc
        n = len(buf) - FRAME_HEADER_SIZE
        with memoryview(buf) as mv:
            crc = zlib.crc32(mv[FRAME_HEADER_SIZE:])
        FRAME_HEADER.pack_into(buf, 0, n, crc)
        return n + FRAME_HEADER_SIZE

    def _put(self, size: int, tag: str) -> None:
        """Write the frame ``_encode`` left in ``self._buf`` and count it under ``tag``."""
        buf = self._buf
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

    def discard(self) -> None:
        """Undo an append (a writer made by ``append``): close without a ``Trailer`` and
        remove every segment this writer opened, so the bundle holds what it held before
        (less the torn tail ``append`` cut off, which held no readable record). For an
        all-or-nothing append (``capture import``: a bad record found while writing)."""
        if self._closed:
            return
        if self._first_new is None:
            raise TypeError("discard() undoes an append: this writer made a new bundle")
        f, self._file = self._file, None
        try:
            if f is not None:
                with contextlib.suppress(OSError):
                    f.close()
            for i in range(self._seg_index, self._first_new - 1, -1):  # newest first
                seg = self.path / segment_name(i)
                try:
                    seg.unlink(missing_ok=True)
                except OSError as exc:
                    raise BundleError(f"cannot remove {seg} to undo the append: {exc}") from exc
            self._sync_dir()
        finally:
            self._closed = True
            self._release_lock()

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


def _listed(rec: RequestRecord) -> RequestRecord:
    """``rec`` with ids given as ``array``s (what a replay writes: ``PrefixIndex.pack``
    packs them as they are) made lists, as msgpack encodes them; ``rec`` itself otherwise."""
    inp: Any = rec.input_ids
    out: Any = rec.output_ids
    if type(inp) is not array and type(out) is not array:
        return rec
    return msgspec.structs.replace(
        rec,
        input_ids=inp.tolist() if type(inp) is array else inp,
        output_ids=out.tolist() if type(out) is array else out,
    )


__all__ = ["AppendReport", "BundleWriter"]
