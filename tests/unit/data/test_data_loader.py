"""ResumableLoader: exactly-once under random interruptions and world sizes, and the contract
with the checkpoint engine (position counts yielded batches, hooks, epochs, RNG untouched)."""

from __future__ import annotations

import json

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from cfdist.data import IncompatibleDataState, ResumableLoader


class Indexed(torch.utils.data.Dataset):
    """Sample i is the integer i; remembers which samples were read (num_workers=0 only)."""

    def __init__(self, n: int):
        self.n, self.reads = n, []

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> int:
        self.reads.append(i)
        return i


def world(n, batch, w, *, state=None, **kw):
    loaders = [ResumableLoader(Indexed(n), batch, rank=r, world_size=w, **kw) for r in range(w)]
    if state is not None:
        for ld in loaders:
            ld.load_state_dict(json.loads(json.dumps(state)))
    return loaders


def lockstep(loaders, steps):
    """Run every rank for up to ``steps`` batches (DDP-style); returns fresh (non-padding) indices."""
    its = [iter(ld) for ld in loaders]
    fresh = []
    for _ in range(steps):
        batches = []
        for it in its:
            try:
                batches.append(next(it))
            except StopIteration:
                batches.append(None)
        if all(b is None for b in batches):
            break
        assert None not in batches, "ranks disagree on the number of steps"
        for ld, b in zip(loaders, batches):
            if not ld.last_batch_is_padding:
                fresh.extend(b.tolist())
        ends = {ld.at_epoch_end() for ld in loaders}
        assert len(ends) == 1, "ranks disagree on the epoch end"
    states = [ld.state_dict() for ld in loaders]
    assert all(s == states[0] for s in states), "ranks disagree on the position"
    return fresh, states[0]


@settings(max_examples=60, deadline=None)
@given(
    n=st.integers(1, 60),
    batch=st.integers(1, 5),
    drop_last=st.booleans(),
    segments=st.lists(st.tuples(st.integers(1, 4), st.integers(0, 8)), min_size=1, max_size=3),
    final_world=st.integers(1, 4),
    seed=st.integers(0, 2**32),
)
def test_each_epoch_is_consumed_exactly_once_across_elastic_restarts(
    n, batch, drop_last, segments, final_world, seed
):
    state, used = None, []
    for w, steps in segments:
        loaders = world(n, batch, w, state=state, seed=seed, drop_last=drop_last)
        assert len({len(ld) for ld in loaders}) == 1
        got, state = lockstep(loaders, steps)
        used += got
        if state["epoch_done"]:
            break
    if not state["epoch_done"]:
        got, state = lockstep(world(n, batch, final_world, state=state, seed=seed, drop_last=drop_last), 10**6)
        used += got
        w = final_world
    assert state["epoch"] == 0 and state["epoch_done"]
    assert len(used) == len(set(used)) == state["consumed"]
    if drop_last:
        assert set(used) <= set(range(n)) and n - len(used) < batch * w
    else:
        assert sorted(used) == list(range(n))


def until_epoch(loader, epochs):
    """(epoch, batch) from wherever the loader stands to the end of epoch ``epochs - 1``."""
    out = []
    while not (loader.epoch == epochs - 1 and loader.at_epoch_end()):
        out += [(loader.epoch, b.tolist()) for b in loader]
    return out


def take(loader, k):
    """The next ``k`` (epoch, batch), crossing epochs as a training loop would."""
    out, it = [], iter(loader)
    while len(out) < k:
        try:
            out.append((None, next(it).tolist()))
        except StopIteration:
            it = iter(loader)
            continue
        out[-1] = (loader.epoch, out[-1][1])
    return out


@pytest.mark.parametrize("cut", [1, 5, 6, 7, 17])
def test_resume_equals_uninterrupted_across_epochs(cut):
    ref = until_epoch(ResumableLoader(Indexed(23), 4, seed=5), 3)
    assert [e for e, _ in ref] == [0] * 6 + [1] * 6 + [2] * 6
    for k in range(3):
        assert sorted(sum((b for e, b in ref if e == k), [])) == list(range(23))
    assert ref[0][1] != ref[6][1]  # a new permutation each epoch
    first = ResumableLoader(Indexed(23), 4, seed=5)
    got = take(first, cut)
    second = ResumableLoader(Indexed(23), 4, seed=5)
    second.load_state_dict(json.loads(json.dumps(first.state_dict())))
    assert second.at_epoch_end() == (cut % 6 == 0)
    assert got + until_epoch(second, 3) == ref


def test_state_counts_yielded_batches_not_prefetched_ones_with_workers():
    ref = [b.tolist() for b in ResumableLoader(Indexed(40), 3, seed=2)]
    loader = ResumableLoader(Indexed(40), 3, seed=2, num_workers=2, prefetch_factor=4)
    it = iter(loader)
    got = [next(it).tolist() for _ in range(5)]
    state = loader.state_dict()
    assert state["consumed"] == 15  # workers have prefetched far more by now
    del it, loader
    resumed = ResumableLoader(Indexed(40), 3, seed=2, num_workers=2)
    resumed.load_state_dict(state)
    got += [b.tolist() for b in resumed]
    assert got == ref


@pytest.mark.parametrize("num_workers", [0, 2])
def test_iterating_never_draws_from_the_global_torch_rng(num_workers):
    torch.manual_seed(123)
    before = torch.get_rng_state()
    loader = ResumableLoader(Indexed(10), 3, num_workers=num_workers)
    for _ in range(2):
        list(loader)
    assert torch.equal(torch.get_rng_state(), before)


def test_resume_reads_only_the_remaining_samples():
    first = ResumableLoader(Indexed(50), 4, seed=9)
    it = iter(first)
    seen = sum((next(it).tolist() for _ in range(7)), [])
    ds = Indexed(50)
    second = ResumableLoader(ds, 4, seed=9)
    second.load_state_dict(first.state_dict())
    rest = sum((b.tolist() for b in second), [])
    assert sorted(ds.reads) == sorted(rest) == sorted(set(range(50)) - set(seen))


def test_before_next_hooks_run_first_and_can_be_removed():
    loader = ResumableLoader(Indexed(6), 2, shuffle=False)
    seen = []
    handle = loader.register_before_next_hook(lambda: seen.append(loader.state_dict()["consumed"]))
    list(loader)
    assert seen == [0, 2, 4, 6]  # incl. the __next__ that ends the epoch
    handle.remove()
    list(loader)
    assert seen == [0, 2, 4, 6]

    def boom():
        raise RuntimeError("hook failed")

    loader.register_before_next_hook(boom)
    it = iter(loader)
    before = loader.state_dict()
    with pytest.raises(RuntimeError, match="hook failed"):
        next(it)
    assert loader.state_dict() == before


def test_epochs_advance_on_iter_and_set_epoch_keeps_a_restored_position():
    loader = ResumableLoader(Indexed(8), 3, seed=1)
    assert len(loader) == 3 and loader.epoch == 0 and not loader.at_epoch_end()
    assert len(list(loader)) == 3 and loader.at_epoch_end() and loader.epoch == 0
    assert len(list(loader)) == 3 and loader.epoch == 1
    it = iter(loader)
    next(it)
    state = loader.state_dict()
    assert state["epoch"] == 2 and state["consumed"] == 3 and not state["epoch_done"]
    restored = ResumableLoader(Indexed(8), 3, seed=1)
    restored.load_state_dict(state)
    restored.set_epoch(2)  # the DistributedSampler habit must not rewind a restored epoch
    assert sum(len(b) for b in restored) == 5
    restored.set_epoch(7)
    assert restored.epoch == 7 and sum(len(b) for b in restored) == 8


def test_padding_when_fewer_samples_than_ranks():
    loaders = world(2, 4, 3, shuffle=False)
    batches = [list(ld) for ld in loaders]
    assert [len(b) for b in batches] == [1, 1, 1]  # one step each, DDP-safe
    assert [ld.last_batch_is_padding for ld in loaders] == [False, False, True]
    assert [b[0].tolist() for b in batches] == [[0], [1], [0]]  # rank 2 re-uses the step's first
    assert loaders[2].state_dict()["consumed"] == 2


def test_mismatched_checkpoints_are_refused_unless_strict_is_false():
    first = ResumableLoader(Indexed(30), 4, seed=1, fingerprint="v1")
    it = iter(first)
    next(it)
    state = first.state_dict()
    with pytest.raises(IncompatibleDataState, match="31 samples.*30"):
        ResumableLoader(Indexed(31), 4, seed=1).load_state_dict(state)
    with pytest.raises(IncompatibleDataState, match="'v2'.*'v1'"):
        ResumableLoader(Indexed(30), 4, seed=1, fingerprint="v2").load_state_dict(state)
    other_seed = ResumableLoader(Indexed(30), 4, seed=2)
    with pytest.raises(IncompatibleDataState, match="seed=2 but .* seed=1 mid-epoch"):
        other_seed.load_state_dict(state)
    other_seed.load_state_dict(state, strict=False)
    assert sum(len(b) for b in other_seed) == 26


def test_loader_refuses_arguments_that_would_break_its_order():
    with pytest.raises(TypeError, match="sampler"):
        ResumableLoader(Indexed(5), 2, sampler=range(5))
    with pytest.raises(TypeError, match="generator"):
        ResumableLoader(Indexed(5), 2, generator=torch.Generator())

    class Stream(torch.utils.data.IterableDataset):
        def __iter__(self):
            return iter(range(5))

    with pytest.raises(TypeError, match="map-style"):
        ResumableLoader(Stream(), 2)


def test_reiterating_mid_epoch_continues_with_persistent_workers():
    plain = ResumableLoader(Indexed(30), 4, seed=1)
    ref = [b.tolist() for _ in range(3) for b in plain]
    loader = ResumableLoader(Indexed(30), 4, seed=1, num_workers=2, persistent_workers=True)
    it = iter(loader)
    got = [next(it).tolist(), next(it).tolist()]  # then abandon this iterator mid-epoch
    for _ in range(3):
        got += [b.tolist() for b in loader]  # continues epoch 0, then epochs 1 and 2
    assert got == ref
