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

import dataclasses
import logging
import math
import os
import time
import uuid
import warnings
from typing import Callable

from cfdist.cluster.config import GROUP_OF, GROUPS, FitConfig, OutputOptions, RecoveryOptions, TierOptions
from cfdist.cluster.context import TrainContext
from cfdist.cluster.result import FitError, FitResult

__all__ = ["fit", "FitConfig", "FitError", "FitResult", "OutputOptions", "RecoveryOptions", "TierOptions",
           "TrainContext"]

log = logging.getLogger("cfdist.fit")


def fit(train_loop: Callable[[TrainContext], object], *, storage, num_nodes: int = 1,
        workers_per_node: int = 1, shared_storage: str | None = None, policy=None, preemption=None,
        max_failures: int = 10, run_name: str = "cfdist", use_gpu: bool = False, cpus_per_worker: float = 1.0,
        total_steps: int | None = None, tiers: TierOptions | None = None, recovery: RecoveryOptions | None = None,
        output: OutputOptions | None = None, ray_address: str | None = None,
        remove_node: Callable[[str], None] | None = None, add_node: Callable[[int], None] | None = None,
        **deprecated) -> FitResult:
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
            ``cfdist.cluster.injector.StepSchedule([...])``); None: no injected failures. A
            time schedule's clock starts when the first group has trained its first step.
        use_gpu: one GPU per rank, NCCL; otherwise CPU and gloo.
        cpus_per_worker: Ray CPUs reserved per rank (0 allowed: ranks are then placed by node
            affinity only).
        total_steps: shown in the progress bar (optional).
        tiers: :class:`TierOptions`: the memory, node-local and shared tiers (``memory_every``,
            ``shared_every``, ``shared_writers``, ``keep``, ``storage_options``, ...).
        recovery: :class:`RecoveryOptions`: ``min_nodes``, ``wait_for_nodes_s``,
            ``warm_spares``, ``sigterm_grace_s``, ``rendezvous_timeout_s``, ``metadata_url``.
        output: :class:`OutputOptions`: ``progress``, ``event_log``, ``log_dir``, ``poll_s``.
        ray_address: a cluster to attach to; default an existing ``ray.init()``, else
            ``$RAY_ADDRESS`` (set by ``ray job submit``), else ``num_nodes`` simulated Ray nodes
            started on this machine (each with its own local-disk directory: ``/{node}`` is
            appended to ``storage`` when missing), stopped at the end. The start says which.
        remove_node, add_node: how the injector takes a node away / brings one back (a test's
            ``ray.cluster_utils.Cluster``); default with simulated nodes: the simulated node's
            processes are killed and a fresh node joins at the schedule's return; on a real
            cluster: exclude the node and kill its actors.

    The grouped settings given one by one (``fit(shared_every=5)``, the spelling before the
    groups) still work, with a ``DeprecationWarning`` naming the group.
    """
    known = [k for k in deprecated if k in GROUP_OF]   # the others: a TypeError from FitConfig.build
    if known:
        warnings.warn(f"cfdist.fit({', '.join(f'{k}=' for k in known)}) is deprecated: pass "
                      + ", ".join(sorted({f"{GROUP_OF[k]}=cfdist.{GROUPS[GROUP_OF[k]].__name__}({k}=...)"
                                          for k in known})), DeprecationWarning, stacklevel=2)
    config = FitConfig.build(storage=storage, shared_storage=shared_storage, num_nodes=num_nodes,
                             workers_per_node=workers_per_node, use_gpu=use_gpu, cpus_per_worker=cpus_per_worker,
                             max_failures=max_failures, run_name=run_name, tiers=tiers, recovery=recovery,
                             output=output, flat=deprecated)
    if policy is None:
        from cfdist.policy import Auto

        policy = Auto()
    if config.memory_every:
        from cfdist.policy.memory import MemoryEvery

        policy = MemoryEvery(policy, config.memory_every)
    config, local, attached = _connect(ray_address, config)
    try:   # whatever fails from here on, the nodes started or the connection made are ended
        return _run(config, local, train_loop, policy, preemption, total_steps, remove_node, add_node)
    finally:
        _disconnect(local, attached)


def _run(config: FitConfig, local, train_loop, policy, preemption, total_steps, remove_node, add_node) -> FitResult:
    """The run on a connected Ray: event log, backend, injector, controller; closes what it opened."""
    from cfdist.cluster.controller import Controller
    from cfdist.cluster.events import EventLog
    from cfdist.cluster.injector import FailureInjector
    from cfdist.cluster.progress import ProgressDisplay
    from cfdist.cluster.ray_backend import RayBackend

    if local is not None and preemption is not None and remove_node is None and add_node is None:
        remove_node, add_node = local.remove_node, local.add_node   # a preemption takes a real (simulated) node
    run_id = f"{config.run_name}-{uuid.uuid4().hex[:8]}"
    path = config.event_log or os.path.join("cfdist-runs", config.run_name,
                                            f"events-{time.strftime('%Y%m%d-%H%M%S')}-{run_id[-8:]}.jsonl")
    if config.log_dir is None:   # the documented default: beside the event log
        config = dataclasses.replace(
            config, log_dir=os.path.join(os.path.dirname(os.path.abspath(path)), f"logs-{run_id[-8:]}"))
    events = EventLog(path)
    backend = injector = None
    try:
        if local is not None:
            _say(events, "cluster", f"no RAY_ADDRESS: started {local.num_nodes} simulated Ray node(s) on this "
                                    f"machine ({local.cpus_per_node} CPU each), local disks {', '.join(config.storage)}",
                 simulated=True, nodes=local.num_nodes, cpus_per_node=local.cpus_per_node,
                 storage=list(config.storage))
        backend = RayBackend(config, run_id=run_id, train_fn=train_loop, policy=policy)
        if preemption is not None:
            injector = FailureInjector(preemption, num_nodes=config.num_nodes, backend=backend,
                                       remove_node=remove_node, add_node=add_node)
        controller = Controller(config, backend, events, injector=injector)
        with ProgressDisplay(events, total_steps=total_steps, enabled=config.progress):
            result = controller.run()
        for r in result.skipped_injections:
            log.warning("injected failure not executed: %s", r.get("reason"))
        return result
    finally:
        try:
            if injector is not None:
                injector.close()   # nodes still joining are waited for
        finally:
            if backend is not None:
                backend.close()
            events.close()


def _say(events, event: str, text: str, **fields) -> None:
    """A line for the user: in the event log (the progress bar prints it) and the logger."""
    events.emit(event, message=text, **fields)
    log.info("%s", text)


def _connect(address: str | None, config: FitConfig):
    """Attach to a cluster, or start simulated nodes here. Returns ``(config, local cluster or
    None, whether this call connected to ``address``)``; :func:`_disconnect` undoes it.

    An initialised Ray (the user's ``ray.init()``, a test's cluster) is used as it is and left
    running; ``address`` / ``$RAY_ADDRESS`` is connected to (and disconnected from at the end).
    Otherwise ``config.num_nodes`` simulated nodes start on this machine
    (:class:`~cfdist.cluster.local_cluster.LocalCluster`), each with its own local-disk
    directory: ``/{node}`` is appended to ``storage`` roots that lack ``{node}`` (the returned
    config says so; the start message names the directories).
    """
    import ray

    from cfdist.cluster.config import NODE_PLACEHOLDER
    from cfdist.cluster.local_cluster import LocalCluster

    if ray.is_initialized():
        return config, None, False
    address = address or os.environ.get("RAY_ADDRESS")
    if address:
        ray.init(address=address, ignore_reinit_error=True, log_to_driver=True)
        return config, None, True
    if config.num_nodes > 1 and config.local_tier:
        roots = tuple(u if NODE_PLACEHOLDER in u else f"{u.rstrip('/')}/{NODE_PLACEHOLDER}" for u in config.storage)
        config = dataclasses.replace(config, storage=roots)
    cpus = max(1, math.ceil(config.workers_per_node * config.cpus_per_worker))
    return config, LocalCluster(num_nodes=config.num_nodes, cpus_per_node=cpus, log_to_driver=True).start(), False


def _disconnect(local, attached: bool) -> None:
    """End what :func:`_connect` started: stop the simulated nodes, or leave the cluster fit
    connected to; a Ray the caller had initialised stays as it was. ``fit`` can then be called
    again in this process, any number of times."""
    if local is not None:
        local.close()
    elif attached:
        import ray

        ray.shutdown()
