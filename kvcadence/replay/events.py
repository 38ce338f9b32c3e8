"""The simulated KV-event queue: per-version event granularity and tail coalescing.

What this file owns (SGLang's ``KVCacheEventRecorder`` and event structs;
docs/sglang-sources.md, docs/format.md):

* ``EventQueue`` is the radix tree's ``EventSink``: it turns "a node was stored / removed"
  into canonical ``kvcadence.format.schema`` events, with the granularity of the chosen
  SGLang version:

  ==============  =========================  ==========================  ============
  mode            BlockStored                BlockRemoved                coalescing
  ==============  =========================  ==========================  ============
  ``0.5.20+``     one per new node           one per evicted node        tail merge
  ``0.5.17``      one per page               one per evicted node        none
  ``0.5.10-14``   one per page               one per page                none
  ==============  =========================  ==========================  ============

* Tail merging (0.5.20+, ``KVCacheEventRecorder.enqueue``): only the last queued event is
  examined. A removal merges into a tail removal of the same medium; a store merges into a
  tail store whose last block is the new store's parent and whose metadata (medium,
  lora_id, block_size, cache_salt, session_id, lora_name) matches; anything else (and any
  ``AllBlocksCleared``) appends. ``take()`` empties the queue (one publish).
* ``Publisher`` numbers published batches (seq from 0) and encodes them with
  ``kvcadence.format.wire.encode_batch`` for the chosen version; it keeps them
  (``batches``) or, given a ``sink``, hands each to it as it is published and keeps only
  the counts (``seq`` messages, ``n_events`` events): a replay writing a sim bundle streams
  its frames (memory grows with what is live, not with the published history).

The canonical events are built lazily from plain lists so the merge is cheap; the version
encoding happens only at publish.
"""

from __future__ import annotations

from array import array
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from kvcadence.errors import UsageError
from kvcadence.format import wire
from kvcadence.format.namespace import Namespace
from kvcadence.format.schema import AllBlocksCleared, BlockRemoved, BlockStored, KVEventBatch

_PER_NODE_REMOVE_FROM = (0, 5, 17)  # array family: one BlockRemoved per node from 0.5.17


def _vt(version: str) -> tuple[int, ...]:
    return tuple(int(x) for x in version.split("."))


def _version_modes() -> dict[str, str]:
    """The event mode of every release ``format.wire`` knows (``wire.VERSION_FAMILY``, the
    one version table), newest first. Not simulated: 0.5.5 (process-seeded Python
    ``hash()``, so its block hashes cannot be reproduced)."""

    modes: dict[str, str] = {}
    for version in sorted(wire.SUPPORTED_VERSIONS, key=_vt, reverse=True):
        family = wire.VERSION_FAMILY[version]
        if family in (wire.FAMILY_MAP, wire.FAMILY_MAP20):
            modes[version] = "coalesced"
        elif family == wire.FAMILY_ARRAY:
            per_node = _vt(version) >= _PER_NODE_REMOVE_FROM
            modes[version] = "per_page_store_per_node_remove" if per_node else "per_page"
    return modes


#: versions the simulator can emit, newest first, and their event mode
VERSION_MODES: dict[str, str] = _version_modes()


def event_mode(version: str) -> str:
    """The event granularity of ``version`` (``UsageError`` for unsupported versions)."""
    mode = VERSION_MODES.get(version)
    if mode is None:
        supported = ", ".join(VERSION_MODES)
        raise UsageError(
            f"--sglang-version {version!r} is not supported by the simulator "
            f"(supported: {supported}; 0.5.5 used process-seeded Python hash())"
        )
    return mode


STORE = 0
REMOVE = 1
CLEAR = 2


def _as_list(ids: Sequence[int]) -> list[int]:
    """A new list of ``ids`` (an array's ``tolist``: one C pass, no iterator per item)."""
    return ids.tolist() if type(ids) is array else list(ids)


@dataclass(slots=True)
class QueuedEvent:
    """One queued event in plain form (lists grow in place when the tail merges)."""

    kind: int
    hashes: list[int]
    parent: int | None = None
    tokens: list[int] | None = None
    block_size: int = 0
    session_id: str | None = None
    #: the cache namespace of its nodes (``format.namespace``): its salt goes on the wire,
    #: the whole of it keeps events apart (a tail merges only within one namespace)
    ns: Namespace | None = None


class EventQueue:
    """The recorder's queue (``EventSink`` for ``RadixTree``) for one SGLang version."""

    def __init__(self, version: str = "0.5.23", medium: str | None = "GPU") -> None:
        self.version = version
        self.mode = event_mode(version)
        self.medium = medium
        self.session_id: str | None = None  # set by the scheduler around inserts
        self.queue: list[QueuedEvent] = []
        self.stored_blocks = 0
        self.removed_blocks = 0

    def __len__(self) -> int:
        return len(self.queue)

    # ------------------------------------------------------------------ recording
    def record_store(
        self,
        hashes: Sequence[int],
        parent_hash: int | None,
        token_ids: Sequence[int],
        page_size: int,
        ns: Namespace | None = None,
    ) -> None:
        self.stored_blocks += len(hashes)
        q = self.queue
        if self.mode == "coalesced":
            sid = self.session_id
            if q:
                tail = q[-1]
                if (
                    tail.kind == STORE
                    and tail.hashes
                    and tail.block_size == page_size
                    and tail.session_id == sid
                    and tail.ns == ns
                    and parent_hash == tail.hashes[-1]
                ):
                    tail.hashes += _as_list(hashes)
                    tail.tokens += _as_list(token_ids)  # type: ignore[operator]
                    return
            q.append(
                QueuedEvent(
                    STORE,
                    _as_list(hashes),
                    parent_hash,
                    _as_list(token_ids),
                    page_size,
                    sid,
                    ns,
                )
            )
            return
        # one event per page
        prev = parent_hash
        for i, h in enumerate(hashes):
            q.append(
                QueuedEvent(
                    STORE,
                    [h],
                    prev,
                    list(token_ids[i * page_size : (i + 1) * page_size]),
                    page_size,
                    None,
                    ns,
                )
            )
            prev = h

    def record_remove(self, hashes: Sequence[int], ns: Namespace | None = None) -> None:
        self.removed_blocks += len(hashes)
        q = self.queue
        if self.mode == "coalesced":
            if q and q[-1].kind == REMOVE and q[-1].ns == ns:
                q[-1].hashes += _as_list(hashes)
                return
            q.append(QueuedEvent(REMOVE, _as_list(hashes), ns=ns))
        elif self.mode == "per_page_store_per_node_remove":
            q.append(QueuedEvent(REMOVE, _as_list(hashes)))
        else:
            for h in hashes:
                q.append(QueuedEvent(REMOVE, [h]))

    def record_clear(self) -> None:
        self.queue.append(QueuedEvent(CLEAR, []))

    def take(self) -> list[QueuedEvent]:
        """Drain the queue (one publish)."""
        out = self.queue
        self.queue = []
        return out


def to_schema_events(events: list[QueuedEvent], medium: str | None) -> list:
    """Canonical ``kvcadence.format.schema`` events for ``events``."""
    AllBlocksCleared, BlockRemoved, BlockStored = _schema_events()  # noqa: N806 - classes
    out: list = []
    for e in events:
        if e.kind == STORE:
            out.append(
                BlockStored(
                    block_hashes=e.hashes,
                    parent_block_hash=e.parent,
                    token_ids=e.tokens or [],
                    block_size=e.block_size,
                    lora_id=None,
                    medium=medium,
                    session_id=e.session_id,
                    cache_salt=None if e.ns is None else e.ns.cache_salt,
                )
            )
        elif e.kind == REMOVE:
            out.append(BlockRemoved(block_hashes=e.hashes, medium=medium))
        else:
            out.append(AllBlocksCleared())
    return out


def _schema_events() -> tuple[type, type, type]:
    """The schema's event classes, imported once (``to_schema_events`` runs per publish)."""
    global _SCHEMA_EVENTS
    if _SCHEMA_EVENTS is None:
        _SCHEMA_EVENTS = (AllBlocksCleared, BlockRemoved, BlockStored)
    return _SCHEMA_EVENTS


_SCHEMA_EVENTS: tuple[type, type, type] | None = None


@dataclass(slots=True)
class PublishedBatch:
    """One simulated ZMQ message: seq, virtual publish time, pass index and payload bytes."""

    seq: int
    time_ns: int
    pass_index: int
    payload: bytes
    n_events: int


class Publisher:
    """Assigns seqs and encodes drained event lists with the wire codec of ``version``.

    Each ``PublishedBatch`` goes to ``sink`` when one is set (then none is kept), else into
    ``batches``; ``seq`` (messages) and ``n_events`` count them either way."""

    def __init__(
        self,
        version: str,
        medium: str | None,
        attn_dp_rank: int = 0,
        anchor_ns: int = 0,
        sink: Callable[[PublishedBatch], None] | None = None,
    ) -> None:

        event_mode(version)
        self._encode = wire.encode_batch
        self._batch_cls = KVEventBatch
        self.version = version
        self.medium = medium
        self.attn_dp_rank = attn_dp_rank
        self.anchor_ns = anchor_ns
        self.seq = 0
        self.n_events = 0  # events published (all batches)
        self.batches: list[PublishedBatch] = []  # empty while a sink takes them
        #: called with every published batch instead of keeping it (None: keep)
        self.sink = sink

    def publish(self, events: list[QueuedEvent], time_ns: int, pass_index: int) -> None:
        """Encode one non-empty batch stamped at virtual ``time_ns`` (relative to anchor)."""
        if not events:
            return
        abs_ns = self.anchor_ns + time_ns
        batch = self._batch_cls(
            ts=abs_ns / 1e9,
            events=to_schema_events(events, self.medium),
            attn_dp_rank=self.attn_dp_rank,
        )
        payload = self._encode(batch, self.version)
        b = PublishedBatch(self.seq, abs_ns, pass_index, payload, len(events))
        self.seq += 1
        self.n_events += b.n_events
        if self.sink is not None:
            self.sink(b)
        else:
            self.batches.append(b)
