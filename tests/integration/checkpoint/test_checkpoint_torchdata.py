"""torchdata's ``StatefulDataLoader`` in a Checkpointer state, and positions converted to and from
``cfdist.ResumableLoader``.

Real: ``torchdata.stateful_dataloader.StatefulDataLoader`` with 0 and 2 worker processes (its own
``RandomSampler``, shuffle on), ``cfdist.Checkpointer`` on ``file://``, restore into fresh
objects. Faked: the crash is simulated in-process by abandoning the first attempt's objects after
its last checkpoint committed (as in ``test_checkpoint_data_sequence.py``; kill -9 at random
instants is covered by ``test_checkpoint_crash.py``). The point: the sample ids of every step
after the restore, and the final parameters, equal the uninterrupted run's; a position moved
between the two loaders keeps every epoch exactly-once.
"""

from __future__ import annotations

import pytest
import torch

import cfdist
from cfdist.data import IncompatibleDataState, data_state_of, load_data_state, stateful_loader

pytest.importorskip("torchdata.stateful_dataloader")
from torchdata.stateful_dataloader import StatefulDataLoader  # noqa: E402

N, BATCH, EPOCHS = 30, 4, 2
STEPS = EPOCHS * -(-N // BATCH)


class Ids(torch.utils.data.Dataset):
    def __len__(self):
        return N

    def __getitem__(self, i):
        return torch.tensor([float(i)])


def _run(url, num_workers, *, stop_after=None, record):
    torch.manual_seed(3)
    model = torch.nn.Linear(1, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    loader = StatefulDataLoader(Ids(), batch_size=BATCH, shuffle=True, num_workers=num_workers)
    ckpt = cfdist.Checkpointer({"model": model, "optim": opt, "data": loader}, url, cfdist.Every(3))
    ckpt.restore()
    while ckpt.step_count < STEPS:
        for x in loader:                       # after a restore: the rest of the epoch first
            model(x).sum().backward()
            ckpt.step(opt)
            opt.zero_grad()
            record[ckpt.step_count] = x.flatten().long().tolist()
            if ckpt.step_count == stop_after:
                ckpt.wait()                    # step 9 committed; steps 10, 11 are lost work
                return None
    ckpt.close()
    return {k: v.clone() for k, v in model.state_dict().items()}


@pytest.mark.parametrize("num_workers", [0, 2])
def test_stateful_dataloader_resumes_after_the_last_batch_of_the_checkpoint(tmp_path, num_workers):
    ref: dict = {}
    want = _run(f"file://{tmp_path}/ref", num_workers, record=ref)
    first: dict = {}
    _run(f"file://{tmp_path}/run", num_workers, stop_after=11, record=first)
    assert cfdist.list_checkpoints(f"file://{tmp_path}/run")[-1]["step"] == 9
    second: dict = {}
    got = _run(f"file://{tmp_path}/run", num_workers, record=second)
    assert min(second) == 10 and {s: second[s] for s in second} == {s: ref[s] for s in range(10, STEPS + 1)}
    assert all(torch.equal(got[k], want[k]) for k in want)
    epoch0 = sorted(i for s in range(1, STEPS // EPOCHS + 1) for i in ref[s])
    assert epoch0 == list(range(N))            # the reference itself is exactly-once


def _take(it, n):
    return [next(it).flatten().long().tolist() for _ in range(n)]


def _epoch_batches(loader):
    return [x.flatten().long().tolist() for x in loader]


def test_resumable_loader_position_continues_in_a_stateful_dataloader_and_back():
    ref_loader = cfdist.ResumableLoader(Ids(), BATCH, seed=5, rank=0, world_size=1)
    ref = _epoch_batches(ref_loader) + _epoch_batches(ref_loader)

    a = cfdist.ResumableLoader(Ids(), BATCH, seed=5, rank=0, world_size=1)
    got = _take(iter(a), 3)
    b = stateful_loader(Ids(), BATCH, seed=5, rank=0, world_size=1, num_workers=2)
    load_data_state(b, a.state_dict())
    it = iter(b)
    got += _take(it, 2)                        # the same batches, now from torchdata workers
    c = cfdist.ResumableLoader(Ids(), BATCH, seed=5, rank=0, world_size=1)
    c.load_state_dict(data_state_of(b.state_dict()))   # prefetched batches are not counted
    got += _epoch_batches(c)                   # the rest of epoch 0
    d = stateful_loader(Ids(), BATCH, seed=5, rank=0, world_size=1)
    load_data_state(d, c.state_dict())         # at the epoch's end: the next iter starts epoch 1
    got += _epoch_batches(d)
    assert got == ref


def test_converted_positions_keep_exactly_once_with_two_ranks():
    """Two ranks switch loaders mid-epoch: each rank's batches differ, the epoch's samples do not."""
    seen = []
    for rank in (0, 1):
        a = cfdist.ResumableLoader(Ids(), BATCH, seed=1, rank=rank, world_size=2)
        seen += sum(_take(iter(a), 2), [])
        b = stateful_loader(Ids(), BATCH, seed=1, rank=rank, world_size=2)
        load_data_state(b, a.state_dict())
        seen += sum(_epoch_batches(b), [])
    assert sorted(seen) == list(range(N))     # N = 30 is even: no padding sample


def test_conversion_refuses_other_orders_and_other_datasets():
    plain = StatefulDataLoader(Ids(), batch_size=BATCH, shuffle=True)
    next(iter(plain))
    with pytest.raises(ValueError, match="RandomSampler.*not cfdist's permutation"):
        data_state_of(plain.state_dict())
    with pytest.raises(TypeError, match="not a cfdist.ResumableSampler"):
        load_data_state(plain, cfdist.ResumableLoader(Ids(), BATCH).state_dict())
    small = torch.utils.data.TensorDataset(torch.arange(10.0))
    a = cfdist.ResumableLoader(Ids(), BATCH, rank=0, world_size=1)
    next(iter(a))
    with pytest.raises(IncompatibleDataState, match="10 samples but the checkpoint was taken with 30"):
        load_data_state(stateful_loader(small, BATCH, rank=0, world_size=1), a.state_dict())
