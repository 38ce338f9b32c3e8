"""The simulated SGLang scheduler loop (overlap and normal), in virtual time.

Why one ~1,000-line module: the loop is one algorithm whose steps share the worker's state
(queue, running batch, pool, tree, publish counters) and whose order *is* the model (what is
evicted before which store is queued): the iteration, result processing, the tree
operations and the stepping API stay here, together. Its steps' own rules are functions
bound as ``Scheduler`` methods in the class body: prefill batch formation in
``replay.prefillbatch``, decode passes, their memory and retraction in
``replay.decodemem``, idle publishes, flushes, aborts and PD transfers in
``replay.loopcontrol``, decode-stretch skipping in ``replay.stretch``, visibility marks in
``replay.marks``; request and batch records are in ``replay.request``.

The model, this file's and its bound modules' together (SGLang's ``scheduler.py`` loops;
docs/sglang-sources.md):

* the loop: each iteration receives arrived requests, stashes the in-flight chunked
  request (its chunk is inserted → one store), merges the last prefill batch into the
  running batch, builds a prefill batch (``replay.admission.PrefillAdder`` over the queue
  ordered by ``replay.policy``; under priority scheduling a request that finds the running
  batch full may preempt less important running ones, ``_preempt_for``) or else a decode
  batch, allocates KV (evicting whole LRU leaves on a shortfall), launches it, then

  - **overlap** (default): processes the *previous* batch's result — so removals caused
    while scheduling batch k+1 are queued before batch k's prefill stores; GPU timing by
    default (the next iteration runs while the forward does); with ``sync_forward`` (what a
    ``--device cpu`` worker does: the launch runs the forward) the iteration receives and
    processes the previous result only after the current forward ends;
  - **normal** (``disable_overlap_schedule``): processes this batch's result at once;

* result processing: a final prefill chunk checkpoints the prompt (one store) and the
  request joins decode; a finished request inserts prompt + output − 1 tokens (one store),
  frees its private KV and unlocks; publishes after every prefill result, at every
  ``decode_log_interval``-th decode result counted globally (reset by a flush), and when
  fully idle (``on_idle``, which also resets ``new_token_ratio``);
* decode memory: ``check_decode_mem`` (evict the shortfall; at page > 1 the allocation
  then evicts until a page per running request is free, ``alloc_paged_token_slots_decode``'s
  over-estimate, every pass), retraction (fewest outputs
  first, ties longest prompt; no store; evict ``remaining × 20`` tokens; re-queue;
  ratio re-estimated over the requests that stay; in the overlap loop a short step with a
  request finishing in flight decodes nothing instead), abort of waiting / running requests, flushes (``AllBlocksCleared`` alone);
* closed-loop clients: a lane's next request arrives ``gap`` after its predecessor finishes,
  the recorded gap scaled by the predecessor's simulated / recorded latency
  (``scale_client_gaps``: the gap spans as many passes as it did on the real worker);
* decode stretches: when only decode happens, whole stretches of passes are advanced at
  once up to the next finish, publish point, arrival or a pass whose KV does not fit even
  after evicting (passes short of free slots evict inside the stretch as they would
  stepped; identical output, statistics included);
* stepping: ``start``, ``step(horizon)`` (one loop iteration, or one skipped stretch),
  ``next_time``, ``add_arrival``, ``finish_run`` and the ``on_finish`` hook; ``run`` drives
  them for one worker and ``replay.fleet`` for many ranks in one clock (one loop body);
* visibility: per stored page, the pass that computed it — prefill marks per request and
  one shared decode log (a decoding request is in every decode pass, so its decoded
  positions map to consecutive log entries): no per-request, per-pass bookkeeping.

KV accounting is in tokens: a request covers sequence positions ``[0, kv_len)``; the first
``tree_len`` are in the radix tree (locked through ``last_node``), the rest are private
slots (``alloc`` = page-ceiled). ``available = pool − tree.total_size − Σ alloc``.
"""

from __future__ import annotations

import contextlib
import heapq
import random
import sys
from array import array
from collections.abc import Callable, Iterator, Sequence
from typing import Any

from kvcadence.errors import ReplayError
from kvcadence.format.namespace import Namespace
from kvcadence.gcpause import gc_paused
from kvcadence.replay import decodemem, loopcontrol, marks, prefillbatch, stretch
from kvcadence.replay.admission import NewTokenRatioTracker, ceil_paged
from kvcadence.replay.config import SimConfig
from kvcadence.replay.events import EventQueue, Publisher
from kvcadence.replay.evictiontrace import EvictionTrace
from kvcadence.replay.flushes import FlushPlan
from kvcadence.replay.radix import PROMPT_PRIORITY, Hasher, Node, NullSink, RadixTree
from kvcadence.replay.request import ABORTED, FINISHED, RUNNING, Batch, SimReq, SimStats
from kvcadence.replay.schedule import RequestSpec, Schedule
from kvcadence.replay.timing import PassTimer
from kvcadence.replay.tokens import CODE

_INF = float("inf")


#: the first placeholder token id of ``Scheduler.hold_unseen`` (past any model's vocabulary)
UNSEEN_TOKEN_BASE = 1 << 31


class _TreeCacheAdapter:
    """``TreeCacheLike`` over the radix tree (no HiCache: load-back always fails)."""

    def __init__(self, tree: RadixTree) -> None:
        self.tree = tree
        #: ``dec_lock_ref`` itself (no wrapper call per unlock)
        self.unlock: Callable[[Node], None] = tree.unlock

    def evictable_size(self) -> int:
        return self.tree.evictable_size

    def lock(self, node: Node) -> Node:
        self.tree.lock(node)
        return node

    def init_load_back(self, req: Any, host_hit_length: int) -> int:
        return 0


class _AllocatorAdapter:
    """``AllocatorLike``: free slots of the simulated pool."""

    def __init__(self, sched: Scheduler) -> None:
        self.sched = sched
        self.page_size = sched.cfg.page_size
        #: ``Scheduler.available`` itself (no wrapper call per budget check)
        self.available_size: Callable[[], int] = sched.available


class Scheduler:
    """One simulated SGLang worker (one DP rank) driven by a ``Schedule``."""

    # visibility marks (replay/marks.py) and decode stretches (replay/stretch.py)
    computed_at = marks.computed_at
    visibility_frames = marks.visibility_frames
    _mark_index = staticmethod(marks._mark_index)
    _record_store = marks._record_store
    _mark_batch = marks._mark_batch
    _skip_decode_stretch = stretch._skip_decode_stretch
    _stretch_needs = stretch._stretch_needs
    _evict_through_stretch = stretch._evict_through_stretch
    # prefill batches (replay/prefillbatch.py), decode passes and retraction
    # (replay/decodemem.py), idle / flush / abort / PD transfers (replay/loopcontrol.py)
    _stash_chunked = prefillbatch._stash_chunked
    _num_allocatable = prefillbatch._num_allocatable
    _calc_priority = prefillbatch._calc_priority
    _get_new_batch_prefill = prefillbatch._get_new_batch_prefill
    _preempt_for = prefillbatch._preempt_for
    _mix = prefillbatch._mix
    _decode_batch = decodemem._decode_batch
    _update_running_batch = decodemem._update_running_batch
    _decode_need = decodemem._decode_need
    _decode_alloc = decodemem._decode_alloc
    _decode_fits = decodemem._decode_fits
    _retract = decodemem._retract
    _requeue = decodemem._requeue
    _pause = decodemem._pause
    _fully_idle = loopcontrol._fully_idle
    _on_idle = loopcontrol._on_idle
    _maybe_flush = loopcontrol._maybe_flush
    _flush_due = loopcontrol._flush_due
    force_flush = loopcontrol.force_flush
    _apply_aborts = loopcontrol._apply_aborts
    _hold_for_transfer = loopcontrol._hold_for_transfer
    _poll_transfers = loopcontrol._poll_transfers

    def __init__(
        self,
        cfg: SimConfig,
        schedule: Schedule,
        hasher: Hasher,
        *,
        publisher: Publisher | None = None,
        on_publish: Callable[[int], None] | None = None,
        requests: list[SimReq] | None = None,
        on_finish: Callable[[SimReq, int], None] | None = None,
        flush_plan: FlushPlan | None = None,
    ) -> None:
        """``requests``: serve these instead of the schedule's (a driver's shared list,
        indexed by spec ``idx``; the driver prepares them and hands each its arrival with
        ``add_arrival``). ``on_finish(req, t)``: called when a request finished or was
        aborted at ``t`` (after the lane's next gap was scaled); when given, the driver
        releases the lane's next request (``replay.fleet`` routes it to any rank), not this
        scheduler. ``flush_plan``: the recorded flushes in request order
        (``replay.flushes``; instead of the schedule's ``flush_times_ns``)."""
        self.cfg = cfg
        self.schedule = schedule
        self.ps = cfg.page_size
        self.overlap = not cfg.disable_overlap_schedule
        #: the forward runs inside the launch (CPU device): the overlap loop receives and
        #: processes the previous result only after the current forward ends
        self.sync = cfg.sync_forward
        #: mixed chunked prefill (0.5.23 ``is_mixed_chunk``: only with chunked prefill on)
        self.mixed = (
            cfg.enable_mixed_chunk and cfg.chunked_prefill_size is not None and cfg.role == "both"
        )
        self.queue = EventQueue(cfg.sglang_version, cfg.medium)
        self.tree = RadixTree(
            cfg.page_size, hasher, self.queue, cfg.eviction_policy, cfg.slru_protected
        )
        self._unseen = 0  # placeholder tokens handed out (``hold_unseen``)
        self.publisher = publisher or Publisher(
            cfg.sglang_version, cfg.medium, cfg.attn_dp_rank, schedule.anchor_ns
        )
        self.on_publish = on_publish
        self.timer = PassTimer(cfg.timing)
        self.tracker = NewTokenRatioTracker(
            cfg.init_new_token_ratio,
            cfg.min_new_token_ratio_factor,
            cfg.new_token_ratio_decay_steps,
            cfg.schedule_conservativeness,
            cfg.retract_decode_steps,
        )
        self.tc = _TreeCacheAdapter(self.tree)
        self.allocator = _AllocatorAdapter(self)
        shared = requests is not None
        self.reqs: list[SimReq] = (
            requests if requests is not None else [SimReq(s) for s in schedule.requests]
        )
        self.role = cfg.role
        #: radix inserts happen (a decode worker inserts only with its decode radix cache)
        self.inserts = cfg.role != "decode" or cfg.decode_radix_cache
        if self.role == "prefill" and not shared:
            # PrefillBootstrapQueue._process_req: max_new_tokens = 1 (one token, no decode);
            # a driver sharing its requests: each request when it is handed to this rank
            # (``add_arrival``), so a fleet's other (non-prefill) ranks keep theirs
            for r in self.reqs:
                r.n_out = r.max_new_tokens = 1
        self.on_finish = on_finish
        #: pred idx -> the lane's next requests (idx into ``self.reqs``)
        self.successors: dict[int, list[int]] = {}
        for r in self.reqs:
            if r.spec.pred is not None:
                self.successors.setdefault(r.spec.pred, []).append(r.idx)
        self.arrivals: list[tuple[int, int]] = []
        self.flush_plan = flush_plan
        if not shared:
            for s in schedule.requests:
                if s.pred is None:
                    at = (s.arrival_ns or 0) + self._kv_ready_ns(s)
                    self._push_arrival(at, s.idx)
        #: virtual times of the flushes to perform (each once fully idle), sorted
        self.flush_times = list(schedule.flush_times_ns) if flush_plan is None else []
        self.waiting: list[SimReq] = []
        self.running: list[SimReq] = []
        self.pending_merge: list[SimReq] = []
        self.chunked_req: SimReq | None = None
        self.batch_is_full = False
        #: ``cfg.effective_max_running``, read once (a property; checked per batch build)
        self.max_running = cfg.effective_max_running
        #: priority scheduling: the waiting queue's sort key of a request (None: off),
        #: whether a request may preempt running ones, and the order entries are made in
        self.prio_key: Callable[[SimReq], int] | None = (
            self._prio_sort_key if cfg.enable_priority_scheduling else None
        )
        self.preemption = cfg.priority_preemption
        #: 1: a lower priority value is more important (``--schedule-low-priority-values-
        #: first``), -1: a higher one (SGLang's default)
        self.prio_sign = 1 if cfg.schedule_low_priority_values_first else -1
        self.wait_seq = 0
        #: ``--prefill-decode-interval``: decode rounds left before a prefill may run again
        self.pdi = cfg.prefill_decode_interval
        self.pdi_left = 0
        #: ``--min-free-slots-delay`` (``MinFreeSlotsDelayer``): the free running-request
        #: slots a fresh prefill waits for while some request runs (None: off)
        self.min_free_slots = cfg.min_free_slots
        #: ``--scheduler-recv-interval`` (``SchedulerRecvSkipper``): its counter, and the kind
        #: of the previous iteration's batch (None: none) whose weight it adds
        self.recv_interval = cfg.scheduler_recv_interval
        self.recv_counter = 0
        self.last_kind: str | None = None
        #: ``processed_tokens_counter``, ``hrrn``'s clock: each launch's extend tokens
        self.processed_tokens = 0
        #: ``random`` scheduling's shuffles (seeded: a replay is deterministic)
        self.rng = random.Random(cfg.random_seed)
        #: what a decode launch adds to it: 0.5.23 counts ``batch.extend_num_tokens`` of
        #: every launch, and a decode batch is the running batch object, which keeps the
        #: ``extend_num_tokens`` of the prefill batch it was made from (``running_batch =
        #: last_batch`` when the running batch was empty; a merge into it keeps its value)
        self.decode_extend_tokens = 0
        self.pending_merge_tokens = 0
        #: ``calc_priority`` calls counted towards the waiting-prefix refresh (policy.py)
        self._prefix_refresh_calls = 0
        self.private_total = 0
        self.decode_ct = 0
        self.pass_index = -1
        self.last_pass_published = -1
        self.stats = SimStats()
        #: (reason, global decode counter, pass index, virtual ns) of every published batch
        self.publish_log: list[tuple[str, int, int, int]] = []
        self.finished_count = 0
        #: stepping state: local virtual time, the batch in flight (overlap), parked = the
        #: run is over unless ``add_arrival`` hands it more; asleep-idle since (ns)
        self.t = 0
        self.last: Batch | None = None
        self.parked = False
        self._idle_since: int | None = None
        self._started = False
        self.gpu_free = 0
        self._aborts: dict[str, int] = {}
        #: pause commands: (at_ns, until_ns, mode), sorted
        self._pauses: list[tuple[int, int, str]] = []
        self.paused_until: int | None = None
        #: PD prefill: requests whose KV is being transferred, (done_ns, idx)
        self.held: list[tuple[int, int]] = []
        self.track = cfg.track_visibility
        #: ``cfg.skip_decode_stretches``, read once (checked every step)
        self.skip_stretches = cfg.skip_decode_stretches
        #: ``trace_evictions``' trace (None: none kept)
        self.eviction_trace: EvictionTrace | None = None
        #: ``cfg.admission_generation``, read once (a property that parses the version
        #: string; read twice per prefill batch otherwise)
        self.adm_generation = cfg.admission_generation
        #: stores queued since the last publish: the computing pass of each stored page
        self.vis_pending: list[array[int]] = []
        #: one entry per published batch that carried stores: (seq, publish pass, publish
        #: ns, reason, computing pass of each stored page); a pass's end ns and phase are
        #: ``pass_end`` / ``pass_phase`` (``visibility_frames`` joins them)
        self.vis_frames: list[tuple[int, int, int, str, array]] = []
        #: every pass (tracking on), by pass index: its end ns and phase (0 prefill, 1 decode)
        self.pass_end = array("q")
        self.pass_phase = array("b")
        #: the decode log: pass index and end ns of every decode pass, in order
        self._dec_pass = array("q")
        self._dec_end = array("q")
        if flush_plan is not None:
            flush_plan.attach(self._flush_due)

    def preload(
        self, keys: Sequence[Sequence[int]], namespaces: Sequence[Namespace | None] | None = None
    ) -> int:
        """Insert prefixes the worker held before the capture started (``replay.precached``)
        into the tree before the first pass, with no event (they were stored before), each
        page floored, in order (the first oldest), while the pool has room (``namespaces``:
        each one's cache namespace, the default where not given); returns the tokens
        inserted."""
        tree = self.tree
        before = tree.total_size
        with self._silent():
            for i, key in enumerate(keys):
                n = len(key) - len(key) % self.ps
                if n and tree.total_size + n <= self.cfg.max_total_tokens:
                    tree.insert(
                        key, end=n, root=tree.root_of(namespaces[i] if namespaces else None)
                    )
        return tree.total_size - before

    @contextlib.contextmanager
    def _silent(self) -> Iterator[None]:
        """Inserts that publish nothing: the tree's event sink dropped and no visibility
        entry noted (each store's entry is paired with its event), both restored after."""
        tree = self.tree
        sink, tree.sink = tree.sink, NullSink()
        track, self.track = self.track, False
        try:
            yield
        finally:
            tree.sink, self.track = sink, track

    def hold_unseen(self, runs: Sequence[int]) -> int:
        """Hold a placeholder for each run of pages the worker held before the capture and
        evicted during it (``replay.heldbefore``: page counts, oldest first), before the
        first pass, with no event: a root child of token ids no prompt has (past any vocab),
        so nothing matches it and it leaves as the worker's did, evicted oldest first (each
        inserted older than the next); while the pool has room. Returns the tokens held."""
        tree = self.tree
        before = tree.total_size
        with self._silent():
            for pages in runs:
                n = pages * self.ps
                if n <= 0 or tree.total_size + n > self.cfg.max_total_tokens:
                    continue
                first = UNSEEN_TOKEN_BASE + self._unseen
                self._unseen += n
                tree.insert(array(CODE, range(first, first + n)))
        self.stats.held_before_tokens += tree.total_size - before
        return tree.total_size - before

    # ------------------------------------------------------------------ accounting
    def available(self) -> int:
        return self.cfg.max_total_tokens - self.tree.total_size - self.private_total

    def trace_evictions(self, trace: EvictionTrace) -> None:
        """Record every eviction into ``trace`` (``replay.evictiontrace``). Decode stretches
        are then stepped pass by pass (the same output: ``skip_decode_stretches`` is an
        optimisation), so each eviction is traced at its own pass with its batch."""
        self.eviction_trace = trace
        self.skip_stretches = False

    def _evict_for(self, need: int, cause: str, reqs: Sequence[SimReq]) -> None:
        """Evict for a demand of ``need`` free tokens (``evict_to_free_tokens``): the
        shortfall, whole leaves; traced with its ``cause`` and the batch ``reqs``."""
        avail = self.available()
        if avail < need:
            freed = self.tree.evict(need - avail)
            if freed:
                self.stats.evictions += 1
            if self.eviction_trace is not None:
                self.eviction_trace.record(
                    self.t, cause, need - avail, avail, self.available(), reqs
                )

    def _alloc(self, req: SimReq, new_alloc: int) -> None:
        req.alloc += new_alloc
        self.private_total += new_alloc

    def _free_private(self, req: SimReq) -> None:
        self.private_total -= req.alloc
        req.alloc = 0

    def _match(self, req: SimReq) -> None:
        """``init_next_round_input``: device match capped at len − 1 (and at the position
        its input logprobs start at, where it asked for them: ``RequestSpec.logprob_cap``),
        page aligned."""
        tree = self.tree
        limit = req.fill_len - 1
        cap = req.spec.logprob_cap
        if cap is not None and cap < limit:
            limit = cap
        n, node = tree.match_prefix(req.fill, limit, tree.root_of(req.spec.namespace))
        req.prefix_len = n
        req.last_node = node
        req.host_hit_length = 0

    def _match_whole(self, req: SimReq) -> None:
        """A cache-aware policy's match (0.5.23 ``_compute_prefix_matches``:
        ``match_kv_cache`` with no ``max_prefix_len``): the whole prompt, page aligned --
        a fully cached prompt matches (and touches, and splits at) its last page too
        (``policy.matched``: what the policy ranks it by)."""
        tree = self.tree
        n, node = tree.match_prefix(req.fill, req.fill_len, tree.root_of(req.spec.namespace))
        req.prefix_len = n
        req.last_node = node
        req.host_hit_length = 0

    # ------------------------------------------------------------------ publish
    def _publish(self, t: int, pass_index: int, reason: str) -> None:
        events = self.queue.take()
        if events:
            self.publish_log.append((reason, self.decode_ct, pass_index, t))
            self.publisher.publish(events, t, pass_index)
            pending = self.vis_pending
            if pending:
                # arrays, not lists: the log is not walked by the cyclic GC
                passes = pending[0]
                for p_ in pending[1:]:
                    passes += p_
                self.vis_pending = []
                seq = self.publisher.seq - 1
                self.vis_frames.append((seq, pass_index, t, reason, passes))
            if self.on_publish is not None:
                self.on_publish(len(events))

    # ------------------------------------------------------------------ public control
    def request_abort(self, rid: str, at_ns: int) -> None:
        """Abort ``rid`` at virtual time ``at_ns`` (tests; recorded aborts)."""
        self._aborts[rid] = at_ns

    def request_pause(self, at_ns: int, until_ns: int, mode: str = "retract") -> None:
        """``pause_generation`` at ``at_ns`` and ``continue_generation`` at ``until_ns``.

        ``mode="retract"`` retracts every running request (no store; re-queued, prompts stay
        cached); ``"in_place"`` keeps them. Either way the pause publishes the queue."""
        if mode not in ("retract", "in_place"):
            raise ValueError(f"unknown pause mode {mode!r}")
        self._pauses.append((at_ns, max(at_ns, until_ns), mode))
        self._pauses.sort()

    # ------------------------------------------------------------------ tree operations
    def _insert_upto(self, req: SimReq, upto: int) -> None:
        """Checkpoint ``req.seq[:upto]`` (page floored) into the tree; move the lock."""
        if not self.inserts:
            return
        ps = self.ps
        end = upto - upto % ps
        if end <= req.tree_len:
            # nothing new to insert, but SGLang 0.5.23's checkpoint still inserts the request's
            # page-aligned key from the root (``UnifiedRadixCache.checkpoint_into_tree`` ->
            # ``insert``), which refreshes every node's LRU stamp on the path. Confirmed on
            # the real worker (Rust tree core), page 16, pool 192: A (65 tokens, 15 out)
            # finishes after B (65 tokens, prefilled after A); a third prompt that needs one
            # leaf evicts B in 7 of 7 runs (A when A finishes before B's prefill, 2 of 2)
            h = req.lock_handle
            if h is not None and h is not self.tree.root and h.key:  # not a namespace's root
                self.tree.insert_below(h, req.tree_len, (), req.inserted_len)
            if end > req.inserted_len:
                req.inserted_len = end
            return
        tree = self.tree
        start = req.lock_handle
        home = tree.root_of(req.spec.namespace)
        if start is None or start is home:
            start, depth = home, 0
        else:
            depth = req.tree_len  # the locked node's path: only the tokens past it are walked
        existing, node, new = tree.insert_below(
            start, depth, req.seq_slice(depth, end), req.inserted_len
        )
        if end > req.inserted_len:
            req.inserted_len = end
        if new is not None and self.track:
            self._record_store(req, existing, end)
        prompt = len(req.ids)
        prompt -= prompt % ps
        if depth < prompt < end:
            # rule: the key runs past the prompt from above its end (a retracted request's
            # re-prefill, prompt + outputs): SGLang 0.5.23's checkpoint inserts the prompt's
            # page-aligned key again (``UnifiedRadixCache.checkpoint_into_tree``: "split the
            # leaf at the prompt boundary so eviction can drop the output KV without the
            # prompt"), so the outputs are a leaf of their own (no event); that insert's
            # priority is the request's + 1 (its prompt outlives its outputs under ``priority``)
            tree.insert_below(start, depth, req.seq_slice(depth, prompt), prompt, PROMPT_PRIORITY)
        elif 0 < prompt < end and tree.policy == "priority":
            # the same insert at a finish (the prompt's nodes end at its last page already:
            # no split); only its priority can change an eviction, so only walked then
            tree.insert_below(home, 0, req.seq_slice(0, prompt), prompt, PROMPT_PRIORITY)
        old = req.lock_handle
        if old is not None:
            self.tree.relock(old, node)
        else:
            self.tree.lock(node)
        req.lock_handle = node
        req.last_node = node
        freed = end - req.tree_len  # private slots now owned by the tree (or duplicates)
        req.tree_len = end
        req.alloc -= freed
        self.private_total -= freed

    def _release(self, req: SimReq, insert: bool) -> None:
        if insert:
            self._insert_upto(req, req.kv_len)
        self._free_private(req)
        if req.lock_handle is not None:
            self.tree.unlock(req.lock_handle)
        req.lock_handle = None
        req.last_node = None
        req.kv_len = req.tree_len = req.inserted_len = 0
        req.marks = []
        req.dec0 = None

    def _finish(self, req: SimReq, t: int, insert: bool = True, error: str | None = None) -> None:
        if insert and req.spec.finish_unseen:
            # the capture holds no store of its outputs (``schedule.FINISH_UNSEEN_KEY``): in
            # the tree as the worker's were, with no event
            with self._silent():
                self._release(req, insert)
        else:
            self._release(req, insert)
        req.drop_tokens()  # only live requests hold their prompt's array
        if error is not None:
            req.error = error
        req.state = ABORTED if req.error is not None else FINISHED
        req.finish_ns = t
        self.finished_count += 1
        self.batch_is_full = False
        self._release_successors(req, t)

    def remote_decode_ns(self, req: SimReq) -> int:
        """Prefill role: how much later than this rank's finish the client sees ``req``
        finish (its decode runs on another worker); 0 for the other roles."""
        if self.role == "prefill" and req.spec.decode_ns:
            return max(0, req.spec.decode_ns - self._transfer_ns(req))
        return 0

    def _release_successors(self, req: SimReq, t: int) -> None:
        """Closed loop: the lane's next request arrives its gap after ``req`` finished."""
        if self.cfg.scale_client_gaps and self.role == "both":
            self._scale_next_gap(req, t)
        if self.on_finish is not None:
            self.on_finish(req, t)
            return
        extra = self.remote_decode_ns(req)
        if self.flush_plan is not None:
            self.flush_plan.ledger.finished(req.idx, t)
        for nxt in self.successors.get(req.idx, ()):
            spec = self.reqs[nxt].spec
            gap = spec.gap_ns
            self._push_arrival(t + gap + extra + self._kv_ready_ns(spec), nxt)

    def _push_arrival(self, at: int, idx: int) -> None:
        """Request ``idx`` arrives at ``at`` -- unless it comes after a recorded flush not
        performed yet: then it waits for it (``replay.flushes``)."""
        plan = self.flush_plan
        if plan is not None and plan.holds(idx):
            plan.hold(at, idx, self._arrive)
            return
        heapq.heappush(self.arrivals, (at, idx))

    def _arrive(self, at: int, idx: int) -> None:
        """A request the flush plan held arrives at ``at`` (``FlushPlan.performed``)."""
        heapq.heappush(self.arrivals, (at, idx))

    def _scale_next_gap(self, req: SimReq, t: int) -> None:
        """The recorded gap before the lane's next turn is wall time on the real worker;
        keep it the same share of the predecessor's service time (recorded receive → finish
        becomes simulated arrival → finish), so the next turn arrives after as many passes
        as it did on the real worker (whose speed may have varied). Written into the
        successor's ``gap_ns`` (the recorded value kept in ``meta``) so that drivers routing
        the lane themselves (``replay.fleet``) use it too."""
        e2e = req.spec.e2e_ns
        if not e2e or t <= req.arrival_ns:
            return
        for idx in self.successors.get(req.idx, ()):
            spec = self.reqs[idx].spec
            recorded = spec.meta.setdefault("recorded_gap_ns", spec.gap_ns)
            spec.gap_ns = recorded * (t - req.arrival_ns) // e2e

    def _transfer_ns(self, req: SimReq) -> int:
        """KV transfer time of ``req`` (recorded by a prefill-worker capture, else modelled)."""
        if req.spec.transfer_ns is not None:
            return req.spec.transfer_ns
        tp = self.cfg.timing
        return int((tp.transfer_base_s + tp.transfer_per_token_s * req.input_len) * 1e9)

    def kv_ready_ns(self, spec: RequestSpec) -> int:
        """Decode role: the KV transfer delay before ``spec`` becomes schedulable here."""
        return self._kv_ready_ns(spec)

    def _kv_ready_ns(self, spec: RequestSpec) -> int:
        """Decode role: a request becomes schedulable once its KV has been transferred."""
        if self.role != "decode":
            return 0
        tp = self.cfg.timing
        return int((tp.transfer_base_s + tp.transfer_per_token_s * len(spec.input_ids)) * 1e9)

    # ------------------------------------------------------------------ batch choice
    def _recv_due(self) -> bool:
        """``SchedulerRecvSkipper.handle``: add the previous iteration's weight (a decode
        batch or none 1, any other 1000: at once after a prefill) and receive when the sum
        reaches ``--scheduler-recv-interval``. An idle scheduler receives at once (its spins
        take no modelled time)."""
        if self.last_kind is None and not self.running and self.chunked_req is None:
            self.recv_counter = 0
            return True
        self.recv_counter += 1 if self.last_kind in (None, "decode") else 1000
        if self.recv_counter >= self.recv_interval:
            self.recv_counter = 0
            return True
        return False

    def _defer_prefill(self) -> bool:
        """``_should_defer_prefill``: a decode round of ``--prefill-decode-interval`` instead
        of a prefill, while the running batch holds ``prefill_decode_interval_min_bs``
        requests (and any: an empty one spins through its rounds in no modelled time)."""
        if not self.pdi_left:
            return False
        if len(self.running) < max(1, self.cfg.prefill_decode_interval_min_bs):
            self.pdi_left = 0
            return False
        self.pdi_left -= 1
        return True

    def _get_next_batch(self, t: int) -> Batch | None:
        if self.chunked_req is not None:
            self._stash_chunked()
        if self.pending_merge:
            if not self.running and any(r.state == RUNNING for r in self.pending_merge):
                # the prefill batch becomes the running batch object (``running_batch =
                # last_batch``), its ``extend_num_tokens`` with it
                self.decode_extend_tokens = self.pending_merge_tokens
            for r in self.pending_merge:
                if r.state == RUNNING:
                    self.running.append(r)
            self.pending_merge = []
        # ``_get_new_batch_prefill``'s first refusal inlined (a call per decode pass else)
        if self.pdi_left and self._defer_prefill():
            batch = None
        elif (
            self.waiting and (not self.batch_is_full or self.preemption)
        ) or self.chunked_req is not None:
            batch = self._get_new_batch_prefill(t)
        else:
            batch = None
        if batch is not None:
            # rule (overlap loop): a request stopping at EOS with its first token is merged
            # into the running batch before that result is processed, like a later EOS stop
            eos_first = self.overlap and self.role == "both"
            for r, final in zip(batch.reqs, batch.finals, strict=False):
                if final:
                    r.decode_left = r.n_out - (r.output_len + 1)
                    if r.decode_left > 0 or (eos_first and r.stops_unseen):
                        self.pending_merge.append(r)
            if self.mixed and self.running:
                self._mix(batch)
            self.pending_merge_tokens = batch.tokens
            self.stats.prefill_passes += 1
            self.pdi_left = self.pdi  # ``_arm_prefill_decode_interval``
            return batch
        batch = self._update_running_batch(t)
        if batch is not None:
            self.stats.decode_passes += 1
        return batch

    # ------------------------------------------------------------------ results
    def _process_result(self, batch: Batch, t: int) -> None:
        if batch.kind == "prefill":
            for r, g, upto, final in zip(
                batch.reqs, batch.gens, batch.upto, batch.finals, strict=False
            ):
                if r.gen != g or r.state != RUNNING or not final:
                    continue  # an intermediate chunk is checkpointed at the next schedule
                r.output_len += 1
                if r.first_token_ns is None:
                    r.first_token_ns = t
                if self.role == "prefill":
                    self._hold_for_transfer(r, upto, t)
                elif r.output_len >= r.n_out:
                    # rule: a request finishing with its first token inserts its prompt at
                    # release, once (release_kv_cache(checkpoint=True))
                    if r in self.running:
                        self.running.remove(r)
                    self._finish(r, t)
                elif self.role != "decode":
                    # rule: the prompt is checkpointed after its prefill result whether or
                    # not its first decode slots can be reserved; a later retraction keeps it
                    self._insert_upto(r, upto)
            if batch.mixed:
                self._process_mixed(batch, t)
            self._publish(t, batch.index, "prefill")
            self.last_pass_published = batch.index
            return
        finished = None
        running_state = RUNNING
        for r in batch.reqs:
            if r.state != running_state:
                continue  # retracted (or aborted) after this batch was launched
            n = r.output_len + 1
            r.output_len = n
            if n >= r.n_out:
                if finished is None:
                    finished = []
                finished.append(r)
        if finished is not None:
            running = self.running
            if len(finished) <= 2:
                for r in finished:  # in the running batch at most once (identity match)
                    try:
                        running.remove(r)
                    except ValueError:
                        pass
            else:
                gone = set(map(id, finished))
                self.running = [r for r in running if id(r) not in gone]
            for r in finished:
                self._finish(r, t)
        self.decode_ct = (self.decode_ct + 1) % (1 << 30)
        if self.decode_ct % self.cfg.decode_log_interval == 0:
            self._publish(t, batch.index, "decode")

    def _process_mixed(self, batch: Batch, t: int) -> None:
        """The decoded rows of a mixed prefill: a token each; a finished one releases
        (inserting its sequence), the others insert nothing (0.5.23 skips the checkpoint of
        a mixed batch's ``decoding_reqs``)."""
        for r, g in zip(batch.mixed, batch.mixed_gens, strict=True):
            if r.gen != g or r.state != RUNNING:
                continue  # retracted (or aborted) after this batch was launched
            r.output_len += 1
            if r.output_len >= r.n_out:
                if r in self.running:
                    self.running.remove(r)
                self._finish(r, t)

    # ------------------------------------------------------------------ arrivals, queue
    def _receive(self, t: int) -> None:
        arrivals = self.arrivals
        while arrivals and arrivals[0][0] <= t:
            at, idx = heapq.heappop(arrivals)
            req = self.reqs[idx]
            req.arrival_ns = at
            if req.n_out <= 0:
                # aborted before it was scheduled: emits nothing
                req.state = ABORTED
                req.error = "aborted while waiting"
                req.finish_ns = at
                self.finished_count += 1
                self._release_successors(req, at)
                continue
            self._init_max_new(req)
            self._enqueue(req)

    def _init_max_new(self, req: SimReq) -> None:
        """0.5.23 ``init_req_max_new_tokens``: the output limit capped by the context (the
        worker's ``max_req_len`` less the prompt less one) and by the empty pool (less the
        page-ceiled prompt and a page, less one) -- what admission reserves from; a request
        sent without ``max_new_tokens`` (``schedule``: unbounded) gets exactly that. Never
        below its recorded outputs (a record that ran past it replays them)."""
        cfg, ps = self.cfg, self.ps
        mx = req.max_new_tokens
        if cfg.max_req_input_len is not None:
            mx = min(mx, cfg.max_req_input_len + 5 - req.input_len - 1)
        mx = min(mx, cfg.max_total_tokens - ceil_paged(req.input_len, ps) - ps - 1)
        req.max_new_tokens = max(mx, req.n_out)

    def _enqueue(self, req: SimReq) -> None:
        """``_add_request_to_queue``: ``req`` at the end of the waiting queue, stamped with
        the scheduler's token clock (``hrrn``) and its entry order (priority scheduling's
        ``wait_queue_entry_time``)."""
        self.waiting.append(req)
        req.arrival_processed = self.processed_tokens
        self.wait_seq += 1
        req.wait_seq = self.wait_seq

    def _priority(self, req: SimReq) -> int:
        """``req``'s priority as the worker holds it: the one it was sent with, else the
        least important value (0.5.23 ``_set_or_validate_priority``: ``sys.maxsize`` when low
        values come first, ``-sys.maxsize - 1`` otherwise)."""
        p = req.priority
        if p is None:
            return sys.maxsize if self.prio_sign == 1 else -sys.maxsize - 1
        return p

    def _prio_sort_key(self, req: SimReq) -> int:
        """The waiting queue's priority key: the most important request first."""
        return self._priority(req) * self.prio_sign

    # ------------------------------------------------------------------ main loop
    def run(self, progress: Callable[[int], None] | None = None) -> SimStats:
        """Run the whole schedule (``start``, ``step`` until parked, ``finish_run``);
        returns statistics (events go to the publisher).

        The cyclic garbage collector is paused for the run (restored after): the run
        allocates millions of small objects that live until it ends (requests' token
        lists, nodes, event structs), so collections would only re-walk them (≈ 17 % of a
        run); the objects that do form cycles (tree nodes) are freed when the tree goes."""
        with gc_paused():
            self.start()
            reported = 0
            guard = 0
            while self.step():
                if progress is not None and self.finished_count != reported:
                    progress(self.finished_count - reported)
                    reported = self.finished_count
                guard += 1
                if guard > 50_000_000:
                    raise ReplayError("simulation did not terminate (loop guard)")
            if progress is not None and self.finished_count != reported:
                progress(self.finished_count - reported)
            if self.finished_count < len(self.reqs):
                stuck = [r.rid for r in self.reqs if r.state not in (FINISHED, ABORTED)][:5]
                raise ReplayError(f"simulation ended with unfinished requests: {stuck}")
            return self.finish_run()

    # ------------------------------------------------------------------ stepping API
    def start(self) -> None:
        """Begin the run at virtual time 0: the tree's construction records
        AllBlocksCleared (published as seq 0); a decode worker without its radix cache has
        no tree and publishes nothing."""
        if self._started:
            raise ReplayError("scheduler already started")
        self._started = True
        if self.inserts:
            self.queue.record_clear()
            self._publish(0, -1, "startup")

    @property
    def next_time(self) -> float:
        """Virtual time of the next ``step`` (infinite while parked)."""
        return _INF if self.parked else self.t

    def publish_floor(self) -> float:
        """The earliest virtual time this rank may still publish at by itself: its next
        step's; parked, never (a driver's new arrival or due flush wakes it no earlier than
        that arrival or flush) -- unless a recorded flush is still pending, which a driver
        may force at the time it parked (``force_flush``)."""
        if not self.parked:
            return self.t
        plan = self.flush_plan
        if plan is not None and plan.pending:
            return self._idle_since if self._idle_since is not None else self.t
        return _INF

    def step(self, horizon: float = _INF) -> bool:
        """One iteration of SGLang's event loop at ``self.t`` (a whole decode stretch when
        one can be skipped). ``horizon``: the earliest time a driver may still
        ``add_arrival`` a request (a skipped stretch never jumps over it). Returns False
        once the scheduler is parked: idle with nothing scheduled (no arrival, flush,
        abort, pause or transfer ahead); ``add_arrival`` wakes it."""
        t = self.t
        last = self.last
        arrivals = self.arrivals
        # the skip's cheapest refusals inlined (a call per pass otherwise): an arrival due
        # now also ends any stretch
        if (
            self.running
            and not self.waiting
            and self.chunked_req is None
            and not self.pending_merge
            and self.skip_stretches
            and not (arrivals and arrivals[0][0] <= t)
            and not self.pdi_left
        ):
            before = self.pass_index
            jumped = self._skip_decode_stretch(t, last, horizon)
            if jumped is not None:
                self.t, self.last = jumped
                self._idle_since = None
                if self.recv_interval > 1:  # a decode iteration adds 1 to the skipper
                    self.recv_counter = (
                        self.recv_counter + self.pass_index - before
                    ) % self.recv_interval
                    self.last_kind = "decode"
                return True
        self._idle_since = None
        if self._pauses and self._pauses[0][0] <= t and self.paused_until is None:
            if self.overlap and last is not None:
                t = max(t, last.end_ns)
                self._process_result(last, t)
                last = self.last = None
            self._pause(t)
        if self.paused_until is not None:
            self._receive(t)
            if t < self.paused_until:
                self.t = self.paused_until
                return True
            self.paused_until = None
        if self.recv_interval > 1 and not self._recv_due():
            pass  # ``SchedulerRecvSkipper``: not this iteration
        elif arrivals and arrivals[0][0] <= t:  # ``_receive``'s first check (a call per pass)
            self._receive(t)
        if self._aborts:
            self._apply_aborts(t)
        if self.flush_times:
            self._maybe_flush(t)
        batch = self._get_next_batch(t)
        self.last_kind = None if batch is None else batch.kind
        if batch is not None:
            if batch.kind == "prefill":
                # ``run_batch`` counts each launch's ``extend_num_tokens`` (``hrrn``'s clock)
                self.processed_tokens += batch.tokens
                # a decode worker's "prefill" is the prebuilt batch of transferred KV
                if self.role == "decode":
                    dur = self.timer.prefill_ns(0, len(batch.reqs))
                else:  # the prefix the batch attends to: sequence ends − computed tokens
                    tokens = batch.tokens
                    n, ends = len(batch.reqs), sum(batch.upto)
                    # each row's sequence squared, where the pass time depends on it
                    sq = sum([u * u for u in batch.upto]) if self.timer.sq_ns else 0
                    if batch.mixed:  # a mixed prefill's decoded rows: a token each
                        n += len(batch.mixed)
                        ends += batch.mixed_seq
                        if sq:
                            sq += sum([r.kv_len * r.kv_len for r in batch.mixed])
                    dur = self.timer.prefill_ns(tokens, n, ends - tokens, sq)
            else:
                self.processed_tokens += self.decode_extend_tokens
                timer = self.timer  # the context summed only where the pass depends on it
                ctx = sum([r.kv_len for r in batch.reqs]) if timer.ctx_ns else 0
                dur = timer.decode_ns(len(batch.reqs), ctx)
            start = max(t, self.gpu_free)
            batch.end_ns = start + dur
            self.gpu_free = batch.end_ns
            self.stats.passes += 1
            if self.track:
                self._mark_batch(batch)
        if self.overlap:
            if self.sync and batch is not None:
                # CPU device: the launch runs the forward before the previous result is
                # processed and before the next receive
                t = max(t, batch.end_ns)
            if last is not None:
                t = max(t, last.end_ns)
                self._process_result(last, t)
            elif batch is None:
                t = self._idle(t)
            self.last = batch
        else:
            if batch is not None:
                t = batch.end_ns
                self._process_result(batch, t)
            else:
                t = self._idle(t)
        if self.held:
            self._poll_transfers(t)
        if self.role == "prefill":
            # SGLang resets the flag every iteration (no update_running_batch on a prefill
            # worker)
            self.batch_is_full = False
        self.t = t
        return not self.parked

    def add_arrival(self, at_ns: int, idx: int) -> None:
        """A driver hands request ``idx`` (of ``self.reqs``) to this scheduler, arriving at
        ``at_ns`` (not before ``self.t`` unless it sleeps): wakes it if parked or asleep.
        ``at_ns`` is when the request is schedulable here (a decode rank's driver adds the
        KV transfer, ``kv_ready_ns``). A prefill rank caps it at one new token."""
        if self.role == "prefill":
            r = self.reqs[idx]
            r.n_out = r.max_new_tokens = 1
        self._push_arrival(at_ns, idx)
        self._wake()

    def _wake(self) -> None:
        """Something new is scheduled (an arrival, a due flush): unpark / recompute the
        wake-up of a sleeping scheduler."""
        if self.parked:
            self.parked = False
            if self._idle_since is not None:
                self.t = self._idle_since
        if self._idle_since is not None:
            # asleep since _idle_since: recompute the wake-up with the new arrival
            self.t = self._next_wake(self._idle_since)

    def finish_run(self) -> SimStats:
        """Close the run's statistics (passes, virtual end time) and return them."""
        self.stats.passes = self.pass_index + 1
        self.stats.virtual_ns = self.t
        return self.stats

    def _idle(self, t: int) -> int:
        """No batch to launch (and none to process): idle handling; returns the time of the
        next iteration (parks the scheduler when the run is over)."""
        if not self._idle_step(t):
            self.parked = True
            self._idle_since = t
            return t
        if self._fully_idle():
            self._idle_since = t
        return self._next_wake(t)

    def _idle_step(self, t: int) -> bool:
        """No batch and no last batch: idle handling. False when the run is over."""
        if self._fully_idle():
            self._on_idle(t)
            self._maybe_flush(t)
            if (
                not self.arrivals
                and not self.flush_times
                and not self._aborts
                and not self._pauses
                and not self.held
            ):
                plan = self.flush_plan
                if plan is not None and plan.pending and self.on_finish is None:
                    # requests before the flush that can never finish here: flush now
                    plan.force(t)
                    return True
                return False
            return True
        # waiting requests that cannot be admitted while nothing runs (and no transfer will
        # release a held prompt): they never will
        if not self.running and self.chunked_req is None and self.waiting and not self.held:
            if self.batch_is_full:
                self.batch_is_full = False
                return True
            head = self.waiting.pop(0)
            self._release(head, insert=False)
            head.state = ABORTED
            head.error = "does not fit in the KV pool"
            head.finish_ns = t
            self.finished_count += 1
            self.stats.aborted += 1
            self._release_successors(head, t)
            return True
        return True

    def _next_wake(self, t: int) -> int:
        """Sleep (``--sleep-on-idle``) until the next arrival, flush or abort."""
        if not self._fully_idle():
            if self.held and not self.running and self.chunked_req is None:
                return max(t, self.held[0][0])  # waiting for a held prompt to be released
            return t
        cands = []
        if self.held:
            cands.append(self.held[0][0])
        if self._pauses:
            cands.append(self._pauses[0][0])
        if self.arrivals:
            cands.append(self.arrivals[0][0])
        if self.flush_times:
            cands.append(self.flush_times[0])
        if self._aborts:
            cands.append(min(self._aborts.values()))
        if not cands:
            return t
        nxt = min(cands)
        if nxt <= t:
            return t
        return nxt + self.timer.wakeup_ns
