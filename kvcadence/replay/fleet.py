"""Replaying workers: the one replay driver, N single-rank schedulers in one clock.

Every replay goes through ``Fleet``: a multi-rank worker, several workers, and the
single-rank replay (``replay.simulator.simulate`` is a fleet of one: one worker made by
``replay.worker.one_rank_worker``, ``recorded`` routing, ``model`` pace unless asked for
``recorded``).

What this file owns:

* ``simulate_fleet(workers, router)`` / ``Fleet`` -- every (worker, rank) of the
  ``replay.worker.WorkerInput``s is a ``replay.scheduler.Scheduler`` with its own radix
  cache, event queue, publisher (own seq from 0) and pass timer. They step in one virtual
  clock: always the rank with the smallest local time, ties by slot order. Requests are
  routed by a ``replay.routing`` policy: static policies (``recorded``) at the moment the
  arrival becomes known, dynamic ones at the arrival time itself, seeing the ranks' states
  and (``cache_aware``) only the events the ranks had *published* by then. Closed-loop
  lanes cross ranks: a lane's next request is released ``gap`` after its predecessor
  finishes on whichever rank served it. Recorded flushes are replayed in request order
  (``replay.flushes``): one ledger per worker, one plan per rank with that rank's clears;
* pass-time pacing (``PACES``, ``Fleet.pace_of``): ``recorded`` gives each rank a
  ``pace.PacedTimer`` that keeps it on the pace its requests' outputs were recorded at
  (per rank: ``pace.recorded_token_times``); ``auto`` does so for a multi-rank worker
  under ``recorded`` routing -- the DP controller's round robin was decided on the recorded
  arrival order, which the pass-time model's drift would scramble -- and for a one-rank
  worker whose requests queued (``pace.queued``: a median wait of a second or more), else
  ``model``;
* ``simulate_fleet(..., out=)`` -- the sim bundles (``replay.fleetout.FleetOut``: one per
  worker, one endpoint per rank, the ranks' frames in (publish time, rank, seq) order)
  written as the ranks publish: the fleet tells the output how far every rank has got
  (``publish_floor``, each loop iteration) so a batch is written once no rank can publish
  before it; no rank keeps its batches. ``write_fleet_bundles`` (``replay.fleetout``) writes
  the same bytes from a run that kept them. The single-rank replay writes its own header
  through the same ``simbundle.SimBundleOut`` and streams its frames into it directly.

The single-rank scheduler is driven through its public stepping API: ``start``,
``step(horizon)`` (one loop iteration), ``next_time``, ``add_arrival`` (the router hands a
rank a request; wakes it) and ``finish_run``; every rank serves the fleet's shared request
list (``requests=``) and reports finished requests through ``on_finish``, so the fleet
releases each lane's next request on any rank.

A paced rank steps one pass at a time (no decode stretch is skipped). Otherwise
decode-stretch skipping is bounded by the earliest moment another rank (or a known, not yet
routed arrival) could hand this rank a request (``step``'s ``horizon``, ``bound_for``), so a
stretch never jumps over a cross-rank arrival. An idle rank recomputes its wake-up when a
request is routed to it. The cyclic garbage collector is paused for a run, and by
``simulate_fleet`` (and ``simulator.simulate``) for the fleet's construction too: millions of
long-lived objects that collections would only re-walk.

Why ~500 lines: ``Fleet`` is one clock over many schedulers (routing, pacing, flush ledgers,
finish hooks, the publish floor its outputs need) and the only replay driver; its inputs are
``replay.worker``, its outputs ``replay.fleetout`` and ``replay.simbundle``.
"""

from __future__ import annotations

import copy
import functools
import heapq
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from kvcadence.errors import InputError, ReplayError, UsageError
from kvcadence.format.schema import served_rank
from kvcadence.gcpause import gc_paused
from kvcadence.replay.events import Publisher, QueuedEvent
from kvcadence.replay.fleetout import write_fleet_bundles as write_fleet_bundles
from kvcadence.replay.flushes import FlushLedger, FlushPlan
from kvcadence.replay.heldbefore import runs_to_hold
from kvcadence.replay.pace import PacedTimer, queued, recorded_token_times
from kvcadence.replay.precached import preloads
from kvcadence.replay.radix import Hasher, wire_hasher
from kvcadence.replay.request import ABORTED, FINISHED, SimReq
from kvcadence.replay.routing import make_router
from kvcadence.replay.schedule import RequestSpec, Schedule, build_schedule
from kvcadence.replay.scheduler import Scheduler
from kvcadence.replay.simbundle import sim_request_record
from kvcadence.replay.simrecords import SimRecords
from kvcadence.replay.worker import WorkerInput, spans_next_forward

_INF = float("inf")
#: loop iterations after which a replay is taken to be stuck
_GUARD = 100_000_000
#: pass-time pacing of a fleet replay (``Fleet.pace_of``)
PACES = ("auto", "recorded", "model")


# ---------------------------------------------------------------------- rank plumbing
class TapPublisher(Publisher):
    """``Publisher`` that also keeps each published batch's events (for the cache-aware
    router and the sweep's per-message counts) unless ``keep`` is False."""

    def __init__(self, *a: Any, keep: bool = True, **kw: Any) -> None:
        super().__init__(*a, **kw)
        self.keep = keep
        #: (absolute publish ns, events) per published batch, in order (empty: not kept)
        self.log: list[tuple[int, list[QueuedEvent]]] = []

    def publish(self, events: list[QueuedEvent], time_ns: int, pass_index: int) -> None:
        super().publish(events, time_ns, pass_index)
        if events and self.keep:
            self.log.append((self.anchor_ns + time_ns, events))


@dataclass
class Slot:
    """One simulated rank of one worker."""

    index: int
    worker: int
    rank: int
    sched: Scheduler
    publisher: TapPublisher


# ---------------------------------------------------------------------- the fleet
@dataclass
class FleetResult:
    """Everything one fleet replay produced."""

    workers: list[WorkerInput]
    slots: list[Slot]
    router: str
    requests: Sequence[Any]  # sim RequestRecords, spec order (``SimRecords``: built when read)
    serving: list[int]  # slot index per spec
    anchor_ns: int
    virtual_ns: int
    wall_s: float
    specs: list[RequestSpec]
    extra: dict[str, Any] = field(default_factory=dict)

    def summary(self) -> dict[str, Any]:
        per_slot = []
        for sl in self.slots:
            st = sl.sched.stats
            pub = sl.publisher
            per_slot.append(
                {
                    "worker": self.workers[sl.worker].name,
                    "rank": sl.rank,
                    "requests": sum(1 for x in self.serving if x == sl.index),
                    "passes": st.passes,
                    "prefill_passes": st.prefill_passes,
                    "decode_passes": st.decode_passes,
                    "mixed_passes": st.mixed_passes,
                    "messages": pub.seq,
                    "events": pub.n_events,
                    "evictions": st.evictions,
                    "retractions": st.retractions,
                    **({"preemptions": st.preemptions} if st.preemptions else {}),
                    "aborted": st.aborted,
                    **(
                        {"held_before_tokens": st.held_before_tokens}
                        if st.held_before_tokens
                        else {}
                    ),
                }
            )
        return {
            "route": self.router,
            "workers": len(self.workers),
            "ranks": len(self.slots),
            "requests": len(self.requests),
            "messages": sum(p["messages"] for p in per_slot),
            "events": sum(p["events"] for p in per_slot),
            "evictions": sum(p["evictions"] for p in per_slot),
            "virtual_s": round(self.virtual_ns / 1e9, 6),
            "wall_s": round(self.wall_s, 3),
            "per_rank": per_slot,
        }


class Fleet:
    """N simulated ranks (over one or more workers) stepping in one virtual clock.

    ``event_log``: keep every published batch's events (``TapPublisher.log``: the sweep
    counts them per message); kept anyway for a router that reads them (``reads_events``:
    ``cache_aware``). The single-rank replay and the fleet CLI keep none (memory grows with
    what is live, not with history)."""

    def __init__(
        self,
        workers: Sequence[WorkerInput],
        router: Any,
        *,
        hasher: Hasher | None = None,
        align_workers: bool = False,
        pace: str = "auto",
        event_log: bool = True,
        pace_clamp: tuple[float, float] | None = None,
    ) -> None:
        if pace not in PACES:
            raise UsageError(f"pace {pace!r} not known (choose from {', '.join(PACES)})")
        if not workers:
            raise UsageError("replay: no worker to simulate")
        for w in workers:
            if w.one_rank and w.dp_size != 1:
                raise UsageError(f"{w.name}: a one-rank worker has {w.dp_size} rank configs")
        self.workers = list(workers)
        self.router = router
        self.hasher = hasher or wire_hasher()
        # one global schedule: every worker's requests, renumbered, one anchor
        per_worker: list[Schedule] = []
        #: each worker's own schedule (its requests renumbered into the fleet's list)
        self.schedules = per_worker
        anchors = []
        for w in self.workers:
            sch = build_schedule(
                w.records, default_gap_ns=int(w.rank_configs[0].timing.default_gap_s * 1e9)
            )
            per_worker.append(sch)
            anchors.append(sch.anchor_ns)
        self.anchor_ns = min(anchors)
        specs: list[RequestSpec] = []
        self.home: list[tuple[int, int]] = []  # (worker, recorded rank) per spec
        homes: dict[tuple[int, int], tuple[int, int]] = {}  # one tuple per (worker, rank)
        #: per worker: the flush ledger (None: no recorded flush)
        self.ledgers: list[FlushLedger | None] = []
        for wi, (w, sch) in enumerate(zip(self.workers, per_worker, strict=True)):
            shift = 0 if align_workers else sch.anchor_ns - self.anchor_ns
            base = len(specs)
            n_ranks = w.dp_size
            for s in sch.requests:
                s.idx += base
                if s.pred is not None:
                    s.pred += base
                if s.arrival_ns is not None:
                    s.arrival_ns += shift
                specs.append(s)
                rank = served_rank(s.source) if s.source is not None and not w.one_rank else 0
                if rank >= n_ranks:
                    raise InputError(
                        f"{w.name}: request {s.rid!r} was served by dp rank {rank}, "
                        f"but the worker has {n_ranks} rank(s)"
                    )
                self.home.append(homes.setdefault((wi, rank), (wi, rank)))
            self.ledgers.append(FlushLedger(sch.requests) if w.flush_abs_ns else None)
        self.specs = specs
        self.reqs = [SimReq(s) for s in specs]
        # slots: every rank's scheduler serves the shared request list; this fleet routes
        # each request to one of them and releases lanes across ranks (``_on_finish``)
        self.slots: list[Slot] = []
        for wi, (w, sch) in enumerate(zip(self.workers, per_worker, strict=True)):
            # scheduler time 0 = this absolute capture time of the worker
            origin = sch.anchor_ns if align_workers else self.anchor_ns
            paced = self.pace_of(w, pace, [sp.source for sp in sch.requests if sp.source])
            times: list[dict[int, list[float]]] = [{} for _ in w.rank_configs]
            if paced:
                spans = spans_next_forward(getattr(w.header, "server_info", None))
                for rank, cfg in enumerate(w.rank_configs):
                    mine = [
                        sp
                        for sp in sch.requests
                        if sp.source is not None and self.home[sp.idx] == (wi, rank)
                    ]
                    got = recorded_token_times(
                        [sp.source for sp in mine], cfg.timing, sync_forward=spans
                    )
                    times[rank] = {mine[i].idx: ts for i, ts in got.items()}
            ledger = self.ledgers[wi]
            keep = event_log or bool(getattr(router, "reads_events", False))
            for rank, cfg in enumerate(w.rank_configs):
                cfg = copy.deepcopy(cfg)
                if not w.one_rank:  # a single-rank replay publishes as its config's rank
                    cfg.attn_dp_rank = rank
                cfg.validate()
                pub = TapPublisher(
                    cfg.sglang_version, cfg.medium, cfg.attn_dp_rank, self.anchor_ns, keep=keep
                )
                rank_flushes = w.flushes_of(rank)
                plan = (
                    FlushPlan(rank_flushes, ledger, origin)
                    if ledger is not None and rank_flushes
                    else None
                )
                sched = Scheduler(
                    cfg,
                    Schedule([], self.anchor_ns, [max(0, f - origin) for f in rank_flushes]),
                    self.hasher,
                    publisher=pub,
                    requests=self.reqs,
                    on_finish=self._on_finish,
                    flush_plan=plan,
                )
                if times[rank]:
                    sched.timer = PacedTimer(
                        cfg.timing, sched, times[rank], origin, clamp=pace_clamp
                    )
                self.slots.append(Slot(len(self.slots), wi, rank, sched, pub))
        self.slot_of = {(sl.worker, sl.rank): sl.index for sl in self.slots}
        # prefixes the workers had cached before their capture: each rank's tree holds them
        # from the start (``replay.precached``), and before them (older) placeholders of the
        # pages the worker held before a late capture and evicted during it
        # (``replay.heldbefore``)
        at_slot = ((self.slot_of[self.home[s.idx]], s) for s in specs)
        pre = preloads(at_slot)
        for sl in self.slots:
            pairs = pre.get(sl.index, [])  # (prefix, its cache namespace)
            keys, spaces = [k for k, _ in pairs], [ns for _, ns in pairs]
            runs = workers[sl.worker].unseen.get(sl.rank)
            if runs:
                sl.sched.hold_unseen(runs_to_hold(runs, keys, sl.sched.ps, spaces))
            if keys:
                sl.sched.preload(keys, spaces)
        #: pred idx -> the lane's next requests: every rank's scheduler maps the shared
        #: request list so (``Scheduler.successors``); the fleet reads the first one's
        self.successors: dict[int, list[int]] = self.slots[0].sched.successors if self.slots else {}
        self.serving = [-1] * len(specs)
        self.pending: list[tuple[int, int]] = []  # (arrival ns, idx): known, not routed
        self.static = bool(getattr(router, "static", False))
        #: sinks of the ranks' batches told how far the ranks have got (``advance(ns)``:
        #: no rank publishes before absolute ``ns``): ``replay.fleetout.FleetOut.attach``
        self.outputs: list[Any] = []

    def pace_of(self, w: WorkerInput, pace: str, records: Sequence[Any] = ()) -> bool:
        """Whether worker ``w``'s ranks run on the recorded pace: ``recorded`` yes,
        ``model`` no, ``auto`` when several ranks share the worker's host and the requests
        are routed to their recorded ranks, or one rank's, so routed, when its ``records``
        queued (``pace.queued``): another router serves a rank other requests than those
        whose recorded times the pace aims at."""
        if pace != "auto" or getattr(self.router, "name", None) != "recorded":
            return pace == "recorded"
        return w.dp_size > 1 or queued(records)

    def publish_floor(self) -> float:
        """The earliest virtual time any rank may still publish at: the earliest rank's
        own floor (``Scheduler.publish_floor``) or a known, not yet routed arrival. A rank
        woken by a request or a due flush publishes no earlier than that: a static
        router's arrivals and the flushes come due at or after the finish that released
        them, on a rank stepped at the fleet's earliest time."""
        b = self.pending[0][0] if self.pending else _INF
        for sl in self.slots:
            f = sl.sched.publish_floor()
            if f < b:
                b = f
        return b

    # ------------------------------------------------------------------ routing
    def bound_for(self, sched: Scheduler) -> float:
        """Earliest time another rank (or a pending arrival) could hand ``sched`` a
        request."""
        b = self.pending[0][0] if self.pending else _INF
        for sl in self.slots:
            other = sl.sched
            if other is not sched and other.next_time < b:
                b = other.next_time
        return b

    def _known(self, at: int, idx: int) -> None:
        if self.static:
            self._route(at, idx)  # the rank's flush plan holds it if it must
            return
        # routed at its arrival: one that comes after a recorded flush not performed yet
        # waits for it in its recorded rank's plan, which releases it at its time from
        # the flush (``replay.flushes``)
        plan = self.slots[self.slot_of[self.home[idx]]].sched.flush_plan
        if plan is not None and plan.holds(idx):
            plan.hold(at, idx, self._pend)
        else:
            heapq.heappush(self.pending, (at, idx))

    def _pend(self, at: int, idx: int) -> None:
        heapq.heappush(self.pending, (at, idx))

    def _route(self, at: int, idx: int) -> None:
        slot = self.router.route(self, idx, at)
        if not 0 <= slot < len(self.slots):
            raise ReplayError(f"router {self.router.name!r} chose slot {slot} of {len(self.slots)}")
        self.serving[idx] = slot
        sched = self.slots[slot].sched
        # a decode rank can schedule it only once its KV has been transferred
        sched.add_arrival(at + sched.kv_ready_ns(self.reqs[idx].spec), idx)

    def _on_finish(self, req: SimReq, t: int) -> None:
        """A rank finished (or aborted) ``req`` at ``t``: its lane's next request becomes
        known, arriving its (already scaled) gap later -- plus, from a prefill rank, the
        decode elsewhere -- on whichever rank it is routed to."""
        ledger = self.ledgers[self.home[req.idx][0]]
        if ledger is not None:
            ledger.finished(req.idx, t)  # may make a flush due on any of its ranks
        sl = self.serving[req.idx]
        extra = self.slots[sl].sched.remote_decode_ns(req) if sl >= 0 else 0
        for nxt in self.successors.get(req.idx, ()):
            self._known(t + self.reqs[nxt].spec.gap_ns + extra, nxt)

    # ------------------------------------------------------------------ run
    def run(self, progress: Callable[[int], None] | None = None) -> FleetResult:
        """Run every rank to the end (the cyclic GC paused meanwhile); ``progress(n)``:
        ``n`` more requests finished."""
        with gc_paused():
            return self._run(progress)

    def _run(self, progress: Callable[[int], None] | None) -> FleetResult:
        t0 = time.perf_counter()
        scheds = [sl.sched for sl in self.slots]
        for sched in scheds:
            sched.start()
        for s in self.specs:
            if s.pred is None:
                self._known(s.arrival_ns or 0, s.idx)
        guard = 0
        done_reported = 0
        pending = self.pending
        # one rank (a single-rank replay): no other rank to pick or bound it
        one = scheds[0] if len(scheds) == 1 else None
        alone = one is not None and type(one.timer) is not PacedTimer
        outputs = self.outputs
        anchor = self.anchor_ns
        while True:
            if outputs:
                floor = anchor + self.publish_floor()
                for o in outputs:
                    o.advance(floor)
            if one is not None:
                if alone and not pending:
                    guard, done_reported = self._step_alone(one, progress, guard, done_reported)
                bt = one.next_time
                best = one if bt < _INF else None
            else:
                best = None
                bt = _INF
                for sched in scheds:
                    nt = sched.next_time
                    if nt < bt:
                        bt = nt
                        best = sched
            if pending and pending[0][0] <= bt:
                at, idx = heapq.heappop(pending)
                self._route(at, idx)
                continue
            if best is None:
                # every rank stopped: a flush whose requests before it never finished
                # (inconsistent records) is performed now rather than never
                if any(sched.force_flush() for sched in scheds):
                    continue
                break
            if type(best.timer) is PacedTimer:
                # every paced pass has its own duration: no decode stretch is skipped
                best.step(best.t + 1)
            elif one is not None:
                best.step(pending[0][0] if pending else _INF)
            else:
                best.step(self.bound_for(best))
            guard += 1
            if guard > _GUARD:
                raise ReplayError("simulation did not terminate (loop guard)")
            if progress is not None:
                done = sum(sched.finished_count for sched in scheds)
                if done != done_reported:
                    progress(done - done_reported)
                    done_reported = done
        stuck = [r.rid for r in self.reqs if r.state not in (FINISHED, ABORTED)][:5]
        if stuck:
            raise ReplayError(f"simulation ended with unfinished requests: {stuck}")
        vend = 0
        for sched in scheds:
            vend = max(vend, sched.finish_run().virtual_ns)
        records = SimRecords(  # built when read
            len(self.reqs), self._record, functools.partial(self._record, arrays=True)
        )
        return FleetResult(
            self.workers,
            self.slots,
            getattr(self.router, "name", "?"),
            records,
            list(self.serving),
            self.anchor_ns,
            vend,
            time.perf_counter() - t0,
            self.specs,
        )

    def _step_alone(
        self,
        one: Scheduler,
        progress: Callable[[int], None] | None,
        guard: int,
        done_reported: int,
    ) -> tuple[int, int]:
        """The one rank of a fleet with nothing to route: step it as ``Scheduler.run``
        does (no horizon: no other rank or pending arrival can hand it a request) until it
        parks or a request waits to be routed (``pending``, a dynamic router's); returns
        the loop guard and the finished count reported."""
        pending = self.pending
        while True:
            more = one.step()
            guard += 1
            if guard > _GUARD:
                raise ReplayError("simulation did not terminate (loop guard)")
            if progress is not None and one.finished_count != done_reported:
                progress(one.finished_count - done_reported)
                done_reported = one.finished_count
            if not more or pending:
                return guard, done_reported

    def _record(self, i: int, arrays: bool = False) -> Any:
        """The sim ``RequestRecord`` of request ``i``: its serving rank (the rank its
        publisher stamps), also in ``meta_info`` unless a single-rank replay, and the
        worker's name when there are several; ``arrays``: its ids as arrays."""
        slot = self.slots[self.serving[i]] if self.serving[i] >= 0 else None
        if slot is None:
            return sim_request_record(
                self.reqs[i], self.anchor_ns, None, rank_in_meta=True, arrays=arrays
            )
        w = self.workers[slot.worker]
        return sim_request_record(
            self.reqs[i],
            self.anchor_ns,
            slot.publisher.attn_dp_rank,
            w.name if len(self.workers) > 1 else None,
            rank_in_meta=not w.one_rank,
            arrays=arrays,
        )


def simulate_fleet(
    workers: Sequence[WorkerInput],
    route: str | Any = "recorded",
    *,
    hasher: Hasher | None = None,
    align_workers: bool = False,
    progress: Callable[[int], None] | None = None,
    pace: str = "auto",
    event_log: bool = True,
    out: Any = None,
    pace_clamp: tuple[float, float] | None = None,
) -> FleetResult:
    """Replay ``workers`` with routing policy ``route`` (a name or a router object) and
    pass-time ``pace`` (``PACES``; see ``Fleet.pace_of``; ``pace_clamp``: a paced pass's
    bounds as multiples of the model's, ``pace.PacedTimer``'s ``clamp``, default
    [``pace.PACE_MIN_FACTOR``, ``pace.PACE_MAX_FACTOR``]); ``event_log``: see ``Fleet``.
    ``out`` (a ``replay.fleetout.FleetOut``): its sim bundles are opened before the run and
    every rank's batches written into them as they are published (none kept in
    ``Publisher.batches``); ``out.finish(result)`` completes them, a failed run removes
    them."""

    router = make_router(route) if isinstance(route, str) else route
    with gc_paused():  # the schedules' construction too (they copy every token stream)
        fleet = Fleet(
            workers,
            router,
            hasher=hasher,
            align_workers=align_workers,
            pace=pace,
            event_log=event_log,
            pace_clamp=pace_clamp,
        )
        if out is None:
            return fleet.run(progress)
        out.attach(fleet)
        try:
            return fleet.run(progress)
        except BaseException as exc:
            out.abandon(exc)
            raise
