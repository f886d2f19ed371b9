"""Chaos: seeded failure schedules and trace replay. Pure: no clocks, no Ray."""

from cfdist.chaos.events import FailureEvent, Schedule
from cfdist.chaos.replay import TraceReplay
from cfdist.chaos.schedules import Exponential, FixedInterval, Weibull
from cfdist.chaos.trace_io import BUNDLED_TRACES, bundled_trace

__all__ = [
    "BUNDLED_TRACES",
    "Exponential",
    "FailureEvent",
    "FixedInterval",
    "Schedule",
    "TraceReplay",
    "Weibull",
    "bundled_trace",
]
