"""One rank's position in its epochs and the plan for the rest of the current epoch.

Shared by the sampler, the PyTorch loader and the DALI iterator, which differ only in how
they turn planned index batches into data. No torch, no clocks, no I/O.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from cfdist.data.partition import epoch_permutation, rows_for_rank, step_sizes, step_starts
from cfdist.data.state import DataState, Layout, batches_per_epoch, resolve_world, resume_position


@dataclass(frozen=True, slots=True)
class Plan:
    """The rest of an epoch as seen from ``base`` consumed samples."""

    base: int
    """Samples consumed when the plan was made."""
    sizes: np.ndarray
    """Global samples per remaining step."""
    starts: np.ndarray
    """Offset in the permutation where each step starts."""
    rows: np.ndarray
    """This rank's ``(steps, batch_size)`` indices, ``-1``-filled (see :func:`partition`)."""


class EpochCursor:
    """Position ``(epoch, consumed, done)`` plus the plan it implies. Not thread-safe.

    ``advance()`` is called once per batch handed to the training loop, so the position
    counts yielded batches only, never prefetched ones.
    """

    @classmethod
    def for_rank(cls, *, num_samples: int, batch_size: int, seed: int, shuffle: bool, drop_last: bool,
                 rank: int | None, world_size: int | None, fingerprint: str | None) -> "EpochCursor":
        """A cursor for this process (``rank``/``world_size`` default from torch.distributed)."""
        rank, world_size = resolve_world(rank, world_size)
        return cls(Layout(num_samples=num_samples, batch_size=batch_size, seed=seed, shuffle=shuffle,
                          drop_last=drop_last, rank=rank, world_size=world_size, fingerprint=fingerprint))

    def __init__(self, layout: Layout):
        self.layout = layout
        self.epoch = 0
        self.consumed = 0
        self.done = False
        self.epoch_world_size = layout.world_size
        self._perm_key: tuple | None = None
        self._perm: np.ndarray | None = None
        self._plan: Plan | None = None
        self._k = 0  # steps taken since the plan's base

    # --- plan -------------------------------------------------------------------------
    def permutation(self) -> np.ndarray:
        lay = self.layout
        key = (lay.seed, self.epoch, lay.num_samples, lay.shuffle)
        if key != self._perm_key:
            self._perm = epoch_permutation(lay.seed, self.epoch, lay.num_samples, lay.shuffle)
            self._perm_key = key
        return self._perm

    @property
    def plan(self) -> Plan:
        """The plan from the position at which it was (re)made; made on first use."""
        if self._plan is None:
            lay = self.layout
            sizes = step_sizes(lay.num_samples - self.consumed, lay.world_size, lay.batch_size, lay.drop_last)
            rows = rows_for_rank(
                self.permutation(), self.consumed, sizes, lay.world_size, lay.rank, lay.batch_size
            )
            self._plan = Plan(self.consumed, sizes, step_starts(self.consumed, sizes), rows)
            self._k = 0
            if len(sizes) == 0:
                self.done = True  # e.g. drop_last after an elastic resume onto more ranks
        return self._plan

    @property
    def current_plan(self) -> Plan | None:
        """The plan if one is made (without making one)."""
        return self._plan

    def replan(self) -> None:
        """Forget the plan; the next use re-makes it from the current position (same batches)."""
        self._plan = None
        self._k = 0

    @property
    def step_in_plan(self) -> int:
        """Steps taken since the plan's base."""
        return self._k

    @property
    def steps_left(self) -> int:
        return 0 if self.done else len(self.plan.sizes) - self._k

    def batch(self, k: int) -> tuple[list[int], bool]:
        """``(indices, is_padding)`` of the plan's step ``k`` for this rank."""
        plan = self.plan
        row = plan.rows[k]
        idx = row[row >= 0]
        if len(idx):
            return idx.tolist(), False
        return [int(self.permutation()[plan.starts[k]])], True

    def advance(self) -> None:
        """Count the plan's next step as consumed (its batch was yielded to the training loop)."""
        plan = self.plan
        if self._k >= len(plan.sizes):
            raise RuntimeError(f"epoch {self.epoch} has no step left to advance past")
        self.consumed += int(plan.sizes[self._k])
        self._k += 1
        self.done = self._k == len(plan.sizes)

    # --- epochs -----------------------------------------------------------------------
    def start_epoch(self, epoch: int) -> None:
        if not isinstance(epoch, int) or isinstance(epoch, bool) or epoch < 0:
            raise ValueError(f"epoch must be an integer >= 0, got {epoch!r}")
        self.epoch, self.consumed, self.done = epoch, 0, False
        self.epoch_world_size = self.layout.world_size
        self.replan()

    def set_epoch(self, epoch: int) -> None:
        """Start ``epoch`` from its beginning, unless it is the epoch in progress (then keep the
        position, so calling ``set_epoch(epoch)`` after a restore does not rewind it)."""
        if epoch == self.epoch and not self.done:
            return
        self.start_epoch(epoch)

    def begin_iteration(self) -> None:
        """Called by ``__iter__``: after a finished epoch move on to the next one; plan afresh
        from the current position (the same batches as before, the rule being memoryless)."""
        if self.done:
            self.start_epoch(self.epoch + 1)
        self.replan()
        self.plan  # noqa: B018 - making the plan marks an empty epoch done

    @property
    def batches_per_epoch(self) -> int:
        return batches_per_epoch(self.layout)

    # --- state ------------------------------------------------------------------------
    def state(self) -> DataState:
        lay = self.layout
        return DataState(
            epoch=self.epoch,
            consumed=self.consumed,
            epoch_done=self.done,
            seed=lay.seed,
            shuffle=lay.shuffle,
            drop_last=lay.drop_last,
            batch_size=lay.batch_size,
            num_samples=lay.num_samples,
            fingerprint=lay.fingerprint,
            world_size=lay.world_size,
            epoch_world_size=self.epoch_world_size,
        )

    def load(self, saved: DataState, *, strict: bool = True) -> None:
        self.epoch, self.consumed, self.done = resume_position(saved, self.layout, strict=strict)
        self.epoch_world_size = saved.epoch_world_size
        self.replan()


class CursorPosition:
    """The read-only position API shared by the sampler, the loader and the DALI iterator.

    Subclasses keep their :class:`EpochCursor` in ``self._cursor``.
    """

    _cursor: EpochCursor
    _last_padding: bool = False

    @property
    def layout(self) -> Layout:
        return self._cursor.layout

    @property
    def epoch(self) -> int:
        """Epoch of the last batch yielded (or of the next one, before the first)."""
        return self._cursor.epoch

    @property
    def last_batch_is_padding(self) -> bool:
        """The last batch yielded re-uses a sample (fewer samples than ranks were left)."""
        return self._last_padding

    def at_epoch_end(self) -> bool:
        """True when the last batch yielded was the last of its epoch (same on every rank)."""
        return self._cursor.done

    def __len__(self) -> int:
        """Batches (sampler: indices) per epoch on this rank, the same on every rank."""
        return self._cursor.batches_per_epoch
