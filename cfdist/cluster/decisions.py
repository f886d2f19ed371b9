"""The controller's decisions, as pure functions and small policy classes (no Ray, no clock).

Each decision returns a value that says what to do *and why* (``reason`` holds the inputs), so
the controller can log it verbatim and tests can drive it with tables.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from dataclasses import dataclass, field

TIERS = ("live", "memory", "local", "peer", "shared")
"""Where a node's copy of the chosen checkpoint comes from, fastest first."""


@dataclass(frozen=True, kw_only=True)
class Failure:
    """One failure as the controller saw it."""

    kind: str
    """``"crash"`` (a rank's process died, its node is up), ``"preempt"`` (a node was lost) or
    ``"error"`` (training code raised)."""
    step: int
    """Last step rank 0 was known to have finished."""
    rank: int | None = None
    node: int | None = None
    """Node rank (position in the group) hit, when known."""
    node_id: str | None = None
    message: str = ""
    failed_at: float = 0.0
    """Wall time it happened (injected failures: the injection; else when it was detected)."""
    detected_at: float = 0.0

    def __post_init__(self):
        if self.kind not in ("crash", "preempt", "error"):
            raise ValueError(f"Failure.kind must be 'crash', 'preempt' or 'error', got {self.kind!r}")


@dataclass(frozen=True)
class FailureDecision:
    action: str
    """``"retry"`` or ``"raise"``."""
    reason: str


@dataclass(frozen=True, kw_only=True)
class FailurePolicy:
    """Retry until ``max_failures`` failures were tolerated, then raise."""

    max_failures: int

    def make_decision(self, failures_so_far: int, failure: Failure) -> FailureDecision:
        """``failures_so_far``: failures already tolerated before this one."""
        n = failures_so_far + 1
        if n > self.max_failures:
            return FailureDecision("raise", f"failure {n} ({failure.kind} at step {failure.step}) exceeds "
                                            f"max_failures={self.max_failures}")
        return FailureDecision("retry", f"failure {n} of at most {self.max_failures} "
                                        f"({failure.kind} at step {failure.step})")


@dataclass(frozen=True)
class ScalingDecision:
    num_nodes: int | None
    """Nodes for the next group; None: not enough nodes (wait, or fail after the deadline)."""
    reason: str


@dataclass(frozen=True, kw_only=True)
class ScalingPolicy:
    """Same size when capacity allows, smaller down to ``min_nodes`` (elastic), never larger
    than ``num_nodes``."""

    num_nodes: int
    min_nodes: int

    def size_for(self, usable_nodes: int) -> ScalingDecision:
        """Group size for a (re)start, given the nodes that can host a full node's ranks now."""
        n = min(self.num_nodes, usable_nodes)
        if n < self.min_nodes:
            return ScalingDecision(None, f"{usable_nodes} usable node(s) < min_nodes={self.min_nodes}")
        why = "full size" if n == self.num_nodes else f"elastic: {usable_nodes} usable of {self.num_nodes} wanted"
        return ScalingDecision(n, f"{n} node(s): {why}")

    def should_grow(self, current_nodes: int, usable_nodes: int) -> ScalingDecision:
        """While running smaller than wanted: grow when more nodes became usable."""
        target = min(self.num_nodes, usable_nodes)
        if target > current_nodes:
            return ScalingDecision(target, f"capacity returned: {usable_nodes} usable, running on "
                                           f"{current_nodes}, want {self.num_nodes}")
        return ScalingDecision(None, f"no growth: {usable_nodes} usable, running on {current_nodes}")


@dataclass(frozen=True, kw_only=True)
class Holding:
    """What one source holds: committed steps per tier. ``node_id=None`` is shared storage."""

    node_id: str | None
    live: tuple[int, ...] = ()
    """Steps a survivor of the failed group on this node keeps in process (its live state): the
    next group restores one over the group, from that survivor, when it is one of its ranks."""
    memory: tuple[int, ...] = ()
    local: tuple[int, ...] = ()
    shared: tuple[int, ...] = ()

    def tier_of(self, step: int) -> str | None:
        for t in ("memory", "local", "shared"):
            if step in getattr(self, t):
                return t
        return None


@dataclass(frozen=True)
class RestoreChoice:
    step: int | None
    """Step to restore on every rank; None: start from scratch."""
    sources: dict = field(default_factory=dict)
    """``{node_id: (tier, from_node_id)}`` for every node of the new group: ``("memory", None)``
    and ``("local", None)`` read its own copy, ``("peer", id)`` is copied from that node's actor,
    ``("shared", None)`` is read from shared storage, ``("live", id)`` is sent over the group by
    a survivor on that node that kept it in process."""
    reason: str = ""

    @property
    def tier(self) -> str:
        """The slowest source any node uses (what recovery waits for); "none" from scratch."""
        if self.step is None:
            return "none"
        return max((t for t, _ in self.sources.values()), key=TIERS.index, default="none")


def choose_restore(holdings: list[Holding], group: list[str], *, peer_copy: bool = True,
                   exclude: frozenset[int] = frozenset()) -> RestoreChoice:
    """The newest step every node of ``group`` (node ids) can obtain, and where each gets it.

    A step a survivor on a node of ``group`` keeps in process (``Holding.live``) reaches every
    node over the next group, from that survivor: every source is ``("live", its node)``.
    Otherwise a node obtains a step from its own memory or local tier, else from a surviving
    peer's actor (``peer_copy``), else from shared storage. Steps in ``exclude`` (failed
    verification before) are skipped. Pure: holdings are what the surviving actors and shared
    storage reported.
    """
    own = {h.node_id: h for h in holdings if h.node_id is not None}
    shared = set().union(*(h.shared for h in holdings)) if holdings else set()
    peer_held: dict[int, str] = {}
    for h in holdings:
        if h.node_id is not None:
            for s in (*h.memory, *h.local):
                peer_held.setdefault(s, h.node_id)
    live_held: dict[int, str] = {}
    for h in holdings:
        if h.node_id in group:
            for s in h.live:
                live_held.setdefault(s, h.node_id)
    all_steps = sorted((set(peer_held) | shared | set(live_held)) - set(exclude), reverse=True)
    inputs = (f"holdings={[(h.node_id and h.node_id[:8], max(h.live, default=None), max(h.memory, default=None), max(h.local, default=None), max(h.shared, default=None)) for h in holdings]} "
              f"group={[g[:8] for g in group]} excluded={sorted(exclude)}")
    for step in all_steps:
        if step in live_held:
            return RestoreChoice(step, {nid: ("live", live_held[step]) for nid in group},
                                 f"newest step: {step}, kept in process by a survivor on node "
                                 f"{live_held[step][:8]}; the others receive it over the group; {inputs}")
        sources = {}
        for nid in group:
            h = own.get(nid)
            tier = None
            if h is not None:
                tier = "memory" if step in h.memory else "local" if step in h.local else None
            if tier is not None:
                sources[nid] = (tier, None)
            elif peer_copy and step in peer_held:
                sources[nid] = ("peer", peer_held[step])
            elif step in shared:
                sources[nid] = ("shared", None)
            else:
                break
        else:
            return RestoreChoice(step, sources, f"newest step every node can obtain: {step}; {inputs}")
    return RestoreChoice(None, {}, f"no committed checkpoint reachable: start from scratch; {inputs}")


@dataclass(frozen=True)
class HaltDecision:
    """When a group that a notice named in full halts (:func:`pool_halt`)."""

    halt_in_s: float
    """Seconds from the notice until the group halts (0: at once)."""
    reason: str


POOL_HALT_FLOOR_S = 1.0
"""The least margin :func:`pool_halt` leaves before the kill: a second of training out of a
notice's 30-120 s, against a machine slower than its recent commits said."""


def pool_halt(window_s: float, latencies_s: Sequence[float], step_s: float | None, *,
              slack_s: float = 0.0, floor_s: float = POOL_HALT_FLOOR_S) -> HaltDecision:
    """When to halt a group whose every node a preemption notice named (a whole spot pool
    reclaimed: no replica survives the kill, ``window_s`` from now). Pure.

    The group trains on while it can, and halts ``margin`` before the kill so that its last
    completed step reaches a durable tier in time: margin = 2 x the recent durable commit
    latency (``latencies_s``: step to commit on disk, median of the last five; a checkpoint in
    flight at the halt, then the live save, each take about that) + one step (``step_s``: the
    halt waits for the update in progress) + ``slack_s`` (the halt's own delivery: the
    controller's poll), and at least ``floor_s``. With no latency measured yet, or a window
    within the margin: at once.
    """
    recent = list(latencies_s)[-5:]
    if not recent:
        return HaltDecision(0.0, f"window {window_s:.2f}s, no durable commit latency measured yet: halt now")
    est = statistics.median(recent)
    margin = max(2 * est + (step_s or 0.0) + slack_s, floor_s)
    inputs = (f"commit latency ~{est:.3g}s (median of {len(recent)}), step {step_s or 0:.3g}s, "
              f"slack {slack_s:.3g}s, margin {margin:.3g}s (at least {floor_s:g}s)")
    if window_s <= margin:
        return HaltDecision(0.0, f"window {window_s:.2f}s <= {inputs}: halt now")
    return HaltDecision(window_s - margin, f"window {window_s:.2f}s, {inputs}: train {window_s - margin:.2f}s more, "
                                           f"then halt")
