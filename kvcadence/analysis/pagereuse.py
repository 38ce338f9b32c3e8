"""Reusing request page digests across requests, for ``kvcadence.analysis.pages``.

What this file owns: what a request's page hashing may start from instead of the root --
``Carry`` (a session's latest chain and digests, keyed by ``(lane, session)``), ``Recent``
(the latest requests' chains and digests by their first tokens: content, for requests with
no session to extend, every request of a production capture) and ``longest_prefix`` (the
longest such chain that is a whole-page prefix of a request's, or has it as one). Both
carries are bounded by ``CARRY_BYTES``: neither grows with the capture. A digest is a
function of the tokens alone, so any reuse gives the hashes hashing from the root would.
"""

from __future__ import annotations

from typing import Any

import numpy as np

#: bytes of the session reuse carried between batches (each session's latest chain and
#: digests), least recently used sessions dropped beyond it: the carry grew with every
#: session of the capture (a dropped session's next turn is hashed from the root: the same
#: hashes)
CARRY_BYTES = 1 << 27


class Digests:
    """A chain's page digests, prefix-shared: its first ``m`` pages' are ``base``'s (another
    ``Digests``; None when ``m`` is 0), the rest ``own`` (a ``(pages - m, 32)`` uint8 array).
    A session's turns each hold only their new pages' digests (copying every turn's whole
    chain was most of the page hashing of a production capture at page size 1: 100k-page
    prompts, 3.2 MB of digests each, copied twice a request)."""

    __slots__ = ("base", "m", "own", "pages")

    def __init__(self, base: Digests | None, m: int, own: Any) -> None:
        self.base = base
        self.m = m
        self.own = own
        self.pages = m + len(own)

    @property
    def nbytes(self) -> int:
        """The bytes of the digests it stands for (what the carries count: shared or not)."""
        return 32 * self.pages

    def get(self, lo: int, hi: int) -> Any:
        """Pages ``lo`` .. ``hi``'s digests, a ``(hi - lo, 32)`` uint8 array."""
        out = np.empty((max(0, hi - lo), 32), dtype=np.uint8)
        node: Digests | None = self
        top = hi
        while top > lo and node is not None:
            if top > node.m:
                s = max(lo, node.m)
                out[s - lo : top - lo] = node.own[s - node.m : top - node.m]
                top = s
            node = node.base
        if top > lo:
            raise ValueError(f"pages {lo}..{top} are not in the chain")
        return out


class Carry:
    """The session reuse carried from batch to batch: ``(lane, session)`` -> (pages, chain
    words, digests) of the session's latest row, within ``CARRY_BYTES`` (the least recently
    used sessions dropped first)."""

    def __init__(self, limit: int | None = None) -> None:
        from collections import OrderedDict

        self.limit = CARRY_BYTES if limit is None else limit
        self.items: OrderedDict[tuple[Any, Any], tuple[int, bytes, Any]] = OrderedDict()
        self.bytes = 0

    def get(self, key: tuple[Any, Any]) -> tuple[int, bytes, Any] | None:
        return self.items.get(key)

    def put(self, key: tuple[Any, Any], k: int, words: bytes, digests: Any) -> None:
        old = self.items.pop(key, None)
        if old is not None:
            self.bytes -= len(old[1]) + old[2].nbytes
        self.items[key] = (k, words, digests)
        self.bytes += len(words) + digests.nbytes
        while self.bytes > self.limit and len(self.items) > 1:
            _, (_, w, d) = self.items.popitem(last=False)
            self.bytes -= len(w) + d.nbytes


#: tokens of a chain's start that key the content reuse (``Recent``): rows are compared only
#: with recent rows that start alike (a shared system prompt keys them all together)
HEAD_TOKENS = 16
#: rows of one head compared at most (the latest): more than a worker's concurrent sessions
HEAD_CANDIDATES = 256
#: rows of a batch carried to the next for content reuse at most (the latest)
RECENT_ROWS = 1024


def head_pages(page_size: int) -> int:
    """Whole pages of a chain's start that key the content reuse: ``HEAD_TOKENS`` rounded up."""
    return max(1, -(-HEAD_TOKENS // max(1, page_size)))


class Recent:
    """The content reuse carried from batch to batch: the latest rows' (pages, chain words,
    digests) by head (their first ``head_pages`` pages' words), at most ``HEAD_CANDIDATES``
    a head and ``CARRY_BYTES`` in all (the least recently added dropped first)."""

    def __init__(self, limit: int | None = None) -> None:
        from collections import OrderedDict

        self.limit = CARRY_BYTES if limit is None else limit
        self.items: OrderedDict[int, tuple[bytes, int, bytes, Any]] = OrderedDict()
        self.by_head: dict[bytes, list[int]] = {}
        self.bytes = 0
        self._next = 0

    def candidates(self, head: bytes) -> list[tuple[int, bytes, Any]]:
        """``(pages, words, digests)`` of the rows carried for ``head``, oldest first."""
        ids = self.by_head.get(head)
        if not ids:
            return []
        items = self.items
        return [items[i][1:] for i in ids]  # (digests: a ``Digests``)

    def put(self, head: bytes, k: int, words: bytes, digests: Any) -> None:
        i = self._next
        self._next += 1
        self.items[i] = (head, k, words, digests)
        self.bytes += len(words) + digests.nbytes
        ids = self.by_head.setdefault(head, [])
        ids.append(i)
        if len(ids) > HEAD_CANDIDATES:
            self._drop(ids[0])
        while self.bytes > self.limit and len(self.items) > 1:
            self._drop(next(iter(self.items)))

    def _drop(self, i: int) -> None:
        head, _, words, digests = self.items.pop(i)
        self.bytes -= len(words) + digests.nbytes
        ids = self.by_head[head]
        ids.remove(i)
        if not ids:
            del self.by_head[head]


def longest_prefix(
    buf: bytes,
    a: int,
    k: int,
    step: int,
    pol: list[int],
    npl: list[int],
    prev_same: list[int],
    q: int,
    carried: list[tuple[int, bytes, Any]],
) -> tuple[int, Any]:
    """``(pages, source)`` of the longest candidate whose chain is a whole-page prefix of the
    row at byte ``a`` of ``buf`` (``k`` pages of ``step`` bytes), or has that row's as one:
    this batch's rows under the same head, from row ``q`` back along ``prev_same`` (at most
    ``HEAD_CANDIDATES``; a row's words at ``step * pol[row]``, ``npl[row]`` pages) -- the
    row --, then the carried ``(pages, words, digests)`` -- the digests; ``(0, None)`` if
    none. The latest first: a session's previous turn is near."""
    best, src = 0, None
    left = HEAD_CANDIDATES
    while q >= 0 and left:
        qk = npl[q]
        m = qk if qk < k else k
        if m > best:
            qa = step * pol[q]
            e = step * m  # the last page first: another session's chain parts there
            if buf[a + e - step : a + e] == buf[qa + e - step : qa + e] and (
                buf[a : a + e] == buf[qa : qa + e]
            ):
                best, src = m, q
                if m == k:
                    return best, src
        q = prev_same[q]
        left -= 1
    for qk, qw, d in reversed(carried):
        m = qk if qk < k else k
        if m > best:
            e = step * m
            if buf[a + e - step : a + e] == qw[e - step : e] and buf[a : a + e] == qw[:e]:
                best, src = m, d
                if m == k:
                    return best, src
    return best, src


__all__ = [
    "CARRY_BYTES",
    "HEAD_CANDIDATES",
    "HEAD_TOKENS",
    "RECENT_ROWS",
    "Carry",
    "Digests",
    "Recent",
    "head_pages",
    "longest_prefix",
]
