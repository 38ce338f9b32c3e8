"""A request's cache namespace read from its record (``format.namespace``)."""

from __future__ import annotations

from kvcadence.format.namespace import Namespace, namespace_of, salt_of


def test_namespace_of_reads_the_request_parameters():
    assert namespace_of(None) is None
    assert namespace_of({"request_parameters": {"rid": "a"}}) is None
    assert namespace_of({"request_parameters": {"cache_salt": "", "extra_key": ""}}) is None
    assert namespace_of({"request_parameters": {"cache_salt": 7}}) is None  # not a str
    got = namespace_of({"request_parameters": {"cache_salt": "s", "extra_key": "k"}})
    assert got == Namespace("k", "s")
    assert salt_of({"request_parameters": {"extra_key": "k"}}) is None
    assert salt_of({"request_parameters": {"cache_salt": "s"}}) == "s"
