"""Requests a production capture's records lack, rebuilt from its KV events.

What this file owns: ``rebuild`` (``claimed_mask``, ``find_unrecorded``); the rebuilt
requests' records and their rows in the inference are ``rebuiltrows``'. SGLang 0.5.23's
``--export-metrics-to-file`` writes a request when it finishes; a request whose client hung
up (a closed stream: SGLang aborts it) is not written, yet it ran: its prefill stored its
pages, it held the pool while it decoded, and its pages stayed in the tree (measured on a
real worker, corpus ``p16-http-clients-cancel``: 93 of 305 requests aborted by clients that
hung up after 1-4 streamed tokens, none in the metrics file, their prefills in the event
stream). Replaying the records alone leaves those stores, their evictions and the cache hits
they gave out of the replay.

Every stored page that no record claimed (``storepass.match_stores`` marks the runs it matched
to a record's prefill or finish, and the page hashes of prompts it hashed past their
recorded cached prefix -- a cached page is another request's store, maybe an aborted one's;
a store of a run's pages published after the run is a re-store, one published before it is
another request's -- an aborted turn whose pages the next turn stored again --, except a
retracted record's, every store of whose pages is its own: ``claimed_mask``)
is looked at in publish order, runs of consecutive unclaimed pages of one event at a time:

* a run below the last page of a rebuilt request, published later, is that request's finish
  store: its tokens become the request's outputs (all but the last output token is
  inserted, so ``pages * page_size + 1`` outputs) and its publish time its finish -- unless
  it came sooner than that many outputs take to decode (at least ``tokens - page_size + 1``
  decode passes, each at least half the records' least time per output token), or later
  than all it holds and the fewer than a page decoded past it take, and its publish after
  them, at twice the records' greatest mean time per output token (``tokens + page_size -
  1`` passes, and ``--decode-log-interval`` more: a store made in a decode pass is published
  at the next prefill result or the interval-th decode pass -- an aborted 14351-token
  prompt's 2-page finish store came 4.1 s after its prefill store, nothing published in
  between, on corpus ``p4-nooverlap-chunk4096-longout-ctx16k-http-clients-cancel``; then it
  is another request's prefill; corpus ``p64-http-clients-cancel``, a page 20 s after an
  aborted system prompt's store). When too soon, below
  a run of half the worker's chunk or more, it is the next chunk of the request's prompt
  (chunked prefill stores a long prompt chunk by chunk, each chunk's store below the one
  before; measured on corpus ``p16-chunk512-longprompt-http-clients-cancel``, where an
  aborted 2558-token prompt's five chunk stores were rebuilt as two phantom requests with
  513 outputs each); below a shorter one it is another request's prefill (the next turn
  of an aborted one: corpus ``p32-tight-longprompt-http-clients-cancel``, a 3105-token
  turn aborted after 11 tokens and the next, 3269 tokens, 235 ms later). Below a whole chunk
  (a run of the chunk's pages) it is the next chunk also when it came no later than the
  longest gap between a record's chunk stores (a prompt's last chunk of one page is as
  fast as a one-page finish store: corpus ``dp2-p16-tight-long-http-clients-cancel``);
* a run below a page of another request's store, not its last (a branch off it), where
  that store's pages above it begin right below the last prompt page of a rebuilt request with no finish store yet, is
  that request's finish store, those pages and the run its outputs (same time bounds): its
  client's next turn prefilled first, storing the aborted prompt's tail and the outputs the
  client read, and the abort inserted only what it decoded past them (corpus
  ``p4-tight40k-nooverlap-chunk4096-longout-ctx16k-http-clients-cancel``: a turn aborted
  after 8 streamed tokens, its next turn's prefill 3.1 s later, its one-page finish store
  1.3 s after that; read as a request of its own, it left the next turn without its
  predecessor, and the replay merged three chained stores into one event);
* a run below a record's prompt whose finish store was not found is left alone (most
  likely that finish store);
* any other run is a request's prefill: its prompt is the run's tokens after the tokens of
  its parent chain, read back page by page through the stored events to the root (a chain
  that leaves the capture -- stored before it started -- takes the tokens above it from a
  record whose cached prefix holds the page it left at, those tokens pre-loaded as the
  records' older prefixes are: ``precached.OlderPages``; where no record's does, the run is
  not rebuilt, only counted); it
  arrived the prefill delay (receive -> publish of the prefill store) of the records
  prefilled around it (the median of the ``LOCAL_DELAY`` before and after it: a queue
  comes and goes -- on ``p4-tight-long-http-clients-cancel`` the delay grows from 30 ms to
  8 s, and the capture-wide median, 4.7 s, received its first aborted request before the
  first request of the capture) before the run was published, but not before the finish
  of the request whose outputs it extends (its parent page first stored in a record's finish store, or a rebuilt one's: a client
  sends the next turn after the answer; under a queue the median delay put such turns
  before their predecessor's finish, so they ran open loop), nor before the prefill of a
  rebuilt request whose prompt it extends; without a finish store it
  runs one output token. The tokens of its prompt's partial last page and of its outputs
  were never stored: unknown, left out.

``production`` then treats the rebuilt requests as records in the session inference (a
cancelled chat turn is its chat's turn). In a multi-rank capture a page is the rank's that
published it: a record claims the pages its runs hold on the rank that served it (its
prefill is found by content, possibly in another rank's store of the same pages), and a
rebuilt request runs on the rank that published its prefill (``dp_rank``). Rebuilt records
have ``source = "kv-events"``; the sim bundle keeps the source, and the report counts only
the capture's own requests per request.
"""

from __future__ import annotations

from array import array
from bisect import bisect_left
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, cast

import numpy as np

from kvcadence.format.hashes import block_hashes
from kvcadence.replay.chains import Chains
from kvcadence.replay.sieve import matches
from kvcadence.replay.tokens import CODE, Prompt, PromptIndex


@dataclass(slots=True)
class Unrecorded:
    """One rebuilt request: its prompt (whole pages), outputs, receive and finish times."""

    prompt: Prompt  # prefix-shared with the rebuilt prompts before it (``tokens.Prompt``)
    outputs: array
    arrival_ns: int
    prefill_ns: int
    finish_ns: int | None
    last: int  # hash of the prompt's last page
    rank: int = 0  # the DP rank that published its prefill
    end: int | None = None  # hash of the finish store's last page
    run: int = 0  # tokens of its prompt's latest run (a chunk, if it was chunked)
    out_pages: list[int] | None = None  # its finish store's page hashes
    salt: str | None = None  # its prefill store's ``cache_salt`` (its namespace's salt)
    #: tokens of its prompt its rank held before the capture (``Chains.prefix``: the part
    #: above the capture's stores, from a record's cached prefix, and in a DP capture the
    #: pages up to the last its rank never stored), pre-loaded by the replay
    precached: int = 0

    def take_finish(self, outputs: array, t: int, end: int, pages: list[int]) -> None:
        """Its finish store, published at ``t``: the stored ``outputs`` (the last output's
        KV was never inserted: its last token stands in for it), the store's last page
        ``end`` and page hashes ``pages``."""
        outputs.append(outputs[-1])
        self.outputs = outputs
        self.finish_ns = t
        self.end = end
        self.out_pages = pages


@dataclass(slots=True)
class Found:
    """``find_unrecorded``'s result: the requests and what was left alone."""

    requests: list[Unrecorded] = field(default_factory=list)
    #: unclaimed runs below a record's prompt whose finish store was not found
    below_records: int = 0
    #: rebuilt requests whose finish store chained below their next turn's prefill store
    #: (``_finish_below_next_turn``)
    below_next_turn: int = 0
    #: unclaimed runs whose parent chain leaves the capture (stored before it) at a page no
    #: record's cached prefix holds (not rebuilt)
    outside: int = 0
    #: rebuilt requests whose chain left the capture at a page a record's cached prefix
    #: holds (the part above it read from that record)
    older_prefix: int = 0
    #: whether the capture has several DP ranks (rebuilt records then say theirs)
    multi_rank: bool = False


#: a rebuilt request's prefill delay is the median of this many records' prefilled before
#: it and as many after (``LocalDelay``)
LOCAL_DELAY = 3


class LocalDelay:
    """The records' prefill delays by prefill time: ``at(t)`` is the median delay of the
    ``LOCAL_DELAY`` records prefilled last before ``t`` and as many first after it (0 when
    there is none). All DP ranks' together: per rank (each its own queue) held 600 bars of
    the corpus against 602 (2026-12-04)."""

    def __init__(self, pairs: Sequence[tuple[int, int]]) -> None:
        got = sorted(pairs)
        self.ts = [t for t, _ in got]
        self.delays = [d for _, d in got]

    def at(self, t: int) -> int:
        """The prefill delay of a request prefilled at ``t`` (ns)."""
        i = bisect_left(self.ts, t)
        near = sorted(self.delays[max(0, i - LOCAL_DELAY) : i + LOCAL_DELAY])
        return near[len(near) // 2] if near else 0


#: a page's key in a multi-rank capture: its hash moved by its rank (int64 wrap-around); a
#: rank-0 page's key is its hash
_RANK_STRIDE = 0x5BD1E9955BD1E995


def page_key(h: int, rank: int) -> int:
    """The key of a page of hash ``h`` published by DP rank ``rank`` (see ``_RANK_STRIDE``)."""
    if not rank:
        return h
    return (h + rank * _RANK_STRIDE + (1 << 63)) % (1 << 64) - (1 << 63)


def page_keys(index: Any) -> Any:
    """Every stored page's key (``page_key``, vectorised)."""
    ranks = np.fromiter(
        (index.rank_of(ei) for ei in range(len(index.offs))), np.int64, len(index.offs)
    )
    per_page = np.repeat(ranks, np.asarray(index.pages, dtype=np.int64))
    return index.hashes + per_page * np.int64(_RANK_STRIDE)  # int64 arrays wrap around


def claimed_mask(index: Any, runs: Sequence[tuple[int, int, int, int]], hashes: Any) -> Any:
    """Per stored page of ``index``: whether a record claimed it -- in ``runs`` ``(event,
    first page, pages, the record's rank)``; a later store of a page a run holds (a
    re-store after an eviction: the prefill of a request that shares the prefix, a record's
    where its run is found, else one its own run starts below); or a page with a hashed
    prompt's hash (``hashes``, as ``page_key``s: no position known, any store of it). A store
    of a claimed page published *before* the run that holds it is not claimed: the run was
    found as the first store of those pages after the record's receive, so the earlier one
    is another request's -- a client-aborted turn whose pages were evicted and stored again
    by the chat's next turn (corpus ``p8-longout1500-http-clients-cancel``: 4 of its 9
    aborted requests were left out so). On several DP ranks the same hash on the record's
    rank: its prefill is found by content, possibly in another rank's store of the same
    pages, and a page is the rank's that stored it (a store on the record's rank is claimed
    from the run's publish on)."""
    h = index.hashes
    offs, pages = index.offs, index.pages
    if index.frame_rank:
        keys = page_keys(index)
        hashed = np.isin(keys, np.asarray(hashes, dtype=np.int64))
        parts, at = [], []
        for ei, j, n, rk in runs:
            a = offs[ei] + j
            part = h[a : a + min(n, pages[ei] - j)]
            parts.append(part + np.int64(page_key(0, rk)) if rk else part)  # no scalar overflow
            at.append(np.arange(a, a + len(part), dtype=np.int64))
        if not parts:
            return hashed
        return hashed | _restored(keys, np.concatenate(parts), np.concatenate(at))
    mask = np.zeros(len(h), dtype=bool)
    for ei, j, n, _ in runs:
        a = offs[ei] + j
        mask[a : a + min(n, pages[ei] - j)] = True
    free = np.flatnonzero(~mask)
    if not len(free):  # every store is a record's (the usual capture)
        return mask
    # a free hash stored at a claimed page too (``matches``), and published after it
    fh = h[free]
    cand = matches(h, fh)
    held = cand[mask[cand]]
    again = _restored(fh, h[held], held, free) if len(held) else np.zeros(len(free), bool)
    mask[free[again | np.isin(fh, np.asarray(hashes, dtype=np.int64))]] = True
    return mask


def _restored(keys: Any, claimed: Any, at: Any, pos: Any = None) -> Any:
    """Per key of ``keys`` (at positions ``pos``; default ``0 .. len - 1``): whether it is
    one of ``claimed`` (keys claimed at positions ``at``) and not before the first position
    that claimed it."""
    if pos is None:
        pos = np.arange(len(keys), dtype=np.int64)
    if not len(claimed):
        return np.zeros(len(keys), dtype=bool)
    order = np.lexsort((at, claimed))
    uniq, first = np.unique(claimed[order], return_index=True)
    first_at = at[order][first]
    k = np.searchsorted(uniq, keys)
    k[k == len(uniq)] = 0
    return (uniq[k] == keys) & (pos >= first_at[k])


def _runs(index: Any, free: Any) -> list[tuple[int, int, int]]:
    """``(event, first page, pages)`` of every maximal run of ``free`` pages inside one
    event, in event (publish) order."""
    out: list[tuple[int, int, int]] = []
    pos = np.flatnonzero(free)
    if not len(pos):
        return out
    offs = np.asarray(index.offs, dtype=np.int64)
    ev = np.searchsorted(offs, pos, side="right") - 1
    # a new run where the position jumps or the event changes
    brk = np.ones(len(pos), dtype=bool)
    brk[1:] = (np.diff(pos) != 1) | (np.diff(ev) != 0)
    starts = np.flatnonzero(brk)
    ends = np.append(starts[1:], len(pos))
    for s, e in zip(starts.tolist(), ends.tolist(), strict=True):
        ei = int(ev[s])
        out.append((ei, int(pos[s] - offs[ei]), e - s))
    return out


def find_unrecorded(
    index: Any,
    free: Any,
    record_anchors: dict[int, int],
    prefill_delay: LocalDelay,
    max_pages: int,
    min_token_ns: int = 0,
    chunk_tokens: int | None = None,
    finish_at: dict[int, int] | None = None,
    chunk_gap_ns: int = 0,
    max_token_ns: int = 0,
    older: Callable[[int], array | None] | None = None,
) -> Found:
    """The requests behind the unclaimed pages ``free`` (``claimed_mask``'s negation) of
    ``index`` (see module doc). ``record_anchors``: the last prompt pages (keys) of records
    whose finish store was not found -> the pages that finish may store; ``prefill_delay``:
    the records' prefill delays by time (``LocalDelay``); ``max_pages``: the longest prompt
    rebuilt, in pages; ``min_token_ns``: a lower bound of one output token's decode time (0: none known);
    ``chunk_tokens``: the worker's chunked-prefill size (None: chunking off);
    ``finish_at``: the events holding the records' finish stores -> the earliest of those
    records' finish times (a rebuilt request whose prompt extends a page first stored in
    one arrived after that finish; the rebuilt requests' finish stores join it, at their
    publish); ``chunk_gap_ns``: the longest a record's chunk store came after its previous
    chunk's (a run below a whole chunk within it is the next chunk); ``max_token_ns``: an
    upper bound of one output token's decode time (0: none known): a run published later
    after a rebuilt prompt's last store than all it may hold and the outputs decoded past
    it (``len + page - 1``) take at that pace is not its finish store. ``older``: the tokens
    from the root through a page stored before the capture (None: not known), where a run's
    chain leaves the capture's stores (``precached.OlderPages``)."""
    finish_at = {} if finish_at is None else dict(finish_at)
    found = Found(multi_rank=bool(index.frame_rank))
    # a finish store is made in a decode pass and published at the next publish point: up
    # to ``decode_log_interval`` decode passes later when no prefill result comes first
    lag = index.decode_log_interval
    ps = index.page_size

    def pace(gap: int, n_tok: int) -> tuple[bool, bool]:
        """(too soon, too late) for a finish store of ``n_tok`` tokens ``gap`` after the
        prefill store: it holds at most the prompt's partial page (< ps tokens) and all but
        the last output -- ``n_tok - ps + 1`` decode passes at least --, and went out at the
        next publish point, up to ``lag`` decode passes after the last of at most
        ``n_tok + ps - 1``."""
        soon = gap < (n_tok - ps + 1) * min_token_ns
        return soon, bool(max_token_ns) and gap > (n_tok + ps - 1 + lag) * max_token_ns

    def run_pages(ei: int, j: int, n: int) -> list[int]:
        """The hashes of event ``ei``'s pages ``j .. j + n``."""
        return hashes[offs[ei] + j : offs[ei] + j + n].tolist()

    by_last: dict[int, Unrecorded] = {}  # a rebuilt request's last prompt page (key) -> it
    chains = Chains(index, older)
    prompts = PromptIndex()  # each rebuilt prompt shares its prefix with the ones before
    hashes, offs = index.hashes, index.offs
    for ei, j, n in _runs(index, free):
        parent = index.parents[ei] if j == 0 else int(hashes[offs[ei] + j - 1])
        toks = index.tokens.span(ei, j * ps, (j + n) * ps)
        last = int(hashes[offs[ei] + j + n - 1])
        t = index.ts_of(ei)
        rank = index.rank_of(ei)
        pkey = None if parent is None else page_key(parent, rank)
        req = by_last.get(pkey) if pkey is not None else None
        if req is not None and not len(req.outputs) and t >= req.prefill_ns:
            gap = t - req.prefill_ns
            full = chunk_tokens is not None and req.run >= chunk_tokens // ps * ps
            soon, late = pace(gap, len(toks))
            soon = soon or (full and gap <= chunk_gap_ns)
            if not soon and not late:
                req.take_finish(array(CODE, toks), t, last, run_pages(ei, j, n))
                by_last[page_key(last, rank)] = req  # (a store below it is another request's)
                finish_at.setdefault(ei, t)
                continue
            if soon and chunk_tokens and 2 * req.run >= chunk_tokens:
                # too soon for its outputs, or as soon as a record's chunks came below a
                # whole chunk, below a chunk-sized run: the prompt's next chunk
                grown = req.prompt.materialize()
                grown.extend(toks)
                req.prompt = prompts.add(grown)
                req.prefill_ns, req.last, req.run = t, last, len(toks)
                by_last.pop(cast("int", pkey))
                by_last[page_key(last, rank)] = req
                continue
            # neither: another request's prefill below it (a next turn after its abort)
        if req is None and parent is not None:
            above = _finish_below_next_turn(index, chains, by_last, parent, rank, t, toks)
            if above is not None:
                owner, held_toks, held_pages = above
                soon, late = pace(t - owner.prefill_ns, len(held_toks) + len(toks))
                if not soon and not late:
                    outs = array(CODE, held_toks)
                    outs.extend(toks)
                    owner.take_finish(outs, t, last, held_pages + run_pages(ei, j, n))
                    by_last[page_key(last, rank)] = owner
                    finish_at.setdefault(ei, t)
                    found.below_next_turn += 1
                    continue
        if pkey is not None and pkey in record_anchors:
            found.below_records += 1
            continue
        got = chains.prefix(parent, max_pages, rank if found.multi_rank else None)
        if got is None:
            found.outside += 1
            continue
        head, held, left = got
        if left and _in_finish_span(head, ps, index.salts.get(ei), rank, record_anchors):
            found.below_records += 1  # that record's finish store, its first pages cached
            continue
        found.older_prefix += left
        head.extend(toks)
        prompt = prompts.add(head)  # (the whole array is not kept)
        arrival = t - prefill_delay.at(t)
        first = chains.where(parent) if parent is not None else None
        if first is not None and first[0] in finish_at:
            # it extends another request's outputs: sent after that request finished
            arrival = min(max(arrival, finish_at[first[0]]), t)
        if req is not None:  # below a rebuilt prompt: sent after that request's prefill
            arrival = min(max(arrival, req.prefill_ns), t)
        req = Unrecorded(
            prompt,
            array(CODE),
            arrival,
            t,
            None,
            last,
            rank,
            run=len(toks),
            salt=index.salts.get(ei),
            precached=held,
        )
        found.requests.append(req)
        by_last[page_key(last, rank)] = req
    return found


def _finish_below_next_turn(
    index: Any,
    chains: Chains,
    by_last: dict[int, Unrecorded],
    parent: int,
    rank: int,
    t: int,
    toks: array,
) -> tuple[Unrecorded, array, list[int]] | None:
    """A run below a page of another request's store, not its last, whose pages above it,
    within that one store, begin right below the last prompt page of a rebuilt request with
    no finish store yet, prefilled before ``t``: ``(that request, the tokens of those pages,
    their hashes)``
    -- its finish store, below the pages its client's next turn stored first (the next
    prompt holds the aborted prompt's tail and the outputs the client read; the aborted
    request decoded a little more before its abort, and its finish inserted only the pages
    past the shared ones). None otherwise."""
    got = chains.where(parent)
    if got is None or not len(toks):
        return None
    ei, j = got
    if j + 1 >= index.pages[ei]:
        # below the store's last page: a continuation of that store's prompt (its finish
        # store, its next turn -- corpus ``p64-http-clients-cancel``), not a branch off it
        return None
    ps, hashes, offs = index.page_size, index.hashes, index.offs
    for k in range(j, -1, -1):  # the pages k .. j of the store: below the page above k
        above = index.parents[ei] if k == 0 else int(hashes[offs[ei] + k - 1])
        if above is None:
            return None
        owner = by_last.get(page_key(above, rank))
        if owner is not None and not len(owner.outputs) and owner.prefill_ns <= t:
            held = index.tokens.span(ei, k * ps, (j + 1) * ps)
            return owner, held, hashes[offs[ei] + k : offs[ei] + j + 1].tolist()
    return None


def _in_finish_span(
    head: array, ps: int, salt: str | None, rank: int, anchors: dict[int, int]
) -> bool:
    """Whether a run below ``head`` (the tokens through its parent, in part a record's
    cached prefix) starts within the pages a finish whose store was not found may store
    (``anchors``: its prompt's last page key -> those pages): that finish's store, below
    output pages cached already (the same prompt and greedy answer stored before the
    capture), not a request. Asked only where the chain left the capture."""
    path = block_hashes(head, ps, salt) if anchors else []
    # the run's first page is page ``len(path)``: within the span of an anchor above it?
    return any(len(path) <= k + anchors.get(page_key(h, rank), 0) for k, h in enumerate(path))


def rebuild(
    index: Any,
    claims: list[tuple[int, int, int, int]],
    hashed: list[int],
    no_finish: dict[int, int],
    delays: list[tuple[int, int]],
    lens: list[int],
    min_token_ns: int = 0,
    finish_at: dict[int, int] | None = None,
    chunk_gap_ns: int = 0,
    max_token_ns: int = 0,
    older: Callable[[int], array | None] | None = None,
) -> Found:
    """The requests behind the stores no record claimed: ``claims`` ``(event, first page,
    pages, the record's rank)`` and ``hashed`` (page keys, ``page_key``) as ``claimed_mask``
    takes them, ``no_finish`` the page keys of records' prompts whose finish store was not
    found (-> the pages that finish may store), ``delays`` the records' ``(prefill store's
    publish, prefill delay)`` (``LocalDelay``: the rebuilt requests' delays), ``lens`` their
    prompt lengths (a walk's bound), ``min_token_ns`` the least of their mean times per
    output token (half of it is ``find_unrecorded``'s bound of one output's decode: a run
    published sooner than that many outputs take after a rebuilt prompt's last store is not
    its finish store; 0: none known), ``finish_at`` the events of the records' finish stores
    and those records' earliest finish, ``chunk_gap_ns`` the longest gap between a record's
    chunk stores, ``max_token_ns`` the most of their mean times per output token (twice it
    is ``find_unrecorded``'s bound of one output's decode: a run published later than that
    many outputs take is not the finish store; 0: none known), ``older``
    ``find_unrecorded``'s."""
    free = ~claimed_mask(index, claims, hashed)
    if not free.any():
        return Found()
    max_pages = 2 * (max(lens, default=0) // index.page_size) + 1
    return find_unrecorded(
        index,
        free,
        no_finish,
        LocalDelay(delays),
        max_pages,
        min_token_ns // 2,
        index.chunk_tokens,
        finish_at,
        chunk_gap_ns,
        2 * max_token_ns,
        older,
    )
