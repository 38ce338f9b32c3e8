"""Closed-loop request client for Dynamo's mocker (runs in the mocker's own venv, not
kvcadence's: it imports only the standard library and ``dynamo.runtime``).

``python mocker_client.py SCHEDULE.json OUT.jsonl``

SCHEDULE.json (written by ``run_mocker.py``)::

    {"lanes": [{"lane": 0, "start_s": 0.0,
                "requests": [{"rid": "...", "session": 0, "turn": 0, "input_ids": [...],
                              "max_tokens": 18, "gap_s": 0.031}, ...]}, ...]}

Each lane sends its requests one after another: the first ``start_s`` after the run starts,
each later one ``gap_s`` after the previous one finished (the recorded client pause). Every
request is annotated ``output_replay_id:<rid>`` so the mocker returns the recorded output
tokens (``--response-replay-trace-path``). OUT.jsonl gets one line per request in
kvcadence's request-import form (``rid``, ``lane``, ``session``, ``turn``,
``max_new_tokens``, ``send_ns``, ``first_token_ns``, ``finish_ns``, ``input_ids``,
``output_ids``, ``meta_info.finish_reason``).
"""

from __future__ import annotations

import asyncio
import json
import sys
import time
from typing import Any


async def _one(client: Any, req: dict[str, Any]) -> dict[str, Any]:
    body = {
        "model": "mock",
        "token_ids": req["input_ids"],
        "stop_conditions": {
            "max_tokens": req["max_tokens"],
            "min_tokens": req["max_tokens"],
            "ignore_eos": True,
        },
        "sampling_options": {"temperature": 0.0},
        "eos_token_ids": [],
        "annotations": [f"output_replay_id:{req['rid']}"],
    }
    out: list[int] = []
    first_ns = None
    finish = None
    send_ns = time.time_ns()
    stream = await client.round_robin(body)
    async for item in stream:
        data = item.data() if hasattr(item, "data") else item
        data = data or {}
        toks = data.get("token_ids") or []
        if toks and first_ns is None:
            first_ns = time.time_ns()
        out.extend(toks)
        if data.get("finish_reason"):
            finish = data["finish_reason"]
    finish_ns = time.time_ns()
    return {
        "rid": req["rid"],
        "session": req.get("session"),
        "turn": req.get("turn"),
        "max_new_tokens": req["max_tokens"],
        "send_ns": send_ns,
        "first_token_ns": first_ns,
        "finish_ns": finish_ns,
        "input_ids": req["input_ids"],
        "output_ids": out,
        "meta_info": {
            "finish_reason": {"type": str(finish) if finish else "unknown"},
            "prompt_tokens": len(req["input_ids"]),
            "completion_tokens": len(out),
        },
    }


async def _lane(client: Any, lane: dict[str, Any], t0: float, sink: list[dict[str, Any]]) -> None:
    delay = t0 + lane["start_s"] - time.monotonic()
    if delay > 0:
        await asyncio.sleep(delay)
    for i, req in enumerate(lane["requests"]):
        if i and req.get("gap_s", 0.0) > 0:
            await asyncio.sleep(req["gap_s"])
        rec = await _one(client, req)
        rec["lane"] = lane["lane"]
        sink.append(rec)


async def main(schedule_path: str, out_path: str) -> int:
    from dynamo.runtime import DistributedRuntime

    with open(schedule_path) as f:
        schedule = json.load(f)
    loop = asyncio.get_running_loop()
    rt = DistributedRuntime(loop, "file", "tcp")
    client = await rt.endpoint("dynamo.backend.generate").client()
    await asyncio.wait_for(client.wait_for_instances(), timeout=120)
    done: list[dict[str, Any]] = []
    t0 = time.monotonic()
    await asyncio.gather(*(_lane(client, ln, t0, done) for ln in schedule["lanes"]))
    with open(out_path, "w") as f:
        for rec in done:
            f.write(json.dumps(rec, separators=(",", ":")) + "\n")
    want = sum(len(ln["requests"]) for ln in schedule["lanes"])
    print(f"mocker client: {len(done)}/{want} requests in {time.monotonic() - t0:.2f} s")
    rt.shutdown()
    return 0 if len(done) == want else 1


if __name__ == "__main__":
    sys.exit(asyncio.run(main(sys.argv[1], sys.argv[2])))
