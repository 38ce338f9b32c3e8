"""The Parquet cache of a bundle: where it lives, when it is stale, how it is rebuilt.

The tables are cached next to the bundle in ``<bundle>/.parquet/`` (or a directory the caller
names, ``check_cache_dir``) with a ``manifest.json`` holding a fingerprint of the bundle's files
(names, sizes, mtimes) and ``INGEST_VERSION``; ``ingest`` rebuilds them when either changes.
A rebuild (``kvcadence.analysis.records.write_tables``: row groups written as the bundle is
read) goes into a temporary sibling directory renamed over the old cache, so a reader never
sees half a cache. The manifest
also carries what is not a table (``Ingested.info``): header facts, the reader's report, the
trailer and ingest counters.
"""

from __future__ import annotations

import json
import os
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvcadence.analysis.cachedir import cache_write_error, default_cache
from kvcadence.analysis.outpaths import check_out_dir
from kvcadence.analysis.records import write_tables
from kvcadence.analysis.tables import tables_of
from kvcadence.errors import UsageError

INGEST_VERSION = 4
#: ``ingest(ids=None)`` keeps ``request_ids`` while its ids, as uint32, are at most this
#: many times the bundle's bytes (the fingerprint's sizes)
IDS_BUDGET = 1.0
CACHE_DIRNAME = ".parquet"
MANIFEST = "manifest.json"


@dataclass
class Ingested:
    """Where a bundle's tables are and what the manifest says about the bundle."""

    bundle: Path
    dir: Path
    manifest: dict[str, Any]
    rebuilt: bool

    def path(self, table: str) -> Path:
        return self.dir / f"{table}.parquet"

    @property
    def info(self) -> dict[str, Any]:
        info: dict[str, Any] = self.manifest["info"]
        return info


# --------------------------------------------------------------------------------------
# cache management
# --------------------------------------------------------------------------------------


def fingerprint(bundle: Path) -> list[list[Any]]:
    """Names, sizes and mtimes (ns) of the bundle's top-level files (dot-files excluded)."""
    out: list[list[Any]] = []
    for p in sorted(bundle.iterdir()):
        if p.name.startswith(".") or not p.is_file():
            continue
        st = p.stat()
        out.append([p.name, st.st_size, st.st_mtime_ns])
    return out


def _check_bundle(bundle: Path) -> None:
    if not bundle.exists():
        raise UsageError(f"bundle not found: {bundle}")
    if not bundle.is_dir():
        raise UsageError(f"not a bundle directory: {bundle}")


def _is_cache(path: Path) -> bool:
    """``path`` holds a manifest written by ``_build`` (so replacing it loses nothing)."""
    try:
        doc = json.loads((path / MANIFEST).read_text())
    except (OSError, ValueError):
        return False
    return isinstance(doc, dict) and "ingest_version" in doc


def check_cache_dir(path: str | os.PathLike[str], flag: str = "--out") -> Path:
    """A cache directory the caller named: new, empty, or an earlier cache (never anything else).

    ``_build`` replaces the whole directory, so a non-empty directory without our manifest
    (the user's own files, the bundle itself) is refused with a UsageError naming ``flag``.
    """
    p = check_out_dir(path, flag)
    if p.is_dir() and any(p.iterdir()) and not _is_cache(p):
        raise UsageError(
            f"{flag} {os.fspath(path)}: not a kvcadence Parquet cache (no {MANIFEST}) and not "
            "empty; refusing to replace it (name a new or empty directory)"
        )
    return p


def ingest(
    bundle: str | os.PathLike[str],
    out: str | os.PathLike[str] | None = None,
    *,
    force: bool = False,
    ids: bool | None = None,
) -> Ingested:
    """Make sure the Parquet tables of ``bundle`` are current; (re)build them if not.

    ``out`` overrides the cache directory (default ``<bundle>/.parquet``). ``ids``: whether
    the cache holds ``request_ids`` (``tables.ON_DEMAND``): True, always (a current cache
    without it is rebuilt with it); None (the default), while its ids are no more than
    ``IDS_BUDGET`` times the bundle's bytes (as uint32) -- small requests keep them, long
    prompts sharing their prefixes (several times the bundle) do not; False, never (a
    current cache with it serves).
    """
    bundle = Path(bundle)
    _check_bundle(bundle)
    cache = (
        check_cache_dir(out) if out is not None else default_cache(bundle, CACHE_DIRNAME, MANIFEST)
    )
    fp = fingerprint(bundle)
    man_path = cache / MANIFEST
    if not force and man_path.exists():
        try:
            manifest = json.loads(man_path.read_text())
        except (OSError, ValueError):
            manifest = None
        if (
            manifest
            and manifest.get("ingest_version") == INGEST_VERSION
            and manifest.get("fingerprint") == fp
            and (manifest.get("ids") or ids is not True)
            and all((cache / f"{t}.parquet").exists() for t in tables_of(bool(manifest.get("ids"))))
        ):
            return Ingested(bundle, cache, manifest, rebuilt=False)
    manifest = _build(bundle, cache, fp, ids)
    return Ingested(bundle, cache, manifest, rebuilt=True)


def _build(bundle: Path, cache: Path, fp: list[list[Any]], ids: bool | None) -> dict[str, Any]:
    t0 = time.perf_counter()
    cache = Path(os.path.abspath(cache))  # "." / ".." have no usable name for the temp dir
    tmp = cache.with_name(f"{cache.name}.tmp-{os.getpid()}")
    try:
        if tmp.exists():
            shutil.rmtree(tmp)
        tmp.mkdir(parents=True)
        # the tables are written as row groups while the bundle is read (bounded memory)
        budget = None if ids else int(IDS_BUDGET * sum(f[1] for f in fp)) // 4
        rows, info = write_tables(bundle, tmp, ids=ids is not False, ids_budget=budget)
        manifest = {
            "ingest_version": INGEST_VERSION,
            "ids": "request_ids" in rows,
            "bundle": str(bundle.resolve()),
            "fingerprint": fp,
            "built_s": round(time.perf_counter() - t0, 6),
            "info": info,
            "tables": rows,
        }
        (tmp / MANIFEST).write_text(json.dumps(manifest, indent=1, default=str))
        if cache.exists():
            shutil.rmtree(cache)
        os.replace(tmp, cache)
    except BaseException as exc:  # never leave a .tmp-PID directory behind
        shutil.rmtree(tmp, ignore_errors=True)
        err = cache_write_error(exc, cache)
        if err is exc:
            raise
        raise err from None
    return manifest


# --------------------------------------------------------------------------------------
# column building
# --------------------------------------------------------------------------------------
