"""Drive the REAL ``sglang.srt.managers.schedule_policy.PrefillAdder`` with kvcadence's fakes.

A standalone script for the SGLang 0.5.23 venv's python (``kvcadence.harness.venv``): it
imports nothing from kvcadence. It reads one JSON job on stdin::

    {"config": {"available_tokens": 20000, "max_prefill_tokens": 16384,
                "chunked_prefill_size": 8192, "page_size": 64, "max_running_requests": null,
                "new_token_ratio": 0.7, "drain": false, "load_back_threshold": 10,
                "max_ticks": 100000},
     "queues": [[{"rid": "r0", "l1": 0, "l2": 4096, "extend": 128, "max_new_tokens": 128}, ...]],
     "timing_repeats": 0}

and prints one JSON document: ``{"sglang_version", "results": [{"ticks": [...]}, ...],
"timing": {...}}``. ``{"jobs": [job, ...]}`` runs several such jobs in one process (one
sglang import) and prints ``{"sglang_version", "jobs": [document, ...]}``. Each raw tick carries the accepted requests, the stop (kind ``add`` /
``precheck`` / ``max_running``, SGLang's ``AddReqResult`` name, whether the stopping request
was admitted), ``log_hit_tokens``, ``log_input_tokens``, the remaining budgets, the allocator's
free count after admission, load-back events and the admission loop's duration.

The fakes and the tick loop follow the same conventions as ``kvcadence/admit/ticks.py``
(docs/admit.md) so the two can be compared
tick by tick; the CP limits are kvcadence-only and not modelled here. With
``timing_repeats > 0`` every queue is re-run that many times and only the admission loop
(adder construction, continuing chunk, scan) is timed.
"""

from __future__ import annotations

import json
import sys
import time
from types import SimpleNamespace


def _ceil_paged(tokens: int, page: int) -> int:
    return -(-tokens // page) * page


class FakeAllocator:
    def __init__(self, page_size: int, available: int, budget_cls) -> None:
        self.page_size = page_size
        self.free = available
        self._budget_cls = budget_cls
        self.shard_spec = None

    def available_size(self) -> int:
        return self.free

    def create_prefill_budget(self, tree_cache, *, num_mixed_decode_tokens: int = 0):
        return self._budget_cls(self, tree_cache, num_mixed_decode_tokens=num_mixed_decode_tokens)

    def request_slot_reserve(self, *, has_req_pool_slot: bool, prefill_tokens: int) -> int:
        return 0


class FakeNode:
    __slots__ = ("rid", "size", "lock_ref", "evicted")

    def __init__(self, rid: str, size: int) -> None:
        self.rid = rid
        self.size = size
        self.lock_ref = 0
        self.evicted = False


class FakeTreeCache:
    disable = False
    buffer_pipeline = None
    linker = None

    def __init__(self, allocator: FakeAllocator, threshold: int) -> None:
        self.allocator = allocator
        self.page_size = allocator.page_size
        self.nodes: dict[str, FakeNode] = {}
        self._evictable = 0
        self.threshold = threshold
        self.events: list[dict] = []
        self.evictions: list[list] = []

    def supports_mamba(self) -> bool:
        return False

    def supports_prefix_sharing(self) -> bool:
        return True

    def is_tree_cache(self) -> bool:
        return True

    def evictable_size(self) -> int:
        return self._evictable

    def full_evictable_size(self) -> int:
        return self._evictable

    def load_back_is_cache_owned(self) -> bool:
        return True

    def discard_storage_prefetch_accounting(self, *args, **kwargs) -> None:
        return None

    def finish_storage_prefetch_admission(self, *args, **kwargs) -> None:
        return None

    def add_node(self, rid: str, size: int) -> FakeNode:
        node = FakeNode(rid, size)
        self.nodes[rid] = node
        self._evictable += size
        return node

    def remove_node(self, rid: str) -> int:
        node = self.nodes.pop(rid)
        if node.lock_ref == 0 and not node.evicted:
            self._evictable -= node.size
        return 0 if node.evicted else node.size

    def lock(self, node: FakeNode) -> FakeNode:
        if node.lock_ref == 0 and not node.evicted:
            self._evictable -= node.size
        node.lock_ref += 1
        return node

    def unlock(self, node: FakeNode) -> None:
        node.lock_ref -= 1
        if node.lock_ref == 0 and not node.evicted:
            self._evictable += node.size

    def evict(self, need: int) -> int:
        freed = 0
        for node in reversed(list(self.nodes.values())):
            if freed >= need:
                break
            if node.lock_ref or node.evicted or node.size == 0:
                continue
            node.evicted = True
            self._evictable -= node.size
            self.allocator.free += node.size
            freed += node.size
            self.evictions.append([node.rid, node.size])
        return freed

    def current_l1(self, rid: str) -> int:
        node = self.nodes[rid]
        return 0 if node.evicted else node.size

    def init_load_back(self, params):
        # A copy of ``kvcadence.admit.fakes.FakeTreeCache.load_back`` (this driver runs inside
        # real SGLang and must not import kvcadence): keep the two in sync by hand.
        req = params.req
        host = params.host_hit_length
        paged = _ceil_paged(host, self.page_size)
        before = self.allocator.free
        quota = before + self._evictable
        evicted = 0
        if host < max(1, self.threshold):
            ok, reason = False, "threshold"
        elif paged > quota:
            ok, reason = False, "no_space"
        else:
            if before < paged:
                evicted = self.evict(paged - before)
            self.allocator.free -= paged
            ok, reason = True, "ok"
        self.events.append(
            {
                "rid": req.rid,
                "requested": host,
                "page_aligned": paged,
                "loaded": host if ok else 0,
                "quota": quota,
                "available_before": before,
                "available_after": self.allocator.free,
                "evicted_tokens": evicted,
                "success": ok,
                "reason": reason,
            }
        )
        return (host if ok else 0), params.best_match_node


class FakeReq:
    """The attributes 0.5.23's PrefillAdder reads."""

    def __init__(self, rid: str, fill_len: int, max_new_tokens: int, node: FakeNode) -> None:
        self.rid = rid
        self.full_untruncated_fill_ids = range(fill_len)
        self.origin_input_ids = self.full_untruncated_fill_ids
        self.prefix_len = 0
        self.host_hit_length = 0
        self.swa_host_hit_length = 0
        self.mamba_host_hit_length = 0
        self.auxiliary_swa_host_hit_length = 0
        self.host_loaded_length = 0
        self.storage_hit_length = 0
        self.storage_hit_start = None
        self.host_hit_is_storage = False
        self.cache_request_handle = None
        self.output_ids: list[int] = []
        self.sampling_params = SimpleNamespace(max_new_tokens=max_new_tokens, ignore_eos=False)
        self.kv = SimpleNamespace(holds_mamba=False, req_pool_idx=None, cache_protected_len=0)
        self.retracted_stain = False
        self.is_retracted = False
        self.last_node = node
        self.best_match_node = node
        self.extend_end = 0
        self.lock = None
        self.priority = None
        self.routing_key = None

    @property
    def extend_len(self) -> int:
        return self.extend_end - self.prefix_len

    def needs_host_load_back(self) -> bool:
        return self.host_hit_length > 0

    def materialized_host_hit_len(self) -> int:
        return min(self.host_hit_length, self.host_loaded_length)

    def fulfilled_storage_hit_len(self, prefix_len: int) -> int:
        return 0

    def finished(self) -> bool:
        return False


class _State:
    __slots__ = ("spec", "req", "loaded", "held")

    def __init__(self, spec: dict, req: FakeReq) -> None:
        self.spec = spec
        self.req = req
        self.loaded = 0
        self.held = 0


def run_queue(sg, cfg: dict, queue_specs: list[dict]) -> tuple[list[dict], int, int]:
    """Run one queue to the end; returns (raw ticks, total admission ns, evaluated count)."""
    PrefillAdder, AddReqResult, PrefillBudget = sg
    page = cfg["page_size"]
    chunk = cfg.get("chunked_prefill_size")
    if chunk is not None and chunk <= 0:
        chunk = None
    max_running = cfg.get("max_running_requests")
    alloc = FakeAllocator(page, cfg["available_tokens"], PrefillBudget)
    tree = FakeTreeCache(alloc, cfg.get("load_back_threshold", 10))
    queue: list[_State] = []
    for spec in queue_specs:
        node = tree.add_node(spec["rid"], spec["l1"])
        fill = spec["l1"] + spec["l2"] + spec["extend"]
        queue.append(_State(spec, FakeReq(spec["rid"], fill, spec["max_new_tokens"], node)))
    running: list[_State] = []
    chunked: list[_State] = []
    ticks: list[dict] = []
    total_ns = 0
    evaluated = 0
    CONTINUE, OTHER = AddReqResult.CONTINUE, AddReqResult.OTHER
    while queue or chunked:
        if len(ticks) >= cfg.get("max_ticks", 100000):
            raise RuntimeError("too many ticks")
        n_events = len(tree.events)
        # re-match every waiting request (init_next_round_input)
        for st in queue:
            r = st.req
            r.prefix_len = tree.current_l1(st.spec["rid"]) + st.loaded
            r.host_hit_length = st.spec["l2"] - st.loaded
            r.host_loaded_length = 0
            r.extend_end = r.prefix_len
        for st in chunked:
            st.req.host_hit_length = 0
        running_batch = SimpleNamespace(reqs=[s.req for s in running])
        running_batch.batch_size = lambda rb=running_batch: len(rb.reqs)
        t0 = time.perf_counter_ns()
        adder = PrefillAdder(
            page,
            tree,
            alloc,
            running_batch,
            cfg["new_token_ratio"],
            cfg["max_prefill_tokens"],
            chunk,
            max_running_requests=max_running,
        )
        continuing = []
        for st in chunked:
            still = adder.add_chunked_req(st.req)
            continuing.append((st, still is not None))
        stop = None
        n_eval = 0
        for st in queue:
            if adder.budget_state() == OTHER:
                stop = {
                    "rid": st.spec["rid"],
                    "kind": "precheck",
                    "result": "OTHER",
                    "admitted": False,
                }
                break
            if max_running is not None and len(adder.can_run_list) >= max_running - len(running):
                stop = {
                    "rid": st.spec["rid"],
                    "kind": "max_running",
                    "result": "OTHER",
                    "admitted": False,
                }
                break
            rem_input_before = adder.rem_input_tokens
            n_eval += 1
            res = adder.add_one_req(
                st.req, has_chunked_req=bool(chunked), truncation_align_size=None
            )
            if res != CONTINUE:
                r = st.req
                stop = {
                    "rid": st.spec["rid"],
                    "kind": "add",
                    "result": res.name,
                    "admitted": bool(adder.can_run_list) and adder.can_run_list[-1] is r,
                    "rem_input_before": rem_input_before,
                    "cand_input_tokens": _ceil_paged(
                        len(r.full_untruncated_fill_ids) - r.prefix_len, page
                    ),
                }
                break
        t1 = time.perf_counter_ns()
        total_ns += t1 - t0
        evaluated += n_eval
        # -- outputs (after admission: only load-backs touched the allocator) --
        by_req = {id(st.req): st for st in queue}
        by_req.update({id(st.req): st for st in chunked})
        cont_ids = {id(st.req) for st, _ in continuing}
        accepted = []
        for r in adder.can_run_list:
            accepted.append(
                {
                    "rid": r.rid,
                    "prefix_len": r.prefix_len,
                    "extend_len": r.extend_end - r.prefix_len,
                    "loaded": r.host_loaded_length if id(r) not in cont_ids else 0,
                    "continuation": id(r) in cont_ids,
                }
            )
        rem_chunk = adder.rem_chunk_tokens
        tick = {
            "accepted": accepted,
            "stop": stop,
            "log_hit_tokens": adder.log_hit_tokens,
            "log_input_tokens": adder.log_input_tokens,
            "rem_input_tokens": adder.rem_input_tokens,
            "rem_chunk_tokens": rem_chunk,
            "rem_total_tokens": float(adder.rem_total_tokens),
            "allocator_available_after_tick": alloc.free,
            "load_back_events": tree.events[n_events:],
            "duration_ns": t1 - t0,
            "evaluated": n_eval,
        }
        # -- prepare_for_extend, running / chunked bookkeeping --
        new_chunked = []
        admitted_ids = set()
        for r in adder.can_run_list:
            st = by_req[id(r)]
            admitted_ids.add(id(r))
            start, end = r.prefix_len, r.extend_end
            need = _ceil_paged(end, page) - _ceil_paged(start, page)
            if alloc.free < need:
                tree.evict(need - alloc.free)
            take = min(need, alloc.free)
            alloc.free -= take
            st.held += take + (
                _ceil_paged(r.host_loaded_length, page) if id(r) not in cont_ids else 0
            )
            truncated = (r is adder.new_chunked_req) or any(
                s is st and still for s, still in continuing
            )
            if truncated:
                r.prefix_len = end
                r.extend_end = end
                r.host_hit_length = 0
                new_chunked.append(st)
            else:
                running.append(st)
        # a committed load-back of a request that was then refused stays loaded
        for st in queue:
            if id(st.req) not in admitted_ids and st.req.host_loaded_length > 0:
                st.loaded += st.req.host_loaded_length
                st.held += _ceil_paged(st.req.host_loaded_length, page)
        queue = [st for st in queue if id(st.req) not in admitted_ids]
        chunked = new_chunked
        if cfg.get("drain"):
            for st in running:
                alloc.free += st.held + tree.remove_node(st.spec["rid"])
            running = []
        tick["evictions"] = tree.evictions[:]
        tree.evictions.clear()
        ticks.append(tick)
        if not accepted:
            break
    return ticks, total_ns, evaluated


def main() -> int:
    job = json.load(sys.stdin)
    from sglang.srt.managers.schedule_policy import AddReqResult, PrefillAdder
    from sglang.srt.mem_cache.prefill_budget import PrefillBudget
    from sglang.srt.server_args import ServerArgs, set_global_server_args_for_scheduler

    set_global_server_args_for_scheduler(ServerArgs(model_path="dummy"))
    try:
        from importlib.metadata import version

        sglang_version = version("sglang")
    except Exception:  # noqa: BLE001 - informational only
        sglang_version = None
    sg = (PrefillAdder, AddReqResult, PrefillBudget)
    outputs = [run_job(sg, j) for j in job["jobs"]] if "jobs" in job else [run_job(sg, job)]
    for out in outputs:
        out["sglang_version"] = sglang_version
    doc = {"sglang_version": sglang_version, "jobs": outputs} if "jobs" in job else outputs[0]
    json.dump(doc, sys.stdout)
    sys.stdout.write("\n")
    return 0


def run_job(sg, job: dict) -> dict:
    """One config, many queues: raw ticks per queue, plus timing when asked."""
    cfg = job["config"]
    results = []
    for queue in job["queues"]:
        ticks, _, _ = run_queue(sg, cfg, queue)
        results.append({"ticks": ticks})
    timing = None
    repeats = int(job.get("timing_repeats", 0))
    if repeats > 0:
        total_ns = 0
        evaluated = 0
        for _ in range(repeats):
            for queue in job["queues"]:
                _, ns, n = run_queue(sg, cfg, queue)
                total_ns += ns
                evaluated += n
        timing = {"admission_ns": total_ns, "evaluated": evaluated, "repeats": repeats}
    return {"results": results, "timing": timing}


if __name__ == "__main__":
    sys.exit(main())
