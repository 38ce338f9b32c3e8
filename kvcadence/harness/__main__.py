"""``python -m kvcadence.harness``: the SGLang CPU harness command only."""

import sys

from kvcadence.cli import main

sys.exit(main(stages=("harness",)))
