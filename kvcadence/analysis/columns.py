"""Columns -> pyarrow tables: what the record loop (``kvcadence.analysis.records``) gathered,
with everything derivable (event/batch ids, positions, block and token counts, per-message
kind counts, first/last hashes, block token counts) computed with numpy, one function per
table of ``kvcadence.analysis.tables.TABLES``.
"""

from __future__ import annotations

from array import array
from pathlib import Path
from typing import Any

from kvcadence.analysis.tables import (
    K_CLEARED,
    K_REMOVED,
    K_STORED,
    K_UNKNOWN,
    KINDS,
    arrow_schema,
)
from kvcadence.analysis.tokcols import RawIdColumns
from kvcadence.errors import InputError
from kvcadence.format.schema import RequestRecord, RequestRecordU32View, RequestRecordView

#: a column as the record loop hands it over: an ``array('q')``/``array('b')`` or a numpy array
Column = Any


def as_numpy(a: Any, dtype: str = "int64") -> Any:
    """An ``array`` (no copy) or numpy array as a numpy array of ``dtype``."""
    import numpy as np

    if isinstance(a, np.ndarray):
        return a.astype(dtype, copy=False)
    src = {"q": np.int64, "b": np.int8}[a.typecode]
    return np.frombuffer(a, dtype=src).astype(dtype, copy=False) if len(a) else np.zeros(0, dtype)


def _kind_array(codes: Any) -> Any:
    import pyarrow as pa

    return pa.DictionaryArray.from_arrays(
        pa.array(codes, type=pa.int8()), pa.array(list(KINDS), type=pa.string())
    )


class EventColumns:
    """The per-event columns of one ingest plus the numpy arrays derived from them."""

    def __init__(
        self,
        kind: Column,
        n_blocks: Column,
        medium: list[str | None],
        stored: tuple[Column, list[int | None], Column, Column, list[int | None]],
        unknown: list[tuple[int, str]],
        hashes: Column,
        per_batch: Column,
    ) -> None:
        import numpy as np

        self.n = len(kind)
        self.kind = as_numpy(kind, "int8")
        self.n_blocks = as_numpy(n_blocks)
        self.medium = medium
        self.hashes = as_numpy(hashes)
        self.per_batch = as_numpy(per_batch)
        nb = len(per_batch)
        self.batch_of = np.repeat(np.arange(nb, dtype=np.int64), self.per_batch)
        starts = np.zeros(nb + 1, dtype=np.int64)
        np.cumsum(self.per_batch, out=starts[1:])
        self.idx = np.arange(self.n, dtype=np.int64) - starts[:-1][self.batch_of]
        self.off = np.zeros(self.n + 1, dtype=np.int64)
        np.cumsum(self.n_blocks, out=self.off[1:])
        # stored-only fields, scattered to full-length columns with a null mask
        st_idx, self.st_parent, st_bs, st_ntok, self.st_lora = stored
        self.st_idx = as_numpy(st_idx)
        self.st_bs = as_numpy(st_bs)
        self.st_ntok = as_numpy(st_ntok)
        self.unknown = unknown

    def counts_per_batch(self, code: int) -> Any:
        import numpy as np

        return np.bincount(self.batch_of[self.kind == code], minlength=len(self.per_batch)).astype(
            np.int32
        )

    def scatter(self, idx: Any, values: Any, typ: Any) -> Any:
        """A full-length arrow column: ``values`` (None = null) at rows ``idx``, null elsewhere."""
        import numpy as np
        import pyarrow as pa

        valid = np.ones(len(idx), dtype=bool)
        if not isinstance(values, np.ndarray):
            got = pa.array(values, type=pa.int64())
            if got.null_count:
                valid = got.is_valid().to_numpy(zero_copy_only=False)
            values = got.fill_null(0).to_numpy()
        full = np.zeros(self.n, dtype=np.int64)
        full[idx] = values
        mask = np.ones(self.n, dtype=bool)
        mask[idx[valid]] = False
        return pa.array(full, mask=mask).cast(typ)


def batches_table(
    b: dict[str, Column],
    ev: EventColumns,
    ts: list[float | None],
    via: Column,
    pidx: Column,
    nbytes: Column,
    ok: list[bool],
    base: int = 0,
) -> Any:
    """``base``: the batch id of the first row (a chunk of a streamed ingest)."""
    import numpy as np
    import pyarrow as pa

    n = len(b["seq"])
    cols = [
        pa.array(np.arange(base, base + n, dtype=np.int64)),
        pa.array(as_numpy(b["endpoint"], "int32")),
        pa.array(as_numpy(b["rank"], "int32")),
        pa.array(as_numpy(b["epoch"], "int32")),
        pa.array(as_numpy(b["seq"])),
        pa.array(as_numpy(b["recv"])),
        pa.array(ts, type=pa.float64()),
        pa.array(as_numpy(b["nev"], "int32")),
        pa.array(ev.counts_per_batch(K_STORED)),
        pa.array(ev.counts_per_batch(K_REMOVED)),
        pa.array(ev.counts_per_batch(K_CLEARED)),
        pa.array(ev.counts_per_batch(K_UNKNOWN)),
        pa.array(as_numpy(via, "int8")),
        pa.array(as_numpy(pidx)),
        pa.array(as_numpy(nbytes)),
        pa.array(ok, type=pa.bool_()),
    ]
    return pa.Table.from_arrays(cols, schema=arrow_schema("batches"))


def events_table(ev: EventColumns, b: dict[str, Column], ev_base: int = 0, b_base: int = 0) -> Any:
    """``ev_base``/``b_base``: the event and batch ids of the chunk's first rows."""
    import numpy as np
    import pyarrow as pa

    n = ev.n
    bo = ev.batch_of
    has = ev.n_blocks > 0
    nz = np.flatnonzero(has)
    first = ev.hashes[ev.off[:-1][nz]] if len(nz) else np.zeros(0, np.int64)
    last = ev.hashes[ev.off[1:][nz] - 1] if len(nz) else np.zeros(0, np.int64)
    un_idx = np.fromiter((r[0] for r in ev.unknown), np.int64, len(ev.unknown))
    tags: list[str | None] = [None] * n
    for i, tag in ev.unknown:
        tags[i] = tag
    arrays = [
        pa.array(np.arange(ev_base, ev_base + n, dtype=np.int64)),
        pa.array(bo + b_base if b_base else bo),
        pa.array(as_numpy(b["endpoint"], "int32")[bo]),
        pa.array(as_numpy(b["rank"], "int32")[bo]),
        pa.array(as_numpy(b["epoch"], "int32")[bo]),
        pa.array(as_numpy(b["seq"])[bo]),
        pa.array(ev.idx.astype(np.int32)),
        pa.array(as_numpy(b["recv"])[bo]),
        _kind_array(ev.kind),
        pa.array(ev.medium, type=pa.string()),
        pa.array(ev.n_blocks.astype(np.int32)),
        ev.scatter(ev.st_idx, ev.st_parent, pa.int64()).view(pa.uint64()),
        ev.scatter(nz, first, pa.int64()).view(pa.uint64()),
        ev.scatter(nz, last, pa.int64()).view(pa.uint64()),
        ev.scatter(ev.st_idx, ev.st_bs, pa.int32()),
        ev.scatter(ev.st_idx, ev.st_ntok, pa.int64()),
        ev.scatter(ev.st_idx, ev.st_lora, pa.int64()),
        pa.array(tags, type=pa.string()) if len(un_idx) else pa.nulls(n, pa.string()),
    ]
    return pa.Table.from_arrays(arrays, schema=arrow_schema("events"))


def blocks_table(ev: EventColumns, ev_base: int = 0) -> Any:
    """Long-form blocks: event id, kind, position, hash, tokens in the block (vectorised).
    ``ev_base``: the event id of the chunk's first event."""
    import numpy as np
    import pyarrow as pa

    bs = np.zeros(ev.n, dtype=np.int64)
    nt = np.zeros(ev.n, dtype=np.int64)
    bs[ev.st_idx] = ev.st_bs
    nt[ev.st_idx] = ev.st_ntok
    # in place where possible: every temporary here is one int64 per block (5M+ at 1M events)
    event_of = np.repeat(np.arange(ev.n, dtype=np.int64), ev.n_blocks)
    pos = np.arange(len(event_of), dtype=np.int64)
    pos -= ev.off[:-1][event_of]
    pos32 = pos.astype(np.int32)
    kinds = ev.kind[event_of]
    not_stored = kinds != K_STORED
    bs_b = bs[event_of]
    tokens = nt[event_of]
    pos *= bs_b
    tokens -= pos  # nt - pos * bs
    del pos
    np.minimum(bs_b, tokens, out=tokens)
    del bs_b
    cols = [
        pa.array(event_of + ev_base if ev_base else event_of),
        _kind_array(kinds),
        pa.array(pos32),
        pa.array(ev.hashes).view(pa.uint64()),
        pa.array(tokens.astype(np.int32), mask=not_stored),
    ]
    return pa.Table.from_arrays(cols, schema=arrow_schema("blocks"))


def _id_lists(chunks: list[tuple[Any, Any]]) -> Any:
    """Chunks of (flat ids, per-row lengths) -> an arrow list<int64> column (one chunk each:
    no copy of the ids) and the row lengths (one int64 array)."""
    import numpy as np
    import pyarrow as pa

    arrays = []
    for flat, lens in chunks:
        off = np.zeros(len(lens) + 1, dtype=np.int64)
        np.cumsum(lens, out=off[1:])
        arrays.append(pa.ListArray.from_arrays(pa.array(off, type=pa.int32()), pa.array(flat)))
    lens = [n for _, n in chunks]
    return (
        pa.chunked_array(arrays, type=pa.list_(pa.int64())),
        np.concatenate(lens) if lens else np.zeros(0, np.int64),
    )


class RequestColumns:
    """Request rows (``msgspec.structs.astuple`` of RequestRecord, RequestRecordView or
    RequestRecordU32View) -> columns, a chunk of rows at a time: the hot loop appends to
    ``rows`` and calls ``flush`` once ``len(rows) >= batch``; the chunk is transposed while
    its rows are still in cache.

    Token ids: views -> ``tokcols.RawIdColumns`` (numpy from the raw msgpack or the packed
    requests' uint32 arrays; raises ``NotInt64Arrays`` if any id is not an int64); RequestRecord lists -> ``array('q')``
    (an id beyond int64 is an ``InputError`` naming the request).
    """

    def __init__(self, bundle: Path, views: bool) -> None:
        for cls in (RequestRecord, RequestRecordView, RequestRecordU32View):
            if cls.__struct_fields__ != RequestRecord.__struct_fields__:
                raise AssertionError("RequestRecord field order changed")  # pragma: no cover
        self.bundle = bundle
        self.names = [f for f in RequestRecord.__struct_fields__ if f not in _ID_FIELDS]
        self.cols: list[list[Any]] = [[] for _ in self.names]
        self.rows: list[tuple[Any, ...]] = []
        self.raw_ids = RawIdColumns() if views else None
        self.batch = self.raw_ids.batch if self.raw_ids is not None else 4096
        self.lists: tuple[list[tuple[Any, Any]], list[tuple[Any, Any]]] = ([], [])
        #: rows and token ids converted since the last ``reset`` (a chunk of the table)
        self.pending_rows = 0
        self.pending_ids = 0

    def flush(self) -> None:
        if not self.rows:
            return
        cols = list(zip(*self.rows, strict=True))
        self.pending_rows += len(self.rows)
        self.rows.clear()
        if self.raw_ids is not None:
            self.pending_ids += self.raw_ids.add_chunk(cols[1], cols[2])
            self.batch = self.raw_ids.batch
        else:
            for side, ids in ((0, cols[1]), (1, cols[2])):
                flat, lens = array("q"), array("q")
                for rid, x in zip(cols[0], ids, strict=True):
                    try:
                        flat.extend(x)
                    except OverflowError:
                        raise InputError(
                            f"{self.bundle}: request {rid!r}: a token id is outside the int64 range"
                        ) from None
                    lens.append(len(x))
                self.lists[side].append((as_numpy(flat), as_numpy(lens)))
                self.pending_ids += len(flat)
        for dst, col in zip(self.cols, cols[:1] + cols[3:], strict=True):
            dst.extend(col)

    def reset(self) -> None:
        """Forget the converted rows (after ``requests_table`` wrote them)."""
        for c in self.cols:
            c.clear()
        for side in self.lists:
            side.clear()
        if self.raw_ids is not None:
            self.raw_ids.clear()
        self.pending_rows = self.pending_ids = 0

    def token_ids(self) -> tuple[list[tuple[Any, Any]], list[tuple[Any, Any]]]:
        """(input chunks, output chunks), each chunk (flat int64 ids, int64 row lengths)."""
        return self.raw_ids.columns() if self.raw_ids is not None else self.lists


_ID_FIELDS = ("input_ids", "output_ids")


def requests_table(reqs: RequestColumns, base: int = 0) -> Any:
    """The requests table from the request columns, with their token ids' lengths (the rows
    converted since the last ``reset``; ``base``: the request id of the first); the ids
    themselves are ``request_ids_table``'s."""
    import msgspec
    import numpy as np
    import pyarrow as pa

    cols = dict(zip(reqs.names, reqs.cols, strict=True))
    n = len(cols["rid"])

    def col(name: str, typ: Any) -> Any:
        c = cols[name]
        if c and c[0] is None and c.count(None) == len(c):
            return pa.nulls(len(c), typ)  # a field no request has (no per-value conversion)
        return pa.array(c, type=typ)

    _, n_in, n_out = _token_columns(reqs, n)
    enc = msgspec.json.encode
    # an empty meta_info (most request sources) is "{}" without an encode call per row
    meta = pa.array([enc(m).decode() if m else "{}" for m in cols["meta_info"]], type=pa.string())
    arrays = [
        pa.array(np.arange(base, base + n, dtype=np.int64)),
        col("rid", pa.string()),
        pa.array(n_in),
        pa.array(n_out),
        col("send_ns", pa.int64()),
        col("first_token_ns", pa.int64()),
        col("finish_ns", pa.int64()),
        col("lane", pa.int64()),
        col("session", pa.int64()),
        col("turn", pa.int64()),
        col("max_new_tokens", pa.int64()),
        col("prompt_tokens", pa.int64()),
        col("cached_tokens", pa.int64()),
        col("completion_tokens", pa.int64()),
        col("finish_reason", pa.string()),
        col("error", pa.string()),
        col("dp_rank", pa.int64()),
        col("source", pa.string()),
        col("think_ns", pa.int64()),
        col("arrival_ns", pa.int64()),
        meta,
    ]
    return pa.Table.from_arrays(arrays, schema=arrow_schema("requests"))


def request_ids_table(reqs: RequestColumns, base: int = 0) -> Any:
    """The request_ids table (``tables.ON_DEMAND``) of the rows ``requests_table`` writes."""
    import numpy as np
    import pyarrow as pa

    n = reqs.pending_rows
    (inp, out), _, _ = _token_columns(reqs, n)
    arrays = [pa.array(np.arange(base, base + n, dtype=np.int64)), inp, out]
    return pa.Table.from_arrays(arrays, schema=arrow_schema("request_ids"))


def _token_columns(reqs: RequestColumns, n: int) -> tuple[tuple[Any, Any], Any, Any]:
    """``((input_ids, output_ids) as list arrays, n_input, n_output)`` of ``n`` rows."""
    import numpy as np
    import pyarrow as pa

    inp_ids, out_ids = reqs.token_ids()
    if not n:
        empty = pa.array([], type=pa.list_(pa.int64()))
        return (empty, empty), np.zeros(0, np.int64), np.zeros(0, np.int64)
    inp, n_in = _id_lists(inp_ids)
    out, n_out = _id_lists(out_ids)
    return (inp, out), n_in, n_out


def gaps_table(gaps: list[Any]) -> Any:
    import pyarrow as pa

    data = {
        "endpoint": [g.endpoint for g in gaps],
        "epoch": [g.epoch for g in gaps],
        "first_seq": [g.first_seq for g in gaps],
        "last_seq": [g.last_seq for g in gaps],
        "n_missing": [g.last_seq - g.first_seq + 1 for g in gaps],
        "recovered": [g.recovered for g in gaps],
        "reason": [g.reason for g in gaps],
        "recv_ns": [g.recv_ns for g in gaps],
    }
    return pa.Table.from_pydict(data, schema=arrow_schema("gaps"))


def epochs_table(epochs: list[Any]) -> Any:
    import pyarrow as pa

    data = {
        "endpoint": [e.endpoint for e in epochs],
        "epoch": [e.epoch for e in epochs],
        "first_seq": [e.first_seq for e in epochs],
        "recv_ns": [e.recv_ns for e in epochs],
        "reason": [e.reason for e in epochs],
    }
    return pa.Table.from_pydict(data, schema=arrow_schema("epochs"))


def notes_table(notes: list[Any]) -> Any:
    import msgspec
    import pyarrow as pa

    data = {
        "kind": [n.kind for n in notes],
        "recv_ns": [n.recv_ns for n in notes],
        "data": [msgspec.json.encode(n.data).decode() for n in notes],
    }
    return pa.Table.from_pydict(data, schema=arrow_schema("notes"))
