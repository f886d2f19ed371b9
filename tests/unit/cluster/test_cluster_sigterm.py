"""SIGTERM on a rank: an emergency checkpoint when the recent commit latency fits the grace
window, else an immediate exit. Real: the signal (raised in this process, handled on the main
thread) and the TrainContext bookkeeping; faked: the Checkpointer (a stub with the fields
the context reads) and the process exit (recorded instead of exiting the test)."""

from __future__ import annotations

import signal
import time

import pytest
import torch

from cfdist.cluster.context import RankInfo, TrainContext
from cfdist.cluster.worker import RankWorker

INFO = RankInfo(rank=0, world_size=1, local_rank=0, local_world_size=1, node_rank=0, num_nodes=1, attempt=0)


class Ck:
    writer = True

    def __init__(self):
        self.step_count, self.latest_step = 0, None
        self._stats = {"stall_s": 0.0, "errors": 0, "last_error": None}


@pytest.fixture
def worker(monkeypatch):
    exits = []
    monkeypatch.setattr("os._exit", lambda code: exits.append(code))
    old = signal.getsignal(signal.SIGTERM)
    w = RankWorker(INFO, use_gpu=False, timeout_s=10, cpus=0, sigterm_grace_s=2.0)
    w.ctx = TrainContext(info=INFO, device=torch.device("cpu"), tiers={}, node_actor=None, policy=None, keep=1,
                         restore_step=None, restore_tier="none")
    ck = Ck()
    w.ctx._ckpts.append(ck)
    w._training = True   # inside run()
    yield w, ck, exits
    signal.signal(signal.SIGTERM, old)


def _steps(ctx, ck, n, commit_lag_s):
    for _ in range(n):
        ck.step_count += 1
        if ck.step_count % 5 == 0:
            ck._pending = (ck.step_count, time.time())
        if getattr(ck, "_pending", None) and time.time() - ck._pending[1] >= commit_lag_s:
            ck.latest_step = ck._pending[0]
            ck._pending = None
        ctx._on_step(ck)
        time.sleep(0.01)


def test_sigterm_with_fast_commits_requests_a_checkpoint_and_exits_after_it(worker):
    w, ck, exits = worker
    _steps(w.ctx, ck, 22, commit_lag_s=0.0)
    assert list(w.ctx._commit_s) and max(w.ctx._commit_s) < 2.0
    signal.raise_signal(signal.SIGTERM)
    assert w.sigterm_handled and w.ctx.preempted
    assert w.ctx._on_step(ck) is True              # the save request reaches the next step
    ck.latest_step = ck.step_count + 1             # ... and it commits
    deadline = time.time() + 5
    while not exits and time.time() < deadline:
        time.sleep(0.02)
    assert exits == [1]


def test_sigterm_with_commits_slower_than_the_window_exits_at_once(worker):
    w, ck, exits = worker
    w.ctx._commit_s.extend([5.0, 6.0, 7.0])        # measured commit latencies: ~6 s > 2 s window
    signal.raise_signal(signal.SIGTERM)
    assert exits == [1]   # through cfdist.cluster.exits.exit_process: no interpreter shutdown
    assert w.ctx.preempted and w.ctx._on_step(ck) is False


def test_sigterm_outside_training_exits_as_ray_would(worker):
    w, ck, exits = worker
    w._training = False    # a spare, or a rank whose loop returned
    signal.raise_signal(signal.SIGTERM)
    assert exits == [1] and not w.ctx.preempted
