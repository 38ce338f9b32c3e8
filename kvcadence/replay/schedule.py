"""Request schedule reconstruction: what the simulated clients send, and when.

What this file owns: turning a bundle's ``RequestRecord``s into ``RequestSpec``s — the same
prompt token ids and output lengths, plus how each request is released. The records are read
once, as a stream, and each one's token ids are made compact as it is read
(``replay.tokens``: the prompt a prefix-shared ``Prompt``, the outputs an array; the spec's
``source`` is the record with these in place of its lists), so a schedule holds the unique
tokens of its prompts, never a list of ints per token:

* **closed loop** (``lane`` known): requests of one lane are sent one after the other; the
  first at its recorded arrival, each next one ``gap_ns`` after its predecessor *finishes in
  the simulation* (the scheduler may rescale it, ``SimConfig.scale_client_gaps``).
  ``gap_ns`` is the recorded server-side gap (next receive − previous finish: client round
  trip + think time), else the client-side gap (``send_ns`` − previous ``finish_ns``), else
  ``think_ns``, else the configured default;
* **open loop** (no lane): the recorded arrival time.

Server-side times come first: receive = ``arrival_ns``, else ``request_received_ts``, else
``response_sent_to_client_ts − e2e_latency`` (SGLang's e2e latency runs from the tokenizer
manager's receive; captures without per-phase timings still carry both), else ``send_ns``;
finish = ``request_finished_ts``, else ``response_sent_to_client_ts``, else ``finish_ns``.
The server's receive order can differ from the client's send order. ``e2e_ns`` = recorded
finish − receive (for the gap scaling).

For PD disaggregation each spec also carries the recorded prefill-result → finish time:
``transfer_ns`` when the record is a prefill worker's (one output token: its finish is the
end of the KV transfer), else ``decode_ns`` (decode time, which ``--role prefill`` adds to
the client gap because the decode runs elsewhere).

``ignore_eos`` (which decides SGLang's decode reservation: all of a request's remaining
output, or ``new_token_ratio`` of it) is the one sent where the record keeps its sampling
parameters (``meta_info["request_parameters"]["sampling_params"]``: the metrics import, the
driver); else inferred: on unless the request stopped short of ``max_new_tokens`` for another
reason than its length. A request sent without ``ignore_eos`` that ran to its length is not
told apart by the inference, so only the sent value gives it the ratio reservation.

Times are virtual ns relative to ``anchor_ns`` (the earliest recorded arrival). Output token
ids are the recorded ones; when absent they are recovered from the next turn's prompt when it
extends this one, else synthesised deterministically (hashes of such outputs cannot match
the real ones). Flushes recorded in the capture become ``flush_times``.
"""

from __future__ import annotations

import hashlib
import struct
from array import array
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import msgspec
import numpy as np

from kvcadence.errors import InputError
from kvcadence.format.bounds import MAX_REQUEST_TOKENS
from kvcadence.format.namespace import Namespace, namespace_of
from kvcadence.format.schema import MAX_SECONDS, meta_duration, meta_ns, meta_seconds
from kvcadence.replay.tokens import Prompt, PromptIndex, compact

#: ``meta_info`` key of a completed production record whose outputs no store of the capture
#: holds (``replay.production``): the worker published none at its finish, so the replay
#: inserts them with no event
FINISH_UNSEEN_KEY = "kvcadence_finish_unseen"
#: ``meta_info`` key of a completed production record that is one of the samples of a
#: parallel request (``n > 1``) but not its prefill-only request's first successor: that
#: request's ``[session, turn]``. SGLang's tokenizer manager sends the samples only once
#: the prefill-only request has finished (``_handle_batch_request`` awaits its response),
#: so each sample is released its recorded gap after that request's simulated finish, as
#: a lane's next turn is, not at its own recorded receive
AFTER_KEY = "kvcadence_after"


@dataclass(slots=True)
class RequestSpec:
    """One request to simulate."""

    idx: int
    rid: str
    #: the prompt, prefix-shared with earlier prompts (``replay.tokens``)
    input_ids: Prompt
    #: the output ids (recorded, recovered or synthesised), or empty until filled
    output_ids: array
    max_new_tokens: int
    lane: int | None = None
    session: int | None = None
    turn: int | None = None
    arrival_ns: int | None = None  # open loop / first of a lane (virtual)
    pred: int | None = None  # closed loop: index of the predecessor on the lane
    gap_ns: int = 0  # closed loop: finish(pred) -> arrival
    ignore_eos: bool = True
    real_cached_tokens: int | None = None
    meta: dict[str, Any] = field(default_factory=dict)
    source: Any = None  # the RequestRecord this spec came from
    #: PD prefill worker capture: recorded KV transfer time (prefill done -> released)
    transfer_ns: int | None = None
    #: recorded time from prefill result to finish (decode elsewhere, for --role prefill)
    decode_ns: int = 0
    #: recorded server-side latency (receive -> finish), when known
    e2e_ns: int | None = None
    #: the capture holds no store of its outputs (``production``'s ``FINISH_UNSEEN_KEY``):
    #: its finish inserts them with no event (``Scheduler._finish``)
    finish_unseen: bool = False
    #: the routing key it was sent with (``routing-key`` scheduling), where its record kept it
    routing_key: str | None = None
    #: the most of its prompt the cache may give it: the position its input logprobs start
    #: at, where it asked for them (``_logprob_cap``; None: its length less one, as any)
    logprob_cap: int | None = None
    #: its recorded first forward (``forward_entry_time``, s), where its record has it: the
    #: order a ``random`` worker's draws admitted the requests in
    recorded_entry_s: float | None = None
    #: its cache namespace (``format.namespace``: extra key, cache salt; None: the default)
    namespace: Namespace | None = None
    #: the ``priority`` it was sent with (priority scheduling), where its record kept it
    priority: int | None = None

    @property
    def n_out(self) -> int:
        return len(self.output_ids)


@dataclass(slots=True)
class Schedule:
    """The reconstructed workload."""

    requests: list[RequestSpec]
    anchor_ns: int
    flush_times_ns: list[int] = field(default_factory=list)
    closed_loop: bool = True


def _sent(mi: dict[str, Any], key: str) -> Any:
    """``key`` of the request as it was sent, where the record kept it (SGLang's metrics
    line: ``request_parameters``); ``None`` where it did not."""
    params = mi.get("request_parameters")
    return params.get(key) if isinstance(params, dict) else None


def _sent_ignore_eos(mi: dict[str, Any]) -> bool | None:
    """The ``ignore_eos`` the request was sent with, where the record kept it."""
    sp = _sent(mi, "sampling_params")
    v = sp.get("ignore_eos") if isinstance(sp, dict) else None
    return v if isinstance(v, bool) else None


def _priority(mi: dict[str, Any]) -> int | None:
    """The ``priority`` the request was sent with (or the worker's
    ``--default-priority-value``, which its tokenizer sets before the metrics line is
    written), where the record kept it."""
    v = _sent(mi, "priority")
    return v if type(v) is int else None


#: a request sent with ``"max_new_tokens": null``: unbounded, capped when it is received
#: (``Scheduler._init_max_new``: by the context and the pool)
UNBOUNDED_MAX_NEW = 1 << 30
#: the limit of a request whose ``sampling_params`` leave ``max_new_tokens`` out (0.5.23
#: ``SamplingParams``' default)
DEFAULT_MAX_NEW = 128


def _unsent_max_new(mi: dict[str, Any], n_out: int) -> int:
    """The output limit of a record without ``max_new_tokens``, from what SGLang's line
    kept of the request: ``"max_new_tokens": null`` sent -- what the OpenAI layer forwards
    for a client that sets no ``max_tokens`` -- is unbounded (``UNBOUNDED_MAX_NEW``: capped
    by the worker when received); left out of ``sampling_params``, SGLang's default
    (``DEFAULT_MAX_NEW``); else its output length (a record that does not say)."""
    sp = _sent(mi, "sampling_params")
    if not isinstance(sp, dict):
        return n_out
    if "max_new_tokens" in sp and sp["max_new_tokens"] is None:
        return UNBOUNDED_MAX_NEW
    return DEFAULT_MAX_NEW if "max_new_tokens" not in sp else n_out


def _logprob_cap(mi: dict[str, Any]) -> int | None:
    """The prompt position a request's input logprobs start at, where it asked for them
    (``return_logprob`` with a ``logprob_start_len`` >= 0 sent: the native ``/generate``
    API, or ``/v1/completions`` with ``echo`` and ``logprobs``, which sends 0): SGLang
    0.5.23 matches no more of its prompt in the cache than that
    (``Req._compute_max_prefix_len``: the prefix it reuses has no logprobs to return).
    None: no such cap (no logprobs asked for, or only the outputs')."""
    if _sent(mi, "return_logprob") is not True:
        return None
    v = _sent(mi, "logprob_start_len")
    return v if type(v) is int and v >= 0 else None


def _routing_key(mi: dict[str, Any]) -> str | None:
    """The ``routing_key`` the request was sent with, where the record kept it."""
    v = _sent(mi, "routing_key")
    return v if isinstance(v, str) and v else None


def _received_ns(meta: dict[str, Any]) -> int | None:
    """Server-side receive time: ``request_received_ts``, else ``response_sent_to_client_ts −
    e2e_latency`` (SGLang's e2e latency runs from the tokenizer manager's receive)."""
    v = meta_ns(meta, "request_received_ts")
    if v is not None:
        return v
    sent, e2e = meta_seconds(meta, "response_sent_to_client_ts"), meta_duration(meta, "e2e_latency")
    if sent is not None and e2e is not None:
        return int(round((sent - e2e) * 1e9))
    return None


def _length_limit(r: Any, mi: dict[str, Any]) -> int | None:
    """The output limit a request that finished by length ran to, when its record states
    it (SGLang's ``finish_reason`` ``{"type": "length", "length": k}``) and it is below the
    ``max_new_tokens`` asked for: the prefill-only request SGLang sends first for ``n > 1``
    parallel samples (0: it caches the prompt, its record keeps the request's sampling
    parameters), or a limit clipped to the context length. A request replayed past the limit
    would look like an EOS stop the scheduler cannot see ahead (``SimReq.stops_unseen``): one
    decode pass more, and its finish inserting that output's KV too."""
    fr = mi.get("finish_reason")
    if r.finish_reason != "length" or not isinstance(fr, dict):
        return None
    k = fr.get("length")
    if type(k) is not int or k < 0 or (r.max_new_tokens is not None and k >= r.max_new_tokens):
        return None
    return k


def _arrival(rec: Any) -> int | None:
    """Arrival: the record's ``arrival_ns``, else the server-side receive, else ``send_ns``."""
    if rec.arrival_ns is not None:
        return int(rec.arrival_ns)
    mi = rec.meta_info or {}
    v = mi.get("request_received_ts")
    if type(v) is float and 0 < v < MAX_SECONDS:  # the usual case (``_mi_ns``), without its calls
        return round(v * 1e9)
    v = _received_ns(mi)
    if v is not None:
        return v
    return None if rec.send_ns is None else int(rec.send_ns)


def output_length(rec: Any) -> int | None:
    """A record's output length as a replay reads it: ``completion_tokens`` (what the worker
    decoded), else its recorded output ids, else ``max_new_tokens``; None when none says.
    More than a request can hold (``format.bounds.MAX_REQUEST_TOKENS`` token ids) is an
    ``InputError`` naming the request: no worker decodes that many for one request, and a
    replay would make them (the inference one synthetic id each: ``completion_tokens`` of
    10**9 in one metrics line took every byte of memory)."""
    n = rec.completion_tokens
    if n is None:
        n = len(rec.output_ids) if rec.output_ids else rec.max_new_tokens
    if n is not None and n > MAX_REQUEST_TOKENS:
        raise InputError(
            f"request {rec.rid!r}: {n} output tokens, more than a request can hold "
            f"({MAX_REQUEST_TOKENS:,} token ids); a damaged record?"
        )
    return n


def _why_no_ids(rec: Any) -> str:
    """Why a record has no prompt token ids, read from what SGLang's metrics line kept of the
    request (``meta_info.request_parameters``, its fields but ``input_ids``)."""
    params = (rec.meta_info or {}).get("request_parameters")
    if isinstance(params, dict) and params.get("text"):
        return (
            "a text prompt -- SGLang's metrics line holds the text, not the token ids (a string "
            "prompt sent to /generate or /v1/completions; /v1/chat/completions and requests "
            "sent with input_ids log the ids): give the worker's tokenizer, `replay --tokenizer "
            "DIR` (or `capture` / `capture import` with --tokenizer)"
        )
    if isinstance(params, dict) and rec.source == "sglang-metrics":
        return (
            "the metrics line holds neither input_ids nor text: the worker runs with "
            "--log-requests at --log-requests-level 0 or 1, which also drops both from "
            "--export-metrics-to-file; run it at level 2 or 3 (or without --log-requests)"
        )
    return "a text prompt? SGLang logs token ids for requests sent with input_ids"


def _finish(rec: Any, finished_ts_ns: int | None = None) -> int | None:
    """Server-side finish: ``request_finished_ts`` (``finished_ts_ns`` when the caller read it
    already), else ``response_sent_to_client_ts``, else the client's ``finish_ns``."""
    mi = rec.meta_info or {}
    if finished_ts_ns is None:
        v = mi.get("request_finished_ts")
        if (
            type(v) is float and 0 < v < MAX_SECONDS
        ):  # the usual case (``_mi_ns``), without its call
            return round(v * 1e9)
        finished_ts_ns = meta_ns(mi, "request_finished_ts")
    if finished_ts_ns is not None:
        return finished_ts_ns
    v = meta_ns(mi, "response_sent_to_client_ts")
    return v if v is not None else rec.finish_ns


def _synth_tokens(rid: str, n: int) -> list[int]:
    """``n`` made-up output ids for ``rid``: SHA-256 of ``rid/0``, ``rid/1``, ... read as
    little-endian uint16 values, each ``3 + v % 1021`` (deterministic, 16 ids a digest)."""
    if n <= 0:
        return []
    sha = hashlib.sha256
    if n <= 16:  # one digest (a production record's unstored tail): no numpy call
        d = sha(f"{rid}/0".encode()).digest()
        return [v % 1021 + 3 for v in struct.unpack_from(f"<{n}H", d)]
    digests = b"".join([sha(f"{rid}/{c}".encode()).digest() for c in range((n + 15) // 16)])
    ids = np.frombuffer(digests, "<u2")[:n] % 1021 + 3
    return ids.tolist()


def _stripped(r: Any, prompt: Prompt, outputs: array) -> Any:
    """``r`` with its token lists replaced by the compact forms (what ``RequestSpec.source``
    keeps: the record's times and counts without a list of ints per token)."""
    if isinstance(r, msgspec.Struct):
        return msgspec.structs.replace(r, input_ids=prompt, output_ids=outputs)
    return r  # a test's stand-in record: kept as it is


def build_schedule(  # noqa: C901 - one pass over the records, then the lanes and outputs
    records: Iterable[Any],
    *,
    default_gap_ns: int = 30_000_000,
    flush_abs_ns: Iterable[int] = (),
    anchor_ns: int | None = None,
) -> Schedule:
    """Build the schedule from ``RequestRecord``-like objects (see module docstring).

    ``records`` is read once, as a stream: each record's token ids become compact
    (``replay.tokens``: a prefix-shared ``Prompt``, an output array) as it is read, so no
    more than one record's lists are alive here at a time."""
    index = PromptIndex()
    # (arrival, rid, spec, server-side finish, output length) of every kept record
    rows: list[tuple[int, str, RequestSpec, int | None, int]] = []
    for r in records:
        if not (r.error is None or r.output_ids or r.completion_tokens):
            continue
        a = _arrival(r)
        if a is None:
            raise InputError(f"request {r.rid!r}: no arrival or send time recorded")
        if not r.input_ids:
            raise InputError(
                f"request {r.rid!r}: no input_ids recorded (cannot replay): {_why_no_ids(r)}"
            )
        n_out = output_length(r)
        if n_out is None:
            raise InputError(f"request {r.rid!r}: output length unknown")
        n_out = max(int(n_out), 1)
        mi = r.meta_info or {}
        max_new = r.max_new_tokens if r.max_new_tokens is not None else _unsent_max_new(mi, n_out)
        limit = _length_limit(r, mi)
        if limit is not None:  # the limit the worker applied, not the one asked for
            max_new = limit
        ignore_eos = _sent_ignore_eos(mi)
        if ignore_eos is None:
            ignore_eos = r.finish_reason in (None, "length") or n_out >= max_new
        prompt = index.add(r.input_ids, r.lane)
        rec_out = compact(r.output_ids)
        if len(rec_out) > n_out:
            outputs = rec_out[:n_out]
        else:
            outputs = rec_out if len(rec_out) == n_out else rec_out[:0]
        spec = RequestSpec(
            idx=0,
            rid=r.rid,
            input_ids=prompt,
            output_ids=outputs,
            max_new_tokens=max(int(max_new), n_out),
            lane=r.lane,
            session=r.session,
            turn=r.turn,
            ignore_eos=ignore_eos,
            real_cached_tokens=r.cached_tokens,
            source=_stripped(r, prompt, rec_out),
            routing_key=_routing_key(mi),
            logprob_cap=_logprob_cap(mi),
            recorded_entry_s=meta_seconds(mi, "forward_entry_time"),
            namespace=namespace_of(mi),
            priority=_priority(mi),
        )
        pf, fin = meta_ns(mi, "prefill_finished_time"), meta_ns(mi, "request_finished_ts")
        if pf is not None and fin is not None and fin >= pf:
            if n_out <= 1:
                # a prefill worker reports its request finished when the transfer is done
                spec.transfer_ns = fin - pf
            else:
                spec.decode_ns = fin - pf
        fin_ns = _finish(r, fin)
        if fin_ns is not None and fin_ns > a:
            spec.e2e_ns = fin_ns - a
        if mi.get(FINISH_UNSEEN_KEY) is True:
            spec.finish_unseen = True
        rows.append((a, r.rid, spec, fin_ns, n_out))
    if not rows:
        raise InputError("the bundle has no requests to replay")
    del index  # its lane arrays: only the prompts are kept
    anchor = min(row[0] for row in rows) if anchor_ns is None else anchor_ns
    rows.sort(key=lambda row: (row[0], row[1]))
    specs: list[RequestSpec] = []
    finishes: list[int | None] = []  # server-side finish of each spec
    arr: list[int] = []
    n_outs: list[int] = []
    by_lane: dict[int, list[int]] = {}
    for new_idx, (a, _rid, spec, fin_ns, n_out) in enumerate(rows):
        spec.idx = new_idx
        specs.append(spec)
        finishes.append(fin_ns)
        arr.append(a)
        n_outs.append(n_out)
        if spec.lane is not None:
            by_lane.setdefault(int(spec.lane), []).append(new_idx)
        else:
            spec.arrival_ns = a - anchor
    del rows
    # closed-loop dependencies
    for idxs in by_lane.values():
        first = idxs[0]
        specs[first].arrival_ns = arr[first] - anchor
        for prev, cur in zip(idxs, idxs[1:], strict=False):
            _follow(specs[cur], prev, arr[cur], finishes[prev], default_gap_ns)
    _after_prefill_only(specs, arr, finishes, default_gap_ns)
    _fill_outputs(specs, n_outs)
    flushes = sorted(max(0, int(f) - anchor) for f in flush_abs_ns)
    return Schedule(specs, anchor, flushes, closed_loop=bool(by_lane))


def _follow(
    spec: RequestSpec, prev: int, arrival: int, prev_finish: int | None, default_gap_ns: int
) -> None:
    """``spec`` released after request ``prev`` finishes: its recorded gap after that
    finish (``prev_finish``), else its record's ``think_ns``, else the default gap."""
    spec.pred = prev
    gap: int | None = None
    if prev_finish is not None:
        gap = arrival - prev_finish
    elif spec.source is not None and spec.source.think_ns is not None:
        gap = int(spec.source.think_ns)
    spec.gap_ns = max(0, gap) if gap is not None else default_gap_ns


def _after_prefill_only(
    specs: list[RequestSpec], arr: list[int], finishes: list[int | None], default_gap_ns: int
) -> None:
    """The samples a production record marks (``AFTER_KEY``) released after their parallel
    request's prefill-only request, where they open a lane (a lane's later request already
    follows its predecessor)."""
    marked = [
        (s, after)
        for s in specs
        if s.pred is None
        and s.source is not None
        and isinstance(after := (s.source.meta_info or {}).get(AFTER_KEY), list)
        and len(after) == 2
    ]
    if not marked:
        return
    by_turn = {(s.session, s.turn): s.idx for s in specs if s.session is not None}
    for s, (session, turn) in marked:
        prev = by_turn.get((session, turn))
        if prev is None or prev == s.idx or arr[prev] > arr[s.idx]:
            continue
        _follow(s, prev, arr[s.idx], finishes[prev], default_gap_ns)
        s.arrival_ns = None


def _fill_outputs(specs: list[RequestSpec], n_outs: list[int]) -> None:
    """Output ids of the specs without recorded ones: recovered from the lane's next prompt
    when it extends this one, else synthesised."""
    first_succ: dict[int, RequestSpec] = {}
    for t in specs:
        if t.pred is not None and t.pred not in first_succ:
            first_succ[t.pred] = t
    for s in specs:
        n_out = n_outs[s.idx]
        if len(s.output_ids) == n_out:
            continue
        recovered: array | None = None
        nxt = first_succ.get(s.idx)
        k = len(s.input_ids)
        if nxt is not None and len(nxt.input_ids) >= k + n_out:
            mine = s.input_ids.materialize()
            theirs = nxt.input_ids.materialize()
            if theirs[:k] == mine:
                recovered = theirs[k : k + n_out]
        s.output_ids = recovered if recovered is not None else compact(_synth_tokens(s.rid, n_out))
