"""Up-front checks of the paths the analysis commands write (``--out``, ``--cache``).

What this file owns: ``check_out_dir`` (a directory to write into, created if missing) and
``check_out_file`` (a file to write), each raising a ``UsageError`` that names the flag and
the path ("--out x: exists and is not a directory") before a command does any work, so bad
paths never surface as an ``OSError`` half-way through; and ``write_atomic`` (a file written
whole or not at all: a temp file next to it, renamed into place, removed on any failure, a
full disk reported in one line naming the flag). Overwriting is decided by the one
overwrite guard, ``kvcadence.outguard``: an existing file only with ``force``, and never a
path inside a bundle directory. Standard library only.
"""

from __future__ import annotations

import contextlib
import errno
import os
from collections.abc import Callable
from pathlib import Path

from kvcadence.errors import KvcadenceError, UsageError
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


_FS_ERRNOS = (errno.ENOSPC, errno.EDQUOT, errno.EFBIG, errno.EACCES, errno.EPERM, errno.EROFS)


def fs_errno(exc: BaseException) -> int | None:
    """The errno behind ``exc``: an ``OSError``'s own, else one named in its text (pyarrow
    and polars report a full disk as "[errno 28]" / "(os error 28)" in other exceptions)."""
    if isinstance(exc, OSError) and exc.errno is not None:
        return exc.errno
    if not isinstance(exc, Exception):
        return None
    text = str(exc).lower()
    for code in _FS_ERRNOS:
        if f"errno {code}]" in text or f"os error {code})" in text:
            return code
    return None


def write_atomic(
    path: str | os.PathLike[str], fill: Callable[[Path], object], flag: str = "--out"
) -> Path:
    """Write ``path`` whole or not at all: ``fill(tmp)`` writes a hidden temp file in the same
    directory, which is fsynced and renamed onto ``path``. On any failure the temp file is
    removed and ``path`` is left as it was; a full disk (or a quota) is one ``KvcadenceError``
    naming ``flag`` and the path (exit 1), never a truncated file."""
    final = Path(path)
    tmp = final.with_name(f".{final.name}.tmp-{os.getpid()}")
    try:
        fill(tmp)
        with open(tmp, "rb+") as fh:
            os.fsync(fh.fileno())
        os.replace(tmp, final)
    except BaseException as exc:
        with contextlib.suppress(OSError):
            tmp.unlink()
        code = fs_errno(exc)
        if code in (errno.ENOSPC, errno.EDQUOT, errno.EFBIG):
            raise KvcadenceError(
                f"{flag} {os.fspath(path)}: {os.strerror(code)}; nothing written"
            ) from None
        raise
    return final
