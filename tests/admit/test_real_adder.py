"""Differential test: ``kvcadence admit`` vs the REAL SGLang 0.5.23 ``PrefillAdder``.

Both drive the adder with the same fakes (docs/admit.md); the real one runs in
the capture harness's SGLang venv through ``sglang_adder_driver.py`` -- all queues in ONE
subprocess (the sglang import takes ~10 s). Without CP limits (kvcadence-only), every tick's
accepted set (rid, prefix, extend, loaded), stop (rid, result), logged tokens, remaining budgets,
allocator count, load-back events and evictions must be identical. The venv is built (session
fixture ``sglang_harness``) before the availability check, which runs at test time; an adder
that cannot be imported after that fails the test.
"""

from __future__ import annotations

import random

import pytest

from kvcadence.admit.real import compare, run_real_many, sglang_available
from kvcadence.admit.ticks import AdmitConfig, QueuedRequest, run_admission

pytestmark = pytest.mark.sglang_adder


def _queue(rng: random.Random, n: int) -> list[QueuedRequest]:
    def tokens() -> int:
        return rng.choice([0, 0, 5, 64, 100, 1024, 4096, rng.randrange(0, 9000)])

    return [
        QueuedRequest(
            f"q{i}", tokens(), tokens(), rng.randrange(1, 9000), rng.choice([0, 1, 128, 5000])
        )
        for i in range(n)
    ]


def _cases(seed: int = 5) -> list[tuple[AdmitConfig, list[list[QueuedRequest]]]]:
    rng = random.Random(seed)
    cases = []
    configs = [
        AdmitConfig(available_tokens=100_000),  # the reference budgets
        AdmitConfig(available_tokens=20_000, page_size=64, chunked_prefill_size=-1),
        AdmitConfig(
            available_tokens=3000,
            page_size=16,
            max_prefill_tokens=4096,
            chunked_prefill_size=2048,
            new_token_ratio=1.0,
        ),
        AdmitConfig(available_tokens=60_000, page_size=1, max_running_requests=3, drain=True),
        AdmitConfig(
            available_tokens=8000,
            page_size=64,
            chunked_prefill_size=16384,
            max_prefill_tokens=8192,
            new_token_ratio=0.3,
            drain=True,
        ),
    ]
    for cfg in configs:
        cases.append((cfg, [_queue(rng, rng.randrange(1, 16)) for _ in range(10)]))
    return cases


REFERENCE_QUEUE = [
    QueuedRequest("a", 1024, 512, 300, 0),
    QueuedRequest("b", 0, 0, 5000, 0),
    QueuedRequest("c", 0, 0, 6000, 0),
]
REFERENCE_CFG = AdmitConfig(available_tokens=100_000)


@pytest.fixture(scope="module")
def real_runs(sglang_harness):
    ok, why = sglang_available()
    assert ok, f"real sglang PrefillAdder unavailable after the harness set-up: {why}"

    cases = _cases()
    # ONE subprocess for all 50 random queues and the reference queue
    reals = run_real_many([*cases, (REFERENCE_CFG, [REFERENCE_QUEUE])])
    return cases, reals


def test_identical_to_real_prefill_adder_0523(real_runs):
    cases, reals = real_runs
    n_queues = 0
    for (cfg, queues), real in zip(cases, reals[: len(cases)], strict=True):
        assert real["sglang_version"] == "0.5.23"
        for queue, theirs in zip(queues, real["results"], strict=True):
            ours = run_admission(queue, cfg)
            diffs = compare(ours, theirs, cfg)
            assert not diffs, f"{cfg}\n{queue}\n" + "\n".join(diffs[:5])
            n_queues += 1
    assert n_queues == 50


def test_reference_scenario_and_compare_is_not_vacuous(real_runs):
    _, reals = real_runs
    theirs = reals[-1]["results"][0]
    raw0 = theirs["ticks"][0]  # docs/admit.md, reference scenarios, first row
    assert raw0["log_hit_tokens"] == 1536 and raw0["log_input_tokens"] == 8116
    assert raw0["allocator_available_after_tick"] == 99488
    assert compare(run_admission(REFERENCE_QUEUE, REFERENCE_CFG), theirs, REFERENCE_CFG) == []
    # a different chunk budget must be reported as a difference
    other = AdmitConfig(available_tokens=100_000, chunked_prefill_size=4096)
    assert compare(run_admission(REFERENCE_QUEUE, other), theirs, REFERENCE_CFG)
