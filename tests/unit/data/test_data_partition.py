"""The pure partition: step sizes (table), permutations (pinned), exactly-once (property)."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from cfdist.data.partition import (
    epoch_permutation,
    partition,
    rows_for_rank,
    step_sizes,
    step_starts,
)


@pytest.mark.parametrize(
    "remaining, world, batch, drop_last, want",
    [
        (12, 2, 3, False, [6, 6]),  # exact
        (13, 2, 3, False, [6, 4, 3]),  # tail 1 < 2 ranks: last full step + tail split 4 + 3
        (14, 2, 3, False, [6, 6, 2]),  # tail 2 >= W: one short step
        (14, 2, 3, True, [6, 6]),  # tail dropped
        (5, 2, 3, False, [5]),  # one short step
        (5, 2, 3, True, []),  # nothing but a tail
        (2, 3, 4, False, [2]),  # fewer samples than ranks: unavoidable padding step
        (7, 3, 1, False, [3, 3, 1]),  # batch 1 cannot rebalance
        (0, 2, 3, False, []),
        (25, 4, 3, False, [12, 7, 6]),  # 12 + 1 split evenly over two steps
    ],
)
def test_step_sizes_table(remaining, world, batch, drop_last, want):
    assert step_sizes(remaining, world, batch, drop_last).tolist() == want


def test_epoch_permutation_is_pinned_and_seeded_by_seed_and_epoch():
    # Pinned: a change here silently breaks resuming checkpoints written by older versions.
    assert epoch_permutation(7, 3, 10).tolist() == PINNED_7_3_10
    assert epoch_permutation(7, 4, 10).tolist() != PINNED_7_3_10
    assert epoch_permutation(8, 3, 10).tolist() != PINNED_7_3_10
    assert epoch_permutation(7, 3, 10, shuffle=False).tolist() == list(range(10))


PINNED_7_3_10 = [3, 5, 4, 7, 8, 0, 9, 2, 1, 6]


def test_partition_shape_and_fill():
    rows = partition(1, 0, 10, 0, 3, 2, 2)  # 3 ranks x 2: steps of 6 then 4
    assert rows.shape == (2, 2)
    assert rows.dtype == np.int64
    assert (rows[1] == -1).sum() == 1  # last step of 4 over 3 ranks: rank 2 gets one sample
    perm = epoch_permutation(1, 0, 10)
    assert rows[0].tolist() == [perm[2], perm[5]]  # strided within a step


@st.composite
def scenarios(draw):
    n = draw(st.integers(1, 200))
    batch = draw(st.integers(1, 6))
    drop_last = draw(st.booleans())
    segments = draw(
        st.lists(st.tuples(st.integers(1, 5), st.integers(0, 12)), min_size=1, max_size=4)
    )  # (world size, steps run before the next interruption)
    final_world = draw(st.integers(1, 5))
    return n, batch, drop_last, segments, final_world


def _run_step(perm, consumed, world, batch, drop_last):
    sizes = step_sizes(len(perm) - consumed, world, batch, drop_last)
    rows = [rows_for_rank(perm, consumed, sizes, world, r, batch) for r in range(world)]
    return sizes, rows


@settings(max_examples=150, deadline=None)
@given(scenarios(), st.integers(0, 3), st.integers(0, 50))
def test_exactly_once_across_elastic_interruptions(scenario, epoch, seed):
    n, batch, drop_last, segments, final_world = scenario
    perm = epoch_permutation(seed, epoch, n)
    consumed, used = 0, []
    for world, steps in [*segments, (final_world, 10**9)]:
        sizes, rows = _run_step(perm, consumed, world, batch, drop_last)
        assert {len(r) for r in rows} == {len(sizes)}  # same number of steps on every rank
        for k in range(min(steps, len(sizes))):
            got = [r[k][r[k] >= 0] for r in rows]
            counts = [len(g) for g in got]
            assert max(counts) <= batch and max(counts) - min(counts) <= 1
            if min(counts) == 0:  # padding only where unavoidable
                remaining = n - consumed
                assert remaining < world or batch == 1
            step = np.concatenate(got)
            assert sorted(step.tolist()) == sorted(perm[consumed : consumed + sizes[k]].tolist())
            used.extend(step.tolist())
            consumed += int(sizes[k])
    assert len(used) == len(set(used))  # never twice
    assert sorted(used) == sorted(perm[: len(used)].tolist())  # always a prefix
    if drop_last:
        assert n - len(used) < batch * final_world  # only a short tail is dropped
    else:
        assert sorted(used) == list(range(n))  # all of them


@settings(max_examples=100, deadline=None)
@given(st.integers(1, 300), st.integers(1, 5), st.integers(1, 8), st.booleans(), st.data())
def test_plan_is_memoryless(n, world, batch, drop_last, data):
    """Continuing a plan after k steps equals planning afresh from there (resume = no replay)."""
    sizes = step_sizes(n, world, batch, drop_last)
    k = data.draw(st.integers(0, len(sizes)))
    consumed = int(sizes[:k].sum())
    assert step_sizes(n - consumed, world, batch, drop_last).tolist() == sizes[k:].tolist()
    assert step_starts(consumed, sizes[k:]).tolist() == step_starts(0, sizes)[k:].tolist()
    rank = data.draw(st.integers(0, world - 1))
    full = partition(3, 1, n, 0, world, rank, batch, drop_last=drop_last)
    rest = partition(3, 1, n, consumed, world, rank, batch, drop_last=drop_last)
    assert np.array_equal(full[k:], rest)
