"""``kvcadence admit``: how SGLang's PrefillAdder forms prefill batches, tick by tick.

Owns the admission benchmark around the one PrefillAdder model (``kvcadence.replay.admission``;
this file never re-implements it): the request model (L1 / L2 / extend per request), the fake
tree cache and fake allocator of the upstream benchmark's conventions (docs/admit.md), the scheduler-side tick loop (chunk continuation first, the 0.5.23 ``budget_state() ==
OTHER`` pre-check, max running requests, kvcadence's CP shared-KV limits), the between-tick
model (running requests keep their KV; ``--drain`` frees it) and the three output formats.

Conventions (kept identical in ``sglang_adder_driver.py`` so the real PrefillAdder can be driven
the same way):

* device pool = ``available_tokens`` free slots + every waiting request's own L1 prefix (one
  radix node per request, resident from the start, evictable until locked);
* L2 load-back: all or nothing; fails below ``load_back_threshold`` tokens or when free +
  evictable cannot cover the page-aligned size; otherwise evicts whole unlocked L1 nodes from the
  back of the queue until the free pool covers it, then consumes it from the free pool;
* an evicted L1 node is gone (its request recomputes those tokens: L1 becomes 0);
* after a tick the admitted requests' extend KV is allocated (``prepare_for_extend``:
  ``ceil(end/page) - ceil(prefix/page)`` pages); ``allocator_available_after_tick`` is read
  before that, i.e. after admission, when only load-backs have touched the allocator.

The CP limits are kvcadence's model of the CP shared-KV branch's scheduler rules, not upstream
SGLang's. Only the standard library is imported at module level.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from kvcadence.admit.fakes import (
    LOAD_BACK_THRESHOLD,
    FakeAllocator,
    FakeNode,
    FakeTreeCache,
)
from kvcadence.errors import ReplayError, UsageError
from kvcadence.replay.admission import AddReqResult, PrefillAdder, ceil_paged

SEMANTICS = ("classic", "0.5.23")
DEFAULT_MAX_NEW_TOKENS = 128
CLIP_MAX_NEW_TOKENS = 4096

# stopped_result values
NO_TOKEN = "NO_TOKEN"
OTHER_MAX_PREFILL = "OTHER:max_prefill"
OTHER_CHUNK = "OTHER:chunk"
OTHER_CP_EXTEND = "OTHER:cp_total_extend"
OTHER_CP_CACHED = "OTHER:cp_total_cached"
OTHER_CP_BATCH = "OTHER:cp_batch_requests"
OTHER_MAX_RUNNING = "OTHER:max_running"
STOP_RESULTS = (
    NO_TOKEN,
    OTHER_MAX_PREFILL,
    OTHER_CHUNK,
    OTHER_CP_EXTEND,
    OTHER_CP_CACHED,
    OTHER_CP_BATCH,
    OTHER_MAX_RUNNING,
)
DURATION_NOTE = (
    "duration_us is the Python admission path only (adder + scan), not end-to-end latency"
)


# ---------------------------------------------------------------------------------------------
# Request model and configuration


@dataclass(frozen=True)
class QueuedRequest:
    """One waiting request: device hit (L1), host hit (L2), tokens to compute (extend)."""

    rid: str
    l1: int
    l2: int
    extend: int
    max_new_tokens: int = DEFAULT_MAX_NEW_TOKENS
    priority: int | None = None

    @property
    def fill_len(self) -> int:
        return self.l1 + self.l2 + self.extend


@dataclass
class AdmitConfig:
    """Budgets and switches of one admission run (flag names in ``cli_admit``)."""

    available_tokens: int
    max_prefill_tokens: int = 16384
    chunked_prefill_size: int | None = 8192  # None (or <= 0) disables chunking
    page_size: int = 64
    max_running_requests: int | None = None
    new_token_ratio: float = 0.7
    semantics: str = "0.5.23"
    cp_max_total_extend_tokens: int | None = None
    cp_max_total_cached_tokens: int | None = None
    cp_max_batch_requests: int | None = None
    drain: bool = False
    load_back_threshold: int = LOAD_BACK_THRESHOLD
    max_ticks: int = 100_000

    def __post_init__(self) -> None:
        if self.semantics not in SEMANTICS:
            raise UsageError(f"--semantics must be one of {', '.join(SEMANTICS)}")
        if self.chunked_prefill_size is not None and self.chunked_prefill_size <= 0:
            self.chunked_prefill_size = None
        for name in ("available_tokens", "max_prefill_tokens"):
            if getattr(self, name) < 0:
                raise UsageError(f"--{name.replace('_', '-')} must be >= 0")
        if self.page_size < 1:
            raise UsageError("--page-size must be >= 1")
        if self.max_running_requests is not None and self.max_running_requests < 1:
            raise UsageError("--max-running-requests must be >= 1")
        if not 0.0 <= self.new_token_ratio <= 1.0:
            raise UsageError("--new-token-ratio must be in [0, 1]")
        for name in (
            "cp_max_total_extend_tokens",
            "cp_max_total_cached_tokens",
            "cp_max_batch_requests",
        ):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise UsageError(f"--{name.replace('_', '-')} must be >= 1")

    @property
    def cp_enabled(self) -> bool:
        return any(
            v is not None
            for v in (
                self.cp_max_total_extend_tokens,
                self.cp_max_total_cached_tokens,
                self.cp_max_batch_requests,
            )
        )


# ---------------------------------------------------------------------------------------------
# Fakes: allocator and tree cache (the upstream benchmark's conventions)


class AdmitReq:
    """The request object ``kvcadence.replay.admission.PrefillAdder`` reads and updates."""

    __slots__ = (
        "rid",
        "fill_len",
        "prefix_len",
        "host_hit_length",
        "last_node",
        "max_new_tokens",
        "output_len",
        "ignore_eos",
        "extend_len",
        "is_chunked",
        "load_back",
        "adm_max_new",
        "lock_handle",
    )

    def __init__(self, spec: QueuedRequest, node: FakeNode) -> None:
        self.rid = spec.rid
        self.fill_len = spec.fill_len
        self.prefix_len = spec.l1
        self.host_hit_length = spec.l2
        self.last_node = node
        self.max_new_tokens = spec.max_new_tokens
        self.output_len = 0
        self.ignore_eos = False
        self.extend_len = 0
        self.is_chunked = False
        self.load_back = 0
        self.adm_max_new = 0
        self.lock_handle: Any = None


class _State:
    """A request's life across ticks: waiting -> (chunking) -> running (-> drained)."""

    __slots__ = ("spec", "req", "loaded", "held")

    def __init__(self, spec: QueuedRequest, req: AdmitReq) -> None:
        self.spec = spec
        self.req = req
        self.loaded = 0  # L2 tokens loaded back by an earlier, refused evaluation (classic)
        self.held = 0  # allocator tokens this request holds (loaded L2 + extend KV)


# ---------------------------------------------------------------------------------------------
# Stop classification (shared with the differential test: raw SGLang verdicts -> categories)


def classify_stop(
    stop: dict[str, Any] | None,
    *,
    rem_input_tokens: int,
    rem_chunk_tokens: int | None,
    chunking: bool,
    semantics: str,
) -> str | None:
    """Map a raw stop (kind, AddReqResult name, admitted, ...) to a ``stopped_result``."""
    if stop is None:
        return None
    kind = stop["kind"]
    if kind != "add" and kind != "precheck":
        return kind  # max_running / CP limits carry their category already
    if stop["result"] == "NO_TOKEN":
        return NO_TOKEN
    if kind == "precheck" or stop["admitted"]:
        if rem_input_tokens <= 0:
            return OTHER_MAX_PREFILL
        if rem_chunk_tokens is not None and rem_chunk_tokens <= 0:
            return OTHER_CHUNK
        return "OTHER"
    # refused with OTHER before admission: the input cap or a chunk floored to nothing
    if not chunking:
        return OTHER_MAX_PREFILL
    if semantics == "classic" and stop["cand_input_tokens"] >= stop["rem_input_before"]:
        return OTHER_MAX_PREFILL
    return OTHER_CHUNK


# ---------------------------------------------------------------------------------------------
# The tick loop


@dataclass
class AdmitResult:
    config: dict[str, Any]
    n_requests: int
    ticks: list[dict[str, Any]] = field(default_factory=list)
    unadmitted: list[str] = field(default_factory=list)

    def summary(self) -> dict[str, Any]:
        stops: dict[str, int] = {}
        for t in self.ticks:
            key = t["stopped_result"] or "queue_exhausted"
            stops[key] = stops.get(key, 0) + 1
        durations = [t["duration_us"] for t in self.ticks]
        evaluated = sum(t["evaluated"] for t in self.ticks)
        return {
            "ticks": len(self.ticks),
            "requests": self.n_requests,
            "admitted_requests": self.n_requests - len(self.unadmitted),
            "unadmitted": list(self.unadmitted),
            "stopped_results": dict(sorted(stops.items())),
            "log_hit_tokens": sum(t["log_hit_tokens"] for t in self.ticks),
            "log_input_tokens": sum(t["log_input_tokens"] for t in self.ticks),
            "load_back_events": sum(len(t["load_back_events"]) for t in self.ticks),
            "load_back_failures": sum(
                1 for t in self.ticks for e in t["load_back_events"] if not e["success"]
            ),
            "duration_us_total": round(sum(durations), 3),
            "duration_us_per_evaluated_request": round(sum(durations) / evaluated, 3)
            if evaluated
            else None,
            "duration_note": DURATION_NOTE,
        }

    def to_json(self) -> dict[str, Any]:
        return {"config": self.config, "summary": self.summary(), "ticks": self.ticks}


def _new_adder(cfg: AdmitConfig, tree: FakeTreeCache, alloc: FakeAllocator, running: list[Any]):

    return PrefillAdder(
        cfg.page_size,
        tree,
        alloc,
        running,
        cfg.new_token_ratio,
        cfg.max_prefill_tokens,
        cfg.chunked_prefill_size,
        generation=cfg.semantics,
    )


def order_queue(specs: Sequence[QueuedRequest]) -> list[QueuedRequest]:
    """FCFS; with any ``priority`` set, higher priority first (stable), as SGLang's default."""
    if any(s.priority is not None for s in specs):
        return sorted(specs, key=lambda s: -(s.priority or 0))
    return list(specs)


def run_admission(  # noqa: C901 - one tick loop of SGLang's scheduler, kept whole
    specs: Sequence[QueuedRequest],
    cfg: AdmitConfig,
    *,
    clock: Callable[[], int] = time.perf_counter_ns,
) -> AdmitResult:
    """Run the waiting queue through the PrefillAdder tick by tick (see the module docstring)."""

    if len({s.rid for s in specs}) != len(specs):
        raise UsageError("admit: request ids must be unique")
    page = cfg.page_size
    chunking = cfg.chunked_prefill_size is not None
    alloc = FakeAllocator(page, cfg.available_tokens)
    tree = FakeTreeCache(alloc, load_back_threshold=cfg.load_back_threshold)
    queue: list[_State] = []
    for spec in order_queue(specs):
        node = tree.add_node(spec.rid, spec.l1)
        queue.append(_State(spec, AdmitReq(spec, node)))
    running: list[_State] = []
    chunked: list[_State] = []
    result = AdmitResult(config=asdict(cfg), n_requests=len(queue))
    CONTINUE, OTHER = AddReqResult.CONTINUE, AddReqResult.OTHER
    is_0523 = cfg.semantics == "0.5.23"
    max_running = cfg.max_running_requests
    cp_ext_lim = cfg.cp_max_total_extend_tokens
    cp_cached_lim = cfg.cp_max_total_cached_tokens
    cp_batch_lim = cfg.cp_max_batch_requests
    cp_on = cfg.cp_enabled
    lb_min = max(1, cfg.load_back_threshold)

    while queue or chunked:
        if len(result.ticks) >= cfg.max_ticks:
            raise ReplayError(f"admit: more than {cfg.max_ticks} ticks (raise --max-ticks?)")
        n_events = len(tree.events)
        for st in queue:  # init_next_round_input: re-match L1 (it may have been evicted)
            r = st.req
            r.prefix_len = tree.current_l1(st.spec.rid) + st.loaded
            r.host_hit_length = st.spec.l2 - st.loaded
            r.load_back = 0
            r.extend_len = 0
        running_reqs = [s.req for s in running]

        t0 = clock()
        adder = _new_adder(cfg, tree, alloc, running_reqs)
        continuing: list[tuple[_State, bool]] = []
        cp_ext = cp_cached = 0
        for st in chunked:
            still = adder.add_chunked_req(st.req)
            continuing.append((st, still is not None))
            if cp_on:
                cp_ext += ceil_paged(st.req.extend_len, page)
                cp_cached += ceil_paged(st.req.prefix_len, page)
        stop: dict[str, Any] | None = None
        n_eval = 0
        for st in queue:
            rid = st.spec.rid
            if is_0523 and adder.budget_state() == OTHER:
                stop = {"rid": rid, "kind": "precheck", "result": "OTHER", "admitted": False}
                break
            n_batch = len(adder.can_run_list)
            if max_running is not None and n_batch >= max_running - len(running):
                stop = {"rid": rid, "kind": OTHER_MAX_RUNNING, "result": "OTHER", "admitted": False}
                break
            if cp_on and n_batch > 0:
                # prospective shape: an L2 hit under the threshold is recomputed
                r = st.req
                host = r.host_hit_length if r.host_hit_length >= lb_min else 0
                kind = None
                if cp_batch_lim is not None and n_batch >= cp_batch_lim:
                    kind = OTHER_CP_BATCH
                elif (
                    cp_ext_lim is not None
                    and cp_ext + ceil_paged(r.fill_len - r.prefix_len - host, page) > cp_ext_lim
                ):
                    kind = OTHER_CP_EXTEND
                elif (
                    cp_cached_lim is not None
                    and cp_cached + ceil_paged(r.prefix_len + host, page) > cp_cached_lim
                ):
                    kind = OTHER_CP_CACHED
                if kind is not None:
                    stop = {"rid": rid, "kind": kind, "result": "OTHER", "admitted": False}
                    break
            rem_input_before = adder.rem_input_tokens
            n_eval += 1
            res = adder.add_one_req(st.req, has_chunked_req=bool(chunked))
            admitted = bool(adder.can_run_list) and adder.can_run_list[-1] is st.req
            if admitted and cp_on:
                cp_ext += ceil_paged(st.req.extend_len, page)
                cp_cached += ceil_paged(st.req.prefix_len, page)
            if res != CONTINUE:
                r = st.req
                stop = {
                    "rid": rid,
                    "kind": "add",
                    "result": res.name,
                    "admitted": admitted,
                    "rem_input_before": rem_input_before,
                    "cand_input_tokens": ceil_paged(r.fill_len - r.prefix_len, page),
                }
                break
        t1 = clock()

        by_req = {id(s.req): s for s in queue}
        by_req.update({id(s.req): s for s in chunked})
        cont_ids = {id(s.req) for s, _ in continuing}
        still_ids = {id(s.req) for s, still in continuing if still}
        accepted = []
        for r in adder.can_run_list:
            st = by_req[id(r)]
            cont = id(r) in cont_ids
            accepted.append(
                {
                    "rid": r.rid,
                    "l1": st.spec.l1,
                    "l2": st.spec.l2,
                    "extend": st.spec.extend,
                    "loaded": 0 if cont else r.load_back,
                    "prefix_len": r.prefix_len,
                    "extend_len": r.extend_len,
                    "chunked": bool(r.is_chunked) if not cont else id(r) in still_ids,
                    "continuation": cont,
                }
            )
        rem_chunk = adder.rem_chunk_tokens
        stopped_result = classify_stop(
            stop,
            rem_input_tokens=adder.rem_input_tokens,
            rem_chunk_tokens=rem_chunk,
            chunking=chunking,
            semantics=cfg.semantics,
        )
        tick: dict[str, Any] = {
            "tick": len(result.ticks),
            "accepted": accepted,
            "stopped_on_rid": stop["rid"] if stop else None,
            "stopped_result": stopped_result,
            "stopped_admitted": bool(stop and stop["admitted"]),
            "log_hit_tokens": adder.log_hit_tokens,
            "log_input_tokens": adder.log_input_tokens,
            "cp_total_extend_tokens": cp_ext,
            "cp_total_cached_tokens": cp_cached,
            "rem_input_tokens": adder.rem_input_tokens,
            "rem_chunk_tokens": rem_chunk,
            "rem_total_tokens": float(adder.rem_total_tokens),
            "allocator_available_after_tick": alloc.free,
            "load_back_events": [asdict(e) for e in tree.events[n_events:]],
            "evaluated": n_eval,
            "waiting_after_tick": 0,
            "running_after_tick": 0,
            "duration_us": round((t1 - t0) / 1000.0, 3),
        }

        # prepare_for_extend: allocate the admitted requests' extend KV; move them on
        new_chunked: list[_State] = []
        admitted_ids = set()
        for r in adder.can_run_list:
            st = by_req[id(r)]
            admitted_ids.add(id(r))
            start, end = r.prefix_len, r.prefix_len + r.extend_len
            need = ceil_paged(end, page) - ceil_paged(start, page)
            if alloc.free < need:
                tree.evict(need - alloc.free)
            take = min(need, alloc.free)
            alloc.free -= take
            st.held += take + (0 if id(r) in cont_ids else ceil_paged(r.load_back, page))
            truncated = id(r) in still_ids or (id(r) not in cont_ids and r.is_chunked)
            if truncated:
                r.prefix_len = end
                r.host_hit_length = 0
                new_chunked.append(st)
            else:
                running.append(st)
        for st in queue:  # a committed load-back of a refused request stays loaded (classic)
            if id(st.req) not in admitted_ids and st.req.load_back > 0:
                st.loaded += st.req.load_back
                st.held += ceil_paged(st.req.load_back, page)
        queue = [st for st in queue if id(st.req) not in admitted_ids]
        chunked = new_chunked
        if cfg.drain:
            for st in running:
                alloc.free += st.held + tree.remove_node(st.spec.rid)
            running = []
        tick["evictions"] = [{"rid": rid, "tokens": n} for rid, n in tree.evictions]
        tree.evictions.clear()
        tick["allocator_available_after_alloc"] = alloc.free
        tick["waiting_after_tick"] = len(queue)
        tick["running_after_tick"] = len(running)
        result.ticks.append(tick)
        if not accepted:
            break
    result.unadmitted = [st.spec.rid for st in queue] + [st.spec.rid for st in chunked]
    return result


# ---------------------------------------------------------------------------------------------
# Outputs


def specs_to_jobs(specs: Iterable[QueuedRequest]) -> list[dict[str, Any]]:
    """Requests in the driver's JSON form."""
    return [
        {
            "rid": s.rid,
            "l1": s.l1,
            "l2": s.l2,
            "extend": s.extend,
            "max_new_tokens": s.max_new_tokens,
        }
        for s in order_queue(list(specs))
    ]
