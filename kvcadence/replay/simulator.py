"""Single-rank replay: a fleet of one, seen as one rank (its own result view and header).

A single-rank replay is the one replay driver (``replay.fleet.Fleet``) run on one worker of
one rank (``replay.worker.one_rank_worker``); this file owns only what is single-rank about
it:

* ``SimResult`` -- the one rank's view of that run: its config, schedule, statistics,
  published batches (none kept when they were streamed into a sim bundle; their counts
  always), sim ``RequestRecord``s (no ``meta_info["dp_rank"]``) and finished
  ``Scheduler``, and the summary a single-rank replay prints and writes in its trailer;
* ``simulate(records, cfg, ...)`` -- that run in memory (no I/O), or, given ``out`` (a
  ``simbundle.SimBundleOut``), writing each published batch into the sim bundle as it is
  published (the header first; ``write_sim_bundle`` finishes it): the run holds no list of
  batches (~4.4 KB a request on the bench's workload);
* ``replay_bundle(src, out, config)`` -- read a bundle (``replay.production`` completes a
  production capture's records; settings by ``replay.worker.effective_config``; one rank's
  recorded flushes), simulate, write the sim bundle (streamed, unless ``keep_batches``);
* ``write_sim_bundle`` -- the single-rank sim bundle through ``replay.simbundle.write_sim``:
  ``Header(source="sim", sim_config=…, server_info copied)`` with one endpoint ``sim://``
  (the fleet's bundles have ``sim://rank<N>`` and ``route`` / ``dp_size`` / ``ranks`` in
  ``sim_config``), one ``EventFrame`` per published batch (real wire bytes, own seq from 0,
  ``via=VIA_SIM``, ``recv_ns`` = virtual publish time anchored at the capture's first
  arrival, ``pass_index``), the visibility notes, the ``RequestRecord``s, a ``Trailer``
  with the run statistics. Deterministic: the same input gives the same bytes;
* ``check_some_ran`` -- the replay commands' exit status when every request was aborted.

Flushes recorded in the source (an ``AllBlocksCleared`` after seq 0 of an epoch, or an
``Annotation`` of kind ``flush``; ``replay.flushes.recorded_flushes``) are replayed in request
order: after every request that finished before them, before every other one, each when the
rank is idle (``replay.flushes``).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvcadence.errors import InputError, ReplayError, UsageError
from kvcadence.format.bundle import BundleReader
from kvcadence.format.schema import EndpointInfo
from kvcadence.gcpause import gc_paused
from kvcadence.outguard import refuse_nonempty_dir
from kvcadence.progress import NoPhases
from kvcadence.replay.config import SimConfig
from kvcadence.replay.events import PublishedBatch
from kvcadence.replay.evictiontrace import EvictionTrace
from kvcadence.replay.fleet import Fleet
from kvcadence.replay.heldbefore import unseen_runs
from kvcadence.replay.loading import load_for_replay
from kvcadence.replay.pace import PacedTimer, median_wait_s
from kvcadence.replay.radix import Hasher
from kvcadence.replay.request import SimStats
from kvcadence.replay.retracted import retractions
from kvcadence.replay.routing import make_router
from kvcadence.replay.schedule import Schedule
from kvcadence.replay.settings import capture_settings
from kvcadence.replay.simbundle import SimBundleOut, sim_header, write_sim
from kvcadence.replay.visibility import visibility_notes
from kvcadence.replay.worker import effective_config, flush_times_from_bundle, one_rank_worker


@dataclass
class SimResult:
    """Everything a single-rank replay produced (the one rank of a fleet of one)."""

    config: SimConfig
    schedule: Schedule
    stats: SimStats
    batches: list[PublishedBatch]
    requests: Sequence[Any]  # RequestRecords (``SimRecords``: built when read)
    wall_s: float = 0.0
    extra: dict[str, Any] = field(default_factory=dict)
    scheduler: Any = None  # the finished Scheduler (tree, publish log) for inspection
    #: messages / events published (None: count ``batches``, all kept)
    messages: int | None = None
    events: int | None = None

    def summary(self) -> dict[str, Any]:
        return {
            "requests": len(self.requests),
            "passes": self.stats.passes,
            "prefill_passes": self.stats.prefill_passes,
            "decode_passes": self.stats.decode_passes,
            "mixed_passes": self.stats.mixed_passes,
            "skipped_decode_passes": self.stats.skipped_passes,
            "messages": len(self.batches) if self.messages is None else self.messages,
            "events": (
                sum(b.n_events for b in self.batches) if self.events is None else self.events
            ),
            "evictions": self.stats.evictions,
            "retractions": self.stats.retractions,
            # running requests released for a more important one (priority scheduling)
            **({"preemptions": self.stats.preemptions} if self.stats.preemptions else {}),
            "aborted": self.stats.aborted,
            "flushes": self.stats.flushes,
            # placeholders of pages held before a late capture (replay/heldbefore)
            **(
                {"held_before_tokens": self.stats.held_before_tokens}
                if self.stats.held_before_tokens
                else {}
            ),
            "virtual_s": round(self.stats.virtual_ns / 1e9, 6),
            "wall_s": round(self.wall_s, 3),
            # production captures: how outputs and sessions were inferred (replay/production)
            **({"inferred": self.extra["inferred"]} if "inferred" in self.extra else {}),
            # a rank kept on its recorded pace (``--pace recorded``; the model's: no key), and
            # why when ``auto`` chose it (its requests' median wait, ``pace.queued``)
            **({"pace": self.extra["pace"]} if "pace" in self.extra else {}),
            **(
                {"queue_wait_s": self.extra["queue_wait_s"]} if "queue_wait_s" in self.extra else {}
            ),
            # offline traces: which file and format (replay/trace)
            **({"trace": self.extra["trace"]} if "trace" in self.extra else {}),
        }


def simulate(
    records: Iterable[Any],
    cfg: SimConfig,
    *,
    hasher: Hasher | None = None,
    flush_abs_ns: Iterable[int] = (),
    progress: Callable[[int], None] | None = None,
    out: SimBundleOut | None = None,
    source_header: Any = None,
    pace: str = "auto",
    pace_clamp: tuple[float, float] | None = None,
    unseen: Sequence[list[int]] = (),
    eviction_trace: EvictionTrace | None = None,
) -> SimResult:
    """Simulate ``records`` (``RequestRecord``-like) on one rank under ``cfg``; no I/O
    unless ``out``: then the sim bundle of a replay of ``source_header``'s bundle is opened
    before the run and every published batch written into it as it is published (none kept
    in ``SimResult.batches``); ``write_sim_bundle`` finishes it, a failed run removes it.

    A fleet of one (``replay.fleet``, the one replay driver): every request on this rank,
    ``recorded`` routing, ``pace`` (``model``: the pass-time model alone; ``recorded``: the
    rank kept on its recorded pace, ``auto``: so when its records queued, ``Fleet.pace_of``,
    when its records have per-phase
    timings -- ``source_header``'s ``server_info`` says how they were recorded,
    ``worker.spans_next_forward``; the summary then says ``"pace": "recorded"``;
    ``pace_clamp`` as ``fleet.simulate_fleet``'s), no event
    log kept; flushing at
    ``flush_abs_ns`` (absolute receive times) in request order, holding the ``unseen`` runs
    of pages from the start (``replay.heldbefore``); every eviction into ``eviction_trace``
    when given (``Scheduler.trace_evictions``). The cyclic garbage
    collector is paused for the call (a replay builds millions of long-lived objects that
    collections would only re-walk)."""
    t0 = time.perf_counter()
    cfg.validate()
    worker = one_rank_worker(records, cfg, flush_abs_ns, header=source_header, unseen=unseen)
    with gc_paused():  # the schedule's construction too (it copies every token stream)
        fleet = Fleet(
            [worker],
            make_router("recorded"),
            hasher=hasher,
            pace=pace,
            event_log=False,
            pace_clamp=pace_clamp,
        )
        (slot,) = fleet.slots
        if eviction_trace is not None:
            slot.sched.trace_evictions(eviction_trace)
        if out is not None:
            cfg0 = slot.sched.cfg
            out.open(_header(source_header, cfg0, fleet.schedules[0].anchor_ns))
            slot.publisher.sink = out.sink(0)
        try:
            run = fleet.run(progress)
        except BaseException as exc:
            if out is not None:
                out.abandon(exc)
            raise
    sched = slot.sched
    schedule = fleet.schedules[0]
    paced = type(sched.timer) is PacedTimer
    schedule.flush_times_ns = list(sched.schedule.flush_times_ns)  # its rank's, as run
    return SimResult(
        sched.cfg,
        schedule,
        sched.stats,
        slot.publisher.batches,
        run.requests,
        time.perf_counter() - t0,
        scheduler=sched,
        messages=slot.publisher.seq,
        events=slot.publisher.n_events,
        extra=_pace_extra(paced, pace, [sp.source for sp in schedule.requests if sp.source]),
    )


def _pace_extra(paced: bool, pace: str, records: Sequence[Any]) -> dict[str, Any]:
    """The summary's pace keys: ``pace`` when the rank was paced, and, when ``auto`` chose
    it, ``queue_wait_s`` (the records' median wait that made it, ``pace.median_wait_s``)."""
    if not paced:
        return {}
    if pace != "auto":
        return {"pace": "recorded"}
    return {"pace": "recorded", "queue_wait_s": round(median_wait_s(records) or 0.0, 3)}


def _header(source_header: Any, cfg: SimConfig, anchor_ns: int) -> Any:
    """The single-rank sim bundle's header (one endpoint ``sim://``)."""
    return sim_header(
        source_header,
        sglang_version=cfg.sglang_version,
        command=["kvcadence", "replay"],
        start_ns=anchor_ns,
        endpoints=[EndpointInfo(id=0, url="sim://", dp_rank=cfg.attn_dp_rank, topic=cfg.topic)],
        sim_config=cfg.to_dict(),
    )


def write_sim_bundle(out: str | Path | SimBundleOut, result: SimResult, source_header: Any) -> None:
    """Write ``result`` as a sim bundle at ``out`` (must not exist or be empty), or finish
    the one its run streamed its frames into (``out`` the ``SimBundleOut`` given to
    ``simulate``): the visibility notes, the records and the trailer."""
    notes = visibility_notes(result)
    end_ns = result.schedule.anchor_ns + result.stats.virtual_ns
    if isinstance(out, SimBundleOut) and out.opened:
        out.finish(notes, result.requests, result.summary(), end_ns)
        return
    path = out.path if isinstance(out, SimBundleOut) else out
    write_sim(
        path,
        _header(source_header, result.config, result.schedule.anchor_ns),
        ((0, b) for b in result.batches),
        notes,
        result.requests,
        result.summary(),
        end_ns,
    )


def replay_bundle(
    src: str | Path,
    out: str | Path | None,
    config: SimConfig | None = None,
    *,
    overrides: dict[str, Any] | None = None,
    sglang_version: str | None = None,
    progress: Callable[[int], None] | None = None,
    hasher: Hasher | None = None,
    phases: Any = None,
    loaded: tuple[Any, Sequence[Any]] | None = None,
    inferred: dict[str, Any] | None = None,
    flushes: list[Any] | None = None,
    keep_batches: bool = False,
    pace: str = "auto",
    pace_clamp: tuple[float, float] | None = None,
    eviction_trace: EvictionTrace | None = None,
) -> SimResult:
    """Replay bundle ``src``; write the sim bundle to ``out`` (skipped when None): its
    frames as they are published (``SimResult.batches`` left empty), or, with
    ``keep_batches`` (a live ``--publish`` sends them after the run), after the run from
    ``SimResult.batches`` -- the same bytes.

    ``phases`` (a ``kvcadence.progress.Phases``) says and times the load, simulate and write
    phases; ``loaded`` = ``(header, records)`` of ``src`` already read by the caller, the
    records as ``loading.load_for_replay`` returned them with its report
    ``inferred`` and the recorded ``flushes`` (a production capture's records are completed
    here when not given; flushes scanned when None). ``pace``, ``pace_clamp``,
    ``eviction_trace``: as ``simulate``'s."""

    phases = phases or NoPhases()

    src_path = Path(src)
    if not src_path.exists():
        raise UsageError(f"{src_path}: no such bundle")
    out_path = Path(out) if out is not None else None
    if out_path is not None:
        refuse_nonempty_dir(out_path)
    records: Sequence[Any]
    what = f"loading {src_path}" if loaded is None else f"scanning {src_path} for cache flushes"
    with phases.phase("load", what):
        if loaded is None:
            reader = BundleReader(src_path)
            header = reader.header
            records, inferred, flushes = load_for_replay(reader)
        else:
            header, records = loaded
        if not records:
            raise InputError(f"{src_path}: the bundle has no request records to replay")
        if config is None:
            config = effective_config(
                capture_settings(reader if loaded is None else BundleReader(src_path)).server_info,
                records,
                overrides,
                sglang_version=sglang_version or header.sglang_version,
            )
        # one rank's clears (a DP bundle replayed as one rank would flush once per rank)
        flush_ns = flush_times_from_bundle(BundleReader(src_path), config.attn_dp_rank, flushes)
        unseen = unseen_runs(BundleReader(src_path)).get(config.attn_dp_rank or 0, [])
    sink = SimBundleOut(out_path) if out_path is not None and not keep_batches else None
    with phases.phase("simulate", f"simulating {len(records)} requests"):
        result = simulate(
            records,
            config,
            hasher=hasher,
            flush_abs_ns=flush_ns,
            progress=progress,
            out=sink,
            source_header=header,
            pace=pace,
            pace_clamp=pace_clamp,
            unseen=unseen,
            eviction_trace=eviction_trace,
        )
    try:
        if inferred:
            if inferred.get("retracted_in_capture"):
                inferred = {**inferred, **retractions(list(records), list(result.requests))}
            result.extra["inferred"] = inferred
        if out_path is not None:
            with phases.phase("write", f"writing {out_path}"):
                write_sim_bundle(sink or out_path, result, header)
    except BaseException as exc:
        if sink is not None:
            sink.abandon(exc)
        raise
    return result


def check_some_ran(records: Sequence[Any]) -> None:
    """``ReplayError`` (exit 1, one line) when no simulated request produced a token: every
    one was aborted (the sim bundle, already written, keeps why in each record)."""
    if not records or any((r.completion_tokens or 0) > 0 for r in records):
        return
    reasons = sorted({r.error for r in records if r.error})
    why = f" ({'; '.join(reasons[:3])})" if reasons else ""
    raise ReplayError(
        f"replay: no request ran: all {len(records)} were aborted{why}; "
        "check --max-total-tokens / --page-size"
    )
