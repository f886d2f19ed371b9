"""``FitResult`` (what ``cfdist.fit`` returns) and the errors it raises."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True, kw_only=True)
class FailureStats:
    """One tolerated failure and its recovery, as the controller measured it (wall seconds)."""

    kind: str
    """``"crash"``, ``"preempt"`` or ``"error"``."""
    step: int
    """Steps finished when it happened."""
    restored_step: int
    """Step training resumed from (0: scratch)."""
    tier: str
    """Where the restored checkpoint came from: memory, local, peer, shared or none."""
    detect_s: float
    restart_s: float
    """Detected until the new group ran (includes waiting for nodes and staging the checkpoint)."""
    restore_s: float
    """Loading the checkpoint on rank 0."""
    world_size: int
    """Ranks of the group that resumed."""

    @property
    def lost_iterations(self) -> int:
        return max(0, self.step - self.restored_step)

    @property
    def recovery_s(self) -> float:
        """Failure until training resumed (detect + restart + restore)."""
        return self.detect_s + self.restart_s + self.restore_s


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
    world_sizes: tuple[int, ...] = ()
    """World size of each attempt, in order (elastic runs change it)."""
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
    def recovery_seconds(self) -> list[float]:
        """Seconds from each failure until training resumed."""
        return [f.recovery_s for f in self.failure_stats]


class FitError(RuntimeError):
    """``cfdist.fit`` gave up: too many failures, or too few nodes for too long."""
