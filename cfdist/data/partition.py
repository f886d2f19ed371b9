"""Which samples each rank reads at each step: pure numpy, no torch, no clocks, no I/O.

The whole data position is ``(seed, epoch, consumed)``: ``consumed`` counts the samples of the
epoch's permutation already used by training steps, summed over all ranks. Steps always take a
*prefix* of what remains, so the first ``consumed`` samples of ``epoch_permutation(seed, epoch)``
are exactly the samples used so far, whatever world size(s) used them. Resuming with another
world size therefore only re-partitions ``perm[consumed:]``: every sample stays exactly once
per epoch (with ``drop_last``, exactly the non-dropped ones, each once).

Step sizes (global samples per step) for ``remaining`` samples, ``W`` ranks, per-rank batch ``B``:

* full steps of ``B*W`` while they fit;
* ``drop_last=True``: the tail shorter than ``B*W`` is dropped;
* ``drop_last=False``: the tail ``r`` (``0 < r < B*W``) becomes one last, smaller step. If that
  step would leave a rank without a sample (``r < W``) and ``B >= 2``, the last full step and
  the tail are split evenly into two steps instead, each giving every rank at least one sample;
* a step smaller than ``W`` remains only where nothing else is possible: fewer than ``W``
  samples left in the epoch (``num_samples < W``, or an elastic resume onto more ranks near the
  end of an epoch), or ``B == 1`` with a tail of ``r < W``. Ranks ``r >= size`` then get no fresh
  sample in that step: the partition marks their row empty (all ``-1``) and the loaders hand them
  a *padding batch* of one sample re-used from the same step (its first sample), flagged
  so the training loop can give it zero weight. Padding is never counted as consumed.

The rule depends only on ``remaining`` (memoryless), so the plan continued after ``k`` steps is
the plan recomputed from the position after ``k`` steps; and every rank of a world gets the same
number of steps per epoch, as DDP needs.

Within a step of ``g`` samples starting at ``start``, rank ``r`` gets ``perm[start + r :: W]``
(strided), so per-rank sizes differ by at most one and, for full steps, the assignment equals a
per-sample sharding (``B=1``) — a :class:`~cfdist.data.ResumableSampler` and a
:class:`~cfdist.data.ResumableLoader` agree on who reads what.
"""

from __future__ import annotations

import numpy as np

__all__ = [
    "epoch_permutation",
    "step_sizes",
    "step_starts",
    "partition",
    "rows_for_rank",
    "derive_seed",
]


def derive_seed(*parts: int) -> int:
    """A 63-bit seed mixed from non-negative integers (stable across numpy versions/platforms)."""
    return int(np.random.SeedSequence([int(p) for p in parts]).generate_state(1, np.uint64)[0] >> 1)


def epoch_permutation(seed: int, epoch: int, num_samples: int, shuffle: bool = True) -> np.ndarray:
    """The order of epoch ``epoch``: a pure function of ``(seed, epoch)`` (int64, length ``num_samples``).

    ``seed`` and ``epoch`` are mixed by :class:`numpy.random.SeedSequence`, so epochs of nearby
    seeds are unrelated; the generator is ``PCG64``.
    """
    if not shuffle:
        return np.arange(num_samples, dtype=np.int64)
    rng = np.random.Generator(np.random.PCG64(np.random.SeedSequence([int(seed), int(epoch)])))
    return rng.permutation(num_samples).astype(np.int64, copy=False)


def step_sizes(remaining: int, world_size: int, batch_size: int, drop_last: bool) -> np.ndarray:
    """Global samples per step for the rest of an epoch with ``remaining`` samples left (int64).

    See the module docstring for the rule. ``len(result)`` is the number of steps every rank
    still takes in this epoch; ``result.sum()`` is ``remaining`` (less the dropped tail).
    """
    full = batch_size * world_size
    q, r = divmod(int(remaining), full)
    if drop_last or r == 0:
        return np.full(q, full, dtype=np.int64)
    if q == 0 or r >= world_size or batch_size == 1:
        return np.concatenate([np.full(q, full, dtype=np.int64), [r]]).astype(np.int64)
    both = full + r  # last full step + short tail, split evenly: each half >= world_size as B >= 2
    return np.concatenate(
        [np.full(q - 1, full, dtype=np.int64), [(both + 1) // 2, both // 2]]
    ).astype(np.int64)


def step_starts(consumed: int, sizes: np.ndarray) -> np.ndarray:
    """Offset in the epoch's permutation at which each step starts (int64, like ``sizes``)."""
    starts = np.empty(len(sizes), dtype=np.int64)
    if len(sizes):
        starts[0] = consumed
        np.cumsum(sizes[:-1], out=starts[1:])
        starts[1:] += consumed
    return starts


def partition(
    seed: int,
    epoch: int,
    num_samples: int,
    consumed: int,
    world_size: int,
    rank: int,
    batch_size: int,
    *,
    shuffle: bool = True,
    drop_last: bool = False,
) -> np.ndarray:
    """Sample indices rank ``rank`` reads in the rest of the epoch: shape ``(steps, batch_size)``.

    Row ``k`` is the batch of the ``k``-th remaining step; slots past the end of a short batch
    are ``-1``. A row of only ``-1`` is a step in which this rank gets no fresh sample (fewer
    samples than ranks left; the loaders substitute a padding batch). ``steps`` is the same on
    every rank. Pure: the same arguments give the same array on any machine.
    """
    perm = epoch_permutation(seed, epoch, num_samples, shuffle)
    sizes = step_sizes(num_samples - consumed, world_size, batch_size, drop_last)
    return rows_for_rank(perm, consumed, sizes, world_size, rank, batch_size)


def rows_for_rank(
    perm: np.ndarray,
    consumed: int,
    sizes: np.ndarray,
    world_size: int,
    rank: int,
    batch_size: int,
) -> np.ndarray:
    """:func:`partition` given an already computed permutation and step sizes."""
    starts = step_starts(consumed, sizes)
    offsets = rank + world_size * np.arange(batch_size, dtype=np.int64)  # strided within a step
    valid = offsets[None, :] < sizes[:, None]
    pos = np.minimum(starts[:, None] + offsets[None, :], max(len(perm) - 1, 0))
    if len(perm) == 0:
        return np.full((len(sizes), batch_size), -1, dtype=np.int64)
    return np.where(valid, perm[pos], np.int64(-1))

