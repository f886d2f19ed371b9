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

The training rank's pending handle completes after (1) and (2). The driver asks the actor for
its committed steps during recovery (:meth:`holdings`, which first waits out a persist in
flight), makes it fetch a checkpoint from a peer's actor or from shared storage
(:meth:`stage`), and drains its commit events for the log (:meth:`drain_events`).

Thread-safety: the actor runs methods on several threads (``max_concurrency``); persisting and
staging hold one lock, so at most one write to the node's tiers is in flight.
"""

from __future__ import annotations

import glob
import logging
import os
import shutil
import threading
import time

from cfdist.checkpoint.discovery import committed_steps, sweep
from cfdist.checkpoint.persist import CommitInfo, PersistJob, write_checkpoint
from cfdist.cluster import transfer
from cfdist.cluster.config import FitConfig
from cfdist.storage import open_storages

log = logging.getLogger("cfdist.node")

SHM_ROOT = "/dev/shm" if os.path.isdir("/dev/shm") else None


def memory_root(run_id: str) -> str | None:
    """Directory of a run's memory tiers on this machine (one subdirectory per node actor)."""
    return os.path.join(SHM_ROOT, f"cfdist-{run_id}") if SHM_ROOT else None


class StaleAttempt(RuntimeError):
    """A persist from a worker group that the controller already replaced."""


class NodeCheckpointer:
    """The actor body (decorated with ``ray.remote`` by the driver; plain class for tests).

    Created by the driver with node-affinity scheduling, one per node, kept across attempts.
    """

    def __init__(self, *, config: FitConfig, run_id: str, node_id: str, node_name: str):
        self.config = config
        self.node_id = node_id
        self.node_name = node_name
        self._lock = threading.Lock()
        self._events: list[dict] = []
        self._ev_lock = threading.Lock()
        self._attempt = 0
        self._shared_writer = False
        self._commits = 0
        self._mem_dir = None
        self.mem = self.local = self.shared = None
        root = memory_root(run_id)
        if config.memory_tier and root:
            # Another incarnation's directory for this node (an actor killed by the injector on
            # a node that stayed up) is stale: a replacement starts with empty memory.
            for old in glob.glob(os.path.join(root, f"{node_id[:16]}-*")):
                shutil.rmtree(old, ignore_errors=True)
            self._mem_dir = os.path.join(root, f"{node_id[:16]}-{os.getpid()}")
            self.mem = open_storages(f"file://{self._mem_dir}")
        if config.local_tier:
            self.local = open_storages(config.local_urls(node_name))
            sweep(self.local)
        if config.shared_url():
            self.shared = open_storages(config.shared_url(), **(config.storage_options or {}))
        self._shared_want: int | None = None
        self._shared_done: int | None = None
        self._shared_error: str | None = None
        self._shared_cv = threading.Condition()
        self._closing = False
        self._shared_thread = threading.Thread(target=self._shared_loop, name="cfdist-shared", daemon=True)
        if self.shared is not None:
            self._shared_thread.start()

    # ---- wiring ------------------------------------------------------------------------------
    def ready(self) -> dict:
        """Where this node's tiers are (the worker's Checkpointer opens the same URLs)."""
        return {"node_id": self.node_id, "node_name": self.node_name, "pid": os.getpid(),
                "memory": [s.url for s in self.mem] if self.mem else None,
                "local": [s.url for s in self.local] if self.local else None,
                "shared": self.shared[0].url if self.shared else None}

    def begin_attempt(self, attempt: int, *, shared_writer: bool, dead_pids: list[int] = ()) -> None:
        """Called by the controller before a (re)started group runs: persists from older
        attempts are refused from now on; arenas of dead workers are removed."""
        with self._lock:
            self._attempt = attempt
            self._shared_writer = shared_writer
        self.forget_workers(dead_pids)

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
    def persist(self, job: PersistJob, attempt: int) -> CommitInfo:
        """Write ``job`` to the memory and local tiers (blocking the caller's handle only)."""
        t0 = time.perf_counter()
        with self._lock:
            if attempt != self._attempt:
                raise StaleAttempt(f"persist of step {job.step} from attempt {attempt} refused: the "
                                   f"controller runs attempt {self._attempt} now")
            infos = []
            for tier, sts in (("memory", self.mem), ("local", self.local)):
                if sts is None:
                    continue
                info = write_checkpoint(sts, job)
                infos.append(info)
                self._event("checkpoint_committed", step=job.step, tier=tier, bytes=info.bytes,
                            persist_s=round(info.seconds, 6))
            self._commits += 1
            share = self._shared_writer and self.shared is not None and (
                self._commits % self.config.shared_every == 0)
        if share:
            self._want_shared(job.step)
        return CommitInfo(step=job.step, url=infos[-1].url, bytes=infos[-1].bytes,
                          bytes_logical=infos[-1].bytes_logical, seconds=time.perf_counter() - t0,
                          deleted=tuple(sorted(set().union(*(i.deleted for i in infos)))))

    def _node_tiers(self):
        return [t for t in (self.mem, self.local) if t is not None]

    def _freeze_newest(self, step: int):
        """Freeze ``step`` from the first node tier holding it (under the lock: retention
        cannot delete it meanwhile)."""
        with self._lock:
            for sts in self._node_tiers():
                if step in committed_steps(sts[0]):
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
                frozen = self._freeze_newest(step)
                if frozen is not None:
                    t0 = time.perf_counter()
                    transfer.commit_frozen(frozen, step, self.shared, source=f"node {self.node_name}",
                                           keep=self.config.keep)
                    self._event("checkpoint_committed", step=step, tier="shared",
                                bytes=transfer.nbytes(frozen), persist_s=round(time.perf_counter() - t0, 6))
                err = None
            except Exception as e:  # noqa: BLE001 - reported, retried with the next checkpoint
                err = f"{type(e).__name__}: {e}"
                log.warning("copying step %d to the shared tier %s failed: %s", step, self.shared[0].url, err)
            with self._shared_cv:
                self._shared_done = step
                self._shared_error = err
                self._shared_cv.notify_all()

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
        self._want_shared(step)
        with self._shared_cv:
            ok = self._shared_cv.wait_for(lambda: self._shared_done is not None and self._shared_done >= step,
                                          timeout=timeout_s)
            if not ok:
                raise TimeoutError(f"copying step {step} to {self.shared[0].url} took more than {timeout_s}s")
            if self._shared_error:
                raise RuntimeError(f"copying step {step} to {self.shared[0].url} failed: {self._shared_error}")
        return step if step in committed_steps(self.shared[0]) else None

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
        with self._shared_cv:
            self._closing = True
            self._shared_cv.notify_all()
        if self._shared_thread.is_alive():
            self._shared_thread.join(timeout=60)
        self.forget_workers(dead_pids)
        if remove_memory and self._mem_dir:
            shutil.rmtree(self._mem_dir, ignore_errors=True)
            try:
                os.rmdir(os.path.dirname(self._mem_dir))   # the run's directory, once empty
            except OSError:
                pass


class ActorPending:
    """Pending persist on a node actor: ``wait()`` returns the CommitInfo or re-raises."""

    def __init__(self, ref, step: int):
        self._ref = ref
        self.step = step

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

    def __init__(self, actor, attempt: int):
        self.actor = actor
        self.attempt = attempt

    def submit(self, job: PersistJob) -> ActorPending:
        return ActorPending(self.actor.persist.remote(job, self.attempt), job.step)

    def close(self) -> None:
        pass  # the actor outlives the workers
