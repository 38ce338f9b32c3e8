"""Every record's own stores, matched in finish order (production captures).

What this file owns: ``match_stores``, the first pass of ``production.complete_records``.
For each record, in finish order (parallel samples of one prompt all chain below the same
page and claim their finish stores in that order: ``StoreIndex.finish_pages(taken=...)``):

* its prefill store (``StoreIndex.prefill_run``: the run of its uncached full pages
  published between its receive and its finish), or, when it stored nothing at prefill
  (fully cached) or that run is not found, every page hash of its prompt
  (``format.hashes.block_hashes``);
* its finish store below its prompt's last full page (``StoreIndex.finish_pages``; a
  retracted record's two runs, ``retracted.retracted_run``): the stored part of its output;
* on its ``sessions.Node``, the anchors the session inference looks for (the prefill
  segments and the block they attached to, the prompt's and the finish's last pages).

On the way it keeps what the later steps read off the stores (``StorePass``): the runs the
records claim and the hashes of their prompts (``unrecorded.rebuild``), the prompts whose
finish store was not found, the prefill delays, the output pace and the longest gap between
a prompt's chunk stores (the rebuilt requests' times), the records whose cached prefix may
have been stored before the capture (``precached``) and those no store of whose outputs the
capture holds.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from itertools import pairwise
from typing import Any, cast

from kvcadence.errors import WireError
from kvcadence.format.hashes import block_hashes
from kvcadence.format.namespace import salt_of
from kvcadence.format.schema import served_rank
from kvcadence.replay.outputs import StoreIndex, Window
from kvcadence.replay.retracted import retracted_run
from kvcadence.replay.sessions import Node
from kvcadence.replay.timing import is_retracted
from kvcadence.replay.tokens import EMPTY, span
from kvcadence.replay.unrecorded import page_key

#: why an output stays synthetic (report keys; ``production`` adds the tail's reasons)
WHY_NO_IDS = "no prompt token ids (text prompt)"
WHY_NO_PROMPT = "prompt not in the event stream"
WHY_NO_FINISH = "finish store not found"


@dataclass(slots=True)
class StorePass:
    """What ``match_stores`` found (see module)."""

    #: per record: the stored part of its outputs (None: its record's own output ids)
    known: list[Sequence[int] | None]
    #: record -> why the stored part of its output is unknown
    missing: dict[int, str] = field(default_factory=dict)
    #: the finish runs claimed, ``(event, first page)`` -> the first record that claimed it
    taken: dict[tuple[int, int], int] = field(default_factory=dict)
    #: the runs the records claimed: ``(event, first page, pages, the record's rank)``
    claims: list[tuple[int, int, int, int]] = field(default_factory=list)
    #: the page keys of the hashed prompts past their cached prefix (``unrecorded.page_key``)
    hashed: list[int] = field(default_factory=list)
    #: a prompt's last page key -> the pages its finish may store, where none was found
    no_finish: dict[int, int] = field(default_factory=dict)
    #: ``(prefill store's publish, prefill delay)`` of each record whose run was found
    delays: list[tuple[int, int]] = field(default_factory=list)
    #: ``(record, the block its cached prefix ends in, its finish, rank)``: was that prefix
    #: stored before the capture (``precached``: no store of it published before the
    #: record finished -- its prefill found it, its store's publish may lag that a little)
    pre_cands: list[tuple[int, int, int, int]] = field(default_factory=list)
    #: records no store of whose outputs the capture holds (``FINISH_UNSEEN_KEY``)
    unseen_finish: set[int] = field(default_factory=set)
    #: ``claims[a:b]`` of each retracted record: every store of those pages is its own
    retracted: list[tuple[int, int]] = field(default_factory=list)
    #: the least and the most of the records' mean times per output token (ns; 0: none)
    min_token: int = 0
    max_token: int = 0
    #: the longest a record's chunk store came after its previous chunk's (ns)
    chunk_gap: int = 0
    #: outputs read from the events, of them in a tail-merged event; finish runs another
    #: record claimed first (met on the way / taken as the result)
    via_events: int = 0
    in_merged: int = 0
    ties: int = 0
    shared: int = 0


def match_stores(  # noqa: C901 - one pass, its per-record steps inline (see below)
    records: Sequence[Any],
    index: StoreIndex,
    times: Sequence[tuple[int | None, int | None]],
    n_outs: Sequence[int],
    lens: Sequence[int],
    nodes: Sequence[Node],
    order: Sequence[int],
) -> StorePass:
    """The pass over ``records`` in ``order`` (finish order, then those without a finish):
    ``times`` (receive, finish), ``n_outs`` (output lengths) and ``lens`` (prompt lengths)
    are per record; each record's ``nodes`` entry gets its anchors (see module). The
    per-record steps are inline, the pass's state in locals: split into a function per step
    (a row object, three calls a record) the whole inference measured 0-7 % slower in
    alternated runs on the 2-core box (2026-12-07; within its noise at best)."""
    ps = index.page_size
    sp = StorePass([None] * len(records))
    known, missing, taken, claims = sp.known, sp.missing, sp.taken, sp.claims
    hashed, no_finish, delays, pre_cands = sp.hashed, sp.no_finish, sp.delays, sp.pre_cands
    unseen_finish, retracted = sp.unseen_finish, sp.retracted
    min_token = max_token = chunk_gap = 0
    via_events = in_merged = ties = shared = 0
    # every request's search windows in one vectorised pass (those with both times)
    timed = [(i, a, f) for i, (a, f) in enumerate(times) if a is not None and f is not None]
    wins: list[Window | None] = [None] * len(records)
    found = index.windows([x[1] for x in timed], [x[2] for x in timed])
    for x, w in zip(timed, found, strict=True):
        wins[x[0]] = w
    ts = index._ts  # every event's publish time (on the records' clock already)
    multi_rank = bool(index.frame_rank)
    for i in order:
        r = records[i]
        was_retracted = is_retracted(r)
        c0 = len(claims)
        arr, fin = times[i]
        rk = served_rank(r) if multi_rank else 0
        rank = rk if multi_rank else None  # a multi-rank capture: its rank's stores
        node = nodes[i]
        # the prompt's tokens are read by ``span``: only the runs looked at
        prompt = r.input_ids
        n = n_outs[i]
        L = lens[i]
        P = L // ps
        if not L:
            known[i] = None if r.output_ids else []
            if not r.output_ids:
                missing[i] = WHY_NO_IDS
            continue
        # --- the prefill store
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
        # --- the finish store below ``h``, and so the stored outputs
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
        else:
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
                    node.out_run = (got[3][0], got[3][1], len(got[0]) // ps)
            elif h is not None:
                key = page_key(h, rk)
                no_finish[key] = max(Kq, no_finish.get(key, 0))
            if r.output_ids:
                known[i] = None
                if got is not None and len(got[0]) in (K * ps, Kq * ps):
                    node.end_anchor = got[1]
            elif got is None:
                known[i] = []
                stored_prompt = fast is not None or (r.cached_tokens or 0) >= P * ps
                missing[i] = WHY_NO_FINISH if stored_prompt else WHY_NO_PROMPT
                if fin is not None and arr is not None and Kq > 0:
                    unseen_finish.add(i)
            else:
                toks, last, was_merged = got[:3]
                known[i] = toks[L - P * ps :] if L > P * ps else toks  # a fresh slice already
                via_events += 1
                in_merged += was_merged
                if len(toks) in (K * ps, Kq * ps):
                    node.end_anchor = last
                else:
                    missing[i] = WHY_NO_FINISH
        if was_retracted:
            retracted.append((c0, len(claims)))
    sp.min_token, sp.max_token, sp.chunk_gap = min_token, max_token, chunk_gap
    sp.via_events, sp.in_merged, sp.ties, sp.shared = via_events, in_merged, ties, shared
    return sp
