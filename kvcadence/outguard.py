"""The one overwrite guard: nothing already recorded is replaced unless the user asked for it.

What this file owns, for every command that writes an ``--out``:

* ``refuse_nonempty_dir(path)`` -- a directory output (a bundle from ``capture``, ``import``,
  ``replay``, a sweep or fleet output directory): an existing file, or a directory that is not
  empty, is refused (``UsageError``, exit 2: "already exists and is not empty; refusing to
  overwrite").
* ``refuse_out_file(path, flag, force=)`` -- a single-file output (``sql --out``, ``prefixes
  --out``, ``admit --out``): an existing file is kept unless ``force`` (the commands' ``--force``).
* Both refuse, ``--force`` or not, a path inside a bundle directory (a directory holding
  ``seg-NNNNNN.kvcb`` segment files, itself or any directory above the path, symbolic links
  resolved): writing there can replace a segment (``prefixes B --out B/seg-000000.kvcb``
  destroyed the bundle) or leave foreign files among them. ``enclosing_bundle`` is that test.

Standard library only (imported by the capture, replay and analysis command modules alike).
"""

from __future__ import annotations

import os
import re
from pathlib import Path

from kvcadence.errors import UsageError

_SEGMENT_NAME = re.compile(r"^seg-\d{6,}\.kvcb$")


def _holds_segments(d: str) -> bool:
    try:
        with os.scandir(d) as it:
            return any(_SEGMENT_NAME.match(e.name) for e in it)
    except OSError:
        return False


def enclosing_bundle(path: str | os.PathLike[str]) -> Path | None:
    """The bundle directory ``path`` is (or would be created) inside of, or None.

    ``path`` itself counts when it is a segment file name inside a bundle; the directories
    above it are checked up to the root (symbolic links resolved).
    """
    p = os.path.realpath(os.path.abspath(os.fspath(path)))
    d = os.path.dirname(p)
    while True:
        if _holds_segments(d):
            return Path(d)
        parent = os.path.dirname(d)
        if parent == d:
            return None
        d = parent


def refuse_inside_bundle(path: str | os.PathLike[str], flag: str, *, is_dir: bool = False) -> None:
    """``UsageError`` if ``path`` lies inside a bundle directory (``is_dir``: a directory
    output, which must not be a bundle directory itself either)."""
    b = enclosing_bundle(path)
    if b is None and is_dir:
        real = os.path.realpath(os.path.abspath(os.fspath(path)))
        b = Path(real) if _holds_segments(real) else None
    if b is not None:
        where = f"{flag} {os.fspath(path)}" if flag else os.fspath(path)
        raise UsageError(
            f"{where}: inside the bundle directory {b}; refusing to write into a bundle "
            "(choose a path outside it)"
        )


def refuse_nonempty_dir(path: str | os.PathLike[str], flag: str = "", hint: str = "") -> Path:
    """A directory output: refused if it exists and is not an empty directory, or lies inside
    a bundle directory. Returns it as a ``Path``."""
    p = Path(path)
    shown = f"{flag} {p}" if flag else str(p)
    tail = f"; refusing to overwrite ({hint})" if hint else "; refusing to overwrite"
    if p.exists() and not p.is_dir():
        raise UsageError(f"{shown}: already exists and is not a directory{tail}")
    if p.is_dir() and any(p.iterdir()):
        raise UsageError(f"{shown}: already exists and is not empty{tail}")
    refuse_inside_bundle(p, flag)
    return p


def refuse_out_file(
    path: str | os.PathLike[str], flag: str = "--out", *, force: bool = False
) -> Path:
    """A single-file output: an existing file is refused unless ``force``; a path inside a
    bundle directory always. Returns it as a ``Path``."""
    p = Path(path)
    refuse_inside_bundle(p, flag)
    if not force and (p.exists() or p.is_symlink()) and not p.is_dir():
        raise UsageError(
            f"{flag} {p}: already exists; refusing to overwrite it (--force replaces it)"
        )
    return p


__all__ = ["enclosing_bundle", "refuse_inside_bundle", "refuse_nonempty_dir", "refuse_out_file"]
