"""Decode passes and their memory: the simulated scheduler's ``update_running_batch``.

Methods of ``Scheduler`` (bound in its class body, as ``replay.stretch``'s). What this file
owns (0.5.23 ``scheduler.py`` / ``schedule_batch.py``):

* which running requests the next decode step runs (``_decode_batch``: in the overlap loop
  not those whose result in flight finishes them by length; a request stopping at EOS is
  decoded once more);
* ``check_decode_mem`` (``_decode_need``, ``_decode_fits``: a token per request at page 1,
  else a page per request whose next token starts one; the shortfall evicted first) and
  ``prepare_for_decode`` (``_decode_alloc``; at page > 1 the allocation first evicts as if
  every request needed a page);
* retraction when the step does not fit (``_retract``, ``retract_decode``: fewest outputs
  first, ties longest prompt, or the least important first under ``--retraction-policy
  priority``; each release evicts ``remaining x retract_decode_steps`` tokens; the last
  request that cannot fit is aborted) and the release itself (``_requeue``: no store, the
  request waits again);
* ``pause_generation`` (``_pause``: every running request retracted, the queue published).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from kvcadence.replay.request import RUNNING, WAITING, Batch, SimReq

if TYPE_CHECKING:  # type-only: these functions run as methods of a Scheduler
    from kvcadence.replay.scheduler import Scheduler


def _decode_batch(self: Scheduler) -> list[SimReq]:
    """The running requests the next decode step runs: not those whose result in flight
    finishes them by length (``_reqs_finishing_inflight``). In the overlap loop a request
    that stops at EOS is not known to finish until its result is processed, after the
    next batch is launched: it is decoded once more (its EOS token's KV computed, so its
    finish inserts prompt + every output), also when its first token is EOS (merged
    from its prefill batch by ``_get_next_batch``)."""
    if self.overlap:
        return [r for r in self.running if r.decode_left > 0 or r.stops_unseen]
    return [r for r in self.running if r.decode_left > 0]


def _update_running_batch(self: Scheduler, t: int) -> Batch | None:
    running = self._decode_batch()
    if not running:
        return None
    need = self._decode_need(running)
    cap = self.cfg.max_total_tokens - self.private_total  # available() = cap - tree size
    if cap - self.tree.total_size < need:
        self._evict_for(need, "check_decode", running)
        short = self.available() < need
    else:
        short = False
    if short:
        if self.overlap and len(running) < len(self.running):
            # rule (overlap loop, ``_reqs_finishing_inflight``): a request whose result
            # in flight finishes it by length frees its KV when that result is
            # processed, so a short step decodes nothing instead of retracting
            self.batch_is_full = False
            return None
        self._retract(t, running)
        running = self._decode_batch()
        if not running:
            return None
    else:
        self.tracker.on_decode_steps(1)
    self._decode_alloc(running)
    self.pass_index += 1
    return Batch("decode", running, [], self.pass_index, 0, len(running))


def _decode_need(self: Scheduler, running: list[SimReq]) -> int:
    """``check_decode_mem``'s tokens: a token per request at page 1, else a page per
    request whose next token starts one."""
    ps = self.ps
    if ps == 1:
        return len(running)
    need = 0
    for r in running:
        if r.kv_len % ps == 0:
            need += ps
    return need


def _decode_alloc(self: Scheduler, running: list[SimReq]) -> None:
    """``prepare_for_decode``: a token's KV for each request of ``running`` (at page > 1
    ``alloc_paged_token_slots_decode`` first evicts as if each needed a new page)."""
    ps = self.ps
    if ps > 1:
        self._evict_for(len(running) * ps, "decode", running)
    if ps == 1:
        for r in running:
            r.alloc += 1
            r.kv_len += 1
            r.decode_left -= 1
        self.private_total += len(running)
    else:
        grown = 0
        for r in running:
            if r.kv_len % ps == 0:
                r.alloc += ps
                grown += ps
            r.kv_len += 1
            r.decode_left -= 1
        self.private_total += grown


def _decode_fits(self: Scheduler, reqs: list[SimReq]) -> bool:
    """``check_decode_mem(selected)``: evict for the next decode step of ``reqs`` (a page
    per request whose next token starts one), then whether it fits."""
    need = sum(self.ps for r in reqs if r.kv_len % self.ps == 0)
    self._evict_for(need, "check_decode", reqs)
    return self.available() >= need


def _retract(self: Scheduler, t: int, batch: list[SimReq]) -> None:
    """``retract_decode``: release requests of the decode ``batch`` until the next decode
    step fits (``_get_decode_retraction_order``: fewest outputs first, ties longest
    prompt; ``--retraction-policy priority``: the least important first)."""
    if self.cfg.retraction_policy == "priority":  # the least important first, then length
        sign = self.prio_sign
        cand = sorted(
            batch,
            key=lambda r: (self._priority(r) * -sign, r.output_len, -r.input_len),
            reverse=True,
        )
    else:
        cand = sorted(batch, key=lambda r: (r.output_len, -r.input_len), reverse=True)
    retracted: list[SimReq] = []
    # ``while first_iter or not check_decode_mem(kept)``: the first request goes
    # unchecked (the caller's check failed), then each check evicts its shortfall first
    # -- what the release's ``remaining x retract_decode_steps`` tokens did not cover at a
    # page over that many tokens
    while True:
        if retracted and self._decode_fits(cand):
            break
        if len(cand) <= 1:
            break
        r = cand.pop()
        retracted.append(r)
        self._requeue(r)
        # traced with the decode batch it retracts from (the worker's trace shows that)
        self._evict_for(len(cand) * self.cfg.retract_decode_steps, "retract", batch)
    if retracted:
        self.stats.retractions += len(retracted)
        gone = {id(r) for r in retracted}
        self.running = [r for r in self.running if id(r) not in gone]
        for r in retracted:
            self._enqueue(r)
        # the new ratio is estimated over the requests that stay (the filtered batch)
        self.tracker.on_retract(cand)
        self.batch_is_full = False
    if len(cand) <= 1 and not self._decode_fits(cand):
        # even the last one does not fit: abort it (SGLang: "Out of memory even after
        # retracting all other requests in the decode batch")
        for r in cand:
            self.running.remove(r)
            self._finish(r, t, insert=False, error="out of memory after retraction")
            self.stats.aborted += 1


def _requeue(self: Scheduler, r: SimReq) -> None:
    """``release_req`` of a retraction: free the request's KV without a store (its prompt,
    checkpointed at its prefill result, stays cached and matchable) and make it wait
    again; readmitted, it recomputes only what is not in the tree (its decoded tokens)."""
    self._release(r, insert=False)
    r.gen += 1
    r.state = WAITING
    r.retractions += 1
    n = r.input_len + r.output_len
    r.fill = r.seq_slice(0, n)
    r.fill_len = len(r.fill)
    r.prefix_len = 0
    r.decode_left = 0


def _pause(self: Scheduler, t: int) -> None:
    """``pause_generation``: retract (mode retract) every running request, publish the
    queue (also when idle), and stop scheduling until ``continue_generation``."""
    _at, until, mode = self._pauses.pop(0)
    if mode == "retract":
        victims = [r for r in self.running if r.state == RUNNING]
        victims += [r for r in self.pending_merge if r.state == RUNNING]
        for r in victims:
            self._requeue(r)
        if victims:
            self.stats.retractions += len(victims)
            self.running = []
            self.pending_merge = []
            rest, self.waiting = self.waiting, []
            for r in victims:
                self._enqueue(r)
            self.waiting.extend(rest)
            self.batch_is_full = False
    self._publish(t, self.pass_index, "pause")
    self.paused_until = until
