"""``FitConfig``: every setting of a ``cfdist.fit`` run, validated once on the driver.

Live objects (the training function, a policy instance, a failure schedule, callbacks) are
arguments of :func:`cfdist.fit`, never fields here.
"""

from __future__ import annotations

import math
import re
from dataclasses import asdict, dataclass, fields

from cfdist.checkpoint.options import route_settings
from cfdist.storage.redact import redact_url

NODE_PLACEHOLDER = "{node}"
"""In a ``storage`` URL, replaced on each node by its name (label ``cfdist-node``, else hostname)."""

_RUN_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,99}$")


def _urls(value) -> tuple[str, ...]:
    if isinstance(value, str):
        return (value,)
    if isinstance(value, (list, tuple)) and value and all(isinstance(v, str) for v in value):
        return tuple(value)
    raise ValueError(f"storage must be a URL or a non-empty list of URLs (one per local disk), got {redact_url(repr(value))}")


@dataclass(frozen=True, kw_only=True)
class TierOptions:
    """Where checkpoints go under ``cfdist.fit`` (``fit(tiers=...)``): the memory, node-local
    and shared tiers, how often each is written, what each keeps."""

    memory_tier: bool = True
    """Keep the newest snapshot in /dev/shm on each node (survives a crashed worker)."""
    local_tier: bool = True
    """Persist every checkpoint to the node-local ``storage`` (False: memory + shared only)."""
    memory_every: int | None = None
    """Snapshot to the memory tier every n steps (1: every step; a crashed worker then loses at
    most n iterations) while disk and shared storage keep the policy's interval. None: every
    checkpoint goes to all tiers. Needs ``memory_tier``."""
    keep: int = 2
    """Committed checkpoints kept per tier (the one in flight comes on top); two, so a restore
    that finds the newest one corrupt falls back to the previous one."""
    shared_every: int = 10
    """Copy every n-th checkpoint of node 0 to ``shared_storage`` (and always the final one)."""
    shared_writers: str | int = "all"
    """Which nodes upload a shared-tier checkpoint. ``"all"``: node 0's actor splits it into
    byte-balanced slices (:mod:`cfdist.checkpoint.slices`) and each node of the group that holds
    the step uploads one slice from its own node-local copy, in parallel; node 0 writes its
    slice plus every tensor that differs between the nodes' copies (module buffers such as
    BatchNorm statistics) and commits once all slices are durable. A peer that fails or does
    not answer within ``shared_slice_timeout_s`` leaves that step uncommitted on the shared
    tier (the previous one stays) and node 0 uploads whole from then on, until the next
    restart of the group. ``N``: node 0 and the first N-1 other nodes (in the group's order)
    that hold the step. ``1``: node 0 uploads every byte (the behaviour before slicing). Each
    node-local tier always keeps its full copy; the shared manifest's ``slicing.nodes`` names
    the node of each writer."""
    shared_slice_timeout_s: float = 600.0
    """How long node 0 waits for its peers' slices of a shared-tier upload before giving the
    step up (it then uploads whole)."""
    peer_copy: bool = True
    """Give a replacement node the chosen checkpoint from a surviving node's actor (else: only
    shared storage can seed it)."""
    storage_options: dict | None = None
    """fsspec options for ``shared_storage`` (credentials, endpoint_url); never logged."""


@dataclass(frozen=True, kw_only=True)
class RecoveryOptions:
    """How ``cfdist.fit`` recovers (``fit(recovery=...)``): how small a group it continues on,
    how long it waits for nodes, warm spares, preemption notices."""

    min_nodes: int = 1
    """Smallest group to continue on after losing nodes (elastic); fewer fails the run."""
    wait_for_nodes_s: float = 120.0
    """How long recovery waits for ``min_nodes`` usable nodes before giving up."""
    warm_spares: bool = True
    """Keep a warm spare rank process per rank slot on every node of the group (started in the
    background, torch and the training function already imported, 0 CPUs reserved while it
    waits), so a restart reuses processes instead of starting them. CPU runs only: GPU ranks
    always start fresh (Ray assigns GPUs when a process starts)."""
    sigterm_grace_s: float = 25.0
    """Seconds a preempted machine leaves between SIGTERM and the kill. A rank that receives
    SIGTERM takes an emergency checkpoint when its recent commit latency fits this window, waits
    for it to commit (at most the window), then exits; otherwise it exits at once."""
    rendezvous_timeout_s: float = 120.0
    """torch.distributed init and collective timeout (a hung collective fails after this)."""
    metadata_url: str | None = None
    """Base URL of the instance metadata service that nodes labelled ``cfdist-notices`` poll
    for preemption notices (None: the cloud's own; a test's fake server otherwise)."""
    live_recovery: bool = True
    """Recover from the survivors' live state: when a rank or a node dies, every surviving
    node's writer keeps the state of the last step it completed (no collective): with warm
    spares on CPU in its own process (:meth:`cfdist.Checkpointer.keep_live`), which the next
    group is formed around and which sends it to the other ranks over that group
    (:meth:`cfdist.Checkpointer.restore_live`); otherwise it writes it to its node's memory tier
    (:meth:`cfdist.Checkpointer.save_live`) and the next group restores the newest step every
    node can obtain, as from any checkpoint. Either way at most the step in progress is lost,
    instead of everything since the last checkpoint. False: the survivors stop at once and the
    run rolls back to the last checkpoint."""
    live_timeout_s: float = 30.0
    """How long a survivor's live save may take (its copy and its commit to the memory tier);
    past it the rank stops and the run rolls back to the last checkpoint."""
    hang_timeout_s: float | None = 600.0
    """A group that completes no step for this long, once it completed one, is hung: the driver
    asks every rank for its progress, kills the ranks that do not answer within 2 s (a frozen
    process: a SIGSTOP, a hang in a driver call holding the GIL) and recovers as from their
    crash, the survivors writing their live state; when every rank answers (a hang the ranks
    share), the whole group is stopped and the run rolls back to the last checkpoint (not while
    a rank is at the end of its run, writing the final checkpoint). None: no
    hang detection (torch.distributed's own collective timeout, ``rendezvous_timeout_s``, still
    applies). Longer than any step, checkpoint or evaluation the loop does between two steps."""


@dataclass(frozen=True, kw_only=True)
class OutputOptions:
    """What ``cfdist.fit`` shows and writes about a run (``fit(output=...)``): the progress
    bar, the event log, the rank processes' logs."""

    event_log: str | None = None
    """Path of the JSONL event log; None: ``./cfdist-runs/<run_name>/events-<time>.jsonl``."""
    log_dir: str | None = None
    """Directory of the rank processes' logs, one file per process (its stderr: C++ warnings,
    tracebacks, cfdist's worker log records), the same path on every node. None: ``cfdist.fit``
    puts them beside the event log, in ``logs-<run id>/``. Ray no longer forwards a rank's
    stderr to the driver's console; the console gets one line per recovered failure."""
    progress: bool = True
    """Show a progress bar on the driver (rich)."""
    poll_s: float = 0.2
    """Driver polling period: failure detection latency and progress refresh."""


GROUPS: dict[str, type] = {"tiers": TierOptions, "recovery": RecoveryOptions, "output": OutputOptions}
"""``cfdist.fit``'s groups of settings: keyword -> class."""

GROUP_OF: dict[str, str] = {f.name: g for g, cls in GROUPS.items() for f in fields(cls)}
"""Each grouped setting's group (``"shared_every"`` -> ``"tiers"``)."""


@dataclass(frozen=True, kw_only=True)
class FitConfig:
    """Settings of one ``cfdist.fit`` run. Build it on the driver; it is pickled to actors.

    Users give the grouped settings as :class:`TierOptions`, :class:`RecoveryOptions` and
    :class:`OutputOptions` (documented there); this record holds them flat, validated once
    (:meth:`build`)."""

    storage: tuple[str, ...]
    """Node-local tier: one URL per local disk, striped (``file:///mnt/ssd/cfdist``). The same
    path is used on every node; ``{node}`` in it is replaced by the node's name, which gives
    each fake node of a one-machine test cluster its own directory."""
    shared_storage: str | None = None
    """Durable tier reachable from every node (``s3://bucket/runs``, NFS), written less often;
    None: no shared tier (a lost node is then recovered from a surviving node only)."""
    run_name: str = "cfdist"
    """Name of the run: a directory under each storage root. A later ``fit`` with the same
    name and storage resumes from its newest checkpoint."""
    num_nodes: int = 1
    """Nodes to train on (one NodeCheckpointer actor and ``workers_per_node`` ranks each)."""
    workers_per_node: int = 1
    """Ranks per node (processes; one GPU each with ``use_gpu``)."""
    use_gpu: bool = False
    """One GPU per rank, NCCL; otherwise CPU and gloo."""
    cpus_per_worker: float = 1.0
    """Ray CPUs reserved per rank (0 allowed: then ranks are placed by node affinity only)."""
    min_nodes: int = RecoveryOptions.min_nodes
    max_failures: int = 10
    """Failures (crashes, lost nodes) tolerated; one more ends the run with an error."""
    wait_for_nodes_s: float = RecoveryOptions.wait_for_nodes_s
    memory_tier: bool = TierOptions.memory_tier
    local_tier: bool = TierOptions.local_tier
    shared_every: int = TierOptions.shared_every
    shared_writers: str | int = TierOptions.shared_writers
    shared_slice_timeout_s: float = TierOptions.shared_slice_timeout_s
    peer_copy: bool = TierOptions.peer_copy
    keep: int = TierOptions.keep
    memory_every: int | None = TierOptions.memory_every
    sigterm_grace_s: float = RecoveryOptions.sigterm_grace_s
    warm_spares: bool = RecoveryOptions.warm_spares
    poll_s: float = OutputOptions.poll_s
    rendezvous_timeout_s: float = RecoveryOptions.rendezvous_timeout_s
    event_log: str | None = OutputOptions.event_log
    log_dir: str | None = OutputOptions.log_dir
    progress: bool = OutputOptions.progress
    metadata_url: str | None = RecoveryOptions.metadata_url
    storage_options: dict | None = TierOptions.storage_options
    live_recovery: bool = RecoveryOptions.live_recovery
    live_timeout_s: float = RecoveryOptions.live_timeout_s
    hang_timeout_s: float | None = RecoveryOptions.hang_timeout_s

    @classmethod
    def build(cls, *, tiers: TierOptions | None = None, recovery: RecoveryOptions | None = None,
              output: OutputOptions | None = None, flat: dict | None = None, owner: str = "cfdist.fit",
              **settings) -> "FitConfig":
        """The validated record of ``settings`` (the ungrouped ones: storage, num_nodes, ...)
        and the groups. ``flat``: grouped settings given one by one, the spelling before the
        groups (the CLI's YAML keys, and ``fit(shared_every=...)``, which warns): each joins its
        group. A setting given both ways is refused (the two could disagree); an unknown one is
        a TypeError naming the groups."""
        given = {"tiers": tiers, "recovery": recovery, "output": output}
        for name, value in given.items():
            if value is not None and not isinstance(value, GROUPS[name]):
                raise TypeError(f"{owner}({name}=...) must be a cfdist.{GROUPS[name].__name__}, got {value!r}")
        routes = {key: (group, key) for key, group in GROUP_OF.items()}
        moved = route_settings(flat or {}, routes, given, GROUPS, owner=owner)
        out = dict(settings)
        for group, cls_ in GROUPS.items():
            values = asdict(given[group]) if given[group] is not None else {}
            values.update(moved.get(group, {}))
            out.update(values)
        return cls(**out)

    def __repr__(self) -> str:

        from cfdist.storage.redact import redact, redact_options

        shown = {f.name: getattr(self, f.name) for f in fields(self)}
        shown["storage_options"] = redact_options(self.storage_options)
        return redact(f"FitConfig({', '.join(f'{k}={v!r}' for k, v in shown.items())})")

    def __post_init__(self):
        from cfdist.storage.redact import register, secrets_in

        register(secrets_in(self.storage_options or {}))   # scrubbed from the driver's logs and events
        object.__setattr__(self, "storage", _urls(self.storage))
        for u in self.storage:
            if "://" in u and not u.startswith(("file://", "local://")):
                raise ValueError(f"storage {redact_url(u)!r} must be node-local (file://...); put object "
                                 f"stores in shared_storage=")
            if "://" not in u and not u.startswith("/"):
                raise ValueError(f"storage {redact_url(u)!r} must be an absolute path or a file:// URL: a relative "
                                 f"path resolves differently in each Ray worker")
        if not _RUN_NAME.match(self.run_name or ""):
            raise ValueError(f"run_name {self.run_name!r} must be 1-100 letters, digits, '.', '_' or '-' "
                             f"(it becomes a directory name)")
        for name in ("num_nodes", "workers_per_node", "min_nodes", "shared_every", "keep"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ValueError(f"{name} must be an int >= 1, got {v!r}")
        if not isinstance(self.max_failures, int) or self.max_failures < 0:
            raise ValueError(f"max_failures must be an int >= 0, got {self.max_failures!r}")
        if self.min_nodes > self.num_nodes:
            raise ValueError(f"min_nodes={self.min_nodes} exceeds num_nodes={self.num_nodes}; "
                             f"use min_nodes <= num_nodes")
        w = self.shared_writers
        if not (w == "all" or (isinstance(w, int) and not isinstance(w, bool) and w >= 1)):
            raise ValueError(f"shared_writers must be 'all' or an int >= 1 (how many nodes upload a slice of a "
                             f"shared-tier checkpoint), got {w!r}; pass 1 to let node 0 upload alone")
        if not isinstance(self.live_recovery, bool):
            raise TypeError(f"live_recovery must be True or False, got {self.live_recovery!r}")
        for name in ("poll_s", "rendezvous_timeout_s", "wait_for_nodes_s", "sigterm_grace_s", "shared_slice_timeout_s",
                     "live_timeout_s"):
            v = getattr(self, name)
            if not (isinstance(v, (int, float)) and math.isfinite(v) and v > 0):
                raise ValueError(f"{name} must be a number of seconds > 0, got {v!r}")
        h = self.hang_timeout_s
        if h is not None and not (isinstance(h, (int, float)) and not isinstance(h, bool) and math.isfinite(h)
                                  and h > 0):
            raise ValueError(f"hang_timeout_s must be a number of seconds > 0, or None (no hang detection), got {h!r}")
        if not (isinstance(self.cpus_per_worker, (int, float)) and self.cpus_per_worker >= 0):
            raise ValueError(f"cpus_per_worker must be >= 0, got {self.cpus_per_worker!r}")
        if self.memory_every is not None:
            if not isinstance(self.memory_every, int) or isinstance(self.memory_every, bool) or self.memory_every < 1:
                raise ValueError(f"memory_every must be an int >= 1 or None, got {self.memory_every!r}")
            if not self.memory_tier:
                raise ValueError(f"memory_every={self.memory_every} snapshots to the memory tier, which "
                                 f"memory_tier=False turns off; enable it or drop memory_every")
        if not (self.memory_tier or self.local_tier or self.shared_storage):
            raise ValueError("no tier to write to: enable memory_tier or local_tier, or set shared_storage")

    @property
    def world_size(self) -> int:
        """Ranks of the full-size group."""
        return self.num_nodes * self.workers_per_node

    def local_urls(self, node_name: str) -> list[str]:
        """The node-local tier's URLs on the node called ``node_name`` (placeholder filled, run dir)."""
        return [f"{_as_url(u).replace(NODE_PLACEHOLDER, node_name).rstrip('/')}/{self.run_name}"
                for u in self.storage]

    def shared_url(self) -> str | None:
        """The shared tier's URL for this run, or None."""
        if not self.shared_storage:
            return None
        return f"{self.shared_storage.rstrip('/')}/{self.run_name}"


def _as_url(u: str) -> str:
    return u if "://" in u else f"file://{u}"
