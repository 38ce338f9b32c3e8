"""Production captures: complete request records that carry no output ids and no lanes.

What this file owns: ``complete_records`` (and ``records_for_replay``, its bundle entry
point). Records from SGLang's own request logs (``--export-metrics-to-file``) have the
prompt, the output *length* and the timings, but no output ids, no lane/session/turn and
opaque rids. Before the replay builds its schedule:

1. **Outputs from the KV events** (``outputs.StoreIndex``): the finish store chained below
   the prompt's last full page gives every output token SGLang ever inserted.
   A request that stopped at EOS before its length may have one output more in its finish
   store (the overlap loop decodes it once more, ``replay.scheduler``): up to that many
   pages are read. A retracted request stored its outputs in two runs (its re-prefill, which
   may re-store its prompt's evicted last pages, and its finish): ``retracted.retracted_run``.
2. **Sessions** (``sessions.infer_predecessors``): each request's predecessor; a chain of
   requests becomes one inferred session, written as ``session`` with ``turn`` its
   position (``lane``: its client, below), so the schedule replays it closed loop (think time = recorded receive − the
   predecessor's recorded finish; its estimated finish for a rebuilt predecessor without a
   finish store, ``_estimated_thinks``). A session start (no predecessor) joins the closed-loop
   client whose session ended last before it (``sessions.infer_clients``: within the
   think-time bound, or as the only idle client) or arrives open loop at its recorded
   time, as does a second successor of one request.
3. **Outputs from the next prompt**: a successor's prompt extends its predecessor's prompt +
   output, so the tokens the finish never stored (the last token at page size 1, a partial
   last page) -- or the whole output when the events had none -- are read from it.
4. The rest stays synthetic (``schedule._synth_tokens``); the report says why. Tokens that
   are never stored and never reused change no hash and no cache hit. A record no store of
   whose outputs the capture holds (its finish published none: they were in the tree
   already, or the message was lost) carries ``schedule.FINISH_UNSEEN_KEY``: its finish
   inserts them with no event.
5. **Requests the records lack** (``unrecorded``): SGLang's metrics file has no line for a
   request its client aborted; the stores no record claimed are rebuilt into requests
   (``source`` ``kv-events``) before step 2, which then treats them as records.
6. **Prefixes cached before the capture** (``precached``): a record whose cached prefix no
   store of the capture made before it (a capture attached to a worker already serving)
   found it stored before; the first to arrive of the records that found one prefix
   carries its length in ``meta_info`` (``PRECACHED_KEY``); the replay pre-loads it. Where a
   stream lost its start, a record whose cached prefix ends in pages the capture stored
   below an older prefix gets that older part pre-loaded (``precached.precached_below``).

Aborted and errored requests that never ran (no output token) stored nothing and are left
out (``error`` set); those that ran are replayed to their recorded, partial, output length.
Parallel samples (``n > 1``) of one prompt each claim their own finish store, in finish
order. Retractions are not imposed: ``retracted.retractions`` compares the capture's with
the replay's own. The counts are in the report (docs/production.md, "Production traffic").

Why one module past 500 lines: ``_complete`` is one pass over the records in finish order
whose every route feeds the next (the finish stores claimed, the rebuild's claims, the
pre-load's candidates, the session anchors); each rule it applies lives in its own module
(``outputs``, ``sessions``, ``unrecorded``, ``precached``, ``retracted``), only their joining
is here.

Records that already have output ids keep them (``--log-requests`` records: only the
sessions are inferred); a bundle with lanes (a ``kvcadence drive`` bundle), or whose records
all have output ids and come from elsewhere (an open-loop trace), is returned unchanged.
Recovered outputs take the record's form: an ``array`` for a compact record
(``loading.compact_record``, what a replay holds), else a list.
"""

from __future__ import annotations

import dataclasses
from array import array
from collections import Counter
from collections.abc import Sequence
from itertools import pairwise
from typing import Any, cast

import msgspec

from kvcadence.errors import WireError
from kvcadence.format.hashes import block_hashes
from kvcadence.format.namespace import namespace_of, salt_of
from kvcadence.format.schema import served_rank
from kvcadence.gcpause import gc_paused
from kvcadence.replay.clocks import outside_stores, records_offset
from kvcadence.replay.flushes import FlushScan, RecordedFlush
from kvcadence.replay.outputs import StoreIndex, Window
from kvcadence.replay.precached import PRECACHED_KEY, OlderPages, carriers
from kvcadence.replay.rebuiltrows import join_rows
from kvcadence.replay.retracted import retracted_run
from kvcadence.replay.schedule import FINISH_UNSEEN_KEY, _arrival, _finish, _synth_tokens
from kvcadence.replay.sessions import (
    Node,
    arrival_order,
    finish_order,
    infer_clients,
    infer_predecessors,
    unlink_shared_open_tails,
)
from kvcadence.replay.settings import capture_settings, page_size_hint, tally_for
from kvcadence.replay.timing import is_retracted
from kvcadence.replay.tokens import EMPTY, as_list, cat, compact, same_ids, span
from kvcadence.replay.unrecorded import page_key, rebuild

#: why an output stays synthetic (report keys)
WHY_NO_IDS = "no prompt token ids (text prompt)"
WHY_NO_PROMPT = "prompt not in the event stream"
WHY_NO_FINISH = "finish store not found"
WHY_NO_PAGE = "output fills no page and no later prompt extends it"
WHY_TAIL = "unstored tail, no later prompt extends it"
#: a session start joins the client whose session ended last before it, at most this many
#: median think times (predecessor finish -> successor receive) earlier, or later when that
#: client is the only idle one (``sessions.infer_clients``, rule 2)
CLIENT_GAP_FACTOR = 10


#: record sources that are SGLang's own request logs (no lanes, opaque rids)
PRODUCTION_SOURCES = ("sglang-metrics", "request-log")


def needs_completion(records: list[Any]) -> bool:
    """True when no record has a lane and some record lacks output ids or comes from
    SGLang's own request logs (``--log-requests`` records have outputs, not sessions)."""
    if any(r.lane is not None for r in records):
        return False
    return any(
        (not r.output_ids and (r.completion_tokens or 0) > 0) or r.source in PRODUCTION_SOURCES
        for r in records
    )


def _n_out(r: Any) -> int:
    n = r.completion_tokens
    if n is None:
        n = len(r.output_ids) if r.output_ids else (r.max_new_tokens or 0)
    n = int(n)
    return n if n > 0 else 0


#: ``error`` of a record the replay leaves out: it never ran, so it stored nothing
NOT_RUN_ABORT = "aborted before it ran (nothing stored): not replayed"
NOT_RUN_ERROR = "errored before it ran (nothing stored): not replayed"


def _kind(r: Any) -> tuple[str | None, bool]:
    """``(kind, ran)`` of a record: kind ``"aborted"``, ``"errored"`` or None (finished);
    ``ran``: it produced at least one output token (its prefill ran)."""
    ran = bool(r.output_ids) or (r.completion_tokens or 0) > 0
    fr = (r.meta_info or {}).get("finish_reason")
    status = fr.get("status_code") if isinstance(fr, dict) else None
    if r.error is not None or (isinstance(status, int) and status >= 400):
        return "errored", ran
    if r.finish_reason == "abort":
        return "aborted", ran
    if r.finish_reason is None and r.source in PRODUCTION_SOURCES:
        return "errored", ran
    return None, ran


def complete_records(
    records: list[Any],
    index: StoreIndex,
    flushes_ns: Sequence[int] = (),
    *,
    lost_start: bool = True,
) -> tuple[list[Any], dict[str, Any]]:
    """Records with recovered outputs and inferred sessions, and the report (see module).

    Aborted and errored requests that ran (at least one output token) are replayed to
    their recorded, partial, output length; those that never ran stored nothing and are
    returned with ``error`` set (the schedule leaves them out) and kept out of the
    inference (no predecessor, no client). ``lost_start``: some stream of the capture lost
    its start (``StoreIndex.lost_start``; ``records_for_replay`` says), the only case
    where a store of the capture can chain from a prefix older than it (``precached_below``
    is looked for then only)."""
    counts: Counter[str] = Counter()
    keep: list[int] = []
    out: list[Any] = list(records)
    retracted = 0
    for i, r in enumerate(records):
        kind, ran = _kind(r)
        if kind is None:
            keep.append(i)
        else:
            counts[f"{kind}_{'running' if ran else 'not_run'}"] += 1
            if ran:
                keep.append(i)
            else:
                why = NOT_RUN_ABORT if kind == "aborted" else NOT_RUN_ERROR
                out[i] = msgspec.structs.replace(r, error=r.error or why)
        retracted += is_retracted(r)
    if len(keep) == len(records):  # every record ran (the usual capture)
        out, report = _complete(records, index, flushes_ns, lost_start)
    else:
        done, report = _complete([records[i] for i in keep], index, flushes_ns, lost_start)
        for i, r in zip(keep, done, strict=False):  # the kept records', in order
            out[i] = r
        out.extend(done[len(keep) :])  # then the requests rebuilt from unclaimed stores
    for k in ("aborted_running", "aborted_not_run", "errored_running", "errored_not_run"):
        report[k] = counts[k]
    report["retracted_in_capture"] = retracted
    spaces = Counter(ns for ns in (namespace_of(r.meta_info) for r in out) if ns is not None)
    report["namespaces"] = len(spaces)
    report["namespaced_requests"] = sum(spaces.values())
    report["salted_requests"] = sum(n for ns, n in spaces.items() if ns.cache_salt is not None)
    return out, report


def _complete(  # noqa: C901 - one pass over the records: outputs by route, in order
    records: list[Any], index: StoreIndex, flushes_ns: Sequence[int] = (), lost_start: bool = True
) -> tuple[list[Any], dict[str, Any]]:
    ps = index.page_size
    n_recorded = len(records)  # (rebuilt requests join ``records`` below)
    times = [(_arrival(r), _finish(r)) for r in records]
    n_outs = [_n_out(r) for r in records]
    lens = [len(r.input_ids) for r in records]
    nodes = [Node(a if a is not None else 0, f) for a, f in times]
    # None: the record's own output ids
    known: list[Sequence[int] | None] = [None] * len(records)
    missing: dict[int, str] = {}  # index -> why the stored part of its output is unknown
    via_events = in_merged = ties = shared = 0
    # finish stores are claimed in finish order: parallel samples of one prompt all chain
    # below the same page, each gets its own run (``StoreIndex.finish_pages(taken=...)``)
    taken: dict[tuple[int, int], int] = {}
    finished = finish_order(nodes, range(len(nodes)))
    by_fin = finished + [i for i, nd in enumerate(nodes) if nd.finish_ns is None]
    # every request's search windows in one vectorised pass (those with both times)
    timed = [(i, a, f) for i, (a, f) in enumerate(times) if a is not None and f is not None]
    wins: list[Window | None] = [None] * len(records)
    found = index.windows([x[1] for x in timed], [x[2] for x in timed])
    for x, w in zip(timed, found, strict=True):
        wins[x[0]] = w
    # what the records claim of the stores (``unrecorded``): runs, hashed prompts, and the
    # prompts whose finish store was not found; the records' prefill delays
    claims: list[tuple[int, int, int, int]] = []  # (event, page, pages, the record's rank)
    hashed: list[int] = []
    no_finish: dict[int, int] = {}  # prompt's last page key -> pages its finish may store
    delays: list[tuple[int, int]] = []  # (prefill store's publish, prefill delay)
    min_token = 0  # the least of the records' mean times per output token (ns; 0: none)
    max_token = 0  # ... and the most
    chunk_gap = 0  # the longest a record's chunk store came after its previous chunk's (ns)
    # (record, the block its cached prefix ends in, its finish, rank): was that prefix
    # stored before the capture (``precached``: no store of it published before the
    # record finished -- its prefill found it, its store's publish may lag that a little)
    pre_cands: list[tuple[int, int, int, int]] = []
    # records no store of whose outputs the capture holds (``FINISH_UNSEEN_KEY``)
    unseen_finish: set[int] = set()
    # ``claims[a:b]`` of each retracted record: every store of those pages is its own
    retracted: list[tuple[int, int]] = []
    ret_from = -1
    ts = index._ts  # every event's publish time (on the records' clock already)
    multi_rank = bool(index.frame_rank)
    for i in by_fin:
        if ret_from >= 0:
            retracted.append((ret_from, len(claims)))
        r = records[i]
        was_retracted = is_retracted(r)
        ret_from = len(claims) if was_retracted else -1
        arr, fin = times[i]
        rk = served_rank(r) if multi_rank else 0
        rank = rk if multi_rank else None  # a multi-rank capture: its rank's stores
        node = nodes[i]
        # the prompt's tokens are read by ``span``: only the runs looked at (a compact
        # record's ``Prompt`` is not built whole, a list's ints are not all visited)
        prompt = r.input_ids
        n = n_outs[i]
        L = lens[i]
        P = L // ps
        if not L:
            known[i] = None if r.output_ids else []
            if not r.output_ids:
                missing[i] = WHY_NO_IDS
            continue
        h: int | None
        fast = None
        if r.cached_tokens is not None and arr is not None and fin is not None:
            fast = index.prefill_run(prompt, r.cached_tokens, arr, fin, wins[i], L, rank)
        if fast is not None:
            h, segs, node.base = fast
            node.segs = segs
            for _, ei, j, m in segs:
                claims.append((ei, j, m, rk))
            t_pre = ts[segs[0][1]]
            delays.append((t_pre, t_pre - cast("int", arr)))
            if node.base is not None and cast("int", r.cached_tokens) >= ps and fin is not None:
                pre_cands.append((i, node.base, fin, rk))
            if n >= 2 and fin is not None:  # its outputs' time, from its prompt's last store
                per = (fin - ts[segs[-1][1]]) // (n - 1)
                if per > 0 and (not min_token or per < min_token):
                    min_token = per
                if per > max_token:
                    max_token = per
            if len(segs) > 1:  # a chunked prompt: one chunk to the next
                for a, b in pairwise(segs):
                    chunk_gap = max(chunk_gap, ts[b[1]] - ts[a[1]])
        else:  # nothing new stored at prefill (fully cached), or not found: hash the prompt
            try:
                node.path = block_hashes(span(prompt, 0, P * ps), ps, salt_of(r.meta_info))
            except WireError:
                node.path = []
            # the pages it may have stored at prefill: those past its recorded cached
            # prefix (a cached page was in the tree before it came: another request's,
            # maybe one the records lack -- its store is no claim of this record's)
            c = r.cached_tokens // ps if r.cached_tokens is not None else 0
            hashed.extend(page_key(x, rk) for x in node.path[c:])
            h = node.path[-1] if node.path else None
            if 0 < c <= len(node.path) and fin is not None:
                pre_cands.append((i, node.path[c - 1], fin, rk))
        node.prompt_anchor = h
        K = (L + n - 1) // ps - P if n > 0 else 0
        # a request that stopped before its length (EOS): the overlap loop decoded it once
        # more, so its finish may also have inserted the last output (``Kq`` pages) -- also
        # when the outputs before it fill no page (K == 0: the page is found or none was)
        Kq = (L + n) // ps - P if n > 0 and r.finish_reason not in (None, "length") else K
        at = None
        if fast is not None:
            _, ei, j, m = node.segs[-1]
            at = (ei, j + m - 1)
        tail = span(prompt, P * ps, L) if P * ps < L else EMPTY  # the partial last page
        got = (
            None
            if fin is None or arr is None or Kq <= 0
            else index.finish_pages(h, tail, Kq, arr, fin, at, taken, wins[i], rank)
        )
        if K <= 0 and got is None:  # nothing stored at finish (or the last output not)
            known[i] = None if r.output_ids else []
            node.end_anchor = h
            continue
        runs: list[tuple[int, int, int]] | None = None
        if (got is None or len(got[0]) < K * ps) and fin is not None and arr is not None:
            if was_retracted:
                runs = []  # its runs, each claimed where found
                more = retracted_run(index, h, tail, Kq, arr, fin, taken, runs)
                got = more or got
                claims.extend((a, b, c, rk) for a, b, c in (runs if more else ()))
        if got is not None:
            ties += got[4]
            shared += got[3] in taken
            taken.setdefault(got[3], i)
            if runs is None:
                claims.append((got[3][0], got[3][1], len(got[0]) // ps, rk))
        elif h is not None:
            key = page_key(h, rk)
            no_finish[key] = max(Kq, no_finish.get(key, 0))
        if r.output_ids:
            known[i] = None
            if got is not None and len(got[0]) in (K * ps, Kq * ps):
                node.end_anchor = got[1]
            continue
        if got is None:
            known[i] = []
            stored_prompt = fast is not None or (r.cached_tokens or 0) >= P * ps
            missing[i] = WHY_NO_FINISH if stored_prompt else WHY_NO_PROMPT
            if fin is not None and arr is not None and Kq > 0:
                unseen_finish.add(i)
            continue
        toks, last, was_merged = got[:3]
        known[i] = toks[L - P * ps :] if L > P * ps else toks  # a fresh slice already
        via_events += 1
        in_merged += was_merged
        if len(toks) in (K * ps, Kq * ps):
            node.end_anchor = last
        else:
            missing[i] = WHY_NO_FINISH

    def extends(q: int, r: int) -> bool:
        """``q``'s prompt repeats ``r``'s partial last prompt page (the anchor pages
        before it are on ``q``'s path): ``r``'s whole prompt is in ``q``'s, and more (a next
        turn holds at least its predecessor's answer: a prompt no longer than ``r``'s is a
        repeat of it, another client's or a retry, not its next turn -- but after a request
        with no output, SGLang's prefill-only line of a parallel request, which its samples,
        the same prompt, follow)."""
        L = lens[r]
        if lens[q] <= L and n_outs[r]:
            return False
        a = L - L % ps
        if a == L:
            return True
        return same_ids(span(records[q].input_ids, a, L), span(records[r].input_ids, a, L))

    def longer(q: int, r: int) -> bool:
        """``extends`` at page size 1 (every prompt ends on a full page)."""
        return lens[q] > lens[r] or not n_outs[r]

    # the prefixes cached before the capture, each carried by one record (``precached``)
    pre = carriers(
        index,
        pre_cands,
        [cast("int", records[c[0]].cached_tokens) // ps for c in pre_cands],
        [times[c[0]][0] or 0 for c in pre_cands],
        lost_start,
    )
    pre_tokens = {i: n * ps for i, n in pre.pages.items()}

    finish_at: dict[int, int] = {}  # an event holding records' finish stores -> their finish
    for (e, _), i in taken.items():
        f = times[i][1]
        if f is not None and (e not in finish_at or f < finish_at[e]):
            finish_at[e] = f
    if ret_from >= 0:
        retracted.append((ret_from, len(claims)))
    # a retracted request stored its pages more than once (its prompt and outputs at the
    # retraction, again at its re-prefill once evicted): each store of them is its own, the
    # earlier ones too (``claimed_mask`` claims a run's re-stores only from the run on)
    offs, pages_of, hs = index.offs, index.pages, index.hashes
    for lo, hi in retracted:
        for ei, j, m, rk in claims[lo:hi]:
            o = offs[ei] + j
            hashed.extend(page_key(x, rk) for x in hs[o : o + min(m, pages_of[ei] - j)].tolist())
    # a rebuilt request below a prefix older than the capture: the tokens above its chain's
    # stores from a record's cached prefix (hashed only when asked)
    older = OlderPages(records, lambda: arrival_order(nodes), ps)
    lost = rebuild(
        index,
        claims,
        hashed,
        no_finish,
        delays,
        lens,
        min_token,
        finish_at,
        chunk_gap,
        max_token,
        older,
    )
    if lost.requests:  # rebuilt requests join the inference as records (sessions, clients)
        records = [*records, *join_rows(lost, ps, times, n_outs, lens, nodes, known)]
        finished = finish_order(nodes, range(len(nodes)))
        # the part of a rebuilt prompt stored before the capture: pre-loaded, as a record's
        for k, u in enumerate(lost.requests, n_recorded):
            if u.precached:
                pre_tokens[k] = u.precached

    order = arrival_order(nodes)
    ext = extends if ps > 1 else longer
    pred_ties = infer_predecessors(nodes, index.hashes, index.offs, ext, order, finished)

    def holds(a: int, b: int) -> bool:
        """``a``'s prompt starts with ``b``'s whole prompt."""
        n = lens[b]
        return lens[a] >= n and same_ids(
            span(records[a].input_ids, 0, n), span(records[b].input_ids, 0, n)
        )

    unlinked = unlink_shared_open_tails(nodes, holds, lens.__getitem__)

    # outputs from the next prompt: the first successor (by arrival) of each request
    first_succ: dict[int, int] = {}
    for q in order:
        pr = nodes[q].pred
        if pr is not None and pr not in first_succ:
            first_succ[pr] = q
    via_prompt = 0
    tail_synth: Counter[str] = Counter()
    outs: list[Sequence[int] | None] = known  # completed in place: read at ``i`` only
    for i, kn in enumerate(known):
        if kn is None:
            continue
        n = n_outs[i]
        L = lens[i]
        nq = first_succ.get(i)
        if len(kn) < n and nq is not None:
            # the successor's prompt holds this whole prompt (``extends`` admitted the link),
            # then ``kn``; when it holds more than ``kn``, the outputs are ``nxt[L : L + n]``
            m = len(kn)
            full = span(records[nq].input_ids, L, L + n)  # read once
            if len(full) > m and same_ids(full[:m], kn):
                kn = full
                via_prompt += 1
                missing.pop(i, None)
        if len(kn) < n:
            if i in missing:
                pass
            elif (L + n - 1) // ps == L // ps and not kn:
                tail_synth[WHY_NO_PAGE] += 1
            else:
                tail_synth[WHY_TAIL] += 1
        outs[i] = kn

    # sessions: a chain of first successors is one session (lane = session)
    gaps = sorted(
        nodes[q].arrival_ns - nodes[p].finish_ns  # type: ignore[operator]
        for p, q in first_succ.items()
        if nodes[p].finish_ns is not None
    )
    max_gap = CLIENT_GAP_FACTOR * gaps[len(gaps) // 2] if gaps else 0
    clients, idle_joins = infer_clients(nodes, max_gap, order, flushes_ns)
    session_of: dict[int, tuple[int, int]] = {}
    lane_of: dict[int, int] = {}
    n_sessions = n_lanes = 0
    for i in order:
        pr = nodes[i].pred
        if pr is not None and first_succ.get(pr) == i and pr in session_of:
            s, t = session_of[pr]
            session_of[i] = (s, t + 1)
            lane_of[i] = lane_of[pr]
            continue
        session_of[i] = (n_sessions, 0)
        n_sessions += 1
        c = clients[i]
        if c is not None and c in lane_of:
            lane_of[i] = lane_of[c]
        else:
            lane_of[i] = n_lanes
            n_lanes += 1
    # only a rebuilt request's estimated finish is one its record lacks (``join_rows``)
    think = _estimated_thinks(records, order, lane_of, times) if lost.requests else {}
    out_records = []
    replace = msgspec.structs.replace
    for i, r in enumerate(records):
        s, t = session_of[i]
        kn = outs[i]
        if i in pre_tokens:  # its cached prefix was stored before the capture: pre-loaded
            r = replace(r, meta_info={**(r.meta_info or {}), PRECACHED_KEY: pre_tokens[i]})
        if i in unseen_finish:  # no store of its outputs: its finish publishes none
            r = replace(r, meta_info={**(r.meta_info or {}), FINISH_UNSEEN_KEY: True})
        if i in think:
            r = replace(r, think_ns=think[i])
        if kn is None:
            out_records.append(replace(r, lane=lane_of[i], session=s, turn=t))
            continue
        n = n_outs[i]
        ids: Any
        if type(r.output_ids) is array:  # a compact record: its outputs stay an array
            ids = compact(kn)
            if len(ids) < n:
                ids = cat(ids, compact(_synth_tokens(r.rid, n - len(ids))))
        else:
            ids = as_list(kn)
            if len(ids) < n:
                ids = ids + _synth_tokens(r.rid, n - len(ids))
        out_records.append(replace(r, lane=lane_of[i], session=s, turn=t, output_ids=ids))
    before, after = outside_stores(index, times[:n_recorded])
    report = {
        "requests": len(records) - len(lost.requests),
        "outputs_recorded": sum(1 for k in known if k is None) - len(lost.requests),
        "outputs_from_events": via_events,
        "finish_stores_in_merged_events": in_merged,
        "outputs_from_next_prompt": via_prompt,
        "outputs_synthetic": dict(sorted(Counter(missing.values()).items())),
        "unstored_tail_synthetic": dict(sorted(tail_synth.items())),
        "finish_store_ties": ties,
        "finish_stores_shared": shared,
        "sessions": n_sessions,
        "clients": n_lanes,
        "idle_client_joins": idle_joins,
        "with_predecessor": sum(1 for nd in nodes if nd.pred is not None),
        "predecessor_ties": pred_ties,
        "unlinked_shared_prefix": unlinked,
        "unrecorded_rebuilt": len(lost.requests),
        "unrecorded_with_finish_store": sum(1 for u in lost.requests if u.finish_ns is not None),
        "unrecorded_finish_below_next_turn": lost.below_next_turn,
        "unrecorded_not_rebuilt": lost.outside,
        "unrecorded_older_prefix": lost.older_prefix,
        "unclaimed_below_records": lost.below_records,
        "finish_stores_unseen": len(unseen_finish),
        "precached_requests": pre.flagged,
        "precached_below_capture_stores": pre.below,
        "precached_prefixes": len(pre.pages),
        "records_before_capture": before,
        "records_after_capture": after,
    }
    return out_records, report


def _estimated_thinks(
    records: Sequence[Any],
    order: Sequence[int],
    lane_of: dict[int, int],
    times: Sequence[tuple[int | None, int | None]],
) -> dict[int, int]:
    """Think times (ns) of the requests that follow, on their client, a request whose record
    has no finish time but whose finish the inference estimated: a rebuilt request without
    a finish store (``rebuiltrows.join_rows``: its last store's publish). The schedule
    releases a closed-loop request its recorded receive less its predecessor's recorded
    finish after that predecessor's simulated finish, else ``think_ns``, else the median
    gap; the median put a request 24-28 s before its recorded receive (corpus
    ``p16-attach-midrun-http-clients``: a single that repeats a prompt sent before the
    attach, and chat turns whose previous turn ran before it, followed their rebuilt
    request's prefill by the median 42 ms), so its receive less that estimate is its think
    time instead."""
    out: dict[int, int] = {}
    last: dict[int, int] = {}  # lane -> its latest request so far (arrival order)
    for i in order:
        lane = lane_of[i]
        p = last.get(lane)
        last[lane] = i
        if p is None:
            continue
        arr, fin = times[i][0], times[p][1]
        if arr is not None and fin is not None and _finish(records[p]) is None:
            out[i] = max(0, arr - fin)
    return out


def records_for_replay(
    reader: Any, records: list[Any] | None = None
) -> tuple[list[Any], dict[str, Any], list[RecordedFlush] | None]:
    """``reader``'s request records, completed when they need it: ``(records, report,
    recorded flushes)``; report ``{}`` and flushes None (not read) when not. The flushes
    come from the same pass over the events (``flushes.FlushScan``), so a production replay
    reads and decodes its events once."""
    recs = reader.requests() if records is None else records
    if not needs_completion(recs):
        return recs, {}, None
    # the capture's page size: its snapshot's, else its events' block_size, counted in the
    # index's pass with the rest of the settings (``settings``: no pass of its own)
    tally = tally_for(reader)
    ps = page_size_hint(reader)
    # like simulate(): the cyclic GC would only re-walk the many long-lived lists made here
    with gc_paused():
        scan = FlushScan(reader.header)
        index = StoreIndex.from_reader(reader, ps, scan, tally)
        if tally is not None and capture_settings(reader, tally.scan).page_size != ps:
            # stores of several page sizes, the first not the most common (SGLang writes one)
            scan = FlushScan(reader.header)
            index = StoreIndex.from_reader(reader, capture_settings(reader).page_size, scan)
        flushes = scan.result()
        # the events on the records' clock when the two disagree (``clocks``)
        off = records_offset(index, recs)
        if off:
            index.shift(off)
            flushes = [dataclasses.replace(f, recv_ns=f.recv_ns - off) for f in flushes]
        out, report = complete_records(
            recs, index, [f.recv_ns for f in flushes], lost_start=index.lost_start
        )
    if off:
        report["clock_offset_s"] = round(off / 1e9, 3)
    return out, report, flushes
