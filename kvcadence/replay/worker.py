"""What to replay of one worker: its request records, settings per DP rank and flushes.

What this file owns (the inputs of ``replay.fleet``, the one replay driver):

* ``effective_config(server_info, records, overrides)`` -- ``SimConfig`` from a
  ``/server_info`` snapshot, the pass-time model calibrated from the capture's own timings,
  then the caller's overrides (CLI flags) on top; ``spans_next_forward(server_info)`` --
  whether the capture's recorded prefill times span the next forward (an overlap-loop CPU
  worker), which the calibration and the recorded pace take into account;
* ``dp_size_of`` / ``rank_configs`` -- a worker's DP ranks and one ``SimConfig`` per rank
  (``max_total_num_tokens`` is per rank, ``internal_states[rank]`` first; ``attn_dp_rank``
  = rank; the pass-time model calibrated from that rank's own requests when it has >= 8);
* ``WorkerInput`` -- one worker to replay: records, rank configs, recorded flushes (with
  the DP rank whose stream carried each), source header. ``one_rank_worker`` makes the
  single-rank replay's input: every request on one rank of the caller's ``SimConfig``
  (its ``attn_dp_rank`` kept, whatever rank recorded it), the flushes given;
* ``read_bundle(path)`` -- what a replay reads of one bundle whatever the overrides
  (``BundleInputs``: a production capture's outputs and sessions recovered by
  ``replay.production``); ``load_worker(path)`` -- that bundle as a worker to replay;
* ``flush_times_from_bundle`` -- one rank's recorded flush times (a single-rank replay of a
  DP bundle flushes once, not once per rank).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvcadence.errors import InputError, UsageError
from kvcadence.format.bounds import MAX_DP_SIZE
from kvcadence.format.bundle import BundleReader
from kvcadence.format.schema import served_rank
from kvcadence.replay.config import SimConfig, from_server_info
from kvcadence.replay.flushes import recorded_flushes
from kvcadence.replay.heldbefore import unseen_runs
from kvcadence.replay.loading import load_for_replay
from kvcadence.replay.settings import capture_settings
from kvcadence.replay.timing import calibrate

_TIMING_KEYS = {f.name for f in dataclasses.fields(SimConfig().timing)}


def _recorded_overlap(server_info: dict[str, Any] | None) -> tuple[bool, bool]:
    """``(a CPU worker, the overlap loop)`` as ``server_info`` recorded them (whatever loop
    the overrides simulate)."""
    info = server_info or {}
    cpu = str(info.get("device", "")) == "cpu"
    return cpu, not from_server_info(info).disable_overlap_schedule


def spans_next_forward(server_info: dict[str, Any] | None) -> bool:
    """Whether a capture's recorded prefill times span the *next* forward: a CPU worker
    runs each forward inside its launch, so under the overlap loop (the one recorded in
    ``server_info``, whatever the overrides simulate) a prefill's result is processed after
    the next forward; the normal loop processes it right after its own. The calibration
    takes that forward out (``timing.calibrate``), the recorded pace too
    (``pace.recorded_token_times``)."""
    cpu, overlap = _recorded_overlap(server_info)
    return cpu and overlap


def spans_previous_forward(server_info: dict[str, Any] | None) -> bool:
    """Whether a capture's recorded prefill times span the forward *before* the batch's
    own: on a GPU the overlap loop forms a batch (``forward_entry_time``) while the forward
    before it runs, launches it behind that one and records its result when it is done.
    The calibration starts it where that forward ended (``timing.prefill_duration``)."""
    cpu, overlap = _recorded_overlap(server_info)
    return overlap and not cpu


def effective_config(
    server_info: dict[str, Any] | None,
    records: Sequence[Any],
    overrides: dict[str, Any] | None = None,
    *,
    sglang_version: str | None = None,
    calibrate_timing: bool = True,
    calibration: dict[str, Any] | None = None,
    memo: tuple[dict[Any, Any], Any] | None = None,
) -> SimConfig:
    """Config from ``server_info`` + calibrated timing + ``overrides`` (None values ignored).
    ``calibration``: where given, ``timing.calibrate``'s report of what it read. ``memo``:
    ``(calibrations, key)`` -- the calibration stored under ``key`` is taken instead of
    calibrating again (its report copied into ``calibration``), or stored there; the caller's
    key names everything it depends on but ``records`` and ``server_info`` (the overrides
    apply after it, all but ``decode_per_ctx_token_s``)."""
    cfg = from_server_info(server_info or {}, sglang_version)
    per_ctx = (overrides or {}).get("decode_per_ctx_token_s")
    if per_ctx is not None:  # given, not fitted: the decode fit takes its share off first
        cfg.timing.decode_per_ctx_token_s = per_ctx
    if calibrate_timing:
        got = memo[0].get(memo[1]) if memo is not None else None
        if got is None:
            report: dict[str, Any] = {}
            timing = calibrate(
                list(records),
                cfg.timing,
                sync_forward=cfg.sync_forward or spans_next_forward(server_info),
                overlap=spans_previous_forward(server_info),
                chunk_tokens=cfg.chunked_prefill_size,
                report=report,
            )
            got = (timing, report)
            if memo is not None:
                memo[0][memo[1]] = got
        cfg.timing = dataclasses.replace(got[0])  # the overrides below set its fields
        if calibration is not None:
            calibration.update(got[1])
    for key, value in (overrides or {}).items():
        if value is None:
            continue
        if key in _TIMING_KEYS:
            setattr(cfg.timing, key, value)
        elif hasattr(cfg, key) and key != "timing":
            setattr(cfg, key, value)
        else:
            raise UsageError(f"unknown simulator setting {key!r}")
    # the capture's own random draws: its records say in which order they won (a what-if
    # ``--schedule-policy random`` shuffles instead)
    cfg.random_as_recorded = (
        cfg.schedule_policy == "random" and (overrides or {}).get("schedule_policy") is None
    )
    return cfg.validate()


@dataclass
class WorkerInput:
    """One worker to replay (normally one bundle)."""

    name: str
    records: Iterable[Any]  # RequestRecords (a one-rank worker's may be a stream, read once)
    rank_configs: list[SimConfig]
    flush_abs_ns: list[int] = field(default_factory=list)
    header: Any = None
    path: str | None = None
    #: the DP rank whose stream carried each of ``flush_abs_ns`` (None: every rank); None:
    #: every flush is every rank's
    flush_ranks: list[int | None] | None = None
    #: the single-rank replay: one rank (``rank_configs[0]``, its ``attn_dp_rank`` kept)
    #: serves every request whatever rank recorded it, and the sim records carry no
    #: ``meta_info["dp_rank"]`` (``one_rank_worker``)
    one_rank: bool = False
    #: a production capture's inference report (``production.records_for_replay``: outputs
    #: and sessions inferred); None for driver records
    inferred: dict[str, Any] | None = None
    #: what the capture's snapshot lacked and how it was filled (``settings``), for the CLI
    settings_note: str | None = None
    #: per rank (an index of ``rank_configs``): the runs of pages the worker held before a
    #: late capture and evicted during it (``replay.heldbefore``), held from the start
    unseen: dict[int, list[list[int]]] = field(default_factory=dict)
    #: per rank (an index of ``rank_configs``): ``timing.calibrate``'s report, for the CLI
    calibrations: list[dict[str, Any]] = field(default_factory=list)

    def flushes_of(self, rank: int) -> list[int]:
        """Recorded flush times (absolute ns) of DP ``rank``."""
        if self.flush_ranks is None:
            return list(self.flush_abs_ns)
        return [
            t
            for t, r in zip(self.flush_abs_ns, self.flush_ranks, strict=True)
            if r is None or r == rank
        ]

    @property
    def dp_size(self) -> int:
        return len(self.rank_configs)


def one_rank_worker(
    records: Iterable[Any],
    cfg: SimConfig,
    flush_abs_ns: Iterable[int] = (),
    *,
    name: str = "sim",
    header: Any = None,
    unseen: Sequence[list[int]] = (),
) -> WorkerInput:
    """The single-rank replay's worker: every request of ``records`` on one rank with
    ``cfg``, flushing at ``flush_abs_ns`` (absolute receive times), holding the ``unseen``
    runs of pages from the start (``replay.heldbefore``). ``records`` may be a stream: the
    fleet reads it once, into its schedule (compact token arrays)."""
    flushes = sorted(int(f) for f in flush_abs_ns)
    held = {0: list(unseen)} if unseen else {}
    return WorkerInput(name, records, [cfg], flushes, header, one_rank=True, unseen=held)


def dp_size_of(header: Any, records: Sequence[Any]) -> int:
    """DP ranks of a worker: ``/server_info`` (``dp_size`` or ``kv_events.dp_size``), the
    bundle's endpoints, or the highest recorded rank + 1 -- whichever is largest."""
    info = dict(getattr(header, "server_info", None) or {})
    cands = [1]
    for v in (info.get("dp_size"), (info.get("kv_events") or {}).get("dp_size")):
        if isinstance(v, int) and v > 0:
            cands.append(v)
    eps = getattr(header, "endpoints", None) or []
    if eps:
        cands.append(max(int(e.dp_rank) for e in eps) + 1)
    if records:
        cands.append(max(served_rank(r) for r in records) + 1)
    if max(cands) > MAX_DP_SIZE:  # a damaged or hostile bundle, not a worker: refuse, never
        raise UsageError(  # allocate a rank per claimed dp_size / dp_rank
            f"the bundle claims {max(cands)} DP ranks (server_info dp_size, endpoints or a "
            f"request's dp_rank); at most {MAX_DP_SIZE} are supported"
        )
    return max(cands)


def bundle_dp_size(reader: Any) -> tuple[int, int]:
    """``(dp_size_of, request count)`` of a bundle, its records read one at a time (only the
    highest served rank's is kept: no prompt list of every request at once; a packed
    request's ids left arrays, ``BundleReader.request_arrays``)."""
    top = None
    top_rank = -1
    n = 0
    for rec in reader.request_arrays():
        n += 1
        rank = served_rank(rec)
        if rank > top_rank:
            top, top_rank = rec, rank
    return dp_size_of(reader.header, [] if top is None else [top]), n


def rank_configs(
    header: Any,
    records: Sequence[Any],
    overrides: dict[str, Any] | None = None,
    *,
    sglang_version: str | None = None,
    calibrate_timing: bool = True,
    dp_size: int | None = None,
    server_info: dict[str, Any] | None = None,
    calibrations: list[dict[str, Any]] | None = None,
    memo: dict[Any, Any] | None = None,
) -> list[SimConfig]:
    """One ``SimConfig`` per rank of a worker (see module docstring); ``server_info``: the
    snapshot to read (``settings.capture_settings``' filled one; default: the header's);
    ``calibrations``: where given, each rank's calibration report is appended to it;
    ``memo``: the worker's calibrations by rank, SGLang version and given
    ``decode_per_ctx_token_s`` (``BundleInputs.calibrated``: the same ``header``,
    ``records`` and ``server_info`` every call), kept and reused."""

    n = dp_size or dp_size_of(header, records)
    info = dict(server_info or getattr(header, "server_info", None) or {})
    internal = info.get("internal_states")
    version = sglang_version or getattr(header, "sglang_version", None)
    out = []
    for rank in range(n):
        rank_info = dict(info)
        if isinstance(internal, list) and len(internal) > rank and isinstance(internal[rank], dict):
            # the per-rank scheduler state first (its max_total_num_tokens is per rank)
            rank_info = {k: v for k, v in info.items() if k != "internal_states"}
            for k, v in internal[rank].items():
                if v is not None:
                    rank_info[k] = v
        mine = [r for r in records if served_rank(r) == rank]
        report: dict[str, Any] = {}
        key = (n, rank, version, (overrides or {}).get("decode_per_ctx_token_s"))
        cfg = effective_config(
            rank_info,
            mine if len(mine) >= 8 else list(records),
            overrides,
            sglang_version=version,
            calibrate_timing=calibrate_timing,
            calibration=report,
            memo=None if memo is None else (memo, key),
        )
        if calibrations is not None:
            calibrations.append(report)
        cfg.attn_dp_rank = rank
        out.append(cfg)
    return out


@dataclass(slots=True)
class BundleInputs:
    """What ``load_worker`` reads of a bundle whatever the overrides (``read_bundle``): its
    compact records (a production capture's completed: ``loading.load_for_replay``), the
    inference report, the recorded flushes, the capture's settings
    (``settings.capture_settings``) and the pages held before a late capture
    (``heldbefore.unseen_runs``); the pass-time calibrations made of them so far
    (``rank_configs``' ``memo``). Nothing here is changed by a replay: a sweep's process
    reads and calibrates a bundle once for all its jobs (``replay.bundlecache``)."""

    path: Path
    header: Any
    records: list[Any]
    inferred: dict[str, Any]
    flushes: list[Any]
    settings: Any
    unseen: dict[int, list[list[int]]]
    #: ``rank_configs``' calibrations of these records (``memo``), made as jobs ask
    calibrated: dict[Any, Any] = field(default_factory=dict)


def read_bundle(path: str | Path, tokenizer: Any = None) -> BundleInputs:
    """Read one bundle for a replay (``tokenizer``: ``loading.load_for_replay``'s)."""
    p = Path(path)
    if not p.exists():
        raise UsageError(f"{p}: no such bundle")
    reader = BundleReader(p)
    # compact; production: outputs, sessions
    records, inferred, recorded = load_for_replay(reader, None, tokenizer)
    if not records:
        raise InputError(f"{p}: the bundle has no request records to replay")
    flushes = recorded if recorded is not None else recorded_flushes(BundleReader(p))
    return BundleInputs(
        p,
        reader.header,
        records,
        inferred,
        flushes,
        capture_settings(reader),  # a missing page / pool size read from its events
        unseen_runs(BundleReader(p)),
    )


def load_worker(
    path: str | Path,
    overrides: dict[str, Any] | None = None,
    *,
    name: str | None = None,
    sglang_version: str | None = None,
    calibrate_timing: bool = True,
    tokenizer: Any = None,
    inputs: BundleInputs | None = None,
) -> WorkerInput:
    """Read one bundle as a worker to replay (``tokenizer``: ``loading.load_for_replay``'s);
    ``inputs``: the bundle as ``read_bundle`` read it already (``path`` and ``tokenizer``
    are then not read again)."""
    b = read_bundle(path, tokenizer) if inputs is None else inputs
    calibrations: list[dict[str, Any]] = []
    cfgs = rank_configs(
        b.header,
        b.records,
        overrides,
        sglang_version=sglang_version,
        calibrate_timing=calibrate_timing,
        server_info=b.settings.server_info,
        calibrations=calibrations,
        memo=b.calibrated,
    )
    return WorkerInput(
        name or b.path.name,
        b.records,
        cfgs,
        [f.recv_ns for f in b.flushes],
        b.header,
        str(b.path),
        [f.rank for f in b.flushes],
        inferred=b.inferred or None,
        settings_note=b.settings.note,
        unseen=b.unseen,
        calibrations=calibrations,
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
