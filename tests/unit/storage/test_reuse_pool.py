"""The reuse pool of local roots: a deleted checkpoint's files are written over by the next one.

Real files on the test's filesystem (``O_DIRECT`` where it is supported, the page cache otherwise).
"""

from __future__ import annotations

import os
import threading

import pytest

from cfdist.storage import direct


@pytest.mark.parametrize("io", ["auto", "buffered"])
def test_a_retired_file_is_written_over_in_place_and_truncated(tmp_path, io):
    pool, old, new = tmp_path / "pool", tmp_path / "step-1", tmp_path / "step-2"
    old.mkdir()
    (old / "shard-0-of-1.safetensors").write_bytes(os.urandom(3 * direct.ALIGN + 100))
    ino = os.stat(old / "shard-0-of-1.safetensors").st_ino
    assert direct.retire_dir(str(old), str(pool)) == 1
    assert not old.exists() and len(os.listdir(pool)) == 1
    new.mkdir()
    data = os.urandom(direct.ALIGN + 7)   # shorter than the old file: the tail must go
    n = direct.write_local(str(new / "shard-0-of-1.safetensors"), [data[:5000], data[5000:]], fsync=True,
                           io=io, reuse=str(pool))
    assert n == len(data) and direct.last_mode.reused
    assert (new / "shard-0-of-1.safetensors").read_bytes() == data
    assert os.stat(new / "shard-0-of-1.safetensors").st_ino == ino   # the same file, not a new one
    assert os.listdir(pool) == []
    # an empty pool: a new file, as without reuse
    n = direct.write_local(str(tmp_path / "other"), [data], fsync=True, io=io, reuse=str(pool))
    assert n == len(data) and not direct.last_mode.reused and (tmp_path / "other").read_bytes() == data


def test_a_longer_write_over_a_shorter_file(tmp_path):
    pool, d = tmp_path / "pool", tmp_path / "old"
    d.mkdir()
    (d / "a").write_bytes(b"x" * 10)
    direct.retire_dir(str(d), str(pool))
    data = os.urandom(5 * direct.ALIGN + 3)
    direct.write_local(str(tmp_path / "b"), [data], fsync=True, io="auto", reuse=str(pool))
    assert (tmp_path / "b").read_bytes() == data


def test_the_pool_is_bounded_and_the_same_name_is_preferred(tmp_path):
    pool = tmp_path / "pool"
    for step in (1, 2):
        d = tmp_path / f"step-{step}"
        d.mkdir()
        (d / "sub").mkdir()   # not a file: removed with the directory, never pooled
        for i in range(3):
            (d / f"shard-{i}-of-3.safetensors").write_bytes(b"%d" % i * (i + 1))
        direct.retire_dir(str(d), str(pool), limit=4)
        assert not d.exists()
    assert len(os.listdir(pool)) == 4   # 3 from step 1, 1 from step 2, the other 2 deleted
    target = tmp_path / "new"
    target.mkdir()
    assert direct.take_reusable(str(pool), str(target / "shard-2-of-3.safetensors"))
    assert (target / "shard-2-of-3.safetensors").read_bytes() == b"222"
    assert direct.retire_dir(str(tmp_path / "missing"), str(pool)) == 0


def test_writers_racing_for_the_pool_each_get_another_file_or_none(tmp_path):
    pool = tmp_path / "pool"
    pool.mkdir()
    for i in range(3):
        (pool / f"f{i}").write_bytes(b"%d" % i)
    got, barrier = [], threading.Barrier(8)

    def take(k):
        barrier.wait()
        got.append(direct.take_reusable(str(pool), str(tmp_path / f"t{k}")))

    ts = [threading.Thread(target=take, args=(k,)) for k in range(8)]
    [t.start() for t in ts]
    [t.join() for t in ts]
    assert sorted(got) == [False] * 5 + [True] * 3
    assert sorted((tmp_path / f"t{k}").read_bytes() for k in range(8) if (tmp_path / f"t{k}").exists()) \
        == [b"0", b"1", b"2"]
