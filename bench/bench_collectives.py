"""Benchmark: the three prefix-merge paths on gloo (CPU) at world 2, as ratios vs dense.

Launches ``torchrun --standalone --nproc-per-node 2 -m kvcadence.kernels --backend gloo`` over
a few prefix sizes, reads the JSON lines it writes, and prints every path's average wall time
as a ratio to ``dense_all_reduce`` measured in the same run (ratio < 1: faster than dense).
CPU/gloo numbers show shape and relative cost only; never compare them with NCCL.

    .venv/bin/python bench/bench_collectives.py [--tokens 4096 16384 40320] [--payload mla]
        [--quick] [--json PATH]

``--quick``: 4096 tokens, mla, warmup 1, repeat 3; ``--json``: the figures for ``bench/run``
(see bench/common.py).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from common import add_output_args, figure, write_results

ROOT = Path(__file__).resolve().parent.parent
BASELINE = "dense_all_reduce"


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tokens", type=int, nargs="+", default=[4096, 16384, 40320])
    p.add_argument("--payload", choices=("mla", "index", "both"), default="both")
    p.add_argument("--nproc-per-node", type=int, default=2)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--repeat", type=int, default=5)
    add_output_args(p, "4096 tokens, mla payload, warmup 1, repeat 3 (a smoke run)")
    args = p.parse_args()
    if args.quick:
        args.tokens, args.payload, args.warmup, args.repeat = [4096], "mla", 1, 3
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "results.jsonl"
        cmd = [
            sys.executable, "-m", "torch.distributed.run", "--standalone",
            "--nproc-per-node", str(args.nproc_per_node), "-m", "kvcadence.kernels",
            "--backend", "gloo", "--payload", args.payload,
            "--tokens", *map(str, args.tokens),
            "--warmup", str(args.warmup), "--repeat", str(args.repeat), "--out", str(out),
        ]  # fmt: skip
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(x for x in (str(ROOT), env.get("PYTHONPATH")) if x)
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, check=False)
        if proc.returncode != 0:
            sys.stderr.write(proc.stderr[-4000:])
            return 1
        rows = [json.loads(line) for line in out.read_text().splitlines()]
    base = {
        (r["payload"], r["prefix_tokens"]): r["cpu_ms_avg"] for r in rows if r["path"] == BASELINE
    }
    r0 = rows[0]
    print(
        f"# gloo world {r0['world_size']}, torch {r0['torch']}, {r0['device']}, "
        f"{os.cpu_count()} CPUs; warmup {args.warmup}, repeat {args.repeat}; wall ms"
    )
    print(f"{'payload':<8}{'tokens':>8}{'MiB':>9}  {'path':<30}{'ms':>10}{'vs_dense':>10}"
          f"{'goodput':>9}")  # fmt: skip
    for r in rows:
        ratio = r["cpu_ms_avg"] / base[r["payload"], r["prefix_tokens"]]
        print(
            f"{r['payload']:<8}{r['prefix_tokens']:>8}{r['full_mib']:>9.2f}  {r['path']:<30}"
            f"{r['cpu_ms_avg']:>10.3f}{ratio:>9.2f}x{r['goodput_gbps']:>9.3f}"
        )
    figs = [
        figure(
            f"{r['payload']} {r['prefix_tokens']} tokens: {r['path']}",
            r["cpu_ms_avg"],
            "ms",
            baseline=base[r["payload"], r["prefix_tokens"]],
            baseline_name=f"{BASELINE} (same payload and size)",
            higher_is_better=False,
            note=f"{r['full_mib']:.2f} MiB prefix, goodput {r['goodput_gbps']:.3f} GB/s",
        )
        for r in rows
        if r["path"] != BASELINE
    ]
    write_results(
        args.json,
        "collectives",
        f"Prefix-merge paths vs dense all-reduce (torchrun, gloo, world {r0['world_size']})",
        figs,
        {
            "tokens": args.tokens,
            "payload": args.payload,
            "warmup": args.warmup,
            "repeat": args.repeat,
            "torch": r0["torch"],
        },
        ["wall ms per merge (cpu_ms_avg); ratio < 1: faster than dense; CPU gloo shows shape "
         "only, never compare with NCCL"],
    )  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
