"""Where ingest's tables go, a chunk of rows at a time: ``ParquetSink`` and ``MemorySink``.

The record loop (``kvcadence.analysis.records``) hands each table's rows over in chunks as
it decodes them (``write(name, table)``), so what it holds is one chunk, never the bundle.
``ParquetSink`` appends every chunk to its table's Parquet file as row groups (one pyarrow
``ParquetWriter`` per table, ``tables.write_options``): ingest's memory is bounded by the
chunk size, not by the bundle. ``MemorySink`` keeps the chunks and concatenates them
(``build_tables``, tests). Both give every table they were made for (``tables.tables_of``:
the ``ON_DEMAND`` ones only when asked) on ``close``, empty ones included, with the schema of
``tables.arrow_schema``.
"""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Any

from kvcadence.analysis.tables import arrow_schema, tables_of, write_options


class ParquetSink:
    """``<dir>/<table>.parquet`` per table, written as row groups as chunks arrive."""

    def __init__(self, directory: Path, ids: bool = False, ids_budget: int | None = None) -> None:
        self.dir = directory
        self._all = tables_of(ids)
        self.tables = list(self._all)
        self.rows: dict[str, int] = dict.fromkeys(self.tables, 0)
        self._writers: dict[str, Any] = {}
        #: token ids ``request_ids`` may hold (None: any number); past it the table is
        #: dropped (``write_ids``)
        self.ids_budget = ids_budget
        self._ids = 0

    def write_ids(self, table: Any, n_ids: int) -> None:
        """``request_ids`` rows holding ``n_ids`` token ids; once the table's ids pass
        ``ids_budget`` it is dropped (its file removed, no more rows written)."""
        self._ids += n_ids
        if self.ids_budget is not None and self._ids > self.ids_budget:
            w = self._writers.pop("request_ids", None)
            if w is not None:
                _close_quietly(w)
            (self.dir / "request_ids.parquet").unlink(missing_ok=True)
            self.tables = [t for t in self.tables if t != "request_ids"]
            self.rows.pop("request_ids", None)
            return
        self.write("request_ids", table)

    def write(self, name: str, table: Any) -> None:
        w = self._writers.get(name)
        if w is None:
            import pyarrow.parquet as pq

            w = pq.ParquetWriter(
                self.dir / f"{name}.parquet", arrow_schema(name), **write_options(name)
            )
            self._writers[name] = w
        w.write_table(table)
        self.rows[name] += table.num_rows

    def close(self) -> dict[str, int]:
        """Write the tables no chunk came for (empty) and close every file; rows per table."""
        for name in self.tables:
            if name not in self._writers:
                self.write(name, arrow_schema(name).empty_table())
        try:
            for name in list(self._writers):
                self._writers[name].close()
                del self._writers[name]  # only once closed: a failed one is aborted below
        except BaseException:
            self.abort()  # a full disk mid-close: the rest closed quietly, every file removed
            raise
        return dict(self.rows)

    def abort(self) -> None:
        """Close and remove what was written (the loop starts over, or failed)."""
        for w in self._writers.values():
            _close_quietly(w)
        for name in self._all:
            (self.dir / f"{name}.parquet").unlink(missing_ok=True)
        self._writers.clear()
        self.tables = list(self._all)  # (a dropped ``request_ids`` is tried again)
        self.rows = dict.fromkeys(self.tables, 0)
        self._ids = 0


def _close_quietly(w: Any) -> None:
    """Close ``w`` discarding its error (what failed is being thrown away). A close that
    fails (a full disk) leaves pyarrow's writer marked open, and its finalizer would retry
    the close and print the error at exit: mark it closed and close the file itself."""
    try:
        w.close()
    except Exception:  # noqa: BLE001 - the file is removed next; the first error is raised
        w.is_open = False
        with contextlib.suppress(Exception):
            if w.file_handle is not None:
                w.file_handle.close()


class MemorySink:
    """The chunks kept in memory; ``close`` gives ``{name: pyarrow.Table}``."""

    def __init__(self, ids: bool = False) -> None:
        self.tables = tables_of(ids)
        self.chunks: dict[str, list[Any]] = {name: [] for name in self.tables}

    def write(self, name: str, table: Any) -> None:
        self.chunks[name].append(table)

    def write_ids(self, table: Any, n_ids: int) -> None:
        self.write("request_ids", table)

    def close(self) -> dict[str, Any]:
        import pyarrow as pa

        out = {}
        for name, parts in self.chunks.items():
            schema = arrow_schema(name)
            out[name] = pa.concat_tables(parts) if parts else schema.empty_table()
        return out

    def abort(self) -> None:
        self.chunks = {name: [] for name in self.tables}


__all__ = ["MemorySink", "ParquetSink"]
