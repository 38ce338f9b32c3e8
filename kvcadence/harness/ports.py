"""Loopback ports and CPU binding for a real SGLang worker.

What this file owns: choosing free ports on 127.0.0.1 -- ``reserve_ports`` (an HTTP port and
the KV-event and replay ranges ``[base, base + dp)``: SGLang offsets both endpoints by the
DP rank, so each range is held free and apart from the others while choosing),
``free_ports`` -- and ``omp_threads_bind``, the ``SGLANG_CPU_OMP_THREADS_BIND`` value that
splits this process's CPUs between DP ranks (``0|1`` on a 2-CPU, 1-NUMA-node box, where
SGLang otherwise refuses more ranks than NUMA nodes).

Only the standard library is imported here.
"""

from __future__ import annotations

import os
import socket
from collections.abc import Sequence

from kvcadence.errors import HarnessError, UsageError


def _bind_local(port: int) -> socket.socket | None:
    """A TCP socket bound to ``127.0.0.1:port`` (0 = any free port), or None if taken."""
    s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        s.bind(("127.0.0.1", port))
    except OSError:
        s.close()
        return None
    return s


def reserve_ports(dp_size: int = 1, *, attempts: int = 64) -> tuple[int, int, int]:
    """``(http, events_base, replay_base)``: an HTTP port and two ranges ``[base, base+dp)``,
    every port free on 127.0.0.1 and all distinct (each is held bound while the rest are
    chosen, so the ranges cannot overlap each other or the HTTP port)."""
    if dp_size < 1:
        raise UsageError(f"dp_size must be >= 1, got {dp_size}")
    held: list[socket.socket] = []
    try:
        http = _bind_local(0)
        if http is None:
            raise HarnessError("no free TCP port on 127.0.0.1")
        held.append(http)
        bases = []
        for what in ("KV-event", "replay"):
            for _ in range(attempts):
                first = _bind_local(0)
                if first is None:
                    continue
                base = first.getsockname()[1]
                group = [first]
                for r in range(1, dp_size):
                    s = _bind_local(base + r) if base + r <= 65535 else None
                    if s is None:
                        break
                    group.append(s)
                if len(group) == dp_size:
                    held += group
                    bases.append(base)
                    break
                for s in group:
                    s.close()
            else:
                raise HarnessError(
                    f"no {dp_size} consecutive free {what} ports on 127.0.0.1 "
                    f"after {attempts} tries"
                )
        return held[0].getsockname()[1], bases[0], bases[1]
    finally:
        for s in held:
            s.close()


def omp_threads_bind(dp_size: int, cpus: Sequence[int] | None = None) -> str:
    """A ``SGLANG_CPU_OMP_THREADS_BIND`` value for ``dp_size`` ranks: ``cpus`` (default: the
    CPUs this process may run on) split into ``dp_size`` contiguous groups, ``|``-separated
    (``"0|1"`` for 2 ranks on CPUs 0-1, ``"0-1|2-3"`` on 4); with fewer CPUs than ranks the
    ranks share CPUs round-robin."""
    if cpus is None:
        try:
            cpus = sorted(os.sched_getaffinity(0))
        except (AttributeError, OSError):
            cpus = list(range(os.cpu_count() or 1))
    cpus = sorted(cpus)
    if not cpus or dp_size < 1:
        raise UsageError("omp_threads_bind needs >= 1 CPU and >= 1 rank")
    if len(cpus) >= dp_size:
        q, extra = divmod(len(cpus), dp_size)
        groups, i = [], 0
        for r in range(dp_size):
            n = q + (r < extra)
            groups.append(cpus[i : i + n])
            i += n
    else:
        groups = [[cpus[r % len(cpus)]] for r in range(dp_size)]
    return "|".join(_cpu_list(g) for g in groups)


def _cpu_list(cpus: Sequence[int]) -> str:
    """``[0, 1, 2, 5]`` -> ``"0-2,5"``."""
    out: list[str] = []
    start = prev = cpus[0]
    for c in [*cpus[1:], None]:
        if c is not None and c == prev + 1:
            prev = c
            continue
        out.append(str(start) if start == prev else f"{start}-{prev}")
        if c is not None:
            start = prev = c
    return ",".join(out)


def free_ports(n: int) -> list[int]:
    """``n`` distinct free TCP ports on 127.0.0.1 (held open together while choosing)."""
    socks = []
    try:
        for _ in range(n):
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            s.bind(("127.0.0.1", 0))
            socks.append(s)
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()
