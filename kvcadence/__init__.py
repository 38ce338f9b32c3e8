"""kvcadence: capture, replay and compare SGLang KV-cache event cadence.

This module holds only the version. It imports nothing beyond the standard library, so
``import kvcadence`` stays cheap and works on a machine that has nothing but torch (the
kernels stage). Stages live in ``kvcadence.capture``, ``kvcadence.replay``,
``kvcadence.analysis`` and ``kvcadence.kernels``.
"""

__version__ = "0.1.0"

__all__ = ["__version__"]
