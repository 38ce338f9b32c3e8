"""The one model of SGLang's ``PrefillAdder`` (``schedule_policy.py``; docs/sglang-sources.md).

Used by ``replay.scheduler`` and by ``kvcadence admit`` (fake tree cache / allocator). Two
generations: ``"0.5.23"`` (budget-object ``PrefillBudget``: one extra page reserved per
request, the input cap only without chunking, chunk decision before the L2 load, raw extend in
``log_input_tokens``) and ``"classic"`` (0.5.6.post2 / 0.5.9: input cap also with chunking,
decision after the load, page-ceiled ``log_input_tokens``).

Interface (mirrors SGLang; every collaborator is a Protocol, so fakes are plain objects)::

    tree_cache: TreeCacheLike
        evictable_size() -> int              unlocked tokens in the tree (live)
        lock(node) -> handle                 inc_lock_ref on node and ancestors
        unlock(handle) -> None               dec_lock_ref
        init_load_back(req, host_hit_length) -> int
                                             L2 -> device load; page-aligned tokens loaded,
                                             all or nothing (0 = failed: full recompute).
                                             It must take the loaded slots from the allocator.
    allocator: AllocatorLike
        available_size() -> int              free KV slots (live)
    req: ReqLike (attributes)
        rid, fill_len (input + output tokens so far), prefix_len (L1, device match),
        host_hit_length (L2), last_node, max_new_tokens, output_len, ignore_eos
      set by the adder on admission: extend_len (tokens computed this pass), prefix_len
      (+ loaded L2), is_chunked, load_back (tokens loaded), adm_max_new (reservation)
    running: iterable of ReqLike (the running batch, for the decode reservation)

    adder = PrefillAdder(page_size, tree_cache, allocator, running, new_token_ratio,
                         rem_input_tokens, rem_chunk_tokens, generation="0.5.23",
                         num_mixed_decode_tokens=0, prefill_max_requests=None,
                         clip_max_new_tokens=4096)
    adder.add_chunked_req(req) -> req | None       continuing chunk first (None when done)
    adder.budget_state() -> AddReqResult           run before each candidate (0.5.23)
    adder.add_one_req(req, has_chunked_req=False, truncation_align_size=None) -> AddReqResult
    adder.can_run_list, adder.new_chunked_req, adder.log_hit_tokens, adder.log_input_tokens
    adder.rem_total_tokens, adder.cur_rem_tokens, adder.rem_input_tokens, adder.rem_chunk_tokens
    adder.load_back_events                          [(rid, requested, loaded)]

``NewTokenRatioTracker`` is the decode-reservation ratio (init, decay per decode step, reset
on retraction and when fully idle).
"""

from __future__ import annotations

import enum
from collections.abc import Iterable
from typing import Any, Protocol


class AddReqResult(enum.Enum):
    """SGLang's ``AddReqResult``."""

    CONTINUE = 0
    NO_TOKEN = 1
    OTHER = 2


class TreeCacheLike(Protocol):
    def evictable_size(self) -> int: ...

    def lock(self, node: Any) -> Any: ...

    def unlock(self, handle: Any) -> None: ...

    def init_load_back(self, req: Any, host_hit_length: int) -> int: ...


class AllocatorLike(Protocol):
    def available_size(self) -> int: ...


class NewTokenRatioTracker:
    """``new_token_ratio``: init × conservativeness, linear decay to min, reset rules."""

    def __init__(
        self,
        init: float = 0.7,
        min_factor: float = 0.14,
        decay_steps: int = 600,
        conservativeness: float = 1.0,
        retract_decode_steps: int = 20,
    ) -> None:
        self.init = min(init * conservativeness, 1.0)
        self.min = min(self.init * min_factor, 1.0)
        self.decay = (self.init - self.min) / decay_steps
        self.retract_decode_steps = retract_decode_steps
        self.current = self.init

    def on_decode_steps(self, n: int = 1) -> None:
        """``n`` decode steps without retraction."""
        self.current = max(self.current - self.decay * n, self.min)

    def on_retract(self, batch: Iterable[Any]) -> None:
        """After a retraction: ``(Σ out + steps × n) / (Σ max_new + 1)``, capped at 1."""
        reqs = list(batch)
        out = sum(r.output_len for r in reqs)
        mx = sum(r.max_new_tokens for r in reqs)
        self.current = min(1.0, (out + self.retract_decode_steps * len(reqs)) / (mx + 1))

    def on_idle(self) -> None:
        self.current = self.init


def ceil_paged(tokens: int, page_size: int) -> int:
    return -(-tokens // page_size) * page_size


class PrefillAdder:
    """SGLang's ``PrefillAdder`` (see the module docstring for the interface)."""

    def __init__(
        self,
        page_size: int,
        tree_cache: TreeCacheLike,
        allocator: AllocatorLike,
        running: Iterable[Any],
        new_token_ratio: float,
        rem_input_tokens: int,
        rem_chunk_tokens: int | None,
        *,
        generation: str = "0.5.23",
        num_mixed_decode_tokens: int = 0,
        prefill_max_requests: int | None = None,
        clip_max_new_tokens: int = 4096,
    ) -> None:
        if generation not in ("0.5.23", "classic"):
            raise ValueError(f"unknown PrefillAdder generation {generation!r}")
        self.page_size = page_size
        self.tree_cache = tree_cache
        self.allocator = allocator
        self.generation = generation
        self.clip = clip_max_new_tokens
        self.prefill_max_requests = prefill_max_requests
        self.rem_input_tokens = rem_input_tokens - num_mixed_decode_tokens
        self.rem_chunk_tokens = (
            None if rem_chunk_tokens is None else rem_chunk_tokens - num_mixed_decode_tokens
        )
        self.rem_total_token_offset: float = num_mixed_decode_tokens
        self.cur_rem_token_offset: float = num_mixed_decode_tokens
        # the running requests' reservations, summed in order (a loop per admission pass)
        ignore_eos_at_1 = generation == "0.5.23"  # 0.5.23: ignore-EOS requests at ratio 1.0
        clip = self.clip
        offset = self.rem_total_token_offset
        for r in running:
            # min(max(max_new - out, 0), clip) without two calls per running request
            left = r.max_new_tokens - r.output_len
            if left < 0:
                left = 0
            if left > clip:
                left = clip
            if ignore_eos_at_1 and getattr(r, "ignore_eos", False):
                offset += left * 1.0
            else:
                offset += left * new_token_ratio
        self.rem_total_token_offset = offset
        self.can_run_list: list[Any] = []
        self.new_chunked_req: Any = None
        self.log_hit_tokens = 0
        self.log_input_tokens = 0
        self.load_back_events: list[tuple[str, int, int]] = []

    # ------------------------------------------------------------------ budgets
    @property
    def rem_total_tokens(self) -> float:
        return (
            self.allocator.available_size()
            + self.tree_cache.evictable_size()
            - self.rem_total_token_offset
        )

    @property
    def cur_rem_tokens(self) -> float:
        return (
            self.allocator.available_size()
            + self.tree_cache.evictable_size()
            - self.cur_rem_token_offset
        )

    def budget_state(self) -> AddReqResult:
        # ``rem_total_tokens`` / ``cur_rem_tokens`` with the live sizes read once
        free = self.allocator.available_size() + self.tree_cache.evictable_size()
        if free - self.rem_total_token_offset <= 0 or free - self.cur_rem_token_offset <= 0:
            return AddReqResult.NO_TOKEN
        if self.rem_input_tokens <= 0 or (
            self.rem_chunk_tokens is not None and self.rem_chunk_tokens <= 0
        ):
            return AddReqResult.OTHER
        return AddReqResult.CONTINUE

    def _charge(self, prefix_len: int, extend: int, max_new: int) -> None:
        ps = self.page_size
        e = ceil_paged(extend, ps)
        immediate = e + ps if self.generation == "0.5.23" else e
        self.rem_total_token_offset += immediate + max_new
        self.cur_rem_token_offset += immediate
        self.rem_input_tokens -= e
        if self.rem_chunk_tokens is not None:
            self.rem_chunk_tokens -= e
        self.log_hit_tokens += prefix_len
        self.log_input_tokens += extend if self.generation == "0.5.23" else e

    def _lock_admitted(self, req: Any, pinned: Any, pin: Any) -> bool:
        """Give the admitted ``req`` its own lock on ``req.last_node`` (``lock_handle``).

        When that is the node the temporary pin holds (``pinned``, handle ``pin``), the
        pin's reference becomes the request's and True is returned: the caller then does
        not release the pin. Locking again and releasing the pin would leave every count as
        it is, and nothing reads the tree cache in between -- two tree walks fewer per
        admission."""
        if req.last_node is pinned:
            req.lock_handle = pin
            return True
        req.lock_handle = self.tree_cache.lock(req.last_node)
        return False

    # ------------------------------------------------------------------ chunked continuation
    def add_chunked_req(self, req: Any, limit: int | None = None) -> Any:
        """Continue ``req``'s chunked prefill first; return it while still truncated.

        Both generations: ``available = min(rem_chunk_tokens, int(rem_total_tokens))``, or
        ``rem_chunk_tokens`` when that is <= 0 (the request must progress to free its KV);
        ``extend = min(remaining, available)`` -- no page rounding (0.5.23 ``fit_chunk`` is
        the identity for a plain ``PrefillBudget``; the mamba grid floor does not apply).
        ``limit``: ``chunked_req_limit`` (shortest-prefill-first), a cap on the chunk.
        """
        chunk = self.rem_chunk_tokens if self.rem_chunk_tokens is not None else 1 << 62
        if limit is not None:
            chunk = min(chunk, limit)
        avail = min(chunk, int(self.rem_total_tokens))
        if avail <= 0:
            avail = chunk
        remaining = req.fill_len - req.prefix_len
        truncated = remaining > avail
        extend = avail if truncated else remaining
        req.extend_len = extend
        req.is_chunked = truncated
        req.load_back = 0
        # the last chunk reserves the whole clipped max_new_tokens (as a whole admission)
        max_new = 0 if truncated else min(req.max_new_tokens, self.clip)
        req.adm_max_new = max_new
        self.can_run_list.append(req)
        self._charge(0, extend, max_new)
        return req if truncated else None

    # ------------------------------------------------------------------ new requests
    def add_one_req(
        self, req: Any, has_chunked_req: bool = False, truncation_align_size: int | None = None
    ) -> AddReqResult:
        if self.generation == "0.5.23":
            return self._add_one_req_0523(req, truncation_align_size)
        return self._add_one_req_classic(req, truncation_align_size)

    def _select(
        self, req: Any, total_tokens: int, host_hit: int, align: int | None
    ) -> tuple[AddReqResult, int, int, bool]:
        """0.5.23 ``_select_prefill_admission``: (verdict, prefix, extend, chunked)."""
        ps = self.page_size
        prefix = req.prefix_len + host_hit
        extend = req.fill_len - prefix
        input_tokens = ceil_paged(extend, ps)
        if not total_tokens < self.rem_total_tokens:
            return AddReqResult.NO_TOKEN, prefix, extend, False
        if (
            self.rem_chunk_tokens is None
            and self.can_run_list
            and input_tokens >= self.rem_input_tokens
        ):
            return AddReqResult.OTHER, prefix, extend, False
        if self.rem_chunk_tokens is not None and input_tokens > self.rem_chunk_tokens:
            ext = (self.rem_chunk_tokens // ps) * ps
            if align:
                ext = (ext // align) * align
            ext = ((prefix + ext) // ps) * ps - prefix
            if ext <= 0:
                return AddReqResult.OTHER, prefix, extend, False
            return AddReqResult.CONTINUE, prefix, ext, True
        return AddReqResult.CONTINUE, prefix, extend, False

    def _add_one_req_0523(self, req: Any, align: int | None) -> AddReqResult:
        if (
            self.prefill_max_requests is not None
            and len(self.can_run_list) >= self.prefill_max_requests
        ):
            return AddReqResult.OTHER
        ps = self.page_size
        max_new = min(max(req.max_new_tokens - req.output_len, 0), self.clip)
        host_hit = req.host_hit_length
        cand_extend = req.fill_len - req.prefix_len
        total_tokens = cand_extend + max_new + ps
        # 0.5.23 holds the temporary pin of the candidate's device prefix (``with
        # self._lock_node(req.last_node)``) across selection, the L2 load-back, the
        # re-selection after a failed load, and the commit: the prefix is never evictable
        # (nor counted in ``rem_total_tokens``) while the load makes room.
        pinned = req.last_node
        handle = self.tree_cache.lock(pinned)
        kept = False  # the pin became the request's lock (``_lock_admitted``)
        try:
            verdict, prefix, extend, chunked = self._select(req, total_tokens, host_hit, align)
            if verdict is not AddReqResult.CONTINUE:
                return verdict
            loaded = 0
            if host_hit > 0:
                loaded = self.tree_cache.init_load_back(req, host_hit)
                self.load_back_events.append((req.rid, host_hit, loaded))
                if loaded <= 0:
                    # nothing loaded: full recompute of L2 + extend; this verdict is final
                    loaded = 0
                    verdict, prefix, extend, chunked = self._select(req, total_tokens, 0, align)
                    if verdict is not AddReqResult.CONTINUE:
                        return verdict
                elif loaded > host_hit:
                    # more than promised (resident KV behind the host hit): keep the
                    # approved budget, shrink the work
                    prefix = req.prefix_len + loaded
                    extend = min(extend, req.fill_len - prefix)
                    chunked = chunked and prefix + extend < req.fill_len
                elif loaded < host_hit:
                    # a partial load (SGLang raises: all or nothing); a lenient fake gets the
                    # rest recomputed
                    prefix = req.prefix_len + loaded
                    if not chunked:
                        extend = req.fill_len - prefix
            req.prefix_len = prefix
            req.extend_len = extend
            req.is_chunked = chunked
            req.load_back = loaded
            # the check above uses max_new − outputs; the reservation charged for a whole
            # admission is ``min(max_new_tokens, clip)`` (``_PrefillAdmission``): a
            # re-admitted retracted request reserves its full budget again
            req.adm_max_new = 0 if chunked else min(req.max_new_tokens, self.clip)
            kept = self._lock_admitted(req, pinned, handle)
            self.can_run_list.append(req)
            if chunked:
                self.new_chunked_req = req
            self._charge(prefix, extend, req.adm_max_new)
        finally:
            if not kept:
                self.tree_cache.unlock(handle)
        # the verdict for the next candidate, read after the temporary pin is released
        return self.budget_state()

    def _add_one_req_classic(self, req: Any, align: int | None) -> AddReqResult:
        if (
            self.prefill_max_requests is not None
            and len(self.can_run_list) >= self.prefill_max_requests
        ):
            return AddReqResult.OTHER
        ps = self.page_size
        max_new = min(max(req.max_new_tokens - req.output_len, 0), self.clip)
        host_hit = req.host_hit_length
        extend = req.fill_len - req.prefix_len
        total_tokens = extend + max_new
        real_input = ceil_paged(extend - host_hit, ps)
        if total_tokens >= self.rem_total_tokens:
            return AddReqResult.NO_TOKEN
        if real_input >= self.rem_input_tokens and self.can_run_list:
            return AddReqResult.OTHER
        pinned = req.last_node
        handle = self.tree_cache.lock(pinned)
        kept = False  # the pin became the request's lock (``_lock_admitted``)
        try:
            if total_tokens >= self.rem_total_tokens:
                return AddReqResult.NO_TOKEN
            loaded = 0
            if host_hit > 0:
                loaded = self.tree_cache.init_load_back(req, host_hit)
                self.load_back_events.append((req.rid, host_hit, loaded))
                if loaded > 0:
                    req.prefix_len += loaded
                    extend = req.fill_len - req.prefix_len
            input_tokens = ceil_paged(extend, ps)
            if input_tokens >= self.rem_input_tokens and self.can_run_list:
                return AddReqResult.OTHER
            req.load_back = loaded
            if self.rem_chunk_tokens is None or input_tokens <= self.rem_chunk_tokens:
                req.extend_len = extend
                req.is_chunked = False
                # classic ``_update_prefill_budget(..., min(max_new_tokens, clip))``
                req.adm_max_new = min(req.max_new_tokens, self.clip)
                self.can_run_list.append(req)
                kept = self._lock_admitted(req, pinned, handle)
                self._charge(req.prefix_len, extend, req.adm_max_new)
            else:
                trunc = (self.rem_chunk_tokens // ps) * ps
                if align:
                    if trunc < align:
                        return AddReqResult.OTHER
                    trunc = (trunc // align) * align
                if trunc <= 0:
                    return AddReqResult.OTHER
                req.extend_len = trunc
                req.is_chunked = True
                req.adm_max_new = 0
                self.can_run_list.append(req)
                self.new_chunked_req = req
                kept = self._lock_admitted(req, pinned, handle)
                self._charge(req.prefix_len, trunc, 0)
        finally:
            if not kept:
                self.tree_cache.unlock(handle)
        return self.budget_state()
