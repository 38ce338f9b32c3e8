"""The stdlib reader of prefixes.json: case building, weighting, and one-line errors."""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import pytest

from kvcadence.errors import InputError, UsageError
from kvcadence.kernels.prefixes import load_prefixes, parse_prefixes

EXAMPLE = Path(__file__).with_name("prefixes_example.json")


def _doc() -> dict[str, Any]:
    return json.loads(EXAMPLE.read_text())


def test_example_cached_tokens() -> None:
    d = load_prefixes(EXAMPLE)
    assert d.dist == "cached_tokens" and d.page_size == 64 and d.n == 200
    assert d.weights() == {0: 0.2, 256: 0.3, 1280: 0.3, 4096: 0.2}
    # bins' representatives ∪ positive quantiles; the 0-token bin is not a case
    assert d.case_tokens() == [64, 256, 640, 1280, 2048, 4096, 8000, 8192]
    assert d.quantile_names()[4096] == ["p90"]
    assert d.source["bundle"] == "example"


def test_example_stored_runs_rounds_fractional_quantiles_up() -> None:
    d = load_prefixes(EXAMPLE, "stored_run_tokens")
    assert d.quantiles["p90"] == 705
    assert d.weights() == {128: 0.6, 640: 0.4}
    assert 705 in d.case_tokens()


def test_bins_sharing_a_representative_add_up() -> None:
    doc = _doc()
    h = doc["distributions"]["cached_tokens"]["histogram"]
    h[3]["rep_tokens"] = 1280
    assert parse_prefixes(doc, "cached_tokens").weights()[1280] == pytest.approx(0.5)


def _broken(mutate: Any) -> dict[str, Any]:
    doc = copy.deepcopy(_doc())
    mutate(doc)
    return doc


CACHED = ("distributions", "cached_tokens")


def _set(path: tuple[Any, ...], value: Any) -> Any:
    def mutate(doc: dict[str, Any]) -> None:
        node = doc
        for k in path[:-1]:
            node = node[k]
        if value is _DELETE:
            del node[path[-1]]
        else:
            node[path[-1]] = value

    return mutate


_DELETE = object()


@pytest.mark.parametrize(
    ("mutate", "message"),
    [
        (_set(("schema",), "kvcadence.prefixes/2"), "field 'schema'"),
        (_set(("page_size",), "64"), "field 'page_size' must be an integer"),
        (_set(("page_size",), 0), "field 'page_size' must be >= 1"),
        (_set(("page_size",), True), "field 'page_size' must be an integer"),
        (_set(("distributions",), []), "field 'distributions' must be an object"),
        (_set((*CACHED,), _DELETE), "no distribution 'cached_tokens'"),
        (_set((*CACHED, "unit"), "pages"), "unit' must be 'tokens'"),
        (_set((*CACHED, "histogram"), {}), "histogram' must be a list"),
        (_set((*CACHED, "histogram"), []), "is empty"),
        (_set((*CACHED, "histogram", 1, "weight"), -0.3), "histogram[1].weight' must be finite"),
        (_set((*CACHED, "histogram", 1, "weight"), 0.9), "weights sum to 1.6"),
        (_set((*CACHED, "histogram", 2, "rep_tokens"), None), "histogram[2].rep_tokens'"),
        (_set((*CACHED, "histogram", 2, "hi"), 1), "histogram[2].hi' must be >= 513"),
        (_set((*CACHED, "quantiles", "p50"), "x"), "quantiles.p50' must be a number"),
    ],
)
def test_bad_documents_name_the_field(mutate: Any, message: str) -> None:
    with pytest.raises(InputError) as info:
        parse_prefixes(_broken(mutate), "cached_tokens", where="p.json")
    text = str(info.value)
    assert message in text and text.startswith("p.json: ") and "\n" not in text


def test_file_errors(tmp_path: Path) -> None:
    with pytest.raises(UsageError, match="no such prefixes file"):
        load_prefixes(tmp_path / "missing.json")
    bad = tmp_path / "bad.json"
    bad.write_text('{"schema": "kvcadence.prefixes/1",\n  "page_size": }')
    with pytest.raises(InputError, match=r"bad.json:2:\d+: not valid JSON"):
        load_prefixes(bad)
    with pytest.raises(UsageError, match="--prefix-dist"):
        load_prefixes(EXAMPLE, "nope")
    top = tmp_path / "list.json"
    top.write_text("[]")
    with pytest.raises(InputError, match="top level must be a JSON object"):
        load_prefixes(top)
