"""Prompt vs output attribution of stored blocks, by recomputing each request's page hashes.

Rule (reference/cadence-metrics.md): every request's token chain is ``input_ids +
output_ids[:-1]`` (what SGLang caches at finish); its page hashes come from
``kvcadence.capture.wire.block_hashes`` at the bundle's page size. A request can only have
*stored* pages at or past its ``cached_tokens`` (the rest were already in the tree at
admission). Each ``BlockStored`` event's hashes are split greedily into runs of consecutive
pages of one request's chain; a run is then split at that request's own prompt/output
boundary: pages wholly inside the prompt (index < ``len(input_ids) // page_size``) are
``prefill`` (prompt) pages, later pages are ``finish`` (output) pages. Blocks that match no
request are counted as unmatched, never guessed.

When a hash is a candidate of several requests (a shared prefix re-stored after an eviction)
the pick is, in order: a page not yet attributed, then the request whose [send, finish]
interval is closest in time to the message, then the earliest request.

The peer-compatible variant (``any_prompt=True``) labels a stored block "prompt" when its hash
is a page of *any* request's prompt (Dynamo's definition), else "output".
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

_U64 = (1 << 64) - 1


@dataclass
class Request:
    """What attribution needs of one request."""

    rid: str
    input_ids: list[int]
    output_ids: list[int]
    cached_tokens: int | None = None
    send_ns: int | None = None
    finish_ns: int | None = None
    lane: int | None = None
    session: int | None = None


@dataclass
class StoredEvent:
    """One BlockStored event: its row id, receive time and hashes (uint64 form)."""

    event_id: int
    recv_ns: int
    hashes: list[int]


@dataclass
class Attribution:
    """Result: totals, per-event labels and per-request counts."""

    page_size: int
    stored_blocks: int = 0
    matched_blocks: int = 0
    unmatched_blocks: int = 0
    unmatched_events: int = 0
    prompt_blocks: int = 0
    output_blocks: int = 0
    expected_output_blocks: int = 0
    event_kinds: dict[str, int] = field(default_factory=dict)
    events_spanning_same_session: int = 0
    events_spanning_other: int = 0
    # per request (index-aligned with the requests given)
    req_prompt_blocks: list[int] = field(default_factory=list)
    req_output_blocks: list[int] = field(default_factory=list)
    req_stored_events: list[int] = field(default_factory=list)
    req_prefill_events: list[int] = field(default_factory=list)
    req_finish_events: list[int] = field(default_factory=list)
    # per event: event_id -> (prompt blocks, output blocks, unmatched blocks)
    per_event: dict[int, tuple[int, int, int]] = field(default_factory=dict)

    @property
    def requests_without_prefill_store(self) -> int:
        return sum(1 for n in self.req_prefill_events if n == 0)


def _chain_hashes(req: Request, page_size: int) -> list[int]:
    from kvcadence.capture import wire

    tokens = list(req.input_ids) + list(req.output_ids[:-1])
    return [h & _U64 for h in wire.block_hashes(tokens, page_size)]  # == wire.u64(h)


def _distance(req: Request, t: int) -> int:
    lo, hi = req.send_ns, req.finish_ns
    if lo is None and hi is None:
        return 0
    lo = hi if lo is None else lo
    hi = lo if hi is None else hi
    if t < lo:
        return lo - t
    if t > hi:
        return t - hi
    return 0


def attribute(requests: list[Request], events: list[StoredEvent], page_size: int) -> Attribution:
    """Split every stored event into per-request prompt/output runs (see module docstring)."""
    ps = max(1, int(page_size))
    res = Attribution(page_size=ps)
    nreq = len(requests)
    res.req_prompt_blocks = [0] * nreq
    res.req_output_blocks = [0] * nreq
    res.req_stored_events = [0] * nreq
    res.req_prefill_events = [0] * nreq
    res.req_finish_events = [0] * nreq

    chains: list[list[int]] = []
    prompt_pages: list[int] = []
    index: dict[int, list[tuple[int, int]]] = {}
    for r, req in enumerate(requests):
        chain = _chain_hashes(req, ps)
        chains.append(chain)
        pp = len(req.input_ids) // ps
        prompt_pages.append(pp)
        if req.output_ids:
            res.expected_output_blocks += len(chain) - pp
        first = (req.cached_tokens or 0) // ps
        for p in range(first, len(chain)):
            index.setdefault(chain[p], []).append((r, p))

    consumed: set[tuple[int, int]] = set()
    for ev in sorted(events, key=lambda e: (e.recv_ns, e.event_id)):
        hs = ev.hashes
        n = len(hs)
        res.stored_blocks += n
        i = 0
        unmatched = 0
        ev_prompt = ev_output = 0
        runs: list[tuple[int, str]] = []  # (request, kind)
        while i < n:
            cands = index.get(hs[i])
            if not cands:
                unmatched += 1
                i += 1
                continue
            if len(cands) == 1:
                r, p = cands[0]
            else:
                r, p = min(
                    cands,
                    key=lambda c: (
                        (c[0], c[1]) in consumed,
                        _distance(requests[c[0]], ev.recv_ns),
                        c[0],
                    ),
                )
            chain = chains[r]
            # extend the run while the event's hashes follow this request's chain
            m = 1
            limit = min(n - i, len(chain) - p)
            if hs[i : i + limit] == chain[p : p + limit]:
                m = limit
            else:
                while m < limit and hs[i + m] == chain[p + m]:
                    m += 1
            for q in range(p, p + m):
                consumed.add((r, q))
            pp = prompt_pages[r]
            n_prompt = max(0, min(p + m, pp) - p)
            n_output = m - n_prompt
            if n_prompt:
                runs.append((r, "prefill"))
                res.req_prompt_blocks[r] += n_prompt
                ev_prompt += n_prompt
            if n_output:
                runs.append((r, "finish"))
                res.req_output_blocks[r] += n_output
                ev_output += n_output
            i += m
        res.matched_blocks += n - unmatched
        res.unmatched_blocks += unmatched
        res.prompt_blocks += ev_prompt
        res.output_blocks += ev_output
        if unmatched:
            res.unmatched_events += 1
        res.per_event[ev.event_id] = (ev_prompt, ev_output, unmatched)
        reqs = sorted({r for r, _ in runs})
        for r in reqs:
            res.req_stored_events[r] += 1
        for r in sorted({r for r, k in runs if k == "prefill"}):
            res.req_prefill_events[r] += 1
        for r in sorted({r for r, k in runs if k == "finish"}):
            res.req_finish_events[r] += 1
        kinds = sorted({k for _, k in runs})
        if unmatched:
            kinds.append("unmatched")
        label = " | ".join(kinds) if kinds else "empty"
        if len(reqs) > 1:
            sessions = {(requests[r].lane, requests[r].session) for r in reqs}
            same = len(sessions) == 1 and None not in next(iter(sessions))
            if same:
                res.events_spanning_same_session += 1
                label += " (same session)"
            else:
                res.events_spanning_other += 1
                label += " (other sessions)"
        res.event_kinds[label] = res.event_kinds.get(label, 0) + 1
    return res


def any_prompt_split(
    requests: list[Request], events: list[StoredEvent], page_size: int
) -> dict[str, int]:
    """Peer-compatible split: prompt if the hash is a page of any request's prompt."""
    from kvcadence.capture import wire

    ps = max(1, int(page_size))
    prompt: set[int] = set()
    for req in requests:
        prompt.update(wire.u64(h) for h in wire.block_hashes(list(req.input_ids), ps))
    n_prompt = n_total = 0
    for ev in events:
        n_total += len(ev.hashes)
        n_prompt += sum(1 for h in ev.hashes if h in prompt)
    return {"prompt_blocks": n_prompt, "output_blocks": n_total - n_prompt}


def load(con: Any, scope: str = "TRUE") -> tuple[list[Request], list[StoredEvent]]:
    """Requests and stored events (hashes in event order) from a DuckDB connection (sql.connect)."""
    from kvcadence.analysis import sql

    tbl = sql.arrow(
        con,
        "SELECT rid, input_ids, output_ids, cached_tokens, send_ns, finish_ns, lane, session "
        "FROM requests ORDER BY request_id",
    )
    ins = _lists(tbl, "input_ids")
    outs = _lists(tbl, "output_ids")
    requests = [
        Request(rid, i, o, c, s, f, la, se)
        for rid, i, o, c, s, f, la, se in zip(
            _col(tbl, "rid"),
            ins,
            outs,
            _col(tbl, "cached_tokens"),
            _col(tbl, "send_ns"),
            _col(tbl, "finish_ns"),
            _col(tbl, "lane"),
            _col(tbl, "session"),
            strict=False,
        )
    ]
    ev = sql.arrow(
        con,
        "SELECT event_id, recv_ns, n_blocks FROM events WHERE kind = 'stored' "
        f"AND {scope} ORDER BY event_id",
    )
    hashes = sql.arrow(
        con,
        "SELECT b.hash FROM blocks b JOIN events e ON b.event_id = e.event_id "
        f"WHERE b.kind = 'stored' AND {scope.replace('seq', 'e.seq')} ORDER BY b.event_id, b.pos",
    )
    ids = _col(ev, "event_id")
    recv = _col(ev, "recv_ns")
    nb = _col(ev, "n_blocks")
    flat = _col(hashes, "hash")
    events: list[StoredEvent] = []
    off = 0
    for eid, t, k in zip(ids, recv, nb, strict=False):
        events.append(StoredEvent(eid, t, flat[off : off + k]))
        off += k
    return requests, events


def _lists(tbl: Any, name: str) -> list[list[int]]:
    """A list<int64> column as Python lists, via one flat conversion (fast)."""
    col = tbl.column(name).combine_chunks()
    if len(col) == 0:
        return []
    flat = col.flatten().to_numpy(zero_copy_only=False).tolist()
    off = col.offsets.to_numpy().tolist()
    base = off[0]
    return [flat[a - base : b - base] for a, b in zip(off, off[1:], strict=False)]


def _col(tbl: Any, name: str) -> list[Any]:
    col = tbl.column(name)
    return col.to_pylist()
