"""``cfdist.fit``: run a training function on Ray, checkpointed, surviving failures.

::

    result = cfdist.fit(
        train_loop,                        # def train_loop(ctx: cfdist.TrainContext) -> None
        num_nodes=2, workers_per_node=2, use_gpu=False,
        storage="file:///mnt/local-ssd/cfdist",   # node-local tier (one or several roots)
        shared_storage="s3://bucket/runs",        # optional durable tier
        policy=None,                              # default cfdist.Auto()
        preemption=None,                          # a failure schedule (cfdist.chaos)
        max_failures=10, run_name="resnet-spot",
    )
    print(result.final_step, result.failures, result.lost_iterations, result.checkpoint)

This module only wires arguments to components: :class:`~cfdist.cluster.config.FitConfig`,
:class:`~cfdist.cluster.ray_backend.RayBackend`, :class:`~cfdist.cluster.controller.Controller`,
the event log, the progress bar and the failure injector.
"""

from __future__ import annotations

import logging
import os
import time
import uuid
from typing import Callable

from cfdist.cluster.config import FitConfig
from cfdist.cluster.context import TrainContext
from cfdist.cluster.result import FitError, FitResult

__all__ = ["fit", "FitConfig", "FitError", "FitResult", "TrainContext"]

log = logging.getLogger("cfdist.fit")


def fit(train_loop: Callable[[TrainContext], object], *, storage, num_nodes: int = 1,
        workers_per_node: int = 1, use_gpu: bool = False, shared_storage: str | None = None,
        policy=None, preemption=None, max_failures: int = 10, run_name: str = "cfdist",
        total_steps: int | None = None, ray_address: str | None = None,
        remove_node: Callable[[str], None] | None = None, add_node: Callable[[int], None] | None = None,
        **options) -> FitResult:
    """Train ``train_loop`` on ``num_nodes`` x ``workers_per_node`` Ray actors until it returns.

    Blocks the calling (driver) process until the run finishes; raises :class:`FitError` after
    more than ``max_failures`` failures or when too few nodes stay usable.

    Args:
        train_loop: ``train_loop(ctx)``, run on every rank with ``torch.distributed`` initialised;
            build the state, ``ckpt = ctx.checkpointer(state)``, ``ckpt.restore()``, train.
            Must be picklable (a module-level function, or a closure cloudpickle can carry).
        storage: node-local checkpoint directory (``file://``; same path on every node; ``{node}``
            in it is replaced by the node's name, see :mod:`cfdist.cluster.nodes`).
        shared_storage: durable tier every node can reach (``s3://``, ``gs://``, NFS), optional.
        policy: when to checkpoint (``cfdist.Every(k)``, ``cfdist.Auto()`` - the default).
        preemption: a failure schedule to inject (``cfdist.chaos.FixedInterval(...)``,
            ``cfdist.cluster.injector.StepSchedule([...])``); None: no injected failures.
        total_steps: shown in the progress bar (optional).
        ray_address: a cluster to attach to; default ``$RAY_ADDRESS`` (set by ``ray job submit``),
            else an existing ``ray.init()``, else a new local Ray instance (stopped at the end).
        remove_node, add_node: how the injector takes a node away / brings one back (a test's
            ``ray.cluster_utils.Cluster``); default: exclude the node and kill its actors.
        **options: any other :class:`FitConfig` field (``min_nodes``, ``shared_every``,
            ``cpus_per_worker``, ``event_log``, ``progress``, ``storage_options``, ...).
    """
    import ray

    from cfdist.cluster.controller import Controller
    from cfdist.cluster.events import EventLog
    from cfdist.cluster.injector import FailureInjector
    from cfdist.cluster.progress import ProgressDisplay
    from cfdist.cluster.ray_backend import RayBackend

    config = FitConfig(storage=storage, shared_storage=shared_storage, num_nodes=num_nodes,
                       workers_per_node=workers_per_node, use_gpu=use_gpu, max_failures=max_failures,
                       run_name=run_name, **options)
    if policy is None:
        from cfdist.policy import Auto

        policy = Auto()
    started_ray = _ensure_ray(ray_address, config)
    run_id = f"{config.run_name}-{uuid.uuid4().hex[:8]}"
    path = config.event_log or os.path.join("cfdist-runs", config.run_name,
                                            f"events-{time.strftime('%Y%m%d-%H%M%S')}-{run_id[-8:]}.jsonl")
    events = EventLog(path)
    backend = RayBackend(config, run_id=run_id, train_fn=train_loop, policy=policy)
    injector = None
    if preemption is not None:
        injector = FailureInjector(preemption, num_nodes=config.num_nodes, backend=backend,
                                   remove_node=remove_node, add_node=add_node)
    controller = Controller(config, backend, events, injector=injector)
    try:
        with ProgressDisplay(events, total_steps=total_steps, enabled=config.progress):
            return controller.run()
    finally:
        backend.close()
        events.close()
        if started_ray:
            ray.shutdown()


def _ensure_ray(address: str | None, config: FitConfig) -> bool:
    """Connect to (or start) Ray; True when this call started a local instance."""
    import ray

    if ray.is_initialized():
        return False
    address = address or os.environ.get("RAY_ADDRESS")
    if address:
        ray.init(address=address, ignore_reinit_error=True, log_to_driver=True)
        return False
    # A fresh local instance (never another user's cluster found on this machine).
    need = config.world_size * config.cpus_per_worker
    ray.init(address="local", include_dashboard=False, _node_ip_address="127.0.0.1",
             num_cpus=max(int(need + 0.999), os.cpu_count() or 1), num_gpus=None,
             configure_logging=True, logging_level=logging.WARNING)
    return True
