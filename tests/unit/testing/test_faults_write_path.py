"""The hang/torn/lagging/denied wrappers of ``cfdist.testing`` on a real local root, and
the ``CommitGate`` that decides between a late writer and the waiter that gave it up.

Real: the local files, threads, a second process for the file-backed gate. Faked: the clock of
the lagging listing (injected), so the lag is exact without waiting.
"""

from __future__ import annotations

import errno
import multiprocessing as mp
import threading

import pytest

from cfdist.checkpoint.persist import CommitGate
from cfdist.storage import StorageError, open_storage
from cfdist.testing import LaggingStorage, denied, hang, torn


@pytest.fixture
def local(tmp_path):
    return open_storage(f"file://{tmp_path}/root")


def test_hang_blocks_at_the_byte_then_release_finishes_the_file(local):
    h = hang(local, hang_after_bytes=5)
    done = []
    t = threading.Thread(target=lambda: done.append(h.write_file("f", [b"abc", b"defgh"])))
    t.start()
    assert h.entered.wait(10)
    assert h.hung == 1 and not done
    assert local.read_bytes("f") == b"abcde"          # written up to the hang point, then blocked
    h.release()
    t.join(10)
    assert done == [8] and local.read_bytes("f") == b"abcdefgh" and h.hung == 0


def test_hang_only_matching_paths_and_disarmed_writes_pass(local):
    h = hang(local, hang_after_bytes=0, only="shard")
    assert h.write_file("MANIFEST.json", [b"{}"]) == 2   # not a shard: passes
    h.arm(hang_after_bytes=None)
    assert h.write_file("shard-0", [b"xy"]) == 2
    with pytest.raises(ValueError, match="hang_after_bytes=-1"):
        h.arm(hang_after_bytes=-1)


def test_torn_write_reports_all_bytes_and_keeps_a_prefix(local):
    t = torn(local, writes=1, keep_fraction=0.25, only="shard")
    assert t.write_file("MANIFEST.json", [b"{}"]) == 2
    assert t.write_file("shard-0", [b"a" * 60, b"b" * 40]) == 100
    assert local.size("shard-0") == 25 and t.torn == ["shard-0"]
    assert t.write_file("shard-1", [b"c" * 10]) == 10 and local.size("shard-1") == 10   # only one torn
    with pytest.raises(ValueError, match="keep_fraction"):
        t.arm(writes=1, keep_fraction=1.0)


def test_lagging_listing_hides_young_entries_but_keys_are_readable(local):
    now = [100.0]
    lag = LaggingStorage(local, lag_s=30.0, clock=lambda: now[0])
    local.write_file("old", [b"1"])                      # not written through the wrapper: visible
    lag.write_file("step-1.tmp-x/a", [b"2"])
    lag.publish("step-1.tmp-x", "step-1")
    assert lag.listdir("") == ["old"] and lag.listdir("step-1") == []
    assert lag.exists("step-1/a") and lag.read_bytes("step-1/a") == b"2"   # read-after-write
    now[0] += 30.0
    assert lag.listdir("") == ["old", "step-1"] and lag.listdir("step-1") == ["a"]
    assert lag.hidden == 2


def test_denied_refuses_every_write_even_as_root_and_heals(local):
    d = denied(local)
    for call in (lambda: d.write_file("x", [b"1"]), lambda: d.write_atomic("y", b"1"),
                 lambda: d.makedirs("z"), lambda: d.remove("old")):
        with pytest.raises(StorageError) as e:
            call()
        assert e.value.errno == errno.EACCES and local.url in str(e.value) and "permissions" in str(e.value)
    assert d.denied == 4 and not local.exists("x")
    d.heal()
    d.write_file("x", [b"1"])
    assert d.read_bytes("x") == b"1"


@pytest.mark.parametrize("where", ["thread", "file"])
def test_commit_gate_has_exactly_one_winner(where, tmp_path):
    gates = [CommitGate(None if where == "thread" else str(tmp_path / f"g{i}")) for i in range(3)]
    a, b, c = gates
    assert a.claim() and a.claim() and not a.abandon() and not a.abandoned()    # the writer won
    assert b.abandon() and b.abandon() and not b.claim() and b.abandoned()      # the waiter won
    won = []
    ts = [threading.Thread(target=lambda f=f: won.append(f())) for f in (c.claim, c.abandon) * 4]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    assert sorted(won) == [False] * 4 + [True] * 4   # one side won all its calls, the other none
    for g in gates:
        g.close()


def _claim(path, q):
    q.put(CommitGate(path).claim())


def test_file_gate_decides_across_processes(tmp_path):
    gate = CommitGate(str(tmp_path / "gate"))
    assert gate.abandon()
    ctx = mp.get_context("fork")   # the claim only needs the path; no torch import in the child
    q = ctx.Queue()
    p = ctx.Process(target=_claim, args=(gate.path, q))
    p.start()
    assert q.get(timeout=60) is False            # the writer process may not commit
    p.join(60)
    with pytest.raises(TypeError, match="cannot be pickled"):
        import pickle
        pickle.dumps(CommitGate())
