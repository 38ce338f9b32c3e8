"""Where a bundle's Parquet cache goes, and what a failed cache write tells the user.

What this file owns:

* ``default_cache(bundle)``: ``BUNDLE/.parquet`` -- unless the bundle directory is not
  writable (a read-only mount, another user's capture) and holds no cache yet: then a private
  per-user directory under the system temp dir, one per bundle (keyed by its resolved path),
  so ``sql``, ``report`` and ``prefixes`` work on a read-only bundle without a flag.
* ``cache_write_error(exc, cache)``: the one-line error for a cache build that failed: a
  permission / read-only file system names ``--cache DIR`` (sql, prefixes) and ``--out DIR``
  (ingest); a full disk says so (exit 1). The caller removes its temp directory first, so
  no ``.parquet.tmp-PID`` directory is left behind either way.

Standard library only.
"""

from __future__ import annotations

import errno
import hashlib
import os
import tempfile
from pathlib import Path

from kvcadence.analysis.outpaths import fs_errno
from kvcadence.errors import KvcadenceError, UsageError

_NOT_WRITABLE = (errno.EACCES, errno.EPERM, errno.EROFS)
_FULL = (errno.ENOSPC, errno.EDQUOT, errno.EFBIG)


def fallback_cache(bundle: Path) -> Path | None:
    """A private cache directory for ``bundle`` under the temp dir (None if unusable)."""
    key = hashlib.sha256(os.fsencode(os.path.realpath(bundle))).hexdigest()[:20]
    root = Path(tempfile.gettempdir()) / f"kvcadence-parquet-{os.getuid()}"
    try:
        root.mkdir(mode=0o700, exist_ok=True)
        st = root.stat()
    except OSError:
        return None
    if st.st_uid != os.getuid() or not root.is_dir() or root.is_symlink():
        return None  # someone else's directory: do not write there
    return root / key


def default_cache(bundle: Path, dirname: str, manifest: str) -> Path:
    """``bundle/dirname``, or ``fallback_cache(bundle)`` when the bundle cannot take one."""
    own = bundle / dirname
    if (own / manifest).exists() or os.access(bundle, os.W_OK | os.X_OK):
        return own
    return fallback_cache(bundle) or own


def cache_write_error(exc: BaseException, cache: Path) -> BaseException:
    """The error to raise for ``exc`` met while writing the cache ``cache`` (``exc`` itself
    when it is no file-system failure)."""
    code = fs_errno(exc)
    if code in _NOT_WRITABLE:
        return UsageError(
            f"cannot write the Parquet cache {cache}: {os.strerror(code)}; pass --cache DIR "
            "(sql, prefixes) or --out DIR (ingest) to put it elsewhere"
        )
    if code in _FULL:
        return KvcadenceError(
            f"cannot write the Parquet cache {cache}: {os.strerror(code)}; nothing kept "
            "(free space, or pass --cache DIR on another file system)"
        )
    return exc


__all__ = ["cache_write_error", "default_cache", "fallback_cache"]
