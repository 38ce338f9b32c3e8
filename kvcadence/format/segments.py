"""Which segments of a bundle are there, and which are missing: the segment-numbering check.

What this file owns: ``survey_segments(path)``, the reader's first look at a bundle
directory. Segments are numbered 0, 1, 2, ... without holes (``BundleWriter`` only ever opens
the next index; ``append`` reuses the index of a last segment it removed), so a hole in the
numbering, a name that is a directory or a dangling symbolic link, or a segment other than
the last that is shorter than its 8-byte segment header is a lost segment, never a normal
state. Each one is reported as ``(segment name, why)``; the segment files that can be read
are returned in index order. Standard library only.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

SEGMENT_GLOB = "seg-*.kvcb"
_SEGMENT_NAME = re.compile(r"^seg-(\d{6,})\.kvcb$")
_SEGMENT_HEADER_SIZE = 8


def _name(index: int) -> str:
    return f"seg-{index:06d}.kvcb"


def survey_segments(path: str | os.PathLike[str]) -> tuple[list[Path], list[tuple[str, str]]]:
    """``(readable segment files in index order, [(name, why) per missing segment])``.

    Missing: an index below the highest present one with no file (``"missing"``), a name
    that is not a regular file (``"a directory"``, ``"a dangling symbolic link"``, ...), a
    segment before the last one that is shorter than a segment header (``"empty (N
    bytes)"``: it is returned too, its bytes count as torn when read).
    """
    files: list[tuple[int, Path]] = []
    lost: dict[int, tuple[str, str]] = {}
    for p in Path(path).glob(SEGMENT_GLOB):
        m = _SEGMENT_NAME.match(p.name)
        if not m:
            continue
        idx = int(m.group(1))
        if p.is_file():
            files.append((idx, p))
        elif p.is_symlink() and not p.exists():
            lost[idx] = (p.name, "a dangling symbolic link")
        elif p.is_dir():
            lost[idx] = (p.name, "a directory, not a segment file")
        else:
            lost[idx] = (p.name, "not a regular file")
    files.sort()
    present = {i for i, _ in files}
    top = max([*present, *lost], default=-1)
    missing: list[tuple[int, tuple[str, str]]] = list(lost.items())
    for i in range(top + 1):  # bounded by the files listed: indices are dense in practice
        if i not in present and i not in lost:
            missing.append((i, (_name(i), "missing")))
        if len(missing) > 10_000:  # a crafted name (seg-999999999.kvcb): do not list them all
            missing.append((i, (_name(i), f"... and every index up to {top}")))
            break
    last = files[-1][0] if files else -1
    for i, p in files:
        if i == last:
            continue
        try:
            size = p.stat().st_size
        except OSError as exc:
            missing.append((i, (p.name, f"cannot stat: {exc.strerror or exc}")))
            continue
        if size < _SEGMENT_HEADER_SIZE:
            missing.append((i, (p.name, f"empty ({size} bytes)")))
    missing.sort()
    return [p for _, p in files], [m for _, m in missing]


__all__ = ["survey_segments"]
