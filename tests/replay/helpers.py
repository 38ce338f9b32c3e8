"""Hand-built schedules and event decoding shared by the replay tests."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from kvcadence.format import wire
from kvcadence.format.schema import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    RequestRecord,
)
from kvcadence.replay.config import SimConfig, TimingParams
from kvcadence.replay.simulator import SimResult, simulate

MS = 1_000_000


def req(
    rid: str,
    prompt: Sequence[int],
    n_out: int,
    *,
    lane: int | None = None,
    arrival_ms: float = 0.0,
    out: Sequence[int] | None = None,
    gap_ms: float | None = None,
    prev_finish_ms: float | None = None,
) -> RequestRecord:
    """A request record: open loop at ``arrival_ms`` or, on a lane, ``gap_ms`` after its
    predecessor finishes (encoded as recorded server timings)."""
    outs = list(out) if out is not None else [(7 * i + len(prompt)) % 997 + 3 for i in range(n_out)]
    meta: dict[str, Any] = {"request_received_ts": (1_000_000 + arrival_ms) / 1e3}
    if prev_finish_ms is not None and gap_ms is not None:
        meta["request_received_ts"] = (1_000_000 + prev_finish_ms + gap_ms) / 1e3
    return RequestRecord(
        rid=rid,
        input_ids=list(prompt),
        output_ids=outs,
        lane=lane,
        max_new_tokens=n_out,
        completion_tokens=n_out,
        prompt_tokens=len(prompt),
        finish_reason="length",
        send_ns=int(meta["request_received_ts"] * 1e9),
        meta_info=meta,
    )


def lane_chain(lane: int, turns: list[tuple[list[int], int]], gap_ms: float = 1.0) -> list:
    """Requests of one closed-loop lane; each turn arrives ``gap_ms`` after the previous
    finishes (recorded finish times are synthetic: only the gap matters)."""
    out = []
    t = 0.0
    for i, (prompt, n_out) in enumerate(turns):
        r = req(f"l{lane}-t{i}", prompt, n_out, lane=lane, arrival_ms=t)
        r.meta_info["request_finished_ts"] = (1_000_000 + t + 1.0) / 1e3
        out.append(r)
        t += 1.0 + gap_ms
    return out


def config(*, decode_per_ctx_token_s: float = 0.0, **kw: Any) -> SimConfig:
    """The tests' ``SimConfig``: fixed pass times (a decode pass 5 ms, plus
    ``decode_per_ctx_token_s`` a context token), ``kw`` its other fields."""
    timing = TimingParams(
        prefill_base_s=0.010,
        prefill_per_token_s=0.0,
        decode_base_s=0.005,
        decode_per_req_s=0.0,
        decode_per_ctx_token_s=decode_per_ctx_token_s,
        default_gap_s=0.001,
        wakeup_s=0.0,
    )
    base: dict[str, Any] = dict(
        page_size=1,
        max_total_tokens=10_000,
        chunked_prefill_size=None,
        max_prefill_tokens=16384,
        decode_log_interval=40,
    )
    base.update(kw)
    return SimConfig(timing=timing, **base).validate()


def run(records: list, cfg: SimConfig | None = None, **kw: Any) -> SimResult:
    return simulate(records, cfg or config(), **kw)


def decoded(result: SimResult) -> list[list]:
    """Each published batch's canonical events."""
    return [wire.decode_batch(b.payload).events for b in result.batches]


def shape(result: SimResult) -> list[list[str]]:
    """Messages as lists like ``["S10", "R4", "C"]``."""
    out = []
    for events in decoded(result):
        row = []
        for e in events:
            if isinstance(e, BlockStored):
                row.append(f"S{len(e.block_hashes)}")
            elif isinstance(e, BlockRemoved):
                row.append(f"R{len(e.block_hashes)}")
            elif isinstance(e, AllBlocksCleared):
                row.append("C")
        out.append(row)
    return out


def check_stream(result: SimResult) -> set[int]:
    """Replay the published events against a resident-block set and assert SGLang's
    invariants at every publish; returns the final resident set (== the tree's)."""
    resident: set[int] = set()
    stored = removed = 0
    for events in decoded(result):
        for e in events:
            if isinstance(e, BlockStored):
                assert e.parent_block_hash is None or e.parent_block_hash in resident, (
                    "store whose parent is not resident"
                )
                new = set(e.block_hashes)
                assert len(new) == len(e.block_hashes) and not (new & resident), "double store"
                resident |= new
                stored += len(new)
            elif isinstance(e, BlockRemoved):
                gone = set(e.block_hashes)
                assert gone <= resident, "removal of a block never stored"
                resident -= gone
                removed += len(gone)
            elif isinstance(e, AllBlocksCleared):
                removed += len(resident)
                resident = set()
        assert stored - removed == len(resident)
    sched = result.scheduler
    if sched is not None:
        assert resident == sched.tree.resident_hashes()
        sched.tree.check_invariants()
    return resident


#: how far (s) a store's publish may precede the recorded time of what stored it
_LABEL_SLACK_S = 0.3


def finish_prefill_merges(
    frames: Sequence[tuple[int, float, Sequence[Any]]], records: Sequence[Any], page_size: int
) -> dict[int, set[tuple[str, str]]]:
    """Per rank, the ``(A, A')`` pairs whose finish store (A's output pages) and prefill store
    (A''s prompt pages) went out as one BlockStored event.

    ``frames``: ``(rank, publish ts in s, events)`` in publish order per rank (real or
    simulated); ``records``: the requests (``dp_rank``, ``input_ids``, ``output_ids``,
    ``meta_info`` with ``prefill_finished_time`` and ``request_finished_ts``). Every stored
    block is labelled with the request that stored it: among the requests of that rank whose
    hash chain (prompt + outputs but the last) holds the block, the first whose prefill
    result (a prompt page) or finish (an output page) came after the block was last removed
    and not after the publish."""
    from kvcadence.replay.radix import wire_hasher

    hasher = wire_hasher()
    cand: dict[tuple[int, int], list[tuple[float, str, str]]] = {}
    for r in records:
        seq = [*r.input_ids, *r.output_ids[:-1]]
        _digest, hashes = hasher(None, seq, page_size)
        n_prompt = len(r.input_ids) // page_size
        mi = r.meta_info
        for i, h in enumerate(hashes):
            t, part = (
                (mi["prefill_finished_time"], "P")
                if i < n_prompt
                else (mi["request_finished_ts"], "F")
            )
            cand.setdefault((r.dp_rank or 0, h), []).append((t, r.rid, part))
    for v in cand.values():
        v.sort()
    merges: dict[int, set[tuple[str, str]]] = {}
    removed_at: dict[tuple[int, int], float] = {}
    for rank, ts, events in frames:
        out = merges.setdefault(rank, set())
        for e in events:
            if isinstance(e, BlockRemoved):
                for h in e.block_hashes:
                    removed_at[(rank, h)] = ts
            elif isinstance(e, BlockStored):
                labels = []
                for h in e.block_hashes:
                    lo = removed_at.get((rank, h), float("-inf")) - _LABEL_SLACK_S
                    hit = next(
                        (
                            (rid, part)
                            for t, rid, part in cand.get((rank, h), ())
                            if lo <= t <= ts + _LABEL_SLACK_S
                        ),
                        ("?", "?"),
                    )
                    if not labels or labels[-1] != hit:
                        labels.append(hit)
                for (a, pa), (b, pb) in zip(labels, labels[1:], strict=False):
                    if pa == "F" and pb == "P":
                        out.add((a, b))
            elif isinstance(e, AllBlocksCleared):
                for key in cand:
                    if key[0] == rank:
                        removed_at[key] = ts
    return merges


def radix_op(tree: Any, op: str, key: tuple[int, ...], n: int, locked: list) -> None:
    """One operation of the radix tree's random-operation tests on ``tree`` (``evict`` is the
    caller's): ``ins`` inserts ``key`` from the root (``n``: what the inserting request had
    inserted before, ``n % 3`` its priority), ``again`` inserts it again at the prompt
    re-insert's priority, ``match`` matches it (capped at ``len - 1``), ``lock`` locks the node
    its whole match ends at (kept in ``locked``), ``unlock`` releases the latest lock."""
    from kvcadence.replay.radix import PROMPT_PRIORITY

    if op == "ins":
        tree.insert_below(tree.root, 0, key, inserted_len=n, priority=n % 3)
    elif op == "again":
        tree.insert_below(tree.root, 0, key, len(key), PROMPT_PRIORITY)
    elif op == "match":
        tree.match_prefix(key, len(key) - 1)
    elif op == "lock":
        _, node = tree.match_prefix(key, len(key))
        if node is not tree.root:
            tree.lock(node)
            locked.append(node)
    elif op == "unlock" and locked:
        tree.unlock(locked.pop())


def replay_choices(dest: str) -> tuple[Any, Any]:
    """``(the choices of the replay option stored in dest, the replay parser)``: the
    ``kvcadence replay`` parser as the console script builds it."""
    import argparse

    from kvcadence.replay import cli as replay_cli

    sub = argparse.ArgumentParser().add_subparsers()
    replay_cli.register(sub)
    (parser,) = sub.choices.values()
    (action,) = [a for a in parser._actions if a.dest == dest]
    return tuple(action.choices), parser
