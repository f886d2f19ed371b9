"""Read and write the three preemption-trace formats, exactly as they appear on disk.

=============  ==========================================  ====================================
format         one line                                    record
=============  ==========================================  ====================================
``events``     ``480000,add,node1``                        :class:`NodeEvent` (cluster
                                                           membership: a VM joins or leaves)
``pool``       ``2021-12-11, 11:11:30, 55``                :class:`PoolSample` (how many VMs the
                                                           pool held at that moment)
``lifetimes``  ``us-east1-b,n1-highcpu-4,2363.482,...``    :class:`VmLifetime` (one VM's life,
               (after a header line)                       start to preemption)
=============  ==========================================  ====================================

``parse_*`` take the text and return records; ``format_*`` return text that parses back to
equal records (for the bundled files, the very same bytes). Malformed lines raise ValueError
naming the source, the line number and the expected shape. No interpretation happens here:
turning records into failure events is :mod:`cfdist.chaos.replay`'s job.
"""

from __future__ import annotations

import datetime as _dt
import math
from dataclasses import dataclass
from importlib import resources
from typing import Literal

TraceFormat = Literal["events", "pool", "lifetimes"]
LIFETIMES_HEADER = "zone,machine_type,lifetime_s,day_of_week,hour_of_day,preempted"
_POOL_TIME = "%Y-%m-%d, %H:%M:%S"

BUNDLED_TRACES: tuple[str, ...] = (
    "bamboo-p3-trace.csv",
    "bamboo-g4dn-trace.csv",
    "bamboo-a100x1-east1b.txt",
    "bamboo-v100x1-east1c.txt",
    "gcp-preemptible-lifetimes.csv",
)
"""Trace files shipped in ``cfdist/chaos/traces/`` (sources and licenses in its README.md)."""


def bundled_trace(name: str) -> str:
    """Filesystem path of a bundled trace, e.g. ``bundled_trace("bamboo-p3-trace.csv")``."""
    if name not in BUNDLED_TRACES:
        raise ValueError(f"no bundled trace {name!r}; the bundled ones are {', '.join(BUNDLED_TRACES)}")
    return str(resources.files("cfdist.chaos") / "traces" / name)


@dataclass(frozen=True, kw_only=True)
class NodeEvent:
    """A VM joining or leaving the cluster (``events`` format)."""

    time_ms: int
    """Milliseconds from the start of the trace."""
    action: Literal["add", "remove"]
    """``"add"``: the VM joined; ``"remove"``: it was preempted."""
    node: str
    """The VM's name in the trace (``"node17"``); unique per VM."""

    def __post_init__(self) -> None:
        if not isinstance(self.time_ms, int) or self.time_ms < 0:
            raise ValueError(f"NodeEvent.time_ms must be an int >= 0 (ms from trace start), got {self.time_ms!r}")
        if self.action not in ("add", "remove"):
            raise ValueError(f"NodeEvent.action must be 'add' or 'remove', got {self.action!r}")
        if not self.node or "," in self.node or self.node != self.node.strip():
            raise ValueError(f"NodeEvent.node must be a non-empty name without commas or spaces around, got {self.node!r}")


@dataclass(frozen=True, kw_only=True)
class PoolSample:
    """How many VMs a spot pool held at one moment (``pool`` format)."""

    time: _dt.datetime
    """Wall-clock time of the observation (naive, as in the file; whole seconds)."""
    size: int
    """Number of VMs in the pool."""

    def __post_init__(self) -> None:
        if not isinstance(self.size, int) or self.size < 0:
            raise ValueError(f"PoolSample.size must be an int >= 0, got {self.size!r}")


@dataclass(frozen=True, kw_only=True)
class VmLifetime:
    """One preemptible VM's lifetime (``lifetimes`` format)."""

    zone: str
    """Cloud zone, e.g. ``"us-east1-b"``."""
    machine_type: str
    """Machine type, e.g. ``"n1-highcpu-16"``."""
    lifetime_s: float
    """Seconds from start to the end of the VM."""
    day_of_week: str
    """Day the VM started (``"Monday"`` ...)."""
    hour_of_day: int
    """Hour the VM started, 0..23."""
    preempted: bool
    """The source's ``preempted`` flag."""

    def __post_init__(self) -> None:
        if not (math.isfinite(self.lifetime_s) and self.lifetime_s > 0):
            raise ValueError(f"VmLifetime.lifetime_s must be a finite number of seconds > 0, got {self.lifetime_s!r}")
        if not 0 <= self.hour_of_day <= 23:
            raise ValueError(f"VmLifetime.hour_of_day must be 0..23, got {self.hour_of_day!r}")


def _lines(text: str) -> list[tuple[int, str]]:
    return [(i, line) for i, line in enumerate(text.splitlines(), 1) if line.strip()]


def _bad(source: str, lineno: int, line: str, want: str, why: Exception | str) -> ValueError:
    return ValueError(f"{source}:{lineno}: expected {want}, got {line!r} ({why})")


def parse_node_events(text: str, *, source: str = "<text>") -> list[NodeEvent]:
    """Records of an ``events`` trace, in file order (time_ms, add|remove, name)."""
    out = []
    for lineno, line in _lines(text):
        try:
            t, action, node = line.strip().split(",")
            out.append(NodeEvent(time_ms=int(t), action=action, node=node))  # type: ignore[arg-type]
        except ValueError as e:
            raise _bad(source, lineno, line, "'time_ms,add|remove,nodeN'", e) from None
    return out


def format_node_events(events: list[NodeEvent]) -> str:
    """Text of an ``events`` trace (one line per event, LF endings)."""
    return "".join(f"{e.time_ms},{e.action},{e.node}\n" for e in events)


def parse_pool_sizes(text: str, *, source: str = "<text>") -> list[PoolSample]:
    """Records of a ``pool`` trace, in file order (timestamps may go backwards; see replay)."""
    out = []
    for lineno, line in _lines(text):
        try:
            stamp, size = line.strip().rsplit(", ", 1)
            out.append(PoolSample(time=_dt.datetime.strptime(stamp, _POOL_TIME), size=int(size)))
        except ValueError as e:
            raise _bad(source, lineno, line, "'YYYY-MM-DD, HH:MM:SS, n'", e) from None
    return out


def format_pool_sizes(samples: list[PoolSample]) -> str:
    """Text of a ``pool`` trace."""
    return "".join(f"{s.time.strftime(_POOL_TIME)}, {s.size}\n" for s in samples)


def parse_lifetimes(text: str, *, source: str = "<text>") -> list[VmLifetime]:
    """Records of a ``lifetimes`` trace (the header line is required)."""
    lines = _lines(text)
    if not lines or lines[0][1].strip() != LIFETIMES_HEADER:
        got = lines[0][1] if lines else ""
        raise ValueError(f"{source}:1: expected the header {LIFETIMES_HEADER!r}, got {got!r}")
    out = []
    for lineno, line in lines[1:]:
        try:
            zone, mtype, life, day, hour, pre = line.strip().split(",")
            if pre not in ("True", "False"):
                raise ValueError(f"preempted must be True or False, not {pre!r}")
            out.append(
                VmLifetime(zone=zone, machine_type=mtype, lifetime_s=float(life), day_of_week=day,
                           hour_of_day=int(hour), preempted=pre == "True")
            )
        except ValueError as e:
            raise _bad(source, lineno, line, f"'{LIFETIMES_HEADER}'", e) from None
    return out


def format_lifetimes(rows: list[VmLifetime]) -> str:
    """Text of a ``lifetimes`` trace, header first; floats in shortest round-trip form."""
    body = "".join(
        f"{r.zone},{r.machine_type},{r.lifetime_s!r},{r.day_of_week},{r.hour_of_day},{r.preempted}\n" for r in rows
    )
    return LIFETIMES_HEADER + "\n" + body


def detect_format(text: str) -> TraceFormat:
    """Which of the three formats ``text`` is in, from its first non-empty line."""
    first = next((line.strip() for _, line in _lines(text)), "")
    if first == LIFETIMES_HEADER:
        return "lifetimes"
    parts = first.split(",")
    if len(parts) == 3 and parts[1] in ("add", "remove"):
        return "events"
    if len(parts) == 3 and len(parts[0]) == 10 and parts[0].count("-") == 2:
        return "pool"
    raise ValueError(
        f"cannot tell the trace format from its first line {first!r}; expected 'time_ms,add|remove,nodeN', "
        f"'YYYY-MM-DD, HH:MM:SS, n' or the header {LIFETIMES_HEADER!r} (or pass format=...)"
    )


def read_text(path: str) -> str:
    """A trace file's text (UTF-8)."""
    with open(path, encoding="utf-8") as f:
        return f.read()
