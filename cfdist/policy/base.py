"""The policy protocol: when to checkpoint, given what was measured.

The :class:`~cfdist.checkpoint.Checkpointer` calls, on every rank, once per training step:

1. ``policy.should_checkpoint(step, epoch_end=...)`` right after the optimizer step of ``step``
   (1-based count of optimizer steps). It must return the same answer on every rank for the same
   step: decide from the step count and from numbers every rank agrees on, never from a
   rank-local clock.
2. ``policy.observe(m)`` with a :class:`StepMeasurement` after that step (timings of this rank).

Policies do no I/O and no collectives. ``k`` (the current interval, or None) and ``mode``
(``"cpu"``/``"gpu"``/``"epoch"``) appear in ``Checkpointer.stats``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, runtime_checkable


@dataclass(kw_only=True, slots=True)
class StepMeasurement:
    """What one rank measured around one training step (seconds, bytes). Pure data."""

    step: int
    """Optimizer steps done so far (the step just finished)."""
    iter_s: float
    """Wall time from the previous ``ckpt.step()`` return to this one's (a whole iteration)."""
    stall_s: float = 0.0
    """Time this step waited at the gate for an unfinished snapshot copy."""
    update_s: float = 0.0
    """Time of ``optimizer.step()`` itself (Tw)."""
    snapshot_s: float | None = None
    """Duration of the snapshot copy started at this step, when known (Tc or Tg)."""
    snapshot_device: str | None = None
    """Where that snapshot went: ``"cpu"`` or ``"gpu"``."""
    persist_s: float | None = None
    """Duration of a persist that completed since the previous measurement (Ts)."""
    persist_bytes: int | None = None
    """Bytes written by that persist (m)."""
    checkpointed: bool = False
    """Whether a snapshot was taken at this step."""


@runtime_checkable
class Policy(Protocol):
    k: int | None
    mode: str

    def should_checkpoint(self, step: int, *, epoch_end: bool = False) -> bool: ...

    def observe(self, m: StepMeasurement) -> None: ...


@dataclass(kw_only=True, slots=True)
class Every:
    """Checkpoint every ``k`` optimizer steps (and at epoch ends if ``at_epoch_end``)."""

    k: int
    """Interval in optimizer steps; >= 1."""
    at_epoch_end: bool = False
    """Also checkpoint at the last step of each epoch."""
    mode: str = "cpu"

    def __init__(self, k: int, *, at_epoch_end: bool = False):
        if not isinstance(k, int) or isinstance(k, bool) or k < 1:
            raise ValueError(f"Every(k) needs an integer k >= 1, got {k!r}")
        self.k = k
        self.at_epoch_end = at_epoch_end
        self.mode = "cpu"

    def should_checkpoint(self, step: int, *, epoch_end: bool = False) -> bool:
        return step % self.k == 0 or (self.at_epoch_end and epoch_end)

    def observe(self, m: StepMeasurement) -> None:
        pass


@dataclass(kw_only=True, slots=True)
class EveryEpoch:
    """Checkpoint at the end of every epoch only (the common baseline)."""

    k: int | None = None
    mode: str = "epoch"

    def should_checkpoint(self, step: int, *, epoch_end: bool = False) -> bool:
        return epoch_end

    def observe(self, m: StepMeasurement) -> None:
        pass
