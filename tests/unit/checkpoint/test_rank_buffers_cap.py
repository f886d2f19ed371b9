"""A rank's own module buffers travel with its RNG states only up to a cap.

Real: ``state.rank_buffers`` on real modules. The point: BatchNorm statistics (small) travel;
a module whose buffers exceed ``RANK_BUFFERS_MAX_BYTES`` sends none (the c10d Store refuses a
message over 8 MiB: a run with an 11 MB registered buffer failed at its first checkpoint, every
attempt), and every rank then restores the writer's.
"""

import torch

from cfdist.checkpoint import state as st


def test_small_buffers_travel_and_large_ones_do_not():
    bn = torch.nn.BatchNorm1d(64)
    got = st.rank_buffers({"model": bn})
    assert set(got["model"]) == {"running_mean", "running_var", "num_batches_tracked"}

    big = torch.nn.Module()
    big.register_buffer("table", torch.zeros(st.RANK_BUFFERS_MAX_BYTES // 4 + 1))   # float32: just over
    assert st.rank_buffers({"model": bn, "big": big}) is None
    assert st.rank_buffers({"model": bn, "big": big}, limit=1 << 30) is not None
