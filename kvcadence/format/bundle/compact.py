"""Compact request storage (format 2.0): shared prompt prefixes and packed token ids.

What this file owns: the conversion ``RequestRecord`` <-> ``PackedRequest`` (layout in
``kvcadence.format.schema``, specified in ``docs/format.md``), i.e. the writer's
``PrefixIndex`` (which earlier blocks a new prompt starts with), the reader's
``PrefixResolver`` (a record back to its full token ids) and ``SegmentUnpacker`` (what the
reader calls per packed frame: errors and damage), the uint32 packing, and the msgpack
int-array bytes the view path hands out.

Blocks. Inside one segment, every request record adds as new *blocks* the full
``BLOCK``-token blocks of its token sequence ``input_ids + output_ids`` that lie past its
shared prefix, numbered in write order from 0 (``PackedRequest.base`` is the number of the
record's first one). A block's parent is the block before it in that sequence, so a block
names a whole prefix: a record stores ``ref`` (the last block of its prefix) and its own
tokens after the prefix. The numbering restarts in every segment, so a reference never
leaves its segment: a lost or refused segment costs its own records, never a later one's.

Memory. The writer keeps per block it wrote one dict entry ``parent number + the block's
token bytes -> number`` and the block's bytes once more in its record's run, the reader
three ints per record (its run of new blocks) plus the blocks' tokens as one
``array('I')``: both grow with the tokens the segment actually stores, never with the
prompts' total length. Per request the writer looks the prompt's full blocks up until the
first one it has not seen (a dict lookup, then one slice comparison along the run the block
belongs to), the reader walks the prefix chain a run at a time and copies each run's part
as one slice.

Expansion. A packed request is a few bytes that name a chain of earlier blocks, so it may
expand to far more ids than it occupies. The reader refuses (``BadReference``, one
``InputError`` line) a packed request whose ``prefix_len`` + own ids exceed
``format.bounds.MAX_REQUEST_TOKENS`` before walking or copying anything, and walks a chain no
further than ``prefix_len`` says; references point only backwards within the segment (no
cycle can be named), and ``prefix_len`` must be exactly the named chain's length. Since a
block chain is at most one earlier request's ids, no request expands past the limit; the
writer stores a longer request whole (``RequestRecord``), so all it writes reads back.
"""

from __future__ import annotations

import struct
import sys
from array import array
from bisect import bisect_right
from collections.abc import Callable
from pathlib import Path

import msgspec

from kvcadence.errors import InputError
from kvcadence.format.bounds import MAX_REQUEST_TOKENS
from kvcadence.format.bundle.frames import FRAME_HEADER_SIZE
from kvcadence.format.bundle.report import ReadReport
from kvcadence.format.schema import (
    PackedRequest,
    RequestRecord,
    RequestRecordU32View,
    RequestRecordView,
)

#: tokens per block (fixed by the format: 2.0)
BLOCK = 32
#: the writer starts a new segment once its index holds this many blocks (8M stored tokens):
#: a writer policy, not a format rule, that bounds the memory of the writer's index
#: (~90 MB) and of a reader's resolver (~40 MB) however long a capture runs
MAX_BLOCKS = 1 << 18
_BLOCK_BYTES = 4 * BLOCK
_LITTLE = sys.byteorder == "little"
_MISSING = -1  # offset of a block whose record the reader did not read (lost to damage)
# fields after the ids: identical in RequestRecord, RequestRecordView and PackedRequest
_ID_FIELDS = 3  # rid, input_ids, output_ids
_PACKED_HEAD = 6  # rid, base, ref, prefix_len, input_tail, output

if array("I").itemsize != 4:  # pragma: no cover - every platform CPython supports today
    raise ImportError("kvcadence needs a 4-byte array('I')")


class BadReference(ValueError):
    """A packed request that cannot be what a writer wrote (a dangling or malformed
    reference): the reader turns it into one ``InputError`` line."""


class LostPrefix(Exception):
    """A packed request whose prefix runs through blocks of records the reader did not read
    (lost in a corrupt span): damage, reported like a corrupt frame."""


def pack_u32(ids: list[int]) -> array[int] | None:
    """``ids`` as an ``array('I')``, or None when one is not an int in 0..2^32-1."""
    try:
        return array("I", ids)
    except (OverflowError, TypeError):
        return None


def _le(a: array[int]) -> bytes:
    if _LITTLE:
        return a.tobytes()
    b = array("I", a)  # pragma: no cover - big-endian hosts
    b.byteswap()  # pragma: no cover
    return b.tobytes()  # pragma: no cover


def _unpack(data: bytes, what: str) -> array[int]:
    if len(data) % 4:
        raise BadReference(f"{what} is {len(data)} bytes, not a whole number of uint32 ids")
    a = array("I")
    a.frombytes(data)
    if not _LITTLE:  # pragma: no cover - big-endian hosts
        a.byteswap()
    return a


def msgpack_uint_array(a: array[int]) -> bytes:
    """The msgpack array of ``a``'s ids (each a uint32, ``0xce`` + 4 bytes big-endian): the
    ``msgspec.Raw`` a ``RequestRecordView`` carries, built without a Python int per id."""
    n = len(a)
    if n < 16:
        head = bytes((0x90 | n,))
    elif n < 1 << 16:
        head = b"\xdc" + n.to_bytes(2, "big")
    else:
        head = b"\xdd" + n.to_bytes(4, "big")
    be = array("I", a)
    if _LITTLE:
        be.byteswap()
    raw = be.tobytes()
    out = bytearray(5 * n)
    out[0::5] = b"\xce" * n
    for k in range(4):
        out[k + 1 :: 5] = raw[k::4]
    return head + bytes(out)


class PrefixIndex:
    """The writer's side: which blocks of this segment exist, as a dict ``parent number (8
    bytes) + the block's 4 * BLOCK token bytes -> number`` (exact: a match compares the
    bytes, no digest can collide), and each written record's new blocks as one *run* of
    bytes.

    A match walks the dict block by block, but once it is on a block it continues along
    that block's run with one slice comparison (the blocks one record added are a chain,
    and an agent's next prompt goes on along the previous turn's run): a few lookups per
    turn of history instead of one per 32 tokens.

    ``pack`` builds the ``PackedRequest`` of a record and returns, with it, the callable that
    adds the record's new blocks; the writer calls it only once the frame is written (a
    record that is not written, or is written after a rotation to a fresh index, adds none).
    """

    def __init__(self) -> None:
        # keys are bytes (parent number as 8 bytes + the block's bytes), never tuples: the
        # index creates no object the cyclic GC tracks (a writer that holds many records,
        # e.g. ``import``, would otherwise pay full collections over them)
        self._ids: dict[bytes, int] = {}
        self._runs: list[bytes] = []  # per written record with new blocks: their bytes
        self._run_first = array("q")  # per run: the number of its first block
        self._run_of = array("q")  # per block: its run
        self.blocks = 0

    def pack(self, rec: RequestRecord) -> tuple[PackedRequest, _Commit] | None:
        """``(packed record, commit)``; None when an id does not fit a uint32 or the record
        holds more than ``bounds.MAX_REQUEST_TOKENS`` ids (it is then written as a
        ``RequestRecord``, which this format also reads)."""
        if len(rec.input_ids) + len(rec.output_ids) > MAX_REQUEST_TOKENS:
            return None  # stored whole: a reader refuses a packed one this long
        inp = pack_u32(rec.input_ids)
        out = pack_u32(rec.output_ids)
        if inp is None or out is None:
            return None
        seq = _le(inp) + _le(out)
        get = self._ids.get
        runs, run_first, run_of = self._runs, self._run_first, self._run_of
        bb = _BLOCK_BYTES
        ref = -1
        m = 0  # full prompt blocks found so far
        full = len(inp) // BLOCK
        while m < full:
            found = get(_parent(ref) + seq[m * bb : (m + 1) * bb])
            if found is None:
                break
            ref = found
            m += 1
            r = run_of[found]
            run = runs[r]
            p = found - run_first[r] + 1  # the run's next block
            k = _common_blocks(run, p * bb, seq, m * bb, min(len(run) // bb - p, full - m))
            ref += k
            m += k
        prefix = m * BLOCK
        packed = PackedRequest(
            rec.rid,
            self.blocks,
            ref,
            prefix,
            seq[4 * prefix : 4 * len(inp)],
            seq[4 * len(inp) :],
            *msgspec.structs.astuple(rec)[_ID_FIELDS:],
        )
        return packed, _Commit(self, seq, m, ref)


_parent = struct.Struct("<q").pack
_astuple = msgspec.structs.astuple


def _common_blocks(a: bytes, i: int, b: bytes, j: int, k: int) -> int:
    """How many whole blocks ``a[i:]`` and ``b[j:]`` share, at most ``k``: one slice
    comparison when all ``k`` are equal, a binary search otherwise."""
    bb = _BLOCK_BYTES
    if k <= 0:
        return 0
    if a[i : i + k * bb] == b[j : j + k * bb]:
        return k
    lo, hi = 0, k  # a[i : i + lo * bb] matches, a[i : i + hi * bb] does not
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if a[i : i + mid * bb] == b[j : j + mid * bb]:
            lo = mid
        else:
            hi = mid
    return lo


class _Commit:
    """Adds a written record's new blocks to its ``PrefixIndex`` (see ``PrefixIndex.pack``)."""

    __slots__ = ("index", "m", "ref", "seq")

    def __init__(self, index: PrefixIndex, seq: bytes, m: int, ref: int) -> None:
        self.index, self.seq, self.m, self.ref = index, seq, m, ref

    def __call__(self) -> None:
        index, seq, parent, m = self.index, self.seq, self.ref, self.m
        bb = _BLOCK_BYTES
        end = len(seq) // bb
        if end <= m:
            return
        ids = index._ids
        first = n = index.blocks
        for j in range(m, end):
            ids[_parent(parent) + seq[j * bb : (j + 1) * bb]] = n
            parent = n
            n += 1
        index._run_of.extend(array("q", [len(index._runs)]) * (end - m))
        index._run_first.append(first)
        index._runs.append(seq[m * bb : end * bb])
        index.blocks = n


class PrefixResolver:
    """The reader's side, one per segment: ``PackedRequest`` -> its full token ids.

    Keeps the tokens of every block in ``store`` (numbering order) and, per *run* (the new
    blocks one record added: consecutive numbers, contiguous in ``store``, each block's
    parent the one before it), its first block's number, the offset of its tokens and the
    first block's parent (the record's ``ref``). Blocks of records that were not read form a
    run at offset ``_MISSING``. A block's run is found by bisection, and a prefix chain is
    walked a run at a time (one slice copied per run, not a step per block).
    """

    def __init__(self) -> None:
        # the most blocks the segment can hold before the record being resolved (the reader
        # sets it: a crafted ``base`` must not make it allocate a placeholder per claimed block)
        self.max_blocks = 0
        self.store = array("I")
        #: per run: number of its first block, offset of its tokens in ``store``, the first
        #: block's parent
        self.run_first = array("q")
        self.run_offset = array("q")
        self.run_parent = array("q")
        #: blocks numbered so far (read or missing): the next record's ``base``
        self.blocks = 0

    def resolve(self, rec: PackedRequest) -> tuple[array[int], array[int]]:
        """``(input_ids, output_ids)`` of ``rec``; adds its blocks. ``BadReference`` for a
        record no writer wrote, ``LostPrefix`` when its prefix was lost with damage.

        Runs once per request a reader yields (hundreds of thousands per bundle), so the
        usual record -- no shared prefix, every earlier block read, its ids whole uint32s
        within the limit -- takes a short path that passes every check of the general one
        (``_resolve``) by construction and does what it does."""
        it, ob = rec.input_tail, rec.output
        base = rec.base
        if (
            rec.ref == -1
            and not rec.prefix_len
            and base == self.blocks
            and base <= self.max_blocks
            and type(it) is bytes
            and type(ob) is bytes
            and _LITTLE
        ):
            li, lo = len(it), len(ob)
            if not (li | lo) & 3 and (li + lo) >> 2 <= MAX_REQUEST_TOKENS:
                tail = array("I", it)  # bytes: the initializer goes to frombytes
                out = array("I", ob)
                nb = (li + lo) // _BLOCK_BYTES * _BLOCK_BYTES  # the new blocks' bytes
                if nb:
                    store = self.store
                    at = len(store)
                    if nb <= li:
                        store.frombytes(it[:nb])
                    else:
                        store.frombytes(it)
                        store.frombytes(ob[: nb - li])
                    self.run_first.append(base)
                    self.run_offset.append(at)
                    self.run_parent.append(-1)
                    self.blocks = base + nb // _BLOCK_BYTES
                return tail, out
        return self._resolve(rec)

    def _resolve(self, rec: PackedRequest) -> tuple[array[int], array[int]]:
        """``resolve``, every case: the checks in a fixed order (the first that fails names
        the error), the prefix chain walked (``_chain``) and copied a run at a time."""
        base, ref, plen = rec.base, rec.ref, rec.prefix_len
        it, ob = rec.input_tail, rec.output
        known = self.blocks
        if base < known:
            raise BadReference(f"its first block is numbered {base}, {known} were read before it")
        if base > self.max_blocks:
            raise BadReference(
                f"its first block is numbered {base}, more than the bytes before it can hold"
            )
        if not -1 <= ref < base:
            raise BadReference(f"reference to block {ref}, which is not before block {base}")
        if plen < 0 or plen % BLOCK:
            raise BadReference(f"prefix length {plen} is not a multiple of {BLOCK}")
        n_ids = plen + len(it) // 4 + len(ob) // 4
        if n_ids > MAX_REQUEST_TOKENS:  # checked before anything is walked or copied
            raise BadReference(
                f"it expands to {n_ids} token ids, more than the {MAX_REQUEST_TOKENS} a "
                "request may hold (kvcadence.format.bounds.MAX_REQUEST_TOKENS)"
            )
        run_first, run_offset, run_parent = self.run_first, self.run_offset, self.run_parent
        if base > known:  # records between were not read: their blocks are unknown
            run_first.append(known)
            run_offset.append(_MISSING)
            run_parent.append(-1)
            self.blocks = base
        spans = self._chain(ref, plen)  # the chain's runs, last first: store slices
        tail = _unpack(it, "input_tail")
        out = _unpack(ob, "output")
        store = self.store
        if spans:
            inp = array("I")
            for lo, hi in reversed(spans):
                inp.extend(store[lo:hi])
            inp.extend(tail)
        else:
            inp = tail  # no prefix: the tail is the whole prompt (a fresh array)
        # the record's new blocks: full blocks of input + output past the prefix
        new = (plen + len(tail) + len(out)) // BLOCK - plen // BLOCK
        if new > 0:
            at = len(store)
            store.extend(tail)
            store.extend(out)
            del store[at + new * BLOCK :]
            run_first.append(base)
            run_offset.append(at)
            run_parent.append(ref)
            self.blocks = base + new
        return inp, out

    def _chain(self, ref: int, plen: int) -> list[tuple[int, int]]:
        """The ``store`` slices of the prefix chain that ends at block ``ref`` (-1: none),
        its runs last first, walked a run at a time and no further than ``plen`` tokens;
        ``BadReference`` when the chain's length is not ``plen``, ``LostPrefix`` when it runs
        through blocks of a record not read."""
        run_first, run_offset, run_parent = self.run_first, self.run_offset, self.run_parent
        spans: list[tuple[int, int]] = []
        n = 0  # blocks of the chain so far
        limit = plen // BLOCK
        b = ref
        while b >= 0:  # parents always have smaller numbers: the walk ends
            if n == limit:  # longer than it says: walked no further than plen
                raise BadReference(
                    f"prefix length {plen} but block {ref} ends a longer chain than that"
                )
            r = bisect_right(run_first, b) - 1
            o = run_offset[r]
            if o == _MISSING:
                raise LostPrefix(f"its shared prefix (block {b}) was in a record not read")
            k = b - run_first[r] + 1  # the run's blocks up to b: contiguous tokens
            if n + k > limit:
                raise BadReference(
                    f"prefix length {plen} but block {ref} ends a longer chain than that"
                )
            spans.append((o, o + k * BLOCK))
            n += k
            b = run_parent[r]
        if n * BLOCK != plen:
            raise BadReference(
                f"prefix length {plen} but block {ref} ends a chain of {n * BLOCK} tokens"
            )
        return spans

    def record(self, rec: PackedRequest) -> RequestRecord:
        """The ``RequestRecord`` that was written."""
        inp, out = self.resolve(rec)
        rest = msgspec.structs.astuple(rec)[_PACKED_HEAD:]
        return RequestRecord(rec.rid, inp.tolist(), out.tolist(), *rest)

    def arrays(self, rec: PackedRequest) -> RequestRecord:
        """The ``RequestRecord`` that was written, its ids the ``array('I')`` resolved (not
        made lists: ``BundleReader.request_arrays``)."""
        inp, out = self.resolve(rec)
        return RequestRecord(rec.rid, inp, out, *_astuple(rec)[_PACKED_HEAD:])  # type: ignore[arg-type]

    def view(self, rec: PackedRequest) -> RequestRecordView:
        """The ``RequestRecordView`` of the record (ids as msgpack arrays)."""
        inp, out = self.resolve(rec)
        rest = msgspec.structs.astuple(rec)[_PACKED_HEAD:]
        return RequestRecordView(
            rec.rid,
            msgspec.Raw(msgpack_uint_array(inp)),
            msgspec.Raw(msgpack_uint_array(out)),
            *rest,
        )

    def u32(self, rec: PackedRequest) -> RequestRecordU32View:
        """The ``RequestRecordU32View`` of the record (ids as the ``array('I')`` resolved)."""
        inp, out = self.resolve(rec)
        return RequestRecordU32View(rec.rid, inp, out, *msgspec.structs.astuple(rec)[_PACKED_HEAD:])


class SegmentUnpacker:
    """The reader's: one segment's ``PackedRequest``s back to ``RequestRecord`` /
    ``RequestRecordView`` (a ``PrefixResolver`` made at the segment's first one), counted in
    the ``ReadReport``; ``views``: False (``RequestRecord``), True (``RequestRecordView``),
    ``"u32"`` (``RequestRecordU32View``) or ``"arrays"`` (``RequestRecord`` with ``array('I')``
    ids). A request whose prefix was lost with a corrupt span counts as a
    corrupt frame (``corrupt``, the reader's reporter; ``None``: not yielded); a reference no
    writer wrote is one ``InputError`` line naming segment, offset and rid."""

    __slots__ = ("corrupt", "report", "resolver", "seg", "views")

    def __init__(
        self,
        seg: Path,
        report: ReadReport,
        views: bool | str,
        corrupt: Callable[[ReadReport, Path, int, int, str], None],
    ) -> None:
        self.seg, self.report, self.views, self.corrupt = seg, report, views, corrupt
        self.resolver: PrefixResolver | None = None

    def __call__(
        self, rec: PackedRequest, pos: int, body: memoryview
    ) -> RequestRecord | RequestRecordView | RequestRecordU32View | None:
        res = self.resolver
        if res is None:
            res = self.resolver = PrefixResolver()
        # every block read before this record has its 4 * BLOCK token bytes before ``pos``
        res.max_blocks = pos // _BLOCK_BYTES
        try:
            views = self.views
            if views == "u32":  # ``res.u32`` inlined: one call less per request
                inp, ids = res.resolve(rec)
                out: RequestRecord | RequestRecordView | RequestRecordU32View = (
                    RequestRecordU32View(rec.rid, inp, ids, *_astuple(rec)[_PACKED_HEAD:])
                )
            elif views == "arrays":
                out = res.arrays(rec)
            else:
                out = res.view(rec) if views else res.record(rec)
        except LostPrefix as exc:
            self.report.frames -= 1
            self.corrupt(
                self.report, self.seg, pos, FRAME_HEADER_SIZE + len(body), f"request {exc}"
            )
            return None
        except BadReference as exc:
            raise InputError(
                f"{self.seg}: request record rid={rec.rid!r} at offset {pos}: bad shared-prefix "
                f"reference: {exc}"
            ) from None
        rep = self.report
        rep.packed_requests += 1
        stored = len(rec.input_tail) + len(rec.output)
        rep.packed_bytes += stored
        rep.packed_ids += rec.prefix_len + stored // 4
        return out


__all__ = [
    "SegmentUnpacker",
    "BLOCK",
    "BadReference",
    "LostPrefix",
    "PrefixIndex",
    "PrefixResolver",
    "msgpack_uint_array",
    "pack_u32",
]
