"""Retracted requests in a production capture: their outputs' stores, and the counts.

What this file owns: ``retracted_run`` (a retracted request stored its outputs in two runs,
at its re-prefill and at its finish: ``production`` reads both) and ``retractions`` (the
capture's retracted requests against the replay's own: the replay simulates retractions
from memory pressure, the recorded count is not imposed; ``timing.is_retracted`` reads a
record's ``meta_info.num_retractions``).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

from kvcadence.replay.outputs import StoreIndex
from kvcadence.replay.timing import is_retracted
from kvcadence.replay.tokens import EMPTY, cat


def retracted_run(
    index: StoreIndex,
    h: int | None,
    tail: Sequence[int],
    k: int,
    arr: int,
    fin: int,
    taken: dict[tuple[int, int], int],
    runs: list[tuple[int, int, int]],
) -> tuple[Any, int, bool, tuple[int, int], bool] | None:
    """A retracted request's outputs, ``finish_pages``' result for up to ``k`` pages. It
    stored them in two runs: at its re-prefill, with the outputs decoded before the
    retraction (the run after ``h`` in the first event from its arrival on that holds
    ``h``: the retraction may have evicted its prompt's last pages, re-stored there too),
    and at its finish, chained below that run. ``runs``: each run's ``(event, first page,
    pages)`` is appended to it."""
    got = index.finish_pages(h, tail, k, arr, arr, None, taken)
    if got is None:
        return None
    toks, last, merged, where, tie = got
    ps = index.page_size
    runs.append((where[0], where[1], len(toks) // ps))
    while len(toks) < k * ps:
        more = index.finish_pages(last, EMPTY, k - len(toks) // ps, arr, fin, None, taken)
        if more is None or not len(more[0]):
            break
        runs.append((more[3][0], more[3][1], len(more[0]) // ps))
        toks = cat(toks, more[0])
        last = more[1]
        merged = merged or more[2]
    return toks, last, merged, where, tie


def retractions(records: Iterable[Any], sim_requests: Iterable[Any]) -> dict[str, int]:
    """The capture's retracted requests against the replay's: how many the capture
    retracted (``meta_info.num_retractions`` > 0), how many of those the replay retracted
    too, and how many the replay retracted in all. The replay simulates its own
    retractions (memory pressure); the recorded count is not imposed."""
    real = {r.rid for r in records if is_retracted(r)}
    sim = {r.rid for r in sim_requests if is_retracted(r)}
    return {
        "retracted_in_capture": len(real),
        "retracted_in_capture_and_replay": len(real & sim),
        "retracted_in_replay": len(sim),
    }
