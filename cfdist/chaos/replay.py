"""Replay a real preemption trace as failure events for a job of ``num_nodes`` nodes.

How a trace's VMs map to the job (the same rule for the two cluster formats):

- The job owns ``num_nodes`` **slots** (node ids ``0..num_nodes-1`` in the events). The trace is
  a pool of VMs; the job runs on ``num_nodes`` of them and the rest are spares.
- **Start**: schedule time 0 is trace time ``start_s``, or, when that is None, the first trace
  instant at which the pool holds at least ``num_nodes`` VMs (after every line at that instant).
  The slots then take the VMs that joined earliest (slot 0 the oldest).
- **Removal of a slot's VM**: a ``"preempt"`` of that slot (``notice_s`` before it, if set). If a
  spare exists, the oldest spare takes the slot at once: a ``"return"`` of that slot at the same
  instant (the job still fails: its ranks there died). Removal of a spare: no event.
- **A VM joins**: it fills the lowest empty slot (a ``"return"``), else it becomes a spare.
- Hence at every instant ``up slots == min(num_nodes, pool size)``: the job needs all its slots
  and, in the simulator, pauses while some are empty (a fixed-size job, not an elastic one).

Per format:

- ``events`` (``time_ms,add|remove,nodeN``): exactly the rule above.
- ``pool`` (pool size over time): the pool's VMs are anonymous, so a drop by ``d`` removes ``d``
  VMs chosen uniformly at random (from ``seed``) among those present; a rise adds fresh VMs. The
  files log each observation about three times a minute apart, so timestamps can go backwards:
  rows are read in file order and a change of size takes effect at its row's time, or at the
  previous change's time if that is later. Trace time 0 is the first row's time.
- ``lifetimes`` (VM lifetimes to sample from): each slot runs a VM whose lifetime is drawn (from
  ``seed``) from the rows that pass the filters; at its end the slot is preempted, and
  ``replacement_delay_s`` later a new VM (a new draw) returns to it. All slots start fresh at 0.

Times: every duration in this config is in **trace seconds**; events come out multiplied by
``time_scale`` (``time_scale=1/3600`` replays a trace hour in one second).
"""

from __future__ import annotations

import heapq
import math
import os
from dataclasses import dataclass, field
from typing import Literal

from cfdist.chaos.events import FailureEvent, check_job_args, pick_distinct, rng_for, uniform_index
from cfdist.chaos.trace_io import (
    BUNDLED_TRACES,
    NodeEvent,
    PoolSample,
    VmLifetime,
    detect_format,
    parse_lifetimes,
    parse_node_events,
    parse_pool_sizes,
    read_text,
)

Membership = list[tuple[float, str, str]]
"""``(trace_s, "add"|"remove", vm_name)`` in the order they happen."""


def membership_from_node_events(events: list[NodeEvent]) -> Membership:
    """``events``-format records as membership changes (stable-sorted by time)."""
    return sorted(((e.time_ms / 1000.0, e.action, e.node) for e in events), key=lambda m: m[0])


def membership_from_pool_sizes(samples: list[PoolSample], *, seed: int) -> Membership:
    """``pool``-format records as membership changes of anonymous VMs ``pool-0, pool-1, ...``.

    Which VMs leave on a drop is drawn from ``seed`` (one draw per VM removed).
    """
    if not samples:
        return []
    rng = rng_for(seed, "pool-victims")
    t0 = samples[0].time
    present: list[str] = []
    made = 0
    out: Membership = []
    last_change = 0.0
    prev_size = 0
    for s in samples:
        if s.size == prev_size:
            continue
        t = max((s.time - t0).total_seconds(), last_change)
        last_change = t
        if s.size > prev_size:
            for _ in range(s.size - prev_size):
                name = f"pool-{made}"
                made += 1
                present.append(name)
                out.append((t, "add", name))
        else:
            for name in pick_distinct(rng, present, prev_size - s.size):
                present.remove(name)
                out.append((t, "remove", name))
        prev_size = s.size
    return out


def pool_size_series(membership: Membership) -> list[tuple[float, int]]:
    """``(trace_s, pool size after that instant)`` at each instant the pool changes."""
    out: list[tuple[float, int]] = []
    size = 0
    for t, action, _ in membership:
        size += 1 if action == "add" else -1
        if out and out[-1][0] == t:
            out[-1] = (t, size)
        else:
            out.append((t, size))
    return out


def _start_time(membership: Membership, num_nodes: int, start_s: float | None) -> float:
    series = pool_size_series(membership)
    if start_s is None:
        for t, size in series:
            if size >= num_nodes:
                return t
        most = max((s for _, s in series), default=0)
        raise ValueError(
            f"the trace never holds {num_nodes} VMs at once (at most {most}); "
            f"replay it for a job of at most {most} nodes"
        )
    size = 0
    for t, s in series:
        if t > start_s:
            break
        size = s
    if size < num_nodes:
        raise ValueError(
            f"at trace second {start_s} the pool holds {size} VMs, fewer than the job's {num_nodes} nodes; "
            f"pass start_s=None to start at the first instant it holds {num_nodes}, or a smaller num_nodes"
        )
    return start_s


def slot_events(
    membership: Membership,
    *,
    num_nodes: int,
    start_s: float | None,
    time_scale: float,
    notice_s: float,
    horizon_s: float,
) -> list[FailureEvent]:
    """Failure events of the job's slots under the mapping in this module's docstring. Pure."""
    t_start = _start_time(membership, num_nodes, start_s)
    present: dict[str, None] = {}  # insertion order == join order
    i = 0
    while i < len(membership) and membership[i][0] <= t_start:
        _, action, name = membership[i]
        if action == "add":
            present[name] = None
        else:
            present.pop(name, None)
        i += 1
    slots: list[str | None] = list(present)[:num_nodes]
    spares: dict[str, None] = dict.fromkeys(list(present)[num_nodes:])
    where = {name: s for s, name in enumerate(slots)}
    out: list[FailureEvent] = []
    for t_trace, action, name in membership[i:]:
        t = (t_trace - t_start) * time_scale
        if t >= horizon_s:
            break
        if action == "add":
            if None in slots:
                s = slots.index(None)
                slots[s], where[name] = name, s
                out.append(FailureEvent(time_s=t, kind="return", node=s))
            else:
                spares[name] = None
        elif name in where:
            s = where.pop(name)
            out.append(FailureEvent(time_s=t, kind="preempt", node=s, notice_s=notice_s * time_scale))
            slots[s] = None
            if spares:
                spare = next(iter(spares))
                del spares[spare]
                slots[s], where[spare] = spare, s
                out.append(FailureEvent(time_s=t, kind="return", node=s))
        else:
            spares.pop(name, None)
    return out


def lifetime_events(
    lifetimes: list[float],
    *,
    num_nodes: int,
    seed: int,
    time_scale: float,
    notice_s: float,
    replacement_delay_s: float,
    horizon_s: float,
) -> list[FailureEvent]:
    """Per-slot renewal: preempt after a drawn lifetime, return ``replacement_delay_s`` later."""
    if not lifetimes:
        raise ValueError("no VM lifetimes to sample from; loosen the zone/machine_type/preempted filters")
    if not math.isfinite(horizon_s):
        raise ValueError("sampled VM lifetimes never run out of events; pass a finite horizon_s")
    rng = rng_for(seed, "lifetimes")
    heap: list[tuple[float, int, int, str]] = []  # (time, seq, slot, kind)
    seq = 0
    for slot in range(num_nodes):
        heapq.heappush(heap, (lifetimes[uniform_index(rng, len(lifetimes))] * time_scale, seq, slot, "preempt"))
        seq += 1
    out: list[FailureEvent] = []
    while heap and heap[0][0] < horizon_s:
        t, _, slot, kind = heapq.heappop(heap)
        if kind == "preempt":
            out.append(FailureEvent(time_s=t, kind="preempt", node=slot, notice_s=notice_s * time_scale))
            heapq.heappush(heap, (t + replacement_delay_s * time_scale, seq, slot, "return"))
        else:
            out.append(FailureEvent(time_s=t, kind="return", node=slot))
            life = lifetimes[uniform_index(rng, len(lifetimes))]
            heapq.heappush(heap, (t + life * time_scale, seq, slot, "preempt"))
        seq += 1
    return out


@dataclass(frozen=True, kw_only=True)
class TraceReplay:
    """Failure events replayed from a trace file (any of the three formats).

    ``TraceReplay(bundled_trace("bamboo-p3-trace.csv"), time_scale=1/3600, notice_s=120)``.
    ``events()`` reads the file each call (they are small) and is otherwise pure. The mapping
    from the trace's VMs to the job's node slots is in this module's docstring.
    """

    path: str = field(kw_only=False)
    """Trace file; ``cfdist.chaos.bundled_trace(name)`` gives the path of a bundled one."""
    time_scale: float = 1.0
    """Schedule seconds per trace second (1/3600: a trace hour becomes a second)."""
    notice_s: float = 0.0
    """Preemption notice in trace seconds (AWS spot gives 120, GCP 30); 0: none."""
    seed: int = 0
    """Seed for the random parts: which VMs leave a pool, which lifetimes are drawn."""
    format: Literal["auto", "events", "pool", "lifetimes"] = "auto"
    """File format; ``"auto"`` detects it from the first line."""
    start_s: float | None = None
    """Trace second that becomes time 0 (cluster formats); None: first instant with enough VMs."""
    replacement_delay_s: float = 0.0
    """Lifetimes format: trace seconds from a preemption until the slot's new VM is up."""
    zone: str | None = None
    """Lifetimes format: sample only VMs of this zone (None: all)."""
    machine_type: str | None = None
    """Lifetimes format: sample only VMs of this machine type (None: all)."""
    preempted: bool | None = None
    """Lifetimes format: sample only rows with this ``preempted`` flag (None: all)."""

    def __post_init__(self) -> None:
        if not isinstance(self.path, str) or not os.path.isfile(self.path):
            raise ValueError(
                f"TraceReplay.path {self.path!r} is not a file; pass a path, or "
                f"cfdist.chaos.bundled_trace(name) for one of {', '.join(BUNDLED_TRACES)}"
            )
        if not (math.isfinite(self.time_scale) and self.time_scale > 0):
            raise ValueError(f"TraceReplay.time_scale must be > 0 (schedule s per trace s), got {self.time_scale!r}")
        for name in ("notice_s", "replacement_delay_s"):
            v = getattr(self, name)
            if not (math.isfinite(v) and v >= 0):
                raise ValueError(f"TraceReplay.{name} must be trace seconds >= 0, got {v!r}")
        if self.format not in ("auto", "events", "pool", "lifetimes"):
            raise ValueError(f"TraceReplay.format must be 'auto', 'events', 'pool' or 'lifetimes', got {self.format!r}")
        if self.start_s is not None and not (math.isfinite(self.start_s) and self.start_s >= 0):
            raise ValueError(f"TraceReplay.start_s must be trace seconds >= 0 or None, got {self.start_s!r}")

    def trace_format(self) -> str:
        """The file's format (``format`` unless it is ``"auto"``)."""
        return detect_format(read_text(self.path)) if self.format == "auto" else self.format

    def membership(self) -> Membership:
        """The file as membership changes in trace seconds (cluster formats only)."""
        text, fmt = read_text(self.path), self.trace_format()
        if fmt == "events":
            return membership_from_node_events(parse_node_events(text, source=self.path))
        if fmt == "pool":
            return membership_from_pool_sizes(parse_pool_sizes(text, source=self.path), seed=self.seed)
        raise ValueError(f"{self.path} holds VM lifetimes, not cluster membership; only events() applies")

    def lifetimes_s(self) -> list[float]:
        """The lifetimes (trace seconds) that pass the filters, in file order (lifetimes format)."""
        rows: list[VmLifetime] = parse_lifetimes(read_text(self.path), source=self.path)
        return [
            r.lifetime_s
            for r in rows
            if (self.zone is None or r.zone == self.zone)
            and (self.machine_type is None or r.machine_type == self.machine_type)
            and (self.preempted is None or r.preempted == self.preempted)
        ]

    def span_s(self, num_nodes: int) -> float | None:
        """Schedule seconds from time 0 to the trace's last change (None for lifetimes)."""
        if self.trace_format() == "lifetimes":
            return None
        m = self.membership()
        return (m[-1][0] - _start_time(m, num_nodes, self.start_s)) * self.time_scale

    def events(self, num_nodes: int, horizon_s: float) -> list[FailureEvent]:
        """Failure events of a ``num_nodes``-node job before ``horizon_s`` (schedule seconds)."""
        check_job_args(num_nodes, horizon_s)
        if self.trace_format() == "lifetimes":
            return lifetime_events(
                self.lifetimes_s(), num_nodes=num_nodes, seed=self.seed, time_scale=self.time_scale,
                notice_s=self.notice_s, replacement_delay_s=self.replacement_delay_s, horizon_s=horizon_s,
            )
        return slot_events(
            self.membership(), num_nodes=num_nodes, start_s=self.start_s, time_scale=self.time_scale,
            notice_s=self.notice_s, horizon_s=horizon_s,
        )
