"""Every record layout kvcadence reads or writes, as msgspec Structs (the one schema module).

Two families live here and nowhere else:

1. **SGLang wire structs** -- mirrors of SGLang's ``srt/disaggregation/kv_events.py``.
   The *canonical* in-memory events are the 0.5.20+ map-shaped structs (``BlockStored``,
   ``BlockRemoved``, ``AllBlocksCleared``; tagged maps, ``omit_defaults``) inside a
   ``KVEventBatch`` (array-like ``[ts, events, attn_dp_rank]``). Encoding them with msgspec
   gives bytes identical to SGLang 0.5.23. The ``*V17`` / ``*V05`` structs are the older
   tagged positional-array shapes (0.5.10-0.5.17 and 0.5.5) used only to *encode* for those
   versions; decoding any shape is ``kvcadence.format.wire``'s job, and always yields the
   canonical structs. Block hashes in canonical structs are signed int64 (SGLang's form).
   An event whose tag is unknown becomes ``UnknownEvent(tag, raw)``.

2. **Bundle records** -- what a bundle stores (framing on disk is ``kvcadence.format.bundle``):
   ``Header``, ``EventFrame``, ``RequestRecord``, ``Gap``, ``Epoch``, ``Annotation``,
   ``Trailer``; one tagged union ``BundleRecord``. ``PackedRequest`` is how format 2.0
   stores a ``RequestRecord`` (the bundle layer converts both ways). All are ``array_like`` + ``gc=False``:
   the tag is the first array element.

3. **Eviction trace lines** -- ``EvictionTraceLine``, one JSON line per eviction call, the
   layout ``kvcadence replay --trace-evictions`` writes and ``kvcadence evictions`` reads
   (the real worker's trace, written inside SGLang's venv by
   ``harness/sglang_cpu/sitecustomize.py``, has the same fields plus ``call`` and ``stack``).

Evolution rules (also in ``docs/format.md``): new fields only at the end of a struct and
always with a default; never reorder, rename the tag of, or retype a field; a new record
type gets a new tag and bumps ``FORMAT_MINOR`` (old readers skip unknown tags); anything
incompatible bumps ``FORMAT_MAJOR`` (old readers refuse the bundle).

Why one ~720-line module: the brief's rule is one module owning every record layout; it is
declarations only (no logic beyond ``served_rank``).
"""

from __future__ import annotations

from typing import Annotated, Any, Union

import msgspec

from kvcadence.errors import InputError

# --------------------------------------------------------------------------------------
# 1. SGLang wire structs
# --------------------------------------------------------------------------------------


class KVCacheEvent(msgspec.Struct, omit_defaults=True, gc=False, tag=True):
    """Base of the canonical (0.5.20+ map-shaped) events; the tag key is ``"type"``."""


class BlockStored(KVCacheEvent):
    """Pages inserted into the radix tree (one hash per page, chained from the root)."""

    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None = None
    cache_salt: str | None = None
    session_id: str | None = None
    lora_name: str | None = None


class BlockRemoved(KVCacheEvent):
    """Pages evicted from a medium (all pages of the evicted leaves, leaf-first)."""

    block_hashes: list[int]
    medium: str | None = None


class AllBlocksCleared(KVCacheEvent):
    """The whole tree was reset (startup, ``/flush_cache``)."""


class UnknownEvent(msgspec.Struct, gc=False):
    """An event whose tag kvcadence does not know; kept whole so nothing is lost."""

    tag: str
    raw: Any


KnownEvent = Union[BlockStored, BlockRemoved, AllBlocksCleared]
Event = Union[BlockStored, BlockRemoved, AllBlocksCleared, UnknownEvent]


class KVEventBatch(msgspec.Struct, array_like=True, gc=False):
    """One ZMQ message's payload: ``[ts, events, attn_dp_rank]`` (always 3 elements)."""

    ts: float
    events: list[KnownEvent]
    attn_dp_rank: int | None = None


# Positional-array shapes (encode-only mirrors of older SGLang releases).


class _ArrayEvent(msgspec.Struct, array_like=True, gc=False, tag=True):
    """Base of the 0.5.5-0.5.17 tagged positional-array events."""


class BlockStoredV17(_ArrayEvent, tag="BlockStored"):
    """0.5.10-0.5.17 ``BlockStored``: 7 slots including the tag."""

    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None = None


class BlockRemovedV17(_ArrayEvent, tag="BlockRemoved"):
    """0.5.10-0.5.17 ``BlockRemoved``: 3 slots including the tag."""

    block_hashes: list[int]
    medium: str | None = None


class AllBlocksClearedArr(_ArrayEvent, tag="AllBlocksCleared"):
    """``["AllBlocksCleared"]`` in every array version."""


class BlockStoredV05(_ArrayEvent, tag="BlockStored"):
    """0.5.5 ``BlockStored``: 6 slots including the tag (no ``medium``)."""

    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None


class BlockRemovedV05(_ArrayEvent, tag="BlockRemoved"):
    """0.5.5 ``BlockRemoved``: 2 slots including the tag."""

    block_hashes: list[int]


class KVEventBatchV17(msgspec.Struct, array_like=True, gc=False):
    """Batch of 0.5.10-0.5.17 array events."""

    ts: float
    events: list[Union[BlockStoredV17, BlockRemovedV17, AllBlocksClearedArr]]
    attn_dp_rank: int | None = None


class KVEventBatchV05(msgspec.Struct, array_like=True, gc=False):
    """Batch of 0.5.5 array events."""

    ts: float
    events: list[Union[BlockStoredV05, BlockRemovedV05, AllBlocksClearedArr]]
    attn_dp_rank: int | None = None


# Decode-only "views" (analysis): token ids are left as msgpack bytes (``msgspec.Raw``), which
# decodes ~2.4x faster when only hashes and counts are needed (measured on msgspec 0.23).
# Produced only by ``kvcadence.format.wire.decode_batch_view``; never encoded.


def _raw_array_len(raw: msgspec.Raw) -> int:
    """Element count of a msgpack array held as ``Raw`` (read from its header only)."""
    b = memoryview(raw)
    h = b[0]
    if 0x90 <= h <= 0x9F:
        return h & 0x0F
    if h == 0xDC:
        return (b[1] << 8) | b[2]
    if h == 0xDD:
        return int.from_bytes(b[1:5], "big")
    raise ValueError("token_ids is not a msgpack array")


class BlockStoredView(KVCacheEvent, tag="BlockStored"):
    """``BlockStored`` as analysis reads it: ``token_ids`` kept as its msgpack array bytes
    (``n_tokens`` = its element count; a bigram pair counts as one). The optional keys are
    type-checked as in ``BlockStored`` (so the view's verdict is ``decode_batch``'s); other
    extra keys are skipped."""

    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: msgspec.Raw
    block_size: int
    lora_id: int | None
    medium: str | None = None
    # typed as in BlockStored so a view refuses what decode_batch refuses (one verdict)
    cache_salt: str | None = None
    session_id: str | None = None
    lora_name: str | None = None

    @property
    def n_tokens(self) -> int:
        return _raw_array_len(self.token_ids)


class BlockStoredV17View(_ArrayEvent, tag="BlockStored"):
    """0.5.5-0.5.17 positional ``BlockStored`` with ``token_ids`` as ``Raw`` (decode-only)."""

    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: msgspec.Raw
    block_size: int
    lora_id: int | None
    medium: str | None = None


class KVEventBatchView(msgspec.Struct, array_like=True, gc=False):
    """A payload decoded as a view: events are ``BlockStoredView``, ``BlockRemoved``,
    ``AllBlocksCleared`` or ``UnknownEvent``; hashes signed int64 as in ``KVEventBatch``."""

    ts: float
    events: list[Union[BlockStoredView, BlockRemoved, AllBlocksCleared]]
    attn_dp_rank: int | None = None


class KVEventBatchV17View(msgspec.Struct, array_like=True, gc=False):
    """Decode-only batch of 0.5.5-0.5.17 array events with ``token_ids`` as ``Raw``."""

    ts: float
    events: list[Union[BlockStoredV17View, BlockRemovedV17, AllBlocksClearedArr]]
    attn_dp_rank: int | None = None


# Decode-only "raw views" (analysis ingest's fast path): ``block_hashes`` too is left as its
# msgpack array bytes (``Raw``: no Python int per hash; ingest converts them in numpy chunks
# with ``kvcadence.analysis.tokcols``). A parent hash outside int64 fails msgspec's range
# check in C, so such a payload takes the canonical path. Produced only by
# ``kvcadence.format.wire.decode_batch_raw``; never encoded.

Int64 = Annotated[int, msgspec.Meta(ge=-(1 << 63), le=(1 << 63) - 1)]


class BlockStoredRawView(KVCacheEvent, tag="BlockStored"):
    """``BlockStored`` with ``block_hashes`` and ``token_ids`` as their msgpack bytes."""

    block_hashes: msgspec.Raw
    parent_block_hash: Int64 | None
    token_ids: msgspec.Raw
    block_size: int
    lora_id: int | None
    medium: str | None = None
    # typed as in BlockStored so a view refuses what decode_batch refuses (one verdict)
    cache_salt: str | None = None
    session_id: str | None = None
    lora_name: str | None = None


class BlockRemovedRawView(KVCacheEvent, tag="BlockRemoved"):
    """``BlockRemoved`` with ``block_hashes`` as its msgpack bytes."""

    block_hashes: msgspec.Raw
    medium: str | None = None


class BlockStoredV17RawView(_ArrayEvent, tag="BlockStored"):
    """0.5.5-0.5.17 positional ``BlockStored``, hashes and token ids as ``Raw``."""

    block_hashes: msgspec.Raw
    parent_block_hash: Int64 | None
    token_ids: msgspec.Raw
    block_size: int
    lora_id: int | None
    medium: str | None = None


class BlockRemovedV17RawView(_ArrayEvent, tag="BlockRemoved"):
    """0.5.5-0.5.17 positional ``BlockRemoved``, hashes as ``Raw``."""

    block_hashes: msgspec.Raw
    medium: str | None = None


class KVEventBatchRawView(msgspec.Struct, array_like=True, gc=False):
    """A payload decoded as a raw view: events are ``BlockStoredRawView``,
    ``BlockRemovedRawView``, ``AllBlocksCleared`` or ``UnknownEvent``."""

    ts: float
    events: list[Union[BlockStoredRawView, BlockRemovedRawView, AllBlocksCleared]]
    attn_dp_rank: int | None = None


class KVEventBatchV17RawView(msgspec.Struct, array_like=True, gc=False):
    """Decode-only batch of 0.5.5-0.5.17 array events, hashes and token ids as ``Raw``."""

    ts: float
    events: list[Union[BlockStoredV17RawView, BlockRemovedV17RawView, AllBlocksClearedArr]]
    attn_dp_rank: int | None = None


# --------------------------------------------------------------------------------------
# 2. Bundle records
# --------------------------------------------------------------------------------------

FORMAT_MAJOR = 2  # 2.0: requests stored as PackedRequest (shared prefixes, packed token ids)
FORMAT_MINOR = 0
#: majors this version reads: 1.x (1.1 added SegmentStart) and 2.x
READABLE_MAJORS = (1, 2)
#: what a writer continuing a 1.x bundle writes (``BundleWriter.append``): its own version
LEGACY_VERSION = (1, 1)

# EventFrame.via values
VIA_LIVE = 0  # received on the SUB socket
VIA_REPLAY = 1  # fetched from the publisher's replay (ROUTER) socket
VIA_IMPORT = 2  # converted from another recorder's dump
VIA_SIM = 3  # published by the kvcadence simulator


class BlockStoredIdsView(KVCacheEvent, tag="BlockStored"):
    """``BlockStoredRawView`` with its token ids decoded in the frame's one decode (not
    skipped as ``Raw``, then decoded). Typed as the view otherwise."""

    block_hashes: msgspec.Raw
    parent_block_hash: Int64 | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None = None
    cache_salt: str | None = None
    session_id: str | None = None
    lora_name: str | None = None


class KVEventBatchTsView(msgspec.Struct, array_like=True, gc=False):
    """A payload's publish ``ts`` alone, its events left undecoded (``Raw``): the flush scan's
    view of a frame whose payload cannot hold an ``AllBlocksCleared`` (its tag's bytes are
    not in it)."""

    ts: float
    events: msgspec.Raw
    attn_dp_rank: Any = None


class KVEventBatchIdsView(msgspec.Struct, array_like=True, gc=False):
    """``KVEventBatchRawView`` with ``BlockStoredIdsView`` for its stores; no clear (a frame with
    one is decoded fully for the flush scan anyway) and ``attn_dp_rank`` present (a
    2-element batch is not ``decode_batch_raw``'s typed view: its checked path decides)."""

    ts: float
    events: list[Union[BlockStoredIdsView, BlockRemovedRawView]]
    attn_dp_rank: int | None


class EndpointInfo(msgspec.Struct, array_like=True, gc=False):
    """One publisher endpoint (one per DP rank). ``id`` is what EventFrame.endpoint names."""

    id: int
    url: str
    replay_url: str | None = None
    dp_rank: int = 0
    topic: str = ""


class BundleRecordBase(msgspec.Struct, array_like=True, gc=False, tag=True):
    """Base of every record stored in a bundle (tag = first array element)."""


class Header(BundleRecordBase, tag="header"):
    """First record of a bundle: what was recorded, from where, with which settings."""

    format_major: int
    format_minor: int
    source: str  # "real" | "sim"
    kvcadence_version: str
    sglang_version: str | None = None
    server_info: dict[str, Any] = {}  # the whole /server_info JSON (or the sim's config)
    kv_events_config: str | None = None
    command: list[str] = []
    start_ns: int = 0
    endpoints: list[EndpointInfo] = []
    sim_config: dict[str, Any] | None = None  # effective simulator configuration (sim only)


class EventFrame(BundleRecordBase, tag="event"):
    """One ZMQ message of KV events, payload bytes exactly as received (or as simulated).

    ``payload`` is the msgpack payload inserted unchanged (``msgspec.Raw``). A payload that is
    not one complete msgpack value is stored as a msgpack *bin* wrapping the exact bytes with
    ``payload_is_bin=True`` (see ``kvcadence.format.bundle``), so nothing is ever lost.
    For sim bundles ``recv_ns`` is the virtual publish time and ``pass_index`` the scheduler
    pass that published it.
    """

    endpoint: int
    seq: int
    recv_ns: int
    topic: str
    via: int
    epoch: int
    payload_is_bin: bool
    payload: msgspec.Raw
    pass_index: int = -1


class EventFrameIdsView(BundleRecordBase, tag="event"):
    """``EventFrame`` with the common payload decoded in the frame's decode (one pass over
    its ids, not a ``Raw`` skip and a second decode): map-shaped stores and removals.
    Where this decodes, ``wire.decode_batch_raw``'s typed view of the payload does too,
    with the same events and token ids that its check accepts (msgpack encoders write a
    3-element array as ``0x93``, what that view asks for). A frame it refuses
    (``payload_is_bin``, a clear, 0.5.17 arrays, ids that are not ints, ...) comes as
    ``EventFrame`` and takes ``payload_stores``."""

    endpoint: int
    seq: int
    recv_ns: int
    topic: str
    via: int
    epoch: int
    payload_is_bin: bool
    payload: KVEventBatchIdsView
    pass_index: int = -1


#: ``RequestRecord.source`` of a request the capture's records lack, rebuilt by the replay
#: from its KV events (``replay.unrecorded``); the report counts only the other requests
UNRECORDED_SOURCE = "kv-events"


class RequestRecord(BundleRecordBase, tag="request"):
    """One request of the schedule: what was sent, what came back, when.

    Times are ``time.time_ns()`` host wall clock (virtual ns for sim bundles); ``None`` when
    unknown. ``meta_info`` keeps SGLang's whole ``meta_info`` (or the metrics line) as sent.
    """

    rid: str
    input_ids: list[int]
    output_ids: list[int] = []
    send_ns: int | None = None
    first_token_ns: int | None = None
    finish_ns: int | None = None
    lane: int | None = None
    session: int | None = None
    turn: int | None = None
    max_new_tokens: int | None = None
    prompt_tokens: int | None = None
    cached_tokens: int | None = None
    completion_tokens: int | None = None
    finish_reason: str | None = None
    error: str | None = None
    dp_rank: int | None = None
    source: str = "driver"  # driver | sglang-metrics | request-log | import | sim | kv-events
    think_ns: int | None = None  # client pause before this request (closed loop), if known
    arrival_ns: int | None = None  # open-loop trace arrival time, if the workload had one
    meta_info: dict[str, Any] = {}


class RequestRecordView(BundleRecordBase, tag="request"):
    """``RequestRecord`` as analysis ingest reads it (decode-only, never encoded): the same
    wire layout and tag, but ``input_ids``/``output_ids`` kept as their msgpack array bytes
    (``msgspec.Raw``; not validated element by element). Produced only by
    ``kvcadence.format.bundle.BundleReader.records(request_view=True)``."""

    rid: str
    input_ids: msgspec.Raw
    output_ids: msgspec.Raw = msgspec.Raw(b"\x90")  # an empty msgpack array, as RequestRecord
    send_ns: int | None = None
    first_token_ns: int | None = None
    finish_ns: int | None = None
    lane: int | None = None
    session: int | None = None
    turn: int | None = None
    max_new_tokens: int | None = None
    prompt_tokens: int | None = None
    cached_tokens: int | None = None
    completion_tokens: int | None = None
    finish_reason: str | None = None
    error: str | None = None
    dp_rank: int | None = None
    source: str = "driver"
    think_ns: int | None = None
    arrival_ns: int | None = None
    meta_info: dict[str, Any] = {}


class RequestRidView(BundleRecordBase, tag="request"):
    """A ``RequestRecord`` frame read for its rid only (the fields after it are not
    decoded): ``BundleReader.request_rids``."""

    rid: str


class PackedRequestRidView(BundleRecordBase, tag="preq"):
    """A ``PackedRequest`` frame read for its rid only (its prefix is not resolved):
    ``BundleReader.request_rids``."""

    rid: str


class RequestRecordU32View(msgspec.Struct, gc=False):
    """A format 2.0 packed request as analysis ingest reads it (never encoded or decoded):
    ``RequestRecordView``'s fields in the same order, but ``input_ids``/``output_ids`` are
    the ``array('I')`` of token ids the reader rebuilt from the shared prefix (what the
    format stores: uint32 ids), not re-encoded as msgpack for the caller to decode again.
    Produced only by ``kvcadence.format.bundle.BundleReader.records(request_view="u32")``;
    requests stored whole still come as ``RequestRecordView``."""

    rid: str
    input_ids: Any  # array('I')
    output_ids: Any  # array('I')
    send_ns: int | None = None
    first_token_ns: int | None = None
    finish_ns: int | None = None
    lane: int | None = None
    session: int | None = None
    turn: int | None = None
    max_new_tokens: int | None = None
    prompt_tokens: int | None = None
    cached_tokens: int | None = None
    completion_tokens: int | None = None
    finish_reason: str | None = None
    error: str | None = None
    dp_rank: int | None = None
    source: str = "driver"
    think_ns: int | None = None
    arrival_ns: int | None = None
    meta_info: dict[str, Any] = {}


class PackedRequest(BundleRecordBase, tag="preq"):
    """A ``RequestRecord`` as format 2.0 stores it (written only by ``BundleWriter``, read
    back as ``RequestRecord`` / ``RequestRecordView``: no reader yields it).

    The prompt is a shared prefix plus its own tail. The prefix is a chain of 32-token
    *blocks* of earlier requests of the same segment (``kvcadence.format.bundle.compact``):
    every record adds, as new blocks, the full blocks of its token sequence ``input_ids +
    output_ids`` past its prefix, numbered in write order from 0 in each segment; ``ref``
    is the last block of the prefix (-1: none) and ``prefix_len`` its token count
    (32 x the chain's length). Token ids are packed little-endian uint32 (msgpack bin).
    Every field after ``output`` is ``RequestRecord``'s, in the same order.
    """

    rid: str
    base: int  # blocks this segment held before this record (= the id of its first new block)
    ref: int  # the last block of the shared prefix, -1 when there is none
    prefix_len: int  # tokens of input_ids taken from the chain that ends at ``ref``
    input_tail: bytes  # input_ids[prefix_len:], uint32 LE
    output: bytes  # output_ids, uint32 LE
    send_ns: int | None = None
    first_token_ns: int | None = None
    finish_ns: int | None = None
    lane: int | None = None
    session: int | None = None
    turn: int | None = None
    max_new_tokens: int | None = None
    prompt_tokens: int | None = None
    cached_tokens: int | None = None
    completion_tokens: int | None = None
    finish_reason: str | None = None
    error: str | None = None
    dp_rank: int | None = None
    source: str = "driver"
    think_ns: int | None = None
    arrival_ns: int | None = None
    meta_info: dict[str, Any] = {}


class Gap(BundleRecordBase, tag="gap"):
    """Seqs ``first_seq..last_seq`` (inclusive) of one endpoint/epoch that were missed;
    ``recovered`` of them were fetched through replay (written as EventFrames)."""

    endpoint: int
    epoch: int
    first_seq: int
    last_seq: int
    recovered: int
    reason: str = ""
    recv_ns: int = 0


class Epoch(BundleRecordBase, tag="epoch"):
    """A publisher (re)started: seq went backwards or a leading AllBlocksCleared at seq 0."""

    endpoint: int
    epoch: int
    first_seq: int
    recv_ns: int
    reason: str = ""


class Annotation(BundleRecordBase, tag="note"):
    """A timestamped fact that is not an event or a request (flush issued, server_info
    snapshot refreshed, malformed ZMQ message counted, sim visibility table, ...)."""

    kind: str
    recv_ns: int
    data: dict[str, Any] = {}


class AnnotationRawView(BundleRecordBase, tag="note"):
    """``Annotation`` with ``data`` left as its msgpack bytes (decode-only: a reader pass
    that needs only some kinds' data, e.g. the flush scan's, skips decoding the rest)."""

    kind: str
    recv_ns: int
    data: msgspec.Raw = msgspec.Raw(b"\x80")  # {} as msgpack


class Trailer(BundleRecordBase, tag="trailer"):
    """Last record of a cleanly closed writer session: counts and the shutdown flag."""

    end_ns: int
    clean: bool
    counts: dict[str, int] = {}
    stats: dict[str, Any] = {}


class SegmentStart(BundleRecordBase, tag="segment"):
    """First record of every segment after segment 0 (format 1.1): which bundle the segment
    belongs to (``bundle_id``: a digest of the bundle's Header record, see
    ``kvcadence.format.bundle.bundle_identity``) and its index. The reader checks it and
    never yields it; older readers count it as an unknown record."""

    bundle_id: str
    index: int


BundleRecord = Union[Header, EventFrame, RequestRecord, Gap, Epoch, Annotation, Trailer]
#: what a reader yields: a bundle record, or a request read as a view
#: (``records(request_view=True)``; ``"u32"``: packed requests as ``RequestRecordU32View``)
ReadRecord = Union[BundleRecord, RequestRecordView, RequestRecordU32View]


def served_rank(rec: Any) -> int:
    """The DP rank that served a request record: ``dp_rank``, else ``meta_info.dp_rank``
    (SGLang's own field), else 0 (a one-rank worker records none). A value that is not a
    non-negative integer is an ``InputError`` naming the request, never guessed."""
    r = getattr(rec, "dp_rank", None)
    if r is None:
        meta = getattr(rec, "meta_info", None)
        r = meta.get("dp_rank") if isinstance(meta, dict) else None
    if r is None:
        return 0
    if type(r) is int and r >= 0:
        return r
    raise InputError(
        f"request {getattr(rec, 'rid', '?')!r}: dp_rank {r!r} is not a non-negative integer"
    )


#: the latest time in seconds an int64 of nanoseconds holds (2262-04-11): a time past it is
#: no time (``seconds``)
MAX_SECONDS = (2**63 - 1) / 1e9


def seconds(v: Any) -> float | None:
    """``v`` as a wall-clock time in seconds -- a payload's publish ``ts``, a ``meta_info``
    stamp: a number (not a bool) in (0, ``MAX_SECONDS``), else None. A KV event payload or
    an SGLang metrics line may hold anything there (JSON that Python wrote holds ``NaN``
    and ``Infinity``; a damaged or hand-made one whatever it holds): such a value is no
    time, as an absent one. Every reader that turns one into nanoseconds reads it through
    this, so none overflows an int64."""
    if type(v) is float or type(v) is int:
        return float(v) if 0 < v < MAX_SECONDS else None
    return None


def meta_seconds(meta: dict[str, Any], key: str) -> float | None:
    """``meta[key]`` (a request record's ``meta_info``) as a time in seconds (``seconds``)."""
    return seconds(meta.get(key))


#: the ``meta_info`` stamps a replay reads (absolute times; then the durations)
META_TIMES = (
    "request_received_ts",
    "forward_entry_time",
    "prefill_finished_time",
    "request_finished_ts",
    "response_sent_to_client_ts",
)
META_DURATIONS = ("e2e_latency", "first_token_latency")


def stamps_no_time(meta: dict[str, Any]) -> int:
    """How many of the stamps a replay reads (``META_TIMES``, ``META_DURATIONS``) ``meta``
    holds that are no time (present, not null, and ``seconds`` / ``meta_duration`` None):
    read as absent, and said so (``production.complete_records``' report)."""
    bad = 0
    for k in META_TIMES:
        v = meta.get(k)
        bad += v is not None and seconds(v) is None
    for k in META_DURATIONS:
        v = meta.get(k)
        bad += v is not None and meta_duration(meta, k) is None
    return bad


def meta_ns(meta: dict[str, Any], key: str) -> int | None:
    """``meta_seconds`` in nanoseconds (rounded)."""
    v = seconds(meta.get(key))
    return None if v is None else round(v * 1e9)  # a float's round is an int


def meta_duration(meta: dict[str, Any], key: str) -> float | None:
    """``meta[key]`` as a duration in seconds (``e2e_latency``, ``first_token_latency``,
    ``queue_time``): a number in [0, ``MAX_SECONDS``), else None (``meta_seconds``)."""
    v = meta.get(key)
    if type(v) is float or type(v) is int:
        return float(v) if 0 <= v < MAX_SECONDS else None
    return None


#: an eviction's cause: a prefill batch's KV, a decode step's allocation, the decode memory
#: check, a retraction's release; ``other`` only in a real worker's trace (a caller the
#: harness's trace could not place)
EVICTION_CAUSES = ("prefill", "decode", "check_decode", "retract", "other")


class EvictionTraceLine(msgspec.Struct, kw_only=True, omit_defaults=True):
    """One eviction call with a shortfall (JSON, one a line): ``t`` when (s; wall time on a
    worker, simulated time in a replay), ``cause`` (``EVICTION_CAUSES``), ``need`` the tokens
    asked of the tree (demand - available), ``avail0`` / ``avail1`` the allocator's available
    tokens before and after, ``freed`` the tokens evicted, ``rids`` the requests it was for
    (null where the worker's trace found none); a worker's line also has ``call`` (the method
    wrapped) and ``stack`` (the calling functions, innermost first)."""

    t: float
    cause: str
    need: int
    avail0: int
    avail1: int
    freed: int
    rids: list[str] | None = None
    call: str | None = None
    stack: list[str] | None = None


__all__ = [
    "BlockStoredIdsView",
    "EventFrameIdsView",
    "KVEventBatchIdsView",
    "served_rank",
    "KVCacheEvent",
    "BlockStored",
    "BlockRemoved",
    "AllBlocksCleared",
    "UnknownEvent",
    "KnownEvent",
    "Event",
    "KVEventBatch",
    "BlockStoredV17",
    "BlockRemovedV17",
    "AllBlocksClearedArr",
    "BlockStoredV05",
    "BlockRemovedV05",
    "KVEventBatchV17",
    "KVEventBatchV05",
    "BlockStoredView",
    "BlockStoredV17View",
    "KVEventBatchView",
    "KVEventBatchV17View",
    "Int64",
    "BlockStoredRawView",
    "BlockRemovedRawView",
    "BlockStoredV17RawView",
    "BlockRemovedV17RawView",
    "KVEventBatchRawView",
    "KVEventBatchV17RawView",
    "FORMAT_MAJOR",
    "FORMAT_MINOR",
    "READABLE_MAJORS",
    "LEGACY_VERSION",
    "VIA_LIVE",
    "VIA_REPLAY",
    "VIA_IMPORT",
    "VIA_SIM",
    "EndpointInfo",
    "BundleRecordBase",
    "Header",
    "EventFrame",
    "RequestRecord",
    "RequestRecordU32View",
    "RequestRidView",
    "PackedRequestRidView",
    "RequestRecordView",
    "PackedRequest",
    "Gap",
    "Epoch",
    "Annotation",
    "Trailer",
    "SegmentStart",
    "BundleRecord",
    "ReadRecord",
    "EVICTION_CAUSES",
    "EvictionTraceLine",
]
