"""Expansion bombs in compact request storage (format 2.0): a packed request may expand to at
most ``bounds.MAX_REQUEST_TOKENS`` ids, and a crafted reference is one error line, never an
allocation without bound.

* a prefix length past the limit is refused before any chain is walked or copied;
* many tiny records naming one long chain (the bomb's shape) stop at the first that
  would expand past the limit: one ``InputError`` line, exit 2 at the CLI;
* a chain longer than the prefix length says is refused without walking it to its end;
* any crafted field values make the resolver return at most the limit, or refuse;
* the writer stores a request longer than the limit whole, so what it writes reads back.
"""

from __future__ import annotations

import zlib
from array import array
from pathlib import Path

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvcadence.cli import main
from kvcadence.errors import InputError
from kvcadence.format.bounds import MAX_REQUEST_TOKENS
from kvcadence.format.bundle import (
    FRAME_HEADER,
    FRAME_HEADER_SIZE,
    SEGMENT_HEADER_SIZE,
    BundleReader,
    BundleWriter,
    compact,
    list_segments,
)
from kvcadence.format.bundle.compact import BLOCK, BadReference, LostPrefix, PrefixResolver
from kvcadence.format.schema import FORMAT_MAJOR, Header, PackedRequest, RequestRecord
from tests.test_hostile_inputs import one_error_line

_ANY = msgspec.msgpack.Decoder()
_PACKED = msgspec.msgpack.Decoder(PackedRequest)


def _write(path: Path, reqs: list[RequestRecord]) -> Path:
    h = Header(format_major=FORMAT_MAJOR, format_minor=0, source="real", kvcadence_version="t")
    with BundleWriter(path, h) as w:
        for r in reqs:
            w.write(r)
    return path


def _packed_frames(seg: Path) -> list[tuple[int, bytes]]:
    data = seg.read_bytes()
    out, pos = [], SEGMENT_HEADER_SIZE
    while pos + FRAME_HEADER_SIZE <= len(data):
        n, _ = FRAME_HEADER.unpack_from(data, pos)
        body = data[pos + FRAME_HEADER_SIZE : pos + FRAME_HEADER_SIZE + n]
        if _ANY.decode(body)[0] == "preq":
            out.append((pos, body))
        pos += FRAME_HEADER_SIZE + n
    return out


def _rewrite(path: Path, index: int, **changes: object) -> None:
    """Hand-craft the ``index``-th packed request of segment 0 (its CRC redone)."""
    seg = list_segments(path)[0]
    data = seg.read_bytes()
    pos, body = _packed_frames(seg)[index]
    new = msgspec.msgpack.encode(msgspec.structs.replace(_PACKED.decode(body), **changes))
    frame = FRAME_HEADER.pack(len(new), zlib.crc32(new)) + new
    seg.write_bytes(data[:pos] + frame + data[pos + FRAME_HEADER_SIZE + len(body) :])


def _bomb(path: Path, blocks: int, copies: int) -> Path:
    """One request of ``blocks`` full blocks, then ``copies`` requests each naming its whole
    chain plus one token: a few bytes each, ``blocks * 32 + 1`` ids each."""
    p0 = [(7 * i) % 30_000 for i in range(blocks * BLOCK)]
    reqs = [RequestRecord("seed", p0, [])]
    reqs += [RequestRecord(f"c{i}", p0 + [i], []) for i in range(copies)]
    return _write(path, reqs)


def test_a_prefix_length_past_the_limit_is_refused_before_anything_is_walked(tmp_path, capsys):
    path = _bomb(tmp_path / "b", 2, 1)
    huge = (MAX_REQUEST_TOKENS // BLOCK + 1) * BLOCK
    _rewrite(path, 1, prefix_len=huge)
    with pytest.raises(InputError, match="rid='c0'") as exc:
        BundleReader(path).requests()
    msg = str(exc.value)
    assert f"expands to {huge + 1} token ids" in msg and "MAX_REQUEST_TOKENS" in msg
    assert main(["inspect", str(path)]) == 2
    assert "expands to" in one_error_line(capsys.readouterr().err)


def test_tiny_records_naming_one_long_chain_stop_at_the_limit(tmp_path, capsys, monkeypatch):
    # the real limit needs 16 MB of stored ids to reach; the same shape at a limit of 1,280:
    # the seed's chain (1,280 ids) is within it, each tiny record naming it (+1 id) is not
    path = _bomb(tmp_path / "b", 40, 200)  # 200 records of ~40 bytes, 1,281 ids each
    assert list_segments(path)[0].stat().st_size < 20_000
    assert [r.rid for r in BundleReader(path).requests()][:2] == ["seed", "c0"]
    monkeypatch.setattr(compact, "MAX_REQUEST_TOKENS", 40 * BLOCK)
    with pytest.raises(InputError, match="rid='c0'.*expands to 1281 token ids"):
        BundleReader(path).requests()
    for argv in (["inspect", str(path)], ["sql", str(path), "SELECT count(*) FROM requests"]):
        assert main(argv) == 2
        assert "more than the 1280 a request may hold" in one_error_line(capsys.readouterr().err)


def test_a_chain_longer_than_its_prefix_length_is_refused(tmp_path):
    path = _bomb(tmp_path / "b", 40, 1)
    _rewrite(path, 1, prefix_len=BLOCK)  # names block 39: a chain of 40 blocks
    with pytest.raises(InputError, match="prefix length 32 but block 39 ends a longer chain"):
        BundleReader(path).requests()


def test_a_request_longer_than_the_limit_is_stored_whole_and_reads_back(tmp_path, monkeypatch):
    monkeypatch.setattr(compact, "MAX_REQUEST_TOKENS", 100)
    short = RequestRecord("short", list(range(64)), [1, 2])
    long = RequestRecord("long", list(range(64)) + [5] * 40, [3])  # 105 ids
    path = _write(tmp_path / "b", [short, long])
    tags = [_ANY.decode(b)[0] for _, b in _packed_frames(list_segments(path)[0])]
    assert tags == ["preq"]  # only the short one is packed
    assert BundleReader(path).requests() == [short, long]


_FIELDS = st.fixed_dictionaries(
    {
        "base": st.integers(-2, 400),
        "ref": st.integers(-3, 400),
        "prefix_len": st.integers(-BLOCK, 12 * BLOCK),
        "tail": st.integers(0, 3 * BLOCK),
        "out": st.integers(0, 2 * BLOCK),
    }
)


@settings(max_examples=300, deadline=None)
@given(st.lists(_FIELDS, min_size=1, max_size=30), st.integers(64, 400))
def test_crafted_references_expand_to_at_most_the_limit_or_are_refused(recs, limit):
    res = PrefixResolver()
    saved = compact.MAX_REQUEST_TOKENS
    compact.MAX_REQUEST_TOKENS = limit
    try:
        for f in recs:
            res.max_blocks = max(res.max_blocks, res.blocks) + 4
            rec = PackedRequest(
                "x",
                f["base"],
                f["ref"],
                f["prefix_len"],
                array("I", [3] * f["tail"]).tobytes(),
                array("I", [4] * f["out"]).tobytes(),
            )
            try:
                inp, out = res.resolve(rec)
            except (BadReference, LostPrefix):
                continue
            assert len(inp) + len(out) <= limit
            assert len(inp) == f["prefix_len"] + f["tail"]
            runs = [*res.run_first, res.blocks]
            read = [runs[i + 1] - runs[i] for i, o in enumerate(res.run_offset) if o >= 0]
            assert len(res.store) == BLOCK * sum(read)
    finally:
        compact.MAX_REQUEST_TOKENS = saved


class _PerBlockResolver:
    """The resolver as first written: a parent and an offset per block, the chain walked a
    block at a time. The model ``PrefixResolver`` (a run per record) must agree with."""

    def __init__(self) -> None:
        self.max_blocks = 0
        self.store = array("I")
        self.parent = array("q")
        self.offset = array("q")

    def resolve(self, rec: PackedRequest) -> tuple[array, array]:
        base, ref, plen = rec.base, rec.ref, rec.prefix_len
        offset, parent = self.offset, self.parent
        known = len(offset)
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
        n_ids = plen + len(rec.input_tail) // 4 + len(rec.output) // 4
        if n_ids > compact.MAX_REQUEST_TOKENS:
            raise BadReference(f"it expands to {n_ids} token ids")
        if base > known:
            offset.extend([-1] * (base - known))
            parent.extend([-1] * (base - known))
        chain: list[int] = []
        b = ref
        while b >= 0:
            if len(chain) == plen // BLOCK:
                raise BadReference(
                    f"prefix length {plen} but block {ref} ends a longer chain than that"
                )
            if offset[b] == -1:
                raise LostPrefix(f"its shared prefix (block {b}) was in a record not read")
            chain.append(offset[b])
            b = parent[b]
        if len(chain) * BLOCK != plen:
            raise BadReference(
                f"prefix length {plen} but block {ref} ends a chain of {len(chain) * BLOCK} tokens"
            )
        tail, out = (
            compact._unpack(rec.input_tail, "input_tail"),
            compact._unpack(rec.output, "output"),
        )
        inp = array("I")
        for o in reversed(chain):
            inp.extend(self.store[o : o + BLOCK])
        inp.extend(tail)
        new = (plen + len(tail) + len(out)) // BLOCK - plen // BLOCK
        if new > 0:
            at = len(self.store)
            self.store.extend((tail + out)[: new * BLOCK])
            offset.extend(range(at, at + new * BLOCK, BLOCK))
            parent.append(ref)
            parent.extend(range(base, base + new - 1))
        return inp, out


def _outcome(res: object, rec: PackedRequest) -> object:
    try:
        inp, out = res.resolve(rec)  # type: ignore[attr-defined]
    except (BadReference, LostPrefix) as exc:
        return type(exc).__name__, str(exc).split(" (")[0]
    return inp.tolist(), out.tolist()


# chains over earlier records: a ref among the blocks so far (or none), a prefix length that
# is the chain's (mostly) or one block off, now and then a gap (blocks lost to damage)
_CHAINED = st.fixed_dictionaries(
    {
        "gap": st.sampled_from([0] * 12 + [1, 3]),
        "ref": st.floats(0, 1) | st.none(),
        "off": st.sampled_from([0] * 6 + [-1, 1]),
        "tail": st.integers(0, 3 * BLOCK),
        "out": st.integers(0, 2 * BLOCK),
        "odd": st.sampled_from([0] * 20 + [1]),
    }
)


def _chain_blocks(old: _PerBlockResolver, b: int) -> int:
    n = 0
    while b >= 0:
        n, b = n + 1, old.parent[b]
    return n


@settings(max_examples=300, deadline=None)
@given(st.lists(_CHAINED, min_size=1, max_size=40))
def test_run_resolver_agrees_with_the_per_block_walk(recs):
    """Ids, verdicts and messages of the run-based resolver equal a block-at-a-time walk on
    records that share prefixes, skip blocks (damage) and name chains of the wrong length."""
    new, old = PrefixResolver(), _PerBlockResolver()
    tok = 0
    for f in recs:
        base = new.blocks + f["gap"]
        ref = -1 if f["ref"] is None or not new.blocks else int(f["ref"] * (new.blocks - 1))
        blocks = max(0, _chain_blocks(old, ref) + f["off"]) if ref >= 0 else max(0, f["off"])
        new.max_blocks = old.max_blocks = base + 4
        ids = array("I", range(tok, tok + f["tail"]))
        tok += f["tail"] + f["out"]
        rec = PackedRequest(
            "x",
            base,
            ref,
            blocks * BLOCK,
            ids.tobytes() + b"\x01" * f["odd"],
            array("I", range(tok - f["out"], tok)).tobytes(),
        )
        assert _outcome(new, rec) == _outcome(old, rec)
        assert new.blocks == len(old.offset)
        assert new.store == old.store
