"""The real worker's eviction trace (``harness start --trace-evictions FILE``).

Runs inside SGLang's own venv (this directory is first on the worker's ``PYTHONPATH``, so
every interpreter of the worker imports it at start-up); standard library only. It does
nothing unless ``KVCADENCE_EVICTION_TRACE`` names a file. Then, once SGLang 0.5.23's
``mem_cache.unified_radix_cache`` is imported, every call of
``UnifiedRadixCache.evict_for_alloc`` (the allocations' ``evict_to_free_tokens``) and
``UnifiedRadixCache.evict`` (retraction, ``_evict_until_allocatable``) is appended to that
file as one JSON line, after the call::

    {"t": wall time (s), "call": "evict_for_alloc" | "evict",
     "cause": "prefill" | "decode" | "check_decode" | "retract" | "other",
     "need": the tokens asked for (the shortfall: demand - available),
     "avail0": the allocator's available tokens before, "avail1": after,
     "freed": the tokens the tree evicted, "rids": the request ids it was for (or null),
     "stack": the calling functions, innermost first}

``cause`` is read from the calling functions (``alloc_for_extend``: a prefill batch's KV;
``alloc_for_decode``: a decode step's; ``check_decode_mem``: the decode memory check;
``release_req`` / ``retract_decode``: a retraction), ``rids`` from the innermost caller holding
``requests`` (a decode check's, in a retraction loop the requests that stay) or ``batch``
(a retraction's: the decode batch it retracts from). The worker's behaviour is unchanged: the
wrapped methods are called with the same arguments and their results returned as they are.
An interpreter's own ``sitecustomize`` further on ``sys.path``, which this file shadows,
is run after it (``_chain``). ``replay --trace-evictions`` writes the simulator's evictions
in the same shape
(``replay.evictiontrace``); docs/simulator.md, "Eviction traces", compares the two.
"""

import importlib.abc
import importlib.machinery
import importlib.util
import json
import os
import sys
import threading
import time

_PATH = os.environ.get("KVCADENCE_EVICTION_TRACE")
_MODULE = "sglang.srt.mem_cache.unified_radix_cache"
_LOCK = threading.Lock()
#: calling function -> cause, the first found from the innermost out
_CAUSES = {
    "alloc_for_extend": "prefill",
    "alloc_for_decode_default": "decode",
    "alloc_for_decode": "decode",
    "check_decode_mem": "check_decode",
    "retract_decode": "retract",
    "release_req": "retract",
}


def _rids(local):
    """The request ids of a frame's ``requests`` (a decode check's selected requests) or
    ``batch`` (a ``ScheduleBatch``), None when it has neither."""
    try:
        reqs = local.get("requests")
        if isinstance(reqs, (list, tuple)) and reqs and hasattr(reqs[0], "rid"):
            return [str(r.rid) for r in reqs]
        batch = local.get("batch")
        if batch is not None and hasattr(batch, "reqs"):
            return [str(r.rid) for r in batch.reqs]
    except Exception:  # noqa: BLE001 - a trace, not the worker's business
        pass
    return None


def _context():
    names, rids, cause = [], None, None
    f = sys._getframe(2)  # past this function and the wrapper: the caller
    while f is not None and len(names) < 16:
        name = f.f_code.co_name
        names.append(name)
        if cause is None:
            cause = _CAUSES.get(name)
        if rids is None:
            rids = _rids(f.f_locals)
        f = f.f_back
    return names, rids, cause or "other"


def _wrap(orig, call):
    def traced(self, params, *args, **kwargs):
        alloc = self.token_to_kv_pool_allocator
        avail0 = alloc.available_size()
        result = orig(self, params, *args, **kwargs)
        names, rids, cause = _context()
        line = json.dumps(
            {
                "t": time.time(),
                "call": call,
                "cause": cause,
                "need": int(getattr(params, "num_tokens", 0) or 0),
                "avail0": int(avail0),
                "avail1": int(alloc.available_size()),
                "freed": int(getattr(result, "num_tokens_evicted", 0) or 0),
                "rids": rids,
                "stack": names,
            }
        )
        with _LOCK, open(_PATH, "a") as fh:
            fh.write(line + "\n")
        return result

    traced.__wrapped__ = orig
    return traced


def _patch(module):
    cls = module.UnifiedRadixCache
    cls.evict_for_alloc = _wrap(cls.evict_for_alloc, "evict_for_alloc")
    cls.evict = _wrap(cls.evict, "evict")


class _Finder(importlib.abc.MetaPathFinder):
    """Patches ``_MODULE`` right after it is executed (nothing else is touched)."""

    def find_spec(self, name, path, target=None):
        if name != _MODULE:
            return None
        sys.meta_path.remove(self)  # the real spec, found the usual way
        spec = importlib.util.find_spec(name)
        if spec is None or spec.loader is None:
            return spec
        run = spec.loader.exec_module

        def exec_module(module):
            run(module)
            _patch(module)

        spec.loader.exec_module = exec_module
        return spec


def _chain():
    """Run the ``sitecustomize`` this one shadows (the interpreter's own, further on
    ``sys.path``), as Python would have without this directory first."""
    here = os.path.dirname(os.path.abspath(__file__))
    for entry in sys.path:
        if not entry or os.path.abspath(entry) == here:
            continue
        spec = importlib.machinery.PathFinder.find_spec("sitecustomize", [entry])
        if spec is not None and spec.loader is not None:
            module = importlib.util.module_from_spec(spec)
            spec.loader.exec_module(module)
            return


if _PATH:
    sys.meta_path.insert(0, _Finder())
_chain()
