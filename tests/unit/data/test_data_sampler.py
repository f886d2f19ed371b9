"""ResumableSampler: rank-sharded like DistributedSampler, but resumable and elastic."""

from __future__ import annotations

import json

import pytest
import torch

from cfdist.data import IncompatibleDataState, ResumableLoader, ResumableSampler


def test_shards_cover_the_epoch_once_with_distributed_sampler_style_padding():
    samplers = [ResumableSampler(10, seed=4, rank=r, world_size=3) for r in range(3)]
    shards = [list(s) for s in samplers]
    assert [len(s) for s in samplers] == [4, 4, 4]
    assert [len(x) for x in shards] == [4, 4, 4]
    fresh = shards[0] + shards[1][:3] + shards[2][:3]  # the last step has 1 sample for 3 ranks
    assert sorted(fresh) == list(range(10))
    assert shards[1][3] == shards[2][3] == shards[0][3]  # ranks 1, 2 pad with the step's first
    assert all(s.at_epoch_end() and s.state_dict()["consumed"] == 10 for s in samplers)


def test_drop_last_drops_only_the_short_tail():
    shards = [list(ResumableSampler(10, rank=r, world_size=3, drop_last=True)) for r in range(3)]
    assert [len(x) for x in shards] == [3, 3, 3] and len(set(sum(shards, []))) == 9


def test_elastic_resume_and_agreement_with_the_loader():
    two = [ResumableSampler(17, seed=1, rank=r, world_size=2) for r in range(2)]
    its = [iter(s) for s in two]
    used = [next(it) for _ in range(3) for it in its]
    state = json.loads(json.dumps(two[0].state_dict()))
    assert state["consumed"] == 6 and two[1].state_dict() == state
    three = [ResumableSampler(17, seed=1, rank=r, world_size=3) for r in range(3)]
    for s in three:
        s.load_state_dict(state)
    rest = [list(s) for s in three]
    assert [len(x) for x in rest] == [4, 4, 4]  # 11 left: 3 full steps + 2 -> one padding
    fresh = rest[0] + rest[1] + rest[2][:3]
    assert sorted(used + fresh) == list(range(17))
    # full steps are assigned like a ResumableLoader's batches (strided within a global batch)
    loader = ResumableLoader(list(range(17)), 4, seed=1, rank=1, world_size=2)
    sampler = ResumableSampler(17, seed=1, rank=1, world_size=2)
    assert next(iter(loader)).tolist() == [x for x, _ in zip(sampler, range(4))]


def test_plain_dataloader_over_the_sampler_and_epochs():
    sampler = ResumableSampler(12, seed=3)
    loader = torch.utils.data.DataLoader(list(range(12)), batch_size=5, sampler=sampler)
    e0 = torch.cat(list(loader)).tolist()
    e1 = torch.cat(list(loader)).tolist()  # the next iteration starts epoch 1
    assert sorted(e0) == sorted(e1) == list(range(12)) and e0 != e1 and sampler.epoch == 1
    sampler.set_epoch(0)
    assert torch.cat(list(loader)).tolist() == e0


def test_a_new_iterator_or_load_ends_the_previous_one():
    s = ResumableSampler(8, shuffle=False)
    old = iter(s)
    assert [next(old), next(old)] == [0, 1]
    new = iter(s)  # continues where the position stands
    assert next(new) == 2
    assert list(old) == []  # stale: it must not advance the shared position any more
    assert list(new) == [3, 4, 5, 6, 7]


def test_changed_shuffle_mid_epoch_is_refused():
    s = ResumableSampler(8, shuffle=True)
    it = iter(s)
    next(it)
    with pytest.raises(IncompatibleDataState, match="shuffle"):
        ResumableSampler(8, shuffle=False).load_state_dict(s.state_dict())
