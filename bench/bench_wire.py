"""Benchmark of ``kvcadence.format.wire``: full payload decode and block-hash throughput,
each against a baseline measured in the same run (a script, not a test).

* decode: ~50k realistic 0.5.23 payloads (page-size-1 ``BlockStored`` of 50-300 pages, some
  ``BlockRemoved`` of 50-300 hashes, a rare ``AllBlocksCleared``); ``decode_batch`` MB/s vs a
  plain untyped ``msgspec.msgpack.decode`` MB/s (and the same payloads in the 0.5.14 array
  shape, and the untyped per-event fallback forced on the map payloads). Goal: >= 50 MB/s on
  one core.
* hashes: ``block_hashes`` pages/s at page size 1 and 16 vs a bare hashlib chain over
  pre-packed page bytes.

Usage: ``python bench/bench_wire.py [--payloads 50000] [--repeat 3] [--quick] [--json PATH]``
(``--quick``: 3,000 payloads, 20k hashed tokens, repeat 1; ``--json``: the figures for
``bench/run``, see ``bench/common.py``).
"""

from __future__ import annotations

import argparse
import gc
import os
import random
import time
from array import array
from collections.abc import Callable
from hashlib import sha256

import msgspec
from common import add_output_args, figure, goal, write_results

from kvcadence.format.schema import AllBlocksCleared, BlockRemoved, BlockStored, KVEventBatch
from kvcadence.format.wire import block_hashes, decode_batch, encode_batch
from kvcadence.format.wire.decode import _decode_slow


def _ints(n: int) -> list[int]:
    return array("q", os.urandom(8 * n)).tolist()


def _tokens(n: int) -> list[int]:
    # vocabulary-sized ids (mostly < 2**17): the msgpack forms SGLang really emits
    return [t % 151_936 for t in array("I", os.urandom(4 * n)).tolist()]


def build_payloads(n: int, version: str, seed: int = 1) -> list[bytes]:
    rng = random.Random(seed)
    out = []
    ts = 1_795_961_838.366
    for _ in range(n):
        evs: list = []
        if rng.random() < 0.3:
            evs.append(BlockRemoved(block_hashes=_ints(rng.randint(50, 300)), medium="GPU"))
        pages = rng.randint(50, 300)
        hs = _ints(pages + 1)
        evs.append(
            BlockStored(
                block_hashes=hs[1:],
                parent_block_hash=hs[0] if rng.random() < 0.8 else None,
                token_ids=_tokens(pages),
                block_size=1,
                lora_id=None,
                medium="GPU",
            )
        )
        if rng.random() < 0.001:
            evs.append(AllBlocksCleared())
        ts += 0.05
        out.append(encode_batch(KVEventBatch(ts=ts, events=evs, attn_dp_rank=0), version))
    return out


def _mbps(fn: Callable[[bytes], object], payloads: list[bytes], repeat: int) -> float:
    total = sum(map(len, payloads))
    best = float("inf")
    for _ in range(repeat):
        t0 = time.perf_counter()
        for p in payloads:
            fn(p)
        best = min(best, time.perf_counter() - t0)
    return total / best / 1e6


def _pages_per_s(fn: Callable[[], object], pages: int, repeat: int) -> float:
    best = float("inf")
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return pages / best


def bench_decode(n: int, repeat: int) -> list[dict]:
    t0 = time.perf_counter()
    maps = build_payloads(n, "0.5.23")
    arrays = build_payloads(max(1, n // 5), "0.5.14")
    size = sum(map(len, maps))
    print(
        f"built {len(maps)} 0.5.23 payloads ({size / 1e6:.1f} MB, avg {size / len(maps):.0f} B) "
        f"+ {len(arrays)} 0.5.14 in {time.perf_counter() - t0:.1f}s"
    )
    assert decode_batch(maps[0]).events, "sanity: decodes"
    plain = msgspec.msgpack.decode
    base = _mbps(plain, maps, repeat)
    ours = _mbps(decode_batch, maps, repeat)
    base_arr = _mbps(plain, arrays, repeat)
    ours_arr = _mbps(decode_batch, arrays, repeat)
    fallback = _mbps(_decode_slow, maps[: max(1, len(maps) // 5)], repeat)
    print(
        f"decode 0.5.23 maps : decode_batch {ours:7.1f} MB/s | untyped msgspec {base:7.1f} MB/s "
        f"| ratio {ours / base:.2f}x | goal >= 50 MB/s: {'OK' if ours >= 50 else 'MISSED'}"
    )
    print(
        f"decode 0.5.14 array: decode_batch {ours_arr:7.1f} MB/s | untyped msgspec "
        f"{base_arr:7.1f} MB/s | ratio {ours_arr / base_arr:.2f}x (typed V17 array path)"
    )
    print(
        f"decode 0.5.23 maps, forced untyped per-event fallback (unknown tags, bytes hashes): "
        f"{fallback:7.1f} MB/s | ratio {fallback / base:.2f}x"
    )
    plain_name = "untyped msgspec.msgpack.decode"
    return [
        figure(
            "decode_batch, 0.5.23 map payloads",
            ours,
            "MB/s",
            baseline=base,
            baseline_name=plain_name,
            goal=goal("value", ">=", 50, ">= 50 MB/s on one core"),
        ),
        figure(
            "decode_batch, 0.5.14 array payloads",
            ours_arr,
            "MB/s",
            baseline=base_arr,
            baseline_name=plain_name,
        ),
        figure(
            "untyped per-event fallback, 0.5.23 maps",
            fallback,
            "MB/s",
            baseline=base,
            baseline_name=plain_name,
            note="unknown tags / bytes hashes path, forced",
        ),
    ]


def bench_hashes(repeat: int, n_tokens: int = 200_000) -> list[dict]:
    tokens = _tokens(n_tokens)
    figs = []
    for page_size in (1, 16):
        n_pages = len(tokens) // page_size
        packed = array("I", tokens[: n_pages * page_size]).tobytes()
        step = 4 * page_size
        pages = [packed[i : i + step] for i in range(0, len(packed), step)]

        def bare(pages: list[bytes] = pages) -> None:
            prev = b""
            for page in pages:
                prev = sha256(prev + page).digest()

        def ours(page_size: int = page_size) -> None:
            block_hashes(tokens, page_size)

        b = _pages_per_s(bare, n_pages, repeat)
        o = _pages_per_s(ours, n_pages, repeat)
        print(
            f"block_hashes page_size={page_size:<2}: {o / 1e6:5.2f} M pages/s | bare hashlib "
            f"chain over pre-packed pages {b / 1e6:5.2f} M pages/s | ratio {o / b:.2f}x"
        )
        figs.append(
            figure(
                f"block_hashes, page size {page_size}",
                o / 1e6,
                "M pages/s",
                baseline=b / 1e6,
                baseline_name="bare hashlib chain over pre-packed pages",
            )
        )
    return figs


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--payloads", type=int, default=50_000)
    ap.add_argument("--repeat", type=int, default=3)
    add_output_args(ap, "3,000 payloads, 20k hashed tokens, repeat 1 (a smoke run)")
    args = ap.parse_args()
    n_tokens = 200_000
    if args.quick:
        args.payloads, args.repeat, n_tokens = 3_000, 1, 20_000
    gc.collect()
    figs = bench_decode(args.payloads, args.repeat)
    figs += bench_hashes(args.repeat, n_tokens)
    write_results(
        args.json,
        "wire",
        "SGLang payload decode and block-hash throughput (kvcadence.format.wire)",
        figs,
        {"payloads": args.payloads, "repeat": args.repeat, "hashed_tokens": n_tokens},
        ["best of `repeat` passes per figure; one core"],
    )


if __name__ == "__main__":
    main()
