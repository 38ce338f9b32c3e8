"""``python -m kvcadence.analysis``: the analysis stage's commands only."""

import sys

from kvcadence.cli import main

sys.exit(main(stages=("analysis",)))
