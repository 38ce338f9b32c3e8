"""Prefill batch formation: the simulated scheduler's ``get_new_batch_prefill``.

Methods of ``Scheduler`` (bound in its class body, as ``replay.stretch``'s). What this file
owns (0.5.23 ``scheduler.py``: ``_get_new_batch_prefill_raw`` and what it calls):

* the continuing chunk checkpointed before a pass is built (``_stash_chunked``);
* ``calc_priority``: the waiting queue sorted in place by ``replay.policy`` and its
  waiting-prefix refresh (``_calc_priority``);
* the ``PrefillAdder`` walk over that order (``replay.admission``): the continuing chunk
  first, then each waiting request matched and added until the adder or the running
  batch is full; under priority scheduling a request that finds it full may preempt less
  important running ones (``_preempt_for``, ``preempt_to_schedule``);
* the admitted requests' extend KV (``prepare_for_extend``: the shortfall evicted first;
  at page > 1 the extend tokens plus a page per request asked for) and the prefill
  ``Batch``;
* mixed chunked prefill (``--enable-mixed-chunk``): the running requests decoded in the
  same pass when their next tokens fit (``_mix``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from kvcadence.errors import ReplayError
from kvcadence.replay.admission import AddReqResult, PrefillAdder, ceil_paged
from kvcadence.replay.policy import (
    SPF,
    WAITING_PREFIX_REFRESH_INTERVAL,
    order_waiting,
    refreshes_waiting_prefixes,
    spf_chunk_limit,
    touch_waiting_prefixes,
)
from kvcadence.replay.request import RUNNING, WAITING, Batch, SimReq

if TYPE_CHECKING:  # type-only: these functions run as methods of a Scheduler
    from kvcadence.replay.scheduler import Scheduler


def _stash_chunked(self: Scheduler) -> None:
    req = self.chunked_req
    if req is not None:
        self._insert_upto(req, req.kv_len)
        # the next chunk resumes where this one ended (0.5.23 ``checkpoint_kv_cache``:
        # ``prefix_len = extend_end``), not at the tree's page-floored end: at page > 1 a
        # continuing chunk is not page-aligned (``add_chunked_req``), and the partial
        # page it leaves stays the request's own KV
        req.prefix_len = req.kv_len
        req.last_node = req.lock_handle


def _num_allocatable(self: Scheduler) -> int:
    return self.max_running - len(self.running)


def _calc_priority(self: Scheduler) -> list[SimReq]:
    """``calc_priority``: the waiting queue in the order the adder walks it (sorted in
    place: ``self.waiting`` becomes that order), then the waiting-prefix refresh."""
    cfg = self.cfg
    # called after ``_get_new_batch_prefill``'s early returns, as in 0.5.23
    # ``_get_new_batch_prefill_raw``; its waiting-prefix refresh (policy.py) last
    ordered = order_waiting(
        cfg.schedule_policy,
        self.waiting,
        self.tree,
        self._match_whole,
        self.processed_tokens,
        [r.spec.routing_key for r in (*self.running, *self.pending_merge)],
        self.rng,
        cfg.random_as_recorded,
        self.prio_key,
    )
    # 0.5.23 sorts the waiting queue in place: the next call starts from this order
    # (ties of lpm / dfs-weight, the fcfs fallback beyond 128 waiting requests)
    self.waiting = ordered
    if (
        self.waiting
        and self.role != "decode"
        and refreshes_waiting_prefixes(cfg.schedule_policy, len(self.waiting), cfg.eviction_policy)
    ):
        if self._prefix_refresh_calls % WAITING_PREFIX_REFRESH_INTERVAL == 0:
            touch_waiting_prefixes(ordered, self.tree)
        self._prefix_refresh_calls += 1
    return ordered


def _get_new_batch_prefill(self: Scheduler, t: int) -> Batch | None:
    cfg = self.cfg
    if self.preemption:  # reset to try preemption with a prefill adder (0.5.23)
        self.batch_is_full = False
    if (self.batch_is_full or not self.waiting) and self.chunked_req is None:
        return None
    if (
        self.min_free_slots is not None
        and self.chunked_req is None
        and self.running
        and self._num_allocatable() < self.min_free_slots
    ):
        return None  # ``MinFreeSlotsDelayer.should_delay``: wait for more free slots
    if self._num_allocatable() <= 0 and self.chunked_req is None and not self.preemption:
        self.batch_is_full = True
        return None
    ordered = self._calc_priority()
    adder = PrefillAdder(
        self.ps,
        self.tc,
        self.allocator,
        self.running,
        self.tracker.current,
        cfg.max_prefill_tokens,
        # a decode worker receives the whole KV at once (no chunking)
        None if self.role == "decode" else cfg.chunked_prefill_size,
        generation=self.adm_generation,
        # mixed chunked prefill: a token per running request comes off both budgets
        num_mixed_decode_tokens=len(self.running) if self.mixed else 0,
        prefill_max_requests=cfg.prefill_max_requests,
        clip_max_new_tokens=cfg.clip_max_new_tokens,
    )
    chunked = self.chunked_req
    still_chunked: SimReq | None = None
    if chunked is not None:
        limit = None
        if cfg.schedule_policy == SPF:
            limit = spf_chunk_limit(chunked, ordered, adder.rem_chunk_tokens or 0, self.ps)
        still_chunked = adder.add_chunked_req(chunked, limit)
    gen0523 = self.adm_generation == "0.5.23"
    # the running batch changes here only by preemption
    allocatable = self._num_allocatable()
    has_chunked = chunked is not None
    can_run_list = adder.can_run_list
    preempted: list[SimReq] = []
    for req in ordered:
        if gen0523 and adder.budget_state() is AddReqResult.OTHER:
            break
        # the continuing chunk counts (0.5.23: ``len(adder.can_run_list) >=
        # get_num_allocatable_reqs(running_bs)``; it is not in the running batch)
        if len(can_run_list) >= allocatable:
            self.batch_is_full = True
        if self.batch_is_full:
            # full: only a request that preempts running ones goes on (and once full,
            # every later one of the pass must too: the flag stays set)
            if not self.preemption:
                break
            # its prefix as an earlier pass's match left it (0: never matched): 0.5.23
            # matches a waiting request only once the loop admits it
            # (``init_next_round_input``; fcfs and lof do not match in ``calc_priority``)
            if not self._preempt_for(req, adder, preempted):
                break
            allocatable = self._num_allocatable()
        self._match(req)
        res = adder.add_one_req(req, has_chunked_req=has_chunked)
        if res is not AddReqResult.CONTINUE:
            if res is AddReqResult.NO_TOKEN:
                # 0.5.23 sets the flag when the adder's list holds anything (the continuing
                # chunk too) or requests run; a flag set beside the chunk alone never
                # reaches the next admission -- the empty running batch is reset at its
                # start, or replaced by the prefill batch's object (``running_batch =
                # last_batch``) -- so the chunk is not counted here
                if len(adder.can_run_list) > (1 if chunked is not None else 0) or self.running:
                    self.batch_is_full = True
            break
    can_run = adder.can_run_list
    if not can_run:
        for r in preempted:  # released already: queued again though nothing was admitted
            self._enqueue(r)
        return None
    admitted = {id(r) for r in can_run}
    self.waiting = [r for r in self.waiting if id(r) not in admitted]
    for r in preempted:
        self._enqueue(r)
    new_chunked = adder.new_chunked_req
    self.chunked_req = new_chunked if new_chunked is not None else still_chunked
    # allocate the extend KV (prepare_for_extend): evict the shortfall first; at page > 1
    # alloc_paged_token_slots_extend asks for the extend *tokens* plus a page per request
    # (not the page-rounded extend)
    ps = self.ps
    need = 0
    extend_tokens = 0
    for r in can_run:
        seq_end = r.prefix_len + r.extend_len
        need += ceil_paged(seq_end, ps) - ceil_paged(r.prefix_len, ps)
        extend_tokens += r.extend_len
    target = extend_tokens + len(can_run) * ps if ps > 1 else need
    self._evict_for(target, "prefill", can_run)
    if self.available() < need:
        raise ReplayError(
            f"prefill allocation failed at t={t} ns: need {need}, "
            f"available {self.available()} (admission should have prevented this)"
        )
    tokens = 0
    for r in can_run:
        if r is not chunked:
            # a new (or re-queued) request: its lock was taken by the adder
            r.tree_len = r.prefix_len
            r.kv_len = r.prefix_len
            if r.state == WAITING and not r.prefilled_once:
                r.cached_tokens = r.prefix_len
                r.entry_ns = t
            r.prefilled_once = True
            r.state = RUNNING
            if r.lock_handle is not r.last_node:
                # adder locked last_node; remember it as our handle
                r.lock_handle = r.last_node
        seq_end = r.prefix_len + r.extend_len
        self._alloc(r, ceil_paged(seq_end, ps) - ceil_paged(r.kv_len, ps))
        r.kv_len = seq_end
        tokens += r.extend_len
    self.pass_index += 1
    return Batch(
        "prefill",
        list(can_run),
        [r.gen for r in can_run],
        self.pass_index,
        0,
        tokens,
        [r.kv_len for r in can_run],
        [not r.is_chunked for r in can_run],
    )


def _preempt_for(
    self: Scheduler, req: SimReq, adder: PrefillAdder, preempted: list[SimReq]
) -> bool:
    """0.5.23 ``PrefillAdder.preempt_to_schedule``: release running requests less
    important than ``req`` by more than the threshold, least important (then newest)
    first, until their reservations cover what ``req`` needs beyond the adder's
    budget; False (nothing released) when they do not. Each is released as a retraction
    is (``_requeue``: no insert, ``remaining × retract_decode_steps`` tokens evicted)
    and added to ``preempted`` (queued again after the pass's admissions)."""
    sign = self.prio_sign
    mine = self._priority(req)
    ratio = self.tracker.current
    clip = self.cfg.clip_max_new_tokens

    def offset(r: SimReq) -> float:
        # ``_get_running_request_total_token_offset``
        return min(r.max_new_tokens - r.output_len, clip) * (1.0 if r.ignore_eos else ratio)

    cands = sorted(
        (r for r in self.running if r.state == RUNNING and r not in preempted),
        key=lambda r: (self._priority(r) * -sign, -r.wait_seq),
    )
    need = req.fill_len - req.prefix_len + min(req.max_new_tokens, clip) - adder.rem_total_tokens
    chosen: list[SimReq] = []
    for r in cands:
        if (mine - self._priority(r)) * -sign <= self.cfg.priority_threshold:
            break
        chosen.append(r)
        need -= offset(r)
        if need <= 0:
            break
    if not chosen or need > 0:
        return False
    gone = {id(r) for r in chosen}
    released = 0
    steps = self.cfg.retract_decode_steps
    for r in self.running:  # in the running batch's order, as 0.5.23 releases them
        if id(r) not in gone:
            continue
        adder.rem_total_token_offset -= offset(r)
        released += 1
        self._requeue(r)
        self._evict_for((len(self.running) - released) * steps, "retract", [r])
    self.running = [r for r in self.running if id(r) not in gone]
    preempted.extend(chosen)
    self.stats.preemptions += len(chosen)
    return True


def _mix(self: Scheduler, batch: Batch) -> None:
    """Mixed chunked prefill (``--enable-mixed-chunk``, 0.5.23
    ``_get_new_batch_prefill_raw``): once the prefill batch holds its KV, the running
    requests -- less those whose result in flight finishes them by length, which leave
    the running batch -- are decoded in the same pass if ``check_decode_mem`` finds
    their next tokens room (evicting for them); else they sit this pass out (no
    retraction). Mixed in, they leave the running batch and come back with the prefill
    batch they rode in (``running_batch = last_batch``); their result inserts nothing
    unless it finishes them."""
    rows = self._decode_batch()
    if len(rows) < len(self.running):
        self.batch_is_full = False
        self.running = rows
    if not rows:
        return
    need = self._decode_need(rows)
    self._evict_for(need, "check_decode", rows)
    if self.available() < need:
        return
    self._decode_alloc(rows)
    batch.mixed = rows
    batch.mixed_gens = [r.gen for r in rows]
    batch.mixed_seq = sum(r.kv_len for r in rows)
    batch.tokens += len(rows)
    self.stats.mixed_passes += 1
    self.running = []
    self.pending_merge.extend(rows)
