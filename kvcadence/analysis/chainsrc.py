"""Where the request page hashing (``pages``) reads each request's chain from, a batch of
requests at a time: ``(flat chain ids as int64, their row offsets, lanes, sessions)``.

What this file owns: the two sources of a chain ``input_ids + output_ids[:-1]`` cut to
whole pages --

* ``parquet_batches``: the cache's ``request_ids`` table, where the ingest kept it (small
  requests: ``cache.IDS_BUDGET``), read by DuckDB (list slicing in C++), checked to come in
  request order (``Unordered``: the caller reads it ``ORDERED``);
* ``bundle_batches``: the bundle's own request records (``BundleReader.request_arrays``: a
  packed request's ids are the reader's uint32 arrays rebuilt from the prefix it shares, no
  list of ints), where the cache dropped ``request_ids`` (long prompts sharing prefixes:
  several times the bundle as a column); each batch checked against the ingested lengths;
* ``bundle_chains``: the same records' chains of a few requests alone (the drill-down's).
"""

from __future__ import annotations

from array import array as array_type
from collections.abc import Iterator
from typing import Any

from kvcadence.analysis import sql
from kvcadence.analysis.cache import Ingested
from kvcadence.analysis.records import open_reader
from kvcadence.errors import BundleError


class Unordered(Exception):
    """A scan of ``request_ids`` came out of request order (read it sorted)."""


ORDERED = " ORDER BY request_id"


def parquet_batches(con: Any, ps: int, rows: int, order: str) -> Iterator[tuple[Any, ...]]:
    """``bundle_batches``' batches from the cache's ``request_ids`` (DuckDB's list slicing,
    in C++); raises ``Unordered`` when the scan is not in request order."""
    import numpy as np

    meta = sql.arrow(con, "SELECT lane, session FROM requests ORDER BY request_id")
    lanes, sessions = meta.column(0).to_pylist(), meta.column(1).to_pylist()
    query = (
        "SELECT request_id, (input_ids || output_ids[1:len(output_ids) - 1])"
        f"[1:((len(input_ids) + greatest(len(output_ids) - 1, 0)) // {ps}) * {ps}] AS chain "
        f"FROM request_ids{order}"
    )
    at = 0
    for b in con.sql(query).to_arrow_reader(rows):
        if b.num_rows == 0:
            continue
        rid = b.column("request_id").to_numpy()
        if rid[0] != at or not (np.diff(rid) == 1).all():
            raise Unordered
        end = at + b.num_rows
        cv, co = flat_lists(b.column("chain"))
        yield cv, co, lanes[at:end], sessions[at:end]
        at = end


def bundle_batches(ing: Ingested, con: Any, ps: int, rows: int) -> Iterator[tuple[Any, ...]]:
    """``(flat chain tokens as int64, their row offsets, lanes, sessions)`` of ``rows``
    requests at a time, in request order: each request's chain ``input_ids +
    output_ids[:-1]`` cut to whole pages, read from the bundle's request records as the
    ingest read them (``BundleReader.request_arrays``: a packed request's ids are the
    reader's uint32 arrays, rebuilt from its shared prefix, never a list of ints) -- not
    from a token column of the cache, which holds no prefix sharing (at production size it
    was several times the bundle). Each record is checked against its ``requests`` row
    (the same lengths: the ingest's request order); requests a live capture appended since
    the ingest are left out, as its tables leave them, and a bundle that lost requests or
    whose requests differ is a ``BundleError``."""
    import numpy as np

    lens = sql.arrow(con, "SELECT n_input, n_output FROM requests ORDER BY request_id")
    n_in = lens.column(0).to_numpy(zero_copy_only=False)
    n_out = lens.column(1).to_numpy(zero_copy_only=False)
    n = len(n_in)
    # a batch: its records' ids as read, input then output, in runs of uint32 arrays (each
    # array appended as it is: a copy of its bytes, no slicing and no numpy call a record)
    # and int64 arrays (a record whose ids are not uint32: a 1.x list, a wide id); each
    # chain (the first ``m`` of a record's ids) is cut out with numpy, a batch at once
    parts: list[Any] = []
    run = array_type("I")
    got_in = array_type("q")  # the records' lengths, checked against the ingest's per batch
    got_out = array_type("q")
    lanes: list[Any] = []
    sessions: list[Any] = []
    in_part: list[int] = []  # each record's part (``run``: the next, ``len(parts)``)
    at_in_part: list[int] = []  # ... and where its ids start in it
    start = 0  # the batch's first request

    def batch() -> tuple[Any, ...]:
        nonlocal run, start, got_in, got_out
        li = np.frombuffer(got_in, np.int64)
        lo = np.frombuffer(got_out, np.int64)
        end = start + len(li)
        if not (np.array_equal(li, n_in[start:end]) and np.array_equal(lo, n_out[start:end])):
            raise _changed(ing)
        if run:
            parts.append(run)
        m = (li + np.maximum(lo - 1, 0)) // ps * ps  # each chain's ids
        co = np.zeros(len(li) + 1, dtype=np.int64)
        np.cumsum(m, out=co[1:])
        # each chain cut from its part (views; one copy into the batch's int64 ids)
        flats = [np.frombuffer(p, np.uint32) if type(p) is array_type else p for p in parts]
        cuts = [
            flats[q][at : at + k] for q, at, k in zip(in_part, at_in_part, m.tolist(), strict=True)
        ]
        cv = np.concatenate(cuts).astype(np.int64) if cuts else np.zeros(0, dtype=np.int64)
        out = (cv, co, lanes.copy(), sessions.copy())
        del flats, cuts  # (views of ``run``: released before it is replaced)
        parts.clear()
        run = array_type("I")
        got_in, got_out = array_type("q"), array_type("q")  # (``li``, ``lo`` view the old)
        in_part.clear()
        at_in_part.clear()
        lanes.clear()
        sessions.clear()
        start = end
        return out

    i = 0
    code = run.typecode
    for r in open_reader(ing.bundle).request_arrays():
        if i == n:
            break  # requests a capture appended since the ingest: not in its tables
        inp, outs = r.input_ids, r.output_ids
        if (
            type(inp) is array_type
            and type(outs) is array_type
            and inp.typecode == code
            and outs.typecode == code
        ):
            in_part.append(len(parts))
            at_in_part.append(len(run))
            run.extend(inp)
            run.extend(outs)
        else:  # ids that are not uint32 arrays: this record's as int64
            if run:
                parts.append(run)
                run = array_type("I")
            in_part.append(len(parts))
            at_in_part.append(0)
            parts.append(np.array([*inp, *outs], dtype=np.int64))
        got_in.append(len(inp))
        got_out.append(len(outs))
        lanes.append(r.lane)
        sessions.append(r.session)
        i += 1
        if len(got_in) >= rows:
            yield batch()
    if i != n:
        raise _changed(ing)
    if got_in:
        yield batch()


def bundle_chains(ing: Ingested, con: Any, ps: int, want: list[int]) -> Iterator[tuple[int, Any]]:
    """``(request, its chain as int64 ids, cut to whole pages)`` of each request in ``want``
    (ascending; the drill-down's few: no batch of the others' ids built), read from the bundle's records and checked against its ``requests`` row (a
    bundle whose requests changed since the ingest: ``BundleError``)."""
    import numpy as np

    lens = dict(
        con.sql(
            "SELECT request_id, [n_input, n_output] FROM requests WHERE request_id IN "
            f"({', '.join(str(int(r)) for r in want)})"
        ).fetchall()
    )
    k = 0
    for i, rec in enumerate(open_reader(ing.bundle).request_arrays()):
        if i != want[k]:
            continue
        inp, outs = rec.input_ids, rec.output_ids
        if lens.get(i) != [len(inp), len(outs)]:
            raise _changed(ing)
        m = (len(inp) + max(len(outs) - 1, 0)) // ps * ps
        ids = np.concatenate([np.asarray(inp, dtype=np.int64), np.asarray(outs, dtype=np.int64)])
        yield i, ids[:m]
        k += 1
        if k == len(want):
            return
    raise _changed(ing)


def _changed(ing: Ingested) -> BundleError:
    """The error of a bundle whose requests are not its tables' any more."""
    return BundleError(f"{ing.bundle}: the bundle changed since its tables were built: run again")


def flat_lists(col: Any) -> tuple[Any, Any]:
    """A list<int64> column (Array or ChunkedArray, no nulls) as (flat int64 values, offsets
    from 0), with one copy of the values (no ``combine_chunks``)."""
    import numpy as np
    import pyarrow.compute as pc

    lens = pc.list_value_length(col).to_numpy(zero_copy_only=False).astype(np.int64)
    off = np.zeros(len(lens) + 1, dtype=np.int64)
    np.cumsum(lens, out=off[1:])
    vals = pc.list_flatten(col)
    vals = vals.to_numpy() if hasattr(vals, "chunks") else vals.to_numpy(zero_copy_only=False)
    return np.asarray(vals, dtype=np.int64), off
