"""Where the planner's failures come from: a preemption trace, or a rate per node-hour. Pure.

On spot machines every failure takes a node away (a preemption); the planner does not model
crashes of a process on a node that stays up. Two sources:

- **A trace** (:class:`TraceFailures`): any file :class:`cfdist.chaos.TraceReplay` reads (the
  bundled Bamboo and GCP traces, by name or path), or a SkyPilot ``spot-traces`` JSON file
  (:func:`parse_skypilot`: ``{"metadata": {"gap_seconds": 300}, "data": [n, ...]}``, the number
  of instances available at each tick). The cluster formats map the trace's VMs onto the job's
  node slots as :mod:`cfdist.chaos.replay` documents. A job longer than the trace replays it
  again from its start with every slot up (the trace is *tiled*). Seed ``i`` of ``n`` starts the
  job ``i/n`` of the way through the trace (a *window*); the job starts with all its nodes up.
  The lifetimes format samples VM lifetimes with the seed instead.
- **A rate** (:class:`RateFailures`): preemptions arrive as a Poisson process of
  ``per_node_hour * nodes`` per hour; each takes one node (uniform among those up), or, with
  probability ``p_all``, every node at once; a node is back ``return_after_s`` later.
"""

from __future__ import annotations

import datetime as _dt
import functools
import json
import math
import os
from dataclasses import dataclass

from cfdist.chaos.events import FailureEvent, exponential_interval, pick_node, rng_for, sort_events
from cfdist.chaos.replay import Membership, TraceReplay, membership_from_pool_sizes, pool_size_series, slot_events
from cfdist.chaos.trace_io import BUNDLED_TRACES, PoolSample, bundled_trace


def parse_skypilot(text: str, *, source: str = "<json>") -> tuple[float, list[int]]:
    """``(gap_seconds, counts)`` of a SkyPilot spot-traces JSON file (instances up per tick)."""
    try:
        data = json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"{source} is not JSON ({e}); expected a SkyPilot spot-traces file "
                         '{"metadata": {"gap_seconds": 300}, "data": [...]}') from None
    if not isinstance(data, dict) or not isinstance(data.get("data"), list):
        raise ValueError(f'{source}: expected {{"metadata": {{"gap_seconds": ...}}, "data": [counts]}} '
                         f"(SkyPilot spot-traces), got keys {sorted(data) if isinstance(data, dict) else type(data).__name__}")
    gap = (data.get("metadata") or {}).get("gap_seconds", 300)
    if isinstance(gap, bool) or not isinstance(gap, (int, float)) or not gap > 0:
        raise ValueError(f"{source}: metadata.gap_seconds must be seconds > 0, got {gap!r}")
    counts = data["data"]
    for i, c in enumerate(counts):
        if isinstance(c, bool) or not isinstance(c, int) or c < 0:
            raise ValueError(f"{source}: data[{i}] must be an int >= 0 (instances available at that tick), got {c!r}")
    if not counts:
        raise ValueError(f"{source}: data is empty; the trace needs at least one tick")
    return float(gap), counts


def skypilot_membership(gap_s: float, counts: list[int], *, seed: int) -> Membership:
    """A SkyPilot availability series as membership changes (a pool trace, one row per tick)."""
    t0 = _dt.datetime(2000, 1, 1)
    samples = [PoolSample(time=t0 + _dt.timedelta(seconds=i * gap_s), size=c) for i, c in enumerate(counts)]
    return membership_from_pool_sizes(samples, seed=seed)


def _is_skypilot(path: str) -> bool:
    with open(path, encoding="utf-8") as f:
        return f.read(64).lstrip().startswith("{")


def resolve_trace(name_or_path: str) -> str:
    """A bundled trace's name, or a path, as a path; ValueError naming the bundled ones."""
    if name_or_path in BUNDLED_TRACES:
        return bundled_trace(name_or_path)
    if os.path.isfile(name_or_path):
        return name_or_path
    raise ValueError(f"no trace {name_or_path!r}: give a file path or a bundled trace, one of "
                     f"{', '.join(BUNDLED_TRACES)}")


@dataclass(frozen=True, kw_only=True)
class TraceFailures:
    """Preemptions replayed from a trace file (tiled; one window per seed)."""

    path: str
    """Trace file (:func:`resolve_trace` turns a bundled name into a path)."""
    notice_s: float = 0.0
    """Preemption notice, seconds (AWS spot: 120, GCP: 30)."""
    windows: int = 8
    """Windows the seeds spread over (seed ``i`` starts ``(i % windows) / windows`` into the trace)."""

    def __post_init__(self) -> None:
        if not os.path.isfile(self.path):
            raise ValueError(f"trace {self.path!r} is not a file")
        if not (math.isfinite(self.notice_s) and self.notice_s >= 0):
            raise ValueError(f"notice_s must be seconds >= 0, got {self.notice_s!r}")

    @property
    def label(self) -> str:
        """Short description for reports."""
        return f"trace {os.path.basename(self.path)}"

    def _membership(self, seed: int) -> Membership | None:
        return _membership(self.path, seed)

    def max_nodes(self) -> int | None:
        """The most VMs the trace ever holds at once (None: lifetimes, no limit)."""
        m = self._membership(0)
        return None if m is None else max((s for _, s in pool_size_series(m)), default=0)

    def events(self, nodes: int, horizon_s: float, seed: int) -> list[FailureEvent]:
        """Preemptions and returns of a ``nodes``-node job before ``horizon_s`` for ``seed``."""
        one = _one_pass(self.path, seed, nodes, self.notice_s)
        if one is None:
            return TraceReplay(self.path, seed=seed, notice_s=self.notice_s).events(nodes, horizon_s)
        events, span = one
        offset = (seed % self.windows) / self.windows * span
        out: list[FailureEvent] = []
        rep = 0
        while rep * span < offset + horizon_s:
            base = rep * span - offset
            if rep:   # each repetition starts with every slot up again
                out += [FailureEvent(time_s=base, kind="return", node=n) for n in range(nodes) if base >= 0]
            out += [_shift(e, base) for e in events if 0 <= e.time_s + base < horizon_s]
            rep += 1
        return sort_events(out)

    def mtbf_s(self, nodes: int) -> float:
        """Mean seconds between the job's preemptions over the whole trace (one pass)."""
        one = _one_pass(self.path, 0, nodes, 0.0)
        if one is None:
            lives = TraceReplay(self.path).lifetimes_s()
            return sum(lives) / len(lives) / nodes if lives else math.inf
        events, span = one
        n = len({e.time_s for e in events if e.kind == "preempt"})
        return span / n if n else math.inf


@functools.lru_cache(maxsize=32)
def _membership(path: str, seed: int) -> Membership | None:
    """The trace file's membership changes (None: a lifetimes file). Cached: read once per seed."""
    if _is_skypilot(path):
        with open(path, encoding="utf-8") as f:
            gap, counts = parse_skypilot(f.read(), source=path)
        return skypilot_membership(gap, counts, seed=seed)
    replay = TraceReplay(path, seed=seed)
    return None if replay.trace_format() == "lifetimes" else replay.membership()


@functools.lru_cache(maxsize=128)
def _one_pass(path: str, seed: int, nodes: int, notice_s: float) -> tuple[tuple[FailureEvent, ...], float] | None:
    """``(events, span_s)`` of one pass over a cluster trace for ``nodes`` slots (None: lifetimes)."""
    m = _membership(path, seed)
    if m is None:
        return None
    if not any(s >= nodes for _, s in pool_size_series(m)):
        most = max((s for _, s in pool_size_series(m)), default=0)
        raise ValueError(f"{path} never holds {nodes} VMs at once (at most {most}); plan for at most {most} nodes")
    events = slot_events(m, num_nodes=nodes, start_s=None, time_scale=1.0, notice_s=notice_s, horizon_s=math.inf)
    start = next(t for t, s in pool_size_series(m) if s >= nodes)
    return tuple(events), max(m[-1][0] - start, 1.0)


def _shift(e: FailureEvent, dt: float) -> FailureEvent:
    return FailureEvent(time_s=e.time_s + dt, kind=e.kind, node=e.node, rank=e.rank, notice_s=e.notice_s)


@dataclass(frozen=True, kw_only=True)
class RateFailures:
    """Preemptions at a rate per node-hour; some take every node at once."""

    per_node_hour: float
    """Preemptions per node-hour (0.05: a node lasts 20 hours on average)."""
    notice_s: float = 0.0
    """Preemption notice, seconds."""
    p_all: float = 0.0
    """Probability that a preemption takes every node at once (a zone running out)."""
    return_after_s: float = 0.0
    """Seconds until a preempted node's replacement is up."""

    def __post_init__(self) -> None:
        if not (isinstance(self.per_node_hour, (int, float)) and math.isfinite(self.per_node_hour)
                and self.per_node_hour >= 0):
            raise ValueError(f"the failure rate must be preemptions per node-hour >= 0, got {self.per_node_hour!r}")
        if not (0 <= self.p_all <= 1):
            raise ValueError(f"p_all (the chance a preemption takes every node) must be in [0, 1], got {self.p_all!r}")
        for name in ("notice_s", "return_after_s"):
            v = getattr(self, name)
            if not (math.isfinite(v) and v >= 0):
                raise ValueError(f"{name} must be seconds >= 0, got {v!r}")

    @property
    def label(self) -> str:
        """Short description for reports."""
        return f"{self.per_node_hour:g} preemptions per node-hour" + (f", {self.p_all:.0%} take all" if self.p_all else "")

    def max_nodes(self) -> None:
        """No limit."""
        return None

    def mtbf_s(self, nodes: int) -> float:
        """Mean seconds between the job's preemptions."""
        return 3600.0 / (self.per_node_hour * nodes) if self.per_node_hour > 0 else math.inf

    def events(self, nodes: int, horizon_s: float, seed: int) -> list[FailureEvent]:
        """Preemptions and returns before ``horizon_s`` for ``seed`` (pure)."""
        if self.per_node_hour == 0:
            return []
        gaps, targets, wide = rng_for(seed, "intervals"), rng_for(seed, "targets"), rng_for(seed, "all-nodes")
        mean = self.mtbf_s(nodes)
        back: dict[int, float] = {}
        out: list[FailureEvent] = []
        t = 0.0
        while True:
            t += exponential_interval(gaps.random(), mean)
            if t >= horizon_s:
                break
            all_nodes = wide.random() < self.p_all
            for n in [n for n, r in back.items() if r <= t]:
                del back[n]
            up = [n for n in range(nodes) if n not in back]
            if not up:
                continue
            hit = up if all_nodes else [pick_node(targets, up)]
            for n in hit:
                out.append(FailureEvent(time_s=t, kind="preempt", node=n, notice_s=self.notice_s))
                back[n] = t + self.return_after_s
                if back[n] < horizon_s:
                    out.append(FailureEvent(time_s=back[n], kind="return", node=n))
        return sort_events(out)
