"""prefixes.json: golden distribution, invariants, and the kernels stage can read it."""

from __future__ import annotations

import json
from pathlib import Path

from hypothesis import given
from hypothesis import strategies as st

from kvcadence.analysis import ingest, prefixes
from kvcadence.cli import main


def test_golden_distribution() -> None:
    d = prefixes.distribution([0, 1, 3, 4, 100])
    assert d["unit"] == "tokens" and d["n"] == 5
    assert d["quantiles"] == {
        "p10": 0,
        "p25": 1,
        "p50": 3,
        "p75": 4,
        "p90": 62,
        "p99": 96,
        "max": 100,
    }
    bins = [(b["lo"], b["hi"], b["count"], b["rep_tokens"]) for b in d["histogram"]]
    assert bins[:4] == [(0, 0, 1, 0), (1, 1, 1, 1), (2, 3, 1, 3), (4, 7, 1, 4)]
    assert bins[-1] == (64, 127, 1, 100)
    assert [b["weight"] for b in d["histogram"] if b["count"]] == [0.2] * 5


@given(st.lists(st.integers(0, 100_000), min_size=1, max_size=200))
def test_histogram_invariants(values: list[int]) -> None:
    d = prefixes.distribution(values)
    assert sum(b["count"] for b in d["histogram"]) == d["n"] == len(values)
    assert abs(sum(b["weight"] for b in d["histogram"]) - 1.0) < 1e-9
    for b in d["histogram"]:
        if b["count"]:
            assert b["lo"] <= b["rep_tokens"] <= b["hi"]
    assert d["quantiles"]["max"] == max(values)


def test_fixture_prefixes_json(fixture_bundle: Path, tmp_path: Path) -> None:
    out = tmp_path / "prefixes.json"
    cache = tmp_path / "pq"
    ingest.ingest(fixture_bundle, cache)
    assert main(["prefixes", str(fixture_bundle), "--out", str(out), "--cache", str(cache)]) == 0
    doc = json.loads(out.read_text())
    assert doc["schema"] == "kvcadence.prefixes/1"
    assert doc["page_size"] == 1
    assert doc["source"]["sglang_version"] == "0.5.23" and doc["source"]["n_requests"] == 120
    cached = doc["distributions"]["cached_tokens"]
    assert cached["n"] == 120 and cached["quantiles"]["max"] == 769
    assert cached["histogram"][0] == {
        "lo": 0,
        "hi": 0,
        "count": 4,
        "weight": 4 / 120,
        "rep_tokens": 0,
    }
    runs = doc["distributions"]["stored_run_tokens"]
    assert runs["n"] == 231 and runs["quantiles"]["p50"] == 52 and runs["quantiles"]["max"] == 298
    try:
        from kvcadence.kernels.prefixes import load_prefixes
    except ImportError:
        return
    dist = load_prefixes(out, "stored_run_tokens")
    assert dist.page_size == 1 and dist.n == 231


def test_docs_name_every_metric() -> None:
    from kvcadence.analysis.ingest import TABLES
    from kvcadence.analysis.metrics import CATALOGUES, DEFS, STATS

    docs = Path(__file__).resolve().parents[2] / "docs" / "metrics.md"
    text = docs.read_text()
    for catalogue in CATALOGUES.values():
        for name, (unit, definition) in catalogue.items():
            base, _, suf = name.rpartition(".")
            if catalogue is DEFS and suf in STATS:
                assert f"`{base}.{{n,mean,median,p10,p90,p99,min,max}}`" in text, name
                continue
            cell = definition.replace("|", "\\|")  # a pipe in a table cell is escaped
            assert f"| `{name}` | {unit} | {cell} |" in text, name
    for table, cols in TABLES.items():
        assert f"### `{table}`" in text
        for col, _, _ in cols:
            assert f"| `{col}` |" in text
    assert '"schema": "kvcadence.prefixes/1"' in text


def test_docs_list_the_tables_as_the_schema_dict_does() -> None:
    """The tables' listing in docs/metrics.md is ``describe_tables()`` verbatim (what
    ``kvcadence sql --help`` would print): a column added, moved (the token ids went to
    ``request_ids``) or reworded in ``TABLES`` shows in the docs too."""
    from kvcadence.analysis.tables import describe_tables

    docs = Path(__file__).resolve().parents[2] / "docs" / "metrics.md"
    assert describe_tables().rstrip("\n") in docs.read_text()
