"""The token ids of a capture's stored events, one buffer for all of them.

What this file owns: ``StoredTokens``, ``outputs.StoreIndex``'s token column. Every indexed
``BlockStored`` event holds exactly ``page_size`` tokens a block (``StoreIndex`` indexes no
other), so event ``e``'s tokens are tokens ``offs[e] * page_size ..`` of the events' tokens
laid end to end in publish order: one ``bytearray`` of uint32 ids (4 bytes a token), no
array object per event. ``span(e, a, b)`` copies out tokens ``a .. b`` of one event.

``heads(want, lo, hi)`` finds the pages (positions ``lo .. hi`` of ``StoreIndex.hashes``)
whose first token is ``want``: a prefill store merged after another request's store starts
mid-event, and finding it is one search over the window's page heads (at page size 1 the
buffer itself; above it, a second buffer of each page's first token, 4 bytes a page) -- a
byte search of a narrow window, one numpy comparison of a wide one (a worker serving many
clients publishes many events between a request's receive and its prefill: 128 closed-loop
clients at page 1, the inference's record pass 0.50 -> 0.23 s against a walk of the
window's events) -- not a search per event. An event whose ids do not fit in uint32 (wide
or invalid ids, which the hashes refuse or hash per page) keeps its own array
(``compact``'s) and zeros in the buffers, searched on its own.
"""

from __future__ import annotations

from array import array
from bisect import bisect_left
from collections.abc import Iterator, Sequence
from itertools import accumulate
from typing import Any

import numpy as np

from kvcadence.replay.tokens import CODE, same_ids

_ITEM = array(CODE).itemsize
#: the heads' dtype: uint32, as ``CODE``'s items
_HEAD = np.dtype(f"=u{_ITEM}")
#: ``heads`` searches windows of up to this many pages as bytes (``bytes.find``: no array
#: made, but a stop at every byte-aligned false hit), wider ones with numpy
_FIND_PAGES = 2048


class StoredTokens:
    """Token ids of events ``0 .. len - 1`` (appended in publish order, see module)."""

    def __init__(self, page_size: int) -> None:
        self.page_size = page_size
        self._buf = bytearray()  # every event's tokens, uint32, end to end
        #: each page's first token (page size > 1; at 1 the buffer is its own heads)
        self._heads = bytearray() if page_size > 1 else self._buf
        self._start: list[int] = []  # each event's first page (``StoreIndex.offs``)
        self._pages: list[int] = []
        self._used = 0  # pages appended
        self._wide: dict[int, Any] = {}  # event -> its ids, where they are not uint32
        self._wide_order: list[int] = []  # those events, ascending
        #: the heads as a numpy array (``heads``), a view of ``_heads``: made at the first
        #: search, dropped at the next ``extend_flat`` (a buffer with a view cannot grow)
        self._view: np.ndarray | None = None

    def __len__(self) -> int:
        return len(self._start)

    def __getitem__(self, e: int) -> Any:
        """Event ``e``'s tokens (a new array; a wide event's own ids)."""
        return self.span(e, 0, self._pages[e] * self.page_size)

    def __iter__(self) -> Iterator[Any]:
        return (self[e] for e in range(len(self)))

    def extend_flat(self, flat: Any, pages: Sequence[int], wide: dict[int, Any]) -> None:
        """Append events whose tokens are ``flat`` end to end (a bytes-like of uint32 ids,
        ``pages[k] * page_size`` of them for event ``k``); ``wide[k]``: event ``k``'s own ids
        where they are not uint32 (zeros in ``flat``). Copied into the buffer (taken as it
        is when ``flat`` is a bytearray and the buffer still empty)."""
        if not len(pages):
            return
        ps = self.page_size
        self._view = None
        e0 = len(self._start)
        byte0 = len(self._buf)
        self._start.extend(accumulate(pages[:-1], initial=self._used))
        self._pages.extend(pages)
        self._used += sum(pages)
        if not byte0 and type(flat) is bytearray:
            self._buf = flat
            if ps == 1:
                self._heads = flat  # the buffer is its own heads
        else:
            self._buf += flat
        for k in sorted(wide):
            self._wide[e0 + k] = wide[k]
            self._wide_order.append(e0 + k)
        if ps > 1:  # each new page's first token
            with memoryview(self._buf) as mv:
                self._heads += np.frombuffer(mv[byte0:], dtype=_HEAD)[::ps].tobytes()

    def firsts(self, e0: int) -> list[Any]:
        """The first token of each event from ``e0`` on (a wide event's from its own ids)."""
        ps, n = self.page_size, len(self._start)
        if e0 >= n:
            return []
        with memoryview(self._buf) as mv:
            out: list[Any] = np.frombuffer(mv, dtype=_HEAD)[
                np.asarray(self._start[e0:], dtype=np.int64) * ps
            ].tolist()
        for e in self._wide_order:
            if e >= e0:
                out[e - e0] = self._wide[e][0]
        return out

    def span(self, e: int, a: int, b: int) -> Any:
        """Tokens ``a .. b`` of event ``e`` (clipped to it), a new array."""
        n = self._pages[e] * self.page_size
        if b > n:
            b = n
        wide = self._wide.get(e) if self._wide else None
        if wide is not None:
            return wide[a:b]
        out = array(CODE)
        if a < b:
            at = self._start[e] * self.page_size * _ITEM
            out.frombytes(self._buf[at + a * _ITEM : at + b * _ITEM])
        return out

    def same(self, e: int, a: int, b: int, ids: Any) -> bool:
        """Tokens ``a .. b`` of event ``e`` (clipped to it) equal ``ids`` (an array, as
        ``tokens.compact`` makes them: compared as bytes, no copy to an array first)."""
        if type(ids) is array and ids.typecode == CODE and e not in self._wide:
            n = self._pages[e] * self.page_size
            if b > n:
                b = n
            at = self._start[e] * self.page_size * _ITEM
            return self._buf[at + a * _ITEM : at + b * _ITEM] == ids.tobytes()
        return same_ids(self.span(e, a, b), ids)

    def is_wide(self, e: int) -> bool:
        """Event ``e``'s ids are not uint32 (kept as their own array)."""
        return e in self._wide

    def heads(self, want: Any, lo: int, hi: int) -> list[int]:
        """The pages ``lo .. hi - 1`` (positions of ``StoreIndex.hashes``) whose first token
        is ``want``, ascending; a page of a wide event is looked at in its own ids."""
        found: list[int] = []
        if type(want) is int and 0 <= want < 1 << (8 * _ITEM) and lo < hi:
            if hi - lo <= _FIND_PAGES:  # a few pages: a byte search (no array made)
                pat = array(CODE, [want]).tobytes()
                heads, end = self._heads, hi * _ITEM
                at = heads.find(pat, lo * _ITEM, end)
                while at >= 0:
                    if at % _ITEM == 0:
                        found.append(at // _ITEM)
                    at = heads.find(pat, at + 1, end)
            else:  # many: one comparison of every page's head (no false hit to step over)
                view = self._view
                if view is None:  # (made once the buffers stopped growing: see ``extend_flat``)
                    view = self._view = np.frombuffer(self._heads, dtype=_HEAD)
                found = (np.flatnonzero(view[lo:hi] == want) + lo).tolist()
            if self._wide:
                found = [p for p in found if not self._in_wide(p)]
        if self._wide_order:
            found = sorted(set(found).union(self._wide_found(want, lo, hi)))
        return found

    def _in_wide(self, pos: int) -> bool:
        """Page ``pos`` is a wide event's (its zeros in the buffers are no tokens)."""
        k = bisect_left(self._start, pos + 1) - 1
        return k in self._wide

    def _wide_found(self, want: Any, lo: int, hi: int) -> Iterator[int]:
        ps = self.page_size
        for e in self._wide_order:
            s = self._start[e]
            if s + self._pages[e] <= lo or s >= hi:
                continue
            toks = self._wide[e]
            for j in range(self._pages[e]):
                if lo <= s + j < hi and toks[j * ps] == want:
                    yield s + j
