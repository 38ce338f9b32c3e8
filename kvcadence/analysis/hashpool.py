"""Many root chains of request pages hashed across processes (``ChainHasher``).

A page's SHA-256 costs ~1 us of Python (``wire.root_chains``: one hashlib call a page, the GIL
held throughout -- hashlib releases it only for inputs of 2 KiB and more), so hashing the
request pages of a 10M-event capture (~26M pages) is ~30 s of one core. ``ChainHasher``
splits a batch's pages at chain starts into one share per CPU: the caller hashes the first
share while worker processes hash the others, and the digests come back in order (the same
bytes as one ``root_chains`` call).

Workers: ``KVCADENCE_THREADS`` when set (1: no pool; the benchmarks' one core), else the
CPUs this process may run on, at most ``MAX_WORKERS``; the pool starts at the first batch of
``MIN_PAGES`` pages or more and a failing worker falls back to hashing in the caller. The
workers are plain subprocesses (``python -m kvcadence.analysis.hashpool``, bytes over their
stdin / stdout): never forked from a process running DuckDB threads, and unlike
multiprocessing's spawn they never re-run the caller's ``__main__`` (a script without a
main guard); they import this module, ``kvcadence.format.wire`` and ``sql`` (no DuckDB).
"""

from __future__ import annotations

import os
import struct
import subprocess
import sys
from pathlib import Path
from types import TracebackType
from typing import Any

from kvcadence.analysis import sql
from kvcadence.format import wire

#: at most this many processes (the caller included) hash one batch
MAX_WORKERS = 8
#: batches with fewer pages are hashed in the caller (a share would cost more to ship)
MIN_PAGES = 16384


def _cpus() -> int:
    env = sql.env_threads()
    if env is not None:
        return env
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1  # pragma: no cover - Linux has sched_getaffinity


def digest_bytes(words: bytes, page_size: int, first: bytes) -> bytes:
    """``wire.root_chains`` as one bytes object (32 bytes a page); ``first``: one byte a page,
    nonzero where a chain starts. The workers' function."""
    return b"".join(wire.root_chains(words, page_size, first))  # a flag byte is a bool


_HEAD = struct.Struct("<QQQ")  # page size, words bytes, flag bytes
_LEN = struct.Struct("<Q")


def _read(stream: Any, n: int) -> bytes:
    data = stream.read(n)
    if len(data) != n:
        raise EOFError(f"hash worker: {len(data)} of {n} bytes")
    return bytes(data)


def _serve() -> None:
    """The worker: answer ``_HEAD`` + words + flags on stdin with ``_LEN`` + digests."""
    inp, out = sys.stdin.buffer, sys.stdout.buffer
    while head := inp.read(_HEAD.size):
        if len(head) != _HEAD.size:
            raise EOFError("hash worker: a torn request")
        ps, nw, nf = _HEAD.unpack(head)
        got = digest_bytes(_read(inp, nw), ps, _read(inp, nf))
        out.write(_LEN.pack(len(got)) + got)
        out.flush()


class _Worker:
    """One ``python -m kvcadence.analysis.hashpool`` process (a plain subprocess: nothing of
    the caller's ``__main__`` runs in it, unlike multiprocessing's spawn)."""

    def __init__(self) -> None:
        root = str(Path(__file__).resolve().parents[2])
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH")) if p)
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "kvcadence.analysis.hashpool"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            env=env,
        )

    def send(self, words: bytes, ps: int, flags: bytes) -> None:
        stdin = self.proc.stdin
        assert stdin is not None
        stdin.write(_HEAD.pack(ps, len(words), len(flags)))
        stdin.write(words)
        stdin.write(flags)
        stdin.flush()

    def receive(self) -> bytes:
        stdout = self.proc.stdout
        assert stdout is not None
        (n,) = _LEN.unpack(_read(stdout, _LEN.size))
        return _read(stdout, n)

    def close(self) -> None:
        for stream in (self.proc.stdin, self.proc.stdout):
            if stream is not None:
                stream.close()
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:  # pragma: no cover - a stuck worker
            self.proc.kill()
            self.proc.wait()


class ChainHasher:
    """``digests(words, page_size, first)``: ``digest_bytes`` shared among processes."""

    def __init__(self, workers: int | None = None) -> None:
        self.workers = max(1, min(_cpus() if workers is None else workers, MAX_WORKERS))
        self._pool: list[_Worker] | None = None

    def __enter__(self) -> ChainHasher:
        return self

    def __exit__(
        self, et: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()

    def close(self) -> None:
        for w in self._pool or []:
            w.close()
        self._pool = None

    def _start(self) -> list[_Worker] | None:
        if self._pool is None and self.workers > 1:
            try:
                self._pool = [_Worker() for _ in range(self.workers - 1)]
            except OSError:  # pragma: no cover - no processes here: hash in the caller
                self.workers = 1
        return self._pool

    def digests(self, words: bytes, page_size: int, first: Any) -> bytes:
        """The digests of the chains in ``words`` (``first``: numpy bool, a page each)."""
        import numpy as np

        n = len(first)
        flags = np.ascontiguousarray(first, dtype=np.uint8).tobytes()
        pool = self._start() if n >= MIN_PAGES else None
        if pool is None:
            return digest_bytes(words, page_size, flags)
        step = 4 * page_size
        starts = np.flatnonzero(first)  # shares begin at chain starts
        targets = [n * i // self.workers for i in range(1, self.workers)]
        cut = starts[np.searchsorted(starts, targets).clip(max=len(starts) - 1)]
        bounds = sorted({0, n, *[int(c) for c in cut if 0 < c < n]})
        shares = list(zip(bounds[:-1], bounds[1:], strict=True))
        try:
            for w, (a, b) in zip(pool, shares[1:], strict=False):
                w.send(words[a * step : b * step], page_size, flags[a:b])
            a, b = shares[0]
            head = digest_bytes(words[a * step : b * step], page_size, flags[a:b])
            return b"".join([head, *(w.receive() for w, _ in zip(pool, shares[1:], strict=False))])
        except (OSError, EOFError, ValueError):  # a worker gone (killed): hash here instead
            self.close()
            self.workers = 1
            return digest_bytes(words, page_size, flags)


if __name__ == "__main__":
    _serve()
