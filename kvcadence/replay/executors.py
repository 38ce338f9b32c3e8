"""Where sweep jobs run: the local process pool (default) or a Ray cluster (``--executor ray``).

What this file owns:

* ``EXECUTORS`` and ``require(executor)``: ``ray`` needs the optional extra
  (``pip install 'kvcadence[ray]'``); without it a one-line ``UsageError`` (exit 2), raised
  before anything is read or written;
* ``run_ray(specs, job_fn, write, jobs=…, on_done=…)``: every job spec of
  ``replay.sweep.run_sweep`` becomes one Ray task (``num_cpus=1``) running ``job_fn``
  (``sweep.table_job``), which returns the job's summary and its rows as one Arrow table
  (``sweep.job_table``); the driver writes the table into the dataset with ``write``
  (``sweep.write_table``) -- the very function the process pool's workers call, so both
  executors produce the same hive-partitioned Parquet dataset (same files, same rows). Only
  the driver writes: ``out`` is a directory on the driver's machine, not shared with the
  cluster.

The cluster: ``RAY_ADDRESS`` when set (``host:port`` of a head's GCS, or ``ray://host:10001``
for Ray Client), as ``ray.init`` reads it; otherwise a private single-machine Ray instance
started for this run and stopped at its end: every Ray process listens on 127.0.0.1 only
(``RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0``, Ray's switch for single-machine clusters), no
dashboard, no usage statistics (``RAY_USAGE_STATS_ENABLED=0``), token authentication with
a fresh random token (``RAY_AUTH_MODE=token``, ``RAY_AUTH_TOKEN``) unless the environment
sets them, ``num_cpus`` = ``--jobs`` (default: CPUs, at most one per job). It never attaches
to a cluster found in ``/tmp/ray`` by chance.

On a cluster, every node must have kvcadence (the same version: a task refuses another) and
read the bundles at the same path (shared filesystem): relative paths are made absolute on
the driver. ``--jobs`` then caps the tasks in flight (default: all; Ray queues them on the
cluster's CPUs).

What crosses the wire: Ray serializes (pickles) the job specs -- plain dicts of paths,
settings and the point built by ``run_sweep`` from the command line -- to the tasks, and the
summaries (plain dicts) and Arrow tables back, between the processes of this run and the
cluster the user pointed ``RAY_ADDRESS`` at; as with the process pool, nothing read from a
bundle, a file or a socket is ever unpickled by kvcadence. A Ray cluster runs any code its
clients submit: connect only to a cluster you trust, and do not expose its ports.

Imports Ray only inside the functions (the extra is optional).
"""

from __future__ import annotations

import os
import secrets
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from kvcadence import __version__
from kvcadence.errors import InputError, KvcadenceError, UsageError

EXECUTORS = ("process", "ray")
RAY_EXTRA_HINT = "pip install 'kvcadence[ray]'"


def require(executor: str) -> None:
    """A one-line ``UsageError`` for an unknown executor, or ``ray`` without Ray installed."""
    if executor not in EXECUTORS:
        raise UsageError(f"--executor {executor!r}: choose from {', '.join(EXECUTORS)}")
    if executor == "ray":
        _prepare_env()  # before Ray is imported: its constants and C++ side read these
        try:
            import ray  # noqa: F401
        except ImportError as exc:
            raise UsageError(
                f"--executor ray: Ray is not installed ({exc}); {RAY_EXTRA_HINT}"
            ) from None
        _probe()


def _probe(timeout_s: float = 5.0) -> None:
    """A ``host:port`` ``RAY_ADDRESS`` that accepts no TCP connection is one line, exit 2,
    now (``ray.init`` would retry for minutes)."""
    import socket

    address = os.environ.get("RAY_ADDRESS", "").strip()
    head = _head(address) if address else None
    if head is None:
        return
    try:
        socket.create_connection(head, timeout=timeout_s).close()
    except OSError as exc:
        raise UsageError(
            f"--executor ray: RAY_ADDRESS={address}: no Ray head answers there ({exc})"
        ) from None


def _ray_task(
    job_fn: Callable[[dict[str, Any]], tuple[dict[str, Any], Any]], spec: dict[str, Any]
) -> tuple[dict[str, Any], Any]:
    """One job on a Ray worker: ``job_fn(spec)`` (``sweep.table_job``: the summary and the
    rows as an Arrow table) after checking the node can run it."""
    want = spec.get("kvcadence_version")
    if want is not None and want != __version__:
        raise UsageError(
            f"--executor ray: this Ray node runs kvcadence {__version__}, the driver {want}; "
            "install the same version on every node"
        )
    for p in spec["bundles"]:
        if not Path(p).exists():
            import socket

            raise InputError(
                f"{p}: no such bundle on Ray node {socket.gethostname()}; every node must "
                "read the bundles at the same path (a shared filesystem)"
            )
    return job_fn(spec)


def _head(address: str) -> tuple[str, int] | None:
    """``(host, port)`` of a ``host:port`` GCS address; None for ``ray://``, ``auto`` …"""
    host, sep, port = address.rpartition(":")
    if "://" in address or not sep or not port.isdigit():
        return None
    return host.strip("[]") or "127.0.0.1", int(port)


def _prepare_env() -> None:
    """Without ``RAY_ADDRESS``: the private local instance listens on 127.0.0.1 only and
    uses token authentication with a fresh token (unless the environment says otherwise).
    Either way Ray's usage statistics stay off unless the environment turns them on.
    With a loopback ``RAY_ADDRESS`` (a head on this machine): stay on loopback (Ray would
    otherwise swap 127.0.0.1 for the machine's address). Must run before ``import ray``
    (Ray reads these at import; its processes inherit them)."""
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")  # Ray reports nothing home
    address = os.environ.get("RAY_ADDRESS", "").strip()
    if address:
        head = _head(address)
        if head is not None and head[0] in ("127.0.0.1", "localhost", "::1"):
            os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
        return
    os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
    if "RAY_AUTH_MODE" not in os.environ:
        os.environ["RAY_AUTH_MODE"] = "token"
        if "RAY_AUTH_TOKEN" not in os.environ and "RAY_AUTH_TOKEN_PATH" not in os.environ:
            os.environ["RAY_AUTH_TOKEN"] = secrets.token_hex(32)


def _connect(n_local: int) -> tuple[Any, bool]:
    """``ray`` connected to ``RAY_ADDRESS``, or to a private local instance (started here)."""
    address = os.environ.get("RAY_ADDRESS", "").strip()
    _prepare_env()
    import logging

    import ray

    common: dict[str, Any] = {"log_to_driver": False, "logging_level": logging.WARNING}
    try:
        if address:
            ray.init(address=address, **common)
        else:
            ray.init(address="local", num_cpus=n_local, include_dashboard=False, **common)
    except (ConnectionError, RuntimeError, ValueError) as exc:
        where = f"RAY_ADDRESS={address}" if address else "a local Ray instance"
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise UsageError(f"--executor ray: cannot connect to {where}: {first}") from None
    return ray, not address


def run_ray(
    specs: Sequence[dict[str, Any]],
    job_fn: Callable[[dict[str, Any]], tuple[dict[str, Any], Any]],
    write: Callable[[dict[str, Any], Any], int],
    *,
    jobs: int | None = None,
    on_done: Callable[[dict[str, Any]], None] | None = None,
) -> list[dict[str, Any]]:
    """Run ``job_fn(spec)`` for every spec as a Ray task (``job_fn`` must be importable:
    Ray pickles it by reference); ``write(summary, table)`` each result in the driver as it
    arrives (returns files written). Returns the summaries in job order."""
    local_cpus = max(1, min(jobs or os.cpu_count() or 1, len(specs)))
    ray, started = _connect(local_cpus)
    try:
        from ray.exceptions import RayTaskError

        task = ray.remote(num_cpus=1, max_retries=0)(_ray_task)
        todo = []
        for s in specs:
            spec = dict(s)
            spec["bundles"] = [str(Path(p).resolve()) for p in s["bundles"]]
            spec["names"] = s.get("names") or [Path(p).name for p in s["bundles"]]
            spec["kvcadence_version"] = __version__
            todo.append(spec)
        limit = len(todo) if not jobs or started else max(1, jobs)
        results: list[dict[str, Any] | None] = [None] * len(specs)
        pending: dict[Any, int] = {}
        nxt = 0
        while nxt < len(todo) or pending:
            while nxt < len(todo) and len(pending) < limit:
                pending[task.remote(job_fn, todo[nxt])] = nxt
                nxt += 1
            ready, _ = ray.wait(list(pending), num_returns=1)
            i = pending.pop(ready[0])
            try:
                summary, table = ray.get(ready[0])
            except RayTaskError as exc:
                cause = getattr(exc, "cause", None)
                if isinstance(cause, KvcadenceError):
                    raise cause from None
                raise
            t0 = time.perf_counter()
            summary["files"] = write(summary, table)
            summary["job_wall_s"] = round(summary["job_wall_s"] + time.perf_counter() - t0, 3)
            summary["bundles"] = list(specs[i]["bundles"])  # as given, not resolved
            del table
            results[i] = summary
            if on_done is not None:
                on_done(summary)
        return [r for r in results if r is not None]
    finally:
        ray.shutdown()
