"""Ingest: Parquet columns from hand-made bundles, dedupe, u64 hashes, the cache."""

from __future__ import annotations

from pathlib import Path

import pyarrow.parquet as pq
import pytest

from kvcadence.analysis import ingest, records, sql
from kvcadence.errors import InputError, UsageError
from kvcadence.format import wire
from kvcadence.format.bundle import BundleWriter
from kvcadence.format.schema import BlockStored, KVEventBatch, RequestRecord
from kvcadence.gcpause import gc_paused
from tests.analysis.helpers import T0, cleared, header, removed, stored, write_bundle

NEG = -3488128144981237669  # a real SGLang hash (negative int64)


def _small(tmp_path: Path) -> Path:
    return write_bundle(
        tmp_path / "b",
        [
            (0, [cleared()]),
            (10, [stored([NEG, 5], page_size=4), stored([7], page_size=4, parent=5)]),
            (20, [removed([NEG])]),
        ],
        [RequestRecord(rid="r0", input_ids=[1, 2, 3], output_ids=[4, 5], cached_tokens=0)],
        hdr=header(page_size=4),
    )


def test_tables_columns_and_hashes(tmp_path: Path) -> None:
    ing = ingest.ingest(_small(tmp_path))
    assert ing.rebuilt
    b = pq.read_table(ing.path("batches")).to_pydict()
    assert b["seq"] == [0, 1, 2]
    assert b["n_events"] == [1, 2, 1]
    assert b["n_stored"] == [0, 2, 0]
    assert b["recv_ns"][1] == T0 + 10_000_000
    assert b["ts"] == [0.0, 0.01, 0.02]
    e = pq.read_table(ing.path("events")).to_pydict()
    assert e["kind"] == ["cleared", "stored", "stored", "removed"]
    assert e["n_blocks"] == [0, 2, 1, 1]
    assert e["first_hash"][1] == wire.u64(NEG)
    assert e["parent_hash"][2] == 5
    assert e["n_tokens"] == [None, 8, 4, None]
    k = pq.read_table(ing.path("blocks"))
    assert str(k.schema.field("hash").type) == "uint64"
    kd = k.to_pydict()
    assert kd["hash"] == [wire.u64(NEG), 5, 7, wire.u64(NEG)]
    assert kd["pos"] == [0, 1, 0, 0]
    assert kd["event_id"] == [1, 1, 2, 3]
    assert kd["n_tokens"] == [4, 4, 4, None]
    r = pq.read_table(ing.path("requests")).to_pydict()
    assert "input_ids" not in r and r["n_input"] == [3] and r["n_output"] == [2]
    assert ing.info["page_size"] == 4 and ing.info["clean_shutdown"] is True


def test_request_ids_are_kept_while_they_are_small(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The token ids (``request_ids``, ``ON_DEMAND``) stay in a default cache while they are
    no bigger than the bundle (``IDS_BUDGET``); past it they are dropped, and a cache asked
    for them is rebuilt with them and then serves every later ingest."""
    from kvcadence.analysis import cache

    b = _small(tmp_path)
    assert ingest.ingest(b).manifest["ids"] is True  # 5 ids, a bundle of some KB
    monkeypatch.setattr(cache, "IDS_BUDGET", 0.0)  # every id past the budget
    ing = ingest.ingest(b, force=True)
    assert not ing.path("request_ids").exists() and ing.manifest["ids"] is False
    assert "request_ids" not in ing.manifest["tables"]
    shown = [t for (t,) in sql.connect(ing).sql("SHOW TABLES").fetchall()]
    assert "requests" in shown and "request_ids" not in shown
    assert not ingest.ingest(b).rebuilt  # a default ingest takes the cache as it is
    with_ids = ingest.ingest(b, ids=True)
    assert with_ids.rebuilt and with_ids.manifest["ids"] is True
    r = pq.read_table(with_ids.path("request_ids")).to_pydict()
    assert r == {"request_id": [0], "input_ids": [[1, 2, 3]], "output_ids": [[4, 5]]}
    again = ingest.ingest(b)
    assert not again.rebuilt and again.path("request_ids").exists()
    got = sql.connect(again).sql(
        "SELECT rid, input_ids FROM requests JOIN request_ids USING (request_id)"
    )
    assert got.fetchall() == [("r0", [1, 2, 3])]
    assert not ingest.ingest(b, ids=False).rebuilt


def test_schema_dict_matches_written_tables(tmp_path: Path) -> None:
    ing = ingest.ingest(_small(tmp_path), ids=True)
    for table in ingest.TABLES:
        assert pq.read_schema(ing.path(table)).names == [c for c, _, _ in ingest.TABLES[table]]


def test_cache_reused_and_rebuilt_when_bundle_changes(tmp_path: Path) -> None:
    b = _small(tmp_path)
    assert ingest.ingest(b).rebuilt
    assert not ingest.ingest(b).rebuilt
    w = BundleWriter.append(b)
    w.write(RequestRecord(rid="r1", input_ids=[9], output_ids=[]))
    w.close()
    again = ingest.ingest(b)
    assert again.rebuilt and again.manifest["tables"]["requests"] == 2


def test_duplicates_dropped_and_undecodable_counted(tmp_path: Path) -> None:
    payload = wire.encode_batch(
        __import__("kvcadence.format.schema", fromlist=["KVEventBatch"]).KVEventBatch(
            1.0, [stored([1])], 0
        )
    )
    with BundleWriter(tmp_path / "d", header()) as w:
        for seq in (0, 1, 1):
            w.write_event(
                endpoint=0, seq=seq, recv_ns=T0 + seq, topic="", payload=payload, via=0, epoch=0
            )
        w.write_event(
            endpoint=0, seq=2, recv_ns=T0 + 2, topic="", payload=b"\xc1garbage", via=0, epoch=0
        )
    ing = ingest.ingest(tmp_path / "d")
    assert ing.info["duplicates"] == 1
    assert ing.info["undecodable_payloads"] == 1
    b = pq.read_table(ing.path("batches")).to_pydict()
    assert b["seq"] == [0, 1, 2] and b["decode_ok"] == [True, True, False]


def test_missing_bundle_is_usage_error(tmp_path: Path) -> None:
    with pytest.raises(UsageError):
        ingest.ingest(tmp_path / "nope")


def _tables_both_ways(bundle: Path) -> tuple[dict, dict]:
    """build_tables through the view path and through the ordinary RequestRecord path."""
    with gc_paused():
        fast = records._build_tables(bundle, views=True, ids=True)[0]
        slow = records._build_tables(bundle, views=False, ids=True)[0]
    return fast, slow


def test_request_view_path_equals_ordinary_path(tmp_path: Path) -> None:
    """Token ids converted from raw msgpack (chunked) == ids read as RequestRecord lists."""
    import random

    rng = random.Random(3)
    reqs = []
    for i in range(3000):  # several RawIdColumns chunks, long and empty id lists
        n = rng.choice([0, 1, 15, 16, 200, rng.randrange(1, 4000)])
        ids = [rng.choice([rng.randrange(128), rng.randrange(2**17), -rng.randrange(2**40)])]
        ids = (ids * n)[:n]
        reqs.append(
            RequestRecord(rid=f"r{i}", input_ids=ids, output_ids=ids[: i % 7], send_ns=i or None)
        )
    b = write_bundle(tmp_path / "b", [(0, [cleared()])], reqs, hdr=header())
    fast, slow = _tables_both_ways(b)
    assert fast.keys() == slow.keys()
    for name in fast:
        assert fast[name].equals(slow[name]), name
    got = fast["request_ids"].column("input_ids").to_pylist()
    assert got == [r.input_ids for r in reqs]


def _write_raw_request(path: Path, ids: list, good: RequestRecord) -> Path:
    """A bundle with one good request and one whose ids the typed decoder refuses (Struct
    construction does not type-check, so the bad ids are written as given)."""
    with BundleWriter(path, header()) as w:
        w.write(good)
        w.write(RequestRecord(rid="bad", input_ids=ids, output_ids=[]))
    return path


def test_non_int_ids_fall_back_to_the_ordinary_reader(tmp_path: Path) -> None:
    """Ids that are not ints: the whole ingest reads the ordinary way (RequestRecord), so the
    frame gets exactly the verdict every other reader gives it (not a request row)."""
    good = RequestRecord(rid="ok", input_ids=[1, 2, 300], output_ids=[5])
    b = _write_raw_request(tmp_path / "b", [1, 2.5], good)
    ing = ingest.ingest(b, ids=True)
    r = pq.read_table(ing.path("requests")).to_pydict()
    assert r["rid"] == ["ok"] and r["n_input"] == [3]
    assert pq.read_table(ing.path("request_ids")).column("input_ids").to_pylist() == [[1, 2, 300]]
    with gc_paused():
        slow, slow_info = records._build_tables(b, views=False, ids=True)
    for name in slow:
        assert pq.read_table(ing.path(name)).equals(slow[name]), name
    assert ing.info["corrupt_frames"] == slow_info["corrupt_frames"]


def test_token_id_beyond_int64_is_input_error(tmp_path: Path) -> None:
    good = RequestRecord(rid="ok", input_ids=[1], output_ids=[])
    b = _write_raw_request(tmp_path / "b", [1, 2**63], good)
    with pytest.raises(InputError, match="'bad'.*int64"):
        ingest.ingest(b)
    assert not (b / ".parquet").exists()  # nothing half-written


def _raw_and_list_paths(bundle: Path) -> tuple[tuple[dict, dict], tuple[dict, dict]]:
    with gc_paused():
        raw = records._build_tables(bundle, views=True, raw=True, ids=True)
        lst = records._build_tables(bundle, views=True, raw=False, ids=True)
    return raw, lst


def _bundle(path: Path, batches: list[KVEventBatch], extra: list[tuple[int, list]]) -> Path:
    """``batches`` encoded by wire, then ``extra`` (seq, plain msgpack value) payloads."""
    import msgspec

    payloads = [(i, wire.encode_batch(bt)) for i, bt in enumerate(batches)]
    payloads += [(seq, msgspec.msgpack.encode(v)) for seq, v in extra]
    with BundleWriter(path, header(page_size=4)) as w:
        for seq, payload in payloads:
            w.write_event(
                endpoint=0, seq=seq, recv_ns=T0 + seq, topic="", payload=payload, via=0, epoch=0
            )
        w.write(RequestRecord(rid="r0", input_ids=[1, 2, 3], output_ids=[4, 5]))
    return path


def test_raw_event_path_equals_list_path(tmp_path: Path) -> None:
    """decode_batch_raw + numpy hashes (several 16k-array chunks, uint64 wire hashes, long
    arrays, clears, an unknown tag, a duplicate) == decode_batch_view + Python lists."""
    import random

    rng = random.Random(11)
    batches = []
    for i in range(4500):
        evs: list = []
        for _ in range(rng.randrange(0, 9)):
            n = rng.choice([0, 1, 3, 16, rng.randrange(1, 200)])
            hs = [
                rng.choice([rng.randrange(-(2**63), 2**63), rng.randrange(128)]) for _ in range(n)
            ]
            if rng.random() < 0.5:
                evs.append(removed(hs))
            else:
                toks = list(range(rng.randrange(0, 70)))
                parent = rng.choice([None, rng.randrange(-(2**63), 2**63)])
                evs.append(BlockStored(hs, parent, toks, 4, rng.choice([None, 3]), "GPU"))
        if i % 500 == 7:
            evs.append(cleared())
        batches.append(KVEventBatch(i / 1000, evs, 0))
    unknown = [1.0, [{"type": "BlockUpdated", "x": 1}], None]
    big = [2.0, [{"type": "BlockRemoved", "block_hashes": [2**64 - 1, 2**63]}], None]
    b = _bundle(tmp_path / "b", batches, [(9000, unknown), (9001, big), (9001, big)])
    (raw_t, raw_i), (lst_t, lst_i) = _raw_and_list_paths(b)
    assert raw_t.keys() == lst_t.keys()
    for name in raw_t:
        assert raw_t[name].equals(lst_t[name]), name
    assert raw_i == lst_i
    assert raw_i["unknown_events"] == 1 and raw_i["duplicates"] == 1
    assert raw_t["blocks"].num_rows > 16384 * 2  # several hash chunks
    assert raw_t["events"].column("first_hash").to_pylist()[-1] == 2**64 - 1


_BYTES_HASH = [1.0, [{"type": "BlockRemoved", "block_hashes": [b"\x00" * 7 + b"\x09"]}], 0]
_BAD_TOKENS = [
    1.0,
    [
        {
            "type": "BlockStored",
            "block_hashes": [1],
            "parent_block_hash": None,
            "token_ids": "x",
            "block_size": 1,
            "lora_id": None,
        }
    ],
    0,
]


def _tokens_event(token_ids: object) -> list:
    ev = {**_BAD_TOKENS[1][0], "token_ids": token_ids}  # type: ignore[index]
    return [1.0, [ev], 0]


_BAD_TOKEN_ELEM = _tokens_event([1, "a", 3])
_PAIR_TOKENS = _tokens_event([[5, 6], 7])


@pytest.mark.parametrize(
    "extra",
    [
        [_BYTES_HASH],
        [_BAD_TOKENS],
        [_BYTES_HASH, _BAD_TOKENS],
        [_BAD_TOKEN_ELEM],
        [_PAIR_TOKENS],
    ],
    ids=["bh", "tk", "both", "tk-elem", "pairs"],
)
def test_raw_check_failure_reads_the_bundle_with_decode_batch_view(
    tmp_path: Path, extra: list
) -> None:
    """A bytes hash (the typed raw view takes it, numpy refuses it): ingest reads the bundle
    again through decode_batch_view, so the bytes hash becomes its int64. Token ids that are
    not valid (not an array, an element not an int) fail the raw path's chunked check too,
    and that payload is undecodable on the checked path as on every reader; [t, t+1] pairs
    are valid token ids (one token each) and read on the raw path."""
    good = KVEventBatch(0.5, [stored([NEG, 5], page_size=4), removed([NEG])], 0)
    c = _bundle(tmp_path / "c", [good], [(100 + i, v) for i, v in enumerate(extra)])
    bad_tokens = _BAD_TOKENS in extra or _BAD_TOKEN_ELEM in extra
    if _BYTES_HASH in extra or bad_tokens:
        with pytest.raises(records._RawCheckFailed), gc_paused():
            records._build_tables(c, views=True, raw=True, ids=True)
    else:
        with gc_paused():
            records._build_tables(c, views=True, raw=True, ids=True)  # no second pass needed
    ing = ingest.ingest(c, ids=True)
    with gc_paused():
        lst, lst_info = records._build_tables(c, views=True, raw=False, ids=True)
    for name in lst:
        assert pq.read_table(ing.path(name)).equals(lst[name]), name
    assert ing.info["undecodable_payloads"] == bad_tokens
    if _PAIR_TOKENS in extra:
        assert pq.read_table(ing.path("events")).column("n_tokens").to_pylist()[-1] == 2
    if _BYTES_HASH in extra:
        assert 9 in pq.read_table(ing.path("blocks")).column("hash").to_pylist()


def test_a_connection_without_request_ids_says_how_to_build_them(tmp_path: Path) -> None:
    con = sql.connect(ingest.ingest(_small(tmp_path), ids=False))
    with pytest.raises(UsageError, match=r"built on demand: ingest\(bundle, ids=True\)"):
        sql.query(con, "SELECT * FROM request_ids")
