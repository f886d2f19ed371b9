"""Storage faults during persist: training goes on, the error shows, nothing committed is lost.

One table over the faults of :mod:`cfdist.testing`, each on ``file://`` and on the moto S3
server: a full disk (ENOSPC mid-shard), EIO on every write, permission denied (refused by the
wrapper, so it holds when the tests run as root), a write that hangs (given up after
``PersistOptions.timeout_s``), a torn write (the disk keeps half a shard and reports all of it), a
listing that lags behind writes, a slow disk.

Real: the Checkpointer with its snapshot and persist threads, the storage backends (files with
fsync and renames; s3fs against a real local S3 server), restore by a fresh Checkpointer.
Faked: the faults themselves (wrappers around the real Storage: the bytes that pass really
land on the backend).

The point of every row: ``step()`` never raises and the run reaches its last step; the error is
visible in ``stats["errors"]``/``stats["last_error"]``, in a log record and in ``wait()`` (a
torn write shows only when reading, as a checksum or truncation warning: the disk lied); the last
good checkpoint verifies while the fault lasts; after healing, the next checkpoint commits; a
fresh Checkpointer restores the newest good step into equal parameters.
"""

from __future__ import annotations

import errno
import logging
import os
import signal
import threading
import time

import pytest
import torch

import cfdist
from cfdist.checkpoint.discovery import committed_steps
from cfdist.storage import open_storage
from cfdist.testing import denied, faulty, hang, lagging, throttle, torn

EVERY = 2


def _until(pred, timeout=60.0):
    deadline = time.monotonic() + timeout
    while not pred():
        assert time.monotonic() < deadline, "condition not met in time"
        time.sleep(0.005)


# fault -> (wrap the real storage, arm it, heal it, what the error says, Checkpointer options)
FAULTS = {
    "enospc": dict(wrap=lambda st: faulty(st), arm=lambda w: w.arm(fail_after_bytes=4096), heal=lambda w: w.heal(),
                   says="No space left on device", errno=errno.ENOSPC),
    "eio": dict(wrap=lambda st: faulty(st, errno=errno.EIO), arm=lambda w: w.arm(fail_every_n_writes=1),
                heal=lambda w: w.heal(), says="Input/output error", errno=errno.EIO),
    "eacces": dict(wrap=lambda st: denied(st, armed=False), arm=lambda w: w.arm(), heal=lambda w: w.heal(),
                   says="Permission denied", errno=errno.EACCES),
    "hang": dict(wrap=lambda st: hang(st), arm=lambda w: w.arm(hang_after_bytes=4096, only="shard"),
                 heal=lambda w: w.arm(hang_after_bytes=None), says="PersistOptions.timeout_s", errno=None,
                 options=dict(persist=cfdist.PersistOptions(timeout_s=3.0))),
    "torn": dict(wrap=lambda st: torn(st, writes=0), arm=lambda w: w.arm(writes=1, only="shard"),
                 heal=lambda w: w.arm(writes=0), says=None, errno=None),
    "lag": dict(wrap=lambda st: lagging(st, lag_s=3600.0), arm=lambda w: None, heal=lambda w: None,
                says=None, errno=None),
    "slow": dict(wrap=lambda st: throttle(st), arm=lambda w: w.set_bytes_per_s(2e6), heal=lambda w: w.set_bytes_per_s(None),
                 says=None, errno=None),
}


@pytest.fixture(params=["file", "s3"])
def backend_url(request, tmp_path):
    if request.param == "s3":
        pytest.importorskip("s3fs", reason="s3fs is not installed")
        return request.getfixturevalue("s3_url")
    return f"file://{tmp_path}/ckpt"


def _params(model) -> dict:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


@pytest.mark.parametrize("fault", list(FAULTS))
def test_storage_fault_during_persist(fault, backend_url, mlp_state, train, caplog):
    f = FAULTS[fault]
    url = backend_url
    w = f["wrap"](open_storage(url))
    model, opt, sched = mlp_state()
    ckpt = cfdist.Checkpointer({"model": model, "optim": opt, "sched": sched}, w, cfdist.Every(EVERY), keep=3,
                               **f.get("options", {}))
    train(model, opt, ckpt, 2, sched)                  # step 2: a good checkpoint
    ckpt.wait()
    assert ckpt.latest_step == 2
    good = _params(model)

    caplog.set_level(logging.WARNING)
    arenas = [a.buf.data_ptr() for a in ckpt._snap.host]   # white-box: the buffers step 4 is copied into
    f["arm"](w)
    train(model, opt, ckpt, 2, sched, seed=1)          # step 4's snapshot; its persist meets the fault
    model(torch.zeros(1, 16))                          # the next forward: its persist starts
    if fault == "hang":
        _until(w.entered.is_set)                       # the shard write of step 4 is blocked now
        f["heal"](w)                                   # later writes pass; that one stays blocked
    train(model, opt, ckpt, 2, sched, seed=2)          # step 6: training goes on through the fault
    errors = []
    try:
        ckpt.wait()
    except OSError as e:                               # raised once, by wait(); never by step()
        errors.append(e)
    assert ckpt.step_count == 6

    # The last good checkpoint verifies while the fault lasts (read through a fresh handle).
    two = cfdist.load(url, step=2)
    assert all(torch.equal(two["state"]["model"][k], good[k]) for k in good)

    if f["says"] is not None:                          # an error: counted, logged, raised
        assert ckpt.stats["errors"] >= 1 and f["says"] in ckpt.stats["last_error"]
        assert len(errors) == 1 and f["says"] in str(errors[0])
        if f["errno"] is not None:
            assert errors[0].errno == f["errno"]
        assert any(r.levelno == logging.ERROR and r.name == "cfdist.checkpointer" and f["says"] in r.getMessage()
                   for r in caplog.records), [r.getMessage() for r in caplog.records]
        assert 4 not in committed_steps(open_storage(url))
    else:                                              # lag, slow, torn: the write "succeeded"
        assert ckpt.stats["errors"] == 0 and errors == []
        assert committed_steps(open_storage(url))[-2:] == [4, 6]

    if fault == "hang":                                # the given-up writer wakes up: no late commit
        # The hung writer still holds step 4's buffers: the snapshots after it used fresh ones.
        assert not set(arenas) & {a.buf.data_ptr() for a in ckpt._snap.host}
        late = [t for t in threading.enumerate() if t.name == "cfdist-persist-4"]
        assert len(late) == 1
        w.release()
        late[0].join(timeout=60)
        assert not late[0].is_alive()
        assert 4 not in committed_steps(open_storage(url))

    f["heal"](w)
    train(model, opt, ckpt, 2, sched, seed=3)          # step 8 commits after healing
    ckpt.close()
    final = _params(model)
    assert ckpt.latest_step == 8 and committed_steps(open_storage(url))[-1] == 8

    # A fresh process-like restart restores the newest good step (a torn step 4 is refused).
    m2, o2, s2 = mlp_state(seed=7)
    # (Lag: through the same lagging view, whose listings still hide every step written.)
    fresh = cfdist.Checkpointer({"model": m2, "optim": o2, "sched": s2}, w if fault == "lag" else url,
                                cfdist.Every(EVERY), keep=3)
    assert fresh.restore() == 8
    assert all(torch.equal(m2.state_dict()[k], final[k]) for k in final)
    fresh.close()
    if fault == "lag":
        assert w.hidden > 0 and all(not n.startswith("step-") for n in w.listdir(""))
    if fault == "torn":                                # committed, but the disk lied: reading finds it
        with pytest.raises(cfdist.CheckpointError, match="truncated"):
            cfdist.load(url, step=4)


def test_hung_writer_process_is_given_up_killed_and_replaced(tmp_path, mlp_state, train, caplog):
    """``backend="process"``: the writer process stops (SIGSTOP: a write stuck in the kernel)
    while it writes step 4. After ``PersistOptions.timeout_s`` the persist is declared failed, the
    stopped writer is killed (it can never commit: its gate is taken), a fresh writer process
    writes step 6, which commits; training never stopped; ``wait()`` raises the timeout once.

    Real: the spawned writer process, /dev/shm arenas, ``file://`` storage, SIGSTOP. Faked:
    nothing; the hang is a stopped process.
    """
    url = f"file://{tmp_path}/ckpt"
    st = open_storage(url)
    model, opt, sched = mlp_state(width=2048)               # ~0.8 MB: a write that lasts a moment
    ckpt = cfdist.Checkpointer({"model": model, "optim": opt, "sched": sched}, url, cfdist.Every(EVERY),
                               persist=cfdist.PersistOptions(backend="process", timeout_s=5.0), keep=3)
    train(model, opt, ckpt, 2, sched)
    ckpt.wait()
    assert ckpt.latest_step == 2
    (writer,) = ckpt.backend.writer_pids()
    os.kill(writer, signal.SIGSTOP)                         # step 4's write will hang
    try:
        caplog.set_level(logging.ERROR)
        train(model, opt, ckpt, 2, sched, seed=1)           # step 4: submitted to the stopped writer
        model(torch.zeros(1, 16))
        train(model, opt, ckpt, 2, sched, seed=2)           # step 6 waits out the timeout, then goes on
        with pytest.raises(TimeoutError, match="PersistOptions.timeout_s=5.0"):
            ckpt.wait()
    finally:
        try:
            os.kill(writer, signal.SIGCONT)
        except ProcessLookupError:
            pass
    _until(lambda: not os.path.exists(f"/proc/{writer}") or open(f"/proc/{writer}/stat").read().split()[2] == "Z")
    assert ckpt.step_count == 6 and ckpt.latest_step == 6 and ckpt.stats["errors"] == 1
    assert writer not in ckpt.backend.writer_pids() and ckpt.backend.restarts == 1
    assert any("PersistOptions.timeout_s" in r.getMessage() for r in caplog.records if r.name == "cfdist.checkpointer")
    ckpt.close()
    assert committed_steps(st) == [2, 6]
