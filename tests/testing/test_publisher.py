"""The test publisher parses replay requests with kvcadence's own wire framing."""

from __future__ import annotations

from kvcadence.format import wire
from kvcadence.testing.publisher import TestPublisher, payload_pool

POOL = payload_pool(8)
BIG = 1 << 40


# ------------------------------------------------------------------ 5. testpub


def test_testpub_parses_replay_requests_with_wire():
    import zmq

    with TestPublisher() as pub:
        pub.publish(POOL[0])
        ctx = zmq.Context()
        d = ctx.socket(zmq.DEALER)
        d.setsockopt(zmq.LINGER, 0)
        d.connect(pub.replay_endpoint)
        try:
            d.send_multipart([b"not-empty", (0).to_bytes(8, "big")])  # bad delimiter
            d.send_multipart(wire.replay_request(0))
            assert d.poll(5000)
            first = d.recv_multipart()
            assert wire.parse_replay_reply(first[1:])[1] == 0
        finally:
            d.close(0)
            ctx.term()
        assert pub.bad_requests == 1 and pub.replay_requests == 1
