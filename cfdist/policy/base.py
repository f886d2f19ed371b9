"""The policy protocol: when to checkpoint, given what was measured.

The :class:`~cfdist.checkpoint.Checkpointer` calls, on every rank, once per training step:

1. ``policy.should_checkpoint(step, epoch_end=...)`` right after the optimizer step of ``step``
   (1-based count of optimizer steps). It must return the same answer on every rank for the same
   step: decide from the step count and from numbers every rank agrees on, never from a
   rank-local clock.
2. ``policy.observe(m)`` with a :class:`StepMeasurement` after that step (timings of this rank).

Policies do no I/O and no collectives. ``k`` (the current interval, or None) and ``mode``
(``"cpu"``/``"gpu"``/``"epoch"``) appear in ``Checkpointer.stats``.

Optional hooks, called by the checkpointer when a policy has them (``cfdist.Auto`` does):

* ``bind(ctx: PolicyContext)`` once, at the checkpointer's construction, before any step;
* ``profile_to_save() -> dict | None``: a JSON-able profile to write (atomically) to storage as
  ``profile-{profile_key(ctx)}.json``; None when there is nothing new. Safe to call every step;
* ``stats() -> dict``: merged into ``Checkpointer.stats``;
* ``proposal() -> int`` and ``agreed(k, step)``: a policy whose interval comes from rank-local
  measurements proposes ``k`` (0: none yet); the checkpointer publishes rank 0's proposal and
  calls ``agreed(k, step)`` on every rank with the value in force from ``should_checkpoint(step)``
  on, at the same step everywhere (:mod:`cfdist.checkpoint.agreement`: at once in one process,
  a few steps later through the c10d Store on several ranks). The policy never talks to the
  store itself.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
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
    persist_step: int | None = None
    """Step whose checkpoint that persist committed, when known."""
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


@dataclass(frozen=True, kw_only=True, slots=True)
class PolicyContext:
    """What the checkpointer knows about the job when it binds a policy. Pure data.

    Every rank of a job builds it from the same arguments, except ``rank`` and whatever its
    storage holds (``cached_profile``, ``failure_times_s``).
    """

    rank: int = 0
    """This process's rank in the job."""
    world_size: int = 1
    """Ranks in the job."""
    state_bytes: int = 0
    """Bytes of tensor state one checkpoint holds (model + optimizer ...)."""
    device: str = "cpu"
    """Where the model lives: ``"cpu"`` or ``"cuda"`` (``cuda*`` means GPU snapshots exist)."""
    batch_size: int | None = None
    """Per-rank batch size when the data loader tells it."""
    iters_per_epoch: int | None = None
    """Optimizer steps per epoch when the data loader tells it (sizes the profiling phase)."""
    cached_profile: dict | None = None
    """What ``profile_to_save()`` returned in an earlier run with the same ``profile_key``."""
    failure_times_s: list[float] = field(default_factory=list)
    """Wall-clock times (``time.time()``) of the restarts recorded in this run's history,
    excluding the present start."""
    now_s: float = 0.0
    """Wall-clock time of the present start (``time.time()``)."""
    started_s: float | None = None
    """Wall-clock time this run first started (its history's), None when unknown: with it
    the first restart already estimates the MTBF."""
    state_signature: str | None = None
    """Optional digest of the state's layout (names, dtypes, shapes): tells two models of the
    same size apart in :func:`profile_key`."""
    buffers: int = 1
    """Sets of snapshot buffers of the checkpointer (2: double buffering); changes the interval
    that hides a persist (:func:`cfdist.policy.freq.k_persist`), not what is measured."""

    def __post_init__(self):
        if not (isinstance(self.world_size, int) and self.world_size >= 1):
            raise ValueError(f"PolicyContext.world_size must be an int >= 1, got {self.world_size!r}")
        if not (isinstance(self.rank, int) and 0 <= self.rank < self.world_size):
            raise ValueError(
                f"PolicyContext.rank must be in [0, world_size={self.world_size}), got {self.rank!r}"
            )
        if not (isinstance(self.state_bytes, int) and self.state_bytes >= 0):
            raise ValueError(f"PolicyContext.state_bytes must be an int >= 0, got {self.state_bytes!r}")
        if not (isinstance(self.device, str) and self.device):
            raise ValueError(f"PolicyContext.device must be a device name such as 'cpu' or 'cuda', got {self.device!r}")
        if not (isinstance(self.buffers, int) and self.buffers >= 1):
            raise ValueError(f"PolicyContext.buffers must be an int >= 1, got {self.buffers!r}")
        for name in ("batch_size", "iters_per_epoch"):
            v = getattr(self, name)
            if v is not None and not (isinstance(v, int) and v >= 1):
                raise ValueError(f"PolicyContext.{name} must be None or an int >= 1, got {v!r}")


def profile_key(ctx: PolicyContext) -> str:
    """The storage key of a cached profile: the same for every job whose profile must agree.

    Pure; depends on the state's size (and signature when given), world size, batch size and
    device, never on rank, time or history. Safe as a file name (``[A-Za-z0-9_-]``).
    """
    ident = {"state_bytes": ctx.state_bytes, "state_signature": ctx.state_signature,
             "world_size": ctx.world_size, "batch_size": ctx.batch_size, "device": ctx.device}
    digest = hashlib.sha256(json.dumps(ident, sort_keys=True).encode()).hexdigest()[:12]
    return f"{ctx.device}-w{ctx.world_size}-b{ctx.batch_size or 0}-{digest}"
