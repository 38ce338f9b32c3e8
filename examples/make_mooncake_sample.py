"""Write ``mooncake-sample.jsonl``: a small synthetic trace in Mooncake's format.

Made up from scratch by this script (no line comes from a published trace), with the shape
of a chat / agent serving trace: Poisson arrivals (mean gap 400 ms), four shared system
prompts (16-60 blocks), multi-turn conversations whose turn k repeats turn k-1's prompt
blocks plus new blocks (the previous answer and the new user message), a few one-off
requests without a shared prefix, long-tailed output lengths. One hash id per 16-token
block (``kvcadence replay --trace``'s and ``drive``'s default ``--block-tokens 16``); new
blocks get the next unused id, as in Mooncake's traces; ``input_length`` ends inside the
last block. Deterministic: ``python examples/make_mooncake_sample.py`` rewrites the same
file.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

BLOCK = 16
LINES = 120
OUT = Path(__file__).with_name("mooncake-sample.jsonl")


def main() -> None:
    rng = random.Random(20261201)
    next_id = 0

    def new_blocks(n: int) -> list[int]:
        nonlocal next_id
        ids = list(range(next_id, next_id + n))
        next_id += n
        return ids

    systems = [new_blocks(rng.randint(16, 60)) for _ in range(4)]
    live: list[dict[str, object]] = []  # open conversations: their last prompt blocks
    t_ms = 0.0
    lines = []
    for _ in range(LINES):
        t_ms += rng.expovariate(1 / 400.0)
        roll = rng.random()
        if live and roll < 0.55:  # the next turn of an open conversation
            conv = rng.choice(live)
            blocks = list(conv["blocks"]) + new_blocks(rng.randint(3, 14))  # type: ignore[call-overload]
            conv["turns"] = int(conv["turns"]) + 1  # type: ignore[call-overload]
            if len(blocks) > 110 or conv["turns"] >= rng.randint(3, 8):
                live.remove(conv)
            else:
                conv["blocks"] = blocks
        elif roll < 0.9:  # a new conversation on a shared system prompt
            blocks = rng.choices(systems, weights=[5, 3, 2, 1])[0] + new_blocks(rng.randint(2, 20))
            live.append({"blocks": blocks, "turns": 1})
        else:  # a one-off request, nothing shared
            blocks = new_blocks(rng.randint(4, 40))
        n_in = (len(blocks) - 1) * BLOCK + rng.randint(1, BLOCK)
        n_out = max(4, min(400, int(rng.lognormvariate(3.6, 0.8))))
        lines.append(
            {
                "timestamp": int(t_ms),
                "input_length": n_in,
                "output_length": n_out,
                "hash_ids": blocks,
            }
        )
    OUT.write_text("".join(json.dumps(d, separators=(", ", ": ")) + "\n" for d in lines))


if __name__ == "__main__":
    main()
