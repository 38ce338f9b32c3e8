"""The cache hit rate: ONE formula for every stage that reports it.

A request's prompt tokens are the server-reported ``prompt_tokens``, else (absent or 0)
``len(input_ids)``; its cached tokens are ``cached_tokens`` (absent = 0). The hit rate of a
set of requests is Σ cached / Σ prompt (None when there are no prompt tokens).

``kvcadence.analysis`` sums these over the Parquet tables (``PROMPT_SQL``, ``CACHED_SQL``);
``capture.inspect`` and the replay's sweep summary keep a cheap live count with
``prompt_tokens``/``cached_tokens``; all of them divide with ``hit_rate``.
"""

from __future__ import annotations

from typing import Any

#: a request's prompt tokens over the ``requests`` table (SQL)
PROMPT_SQL = "coalesce(nullif(prompt_tokens, 0), n_input)"
#: a request's cached tokens over the ``requests`` table (SQL)
CACHED_SQL = "coalesce(cached_tokens, 0)"


def prompt_tokens(rec: Any) -> int:
    """A request record's prompt tokens (server-reported, else ``len(input_ids)``)."""
    n: int = rec.prompt_tokens or len(rec.input_ids)
    return n


def cached_tokens(rec: Any) -> int:
    """A request record's cached tokens (absent = 0)."""
    n: int = rec.cached_tokens or 0
    return n


def hit_rate(cached: int, prompt: int) -> float | None:
    """Σ cached tokens / Σ prompt tokens; None without prompt tokens."""
    return cached / prompt if prompt else None
