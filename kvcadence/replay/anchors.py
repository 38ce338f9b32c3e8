"""Where a request's predecessor may lie on the stored blocks: the lookups of
``sessions.infer_predecessors``.

What this file owns: the anchors (``add_anchors``: a finished request's end and prompt
anchors become candidates), the stored positions a prefill segment's lookup has to look at
(``anchor_positions``: one vectorised pass over every stored hash for every node's anchors and
attach blocks), the anchored requests on a prompt that stored nothing (``anchored_rest``)
and the finish runs by position (``Runs``: which requests' answers hold a stored block).
"""

from __future__ import annotations

from bisect import bisect_right
from collections.abc import Iterable, Iterator, Sequence
from typing import TYPE_CHECKING

import numpy as np

from kvcadence.replay.sieve import matches

if TYPE_CHECKING:
    from kvcadence.replay.sessions import Node


def add_anchors(anchors: dict[int, list[tuple[int, int]]], rn: Node, r: int) -> None:
    """Request ``r``'s anchors become candidates: its end (kind 0), its prompt's (1)."""
    if rn.end_anchor is not None:
        anchors.setdefault(rn.end_anchor, []).append((0, r))
    for h in rn.out_pages or ():
        if h != rn.end_anchor:
            anchors.setdefault(h, []).append((0, r))
    if rn.prompt_anchor is not None and rn.prompt_anchor != rn.end_anchor:
        anchors.setdefault(rn.prompt_anchor, []).append((1, r))


def anchor_positions(
    nodes: Sequence[Node], hashes: np.ndarray
) -> tuple[list[int], list[int], dict[int, list[int]]]:
    """The positions in ``hashes`` holding some node's anchor (ascending), and the hash at
    each: the only places of a prefill segment a lookup has to look at; and, where some node
    has a finish run (``Node.out_run``), the positions of every prefill's attach block
    (``Node.base``) that is no anchor, by hash (among the first two lists too: a segment's
    lookup passes over a position whose hash is no anchor). Found by one vectorised pass over every stored hash
    (a table of the wanted hashes' low bits: a gather per hash), the few candidates checked
    exactly, instead of a set lookup per segment page."""
    want = {a for n in nodes for a in (n.end_anchor, n.prompt_anchor) if a is not None}
    want.update(h for n in nodes for h in n.out_pages or ())
    # (an attach block that is an anchor is looked up as one)
    bases = (
        {n.base for n in nodes if n.base is not None} - want
        if any(n.out_run for n in nodes)
        else set()
    )
    every = want | bases
    if not every or not len(hashes):
        return [], [], {}
    cand = matches(hashes, np.fromiter(every, np.int64, len(every)))
    pos, got = cand.tolist(), hashes[cand].tolist()
    base_at: dict[int, list[int]] = {}
    for p, h in zip(pos, got, strict=True):
        if h in bases:
            base_at.setdefault(h, []).append(p)
    return pos, got, base_at


class Runs:
    """Every finish run (``Node.out_run``) by its first position in the capture's hashes:
    which nodes' answers hold a stored position."""

    __slots__ = ("_runs", "_starts")

    def __init__(self, nodes: Sequence[Node], offsets: Sequence[int]) -> None:
        runs = [
            (offsets[run[0]] + run[1], run[2], r)
            for r, run in enumerate([n.out_run for n in nodes])
            if run is not None
        ]
        runs.sort()
        self._runs = runs
        self._starts = [x[0] for x in runs]

    def holding(self, positions: Iterable[int]) -> list[int]:
        """The nodes whose finish run holds one of ``positions`` (runs do not overlap but
        where two nodes claimed the same one)."""
        out: list[int] = []
        runs = self._runs
        for p in positions:
            k = bisect_right(self._starts, p)
            if not k:
                continue
            start = runs[k - 1][0]
            while k and runs[k - 1][0] == start:
                k -= 1
                if p < start + runs[k][1]:
                    out.append(runs[k][2])
        return out


def anchored_rest(
    node: Node, anchors: dict[int, list[tuple[int, int]]]
) -> Iterator[list[tuple[int, int]]]:
    """The anchored requests on ``node``'s prompt path past its prefill segments (which
    ``sessions.infer_predecessors`` looks at first: only their anchor positions), deepest first:
    every page hash of a prompt that stored nothing, then the block its prefill attached
    to."""
    if node.path:
        if not anchors.keys().isdisjoint(node.path):
            for h in reversed(node.path):
                hit = anchors.get(h)
                if hit:
                    yield hit
    if node.base is not None:
        hit = anchors.get(node.base)
        if hit:
            yield hit
