"""A checkpoint that does not fit the live objects, and a disk that fills up during persist."""

from __future__ import annotations

import copy
import errno
import random
import time

import numpy as np
import pytest
import torch

import cfdist
from cfdist.checkpoint.discovery import committed_steps
from cfdist.data import ResumableLoader
from cfdist.storage import open_storage
from cfdist.testing import faulty


class Positions(torch.utils.data.Dataset):
    def __init__(self, n: int):
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i):
        return torch.full((16,), float(i))


def _snapshot(state: dict) -> dict:
    """Deep copies of everything restore could change: live objects' states, values, RNGs."""
    out = {k: copy.deepcopy(v.state_dict()) if hasattr(v, "state_dict") else copy.deepcopy(v)
           for k, v in state.items()}
    out["__rng__"] = (torch.get_rng_state(), random.getstate(), np.random.get_state()[1].copy())
    out["__objects__"] = {k: id(v) for k, v in state.items()}
    return out


def _same(a, b) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, np.ndarray):
        return isinstance(b, np.ndarray) and np.array_equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(map(_same, a, b))
    return a == b


def _assert_unchanged(before: dict, after: dict) -> None:
    assert before.keys() == after.keys()
    for k in before:
        assert _same(before[k], after[k]), f"{k} changed"


def _saved_run(url, mlp_state, train, width=64):
    model, opt, sched = mlp_state(width=width)
    loader = ResumableLoader(Positions(48), 8, seed=3, rank=0, world_size=1)
    state = {"model": model, "optim": opt, "sched": sched, "data": loader, "step_note": "x"}
    ckpt = cfdist.Checkpointer(state, url, cfdist.Every(2))
    it = iter(loader)
    for _ in range(4):
        next(it)
        train(model, opt, ckpt, 1, sched)
    ckpt.close()


def _live(mlp_state, change: str):
    model, opt, sched = mlp_state(seed=5, width=32 if change == "shape" else 64)
    if change == "dtype":
        model = model.double()
        opt = torch.optim.Adam(model.parameters(), lr=1e-2)
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
    n = 40 if change == "data" else 48
    state = {"model": model, "optim": opt, "sched": sched,
             "data": ResumableLoader(Positions(n), 8, seed=3, rank=0, world_size=1), "step_note": "y"}
    if change == "missing":
        state["ema"] = torch.zeros(3)
    if change == "extra":
        del state["step_note"]
    if change == "several":
        state["ema"] = torch.zeros(3)
        model[0] = torch.nn.Linear(16, 64, bias=False)
        del state["step_note"]
    return state


@pytest.mark.parametrize("change, diffs", [
    ("missing", ["ema: missing in the checkpoint"]),
    ("extra", ["step_note: in the checkpoint but not in the live state"]),
    ("shape", ["model.0.weight: shape (64, 16) in the checkpoint, (32, 16) live",
               "model.3.weight: shape (4, 64) in the checkpoint, (4, 32) live"]),
    ("dtype", ["model.0.weight: dtype torch.float32 in the checkpoint, torch.float64 live"]),
    ("several", ["ema: missing in the checkpoint", "step_note: in the checkpoint but not in the live state",
                 "model.0.bias: in the checkpoint but not in the live object"]),
    ("data", ["loading state['data'] failed"]),
])
def test_a_checkpoint_that_does_not_fit_is_refused_and_changes_nothing(tmp_path, mlp_state, train, change, diffs):
    """Restoring into objects of another shape, dtype, key set or dataset fails with every difference.

    Real: a checkpoint written by the Checkpointer (model, Adam, StepLR, ResumableLoader, a
    plain value) and a restore into live objects built differently. Faked: nothing.
    The point: ``CheckpointError`` lists each difference, and the live objects, plain values
    and RNG states are exactly as before the call (nothing half-loaded), including when only
    the data loader refuses its state after the model would already fit.
    """
    url = f"file://{tmp_path / 'ckpt'}"
    _saved_run(url, mlp_state, train)
    state = _live(mlp_state, change)
    ckpt = cfdist.Checkpointer(state, url, cfdist.Every(2))
    torch.manual_seed(99)
    before = _snapshot(state)
    with pytest.raises(cfdist.CheckpointError) as err:
        ckpt.restore()
    for d in diffs:
        assert d in str(err.value), str(err.value)
    _assert_unchanged(before, _snapshot(state))
    assert ckpt.step_count == 0
    ckpt.close()


def test_disk_full_during_persist_keeps_training_and_the_previous_checkpoint(tmp_path, mlp_state, train):
    """ENOSPC in the middle of a shard: training goes on, the error is counted and re-raised.

    Real: the Checkpointer, its persist thread, ``file://`` storage (a partial shard really
    lands in a staging directory). Faked: the full disk (``cfdist.testing.faulty`` lets
    4 KiB through, then fails with ENOSPC until healed).
    The point: ``step()`` never raises; ``stats["errors"]`` counts the failure; step 2 stays
    the loadable checkpoint; after healing the next persist (step 6) commits; ``wait()``
    re-raises the ENOSPC once, with the URL; a new Checkpointer sweeps the partial write.
    """
    root = tmp_path / "ckpt"
    disk = faulty(open_storage(f"file://{root}"))
    model, opt, sched = mlp_state()
    ckpt = cfdist.Checkpointer({"model": model, "optim": opt, "sched": sched}, disk, cfdist.Every(2))
    train(model, opt, ckpt, 2, sched)
    ckpt.wait()
    assert ckpt.latest_step == 2

    disk.arm(fail_after_bytes=4096)
    train(model, opt, ckpt, 2, sched)                      # step 4's snapshot
    model(torch.zeros(1, 16))                              # the next forward: its persist starts, and fails
    deadline = time.monotonic() + 30
    while disk.failures == 0 and time.monotonic() < deadline:
        time.sleep(0.005)
    assert disk.failures == 1
    assert [c["step"] for c in cfdist.list_checkpoints(f"file://{root}")] == [2]
    assert cfdist.load(f"file://{root}")["step"] == 2
    assert any(".tmp-" in p.name for p in root.iterdir())   # the partial write, invisible

    disk.heal()
    train(model, opt, ckpt, 2, sched)                      # step 6: collects step 4's error, persists
    assert ckpt.stats["errors"] == 1
    assert "No space left on device" in ckpt.stats["last_error"]
    with pytest.raises(OSError) as err:
        ckpt.wait()
    assert err.value.errno == errno.ENOSPC and str(root) in str(err.value)
    assert ckpt.latest_step == 6 and ckpt.stats["checkpoints"] == 2
    ckpt.wait()                                            # raised once
    ckpt.close()
    assert committed_steps(open_storage(f"file://{root}")) == [2, 6]   # keep=2, the default

    fresh = cfdist.Checkpointer(dict(zip(("model", "optim", "sched"), mlp_state(seed=1))), f"file://{root}",
                                cfdist.Every(2))
    assert fresh.restore() == 6
    assert sorted(p.name for p in root.iterdir()) == ["LATEST.json", "STRIPE.json", "history.json",
                                                      "step-000000002", "step-000000006"]
    fresh.close()
