"""Production captures: complete request records that carry no output ids and no lanes.

What this file owns: ``complete_records`` (and ``records_for_replay``, its bundle entry
point). Records from SGLang's own request logs (``--export-metrics-to-file``) have the
prompt, the output *length* and the timings, but no output ids, no lane/session/turn and
opaque rids. Before the replay builds its schedule:

1. **Outputs from the KV events** (``outputs.StoreIndex``, ``storepass``): the finish store
   chained below the prompt's last full page gives every output token SGLang ever inserted.
   A request that stopped at EOS before its length may have one output more in its finish
   store (the overlap loop decodes it once more, ``replay.scheduler``): up to that many
   pages are read. A retracted request stored its outputs in two runs (its re-prefill, which
   may re-store its prompt's evicted last pages, and its finish): ``retracted.retracted_run``.
2. **Sessions** (``sessions.infer_predecessors``): each request's predecessor; a chain of
   requests becomes one inferred session, written as ``session`` with ``turn`` its
   position (``lane``: its client, below), so the schedule replays it closed loop (think time = recorded receive − the
   predecessor's recorded finish; its estimated finish for a rebuilt predecessor without a
   finish store, ``lanes.estimated_thinks``). A session start (no predecessor) joins the closed-loop
   client whose session ended last before it (``sessions.infer_clients``, ``lanes``: within the
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

The steps are ``_complete``'s, in order, each a function here or a module of its own:
the first pass over the records (``storepass.match_stores``: each record's prefill and finish
stores, the claims and candidates the later steps read), the pre-load (``precached``), the
rebuild (``unrecorded``), the predecessors (``sessions``), the outputs from the next prompt,
the sessions and clients (``lanes``) and the records written with all of it.

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
from dataclasses import dataclass
from typing import Any, cast

import msgspec

from kvcadence.format.namespace import namespace_of
from kvcadence.format.schema import stamps_no_time
from kvcadence.gcpause import gc_paused
from kvcadence.replay.clocks import (
    outside_stores,
    records_clock,
    scheduler_stamps_on_records_clock,
)
from kvcadence.replay.flushes import FlushScan, RecordedFlush
from kvcadence.replay.lanes import (
    Sessions,
    assign_sessions,
    estimated_thinks,
    first_successors,
    parallel_samples,
)
from kvcadence.replay.outputs import StoreIndex
from kvcadence.replay.precached import PRECACHED_KEY, OlderPages, carriers
from kvcadence.replay.rebuiltrows import join_rows
from kvcadence.replay.schedule import (
    AFTER_KEY,
    FINISH_UNSEEN_KEY,
    _arrival,
    _finish,
    _synth_tokens,
    output_length,
)
from kvcadence.replay.sessions import (
    Node,
    arrival_order,
    finish_order,
    infer_predecessors,
    unlink_shared_open_tails,
)
from kvcadence.replay.settings import capture_settings, page_size_hint, tally_for
from kvcadence.replay.storepass import StorePass, match_stores
from kvcadence.replay.timing import is_retracted
from kvcadence.replay.tokens import as_list, cat, compact, same_ids, span
from kvcadence.replay.unrecorded import page_key, rebuild

#: why an output stays synthetic (report keys)
WHY_NO_PAGE = "output fills no page and no later prompt extends it"
WHY_TAIL = "unstored tail, no later prompt extends it"
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
    n = int(output_length(r) or 0)
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
    retracted = no_time = 0
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
        no_time += stamps_no_time(r.meta_info or {}) > 0
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
    report["stamps_no_time"] = no_time
    spaces = Counter(ns for ns in (namespace_of(r.meta_info) for r in out) if ns is not None)
    report["namespaces"] = len(spaces)
    report["namespaced_requests"] = sum(spaces.values())
    report["salted_requests"] = sum(n for ns, n in spaces.items() if ns.cache_salt is not None)
    return out, report


@dataclass(slots=True)
class _Cols:
    """The inference's per-request columns (the records', then the rebuilt requests')."""

    records: list[Any]
    ps: int
    times: list[tuple[int | None, int | None]]
    n_outs: list[int]
    lens: list[int]
    nodes: list[Node]


def _complete(
    records: list[Any], index: StoreIndex, flushes_ns: Sequence[int] = (), lost_start: bool = True
) -> tuple[list[Any], dict[str, Any]]:
    """``complete_records`` of the records that ran: the steps of the module docstring."""
    n_recorded = len(records)  # (rebuilt requests join the columns below)
    times = [(_arrival(r), _finish(r)) for r in records]
    nodes = [Node(a if a is not None else 0, f) for a, f in times]
    cols = _Cols(
        records,
        index.page_size,
        times,
        [_n_out(r) for r in records],
        [len(r.input_ids) for r in records],
        nodes,
    )
    finished = finish_order(nodes, range(len(nodes)))
    by_fin = finished + [i for i, nd in enumerate(nodes) if nd.finish_ns is None]
    sp = match_stores(records, index, times, cols.n_outs, cols.lens, nodes, by_fin)
    # the prefixes cached before the capture, each carried by one record (``precached``)
    pre = carriers(
        index,
        sp.pre_cands,
        [cast("int", records[c[0]].cached_tokens) // cols.ps for c in sp.pre_cands],
        [times[c[0]][0] or 0 for c in sp.pre_cands],
        lost_start,
    )
    pre_tokens = {i: n * cols.ps for i, n in pre.pages.items()}
    lost = _rebuild(index, sp, cols)
    if lost.requests:  # rebuilt requests join the inference as records (sessions, clients)
        finished = finish_order(nodes, range(len(nodes)))
        # the part of a rebuilt prompt stored before the capture: pre-loaded, as a record's
        for k, u in enumerate(lost.requests, n_recorded):
            if u.precached:
                pre_tokens[k] = u.precached
    order = arrival_order(nodes)
    pred_ties, unlinked = _link(index, cols, order, finished)
    first_succ = first_successors(nodes, order)
    via_prompt, tail_synth = _next_prompt_outputs(cols, sp, first_succ)
    sess = assign_sessions(nodes, order, first_succ, flushes_ns)
    # only a rebuilt request's estimated finish is one its record lacks (``join_rows``)
    think = estimated_thinks(cols.records, order, sess.lane_of, times) if lost.requests else {}
    samples = parallel_samples(nodes, first_succ, cols.n_outs, sess.session_of)
    out_records = _with_outputs(cols, sp, sess, pre_tokens, think, samples)
    before, after = outside_stores(index, times[:n_recorded])
    n_lost = len(lost.requests)
    report = {
        "requests": len(cols.records) - n_lost,
        "outputs_recorded": sum(1 for k in sp.known if k is None) - n_lost,
        "outputs_from_events": sp.via_events,
        "finish_stores_in_merged_events": sp.in_merged,
        "outputs_from_next_prompt": via_prompt,
        "outputs_synthetic": dict(sorted(Counter(sp.missing.values()).items())),
        "unstored_tail_synthetic": dict(sorted(tail_synth.items())),
        "finish_store_ties": sp.ties,
        "finish_stores_shared": sp.shared,
        "sessions": sess.sessions,
        "clients": sess.clients,
        "idle_client_joins": sess.idle_joins,
        "with_predecessor": sum(1 for nd in nodes if nd.pred is not None),
        "predecessor_ties": pred_ties,
        "unlinked_shared_prefix": unlinked,
        "unrecorded_rebuilt": n_lost,
        "unrecorded_with_finish_store": sum(1 for u in lost.requests if u.finish_ns is not None),
        "unrecorded_finish_below_next_turn": lost.below_next_turn,
        "unrecorded_not_rebuilt": lost.outside,
        "unrecorded_older_prefix": lost.older_prefix,
        "unclaimed_below_records": lost.below_records,
        "finish_stores_unseen": len(sp.unseen_finish),
        "precached_requests": pre.flagged,
        "precached_below_capture_stores": pre.below,
        "precached_prefixes": len(pre.pages),
        "records_before_capture": before,
        "records_after_capture": after,
    }
    return out_records, report


def _rebuild(index: StoreIndex, sp: StorePass, cols: _Cols) -> Any:
    """The requests the records lack, rebuilt from the stores no record claimed
    (``unrecorded.rebuild``), appended to ``cols`` (``rebuiltrows.join_rows``); their
    ``Found``."""
    finish_at: dict[int, int] = {}  # an event holding records' finish stores -> their finish
    for (e, _), i in sp.taken.items():
        f = cols.times[i][1]
        if f is not None and (e not in finish_at or f < finish_at[e]):
            finish_at[e] = f
    # a retracted request stored its pages more than once (its prompt and outputs at the
    # retraction, again at its re-prefill once evicted): each store of them is its own, the
    # earlier ones too (``claimed_mask`` claims a run's re-stores only from the run on)
    offs, pages_of, hs = index.offs, index.pages, index.hashes
    for lo, hi in sp.retracted:
        for ei, j, m, rk in sp.claims[lo:hi]:
            o = offs[ei] + j
            sp.hashed.extend(page_key(x, rk) for x in hs[o : o + min(m, pages_of[ei] - j)].tolist())
    # a rebuilt request below a prefix older than the capture: the tokens above its chain's
    # stores from a record's cached prefix (hashed only when asked)
    nodes = cols.nodes
    older = OlderPages(cols.records, lambda: arrival_order(nodes), cols.ps)
    lost = rebuild(
        index,
        sp.claims,
        sp.hashed,
        sp.no_finish,
        sp.delays,
        cols.lens,
        sp.min_token,
        finish_at,
        sp.chunk_gap,
        sp.max_token,
        older,
    )
    if lost.requests:
        cols.records = [
            *cols.records,
            *join_rows(lost, cols.ps, cols.times, cols.n_outs, cols.lens, nodes, sp.known),
        ]
    return lost


def _link(
    index: StoreIndex, cols: _Cols, order: Sequence[int], finished: Sequence[int]
) -> tuple[int, int]:
    """Each request's predecessor (``sessions.infer_predecessors``), those below a shared
    open tail unlinked (``sessions.unlink_shared_open_tails``): ``(ties, unlinked)``."""
    records, lens, n_outs, ps = cols.records, cols.lens, cols.n_outs, cols.ps

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

    ext = extends if ps > 1 else longer
    ties = infer_predecessors(cols.nodes, index.hashes, index.offs, ext, order, finished)

    def holds(a: int, b: int) -> bool:
        """``a``'s prompt starts with ``b``'s whole prompt."""
        n = lens[b]
        return lens[a] >= n and same_ids(
            span(records[a].input_ids, 0, n), span(records[b].input_ids, 0, n)
        )

    return ties, unlink_shared_open_tails(cols.nodes, holds, lens.__getitem__)


def _next_prompt_outputs(
    cols: _Cols, sp: StorePass, first_succ: dict[int, int]
) -> tuple[int, Counter[str]]:
    """Outputs from the next prompt: each request's ``sp.known`` completed in place from its
    first successor's prompt where that holds more of them; ``(how many, why each output
    that stays short is)``."""
    records, lens, n_outs, ps, missing = cols.records, cols.lens, cols.n_outs, cols.ps, sp.missing
    via_prompt = 0
    tail_synth: Counter[str] = Counter()
    known = sp.known
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
        known[i] = kn
    return via_prompt, tail_synth


def _with_outputs(
    cols: _Cols,
    sp: StorePass,
    sess: Sessions,
    pre_tokens: dict[int, int],
    think: dict[int, int],
    samples: dict[int, tuple[int, int]],
) -> list[Any]:
    """The records with their session, turn, lane and outputs (the recovered ones, the rest
    synthetic: ``schedule._synth_tokens``), their pre-loaded prefix and unseen finish noted
    in ``meta_info``."""
    out_records = []
    replace = msgspec.structs.replace
    session_of, lane_of, n_outs = sess.session_of, sess.lane_of, cols.n_outs
    for i, r in enumerate(cols.records):
        s, t = session_of[i]
        kn = sp.known[i]
        if i in pre_tokens:  # its cached prefix was stored before the capture: pre-loaded
            r = replace(r, meta_info={**(r.meta_info or {}), PRECACHED_KEY: pre_tokens[i]})
        if i in sp.unseen_finish:  # no store of its outputs: its finish publishes none
            r = replace(r, meta_info={**(r.meta_info or {}), FINISH_UNSEEN_KEY: True})
        if i in think:
            r = replace(r, think_ns=think[i])
        if i in samples:  # a parallel request's sample: after its prefill-only request
            r = replace(r, meta_info={**(r.meta_info or {}), AFTER_KEY: list(samples[i])})
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
    return out_records


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
        # the events on the records' clock when the two disagree (``clocks``), by stretch
        # where the offset stepped during the capture
        clock = records_clock(index, recs)
        if clock:
            index.shift(clock)
            flushes = [
                dataclasses.replace(f, recv_ns=f.recv_ns - clock.of_time(f.recv_ns))
                for f in flushes
            ]
        out, report = complete_records(
            recs, index, [f.recv_ns for f in flushes], lost_start=index.lost_start
        )
        out = scheduler_stamps_on_records_clock(out, clock)
    if clock.offsets[0]:
        report["clock_offset_s"] = round(clock.offsets[0] / 1e9, 3)
    if len(clock.offsets) > 1:
        report["clock_steps"] = clock.report()
    return out, report, flushes
