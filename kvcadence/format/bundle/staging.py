"""Whole bundles as files: ``copy_bundle`` (a byte copy of the segment files, never a link:
appending repairs a bundle's last segment in place, which must never reach the original) and
``staged_bundle`` (write a new bundle into a hidden sibling directory and rename it into
place only when everything succeeded)."""

from __future__ import annotations

import contextlib
import errno
import os
import shutil
import time
from collections.abc import Iterator
from pathlib import Path

from kvcadence.errors import (
    BundleError,
    UsageError,
)
from kvcadence.format.bundle.segments import is_bundle, list_segments
from kvcadence.outguard import refuse_nonempty_dir


def copy_bundle(src: str | os.PathLike[str], dst: str | os.PathLike[str]) -> list[Path]:
    """Copy the segment files of bundle ``src`` into the new directory ``dst`` (created; an
    existing empty one is used) and return the copies. Always a byte copy, never a (hard)
    link: ``BundleWriter.append`` truncates a bundle's last segment in place, and that must
    not reach the original. Other files of ``src`` (caches, reports) are not copied."""
    s, d = Path(src), Path(dst)
    if not is_bundle(s):
        raise UsageError(f"{s}: not a bundle (no seg-*.kvcb segment files)")
    refuse_nonempty_dir(d)
    out = []
    try:
        d.mkdir(parents=True, exist_ok=True)
        for seg in list_segments(s):
            target = d / seg.name
            shutil.copyfile(seg, target)
            out.append(target)
    except OSError as exc:
        raise BundleError(f"cannot copy bundle {s} to {d}: {exc}") from exc
    return out


@contextlib.contextmanager
def staged_bundle(path: str | os.PathLike[str]) -> Iterator[Path]:
    """Write a new bundle all-or-nothing: yields a hidden sibling directory of ``path`` to
    write into; on success it is renamed to ``path`` (which must not exist, or be an empty
    directory), on any exception it is removed and ``path`` is left as it was."""
    final = refuse_nonempty_dir(path)
    try:
        final.parent.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise BundleError(f"cannot create {final.parent}: {exc}") from exc
    tmp = final.parent / f".{final.name}.partial-{os.getpid()}-{time.monotonic_ns()}"
    try:
        tmp.mkdir()
    except OSError as exc:
        if exc.errno in (errno.EACCES, errno.EPERM, errno.EROFS, errno.ENOTDIR):
            # named by the path the user gave, not the hidden staging directory
            raise UsageError(
                f"{final}: cannot create the bundle directory ({exc.strerror})"
            ) from exc
        raise BundleError(f"cannot create {tmp}: {exc}") from exc
    try:
        yield tmp
        try:
            if final.is_dir():
                final.rmdir()  # empty (checked above): rename replaces it
            os.rename(tmp, final)
        except OSError as exc:
            msg = f"cannot move the finished bundle into place at {final}: {exc}"
            raise BundleError(msg) from exc
        with contextlib.suppress(OSError):
            fd = os.open(final.parent, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


__all__ = ["copy_bundle", "staged_bundle"]
