"""``NodeCheckpointer``: one Ray actor per node that persists the node's snapshots to its tiers.

The node's writer rank (local rank 0) snapshots into shared-memory arenas (/dev/shm files) and
sends only a :class:`~cfdist.checkpoint.PersistJob` (a few KB: arena paths, manifest fields)
through :class:`ActorBackend`. The actor maps the arenas and writes, in its own process (no
GIL shared with training, no copy through the object store):

1. the **memory** tier: ``file:///dev/shm/cfdist-<run>/<node>``, a tmpfs, so the newest
   checkpoint survives a crashed worker and reloads at memory speed through the same restore
   code path as any other tier;
2. the **local** tier: the node-local disk(s) of ``FitConfig.storage``;
3. every ``shared_every``-th checkpoint (when this node is the group's node 0), the **shared**
   tier, copied from the memory/local copy on a background thread so the arenas are free at once.
   With ``FitConfig.shared_writers="all"`` (or N >= 2) the upload is split: node 0's actor asks
   its peers which of them hold the step, takes the first N-1 that do (in the group's order;
   all of them for ``"all"``) and plans byte-balanced slices over the step's tensors
   (:func:`plan_shared_slices`, pure), pinning whole to itself every tensor whose checksum
   differs between its copy and a helper's (module buffers: BatchNorm statistics differ
   between replicas); it asks each helper to upload one slice from its own node copy
   (:meth:`upload_slice`), writes its own slice, and commits once every slice is durable. The
   writers follow the one sliced-commit protocol (:mod:`cfdist.checkpoint.slice_commit`: go,
   slice durable, commit once), here over Ray's key-value store (:class:`cfdist.cluster.kv.RayKV`);
   the manifest's ``slicing.nodes`` names the node of each writer.
   A peer that fails, dies or times out leaves the step uncommitted there (the previous one
   stays); node 0 then uploads whole until the next attempt.

The training rank's pending handle completes after (1) and (2). The driver asks the actor for
its committed steps during recovery (:meth:`holdings`, which first waits out a persist in
flight), makes it fetch a checkpoint from a peer's actor or from shared storage
(:meth:`stage`), and drains its commit events for the log (:meth:`drain_events`).

Thread-safety: the actor runs methods on several threads (``max_concurrency``); persisting and
staging hold one lock, so at most one write to the node's tiers is in flight.
"""

from __future__ import annotations

import dataclasses
import glob
import logging
import os
import shutil
import signal
import threading
import time
import uuid

import torch

from cfdist.checkpoint import slices
from cfdist.checkpoint.discovery import read_tensors, sweep
from cfdist.checkpoint.format import SEAL, ST_TO_TORCH, TMP_MARK, TensorEntry, shard_name, step_dir
from cfdist.checkpoint.persist import (
    CommitGate, CommitInfo, GateDir, PersistAbandoned, PersistJob, ShardJob, pid_alive, write_checkpoint,
)
from cfdist.checkpoint.reader import committed_steps, is_committed, map_shard_data, read_manifest
from cfdist.checkpoint.slice_commit import SliceCommit
from cfdist.cluster import niceness, transfer
from cfdist.cluster.config import FitConfig
from cfdist.cluster.nodes import exited, process_namespace
from cfdist.cluster.proc_log import stderr_to_file
from cfdist.storage import open_storages

log = logging.getLogger("cfdist.node")

SHM_ROOT = "/dev/shm" if os.path.isdir("/dev/shm") else None


def memory_root(run_id: str) -> str | None:
    """Directory of a run's memory tiers on this machine (one subdirectory per node actor)."""
    return os.path.join(SHM_ROOT, f"cfdist-{run_id}") if SHM_ROOT else None


def _sweep_orphans(run_name: str, node_id: str) -> None:
    """Free /dev/shm that dead processes left: this node's memory tiers of earlier runs of
    ``run_name`` whose actor is gone (a driver killed before it could close them), and arenas
    whose creating process is gone. Never touches what a live process owns."""
    for old in glob.glob(os.path.join(SHM_ROOT, f"cfdist-{glob.escape(run_name)}-*", f"{node_id[:16]}-*")):
        pid = old.rsplit("-", 1)[1]
        if pid.isdigit() and not pid_alive(int(pid)):
            shutil.rmtree(old, ignore_errors=True)
            try:
                os.rmdir(os.path.dirname(old))   # that run's directory, once empty
            except OSError:
                pass
    for arena in glob.glob(os.path.join(SHM_ROOT, "cfdist-*-*.arena")):
        pid = os.path.basename(arena).split("-")[1]
        if pid.isdigit() and not pid_alive(int(pid)):
            try:
                os.unlink(arena)
            except OSError:
                pass


PREDECESSOR_WAIT_S = 2.0
"""How long an activation waits for the node's previous actor, killed a moment before, to be
gone (:meth:`NodeCheckpointer.activate`); Ray's kill takes milliseconds."""


def _wait_gone(pids, timeout_s: float) -> None:
    """Return once none of ``pids`` is alive, or after ``timeout_s`` (logged)."""
    deadline = time.monotonic() + timeout_s
    left = [p for p in pids if p]
    while left:
        gone = exited(left)
        left = [p for p in left if p not in gone]
        if not left:
            return
        if time.monotonic() >= deadline:
            log.warning("the node's previous checkpoint actor (pid %s) is still alive %.1fs after its kill; "
                        "opening the tiers anyway", left, timeout_s)
            return
        time.sleep(0.002)


SUMS_WAIT_S = 2.0
"""How long a peer asked for its copy of a step (:meth:`NodeCheckpointer.step_sums`) waits for
that step's persist to arrive and finish (its rank submits it at the same time as node 0's)."""


class _Unsliceable(Exception):
    """A step that cannot be uploaded in slices (nothing written yet): it goes whole."""


@dataclasses.dataclass(frozen=True)
class SharedSlicePlan:
    """Who uploads what of one shared-tier checkpoint (:func:`plan_shared_slices`)."""

    helpers: tuple[int, ...]
    """Indices, into the peers asked, of the nodes that write slices 1, 2, ... (node 0 writes 0)."""
    pieces: list[list[slices.Piece]]
    """The pieces each writer uploads (``pieces[0]``: node 0's)."""
    split: dict
    """The manifest's ``"split"`` (tensors cut between writers)."""
    pinned: frozenset[str]
    """Tensors node 0 writes whole because a helper's copy differs (or has no checksum)."""

    @property
    def writers(self) -> int:
        return 1 + len(self.helpers)


def plan_shared_slices(tensors: dict[str, dict], theirs: list[dict[str, str] | None],
                       shared_writers: str | int) -> SharedSlicePlan | None:
    """Plan a sliced shared-tier upload of one step. Pure.

    ``tensors``: node 0's manifest entries of the step (``dtype``, ``shape``, ``xxh3``);
    ``theirs``: each peer's checksums of its own copy of the step, in the group's order (None:
    no copy, or no answer); ``shared_writers``: ``"all"`` or N (``FitConfig.shared_writers``).
    Node 0 and the first N-1 peers holding a copy (every holder for ``"all"``) write a
    byte-balanced slice each; what differs between node 0's copy and a helper's is node 0's,
    written whole by node 0. None: nothing to split (N = 1, or no peer holds the step).
    """
    want = len(theirs) if shared_writers == "all" else shared_writers - 1
    helpers = tuple(i for i, s in enumerate(theirs) if s is not None)[:max(0, want)]
    if not helpers:
        return None
    mine = {k: t.get("xxh3") for k, t in tensors.items()}
    pinned = frozenset(k for k, v in mine.items() if v is None or any(theirs[i].get(k) != v for i in helpers))
    meta = {k: torch.empty(t["shape"], dtype=ST_TO_TORCH[t["dtype"]], device="meta") for k, t in tensors.items()}
    slicer = slices.Slicer(0, 1 + len(helpers))
    slicer.select(meta, pinned)
    return SharedSlicePlan(helpers=helpers, pieces=[slicer.pieces(w) for w in range(slicer.writers)],
                           split=slicer.split, pinned=pinned)


def _fail_fast(refs: list, every_s: float = 0.1):
    """A protocol ``check`` for node 0: raises the error of a helper's call that ended before
    the outcome (the helper died or failed), instead of waiting ``shared_slice_timeout_s``."""
    import ray

    last = [0.0]

    def check() -> None:
        if not refs or time.monotonic() - last[0] < every_s:
            return
        last[0] = time.monotonic()
        done, _ = ray.wait(refs, num_returns=len(refs), timeout=0)
        for r in done:
            ray.get(r)

    return check


class StaleAttempt(RuntimeError):
    """A persist from a worker group that the controller already replaced."""


class NodeCheckpointer:
    """The actor body (decorated with ``ray.remote`` by the driver; plain class for tests).

    Created by the driver with node-affinity scheduling, one per node, kept across attempts.
    ``standby=True``: a process started ahead (modules imported) that touches no tier until
    :meth:`activate`, so it can wait beside the node's live actor; the driver activates it when
    that actor dies (a preemption drained the node, the actor crashed) instead of waiting for a
    new process to start (2-3 s on a laptop). ``after_pids``: see :meth:`activate` (an actor
    that is not a standby activates in its constructor).
    """

    def __init__(self, *, config: FitConfig, run_id: str, node_id: str, node_name: str,
                 notices: str | None = None, standby: bool = False, role_nice: int | None = None,
                 after_pids: list[int] = ()):
        stderr_to_file(config.log_dir, f"node-actor-{node_name}")   # see cfdist.cluster.proc_log
        self._args = (run_id, notices)
        self.config = config
        self.node_id = node_id
        self.node_name = node_name
        self._lock = threading.Lock()
        self._events: list[dict] = []
        self._ev_lock = threading.Lock()
        self._attempt = 0
        self._shared_writer = False
        self._peers: list = []
        self._whole_only = False   # a sliced upload failed this attempt: upload whole
        self._flushers = 0
        self._commits = 0
        self._durable_at: dict[int, float] = {}   # step -> when it committed on the local tier (recent)
        self._gates_lock = threading.Lock()
        self._disk_gates: dict[int, CommitGate] = {}   # step -> its disk write's gate (see _supersede)
        self._superseded_below = 0
        self._mem_dir = None
        self.mem = self.local = self.shared = None
        self._shared_want: int | None = None
        self._shared_done: int | None = None
        self._shared_error: str | None = None
        self._shared_cv = threading.Condition()
        self._persisted_cv = threading.Condition()
        self._persisted = -1   # the newest step a persist of this attempt finished with (see step_sums)
        self._closing = False
        self._shared_thread = threading.Thread(target=self._shared_loop, name="cfdist-shared", daemon=True)
        self._watcher = None
        self._active = False
        self._nice = niceness.current()
        """This process's priority (Ray's for its workers; a standby's: 19 until activated)."""
        self._role_nice = self._nice if role_nice is None else role_nice
        """The workers' priority on this node: a standby returns to it when activated."""
        self._renice = niceness.can_renice(self._role_nice)
        """Whether a process started at 19 on this node may return to ``_role_nice``: the
        driver starts spares at 19 only then (:mod:`cfdist.cluster.niceness`)."""
        self._prepared = standby
        """Started ahead at the lowest priority (19; ``SCHED_IDLE`` too where it may return)."""
        if standby and self._renice:
            niceness.background()   # idle until activated: the ranks beside it keep the cores
        if not standby:
            self.activate(after_pids)

    def activate(self, after_pids: list[int] = ()) -> dict:
        """Open this node's tiers (a fresh, empty memory tier; the local disk swept of
        uncommitted leftovers), start the shared copier and the notice watcher; returns
        :meth:`ready`. Once per actor: a standby becomes the node's actor. Call only when no
        other actor of this run is active on the node (it removes their memory tier). A
        standby started at the lowest priority returns to the workers' (``role_nice``) where
        allowed (:func:`cfdist.cluster.niceness.foreground`; else it persists at the lowest).

        ``after_pids``: the node's previous actor, killed a moment ago (the kill may not have
        landed yet): nothing is swept before it is gone, or it could still commit a step whose
        files the sweep removed; waited for up to :data:`PREDECESSOR_WAIT_S`."""
        if self._active:
            return self.ready()
        self._active = True
        _wait_gone(after_pids, PREDECESSOR_WAIT_S)
        if self._prepared and self._renice and niceness.foreground(self._role_nice):
            self._nice = self._role_nice
        run_id, notices = self._args
        config, node_id = self.config, self.node_id
        root = memory_root(run_id)
        if config.memory_tier and root:
            # Another incarnation's directory for this node (an actor killed by the injector on
            # a node that stayed up) is stale: a replacement starts with empty memory.
            for old in glob.glob(os.path.join(root, f"{node_id[:16]}-*")):
                shutil.rmtree(old, ignore_errors=True)
            _sweep_orphans(config.run_name, node_id)
            self._mem_dir = os.path.join(root, f"{node_id[:16]}-{os.getpid()}")
            self.mem = open_storages(f"file://{self._mem_dir}")
        if config.local_tier:
            self.local = open_storages(config.local_urls(self.node_name))
            sweep(self.local)
        if config.shared_url():
            self.shared = open_storages(config.shared_url(), **(config.storage_options or {}))
        if self.shared is not None:
            self._shared_thread.start()
        if notices:
            from cfdist.cluster.notices import NoticeWatcher

            self._watcher = NoticeWatcher(notices, self._on_notice, base_url=config.metadata_url)
        return self.ready()

    def _on_notice(self, notice) -> None:
        """The cloud will take this node at ``notice.deadline``: tell the driver (drained)."""
        self._event("preemption_notice", source=notice.source, deadline=notice.deadline, detail=notice.detail)

    # ---- wiring ------------------------------------------------------------------------------
    def ready(self) -> dict:
        """Where this node's tiers are (the worker's Checkpointer opens the same URLs); the
        workers' priority here (``nice``), whether a process started at the lowest may return
        to it (``renice``), and how to start one so (``python``, ``chrt``:
        :func:`cfdist.cluster.niceness.prepared_options`)."""
        return {"node_id": self.node_id, "node_name": self.node_name, "pid": os.getpid(), "ns": process_namespace(),
                "nice": self._role_nice, "renice": self._renice, **niceness.node_facts(),
                "memory": [s.url for s in self.mem] if self.mem else None,
                "local": [s.url for s in self.local] if self.local else None,
                "shared": self.shared[0].url if self.shared else None}

    def begin_attempt(self, attempt: int, *, shared_writer: bool, dead_pids: list[int] = (),
                      peers: list = ()) -> None:
        """Called by the controller before a (re)started group runs: persists from older
        attempts are refused from now on; arenas of dead workers are removed. ``peers``: the
        other nodes' actors of the group (node 0 asks them for slices of shared uploads)."""
        with self._lock:
            self._attempt = attempt
            self._shared_writer = shared_writer
            self._peers = list(peers)
            self._whole_only = False
        with self._gates_lock:
            self._superseded_below = 0   # the next group may restore an older step
        with self._persisted_cv:
            self._persisted = -1
            self._persisted_cv.notify_all()
        self.forget_workers(dead_pids)

    def await_exit(self, pids: list[int], wait_s: float, every_s: float = 0.002) -> list[int]:
        """Which of ``pids`` (rank processes of this node, in this actor's process namespace: its
        ``ready()["ns"]``) have exited or are exiting (:func:`~cfdist.cluster.nodes.exited`):
        answers as soon as one has (looking every ``every_s``), or with none after ``wait_s``.
        The driver asks while a group trains, for the ranks whose processes it cannot see
        itself (``RayWorkerGroup._watch_exits``: a lease of a second, asked again), and after a
        first error (``RayWorkerGroup._settle``): Ray reports a death tens of milliseconds
        later. Any thread."""
        deadline = time.monotonic() + max(0.0, float(wait_s))
        while True:
            gone = exited([int(p) for p in pids], exiting=True)
            if gone or time.monotonic() >= deadline:
                return sorted(gone)
            time.sleep(every_s)

    def kill_workers(self, pids) -> list[int]:
        """SIGKILL rank processes of this node (a frozen one too: SIGKILL needs no cooperation,
        where Ray's own kill first asks the process to exit); returns the pids that were there."""
        killed = []
        for pid in pids:
            try:
                os.kill(int(pid), signal.SIGKILL)
                killed.append(int(pid))
            except ProcessLookupError:
                pass
        return killed

    def forget_workers(self, pids) -> int:
        """Remove the /dev/shm arenas that killed workers (``pids``) left; returns how many."""
        n = 0
        if SHM_ROOT:
            for pid in pids:
                for p in glob.glob(os.path.join(SHM_ROOT, f"cfdist-{int(pid)}-*.arena")):
                    try:
                        os.unlink(p)
                        n += 1
                    except OSError:
                        pass
        return n

    # ---- the persist path ----------------------------------------------------------------------
    def persist(self, job: PersistJob, attempt: int, to_disk: bool = True, memory: bool = True) -> CommitInfo:
        """Write ``job`` to the memory and local tiers (blocking the caller's handle only);
        ``to_disk=False`` (a ``memory_every`` snapshot): the memory tier only; ``memory=False``
        (every node is about to be taken): the local tier only, when the node has one."""
        try:
            return self._persist(job, attempt, to_disk, memory)
        finally:   # a peer's step_sums may be waiting for this step (committed or not)
            with self._persisted_cv:
                if attempt == self._attempt:
                    self._persisted = max(self._persisted, job.step)
                self._persisted_cv.notify_all()

    def _persist(self, job: PersistJob, attempt: int, to_disk: bool, memory: bool) -> CommitInfo:
        t0 = time.perf_counter()
        if to_disk and not memory and self.local is not None:
            self._supersede(job.step)   # a halted group's live state: nothing older holds it up
        with self._lock:
            if attempt != self._attempt:
                raise StaleAttempt(f"persist of step {job.step} from attempt {attempt} refused: the "
                                   f"controller runs attempt {self._attempt} now")
            infos = []
            # RAM is the node's: the memory tier never accumulates epoch-end checkpoints
            in_memory = dataclasses.replace(job, keep_epoch_ends=0)
            for tier, sts, jb in (("memory", self.mem, in_memory), ("local", self.local, job)):
                if sts is None or (tier != "memory" and not to_disk and self.mem is not None):
                    continue
                if tier == "memory" and not memory and to_disk and self.local is not None:
                    continue
                if job.streams is not None and infos:
                    # streamed (a host-memory budget): the windows went into the memory tier as they
                    # came and were given back; the local tier is written from its files
                    jb = dataclasses.replace(job, streams=None, arenas=map_shard_data(
                        self.mem, job.step, [(s.root, shard_name(s.index, s.count)) for s in job.shards]))
                gate = None
                if infos:   # the job's gate went to the memory tier's commit: the disk write gets its own
                    gate = self._disk_gate(job.step)
                    if gate is None:
                        to_disk = False
                        break
                    jb = dataclasses.replace(jb, gate=gate)
                try:
                    info = write_checkpoint(sts, jb)
                except PersistAbandoned:
                    if gate is None or not gate.abandoned():
                        raise
                    log.info("node %s: the disk write of step %d was cut short for a newer live state (every "
                             "node is about to be taken)", self.node_name, job.step)
                    to_disk = False
                    break
                finally:
                    if gate is not None:
                        with self._gates_lock:
                            self._disk_gates.pop(job.step, None)
                infos.append(info)
                if tier == "local":
                    self._durable(job.step, info.committed_at)
                self._event("checkpoint_committed", step=job.step, tier=tier, bytes=info.bytes,
                            persist_s=round(info.seconds, 6), committed_at=info.committed_at,
                            **({"live": True} if job.manifest.get("live") else {}))
            self._commits += to_disk
            share = to_disk and self._shared_writer and self.shared is not None and (
                self._commits % self.config.shared_every == 0)
        if share:
            self._want_shared(job.step)
        return CommitInfo(step=job.step, url=infos[-1].url, bytes=infos[-1].bytes,
                          bytes_logical=infos[-1].bytes_logical, seconds=time.perf_counter() - t0,
                          deleted=tuple(sorted(set().union(*(i.deleted for i in infos)))),
                          committed_at=infos[-1].committed_at)

    def _supersede(self, step: int) -> None:
        """A halted group's live state of ``step`` goes to disk (every node is about to be
        taken): a regular persist of an older step writing its disk copy now gives it up at its
        next chunk (its memory copy dies with the node; the live write waits for this lock, and
        the older disk write took 30-80 ms of a grace of ~160 ms), and one about to start it skips it."""
        with self._gates_lock:
            self._superseded_below = max(self._superseded_below, step)
            older = [(s, g) for s, g in self._disk_gates.items() if s < step]
        for s, g in older:
            if g.abandon():
                log.info("node %s: giving up the disk write of step %d for the live state of step %d",
                         self.node_name, s, step)

    def _disk_gate(self, step: int) -> CommitGate | None:
        """The gate of a regular persist's disk write (after its memory commit), which
        :meth:`_supersede` can give up; None: a live state of a newer step supersedes it already."""
        with self._gates_lock:
            if step < self._superseded_below:
                return None
            gate = self._disk_gates[step] = CommitGate()
            return gate

    def _node_tiers(self):
        return [t for t in (self.mem, self.local) if t is not None]

    def _freeze_newest(self, step: int):
        """Freeze ``step`` from the first node tier holding it (under the lock: retention
        cannot delete it meanwhile)."""
        with self._lock:
            for sts in self._node_tiers():
                if is_committed(sts[0], step):
                    return transfer.freeze(sts, step)
        return None

    # ---- the shared tier (background) ----------------------------------------------------------
    def _want_shared(self, step: int) -> None:
        with self._shared_cv:
            if self._shared_want is None or step > self._shared_want:
                self._shared_want = step   # coalesce: only the newest waiting step is copied
            self._shared_cv.notify_all()

    def _shared_loop(self) -> None:
        while True:
            with self._shared_cv:
                while not self._closing and (self._shared_want is None or self._shared_want == self._shared_done):
                    self._shared_cv.wait()
                if self._closing and (self._shared_want is None or self._shared_want == self._shared_done):
                    return
                step = self._shared_want
            try:
                self._upload(step)
                err = None
            except Exception as e:  # noqa: BLE001 - reported, retried with the next checkpoint
                err = f"{type(e).__name__}: {e}"
                log.warning("copying step %d to the shared tier %s failed: %s", step, self.shared[0].url, err)
            with self._shared_cv:
                self._shared_done = step
                self._shared_error = err
                self._shared_cv.notify_all()

    def _upload(self, step: int) -> None:
        """Put committed ``step`` of this node into the shared tier: in slices with the peers
        (``shared_writers``), else whole; a failed sliced upload is logged, commits nothing, and
        makes every later upload of this attempt whole (a waiting flush retries whole at once)."""
        t0 = time.perf_counter()
        peers = self._peers if self.config.shared_writers != 1 else []
        if peers and not self._whole_only:
            try:
                info = self._upload_sliced(step, peers)
            except _Unsliceable as e:
                log.info("node %s uploads step %d whole: %s", self.node_name, step, e)
            except slices.SliceError as e:
                self._whole_only = True
                log.warning("node %s: sliced upload of step %d to %s not committed (%s); the previous "
                            "shared checkpoint stays, node %s uploads whole from now on", self.node_name,
                            step, self.shared[0].url, e, self.node_name)
                self._event("shared_slices_failed", step=step, error=str(e))
                if not self._flushers:
                    raise
            else:
                if info is not None:
                    self._event("checkpoint_committed", step=step, tier="shared", bytes=info["bytes"],
                                writers=len(info["nodes"]), nodes=info["nodes"],
                                persist_s=round(time.perf_counter() - t0, 6))
                return
        frozen = self._freeze_newest(step)
        if frozen is not None:
            transfer.commit_frozen(frozen, step, self.shared, source=f"node {self.node_name}",
                                   keep=self.config.keep)
            self._event("checkpoint_committed", step=step, tier="shared", writers=1, nodes=[self.node_name],
                        bytes=transfer.nbytes(frozen), persist_s=round(time.perf_counter() - t0, 6))

    def _read_node_copy(self, step: int, names: set[str] | None = None):
        """``(manifest, tensors)`` of committed ``step`` from this node's fastest tier holding
        it (checksums verified), read under the lock so retention cannot delete it meanwhile;
        ``tensors`` only when ``names`` is given (those, whole). None: no tier holds it."""
        with self._lock:
            for sts in self._node_tiers():
                if is_committed(sts[0], step):
                    m = read_manifest(sts, step)
                    return m, (read_tensors(sts, step, m, names=names) if names is not None else None)
        return None

    def step_sums(self, step: int, wait_s: float = SUMS_WAIT_S) -> dict | None:
        """``{"node": this node's name, "sums": each tensor's checksum}`` of this node's copy of
        ``step`` (None: no copy, or one that cannot be sliced: encoded by codecs).

        Node 0 asks as soon as its own copy committed; this node's rank submits the same step
        at the same time, and its job may not have arrived yet (a loaded machine: tens of ms).
        So while no persist of this attempt has finished with ``step`` or a newer one, it waits
        for one, up to ``wait_s``, instead of answering "no copy" and leaving the upload whole."""
        deadline = time.monotonic() + wait_s
        got = self._read_node_copy(step)
        if got is None:
            with self._persisted_cv:
                self._persisted_cv.wait_for(lambda: self._persisted >= step or self._closing,
                                            timeout=max(0.0, deadline - time.monotonic()))
                finished = self._persisted >= step
            # read again once it finished: committed, or not (it failed, or a newer step came)
            got = self._read_node_copy(step) if finished else None
            if got is None:
                return None
        if got[0].get("codecs"):
            return None
        return {"node": self.node_name, "sums": {k: t.get("xxh3") for k, t in got[0]["tensors"].items()}}

    def _slice_job(self, step: int, index: int, writers: int, pieces: list, sums: dict[str, str]) -> PersistJob:
        """Slice ``index`` of ``writers`` of committed ``step`` (its ``pieces``), read from this
        node's copy. ``sums``: the checksums node 0 holds for the tensors of these pieces; a
        copy that differs is refused."""
        names = {p.name for p in pieces}
        got = self._read_node_copy(step, names)
        if got is None:
            raise FileNotFoundError(f"node {self.node_name} holds no committed step {step} to upload a slice of")
        m, tensors = got
        differ = sorted(n for n in names if m["tensors"].get(n, {}).get("xxh3") != sums.get(n))
        if differ:
            raise slices.SliceError(f"node {self.node_name}'s step {step} differs from node 0's in {differ[:3]}")
        entries, bufs, off = [], [], 0
        for p in pieces:
            t = tensors[p.name]
            b = slices.bytes_of(t)[p.start:p.stop]
            dtype, shape = (t.dtype, tuple(t.shape)) if p.whole else (torch.uint8, (p.nbytes,))
            entries.append(TensorEntry(name=p.key, shard=0, dtype=dtype, shape=shape, offset=off, nbytes=p.nbytes))
            bufs.append(b)
            off += p.nbytes
        arena = torch.cat(bufs) if bufs else torch.empty(0, dtype=torch.uint8)
        (g, es), = slices.global_shards(index, [entries], writers)
        return PersistJob(step=step, manifest={}, arenas=[arena], keep=self.config.keep,
                          shards=[ShardJob(index=g, count=writers, root=0, nbytes=off, entries=es)])

    def _slice_commit(self, step: int, index: int, writers: int, tag: str) -> SliceCommit:
        """The sliced-commit protocol of one shared upload, over Ray's key-value store."""
        from cfdist.cluster.kv import RayKV

        kv = RayKV(f"cfdist-slices/{self._args[0]}/{step}/{tag}", rank=index,
                   timeout_s=self.config.shared_slice_timeout_s)
        return SliceCommit(kv, index=index, writers=writers, tag=tag)

    def _write_shared(self, job: PersistJob, index: int) -> CommitInfo:
        """The protocol's write stage on this node: one write into the shared tier."""
        t0 = time.perf_counter()
        info = write_checkpoint(self.shared, job)
        if job.shards:
            self._event("shared_slice_written", step=job.step, writer=index, bytes=info.bytes,
                        seconds=round(time.perf_counter() - t0, 6))
        return info

    def upload_slice(self, step: int, index: int, writers: int, pieces: list, sums: dict[str, str],
                     tag: str) -> dict:
        """A helper node's part of node 0's sliced upload of committed ``step`` (a Ray call from
        node 0): write slice ``index`` of ``writers`` (its ``pieces``, from this node's copy,
        checked against node 0's ``sums``) into the shared tier once node 0 says go, report it,
        and return once node 0 committed (:mod:`cfdist.checkpoint.slice_commit`). Returns the
        slice's manifest entries; raises when the step was not committed."""
        proto = self._slice_commit(step, index, writers, tag)
        try:
            job = self._slice_job(step, index, writers, pieces, sums)
        except Exception as e:
            proto.fail(step, f"{type(e).__name__}: {e}")
            raise
        return proto.run(job, lambda j: self._write_shared(j, index), proto.fate(step), check=lambda: None).slice

    def _upload_sliced(self, step: int, peers: list) -> dict | None:
        """Node 0's side of a sliced shared upload (see the module docstring). Returns
        ``{"bytes", "nodes"}`` (the writers' node names, writer 0 first), or None when the shared
        tier holds this very checkpoint already; raises
        :class:`~cfdist.checkpoint.slices.SliceError` when it did not commit."""
        import ray

        got = self._read_node_copy(step)
        if got is None:
            return None
        m0 = got[0]
        if m0.get("codecs") or m0.get("split"):
            raise _Unsliceable("its copy is encoded by codecs or already sliced")
        if transfer.holds_same(self.shared, step, m0):
            return None
        timeout = self.config.shared_slice_timeout_s
        asked = [p.step_sums.remote(step) for p in peers]
        answered, _ = ray.wait(asked, num_returns=len(asked), timeout=timeout)
        theirs = []
        for ref in asked:   # nothing is written yet: a peer that cannot answer only leaves the upload
            try:
                if ref not in answered:
                    raise TimeoutError(f"no answer in {timeout}s")
                theirs.append(ray.get(ref))
            except Exception as e:  # noqa: BLE001 - logged; that peer writes no slice
                log.warning("node %s: a peer did not say whether it holds step %d (%s: %s); it uploads no "
                            "slice of it", self.node_name, step, type(e).__name__, e)
                theirs.append(None)
        plan = plan_shared_slices(m0["tensors"], [a and a["sums"] for a in theirs], self.config.shared_writers)
        if plan is None:
            raise _Unsliceable("no peer holds it")
        mine = {k: t.get("xxh3") for k, t in m0["tensors"].items()}
        helpers = [peers[i] for i in plan.helpers]
        nodes = [self.node_name] + [theirs[i]["node"] for i in plan.helpers]
        writers = plan.writers
        tag = uuid.uuid4().hex[:8]
        proto = self._slice_commit(step, 0, writers, tag)
        refs = [h.upload_slice.remote(step, w, writers, plan.pieces[w],
                                      {p.name: mine[p.name] for p in plan.pieces[w]}, tag)
                for w, h in enumerate(helpers, start=1)]
        try:
            job = self._slice_job(step, 0, writers, plan.pieces[0], mine)
            job.manifest = {k: v for k, v in m0.items()
                            if k not in ("format", "step", "time", "bytes", "roots", "shards", "tensors", SEAL)}
            job.manifest.update(slicing={"writers": writers, "align": slices.ALIGN, "by": "nodes", "nodes": nodes},
                                split=plan.split, source_time=m0.get("time"))
            proto.run(job, lambda j: self._write_shared(j, 0), proto.fate(step), check=_fail_fast(refs))
            ray.get(refs, timeout=timeout)   # every helper has the outcome
            proto.forget(step)
        except Exception as e:  # noqa: BLE001 - a failed, dead or stalled peer: the step is not committed
            for r in refs:
                ray.cancel(r, force=False)
            self._drop_staging(step, tag)
            raise slices.SliceError(f"a slice of step {step} was not written: {type(e).__name__}: {e}") from e
        return {"bytes": proto.committed_bytes, "nodes": nodes}

    def _drop_staging(self, step: int, tag: str) -> None:
        """Remove what a failed sliced upload of ``step`` left in the shared tier (best effort: a
        stalled peer may still add a file, which the next commit of that step clears)."""
        st = self.shared[0]
        try:
            if st.atomic_rename:
                st.remove(f"{step_dir(step)}{TMP_MARK}{tag}")
            elif not is_committed(st, step):   # object stores: the slices sit under the final prefix
                st.remove(step_dir(step))
        except OSError as e:
            log.warning("could not remove the uncommitted slices of step %d from %s: %s", step, st.url, e)

    def _durable(self, step: int, at: float | None = None) -> None:
        """``step`` committed on the local tier at ``at`` (wall time of its atomic rename; now
        when not known)."""
        self._durable_at[step] = time.time() if at is None else at
        if len(self._durable_at) > 64:
            self._durable_at.pop(min(self._durable_at))

    def flush_local(self) -> int | None:
        """Copy the memory tier's newest step to the local tier when it is newer (``memory_every``
        snapshots and live saves skip the disk); blocking. Returns the local tier's newest step."""
        if self.local is None:
            return None
        with self._lock:
            newest_mem = max(committed_steps(self.mem[0]), default=None) if self.mem else None
            newest_local = max(committed_steps(self.local[0]), default=None)
            if newest_mem is not None and (newest_local is None or newest_mem > newest_local):
                transfer.commit_frozen(transfer.freeze(self.mem, newest_mem), newest_mem, self.local,
                                       source=f"memory of node {self.node_name}", keep=self.config.keep)
                self._durable(newest_mem)
                newest_local = newest_mem
        return newest_local

    def make_durable(self) -> dict | None:
        """:meth:`flush_local`, and when this node's newest local step committed there:
        ``{"step", "t"}`` (wall time; None: no local tier or nothing on it). Blocking."""
        step = self.flush_local()
        if step is None:
            return None
        return {"step": step, "t": self._durable_at.get(step, time.time())}

    def flush_shared(self, step: int | None = None, timeout_s: float = 600.0) -> int | None:
        """Copy ``step`` (default: the newest committed) to shared storage and wait for it.

        Blocking; the driver calls it at the end of a run. Returns the step now in shared
        storage, or None when there is no shared tier or nothing to copy.
        """
        if self.shared is None:
            return None
        if step is None:
            steps = [max(committed_steps(t[0]), default=None) for t in self._node_tiers()]
            steps = [s for s in steps if s is not None]
            if not steps:
                return None
            step = max(steps)
        with self._shared_cv:
            self._flushers += 1   # a sliced upload that fails now is retried whole at once
            if self._shared_error is not None and self._shared_done == step:
                self._shared_done = None   # its earlier copy failed: copy it again
        try:
            self._want_shared(step)
            with self._shared_cv:
                ok = self._shared_cv.wait_for(lambda: self._shared_done is not None and self._shared_done >= step,
                                              timeout=timeout_s)
        finally:
            with self._shared_cv:
                self._flushers -= 1
        with self._shared_cv:
            if not ok:
                raise TimeoutError(f"copying step {step} to {self.shared[0].url} took more than {timeout_s}s")
            if self._shared_error:
                raise RuntimeError(f"copying step {step} to {self.shared[0].url} failed: {self._shared_error}")
        return step if is_committed(self.shared[0], step) else None   # by key: listings may lag

    # ---- recovery --------------------------------------------------------------------------------
    def holdings(self, with_shared: bool = False) -> dict:
        """Committed steps per tier, after any persist in flight finished (blocking)."""
        with self._lock:
            out = {"node_id": self.node_id,
                   "memory": committed_steps(self.mem[0]) if self.mem else [],
                   "local": committed_steps(self.local[0]) if self.local else []}
        if with_shared and self.shared is not None:
            try:
                out["shared"] = committed_steps(self.shared[0])
            except OSError as e:
                log.warning("cannot list the shared tier %s: %s", self.shared[0].url, e)
        return out

    def export(self, step: int) -> transfer.Frozen:
        """The files of committed ``step`` from this node's fastest tier holding it (for a peer)."""
        frozen = self._freeze_newest(step)
        if frozen is None:
            raise FileNotFoundError(f"node {self.node_name} holds no committed step {step}")
        return frozen

    def stage(self, step: int, source: str, peer=None) -> dict:
        """Make committed ``step`` available in this node's fastest tier (blocking).

        ``source``: ``"peer"`` (``peer`` is the NodeCheckpointer handle to copy from) or
        ``"shared"``. Returns ``{"bytes", "seconds"}``.
        """
        t0 = time.perf_counter()
        if source == "peer":
            import ray

            frozen = ray.get(peer.export.remote(step))
        elif source == "shared":
            if self.shared is None:
                raise RuntimeError(f"node {self.node_name} was told to stage step {step} from shared "
                                   f"storage, but the run has no shared_storage")
            frozen = transfer.freeze(self.shared, step)
        else:
            raise ValueError(f"stage source must be 'peer' or 'shared', got {source!r}")
        dst = self._node_tiers()[0]
        with self._lock:
            transfer.commit_frozen(frozen, step, dst, source=source, keep=self.config.keep)
        return {"bytes": transfer.nbytes(frozen), "seconds": time.perf_counter() - t0}

    # ---- events and shutdown ---------------------------------------------------------------------
    def _event(self, event: str, **fields) -> None:
        with self._ev_lock:
            self._events.append({"t": time.time(), "event": event, "node_id": self.node_id, **fields})

    def drain_events(self) -> list[dict]:
        """Records since the previous call (commits per tier), oldest first."""
        with self._ev_lock:
            out, self._events = self._events, []
        return out

    def close(self, remove_memory: bool = True, dead_pids=()) -> None:
        """Stop the shared copier (after its current copy), free the memory tier and the arenas
        of the workers the driver killed (``dead_pids``)."""
        if self._watcher is not None:
            self._watcher.stop()
        with self._shared_cv:
            self._closing = True
            self._shared_cv.notify_all()
        with self._persisted_cv:
            self._persisted_cv.notify_all()   # a peer's step_sums waiting here answers now
        if self._shared_thread.is_alive():
            self._shared_thread.join(timeout=60)
        self.forget_workers(dead_pids)
        from cfdist.checkpoint.checkpointer import _drop_reuse_pools

        _drop_reuse_pools([*(self.local or []), *((self.shared or []) if self._shared_writer else [])])
        if remove_memory and self._mem_dir:
            shutil.rmtree(self._mem_dir, ignore_errors=True)
            try:
                os.rmdir(os.path.dirname(self._mem_dir))   # the run's directory, once empty
            except OSError:
                pass


class ActorPending:
    """Pending persist on a node actor: ``wait()`` returns the CommitInfo or re-raises."""

    def __init__(self, ref, step: int, gate=None):
        self._ref = ref
        self.step = step
        self._gate = gate

    def abandon(self) -> bool:
        """Given up: the actor's write can no longer commit (its gate is taken); the actor
        runs the next persist once that write returns."""
        return self._gate is not None and self._gate.abandon()

    def done(self) -> bool:
        import ray

        ready, _ = ray.wait([self._ref], timeout=0)
        return bool(ready)

    def wait(self, timeout: float | None = None) -> CommitInfo:
        import ray

        return ray.get(self._ref, timeout=timeout)


class ActorBackend:
    """A :class:`~cfdist.checkpoint.PersistBackend` that hands jobs to the node's actor.

    Used by the writer rank's Checkpointer inside a worker actor. ``submit`` returns at once.
    """

    needs_shared_memory = True
    streams = True
    """Takes snapshots streamed through a host-memory budget (a shared chunk pool): the node
    actor writes the windows into the memory tier, and the local tier from the memory tier's files."""
    streams_codecs = False
    """...but not with codecs: the local tier is written from the memory tier's shard files as
    arenas, which codecs under a budget leave encoded frame by frame (refused at construction)."""
    keeps_hung_writers = True
    """A persist given up here is not killed (the node actor lives on): the chunks it may still
    read are retired."""

    def __init__(self, actor, attempt: int, policy=None):
        self.actor = actor
        self.attempt = attempt
        self.policy = policy
        """A :class:`~cfdist.policy.memory.MemoryEvery` decides which steps also go to disk."""
        self._gates = None

    def ready_at(self) -> float | None:
        return 0.0   # the node actor runs before any worker starts

    def new_gate(self, step: int):
        """A file gate in /dev/shm: the node actor runs on this node and claims it there."""
        if self._gates is None:
            self._gates = GateDir()
        return self._gates.new(step)

    def submit(self, job: PersistJob) -> ActorPending:
        to_disk = self.policy is None or not hasattr(self.policy, "to_disk") or self.policy.to_disk(job.step)
        return ActorPending(self.actor.persist.remote(job, self.attempt, to_disk), job.step, job.gate)

    def submit_live(self, job: PersistJob, durable: bool = False) -> ActorPending:
        """A survivor's live state after a failure (:mod:`cfdist.checkpoint.live`): to the
        memory tier only (the local tier when the node has none), where the next group reads it
        at memory speed and a peer node's actor can copy it from; ``durable`` (a halt for a
        notice that names every node: the memory tier dies with the node): the local tier
        instead (the memory tier when the node has no local one)."""
        return ActorPending(self.actor.persist.remote(job, self.attempt, durable, not durable), job.step, job.gate)

    def close(self) -> None:
        if self._gates is not None:   # the actor outlives the workers; the gates do not
            self._gates.close()
