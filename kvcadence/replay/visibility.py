"""Event visibility of a simulation: when each stored block was computed vs published.

What this file owns: turning the scheduler's visibility log (``Scheduler.visibility_frames``) into
bundle records. For every published batch that carries ``BlockStored`` events the sim
bundle gets one ``Annotation(kind="visibility")`` (no schema change) with, per stored
block, in the order the blocks appear in that batch's ``BlockStored`` events:

* ``computed_pass`` — the scheduler pass whose forward wrote the KV of the block's last
  token (a prefill / chunk pass for prompt blocks, a decode pass for decoded blocks; a
  readmitted request's recomputed blocks name the re-prefill pass);
* ``computed_ns`` — that pass's virtual end time (same clock and anchor as
  ``EventFrame.recv_ns``);
* ``phase`` — 0 computed by a prefill pass, 1 by a decode pass;

plus the batch's ``seq``, ``endpoint``, ``publish_pass`` (``EventFrame.pass_index``) and
``reason`` (``prefill`` | ``decode`` | ``idle`` | ``command`` | ``pause`` | ``startup``).
``Annotation.recv_ns`` is the batch's publish time. Visibility delay of a block = publish
− computed, in passes and in virtual seconds (``kvcadence.analysis.visibility``).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from kvcadence.format.schema import Annotation

VISIBILITY_KIND = "visibility"
VISIBILITY_VERSION = 1


def visibility_notes(result: Any, endpoint: int = 0) -> Iterator[Any]:
    """One ``Annotation(kind="visibility")`` per published batch with stores of a
    ``SimResult`` (one scheduler), built as they are read (a note holds a list of ints per
    stored block: the writer streams them, one alive at a time)."""
    sched = getattr(result, "scheduler", None)
    if sched is None:
        return iter(())
    return scheduler_notes(sched, result.schedule.anchor_ns, endpoint)


def scheduler_notes(sched: Any, anchor_ns: int, endpoint: int = 0) -> Iterator[Any]:
    """The visibility notes of one finished ``Scheduler`` whose batches are published as
    ``endpoint`` (a fleet writes one set per rank), built as they are read."""

    if not getattr(sched, "track", False):
        return
    times = {b.seq: b.time_ns for b in sched.publisher.batches}
    for seq, publish_pass, t, reason, passes, comp_ns, phases in sched.visibility_frames():
        yield (
            Annotation(
                kind=VISIBILITY_KIND,
                recv_ns=times.get(seq, anchor_ns + t),
                data={
                    "version": VISIBILITY_VERSION,
                    "endpoint": endpoint,
                    "seq": seq,
                    "publish_pass": publish_pass,
                    "reason": reason,
                    "computed_pass": list(passes),
                    "computed_ns": [anchor_ns + x for x in comp_ns],
                    "phase": list(phases),
                },
            )
        )


def block_delays(result: Any) -> list[tuple[int, int, int, str]]:
    """(delay passes, delay ns, phase, reason) of every stored block of an in-memory run."""
    sched = result.scheduler
    out = []
    for _seq, publish_pass, t, reason, passes, comp_ns, phases in sched.visibility_frames():
        for p, c, ph in zip(passes, comp_ns, phases, strict=True):
            out.append((publish_pass - p, t - c, ph, reason))
    return out
