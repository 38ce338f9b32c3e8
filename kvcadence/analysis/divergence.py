"""Where a replay parts from its capture: the first message whose events differ, per DP rank.

What this file owns (``report_extras.divergence_extra`` adds the section and JSON key
``divergence``): for the reference (real) bundle and each compared one,

* each message reduced to one signature in DuckDB -- its events in order, each its kind,
  block count and first, last and parent block hash (chained hashes: the last names the
  run), from the events table alone (no pass over the blocks, no event list in Python) --
  and the messages of a DP rank in publish order (epoch, seq); leading messages holding only
  ``AllBlocksCleared`` (the start-up clear, present in one bundle and not the other) are
  skipped;
* the number of leading messages with equal signatures on each rank (``same``) and, when
  the streams part, the two differing messages' events side by side, each block attributed
  to the request whose page it is (``analysis.pages``: ``rid pFIRST-LAST`` prompt pages,
  ``oFIRST-LAST`` output pages; ``?`` for a block no request's tokens give);
* the first request, in the reference's arrival order, whose ``cached_tokens`` differs.

The message-by-message comparison is what the corpus analyses did by hand (docs/simulator.md):
a start-up batch, a late arrival or an eviction order shows here as the first parting.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from kvcadence.analysis import pages as pages_mod
from kvcadence.analysis import sql
from kvcadence.analysis.formatting import md_escape

#: events of a differing message shown per side (the rest counted)
MAX_EVENTS = 8

#: one event of a shown message: its kind ("S", "R", "C") and block runs
#: ``(rid or None, first page, last page, prompt pages?, blocks)``
Event = tuple[str, list[tuple[str | None, int, int, bool, int]]]


@dataclass
class Parting:
    """One rank's comparison: ``same`` leading messages equal; ``real`` / ``sim`` the first
    differing message's events (``None``: that stream ended first)."""

    rank: int
    same: int
    real_messages: int
    sim_messages: int
    real: list[Event] | None = None
    sim: list[Event] | None = None

    def as_dict(self) -> dict[str, Any]:
        return {
            "rank": self.rank,
            "same_messages": self.same,
            "real_messages": self.real_messages,
            "sim_messages": self.sim_messages,
            "real_message": None if self.real is None else message_text(self.real),
            "sim_message": None if self.sim is None else message_text(self.sim),
        }


@dataclass
class Divergence:
    """Every rank's ``Parting`` and the first request whose ``cached_tokens`` differs."""

    real: str
    sim: str
    ranks: list[Parting] = field(default_factory=list)
    first_cached: dict[str, Any] | None = None

    def as_dict(self) -> dict[str, Any]:
        return {
            "real": self.real,
            "sim": self.sim,
            "ranks": [p.as_dict() for p in self.ranks],
            "first_cached_tokens_difference": self.first_cached,
        }


_SIGNATURES = """
SELECT dp_rank, batch_id,
       bit_xor(hash(idx, kind::VARCHAR, n_blocks, first_hash, last_hash, parent_hash)) AS sig,
       bool_and(kind::VARCHAR = 'cleared') AS clear_only
FROM events
GROUP BY dp_rank, epoch, seq, batch_id
ORDER BY dp_rank, epoch, seq, batch_id
"""


def _signatures(ing: Any) -> dict[int, tuple[Any, Any]]:
    """rank -> (batch ids, signatures) in publish order (numpy arrays), leading clear-only
    messages out. A message's signature combines each event's position, kind, block count,
    first, last and parent hash (the chained hashes: the last block names the run) -- from
    the events table alone, no pass over the blocks."""
    import numpy as np

    con = sql.connect(ing)
    try:
        cols = con.sql(_SIGNATURES).fetchnumpy()
    finally:
        con.close()
    ranks = np.asarray(cols["dp_rank"], dtype=np.int64)
    ids = np.asarray(cols["batch_id"], dtype=np.int64)
    sigs = np.asarray(cols["sig"], dtype=np.uint64)
    clear = np.asarray(cols["clear_only"], dtype=bool)
    out: dict[int, tuple[Any, Any]] = {}
    for rank in np.unique(ranks).tolist():
        mine = np.flatnonzero(ranks == rank)
        lead = int(np.argmin(clear[mine])) if not clear[mine].all() else len(mine)
        mine = mine[lead:]
        out[int(rank)] = (ids[mine], sigs[mine])
    return out


def _message(ing: Any, batch_id: int, page_size: int) -> list[Event]:
    """The events of message ``batch_id``, each block run attributed to its request pages."""
    con = sql.connect(ing)
    try:
        # a message's events are consecutive rows, its blocks too: the event-id range lets
        # the blocks scan skip every other row group (their min/max statistics)
        ((lo, hi),) = con.sql(
            f"SELECT min(event_id), max(event_id) FROM events WHERE batch_id = {int(batch_id)}"
        ).fetchall()
        rows = con.sql(
            "SELECT e.event_id, e.kind::VARCHAR, b.pos, b.hash FROM events e "
            "LEFT JOIN (SELECT * FROM blocks WHERE event_id BETWEEN $lo AND $hi) b "
            "ON b.event_id = e.event_id "
            "WHERE e.event_id BETWEEN $lo AND $hi ORDER BY e.event_id, b.pos",
            params={"lo": lo, "hi": hi},
        ).fetchall()
        hashes = sorted({int(h) for *_, h in rows if h is not None})
        owners: dict[int, tuple[str, int, bool]] = {}
        path = pages_mod.ensure_file(ing, con, page_size) if hashes else None
        if path is not None:  # (a read-only cache: the blocks stay unattributed)
            got = con.sql(
                "SELECT p.hash, r.rid, p.page, p.page < r.n_input // $ps AS prompt "
                f"FROM ({pages_mod.relation(path)}) p "
                "JOIN requests r ON r.request_id = p.request_id "
                "WHERE p.hash IN (SELECT unnest($h::UBIGINT[])) ORDER BY r.request_id, p.page",
                params={"ps": page_size, "h": hashes},
            ).fetchall()
            for h, rid, page, prompt in got:
                owners.setdefault(int(h), (str(rid), int(page), bool(prompt)))
    finally:
        con.close()
    events: list[Event] = []
    cur: int | None = None
    blocks: list[int] = []
    kind = ""

    def flush() -> None:
        if cur is not None:
            head = {"stored": "S", "removed": "R", "cleared": "C"}.get(kind, kind)
            events.append((head, _runs(blocks, owners)))

    for event_id, k, _pos, h in rows:
        if event_id != cur:
            flush()
            cur, kind, blocks = event_id, k, []
        if h is not None:
            blocks.append(int(h))
    flush()
    return events


def _runs(
    blocks: list[int], owners: dict[int, tuple[str, int, bool]]
) -> list[tuple[str | None, int, int, bool, int]]:
    """Runs of consecutive pages of one request (rid None: blocks no request's tokens give)."""
    parts: list[list[Any]] = []
    for h in blocks:
        rid, page, prompt = owners.get(h, (None, -1, False))
        last = parts[-1] if parts else None
        if (
            last is not None
            and last[0] == rid
            and last[3] == prompt
            and (rid is None or last[2] == page - 1)
        ):
            last[2] = page
            last[4] += 1
        else:
            parts.append([rid, page, page, prompt, 1])
    return [(r, a, b, p, n) for r, a, b, p, n in parts]


def event_text(ev: Event, esc: Any = str) -> str:
    """``S 24: l3-s0-t3 o214-237, ...`` (``p``/``o``: prompt / output pages; ``? ×n``:
    blocks of no request); ``esc`` is applied to each rid (``formatting.md_escape`` for
    the report's shared Markdown / HTML text)."""
    head, runs = ev
    if head == "C":
        return "AllBlocksCleared"
    n = sum(r[4] for r in runs)
    body = ", ".join(
        f"? ×{k}" if rid is None else f"{esc(rid)} {'p' if prompt else 'o'}{a}-{b}"
        for rid, a, b, prompt, k in runs
    )
    return f"{head} {n}: {body}"


def message_text(msg: list[Event], esc: Any = str) -> list[str]:
    """A message's events as text, at most ``MAX_EVENTS`` (the rest counted)."""
    out = [event_text(ev, esc) for ev in msg[:MAX_EVENTS]]
    if len(msg) > MAX_EVENTS:
        out.append(f"... {len(msg) - MAX_EVENTS} more events")
    return out


def _first_cached(real: Any, sim: Any) -> dict[str, Any] | None:
    """The first request (the reference's arrival order) whose ``cached_tokens`` differs: one
    query over both requests tables (no rid list in Python)."""
    path = str(sim.path("requests")).replace("'", "''")
    con = sql.connect(real)
    try:
        rows = con.sql(
            "WITH r AS (SELECT rid, cached_tokens, row_number() OVER "
            "(ORDER BY send_ns, request_id) AS k FROM requests WHERE error IS NULL), "
            "s AS (SELECT rid, any_value(cached_tokens) AS cached_tokens "
            f"FROM read_parquet('{path}') GROUP BY rid) "
            "SELECT r.rid, r.k, r.cached_tokens, s.cached_tokens FROM r JOIN s USING (rid) "
            "WHERE r.cached_tokens IS DISTINCT FROM s.cached_tokens ORDER BY r.k LIMIT 1"
        ).fetchall()
    finally:
        con.close()
    if not rows:
        return None
    ((rid, k, a, b),) = rows
    return {"rid": rid, "arrival_index": int(k), "real": a, "sim": b}


def compare(real_label: str, real: Any, sim_label: str, sim: Any, page_size: int) -> Divergence:
    """The divergence of ``sim`` from ``real`` (both ``Ingested``), see the module."""
    ps = max(1, int(page_size))
    a, b = _signatures(real), _signatures(sim)
    out = Divergence(real_label, sim_label)
    import numpy as np

    none = (np.zeros(0, np.int64), np.zeros(0, np.uint64))
    for rank in sorted(set(a) | set(b)):
        ia, sa = a.get(rank, none)
        ib, sb = b.get(rank, none)
        n = min(len(sa), len(sb))
        diff = np.flatnonzero(sa[:n] != sb[:n])
        same = int(diff[0]) if len(diff) else n
        p = Parting(rank, same, len(sa), len(sb))
        if same < max(len(sa), len(sb)):
            p.real = _message(real, int(ia[same]), ps) if same < len(sa) else None
            p.sim = _message(sim, int(ib[same]), ps) if same < len(sb) else None
        out.ranks.append(p)
    out.first_cached = _first_cached(real, sim)
    return out


def section(d: Divergence) -> tuple[str, str, dict[str, list[str]]]:
    """The report section: one paragraph, one table row per rank."""
    t: dict[str, list[str]] = {
        "rank": [],
        "messages equal": [],
        f"{d.real} message": [],
        f"{d.sim} message": [],
    }
    for p in d.ranks:
        t["rank"].append(str(p.rank))
        t["messages equal"].append(f"{p.same} of {p.real_messages} / {p.sim_messages}")
        for key, msg in ((f"{d.real} message", p.real), (f"{d.sim} message", p.sim)):
            if msg is None:
                t[key].append(
                    "(none: the streams agree)"
                    if p.real is None and p.sim is None
                    else "(the stream ended)"
                )
            else:
                t[key].append(" ; ".join(message_text(msg, md_escape)) or "(no events)")
    fc = d.first_cached
    text = (
        f"Where {d.sim} parts from {d.real}: per DP rank, how many leading messages hold the "
        "same events (kinds and block hashes, in order; the start-up clear left out) and the "
        "first message that differs, each event its kind (S stored, R removed) and block "
        "count, each run of its blocks named by the request pages it holds (rid "
        "pFIRST-LAST: prompt pages, oFIRST-LAST: output pages). "
        + (
            f"The first request whose cached_tokens differs, in {d.real}'s arrival order, is "
            f"{md_escape(fc['rid'])} (#{fc['arrival_index']}): {fc['real']} against "
            f"{fc['sim']}."
            if fc
            else "Every matched request's cached_tokens is equal."
        )
    )
    return f"Divergence ({d.sim})", text, t
