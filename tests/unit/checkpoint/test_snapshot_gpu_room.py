"""Whether a GPU snapshot may go to GPU memory: ``snapshot.gpu_room`` and its use by the
Snapshotter, on the CPU.

Faked (no GPU here): ``torch.cuda.mem_get_info``, monkeypatched to report a device's free and
total bytes; the same decision on a real device is covered by the GPU-marked tests in
``tests/integration/checkpoint/test_checkpoint_gpu_snapshot.py``.
"""

from __future__ import annotations

import pytest
import torch

from cfdist.checkpoint import snapshot

GiB = 1 << 30


@pytest.mark.parametrize("free, total, nbytes, headroom, fits", [
    (10 * GiB, 80 * GiB, 5 * GiB, 0.05, True),      # 5 <= 10 - 4
    (10 * GiB, 80 * GiB, 7 * GiB, 0.05, False),     # 7 > 10 - 4: would eat the headroom
    (10 * GiB, 80 * GiB, 10 * GiB, 0.0, True),
    (1 * GiB, 80 * GiB, 1, 0.05, False),            # less free than the headroom: nothing fits
])
def test_gpu_room_keeps_the_headroom_free(monkeypatch, free, total, nbytes, headroom, fits):
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (free, total))
    assert snapshot.gpu_room(nbytes, torch.device("cuda", 0), headroom=headroom) is fits


def test_cpu_tensors_never_ask_for_gpu_memory(monkeypatch):
    """``mode="gpu"`` with CPU tensors copies to host memory and asks the device nothing."""
    def no_query(*a, **k):
        raise AssertionError("mem_get_info called for a CPU state")

    monkeypatch.setattr(torch.cuda, "mem_get_info", no_query)
    snap = snapshot.Snapshotter()
    t = {"w": torch.arange(6.0)}
    snap.start(t, mode="gpu")
    snap.wait_copied()
    assert snap.last_device == "cpu" and snap.gpu_refused == 0 and snap.gpu_nbytes == 0
    assert torch.equal(snap.host[0].view(snap.layout[0][0]), t["w"])
    snap.close()
