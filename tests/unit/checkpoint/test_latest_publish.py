"""A commit whose ``latest_step`` cannot be published (the job's store is gone) stays a commit.

Real: the Checkpointer, its thread persist backend, ``file://`` storage with fsync.
Faked: the job's c10d store. The Checkpointer runs alone (world size 1 has no store), and its
publishing is pointed at a store that answers like one whose host process ended
(``DistNetworkError: Connection reset by peer``): under torchrun the rendezvous store lives in
rank 0, and a writer on another node that collects its last commit after rank 0 exited hit it.
The point: ``close()`` returns, the step is committed and is this rank's ``latest_step``, and
the failure is logged, not raised (it made the rank exit 1 after a clean run, and torchrun's
agents then waited for each other until their exit barrier timed out).
"""

from __future__ import annotations

import logging

import torch
import torch.distributed as dist

import cfdist
from cfdist.checkpoint import checkpointer as ckmod
from cfdist.checkpoint.discovery import committed_steps
from cfdist.storage import open_storage


def test_a_commit_whose_publish_fails_is_still_committed_and_close_returns(tmp_path, monkeypatch, caplog):
    url = f"file://{tmp_path}"
    model = torch.nn.Linear(4, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ck = cfdist.Checkpointer({"model": model, "optim": opt}, url, cfdist.Every(2))

    def gone(*args, **kwargs):
        raise dist.DistNetworkError("Connection reset by peer")

    ck._channel = object()   # as on a committing rank of a multi-rank job
    monkeypatch.setattr(ckmod.newest, "publish", gone)
    for _ in range(2):
        model(torch.randn(3, 4)).sum().backward()
        ck.step(opt)
        opt.zero_grad()
    with caplog.at_level(logging.WARNING, logger="cfdist.checkpointer"):
        ck.close()
    assert committed_steps(open_storage(url)) == [2]
    assert ck.latest_step == 2
    assert any("step 2 is committed, but publishing it" in r.getMessage() and "Connection reset" in r.getMessage()
               for r in caplog.records), [r.getMessage() for r in caplog.records]
