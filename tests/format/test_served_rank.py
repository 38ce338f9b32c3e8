"""``served_rank``: the one resolver of the DP rank that served a request record."""

from __future__ import annotations

import pytest

from kvcadence.errors import InputError
from kvcadence.format.schema import RequestRecord, served_rank


def rec(dp_rank=None, meta=None) -> RequestRecord:
    return RequestRecord(rid="r1", input_ids=[1, 2], dp_rank=dp_rank, meta_info=meta or {})


def test_field_then_meta_info_then_zero() -> None:
    assert served_rank(rec(dp_rank=3, meta={"dp_rank": 1})) == 3
    assert served_rank(rec(meta={"dp_rank": 1})) == 1
    assert served_rank(rec()) == 0


@pytest.mark.parametrize("bad", ["1", 1.0, True, -1, [0]])
def test_a_rank_that_is_not_a_non_negative_int_is_an_input_error(bad) -> None:
    with pytest.raises(InputError, match=r"'r1'.*dp_rank"):
        served_rank(rec(meta={"dp_rank": bad}))
