"""The records of the requests ``unrecorded`` rebuilt, and their rows in the inference.

What this file owns: ``unrecorded_records`` (a ``RequestRecord`` per rebuilt request:
``source`` ``kv-events``, rid ``kv-events-<n>``, its outputs its finish store's, else one
token) and ``join_rows`` (those records appended to ``production._complete``'s columns, with
their nodes for the session inference).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from kvcadence.format.hashes import block_hashes
from kvcadence.format.schema import UNRECORDED_SOURCE as SOURCE
from kvcadence.format.schema import RequestRecord
from kvcadence.replay.sessions import Node
from kvcadence.replay.unrecorded import Found


def unrecorded_records(found: Found, first_rid: int = 0) -> list[Any]:
    """``RequestRecord``s of the rebuilt requests (``source`` ``SOURCE``; rid
    ``kv-events-<n>``; outputs: the finish store's, else one token)."""
    out = []
    for k, u in enumerate(found.requests, first_rid):
        n = len(u.prompt)
        outputs = u.outputs if len(u.outputs) else u.prompt.span(n - 1, n)
        meta: dict[str, Any] = {"request_received_ts": u.arrival_ns / 1e9}
        if u.finish_ns is not None:
            meta["request_finished_ts"] = u.finish_ns / 1e9
        if u.salt is not None:  # its namespace (an extra key is not on the wire: unknown)
            meta["request_parameters"] = {"cache_salt": u.salt}
        out.append(
            RequestRecord(
                rid=f"kv-events-{k}",
                input_ids=u.prompt,  # type: ignore[arg-type]  # compact, as a replay holds them
                output_ids=outputs,  # type: ignore[arg-type]
                max_new_tokens=len(outputs),
                prompt_tokens=len(u.prompt),
                completion_tokens=len(outputs),
                finish_reason="abort",
                dp_rank=u.rank if found.multi_rank else None,
                source=SOURCE,
                arrival_ns=u.arrival_ns,
                meta_info=meta,
            )
        )
    return out


def join_rows(
    lost: Found,
    ps: int,
    times: list[tuple[int | None, int | None]],
    n_outs: list[int],
    lens: list[int],
    nodes: list[Node],
    known: list[Sequence[int] | None],
) -> list[Any]:
    """The rebuilt requests' records, their rows appended to ``production._complete``'s
    columns: a
    node whose anchors are its prompt's last page and its finish store's (the prefill's
    publish time its finish when it has none: it was aborted soon after), its outputs its
    record's own."""
    recs = unrecorded_records(lost)
    for u, r in zip(lost.requests, recs, strict=True):
        fin = u.finish_ns if u.finish_ns is not None else u.prefill_ns
        times.append((u.arrival_ns, fin))
        n_outs.append(len(r.output_ids))
        lens.append(len(u.prompt))
        node = Node(u.arrival_ns, fin, path=block_hashes(u.prompt.materialize(), ps, u.salt))
        node.prompt_anchor = u.last
        node.end_anchor = u.end if u.end is not None else u.last
        # its stores' publish only bounds its abort (the client hung up, and may have sent
        # its next turn -- its prompt and the outputs it read -- before the finish store
        # went out): a request whose prompt holds its prompt may follow it from its prefill
        node.ready_ns = u.prefill_ns
        node.out_pages = u.out_pages
        node.open_tail = u.end is None
        nodes.append(node)
        known.append(None)
    return recs
