"""What a pass over a bundle found: ``ReadReport`` (whole bundle) and ``SegmentScan`` (one
segment, for ``BundleWriter.append``)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass
class ReadReport:
    """What a full pass over a bundle found (filled by ``BundleReader`` while it reads)."""

    segments: int = 0
    bytes: int = 0  # total size of the segment files
    frames: int = 0  # valid frames (records + unknown records)
    #: of ``frames``: stepped over unread, their CRC not checked (``events_and_notes`` with
    #: ``kinds``: notes of other kinds, requests)
    unread: int = 0
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
    # requests stored compact (format 2.0 ``PackedRequest``), their token ids (input +
    # output) and the bytes those ids take in the bundle (4 per id stored, shared prefixes
    # not stored again)
    packed_requests: int = 0
    packed_ids: int = 0
    packed_bytes: int = 0

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
            "packed_requests": self.packed_requests,
            "packed_ids": self.packed_ids,
            "packed_bytes": self.packed_bytes,
        }


@dataclass
class SegmentScan:
    """Validation of one segment (used by ``append``)."""

    header_ok: bool
    good_end: int  # offset just past the last good frame
    corrupt: list[tuple[str, int, int]]
    torn_bytes: int


__all__ = ["ReadReport", "SegmentScan"]
