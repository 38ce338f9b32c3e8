"""Up-front checks of the paths the analysis commands write (``--out``, ``--cache``).

What this file owns: ``check_out_dir`` (a directory to write into, created if missing) and
``check_out_file`` (a file to write), each raising a ``UsageError`` that names the flag and
the path ("--out x: exists and is not a directory") before a command does any work, so bad
paths never surface as an ``OSError`` half-way through. Overwriting is decided by the one
overwrite guard, ``kvcadence.outguard``: an existing file only with ``force``, and never a
path inside a bundle directory. Standard library only.
"""

from __future__ import annotations

import os
from pathlib import Path

from kvcadence.errors import UsageError
from kvcadence.outguard import refuse_inside_bundle, refuse_out_file


def _nearest_existing(path: Path) -> Path:
    """``path`` or its closest ancestor that exists (the absolute form)."""
    p = Path(os.path.abspath(path))
    while not p.exists() and p != p.parent:
        p = p.parent
    return p


def _check_creatable(path: Path, flag: str, shown: str) -> None:
    """``path`` does not exist: its closest existing ancestor must be a writable directory."""
    if path.is_symlink():
        raise UsageError(f"{flag} {shown}: a broken symbolic link")
    anc = _nearest_existing(path)
    if not anc.is_dir():
        raise UsageError(f"{flag} {shown}: {anc} is not a directory")
    if not os.access(anc, os.W_OK | os.X_OK):
        raise UsageError(f"{flag} {shown}: cannot create it ({anc} is not writable)")


def check_out_dir(path: str | os.PathLike[str], flag: str = "--out") -> Path:
    """A directory to write into: an existing writable directory, or one that can be made."""
    shown = os.fspath(path)
    if not shown:
        raise UsageError(f"{flag}: empty path")
    p = Path(shown)
    refuse_inside_bundle(p, flag, is_dir=True)
    if p.exists():
        if not p.is_dir():
            raise UsageError(f"{flag} {shown}: exists and is not a directory")
        if not os.access(p, os.W_OK | os.X_OK):
            raise UsageError(f"{flag} {shown}: directory is not writable")
        return p
    _check_creatable(p, flag, shown)
    return p


def check_out_file(
    path: str | os.PathLike[str],
    flag: str = "--out",
    *,
    make_parents: bool = False,
    force: bool = False,
) -> Path:
    """A file to write; its directory must exist unless ``make_parents``; an existing file
    is replaced only with ``force``; never inside a bundle directory."""
    shown = os.fspath(path)
    if not shown:
        raise UsageError(f"{flag}: empty path")
    p = Path(shown)
    if p.is_dir():
        raise UsageError(f"{flag} {shown}: is a directory (name a file)")
    refuse_out_file(p, flag, force=force)
    if p.exists():
        if not os.access(p, os.W_OK):
            raise UsageError(f"{flag} {shown}: file is not writable")
        return p
    parent = Path(os.path.abspath(p)).parent
    if parent.is_dir():
        if not os.access(parent, os.W_OK | os.X_OK):
            raise UsageError(f"{flag} {shown}: directory {parent} is not writable")
        if p.is_symlink():
            raise UsageError(f"{flag} {shown}: a broken symbolic link")
        return p
    anc = _nearest_existing(parent)
    if not anc.is_dir():
        raise UsageError(f"{flag} {shown}: {anc} is not a directory")
    if not make_parents:
        raise UsageError(f"{flag} {shown}: directory {parent} does not exist")
    _check_creatable(parent, flag, shown)
    return p
