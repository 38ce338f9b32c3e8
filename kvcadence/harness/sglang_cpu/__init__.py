"""Package data for the real-SGLang CPU harness (not imported by kvcadence itself).

* ``sglang-cpu-requirements.txt`` -- SGLang 0.5.23's pinned runtime dependencies minus CUDA.
* ``sgl_kernel/`` -- the pure-PyTorch ``sgl_kernel`` stand-in; this directory goes first on the
  worker's ``PYTHONPATH`` so SGLang imports it instead of any installed ``sgl_kernel``.
* ``mkmodel.py`` -- writes the tiny deterministic random-weight Llama the worker serves.
"""
