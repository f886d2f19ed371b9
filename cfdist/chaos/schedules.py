"""Synthetic failure schedules: exponential, Weibull and fixed-interval arrivals.

All three are renewal processes at the level of the whole job: the gaps between failures of
*the job* (any node) are independent draws from one distribution. A per-node MTBF ``m`` on
``n`` nodes with exponential lifetimes is a job MTBF of ``m / n``.

Each arrival hits one target, picked uniformly from a separate seeded stream:

- ``kind="crash"``: a rank on a node that is up; the node stays up.
- ``kind="preempt"``: a node that is up (``pool=True``: every node that is up, at the same
  instant, as when a whole spot pool is reclaimed); it comes back ``return_after_s`` later (a
  ``"return"`` event), or never when ``return_after_s`` is None. An arrival while every node is
  down is dropped (there is nothing to take).

Example::

    >>> from cfdist.chaos import Exponential
    >>> evs = Exponential(3600.0, seed=1, notice_s=30.0).events(num_nodes=4, horizon_s=86400)
    >>> evs == Exponential(3600.0, seed=1, notice_s=30.0).events(4, 86400)
    True
"""

from __future__ import annotations

import abc
import itertools
import math
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Literal

from cfdist.chaos.events import (
    FailureEvent,
    check_job_args,
    exponential_interval,
    pick_node,
    pick_rank,
    rng_for,
    sort_events,
    weibull_interval,
)


def _positive(owner: str, name: str, value: float, hint: str) -> None:
    if not (isinstance(value, (int, float)) and math.isfinite(value) and value > 0):
        raise ValueError(f"{owner}.{name} must be a finite number > 0 ({hint}), got {value!r}")


@dataclass(frozen=True, kw_only=True)
class _Arrivals(abc.ABC):
    """Fields and event generation shared by the renewal schedules (not public)."""

    seed: int = 0
    """Seed of both streams (gaps and targets). Same seed, same events."""
    kind: Literal["crash", "preempt"] = "preempt"
    """What each arrival is: a rank ``"crash"`` or a node ``"preempt"``."""
    notice_s: float = 0.0
    """Preemption notice in seconds (preempt only; AWS spot gives 120, GCP 30)."""
    return_after_s: float | None = 0.0
    """Seconds from a preemption until the replacement node is up (preempt only); None: never."""
    ranks_per_node: int = 1
    """Ranks per node, to name the crashing rank (crash only)."""
    pool: bool = False
    """Each preemption takes every node that is up at once (a whole spot pool reclaimed, one
    notice for all of them); preempt only."""

    def __post_init__(self) -> None:
        owner = type(self).__name__
        if self.pool and self.kind != "preempt":
            raise ValueError(f"{owner}: pool=True takes every node at once, which is a preemption; "
                             f"use kind='preempt' (got {self.kind!r})")
        if not isinstance(self.seed, int) or isinstance(self.seed, bool):
            raise ValueError(f"{owner}.seed must be an int, got {self.seed!r}")
        if self.kind not in ("crash", "preempt"):
            raise ValueError(f"{owner}.kind must be 'crash' or 'preempt', got {self.kind!r}")
        if not (math.isfinite(self.notice_s) and self.notice_s >= 0):
            raise ValueError(f"{owner}.notice_s must be a finite number of seconds >= 0, got {self.notice_s!r}")
        if self.kind == "crash" and self.notice_s:
            raise ValueError(f"{owner}: crashes come without notice; drop notice_s={self.notice_s} or use kind='preempt'")
        if self.return_after_s is not None and not (math.isfinite(self.return_after_s) and self.return_after_s >= 0):
            raise ValueError(
                f"{owner}.return_after_s must be seconds >= 0, or None for nodes that never come back; "
                f"got {self.return_after_s!r}"
            )
        if not isinstance(self.ranks_per_node, int) or self.ranks_per_node < 1:
            raise ValueError(f"{owner}.ranks_per_node must be an int >= 1, got {self.ranks_per_node!r}")

    @abc.abstractmethod
    def _arrival_times(self) -> Iterator[float]:
        """Arrival times in seconds from job start, increasing, endless (each schedule's own)."""

    def events(self, num_nodes: int, horizon_s: float) -> list[FailureEvent]:
        """The events before ``horizon_s`` for a job on nodes ``0..num_nodes-1``. Pure."""
        check_job_args(num_nodes, horizon_s)
        targets = rng_for(self.seed, "targets")
        back_at: dict[int, float] = {}  # down node -> when it returns (inf: never)
        out: list[FailureEvent] = []
        for t in self._arrival_times():
            if t >= horizon_s:
                break
            for n in [n for n, r in back_at.items() if r <= t]:
                del back_at[n]
            up = [n for n in range(num_nodes) if n not in back_at]
            if not up:
                continue
            if self.kind == "crash":
                node, rank = pick_rank(targets, up, self.ranks_per_node)
                out.append(FailureEvent(time_s=t, kind="crash", node=node, rank=rank))
                continue
            for node in (up if self.pool else [pick_node(targets, up)]):
                out.append(FailureEvent(time_s=t, kind="preempt", node=node, notice_s=self.notice_s))
                back = math.inf if self.return_after_s is None else t + self.return_after_s
                back_at[node] = back
                if back < horizon_s:
                    out.append(FailureEvent(time_s=back, kind="return", node=node))
        return sort_events(out)


@dataclass(frozen=True, kw_only=True)
class Exponential(_Arrivals):
    """Memoryless failures: gaps ~ Exponential(mean ``mtbf_s``). ``Exponential(3600.0, seed=0)``."""

    mtbf_s: float = field(kw_only=False)
    """Mean time between failures of the whole job, seconds."""

    def __post_init__(self) -> None:
        _positive("Exponential", "mtbf_s", self.mtbf_s, "mean seconds between failures of the job")
        super().__post_init__()

    @property
    def mean_gap_s(self) -> float:
        """Expected seconds between arrivals."""
        return self.mtbf_s

    def _arrival_times(self) -> Iterator[float]:
        rng, t = rng_for(self.seed, "intervals"), 0.0
        while True:
            t += exponential_interval(rng.random(), self.mtbf_s)
            yield t


@dataclass(frozen=True, kw_only=True)
class Weibull(_Arrivals):
    """Gaps ~ Weibull(``shape``, ``scale_s``). shape < 1: infant mortality; > 1: wear-out.

    ``Weibull(0.7, 3600.0, seed=0)``. Mean gap = ``scale_s * Gamma(1 + 1/shape)``.
    """

    shape: float = field(kw_only=False)
    """Weibull shape k (1 = exponential)."""
    scale_s: float = field(kw_only=False)
    """Weibull scale lambda in seconds (the 63rd percentile of the gaps)."""

    def __post_init__(self) -> None:
        _positive("Weibull", "shape", self.shape, "1 is exponential; <1 early failures; >1 wear-out")
        _positive("Weibull", "scale_s", self.scale_s, "seconds, the 63rd percentile of the gaps")
        super().__post_init__()

    @property
    def mean_gap_s(self) -> float:
        """Expected seconds between arrivals."""
        return self.scale_s * math.gamma(1.0 + 1.0 / self.shape)

    def _arrival_times(self) -> Iterator[float]:
        rng, t = rng_for(self.seed, "intervals"), 0.0
        while True:
            t += weibull_interval(rng.random(), self.shape, self.scale_s)
            yield t


@dataclass(frozen=True, kw_only=True)
class FixedInterval(_Arrivals):
    """A failure every ``every_s`` seconds, first at ``first_s`` (default ``every_s``).

    Targets are still drawn from ``seed``. ``FixedInterval(600.0, kind="crash")``.
    """

    every_s: float = field(kw_only=False)
    """Seconds between failures."""
    first_s: float | None = None
    """Time of the first failure; None means ``every_s``."""

    def __post_init__(self) -> None:
        _positive("FixedInterval", "every_s", self.every_s, "seconds between failures")
        if self.first_s is not None and not (math.isfinite(self.first_s) and self.first_s >= 0):
            raise ValueError(f"FixedInterval.first_s must be seconds >= 0 or None, got {self.first_s!r}")
        super().__post_init__()

    @property
    def mean_gap_s(self) -> float:
        """Seconds between arrivals."""
        return self.every_s

    def _arrival_times(self) -> Iterator[float]:
        first = self.every_s if self.first_s is None else self.first_s
        for i in itertools.count():
            yield first + i * self.every_s  # multiplied, not summed: no drift


@dataclass(frozen=True)
class Merged:
    """The union of several schedules' events, e.g. crashes and preemptions at their own rates.

    ``Merged((Exponential(20.0, kind="crash", seed=1), Exponential(20.0, seed=2, notice_s=5.0)))``
    is one job failing every 10 s on average (two independent Poisson processes add up to one).
    Events of the same instant keep the parts' order. A part's preemption of a node another part
    already took down is kept; the injector and the simulator ignore it (the node is down).
    """

    parts: tuple
    """The schedules to merge (anything with ``events(num_nodes, horizon_s)``)."""

    def __post_init__(self) -> None:
        if not isinstance(self.parts, tuple) or not self.parts:
            raise ValueError(f"Merged(parts) needs a non-empty tuple of schedules, got {self.parts!r}")
        bad = [p for p in self.parts if not hasattr(p, "events")]
        if bad:
            raise ValueError(f"Merged parts must have events(num_nodes, horizon_s); these do not: {bad!r}")

    @property
    def mean_gap_s(self) -> float:
        """Expected seconds between failures of the merged schedule (rates add)."""
        rate = sum(1.0 / p.mean_gap_s for p in self.parts)
        return 1.0 / rate if rate > 0 else math.inf

    def events(self, num_nodes: int, horizon_s: float) -> list[FailureEvent]:
        """All parts' events before ``horizon_s``, sorted by time. Pure."""
        check_job_args(num_nodes, horizon_s)
        return sort_events([e for p in self.parts for e in p.events(num_nodes, horizon_s)])
