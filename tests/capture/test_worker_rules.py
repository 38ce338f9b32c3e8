"""Scheduler rules checked on the real SGLang 0.5.23 CPU worker (marker ``sglang_worker``).

Where SGLang's source leaves a rule in doubt (the worker runs the compiled Rust tree core),
a small deterministic schedule is sent to a fresh worker, its KV events are captured
(``kvcadence capture --server URL --sglang-metrics DIR``), and the capture is replayed: the
real events must show the rule, and the replay must show it where the replay kept the
schedule's order.
"""

from __future__ import annotations

import json
import random
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import pytest

from kvcadence.analysis.evictions import compare, figures
from kvcadence.cli import main
from kvcadence.format import wire
from kvcadence.format.bundle import BundleReader
from kvcadence.format.schema import BlockRemoved, BlockStored
from kvcadence.testing.capturerun import start_capture, stop_capture

worker = pytest.mark.sglang_worker

#: page 16, 12 pages: two cached 4-page prompts leave 4 free, so a 97-token prompt (7
#: pages) evicts exactly one of them
TOUCH_CFG = {
    "page_size": 16,
    "max_total_tokens": 192,
    "extra_args": ["--disable-overlap-schedule"],
}


def _params(n: int) -> dict:
    return {"max_new_tokens": n, "temperature": 0, "ignore_eos": True}


def _touch_trial(client: httpx.Client, url: str, seed: int, overlap: bool) -> dict:
    """``/flush_cache``; ``a`` (65 tokens, 15 outputs: its finish fills no new page) and
    ``b`` (another 65 tokens, 3 outputs), ``b`` sent at ``a``'s first token (``overlap``:
    prefilled after ``a``, finished before it) or after ``a`` finished; then ``c`` (97
    tokens, 1 output), which needs one of the two 4-page leaves. Returns the prompts' first
    tokens (each trial's prompts are distinct)."""
    rng = random.Random(seed)
    a, b, c = ([rng.randrange(1, 1000) for _ in range(n)] for n in (65, 65, 97))
    for _ in range(50):  # refused (400) until the worker is idle
        if client.post(url + "/flush_cache").status_code == 200:
            break
        time.sleep(0.2)
    else:
        raise AssertionError("/flush_cache refused for 10 s")
    time.sleep(0.5)

    def gen(ids: list[int], n: int) -> None:
        r = client.post(url + "/generate", json={"input_ids": ids, "sampling_params": _params(n)})
        r.raise_for_status()

    if overlap:
        th = None
        body = {"input_ids": a, "stream": True, "sampling_params": _params(15)}
        with client.stream("POST", url + "/generate", json=body) as r:
            for line in r.iter_lines():
                if th is None and line.startswith("data:") and "[DONE]" not in line:
                    th = threading.Thread(target=gen, args=(b, 3))
                    th.start()
        assert th is not None
        th.join()
    else:
        gen(a, 15)
        gen(b, 3)
    time.sleep(0.3)
    gen(c, 1)
    return {"a": a, "b": b, "c": c}


def _removals(bundle: Path, trials: list[dict]) -> tuple[list[str], dict[tuple, int]]:
    """Who owned each removed leaf (``"t<i>:a"``...), in stream order; finish times by prompt."""
    who = {t[k][0]: f"t{i}:{k}" for i, t in enumerate(trials) for k in "abc"}
    owner: dict[int, str] = {}
    out = []
    for f in BundleReader(bundle).events():
        for e in wire.decode_batch(f.payload).events:
            if isinstance(e, BlockStored):
                w = who.get(e.token_ids[0], "?")
                if e.parent_block_hash is not None:
                    w = owner.get(e.parent_block_hash, "?")
                owner.update((h, w) for h in e.block_hashes)
            elif isinstance(e, BlockRemoved):
                out.append(",".join(sorted({owner.get(h, "?") for h in e.block_hashes})))
    fin = {tuple(r.input_ids): r.finish_ns for r in BundleReader(bundle).requests()}
    return out, fin


@worker
def test_finish_with_nothing_new_to_insert_touches_the_path(sglang_worker_factory, tmp_path):
    """A request whose finish checkpoint has nothing new to insert still re-stamps its path
    (0.5.23 ``checkpoint_into_tree`` inserts from the root; the Rust tree core does the
    same): ``a`` finishing after ``b`` keeps its pages and ``c`` evicts ``b``'s; ``a``
    finishing before ``b`` came is older and goes (the control). Without the touch ``a``'s
    pages, stamped at its prefill, would always go first. Wherever the replay kept the finish
    order it never evicts the other one of ``a`` and ``b``, and it shows the rule on at least
    one overlapped trial."""
    h = sglang_worker_factory("rule-touch", **TOUCH_CFG)
    with httpx.Client(timeout=120) as warm:  # the first forward is slow: not in the capture
        r = warm.post(
            h.url + "/generate", json={"input_ids": [5] * 8, "sampling_params": _params(2)}
        )
        r.raise_for_status()
    out = tmp_path / "capture.kvcb"
    proc = start_capture(h.url, h.metrics_dir, out)
    overlaps = [True, True, True, False]
    try:
        with httpx.Client(timeout=120) as client:
            trials = [_touch_trial(client, h.url, 100 + i, o) for i, o in enumerate(overlaps)]
    finally:
        stop_capture(proc, out, settle_s=3.0)
    assert h.alive(), h.log_tail()

    def b_first(fin: dict[tuple, int]) -> list[bool]:
        return [fin[tuple(t["b"])] < fin[tuple(t["a"])] for t in trials]

    real, real_fin = _removals(out, trials)
    order = b_first(real_fin)
    # on a loaded box ``b`` can reach the worker only after ``a`` finished (``a`` decodes
    # 14 passes): that trial is a control; at least one must have run overlapped
    assert order[-1] is False and any(order), order
    want = [f"t{i}:{'b' if bf else 'a'}" for i, bf in enumerate(order)]
    assert real == want, (real, order)
    sim = tmp_path / "sim.kvcb"
    assert main(["replay", str(out), "--out", str(sim), "--quiet"]) == 0
    got, sim_fin = _removals(sim, trials)
    assert len(got) == len(trials), got
    kept = [i for i, bf in enumerate(b_first(sim_fin)) if bf == order[i]]
    print(f"[rule-touch] b first {order}; real {real}; replay {got}, order kept {kept}")
    # the rule decides between ``a``'s leaf and ``b``'s: the replay must never evict the
    # other one of the two where it kept the order, and must show the rule on an
    # overlapped trial; another removal (the replay's pass timing moved ``c`` or a flush
    # relative to the finishes, seen once in CI) is not this rule's verdict
    other = {i: f"t{i}:{'a' if order[i] else 'b'}" for i in kept}
    assert not [i for i in kept if got[i] == other[i]], (got, want, kept)
    shown = [i for i in kept if got[i] == want[i]]
    assert any(order[i] for i in shown), (got, want, kept)


#: (worker settings, workload, drive flags): page 16, a 100-page pool for 4 lanes of
#: 200-700-token prompts (evictions at prefill and at decode); page 1, a 2400-token pool for
#: 6 lanes of long outputs sent without ``ignore_eos`` (decode checks, retractions)
EVICT_RUNS = {
    "p16": (
        {"page_size": 16, "max_total_tokens": 1600, "chunked_prefill_size": 1024},
        "agent:lanes=4,requests=60,seed=7,first_min=200,first_max=400,max_prompt=700",
        [],
    ),
    "p1-retract": (
        {"page_size": 1, "max_total_tokens": 2400},
        "agent:lanes=6,requests=60,seed=613,out_min=64,out_max=256,max_prompt=700",
        ["--no-ignore-eos"],
    ),
}


def _trace_rules(f: Any, lines: list[dict], page: int) -> None:
    """The allocation rules both traces follow (``f``: ``figures`` of ``lines``)."""
    assert f.calls["prefill"] and not f.calls["other"], f.calls
    # a prefill eviction reaches its target (the admission left room); the others may find
    # every leaf locked (a decode allocation asks for a page per request whether it needs
    # one or not; a decode check that falls short retracts)
    assert not f.short["prefill"], f.short
    if page > 1:
        assert f.calls["decode"] and dict(f.decode_demand) == {page: f.calls["decode"]}
    else:  # check_decode_mem: a token per request; the allocation after it asks nothing
        assert not f.calls["decode"] and f.calls["check_decode"]
        checks = [x for x in lines if x["cause"] == "check_decode"]
        assert all(x["need"] + x["avail0"] == len(x["rids"]) for x in checks)
    # a retraction's release: 20 tokens (``SGLANG_RETRACT_DECODE_STEPS``) per request left
    # in the batch, the k-th release of one retraction with k requests gone
    k, prev = 0, None
    for x in lines:
        if x["cause"] != "retract":
            prev = None
            continue
        k = k + 1 if prev == x["rids"] else 1
        prev = x["rids"]
        assert x["need"] + x["avail0"] == 20 * (len(x["rids"]) - k), x


@worker
@pytest.mark.parametrize("run", list(EVICT_RUNS))
def test_real_evictions_ask_what_the_replay_asks(sglang_worker_factory, tmp_path, run):
    """The worker's own eviction calls (``harness start --trace-evictions``: every
    ``evict_for_alloc`` of the radix cache, with the shortfall asked for, the available
    tokens before and after and the batch) against the replay's (``replay
    --trace-evictions``): a decode step asks for a page per running request at page > 1
    (``alloc_paged_token_slots_decode``), a decode check for a token per request at page 1,
    a retraction's release for 20 tokens per request left, a prefill batch for its extend
    tokens (plus a page per request at page > 1), each as the shortfall; a prefill batch of
    the same requests in both traces, where the replay found the worker's cached prefixes,
    asks for the same tokens."""
    cfg, work, flags = EVICT_RUNS[run]
    real = tmp_path / "real.jsonl"
    h = sglang_worker_factory(f"evict-{run}", trace_evictions=str(real), **cfg)
    bundle, sim = tmp_path / "b", tmp_path / "sim.jsonl"
    drive = ["drive", "--server", h.url, "--workload", work, *flags, "--out", str(bundle)]
    assert main([*drive, "--quiet"]) == 0
    assert h.alive(), h.log_tail()
    replay = ["replay", str(bundle), "--out", str(tmp_path / "s"), "--trace-evictions", str(sim)]
    assert main([*replay, "--quiet"]) == 0
    a, b = figures(real), figures(sim)
    for f, path in ((a, real), (b, sim)):
        _trace_rules(f, [json.loads(x) for x in path.read_text().splitlines()], cfg["page_size"])
    both = [k for k in a.prefill if k in b.prefill]
    print(
        f"[evict-{run}] real {a.total} evictions, replay {b.total}; {len(both)} prefill batches in both"
    )
    # where the replay's batch found the worker's cached prefixes, the same demand
    agree = compare(real, sim, (bundle, tmp_path / "s"))["prefill_cached_agree"]
    assert agree["batches"] >= 5 and agree["same_demand"] == agree["batches"], agree
