"""The report's "Inferred inputs" section: what a production replay had to infer or make up.

What this file owns: ``inferred_extra``, the report hook that reads, from each sim bundle's
``Trailer`` (``stats.replay.inferred``, written by ``kvcadence replay`` for a production
capture: SGLang's own request logs, no output ids, no lanes), how many requests got their
output tokens from the KV events, from a later prompt, or stay synthetic and why; how many
sessions and clients were inferred, how many predecessors the tie rule picked, and how many
requests arrive open loop (the first of each inferred client, at its recorded time). Nothing
the replay guessed goes unsaid in the report; the definitions are ``replay.production``'s
(docs/simulator.md, "Production captures").

A sim bundle without that trailer entry (a replay of driver records, a trace) adds nothing
(single-rank and fleet replays of a production capture both write it); with none among the inputs there is no section.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from kvcadence.analysis.report_extras import Extra
from kvcadence.format.bundle import BundleReader

TITLE = "Inferred inputs"

#: (report key, row label) in table order; a nested dict (reasons) is expanded after its row
ROWS: tuple[tuple[str, str], ...] = (
    ("requests", "requests replayed from SGLang's logs"),
    ("outputs_recorded", "outputs recorded (request log)"),
    ("outputs_from_events", "outputs from the KV events (finish stores)"),
    ("outputs_from_next_prompt", "outputs completed from a later prompt"),
    ("outputs_synthetic", "outputs synthetic (what was stored of them not found)"),
    ("unstored_tail_synthetic", "output tails synthetic (never stored, never reused)"),
    ("finish_store_ties", "finish-store ties (parallel samples)"),
    ("finish_stores_shared", "finish stores shared by samples"),
    ("sessions", "sessions inferred"),
    ("with_predecessor", "requests with an inferred predecessor"),
    ("predecessor_ties", "predecessors picked by the tie rule (ambiguous)"),
    ("unlinked_shared_prefix", "requests not linked to a rebuilt request's shared prefix"),
    ("clients", "clients inferred"),
    ("open_loop", "open-loop arrivals (first of each client, recorded time)"),
    ("session_starts_joined", "session starts joined to a client (timing only)"),
    ("idle_client_joins", "... past the think-time bound, as the only idle client"),
    ("aborted_running", "aborted while running (partial output replayed)"),
    ("aborted_not_run", "aborted before they ran (not replayed)"),
    ("errored_running", "errored after they ran (recorded output replayed)"),
    ("errored_not_run", "errored before they ran (not replayed)"),
    ("unrecorded_rebuilt", "requests not in the records, rebuilt from their prefill stores"),
    ("unrecorded_with_finish_store", "... of them with a finish store (outputs from it)"),
    ("unrecorded_finish_below_next_turn", "... that store below their next turn's prefill"),
    ("unrecorded_not_rebuilt", "unclaimed stores not rebuilt (prefix before the capture)"),
    ("unclaimed_below_records", "unclaimed stores below a record's prompt (left alone)"),
    ("finish_stores_unseen", "finish stores not in the capture (inserted with no event)"),
    ("precached_requests", "requests that found a prefix cached before the capture"),
    ("precached_prefixes", "... prefixes stored before the capture (pre-loaded)"),
    ("precached_below_capture_stores", "... requests below a capture store of an older prefix"),
    ("held_before_tokens", "tokens held before a late capture (placeholders of evicted pages)"),
    ("records_before_capture", "records that finished before the capture's first store"),
    ("records_after_capture", "records received after the capture's last store"),
    ("retracted_in_capture", "retracted in the capture"),
    ("retracted_in_capture_and_replay", "... of them retracted in the replay too"),
    ("namespaced_requests", "requests in a cache namespace (extra_key, cache_salt)"),
    ("namespaces", "... cache namespaces besides the default"),
    ("salted_requests", "... requests with a cache_salt"),
)


def trailer_inferred(bundle: str | Path) -> dict[str, Any] | None:
    """``stats.replay.inferred`` of the bundle's last ``Trailer``; None when absent."""
    found = None
    for rec in BundleReader(Path(bundle)).iter_kinds("trailer"):
        rp = (getattr(rec, "stats", None) or {}).get("replay") or {}
        inf = rp.get("inferred")
        if isinstance(inf, dict):
            found = {**inf, **_held_before(rp)}
    return found


def _held_before(rp: dict[str, Any]) -> dict[str, int]:
    """``held_before_tokens`` of a replay's stats (a fleet's: its ranks' summed), when any."""
    n = rp.get("held_before_tokens")
    if not isinstance(n, int):
        ranks = rp.get("per_rank")
        n = sum(p.get("held_before_tokens") or 0 for p in ranks or () if isinstance(p, dict))
    return {"held_before_tokens": n} if n else {}


def figures(inf: dict[str, Any]) -> dict[str, Any]:
    """The section's figures of one replay: the trailer's counts plus the derived ones
    (every inferred client's first request arrives open loop; the other session starts
    follow a client's previous session)."""
    out = dict(inf)
    clients, sessions = inf.get("clients"), inf.get("sessions")
    if isinstance(clients, int) and isinstance(sessions, int):
        out["open_loop"] = clients
        out["session_starts_joined"] = sessions - clients
    return out


def _cell(v: Any) -> str:
    if isinstance(v, dict):
        return str(sum(n for n in v.values() if isinstance(n, int)))
    return "-" if v is None else f"{v:,}" if isinstance(v, int) else str(v)


def _text(label: str, f: dict[str, Any]) -> str:
    syn = {**(f.get("outputs_synthetic") or {}), **(f.get("unstored_tail_synthetic") or {})}
    why = "; ".join(f"{n} {k}" for k, n in syn.items()) if syn else "none"
    return (
        f"{label}: {f.get('requests', 0)} requests had no output ids or sessions recorded "
        f"(SGLang's own logs); synthetic outputs: {why}; "
        f"{f.get('predecessor_ties', 0)} predecessors picked by the tie rule; "
        f"{f.get('open_loop', 0)} requests arrive open loop at their recorded times."
    )


def inferred_extra(labelled: list[tuple[str, Any]], ings: list[Any], out: Path) -> Extra | None:
    """The report hook: ``section`` of the sim bundles whose trailer has inferred counts
    (one pass over each sim bundle for its trailer; a capture is not read); None when no
    input has them."""
    got: dict[str, dict[str, Any]] = {}
    for (label, m), ing in zip(labelled, ings, strict=True):
        if m.inputs.get("source") != "sim":
            continue  # only a replay has them: no pass over a capture
        inf = trailer_inferred(ing.bundle)
        if inf:
            got[label] = figures(inf)
    return section(got) if got else None


def section(got: dict[str, dict[str, Any]]) -> Extra:
    """The "Inferred inputs" section (one column per replay, one row per count, each
    synthetic reason a row of its own under its total) and report.json ``inferred``
    (label -> figures); right after "Inputs"."""
    table: dict[str, list[str]] = {"figure": []}
    for label in got:
        table[label] = []
    for key, what in ROWS:
        if all(key not in f for f in got.values()):
            continue
        table["figure"].append(what)
        for label, f in got.items():
            table[label].append(_cell(f.get(key)))
        if key in ("outputs_synthetic", "unstored_tail_synthetic"):
            for why in sorted({k for f in got.values() for k in (f.get(key) or {})}):
                table["figure"].append(f"... {why}")
                for label, f in got.items():
                    table[label].append(_cell((f.get(key) or {}).get(why, 0)))
    text = (
        "What the replay could not read from the capture (no output ids, sessions or clients "
        "in SGLang's request logs) and how it was inferred (docs/simulator.md, "
        '"Production captures"). ' + " ".join(_text(lb, f) for lb, f in got.items())
    )
    return Extra({"inferred": got}, [(TITLE, text, table)], after="Inputs")
