"""Double buffering (``Checkpointer(buffers=2)``): snapshot i+1 copies while persist i writes;
persists commit one at a time, in step order; a SIGKILL keeps the newest commit."""

from __future__ import annotations

import copy
import json
import random
import sys
import threading
import time

import torch

import cfdist
from cfdist.checkpoint.discovery import committed_steps
from cfdist.checkpoint.format import parse_step_dir
from cfdist.storage import open_storage
from cfdist.testing import StorageWrapper

N = 8


class Paced(StorageWrapper):
    """Shard writes of step s block until ``grant(s)``: the test decides when each persist may
    finish. Records the order of commits (the publish of a step directory on root 0)."""

    def __init__(self, inner):
        super().__init__(inner)
        self.cv = threading.Condition()
        self.granted: set[int] = set()
        self.commits: list[int] = []

    def grant(self, *steps: int) -> None:
        with self.cv:
            self.granted.update(steps)
            self.cv.notify_all()

    def write_file(self, rel, chunks, *, fsync: bool = True) -> int:
        if "shard-" in rel:
            step = parse_step_dir(rel.split("/")[0].split(".tmp-")[0])
            with self.cv:
                self.cv.wait_for(lambda: step in self.granted)
        return super().write_file(rel, chunks, fsync=fsync)

    def publish(self, staging: str, final: str) -> None:
        super().publish(staging, final)
        self.commits.append(parse_step_dir(final))


def _main_waits_for_persist() -> bool:
    f = sys._current_frames().get(threading.main_thread().ident)
    while f is not None:
        if f.f_code.co_name == "_wait_inflight" and f.f_code.co_filename.endswith("checkpointer.py"):
            return True
        f = f.f_back
    return False


def _run(tmp_path, buffers: int) -> tuple[cfdist.Checkpointer, Paced, dict, str]:
    """N steps at k=1 where persist s may finish only once step s+2 begins (it keeps up with two
    buffer sets), or earlier when training blocks waiting for it (a watchdog grants it then)."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 256), torch.nn.ReLU(), torch.nn.Linear(256, 8))
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    url = f"file://{tmp_path / f'b{buffers}'}"
    st = Paced(open_storage(url))
    ckpt = cfdist.Checkpointer({"model": model, "optim": opt}, st, cfdist.Every(1), keep=100, buffers=buffers)
    stop = threading.Event()
    want, g = {}, torch.Generator().manual_seed(1)

    def watchdog():   # training blocked on a persist: let the persists submitted so far finish
        while not stop.is_set():   # (else: deadlock); never a later step's, which must wait its turn
            if _main_waits_for_persist():
                st.grant(*range(1, len(want) + 1))
            time.sleep(0.001)

    w = threading.Thread(target=watchdog, daemon=True)
    w.start()
    try:
        for step in range(1, N + 1):
            if step > 2:   # persist step-2 finishes during this iteration, before the checkpoint
                st.grant(step - 2)
                while any(not p.done() for p, _ in list(ckpt._inflight) if p.step <= step - 2):   # white-box
                    time.sleep(0.001)
            model(torch.randn(16, 32, generator=g)).pow(2).mean().backward()
            ckpt.step(opt)
            opt.zero_grad()
            want[step] = copy.deepcopy({"model": model.state_dict(), "optim": opt.state_dict()["state"]})
        ckpt.close()
    finally:
        stop.set()
        st.grant(*range(1, N + 1))
        w.join()
    return ckpt, st, want, url


def test_two_buffer_sets_never_wait_for_a_persist_that_keeps_up(tmp_path):
    """Real: the Checkpointer (snapshot thread, thread persist backend behind the ordering
    thread), ``file://`` storage in tmp_path with O_DIRECT where the filesystem takes it, fsync
    and renames. Faked: how long each persist takes, by a wrapper that holds a step's shard
    write until the test grants it: persist s finishes during iteration s+2 (it keeps up with
    two buffer sets, not with one), or as soon as training blocks on it.
    The point, from ``stats`` and the storage, never from clocks: with ``buffers=1`` every
    checkpoint after the first waits for the previous persist (N-1 waits); with ``buffers=2``
    none does; both commit every step once, in step order; the arenas are 2x the state with
    two sets; and every committed step restores bit-exact what the state was at that step
    (no snapshot was overwritten while its persist still read it).
    """
    for buffers, waits in ((1, N - 1), (2, 0)):
        ckpt, st, want, url = _run(tmp_path, buffers)
        s = ckpt.stats
        assert s["persist_waits"] == waits, (buffers, s)
        assert s["checkpoints"] == N and s["errors"] == 0 and s["latest_step"] == N
        assert st.commits == list(range(1, N + 1)), st.commits
        assert s["buffers"] == buffers and s["arena_bytes"] == buffers * ckpt._snap.nbytes
        assert committed_steps(open_storage(url)) == list(range(1, N + 1))
        for step in range(1, N + 1):
            got = cfdist.load(url, step=step)["state"]   # verifies every checksum
            for k, v in want[step]["model"].items():
                assert torch.equal(got["model"][k], v), (buffers, step, k)
            for i, sd in want[step]["optim"].items():
                assert all(torch.equal(got["optim"]["state"][i][n], t) for n, t in sd.items()), (buffers, step, i)


def test_sigkill_during_overlapping_persists_keeps_the_newest_commit(children, tmp_path):
    """Real: training processes (an MLP of 1M parameters under Adam, ``Every(1)``,
    ``buffers=2``, about 12 MB per checkpoint, so persists queue behind each other), file://
    storage with fsync and renames, SIGKILL once the stats the child reports say both buffer
    sets were busy (snapshots wait for persists queued back to back: one writes while the
    next snapshot waits its turn), at a seeded instant, and each next process's sweep and checksum-verified restore. Faked: nothing
    on the write path (processes are forked from a warm server).
    The point: after each kill the newest committed step loads and holds its own step's Adam
    state, the next process restores exactly it with no leftovers after its sweep, and a last
    run trains on and commits.
    """
    out = tmp_path / "out"
    out.mkdir()
    url = f"file://{tmp_path / 'ckpt'}"
    st = open_storage(url)
    common = dict(url=url, k=1, keep=2, out=str(out), hidden=1024, buffers=2, stats_every=1)
    expected, rng = None, random.Random(13)
    for run in range(2):
        pid = children.start("crash", run=run, **common)
        rep = children.report(out / f"restore-{run}.json", pid)
        assert rep["restored"] == expected and rep["leftovers_after_start"] == [] and rep["warnings"] == []
        deadline, seen = time.monotonic() + 60, None
        while time.monotonic() < deadline:
            try:
                seen = json.loads((out / f"stats-{run}.json").read_text())
            except (FileNotFoundError, ValueError):
                seen = None
            if seen and seen["persist_waits"] >= 2 and seen["inflight"] >= 1 and seen["checkpoints"] >= 1:
                break
            time.sleep(0.002)
        assert seen and seen["persist_waits"] >= 2, f"run {run}: the buffer sets were never both busy: {seen}"
        time.sleep(rng.uniform(0.0, 0.05))   # persists queue back to back: any instant overlaps two
        assert children.kill(pid) == -9
        expected = committed_steps(st)[-1]
        adam = cfdist.load(url, step=expected)["state"]["optim"]["state"]
        assert {int(s["step"].item()) for s in adam.values()} == {expected}
    pid = children.start("crash", run=2, steps=3, **common)
    rep = children.report(out / "restore-2.json", pid)
    assert rep["restored"] == expected and rep["leftovers_after_start"] == []
    done = children.report(out / "done-2.json", pid)
    assert children.wait(pid, timeout=60) == 0
    assert done["stats"]["errors"] == 0 and done["close_raised"] is None
    assert committed_steps(st)[-1] == expected + 3


def test_a_hung_persist_given_up_lets_the_queued_ones_commit_in_order(tmp_path):
    """Real: the Checkpointer with ``buffers=2`` and ``PersistOptions.timeout_s``, its ordering thread and
    thread backend, file:// storage. Faked: a disk that hangs (``hang``: step 2's shard write
    blocks until released). The point: step 3's persist, queued behind the hung one, does not
    run out its timeout while it waits its turn; once step 2 is given up (one error, raised once
    by ``wait``) steps 3.. commit, in order; the hung writer, released, never commits step 2.
    """
    from cfdist.testing import hang

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.ReLU(), torch.nn.Linear(64, 4))
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    url = f"file://{tmp_path / 'ckpt'}"
    st = hang(open_storage(url))
    ckpt = cfdist.Checkpointer({"model": model, "optim": opt}, st, cfdist.Every(1), keep=100, buffers=2,
                               persist=cfdist.PersistOptions(timeout_s=3.0))

    def step():
        model(torch.randn(8, 16)).pow(2).mean().backward()
        ckpt.step(opt)
        opt.zero_grad()

    try:
        step()
        ckpt.wait()
        st.arm(hang_after_bytes=0, only="shard")
        step()                                   # step 2: its shard write hangs
        deadline = time.monotonic() + 30
        while not st.entered.is_set() and time.monotonic() < deadline:
            model(torch.zeros(1, 16))            # the next forward hands the snapshot over
            time.sleep(0.005)
        assert st.entered.is_set()
        st.arm(hang_after_bytes=None)            # later writes pass; step 2's stays blocked
        for _ in range(4):
            step()                               # steps 3..6
        raised = []
        try:
            ckpt.wait()
        except TimeoutError as e:
            raised.append(e)
        assert len(raised) == 1 and "step 2" in str(raised[0])
        s = ckpt.stats
        assert s["errors"] == 1 and s["checkpoints"] == 5 and s["latest_step"] == 6
        assert committed_steps(open_storage(url)) == [1, 3, 4, 5, 6]
    finally:
        st.release()                             # the hung writer wakes up: it must not commit
        ckpt.close()
    assert committed_steps(open_storage(url)) == [1, 3, 4, 5, 6]


def test_two_buffer_sets_with_the_writer_process_commit_in_order_and_restore_bit_exact(tmp_path):
    """Real: the Checkpointer with ``buffers=2`` and ``backend="process"``: a spawned writer
    process that maps each arena set from its own /dev/shm file, behind the ordering thread;
    ``file://`` storage in tmp_path with fsync and renames; an MLP of 0.5M parameters under
    Adam (6 MB per checkpoint) at k = 1, so persists take longer than an iteration; SIGKILL of
    the writer process while two persists are in flight. Faked: nothing (the test trains until
    the stats say two persists are in flight at once, the state double buffering exists for,
    instead of timing anything).
    The point: the persist the killed writer was running fails (one error, re-raised once by
    ``close``), unless the kill came right after its publish (then it is reported committed,
    no error: ``ProcessBackend`` checks the gate and the manifest, and the newer one, which the
    writer may have taken by then, is the one that fails), the one queued
    behind it goes to a new writer process and commits, and so do the later ones; every other
    step commits once, in step order (each step's manifest is
    written after the previous step's), and each committed step loads bit-exact the model and
    Adam state of that very step (a snapshot copied into a set the writer process still read
    would show another step's values); the two sets are two distinct /dev/shm files, and
    closing removes them."""
    import os
    import signal
    from concurrent.futures.process import BrokenProcessPool

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(256, 1024), torch.nn.ReLU(), torch.nn.Linear(1024, 256))
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    url = f"file://{tmp_path / 'ckpt'}"
    ckpt = cfdist.Checkpointer({"model": model, "optim": opt}, url, cfdist.Every(1), keep=100, buffers=2,
                               persist=cfdist.PersistOptions(backend="process"))
    paths: set[str] = set()
    real_submit = ckpt._pipeline.submit

    def submit(job):   # white-box: which /dev/shm file each persist reads
        paths.update(s.arena_path for s in job.shards)
        return real_submit(job)

    ckpt._pipeline.submit = submit
    gates = ckpt.backend._gates.path
    assert gates.startswith("/dev/shm/cfdist-gates-") and os.path.isdir(gates), gates
    want, g, step, killed = {}, torch.Generator().manual_seed(1), 0, None

    def train(kill: bool = False) -> bool:
        nonlocal step, killed
        loss = model(torch.randn(16, 256, generator=g)).pow(2).mean()
        both = ckpt.stats["inflight"] >= 2   # the forward handed the last snapshot over
        if both and kill:
            (pid,) = ckpt.backend.writer_pids()
            os.kill(pid, signal.SIGKILL)     # it writes the older one; the newer one waits its turn
            killed = [p.step for p, _ in ckpt._inflight if not p.done()]
        # The state of the last step, copied *after* the look at the persists in flight (the
        # forward changes none of it): a deepcopy of 6 MB between the step and the look gave
        # the writer the time to finish the older persist, and on an idle machine two were
        # then never seen in flight.
        remember()
        loss.backward()
        ckpt.step(opt)
        opt.zero_grad()
        step += 1
        return both

    def remember():
        if step:
            want[step] = copy.deepcopy({"model": model.state_dict(), "optim": opt.state_dict()["state"]})

    try:
        while not train() and step < 40:
            pass
        assert step < 40, "two persists were never in flight at once (test premise)"
        while killed is None and step < 80:
            train(kill=True)
        assert killed is not None and len(killed) == 2, killed
        for _ in range(3):
            train()
        remember()
        raised = None
        try:
            ckpt.close()
        except BrokenProcessPool as e:
            raised = e
    finally:
        ckpt.close()
    committed = committed_steps(open_storage(url))
    # The writer was killed while one of the two persists in flight was its job. It may have
    # published the older step right before the kill (reported committed, no error) and then
    # taken the newer one, which then fails; or it was still writing the older one, which fails
    # while the newer goes to a new writer. Either way at most one step failed, once, and it is
    # one of the two in flight; every other step committed.
    failed = [i for i in killed if i not in committed]
    s = ckpt.stats
    assert len(failed) <= 1, (killed, committed)
    assert (raised is None) == (not failed), (raised, killed, committed)
    assert s["errors"] == len(failed), s
    assert s["checkpoints"] == step - len(failed) and s["latest_step"] == step, s
    assert len(paths) == 2 and all(p.startswith("/dev/shm/") for p in paths), paths
    assert not [p for p in paths if os.path.exists(p)], "close() leaves no arena behind"
    # this checkpointer's gate folder (an earlier test of this process that failed before its
    # close may have left its own: the glob of every folder of this pid blamed this test for it)
    assert not os.path.exists(gates), f"close() left the commit gates' folder {gates}"
    assert committed == [i for i in range(1, step + 1) if i not in failed], committed
    written = [os.stat(tmp_path / "ckpt" / f"step-{i:09d}" / "MANIFEST.json").st_mtime_ns for i in committed]
    assert written == sorted(written), "a later step's manifest was written before an earlier one's"
    for i in committed:
        got = cfdist.load(url, step=i)["state"]   # verifies every checksum
        for k, v in want[i]["model"].items():
            assert torch.equal(got["model"][k], v), (i, k)
        for p, sd in want[i]["optim"].items():
            assert all(torch.equal(got["optim"]["state"][p][n], t) for n, t in sd.items()), (i, p)
