"""The checkpointer over every storage backend, and striped over two roots."""

from __future__ import annotations

import warnings

import pytest
import safetensors.torch
import torch

import cfdist
from cfdist.checkpoint.format import MANIFEST, step_dir
from cfdist.storage import open_storage


def _state(mlp_state, seed):
    model, opt, sched = mlp_state(seed=seed, width=96)
    return {"model": model, "optim": opt, "sched": sched, "note": {"run": "a", "lr0": 0.01}}


def _assert_same(a: dict, b: dict) -> None:
    for k, t in a["model"].state_dict().items():
        assert torch.equal(t, b["model"].state_dict()[k]), k
    sa, sb = a["optim"].state_dict(), b["optim"].state_dict()
    assert sa["param_groups"] == sb["param_groups"]
    for i, s in sa["state"].items():
        for key, t in s.items():
            assert torch.equal(t, sb["state"][i][key]), (i, key)
    assert a["sched"].state_dict() == b["sched"].state_dict()
    assert a["note"] == b["note"]


def test_save_restore_roundtrip_on_each_backend(storage_url, mlp_state, train):
    """Save with one Checkpointer, restore into fresh objects with another, on file/memory/s3.

    Real: the Checkpointer, the thread persist backend, ``file://`` in tmp_path, ``memory://``,
    and S3 through s3fs against a real local moto server (no rename there: the manifest PUT is
    the commit). Faked: nothing (the S3 server is local).
    The point: the restored model, Adam state, scheduler and plain values equal the saved
    ones; ``cfdist.load`` returns a plain dict of CPU tensors; every shard is a plain
    safetensors file whose tensors equal the model's.
    """
    saved = _state(mlp_state, 0)
    ckpt = cfdist.Checkpointer(saved, storage_url, cfdist.Every(2))
    train(saved["model"], saved["optim"], ckpt, 5, saved["sched"])
    ckpt.save(block=True)                    # step 5, off the Every(2) grid
    ckpt.close()
    assert ckpt.stats["errors"] == 0 and ckpt.latest_step == 5
    assert [c["step"] for c in cfdist.list_checkpoints(storage_url)] == [4, 5]   # keep=2, the default

    restored = _state(mlp_state, 1)
    restored["note"] = None
    ckpt2 = cfdist.Checkpointer(restored, storage_url, cfdist.Every(2))
    assert ckpt2.restore() == 5 and ckpt2.step_count == 5
    _assert_same(saved, restored)
    ckpt2.close()

    plain = cfdist.load(storage_url)
    assert type(plain) is dict and plain["step"] == 5
    assert set(plain["state"]) == {"model", "optim", "sched", "note"}
    fresh = _state(mlp_state, 2)["model"]
    fresh.load_state_dict(plain["state"]["model"])
    for k, t in saved["model"].state_dict().items():
        assert torch.equal(fresh.state_dict()[k], t)

    st = open_storage(storage_url)
    shards = [n for n in st.listdir(step_dir(5)) if n.endswith(".safetensors")]
    assert shards and MANIFEST in st.listdir(step_dir(5))
    tensors = {}
    for n in shards:
        tensors.update(safetensors.torch.load(st.read_bytes(f"{step_dir(5)}/{n}")))
    for k, t in saved["model"].state_dict().items():
        assert torch.equal(tensors[f"model/{k}"], t)


def test_striping_over_two_roots_writes_both_and_restores(tmp_path, mlp_state, train):
    """A checkpoint striped over two ``file://`` roots: shards on both, manifest on the first.

    Real: the Checkpointer writing two shards in parallel to two directories, each published
    by rename before the manifest commit on root 0. Faked: two directories stand for two disks.
    The point: each root holds a shard that ``safetensors.torch.load_file`` reads; restoring
    with both URLs gives the saved state; with root 0 alone the error says to pass all roots.
    """
    roots = [tmp_path / "disk0", tmp_path / "disk1"]
    urls = [f"file://{r}" for r in roots]
    saved = _state(mlp_state, 0)
    ckpt = cfdist.Checkpointer(saved, urls, cfdist.Every(2))
    train(saved["model"], saved["optim"], ckpt, 4, saved["sched"])
    ckpt.close()

    d0, d1 = (r / step_dir(4) for r in roots)
    assert sorted(p.name for p in d0.iterdir()) == [MANIFEST, "shard-00000-of-00002.safetensors"]
    assert sorted(p.name for p in d1.iterdir()) == ["shard-00001-of-00002.safetensors"]
    on_disk = {}
    for f in (d0 / "shard-00000-of-00002.safetensors", d1 / "shard-00001-of-00002.safetensors"):
        part = safetensors.torch.load_file(str(f))
        assert part, f"{f} holds no tensor"
        on_disk.update(part)
    for k, t in saved["model"].state_dict().items():
        assert torch.equal(on_disk[f"model/{k}"], t)

    restored = _state(mlp_state, 1)
    ckpt2 = cfdist.Checkpointer(restored, urls, cfdist.Every(2))
    assert ckpt2.restore() == 4
    _assert_same(saved, restored)
    ckpt2.close()
    assert cfdist.load(urls)["step"] == 4
    with pytest.raises(cfdist.CheckpointError, match="striped over 2 roots.*pass all of them"):
        cfdist.load(urls[0], step=4)


def test_a_rejected_step_is_rewritten_after_the_fallback_on_each_backend(storage_url, mlp_state, train):
    """After restore fell back past a corrupt step, training re-commits that step number cleanly.

    Real: the Checkpointer on file/memory/s3 (on S3 the new shards go under the very prefix of
    the rejected checkpoint, whose manifest must be gone first). Faked: step 4's shard is
    corrupted through the storage API (a flipped byte).
    The point: restore loads step 2 with a warning, the new step 4 and 6 commit without error,
    and a fresh restore takes step 6 without any warning.
    """
    state = _state(mlp_state, 0)
    ckpt = cfdist.Checkpointer(state, storage_url, cfdist.Every(2), keep=2)
    train(state["model"], state["optim"], ckpt, 4, state["sched"])
    ckpt.close()
    st = open_storage(storage_url)
    rel = f"{step_dir(4)}/shard-00000-of-00001.safetensors"
    raw = bytearray(st.read_bytes(rel))
    raw[-3] ^= 0x10
    st.write_file(rel, [bytes(raw)])

    state = _state(mlp_state, 1)
    ckpt = cfdist.Checkpointer(state, storage_url, cfdist.Every(2), keep=2)
    with pytest.warns(RuntimeWarning, match="failed its checksum"):
        assert ckpt.restore() == 2
    train(state["model"], state["optim"], ckpt, 4, state["sched"])
    ckpt.close()
    assert ckpt.stats["errors"] == 0
    assert [c["step"] for c in cfdist.list_checkpoints(storage_url)] == [4, 6]

    again = _state(mlp_state, 2)
    ckpt = cfdist.Checkpointer(again, storage_url, cfdist.Every(2))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert ckpt.restore() == 6
    _assert_same(state, again)
    ckpt.close()
