"""Pages a worker held before its capture started and evicted during it (a late attach).

What this file owns: a capture attached to a worker that has served for a while starts where
the worker's replay buffer still reaches (SGLang keeps its last messages; the capture's
first ``Gap`` record, from seq 0, says what was lost). The worker's tree then held pages no
event of the capture stores; the capture's requests that found some of them name those
(``replay.precached``), the others show only as ``BlockRemoved`` events of pages no earlier
event of the capture stored -- evicted during the capture, known by their hashes alone (no
tokens, no parent). ``unseen_runs(reader)`` lists them per DP rank, one run of pages per
such event, in the order the worker evicted them (its oldest first); the replay holds a
placeholder for each from the start (``Scheduler.hold_unseen``): pool space no prompt
matches, evicted oldest first, as the worker's were -- but for a run of a prefix the replay
pre-loads anyway (``replay.precached``: a prefix a record found, evicted later), held once.
A capture that holds its endpoints' first messages (or recovered them) has none: it is not
read again. One that lost them is read once more, its late endpoints' payloads decoded (a
1M-event bundle, 445 MB: 5.7 cpu-s).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from kvcadence.format import wire


def late_endpoints(reader: Any) -> set[int]:
    """The endpoints whose stream's start (from seq 0) the capture lost for good: said by
    the capture's ``Gap`` records (a gap from seq 0 not wholly recovered); for an endpoint
    no gap record speaks of (a bundle written without them), its first frame's seq > 0."""
    late, told = set(), set()
    for g in reader.iter_kinds("gap"):
        if g.first_seq == 0:
            told.add(g.endpoint)
            if g.recovered < g.last_seq - g.first_seq + 1:
                late.add(g.endpoint)
    endpoints = {e.id for e in reader.header.endpoints} or {0}  # none listed: one endpoint
    seen: set[int] = set()
    for f in reader.events():  # each endpoint's first frame: the file's first few
        if f.endpoint not in seen:
            seen.add(f.endpoint)
            if f.endpoint not in told and f.epoch == 0 and f.seq > 0:
                late.add(f.endpoint)
        if endpoints <= seen:
            break
    return late


def unseen_runs(reader: Any) -> dict[int, list[list[int]]]:
    """Per DP rank: the page hashes of each ``BlockRemoved`` event that names only pages no
    earlier event of the capture stored on that rank, in capture order, for the ranks whose
    stream lost its start (``late_endpoints``); until the rank's first clear (after it the
    worker holds nothing from before). What is kept to tell is the pages the capture stored
    and has not seen removed yet (a page is removed once a store): the rank's live tree, not
    its history. Empty when no stream lost its start."""
    late = late_endpoints(reader)
    if not late:
        return {}
    ep_rank = {e.id: e.dp_rank for e in reader.header.endpoints}
    live: dict[int, set[int]] = {}
    cleared: set[int] = set()
    runs: dict[int, list[list[int]]] = {}
    for f in reader.events():
        if f.endpoint not in late or f.payload_is_bin:
            continue
        try:
            batch = wire.decode_batch(f.payload)
        except Exception:  # noqa: BLE001 - a torn payload holds nothing to count
            continue
        rank = ep_rank.get(f.endpoint)
        if rank is None:
            rank = getattr(batch, "attn_dp_rank", None) or 0
        if rank in cleared:
            continue
        mine = live.setdefault(rank, set())
        for e in batch.events:  # every version's shapes (``BlockStoredV17``, ...): by name
            kind = type(e).__name__
            hs = getattr(e, "block_hashes", None) or ()
            if kind.startswith("BlockStored"):
                mine.update(hs)
            elif kind.startswith("BlockRemoved"):
                if hs and mine.isdisjoint(hs):
                    runs.setdefault(rank, []).append(list(hs))
                mine.difference_update(hs)
            elif kind.startswith("AllBlocksCleared"):
                cleared.add(rank)
                live.pop(rank, None)
                break
    return runs


def runs_to_hold(
    runs: list[list[int]],
    preloaded: list[Any],
    page_size: int,
    namespaces: Sequence[Any] | None = None,
) -> list[int]:
    """The page counts of ``runs`` to hold as placeholders: those with no page of the
    ``preloaded`` prefixes (token arrays: those pages are pre-loaded with their tokens;
    ``namespaces``: each one's cache namespace, whose salt seeds its hashes)."""
    if not runs:
        return []
    have: set[int] = set()
    for i, key in enumerate(preloaded):
        ns = namespaces[i] if namespaces else None
        salt = None if ns is None else ns.cache_salt
        have.update(wire.block_hashes(key[: len(key) - len(key) % page_size], page_size, salt))
    return [len(r) for r in runs if not have.intersection(r)]
