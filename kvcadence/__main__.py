"""``python -m kvcadence``: the same as the ``kvcadence`` console script."""

import sys

from kvcadence.cli import main

sys.exit(main())
