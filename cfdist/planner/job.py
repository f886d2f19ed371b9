"""The job to plan: how long a step takes, how many steps, what a checkpoint costs. Pure.

A :class:`Job` holds numbers measured on a short real run (:meth:`Job.from_event_log` reads a
``cfdist.fit`` event log, :meth:`Job.from_bench` a ``cfdist bench`` ``results.json``) or given
by hand. The planner turns it into the simulator's :class:`~cfdist.chaos.simulator.Costs` for
each candidate (:mod:`cfdist.planner.model`).
"""

from __future__ import annotations

import json
import statistics
from dataclasses import dataclass

from cfdist.chaos.calibrate import iteration_time, measure_costs, training_window, window_metrics
from cfdist.chaos.metrics import read_event_log
from cfdist.chaos.simulator import Costs, check_number


@dataclass(frozen=True, kw_only=True)
class Job:
    """A data-parallel training job, as the planner sees it."""

    iter_s: float
    """Seconds per training step (no checkpoint) on ``ref_nodes`` nodes."""
    steps: int
    """Steps to train (the job is done when step ``steps`` finishes)."""
    state_bytes: int
    """Bytes of one checkpoint before codecs (model + optimizer state; every node holds it all)."""
    nodes: tuple[int, ...] = (1,)
    """Node counts to consider."""
    ref_nodes: int = 1
    """Node count ``iter_s`` was measured on."""
    ranks_per_node: int = 1
    """Ranks (GPUs) per node."""
    scaling: float = 1.0
    """How a step's time scales with nodes: ``iter_s(n) = iter_s * (ref_nodes / n) ** scaling``
    (1: perfect strong scaling of a fixed global batch; 0: no speed-up)."""
    stall_s: float = 0.0
    """Seconds training is blocked per checkpoint (measured: ``Costs.stall_s``)."""
    persist_s: float | None = None
    """Checkpoint start to commit on node-local storage, seconds. None (not measured, not
    given): ``state_bytes / local_bytes_per_s``."""
    restore_s: float | None = None
    """Loading a checkpoint from node-local storage into a restarted group, seconds. None:
    ``state_bytes / local_bytes_per_s``."""
    restart_s: float = 60.0
    """Starting the worker group again once its nodes are up, seconds (default: an assumption)."""
    detect_s: float = 10.0
    """Failure until the controller notices it, seconds (default: an assumption)."""
    local_bytes_per_s: float = 2e9
    """Node-local disk bandwidth (an NVMe SSD: 2 GB/s), for ``persist_s`` and ``restore_s``
    when neither a measurement nor the caller gives them: a plan for a 20 GB state must not
    assume its checkpoints are free (``Auto`` would checkpoint every step)."""
    shared_bytes_per_s: float = 200e6
    """Bandwidth to and from shared storage (uploads and a replacement node's download)."""
    peer_bytes_per_s: float = 1e9
    """Bandwidth of a node-to-node copy (a replacement node gets a survivor's checkpoint)."""

    def __post_init__(self) -> None:
        check_number("Job", "iter_s", self.iter_s, positive=True, hint=" (seconds per step)")
        if not isinstance(self.steps, int) or isinstance(self.steps, bool) or self.steps < 1:
            raise ValueError(f"Job.steps must be an int >= 1 (steps to train), got {self.steps!r}")
        if not isinstance(self.state_bytes, int) or self.state_bytes < 0:
            raise ValueError(f"Job.state_bytes must be an int >= 0 (bytes per checkpoint), got {self.state_bytes!r}")
        if not self.nodes or any(not isinstance(n, int) or isinstance(n, bool) or n < 1 for n in self.nodes):
            raise ValueError(f"Job.nodes must be a non-empty tuple of node counts >= 1, got {self.nodes!r}")
        for name in ("ref_nodes", "ranks_per_node"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ValueError(f"Job.{name} must be an int >= 1, got {v!r}")
        if not (isinstance(self.scaling, (int, float)) and 0 <= self.scaling <= 1):
            raise ValueError(f"Job.scaling must be in [0, 1] (1: perfect strong scaling), got {self.scaling!r}")
        for name in ("shared_bytes_per_s", "peer_bytes_per_s", "local_bytes_per_s"):
            check_number("Job", name, getattr(self, name), positive=True, hint=" bytes per second")
        for name in ("persist_s", "restore_s"):
            if getattr(self, name) is None:
                object.__setattr__(self, name, self.state_bytes / self.local_bytes_per_s)
        for name in ("stall_s", "persist_s", "restore_s", "restart_s", "detect_s"):
            check_number("Job", name, getattr(self, name), hint=" seconds")

    def iter_s_on(self, nodes: int) -> float:
        """Seconds per step on ``nodes`` nodes (the ``scaling`` rule)."""
        return self.iter_s * (self.ref_nodes / nodes) ** self.scaling

    @classmethod
    def from_event_log(cls, path: str, *, steps: int, state_bytes: int, **given) -> Job:
        """Step time, stall, commit latency, restart, detect and restore from a ``cfdist.fit``
        JSONL event log (:mod:`cfdist.chaos.calibrate`'s measurement), ``ref_nodes`` from its
        ``start`` record. A recovery the log does not contain keeps the default (or ``given``)."""
        records = read_event_log(path)
        window, _ = training_window(records)
        metrics = window_metrics(window, iter_s=iteration_time(window), label="measured")
        base = cls(iter_s=1.0, steps=steps, state_bytes=state_bytes)
        fallback = Costs(iter_s=1.0, stall_s=0.0, persist_s=0.0, restore_s=base.restore_s,
                         restart_s=base.restart_s, detect_s=base.detect_s)
        c, sample = measure_costs([window], [metrics], fallback=fallback)
        start = next((r for r in records if r["event"] == "start"), {})
        measured = dict(iter_s=c.iter_s, stall_s=c.stall_s, persist_s=c.snapshot_s + c.persist_s,
                        ref_nodes=int(start.get("nodes", 1)))
        if sample.recoveries:
            measured.update(restore_s=c.restore_s, restart_s=c.restart_s, detect_s=c.detect_s)
        ref = measured["ref_nodes"]
        if "nodes" not in given:
            given["nodes"] = (ref,)
        if "ranks_per_node" not in given and start.get("world_size"):
            given["ranks_per_node"] = max(1, int(start["world_size"]) // ref)
        return cls(steps=steps, state_bytes=state_bytes, **{**measured, **given})

    @classmethod
    def from_bench(cls, path: str, *, steps: int, method: str = "cfdist", **given) -> Job:
        """Step time, stall, commit latency, restore and state size from ``cfdist bench``'s
        ``results.json``: the median step of the ``none`` runs (no checkpoint), ``method``'s mean
        stall and snapshot + persist time, its restore time and checkpoint bytes."""
        with open(path, encoding="utf-8") as f:
            try:
                data = json.load(f)
            except json.JSONDecodeError as e:
                raise ValueError(f"{path} is not JSON ({e}); give the results.json that cfdist bench wrote") from None
        runs = [r for b in data.get("blocks", []) if isinstance(b, dict) for r in b.get("runs", [])]
        plain = [p for r in runs if r.get("method") == "none" for p in r.get("phases", [])]
        mine = [r for r in runs if r.get("method") == method and r.get("stats")]
        if not plain or not mine:
            have = sorted({r.get("method") for r in runs if r.get("stats")})
            raise ValueError(f"{path} has no 'none' runs or no {method!r} runs with stats; "
                             f"pass method= one of {', '.join(have) or '(none: run cfdist bench)'}")
        stats = [r["stats"] for r in mine]
        restore = (data.get("restore") or {}).get(method) or []
        measured = dict(
            iter_s=statistics.median(plain),
            stall_s=statistics.fmean(s["mean_stall_s"] for s in stats),
            persist_s=statistics.fmean(s["mean_snapshot_s"] + s["mean_persist_s"] for s in stats),
            state_bytes=int(statistics.median(s["bytes"] for s in stats)),
        )
        if restore:
            measured["restore_s"] = statistics.fmean(r["s"] for r in restore)
        return cls(steps=steps, **{**measured, **given})
