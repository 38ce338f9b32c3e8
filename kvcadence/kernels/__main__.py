"""``torchrun --nproc-per-node N -m kvcadence.kernels ...``: the collective benchmark worker."""

import sys

from kvcadence.kernels.bench import main

sys.exit(main())
