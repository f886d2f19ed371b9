"""``Checkpointer.abandon``: what a rank whose attempt failed does before its process is reused
for the next attempt (in-process re-forming under ``cfdist.fit``).

Real: the Checkpointer, its thread backend and file:// storage. Faked: a disk whose shard write
hangs (``hang``), standing in for a persist the failed attempt left in flight. The point:
abandon returns without waiting for that persist, removes the hooks it put on the live objects
(the next attempt's Checkpointer puts its own), and a later close() is a no-op.
"""

from __future__ import annotations

import time

import torch

import cfdist
from cfdist.storage import open_storage
from cfdist.testing import hang


def test_abandon_does_not_wait_for_the_persist_in_flight_and_removes_its_hooks(tmp_path):
    model = torch.nn.Linear(8, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    st = hang(open_storage(f"file://{tmp_path / 'ckpt'}"))
    ckpt = cfdist.Checkpointer({"model": model, "optim": opt}, st, cfdist.Every(1))
    assert len(model._forward_pre_hooks) == 1
    st.arm(hang_after_bytes=0, only="shard")
    try:
        model(torch.randn(4, 8)).sum().backward()
        ckpt.step(opt)
        deadline = time.monotonic() + 30
        while not st.entered.is_set() and time.monotonic() < deadline:
            model(torch.zeros(1, 8))        # the next forward hands the snapshot to the persist
            time.sleep(0.005)
        assert st.entered.is_set()          # step 1's persist is in flight and blocked
        ckpt.abandon()                      # returns although the persist never ends
        assert len(model._forward_pre_hooks) == 0
        ckpt.close()                        # no-op: abandoned
        assert ckpt.latest_step is None
    finally:
        st.release()
