"""A bounded view of one segment file for the reader's frame walk (``SegmentWindow``).

What this file owns: how the reader holds a segment's bytes. Reading a bundle never holds a
whole segment: the walk sees ``data[:n]``, a window of about ``WINDOW`` bytes starting at
file offset ``base``, and asks for more (``advance``) when a frame does not fit in it.

* A complete segment (not the bundle's last) is memory-mapped (``segments._segment_map``:
  no copy, the page cache as is); the window is a moving limit inside the map, and the pages
  behind it are dropped from the process (``MADV_DONTNEED``: a file-backed page is read back
  from the page cache if a record still points into it), so the resident size is a window,
  not the segment.
* The last segment, which may still be growing or be truncated by ``BundleWriter.append``
  (a live map of it would fault, SIGBUS, instead of raising), is read in chunks of
  ``WINDOW`` bytes; a window is a fresh ``bytes`` (records decoded from an earlier one keep
  it alive through their ``Raw`` views). Its size is taken when it is opened: bytes
  appended later are not read (as a snapshot read would not).

Damage is the exception: resynchronising past a corrupt frame needs the bytes after it
(``rest``: the rest of the segment, read at once; for a torn tail that is the tail).
Standard library only.
"""

from __future__ import annotations

import mmap
import os
from pathlib import Path
from types import TracebackType

from kvcadence.format.bundle.segments import _segment_map

#: bytes a window covers beyond what a frame needs. Small enough that a chunk read of the
#: last segment reuses the memory the previous window freed (glibc hands larger blocks back
#: to the kernel: a page fault per 4 KB of every fresh window, ~40 % of the frame walk of a
#: 38 MB bundle at 8 MB); a frame larger than this gets a window of its own size
WINDOW = 256 << 10
_LAG = 4 << 20  # mapped pages dropped only this far behind the walk


class SegmentWindow:
    """``data[:n]`` is the segment's bytes from file offset ``base`` (see the module)."""

    def __init__(self, seg: Path, mapped: bool, window: int | None = None) -> None:
        self.window = window = window if window is not None else WINDOW
        self.base = 0
        self._file = None
        self._map: mmap.mmap | None = None
        self._dropped = 0  # mapped: pages before this offset were released
        self.data: bytes | mmap.mmap
        if mapped:
            m = _segment_map(seg)
            if m is not None:
                self._map = m
                self.data = m
                self.size = len(m)
                self.n = min(self.size, window)
                return
            # empty, or a file system that cannot map: read in chunks
        f = open(seg, "rb")  # noqa: SIM115 (closed by close())
        try:
            self.size = os.fstat(f.fileno()).st_size
            self.data = f.read(min(self.size, window))
        except BaseException:
            f.close()
            raise
        self._file = f
        if len(self.data) < min(self.size, window):  # truncated since the fstat
            self.size = len(self.data)
        self.n = len(self.data)

    @property
    def at_end(self) -> bool:
        """The window reaches the end of the segment."""
        return self.base + self.n >= self.size

    def advance(self, pos: int, need: int) -> int:
        """Cover at least ``need`` bytes from ``pos`` (window-relative); returns ``pos``
        relative to the new window. False coverage (the file is shorter than it was, or
        ``need`` reaches past its end) leaves ``at_end`` true with less than ``need``."""
        if self._map is not None:
            keep = pos - _LAG
            if keep - self._dropped >= self.window:
                page = mmap.PAGESIZE
                cut = keep - keep % page
                if cut > self._dropped and hasattr(self._map, "madvise"):
                    self._map.madvise(mmap.MADV_DONTNEED, self._dropped, cut - self._dropped)
                    self._dropped = cut
            self.n = min(self.size, pos + max(need, self.window))
            return pos
        assert self._file is not None
        start = self.base + pos
        # the window's unread tail (if any) is read again with what follows, in one read: the
        # page cache copies it, not a concatenation of the tail and a fresh chunk (a copy of
        # every window); past the window (a frame header's claimed length) there is no tail
        want = min(self.size - start, max(need, self.window))
        self._file.seek(start)
        data = self._file.read(want) if want > 0 else b""
        if len(data) < want:  # truncated under us: what is there is all there is
            self.size = start + len(data)
        self.base = start
        self.data = data
        self.n = len(data)
        return 0

    def rest(self, pos: int) -> int:
        """Cover everything from ``pos`` to the end of the segment (resynchronisation)."""
        return self.advance(pos, self.size - (self.base + pos))

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None

    def __enter__(self) -> SegmentWindow:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()


__all__ = ["WINDOW", "SegmentWindow"]
