"""The reference implementation of prompt/output attribution (the test oracle).

``attribute`` walks every ``BlockStored`` event in Python over ``Request`` / ``StoredEvent``
objects: the readable statement of the rule in ``kvcadence.analysis.attribution``'s docstring.
The shipped path is ``attribute_arrays`` (numpy columns); the tests check the two agree.
``columns_from_objects`` turns the object inputs into the shipped path's columns.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from kvcadence.analysis.attribution import (
    _U64,
    Attribution,
    EventColumns,
    Request,
    RequestColumns,
    _distance,
)
from kvcadence.format import wire


@dataclass
class StoredEvent:
    """One BlockStored event: its row id, receive time and hashes (uint64 form)."""

    event_id: int
    recv_ns: int
    hashes: list[int]


def _chain_hashes(req: Request, page_size: int) -> list[int]:

    tokens = list(req.input_ids) + list(req.output_ids[:-1])
    return [h & _U64 for h in wire.block_hashes(tokens, page_size)]  # == wire.u64(h)


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

    ps = max(1, int(page_size))
    prompt: set[int] = set()
    for req in requests:
        prompt.update(wire.u64(h) for h in wire.block_hashes(list(req.input_ids), ps))
    n_prompt = n_total = 0
    for ev in events:
        n_total += len(ev.hashes)
        n_prompt += sum(1 for h in ev.hashes if h in prompt)
    return {"prompt_blocks": n_prompt, "output_blocks": n_total - n_prompt}


def columns_from_objects(
    requests: list[Request], events: list[StoredEvent], page_size: int, cut: bool = False
) -> tuple[Any, RequestColumns, EventColumns]:
    """(pages, RequestColumns, EventColumns) of the object inputs of ``attribute`` (tests);
    ``cut``: each request's pages from the page the report's cache keeps first
    (``pages.keep_from``'s rule: its cached pages, at most its last prompt page), else
    every page."""
    import numpy as np

    from kvcadence.analysis.pages import RequestPages

    ps = max(1, int(page_size))
    chains = [
        [h - (1 << 64) if h >= 1 << 63 else h for h in _chain_hashes(r, ps)] for r in requests
    ]
    starts = [
        max(0, min((r.cached_tokens or 0) // ps, len(r.input_ids) // ps - 1)) if cut else 0
        for r in requests
    ]
    chains = [c[min(s, len(c)) :] for c, s in zip(chains, starts, strict=True)]
    offsets = np.zeros(len(requests) + 1, dtype=np.int64)
    np.cumsum([len(c) for c in chains], out=offsets[1:])
    flat = np.array([h for c in chains for h in c], dtype=np.int64)
    pages = RequestPages(ps, offsets, flat, np.array(starts, dtype=np.int64))
    rc = RequestColumns(
        n_input=np.array([len(r.input_ids) for r in requests], dtype=np.int64),
        n_output=np.array([len(r.output_ids) for r in requests], dtype=np.int64),
        cached_tokens=[r.cached_tokens for r in requests],
        send_ns=[r.send_ns for r in requests],
        finish_ns=[r.finish_ns for r in requests],
        lane=[r.lane for r in requests],
        session=[r.session for r in requests],
    )
    hs = [h - (1 << 64) if h >= 1 << 63 else h for e in events for h in e.hashes]
    ec = EventColumns(
        event_id=np.array([e.event_id for e in events], dtype=np.int64),
        recv_ns=np.array([e.recv_ns for e in events], dtype=np.int64),
        n_blocks=np.array([len(e.hashes) for e in events], dtype=np.int64),
        hashes=np.array(hs, dtype=np.int64),
    )
    return pages, rc, ec
