"""The controller's states, one tiny class each, and the interfaces it drives.

::

    RecoveringState --(group started)--> RunningState --(all ranks returned)--> FinishedState
          ^   |                              |
          |   +--(no nodes, deadline)--> FailedState <--(failure beyond max_failures)
          +----(failure, or capacity returned: resize)--+

The initial start is a ``RecoveringState`` without a failure: a new run and a resumed run take
the same path (ask the tiers for their newest committed step, start the group, restore).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol

from cfdist.cluster.decisions import Failure, Holding, RestoreChoice
from cfdist.cluster.nodes import NodeInfo


class ControllerState:
    name = "?"
    terminal = False

    def __repr__(self) -> str:
        return f"{type(self).__name__}({', '.join(f'{k}={v!r}' for k, v in vars(self).items())})"


class RecoveringState(ControllerState):
    """Build a worker group: first start, after ``failure``, or a planned ``resize``."""

    name = "recovering"

    def __init__(self, failure: Failure | None = None, *, resize: bool = False, since: float | None = None):
        self.failure = failure
        self.resize = resize
        self.since = since
        """When recovery started waiting for nodes (None: not waiting yet)."""
        self.stage_failures = 0


class RunningState(ControllerState):
    name = "running"

    def __init__(self, group: "WorkerGroup"):
        self.group = group


class FinishedState(ControllerState):
    name = "finished"
    terminal = True

    def __init__(self, value: Any = None):
        self.value = value


class FailedState(ControllerState):
    name = "failed"
    terminal = True

    def __init__(self, error: BaseException):
        self.error = error


@dataclass
class RankError:
    rank: int
    node_id: str | None
    actor_died: bool
    """The rank's process is gone (killed, crashed, its node lost), not a Python exception."""
    message: str


@dataclass
class GroupStatus:
    """One poll of a running group."""

    finished: bool = False
    """Every rank's ``run`` returned."""
    errors: list[RankError] = field(default_factory=list)
    results: dict[int, dict] = field(default_factory=dict)
    """Per rank: what ``RankWorker.run`` returned (for ranks that finished)."""
    records: list[dict] = field(default_factory=list)
    """Rank 0's step/metrics/restored records since the previous poll."""


class WorkerGroup(Protocol):
    """One attempt's ranks (Ray actors in production, a scripted fake in tests)."""

    nodes: list[NodeInfo]
    world_size: int

    def poll(self, timeout_s: float) -> GroupStatus: ...

    def current_step(self) -> int | None:
        """Newest step any live rank finished (asked now), or None."""

    def notify(self, node_ranks: list[int], *, save: bool) -> None: ...

    def halt(self) -> None:
        """Every rank stops at its next iteration boundary; the node writers save that step."""

    def pids(self) -> list[int]: ...

    def shutdown(self) -> None: ...


class ClusterBackend(Protocol):
    """What the controller needs from the cluster (Ray in production, fakes in tests)."""

    def usable_nodes(self) -> list[NodeInfo]: ...

    def lost_nodes(self, nodes: list[NodeInfo]) -> set[str]:
        """Ids of ``nodes`` that are gone (asked after a failure)."""

    def holdings(self, newest: int | None = None) -> list[Holding]:
        """Committed steps of every live node actor (after in-flight persists) and of shared
        storage. ``newest``: the run's last completed step; nodes whose checkpoint actor is
        still starting (``NodeInfo.starting``) are not waited for when the others hold it
        (nothing can be newer)."""

    def stage(self, choice: RestoreChoice, nodes: list[NodeInfo]) -> dict:
        """Copy the chosen checkpoint to the nodes that lack it. The copies may still run when
        it returns: the next :meth:`start_group`'s ranks then wait for their node's copy before
        restoring (a copy that fails fails that attempt)."""

    def start_group(self, nodes: list[NodeInfo], choice: RestoreChoice, attempt: int,
                    dead_pids: list[int]) -> WorkerGroup: ...

    def drain_commits(self, final: bool = False) -> list[dict]:
        """Commit records of the node actors since the previous call; ``final``: the run's
        last call, after :meth:`finish`, which waits for every live actor's answer."""

    def commit_durable(self, nodes: list[NodeInfo], deadline: float) -> dict | None:
        """Before every node of the group is taken: each node's newest step into its durable
        tiers (local disk; shared storage when the run has it), within ``deadline`` (wall time).
        Returns ``{"step", "tier", "t"}`` of the newest durable commit, or None."""

    def finish(self) -> str | None:
        """After success: make the final checkpoint durable; return its URL."""
