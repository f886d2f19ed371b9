"""Multi-node training on Ray: the driver's controller, worker group and node checkpointers.

* :mod:`~cfdist.cluster.controller`: the state machine (recovering, running, finished, failed)
  with ``step()``; decisions are pure (:mod:`~cfdist.cluster.decisions`).
* :mod:`~cfdist.cluster.worker_group` / :mod:`~cfdist.cluster.worker`: one actor per rank,
  node by node, ``torch.distributed`` over a rendezvous on rank 0's node.
* :mod:`~cfdist.cluster.node_actor`: ``NodeCheckpointer``, one actor per node, persisting the
  node's snapshots to memory (/dev/shm), local disk and shared storage; peer copies.
* :mod:`~cfdist.cluster.context`: :class:`TrainContext`, what the training function sees.
* :mod:`~cfdist.cluster.injector`: executes a :mod:`cfdist.chaos` schedule against a run.
* :mod:`~cfdist.cluster.events` / :mod:`~cfdist.cluster.progress`: JSONL event log, progress bar.

Users call :func:`cfdist.fit` (``cfdist/api.py``); nothing here is needed directly.
"""

from cfdist.cluster.config import FitConfig
from cfdist.cluster.context import TrainContext
from cfdist.cluster.injector import AtStep, FailureInjector, StepSchedule
from cfdist.cluster.result import FailureStats, FitError, FitResult

__all__ = ["AtStep", "FailureInjector", "FailureStats", "FitConfig", "FitError", "FitResult", "StepSchedule",
           "TrainContext"]
