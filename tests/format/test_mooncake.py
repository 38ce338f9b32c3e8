"""``format.mooncake``: the hash id -> token ids mapping drive and ``replay --trace`` share."""

from __future__ import annotations

import random

import pytest

from kvcadence.errors import InputError
from kvcadence.format.mooncake import HashIdTokens, parse_mooncake_line, synthetic_tokens


@pytest.mark.parametrize("vocab", [4, 5, 8, 1024, 1025, 32000, 151936])
def test_synthetic_tokens_are_randints(vocab: int) -> None:
    """The fast draw gives exactly ``randint(3, vocab - 1)``'s values (what every drive and
    bundle made before it used)."""
    for seed in range(50):
        rng = random.Random(f"{seed}-hash-{vocab}")
        want = [rng.randint(3, vocab - 1) for _ in range(40)]
        assert synthetic_tokens(random.Random(f"{seed}-hash-{vocab}"), 40, vocab) == want


def test_blocks_are_stable_and_prompts_are_prefixes() -> None:
    m = HashIdTokens(block_tokens=4, seed=0, vocab=1024)
    assert m.block(7) == HashIdTokens(4).block(7) and len(m.block(7)) == 4
    assert m.block(7) != m.block(8)
    short = m.prompt([1, 2, 3], 10, idx=0)
    assert short == m.block(1) + m.block(2) + m.block(3)[:2]
    assert m.prompt([1, 2, 3], 12, idx=5)[:10] == short  # a longer prompt extends it
    padded = m.prompt([1], 9, idx=3)  # past its blocks: filler unique to the request
    assert padded[:4] == m.block(1) and padded != m.prompt([1], 9, idx=4)
    assert len(m) == 5  # ids 7, 8, 1, 2, 3


def test_a_bad_line_names_where_and_the_field() -> None:
    with pytest.raises(InputError, match=r"t\.jsonl:4: field 'output_length'"):
        parse_mooncake_line({"timestamp": 1, "input_length": 3, "output_length": 0}, "t.jsonl:4")
    with pytest.raises(InputError, match="hash_ids"):
        parse_mooncake_line({"input_length": 3, "output_length": 1, "hash_ids": [True]}, "x:1")


@pytest.mark.parametrize(
    "line, why",
    [
        ({"timestamp": -(2**63)}, "must be milliseconds in"),
        ({"timestamp": float("nan")}, "must be milliseconds in"),
        ({"timestamp": float("inf")}, "must be milliseconds in"),
        ({"timestamp": 1e300}, "must be milliseconds in"),
        ({"input_length": 2**64 - 1}, "more than a request can hold"),
        ({"output_length": 10**9}, "more than a request can hold"),
    ],
)
def test_a_line_no_replay_can_hold_is_refused_before_anything_is_made(line, why) -> None:
    """Found by fuzzing ``replay --trace``: a timestamp of -2**63 ms ended the replay in
    "int too big to convert" (exit 1), an input_length of 2**64 - 1 made its prompt's
    tokens until memory ran out. Both are input errors naming the line."""
    d = {"timestamp": 5, "input_length": 40, "output_length": 8, "hash_ids": [1, 2], **line}
    with pytest.raises(InputError, match=rf"t\.jsonl:3: .*{why}"):
        parse_mooncake_line(d, "t.jsonl:3")
