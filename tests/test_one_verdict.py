"""One decoder verdict everywhere: inspect, the report and sql agree on
which payloads are undecodable and how many events the rest hold, for payloads with a
mistyped optional key (``cache_salt``, ``session_id``) or bad ``token_ids``."""

from __future__ import annotations

import json
from pathlib import Path

import msgspec
import pytest

from kvcadence.capture.inspect import inspect_bundle
from kvcadence.cli import main
from kvcadence.format import wire
from kvcadence.format.bundle import BundleWriter
from kvcadence.format.schema import VIA_LIVE
from tests.analysis.helpers import header

EV = {
    "type": "BlockStored",
    "block_hashes": [11, 12],
    "parent_block_hash": None,
    "token_ids": [5, 6],
    "block_size": 1,
    "lora_id": None,
}
PAYLOADS = {
    "plain": [1.0, [EV, {"type": "BlockRemoved", "block_hashes": [11]}], 0],
    "cache_salt_str": [1.1, [{**EV, "cache_salt": "s"}], 0],
    "cache_salt_int": [1.2, [{**EV, "cache_salt": 5}], 0],
    "session_id_int": [1.3, [{**EV, "session_id": 7}], 0],
    "tokens_str": [1.4, [{**EV, "token_ids": ["a", "b"]}], 0],
    "tokens_bool": [1.5, [{**EV, "token_ids": [True, 6]}], 0],
    "tokens_nil": [1.6, [{**EV, "token_ids": None}], 0],
    "bigram": [1.7, [{**EV, "token_ids": [[5, 6], 7]}], 0],
    "v17_tokens_str": [1.8, [["BlockStored", [21], None, ["x"], 1, None]], 0],
}
BAD = {"cache_salt_int", "session_id_int", "tokens_str", "tokens_bool", "tokens_nil"}
BAD_V17 = {"v17_tokens_str"}


@pytest.mark.parametrize("name", sorted(PAYLOADS))
def test_every_decoder_gives_the_same_verdict(name: str) -> None:
    p = msgspec.msgpack.encode(PAYLOADS[name])
    verdicts = []
    for fn in (wire.decode_batch, wire.decode_batch_view, wire.decode_batch_raw):
        try:
            verdicts.append(len(fn(p).events))
        except wire.WireError:
            verdicts.append("undecodable")
    assert len(set(verdicts)) == 1, verdicts
    assert (verdicts[0] == "undecodable") == (name in BAD | BAD_V17)


def test_inspect_report_and_sql_agree(tmp_path: Path, capsys) -> None:
    b = tmp_path / "b"
    with BundleWriter(b, header()) as w:
        for seq, name in enumerate(sorted(PAYLOADS)):
            payload = msgspec.msgpack.encode(PAYLOADS[name])
            w.write_event(
                endpoint=0, seq=seq, recv_ns=10**18 + seq, topic="kv", payload=payload,
                via=VIA_LIVE, epoch=0,
            )  # fmt: skip
    n_bad = len(BAD | BAD_V17)
    good_events = sum(len(v[1]) for k, v in PAYLOADS.items() if k not in BAD | BAD_V17)
    s = inspect_bundle(b)
    assert (s["undecodable_messages"], s["events"]) == (n_bad, good_events)
    assert main(["sql", str(b), "SELECT count(*) AS n FROM events", "--format", "json"]) == 0
    assert json.loads(capsys.readouterr().out)[0]["n"] == good_events
    from kvcadence.analysis import report

    report.make_report([str(b)], tmp_path / "r", plots=False)
    doc = json.loads((tmp_path / "r" / "report.json").read_text())
    q = doc["bundles"][0]["quality"]
    assert q["quality.undecodable_payloads"]["value"] == n_bad
