"""The real worker's eviction trace (``harness start --trace-evictions``): the
``sitecustomize`` the harness puts first on the worker's ``PYTHONPATH``
(``harness/sglang_cpu/sitecustomize.py``), run here on a stand-in of SGLang's
``unified_radix_cache`` module in a fresh interpreter; the real worker's trace is checked
against the replay's in ``tests/capture/test_worker_rules.py``."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

from kvcadence.cli import main
from kvcadence.harness import worker as harness

#: a stand-in of SGLang 0.5.23's module, with its callers' names (which give the cause)
FAKE_MODULE = """
class Result:
    def __init__(self, n):
        self.num_tokens_evicted = n

class Alloc:
    free = 16
    def available_size(self):
        return self.free

class UnifiedRadixCache:
    def __init__(self):
        self.token_to_kv_pool_allocator = Alloc()
    def evict_for_alloc(self, params):
        self.token_to_kv_pool_allocator.free += 32
        return Result(32)
    def evict(self, params):
        return Result(0)
"""

DRIVER = """
import types
from sglang.srt.mem_cache.unified_radix_cache import UnifiedRadixCache

class Req:
    def __init__(self, rid):
        self.rid = rid

def evict_to_free_tokens(tree, n):
    return tree.evict_for_alloc(types.SimpleNamespace(num_tokens=n))

def alloc_for_extend(batch):
    return evict_to_free_tokens(batch.tree, 20)

def alloc_for_decode_default(batch):
    return evict_to_free_tokens(batch.tree, 16)

def check_decode_capacity(tree, requests):
    return evict_to_free_tokens(tree, 8)

def check_decode_mem(batch):
    return check_decode_capacity(batch.tree, batch.reqs[:1])  # the requests that stay

def release_req(tree):
    return tree.evict(types.SimpleNamespace(num_tokens=40))

def main():
    tree = UnifiedRadixCache()
    two = types.SimpleNamespace(tree=tree, reqs=[Req("a"), Req("b")])
    assert alloc_for_extend(two).num_tokens_evicted == 32  # results passed on unchanged
    alloc_for_decode_default(two)
    check_decode_mem(two)
    release_req(tree)  # no batch on the way: no rids

main()
"""


def _run(tmp_path, trace):
    # the interpreter's own sitecustomize, further on the path: still run
    (tmp_path / "sitecustomize.py").write_text("open('chained', 'w').close()\n")
    pkg = tmp_path / "sglang" / "srt" / "mem_cache"
    pkg.mkdir(parents=True)
    for d in (tmp_path / "sglang", tmp_path / "sglang" / "srt", pkg):
        (d / "__init__.py").write_text("")
    (pkg / "unified_radix_cache.py").write_text(textwrap.dedent(FAKE_MODULE))
    env = {k: v for k, v in os.environ.items() if k != harness.EVICTION_TRACE_ENV}
    env["PYTHONPATH"] = os.pathsep.join([str(harness.ASSET_DIR), str(tmp_path)])
    if trace is not None:
        env[harness.EVICTION_TRACE_ENV] = str(trace)
    subprocess.run([sys.executable, "-c", DRIVER], env=env, check=True, cwd=tmp_path)


def test_each_eviction_is_one_line_with_its_cause_and_batch(tmp_path):
    trace = tmp_path / "real.jsonl"
    _run(tmp_path, trace)
    lines = [json.loads(x) for x in trace.read_text().splitlines()]
    assert [x["cause"] for x in lines] == ["prefill", "decode", "check_decode", "retract"]
    assert [x["call"] for x in lines][::2] == ["evict_for_alloc", "evict_for_alloc"]
    assert lines[-1]["call"] == "evict"
    assert [x["need"] for x in lines] == [20, 16, 8, 40]
    assert lines[2]["rids"] == ["a"]  # the check's own requests, not its batch's
    assert [(x["avail0"], x["avail1"], x["freed"]) for x in lines[:2]] == [
        (16, 48, 32),
        (48, 80, 32),
    ]
    assert lines[0]["rids"] == ["a", "b"] and lines[3]["rids"] is None
    assert lines[0]["stack"][:2] == ["evict_to_free_tokens", "alloc_for_extend"]


def test_no_trace_unless_asked(tmp_path):
    _run(tmp_path, None)  # the module loads and runs as it is
    assert not list(tmp_path.glob("*.jsonl"))
    assert (tmp_path / "chained").exists()  # the shadowed sitecustomize ran


def test_harness_passes_the_trace_file_to_the_worker(tmp_path, monkeypatch, harness_starts, capsys):
    cfg = harness.ServerConfig(trace_evictions="t.jsonl")
    monkeypatch.chdir(tmp_path)
    env = harness.worker_env_extra(cfg, base={})
    assert env[harness.EVICTION_TRACE_ENV] == str(tmp_path / "t.jsonl")  # absolute
    assert harness.EVICTION_TRACE_ENV not in harness.worker_env_extra(harness.ServerConfig())
    seen = harness_starts
    argv = ["harness", "start", "--workdir", str(tmp_path / "w"), "--trace-evictions"]
    (tmp_path / "old.jsonl").write_text("kept\n")
    assert main([*argv, str(tmp_path / "old.jsonl")]) == 2  # never appended to
    assert not seen and "exists" in capsys.readouterr().err
    assert main([*argv, str(tmp_path / "new.jsonl")]) == 0
    assert seen[0].trace_evictions == str(tmp_path / "new.jsonl")
