"""``kvcadence capture`` records the vLLM/Dynamo wire family live, byte for byte: the payloads
are the committed live recording of Dynamo's mocker (empty topic frame, ``group_idx``, no
``medium``, uint64 hashes), republished by a test publisher with that empty topic; the first
ones before the capture starts (recovered through the replay socket), the rest live."""

from __future__ import annotations

import base64
import threading
import time

from kvcadence.cli import main
from kvcadence.format import wire
from kvcadence.format.bundle import BundleReader
from kvcadence.format.schema import VIA_LIVE, VIA_REPLAY, BlockRemoved, BlockStored
from kvcadence.testing.publisher import TestPublisher


def test_capture_records_the_mocker_wire_family(tmp_path, mocker_frames):
    frames = mocker_frames[:100] + mocker_frames[700:900]  # the start, and evictions
    assert {f["topic"] for f in frames} == {""}
    payloads = [base64.b64decode(f["payload_b64"]) for f in frames]
    out = tmp_path / "mocker.kvcb"
    rc: list[int] = []
    with TestPublisher(topic="") as pub:
        for p in payloads[:50]:  # before the capture joins: only the replay socket has them
            pub.publish(p)
        args = ["capture", "--endpoint", pub.endpoint, "--replay-endpoint", pub.replay_endpoint]
        th = threading.Thread(
            target=lambda: rc.append(
                main([*args, "--out", str(out), "--until-idle", "1.5", "--quiet"])
            )
        )
        th.start()
        time.sleep(1.0)  # the SUB joins and the initial replay fetches seqs 0..49
        for p in payloads[50:]:
            pub.publish(p)
        th.join(60)
    assert rc == [0]
    got = list(BundleReader(out).events())
    assert [f.seq for f in got] == list(range(300))
    assert {f.topic for f in got} == {""}
    assert [bytes(f.payload) for f in got] == payloads  # stored exactly as published
    assert {f.via for f in got[:50]} == {VIA_REPLAY} and {f.via for f in got[50:]} <= {
        VIA_LIVE,
        VIA_REPLAY,
    }
    events = [ev for f in got for ev in wire.decode_batch(f.payload).events]
    stored = [ev for ev in events if type(ev) is BlockStored]
    assert stored and any(type(ev) is BlockRemoved for ev in events)
    assert all(ev.medium is None and ev.lora_id is None for ev in stored)  # group_idx ignored
    assert all(ev.token_ids for ev in stored)
    # uint64 wire hashes come out as SGLang's signed int64 form
    assert any(h < 0 for ev in stored for h in ev.block_hashes)
