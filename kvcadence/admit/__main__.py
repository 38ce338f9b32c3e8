"""``python -m kvcadence.admit``: the admission benchmark's command only."""

import sys

from kvcadence.cli import main

sys.exit(main(stages=("admit",)))
