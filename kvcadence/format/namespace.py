"""A request's cache namespace: SGLang 0.5.23's ``(extra_key, cache_salt)``.

What this file owns: the ``Namespace`` value and reading it from a request record (the
metrics line's ``request_parameters``, where SGLang's ``--export-metrics-to-file`` keeps
every field the request was sent with).

SGLang 0.5.23 keys its radix tree by the namespace (``RadixKey.child_key_at``: a child's key
is ``((extra_key, cache_salt), page)`` with a salt, ``(extra_key, page)`` with an extra key
alone), so requests of different namespaces never share a prefix; a salt also seeds the page
hash chain (``sha256(b"sglang-cache-salt-v1\\0" + salt)``, ``format.hashes.cache_salt_seed``)
and rides on the ``BlockStored`` event (``cache_salt``: a store merges into the queue's tail
only with the same salt); an extra key alone changes no hash. ``""`` is no value (the
worker's ``GenerateReqInput`` normalises it to None). A LoRA adapter's id appended to the
extra key, and its post-mapped hashes, are not modelled (``settings.namespace_note``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

#: the request parameters that make a namespace
NAMESPACE_PARAMS = ("extra_key", "cache_salt")


@dataclass(frozen=True, slots=True)
class Namespace:
    """A non-default cache namespace (the default one, neither set, is None)."""

    extra_key: str | None = None
    cache_salt: str | None = None


def _param(params: dict[str, Any], key: str) -> str | None:
    v = params.get(key)
    return v if isinstance(v, str) and v else None


def namespace_of(meta_info: dict[str, Any] | None) -> Namespace | None:
    """The namespace a request was sent in (its record's ``request_parameters``), None for
    the default one (or where the record does not say)."""
    params = (meta_info or {}).get("request_parameters")
    if not isinstance(params, dict):
        return None
    extra, salt = _param(params, "extra_key"), _param(params, "cache_salt")
    if extra is None and salt is None:
        return None
    return Namespace(extra, salt)


def salt_of(meta_info: dict[str, Any] | None) -> str | None:
    """The ``cache_salt`` a request was sent with (``namespace_of``'s), None without one:
    what seeds its page hash chain."""
    ns = namespace_of(meta_info)
    return None if ns is None else ns.cache_salt
