"""What the simulated scheduler does between batches: idle publishes, recorded flushes,
aborts, and PD prefill's KV transfers.

Methods of ``Scheduler`` (bound in its class body, as ``replay.stretch``'s). What this file
owns:

* fully idle (``_fully_idle``, ``_on_idle``: the queue published, ``new_token_ratio``
  reset);
* recorded flushes (``_maybe_flush``: only when fully idle, as ``flush_cache`` refuses
  otherwise; the queue published first, the ``AllBlocksCleared`` alone; ``_flush_due``,
  ``replay.flushes.FlushPlan``'s callback; ``force_flush`` for a driver that found every
  rank stopped);
* recorded aborts (``_apply_aborts``: a waiting request leaves the queue, a running one
  takes one more forward and finishes by the normal path, ``FINISH_ABORT``);
* PD prefill (``_hold_for_transfer``, ``_poll_transfers``: the prompt inserted and held
  locked while its KV is transferred, released with no event).
"""

from __future__ import annotations

import bisect
import heapq
from typing import TYPE_CHECKING

from kvcadence.replay.request import ABORTED, FINISHED, RUNNING, WAITING, SimReq

if TYPE_CHECKING:  # type-only: these functions run as methods of a Scheduler
    from kvcadence.replay.scheduler import Scheduler


def _fully_idle(self: Scheduler) -> bool:
    return (
        not self.running
        and not self.waiting
        and self.chunked_req is None
        and not any(r.state == RUNNING for r in self.pending_merge)
    )


def _on_idle(self: Scheduler, t: int) -> None:
    if self._fully_idle():
        self._publish(t, self.pass_index, "idle")
        self.tracker.on_idle()


def _maybe_flush(self: Scheduler, t: int) -> None:
    while self.flush_times and self.flush_times[0] <= t and self._fully_idle():
        self.flush_times.pop(0)
        # rule: a command while idle publishes what is queued first (the clear goes
        # out alone)
        self._publish(t, self.pass_index, "command")
        self.tree.reset()
        self.queue.record_clear()
        self._publish(t, self.pass_index, "flush")
        self.decode_ct = 0
        self.stats.flushes += 1
        if self.flush_plan is not None:
            # the requests that came after it (may make the next flush due)
            self.flush_plan.performed(t)


def _flush_due(self: Scheduler, at: int) -> None:
    """``FlushPlan`` callback: the next recorded flush may be performed from ``at`` on
    (its requests before it all finished, on this rank or another): wake up for it."""
    bisect.insort(self.flush_times, at)
    self._wake()


def force_flush(self: Scheduler) -> bool:
    """A driver found every rank stopped: perform this rank's next recorded flush even
    though requests before it never finished (inconsistent records). False when none
    is pending."""
    plan = self.flush_plan
    if plan is None or not plan.pending or self.flush_times:
        return False
    plan.force(self._idle_since if self._idle_since is not None else self.t)
    return True


def _apply_aborts(self: Scheduler, t: int) -> None:
    if not self._aborts:
        return
    for rid, at in list(self._aborts.items()):
        if at > t:
            continue
        req = next((r for r in self.reqs if r.rid == rid), None)
        if req is None or req.state in (FINISHED, ABORTED):
            del self._aborts[rid]
            continue
        if req.state == WAITING and req in self.waiting:
            self.waiting.remove(req)
            req.state = ABORTED
            req.error = "aborted while waiting"
            req.finish_ns = t
            self.finished_count += 1
            self._release_successors(req, t)
            del self._aborts[rid]
        elif req.state == RUNNING and req is not self.chunked_req and req.decode_left > 0:
            # FINISH_ABORT: one more forward, then the normal finish path
            # one more forward after the ones already launched; finish then stores
            # prompt + outputs - 1 (kv_len after that forward)
            req.n_out = req.kv_len - req.input_len + 2
            req.decode_left = 1
            req.error = "aborted"
            del self._aborts[rid]


def _hold_for_transfer(self: Scheduler, req: SimReq, upto: int, t: int) -> None:
    """PD prefill: insert the prompt (published with this result), keep it locked and
    matchable while its KV is transferred (``disagg_prefill_inflight_queue``)."""
    self._insert_upto(req, upto)
    if req in self.running:
        self.running.remove(req)
    req.decode_left = 0
    heapq.heappush(self.held, (t + self._transfer_ns(req), req.idx))


def _poll_transfers(self: Scheduler, t: int) -> None:
    """``process_disagg_prefill_inflight_queue``: release finished transfers (unlock, free
    the partial page; the prompt is already in the tree, so no event)."""
    held = self.held
    while held and held[0][0] <= t:
        _done, idx = heapq.heappop(held)
        req = self.reqs[idx]
        self._finish(req, t, insert=False)
