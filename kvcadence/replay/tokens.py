"""Compact token ids for the replay: typed arrays and prefix-shared prompts.

What this file owns: how the replay keeps token ids in memory.

* ``compact(ids)`` — token ids as an ``array('I')`` (4 bytes a token, no int objects);
  ids that do not fit in uint32 (invalid or wide ones, which the hashes refuse or hash
  per page as before) fall back to ``array('q')``, and ``cat`` joins either kind;
  ``same_ids`` compares two runs of ids by value (arrays in C, without int objects).
* ``Prompt`` — one request's prompt as *(shared prefix of another prompt + own suffix)*:
  ``base`` (a ``Prompt`` or None), ``base_len`` tokens of it, then ``own``. An agent turn's
  prompt repeats its predecessor's prompt + output, so a replay's prompts cost their unique
  tokens, not the sum of their lengths. ``materialize()`` builds the full array (O(length),
  on demand: the simulated request keeps it only while it is live); ``span(a, b)`` only
  tokens ``a..b`` (from the levels that hold them: O(b - a + depth)).
* ``span(ids, a, b)`` — ``ids[a:b]`` as an array, whatever form the ids have (a ``Prompt``:
  its ``span``; a list: ``compact`` of the slice; an array: its slice).
* ``PromptIndex`` — builds ``Prompt``s as records stream in: each new prompt is compared
  with the last prompt of its lane and, when that shares less than half of it, with the
  last prompt that started with the same first tokens and (records without a lane: SGLang's
  own request logs) the last prompt that shares its longest whole ``BLOCK_KEY``-token
  prefix (``block_keys``); it shares the longest common prefix found. Chains are cut (a full copy) after
  ``MAX_DEPTH`` levels, so materializing stays linear in the prompt's length.

Hashes are unchanged: an ``array('I')`` hashes to the same SGLang block hashes as the list
of the same ints (``format.hashes`` packs either as uint32).
"""

from __future__ import annotations

from array import array
from collections.abc import Iterator, Sequence
from typing import Any

#: array typecode with 4-byte unsigned items (``I`` everywhere that matters; ``L`` as a guard)
CODE = "I" if array("I").itemsize == 4 else "L"
#: the fallback for ids that are not uint32 (wide or invalid: hashed or refused as before)
WIDE = "q"
#: prompt chains longer than this are cut with a full copy (bounds materializing)
MAX_DEPTH = 32
#: tokens of a prompt's start that key the same-start candidate
START_KEY = 16
#: tokens per block of the lane-less candidates' prefix keys (``block_keys``)
BLOCK_KEY = 512

EMPTY = array(CODE)


def compact(ids: Sequence[int] | Any) -> array:
    """``ids`` as a typed array (``array('I')``; ``array('q')`` when some id is not uint32;
    an array passed in is returned as is)."""
    if type(ids) is array:
        return ids
    out = array(CODE)
    try:
        if type(ids) is list:
            out.fromlist(ids)  # ~3x faster than array(CODE, ids) on a list
            return out
        return array(CODE, ids)
    except (OverflowError, TypeError):
        pass
    try:
        return array(WIDE, ids)
    except (OverflowError, TypeError):
        # not int64 either (bigram pairs, garbage): keep the values; hashing refuses them
        return ids  # type: ignore[return-value]


def cat(a: array, b: array) -> array:
    """``a + b`` for arrays of either typecode (promoted to ``WIDE`` when they differ)."""
    if a.typecode == b.typecode:
        return a + b
    return array(WIDE, a) + array(WIDE, b)


def as_list(ids: Any) -> list[int]:
    """A plain list of the ids (for records written to a bundle)."""
    if type(ids) is list:
        return ids
    if isinstance(ids, Prompt):
        return ids.materialize().tolist()
    if type(ids) is array:
        return ids.tolist()
    return list(ids)


def span(ids: Any, a: int, b: int) -> array:
    """``ids[a:b]`` (``0 <= a``) as ``compact`` keeps token ids: a ``Prompt``'s ``span``,
    an array's slice, a list's slice made compact."""
    if isinstance(ids, Prompt):
        return ids.span(a, b)
    return compact(ids[a:b])


def same_ids(a: Any, b: Any) -> bool:
    """Token ids ``a == b`` by value: arrays (either typecode: compared in C, no int objects)
    or lists, as ``compact`` leaves them (a list only for ids that are not int64)."""
    if type(a) is type(b):
        return bool(a == b)
    return list(a) == list(b)


class Prompt:
    """A prompt stored as ``base[:base_len] + own`` (see the module docstring)."""

    __slots__ = ("base", "base_len", "own", "n", "depth")
    base: Prompt | None
    base_len: int
    own: array
    n: int
    depth: int

    def __init__(self, base: Prompt | None, base_len: int, own: array) -> None:
        # skip levels that the shared prefix does not reach past
        while base is not None and base_len <= base.base_len:
            base = base.base
        if base is None or base_len == 0:
            base, base_len = None, 0
        self.base = base
        self.base_len = base_len
        self.own = own
        self.n = base_len + len(own)
        self.depth = 0 if base is None else base.depth + 1

    def __len__(self) -> int:
        return self.n

    def __iter__(self) -> Iterator[int]:
        return iter(self.materialize())

    def __getitem__(self, i: Any) -> Any:
        return self.materialize()[i]

    def __repr__(self) -> str:  # pragma: no cover - debugging aid
        return f"Prompt(n={self.n}, own={len(self.own)}, depth={self.depth})"

    def span(self, a: int, b: int) -> array:
        """Tokens ``a`` .. ``b`` (``0 <= a``; ``b`` capped at the length) as a new array,
        copied from the levels that hold them only: O(b - a + depth)."""
        hi = b if b < self.n else self.n  # (not ``min``: a call per span)
        if a >= hi:
            return self.own[:0]
        lo = self.base_len
        if a >= lo:  # all in this level's own tokens (a prompt's new turn, usually)
            return self.own[a - lo : hi - lo]
        parts: list[array] = []
        cur: Prompt | None = self
        while cur is not None and a < hi:
            lo = cur.base_len  # ``cur.own`` holds tokens lo .. lo + len(own)
            if hi > lo:
                s = a if a > lo else lo
                parts.append(cur.own[s - lo : hi - lo])
                hi = s
            cur = cur.base
        out = parts.pop()
        while parts:
            nxt = parts.pop()
            if nxt.typecode == out.typecode:
                out += nxt
            else:
                out = cat(out, nxt)
        return out

    def materialize(self, limit: int | None = None) -> array:
        """The full token array, or its first ``limit`` tokens (a new array; O(length +
        depth))."""
        cut = self.n if limit is None or limit > self.n else limit
        if self.base is None:
            return self.own[:cut]
        # from this prompt down: how much of each level is needed
        chain: list[tuple[Prompt, int]] = []
        cur: Prompt | None = self
        while cur is not None:
            chain.append((cur, cut))
            if cur.base_len < cut:
                cut = cur.base_len
            cur = cur.base
        out: array | None = None
        for p, need in reversed(chain):
            if out is None:
                out = p.own[:need]
                continue
            extra = need - p.base_len  # ``out`` holds min(need, p.base_len) tokens here
            if extra > 0:
                own = p.own
                if extra < len(own):
                    own = own[:extra]  # else the whole run: no slice copy
                if own.typecode == out.typecode:
                    out += own  # in place: amortised, not a copy per level
                else:
                    out = cat(out, own)
        assert out is not None
        return out


def common_prefix(a: array, b: array) -> int:
    """Length of the longest common prefix of ``a`` and ``b``."""
    n = min(len(a), len(b))
    if a[:n] == b[:n]:
        return n
    lo, hi = 0, n - 1  # a[:lo] == b[:lo]; they differ within [:hi+1]
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if a[lo:mid] == b[lo:mid]:
            lo = mid
        else:
            hi = mid - 1
    return lo


def block_keys(arr: array) -> list[int]:
    """One key per whole ``BLOCK_KEY``-token block of ``arr``: key ``k`` names
    ``arr[:(k + 1) * BLOCK_KEY]`` (a chain of Python's 64-bit hashes of its blocks' bytes,
    its typecode first), so two arrays that share that prefix share key ``k``. A key only
    names a candidate (``PromptIndex.add`` then compares the two prompts exactly,
    ``common_prefix``): a collision would cost a comparison, never a wrong prompt, so the
    hash is the fastest at hand (~2.6x SHA-1's, ~6x BLAKE2b's here: a 100k-token prompt is
    400 KB hashed). Keys live in one process (its hash seed): never stored."""
    raw = arr.tobytes()
    step = BLOCK_KEY * arr.itemsize
    key = hash(arr.typecode)
    keys = []
    for k in range(len(arr) // BLOCK_KEY):
        key = hash((key, raw[k * step : (k + 1) * step]))
        keys.append(key)
    return keys


class PromptIndex:
    """Builds prefix-shared ``Prompt``s from streamed prompts (see the module docstring).

    Live memory: the last prompt (full array) of each lane, one ``Prompt`` reference per
    distinct prompt start and one per distinct ``BLOCK_KEY``-token prefix (the lane-less
    records' candidates: they grow with the unique tokens, not with the prompts)."""

    def __init__(self) -> None:
        self._lane: dict[Any, tuple[Prompt, array]] = {}
        self._start: dict[bytes, Prompt] = {}
        self._blocks: dict[int, Prompt] = {}

    def add(self, ids: Any, lane: Any = None) -> Prompt:
        """The ``Prompt`` of token ids ``ids`` (a list, an array or a ``Prompt``, kept as
        is) on ``lane`` (None: no lane)."""
        if isinstance(ids, Prompt):
            return ids
        arr = compact(ids)
        if type(arr) is not array:
            return Prompt(None, 0, arr)
        best: Prompt | None = None
        best_len = 0
        held = self._lane.get(lane) if lane is not None else None
        if held is not None:
            best, best_arr = held
            best_len = common_prefix(arr, best_arr)
        key = arr[:START_KEY].tobytes()
        cand = self._start.get(key)
        # the lane's last prompt usually holds most of this one (the next turn): the
        # same-start candidate is compared only when it does not
        if cand is not None and cand is not best and 2 * best_len < len(arr):
            cand_len = common_prefix(arr, cand.materialize(len(arr)))
            if cand_len > best_len:
                best, best_len = cand, cand_len
        # no lane (SGLang's own request logs): the latest prompt sharing this one's longest
        # whole-block prefix (the previous turn of its session, usually), by block keys
        keys = block_keys(arr) if lane is None else []
        if 2 * best_len < len(arr):
            for k in range(len(keys) - 1, -1, -1):
                if (k + 1) * BLOCK_KEY <= best_len:
                    break
                cand = self._blocks.get(keys[k])
                if cand is None:
                    continue
                cand_len = common_prefix(arr, cand.materialize(len(arr)))
                if cand_len > best_len:
                    best, best_len = cand, cand_len
                break
        if best is None or best_len == 0 or best.depth >= MAX_DEPTH:
            prompt = Prompt(None, 0, arr)
        else:
            prompt = Prompt(best, best_len, arr[best_len:])
        if lane is not None:
            self._lane[lane] = (prompt, arr)
        self._start[key] = prompt
        for block in keys:
            self._blocks[block] = prompt
        return prompt
