"""The all_gather_single / all_gather_into_tensor shim, on fakes and on a real world-1 group."""

from __future__ import annotations

import types

import torch
import torch.distributed as dist

from kvcadence.kernels.compat import all_gather_name, resolve_all_gather


def _old(out, inp, group=None, async_op=False):  # noqa: ANN001, ANN202 - a fake torch API
    return "old"


def _new(out, inp, group=None, async_op=False):  # noqa: ANN001, ANN202
    return "new"


def test_prefers_the_new_name() -> None:
    both = types.SimpleNamespace(all_gather_single=_new, all_gather_into_tensor=_old)
    assert resolve_all_gather(both) is _new


def test_falls_back_on_older_torch() -> None:
    old_only = types.SimpleNamespace(all_gather_into_tensor=_old)  # torch 2.4 .. 2.12
    assert resolve_all_gather(old_only) is _old
    assert all_gather_name(old_only) == "_old"


def test_neither_name_is_a_clear_error() -> None:
    import pytest

    with pytest.raises(RuntimeError, match="torch >= 2.4"):
        resolve_all_gather(types.SimpleNamespace())


def test_real_gloo_all_gather_emits_no_warning() -> None:
    """pytest runs with filterwarnings=error: a FutureWarning here fails the test."""
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        fn = resolve_all_gather()
        if hasattr(dist, "all_gather_single"):
            assert fn is dist.all_gather_single
        out = torch.zeros(4, dtype=torch.bfloat16)
        fn(out, torch.arange(4, dtype=torch.bfloat16))
        assert out.tolist() == [0.0, 1.0, 2.0, 3.0]
    finally:
        dist.destroy_process_group()
