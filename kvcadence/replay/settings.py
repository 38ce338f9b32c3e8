"""The worker settings a replay of a capture starts from: its ``/server_info`` snapshot, and
what a capture without one says in its events.

What this file owns: ``capture_settings(reader)``. A capture recorded with ``--endpoint``
only (no ``--server``: the worker's HTTP port not reachable from the capture host) or
imported without ``--server-info`` has no snapshot, and one from an older or stripped worker
may lack keys. Two settings decide every event the replay publishes, and the events tell
them:

* **page size**: every ``BlockStored`` carries ``block_size``, SGLang's tokens per page
  (``page_size * dcp_size``; a capture without a snapshot is taken as ``dcp_size`` 1): the
  most common one. Without this the replay assumed page size 1: a page-16 capture replayed
  with 16x the events, its production inference found none of its stores (every prompt
  hashed token by token) and the report compared nothing alike.
* **KV pool size**: the blocks resident in the tree (stored less removed, a clear resets;
  per DP rank) never pass the pool. When the capture evicted (``BlockRemoved`` events), the
  pool was full at its peak: the peak resident tokens are the estimate (a lower bound: the
  running requests' outputs not yet in the tree are not seen). When it never evicted, any
  pool that does not fill replays alike: twice the peak, at least ``SimConfig``'s default.

Everything else keeps ``SimConfig``'s defaults (SGLang's: chunked prefill 8192, the overlap
schedule on, ``fcfs``). ``CaptureSettings.note`` says in one line what was read from the
events and what was left at a default, and which of the snapshot's settings the replay
does not model (``config.unmodelled_settings``: HiCache, speculative decoding, the
prefill delayer, ...), for the CLI to print; the values can be overridden
on the command line (``--page-size``, ``--max-total-tokens``, ...). The event scan runs only
when a key is missing: a capture with a full snapshot pays nothing; a pass over the events
made anyway (the production inference's) counts them on the way (``tally_for``).

``namespace_note(records)``: the one line a replay prints when requests carry a cache
namespace SGLang keys its tree by (``cache_salt``, ``extra_key``, a LoRA adapter), which the
replay does not model.
"""

from __future__ import annotations

import dataclasses
import weakref
from collections import Counter
from dataclasses import dataclass
from typing import Any

from kvcadence.format import wire
from kvcadence.format.bundle import event_payload
from kvcadence.format.schema import (
    AllBlocksCleared,
    BlockRemovedRawView,
    BlockStoredIdsView,
    BlockStoredRawView,
    _raw_array_len,
)
from kvcadence.replay.config import SimConfig, unmodelled_settings

#: keys of the snapshot a replay cannot do without (``config._SERVER_INFO_FIELDS``' names)
PAGE_KEYS = ("page_size",)
POOL_KEYS = ("max_total_num_tokens", "max_total_tokens")
#: settings a replay takes from the snapshot and otherwise leaves at ``SimConfig``'s default:
#: (key, how the note says the default)
DEFAULTED = (
    ("chunked_prefill_size", f"chunked prefill {SimConfig().chunked_prefill_size}"),
    ("disable_overlap_schedule", "the overlap schedule on"),
    ("schedule_policy", f"schedule policy {SimConfig().schedule_policy}"),
)


@dataclass(frozen=True)
class CaptureSettings:
    """``server_info``: the snapshot with the missing page size / pool size filled in from
    the events (``filled`` names them, ``source`` says how); ``note``: one line for the user
    when anything was filled or left at a default or the worker ran with a setting the
    replay does not model, else None."""

    server_info: dict[str, Any]
    filled: tuple[str, ...] = ()
    note: str | None = None

    @property
    def page_size(self) -> int:
        v = _stated(self.server_info, PAGE_KEYS)
        return int(v) if isinstance(v, int) and not isinstance(v, bool) and v > 0 else 1


_CACHE: weakref.WeakKeyDictionary[Any, CaptureSettings] = weakref.WeakKeyDictionary()


def capture_settings(reader: Any, scan: EventScan | None = None) -> CaptureSettings:
    """The settings of ``reader``'s capture (see module); read once per reader. ``scan``: a
    ``tally_for`` tally's result (every event frame of ``reader``, counted in a pass made
    anyway), used instead of a scan of its own."""
    got = _CACHE.get(reader)
    if got is None:
        got = _settings(reader, scan)
        _CACHE[reader] = got
    return got


def tally_for(reader: Any) -> EventTally | None:
    """An ``EventTally`` for a pass over ``reader``'s events that someone makes anyway (the
    production inference's ``StoreIndex.from_reader``) when ``capture_settings`` would scan
    them, else None; hand its result to ``capture_settings``."""
    if reader in _CACHE:
        return None
    info = getattr(reader.header, "server_info", None) or {}
    if _stated(info, PAGE_KEYS) is not None and _stated(info, POOL_KEYS) is not None:
        return None
    return EventTally(getattr(reader.header, "endpoints", None) or [])


def page_size_hint(reader: Any) -> int:
    """``reader``'s page size before its events are scanned: its settings' when known (a
    full snapshot, or read before), else the first ``BlockStored``'s ``block_size`` (a
    short read; 1 when there is none). The settings' page size is the most common one, the
    same in every capture SGLang writes."""
    got = _CACHE.get(reader)
    if got is not None:
        return got.page_size
    v = _stated(getattr(reader.header, "server_info", None) or {}, PAGE_KEYS)
    if isinstance(v, int) and not isinstance(v, bool) and v > 0:
        return v
    for frame in reader.events():
        try:
            batch = wire.decode_batch_raw(event_payload(frame), check_tokens=False)
        except Exception:  # noqa: BLE001 - as scan_events: a damaged payload says nothing
            continue
        ev: Any
        for ev in batch.events:
            if type(ev) in _STORED:
                return int(ev.block_size)
    return 1


def _merged(info: dict[str, Any]) -> dict[str, Any]:
    """The snapshot as ``config.from_server_info`` reads it: rank 0's scheduler state under
    the top-level keys."""
    internal = info.get("internal_states")
    if isinstance(internal, list) and internal and isinstance(internal[0], dict):
        return {**internal[0], **info}
    return info


def _stated(info: dict[str, Any], keys: tuple[str, ...]) -> Any:
    merged = _merged(info)
    for k in keys:
        if merged.get(k) is not None:
            return merged[k]
    return None


#: the note of a worker that shuffled its waiting queue (``--schedule-policy random``)
RANDOM_NOTE = (
    "the worker ran with --schedule-policy random: its draws cannot be reproduced, so the "
    "replay admits the waiting requests in the order the records show they won them (their "
    "first forward), those without one in a shuffle of its own (seeded with the worker's "
    "--random-seed)"
)


def _settings(reader: Any, scan: EventScan | None = None) -> CaptureSettings:
    got = _filled(reader, scan)
    merged = _merged(got.server_info)
    off = unmodelled_settings(merged)
    said = []
    if off:
        said.append(
            f"the worker ran with {', '.join(off)}, which the replay does not model "
            '(docs/simulator.md, "What is not modelled"): its figures may part from the '
            "worker's"
        )
    if merged.get("schedule_policy") == "random":
        said.append(RANDOM_NOTE)
    if not said:
        return got
    note = "; ".join(said if got.note is None else [got.note, *said])
    return dataclasses.replace(got, note=note)


def _filled(reader: Any, scan: EventScan | None = None) -> CaptureSettings:
    """The snapshot with the page and pool sizes filled in from the events where missing."""
    info = dict(getattr(reader.header, "server_info", None) or {})
    need_page = _stated(info, PAGE_KEYS) is None
    need_pool = _stated(info, POOL_KEYS) is None
    if not need_page and not need_pool:
        return CaptureSettings(info)
    if scan is None:
        scan = scan_events(reader, getattr(reader.header, "endpoints", None) or [])
    filled: list[str] = []
    said: list[str] = []
    if need_page:
        if scan.block_sizes:
            ps = scan.block_sizes.most_common(1)[0][0]
            info["page_size"] = ps
            filled.append("page_size")
            said.append(f"page size {ps} from its events' block_size")
        else:
            said.append("page size 1 (no stored block in its events)")
    ps = int(_stated(info, PAGE_KEYS) or 1)
    if need_pool:
        peak = scan.peak_blocks * ps
        default = SimConfig().max_total_tokens
        if peak and scan.evicted:
            info["max_total_num_tokens"] = peak
            said.append(
                f"KV pool {peak:,} tokens, its peak of resident blocks (it evicted: a lower bound)"
            )
        else:
            pool = max(2 * peak, default)
            info["max_total_num_tokens"] = pool
            said.append(
                f"KV pool {pool:,} tokens (it never evicted: twice its peak of "
                f"{peak:,} resident tokens, at least {default:,})"
            )
        filled.append("max_total_num_tokens")
    rest = [said for key, said in DEFAULTED if _stated(info, (key,)) is None]
    what = (
        "has no /server_info snapshot"
        if not reader.header.server_info
        else (
            "has a /server_info snapshot without "
            + " or ".join(
                k
                for k, need in (("page_size", need_page), ("max_total_num_tokens", need_pool))
                if need
            )
        )
    )
    note = (
        f"the capture {what}: replayed with {'; '.join(said)}"
        + (f"; {', '.join(rest)} (SimConfig's defaults)" if rest else "")
        + "; set them with --page-size, --max-total-tokens, --chunked-prefill-size, ..."
    )
    return CaptureSettings(info, tuple(filled), note)


@dataclass
class EventScan:
    """What ``scan_events`` read: ``block_sizes`` (count of ``BlockStored`` events per
    ``block_size``), ``peak_blocks`` (the most blocks resident on one DP rank at once),
    ``evicted`` (any ``BlockRemoved``)."""

    block_sizes: Counter[int]
    peak_blocks: int = 0
    evicted: bool = False


#: the event views a stored / removed block comes as (``decode_batch_raw``'s, every wire
#: version converted to them; ``schema.EventFrameIdsView``'s store)
_STORED = frozenset({BlockStoredRawView, BlockStoredIdsView})
_REMOVED = frozenset({BlockRemovedRawView})


class EventTally:
    """``EventScan`` fed one decoded batch at a time (``batch``): ``scan_events``' pass, or
    another pass over the same frames. Per DP rank: the batch's ``attn_dp_rank``, else its
    endpoint's."""

    def __init__(self, endpoints: Any = ()) -> None:
        self._rank_of = {e.id: int(e.dp_rank) for e in endpoints}
        self._resident: dict[int, int] = {}
        self.scan = EventScan(Counter())

    def batch(self, batch: Any, endpoint: int) -> None:
        """Count ``batch``'s events (hashes that are not an array are not counted)."""
        rank = batch.attn_dp_rank
        if rank is None:
            rank = self._rank_of.get(endpoint, 0)
        out = self.scan
        n = self._resident.get(rank, 0)
        for ev in batch.events:
            t = type(ev)
            try:
                if t in _STORED:
                    out.block_sizes[ev.block_size] += 1
                    n += _raw_array_len(ev.block_hashes)
                elif t in _REMOVED:
                    out.evicted = True
                    n = max(0, n - _raw_array_len(ev.block_hashes))
                elif t is AllBlocksCleared:
                    n = 0
            except (ValueError, IndexError):
                continue
            if n > out.peak_blocks:
                out.peak_blocks = n
        self._resident[rank] = n


def scan_events(reader: Any, endpoints: Any = ()) -> EventScan:
    """One pass over ``reader``'s event frames, hashes and token ids left undecoded
    (``wire.decode_batch_raw``): block sizes, peak resident blocks per DP rank (stored less
    removed, never below 0: a capture that started late sees removals of blocks stored
    before it; a clear empties the rank), whether anything was evicted. A payload that does
    not decode is skipped."""
    tally = EventTally(endpoints)
    for frame in reader.events():
        try:
            batch = wire.decode_batch_raw(event_payload(frame), check_tokens=False)
        except Exception:  # noqa: BLE001 - a damaged payload says nothing of the settings
            continue
        tally.batch(batch, frame.endpoint)
    return tally.scan


#: request fields of a cache namespace the replay does not model: a LoRA adapter (SGLang
#: 0.5.23 appends its id to ``extra_key`` and post-maps its hashes); ``extra_key`` and
#: ``cache_salt`` are modelled (``format.namespace``)
NAMESPACE_FIELDS = ("lora_path",)


def namespace_note(records: Any) -> str | None:
    """One line when requests name a LoRA adapter (``NAMESPACE_FIELDS`` in the metrics
    line's ``request_parameters``), whose namespace the replay does not model, else None."""
    counts: Counter[str] = Counter()
    n = 0
    for r in records:
        params = (getattr(r, "meta_info", None) or {}).get("request_parameters")
        if not isinstance(params, dict):
            continue
        hit = [k for k in NAMESPACE_FIELDS if params.get(k) not in (None, "", [], [None])]
        counts.update(hit)
        n += bool(hit)
    if not n:
        return None
    return (
        f"a LoRA adapter (lora_path) on {n} of the requests, whose cache namespace the replay "
        "does not model: they share prefixes with the other requests of their extra_key / "
        "cache_salt namespace and their stored hashes are not post-mapped, so they differ "
        "from the worker's (docs/production.md)"
    )
