"""``BundleReader``: read a bundle directory, any version of the majors it reads (1 and 2).

Format 2.0's packed requests come out as ``RequestRecord`` / ``RequestRecordView`` with
their full token ids (``compact.SegmentUnpacker``, one per segment).

A frame whose length or CRC does not check out in the middle of a segment is reported and
skipped: the reader scans forward for the next offset where length, CRC and decoding all
validate (linear in the span, ``crcspan.SpanCrc``), and never yields a record that was not
written. A torn tail (a crash's partial frame) is normal. Lost, refused and foreign segments
and a trailer's shortfall are reported in ``ReadReport``. Each segment is walked through a
``window.SegmentWindow`` (a bounded window of it, never the whole segment unless damage
must be resynchronised past).

Why one file over 500 lines: the walk (window, resynchronisation, segment checks), the
decode dispatch (fast decoder, tag peek, packed requests) and the report's accounting act
on the same frame at the same offset in one loop; the pieces that stand alone already live
beside it (``frames``, ``window``, ``compact``, ``crcspan``, ``segments``, ``report``).
"""

from __future__ import annotations

import mmap
import os
import zlib
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import msgspec

from kvcadence import __version__
from kvcadence.errors import (
    BundleError,
    CorruptFrameError,
    FormatVersionError,
    UsageError,
)
from kvcadence.format.bundle.compact import SegmentUnpacker
from kvcadence.format.bundle.crcspan import SpanCrc
from kvcadence.format.bundle.frames import (
    _ANY,
    _DECODERS,
    _RESYNC,
    _SEGMENT_START,
    _VIEW_DECODERS,
    FRAME_HEADER,
    FRAME_HEADER_SIZE,
    MIN_BODY,
    NOTE_RAW,
    REQUEST_TAGS,
    SKIPPED,
    _decode_fresh_stack,
    _is_append_note,
    _one_value,
    _peek_tag,
    events_and_notes_decoder,
    fast_decoder,
    unread_events,
    unread_frames,
)
from kvcadence.format.bundle.report import ReadReport, SegmentScan
from kvcadence.format.bundle.segments import (
    MAGIC,
    SEGMENT_HEADER,
    SEGMENT_HEADER_SIZE,
    _segment_index,
    bundle_identity,
    survey_segments,
)
from kvcadence.format.bundle.window import SegmentWindow
from kvcadence.format.schema import (
    READABLE_MAJORS,
    BundleRecord,
    EventFrame,
    Header,
    PackedRequest,
    ReadRecord,
    RequestRecord,
    Trailer,
)

_KEEP_ALL = None


class BundleReader:
    """Read a bundle directory written by ``BundleWriter`` (any version of majors 1 and 2).

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
            elif major not in READABLE_MAJORS:
                reads = " and ".join(f"{m}.x" for m in READABLE_MAJORS)
                msg = (
                    f"bundle format {major}.{minor} is not readable by kvcadence "
                    f"{__version__} (reads format {reads})"
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
        self, seg: Path, report: ReadReport, mapped: bool = False, unread: Any = None
    ) -> Iterator[tuple[int, memoryview]]:
        """Yield ``(offset, body)`` of each frame of ``seg`` whose length and CRC check out;
        resynchronise past corrupt spans; count a torn tail. Fills ``report``.
        The segment is seen through a ``SegmentWindow`` (a bounded window: never the whole
        segment but to resynchronise past damage); ``mapped``: memory-map it (a complete
        segment, see ``_segment_map``) instead of reading it in chunks. ``unread``: a
        predicate on a frame's body (``frames.unread_frames``): a frame it is true for, but
        a segment's first, is stepped over by its length, its CRC not checked and not
        yielded (counted in ``frames`` and ``unread``; damage inside it goes unnoticed, a
        damaged length is noticed at the frame after it, which fails its own check)."""
        try:
            win = SegmentWindow(seg, mapped)
        except OSError as exc:
            raise BundleError(f"cannot read {seg}: {exc}") from exc
        with win:
            yield from self._walk_window(seg, report, win, unread)

    def _walk_window(
        self, seg: Path, report: ReadReport, win: SegmentWindow, unread: Any = None
    ) -> Iterator[tuple[int, memoryview]]:
        size = win.size
        report.segments += 1
        report.bytes += size
        if size < SEGMENT_HEADER_SIZE:
            if size:
                report.torn_bytes += size
                report.torn.append((seg.name, 0))
            return
        report.format_minor = max(report.format_minor, self._minors.get(seg, 0))
        data, n, base = win.data, win.n, win.base  # data[:n] is the file from offset base
        mv = memoryview(data)
        pos = SEGMENT_HEADER_SIZE
        unpack = FRAME_HEADER.unpack_from
        crc32 = zlib.crc32
        while True:
            while pos < n:
                start = pos + FRAME_HEADER_SIZE
                if start <= n:
                    length, crc = unpack(data, pos)
                    end = start + length
                    if length >= MIN_BODY and end <= n:
                        body = mv[start:end]
                        if unread is not None and base + pos > SEGMENT_HEADER_SIZE and unread(body):
                            report.frames += 1
                            report.unread += 1
                            pos = end
                            continue
                        if crc32(body) == crc:
                            report.frames += 1
                            yield base + pos, body
                            pos = end
                            continue
                        need = 0  # damaged inside the window
                    else:  # past the window (more to read), or damaged
                        need = FRAME_HEADER_SIZE + length if length >= MIN_BODY else 0
                else:
                    need = FRAME_HEADER_SIZE
                if need and not win.at_end and base + pos + need <= win.size:
                    pos = win.advance(pos, need)  # the frame goes on past the window
                else:
                    # damage (or a torn tail): resynchronise over the rest of the segment
                    pos = win.rest(pos)
                    nxt = self._resync(win.data, memoryview(win.data)[: win.n], pos)
                    if nxt < 0:
                        report.torn_bytes += win.size - (win.base + pos)
                        report.torn.append((seg.name, win.base + pos))
                        return
                    self._corrupt(report, seg, win.base + pos, nxt - pos, "corrupt frame")
                    pos = nxt
                data, n, base = win.data, win.n, win.base
                mv = memoryview(data)
            if win.at_end:
                return
            pos = win.advance(pos, FRAME_HEADER_SIZE)
            data, n, base = win.data, win.n, win.base
            mv = memoryview(data)

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

    def _iter(
        self,
        wanted: frozenset[bytes] | None,
        views: bool | str = False,
        notes_raw: bool = False,
        note_kinds: frozenset[str] | None = None,
        events_as: Any = None,
    ) -> Iterator[ReadRecord]:
        """Decode the frames of every segment; yield the records whose tag is ``wanted``
        (all when None). Trailers are always looked at (for ``clean_shutdown``). ``views``:
        request frames decode as ``RequestRecordView`` (every other record as usual; ``"u32"``:
        packed requests as ``RequestRecordU32View``; ``"arrays"``: every record as usual but
        packed requests' ids left arrays, ``request_arrays``); ``notes_raw``:
        notes as ``AnnotationRawView`` (``events_and_notes``), those of other kinds than
        ``note_kinds`` (when given) skipped, event frames as ``events_as`` where it
        decodes them."""
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
        if wanted is not None and b"request" in wanted:
            wanted = wanted | REQUEST_TAGS  # format 2.0 stores requests as PackedRequest
        decoders, fast, first, unread = self._decoding(
            wanted, views, notes_raw, note_kinds, events_as
        )
        last = len(self.segments) - 1
        rec: Any
        for i, seg in enumerate(self.segments):
            seg_first = True
            # packed requests (2.0) refer only to blocks of their own segment
            unpack = SegmentUnpacker(seg, report, views, self._corrupt)
            for pos, body in self._walk(seg, report, mapped=i < last, unread=unread):
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
                        rec = (first if pos == SEGMENT_HEADER_SIZE else fast)(body)
                    except (msgspec.DecodeError, RecursionError):
                        pass
                    else:
                        t = type(rec)
                        if t is Trailer:
                            report.trailer_seen = True
                            clean = rec.clean
                            sess0 = self._session_end(report, seg, rec, sess0)
                        else:
                            clean = False
                            if rec is SKIPPED:
                                continue
                            if t is PackedRequest:
                                rec = unpack(rec, pos, body)
                                if rec is None:
                                    continue
                        yield rec
                        continue
                clean = False
                rec = self._decode_slow(report, seg, pos, body, wanted, decoders)
                if rec is None:
                    continue
                if type(rec) is Trailer:
                    report.trailer_seen = True
                    clean = rec.clean
                    sess0 = self._session_end(report, seg, rec, sess0)
                    if wanted is not None and b"trailer" not in wanted:
                        continue
                elif type(rec) is PackedRequest:
                    rec = unpack(rec, pos, body)
                    if rec is None:
                        continue
                yield rec
        report.clean_shutdown = clean
        if self.strict and report.shortfall:
            name, want, got = report.shortfall[0]
            raise BundleError(
                f"{self.path}: the trailer in {name} counts {want} records, {got} were read"
            )
        self._report = report

    def _decoding(
        self,
        wanted: frozenset[bytes] | None,
        views: bool | str,
        notes_raw: bool,
        note_kinds: frozenset[str] | None,
        events_as: Any,
    ) -> tuple[dict[bytes, msgspec.msgpack.Decoder[Any]], Any, Any, Any]:
        """``_iter``'s ``(decoders by tag, fast path, fast path of a segment's first frame,
        the walk's ``unread`` predicate)``."""
        if views == "arrays":  # only packed requests differ (``SegmentUnpacker``)
            views = False
        decoders = _VIEW_DECODERS if views else _DECODERS
        fast = fast_decoder(wanted, views)
        if not notes_raw:
            # requests only: the event frames are stepped over by their first bytes, unread
            # (a strict reader checks them all)
            skip = wanted == REQUEST_TAGS and not self.strict
            return decoders, fast, fast, (unread_events if skip else None)
        # events_and_notes
        decoders = {**decoders, b"note": NOTE_RAW}
        fast = events_and_notes_decoder(note_kinds, events_as)
        if note_kinds is None or self.strict:
            return decoders, fast, fast, None
        # the frames ``fast`` would skip are stepped over unchecked by the walk (but for a
        # segment's first frame: ``fast`` itself skips it)
        plain = events_and_notes_decoder(None, events_as)
        return decoders, plain, fast, unread_frames(note_kinds)

    def _decode_slow(
        self,
        report: ReadReport,
        seg: Path,
        pos: int,
        body: memoryview,
        wanted: frozenset[bytes] | None,
        decoders: dict[bytes, msgspec.msgpack.Decoder[Any]],
    ) -> Any:
        """The record of a frame the fast path did not take: decoded by its tag when it is
        wanted or a Trailer (always looked at), else None (skipped; an unknown or
        undecodable record is reported by ``_odd``)."""
        tag = _peek_tag(body)
        if tag is None or tag not in _DECODERS:
            self._odd(report, seg, pos, body)
            return None
        if tag != b"trailer" and wanted is not None and tag not in wanted:
            return None  # a known record nobody asked for: not decoded
        try:
            return _decode_fresh_stack(decoders[tag], body)
        except (msgspec.DecodeError, RecursionError):
            self._odd(report, seg, pos, body)
            return None

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

    def records(self, *, request_view: bool | str = False) -> Iterator[ReadRecord]:
        """Every record in order (unknown record types are skipped and counted).

        ``request_view=True``: requests come as ``RequestRecordView`` (token ids left as
        msgpack bytes, ``msgspec.Raw``), which decodes several times faster. The ids are not
        checked element by element, so a request frame whose ids are not ints (which the
        ordinary pass reports as an undecodable record) is yielded; a caller that needs the
        ordinary pass's exact verdict checks the ids and reads again without views if not.
        ``request_view="u32"``: the same, except that format 2.0's packed requests come as
        ``RequestRecordU32View`` (ids as the ``array('I')`` the reader rebuilds anyway, not
        re-encoded as msgpack: valid uint32 ids by construction).
        """
        return self._iter(_KEEP_ALL, request_view)

    def events(self) -> Iterator[EventFrame]:
        """Only the ``EventFrame``s (payload left as ``Raw``: envelope-only decoding)."""
        return self._iter(frozenset((b"event",)))  # type: ignore[return-value]

    def requests(self) -> list[RequestRecord]:
        """Every ``RequestRecord`` in order. A read of requests only (this,
        ``request_arrays``, ``request_rids``) steps over event frames by their first bytes,
        unread (``report.unread``; a strict reader checks them)."""
        return list(self._iter(frozenset((b"request",))))  # type: ignore[arg-type]

    def request_arrays(self) -> Iterator[RequestRecord]:
        """Every ``RequestRecord`` in order, as ``iter_kinds("request")`` reads them, except
        that a format 2.0 packed request's ``input_ids`` and ``output_ids`` are the
        ``array('I')`` the reader rebuilds anyway, not made lists of ints (a 100k-token
        prompt is 100k int objects as a list): for a caller that keeps ids as arrays (the
        replay). A format 1.x request's ids are lists, as written."""
        return self._iter(frozenset((b"request",)), "arrays")  # type: ignore[return-value]

    def events_and_notes(
        self, kinds: Iterable[str] | None = None, events_as: Any = None
    ) -> Iterator[Any]:
        """The ``EventFrame``s and the ``Annotation``s in order, the notes as
        ``AnnotationRawView`` (``data`` left as msgpack bytes: decode it where the kind asks
        for it). A note whose ``data`` is not a map, which ``iter_kinds("note")`` reports as
        undecodable, is yielded: a caller decoding its data checks that itself.
        ``kinds``: only the notes of these kinds; the others, and packed requests, are
        stepped over by their first bytes, neither decoded nor CRC-checked (a damaged one is
        not reported; one whose length is damaged is, at the frame after it; counted in
        ``report.unread``; a strict reader checks them all).
        ``events_as``: a stricter struct for event frames, tried first (tag ``"event"``,
        ``EventFrame``'s fields, e.g. a typed payload decoded in the same pass instead of
        skipped as ``Raw``); a frame it refuses comes as ``EventFrame``."""
        return self._iter(
            frozenset((b"event", b"note")),
            notes_raw=True,
            note_kinds=None if kinds is None else frozenset(kinds),
            events_as=events_as,
        )

    def request_rids(self) -> Iterator[str]:
        """The rid of every request record, in order, nothing else of them decoded (a
        packed request's prefix is not resolved: its rid is read even where the blocks it
        refers to were lost with damage). For duplicate checks on long captures."""
        for rec in self._iter(REQUEST_TAGS, "rid"):
            yield rec.rid  # type: ignore[union-attr]

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


__all__ = ["BundleReader"]
