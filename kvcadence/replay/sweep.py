"""Parallel replays of many bundles / parameter points into one Parquet dataset.

What this file owns:

* the points (``parse_sweep(["key=v1,v2", ...])``, ``point_label``: ``replay.sweeppoints``);
* ``run_sweep(bundles, points, out)`` -- one job per point (all bundles replayed together
  as one fleet) or, with ``each=True``, one job per (bundle, point); jobs run in separate
  processes (``concurrent.futures.ProcessPoolExecutor``, spawn), or with
  ``executor="ray"`` as Ray tasks (``replay.executors``; same dataset), and only plain
  dicts and paths cross the process boundary. The executor pickles them (job spec out, job
  summary back) between our own processes of one run; nothing read from a file or socket is ever
  unpickled. ``validate_jobs`` builds every job's configs first, so a bad point is a
  ``UsageError`` before ``out`` is created. A process reads each bundle once for all its
  jobs (``replay.bundlecache``: records, a production capture's inference, calibration);
* the dataset: every job writes its rows with pyarrow under ``out`` as a hive-partitioned
  Parquet dataset ``worker=…/rank=…/route=…/<key>=<value>/…`` (one column per swept key, so
  DuckDB's ``read_parquet('out/**/*.parquet', hive_partitioning = true)`` sees them), file
  names unique per job. Rows have ``kind``:

  - ``message``: one published batch -- ``seq``, ``time_ns``, ``pass_index``, ``n_events``,
    ``stored_events``, ``stored_blocks``, ``removed_events``, ``removed_blocks``,
    ``cleared``;
  - ``request``: one request on its serving rank -- ``rid``, ``lane``, ``prompt_tokens``,
    ``cached_tokens``, ``completion_tokens``, ``recorded_rank``, ``recorded_cached_tokens``,
    ``send_ns``, ``finish_ns``;

  plus ``point`` (the job's point as ``k=v;k=v``) and ``job``. ``out/_sweep.json`` lists
  the jobs and their summaries (not Parquet, so globbing ``*.parquet`` skips it).
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from kvcadence.errors import InputError, UsageError
from kvcadence.format.bundle import BundleReader
from kvcadence.format.schema import served_rank
from kvcadence.format.texttokens import load_tokenizer
from kvcadence.outguard import refuse_nonempty_dir
from kvcadence.replay import bundlecache, executors
from kvcadence.replay.events import CLEAR, REMOVE, STORE
from kvcadence.replay.fleet import simulate_fleet
from kvcadence.replay.sweeppoints import point_label
from kvcadence.replay.worker import bundle_dp_size, load_worker, rank_configs

PARTITION_BASE = ("worker", "rank", "route")


# ---------------------------------------------------------------------- one job
def fleet_rows(result: Any) -> list[dict[str, Any]]:
    """The dataset rows (both kinds) of one fleet replay, partition columns included."""

    rows: list[dict[str, Any]] = []
    for sl in result.slots:
        wname = result.workers[sl.worker].name
        batches = sl.publisher.batches
        log = sl.publisher.log
        for b, (_t, events) in zip(batches, log, strict=True):
            se = sb = re_ = rb = cl = 0
            for e in events:
                if e.kind == STORE:
                    se += 1
                    sb += len(e.hashes)
                elif e.kind == REMOVE:
                    re_ += 1
                    rb += len(e.hashes)
                elif e.kind == CLEAR:
                    cl += 1
            rows.append(
                {
                    "kind": "message",
                    "worker": wname,
                    "rank": sl.rank,
                    "seq": b.seq,
                    "time_ns": b.time_ns,
                    "pass_index": b.pass_index,
                    "n_events": b.n_events,
                    "stored_events": se,
                    "stored_blocks": sb,
                    "removed_events": re_,
                    "removed_blocks": rb,
                    "cleared": cl,
                }
            )
    for spec, rec, slot in zip(result.specs, result.requests, result.serving, strict=True):
        sl = result.slots[slot]
        src = spec.source
        rows.append(
            {
                "kind": "request",
                "worker": result.workers[sl.worker].name,
                "rank": sl.rank,
                "rid": rec.rid,
                "lane": rec.lane,
                "prompt_tokens": rec.prompt_tokens,
                "cached_tokens": rec.cached_tokens,
                "completion_tokens": rec.completion_tokens,
                "recorded_rank": served_rank(src) if src is not None else None,
                "recorded_cached_tokens": getattr(src, "cached_tokens", None),
                "send_ns": rec.send_ns,
                "finish_ns": rec.finish_ns,
            }
        )
    return rows


_COLUMNS: tuple[tuple[str, str], ...] = (
    ("kind", "string"),
    ("seq", "int64"),
    ("time_ns", "int64"),
    ("pass_index", "int64"),
    ("n_events", "int64"),
    ("stored_events", "int64"),
    ("stored_blocks", "int64"),
    ("removed_events", "int64"),
    ("removed_blocks", "int64"),
    ("cleared", "int64"),
    ("rid", "string"),
    ("lane", "int64"),
    ("prompt_tokens", "int64"),
    ("cached_tokens", "int64"),
    ("completion_tokens", "int64"),
    ("recorded_rank", "int64"),
    ("recorded_cached_tokens", "int64"),
    ("send_ns", "int64"),
    ("finish_ns", "int64"),
    ("point", "string"),
    ("job", "int64"),
)


def job_table(rows: list[dict[str, Any]], point: dict[str, Any], job: int) -> Any:
    """The rows of one job as a ``pyarrow.Table`` (data columns, then the partition columns
    ``worker``, ``rank``, ``route`` and one per swept key)."""
    import pyarrow as pa

    part_keys = _part_keys(point)
    label = point_label(point)
    cols: dict[str, list[Any]] = {name: [] for name, _ in _COLUMNS}
    for k in part_keys:
        cols[k] = []
    for r in rows:
        for name, _ in _COLUMNS:
            cols[name].append(r.get(name))
        cols["point"][-1] = label
        cols["job"][-1] = job
        cols["worker"].append(r["worker"])
        cols["rank"].append(r["rank"])
        cols["route"].append(point["route"])
        for k in part_keys[3:]:
            cols[k].append(point[k])
    fields = [pa.field(n, getattr(pa, t)()) for n, t in _COLUMNS]
    fields += [pa.field("worker", pa.string()), pa.field("rank", pa.int64())]
    fields += [pa.field("route", pa.string())]
    for k in part_keys[3:]:
        v = point[k]
        typ = (
            pa.bool_()
            if isinstance(v, bool)
            else pa.int64()
            if isinstance(v, int)
            else pa.float64()
            if isinstance(v, float)
            else pa.string()
        )
        fields.append(pa.field(k, typ))
    return pa.Table.from_pydict(cols, schema=pa.schema(fields))


def _part_keys(point: dict[str, Any]) -> list[str]:
    return list(PARTITION_BASE) + sorted(k for k in point if k != "route")


def write_table(out: Path, table: Any, point: dict[str, Any], job: int) -> int:
    """Append one job's ``job_table`` to the dataset at ``out``: a file a ``(worker, rank)``
    under the hive directory pyarrow's ``Partitioning.format`` names; returns files written.
    The pool calls it in the worker, the Ray executor in the driver. Written on the calling
    thread (``parquet.write_table``), not by ``dataset.write_dataset``: its I/O pool tearing
    down at interpreter exit aborted a finished sweep once in CI (exit -6, apache/arrow#34314)."""
    import functools
    import operator

    import pyarrow as pa
    import pyarrow.compute as pc
    import pyarrow.dataset as pads
    import pyarrow.parquet as pq

    keys = _part_keys(point)
    hive = pads.partitioning(pa.schema([table.schema.field(k) for k in keys]), flavor="hive")
    data = table.drop_columns(keys)
    combos: dict[tuple[Any, ...], list[int]] = {}  # partition values -> rows, in order
    for i, combo in enumerate(zip(*(table.column(k).to_pylist() for k in keys), strict=True)):
        combos.setdefault(combo, []).append(i)
    for n, (combo, rows) in enumerate(combos.items()):
        eqs = (pc.field(k) == v for k, v in zip(keys, combo, strict=True))
        expr = functools.reduce(operator.and_, eqs)
        where = out / hive.format(expr)[0] / f"job{job:04d}-{n}.parquet"
        where.parent.mkdir(parents=True, exist_ok=True)
        pq.write_table(data.take(rows), where)
    return len(combos)


def write_rows(out: Path, rows: list[dict[str, Any]], point: dict[str, Any], job: int) -> int:
    """Append ``rows`` to the dataset at ``out`` (hive partitions); returns files written."""
    return write_table(out, job_table(rows, point, job), point, job)


def simulate_job(job: dict[str, Any]) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """Replay one job: its dataset rows and its summary (without ``files``/``job_wall_s``).
    ``job["names"]`` (optional) names the workers (default: each bundle's directory name)."""

    point = dict(job["point"])
    route = point.get("route") or job.get("route") or "recorded"
    point["route"] = route
    overrides = _job_overrides(job)
    if overrides.get("track_visibility") is None:
        overrides["track_visibility"] = False  # the rows carry no visibility: skip the log
    names = job.get("names") or [None] * len(job["bundles"])
    workers = [
        load_worker(
            p,
            overrides,
            sglang_version=job.get("sglang_version"),
            calibrate_timing=job.get("calibrate", True),
            name=name,
            # read once per process for all its jobs (``bundlecache``)
            inputs=bundlecache.cached_bundle(p, job.get("tokenizer")),
        )
        for p, name in zip(job["bundles"], names, strict=True)
    ]
    result = simulate_fleet(
        workers,
        route,
        align_workers=job.get("align_workers", False),
        pace=job.get("pace", "auto"),
    )
    rows = fleet_rows(result)
    summary = result.summary()
    summary.update(
        {
            "job": job["job"],
            "point": point,
            "bundles": list(job["bundles"]),
            "rows": len(rows),
            "totals": totals(rows),
        }
    )
    return rows, summary


def run_job(job: dict[str, Any]) -> dict[str, Any]:
    """One replay (in a worker process): plain dict in, plain dict out."""
    import time

    t0 = time.perf_counter()
    rows, summary = simulate_job(job)
    summary["files"] = write_rows(Path(job["out"]), rows, summary["point"], job["job"])
    summary["job_wall_s"] = round(time.perf_counter() - t0, 3)
    return summary


def table_job(job: dict[str, Any]) -> tuple[dict[str, Any], Any]:
    """One replay for an executor that writes in the driver (Ray): the summary (without
    ``files``) and the rows as one Arrow table (``job_table``)."""
    import time

    t0 = time.perf_counter()
    rows, summary = simulate_job(job)
    table = job_table(rows, summary["point"], job["job"])
    summary["job_wall_s"] = round(time.perf_counter() - t0, 3)
    return summary, table


def totals(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Counts over all rows of a job (the CLI's what-if table is built from these)."""
    t = {
        "requests": 0,
        "prompt_tokens": 0,
        "cached_tokens": 0,
        "recorded_cached_tokens": 0,
        "messages": 0,
        "events": 0,
        "stored_events": 0,
        "stored_blocks": 0,
        "removed_events": 0,
        "removed_blocks": 0,
        "off_recorded_rank": 0,
    }
    for r in rows:
        if r["kind"] == "message":
            t["messages"] += 1
            t["events"] += r["n_events"]
            for k in ("stored_events", "stored_blocks", "removed_events", "removed_blocks"):
                t[k] += r[k]
        else:
            t["requests"] += 1
            t["prompt_tokens"] += r["prompt_tokens"] or 0
            t["cached_tokens"] += r["cached_tokens"] or 0
            t["recorded_cached_tokens"] += r["recorded_cached_tokens"] or 0
            if r["recorded_rank"] is not None and r["recorded_rank"] != r["rank"]:
                t["off_recorded_rank"] += 1
    return t


# ---------------------------------------------------------------------- many jobs
def _job_overrides(job: dict[str, Any]) -> dict[str, Any]:
    overrides = dict(job.get("overrides") or {})
    overrides.update({k: v for k, v in job["point"].items() if k != "route"})
    return overrides


def validate_jobs(specs: Sequence[dict[str, Any]]) -> None:
    """Build every job's rank configs in this process (each bundle read once; no timing
    calibration, which cannot make a config invalid): a bad point (``page_size=0``) or an
    input without requests is a ``UsageError`` / ``InputError`` before anything is written."""

    inputs: dict[str, tuple[Any, int]] = {}
    for job in specs:
        for path in job["bundles"]:
            if path not in inputs:
                reader = BundleReader(path)
                dp_size, n = bundle_dp_size(reader)  # streamed: no records held
                if not n:
                    raise InputError(f"{path}: the bundle has no request records to replay")
                inputs[path] = (reader.header, dp_size)
            header, dp_size = inputs[path]
            try:
                rank_configs(  # uncalibrated: the records are not read, only the rank count
                    header,
                    [],
                    _job_overrides(job),
                    sglang_version=job.get("sglang_version"),
                    calibrate_timing=False,
                    dp_size=dp_size,
                )
            except UsageError as exc:
                if isinstance(exc, InputError):
                    raise
                raise UsageError(f"--sweep {point_label(job['point'])}: {exc}") from None


def run_sweep(
    bundles: Sequence[str | Path],
    points: Sequence[dict[str, Any]],
    out: str | Path,
    *,
    overrides: dict[str, Any] | None = None,
    route: str = "recorded",
    each: bool = False,
    jobs: int | None = None,
    sglang_version: str | None = None,
    calibrate: bool = True,
    align_workers: bool = False,
    on_done: Callable[[dict[str, Any]], None] | None = None,
    pace: str = "auto",
    executor: str = "process",
    tokenizer: str | None = None,
) -> list[dict[str, Any]]:
    """Run every job (see module docstring); returns the job summaries in job order.
    ``executor="ray"`` runs the jobs as Ray tasks (``replay.executors``): same dataset;
    ``tokenizer``: ``replay --tokenizer DIR``, loaded by each job."""
    from concurrent.futures import ProcessPoolExecutor
    from multiprocessing import get_context

    executors.require(executor)  # a missing Ray is one line, before anything is read
    out_path = Path(out)
    refuse_nonempty_dir(out_path)
    paths = [str(Path(b)) for b in bundles]
    for p in paths:
        if not Path(p).exists():
            raise UsageError(f"{p}: no such bundle")
    groups = [[p] for p in paths] if each else [paths]
    specs: list[dict[str, Any]] = []
    for g in groups:
        for pt in points:
            specs.append(
                {
                    "job": len(specs),
                    "bundles": g,
                    "point": dict(pt),
                    "route": route,
                    "overrides": {k: v for k, v in (overrides or {}).items() if v is not None},
                    "out": str(out_path),
                    "sglang_version": sglang_version,
                    "calibrate": calibrate,
                    "align_workers": align_workers,
                    "pace": pace,
                    "tokenizer": tokenizer,
                }
            )
    load_tokenizer(tokenizer)  # a bad --tokenizer fails once, before any job starts
    validate_jobs(specs)  # before anything is written: a bad point leaves no --out behind
    out_path.mkdir(parents=True, exist_ok=True)
    n = max(1, min(jobs or os.cpu_count() or 1, len(specs)))
    results: list[dict[str, Any] | None] = [None] * len(specs)
    if executor == "ray":
        results = list(
            executors.run_ray(
                specs,
                table_job,
                lambda summary, table: write_table(
                    out_path, table, summary["point"], summary["job"]
                ),
                jobs=jobs,
                on_done=on_done,
            )
        )
    elif n == 1:
        try:
            for s in specs:
                results[s["job"]] = run_job(s)
                if on_done is not None:
                    on_done(results[s["job"]])
        finally:  # the caller's process: its bundles are not kept past the sweep
            bundlecache.clear()
    else:
        with ProcessPoolExecutor(max_workers=n, mp_context=get_context("spawn")) as pool:
            futs = {pool.submit(run_job, s): s["job"] for s in specs}
            from concurrent.futures import as_completed

            for f in as_completed(futs):
                res = f.result()
                results[futs[f]] = res
                if on_done is not None:
                    on_done(res)
    done = [r for r in results if r is not None]
    (out_path / "_sweep.json").write_text(json.dumps(done, indent=1, sort_keys=True, default=str))
    return done
