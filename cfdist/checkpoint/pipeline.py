"""The persist pipeline: one object owns a persist from the snapshot hand-off to its commit.

A :class:`~cfdist.checkpoint.Checkpointer` hands each captured snapshot (a
:class:`~cfdist.checkpoint.persist.PersistJob`) to its pipeline, which runs the job's stages in
order on one thread of its own, one job at a time, in step order:

1. **order** -- jobs queue in the order submitted (``buffers=2``: a snapshot may wait its turn
   while the previous step still writes); a later step never commits before an earlier one, and
   a job's timeout counts from when it leaves the queue;
2. **RNG** (multi-rank, committing writer) -- every rank's RNG states of the step, collected
   through the agreement channel (:class:`~cfdist.checkpoint.agreement.RngExchange`);
3. **slice** (``writers="all"``/N) -- the sliced-commit protocol
   (:class:`~cfdist.checkpoint.slice_commit.SliceCommit`): go, this writer's slice, commit once;
4. **write** -- :func:`~cfdist.checkpoint.persist.write_checkpoint` on the backend (a thread,
   a writer process, a node actor): codecs, checksums, fsync, the commit, then retention.

Every job has one :class:`~cfdist.checkpoint.persist.CommitGate`, made by the backend (so it
crosses into a writer process or a node actor) and claimed by the writer right before the
commit; a sliced job also has a cross-rank :class:`~cfdist.checkpoint.slice_commit.Fate`. So the
:class:`PersistHandle` the pipeline returns can always be given up (:meth:`PersistHandle.abandon`)
until the commit was claimed, whatever the world size, ``writers`` or ``buffers``: every stage's
wait checks the handle and stops once it was given up, the backend moves the next job to a fresh
writer, and the late writer can never commit nor run retention.
"""

from __future__ import annotations

import concurrent.futures as cf
import logging
import threading
import time

from cfdist.checkpoint.agreement import RngExchange
from cfdist.checkpoint.persist import CommitInfo, PersistAbandoned, PersistBackend, PersistJob, PersistTimeout
from cfdist.checkpoint.slice_commit import Fate, SliceCommit

log = logging.getLogger("cfdist.persist")


class PersistHandle:
    """One persist in the pipeline. ``wait()`` returns its :class:`CommitInfo` or re-raises its
    error; ``abandon()`` gives it up. Any thread."""

    def __init__(self, step: int, gate, fate: Fate | None = None, ready_at=lambda: 0.0):
        self.step = step
        self._ready_at = ready_at
        self.gate = gate
        self.fate = fate
        self._fut: cf.Future = cf.Future()
        self._fut.set_running_or_notify_cancel()
        self._started: float | None = None
        self._inner = None   # the backend's pending write running now
        self._lock = threading.Lock()
        self.stage = "queued"
        """Where it is: ``queued``, ``rng`` / ``slice`` (waiting for other ranks), ``write``."""

    @property
    def waits_for_peers(self) -> bool:
        """Whether it waits for other ranks now (their RNG states, their slices): after the
        group failed, those may never come."""
        return self.stage in ("rng", "slice")

    @property
    def submitted(self) -> float:
        """``time.monotonic()`` from which its timeout counts: when it left the queue and the
        backend's writer was ready (now, while it still waits for either)."""
        ready = self._ready_at()
        if self._started is None or ready is None:
            return time.monotonic()
        return max(self._started, ready)

    def done(self) -> bool:
        return self._fut.done()

    def wait(self, timeout: float | None = None) -> CommitInfo:
        return self._fut.result(timeout)

    def abandon(self) -> bool:
        """Give the persist up: True when it can no longer commit (on any rank: a sliced step
        given up here is given up by every writer); False when its commit was claimed already
        (wait for it, it is imminent) or it ended."""
        if self._fut.done():
            return False
        if self.fate is not None and not self.fate.abandon():
            return False
        if not self.gate.abandon():
            return False
        with self._lock:
            inner = self._inner
        if inner is not None:
            inner.abandon()   # the backend's part: a fresh writer for the next job
        self._settle(error=PersistAbandoned(f"persist of step {self.step} was given up"))
        return True

    def expire(self, timeout_s: float, where: str) -> PersistTimeout | None:
        """Give the persist up if it ran ``timeout_s`` seconds or more: the error to record,
        or None (not due yet, ended, or its commit was claimed: then it is waited for)."""
        if self.done() or time.monotonic() - self.submitted < timeout_s:
            return None
        if not self.abandon():
            if not self._timeout_noted:
                self._timeout_noted = True
                log.warning("persisting step %d to %s runs past PersistOptions.timeout_s=%s but is past its commit "
                            "point; waiting for it", self.step, where, timeout_s)
            return None
        log.error("persisting step %d to %s did not finish within PersistOptions.timeout_s=%s: declared failed; its "
                  "writer can no longer commit it", self.step, where, timeout_s)
        return PersistTimeout(
            f"persisting step {self.step} to {where} did not finish within PersistOptions.timeout_s={timeout_s}s "
            f"(the storage hangs or is too slow); it is declared failed and can no longer commit; training "
            f"continues with a fresh writer; raise PersistOptions.timeout_s if the storage is just slow")

    _timeout_noted = False

    def abandoned(self) -> bool:
        return self.gate.abandoned() or (self.fate is not None and self.fate.abandoned())

    def check(self) -> None:
        """Raise :class:`PersistAbandoned` once the persist was given up (here or, sliced, by
        another writer). Called by the stages between waits."""
        if self.abandoned():
            raise PersistAbandoned(f"persist of step {self.step} was given up (PersistOptions.timeout_s); "
                                   f"not going on with it")

    def _settle(self, *, result: CommitInfo | None = None, error: BaseException | None = None) -> None:
        with self._lock:
            if self._fut.done():
                return
            if error is not None:
                self._fut.set_exception(error)
            else:
                self._fut.set_result(result)


class PersistPipeline:
    """Owns every persist of one Checkpointer (see the module docstring).

    ``backend``: where writes run (:class:`~cfdist.checkpoint.persist.ThreadBackend`,
    :class:`~cfdist.checkpoint.persist.ProcessBackend`, a node actor's backend); ``rng``: the
    exchange to collect every rank's RNG through (a committing writer of a multi-rank job);
    ``slices``: the sliced-commit protocol of this writer (``writers="all"``/N). Call
    :meth:`submit` from the training or snapshot thread; it never blocks.
    """

    POLL_S = 0.05
    """How often a stage waiting on the backend checks whether its persist was given up."""

    def __init__(self, backend: PersistBackend, *, rng: RngExchange | None = None,
                 slices: SliceCommit | None = None):
        self.backend, self.rng, self.slices = backend, rng, slices
        self.needs_shared_memory = backend.needs_shared_memory
        self._ex = cf.ThreadPoolExecutor(max_workers=1, thread_name_prefix="cfdist-persist-pipeline")

    def submit(self, job: PersistJob) -> PersistHandle:
        job.gate = self.backend.new_gate(job.step)
        h = PersistHandle(job.step, job.gate, self.slices.fate(job.step) if self.slices is not None else None,
                          ready_at=self.backend.ready_at)
        self._ex.submit(self._run, job, h)
        return h

    def _run(self, job: PersistJob, h: PersistHandle) -> None:
        try:
            if h.abandoned():
                raise PersistAbandoned(f"persist of step {job.step} was given up before it started")
            if self.slices is None or self.slices.index == 0:
                h._started = time.monotonic()
            if self.rng is not None:
                h.stage = "rng"
                rngs = self.rng.collect(job.step, job.manifest["rng"], interrupt=h.check)
                job.manifest["rngs"], job.manifest["rng"] = rngs, rngs[0]
            if self.slices is not None:
                h.stage = "slice"
                # the other writers' timeouts count from writer 0's go: before it, writer 0's
                # own timeout (and its writer's start) is what runs
                info = self.slices.run(job, lambda j: self._write(j, h), h.fate, h.check,
                                       on_go=lambda: setattr(h, "_started", h._started or time.monotonic()))
            else:
                info = self._write(job, h)
        except BaseException as e:  # noqa: BLE001 - handed to the waiter, which re-raises it
            h._settle(error=e)
        else:
            h._settle(result=info)
        finally:
            # a streamed snapshot's chunks go back whatever the outcome (a writer given up may
            # still read the ones it took: those are retired), so the copy never waits for them
            job.close_streams(hung=h.abandoned())
            if not h.gate.abandoned():   # an abandoned gate stays taken: a late writer finds it
                h.gate.close()

    def _write(self, job: PersistJob, h: PersistHandle) -> CommitInfo:
        """One write on the backend, waited for until it ends or the persist is given up."""
        h.check()
        p = self.backend.submit(job)
        with h._lock:
            h._inner = p
        before, h.stage = h.stage, "write"
        try:
            while not p.done():
                if h.abandoned():
                    p.abandon()
                    h.check()
                try:
                    p.wait(self.POLL_S)
                except Exception:  # noqa: BLE001 - still running, or its error: p.wait() below re-raises it
                    pass
            return p.wait()
        finally:
            h.stage = "slice" if before == "slice" else "write"   # a slice's own part written: the others' next
            with h._lock:
                h._inner = None

    def close(self) -> None:
        """Wait for the queued and running persists, then close the backend."""
        self._ex.shutdown(wait=True)
        self.backend.close()

    def detach(self) -> None:
        """Stop taking jobs without waiting: the queued ones still run (a node actor refuses a
        replaced attempt's), then the thread ends. For :meth:`Checkpointer.abandon`."""
        self._ex.shutdown(wait=False)
