"""Retention (invariant 2) as the Checkpointer applies it on real storage."""

from __future__ import annotations

import threading

import pytest
import torch

import cfdist
from cfdist.checkpoint.format import MANIFEST, parse_step_dir
from cfdist.checkpoint.roots import IDENTITY
from cfdist.data import ResumableLoader
from cfdist.storage import open_storage
from cfdist.testing import StorageWrapper


class Recording(StorageWrapper):
    """Logs commits (publish of a step directory) and removals, in the order they happen."""

    def __init__(self, inner):
        super().__init__(inner)
        self.events: list[tuple[str, str]] = []
        self._ev_lock = threading.Lock()

    def publish(self, staging: str, final: str) -> None:
        super().publish(staging, final)
        with self._ev_lock:
            self.events.append(("commit", final))

    def remove(self, rel: str) -> None:
        with self._ev_lock:
            self.events.append(("remove", rel))
        super().remove(rel)


def test_keep_one_leaves_one_checkpoint_and_deletes_only_after_a_newer_commit(tmp_path, mlp_state, train):
    """``keep=1`` over 12 checkpoints: one step directory remains, and each deletion came later.

    Real: the Checkpointer, its persist thread, ``file://`` storage with renames. Recorded (not
    faked): every publish and remove, through a pass-through storage wrapper.
    The point: after 12 checkpoints exactly one committed directory (the newest) is left, and
    every checkpoint was deleted only after a newer one committed, manifest first (un-commit),
    then its directory.
    """
    st = Recording(open_storage(f"file://{tmp_path / 'ckpt'}"))
    model, opt, sched = mlp_state()
    ckpt = cfdist.Checkpointer({"model": model, "optim": opt, "sched": sched}, st, cfdist.Every(1), keep=1)
    train(model, opt, ckpt, 12, sched)
    ckpt.close()

    dirs = sorted(p.name for p in (tmp_path / "ckpt").iterdir() if p.name not in ("history.json", IDENTITY, "LATEST.json"))
    assert dirs == ["step-000000012"]
    committed: set[int] = set()
    removed = []
    for i, (what, rel) in enumerate(st.events):
        if what == "commit":
            committed.add(parse_step_dir(rel))
            continue
        step = parse_step_dir(rel.split("/")[0])
        assert committed and max(committed) > step, f"step {step} removed before a newer commit: {st.events[:i + 1]}"
        if rel.endswith(MANIFEST):
            removed.append(step)
        else:
            assert step in removed, f"{rel} removed while still committed (its manifest was not removed first)"
    assert sorted(removed) == list(range(1, 12))


class Positions(torch.utils.data.Dataset):
    def __len__(self) -> int:
        return 32

    def __getitem__(self, i):
        return torch.full((16,), float(i))


@pytest.mark.parametrize("keep_epoch_ends, left", [(True, [4, 8, 12, 13]), (1, [12, 13]), (2, [8, 12, 13]),
                                                   (False, [12, 13]), (0, [12, 13])])
def test_epoch_end_checkpoints_are_kept(memory_url, mlp_state, keep_epoch_ends, left):
    """The ``keep_epoch_ends`` most recent epoch-end checkpoints survive retention (True: all).

    Real: a ResumableLoader (4 batches per epoch, so epochs end at steps 4, 8, 12), the
    Checkpointer with ``Every(3, at_epoch_end=True)`` and ``keep=2``, ``memory://`` storage.
    Faked: nothing.
    The point: after 13 steps (checkpoints 3, 4, 6, 8, 9, 12 and a final save at 13), the two
    newest and the ``keep_epoch_ends`` most recent epoch ends are left, and their manifests say
    ``epoch_end``.
    """
    model, opt, sched = mlp_state()
    loader = ResumableLoader(Positions(), 8, seed=0, rank=0, world_size=1)
    ckpt = cfdist.Checkpointer({"model": model, "optim": opt, "sched": sched, "data": loader}, memory_url,
                               cfdist.Every(3, at_epoch_end=True), keep=2, keep_epoch_ends=keep_epoch_ends)
    while ckpt.step_count < 13:
        for x in loader:
            model(x).pow(2).mean().backward()
            ckpt.step(opt)
            sched.step()
            opt.zero_grad()
            if ckpt.step_count == 13:
                break
    ckpt.save(block=True)
    ckpt.close()
    found = cfdist.list_checkpoints(memory_url)
    assert [c["step"] for c in found] == left
    assert {c["step"]: c["epoch_end"] for c in found if c["epoch_end"]} == {s: True for s in left if s % 4 == 0}


def test_defaults_keep_two_and_no_epoch_ends(memory_url, mlp_state):
    """By default the two newest checkpoints are kept (restore can fall back one) and no epoch
    end beyond them. Real: the Checkpointer on ``memory://``. Faked: nothing."""
    model, opt, _ = mlp_state()
    ckpt = cfdist.Checkpointer({"model": model, "optim": opt}, memory_url, cfdist.Every(1))
    assert (ckpt.config.keep, ckpt.config.keep_epoch_ends) == (2, 0)
    for _ in range(4):
        model(torch.ones(2, 16)).sum().backward()
        ckpt.step(opt)
        opt.zero_grad()
    ckpt.close()
    assert [c["step"] for c in cfdist.list_checkpoints(memory_url)] == [3, 4]


@pytest.mark.parametrize("bad", [-1, 1.5, "all", None])
def test_keep_epoch_ends_must_be_a_count(memory_url, mlp_state, bad):
    """A wrong ``keep_epoch_ends`` fails at construction naming the value and what it means."""
    model, opt, _ = mlp_state()
    with pytest.raises(ValueError, match=rf"keep_epoch_ends must be an int >= 0 .*got {bad!r}"):
        cfdist.Checkpointer({"model": model, "optim": opt}, memory_url, cfdist.Every(1), keep_epoch_ends=bad)
