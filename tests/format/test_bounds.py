"""``format.bounds.json_loads``: the nesting limit holds exactly at ``MAX_JSON_DEPTH``,
whether or not the depth walk (``too_deep``) runs; texts that open few brackets skip it."""

from __future__ import annotations

import json

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvcadence.format import bounds
from kvcadence.format.bounds import MAX_JSON_DEPTH, json_loads, too_deep


def _nest(depth: int, leaf: object = 1) -> object:
    v = leaf
    for k in range(depth):
        v = [v] if k % 2 else {"k": v}
    return v


@pytest.mark.parametrize("as_bytes", [False, True])
def test_the_limit_is_exact(as_bytes):
    ok = json.dumps(_nest(MAX_JSON_DEPTH))
    bad = json.dumps(_nest(MAX_JSON_DEPTH + 1))
    assert json_loads(ok.encode() if as_bytes else ok) == _nest(MAX_JSON_DEPTH)
    with pytest.raises(json.JSONDecodeError, match="nested deeper"):
        json_loads(bad.encode() if as_bytes else bad)


def test_a_long_flat_line_is_not_walked(monkeypatch):
    """A metrics line's 100k-token prompt: a few brackets, so the depth walk does not run."""
    walked = []
    monkeypatch.setattr(bounds, "too_deep", lambda obj: walked.append(obj) or False)
    line = json.dumps({"rid": "a", "input_ids": list(range(100_000)), "meta": {"x": [1, 2]}})
    assert json_loads(line)["input_ids"][-1] == 99_999 and walked == []
    # brackets inside strings only raise the count: walked then, and still accepted
    noisy = json.dumps({"text": "[{" * MAX_JSON_DEPTH})
    assert json_loads(noisy) == {"text": "[{" * MAX_JSON_DEPTH} and len(walked) == 1


json_values = st.recursive(
    st.none() | st.integers() | st.text(alphabet='ab[]{}"\\', max_size=4),
    lambda inner: (
        st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=2), inner, max_size=3)
    ),
    max_leaves=40,
)


@given(json_values, st.integers(0, MAX_JSON_DEPTH + 3))
def test_refused_exactly_when_too_deep(value, wrap):
    doc = _nest(wrap, value)
    text = json.dumps(doc)
    if too_deep(doc):
        with pytest.raises(json.JSONDecodeError, match="nested deeper"):
            json_loads(text)
    else:
        assert json_loads(text) == doc


@given(json_values, st.integers(0, MAX_JSON_DEPTH + 3))
def test_jsonl_objects_refused_exactly_when_too_deep(value, wrap):
    """``jsonl.decode_object`` (``kvcadence import --requests`` lines) holds the same limit."""
    from kvcadence.errors import InputError
    from kvcadence.format.jsonl import decode_object

    doc = {"v": _nest(wrap, value)}
    text = json.dumps(doc)
    if too_deep(doc):
        with pytest.raises(InputError, match="nested deeper"):
            decode_object(text, "x:1")
    else:
        assert decode_object(text.encode(), "x:1") == doc
