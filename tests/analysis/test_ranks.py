"""Per-rank figures read a request's rank by ``served_rank``'s rule, also over the tables."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvcadence.analysis.ranks import rank_figures
from kvcadence.errors import InputError
from kvcadence.format.bundle import BundleWriter
from kvcadence.format.schema import RequestRecord
from tests.analysis.helpers import header


def _bundle(path: Path, meta_ranks: list[object]) -> Path:
    with BundleWriter(path, header(ranks=2)) as w:
        for i, r in enumerate(meta_ranks):
            meta = {"prompt_tokens": 2, "cached_tokens": 0}
            if r is not None:
                meta["dp_rank"] = r
            w.write(RequestRecord(rid=f"r{i}", input_ids=[1, 2], meta_info=meta))
    return path


def test_requests_land_on_their_recorded_rank(tmp_path: Path) -> None:
    figs = rank_figures(_bundle(tmp_path / "b", [0, 1, 1, None]))
    assert figs["0"]["requests"] == 2 and figs["1"]["requests"] == 2


@pytest.mark.parametrize("bad", ["1", 1.5, True, -1])
def test_a_rank_that_is_not_a_non_negative_int_is_an_input_error(tmp_path: Path, bad) -> None:
    with pytest.raises(InputError, match=r"'r1'.*dp_rank"):
        rank_figures(_bundle(tmp_path / "b", [0, bad]))
