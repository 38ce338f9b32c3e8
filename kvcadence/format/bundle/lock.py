"""One writer per bundle: an OS file lock on the bundle directory.

What this file owns: ``BundleLock``, the exclusive ``flock(2)`` a ``BundleWriter`` holds on its
bundle directory from the moment it opens it (new bundle or ``append``) until ``close()``. A
second writer -- ``capture import`` or ``import --append`` into a bundle a capture is still
writing, two captures with the same ``--out`` -- does not wait: it is refused with one line
(``UsageError``, exit 2) and touches nothing, so the running writer never sees a segment it
did not create. The lock is the kernel's: it lives on the directory's open file description,
goes away with the process (a SIGKILLed capture leaves no stale lock behind, nothing to clean
up), and follows the directory through a rename (``staged_bundle``). No lock file is created.
Readers never lock: reading a bundle while it is written is supported (docs/format.md §4).
On a platform without ``fcntl`` (Windows) no lock is taken.
"""

from __future__ import annotations

import os
from pathlib import Path

from kvcadence.errors import BundleError, UsageError

try:
    import fcntl
except ImportError:  # pragma: no cover - not POSIX
    fcntl = None  # type: ignore[assignment]


class BundleLock:
    """An exclusive, non-blocking lock on a bundle directory (see the module docstring)."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)
        self._fd: int | None = None
        if fcntl is None:
            return
        try:
            fd = os.open(self.path, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
        except OSError as exc:
            raise BundleError(f"cannot open bundle directory {self.path}: {exc}") from exc
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            raise UsageError(
                f"{self.path}: another process is writing this bundle (it holds the bundle's "
                "lock); wait until it finishes, or write to another path"
            ) from None
        except OSError:  # a file system without flock (ENOLCK, EOPNOTSUPP): go on unlocked
            os.close(fd)
        else:
            self._fd = fd

    @property
    def held(self) -> bool:
        return self._fd is not None

    def release(self) -> None:
        """Drop the lock (idempotent); closing the descriptor releases it."""
        fd, self._fd = self._fd, None
        if fd is not None:
            os.close(fd)

    def __del__(self) -> None:
        try:
            self.release()
        except Exception:  # noqa: BLE001 - interpreter shutdown: the kernel drops it anyway
            pass


__all__ = ["BundleLock"]
