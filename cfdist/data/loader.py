"""``ResumableLoader``: a ``DataLoader`` whose position counts batches the training loop received."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch
from torch.utils.data import DataLoader, IterableDataset

from cfdist.data.cursor import CursorPosition, EpochCursor
from cfdist.data.hooks import BeforeNextHooks
from cfdist.data.partition import derive_seed
from cfdist.data.state import DataState

_WORKER_SEED_TAG = 0x5EED  # keeps the worker base seed apart from other seeds derived from `seed`
_OWNED_KWARGS = ("sampler", "batch_sampler", "shuffle", "generator", "batch_size")


class _PlannedBatches:
    """The ``batch_sampler`` of the wrapped DataLoader: the plan's remaining batches, frozen
    when its iterator is created (workers prefetch from it; the cursor moves only on yield)."""

    def __init__(self, cursor: EpochCursor):
        self._cursor = cursor

    def __iter__(self) -> Iterator[list[int]]:
        cur = self._cursor
        return self._batches(cur.plan, cur.step_in_plan)  # captured now, not at first next()

    def _batches(self, plan, first: int) -> Iterator[list[int]]:
        cur = self._cursor
        for k in range(first, len(plan.sizes)):
            if cur.current_plan is not plan:  # replanned (load_state_dict, set_epoch): stale
                return
            yield cur.batch(k)[0]

    def __len__(self) -> int:
        return self._cursor.steps_left


class ResumableLoader(CursorPosition, BeforeNextHooks):
    """Batches of ``dataset`` for this rank, resumable at any batch, exactly once per epoch.

    Call from the training process, one thread. Typical loop::

        loader = ResumableLoader(ds, 32, seed=1)            # rank/world from torch.distributed
        loader.load_state_dict(manifest["data"])            # optional: resume mid-epoch
        start = loader.epoch + loader.at_epoch_end()        # a finished epoch is not redone
        for epoch in range(start, epochs):
            for batch in loader:                            # each __iter__ after a finished
                ...                                         # epoch starts the next one

    Position: a batch counts as consumed when ``__next__`` returns it; ``state_dict()`` taken
    after that batch's optimizer step resumes at the next batch. Prefetching by ``num_workers``
    workers never counts. Resuming builds only the remaining plan (no replay of skipped samples).

    Every rank takes the same number of batches per epoch (``len(loader)``). When fewer samples
    than ranks are left for a step (see :mod:`cfdist.data.partition`), the ranks without a fresh
    sample get a one-sample padding batch re-using that step's first sample and
    :attr:`last_batch_is_padding` is True for it: give its loss zero weight to keep exactly-once.

    ``dataloader_kwargs`` go to ``torch.utils.data.DataLoader`` (``collate_fn``,
    ``pin_memory``, ``persistent_workers``, ``prefetch_factor``, ``worker_init_fn``, ...);
    the loader owns ``sampler``/``batch_sampler``/``shuffle``/``generator``. Worker seeds come
    from a generator seeded with ``(seed, epoch, rank)``, so iterating never draws from the
    global torch RNG.
    """

    def __init__(
        self,
        dataset: Any,
        batch_size: int,
        *,
        seed: int = 0,
        shuffle: bool = True,
        rank: int | None = None,
        world_size: int | None = None,
        num_workers: int = 0,
        drop_last: bool = False,
        fingerprint: str | None = None,
        **dataloader_kwargs: Any,
    ):
        super().__init__()
        owned = sorted(set(_OWNED_KWARGS) & set(dataloader_kwargs))
        if owned:
            raise TypeError(
                f"ResumableLoader decides {owned} itself (its order must be a function of seed and "
                "epoch to resume exactly); use batch_size/seed/shuffle/drop_last instead"
            )
        if isinstance(dataset, IterableDataset) or not hasattr(dataset, "__len__"):
            raise TypeError(
                f"ResumableLoader needs a map-style dataset (__getitem__ and __len__), got "
                f"{type(dataset).__name__}: resuming by index is what makes it exactly-once"
            )
        self.dataset = dataset
        self._cursor = EpochCursor.for_rank(
            num_samples=len(dataset), batch_size=batch_size, seed=seed, shuffle=shuffle,
            drop_last=drop_last, rank=rank, world_size=world_size, fingerprint=fingerprint,
        )
        self._generator = torch.Generator()
        self._loader = DataLoader(
            dataset,
            batch_sampler=_PlannedBatches(self._cursor),
            num_workers=num_workers,
            generator=self._generator,
            **dataloader_kwargs,
        )
        self._it: Iterator | None = None
        self._last_padding = False

    # --- iteration --------------------------------------------------------------------
    def __iter__(self) -> ResumableLoader:
        """Continue the current epoch, or start the next one if the current one is finished."""
        self._close()
        self._cursor.begin_iteration()
        self._open()
        return self

    def __next__(self) -> Any:
        self._run_before_next()
        cur = self._cursor
        if self._it is None and not cur.done:
            self._open()  # next() without iter(): continue where the position stands
        if cur.steps_left == 0:
            self._close()
            raise StopIteration
        batch = next(self._it)
        _, self._last_padding = cur.batch(cur.step_in_plan)
        cur.advance()
        return batch

    def _open(self) -> None:
        cur = self._cursor
        if cur.steps_left:
            self._generator.manual_seed(
                derive_seed(cur.layout.seed, cur.epoch, cur.layout.rank, _WORKER_SEED_TAG)
            )
            self._it = iter(self._loader)

    def _close(self) -> None:
        self._it = None  # non-persistent workers shut down with their iterator

    # --- position ---------------------------------------------------------------------
    def set_epoch(self, epoch: int) -> None:
        """Start ``epoch`` from its beginning; a no-op for the epoch in progress (safe after a restore)."""
        if epoch == self._cursor.epoch and not self._cursor.done:
            return
        self._close()
        self._cursor.set_epoch(epoch)

    def state_dict(self) -> dict:
        """The position as JSON-able plain values; call between steps (after the optimizer step
        of the last batch yielded, before the next ``__next__``). Cheap: no I/O, no collective."""
        return self._cursor.state().to_dict()

    def load_state_dict(self, state: dict, *, strict: bool = True) -> None:
        """Resume from ``state`` (possibly saved with another world size or batch size): the next
        ``__iter__``/``__next__`` yields the first batch not yet consumed.

        Raises :class:`~cfdist.data.state.IncompatibleDataState` when exactly-once cannot hold
        (other dataset length or fingerprint; seed or shuffle changed mid-epoch);
        ``strict=False`` resumes anyway from the same position, with a warning.
        """
        self._close()
        self._cursor.load(DataState.from_dict(state), strict=strict)
        self._last_padding = False
