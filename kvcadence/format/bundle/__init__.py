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

The package's public face: import from ``kvcadence.format.bundle``. Inside, one module per
concern: ``segments`` (names, segment header, the numbering survey, ``is_bundle``),
``frames`` (frame header, record tags, payload storage, decoders, resync pattern),
``compact`` (format 2.0's request layout: shared prompt prefixes, packed token ids),
``writer`` (``BundleWriter``), ``reader`` (``BundleReader``), ``report`` (``ReadReport``,
``SegmentScan``), ``staging`` (``copy_bundle``, ``staged_bundle``), ``lock`` (one writer per
bundle), ``crcspan`` (CRCs of overlapping spans for resynchronisation) and ``window`` (the
bounded view of a segment the reader walks: a bundle is never read a whole segment at once).
"""

from __future__ import annotations

from kvcadence.format.bundle.frames import (
    FRAME_HEADER,
    FRAME_HEADER_SIZE,
    RECORD_TAGS,
    check_encodable,
    encode_payload,
    event_payload,
    event_payload_view,
    is_single_msgpack,
)
from kvcadence.format.bundle.reader import BundleReader
from kvcadence.format.bundle.report import ReadReport, SegmentScan
from kvcadence.format.bundle.segments import (
    MAGIC,
    SEGMENT_HEADER_SIZE,
    bundle_identity,
    is_bundle,
    list_segments,
    segment_name,
)
from kvcadence.format.bundle.staging import copy_bundle, staged_bundle
from kvcadence.format.bundle.writer import AppendReport, BundleWriter

__all__ = [
    "FRAME_HEADER",
    "FRAME_HEADER_SIZE",
    "MAGIC",
    "SEGMENT_HEADER_SIZE",
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
