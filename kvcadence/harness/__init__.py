"""Harness: everything that builds or runs inside SGLang's own venv.

``venv`` builds the SGLang 0.5.23 CPU venv and the tiny model, ``worker`` starts workers
(``ports``: their loopback ports; ``proctree``: stopping a worker's whole process tree);
``sglang_cpu/`` holds the assets that run inside that venv (requirements, the model maker,
the ``sgl_kernel`` stand-in); ``sglang_adder_driver.py`` runs the real PrefillAdder there and
never imports kvcadence. Imports nothing heavy at package level.
"""
