"""DuckDB over a bundle's Parquet tables: one connection with one view per table.

``connect(ingested)`` returns an in-memory DuckDB connection where ``batches``, ``events``,
``blocks``, ``requests``, ``gaps``, ``epochs`` and ``notes`` are views over the Parquet files
written by ``kvcadence.analysis.ingest``; ``query(...)`` runs one statement and returns a
Polars DataFrame (via Arrow; DOUBLE casts are the caller's job). The thread count follows
``KVCADENCE_THREADS`` when set (benchmarks pin it to 1; ``env_threads`` validates it).

Out of core: every connection runs under ``MEMORY_LIMIT`` and spills what does not fit
(sorts, hash tables, the materialised tables) to a temporary directory of its own under the
system's temp directory (removed when the connection closes), so a report over a bundle of
any size stays within a bound instead of DuckDB's default of 80% of the machine's memory. Its
buffers come from a block allocator of the same size, kept until the connection closes.
"""

from __future__ import annotations

import os
import tempfile
from typing import Any

from kvcadence.analysis.cache import Ingested
from kvcadence.analysis.tables import tables_of
from kvcadence.errors import UsageError

THREADS_ENV = "KVCADENCE_THREADS"
#: DuckDB's memory bound per connection (beyond it, DuckDB spills to its temp directory)
MEMORY_LIMIT = "1GB"


def env_threads() -> int | None:
    """``KVCADENCE_THREADS`` as a positive int (None when unset or blank); else a UsageError.

    Commands call it before doing any work, so a bad value is one line and exit 2.
    """
    raw = os.environ.get(THREADS_ENV)
    if raw is None or not raw.strip():
        return None
    text = raw.strip()
    if not (text.isascii() and text.isdigit()) or int(text) < 1:
        raise UsageError(f"{THREADS_ENV} must be a positive integer (DuckDB threads), got {raw!r}")
    return int(text)


def connect(ing: Ingested, materialize: tuple[str, ...] = ()) -> Any:
    """An in-memory DuckDB connection with a view per table of ``ing`` (``request_ids``
    where it was built: ``ingest(..., ids=True)``).

    Tables named in ``materialize`` are loaded into memory once instead (a report runs ~70
    queries over ``batches``/``events``; re-reading Parquet for each was a third of its time).
    """
    import duckdb

    con = duckdb.connect(":memory:")
    con.sql("SET enable_progress_bar = false")  # never draw on the user's terminal
    con.sql(f"SET memory_limit = '{MEMORY_LIMIT}'")
    # DuckDB's buffers from one block allocator that keeps its pages until the connection
    # closes: its default returns them to the OS after every query, and faulting them in again
    # was ~1.2 of 1.8 system cpu-s of a 1M-event report's metrics (a VM's page faults are dear)
    con.sql(f"SET block_allocator_memory = '{MEMORY_LIMIT}'")
    spill = os.path.join(tempfile.gettempdir(), f"kvcadence-duckdb-{os.getpid()}-{id(con):x}")
    con.sql("SET temp_directory = '{}'".format(spill.replace("'", "''")))
    threads = env_threads()
    if threads is not None:
        con.sql(f"SET threads = {threads}")
    for table in tables_of(bool(ing.manifest.get("ids"))):
        path = str(ing.path(table)).replace("'", "''")
        if table in materialize:
            con.sql(f"CREATE TEMP TABLE {table} AS SELECT * FROM read_parquet('{path}')")
        else:
            con.sql(f"CREATE VIEW {table} AS SELECT * FROM read_parquet('{path}')")
    return con


def query(con: Any, sql: str, params: list[Any] | None = None) -> Any:
    """Run ``sql`` and return a Polars DataFrame; a bad statement is a UsageError."""
    import duckdb
    import polars as pl

    try:
        rel = con.sql(sql, params=params) if params else con.sql(sql)
        if rel is None:
            return pl.DataFrame()
        return rel.pl()
    except duckdb.Error as exc:
        msg = str(exc).strip().splitlines()[0]
        if "input_ids" in msg or "output_ids" in msg:
            msg += " (token ids are in the request_ids table: JOIN request_ids USING (request_id))"
        elif "request_ids" in msg:  # a connection to a cache built without it
            msg += " (request_ids is built on demand: ingest(bundle, ids=True))"
        raise UsageError(f"SQL error: {msg}") from None


def arrow(con: Any, sql: str) -> Any:
    """Run ``sql`` and return a pyarrow Table."""
    return con.sql(sql).to_arrow_table()


def rows(con: Any, sql: str) -> list[tuple[Any, ...]]:
    """Run ``sql`` and return every row (a relation: leaves no pending result behind)."""
    rel = con.sql(sql)
    return [] if rel is None else rel.fetchall()


def one(con: Any, sql: str) -> tuple[Any, ...]:
    """The first row of ``sql`` (empty tuple when none)."""
    got = rows(con, sql)
    return tuple(got[0]) if got else ()
