"""The simulated scheduler's runtime records: one request (``SimReq``), one launched forward
pass (``Batch``) and a run's counters (``SimStats``), with the request states.

``SimReq`` keeps the schedule's ``RequestSpec`` (its prompt a prefix-shared
``replay.tokens.Prompt``, its outputs an array) plus the KV accounting the scheduler updates:
``kv_len`` positions covered, the first ``tree_len`` of them in the radix tree (locked through
``last_node``), the rest private slots (``alloc``, page-ceiled). The prompt's full token array
(``ids``, and ``fill``: what the next prefill matches) is built when first needed and dropped
when the request is over (``drop_tokens``), so only live requests hold one.
"""

from __future__ import annotations

from array import array
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from kvcadence.format.namespace import Namespace
from kvcadence.replay.radix import Node
from kvcadence.replay.schedule import RequestSpec
from kvcadence.replay.tokens import cat

WAITING, RUNNING, FINISHED, ABORTED = 0, 1, 2, 3


class SimReq:
    """Runtime state of one simulated request."""

    __slots__ = (
        "spec",
        "rid",
        "idx",
        "input_len",
        "_ids",
        "_fill",
        "fill_len",
        "n_out",
        "max_new_tokens",
        "output_len",
        "ignore_eos",
        "prefix_len",
        "host_hit_length",
        "last_node",
        "extend_len",
        "is_chunked",
        "load_back",
        "adm_max_new",
        "lock_handle",
        "kv_len",
        "tree_len",
        "alloc",
        "decode_left",
        "cached_tokens",
        "prefilled_once",
        "retractions",
        "gen",
        "state",
        "arrival_ns",
        "entry_ns",
        "first_token_ns",
        "finish_ns",
        "error",
        "marks",
        "dec0",
        "inserted_len",
        "arrival_processed",
        "wait_seq",
    )

    @property
    def routing_key(self) -> str | None:
        """The routing key it was sent with (``routing-key`` scheduling)."""
        return self.spec.routing_key

    @property
    def priority(self) -> int | None:
        """The priority it was sent with (priority scheduling; None: none)."""
        return self.spec.priority

    @property
    def ns(self) -> Namespace | None:
        """Its cache namespace (``format.namespace``; None: the default one)."""
        return self.spec.namespace

    @property
    def recorded_entry_s(self) -> float | None:
        """Its recorded first forward (``random`` as recorded)."""
        return self.spec.recorded_entry_s

    def __init__(self, spec: RequestSpec) -> None:
        self.spec = spec
        self.rid = spec.rid
        self.idx = spec.idx
        self.input_len = len(spec.input_ids)
        self.n_out = len(spec.output_ids)
        self.max_new_tokens = spec.max_new_tokens
        self.ignore_eos = spec.ignore_eos
        self.output_len = 0
        self._ids: array | None = None
        self._fill: array | None = None  # None: the prompt (``ids``)
        self.fill_len = self.input_len
        self.prefix_len = 0
        self.host_hit_length = 0
        self.last_node: Node | None = None
        self.extend_len = 0
        self.is_chunked = False
        self.load_back = 0
        self.adm_max_new = 0
        self.lock_handle: Node | None = None
        self.kv_len = 0
        self.tree_len = 0
        #: what its checkpoints inserted (page aligned; SGLang's ``cache_inserted_len``):
        #: the walked nodes past it gain a hit (``replay.radix``'s counting policies)
        self.inserted_len = 0
        #: the scheduler's prefill tokens when it entered the queue (``hrrn``'s aging)
        self.arrival_processed = 0
        #: the order it (last) entered the waiting queue in (``Scheduler._enqueue``): its
        #: ``wait_queue_entry_time`` for priority scheduling's sorts
        self.wait_seq = 0
        self.alloc = 0
        self.decode_left = 0
        self.cached_tokens = 0
        self.prefilled_once = False
        self.retractions = 0
        self.gen = 0
        self.state = WAITING
        self.arrival_ns = 0
        self.entry_ns: int | None = None
        self.first_token_ns: int | None = None
        self.finish_ns: int | None = None
        self.error: str | None = None
        #: KV computation marks of prefill passes, in kv order: ``(kv_end, batch)`` —
        #: positions below kv_end (and at or above the previous mark's) were computed by
        #: prefill ``batch``
        self.marks: list[tuple[int, Batch]] = []
        #: ``(kv0, g0)`` once the request decodes: position ``kv0 + j`` was computed by the
        #: decode pass at ``Scheduler``'s decode log entry ``g0 + j`` (a decoding request is
        #: in every decode pass until it stops, so its passes are consecutive log entries)
        self.dec0: tuple[int, int] | None = None

    @property
    def stops_unseen(self) -> bool:
        """It stops short of ``max_new_tokens`` without an error (EOS, a stop string): the
        scheduler learns that only when the result is processed, not ahead as a finish by
        length (``_reqs_finishing_inflight``)."""
        return self.n_out < self.max_new_tokens and self.error is None

    @property
    def ids(self) -> array:
        """The prompt's token array (built from the spec's ``Prompt`` when first needed)."""
        ids = self._ids
        if ids is None:
            ids = self._ids = self.spec.input_ids.materialize()
        return ids

    @property
    def fill(self) -> array:
        """What the next prefill matches and computes: the prompt, or after a retraction
        the prompt + the outputs decoded so far."""
        fill = self._fill
        return fill if fill is not None else self.ids

    @fill.setter
    def fill(self, value: array) -> None:
        self._fill = value

    def drop_tokens(self) -> None:
        """The request is over: drop its token arrays (rebuilt if read again)."""
        self._ids = self._fill = None

    @property
    def seq(self) -> array:
        """The full sequence (prompt + outputs), built on demand: not kept per request."""
        return cat(self.ids, self.spec.output_ids)

    def seq_slice(self, start: int, end: int) -> array:
        """``seq[start:end]`` without building ``seq`` (only the slice is copied)."""
        ids = self.ids
        k = len(ids)
        if end <= k:
            return ids[start:end]
        if start >= k:
            return self.spec.output_ids[start - k : end - k]
        return cat(ids[start:], self.spec.output_ids[: end - k])


@dataclass(slots=True)
class Batch:
    """One launched forward pass."""

    kind: str  # "prefill" | "decode"
    reqs: list[SimReq]
    gens: list[int]
    index: int
    end_ns: int = 0
    tokens: int = 0
    #: prefill: sequence end computed, and whether it is the request's last chunk (a
    #: decode pass shares the empty defaults: no two lists per pass)
    upto: Sequence[int] = ()
    finals: Sequence[bool] = ()
    #: a mixed prefill (``--enable-mixed-chunk``): the running requests it also decodes, a
    #: token each, their generations, and the sum of their sequence ends after that token
    mixed: Sequence[SimReq] = ()
    mixed_gens: Sequence[int] = ()
    mixed_seq: int = 0


@dataclass(slots=True)
class SimStats:
    passes: int = 0
    prefill_passes: int = 0
    decode_passes: int = 0
    #: prefill passes that also decoded the running requests (``--enable-mixed-chunk``)
    mixed_passes: int = 0
    skipped_passes: int = 0
    retractions: int = 0
    #: running requests released for a more important one (priority scheduling)
    preemptions: int = 0
    evictions: int = 0
    flushes: int = 0
    aborted: int = 0
    virtual_ns: int = 0
    #: tokens held from the start as placeholders of pages the worker held before a late
    #: capture (``Scheduler.hold_unseen``)
    held_before_tokens: int = 0
    extra: dict[str, Any] = field(default_factory=dict)
