"""Analysis test helpers: tiny hand-made bundles and the real fixture turned into a bundle."""

from __future__ import annotations

import base64
import json
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from kvcadence.format import wire
from kvcadence.format.bundle import BundleWriter
from kvcadence.format.schema import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    EndpointInfo,
    Gap,
    Header,
    KVEventBatch,
    RequestRecord,
)

T0 = 1_000_000_000_000_000_000  # an arbitrary host-ns origin


def header(
    page_size: int = 1, max_tokens: int | None = 100, source: str = "real", ranks: int = 1
) -> Header:
    info: dict[str, Any] = {"version": "0.5.23", "page_size": page_size}
    if max_tokens is not None:
        info["max_total_num_tokens"] = max_tokens
    return Header(
        format_major=1,
        format_minor=0,
        source=source,
        kvcadence_version="test",
        sglang_version="0.5.23",
        server_info=info,
        endpoints=[EndpointInfo(i, f"tcp://127.0.0.1:{5557 + i}", None, i) for i in range(ranks)],
    )


def stored(hashes: list[int], page_size: int = 1, parent: int | None = None) -> BlockStored:
    return BlockStored(
        block_hashes=list(hashes),
        parent_block_hash=parent,
        token_ids=list(range(len(hashes) * page_size)),
        block_size=page_size,
        lora_id=None,
        medium="GPU",
    )


def removed(hashes: list[int]) -> BlockRemoved:
    return BlockRemoved(block_hashes=list(hashes), medium="GPU")


def cleared() -> AllBlocksCleared:
    return AllBlocksCleared()


def write_bundle(
    path: Path,
    messages: Iterable[tuple[int, list[Any]] | tuple[int, list[Any], int]],
    requests: Iterable[RequestRecord] = (),
    *,
    hdr: Header | None = None,
    gaps: Iterable[Gap] = (),
    start_seq: int = 0,
) -> Path:
    """messages: (t_ms, events[, endpoint]); seqs count per endpoint from ``start_seq``."""
    seqs: dict[int, int] = {}
    with BundleWriter(path, hdr or header()) as w:
        for msg in messages:
            t_ms, events = msg[0], msg[1]
            ep = msg[2] if len(msg) > 2 else 0
            seq = seqs.get(ep, start_seq)
            seqs[ep] = seq + 1
            payload = wire.encode_batch(KVEventBatch(t_ms / 1000.0, list(events), ep))
            w.write_event(
                endpoint=ep,
                seq=seq,
                recv_ns=T0 + t_ms * 1_000_000,
                topic="kv-events",
                payload=payload,
                via=0,
                epoch=0,
            )
        for g in gaps:
            w.write(g)
        for r in requests:
            w.write(r)
    return path


def fixture_to_bundle(fixture: Path, out: Path) -> Path:
    """The shared SGLang fixture as a bundle (the capture importer when it exists)."""
    try:
        from kvcadence.capture.importer import import_bundle
    except ImportError:  # pragma: no cover - only before the capture stage lands
        import_bundle = None
    if import_bundle is not None:
        import_bundle(
            out,
            frames=fixture / "events.jsonl",
            requests=fixture / "requests.jsonl",
            server_info=fixture / "server_info.json",
        )
        return out
    si = json.loads((fixture / "server_info.json").read_text())
    hdr = Header(
        1,
        0,
        "real",
        "test",
        si.get("version"),
        si,
        endpoints=[EndpointInfo(0, "tcp://127.0.0.1:5557", None, 0, "kv-events")],
    )
    with BundleWriter(out, hdr) as w:
        for line in (fixture / "events.jsonl").read_text().splitlines():
            d = json.loads(line)
            w.write_event(
                endpoint=0,
                seq=d["seq"],
                recv_ns=d["recv_ns"],
                topic=d["topic"],
                payload=base64.b64decode(d["payload_b64"]),
                via=1 if d["via"] == "replay" else 0,
                epoch=0,
            )
        for line in (fixture / "requests.jsonl").read_text().splitlines():
            d = json.loads(line)
            mi = d.get("meta_info", {})
            w.write(
                RequestRecord(
                    rid=d["rid"],
                    input_ids=d["input_ids"],
                    output_ids=d["output_ids"],
                    send_ns=d["send_ns"],
                    finish_ns=d["finish_ns"],
                    lane=d["lane"],
                    session=d["session"],
                    turn=d["turn"],
                    max_new_tokens=d["max_new_tokens"],
                    prompt_tokens=mi.get("prompt_tokens"),
                    cached_tokens=mi.get("cached_tokens"),
                    completion_tokens=mi.get("completion_tokens"),
                    source="import",
                    meta_info=mi,
                )
            )
    return out
