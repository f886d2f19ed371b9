"""The persist pipeline's handles and the sliced commit's fate, without a training loop.

Real: :class:`PersistPipeline` with its thread, a fake backend whose writes block until the
test lets them go (to hold a persist at a known stage), c10d ``HashStore`` as the transport
of :class:`Fate`. The points: a handle can be given up while queued, while its write runs, and
not once its commit was claimed; a sliced step given up by one writer cannot be claimed by
writer 0, and one writer 0 claimed cannot be given up by anyone.
"""

from __future__ import annotations

import concurrent.futures as cf
import threading
import time

import pytest
import torch.distributed as dist

from cfdist.checkpoint.agreement import Channel
from cfdist.checkpoint.persist import CommitGate, CommitInfo, FuturePending, PersistAbandoned, PersistJob
from cfdist.checkpoint.pipeline import PersistPipeline
from cfdist.checkpoint.slice_commit import Fate


class HeldBackend:
    """Each write blocks until ``go[step]`` is set; then it claims the gate (as a writer does
    right before its commit) and commits, or raises PersistAbandoned."""

    needs_shared_memory = False

    def __init__(self):
        self.go: dict[int, threading.Event] = {}
        self.started: dict[int, threading.Event] = {}
        self.abandoned: list[int] = []

    def new_gate(self, step: int) -> CommitGate:
        return CommitGate()

    def ready_at(self) -> float:
        return 0.0

    def submit(self, job: PersistJob):
        go = self.go.setdefault(job.step, threading.Event())
        started = self.started.setdefault(job.step, threading.Event())
        fut: cf.Future = cf.Future()

        def run():
            started.set()
            go.wait(30)
            if not job.gate.claim():
                fut.set_exception(PersistAbandoned(f"step {job.step}"))
                return
            fut.set_result(CommitInfo(step=job.step, url="x", bytes=1, seconds=0.0))

        threading.Thread(target=run, daemon=True).start()
        return FuturePending(fut, job.step, job.gate, on_abandon=lambda p: self.abandoned.append(p.step))

    def close(self) -> None:
        pass


def _job(step: int) -> PersistJob:
    return PersistJob(step=step, manifest={}, shards=[])


def _wait(event: threading.Event, what: str) -> None:
    assert event.wait(30), f"{what} did not happen within 30 s"


def test_handles_are_given_up_while_running_and_queued_and_the_next_ones_go_on():
    b = HeldBackend()
    pipe = PersistPipeline(b)
    h1, h2, h3 = pipe.submit(_job(1)), pipe.submit(_job(2)), pipe.submit(_job(3))
    _wait(b.started.setdefault(1, threading.Event()), "step 1's write starting")
    assert h2.abandon()                                  # queued: never starts
    assert h1.abandon()                                  # running: its writer can no longer commit
    with pytest.raises(PersistAbandoned):
        h1.wait(5)
    _wait(b.started.setdefault(3, threading.Event()), "step 3's write starting after 1 was given up")
    assert 2 not in b.started                            # the queued one never ran
    b.go.setdefault(3, threading.Event()).set()
    assert h3.wait(30).step == 3
    b.go[1].set()                                        # the late writer of step 1 wakes up
    assert b.abandoned == [1]                            # the backend was told once
    assert h1.gate.abandoned() and not h1.gate.claim()   # and it cannot commit
    pipe.close()


class ReplacingBackend(HeldBackend):
    """Giving a write up replaces the writer, slowly (a writer process starts); a write handed
    to the writer being replaced dies with it."""

    def __init__(self):
        super().__init__()
        self.writer = 0
        self.handed: dict[int, int] = {}   # step -> the writer it was handed to

    def submit(self, job: PersistJob):
        self.handed[job.step] = self.writer
        p = super().submit(job)
        p._on_abandon = self._replace
        return p

    def _replace(self, p: FuturePending) -> None:
        time.sleep(0.5)
        self.writer += 1


def test_the_next_persist_goes_to_the_fresh_writer_when_the_waiter_gave_the_last_one_up():
    """The training thread gives step 1 up (its timeout) while the pipeline waits on the write;
    the pipeline moves on to step 2 only once the backend replaced the writer. Before, step 2
    went to the old writer process, killed a moment later (BrokenProcessPool, step 2 lost)."""
    b = ReplacingBackend()
    pipe = PersistPipeline(b)
    h1, h2 = pipe.submit(_job(1)), pipe.submit(_job(2))
    _wait(b.started.setdefault(1, threading.Event()), "step 1's write starting")
    assert h1.abandon()                                  # as Checkpointer's timeout does, off the pipeline thread
    _wait(b.started.setdefault(2, threading.Event()), "step 2's write starting after 1 was given up")
    assert b.handed == {1: 0, 2: 1}, b.handed            # step 2 went to the replacement
    b.go.setdefault(2, threading.Event()).set()
    assert h2.wait(30).step == 2
    b.go[1].set()
    pipe.close()


def test_a_handle_whose_commit_was_claimed_cannot_be_given_up():
    b = HeldBackend()
    pipe = PersistPipeline(b)
    h = pipe.submit(_job(1))
    _wait(b.started.setdefault(1, threading.Event()), "step 1's write starting")
    assert h.gate.claim()                                # the writer reached its commit point
    assert not h.abandon()
    b.go[1].set()
    assert h.wait(30).step == 1
    assert not h.abandon()                               # ended: nothing to give up
    pipe.close()


@pytest.mark.parametrize("first, then, claimed", [
    ("abandon", "claim", False),     # a writer gave the step up: writer 0 cannot commit it
    ("claim", "abandon", True),      # writer 0 is committing: nobody can give it up any more
])
def test_fate_is_decided_once_for_every_rank(first, then, claimed):
    store = dist.HashStore()
    ranks = [Channel(store, rank=r, world_size=2, timeout_s=5) for r in range(2)]
    f0, f1 = Fate(ranks[0], 4), Fate(ranks[1], 4)
    who = {"claim": f0.claim, "abandon": f1.abandon}
    assert who[first]()
    assert not who[then]()
    assert (f0.claim() if claimed else f1.abandon())     # idempotent for the winner
    assert Fate(ranks[0], 4).abandoned() is (not claimed)
    assert not Fate(ranks[1], 5).abandoned()             # another step: undecided
