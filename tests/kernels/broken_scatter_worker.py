"""A torchrun worker whose scatter is deliberately broken on rank 1 (used by test_torchrun).

It swaps two pages after the real scatter, then runs the normal benchmark entry; verification
must catch it and every rank must exit non-zero instead of hanging.
"""

from __future__ import annotations

import os
import sys

from kvcadence.kernels import bench, paths

_real_scatter = paths.RankCase.scatter


def _broken_scatter(self: paths.RankCase):  # type: ignore[no-untyped-def]
    dense = _real_scatter(self)
    if self.rank == 1 and self.pages > 1:
        dense[[0, 1]] = dense[[1, 0]]
    return dense


if __name__ == "__main__":
    assert os.environ.get("WORLD_SIZE") == "2"
    paths.RankCase.scatter = _broken_scatter  # type: ignore[method-assign]
    sys.exit(bench.main())
