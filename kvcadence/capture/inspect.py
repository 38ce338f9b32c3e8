"""``kvcadence inspect``: a one-pass summary of a bundle (counts, seqs, gaps, damage).

``inspect_bundle(path)`` returns one JSON-ready dict with stable keys (documented in
``docs/format.md``), including ``ranks``: the same counts per DP rank (endpoints by their
``dp_rank``, requests by ``RequestRecord.dp_rank``, null = rank 0) next to the totals;
``format_text(summary)`` renders the short aligned text block (a bundle without a readable
header says so in place of the format line; ``kvcadence inspect`` then exits 1). Payloads
are decoded with ``kvcadence.format.wire.decode_batch`` one at a time and never kept, so a
large bundle is summarised in constant memory.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from kvcadence.errors import BundleError, WireError
from kvcadence.format import hitrate, wire
from kvcadence.format.bundle import RECORD_TAGS, BundleReader, event_payload
from kvcadence.format.schema import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    Epoch,
    EventFrame,
    Gap,
    Header,
    RequestRecord,
    Trailer,
)

INSPECT_VERSION = 1
NO_HEADER = "no header (damaged or not a kvcadence bundle)"
EVENT_TYPES = ("BlockStored", "BlockRemoved", "AllBlocksCleared", "unknown")


def inspect_bundle(path: str | os.PathLike[str]) -> dict[str, Any]:
    """Summarise the bundle at ``path`` (see ``docs/format.md`` for every key)."""
    reader = BundleReader(path)
    try:
        header: Header | None = reader.header
    except BundleError:
        header = None
    records = dict.fromkeys(RECORD_TAGS.values(), 0)
    events_by_type = dict.fromkeys(EVENT_TYPES, 0)
    messages = undecodable = bin_payloads = payload_bytes = 0
    stored_blocks = removed_blocks = 0
    block_sizes: dict[int, int] = {}  # BlockStored events per block_size
    streams: dict[tuple[int, int], list[int]] = {}  # (endpoint, epoch) -> first, last, n
    first_recv: int | None = None
    last_recv: int | None = None
    gaps = missed = recovered = 0
    epochs: list[dict[str, Any]] = []
    trailers = 0
    no_outputs = no_lanes = 0
    inferred: dict[str, Any] | None = None
    ep_rank = {e.id: int(e.dp_rank) for e in header.endpoints} if header else {}
    ranks: dict[int, dict[str, int]] = {}

    def rank_acc(rank: int) -> dict[str, int]:
        acc = ranks.get(rank)
        if acc is None:
            acc = ranks[rank] = dict.fromkeys(_RANK_KEYS, 0)
        return acc

    decode = wire.decode_batch
    rec: Any
    ev: Any
    payload: bytes | memoryview
    for rec in reader.records():
        t = type(rec)
        records[RECORD_TAGS[t]] += 1
        if t is EventFrame:
            messages += 1
            ep = (rec.endpoint, rec.epoch)
            s = streams.get(ep)
            if s is None:
                streams[ep] = [rec.seq, rec.seq, 1]
            else:
                s[0] = min(s[0], rec.seq)
                s[1] = max(s[1], rec.seq)
                s[2] += 1
            racc = rank_acc(ep_rank.get(rec.endpoint, rec.endpoint))
            racc["messages"] += 1
            if first_recv is None or rec.recv_ns < first_recv:
                first_recv = rec.recv_ns
            if last_recv is None or rec.recv_ns > last_recv:
                last_recv = rec.recv_ns
            if rec.payload_is_bin:
                bin_payloads += 1
                payload = event_payload(rec)
            else:
                payload = memoryview(rec.payload)
            payload_bytes += len(payload)
            try:
                batch = decode(payload)
            except WireError:
                undecodable += 1
                continue
            for ev in batch.events:
                et = type(ev)
                if et is BlockStored:
                    events_by_type["BlockStored"] += 1
                    stored_blocks += len(ev.block_hashes)
                    block_sizes[ev.block_size] = block_sizes.get(ev.block_size, 0) + 1
                    racc["stored_events"] += 1
                    racc["stored_blocks"] += len(ev.block_hashes)
                elif et is BlockRemoved:
                    events_by_type["BlockRemoved"] += 1
                    removed_blocks += len(ev.block_hashes)
                    racc["removed_events"] += 1
                    racc["removed_blocks"] += len(ev.block_hashes)
                elif et is AllBlocksCleared:
                    events_by_type["AllBlocksCleared"] += 1
                else:
                    events_by_type["unknown"] += 1
        elif t is RequestRecord:
            r = rec.dp_rank
            if r is None:
                r = (rec.meta_info or {}).get("dp_rank")
            racc = rank_acc(int(r) if isinstance(r, int) else 0)
            racc["requests"] += 1
            racc["prompt_tokens"] += hitrate.prompt_tokens(rec)
            racc["cached_tokens"] += hitrate.cached_tokens(rec)
            no_outputs += not rec.output_ids
            no_lanes += rec.lane is None
        elif t is Gap:
            gaps += 1
            missed += rec.last_seq - rec.first_seq + 1
            recovered += rec.recovered
        elif t is Epoch:
            epochs.append(
                {
                    "endpoint": rec.endpoint,
                    "epoch": rec.epoch,
                    "first_seq": rec.first_seq,
                    "recv_ns": rec.recv_ns,
                    "reason": rec.reason,
                }
            )
        elif t is Trailer:
            trailers += 1
            inferred = ((rec.stats or {}).get("replay") or {}).get("inferred") or inferred
    rep = reader.report
    span = (
        (last_recv - first_recv) / 1e9 if first_recv is not None and last_recv is not None else None
    )
    return {
        "inspect_version": INSPECT_VERSION,
        "path": str(Path(path)),
        "format": {"major": header.format_major if header else None, "minor": rep.format_minor},
        "header_ok": header is not None,
        "source": header.source if header else None,
        "sglang_version": header.sglang_version if header else None,
        "kvcadence_version": header.kvcadence_version if header else None,
        "start_ns": header.start_ns if header else None,
        "endpoints_declared": len(header.endpoints) if header else 0,
        "segments": rep.segments,
        "bytes": rep.bytes,
        "frames": rep.frames,
        "records": records,
        "unknown_records": rep.unknown_records,
        "unknown_record_tags": dict(rep.unknown_tags),
        "messages": messages,
        "payload_bytes": payload_bytes,
        "bin_payloads": bin_payloads,
        "undecodable_messages": undecodable,
        "events": sum(events_by_type.values()),
        "events_by_type": events_by_type,
        "total_stored_blocks": stored_blocks,
        "total_removed_blocks": removed_blocks,
        "settings": _settings(header, block_sizes),
        "streams": [
            {"endpoint": e, "epoch": p, "first_seq": s[0], "last_seq": s[1], "messages": s[2]}
            for (e, p), s in sorted(streams.items())
        ],
        "gaps": gaps,
        "missed_seqs": missed,
        "recovered_seqs": recovered,
        "epochs": epochs,
        "requests": records["request"],
        "packed_requests": {
            "requests": rep.packed_requests,
            "ids": rep.packed_ids,
            "full_bytes": 4 * rep.packed_ids,
            "stored_bytes": rep.packed_bytes,
        },
        "requests_without_output_ids": no_outputs,
        "requests_without_lanes": no_lanes,
        "inferred": inferred,
        "ranks": [_rank_row(k, v) for k, v in sorted(ranks.items())],
        "first_recv_ns": first_recv,
        "last_recv_ns": last_recv,
        "span_s": span,
        "torn_bytes": rep.torn_bytes,
        "torn": [{"segment": s, "offset": o} for s, o in rep.torn],
        "corrupt_bytes": rep.corrupt_bytes,
        "corrupt": [{"segment": s, "offset": o, "bytes": n} for s, o, n in rep.corrupt],
        "trailers": trailers,
        "clean_shutdown": rep.clean_shutdown,
        "missing_segments": [{"segment": n, "why": w} for n, w in rep.missing_segments],
        "refused_segments": [{"segment": n, "why": w} for n, w in rep.refused_segments],
        "missing_records": rep.missing_records,
        "shortfall": [
            {"trailer_segment": n, "trailer_counts": want, "read": got}
            for n, want, got in rep.shortfall
        ],
        "damaged": rep.damaged,
    }


#: the /server_info settings ``inspect`` shows (key, how the text line names it)
_SETTINGS = (
    ("page_size", "page"),
    ("max_total_num_tokens", "pool"),
    ("chunked_prefill_size", "chunked_prefill"),
    ("disable_overlap_schedule", "overlap_off"),
    ("schedule_policy", "policy"),
    ("radix_eviction_policy", "eviction"),
    ("enable_mixed_chunk", "mixed_chunk"),
    ("dp_size", "dp"),
)

#: settings ``inspect`` shows only where the worker ran them off SGLang 0.5.23's default
#: (key, text name, whether the value is off the default): each changes what it schedules
_SET_ONLY = (
    ("max_running_requests", "max_running", lambda v: v is not None),
    ("max_prefill_tokens", "max_prefill", lambda v: v not in (None, 16384)),
    ("schedule_conservativeness", "conservativeness", lambda v: v not in (None, 1.0)),
    ("enable_priority_scheduling", "priority", lambda v: v is True),
    ("schedule_low_priority_values_first", "low_priority_first", lambda v: v is True),
    ("priority_scheduling_preemption_threshold", "preempt_gap", lambda v: v not in (None, 10)),
    ("disable_priority_preemption", "no_preemption", lambda v: v is True),
    ("retraction_policy", "retraction", lambda v: v not in (None, "length")),
    ("prefill_decode_interval", "prefill_decode_interval", lambda v: bool(v)),
    ("scheduler_recv_interval", "recv_interval", lambda v: v not in (None, 1)),
    ("min_free_slots_delay", "min_free_slots", lambda v: v is not None),
)


#: a sim bundle's ``sim_config`` keys (``replay.config.SimConfig``) named otherwise in
#: /server_info
_SIM_NAMES = {
    "max_total_tokens": "max_total_num_tokens",
    "eviction_policy": "radix_eviction_policy",
    "priority_threshold": "priority_scheduling_preemption_threshold",
}


def _settings(header: Header | None, block_sizes: dict[int, int]) -> dict[str, Any]:
    """The header's /server_info settings a replay starts from (null when absent; rank 0's
    scheduler state under the top level, as the replay reads it) and the events'
    ``block_size`` counts: without a snapshot the replay takes its page size from them. A
    sim bundle keeps its source's snapshot; its own settings -- what the replay ran, the
    overrides included (``sim_config``) -- take their places (``sim``: True)."""
    info = dict((header.server_info or {}) if header else {})
    internal = info.get("internal_states")
    if isinstance(internal, list) and internal and isinstance(internal[0], dict):
        info = {**internal[0], **info}
    sim = header is not None and header.source == "sim" and isinstance(header.sim_config, dict)
    if sim:
        assert header is not None and isinstance(header.sim_config, dict)  # for mypy
        ran = {_SIM_NAMES.get(k, k): v for k, v in header.sim_config.items()}
        if "chunked_prefill_size" in ran and ran["chunked_prefill_size"] is None:
            ran["chunked_prefill_size"] = -1  # SGLang's spelling of chunking off
        info.update({k: v for k, v in ran.items() if k != "dp_size"})
    out: dict[str, Any] = {k: info.get(k) for k, _ in _SETTINGS}
    out.update({k: info[k] for k, _, off in _SET_ONLY if k in info and off(info[k])})
    out["server_info"] = bool(header and header.server_info) or sim
    out["sim"] = sim
    out["block_sizes"] = {str(k): v for k, v in sorted(block_sizes.items())}
    return out


def _settings_text(st: dict[str, Any]) -> str:
    sizes = ", ".join(f"{k} ({v} events)" for k, v in st["block_sizes"].items()) or "none"
    if not st["server_info"]:
        return (
            f"no /server_info snapshot; the events' block_size: {sizes} (replay reads the "
            "page size from them and estimates the KV pool, saying so)"
        )
    known = "  ".join(
        [f"{name}={st[k]}" for k, name in _SETTINGS if st[k] is not None]
        + [f"{name}={st[k]}" for k, name, _ in _SET_ONLY if k in st]
    )
    whose = "  (the replay's)" if st.get("sim") else ""
    return f"{known or 'a /server_info snapshot without settings'}{whose}  (block_size: {sizes})"


_RANK_KEYS = (
    "messages",
    "stored_events",
    "stored_blocks",
    "removed_events",
    "removed_blocks",
    "requests",
    "prompt_tokens",
    "cached_tokens",
)


def _rank_row(rank: int, acc: dict[str, int]) -> dict[str, Any]:
    row: dict[str, Any] = {"rank": rank, **acc}
    p = acc["prompt_tokens"]
    row["hit_rate"] = hitrate.hit_rate(acc["cached_tokens"], p)
    return row


def damage_lines(s: dict[str, Any]) -> list[str]:
    """One line per lost segment and per trailer shortfall (empty for a whole bundle)."""
    out = [f"segment {m['segment']}: {m['why']}" for m in s.get("missing_segments", [])]
    out += [f"segment {m['segment']} refused: {m['why']}" for m in s.get("refused_segments", [])]
    out += [
        f"{m['trailer_counts'] - m['read']} records missing: the trailer in "
        f"{m['trailer_segment']} counts {m['trailer_counts']}, {m['read']} were read"
        for m in s.get("shortfall", [])
    ]
    return out


def _packed_text(s: dict[str, Any]) -> str:
    """The compact request storage line: the ids' bytes stored against 4 bytes per id."""
    p = s["packed_requests"]
    if not p["requests"]:
        return "no packed requests (every request stores its ids in full)"
    share = p["stored_bytes"] / p["full_bytes"] if p["full_bytes"] else 1.0
    return (
        f"{p['requests']:,} packed requests: {p['ids']:,} ids stored in "
        f"{p['stored_bytes']:,} bytes of {p['full_bytes']:,} as uint32 ({share:.1%}; shared "
        "prefixes stored once)"
    )


def format_text(s: dict[str, Any]) -> str:
    """The human-readable block printed by ``kvcadence inspect``."""
    ev = s["events_by_type"]
    rec = s["records"]
    rows: list[tuple[str, str]] = [
        ("bundle", s["path"]),
        (
            "format",
            f"{s['format']['major']}.{s['format']['minor']}  source={s['source']}  "
            f"sglang={s['sglang_version']}  kvcadence={s['kvcadence_version']}"
            if s["header_ok"]
            else NO_HEADER,
        ),
        ("segments", f"{s['segments']}  ({s['bytes']:,} bytes, {s['frames']:,} frames)"),
        ("records", "  ".join(f"{k}={v}" for k, v in rec.items())),
        (
            "messages",
            f"{s['messages']:,}  ({s['payload_bytes']:,} payload bytes, "
            f"{s['undecodable_messages']} undecodable, {s['bin_payloads']} non-msgpack)",
        ),
        ("events", f"{s['events']:,}  " + "  ".join(f"{k}={v}" for k, v in ev.items())),
        (
            "blocks",
            f"stored={s['total_stored_blocks']:,}  removed={s['total_removed_blocks']:,}",
        ),
        ("settings", _settings_text(s["settings"])),
    ]
    for st in s["streams"]:
        rows.append(
            (
                f"seq ep{st['endpoint']}/e{st['epoch']}",
                f"{st['first_seq']}..{st['last_seq']}  ({st['messages']:,} messages)",
            )
        )
    if len(s.get("ranks") or []) > 1:
        for rk in s["ranks"]:
            hit = "-" if rk["hit_rate"] is None else f"{rk['hit_rate']:.3f}"
            rows.append(
                (
                    f"rank {rk['rank']}",
                    f"messages={rk['messages']:,}  stored={rk['stored_events']:,} "
                    f"({rk['stored_blocks']:,} blocks)  removed={rk['removed_events']:,} "
                    f"({rk['removed_blocks']:,} blocks)  requests={rk['requests']:,}  "
                    f"hit={hit}",
                )
            )
    rows += [
        (
            "gaps",
            f"{s['gaps']}  (missed {s['missed_seqs']} seqs, recovered {s['recovered_seqs']})",
        ),
        ("epochs", str(len(s["epochs"]))),
        (
            "requests",
            f"{s['requests']:,}  (without output ids {s['requests_without_output_ids']:,}, "
            f"without lanes {s['requests_without_lanes']:,})",
        ),
        ("token ids", _packed_text(s)),
        (
            "time",
            "-"
            if s["first_recv_ns"] is None
            else f"{s['first_recv_ns']} .. {s['last_recv_ns']}  ({s['span_s']:.3f} s)",
        ),
        (
            "damage",
            f"torn={s['torn_bytes']} bytes  corrupt={s['corrupt_bytes']} bytes "
            f"in {len(s['corrupt'])} spans  unknown records={s['unknown_records']}",
        ),
        ("clean shutdown", "yes" if s["clean_shutdown"] else "no"),
    ]
    at = next(i for i, r in enumerate(rows) if r[0] == "damage") + 1
    rows[at:at] = [("LOST" if i == 0 else "", line) for i, line in enumerate(damage_lines(s))]
    inf = s.get("inferred")
    if inf:  # a replay of a production capture: where its outputs and sessions came from
        syn = sum(inf["outputs_synthetic"].values())
        rows.append(
            (
                "inferred",
                f"outputs from events={inf['outputs_from_events']:,} "
                f"from next prompt={inf['outputs_from_next_prompt']:,} synthetic={syn:,}  "
                f"sessions={inf['sessions']:,} clients={inf['clients']:,} "
                f"with predecessor={inf['with_predecessor']:,}"
                + (
                    f" idle-client joins={inf['idle_client_joins']:,}"
                    if "idle_client_joins" in inf
                    else ""
                ),
            )
        )
    if not s["header_ok"]:
        rows.insert(1, ("WARNING", "no readable header record"))
    width = max(len(k) for k, _ in rows)
    return "\n".join(f"{k:<{width}}  {v}" for k, v in rows)


__all__ = [
    "EVENT_TYPES",
    "INSPECT_VERSION",
    "NO_HEADER",
    "damage_lines",
    "format_text",
    "inspect_bundle",
]
