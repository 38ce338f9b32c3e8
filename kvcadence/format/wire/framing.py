"""SGLang's ZMQ framing: live PUB messages ``[topic, seq8 BE, payload]``, the replay
ROUTER's requests and replies, and the end marker (see ``kvcadence.format.wire``)."""

from __future__ import annotations

from kvcadence.errors import WireError
from kvcadence.format.hashes import (
    U64_MAX,
)

# --------------------------------------------------------------------------------------
# ZMQ framing
# --------------------------------------------------------------------------------------

END_SEQ: int = -1
_END_FRAME = b"\xff" * 8


def _seq_bytes(seq: int) -> bytes:
    if type(seq) is not int or not (-1 <= seq <= U64_MAX):
        raise WireError(f"seq must be an int in 0..2**64-1 (or END_SEQ), got {seq!r}")
    if seq == END_SEQ:
        return _END_FRAME
    return seq.to_bytes(8, "big")


def _seq_from(frame: bytes, where: str) -> int:
    if len(frame) != 8:
        raise WireError(f"seq frame must be 8 bytes, got {len(frame)} - at {where}")
    return int.from_bytes(frame, "big")


def _topic_from(frame: bytes, where: str) -> str:
    try:
        return bytes(frame).decode("utf-8")
    except UnicodeDecodeError:
        raise WireError(f"topic frame is not UTF-8: {bytes(frame)[:32]!r} - at {where}") from None


def parse_live_message(frames: list[bytes]) -> tuple[str, int, bytes]:
    """A SUB-side message ``[topic, seq8 BE, payload]`` -> ``(topic, seq, payload)``."""
    if len(frames) != 3:
        raise WireError(f"a live KV-event message has 3 frames, got {len(frames)}")
    topic, seq, payload = frames
    return _topic_from(topic, "frame 0"), _seq_from(seq, "frame 1"), bytes(payload)


def parse_replay_reply(frames: list[bytes]) -> tuple[str | None, int, bytes] | None:
    """A replay reply as received by a DEALER with the empty delimiter already stripped:
    ``[topic, seq8, payload]`` (0.5.22+) or ``[seq8, payload]`` (older; topic None).
    Returns None for the end marker (seq frame ``ff`` x 8)."""
    n = len(frames)
    if n == 3:
        topic_frame, seq_frame, payload = frames
        if bytes(seq_frame) == _END_FRAME:
            return None
        topic: str | None = _topic_from(topic_frame, "frame 0")
        seq = _seq_from(seq_frame, "frame 1")
    elif n == 2:
        seq_frame, payload = frames
        if bytes(seq_frame) == _END_FRAME:
            return None
        topic = None
        seq = _seq_from(seq_frame, "frame 0")
    else:
        raise WireError(
            f"a replay reply has 3 frames [topic, seq, payload] or 2 [seq, payload] after the "
            f"empty delimiter, got {n}"
        )
    return topic, seq, bytes(payload)


def live_frames(topic: str, seq: int, payload: bytes) -> list[bytes]:
    """The frames a PUB socket sends: ``[topic, seq8 BE, payload]``."""
    return [topic.encode("utf-8"), _seq_bytes(seq), bytes(payload)]


def replay_request(start_seq: int) -> list[bytes]:
    """What a DEALER sends to the replay ROUTER: ``[b"", start_seq8 BE]``."""
    if start_seq == END_SEQ:
        raise WireError("replay start seq must be 0..2**64-1")
    return [b"", _seq_bytes(start_seq)]


def parse_replay_request(frames: list[bytes]) -> int:
    """A replay request as received by the ROUTER, identity frame stripped: exactly
    ``[b"", start_seq8 BE]`` (what a DEALER sends) -> the start seq (read unsigned, as
    SGLang does). Anything else (SGLang logs it and sends no reply) raises ``WireError``."""
    n = len(frames)
    if n != 2:
        raise WireError(
            f"a replay request has 2 frames [b'', start_seq] after the identity, got {n}"
        )
    delim, seq_frame = frames
    if len(delim) != 0:
        raise WireError(
            f"a replay request's frame 0 must be the empty delimiter, got {bytes(delim)[:32]!r}"
        )
    return _seq_from(seq_frame, "frame 1 (start seq)")


def replay_reply_frames(topic: str | None, seq: int, payload: bytes) -> list[bytes]:
    """What a 0.5.23 ROUTER sends after the identity frame: ``[b"", topic, seq8, payload]``;
    ``topic=None`` gives the older ``[b"", seq8, payload]``. ``seq=END_SEQ`` is the end marker
    (its payload is always empty)."""
    seq8 = _seq_bytes(seq)
    body = b"" if seq == END_SEQ else bytes(payload)
    if topic is None:
        return [b"", seq8, body]
    return [b"", topic.encode("utf-8"), seq8, body]


__all__ = [
    "END_SEQ",
    "live_frames",
    "parse_live_message",
    "parse_replay_reply",
    "parse_replay_request",
    "replay_reply_frames",
    "replay_request",
]
