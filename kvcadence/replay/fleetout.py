"""A fleet replay's sim bundles, written as it runs: one per worker, its ranks' frames merged.

What this file owns:

* the frame order of a multi-rank sim bundle: every rank's batches under its endpoint id
  (= rank) with its own seq, interleaved by **(publish time, rank, seq)** -- the order a sort
  of all the ranks' batches by that key gives, the one order a fleet bundle has;
* ``RankMerge`` -- that order produced while the ranks publish: each batch goes into a
  heap and is written as soon as no rank can still publish an earlier one. A rank
  publishes at nondecreasing times, so nothing of rank ``r`` comes before its last
  batch; the fleet also bounds every rank's future publishes (``Fleet.publish_floor``:
  the earliest rank's next step, a pending arrival, a parked rank's forceable flush) and
  passes that bound on (``advance``). What is held is what some rank may still overtake
  (the batches published ahead of the slowest rank's clock), not the history. A batch that
  arrives below what was already written (the bound was wrong) is a ``ReplayError``, never
  a silently different order;
* ``FleetOut`` -- a fleet replay's outputs: ``out`` itself for one worker, ``out/<worker
  name>`` for several (a name met twice gets its worker index in front); ``attach(fleet)``
  (before the run) opens each worker's ``simbundle.SimBundleOut`` with its header (one
  endpoint ``sim://rank<N>`` per rank; ``sim_config`` = rank 0's config plus ``route``,
  ``dp_size``, ``ranks``) and points every rank's publisher at its worker's merge;
  ``finish(result)`` writes the rest: each rank's visibility notes (none with
  ``track_visibility`` off), the worker's sim ``RequestRecord``s in request order (built one
  at a time), a trailer with the worker's part of the summary (and, for a production
  capture, what was inferred); ``abandon(exc)`` removes what a failed run began;
* ``write_fleet_bundles(out, result)`` -- the same bytes from a run that kept its batches.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

from kvcadence.errors import ReplayError
from kvcadence.format.schema import EndpointInfo
from kvcadence.outguard import refuse_nonempty_dir
from kvcadence.replay.retracted import retractions
from kvcadence.replay.simbundle import SimBundleOut, sim_header
from kvcadence.replay.visibility import scheduler_notes

_INF = float("inf")


class RankMerge:
    """One worker's ranks' batches into its sim bundle in (publish time, rank, seq) order,
    each written once no rank can publish before it (see module docstring)."""

    def __init__(self, out: SimBundleOut, ranks: Sequence[int]) -> None:
        self.out = out
        self._heap: list[tuple[int, int, int, Any]] = []
        #: per rank: the time of its last batch (a rank publishes at nondecreasing times)
        self._last: dict[int, float] = {r: -_INF for r in ranks}
        self._floor = -_INF  # the fleet's bound on every rank's future publishes
        self._written = -_INF  # every batch before this time is written
        self.held_max = 0  # most batches held at once (bench and tests read it)

    def sink(self, rank: int) -> Callable[[Any], None]:
        """A ``Publisher`` sink for ``rank``'s batches."""
        return lambda b: self.push(rank, b)

    def push(self, rank: int, b: Any) -> None:
        t = b.time_ns
        if t < self._written:
            raise ReplayError(
                f"fleet output: rank {rank} published seq {b.seq} at {t} ns after the "
                f"batches up to {self._written} ns were written (publish order bound broken)"
            )
        if t > self._last[rank]:
            self._last[rank] = t
        heapq.heappush(self._heap, (t, rank, b.seq, b))
        if len(self._heap) > self.held_max:
            self.held_max = len(self._heap)
        self._release()

    def advance(self, floor_ns: float) -> None:
        """No rank will publish before absolute ``floor_ns``."""
        if floor_ns > self._floor:
            self._floor = floor_ns
            if self._heap and self._heap[0][0] < floor_ns:
                self._release()

    def _release(self) -> None:
        floor = self._floor
        bound = _INF
        for last in self._last.values():
            lb = last if last > floor else floor
            if lb < bound:
                bound = lb
        heap = self._heap
        while heap and heap[0][0] < bound:
            _t, rank, _seq, b = heapq.heappop(heap)
            self.out.frame(rank, b)
        if bound > self._written:
            self._written = bound

    def close(self) -> None:
        """Every rank is done: write what is held."""
        heap = self._heap
        while heap:
            _t, rank, _seq, b = heapq.heappop(heap)
            self.out.frame(rank, b)
        self._written = _INF


def worker_header(worker: Any, slots: Sequence[Any], router: str, anchor_ns: int) -> Any:
    """The sim bundle header of one worker replayed on ``slots`` (its ranks)."""
    cfg0 = slots[0].sched.cfg
    sim_config = cfg0.to_dict()
    sim_config["route"] = router
    sim_config["dp_size"] = len(slots)
    sim_config["ranks"] = [sl.sched.cfg.to_dict() for sl in slots]
    return sim_header(
        worker.header,
        sglang_version=cfg0.sglang_version,
        command=["kvcadence", "replay", "--route", router],
        start_ns=anchor_ns,
        endpoints=[
            EndpointInfo(id=sl.rank, url=f"sim://rank{sl.rank}", dp_rank=sl.rank, topic=cfg0.topic)
            for sl in slots
        ],
        sim_config=sim_config,
    )


class FleetOut:
    """The sim bundles of one fleet replay (see module docstring). ``out`` is refused
    here when it exists and is not empty, before any work."""

    def __init__(self, out: str | Path) -> None:
        self.path = Path(out)
        refuse_nonempty_dir(self.path)
        self._existed = self.path.is_dir()
        self.paths: list[Path] = []
        self.sims: list[SimBundleOut] = []
        self.merges: list[RankMerge] = []
        self._made_dir = False

    def open(self, workers: Sequence[Any], slots: Sequence[Any], router: str, anchor: int) -> None:
        """Open one sim bundle per worker (``slots``: every rank of every worker)."""
        if len(workers) == 1:
            self.paths = [self.path]
        else:
            self.path.mkdir(parents=True, exist_ok=True)
            self._made_dir = not self._existed
            seen: set[str] = set()
            for wi, w in enumerate(workers):
                name = w.name if w.name not in seen else f"{wi}-{w.name}"
                seen.add(name)
                self.paths.append(self.path / name)
        for wi, (w, p) in enumerate(zip(workers, self.paths, strict=True)):
            mine = [sl for sl in slots if sl.worker == wi]
            sim = SimBundleOut(p)
            sim.open(worker_header(w, mine, router, anchor))
            self.sims.append(sim)
            self.merges.append(RankMerge(sim, [sl.rank for sl in mine]))

    def attach(self, fleet: Any) -> None:
        """Open the bundles of ``fleet`` (a ``replay.fleet.Fleet`` not yet run) and stream
        every rank's batches into them as they are published."""
        self.open(fleet.workers, fleet.slots, getattr(fleet.router, "name", "?"), fleet.anchor_ns)
        for sl in fleet.slots:
            sl.publisher.sink = self.merges[sl.worker].sink(sl.rank)
        fleet.outputs.append(self)

    def advance(self, floor_ns: float) -> None:
        """No rank of the fleet will publish before absolute ``floor_ns``."""
        for m in self.merges:
            m.advance(floor_ns)

    def finish(self, result: Any) -> list[Path]:
        """Write the rest of every worker's bundle from the finished ``result`` (a
        ``replay.fleet.FleetResult``) and close them; returns their paths."""
        try:
            summary = result.summary()
            for wi, (sim, merge) in enumerate(zip(self.sims, self.merges, strict=True)):
                merge.close()
                self._finish_worker(sim, result, wi, summary)
        except BaseException as exc:
            self.abandon(exc)
            raise
        return list(self.paths)

    def _finish_worker(self, sim: SimBundleOut, result: Any, wi: int, summary: dict) -> None:
        w = result.workers[wi]
        slots = [sl for sl in result.slots if sl.worker == wi]
        mine = dict(summary)
        mine["per_rank"] = [p for p in summary["per_rank"] if p["worker"] == w.name]
        if w.inferred:  # a production capture: what was inferred, as the single replay says
            inferred = dict(w.inferred)
            if inferred.get("retracted_in_capture"):
                inferred.update(retractions(w.records, _worker_records(result, wi)))
            mine["inferred"] = inferred
        sim.finish(
            # each rank's visibility notes (none with --no-visibility)
            (
                n
                for sl in slots
                for n in scheduler_notes(sl.sched, result.anchor_ns, endpoint=sl.rank)
            ),
            _worker_records(result, wi, arrays=True),  # ids packed from arrays
            mine,
            result.anchor_ns + max(sl.sched.stats.virtual_ns for sl in slots),
        )

    def abandon(self, exc: BaseException) -> None:
        """A failed run: close and remove every bundle begun (``SimBundleOut.abandon``) and
        the directory made for several workers."""
        for sim in self.sims:
            sim.abandon(exc)
        if self._made_dir:
            try:
                self.path.rmdir()  # only if empty: a write failure's bundles stay for outguard
            except OSError:
                pass


def _worker_records(result: Any, worker: int, arrays: bool = False) -> Iterator[Any]:
    """The sim ``RequestRecord``s served by ``worker``'s ranks, in request order, each
    built when read (``arrays``: their ids as arrays, ``SimRecords.array_record``)."""
    slots = result.slots
    requests = result.requests
    get = (getattr(requests, "array_record", None) if arrays else None) or requests.__getitem__
    for i, sl in enumerate(result.serving):
        if sl >= 0 and slots[sl].worker == worker:
            yield get(i)


def write_fleet_bundles(out: str | Path, result: Any) -> list[Path]:
    """Write the sim bundles of a finished fleet replay whose ranks kept their batches
    (``Publisher.batches``): one worker at ``out``, several at ``out/<worker name>``."""
    fo = FleetOut(out)
    fo.open(result.workers, result.slots, result.router, result.anchor_ns)
    try:
        for sl in result.slots:
            merge = fo.merges[sl.worker]
            for b in sl.publisher.batches:
                merge.push(sl.rank, b)
    except BaseException as exc:
        fo.abandon(exc)
        raise
    return fo.finish(result)
