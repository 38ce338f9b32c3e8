"""Admit stage: SGLang's offline admission benchmark around the simulator's PrefillAdder.

``ticks`` (the request model, fake tree cache and allocator, the tick loop, rendering),
``inputs`` (waiting queues from a grid, a JSONL file or a bundle), ``real`` (the bridge to the
real PrefillAdder in the harness venv) and ``cli``. It touches the simulator only through
``kvcadence.replay.admission``. Imports nothing heavy at package level.
"""
