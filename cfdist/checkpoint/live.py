"""The live state of the last completed step, and writing it after the group failed.

In data-parallel training every replica holds the whole model. When a peer dies, a survivor's
next collective fails within milliseconds, and the survivor's own state is a checkpoint of the
last step it completed: newer than any on storage (Just-In-Time Checkpointing, EuroSys'24).
:class:`LiveState` keeps what that checkpoint needs beyond the live tensors, and
:meth:`LiveState.save` writes it without a collective and without the store (both may have
died with the peer).

What is taken from where:

- **Parameters, optimizer state, GradScaler, bare tensors**: the live objects at the failure.
  They still hold step ``n``'s values: the failure surfaced in a collective of step ``n + 1``
  (DDP's gradient all-reduce in backward, its buffer broadcast in forward), before its update.
  A failure that surfaced *inside* the update (``ckpt.step``'s ``optimizer.step()`` raised: some
  parameters updated, others not) leaves a state that cannot be trusted: nothing is written
  (:attr:`LiveState.trusted`).
- **Data iterators**: their ``state_dict()`` right after step ``n``'s update (the next fetch
  moves them), kept at every step.
- **Schedulers, plain values, this rank's RNG states and module buffers**: at step ``n``'s
  boundary (after the scheduler step, before the next fetch or forward: where a regular
  checkpoint takes them), kept at every step. The module buffers (BatchNorm statistics, which
  step ``n + 1``'s forward already moved) replace the live ones in what is written.
- **Other ranks' RNG states**: not reachable without the group. The checkpoint holds this
  rank's; a rank it has none for resumes with :func:`~cfdist.checkpoint.state.derived_rng_state`
  of (run seed, rank, step), as after an elastic resume. Documented in the guarantees.

A halt announced on another thread (``cfdist.fit``: a preemption notice that names every
node, :meth:`LiveState.halt`) while no update runs copies step ``n``'s tensors at once, from
that thread: the parameters and the optimizer's state change only inside the update, which the
halt keeps from running (the training thread raises at the gate before it: ``Checkpointer.step``
checks the halt and enters the update under :attr:`LiveState.lock`), and the rest is the
boundary's kept copies. When the rank is already in step ``n + 1`` (its boundary state kept),
the job goes to the backend from that thread too; the copy and the write then overlap the
training thread's forward and backward of ``n + 1`` (or its wait in a collective for a peer
that halted first), and :meth:`LiveState.save` only waits for them. Otherwise ``save`` sends
the job once the rank halted (after the boundary's state is taken, or a regular persist of
step ``n`` settled). A halt that finds the update under way leaves the save whole to the
training thread, which halts at the next boundary holding ``n + 1``; so does one for a loop
whose update does not go through ``Checkpointer.step`` (it could not tell whether one runs).

Every rank keeps it (a survivor that writes no checkpoints still keeps the step in process for
the next group, :meth:`LiveState.content`). The per-step cost is the data iterators' ``state_dict()``,
copies of the late entries, the RNG states and the module buffers; they are kept as copies and
flattened only at a save (flattening every step cost 1.9 ms, five times the rest). The tensors
are copied only at a failure or a halt. Training thread, except :meth:`LiveState.halt`.
"""

from __future__ import annotations

import copy
import logging
import threading
import time

from cfdist.checkpoint import state as st
from cfdist.checkpoint.flatten import flatten
from cfdist.checkpoint.persist import PersistJob, shard_jobs
from cfdist.checkpoint.snapshot import Snapshotter

log = logging.getLogger("cfdist.checkpointer")


class LiveState:
    """The small state of the last completed step of one Checkpointer."""

    def __init__(self, state: dict, kinds: dict[str, str]):
        self.state = state
        self.data_keys = [k for k, o in state.items() if kinds[k] == st.EARLY and st.is_data_iterator(o)]
        self.late_keys = [k for k in state if kinds[k] == st.LATE]
        self.step = 0
        """The last completed step (0: none in this process)."""
        self.floor = 0
        """The newest step known to be on storage (committed or restored): not written again."""
        self.in_update = False
        """True while ``optimizer.step()`` runs (and after it raised: the state is torn)."""
        self.own_updates = False
        """Whether the last update ran inside ``Checkpointer.step`` (where :attr:`in_update`
        and the halt's check are): only then can another thread tell that none runs."""
        self.lock = threading.Lock()
        """Orders a halt announced on another thread against the training thread's next update
        (taken for the halt's check and :attr:`in_update`, :meth:`after_update`, the end of
        :meth:`at_boundary`, and :meth:`halt`'s decision)."""
        self.epoch: int | None = None
        """The data iterator's epoch after step :attr:`step` (the next fetch may start another)."""
        self._data: dict = {}
        self._small: dict | None = None     # late, rng, buffers of ``step``'s boundary
        self._boundary_due = False
        self._early: tuple | None = None    # (step, Snapshotter, skeleton, shards, pending job | None, t0)
        self._halting: threading.Event | None = None   # set once halt()'s copy is over (or failed)
        self._saving = False
        """:meth:`save` began (after the loop was left: a failure, a halt, or the driver's request
        for a survivor's kept step): a halt announced from then on writes nothing, so that two
        commits of one step never race. Set and read under :attr:`lock`."""

    @property
    def trusted(self) -> bool:
        """Whether the live objects hold a completed step (no update was interrupted)."""
        return not self.in_update

    def after_update(self, step: int, *, rng_now: bool, epoch: int | None = None) -> None:
        """``ckpt.step`` finished step ``step``'s update: keep the data iterators' positions;
        the rest at the boundary (``rng_now``: no hooked fetch comes first, take the RNG now).
        Under :attr:`lock`, with :attr:`in_update` cleared."""
        self.step = step
        self.epoch = epoch
        self._data = {k: copy.deepcopy(st.capture(self.state[k])) for k in self.data_keys}
        self._small = {"rng": st.rng_state()} if rng_now else {}   # copies: the generators move on
        self._boundary_due = True

    def at_boundary(self) -> None:
        """The instant between iterations (the first after :meth:`after_update`): keep the
        schedulers, plain values, RNG and module buffers as they are now."""
        if not self._boundary_due:
            return
        # Copies, not flattened yet (that costs more than all of this and is needed only at a save).
        small = dict(self._small or {})
        small["late"] = copy.deepcopy({k: st.capture(self.state[k]) for k in self.late_keys})
        if "rng" not in small:
            small["rng"] = st.rng_state()
        small["buffers"] = self._buffers()
        with self.lock:   # a halt on another thread sees the step's boundary whole, or not yet
            self._small = small
            self._boundary_due = False

    _buffer_names: dict | None = None

    def _buffers(self) -> dict | None:
        """Copies of the module buffers a checkpoint holds per rank (:func:`state.rank_buffers`:
        its names and size limit, worked out once; a state dict per step cost more than the rest)."""
        if self._buffer_names is None:
            own = st.rank_buffers(self.state)
            self._buffer_names = {} if own is None else {k: list(bufs) for k, bufs in own.items()}
            self._buffers_over = own is None
        if self._buffers_over:
            return None
        out = {}
        for k, names in self._buffer_names.items():
            live = dict(self.state[k].named_buffers())
            out[k] = {n: live[n].detach().clone() for n in names if n in live}
        return out

    def halt(self, ckpt, *, durable: bool) -> int | None:
        """Another thread announced a halt (the flag ``ckpt``'s halt check raises on is set).
        When no update is under way, the parameters and optimizer state are step :attr:`step`'s
        and stay so: copy them now, from this thread (the fresh arenas' pages are faulted in
        here, not after the halt). When step :attr:`step`'s boundary was reached too (the
        training thread is in the next step, before its update) and no other commit of the step
        can race with it (no regular snapshot of it, or its persist given up before its write:
        ``Checkpointer._yield_to_live``), also send the job to ``ckpt``'s backend now;
        otherwise :meth:`save` sends it, once the boundary's state is taken (the schedulers
        step after the update) or the regular persist of the step is settled. Returns the step copied, or None (the save is left whole
        to the training thread: an update under way, nothing to write, a loop whose update
        ``ckpt.step`` does not run; or a :meth:`save` began already, and it writes the step: a
        halt that reaches a rank after its collective failed). The halt's flag must be set before this is called: the
        training thread checks it and enters an update under :attr:`lock`, so once this has
        seen no update under way under the lock, none runs any more."""
        with self.lock:
            n = self.step
            if not (self.trusted and self.own_updates and self._early is None and self._halting is None
                    and not self._saving):
                return None
            at_boundary = not self._boundary_due and self._small is not None
            done = self._halting = threading.Event()
        try:
            if self._why_not(ckpt) is not None:
                return None
            t0 = time.perf_counter()
            # Before the boundary the live module buffers are still step n's (the next forward
            # comes after it); after it, the boundary's copies are (that forward may have run).
            snap, skeleton, shards = self._copy(ckpt, self._small.get("buffers") if at_boundary else None)
            copied = time.perf_counter() - t0
            pending = None
            try:
                if at_boundary and (ckpt._snapped_step != n or ckpt._yield_to_live(n)):
                    pending = self._submit(ckpt, self._job(ckpt, skeleton, shards, snap), durable=durable)
            except BaseException:
                snap.close()
                raise
            with self.lock:
                self._early = (n, snap, skeleton, shards, pending, t0)
        finally:
            done.set()
        log.info("rank %d: the halt found step %d complete and no update under way: its live state was copied "
                 "(%.3f s)%s", ckpt.rank, n, copied,
                 " and sent at once" if pending is not None else "; it is sent when the rank halts")
        return n

    def usable(self, ckpt) -> str | None:
        """Why the live objects are no checkpoint of a step (None: they are one, of
        :attr:`step`, to keep in process: ``Checkpointer.keep_live``, or to write)."""
        if not self.trusted:
            return (f"the failure came inside step {self.step + 1}'s optimizer update: the parameters may be "
                    f"partly updated, so the live state is not a checkpoint of any step")
        if self.step == 0 or self._small is None:
            return "no step completed in this attempt"
        return None

    def _why_not(self, ckpt) -> str | None:
        """Why the live state is not written (None: it is): :meth:`usable`, and not a step on
        storage already, on a writer."""
        if not ckpt.writer:
            return "this rank does not write checkpoints"
        why = self.usable(ckpt)
        if why is None and self.floor >= self.step:
            why = f"step {self.step} is on storage already"
        return why

    def content(self, ckpt) -> tuple[dict, dict]:
        """``(manifest, tensors)`` of step :attr:`step` from the live objects, what a checkpoint
        of it holds, for a survivor that keeps it in process (``Checkpointer.keep_live``): the
        tensors are the live ones, not copies, valid while nothing trains them. Call only when
        :meth:`usable` says so."""
        self.at_boundary()   # the failure came before the next boundary: the state is still its own
        skeleton, tensors = self._tensors(ckpt, self._small.get("buffers"))
        return self._manifest(ckpt, skeleton), tensors

    def _tensors(self, ckpt, buffers: dict | None) -> tuple[dict, dict]:
        """Step :attr:`step`'s skeleton and tensors (the live ones): the parameters and
        optimizer state, the data iterators' kept states, and ``buffers`` (module buffers kept
        at the boundary) in place of the live ones."""
        early = {k: (self._data[k] if k in self._data else st.capture(o))
                 for k, o in self.state.items() if ckpt._kinds[k] == st.EARLY}
        skeleton, tensors = flatten(early)
        if buffers:
            _, kept = flatten(buffers)
            tensors.update({n: t for n, t in kept.items() if n in tensors})
        return skeleton, tensors

    def _copy(self, ckpt, buffers: dict | None) -> tuple[Snapshotter, dict, list]:
        """Step :attr:`step`'s tensors copied into a fresh arena set: the live parameters and
        optimizer state, the data iterators' kept states, and ``buffers`` (module buffers kept
        at the boundary) in place of the live ones. Returns the snapshotter, the skeleton and
        the shards."""
        skeleton, tensors = self._tensors(ckpt, buffers)
        snap = Snapshotter(n_shards=len(ckpt.storages), shared=ckpt.backend.needs_shared_memory)
        try:
            snap.start(tensors, mode="cpu")
            snap.wait_copied()
            layout, host = snap.arenas(0)
            shards = shard_jobs(list(enumerate(layout)), host, count=len(layout), roots=len(ckpt.storages))
        except BaseException:
            snap.close()
            raise
        return snap, skeleton, shards

    def _manifest(self, ckpt, skeleton: dict) -> dict:
        """The manifest of step :attr:`step`: ``skeleton`` and the boundary's small state (this
        rank's RNG states only; the others derive theirs)."""
        small = self._small
        st.refresh_optimizer_groups(skeleton, self.state)   # the lr after the boundary's scheduler step
        rng, _ = flatten(small["rng"], inline_tensors=True)
        late, _ = flatten(small["late"], inline_tensors=True)
        if small.get("buffers") is not None:
            rng["buffers"], _ = flatten(small["buffers"], inline_tensors=True)
        rngs = [None] * ckpt.world_size
        rngs[ckpt.rank] = rng
        epoch = self.epoch if self.epoch is not None else ckpt._epoch()
        return {"step": self.step, "epoch": epoch, "epoch_end": False, "world_size": ckpt.world_size,
                "skeleton": skeleton, "late": late, "rng": rng, "rngs": rngs,
                "lineage": ckpt._lineage, "live": {"rank": ckpt.rank}}

    def _job(self, ckpt, skeleton: dict, shards: list, snap: Snapshotter) -> PersistJob:
        """The job of step :attr:`step`: the copied tensors and the boundary's small state."""
        return PersistJob(step=self.step, manifest=self._manifest(ckpt, skeleton), shards=shards,
                          keep=ckpt.config.keep, arenas=[a.buf for a in snap.arenas(0)[1]],
                          io=ckpt.config.persist.io)

    @staticmethod
    def _submit(ckpt, job: PersistJob, *, durable: bool):
        live = getattr(ckpt.backend, "submit_live", None)
        return live(job, durable=durable) if live is not None else ckpt.backend.submit(job)

    def discard(self) -> None:
        """Release an early copy's arenas that :meth:`save` never collected (the Checkpointer
        is closed or abandoned; its job, if one was sent, is its backend's)."""
        with self.lock:
            early, self._early = self._early, None
        if early is not None:
            early[1].close()

    def save(self, ckpt, *, timeout_s: float, durable: bool = False) -> tuple[int | None, str]:
        """Write step :attr:`step` from the live objects through ``ckpt``'s backend (no store,
        no collective; ``durable``: to all its tiers, else a backend with ``submit_live`` writes
        its fastest only); blocks until it committed or ``timeout_s`` passed. Returns ``(step,
        why)``: the step written, or None and the reason nothing was. What :meth:`halt` copied
        (and sent) for this step is used instead of copying it again."""
        with self.lock:   # a halt that comes after this writes nothing (it would commit the step twice)
            halting, self._saving = self._halting, True
        if halting is not None and not halting.wait(timeout_s):   # a copy on the notice's thread: use it
            return None, f"the copy begun when the halt arrived did not end in {timeout_s:g} s"
        with self.lock:
            early, self._early = self._early, None
        if early is not None and early[0] != self.step:   # cannot happen while the halt keeps the update from running
            early[1].close()
            early = None
        why = self._why_not(ckpt) if early is None or early[4] is None else None
        if why is not None:   # e.g. a regular persist of the step committed meanwhile
            if early is not None:
                early[1].close()
            return None, why
        self.at_boundary()   # the failure came before the next boundary: the state is still its own
        if early is not None:
            _, snap, skeleton, shards, pending, t0 = early
        else:
            t0 = time.perf_counter()
            snap, skeleton, shards = self._copy(ckpt, self._small.get("buffers"))
            pending = None
        try:
            if pending is None:
                pending = self._submit(ckpt, self._job(ckpt, skeleton, shards, snap), durable=durable)
            info = pending.wait(timeout_s)
        finally:
            snap.close()
        return self._written(ckpt, info, t0)

    def _written(self, ckpt, info, t0: float) -> tuple[int, str]:
        self.floor = info.step
        ckpt._latest = max(ckpt._latest or 0, info.step)
        log.warning("rank %d wrote the live state of step %d after the group failed (%.3f s, %d bytes)",
                    ckpt.rank, info.step, time.perf_counter() - t0, info.bytes)
        return info.step, "written"
