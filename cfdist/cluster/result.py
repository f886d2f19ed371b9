"""``FitResult`` (what ``cfdist.fit`` returns) and the errors it raises."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True, kw_only=True)
class FailureStats:
    """One interruption and its recovery, read from the run's event log (wall seconds).

    Built by :func:`failure_stats` from the same records and rules as
    :func:`cfdist.chaos.metrics_from_log`: lost work and recovery time are defined there, once.
    A failure during a recovery joins that interruption (``events`` > 1).
    """

    kind: str
    """``"crash"`` or ``"preempt"`` (a training error counts as a crash)."""
    step: int
    """Last step completed before the failure."""
    restored_step: int
    """Step training resumed from (0: scratch)."""
    tier: str
    """Where the restored checkpoint came from: memory, local, peer, shared, none, or ``"?"`` if the
    run ended before it resumed."""
    detect_s: float
    """Failure until the controller saw it."""
    restart_s: float
    """Detected until the new group ran (waiting for nodes and staging the checkpoint included)."""
    restore_s: float
    """Group running until the checkpoint was loaded."""
    world_size: int
    """Ranks of the group that resumed (0: it never resumed)."""
    resume_s: float | None = None
    """Failure until the first step completed after the restore (None: never resumed)."""
    lost_iterations: int = 0
    """Steps completed after the restored checkpoint and before the failure (work redone)."""
    events: int = 1
    """Failures merged into this interruption."""

    @property
    def recovery_s(self) -> float | None:
        """Failure until training resumed: the first step completed after the restore."""
        return self.resume_s


def failure_stats(records: list[dict]) -> tuple[FailureStats, ...]:
    """The interruptions of a run, from its event-log records (the driver's, in order). Pure."""
    from cfdist.chaos.metrics import metrics_from_log

    if not records:
        return ()
    m = metrics_from_log(records, iter_s=1.0)
    return tuple(FailureStats(
        kind=f.kind, step=f.step, restored_step=f.restored_step, tier=f.tier or "?", detect_s=f.detect_s,
        restart_s=f.wait_s + f.restart_s, restore_s=f.restore_s,
        world_size=(f.world_size or 0) if f.tier is not None else 0,
        resume_s=f.resume_s, lost_iterations=f.lost_iters, events=f.events) for f in m.failures)


@dataclass(frozen=True, kw_only=True)
class FitResult:
    """The outcome of ``cfdist.fit``."""

    final_step: int
    """Optimizer steps of the final state."""
    steps: int
    """Optimizer steps executed across all attempts, redone ones included (>= final_step)."""
    failures: int
    """Failures tolerated."""
    failure_stats: tuple[FailureStats, ...] = ()
    """One per interruption (a failure during a recovery joins it), from the event log."""
    stall_share: float = 0.0
    """Rank 0's checkpoint stall as a share of its running time (0.02 = 2%): cfdist's own account
    of the waits inside ``ckpt.step``. Not the runtime overhead (it leaves out what the background
    copy and persist take from training): ``cfdist bench`` measures that from the outside."""
    checkpoint: str | None = None
    """URL of the final checkpoint (shared tier when configured, else node 0's local tier)."""
    value: Any = None
    """What the training function returned on rank 0."""
    wall_s: float = 0.0
    event_log: str | None = None
    log_dir: str | None = None
    """Directory of the rank processes' logs (the details of every failure: tracebacks, C++
    warnings), one file per process, on each node (see ``FitConfig.log_dir``)."""
    world_sizes: tuple[int, ...] = ()
    """World size of each attempt, in order (elastic runs change it)."""
    skipped_injections: tuple[dict, ...] = ()
    """Scheduled failures that were not executed, each an event-log record with its ``reason``
    (e.g. a preemption due while the job was already recovering). Retargeted ones (their target
    was missing from a smaller group) are executed and logged as ``injection_retargeted``."""
    extra: dict = field(default_factory=dict)

    @property
    def overhead(self) -> float:
        """Deprecated name of :attr:`stall_share` (it is not the runtime overhead)."""
        import warnings

        warnings.warn("FitResult.overhead is rank 0's stall share, now named FitResult.stall_share; "
                      "the runtime overhead is measured by `cfdist bench`", DeprecationWarning, stacklevel=2)
        return self.stall_share

    @property
    def lost_iterations(self) -> list[int]:
        """Iterations redone per failure."""
        return [f.lost_iterations for f in self.failure_stats]

    @property
    def recovery_seconds(self) -> list[float | None]:
        """Seconds from each failure until the first step completed after it (None: never resumed)."""
        return [f.recovery_s for f in self.failure_stats]


class FitError(RuntimeError):
    """``cfdist.fit`` gave up: too many failures, or too few nodes for too long."""
