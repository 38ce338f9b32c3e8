"""Per-request drill-down: the real and the sim event sequence of the requests that differ most.

For a real/sim pair matched by rid, the requests are ranked by ``|cached_tokens sim - real|``,
then by ``|stored events sim - real|`` (attribution counts), then by rid; the first ``LIMIT``
with a difference are shown. For each side, every event that touches the request is listed in
(receive time, event id) order:

* a ``stored`` event, received no earlier than the request was sent, holding any of the
  request's pages at or past its cached pages (what it could have stored: the attribution
  rule of ``kvcadence.analysis.attribution``; an earlier store was another request's), with the
  event's block count and how many of the request's pages are prompt / output pages;
* a ``removed`` event evicting any of the request's pages, with the event's size and how many
  of the request's pages it took.

Each row gives the message (endpoint/seq) it went out in and its time relative to the request's
send time. At most ``MAX_EVENTS`` rows a side; the rest are counted. ``merge_counts`` counts the
Stored events that hold one request's finish (output) pages and another's prompt pages, the
"finish merged with the next prefill" shape, from the attribution labels.
"""

from __future__ import annotations

import html
from dataclasses import dataclass, field
from typing import Any

from kvcadence.analysis import pages as pages_mod
from kvcadence.analysis import sql
from kvcadence.analysis.formatting import md_escape

LIMIT = 10
MAX_EVENTS = 20


@dataclass
class Side:
    """One request on one side: cached tokens and its events (truncated)."""

    cached_tokens: int | None
    stored_events: int | None
    events: list[dict[str, Any]] = field(default_factory=list)
    more: int = 0

    def as_dict(self) -> dict[str, Any]:
        return {
            "cached_tokens": self.cached_tokens,
            "stored_events": self.stored_events,
            "events": self.events,
            "more_events": self.more,
        }


@dataclass
class Drill:
    """The drill-down of one comparison: ``rows`` = [(rid, real side, sim side)]."""

    real: str
    sim: str
    rows: list[tuple[str, Side, Side]]

    def as_list(self) -> list[dict[str, Any]]:
        return [
            {"rid": rid, self.real: a.as_dict(), self.sim: b.as_dict()} for rid, a, b in self.rows
        ]


def pick(per_request: Any, limit: int = LIMIT) -> list[str]:
    """rids of the requests that differ most (cached tokens, then stored events), at most
    ``limit``; none when every matched request agrees."""
    import polars as pl

    if per_request is None or per_request.height == 0:
        return []
    d = (
        per_request.with_columns(
            pl.col("d_cached_tokens").abs().fill_null(0).alias("_c"),
            pl.col("d_stored_events").abs().fill_null(0).alias("_s"),
        )
        .filter((pl.col("_c") > 0) | (pl.col("_s") > 0))
        .sort(["_c", "_s", "rid"], descending=[True, True, False])
        .head(limit)
    )
    return [str(r) for r in d["rid"].to_list()]


def side_events(
    ing: Any, page_size: int, rids: list[str], stored_counts: dict[str, int | None]
) -> dict[str, Side]:
    """Each of ``rids``' events in the bundle ``ing`` (see the module note)."""
    import numpy as np
    import pyarrow as pa

    out: dict[str, Side] = {}
    if not rids:
        return out
    ps = max(1, int(page_size or 1))
    con = sql.connect(ing)
    try:
        reqs = sql.rows(
            con,
            "SELECT request_id, rid, n_input, cached_tokens, send_ns FROM requests "
            "ORDER BY request_id",
        )
        wanted = set(rids)
        chosen = [r for r in reqs if r[1] in wanted]
        # every page of each shown request (its cached ones too: a removal of them is
        # shown), hashed for these requests alone (the page cache keeps no cached page)
        pages = pages_mod.chains(ing, con, ps, [int(r[0]) for r in chosen])
        # the shown requests (``k``: their place in ``shown``) and each page of theirs: a
        # table DuckDB joins the blocks with (a production request is 100k pages at page
        # size 1: no Python object a page or a matching block)
        shown: list[str] = []
        info: dict[str, int | None] = {}  # rid -> send
        hs, ks, ps_, meta = [], [], [], []
        for request_id, rid, n_input, cached, send in chosen:
            if rid in info:  # a repeated rid: the first one is shown
                continue
            info[rid] = send
            chain = np.asarray(pages[int(request_id)], dtype=np.int64).view(np.uint64)
            hs.append(chain)
            ks.append(np.full(len(chain), len(shown), dtype=np.int64))
            ps_.append(np.arange(len(chain), dtype=np.int64))
            meta.append((len(shown), int(n_input) // ps, int(cached or 0) // ps, send))
            shown.append(rid)
            out[rid] = Side(None if cached is None else int(cached), stored_counts.get(rid), [], 0)
        if not sum(len(h) for h in hs):
            return out
        con.register(
            "_drill",
            pa.table(
                {
                    "h": pa.array(np.concatenate(hs), type=pa.uint64()),
                    "k": np.concatenate(ks),
                    "p": np.concatenate(ps_),
                }
            ),
        )
        k_, pp_, first_, send_ = zip(*meta, strict=True)
        con.register(
            "_drill_r",
            pa.table(
                {
                    "k": pa.array(k_, pa.int64()),
                    "pp": pa.array(pp_, pa.int64()),
                    "first": pa.array(first_, pa.int64()),
                    "send": pa.array(send_, pa.int64()),
                }
            ),
        )
        # a stored event counts only at or past the request's cached pages and from its send
        # (else it was in the tree at admission, or another request's store)
        hits = sql.rows(
            con,
            "SELECT d.k, e.event_id, e.kind::VARCHAR, e.recv_ns, e.endpoint, e.seq, "
            "e.n_blocks, count(*), count(*) FILTER (WHERE d.p < r.pp) "
            "FROM blocks b JOIN _drill d ON b.hash = d.h JOIN _drill_r r USING (k) "
            "JOIN events e ON e.event_id = b.event_id "
            "WHERE NOT (e.kind = 'stored' AND (d.p < r.first OR coalesce(e.recv_ns < r.send, false))) "
            "GROUP BY ALL ORDER BY d.k, e.recv_ns, e.event_id",
        )
    finally:
        con.close()
    per: dict[tuple[str, int], dict[str, Any]] = {}
    order: list[tuple[str, int]] = []
    for k, event_id, kind, recv_ns, endpoint, seq, n_blocks, n, n_prompt in hits:
        key = (shown[k], int(event_id))
        order.append(key)
        per[key] = {
            "kind": str(kind),
            "recv_ns": int(recv_ns),
            "message": f"{endpoint}/{seq}",
            "event_blocks": int(n_blocks),
            "prompt_pages": int(n_prompt),
            "output_pages": int(n) - int(n_prompt),
            "request_pages": int(n),
        }
    for rid, event_id in order:
        row = per[(rid, event_id)]
        send = info[rid]
        t = row.pop("recv_ns")
        row["t_ms"] = None if send is None else round((t - int(send)) / 1e6, 3)
        if row["kind"] != "stored":
            row.pop("prompt_pages")
            row.pop("output_pages")
        side = out[rid]
        if len(side.events) < MAX_EVENTS:
            side.events.append(row)
        else:
            side.more += 1
    return out


def build(
    real_label: str,
    sim_label: str,
    comp_per_request: Any,
    real_ing: Any,
    sim_ing: Any,
    real_page_size: int,
    sim_page_size: int,
) -> Drill:
    """The drill-down of one real/sim pair (empty ``rows`` when no request differs)."""
    rids = pick(comp_per_request)
    if not rids:
        return Drill(real_label, sim_label, [])
    pr = comp_per_request
    sub = pr.filter(pr["rid"].is_in(rids))
    real_counts = dict(zip(sub["rid"].to_list(), sub["stored_events"].to_list(), strict=True))
    sim_counts = dict(zip(sub["rid"].to_list(), sub["stored_events_sim"].to_list(), strict=True))
    a = side_events(real_ing, real_page_size, rids, real_counts)
    b = side_events(sim_ing, sim_page_size, rids, sim_counts)
    rows = [
        (rid, a.get(rid, Side(None, None)), b.get(rid, Side(None, None)))
        for rid in rids
        if rid in a or rid in b
    ]
    return Drill(real_label, sim_label, rows)


def merge_counts(kinds: dict[str, int]) -> int:
    """Stored events holding finish (output) pages and prompt pages at once (attribution
    labels ``finish | prefill ...``): a finish store merged with a prefill."""
    return sum(n for k, n in kinds.items() if "finish" in k and "prefill" in k)


def stored_cause(
    real_label: str,
    sim_label: str,
    real_value: float | None,
    sim_value: float | None,
    real_kinds: dict[str, int],
    sim_kinds: dict[str, int],
) -> str | None:
    """One sentence of cause for a failed ``stored_events_per_request`` gate, or None."""
    if not real_value or sim_value is None:
        return None
    rel = (sim_value - real_value) / abs(real_value)
    word = "more" if rel > 0 else "fewer"
    head = (
        f"{sim_label} stores {abs(rel) * 100:.0f}% {word} Stored events per request than "
        f"{real_label}"
    )
    mr, ms = merge_counts(real_kinds), merge_counts(sim_kinds)
    if rel > 0 and mr > ms:
        return (
            f"{head}: {mr - ms} finish stores published separately in {sim_label} where "
            f"{real_label} merged them with the next prefill ({mr} merged in {real_label}, "
            f"{ms} in {sim_label})."
        )
    if rel < 0 and ms > mr:
        return (
            f"{head}: {ms - mr} finish stores merged with the next prefill in {sim_label} "
            f"where {real_label} published them separately ({mr} merged in {real_label}, "
            f"{ms} in {sim_label})."
        )
    return f"{head} (finish+prefill merges: {mr} in {real_label}, {ms} in {sim_label})."


# --------------------------------------------------------------------------------------
# rendering
# --------------------------------------------------------------------------------------


def _row_text(ev: dict[str, Any]) -> tuple[str, str, str, str, str]:
    t = "-" if ev.get("t_ms") is None else f"{ev['t_ms']:+.1f}"
    if ev["kind"] == "stored":
        what = (
            f"{ev['event_blocks']} blocks (its {ev['prompt_pages']} prompt + "
            f"{ev['output_pages']} output pages)"
        )
    else:
        what = f"{ev['event_blocks']} blocks ({ev['request_pages']} of this request's evicted)"
    return t, ev["message"], ev["kind"], what, ""


def _summary(rid: str, a: Side, b: Side, real: str, sim: str) -> str:
    def f(v: Any) -> str:
        return "-" if v is None else str(v)

    return (
        f"{rid}: cached {f(a.cached_tokens)} {real} vs {f(b.cached_tokens)} {sim}; "
        f"stored events {f(a.stored_events)} vs {f(b.stored_events)}"
    )


def _html_side(label: str, s: Side) -> str:
    e = html.escape
    rows = "".join(
        "<tr>" + "".join(f"<td>{e(c)}</td>" for c in _row_text(ev)[:4]) + "</tr>" for ev in s.events
    )
    more = f"<p>... {s.more} more events</p>" if s.more else ""
    cached = "-" if s.cached_tokens is None else str(s.cached_tokens)
    return (
        f'<div class="drill-side"><h4>{e(label)}: cached tokens {e(cached)}</h4>'
        "<table><tr><th>t (ms)</th><th>message</th><th>event</th><th>blocks</th></tr>"
        f"{rows}</table>{more}</div>"
    )


def to_html(d: Drill) -> str:
    """One <details> per request with the two sides next to each other."""
    e = html.escape
    parts = []
    for rid, a, b in d.rows:
        parts.append(
            f'<details class="drill"><summary>{e(_summary(rid, a, b, d.real, d.sim))}</summary>'
            f'<div class="drill-pair">{_html_side(d.real, a)}{_html_side(d.sim, b)}</div>'
            "</details>"
        )
    return "".join(parts)


def _md_cell(text: str) -> str:
    """Literal text in a Markdown table cell or an HTML summary: HTML- and Markdown-escaped."""
    return md_escape(html.escape(text, quote=False))


def to_markdown(d: Drill) -> str:
    """The same as ``to_html`` in Markdown: a <details> per request, one table per side."""
    parts = []
    for rid, a, b in d.rows:
        parts.append(
            f"<details><summary>{_md_cell(_summary(rid, a, b, d.real, d.sim))}</summary>\n"
        )
        for label, s in ((d.real, a), (d.sim, b)):
            cached = "-" if s.cached_tokens is None else str(s.cached_tokens)
            parts.append(f"**{_md_cell(label)}**: cached tokens {cached}\n")
            parts.append("| t (ms) | message | event | blocks |\n|---|---|---|---|")
            for ev in s.events:
                parts.append("| " + " | ".join(_md_cell(c) for c in _row_text(ev)[:4]) + " |")
            if s.more:
                parts.append(f"\n... {s.more} more events")
            parts.append("")
        parts.append("</details>\n")
    return "\n".join(parts)
