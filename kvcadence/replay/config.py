"""Simulator configuration: ``SimConfig`` built from a bundle's ``/server_info`` snapshot.

What this file owns: every knob of the simulated worker (pool, page size, chunking,
admission, decode publish interval, queue policy, loop kind, SGLang version for the event
encoding, the new-token-ratio constants and the pass-time model), how each is read from the
resolved server args in ``Header.server_info`` (``/server_info``, docs/sglang-sources.md), the
CLI overrides on top, validation (``UsageError`` with one clear line) and the plain-dict form
written into the sim bundle's ``Header.sim_config``.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from dataclasses import dataclass, field
from typing import Any

from kvcadence.errors import UsageError
from kvcadence.replay.events import VERSION_MODES, event_mode
from kvcadence.replay.radix import EVICTION_POLICIES, SLRU_PROTECTED

#: SGLang 0.5.23's schedule policies, its two kinds (``CacheAgnosticPolicy``,
#: ``CacheAwarePolicy``)
CACHE_AGNOSTIC_POLICIES = ("fcfs", "lof", "random", "routing-key")
CACHE_AWARE_POLICIES = ("lpm", "dfs-weight", "hrrn", "shortest-prefill-first")
POLICIES = CACHE_AGNOSTIC_POLICIES + CACHE_AWARE_POLICIES
ROLES = ("both", "prefill", "decode")


@dataclass(slots=True)
class TimingParams:
    """Pass-time model (seconds): prefill = base + per_token × extend tokens
    (+ per_req × requests, + per_prefix_token × attended prefix, + per_seq_sq × each
    request's squared sequence length); decode = base + per_req ×
    batch size (+ per_ctx_token × the batch's context); plus the client gap."""

    prefill_base_s: float = 0.010
    prefill_per_token_s: float = 3.0e-5
    prefill_per_req_s: float = 0.0
    #: per prefix token a request of the batch attends to (cached + earlier chunks); 0 (no
    #: term) unless calibrated or set
    prefill_per_prefix_token_s: float = 0.0
    #: per squared sequence length of each request of the batch (its KV length after the
    #: pass, squared; summed over passes and requests): attention that computes every
    #: position's row, as SGLang's torch-native backend (a CPU worker) does by padding an
    #: extend's queries to the whole sequence; 0 (no term) unless calibrated or set
    prefill_per_seq_sq_s: float = 0.0
    decode_base_s: float = 0.004
    decode_per_req_s: float = 0.0003
    #: per context token a decode pass attends to (each running request's KV length:
    #: prompt + outputs so far, summed over the batch); 0 (no term) unless calibrated or set
    decode_per_ctx_token_s: float = 0.0
    #: extra time between a request's finish and its lane's next arrival when the capture
    #: has no per-request gap (round trip + think)
    default_gap_s: float = 0.03
    #: scheduling/loop overhead of one idle wake-up (arrival to first schedule)
    wakeup_s: float = 0.0005
    #: PD disaggregation: KV transfer time = transfer_base + per token × prompt tokens
    #: (a prefill-worker capture's own per-request times are used when it has them)
    transfer_base_s: float = 0.002
    transfer_per_token_s: float = 0.0


#: SGLang's ``--decode-log-interval`` default: a decode pass publishes the queued KV events
#: every this many decode batches
DECODE_LOG_INTERVAL = 40


@dataclass(slots=True)
class SimConfig:
    """Effective configuration of one replay (see module docstring)."""

    page_size: int = 1
    max_total_tokens: int = 100_000
    chunked_prefill_size: int | None = 8192
    max_prefill_tokens: int = 16384
    max_running_requests: int | None = None
    #: the most requests of one prefill batch (SGLang ``--prefill-max-requests``; None: no cap)
    prefill_max_requests: int | None = None
    #: the longest prompt the worker takes (``/server_info`` ``max_req_input_len``: its
    #: ``max_req_len`` less 5); a request's ``max_new_tokens`` is capped at ``max_req_len``
    #: less its prompt less one (``Scheduler._init_max_new``; None: not stated, no such cap)
    max_req_input_len: int | None = None
    decode_log_interval: int = DECODE_LOG_INTERVAL
    schedule_policy: str = "fcfs"
    schedule_conservativeness: float = 1.0
    disable_overlap_schedule: bool = False
    #: mixed chunked prefill (SGLang ``--enable-mixed-chunk``; only with chunked prefill on):
    #: a prefill pass also decodes the running requests (``scheduler.Scheduler._mix``)
    enable_mixed_chunk: bool = False
    #: the radix tree's eviction order (SGLang ``--radix-eviction-policy``; ``replay.radix``)
    eviction_policy: str = "lru"
    #: ``slru``: the hits that protect a node (``--radix-eviction-policy-config``'s
    #: ``protected_threshold``)
    slru_protected: int = SLRU_PROTECTED
    sglang_version: str = "0.5.23"
    medium: str | None = "GPU"
    attn_dp_rank: int = 0
    topic: str = "kv-events"
    # new_token_ratio tracker (SGLANG_* env defaults)
    init_new_token_ratio: float = 0.7
    min_new_token_ratio_factor: float = 0.14
    new_token_ratio_decay_steps: int = 600
    retract_decode_steps: int = 20
    clip_max_new_tokens: int = 4096
    #: advance whole decode stretches at once (pure optimisation; output is identical)
    skip_decode_stretches: bool = True
    timing: TimingParams = field(default_factory=TimingParams)
    #: PD disaggregation role: "both" (normal worker), "prefill" or "decode"
    role: str = "both"
    #: decode role only: the worker enabled its decode radix cache (inserts at finish)
    decode_radix_cache: bool = False
    #: record per-block computed/published pass and time (visibility notes)
    track_visibility: bool = True
    #: the forward runs synchronously inside the launch (what a ``--device cpu`` worker
    #: does): the overlap loop then receives and processes the previous result only after
    #: the current forward ends. Off by default (GPU timing); see docs/simulator.md
    sync_forward: bool = False
    #: closed loop: scale a recorded client gap by the predecessor's simulated / recorded
    #: latency, so the gap spans as many scheduler passes as it did on the real worker
    scale_client_gaps: bool = True
    #: ``--schedule-policy random``: the seed of the replay's own shuffles (the worker's
    #: ``--random-seed``; its shuffles themselves are not reproduced, docs/simulator.md)
    random_seed: int = 0
    #: ``random`` as the capture's worker drew it: the waiting requests in the order of their
    #: recorded first forward (set when the policy is the capture's own, not a what-if)
    random_as_recorded: bool = False
    #: priority scheduling (SGLang ``--enable-priority-scheduling``; ``fcfs`` and ``lof``
    #: only): the waiting queue by each request's ``priority`` first, and a request that
    #: finds the running batch full preempts running ones ``priority_threshold`` below it
    #: (``scheduler.Scheduler._preempt_for``) unless ``disable_priority_preemption``
    enable_priority_scheduling: bool = False
    #: ``--schedule-low-priority-values-first``: a lower value is more important
    schedule_low_priority_values_first: bool = False
    #: ``--priority-scheduling-preemption-threshold``: the priority gap preemption needs
    #: (strictly more than it)
    priority_threshold: int = 10
    #: ``--disable-priority-preemption``
    disable_priority_preemption: bool = False
    #: which running request a decode short of memory retracts first (SGLang
    #: ``--retraction-policy``): ``length`` (fewest outputs, then longest prompt) or
    #: ``priority`` (the least important first, then as ``length``; needs priority scheduling)
    retraction_policy: str = "length"
    #: decode rounds after each prefill batch before the next prefill may be scheduled
    #: (SGLang ``--prefill-decode-interval``; 0: off), only while the running batch holds
    #: at least ``prefill_decode_interval_min_bs`` requests
    prefill_decode_interval: int = 0
    prefill_decode_interval_min_bs: int = 0
    #: receive new requests only every N-th iteration after decode ones (SGLang
    #: ``--scheduler-recv-interval``; 1: every iteration); after a prefill, at once
    scheduler_recv_interval: int = 1
    #: hold fresh prefills while fewer than N running-request slots are free and some
    #: request runs (SGLang ``--min-free-slots-delay``; capped by the running-request
    #: limit, 1 or less: off)
    min_free_slots_delay: int | None = None

    # ------------------------------------------------------------------ derived
    @property
    def admission_generation(self) -> str:
        """``"0.5.23"`` (budget-object PrefillAdder) or ``"classic"`` (≤ 0.5.10)."""
        return _generation(self.sglang_version)

    @property
    def effective_max_running(self) -> int:
        if self.max_running_requests is not None and self.max_running_requests > 0:
            return self.max_running_requests
        return max(1, self.max_total_tokens // 2)

    @property
    def priority_preemption(self) -> bool:
        """Priority scheduling with its preemption on (SGLang's default once it is on)."""
        return self.enable_priority_scheduling and not self.disable_priority_preemption

    @property
    def min_free_slots(self) -> int | None:
        """0.5.23 ``resolve_min_free_slots``: ``min_free_slots_delay`` capped by the
        running-request limit; None (off) when that is 1 or less or unset."""
        if self.min_free_slots_delay is None:
            return None
        n = min(self.min_free_slots_delay, max(0, self.effective_max_running))
        return n if n > 1 else None

    @property
    def init_ratio(self) -> float:
        return min(self.init_new_token_ratio * self.schedule_conservativeness, 1.0)

    @property
    def min_ratio(self) -> float:
        return min(self.init_ratio * self.min_new_token_ratio_factor, 1.0)

    # ------------------------------------------------------------------ build
    def validate(self) -> SimConfig:

        if self.page_size < 1:
            raise UsageError(f"page size must be >= 1 (got {self.page_size})")
        if self.max_total_tokens < self.page_size:
            raise UsageError(f"max total tokens must be >= page size (got {self.max_total_tokens})")
        if self.max_prefill_tokens < 1:
            raise UsageError("max prefill tokens must be >= 1")
        if self.chunked_prefill_size is not None and self.chunked_prefill_size <= 0:
            self.chunked_prefill_size = None
        if self.decode_log_interval < 1:
            raise UsageError("decode log interval must be >= 1")
        if self.schedule_policy not in POLICIES:
            raise UsageError(
                f"schedule policy {self.schedule_policy!r} not simulated "
                f"(choose from {', '.join(POLICIES)})"
            )
        if self.enable_priority_scheduling and self.schedule_policy not in ("fcfs", "lof"):
            raise UsageError(
                "priority scheduling needs schedule policy fcfs or lof (as SGLang: got "
                f"{self.schedule_policy!r})"
            )
        if self.prefill_decode_interval < 0 or self.prefill_decode_interval_min_bs < 0:
            raise UsageError("prefill decode interval (and its min batch size) must be >= 0")
        if self.scheduler_recv_interval < 1:
            raise UsageError("scheduler recv interval must be >= 1")
        if self.retraction_policy not in ("length", "priority"):
            raise UsageError(
                f"retraction policy {self.retraction_policy!r} not simulated (length or priority)"
            )
        if self.retraction_policy == "priority" and not self.enable_priority_scheduling:
            raise UsageError("retraction policy priority needs priority scheduling (as SGLang)")
        if self.eviction_policy not in EVICTION_POLICIES:
            raise UsageError(
                f"radix eviction policy {self.eviction_policy!r} not simulated "
                f"(choose from {', '.join(EVICTION_POLICIES)} with --radix-eviction-policy)"
            )
        if self.prefill_max_requests is not None and self.prefill_max_requests < 1:
            raise UsageError("prefill max requests must be >= 1")
        if self.slru_protected < 1:
            raise UsageError("slru protected threshold must be >= 1")
        if self.schedule_conservativeness <= 0:
            raise UsageError("schedule conservativeness must be > 0")
        event_mode(self.sglang_version)
        if self.role not in ROLES:
            raise UsageError(f"role {self.role!r} not simulated (choose from {', '.join(ROLES)})")
        t = self.timing
        for name in (
            "prefill_base_s",
            "prefill_per_token_s",
            "prefill_per_req_s",
            "prefill_per_prefix_token_s",
            "prefill_per_seq_sq_s",
            "decode_base_s",
            "decode_per_req_s",
            "decode_per_ctx_token_s",
            "default_gap_s",
            "wakeup_s",
            "transfer_base_s",
            "transfer_per_token_s",
        ):
            if getattr(t, name) < 0:
                raise UsageError(f"timing parameter {name} must be >= 0")
        if (
            t.prefill_base_s + t.prefill_per_token_s + t.prefill_per_seq_sq_s <= 0
            or t.decode_base_s + t.decode_per_req_s + t.decode_per_ctx_token_s <= 0
        ):
            raise UsageError("pass times must be positive")
        return self

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["admission_generation"] = self.admission_generation
        return d


@functools.lru_cache(maxsize=64)
def _generation(version: str) -> str:
    return "0.5.23" if _version_tuple(version) >= (0, 5, 20) else "classic"


def _version_tuple(v: str) -> tuple[int, ...]:
    out = []
    for part in v.split("."):
        digits = "".join(ch for ch in part if ch.isdigit())
        out.append(int(digits) if digits else 0)
    return tuple(out)


def _get(info: dict[str, Any], *names: str) -> Any:
    for n in names:
        if n in info and info[n] is not None:
            return info[n]
    return None


# (SimConfig attribute, conversion, /server_info keys in order of preference)
_SERVER_INFO_FIELDS: tuple[tuple[str, Any, tuple[str, ...]], ...] = (
    ("page_size", int, ("page_size",)),
    ("max_total_tokens", int, ("max_total_num_tokens", "max_total_tokens")),
    ("max_prefill_tokens", int, ("max_prefill_tokens",)),
    # the scheduler's own (``internal_states``: the requested value capped by the pool, or
    # the default SGLang derives from the pool), else the requested one
    (
        "max_running_requests",
        int,
        ("effective_max_running_requests_per_dp", "max_running_requests"),
    ),
    ("decode_log_interval", int, ("decode_log_interval",)),
    ("prefill_max_requests", int, ("prefill_max_requests",)),
    ("max_req_input_len", int, ("max_req_input_len",)),
    ("schedule_policy", str, ("schedule_policy",)),
    ("schedule_conservativeness", float, ("schedule_conservativeness",)),
    ("disable_overlap_schedule", bool, ("disable_overlap_schedule",)),
    ("enable_mixed_chunk", bool, ("enable_mixed_chunk",)),
    ("eviction_policy", str, ("radix_eviction_policy",)),
    ("random_seed", int, ("random_seed",)),
    ("enable_priority_scheduling", bool, ("enable_priority_scheduling",)),
    ("schedule_low_priority_values_first", bool, ("schedule_low_priority_values_first",)),
    ("priority_threshold", int, ("priority_scheduling_preemption_threshold",)),
    ("disable_priority_preemption", bool, ("disable_priority_preemption",)),
    ("retraction_policy", str, ("retraction_policy",)),
    ("prefill_decode_interval", int, ("prefill_decode_interval",)),
    ("prefill_decode_interval_min_bs", int, ("prefill_decode_interval_min_bs",)),
    ("scheduler_recv_interval", int, ("scheduler_recv_interval",)),
    ("min_free_slots_delay", int, ("min_free_slots_delay",)),
)


#: the range a /server_info setting must lie in (anything else is a damaged or hostile snapshot)
_INT_RANGE = {
    "page_size": (1, 1 << 20),
    "decode_log_interval": (1, 1 << 31),
    "random_seed": (-(1 << 63), 1 << 64),
    "priority_scheduling_preemption_threshold": (-(1 << 62), 1 << 62),
    "prefill_decode_interval": (0, 1 << 20),
    "prefill_decode_interval_min_bs": (0, 1 << 20),
    "scheduler_recv_interval": (1, 1 << 20),
    "min_free_slots_delay": (-(1 << 31), 1 << 31),
}
_INT_DEFAULT_RANGE = (1, 1 << 40)


#: /server_info settings that change what the worker schedules or publishes and that the
#: replay does not model (docs/simulator.md, "What is not modelled"): key -> whether its
#: value (given the whole snapshot) turns the feature on. ``--num-continuous-decode-steps``
#: is not here: 0.5.23 declares it and never reads it.
UNMODELLED: dict[str, Any] = {
    "enable_hierarchical_cache": lambda v, _: v is True,
    # 0.5.23 sizes chunks dynamically only under pipeline parallelism
    "enable_dynamic_chunking": lambda v, info: v is True and _int(info.get("pp_size")) > 1,
    "enable_prefill_delayer": lambda v, _: v is True,
    "enable_session_radix_cache": lambda v, _: v is True,
    "enable_dp_attention": lambda v, _: v is True,
    "disable_radix_cache": lambda v, _: v is True,
    "speculative_algorithm": lambda v, _: isinstance(v, str) and v.strip() != "",
}


def _int(v: Any) -> int:
    """``v`` when it is an int (not a bool), else 0: a snapshot's value as a count."""
    return v if type(v) is int else 0


def unmodelled_settings(server_info: dict[str, Any]) -> list[str]:
    """The worker's settings in ``server_info`` that the replay does not model, as command
    line flags (``--enable-mixed-chunk``, ``--speculative-algorithm EAGLE``), in a fixed
    order; empty for a snapshot without any."""
    out = []
    for key, on in UNMODELLED.items():
        v = server_info.get(key)
        if on(v, server_info):
            flag = "--" + key.replace("_", "-")
            out.append(flag if v is True else f"{flag} {v}")
    return out


def _checked(conv: Any, v: Any, key: str, lo: int | None = None) -> Any:
    """``conv(v)`` for the /server_info setting ``key``, or a UsageError naming it (never a
    TypeError/OverflowError traceback, a NaN or a page size of 0 inside the simulator)."""
    bad = UsageError(f"/server_info {key}: {v!r} is not a usable value"[:300])
    if isinstance(v, (list, dict)):
        raise bad
    try:
        out = conv(v)
    except (TypeError, ValueError, OverflowError):
        raise bad from None
    if conv is float and (not math.isfinite(out) or out < 0):
        raise bad
    if conv is int:
        rlo, rhi = _INT_RANGE.get(key, _INT_DEFAULT_RANGE)
        if not (rlo if lo is None else lo) <= out <= rhi:
            raise bad
    return out


def from_server_info(server_info: dict[str, Any], sglang_version: str | None = None) -> SimConfig:
    """Read the worker's resolved settings from a ``/server_info`` snapshot."""
    cfg = SimConfig()
    info = server_info or {}
    internal = info.get("internal_states")
    if isinstance(internal, list) and internal and isinstance(internal[0], dict):
        merged = dict(internal[0])
        merged.update(info)
        info = merged
    for attr, conv, names in _SERVER_INFO_FIELDS:
        key = next((n for n in names if info.get(n) is not None), None)
        if key is not None:
            setattr(cfg, attr, _checked(conv, info[key], key))
    pc = info.get("radix_eviction_policy_config")
    if isinstance(pc, dict) and pc.get("protected_threshold") is not None:
        cfg.slru_protected = _checked(int, pc["protected_threshold"], "protected_threshold")
    if "chunked_prefill_size" in info:
        v = info["chunked_prefill_size"]
        if v is not None:
            v = _checked(int, v, "chunked_prefill_size", lo=-(2**40))
        cfg.chunked_prefill_size = v if v is not None and v > 0 else None
    v = _get(info, "disaggregation_mode")
    if v is not None and str(v) in ("prefill", "decode"):
        cfg.role = str(v)
    v = _get(info, "disaggregation_decode_enable_radix_cache")
    if v is not None:
        cfg.decode_radix_cache = bool(v)
    kv = info.get("kv_events")
    if isinstance(kv, dict) and kv.get("topic") is not None:
        cfg.topic = str(kv["topic"])
    ver = sglang_version or _get(info, "version")
    if ver is not None:
        ver = str(ver)

        if ver not in VERSION_MODES:
            # nearest supported version at or below
            vt = _version_tuple(ver)
            cands = [k for k in VERSION_MODES if _version_tuple(k) <= vt]
            ver = max(cands, key=_version_tuple) if cands else ver
        cfg.sglang_version = ver
    return cfg


# SimConfig / TimingParams fields the replay command line may override (flag name = field).
CLI_OVERRIDES = (
    "page_size",
    "max_total_tokens",
    "chunked_prefill_size",
    "max_prefill_tokens",
    "max_running_requests",
    "prefill_max_requests",
    "decode_log_interval",
    "schedule_policy",
    "schedule_conservativeness",
    "disable_overlap_schedule",
    "enable_mixed_chunk",
    "eviction_policy",
    "enable_priority_scheduling",
    "disable_priority_preemption",
    "schedule_low_priority_values_first",
    "priority_threshold",
    "retraction_policy",
    "prefill_decode_interval",
    "prefill_decode_interval_min_bs",
    "scheduler_recv_interval",
    "min_free_slots_delay",
    "sglang_version",
    "prefill_base_s",
    "prefill_per_token_s",
    "prefill_per_req_s",
    "prefill_per_prefix_token_s",
    "prefill_per_seq_sq_s",
    "decode_base_s",
    "decode_per_req_s",
    "decode_per_ctx_token_s",
    "default_gap_s",
    "skip_decode_stretches",
    "role",
    "decode_radix_cache",
    "transfer_base_s",
    "transfer_per_token_s",
    "track_visibility",
    "sync_forward",
    "scale_client_gaps",
)
