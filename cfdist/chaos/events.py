"""Failure events, the schedule protocol, and seeded helpers that pick targets.

A schedule is pure: ``schedule.events(num_nodes, horizon_s)`` reads no clock, starts no
process and returns the same list every time it is called with the same arguments. The
injector (a thin Ray shell, elsewhere) turns the list into real kills; the simulator
(:mod:`cfdist.chaos.simulator`) replays it in virtual time.

Randomness comes from :func:`rng_for`, a :class:`random.Random` seeded from ``(seed, purpose)``.
Only ``Random.random()`` is used, and every distribution is drawn by inverse CDF from it, so a
seed gives the same events on every Python version (the stdlib guarantees ``random()``'s
sequence for a seed; it does not guarantee ``expovariate`` or ``sample``).
"""

from __future__ import annotations

import math
import random
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal, Protocol, runtime_checkable

FailureKind = Literal["crash", "preempt", "return"]
KINDS: tuple[str, ...] = ("crash", "preempt", "return")


@dataclass(frozen=True, kw_only=True)
class FailureEvent:
    """One thing that happens to the job's nodes at one instant (seconds from job start).

    Kinds:

    - ``"crash"``: the process of ``rank`` dies; its node stays up. No notice.
    - ``"preempt"``: ``node`` is taken away at ``time_s``; the cloud warned ``notice_s`` before.
    - ``"return"``: ``node`` (a replacement VM in the same slot) is up again and can host ranks.

    Nodes are the job's node slots ``0 .. num_nodes-1``; ranks are ``0 .. world_size-1``.
    """

    time_s: float
    """When it happens, seconds after the job started (>= 0). For a preemption: the kill."""
    kind: FailureKind
    """``"crash"``, ``"preempt"`` or ``"return"``."""
    node: int | None = None
    """Node slot hit (preempt, return: required; crash: the rank's node, when known)."""
    rank: int | None = None
    """Rank whose process dies (crash only)."""
    notice_s: float = 0.0
    """How long before ``time_s`` the preemption was announced (preempt only; 0 = no notice)."""

    def __post_init__(self) -> None:
        if not (isinstance(self.time_s, (int, float)) and math.isfinite(self.time_s) and self.time_s >= 0):
            raise ValueError(f"FailureEvent.time_s must be a finite number >= 0 (seconds from job start), got {self.time_s!r}")
        if self.kind not in KINDS:
            raise ValueError(f"FailureEvent.kind must be one of {KINDS}, got {self.kind!r}")
        for name in ("node", "rank"):
            v = getattr(self, name)
            if v is not None and (not isinstance(v, int) or isinstance(v, bool) or v < 0):
                raise ValueError(f"FailureEvent.{name} must be an int >= 0 or None, got {v!r}")
        if not (math.isfinite(self.notice_s) and self.notice_s >= 0):
            raise ValueError(f"FailureEvent.notice_s must be a finite number >= 0, got {self.notice_s!r}")
        if self.kind == "crash":
            if self.rank is None:
                raise ValueError("a 'crash' FailureEvent needs rank=<the rank that dies>")
            if self.notice_s:
                raise ValueError(f"crashes come without notice; got notice_s={self.notice_s} for a 'crash' (use kind='preempt')")
        else:
            if self.node is None:
                raise ValueError(f"a {self.kind!r} FailureEvent needs node=<node slot>")
            if self.rank is not None:
                raise ValueError(f"rank is for crashes only; got rank={self.rank} on a {self.kind!r} (set node instead)")
            if self.kind == "return" and self.notice_s:
                raise ValueError(f"notice_s is for preemptions only; got {self.notice_s} on a 'return'")

    @property
    def is_failure(self) -> bool:
        """True for events that interrupt a running job (crash, preempt)."""
        return self.kind != "return"


@runtime_checkable
class Schedule(Protocol):
    """Anything that lists failure events for a job of ``num_nodes`` nodes up to ``horizon_s``.

    ``events`` must be pure: same arguments, same list; no clocks. The list is sorted by
    ``time_s``; events at the same instant are in the order they happen (a preemption of a
    slot before the return of its replacement). Only events with ``time_s < horizon_s``.
    """

    def events(self, num_nodes: int, horizon_s: float) -> list[FailureEvent]: ...


def check_job_args(num_nodes: int, horizon_s: float) -> None:
    """Raise ValueError unless ``num_nodes`` >= 1 and ``horizon_s`` >= 0 (shared by schedules)."""
    if not isinstance(num_nodes, int) or isinstance(num_nodes, bool) or num_nodes < 1:
        raise ValueError(f"num_nodes must be an int >= 1 (the job's node count), got {num_nodes!r}")
    if not horizon_s >= 0:  # also refuses NaN
        raise ValueError(f"horizon_s must be >= 0 seconds (math.inf for all events), got {horizon_s!r}")


def rng_for(seed: int, purpose: str) -> random.Random:
    """A generator for one purpose ("intervals", "targets", ...) of one seed.

    Separate streams keep, e.g., the failure times of a seed unchanged when the number of
    nodes (and so the target draws) changes. String seeds are hashed with SHA-512 by
    :mod:`random`, so this does not depend on ``PYTHONHASHSEED``.
    """
    return random.Random(f"cfdist.chaos:{seed}:{purpose}")


def uniform_index(rng: random.Random, n: int) -> int:
    """An index in ``range(n)``, uniform, from exactly one ``rng.random()`` draw."""
    if n < 1:
        raise ValueError(f"cannot pick from {n} items")
    return min(int(rng.random() * n), n - 1)


def pick_node(rng: random.Random, up_nodes: Sequence[int]) -> int:
    """A node among ``up_nodes`` (in the given order), uniform, one draw."""
    return up_nodes[uniform_index(rng, len(up_nodes))]


def pick_rank(rng: random.Random, up_nodes: Sequence[int], ranks_per_node: int) -> tuple[int, int]:
    """``(node, rank)`` of a rank on one of ``up_nodes``, uniform over those ranks, one draw.

    Ranks are laid out node-major: node ``n`` hosts ranks ``n*ranks_per_node ...``.
    """
    i = uniform_index(rng, len(up_nodes) * ranks_per_node)
    node = up_nodes[i // ranks_per_node]
    return node, node * ranks_per_node + i % ranks_per_node


def pick_distinct(rng: random.Random, items: Sequence, count: int) -> list:
    """``count`` distinct items of ``items`` in draw order (partial Fisher-Yates, ``count`` draws)."""
    if not 0 <= count <= len(items):
        raise ValueError(f"cannot pick {count} distinct items from {len(items)}")
    pool = list(items)
    for i in range(count):
        j = i + uniform_index(rng, len(pool) - i)
        pool[i], pool[j] = pool[j], pool[i]
    return pool[:count]


def exponential_interval(u: float, mean_s: float) -> float:
    """Inverse CDF of the exponential distribution with mean ``mean_s`` at ``u`` in [0, 1)."""
    return -mean_s * math.log1p(-u)


def weibull_interval(u: float, shape: float, scale_s: float) -> float:
    """Inverse CDF of Weibull(``shape``, ``scale_s``) at ``u`` in [0, 1)."""
    return scale_s * (-math.log1p(-u)) ** (1.0 / shape)


def sort_events(events: list[FailureEvent]) -> list[FailureEvent]:
    """Stable sort by ``time_s`` (same-instant events keep the order they were emitted in)."""
    return sorted(events, key=lambda e: e.time_s)
