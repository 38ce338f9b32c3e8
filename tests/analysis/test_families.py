"""Report across hash families, on the committed live recording of Dynamo's mocker: the
mismatch is named (one sentence, right after Data quality), hash-agnostic figures still
compare, and blocks are attributed on SGLang hashes recomputed from token_ids."""

from __future__ import annotations

import json

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvcadence.analysis import families, ingest
from kvcadence.cli import main


class _M:
    inputs = {"page_size": 1}


def test_bundle_family_recomputes_sglang_hashes(mocker_bundles):
    real, mocker = mocker_bundles
    r = families.bundle_family(real)
    assert (r.family, r.checked_events, r.matching_events) == ("sglang", 231, 231)
    assert not r.translated  # an SGLang stream needs no translation
    m = families.bundle_family(mocker)
    assert m.family == "other" and m.matching_events == 0 and m.checked_events > 4000
    assert m.unchecked_events == 0  # every Stored event carries token_ids and a known parent
    assert len(m.translated) >= 14_780


def test_compare_families_on_the_mocker_recording(mocker_bundles):
    real, mocker = mocker_bundles
    ings = [ingest.ingest(real), ingest.ingest(mocker)]
    got = families.compare_families([("real", _M), ("mocker", _M)], ings)
    assert got["mismatches"] == ["mocker"]
    m = got["bundles"]["mocker"]
    assert m["shared_with_real_blocks"] == 0  # no published hash in common
    assert m["recomputed_shared_with_real_blocks"] >= 14_700  # the same tokens after all
    a = m["attribution_recomputed"]
    assert a["matched_blocks"] >= 14_700 and a["unmatched_blocks"] < 100
    assert a["prompt_blocks"] > a["output_blocks"] > 4_000
    # one prompt store at admission, then one single-block store per generated token
    assert a["prefill_store_events_per_request"] == pytest.approx(1.8, abs=0.2)
    assert a["finish_store_events_per_request"] > 30
    s = got["sentence"]
    assert s.startswith("Hash-family mismatch: real publishes SGLang's chained SHA-256")
    assert "mocker publishes block hashes of another family" in s


def test_families_agree_for_kvcadence_replay(mocker_bundles, tmp_path):
    real, _ = mocker_bundles
    sim = tmp_path / "sim.kvcb"
    assert main(["replay", str(real), "--out", str(sim), "--quiet"]) == 0
    got = families.compare_families(
        [("real", _M), ("sim", _M)], [ingest.ingest(real), ingest.ingest(sim)]
    )
    assert got["mismatches"] == [] and got["sentence"].startswith("Hash families agree")
    assert got["bundles"]["sim"]["shared_with_real_blocks"] == 14_747


def test_report_names_the_mismatch_after_data_quality(mocker_bundles, tmp_path):
    real, mocker = mocker_bundles
    out = tmp_path / "rep"
    rc = main(["report", str(real), str(mocker), "--out", str(out), "--no-plots", "--quiet"])
    assert rc == 3  # the mocker fails the default cadence gates
    doc = json.loads((out / "report.json").read_text())
    # both bundles are imported captures (source "real"): labelled by what they are, numbered
    assert [b["label"] for b in doc["bundles"]] == ["real1", "real2"]
    assert doc["hash_families"]["mismatches"] == ["real2"]
    md = (out / "report.md").read_text()
    titles = [line[3:] for line in md.splitlines() if line.startswith("## ")]
    assert titles[titles.index("Data quality") + 1] == "Hash families"
    assert "Hash-family mismatch: real1 publishes" in md
    # hash-agnostic figures compare as usual
    sim = doc["bundles"][1]["metrics"]
    assert sim["stored_events_per_request"]["value"] == pytest.approx(39.61, abs=0.01)
    assert sim["blocks_per_stored_event.median"]["value"] == 1
    assert sim["total_stored_blocks"]["value"] == 14_780


@given(
    st.lists(st.integers(-(1 << 63), (1 << 63) - 1), max_size=60),
    st.lists(st.integers(-(1 << 63), (1 << 63) - 1), max_size=60),
    st.integers(0, 30),
)
def test_distinct_and_shared_hashes_are_numpys(a: list[int], b: list[int], k: int) -> None:
    """``_unique`` (a sort, not numpy's hash table) and ``_shared`` (binary searches) give
    ``np.unique`` and ``np.isin``'s count, with values in both."""
    x = np.array(a + b[:k], dtype=np.int64)
    y = np.array(b, dtype=np.int64)
    ux, uy = families._unique(x), families._unique(y)
    assert np.array_equal(ux, np.unique(x)) and np.array_equal(uy, np.unique(y))
    assert families._shared(ux, uy) == int(np.isin(ux, uy).sum())
