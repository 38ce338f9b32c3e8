"""``python -m kvcadence.capture``: the capture stage's commands only."""

import sys

from kvcadence.cli import main

sys.exit(main(stages=("capture",)))
