"""Inferred sessions and their clients: the lanes a production replay gives its requests.

What this file owns: ``first_successors`` (each request's first successor by arrival, once
``sessions.infer_predecessors`` has linked them), ``assign_sessions`` (a chain of first
successors is one session, ``turn`` its position; a session start joins the client
``sessions.infer_clients`` finds for it, else opens a client of its own: a lane each) and
``estimated_thinks`` (the think time of a turn whose predecessor's finish the inference
estimated). ``production.complete_records`` writes them onto the records.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from kvcadence.replay.schedule import _finish
from kvcadence.replay.sessions import Node, infer_clients

#: a session start joins the client whose session ended last before it, at most this many
#: median think times (predecessor finish -> successor receive) earlier, or later when that
#: client is the only idle one (``sessions.infer_clients``, rule 2)
CLIENT_GAP_FACTOR = 10


@dataclass(slots=True)
class Sessions:
    """Each request's ``(session, turn)`` and lane (its client), and the counts."""

    session_of: dict[int, tuple[int, int]]
    lane_of: dict[int, int]
    sessions: int
    clients: int
    idle_joins: int


def first_successors(nodes: Sequence[Node], order: Sequence[int]) -> dict[int, int]:
    """Each request's first successor, by arrival (``order``)."""
    first_succ: dict[int, int] = {}
    for q in order:
        pr = nodes[q].pred
        if pr is not None and pr not in first_succ:
            first_succ[pr] = q
    return first_succ


def assign_sessions(
    nodes: Sequence[Node],
    order: Sequence[int],
    first_succ: dict[int, int],
    flushes_ns: Sequence[int],
) -> Sessions:
    """Sessions (a chain of first successors) and their clients (``sessions.infer_clients``:
    a lane each)."""
    gaps = sorted(
        nodes[q].arrival_ns - nodes[p].finish_ns  # type: ignore[operator]
        for p, q in first_succ.items()
        if nodes[p].finish_ns is not None
    )
    max_gap = CLIENT_GAP_FACTOR * gaps[len(gaps) // 2] if gaps else 0
    clients, idle_joins = infer_clients(nodes, max_gap, order, flushes_ns)
    out = Sessions({}, {}, 0, 0, idle_joins)
    session_of, lane_of = out.session_of, out.lane_of
    for i in order:
        pr = nodes[i].pred
        if pr is not None and first_succ.get(pr) == i and pr in session_of:
            s, t = session_of[pr]
            session_of[i] = (s, t + 1)
            lane_of[i] = lane_of[pr]
            continue
        session_of[i] = (out.sessions, 0)
        out.sessions += 1
        c = clients[i]
        if c is not None and c in lane_of:
            lane_of[i] = lane_of[c]
        else:
            lane_of[i] = out.clients
            out.clients += 1
    return out


def estimated_thinks(
    records: Sequence[Any],
    order: Sequence[int],
    lane_of: dict[int, int],
    times: Sequence[tuple[int | None, int | None]],
) -> dict[int, int]:
    """Think times (ns) of the requests that follow, on their client, a request whose record
    has no finish time but whose finish the inference estimated: a rebuilt request without
    a finish store (``rebuiltrows.join_rows``: its last store's publish). The schedule
    releases a closed-loop request its recorded receive less its predecessor's recorded
    finish after that predecessor's simulated finish, else ``think_ns``, else the median
    gap; the median put a request 24-28 s before its recorded receive (corpus
    ``p16-attach-midrun-http-clients``: a single that repeats a prompt sent before the
    attach, and chat turns whose previous turn ran before it, followed their rebuilt
    request's prefill by the median 42 ms), so its receive less that estimate is its think
    time instead."""
    out: dict[int, int] = {}
    last: dict[int, int] = {}  # lane -> its latest request so far (arrival order)
    for i in order:
        lane = lane_of[i]
        p = last.get(lane)
        last[lane] = i
        if p is None:
            continue
        arr, fin = times[i][0], times[p][1]
        if arr is not None and fin is not None and _finish(records[p]) is None:
            out[i] = max(0, arr - fin)
    return out


def parallel_samples(
    nodes: Sequence[Node],
    first_succ: dict[int, int],
    n_outs: Sequence[int],
    session_of: dict[int, tuple[int, int]],
) -> dict[int, tuple[int, int]]:
    """The samples of parallel requests that are not their prefill-only request's first
    successor: ``{sample: (session, turn) of that request}``. A request without output
    (SGLang's prefill-only line of an ``n > 1`` request) is followed by its samples, the
    same prompt (``sessions.infer_predecessors`` links each to it); the first continues its
    session, the others start sessions of their own, released after it all the same
    (``schedule.AFTER_KEY``)."""
    return {
        i: session_of[p]
        for i, nd in enumerate(nodes)
        if (p := nd.pred) is not None and n_outs[p] == 0 and first_succ.get(p) != i
    }
