"""``ResumableSampler``: a per-sample, rank-sharded, resumable ``torch.utils.data.Sampler``."""

from __future__ import annotations

from collections.abc import Iterator

from torch.utils.data import Sampler

from cfdist.data.cursor import CursorPosition, EpochCursor
from cfdist.data.state import DataState


class ResumableSampler(CursorPosition, Sampler[int]):
    """Yields this rank's sample indices for the rest of the current epoch.

    Epoch ``e``'s order is ``epoch_permutation(seed, e)``; at each step every rank takes one
    sample (rank ``r`` the ``r``-th of the step's ``world_size``), so the samples handed out so
    far are always a prefix of the permutation and resuming with another world size is exact.
    With ``drop_last=False`` and ``num_samples % world_size != 0`` the last step has fewer
    samples than ranks: the ranks left over re-use that step's first sample (padding, as
    ``DistributedSampler`` does); padding is not counted as consumed. Every rank yields the same
    number of indices per epoch (``len(sampler)``).

    Position counting: an index counts as consumed once this sampler's iterator has handed it
    out. Under a ``DataLoader`` with prefetching that runs ahead of training; for checkpoints
    that count only batches the training loop received, use :class:`ResumableLoader`.

    ``iter(sampler)`` continues the current epoch where it stands, or starts the next one when
    the current one is finished. Not thread-safe; one live iterator at a time (starting a new
    one, or loading a state, ends the previous one).
    """

    def __init__(
        self,
        num_samples: int,
        *,
        seed: int = 0,
        shuffle: bool = True,
        rank: int | None = None,
        world_size: int | None = None,
        drop_last: bool = False,
        fingerprint: str | None = None,
    ):
        self._cursor = EpochCursor.for_rank(
            num_samples=num_samples, batch_size=1, seed=seed, shuffle=shuffle,
            drop_last=drop_last, rank=rank, world_size=world_size, fingerprint=fingerprint,
        )
        self._generation = 0

    def set_epoch(self, epoch: int) -> None:
        """Start ``epoch`` from its beginning; a no-op for the epoch in progress (safe after a restore)."""
        self._generation += 1
        self._cursor.set_epoch(epoch)

    def __iter__(self) -> Iterator[int]:
        self._generation += 1
        self._cursor.begin_iteration()
        return self._indices(self._generation)

    def _indices(self, generation: int) -> Iterator[int]:
        cur = self._cursor
        while generation == self._generation and cur.steps_left:
            (index,), _padding = cur.batch(cur.step_in_plan)
            cur.advance()  # before the yield: a state taken after receiving it counts it
            yield index

    def state_dict(self) -> dict:
        """The position as JSON-able plain values (see :class:`~cfdist.data.state.DataState`)."""
        return self._cursor.state().to_dict()

    def load_state_dict(self, state: dict, *, strict: bool = True) -> None:
        """Continue from ``state``; ``strict=False`` accepts a state that breaks exactly-once."""
        self._generation += 1
        self._cursor.load(DataState.from_dict(state), strict=strict)
