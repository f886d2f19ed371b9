"""Checkpoint benchmarks of cfdist vs torch.save and DCP: a thin script over ``cfdist bench``.

    python bench/bench_checkpoint.py --quick        # same as: cfdist bench --quick
    python bench/bench_checkpoint.py                # the default suite (see cfdist/benchmarks/suite.py)

The measurement lives in :mod:`cfdist.benchmarks` (every method timed from the outside, the
same way); this script only forwards its arguments.
"""

from __future__ import annotations

import sys

from cfdist.cli import main

if __name__ == "__main__":
    sys.exit(main(["bench", *sys.argv[1:]]))
