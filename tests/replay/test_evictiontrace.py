"""``kvcadence replay --trace-evictions``: the simulated worker's evictions, one JSON line each
(``replay.evictiontrace``), in the shape of a real worker's trace (``harness start
--trace-evictions``; ``tests/capture/test_worker_rules.py`` compares the two)."""

from __future__ import annotations

import json
from pathlib import Path

from kvcadence.cli import main
from kvcadence.format.bundle import BundleReader

CORPUS = Path(__file__).parent / "data" / "corpus"
#: page 16, a 300-page pool under steady eviction, 6 lanes
CAPTURE = CORPUS / "p16-mpt512-quiet" / "bundle"
DP_CAPTURE = CORPUS / "dp2-p16-chunk256" / "bundle"


def _payloads(bundle: Path) -> list[bytes]:
    return [bytes(f.payload) for f in BundleReader(bundle).events()]


def test_trace_lines_follow_the_allocation_rules_and_change_nothing(tmp_path, capsys):
    trace = tmp_path / "sim.jsonl"
    argv = ["replay", str(CAPTURE)]
    assert main([*argv, "--quiet", "--out", str(tmp_path / "plain")]) == 0
    assert main([*argv, "--out", str(tmp_path / "traced"), "--trace-evictions", str(trace)]) == 0
    # the same sim bundle: stepping every decode pass changes no event
    assert _payloads(tmp_path / "traced") == _payloads(tmp_path / "plain")
    lines = [json.loads(x) for x in trace.read_text().splitlines()]
    assert {x["cause"] for x in lines} >= {"prefill", "decode"}
    assert set(lines[0]) == {"t", "cause", "need", "avail0", "avail1", "freed", "rids"}
    assert [x["t"] for x in lines] == sorted(x["t"] for x in lines)
    for x in lines:
        assert x["need"] > 0 and x["freed"] == x["avail1"] - x["avail0"]
        assert x["freed"] >= x["need"] or x["avail1"] < x["avail0"] + x["need"]  # or none left
        assert x["rids"]
        if x["cause"] == "decode":  # alloc_paged_token_slots_decode: a page per request
            assert x["need"] + x["avail0"] == 16 * len(x["rids"])
    recs = {r.rid: r for r in BundleReader(tmp_path / "traced").requests()}
    for x in lines:
        if x["cause"] == "prefill":  # extend tokens + a page per request (none chunked here)
            rs = [recs[rid] for rid in x["rids"]]
            extend = sum(len(r.input_ids) - r.cached_tokens for r in rs)
            assert x["need"] + x["avail0"] == extend + 16 * len(rs)
    assert f"replay: {len(lines)} evictions traced -> {trace}" in capsys.readouterr().err


def test_trace_file_is_new_and_one_rank(tmp_path, capsys):
    trace = tmp_path / "sim.jsonl"
    trace.write_text("kept\n")
    argv = ["replay", str(CAPTURE), "--out", str(tmp_path / "s"), "--quiet"]
    assert main([*argv, "--trace-evictions", str(trace)]) == 2
    assert trace.read_text() == "kept\n" and not (tmp_path / "s").exists()
    dp = ["replay", str(DP_CAPTURE), "--out", str(tmp_path / "d"), "--quiet"]
    assert main([*dp, "--trace-evictions", str(tmp_path / "dp.jsonl")]) == 2
    assert not (tmp_path / "dp.jsonl").exists()
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 2 and all(x.startswith("kvcadence: error: replay: --trace-ev") for x in err)
    assert "exists" in err[0] and "one rank" in err[1]
