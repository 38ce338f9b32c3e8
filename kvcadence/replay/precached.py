"""Prefixes the worker had cached before the capture started, and their pre-load.

What this file owns: a capture attached to a worker that already served traffic holds the
worker's earlier messages only as far back as its replay buffer reaches (SGLang keeps the
last 10,000), so a prefix stored before that (a long-lived system prompt) is found cached by
the capture's requests but was never stored in it. The replay starts from an empty tree and
would replay those requests as misses that store the prefix.

* ``precached(index, cands)`` -- which records found such a prefix: the block a record's
  prefill attached to (``outputs.StoreIndex.prefill_run``'s base; for a prompt that stored
  nothing new, its last cached page) was stored on its rank by no event of the capture
  published before the record finished, nor soon after (a store is published at the next
  publish point, which can come after a quick request's finish: within
  ``outputs.FINISH_WINDOW_NS``). Every block above it is then older too (a
  child is stored after its parent, and a parent is evicted only after its children), so
  the record's whole cached prefix (``cached_tokens``, page floored) was in the tree when
  the capture attached. Vectorised: the candidates' hashes are looked up among the stored
  pages through ``unrecorded.matches`` (a low-bit sieve, one pass over the pages).
* ``PRECACHED_KEY`` -- the ``meta_info`` key of a completed record that carries that
  prefix's length in tokens (one record per prefix, the first to arrive, so the prefixes
  kept grow with the distinct ones); ``preloads(specs)`` reads them back, per rank, as the
  prefixes ``Scheduler.preload`` inserts into the simulated tree before the first pass,
  with no event (they were stored before the capture), the one used latest inserted first
  (oldest).

Only records are looked at (a rebuilt request's prompt above its store is not known).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

import numpy as np

from kvcadence.replay.outputs import FINISH_WINDOW_NS
from kvcadence.replay.schedule import _arrival
from kvcadence.replay.tokens import span
from kvcadence.replay.unrecorded import matches, page_key, page_keys

#: ``meta_info`` key of a record whose cached prefix was stored before the capture: its
#: length in tokens (page aligned)
PRECACHED_KEY = "kvcadence_precached_tokens"


def precached(index: Any, cands: Sequence[tuple[int, int, int, int]]) -> list[int]:
    """Of ``cands`` -- ``(record, block hash, finish ns, rank)`` -- the records whose block no
    event of ``index`` stored on that rank before that time (+ ``FINISH_WINDOW_NS``), in
    ``cands``' order."""
    if not cands:
        return []
    multi = bool(index.frame_rank)
    keys = page_keys(index) if multi else index.hashes
    want = np.fromiter(
        (page_key(h, rk) if multi else h for _, h, _, rk in cands), np.int64, len(cands)
    )
    pos = matches(keys, want)
    first: dict[int, int] = {}
    if len(pos):
        offs = np.asarray(index.offs, dtype=np.int64)
        ev = np.searchsorted(offs, pos, side="right") - 1
        ts = np.asarray(index._ts, dtype=np.int64)[ev]
        for k, t in zip(keys[pos].tolist(), ts.tolist(), strict=True):
            if k not in first or t < first[k]:
                first[k] = t
    out = []
    for (i, _, t, _), k in zip(cands, want.tolist(), strict=True):
        got = first.get(k)
        if got is None or got > t + FINISH_WINDOW_NS:
            out.append(i)
    return out


def preloads(specs: Iterable[tuple[Any, Any]]) -> dict[Any, list[Any]]:
    """Per home (``(home, spec)`` pairs: whatever the caller maps a spec to, the fleet its
    rank's slot): the prefixes to pre-load (``PRECACHED_KEY`` of each spec's source
    record), as token arrays, the one first used latest first (it goes in oldest)."""
    by: dict[Any, list[tuple[int, int, Any, int]]] = {}
    for home, s in specs:
        src = s.source
        mi = getattr(src, "meta_info", None) if src is not None else None
        n = mi.get(PRECACHED_KEY) if isinstance(mi, dict) else None
        if type(n) is not int or n <= 0:
            continue
        at = _arrival(src)
        by.setdefault(home, []).append((at if at is not None else 0, s.idx, s.input_ids, n))
    out: dict[Any, list[Any]] = {}
    for home, items in by.items():
        items.sort(key=lambda x: (x[0], x[1]), reverse=True)
        out[home] = [span(prompt, 0, n) for _, _, prompt, n in items]
    return out
