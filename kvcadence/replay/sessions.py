"""Sessions without lanes: each request's predecessor, and the client of a session start.

What this file owns: ``infer_predecessors`` and ``infer_clients``. A request Q's
predecessor is an earlier request R, finished (server-side) before Q arrived, whose stored
sequence lies deepest on Q's prompt: Q's prompt path (its prefill run and the block it
attached to, from ``outputs.StoreIndex``, or every page hash of a prompt that stored
nothing) runs through R's *end anchor* (the last block R's finish inserted: prompt +
output, page aligned) or, failing that, R's *prompt anchor* (its prompt's last full page:
the client rewrote or dropped the output). Whatever follows in Q's prompt (chat-template
tokens, the new user turn) is ignored: the longest common prefix over anchors, not strict
containment.

Ties at one anchor (identical sequences) go to an R that has no successor yet, then to the
one that finished last, then to the later index: deterministic, and nothing is read from
rid text. Limits: a context truncated or rewritten *inside* the predecessor's prompt has no
anchor on its path (a new session); a request whose cache hit ran past its predecessor's
end anchor is not linked.

``infer_clients`` links each request without a predecessor (a session start) to the
session end (a request without a successor) that finished last before it, within a gap
bound: a closed-loop client's next session (timing only).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field


@dataclass(slots=True)
class Node:
    """What the inference needs of one request."""

    arrival_ns: int
    finish_ns: int | None
    #: stored-content path of the prompt: (first page, event index, position, pages)
    segs: list[tuple[int, int, int, int]] = field(default_factory=list)
    base: int | None = None  # the block ``segs`` attached to, when they do not start at 0
    path: list[int] | None = None  # instead of ``segs``: every page hash of the prompt
    prompt_anchor: int | None = None  # hash of the prompt's last full page (when stored)
    end_anchor: int | None = None  # hash of the last page the finish inserted
    pred: int | None = None
    has_successor: bool = False


def infer_predecessors(nodes: Sequence[Node], event_hashes: Sequence[list[int]]) -> int:
    """Set ``pred`` (index into ``nodes``) on every node that has one (see module doc).

    ``event_hashes[i]``: the block hashes of stored event ``i`` (what ``segs`` point into).
    Returns how many predecessors were ambiguous: picked by the tie rule among several
    finished requests of the same kind (end / prompt anchor) at the deepest anchor."""
    ties = 0
    order = sorted(range(len(nodes)), key=lambda i: (nodes[i].arrival_ns, i))
    by_finish = sorted(
        (i for i in range(len(nodes)) if nodes[i].finish_ns is not None),
        key=lambda i: (nodes[i].finish_ns, i),
    )
    anchors: dict[int, list[tuple[int, int]]] = {}  # hash -> [(kind, index)], 0 = end
    fi = 0
    for q in order:
        node = nodes[q]
        while fi < len(by_finish) and nodes[by_finish[fi]].finish_ns <= node.arrival_ns:  # type: ignore[operator]
            r = by_finish[fi]
            fi += 1
            rn = nodes[r]
            if rn.end_anchor is not None:
                anchors.setdefault(rn.end_anchor, []).append((0, r))
            if rn.prompt_anchor is not None and rn.prompt_anchor != rn.end_anchor:
                anchors.setdefault(rn.prompt_anchor, []).append((1, r))
        if not anchors:
            continue
        keys = anchors.keys()
        hit: list[tuple[int, int]] | None = None
        for hs in _runs(node, event_hashes):  # deepest first
            if keys.isdisjoint(hs):
                continue
            for h in reversed(hs):
                hit = anchors.get(h)
                if hit:
                    break
            break
        if not hit:
            continue
        best = hit[0]
        if len(hit) > 1:
            best = min(
                hit,
                key=lambda c: (
                    c[0],
                    nodes[c[1]].has_successor,
                    -(nodes[c[1]].finish_ns or 0),
                    -c[1],
                ),
            )
            ties += sum(1 for c in hit if c[0] == best[0]) > 1
        node.pred = best[1]
        nodes[best[1]].has_successor = True
    return ties


def _runs(node: Node, event_hashes: Sequence[list[int]]) -> Iterator[Sequence[int]]:
    """The page hashes of ``node``'s prompt path in runs, deepest run first: its prefill
    segments (last first), every page hash of a prompt that stored nothing, the block its
    prefill attached to."""
    for _, ei, j, m in reversed(node.segs):
        hs = event_hashes[ei]
        yield hs if j == 0 and m == len(hs) else hs[j : j + m]
    if node.path:
        yield node.path
    if node.base is not None:
        yield (node.base,)


def infer_clients(nodes: Sequence[Node], max_gap_ns: int) -> list[int | None]:
    """For each request without a predecessor, the closed-loop client it most likely came
    from: the request that ended a session (no successor) last before it arrived, at most
    ``max_gap_ns`` earlier and not claimed by another session start. ``None`` = open loop."""
    out: list[int | None] = [None] * len(nodes)
    ends = sorted(
        (i for i, n in enumerate(nodes) if not n.has_successor and n.finish_ns is not None),
        key=lambda i: (nodes[i].finish_ns, i),
    )
    starts = sorted(
        (i for i, n in enumerate(nodes) if n.pred is None), key=lambda i: (nodes[i].arrival_ns, i)
    )
    free: list[int] = []  # session ends finished so far, unclaimed, by finish time
    ei = 0
    for q in starts:
        t = nodes[q].arrival_ns
        while ei < len(ends) and nodes[ends[ei]].finish_ns <= t:  # type: ignore[operator]
            free.append(ends[ei])
            ei += 1
        if free and t - nodes[free[-1]].finish_ns > max_gap_ns:  # type: ignore[operator]
            free.clear()  # the latest is too old: so are all the others, for every later one
        if free:
            out[q] = free.pop()
    return out
