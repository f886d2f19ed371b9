"""Checkpoints written with each I/O mode (``Checkpointer(io=...)``) on real local files: shards
stay plain safetensors files (a 4 KiB-aligned data section for O_DIRECT), restore bit-exact."""

from __future__ import annotations

import glob
import os
import struct

import pytest
import torch
from safetensors.torch import load_file

import cfdist
from cfdist.storage import direct


def _train(url: str, io: str, steps: int = 3):
    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Linear(7, 33), torch.nn.ReLU(), torch.nn.Linear(33, 5))   # odd sizes
    opt = torch.optim.Adam(m.parameters(), lr=0.1)
    ck = cfdist.Checkpointer({"model": m, "optim": opt}, url, cfdist.Every(1), persist=cfdist.PersistOptions(io=io))
    for _ in range(steps):
        m(torch.randn(4, 7)).sum().backward()
        ck.step(opt)
        opt.zero_grad()
    ck.close()
    return m, opt, ck.stats


@pytest.mark.parametrize("io", ["auto", "buffered"])
def test_shards_are_safetensors_and_restore_bit_exact(tmp_path, io):
    url = f"file://{tmp_path}/run"
    m, opt, stats = _train(url, io)
    direct_ok = direct.unsupported_reason(str(tmp_path)) is None
    assert stats["io"] == ("direct" if io == "auto" and direct_ok else "buffered")
    (shard,) = glob.glob(f"{tmp_path}/run/step-000000003/shard-*.safetensors")
    with open(shard, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
    assert (8 + n) % (direct.ALIGN if io == "auto" else 8) == 0
    got = load_file(shard)   # the safetensors library reads the padded header
    assert all(torch.equal(got[f"model/{k}"], v) for k, v in m.state_dict().items())
    m2 = torch.nn.Sequential(torch.nn.Linear(7, 33), torch.nn.ReLU(), torch.nn.Linear(33, 5))
    opt2 = torch.optim.Adam(m2.parameters(), lr=0.1)
    ck = cfdist.Checkpointer({"model": m2, "optim": opt2}, url, cfdist.Every(1), persist=cfdist.PersistOptions(io=io))
    assert ck.restore() == 3
    ck.close()
    assert all(torch.equal(a, b) for a, b in zip(m.state_dict().values(), m2.state_dict().values()))
    for s1, s2 in zip(opt.state_dict()["state"].values(), opt2.state_dict()["state"].values()):
        assert all(torch.equal(s1[k], s2[k]) for k in s1)


def test_bad_io_values_are_refused(tmp_path):
    m = torch.nn.Linear(2, 2)
    with pytest.raises(ValueError, match="io must be one of"):
        cfdist.Checkpointer({"model": m}, f"file://{tmp_path}/a", persist=cfdist.PersistOptions(io="fast"))
    with pytest.raises(ValueError, match="io='direct' needs local file:// roots"):
        cfdist.Checkpointer({"model": m}, "memory://io-direct-refused", persist=cfdist.PersistOptions(io="direct"))
    with pytest.raises(ValueError, match="buffers must be an int in"):
        cfdist.Checkpointer({"model": m}, f"file://{tmp_path}/b", buffers=0)


def test_deleted_checkpoints_files_are_written_over_and_the_pool_goes_at_close(tmp_path):
    """keep=1 at every step: from the third step on each shard is written over the file of the step
    retention deleted (the same inode), every checkpoint restores bit-exact, and close() leaves
    the checkpoints only. A pool left by a crashed run is emptied by the next start."""
    url = f"file://{tmp_path}/run"
    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Linear(7, 33), torch.nn.BatchNorm1d(33), torch.nn.Linear(33, 5))
    opt = torch.optim.Adam(m.parameters(), lr=0.1)
    ck = cfdist.Checkpointer({"model": m, "optim": opt}, url, cfdist.Every(1), keep=1)
    inodes, states = [], {}
    for step in range(1, 6):
        m(torch.randn(4, 7)).sum().backward()
        ck.step(opt)
        opt.zero_grad()
        ck.wait()
        (shard,) = glob.glob(f"{tmp_path}/run/step-{step:09d}/shard-*.safetensors")
        inodes.append(os.stat(shard).st_ino)
        states[step] = {k: v.clone() for k, v in m.state_dict().items()}
        got = cfdist.load(url, step=step)["state"]["model"]   # verifies every checksum
        assert all(torch.equal(got[k], v) for k, v in states[step].items())
    assert ck.stats["files_reused"] == 3
    assert inodes[2] == inodes[0] and inodes[3] == inodes[1] and inodes[4] == inodes[2]
    assert os.path.isdir(f"{tmp_path}/run/{direct.REUSE_DIR}")
    ck.close()
    assert not os.path.exists(f"{tmp_path}/run/{direct.REUSE_DIR}")
    assert [n for n in os.listdir(f"{tmp_path}/run") if n.startswith("step-")] == ["step-000000005"]
    # a crashed run's pool: swept at the next start, which restores the newest step
    os.makedirs(f"{tmp_path}/run/{direct.REUSE_DIR}")
    with open(f"{tmp_path}/run/{direct.REUSE_DIR}/shard-0-of-1.safetensors.x", "wb") as f:
        f.write(b"junk")
    ck = cfdist.Checkpointer({"model": m, "optim": opt}, url, cfdist.Every(1), keep=1)
    assert not os.path.exists(f"{tmp_path}/run/{direct.REUSE_DIR}")
    assert ck.restore() == 5
    ck.close()
