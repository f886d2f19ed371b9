"""Chaos: seeded failure schedules, trace replay, a discrete-event simulator and goodput metrics.

Everything here is pure (no clocks, no Ray). The injector that executes a schedule against a
running ``cfdist.fit`` job lives beside it and is the only part that touches processes.

- :mod:`~cfdist.chaos.events`: :class:`FailureEvent`, the :class:`Schedule` protocol, seeded pickers.
- :mod:`~cfdist.chaos.schedules`: :class:`Exponential`, :class:`Weibull`, :class:`FixedInterval`.
- :mod:`~cfdist.chaos.replay`: :class:`TraceReplay` of the bundled (or your own) traces;
  :mod:`~cfdist.chaos.trace_io` reads and writes their formats.
- :mod:`~cfdist.chaos.simulator`: :func:`simulate` a policy against a schedule.
- :mod:`~cfdist.chaos.metrics`: the JSONL event-log schema and :func:`metrics_from_log`.
- :mod:`~cfdist.chaos.plots`: PNG figures (imports matplotlib; not imported here).
"""

from cfdist.chaos.events import FailureEvent, Schedule
from cfdist.chaos.metrics import (
    FailureRecord,
    RunMetrics,
    event_log_from_metrics,
    metrics_from_log,
    parse_event_log,
    read_event_log,
)
from cfdist.chaos.replay import TraceReplay
from cfdist.chaos.schedules import Exponential, FixedInterval, Weibull
from cfdist.chaos.simulator import (
    Auto,
    Costs,
    EpochBoundary,
    FailureAware,
    FixedK,
    SimResult,
    compare,
    simulate,
)
from cfdist.chaos.trace_io import BUNDLED_TRACES, bundled_trace

__all__ = [
    "BUNDLED_TRACES",
    "Auto",
    "Costs",
    "EpochBoundary",
    "Exponential",
    "FailureAware",
    "FailureEvent",
    "FailureRecord",
    "FixedInterval",
    "FixedK",
    "RunMetrics",
    "Schedule",
    "SimResult",
    "TraceReplay",
    "Weibull",
    "bundled_trace",
    "compare",
    "event_log_from_metrics",
    "metrics_from_log",
    "parse_event_log",
    "read_event_log",
    "simulate",
]
