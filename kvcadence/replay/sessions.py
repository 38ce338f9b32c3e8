"""Sessions without lanes: each request's predecessor, and the client of a session start.

What this file owns: ``infer_predecessors`` and ``infer_clients``. A request Q's
predecessor is an earlier request R, finished (server-side) before Q arrived, whose stored
sequence lies deepest on Q's prompt: Q's prompt path (its prefill run and the block it
attached to, from ``outputs.StoreIndex``, or every page hash of a prompt that stored
nothing) runs through R's *end anchor* (the last block R's finish inserted: prompt +
output, page aligned) or, failing that, R's *prompt anchor* (its prompt's last full page:
the client rewrote or dropped the output). R's whole prompt must be in Q's (``extends``:
the tokens past R's last full page, which no anchor covers, are compared too; a short
prompt's last full page can lie inside a system prompt every session shares). Whatever
follows in Q's prompt (chat-template tokens, the new user turn) is ignored: the longest
common prefix over anchors, not strict containment.

Where no anchor lies on Q's path, the block Q's prefill attached to may lie *inside* R's
finish store (``Node.out_run``): Q holds R's prompt and the first part of R's answer, then
parts from it -- a chat client sends the answer back as the worker's text of it, and that
text tokenized again need not give the same ids (a dropped special token, a merge the
tokenizer makes otherwise). That R is Q's predecessor too (as an end anchor), under the same
``extends`` check, while R has no successor yet (a later prompt through part of an answer
that has a next turn continues another request that answered the same: a repeated prompt
at temperature 0, corpus ``dp2-p8-attach-late-ring4-http-clients``) (measured on SGLang's benchmark client over ``/v1/chat/completions``,
corpus ``p4-nooverlap-chat-retok-bench-serving``: 18 of its 169 next turns were linked
without this, all 169 with it, and no other corpus capture's links moved).

Ties at one anchor (identical sequences) go to an R that has no successor yet, then to the
one that finished last, then to the later index: deterministic, and nothing is read from
rid text. Limits: a context truncated or rewritten *inside* the predecessor's prompt has no
anchor on its path (a new session); a request whose cache hit ran past its predecessor's
end anchor is not linked.

A request rebuilt from the KV events (``replay.unrecorded``: its client hung up, SGLang
aborted it and wrote no metrics line) has only its stores' publish times, which bound its
abort from above: its client may have sent the next turn before the finish store went out,
holding only part of what that store holds (the answer as far as the client read it). Its
anchors count from its prefill on (``Node.ready_ns``), and every page of its finish store is
an end anchor too (``Node.out_pages``). Measured on the corpus's captures of such clients
(``tests/replay/test_corpus.py``, ``SUCCESSORS``): the records that follow an aborted turn
and are linked to it went from 79 to 162 of 215 (2026-12-04), none linked to another. Its
receive time is an estimate (its prefill store's publish less the prefill delay of the
records prefilled around it): any request that finished before its prefill may be its
predecessor (rebuilt turns inferred over the corpus's 13 such captures: +12 toward the
clients' truth, none past it). Without a finish store its anchor is its prompt's last
stored page alone, and the prompts through it are its next turn only when they are one
conversation (``unlink_shared_open_tails``: a system prompt an aborted request was the
first to send is every later request's prefix).

``infer_clients`` links each request without a predecessor (a session start) to the
session end (a request without a successor) that finished last before it: a closed-loop
client's next session (timing only). Two ways in: (1) that end is within the think-time
bound (``max_gap_ns``); (2) it is the *only idle client* -- the one session end no later
start has joined yet, every other client being in a session -- whose session itself joined
a client (it came back before), and it came at most the median wait from a given moment to
the next session start earlier (``median_wait``: an independent, open-loop arrival would
follow a given moment that closely less often than not). A start that neither way joins
tries one augmenting step (an earlier start gives up its end when another free
end is within its own bound): the pairing that joins more starts. (2) keeps a closed-loop client
that paused long (a loaded box) from becoming a new, open-loop one; open-loop traffic leaves session ends
nobody joins, and from the first of them on no client is the only idle one.
"""

from __future__ import annotations

import math
from bisect import bisect_right
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from itertools import pairwise
from typing import cast

import numpy as np

from kvcadence.replay.anchors import Runs, add_anchors, anchor_positions, anchored_rest


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
    #: when its anchors may already be a predecessor's (before its finish): a request
    #: rebuilt from its stores, whose finish is only bounded by its stores' publish
    ready_ns: int | None = None
    #: more end anchors (kind 0): every page of a rebuilt request's finish store (its
    #: client read only part of what the worker stored before the abort landed, so the next
    #: turn's prompt holds only part of those pages)
    out_pages: list[int] | None = None
    #: its prompt's tail past its last stored page and its outputs are unknown (a rebuilt
    #: request without a finish store): the later prompts that take it for their
    #: predecessor keep it only when they are one conversation (``unlink_shared_open_tails``)
    open_tail: bool = False
    #: its finish store's run ``(event, first page, pages)`` (``outputs.StoreIndex``): a
    #: prompt whose cached prefix ends inside it holds its prompt and the first part of its
    #: answer, as far as the client's text of it tokenized back to the same ids
    out_run: tuple[int, int, int] | None = None
    pred: int | None = None
    has_successor: bool = False


def arrival_order(nodes: Sequence[Node]) -> list[int]:
    """Indices of ``nodes`` by arrival, ties by index (a stable sort of ascending indices)."""
    return sorted(range(len(nodes)), key=[n.arrival_ns for n in nodes].__getitem__)


def finish_order(nodes: Sequence[Node], among: Iterable[int]) -> list[int]:
    """Those of the ascending indices ``among`` whose node has a finish time, by finish
    time, ties by index."""
    fin = [n.finish_ns for n in nodes]
    known = cast("list[int]", fin)  # read only at the indices that have one
    return sorted([i for i in among if fin[i] is not None], key=known.__getitem__)


def infer_predecessors(
    nodes: Sequence[Node],
    hashes: np.ndarray,
    offsets: Sequence[int],
    extends: Callable[[int, int], bool] | None = None,
    order: Sequence[int] | None = None,
    by_finish: Sequence[int] | None = None,
) -> int:
    """Set ``pred`` (index into ``nodes``) on every node that has one (see module doc).

    ``hashes``: every stored event's block hashes, one array (``outputs.StoreIndex``);
    ``offsets[i]``: where stored event ``i``'s start in it (what ``segs`` point into).
    ``extends(q, r)``: whether request ``q``'s prompt holds request ``r``'s whole prompt
    (the tokens past ``r``'s last full page too); a candidate it refuses is no
    predecessor, and the next shallower anchor on the path is looked at.
    ``order``, ``by_finish``: ``arrival_order(nodes)`` and ``finish_order(nodes,
    range(len(nodes)))`` when the caller has them (else sorted here).
    Returns how many predecessors were ambiguous: picked by the tie rule among several
    finished requests of the same kind (end / prompt anchor) at the deepest anchor."""
    ties = 0
    if order is None:
        order = arrival_order(nodes)
    if by_finish is None:
        by_finish = finish_order(nodes, range(len(nodes)))
    hits, hit_hash, base_at = anchor_positions(nodes, hashes)
    anchors: dict[int, list[tuple[int, int]]] = {}  # hash -> [(kind, index)], 0 = end
    runs: Runs | None = None  # built at the first attach block it is asked about
    ready = [False] * len(nodes)  # its anchors are candidates (finished, or ready early)
    fins = cast("list[int]", [nodes[r].finish_ns for r in by_finish])  # ascending
    fi = 0
    # anchors ready before their finish (``Node.ready_ns``), by that time
    early = sorted((n.ready_ns, r) for r, n in enumerate(nodes) if n.ready_ns is not None)
    added: set[int] = set()
    ek = 0
    # a rebuilt request's arrival is an estimate (its prefill store's publish less a
    # queue's delay): any request that finished before its prefill may be its predecessor
    at = [n.arrival_ns if n.ready_ns is None else max(n.arrival_ns, n.ready_ns) for n in nodes]
    if early:
        order = sorted(order, key=at.__getitem__)  # stable: arrival order within a time
    for q in order:
        node = nodes[q]
        # (strictly before: a request's own anchors are ready at its prefill, never before
        # its arrival)
        while ek < len(early) and early[ek][0] < at[q]:
            add_anchors(anchors, nodes[early[ek][1]], early[ek][1])
            added.add(early[ek][1])
            ready[early[ek][1]] = True
            ek += 1
        if fi < len(fins) and fins[fi] <= at[q]:
            stop = bisect_right(fins, at[q], fi)
            for r in by_finish[fi:stop]:  # finished by now: their anchors become candidates
                if r not in added:
                    add_anchors(anchors, nodes[r], r)
                ready[r] = True
            fi = stop
        if not anchors:
            continue
        hit = None
        # the deepest anchor on the prompt's path first: the prefill segments' anchor
        # positions (last segment first), then (``anchors.anchored_rest``) every page hash of a
        # prompt that stored nothing, the block the prefill attached to
        for _, ei, j, m in reversed(node.segs):
            lo = offsets[ei] + j
            c = bisect_right(hits, lo + m - 1)
            while c > 0 and hits[c - 1] >= lo:
                c -= 1
                found = anchors.get(hit_hash[c])
                if found:
                    hit = [x for x in found if x[1] != q and (extends is None or extends(q, x[1]))]
                    if hit:
                        break
            if hit:
                break
        else:
            if node.path:
                for found in anchored_rest(node, anchors):
                    hit = [x for x in found if x[1] != q and (extends is None or extends(q, x[1]))]
                    if hit:
                        break
            elif node.base is not None:  # ``anchored_rest``'s only anchor here
                found = anchors.get(node.base)
                if found:
                    hit = [x for x in found if x[1] != q and (extends is None or extends(q, x[1]))]
        if not hit and node.base in base_at:
            # no anchor on the path: the prefill attached inside a finished request's
            # answer (the client's text of it tokenized back differs further on); its next
            # turn only while it has none (a later prompt through part of an answer that
            # has one continues another request that answered the same, at temperature 0)
            if runs is None:
                runs = Runs(nodes, offsets)
            hit = [
                (0, r)
                for r in runs.holding(base_at[node.base])
                if r != q
                and ready[r]
                and not nodes[r].has_successor
                and (extends is None or extends(q, r))
            ]
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


def unlink_shared_open_tails(
    nodes: Sequence[Node], holds: Callable[[int, int], bool], length: Callable[[int], int]
) -> int:
    """Unlink the requests whose predecessor has an open tail (``Node.open_tail``) when
    that predecessor's takers are not one conversation: ``holds(a, b)``, whether request
    ``a``'s prompt holds request ``b``'s whole prompt, fails for two of them (by prompt
    ``length``, each holds the one before). Its stored pages are then a prefix several prompts
    continue differently -- a system prompt the aborted request was the first to store --
    and which of them is its next turn, if any, is not known. Returns how many were
    unlinked."""
    taken: dict[int, list[int]] = {}
    for q, n in enumerate(nodes):
        if n.pred is not None and nodes[n.pred].open_tail:
            taken.setdefault(n.pred, []).append(q)
    out = 0
    for r, qs in taken.items():
        if len(qs) < 2:
            continue
        qs.sort(key=lambda q: (length(q), q))
        if all(holds(b, a) for a, b in pairwise(qs)):
            continue  # one conversation: each longer prompt holds the shorter ones
        for q in qs:
            nodes[q].pred = None
        nodes[r].has_successor = False
        out += len(qs)
    return out


def infer_clients(
    nodes: Sequence[Node],
    max_gap_ns: int,
    order: Sequence[int] | None = None,
    flushes_ns: Sequence[int] = (),
) -> tuple[list[int | None], int]:
    """For each request without a predecessor (a session start, in arrival order), the
    closed-loop client it most likely came from: the request that ended a session (no
    successor) last before it arrived and not claimed by another session start, when

    1. that end is at most ``max_gap_ns`` earlier (a think time), or
    2. that end is the only unclaimed session end so far (the one idle client: every other
       client is in a session, every earlier session end was joined), the session it ends
       itself joined a client (the client came back before), and it is at most
       ``median_wait`` of the intervals between consecutive session starts earlier
       (data-derived: an open-loop arrival lands that close after a given moment less
       often than not).

    A pause that spans a recorded cache flush (``flushes_ns``: absolute receive times) is
    counted from the last such flush: SGLang flushes only an idle worker, so every client
    was idle then, and the replay releases a client's turn that crosses a flush at its
    recorded offset from the flush (``flushes.FlushPlan``), not after a think time. Its
    bound in rule 1 is also at least the longest pause a closed-loop turn (a request with
    a predecessor) took across that flush (``_flush_pauses``): the clients demonstrably
    paused that long there, so a session start within it is a client resuming too.

    A start that finds no end within the bound, and does not join as the only idle client,
    takes one from an earlier start when that
    start can take another unclaimed end within its own bound instead (an augmenting path
    of one step: two sessions that started ms apart after two clients' ends -- the later
    start's end claimed by the earlier start -- are both closed loop, as their clients were;
    the pairing that joins more starts wins, ties as above).

    ``None`` = open loop; ``order``: ``arrival_order(nodes)`` when the caller has it.
    Returns the links and how many of them rule 2 made."""
    out: list[int | None] = [None] * len(nodes)
    ends = finish_order(nodes, [i for i, n in enumerate(nodes) if not n.has_successor])
    if order is None:
        order = arrival_order(nodes)
    starts = [i for i in order if nodes[i].pred is None]
    idle_gap: int | None = None  # rule 2's bound, computed when first needed
    free: list[int] = []  # every session end finished so far and unclaimed, by finish time
    flushes = sorted(flushes_ns)
    crossing: list[int] = []  # ``_flush_pauses``, computed when first needed

    def pause(q: int, e: int) -> tuple[int, int]:
        """``(gap, bound)``: start ``q``'s pause after session end ``e`` and its rule-1
        think-time bound."""
        t = nodes[q].arrival_ns
        since = cast("int", nodes[e].finish_ns)
        k = bisect_right(flushes, t)
        bound = max_gap_ns
        if k and flushes[k - 1] > since:
            since = flushes[k - 1]  # the pause spans a flush: counted from it
            if not crossing:
                crossing.extend(_flush_pauses(nodes, flushes))
            bound = max(bound, crossing[k - 1])
        return t - since, bound

    def fits(q: int, e: int) -> bool:
        """Rule 1: session end ``e`` within start ``q``'s think-time bound."""
        gap, bound = pause(q, e)
        return gap <= bound

    # the latest starts rule 1 joined, in arrival order (an augmenting step looks at these)
    joined: deque[int] = deque(maxlen=AUGMENT_LOOKBACK)
    ei = idle = 0
    for q in starts:
        t = nodes[q].arrival_ns
        while ei < len(ends) and nodes[ends[ei]].finish_ns <= t:  # type: ignore[operator]
            free.append(ends[ei])
            ei += 1
        if not free:
            continue
        gap, bound = pause(q, free[-1])
        if gap <= bound:
            out[q] = free.pop()
            joined.append(q)
            continue
        if len(free) == 1:
            if idle_gap is None:
                idle_gap = median_wait(
                    [nodes[b].arrival_ns - nodes[a].arrival_ns for a, b in pairwise(starts)]
                )
            if gap <= idle_gap and out[_session_start(nodes, free[0])] is not None:
                out[q] = free.pop()
                idle += 1
                continue
        if _augment(q, joined, free, out, fits, nodes):  # rule 1 after one augmenting step
            joined.append(q)
    return out, idle


#: how many of the latest rule-1 joins an augmenting step looks at
AUGMENT_LOOKBACK = 16


def _augment(
    q: int,
    joined: deque[int],
    free: list[int],
    out: list[int | None],
    fits: Callable[[int, int], bool],
    nodes: Sequence[Node],
) -> bool:
    """Join start ``q`` (no free end within its bound) by one augmenting step: an earlier
    start ``p`` (of the latest ``joined``, latest first) holds an end within ``q``'s bound
    and can take the latest free end that had finished before ``p`` arrived, when that is
    within ``p``'s bound (an older end's pause is no shorter); ``p`` moves to it, ``q``
    takes ``p``'s. True when done. ``free`` is in finish order: only the ends that finished
    after ``p`` arrived are stepped over."""
    for p in reversed(joined):
        e = out[p]
        if e is None or not fits(q, e):
            continue
        t = nodes[p].arrival_ns
        j = len(free) - 1
        while j >= 0 and cast("int", nodes[free[j]].finish_ns) > t:
            j -= 1
        if j >= 0 and fits(p, free[j]):
            out[p] = free.pop(j)
            out[q] = e
            return True
    return False


def _flush_pauses(nodes: Sequence[Node], flushes: Sequence[int]) -> list[int]:
    """For each flush (ascending receive times), the longest pause a closed-loop turn took
    across it: receive − flush over the requests whose predecessor finished before the
    flush and that arrived after it, before the next flush (0 where none did)."""
    out = [0] * len(flushes)
    for n in nodes:
        if n.pred is None:
            continue
        k = bisect_right(flushes, n.arrival_ns)
        pf = nodes[n.pred].finish_ns
        if k and pf is not None and pf <= flushes[k - 1]:
            out[k - 1] = max(out[k - 1], n.arrival_ns - flushes[k - 1])
    return out


def median_wait(intervals: Sequence[int]) -> int:
    """The median wait from a moment independent of a stream of arrivals to its next
    arrival, for arrivals ``intervals`` apart (the stream's own, observed): the smallest
    ``w`` with ``sum(min(x, w)) >= sum(intervals) / 2``. A moment falls into an interval
    of length ``x`` with a chance proportional to ``x``, and waits at most ``w`` there with
    a chance ``min(x, w) / x`` (the forward recurrence time of a renewal process). Only for
    exponential intervals (Poisson arrivals) is it the median interval itself: regular
    arrivals wait less, bunched ones (a few long pauses between bursts) longer. 0 for no
    intervals."""
    xs = sorted(intervals)
    half = sum(xs) / 2
    below = 0  # the sum of the intervals shorter than the candidate
    for k, x in enumerate(xs):
        # with w in [previous x, x]: below + w * (intervals not shorter) reaches half at
        w = (half - below) / (len(xs) - k)
        if w <= x:
            return math.ceil(w)
        below += x
    return 0  # no intervals (a non-empty list returns in the loop)


def _session_start(nodes: Sequence[Node], i: int) -> int:
    """The first request of the predecessor chain ``i`` ends."""
    while (p := nodes[i].pred) is not None:
        i = p
    return i
