"""A restored run consumes the same sample sequence as the uninterrupted one, also with workers.

Real: ``cfdist.ResumableLoader`` with ``num_workers`` 0 and 2 (real DataLoader worker
processes), ``cfdist.Checkpointer`` on ``file://``, restore in fresh objects. Faked: the crash is
simulated in-process by abandoning the first attempt's loader (and its live worker processes)
and checkpointer mid-epoch without closing them, after its last checkpoint committed; kill -9
at random instants is covered by ``test_checkpoint_crash.py``.
The point: the sample ids of every step after the restore equal the uninterrupted run's, and
over the whole run every epoch uses each sample exactly once.
"""

from __future__ import annotations

import pytest
import torch

import cfdist

N, BATCH, EPOCHS = 50, 4, 2


class Ids(torch.utils.data.Dataset):
    def __len__(self):
        return N

    def __getitem__(self, i):
        return torch.tensor([float(i)])


def _run(url, num_workers, *, stop_after=None, record=None):
    """Train (a tiny model) over EPOCHS; record {step: sample ids}; stop after ``stop_after`` steps."""
    model = torch.nn.Linear(1, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    loader = cfdist.ResumableLoader(Ids(), BATCH, seed=7, num_workers=num_workers)
    ckpt = cfdist.Checkpointer({"model": model, "optim": opt, "data": loader}, url, cfdist.Every(3))
    ckpt.restore()
    for _ in range(loader.epoch + loader.at_epoch_end(), EPOCHS):
        for x in loader:
            model(x).sum().backward()
            ckpt.step(opt)
            opt.zero_grad()
            record[ckpt.step_count] = (loader.epoch, x.flatten().long().tolist())
            if stop_after is not None and ckpt.step_count == stop_after:
                ckpt.wait()          # the step-12 checkpoint is committed; then the "crash"
                return ckpt.step_count
    ckpt.close()
    return ckpt.step_count


@pytest.mark.parametrize("num_workers", [0, 2])
def test_restored_run_consumes_the_uninterrupted_sequence(tmp_path, num_workers):
    ref: dict = {}
    last = _run(f"file://{tmp_path}/ref", num_workers, record=ref)
    assert last == EPOCHS * -(-N // BATCH)

    first: dict = {}
    _run(f"file://{tmp_path}/run", num_workers, stop_after=14, record=first)   # committed: 12
    second: dict = {}
    _run(f"file://{tmp_path}/run", num_workers, record=second)
    assert min(second) == 13, "the restored run must start right after the committed step 12"

    merged = {**{s: v for s, v in first.items() if s <= 12}, **second}
    assert merged == ref
    for epoch in range(EPOCHS):
        ids = sorted(i for e, batch in merged.values() if e == epoch for i in batch)
        assert ids == list(range(N)), f"epoch {epoch} did not use every sample exactly once"
