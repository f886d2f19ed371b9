"""Chaos: seeded failure schedules, trace replay, a discrete-event simulator and goodput metrics.

Everything here is pure (no clocks, no Ray) and imports nothing from :mod:`cfdist.cluster` or
:mod:`cfdist.api`. The injector that executes a schedule against a running ``cfdist.fit`` job
lives in :mod:`cfdist.cluster.injector`; the experiment runner that calls ``cfdist.fit`` lives
in :mod:`cfdist.experiments` (an entry point).

- :mod:`~cfdist.chaos.events`: :class:`FailureEvent`, the :class:`Schedule` protocol, seeded pickers.
- :mod:`~cfdist.chaos.schedules`: :class:`Exponential`, :class:`Weibull`, :class:`FixedInterval`.
- :mod:`~cfdist.chaos.replay`: :class:`TraceReplay` of the bundled (or your own) traces;
  :mod:`~cfdist.chaos.trace_io` reads and writes their formats.
- :mod:`~cfdist.chaos.simulator`: :func:`simulate` a policy against a schedule.
- :mod:`~cfdist.chaos.metrics`: the JSONL event-log schema and :func:`metrics_from_log`.
- :mod:`~cfdist.chaos.plots`: PNG figures (imports matplotlib; not imported here).
- The pure parts of :mod:`cfdist.experiments.experiment` (``cfdist experiment``, on Ray):
  :mod:`~cfdist.chaos.calibrate` (costs from event logs, prediction) and
  :mod:`~cfdist.chaos.report` (results.json, markdown tables, figures).

Example: what the AWS p3 spot trace costs an 8-node job under CheckFreq's k::

    from cfdist.chaos import Auto, Costs, EpochBoundary, TraceReplay, bundled_trace, compare

    trace = TraceReplay(bundled_trace("bamboo-p3-trace.csv"))
    costs = Costs(iter_s=0.5, stall_s=0.1, snapshot_s=1.8, persist_s=12.0,
                  restore_s=30.0, restart_s=60.0, detect_s=10.0)
    for r in compare(trace, [EpochBoundary(iters_per_epoch=7200), Auto()], costs=costs,
                     nodes=8, horizon_s=trace.span_s(8)):
        print(r.label, r.k, f"{r.goodput:.2f}", r.lost_iters_mean)
"""

from cfdist.chaos.events import FailureEvent, Schedule
from cfdist.chaos.metrics import (
    FailureRecord,
    RunMetrics,
    commit_latencies,
    event_log_from_metrics,
    metrics_from_log,
    parse_event_log,
    read_event_log,
)
from cfdist.chaos.replay import TraceReplay
from cfdist.chaos.schedules import Exponential, FixedInterval, Merged, Weibull
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
    "Merged",
    "RunMetrics",
    "Schedule",
    "SimResult",
    "TraceReplay",
    "Weibull",
    "bundled_trace",
    "compare",
    "commit_latencies",
    "event_log_from_metrics",
    "metrics_from_log",
    "parse_event_log",
    "read_event_log",
    "simulate",
]
