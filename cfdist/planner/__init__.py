"""``cfdist plan``: what a training run will cost on spot machines, and which settings make it cheapest.

- :mod:`~cfdist.planner.job`: :class:`Job` (step time, steps, checkpoint costs; from an event
  log, a ``cfdist bench`` result, or given).
- :mod:`~cfdist.planner.prices`: :class:`Prices` from a YAML file (a dated example ships).
- :mod:`~cfdist.planner.failures`: :class:`TraceFailures` (bundled traces, any trace file,
  SkyPilot spot-traces JSON) and :class:`RateFailures` (a rate per node-hour).
- :mod:`~cfdist.planner.model`: the cost model of one candidate under one schedule (its
  assumptions are listed there), on top of :func:`cfdist.chaos.simulate`.
- :mod:`~cfdist.planner.evaluate`: :func:`plan` over the candidate grid and the seeds.
- :mod:`~cfdist.planner.output`: the table, the recommendation, JSON and the PNG.
- :mod:`~cfdist.planner.cli`: the ``cfdist plan`` command.

Example::

    import cfdist
    from cfdist.planner import Job, RateFailures

    job = Job(iter_s=0.8, steps=100_000, state_bytes=40 * 10**9, nodes=(2, 4, 8), ref_nodes=4,
              stall_s=0.2, persist_s=30.0, restore_s=20.0)
    result = cfdist.plan(job, failures=RateFailures(per_node_hour=0.1, notice_s=30.0),
                         instance="gpu-8x-a100", deadline_h=24.0)
    print(result.best.name, result.best.dollars)
"""

from cfdist.planner.failures import RateFailures, TraceFailures, parse_skypilot, resolve_trace
from cfdist.planner.job import Job
from cfdist.planner.model import Candidate, Outcome
from cfdist.planner.evaluate import PlanResult, PlanRow, grid, plan
from cfdist.planner.prices import InstancePrice, Prices, example_prices_path, load_prices, parse_prices

__all__ = [
    "Candidate", "InstancePrice", "Job", "Outcome", "PlanResult", "PlanRow", "Prices", "RateFailures",
    "TraceFailures", "example_prices_path", "grid", "load_prices", "parse_prices", "parse_skypilot", "plan",
    "resolve_trace",
]
