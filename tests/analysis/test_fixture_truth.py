"""The real SGLang 0.5.23 fixture: every metric truth.json states must come out equal."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from kvcadence.analysis import ingest, metrics


@pytest.fixture(scope="module")
def fx(fixture_bundle: Path, tmp_path_factory: pytest.TempPathFactory) -> metrics.BundleMetrics:
    return metrics.compute(ingest.ingest(fixture_bundle, tmp_path_factory.mktemp("pq")))


def _dist(m: dict[str, Any], name: str, truth: dict[str, Any]) -> None:
    for k in ("n", "mean", "median", "p90", "min", "max"):
        assert m[f"{name}.{k}"] == pytest.approx(truth[k], rel=1e-12), f"{name}.{k}"


def test_counts(fx: metrics.BundleMetrics, truth: dict[str, Any]) -> None:
    m = fx.metrics
    assert m["requests"] == truth["n_requests"]
    assert m["messages"] == truth["n_messages"]
    assert m["quality.seq_holes"] == truth["seq_gaps"] == 0
    assert m["quality.duplicates"] == truth["duplicate_lines"]
    assert m["events"] == truth["n_events"]
    ebt = truth["events_by_type"]
    assert m["stored_events"] == ebt["BlockStored"]
    assert m["removed_events"] == ebt["BlockRemoved"]
    assert m["cleared_events"] == ebt["AllBlocksCleared"]
    assert m["unknown_events"] == ebt["other"]
    assert m["stored_events_per_request"] == pytest.approx(truth["stored_events_per_request"])
    assert m["removed_events_per_request"] == pytest.approx(truth["removed_events_per_request"])
    assert m["total_stored_blocks"] == truth["total_stored_blocks"]
    assert m["total_removed_blocks"] == truth["total_removed_blocks"]
    assert m["total_stored_tokens"] == truth["total_stored_tokens"]
    for k, v in truth["message_composition"].items():
        assert m[f"message_composition.{k}"] == v


def test_distributions(fx: metrics.BundleMetrics, truth: dict[str, Any]) -> None:
    m = fx.metrics
    _dist(m, "blocks_per_stored_event", truth["blocks_per_stored_event"])
    _dist(m, "blocks_per_removed_event", truth["blocks_per_removed_event"])
    _dist(m, "events_per_message", truth["events_per_message"])


def test_requests(fx: metrics.BundleMetrics, truth: dict[str, Any]) -> None:
    m, t = fx.metrics, truth["requests"]
    _dist(m, "requests.prompt_tokens", t["prompt_tokens"])
    _dist(m, "requests.output_tokens", t["output_tokens"])
    _dist(m, "requests.cached_tokens", t["cached_tokens"])
    assert m["requests.total_prompt_tokens"] == t["total_prompt_tokens"]
    assert m["requests.total_output_tokens"] == t["total_output_tokens"]
    assert m["requests.total_cached_tokens"] == t["total_cached_tokens"]
    assert m["requests.cache_hit_rate"] == pytest.approx(t["cache_hit_rate"])
    assert m["requests.share_with_removal_in_flight"] == pytest.approx(
        t["share_with_removal_in_flight"]
    )


def test_attribution(fx: metrics.BundleMetrics, truth: dict[str, Any]) -> None:
    m, t = fx.metrics, truth["attribution"]
    assert m["attribution.matched_blocks"] == t["stored_hashes_recomputed"]
    assert m["attribution.stored_blocks"] == t["stored_hashes_total"]
    assert m["attribution.unmatched_blocks"] == 0
    assert fx.attribution_kinds == t["stored_event_kinds"]
    assert (
        m["attribution.events_spanning_requests_same_session"]
        == t["events_spanning_requests_same_session"]
    )
    assert m["attribution.events_spanning_requests_other"] == t["events_spanning_requests_other"]
    _dist(m, "attribution.stored_events_per_request", t["stored_events_per_request"])
    _dist(m, "attribution.prefill_store_events_per_request", t["prefill_store_events_per_request"])
    _dist(m, "attribution.finish_store_events_per_request", t["finish_store_events_per_request"])
    assert m["attribution.requests_without_prefill_store"] == t["requests_without_prefill_store"]
    # docs/metrics.md: output pages = sum pages(prompt + output - 1) - pages(prompt), exactly
    assert m["attribution.output_blocks"] == m["attribution.expected_output_blocks"] == 4513
    assert m["attribution.prompt_blocks"] + m["attribution.output_blocks"] == 14747


def test_pool_pressure_is_high_at_removals(fx: metrics.BundleMetrics) -> None:
    m = fx.metrics
    assert m["removal.pool_pages"] == 5000
    assert m["removal.capacity_events"] == 94
    assert 0.9 < m["removal.pool_pressure_at_removal.median"] <= 1.0
