"""``python -m kvcadence.replay``: the replay stage's commands only."""

import sys

from kvcadence.cli import main

sys.exit(main(stages=("replay",)))
