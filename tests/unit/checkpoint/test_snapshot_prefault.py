"""Snapshot arenas made ahead (``Snapshotter.prefault``): after a checkpointer's first step, the
arenas of its first snapshot are made and written on an idle helper thread, so that snapshot
does not pay a page fault per page on the training thread (a process that restarts training,
e.g. a spare taking a rank's role, otherwise pays it at its first checkpoint).

What is checked: the prefaulted arenas are the ones the snapshot copies into, and hold the right
bytes; a snapshot that comes while the arenas are still being written stops that and copies
correctly; a prefault that fails is reported and the snapshot makes its arenas itself; a
``Checkpointer`` prefaults after its first step, not when that step is a checkpoint, and not
under a host-memory budget. Real /dev/shm arenas where the machine has them."""

from __future__ import annotations

import threading
import time

import pytest
import torch

import cfdist
from cfdist.checkpoint import snapshot
from cfdist.checkpoint.snapshot import Snapshotter

SHARED = snapshot.os.path.isdir(snapshot._SHM_DIR)


def _state():
    g = torch.Generator().manual_seed(0)
    return {"buf": torch.randn(300_000, generator=g), "w": torch.randn(64, 32, generator=g)}


def _wait(cond, what: str, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s}s waiting for {what}")
        time.sleep(0.001)


def _copied(snap: Snapshotter, tensors: dict) -> dict:
    out = {}
    for es, arena in zip(snap.layout, snap.host):
        for e, v in zip(es, arena.views(es)):
            out[e.name] = v.clone()
    assert out.keys() == tensors.keys()
    return out


def test_the_first_snapshot_copies_into_the_arenas_made_and_written_ahead():
    t = _state()
    snap = Snapshotter(shared=SHARED, n_shards=2)
    try:
        assert snap.prefault(t)
        assert not snap.prefault(t), "a second prefault started while one runs"
        stop, done = snap._prefault
        done.result(timeout=30)
        arenas = list(snap.host)
        assert snap.prefaulted == sum(a.nbytes for a in arenas) > 0
        snap.start(t, first={"buf"})
        snap.wait_copied()
        assert [id(a) for a in snap.host] == [id(a) for a in arenas], "the snapshot made new arenas"
        got = _copied(snap, t)
        assert all(torch.equal(got[k], t[k]) for k in t)
        assert not snap.prefault(t), "arenas made already: nothing to prefault"
    finally:
        snap.close()


def test_a_snapshot_that_comes_while_the_arenas_are_written_stops_that_and_copies_correctly(monkeypatch):
    """The helper thread is held before it writes anything until the snapshot asked it to stop:
    it then writes nothing more, and the snapshot copies into its arenas."""
    go = threading.Event()
    monkeypatch.setattr(snapshot.idle, "idle_thread", lambda tid=0: go.wait(30))
    t = _state()
    snap = Snapshotter(shared=SHARED)
    try:
        assert snap.prefault(t)
        stop, _ = snap._prefault
        started = threading.Thread(target=snap.start, args=(t,), kwargs={"first": {"buf"}})
        started.start()
        _wait(stop.is_set, "the snapshot to stop the prefault")
        go.set()
        started.join(30)
        assert not started.is_alive(), "the snapshot did not start"
        snap.wait_copied()
        assert snap.prefaulted == 0 and snap._prefault is None
        got = _copied(snap, t)
        assert all(torch.equal(got[k], t[k]) for k in t)
    finally:
        go.set()
        snap.close()


def test_a_prefault_that_fails_is_logged_and_the_snapshot_makes_its_arenas_itself(monkeypatch, caplog):
    real = snapshot.Arena

    def arena(*a, **k):
        if threading.current_thread().name == "cfdist-prefault":
            raise OSError(28, "No space left on device")
        return real(*a, **k)

    monkeypatch.setattr(snapshot, "Arena", arena)
    t = _state()
    snap = Snapshotter(shared=SHARED)
    try:
        assert snap.prefault(t)
        with caplog.at_level("WARNING", logger="cfdist.snapshot"):
            snap.start(t, first={"buf"})
        snap.wait_copied()
        assert "making the snapshot arenas ahead failed (OSError: [Errno 28] No space left on device)" in caplog.text
        got = _copied(snap, t)
        assert all(torch.equal(got[k], t[k]) for k in t)
    finally:
        snap.close()


def _train(ck, m, opt, steps):
    for i in range(steps):
        m(torch.randn(4, 32, generator=torch.Generator().manual_seed(i))).sum().backward()
        ck.step(opt)
        opt.zero_grad()


def _model():
    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 4))
    m.register_buffer("ballast", torch.zeros(100_000))
    return m, torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9)


@pytest.mark.parametrize("every,host_memory,prefaults", [(3, None, True), (1, None, False), (3, 0.5, False)])
def test_a_checkpointer_prefaults_after_its_first_step_unless_that_step_checkpoints_or_memory_is_budgeted(
        tmp_path, every, host_memory, prefaults):
    """After the first step the optimizer's state exists (SGD's momentum), so the arenas made
    then have the layout of every snapshot: the checkpoint at step 3 copies into them (same
    arena objects) and restores bit-exact. At ``Every(1)`` the first step's own snapshot made
    them; under a host-memory budget snapshots stream through chunks, with no arenas."""
    m, opt = _model()
    ck = cfdist.Checkpointer({"model": m, "optim": opt}, f"file://{tmp_path}/ck", policy=cfdist.Every(every),
                             host_memory=host_memory)
    try:
        _train(ck, m, opt, 1)
        if not prefaults:
            assert ck._snap._prefault is None and ck._snap.prefaulted == 0
        else:
            _, done = ck._snap._prefault
            done.result(timeout=30)
            arenas = [id(a) for a in ck._snap.host]
            assert ck._snap.prefaulted == sum(a.nbytes for a in ck._snap.host) > 0
            _train(ck, m, opt, 2)
            assert [id(a) for a in ck._snap.host] == arenas, "the first checkpoint did not use the arenas made ahead"
        _train(ck, m, opt, 3 - ck.step_count)
        ck.wait()
        want = {k: v.clone() for k, v in m.state_dict().items()}
    finally:
        ck.close()
    m2, opt2 = _model()
    ck2 = cfdist.Checkpointer({"model": m2, "optim": opt2}, f"file://{tmp_path}/ck", policy=cfdist.Every(every))
    try:
        assert ck2.restore() == 3
        assert all(torch.equal(m2.state_dict()[k], v) for k, v in want.items())
    finally:
        ck2.close()
