"""Tests of bench/pace_matrix.py: the pace settings' bars, counted per setting."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.benchscript import bench_script


@pytest.fixture(scope="module")
def pm():
    yield from bench_script("pace_matrix")


def test_one_capture_under_every_setting(pm, tmp_path: Path, capsys):
    """``p8-chunk128-nooverlap-http-clients`` (production path only) misses ``cached_tokens``
    equal at the model's pace and holds every bar at the recorded pace clamped to [0.5, 2]
    (``tests/replay/test_corpus.py`` pins both); the report counts each setting."""
    out = tmp_path / "m.json"
    assert pm.main(["--only", "p8-chunk128-nooverlap-http-clients", "--json", str(out)]) == 0
    (res,) = json.loads(out.read_text())
    assert (res["name"], res["path"], res["multi_rank"]) == (
        "p8-chunk128-nooverlap-http-clients",
        "production",
        False,
    )
    names = [pm.setting_name(p, c) for p, c in pm.SETTINGS]
    assert list(res["misses"]) == names
    assert list(res["misses"][names[0]]) == ["cached_equal"]
    assert res["misses"]["recorded [0.5, 2]"] == {}
    # one rank at the model's pace does not depend on the clamp
    for s in names:
        if s.startswith("model"):
            assert res["misses"][s] == res["misses"][names[0]]
    text = capsys.readouterr().out
    assert "| model [0.5, 2] | 0/1 | 0/1 | 0/0 | 0/1 |" in text
    assert "| recorded [0.5, 2] | 1/1 | 1/1 | 0/0 | 1/1 |" in text
    assert "recorded [0.5, 2] vs model [0.5, 2]: fixes 1" in text
