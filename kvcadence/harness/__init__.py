"""Harness: everything that builds or runs inside SGLang's own venv.

``worker`` builds the SGLang 0.5.23 CPU venv and the tiny model and starts/stops workers;
``sglang_cpu/`` holds the assets that run inside that venv (requirements, the model maker,
the ``sgl_kernel`` stand-in); ``sglang_adder_driver.py`` runs the real PrefillAdder there and
never imports kvcadence. Imports nothing heavy at package level.
"""
