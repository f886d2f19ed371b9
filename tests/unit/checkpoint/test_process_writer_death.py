"""A writer process that dies after committing its step: the step is reported committed.

Real: ``write_checkpoint`` into ``file://`` in tmp_path, the cross-process ``CommitGate`` file.
Faked: the writer process's death, as the ``BrokenProcessPool`` its future fails with (the
SIGKILLs themselves are in tests/integration/checkpoint/test_checkpoint_double_buffer.py, where
the instant of the kill, before or after the commit, is not under the test's control).
"""

from __future__ import annotations

import concurrent.futures as cf
from concurrent.futures.process import BrokenProcessPool

import pytest
import torch

from cfdist.checkpoint.persist import CommitGate, PersistJob, ProcessBackend, ShardJob, write_checkpoint
from cfdist.checkpoint.snapshot import Snapshotter
from cfdist.storage import open_storages


def _job(tmp_path, step: int, gate_name: str):
    snap = Snapshotter()
    snap.start({"w": torch.arange(1000, dtype=torch.float32)})
    snap.wait_copied()
    shards = [ShardJob(index=0, count=1, root=0, nbytes=snap.host[0].nbytes, entries=snap.layout[0])]
    job = PersistJob(step=step, manifest={"skeleton": {}}, shards=shards, arenas=[snap.host[0].buf],
                     gate=CommitGate(str(tmp_path / gate_name)))
    return snap, job


def _backend(url: str) -> ProcessBackend:
    be = object.__new__(ProcessBackend)   # no writer process: the death is the future's error
    be.urls, be.options = [url], {}
    return be


def _died(be, job) -> cf.Future:
    f: cf.Future = cf.Future()
    out = be._settled(f, job)
    f.set_running_or_notify_cancel()
    f.set_exception(BrokenProcessPool("A process in the process pool was terminated abruptly"))
    return out


def test_died_after_the_commit_is_a_commit(tmp_path):
    url = f"file://{tmp_path}/run"
    snap, job = _job(tmp_path, 7, "gate-7")
    write_checkpoint(open_storages([url]), job)   # claims the gate, commits; "then the process died"
    info = _died(_backend(url), job).result(timeout=5)
    assert info.step == 7 and info.bytes == 4000 and info.url.endswith("step-000000007")
    snap.close()


def test_died_before_the_commit_is_a_failure(tmp_path):
    url = f"file://{tmp_path}/run"
    snap, job = _job(tmp_path, 8, "gate-8")
    with pytest.raises(BrokenProcessPool):   # the gate was never claimed
        _died(_backend(url), job).result(timeout=5)
    # claimed for the commit but the manifest never published (died between claim and rename)
    assert job.gate.claim()
    with pytest.raises(BrokenProcessPool):
        _died(_backend(url), job).result(timeout=5)
    snap.close()


def test_an_abandoned_persist_whose_writer_died_stays_failed(tmp_path):
    """A step committed under the same number by an earlier writer does not count: only a writer
    that claimed this persist's gate for its commit did commit it."""
    url = f"file://{tmp_path}/run"
    snap, job = _job(tmp_path, 9, "gate-9")
    write_checkpoint(open_storages([url]), job)
    snap2, job2 = _job(tmp_path, 9, "gate-9b")
    assert job2.gate.abandon()
    with pytest.raises(BrokenProcessPool):
        _died(_backend(url), job2).result(timeout=5)
    snap.close(), snap2.close()


def test_a_write_given_up_midway_stops_at_its_next_chunk_and_commits_nothing(tmp_path, monkeypatch):
    """The persist is given up (its gate abandoned, as ``save_live(durable=True)`` does to an
    older persist in flight) after the shard's first data chunk was written: the writer stops
    there (``PersistAbandoned``) instead of writing the remaining chunks of a checkpoint that
    cannot commit; nothing is committed. Real: ``write_checkpoint`` into ``file://``, the file
    gate; the chunk size is made small so that the 4 KB tensor spans four chunks."""
    from cfdist.checkpoint import persist
    from cfdist.checkpoint.discovery import committed_steps
    from cfdist.storage import open_storage

    monkeypatch.setattr(persist, "_CHUNK", 1024)
    url = f"file://{tmp_path}/run"
    snap, job = _job(tmp_path, 9, "gate-9")
    sent = []
    real = persist._shard_chunks

    def chunks(*a, **k):
        for c in real(*a, **k):
            sent.append(len(c))
            if len(sent) == 2:          # the header, then the first data chunk: given up now
                assert job.gate.abandon()
            yield c

    monkeypatch.setattr(persist, "_shard_chunks", chunks)
    with pytest.raises(persist.PersistAbandoned, match="given up while it was written"):
        write_checkpoint(open_storages([url]), job)
    assert sent[1:] == [1024], sent   # the 3 chunks after it were never read (nor that one written)
    assert committed_steps(open_storage(url)) == []
    snap.close()
