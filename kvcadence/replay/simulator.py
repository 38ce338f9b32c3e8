"""Replay entry points: a captured schedule in, a simulated bundle (or in-memory result) out.

What this file owns:

* ``effective_config(header, records, overrides)`` — ``SimConfig`` from the bundle's
  ``/server_info`` snapshot, the pass-time model calibrated from the capture's own timings,
  then the caller's overrides (CLI flags) on top;
* ``simulate(records, cfg, ...)`` — schedule reconstruction + one ``Scheduler`` run, returning
  the published batches and one sim ``RequestRecord`` per request (no I/O);
* ``replay_bundle(src, out, config)`` — read a bundle, simulate, write the sim bundle:
  ``Header(source="sim", sim_config=…, server_info copied)``, one ``EventFrame`` per published
  batch (real wire bytes, own seq from 0, ``via=VIA_SIM``, ``recv_ns`` = virtual publish time
  anchored at the capture's first arrival, ``pass_index``), the ``RequestRecord``s, a
  ``Trailer`` with the run statistics. Deterministic: the same input gives the same bytes.

Flushes recorded in the source (an ``AllBlocksCleared`` after seq 0 of an epoch, or an
``Annotation`` of kind ``flush``; ``replay.flushes.recorded_flushes``) are replayed in request
order: after every request that finished before them, before every other one, each when the
rank is idle (``replay.flushes``).
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvcadence.errors import InputError, ReplayError, UsageError
from kvcadence.format.bundle import BundleReader
from kvcadence.format.schema import EndpointInfo, RequestRecord
from kvcadence.gcpause import gc_paused
from kvcadence.outguard import refuse_nonempty_dir
from kvcadence.progress import NoPhases
from kvcadence.replay.config import SimConfig, from_server_info
from kvcadence.replay.events import PublishedBatch, Publisher
from kvcadence.replay.flushes import FlushLedger, FlushPlan, recorded_flushes
from kvcadence.replay.loading import load_for_replay
from kvcadence.replay.production import retractions
from kvcadence.replay.radix import Hasher, wire_hasher
from kvcadence.replay.request import ABORTED, SimReq, SimStats
from kvcadence.replay.schedule import Schedule, build_schedule
from kvcadence.replay.scheduler import Scheduler
from kvcadence.replay.simbundle import sim_header, write_sim
from kvcadence.replay.simrecords import SimRecords
from kvcadence.replay.timing import calibrate
from kvcadence.replay.tokens import as_list
from kvcadence.replay.visibility import visibility_notes


@dataclass
class SimResult:
    """Everything one replay produced."""

    config: SimConfig
    schedule: Schedule
    stats: SimStats
    batches: list[PublishedBatch]
    requests: Sequence[Any]  # RequestRecords (``SimRecords``: built when read)
    wall_s: float = 0.0
    extra: dict[str, Any] = field(default_factory=dict)
    scheduler: Any = None  # the finished Scheduler (tree, publish log) for inspection

    def summary(self) -> dict[str, Any]:
        return {
            "requests": len(self.requests),
            "passes": self.stats.passes,
            "prefill_passes": self.stats.prefill_passes,
            "decode_passes": self.stats.decode_passes,
            "skipped_decode_passes": self.stats.skipped_passes,
            "messages": len(self.batches),
            "events": sum(b.n_events for b in self.batches),
            "evictions": self.stats.evictions,
            "retractions": self.stats.retractions,
            "aborted": self.stats.aborted,
            "flushes": self.stats.flushes,
            "virtual_s": round(self.stats.virtual_ns / 1e9, 6),
            "wall_s": round(self.wall_s, 3),
            # production captures: how outputs and sessions were inferred (replay/production)
            **({"inferred": self.extra["inferred"]} if "inferred" in self.extra else {}),
            # offline traces: which file and format (replay/trace)
            **({"trace": self.extra["trace"]} if "trace" in self.extra else {}),
        }


_TIMING_KEYS = {f.name for f in dataclasses.fields(SimConfig().timing)}


def effective_config(
    server_info: dict[str, Any] | None,
    records: Sequence[Any],
    overrides: dict[str, Any] | None = None,
    *,
    sglang_version: str | None = None,
    calibrate_timing: bool = True,
) -> SimConfig:
    """Config from ``server_info`` + calibrated timing + ``overrides`` (None values ignored)."""
    cfg = from_server_info(server_info or {}, sglang_version)
    if calibrate_timing:
        # a CPU worker runs each forward inside its launch: its recorded prefill times then
        # span the next forward too, which the calibration takes out
        cpu = str((server_info or {}).get("device", "")) == "cpu"
        cfg.timing = calibrate(list(records), cfg.timing, sync_forward=cfg.sync_forward or cpu)
    for key, value in (overrides or {}).items():
        if value is None:
            continue
        if key in _TIMING_KEYS:
            setattr(cfg.timing, key, value)
        elif hasattr(cfg, key) and key != "timing":
            setattr(cfg, key, value)
        else:
            raise UsageError(f"unknown simulator setting {key!r}")
    return cfg.validate()


def simulate(
    records: Iterable[Any],
    cfg: SimConfig,
    *,
    hasher: Hasher | None = None,
    flush_abs_ns: Iterable[int] = (),
    progress: Callable[[int], None] | None = None,
    on_publish: Callable[[int], None] | None = None,
) -> SimResult:
    """Simulate ``records`` (``RequestRecord``-like; read once, as a stream) under ``cfg``;
    no I/O.

    The cyclic garbage collector is paused for the call (restored after): a replay creates
    millions of long-lived objects (token lists, radix nodes, events, records) that
    collections would only re-walk (≈ 20 % of a large replay)."""
    with gc_paused():
        return _simulate(
            records,
            cfg,
            hasher=hasher,
            flush_abs_ns=flush_abs_ns,
            progress=progress,
            on_publish=on_publish,
        )


def _simulate(
    records: Iterable[Any],
    cfg: SimConfig,
    *,
    hasher: Hasher | None,
    flush_abs_ns: Iterable[int],
    progress: Callable[[int], None] | None,
    on_publish: Callable[[int], None] | None,
) -> SimResult:
    cfg.validate()
    t0 = time.perf_counter()
    schedule = build_schedule(records, default_gap_ns=int(cfg.timing.default_gap_s * 1e9))
    flushes = sorted(int(f) for f in flush_abs_ns)
    plan = None
    if flushes:
        plan = FlushPlan(flushes, FlushLedger(schedule.requests), schedule.anchor_ns)
        schedule.flush_times_ns = [max(0, f - schedule.anchor_ns) for f in flushes]
    publisher = Publisher(cfg.sglang_version, cfg.medium, cfg.attn_dp_rank, schedule.anchor_ns)
    sched = Scheduler(
        cfg,
        schedule,
        hasher or wire_hasher(),
        publisher=publisher,
        on_publish=on_publish,
        flush_plan=plan,
    )
    stats = sched.run(progress)
    anchor = schedule.anchor_ns
    reqs, rank = sched.reqs, cfg.attn_dp_rank
    # built when read (the bundle writer streams them): not every prompt as a list at once
    out = SimRecords(len(reqs), lambda i: sim_request_record(reqs[i], anchor, rank))
    return SimResult(
        cfg, schedule, stats, publisher.batches, out, time.perf_counter() - t0, scheduler=sched
    )


def sim_request_record(
    r: SimReq,
    anchor_ns: int,
    rank: int | None = None,
    worker: str | None = None,
    *,
    rank_in_meta: bool = False,
) -> Any:
    """The sim ``RequestRecord`` of one simulated request (virtual times anchored at
    ``anchor_ns``), served by DP ``rank``. ``rank_in_meta``: also ``meta_info["dp_rank"]``
    (a fleet replay); ``worker``: ``meta_info["worker"]`` (a fleet of several workers)."""

    s = r.spec
    arr, entry, first, fin = r.arrival_ns, r.entry_ns, r.first_token_ns, r.finish_ns
    meta: dict[str, Any] = {
        "prompt_tokens": r.input_len,
        "completion_tokens": r.output_len,
        "cached_tokens": r.cached_tokens,
        "num_retractions": r.retractions,
        "request_received_ts": None if arr is None else (anchor_ns + arr) / 1e9,
        "forward_entry_time": None if entry is None else (anchor_ns + entry) / 1e9,
        "prefill_finished_time": None if first is None else (anchor_ns + first) / 1e9,
        "request_finished_ts": None if fin is None else (anchor_ns + fin) / 1e9,
    }
    if rank_in_meta:
        meta["dp_rank"] = rank
    if worker is not None:
        meta["worker"] = worker
    return RequestRecord(
        rid=s.rid,
        input_ids=as_list(s.input_ids),
        output_ids=list(s.output_ids[: r.output_len]),
        send_ns=anchor_ns + r.arrival_ns,
        first_token_ns=None if r.first_token_ns is None else anchor_ns + r.first_token_ns,
        finish_ns=None if r.finish_ns is None else anchor_ns + r.finish_ns,
        lane=s.lane,
        session=s.session,
        turn=s.turn,
        max_new_tokens=s.max_new_tokens,
        prompt_tokens=r.input_len,
        cached_tokens=r.cached_tokens if r.prefilled_once else None,
        completion_tokens=r.output_len,
        finish_reason="abort" if r.state == ABORTED else "length",
        error=r.error,
        dp_rank=rank,
        source="sim",
        think_ns=s.gap_ns if s.pred is not None else None,
        arrival_ns=None if s.pred is not None else anchor_ns + (s.arrival_ns or 0),
        meta_info=meta,
    )


def flush_times_from_bundle(
    reader: Any, rank: int | None = None, recorded: list[Any] | None = None
) -> list[int]:
    """Receive times of the flushes recorded in a bundle (``recorded_flushes``; ``recorded``:
    those already read): those of DP ``rank`` (the lowest rank that has any when it has
    none) and those of every rank; ``rank`` None: all of them."""
    flushes = recorded_flushes(reader) if recorded is None else recorded
    ranks = sorted({f.rank for f in flushes if f.rank is not None})
    if rank is not None and ranks and rank not in ranks:
        rank = ranks[0]
    return sorted({f.recv_ns for f in flushes if rank is None or f.rank is None or f.rank == rank})


def write_sim_bundle(out: str | Path, result: SimResult, source_header: Any) -> None:
    """Write ``result`` as a sim bundle at ``out`` (must not exist or be empty)."""
    cfg = result.config
    header = sim_header(
        source_header,
        sglang_version=cfg.sglang_version,
        command=["kvcadence", "replay"],
        start_ns=result.schedule.anchor_ns,
        endpoints=[EndpointInfo(id=0, url="sim://", dp_rank=cfg.attn_dp_rank, topic=cfg.topic)],
        sim_config=cfg.to_dict(),
    )
    write_sim(
        out,
        header,
        ((0, b) for b in result.batches),
        visibility_notes(result),
        result.requests,
        result.summary(),
        result.schedule.anchor_ns + result.stats.virtual_ns,
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
) -> SimResult:
    """Replay bundle ``src``; write the sim bundle to ``out`` (skipped when None).

    ``phases`` (a ``kvcadence.progress.Phases``) says and times the load, simulate and write
    phases; ``loaded`` = ``(header, records)`` of ``src`` already read by the caller, the
    records as ``loading.load_for_replay`` returned them with its report
    ``inferred`` and the recorded ``flushes`` (a production capture's records are completed
    here when not given; flushes scanned when None)."""

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
                header.server_info,
                records,
                overrides,
                sglang_version=sglang_version or header.sglang_version,
            )
        # one rank's clears (a DP bundle replayed as one rank would flush once per rank)
        flush_ns = flush_times_from_bundle(BundleReader(src_path), config.attn_dp_rank, flushes)
    with phases.phase("simulate", f"simulating {len(records)} requests"):
        result = simulate(records, config, hasher=hasher, flush_abs_ns=flush_ns, progress=progress)
    if inferred:
        if inferred.get("retracted_in_capture"):
            inferred = {**inferred, **retractions(list(records), list(result.requests))}
        result.extra["inferred"] = inferred
    if out_path is not None:
        with phases.phase("write", f"writing {out_path}"):
            write_sim_bundle(out_path, result, header)
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
