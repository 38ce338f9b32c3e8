"""Token chains back to the root through a capture's stored events.

What this file owns: ``Chains``, the lookups ``unrecorded`` rebuilds a request's prompt
with: where a page hash was first stored (a sorted copy of the index's hashes), whether a
DP rank stored it, and the tokens from the root through a page (``prefix``), read back page
by page through the stored events -- and, where the chain leaves the capture (a page stored
before it), from a record's cached prefix (``precached.OlderPages``, given as ``older``).
"""

from __future__ import annotations

from array import array
from collections.abc import Callable
from typing import Any

import numpy as np

from kvcadence.replay.tokens import CODE


class Chains:
    """Token chains back to the root through the stored events (a hash -> its first
    position, by a sorted copy of the hashes)."""

    def __init__(self, index: Any, older: Callable[[int], array | None] | None = None) -> None:
        self.index = index
        self.older = older
        self.order = np.argsort(index.hashes, kind="stable")
        self.sorted = index.hashes[self.order]
        self.offs = np.asarray(index.offs, dtype=np.int64)

    def where(self, h: int) -> tuple[int, int] | None:
        """``(event, page)`` of the first stored page with hash ``h``."""
        k = int(np.searchsorted(self.sorted, h))
        if k >= len(self.sorted) or int(self.sorted[k]) != h:
            return None
        return self._at(int(self.order[k]))

    def _at(self, pos: int) -> tuple[int, int]:
        ei = int(np.searchsorted(self.offs, pos, side="right") - 1)
        return ei, pos - int(self.offs[ei])

    def on_rank(self, h: int, rank: int) -> bool:
        """Whether some event of DP rank ``rank`` stored the page with hash ``h``."""
        lo = int(np.searchsorted(self.sorted, h))
        hi = int(np.searchsorted(self.sorted, h, side="right"))
        return any(self.index.rank_of(self._at(int(p))[0]) == rank for p in self.order[lo:hi])

    def prefix(
        self, parent: int | None, limit: int, rank: int | None = None
    ) -> tuple[array, int, bool] | None:
        """The tokens from the root through the page ``parent`` (None: the root, no tokens),
        how many of them the worker held before the capture, and whether the chain left the
        capture's stores (``older`` told the tokens above them). Held: those above the
        capture's stores (``older``: the tokens through a page stored before the capture,
        from a record's cached prefix), and with ``rank`` (a multi-rank capture) also the
        pages through the last one on the way up that no event of that rank stored (another
        rank's store of them shows their tokens; that rank held them). None when the chain
        runs past ``limit`` pages, or leaves the capture at a page ``older`` does not know."""
        idx, ps = self.index, self.index.page_size
        parts: list[array] = []
        pages = 0
        up = None  # pages from ``parent`` up to the first one ``rank`` did not store
        above: array | None = None
        while parent is not None:
            got = self.where(parent)
            if got is None:  # stored before the capture
                above = self.older(parent) if self.older is not None else None
                if above is None:
                    return None
                pages += len(above) // ps
                if pages > limit:
                    return None
                break
            ei, j = got
            if up is None and rank is not None and idx.rank_of(ei) != rank:
                hs = idx.hashes[idx.offs[ei] : idx.offs[ei] + j + 1].tolist()
                for k in range(j, -1, -1):
                    if not self.on_rank(hs[k], rank):
                        up = pages + (j - k)
                        break
            parts.append(idx.tokens.span(ei, 0, (j + 1) * ps))
            pages += j + 1
            if pages > limit:
                return None
            parent = idx.parents[ei]
        out = array(CODE) if above is None else array(CODE, above)
        for p in reversed(parts):
            out.extend(p)
        held = 0 if above is None else len(above)
        if up is not None:
            held = len(out) - up * ps
        return out, held, above is not None
