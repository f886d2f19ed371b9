"""The NodeCheckpointer's persist path without Ray: a real Checkpointer hands pickled jobs
(arena paths in /dev/shm, no tensors) to the actor class called in-process; the actor writes
the memory and local tiers, copies to shared storage in the background, exports a frozen copy
for a peer, and refuses persists from a replaced attempt."""

from __future__ import annotations

import concurrent.futures as cf
import functools
import os
import pickle
import subprocess
import sys
import threading
import time
import uuid

import pytest
import torch

import cfdist
from cfdist.checkpoint.persist import FuturePending, GateDir
from cfdist.cluster import transfer
from cfdist.cluster.config import FitConfig
from cfdist.cluster.node_actor import SHM_ROOT, NodeCheckpointer, StaleAttempt, memory_root
from cfdist.storage import open_storages

pytestmark = pytest.mark.skipif(SHM_ROOT is None, reason="needs /dev/shm")


class InProcess:
    """A PersistBackend that pickles each job (as Ray would) and calls the actor on a thread."""

    needs_shared_memory = True

    def __init__(self, actor, attempt=0):
        self.actor, self.attempt = actor, attempt
        self.ex = cf.ThreadPoolExecutor(1)
        self.sent_bytes = []
        self.gates = GateDir()   # file gates: they pickle, as ActorBackend's do

    def new_gate(self, step):
        return self.gates.new(step)

    def ready_at(self):
        return 0.0

    def submit(self, job):
        blob = pickle.dumps(job)
        self.sent_bytes.append(len(blob))
        return FuturePending(self.ex.submit(self.actor.persist, pickle.loads(blob), self.attempt), job.step, job.gate)

    def submit_live(self, job, durable=False):   # as ActorBackend.submit_live, on a thread of its own
        return FuturePending(self.live_ex.submit(self.actor.persist, pickle.loads(pickle.dumps(job)), self.attempt,
                                                 durable, not durable), job.step, job.gate)

    @functools.cached_property
    def live_ex(self):
        return cf.ThreadPoolExecutor(1)

    def close(self):
        self.ex.shutdown()
        self.gates.close()


def _state(seed=0):
    torch.manual_seed(seed)
    m = torch.nn.Linear(64, 64)
    return m, torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9)


def _train(ck, m, opt, steps):
    for i in range(steps):
        m(torch.randn(4, 64, generator=torch.Generator().manual_seed(i))).sum().backward()
        ck.step(opt)
        opt.zero_grad()


@pytest.fixture(params=["file", "s3"])
def shared(request, tmp_path):
    """The shared tier: a local directory, or a bucket on the local S3 server (moto)."""
    if request.param == "file":
        return f"file://{tmp_path}/shared", {}
    pytest.importorskip("s3fs")
    return request.getfixturevalue("s3_url"), request.getfixturevalue("s3_storage_options")


@pytest.fixture
def actors(tmp_path, shared):
    run_id = f"unit-{uuid.uuid4().hex[:8]}"
    cfg = FitConfig(storage=f"file://{tmp_path}/{{node}}", shared_storage=shared[0], storage_options=shared[1],
                    shared_every=2, run_name="r")
    made = [NodeCheckpointer(config=cfg, run_id=run_id, node_id=n * 20, node_name=n.lower()) for n in "AB"]
    yield made
    for a in made:
        a.close()
    assert made[0]._mem_dir.startswith(memory_root(run_id))
    assert not os.path.exists(memory_root(run_id)), "memory tier not freed"


def test_persist_writes_memory_and_local_then_shared_in_background(actors, shared):
    a, _ = actors
    a.begin_attempt(0, shared_writer=True)
    tiers = a.ready()
    m, opt = _state()
    backend = InProcess(a)
    ck = cfdist.Checkpointer({"model": m, "optim": opt}, tiers["memory"], cfdist.Every(2),
                             writers=True, persist=cfdist.PersistOptions(backend=backend), restore_from=tiers["local"])
    _train(ck, m, opt, 8)
    ck.close()
    assert max(backend.sent_bytes) < 16_000, "jobs must carry arena paths, not tensor bytes"
    assert a.flush_shared() == 8
    h = a.holdings(with_shared=True)
    assert h["memory"] == [6, 8] and h["local"] == [6, 8] and 8 in h["shared"]   # keep=2 (default)
    evs = a.drain_events()
    assert {(e["step"], e["tier"]) for e in evs} >= {(2, "memory"), (2, "local"), (8, "memory"), (8, "local"), (8, "shared")}
    # a commit is dated by its atomic rename, before its LATEST hint and retention ran and it was reported
    assert all(0 < e["committed_at"] <= e["t"] for e in evs if e["tier"] != "shared")
    assert a.make_durable()["t"] == next(e["committed_at"] for e in evs if (e["step"], e["tier"]) == (8, "local"))
    assert a.drain_events() == []
    loaded = cfdist.load(tiers["shared"], 8, **shared[1])["state"]["model"]
    assert torch.equal(loaded["weight"], m.weight.detach())


@pytest.mark.parametrize("shared", ["file"], indirect=True)
def test_export_seeds_a_peer_that_restores_the_same_bytes(actors):
    a, b = actors
    a.begin_attempt(0, shared_writer=False)
    m, opt = _state()
    ck = cfdist.Checkpointer({"model": m, "optim": opt}, a.ready()["memory"], cfdist.Every(3),
                             writers=True, persist=cfdist.PersistOptions(backend=InProcess(a)))
    _train(ck, m, opt, 6)
    ck.close()
    frozen = a.export(6)
    assert transfer.nbytes(frozen) > 64 * 64 * 4
    dst = open_storages(b.ready()["memory"])
    assert transfer.commit_frozen(frozen, 6, dst, source="peer A", keep=1) is True
    assert transfer.commit_frozen(frozen, 6, dst, source="peer A", keep=1) is False   # already there
    assert b.holdings()["memory"] == [6]
    m2, opt2 = _state(seed=1)
    ck2 = cfdist.Checkpointer({"model": m2, "optim": opt2}, b.ready()["memory"], cfdist.Every(3), writers=False)
    assert ck2.restore(6) == 6
    assert torch.equal(m2.weight, m.weight) and torch.equal(opt2.state_dict()["state"][0]["momentum_buffer"],
                                                            opt.state_dict()["state"][0]["momentum_buffer"])
    with pytest.raises(FileNotFoundError, match="no committed step 5"):
        a.export(5)


@pytest.mark.parametrize("shared", ["file"], indirect=True)
def test_a_replaced_attempt_cannot_persist(actors):
    a, _ = actors
    a.begin_attempt(3, shared_writer=False)
    m, opt = _state()
    ck = cfdist.Checkpointer({"model": m, "optim": opt}, a.ready()["memory"], cfdist.Every(1),
                             writers=True, persist=cfdist.PersistOptions(backend=InProcess(a, attempt=2)))
    _train(ck, m, opt, 1)
    with pytest.raises(StaleAttempt, match="attempt 2 refused.*attempt 3"):
        ck.wait()
    ck.close()
    assert a.holdings()["memory"] == []


@pytest.mark.parametrize("shared", ["file"], indirect=True)
def test_memory_tier_never_accumulates_epoch_ends(actors):
    """``keep_epoch_ends=True`` keeps every epoch end on the node-local disk, never in /dev/shm.

    Real: a Checkpointer with a ResumableLoader (2 batches per epoch: epochs end at steps 2, 4,
    6, 8), ``Every(1)``, ``keep=1``, the actor's memory and local tiers. Faked: Ray (the actor
    class is called in-process). The point: the memory tier holds the newest checkpoint only.
    """
    from cfdist.data import ResumableLoader

    a = actors[0]
    a.begin_attempt(0, shared_writer=False)
    tiers = a.ready()
    m, opt = _state()
    loader = ResumableLoader(torch.randn(8, 64), 4, seed=0, rank=0, world_size=1)
    ck = cfdist.Checkpointer({"model": m, "optim": opt, "data": loader}, tiers["memory"], cfdist.Every(1),
                             writers=True, persist=cfdist.PersistOptions(backend=InProcess(a)),
                             restore_from=tiers["local"], keep=1,
                             keep_epoch_ends=True)
    while ck.step_count < 8:
        for x in loader:
            m(x).sum().backward()
            ck.step(opt)
            opt.zero_grad()
    ck.close()
    h = a.holdings()
    assert h["memory"] == [8]
    assert h["local"] == [2, 4, 6, 8]


@pytest.mark.parametrize("shared", ["file"], indirect=True)
def test_memory_every_step_keeps_disk_at_the_policys_interval_and_the_end_reaches_disk(actors):
    """``memory_every=1`` (``MemoryEvery(Every(4), 1)``): every step is committed to the memory
    tier, only every 4th to the local disk; at the end, the newest memory step is copied to disk."""
    from cfdist.cluster.node_actor import ActorBackend
    from cfdist.policy.memory import MemoryEvery

    a, _ = actors
    a.begin_attempt(0, shared_writer=False)
    tiers = a.ready()
    policy = MemoryEvery(cfdist.Every(4), every=1)
    to_disk = ActorBackend(None, 0, policy)    # the decision the real backend sends with each job
    m, opt = _state()

    class Backend(InProcess):
        def submit(self, job):
            return FuturePending(self.ex.submit(self.actor.persist, job, self.attempt, to_disk.policy.to_disk(job.step)),
                                 job.step)

    ck = cfdist.Checkpointer({"model": m, "optim": opt}, tiers["memory"], policy, writers=True,
                             persist=cfdist.PersistOptions(backend=Backend(a)), restore_from=tiers["local"], keep=1)
    _train(ck, m, opt, 10)
    ck.close()
    commits = {(e["step"], e["tier"]) for e in a.drain_events()}
    assert {s for s, t in commits if t == "memory"} == set(range(1, 11))
    assert {s for s, t in commits if t == "local"} == {4, 8}
    assert a.holdings()["memory"] == [10] and a.holdings()["local"] == [8]
    assert a.flush_local() == 10 and a.holdings()["local"] == [8, 10]   # the actor keeps 2 (FitConfig.keep)
    assert torch.equal(cfdist.load(tiers["local"][0], 10)["state"]["model"]["weight"], m.weight.detach())


@pytest.mark.parametrize("every, disk_k, want_memory, want_disk", [
    (1, 4, list(range(1, 9)), [4, 8]),
    (2, 3, [2, 3, 4, 6, 8], [3, 6]),
])
def test_memory_every_decisions(every, disk_k, want_memory, want_disk):
    from cfdist.policy.memory import MemoryEvery

    p = MemoryEvery(cfdist.Every(disk_k), every=every)
    took = [s for s in range(1, 9) if p.should_checkpoint(s)]
    assert took == want_memory and [s for s in took if p.to_disk(s)] == want_disk
    assert p.k == disk_k and p.mode == "cpu"          # the wrapped policy's attributes
    with pytest.raises(ValueError, match="memory_every must be an int >= 1"):
        MemoryEvery(cfdist.Every(2), every=0)

def test_the_actor_encodes_and_a_chain_travels_whole_to_shared_storage_and_peers(actors, shared):
    """Codecs run in the actor (the job carries them, not the training process); an increment
    copied to the shared tier or to a peer brings the checkpoints it depends on."""
    a, b = actors
    a.begin_attempt(0, shared_writer=True)
    tiers = a.ready()
    m, opt = _state()
    with torch.no_grad():
        m.weight.zero_()
    ck = cfdist.Checkpointer({"model": m}, tiers["memory"], cfdist.Every(1), writers=True,
                             persist=cfdist.PersistOptions(backend=InProcess(a)),
                             codecs=[cfdist.codecs.Incremental(full_every=None)], keep=1)
    for i in range(4):          # one row changes per step: every checkpoint after the first is an increment
        with torch.no_grad():
            m.weight[i] += 1
        ck.step()
    ck.close()
    assert a.holdings()["memory"] == [1, 4] and a.holdings()["local"] == [1, 4]    # 4 needs 1
    assert a.flush_shared(4) == 4 and "step-000000001" in open_storages(tiers["shared"])[0].listdir("")
    loaded = cfdist.load(tiers["shared"], 4)["state"]["model"]
    assert torch.equal(loaded["weight"], m.weight.detach())
    assert transfer.commit_frozen(a.export(4), 4, open_storages(b.ready()["memory"]), source="peer A", keep=1)
    assert b.holdings()["memory"] == [1, 4]
    assert torch.equal(cfdist.load(b.ready()["memory"], 4)["state"]["model"]["weight"], m.weight.detach())



class ContendedLock:
    """A spy around the node actor's write lock: ``contended`` is set once a caller has to
    wait for it (another write holds it)."""

    def __init__(self, lock):
        self.lock, self.contended = lock, threading.Event()

    def acquire(self, *args, **kwargs):
        if self.lock.acquire(blocking=False):
            return True
        self.contended.set()
        return self.lock.acquire(*args, **kwargs)

    def release(self):
        self.lock.release()

    __enter__ = acquire

    def __exit__(self, *exc):
        self.release()


@pytest.mark.parametrize("shared", ["file"], indirect=True)
def test_a_live_state_for_the_disk_cuts_an_older_disk_write_short(actors, monkeypatch):
    """Every node is about to be taken, so a halted group's live state goes to the disk
    (``save_live(durable=True)``). Step 4's regular persist has committed to the memory tier
    and its disk write is blocked (``cfdist.testing.hang``: a slow disk). The live state of
    step 5 neither waits for step 4 on the rank nor behind it on the node: the node gives
    step 4's disk write up, so once the disk moves again step 4 does not reach it and step 5
    does. (On the old code the rank waited for step 4's persist, and the node finished step
    4's disk write first, holding its write lock: 30-80 ms of a ~160 ms grace.) Step 4's
    persist ends with its memory commit, not an error, and the next attempt's disk writes are
    not cut. (A live save gives a persist it waits for up to ``_LIVE_SETTLE_S``, 2 s; raised
    here, so that a rank that waited for step 4 would never get its live job to the node.)"""
    from cfdist.checkpoint import checkpointer
    from cfdist.checkpoint.discovery import committed_steps
    from cfdist.testing import hang

    monkeypatch.setattr(checkpointer, "_LIVE_SETTLE_S", 3600.0)
    a, _ = actors
    a.begin_attempt(0, shared_writer=False)
    tiers = a.ready()
    disk = a.local[0] = hang(a.local[0], hang_after_bytes=0, only="shard")
    m, opt = _state()
    backend = InProcess(a)
    ck = cfdist.Checkpointer({"model": m, "optim": opt}, tiers["memory"], cfdist.Every(4), writers=True,
                             persist=cfdist.PersistOptions(backend=backend), group=cfdist.GroupOptions(live=True))
    saved = None
    try:
        _train(ck, m, opt, 5)   # step 4's persist starts at step 5's forward (the boundary)
        assert disk.entered.wait(30), "step 4's disk write never started"
        disk.arm(hang_after_bytes=None)   # later writes pass; step 4's stays blocked
        a._lock = lock = ContendedLock(a._lock)
        saved = cf.ThreadPoolExecutor(1).submit(ck.save_live, timeout_s=600, durable=True)
        assert lock.contended.wait(30), "the live state of step 5 did not reach the node's write lock within 30 s"
        assert disk.hung == 1, "step 4's disk write is no longer blocked"
    finally:
        disk.release()
    assert saved.result(timeout=30) == 5
    assert committed_steps(a.local[0]) == [5], "step 4's disk write was finished although step 5 superseded it"
    assert 4 in committed_steps(a.mem[0])
    ck.abandon()
    assert ck.stats["errors"] == 0, ck.stats["last_error"]
    a.begin_attempt(1, shared_writer=False)   # a new group: its disk writes are not cut
    m2, opt2 = _state(1)
    ck2 = cfdist.Checkpointer({"model": m2, "optim": opt2}, tiers["memory"], cfdist.Every(2), writers=True,
                              persist=cfdist.PersistOptions(backend=InProcess(a, attempt=1)))
    _train(ck2, m2, opt2, 2)
    ck2.close()
    assert 2 in committed_steps(a.local[0])


@pytest.mark.parametrize("shared", ["file"], indirect=True)
def test_a_peer_asked_for_a_step_its_rank_has_not_submitted_yet_answers_once_it_committed(actors):
    """Node 0 asks its peers for their copy of a step (``step_sums``) as soon as its own copy
    committed; a peer's rank submits the same step at the same time and may be behind. The
    peer waits for that persist instead of answering "no copy" (which left the shared upload
    whole); a step this attempt went past without a copy is answered at once."""
    _, b = actors
    b.begin_attempt(0, shared_writer=False)
    ex = cf.ThreadPoolExecutor(1)
    asked = ex.submit(b.step_sums, 2, 60.0)
    deadline = time.monotonic() + 30
    while len(b._persisted_cv._waiters) != 1:   # the question is in, before any step is
        assert not asked.done(), f"step_sums answered before step 2 was persisted: {asked.result()}"
        assert time.monotonic() < deadline, "step_sums(2) never started waiting for the step"
        time.sleep(0.01)
    m, opt = _state()
    ck = cfdist.Checkpointer({"model": m, "optim": opt}, b.ready()["memory"], cfdist.Every(2),
                             writers=True, persist=cfdist.PersistOptions(backend=InProcess(b)))
    _train(ck, m, opt, 4)
    ck.wait()
    got = asked.result(timeout=60)
    assert got is not None and got["node"] == "b", got
    assert set(got["sums"]) >= {"model/weight", "model/bias"} and all(got["sums"].values()), got
    t0 = time.monotonic()
    assert b.step_sums(3, 60.0) is None            # steps 2 and 4 persisted, 3 never will
    assert time.monotonic() - t0 < 10, "waited for a step the attempt had gone past"
    ck.close()
    ex.shutdown()


def test_an_activation_sweeps_nothing_before_the_nodes_killed_actor_is_gone(tmp_path, monkeypatch):
    """A drained node's actor is killed and, when the node returns, its standby is activated at
    once (``RayBackend.undrain``): Ray's kill may not have landed yet. The activation
    (``after_pids``) opens and sweeps the node's tiers only once that process is gone: a step
    directory it was writing (no manifest yet) stays while it lives, and is swept once it is
    killed. (The predecessor is a plain child process here; killed, not reaped: a zombie's
    files are closed, so it counts as gone.)"""
    from cfdist.checkpoint.format import step_dir
    from cfdist.cluster import node_actor

    monkeypatch.setattr(node_actor.niceness, "can_renice", lambda to: False)   # the test process keeps its priority
    cfg = FitConfig(storage=f"file://{tmp_path}/{{node}}", run_name="r")
    standby = NodeCheckpointer(config=cfg, run_id=f"unit-{uuid.uuid4().hex[:8]}", node_id="A" * 20,
                               node_name="a", standby=True)
    leftover = tmp_path / "a" / "r" / step_dir(5) / "shard-0.bin"
    leftover.parent.mkdir(parents=True)
    leftover.write_bytes(b"half a step")
    predecessor = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    try:
        out = []
        t = threading.Thread(target=lambda: out.append(standby.activate(after_pids=[predecessor.pid])))
        t.start()
        t.join(0.3)
        assert t.is_alive() and leftover.exists(), "the activation did not wait for the node's previous actor"
        predecessor.kill()
        t.join(30)
        assert not t.is_alive(), "the activation did not return once the previous actor was gone"
        assert out[0]["local"] == cfg.local_urls("a") and not leftover.parent.exists()
    finally:
        predecessor.kill()
        predecessor.wait()
        standby.close()


def test_await_exit_answers_at_a_ranks_exit_and_names_only_the_exited(tmp_path, monkeypatch):
    """``NodeCheckpointer.await_exit`` (the driver's question for ranks on another machine):
    two live rank-like processes; none exits within a short wait (empty answer after the
    wait); one is then killed while the question stands, and the answer names it alone, well
    before the wait's end. Its ``ready()`` reports the namespace the driver compares with the
    ranks' own."""
    from cfdist.cluster import node_actor
    from cfdist.cluster.nodes import process_namespace

    monkeypatch.setattr(node_actor.niceness, "can_renice", lambda to: False)
    cfg = FitConfig(storage=f"file://{tmp_path}/{{node}}", run_name="r")
    actor = NodeCheckpointer(config=cfg, run_id=f"unit-{uuid.uuid4().hex[:8]}", node_id="A" * 20, node_name="a")
    ranks = [subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"]) for _ in range(2)]
    try:
        assert actor.ready()["ns"] == process_namespace()
        t0 = time.monotonic()
        assert actor.await_exit([p.pid for p in ranks], 0.05) == []
        assert time.monotonic() - t0 >= 0.05
        out = []
        t = threading.Thread(target=lambda: out.append(actor.await_exit([p.pid for p in ranks], 60.0)))
        t0 = time.monotonic()
        t.start()
        t.join(0.2)
        assert t.is_alive(), "await_exit answered while both processes lived"
        ranks[1].kill()   # killed, not reaped: a zombie counts as exited
        t.join(30)
        assert not t.is_alive(), "await_exit did not answer once a process exited"
        assert out == [[ranks[1].pid]] and time.monotonic() - t0 < 30
    finally:
        for p in ranks:
            p.kill()
            p.wait()
        actor.close()
