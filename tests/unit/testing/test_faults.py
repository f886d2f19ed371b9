"""The fault-injection wrappers over real backends (file, memory, s3 on the local moto server).

Real: the wrapped storages and the bytes they hold. Faked: time, in the throttle tests that
check the amount of slowdown (an injected clock and sleep; a backend that "takes" a fixed time
per chunk), so they assert exact seconds without measuring wall time. One test checks that the
real sleep happens, as a lower bound only.
"""

from __future__ import annotations

import errno
import pickle
import threading
import time

import pytest

from cfdist.storage import Storage, StorageError, open_storage
from cfdist.testing import FaultyStorage, StorageWrapper, ThrottledStorage, faulty, throttle


@pytest.fixture
def st(storage_url) -> Storage:
    return open_storage(storage_url)


@pytest.fixture
def local(tmp_path) -> Storage:
    return open_storage(f"file://{tmp_path}/root")


# ---- faulty ---------------------------------------------------------------------------------------
def test_full_disk_leaves_partial_file_then_heals(st):
    full = faulty(st, fail_after_bytes=1000)
    assert isinstance(full, Storage)
    with pytest.raises(StorageError) as ei:
        full.write_file("run/shard.bin", [b"a" * 400, b"b" * 400, b"c" * 400])
    e = ei.value
    assert e.errno == errno.ENOSPC
    assert f"writing {st.url}/run/shard.bin failed after 1000 bytes" in str(e)
    assert "injected" in str(e) and "fail_after_bytes=1000" in str(e)
    if st.atomic_rename:  # a disk keeps what reached it
        assert st.read_bytes("run/shard.bin") == b"a" * 400 + b"b" * 400 + b"c" * 200
    else:  # an aborted upload leaves no object
        assert not st.exists("run/shard.bin")

    with pytest.raises(StorageError, match="after 0 bytes"):  # still full
        full.write_file("run/small", [b"x"])
    assert full.failures == 2 and full.calls["write_file"] == 2 and full.bytes_written == 1000

    full.heal()
    assert full.write_file("run/shard.bin", [b"ok"]) == 2
    assert st.read_bytes("run/shard.bin") == b"ok"  # really on the real backend
    assert full.failures == 2 and full.calls["write_file"] == 3


def test_budget_is_shared_across_files_and_rearmed(local):
    full = faulty(local, fail_after_bytes=1000)
    full.write_file("a", [b"x" * 600])
    with pytest.raises(StorageError, match="after 400 bytes"):
        full.write_file("b", [b"y" * 600])
    assert local.size("b") == 400
    full.arm(fail_after_bytes=10)  # budget counts from now
    full.write_file("c", [b"z" * 10])
    with pytest.raises(StorageError):
        full.write_file("d", [b"z"])
    assert full.bytes_written == 1010


def test_write_atomic_on_a_full_disk_keeps_the_old_content(st):
    st.write_atomic("MANIFEST.json", b'{"step": 1}')
    full = faulty(st, fail_after_bytes=4)
    with pytest.raises(StorageError) as ei:
        full.write_atomic("MANIFEST.json", b'{"step": 2}')
    assert ei.value.errno == errno.ENOSPC
    assert st.read_bytes("MANIFEST.json") == b'{"step": 1}'
    assert st.listdir("") == ["MANIFEST.json"]  # no tmp leftovers
    assert full.calls["write_atomic"] == 1 and full.calls["write_file"] == 1


def test_every_nth_write_fails_before_its_first_byte(st):
    flaky = faulty(st, fail_every_n_writes=3, errno=errno.EIO)
    outcomes = []
    for i in range(1, 7):
        try:
            flaky.write_file(f"f{i}", [b"data"])
            outcomes.append("ok")
        except StorageError as e:
            assert e.errno == errno.EIO and f"f{i}" in str(e) and "after 0 bytes" in str(e)
            outcomes.append("fail")
    assert outcomes == ["ok", "ok", "fail", "ok", "ok", "fail"]
    assert flaky.failures == 2
    assert st.read_bytes("f4") == b"data"
    if st.atomic_rename:
        assert st.read_bytes("f3") == b""  # opened, then the link dropped
    else:
        assert not st.exists("f3")


def test_every_nth_read_fails_other_verbs_are_counted(local):
    local.write_file("x", [b"abc"])
    flaky = faulty(local, fail_every_n_reads=2, errno=errno.ECONNRESET)
    assert flaky.read_bytes("x") == b"abc"
    with pytest.raises(StorageError, match=r"reading file://.*/x failed.*fail_every_n_reads=2") as ei:
        flaky.read_bytes("x")
    assert ei.value.errno == errno.ECONNRESET
    with flaky.open_read("x") as f:
        assert f.read() == b"abc"
    with pytest.raises(StorageError):
        flaky.open_read("x")
    assert flaky.listdir("") == ["x"] and flaky.exists("x") and flaky.size("x") == 3
    assert flaky.calls == {"read_bytes": 2, "open_read": 2, "listdir": 1, "exists": 1, "size": 1}
    flaky.heal()
    assert [flaky.read_bytes("x") for _ in range(3)] == [b"abc"] * 3


def test_faulty_validates_its_settings(local):
    with pytest.raises(ValueError, match="fail_every_n_writes=0"):
        faulty(local, fail_every_n_writes=0)
    with pytest.raises(ValueError, match="fail_after_bytes=-1"):
        faulty(local, fail_after_bytes=-1)


def test_faulty_is_thread_safe_on_its_budget(local):
    full = faulty(local, fail_after_bytes=10_000)
    failed = []

    def write(i):
        try:
            full.write_file(f"t{i}", [b"x" * 100] * 30)
        except StorageError:
            failed.append(i)

    threads = [threading.Thread(target=write, args=(i,)) for i in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    sizes = [local.size(f"t{i}") for i in range(6)]
    assert sum(sizes) == 10_000 == full.bytes_written  # not a byte more, however interleaved
    assert len(failed) >= 3 and full.failures == len(failed)  # at most 3 x 3000 bytes fit
    assert all(sizes[i] == 3000 for i in range(6) if i not in failed)


# ---- throttle -------------------------------------------------------------------------------------
class FakeTime:
    """A clock that only sleeping and the fake backend move."""

    def __init__(self):
        self.now = 0.0

    def clock(self) -> float:
        return self.now

    def sleep(self, s: float) -> None:
        assert s > 0
        self.now += s


class TimedBackend(StorageWrapper):
    """Writes really go to ``inner``; each chunk "takes" ``per_chunk`` s, the close ``tail`` s."""

    def __init__(self, inner, t: FakeTime, per_chunk: float, tail: float):
        super().__init__(inner)
        self.t, self.per_chunk, self.tail = t, per_chunk, tail

    def write_file(self, rel, chunks, *, fsync=True):
        def timed():
            for c in chunks:
                yield c
                self.t.now += self.per_chunk

        n = self.inner.write_file(rel, timed(), fsync=fsync)
        self.t.now += self.tail
        return n


def _slow(local, *, per_chunk=0.0, tail=0.0, **kw) -> tuple[ThrottledStorage, FakeTime]:
    t = FakeTime()
    return ThrottledStorage(TimedBackend(local, t, per_chunk, tail), clock=t.clock, sleep=t.sleep, **kw), t


def test_bytes_per_s_caps_the_rate(local):
    slow, t = _slow(local, bytes_per_s=100.0)
    assert slow.write_file("a", [b"x" * 250, b"y" * 250]) == 500
    assert t.now == pytest.approx(5.0) and slow.slept_s == pytest.approx(5.0)
    assert local.read_bytes("a") == b"x" * 250 + b"y" * 250


def test_bytes_per_s_counts_the_backends_own_time(local):
    slow, t = _slow(local, per_chunk=1.0, bytes_per_s=100.0)
    slow.write_file("a", [b"x" * 250, b"y" * 250])  # 2 s of real work, 5 s needed
    assert t.now == pytest.approx(5.0) and slow.slept_s == pytest.approx(3.0)


def test_factor_multiplies_chunk_and_tail_time_and_switches_at_runtime(local):
    slow, t = _slow(local, per_chunk=0.5, tail=0.25)
    slow.write_file("a", [b"x"] * 4)  # no factor: full speed
    assert slow.slept_s == 0 and t.now == pytest.approx(2.25)
    slow.set_factor(5.0)
    t.now = 0.0
    slow.write_file("b", [b"x"] * 4)
    assert t.now == pytest.approx(5 * 2.25) and slow.slept_s == pytest.approx(4 * 2.25)
    slow.set_factor(None)
    t.now = 0.0
    slow.write_file("c", [b"x"] * 4)
    assert t.now == pytest.approx(2.25)


def test_after_bytes_lets_a_burst_through_first(local):
    slow, t = _slow(local, bytes_per_s=100.0, after_bytes=300)
    slow.write_file("a", [b"x" * 200])  # within the burst
    assert t.now == 0.0
    slow.write_file("b", [b"x" * 200])  # 100 within, 100 throttled
    assert t.now == pytest.approx(1.0)
    slow.write_file("c", [b"x" * 200])
    assert t.now == pytest.approx(3.0) and slow.bytes_written == 600


def test_write_atomic_is_throttled_too(local):
    slow, t = _slow(local, bytes_per_s=10.0)
    slow.write_atomic("MANIFEST.json", b"0123456789")
    assert t.now == pytest.approx(1.0) and local.read_bytes("MANIFEST.json") == b"0123456789"


def test_throttle_validates_its_settings(local):
    with pytest.raises(ValueError, match="factor=0.5 would speed the disk up"):
        throttle(local, factor=0.5)
    with pytest.raises(ValueError, match="bytes_per_s=0"):
        throttle(local, bytes_per_s=0)
    slow = throttle(local)
    with pytest.raises(ValueError, match="factor >= 1"):
        slow.set_factor(0.0)


def test_throttle_really_sleeps(local):
    slow = throttle(local, bytes_per_s=1_000_000)
    t0 = time.perf_counter()
    slow.write_file("a", [b"x" * 50_000] * 4)  # 0.2 s at 1 MB/s
    assert time.perf_counter() - t0 >= 0.2 and slow.slept_s > 0.15


def test_bytes_per_s_is_shared_by_concurrent_writers(local):
    slow = throttle(local, bytes_per_s=2_000_000)
    threads = [threading.Thread(target=slow.write_file, args=(f"t{i}", [b"x" * 50_000] * 2))
               for i in range(2)]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    # 200 kB at 2 MB/s: 0.1 s together (each thread alone would need only 0.05 s)
    assert time.perf_counter() - t0 >= 0.099 and slow.bytes_written == 200_000


# ---- both -----------------------------------------------------------------------------------------
def test_wrappers_nest_and_pickle(st):
    both = throttle(faulty(st, fail_every_n_writes=2), factor=1.0)
    both.write_file("a", [b"1"])
    with pytest.raises(StorageError):
        both.write_file("b", [b"2"])
    assert isinstance(both.inner, FaultyStorage) and both.inner.failures == 1
    assert both.listdir("") == (["a", "b"] if st.atomic_rename else ["a"])
    copy = pickle.loads(pickle.dumps(both))  # settings and counters travel; switches do not
    assert copy.inner.failures == 1 and copy.read_bytes("a") == b"1"
    copy.inner.heal()
    assert not both.inner.healed
    copy.write_file("c", [b"3"])
    both.write_file("d", [b"4"])
    with pytest.raises(StorageError):  # the original is still armed: its 4th write fails
        both.write_file("e", [b"5"])
