"""Pure-PyTorch stand-in for the CPU build of ``sgl_kernel`` (SGLang 0.5.23, non-AMX CPUs).

Provides the one op SGLang calls in plain CPU serving, ``assign_req_to_token_pool_cpu``;
every other name resolves to a placeholder that raises ``NotImplementedError`` when called
(so ``from sgl_kernel import X`` succeeds at SGLang's module load). Runs inside the SGLang
worker's venv only, never inside kvcadence.
"""

from __future__ import annotations

import logging

__version__ = "0.0.0+torchshim"

_log = logging.getLogger(__name__)


def assign_req_to_token_pool_cpu(
    req_pool_indices, req_to_token, start_offset, end_offset, out_cache_loc, pool_len
) -> None:
    """Write each request's newly allocated KV slots into its ``req_to_token`` row."""
    pos = 0
    for row, s, e in zip(
        req_pool_indices.tolist(), start_offset.tolist(), end_offset.tolist(), strict=True
    ):
        n = e - s
        if n > 0:
            req_to_token[row, s:e] = out_cache_loc[pos : pos + n].to(req_to_token.dtype)
        pos += n


def __getattr__(name: str):
    if name.startswith("__") and name.endswith("__"):
        raise AttributeError(name)
    _log.warning("sgl_kernel shim: providing placeholder for %s", name)

    def _placeholder(*args, **kwargs):
        raise NotImplementedError(f"sgl_kernel shim: {name} not implemented")

    _placeholder.__name__ = name
    return _placeholder
