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

The per-step cost on a writer (nothing on other ranks) is the data iterators' ``state_dict()``,
copies of the late entries, the RNG states and the module buffers; they are kept as copies and
flattened only at a save (flattening every step cost 1.9 ms, five times the rest). The tensors
are copied only at a failure. Training thread only.
"""

from __future__ import annotations

import copy
import logging
import time

from cfdist.checkpoint import state as st
from cfdist.checkpoint.flatten import flatten
from cfdist.checkpoint.persist import PersistJob, shard_jobs
from cfdist.checkpoint.snapshot import Snapshotter

log = logging.getLogger("cfdist.checkpointer")


class LiveState:
    """The small state of the last completed step of one writer Checkpointer."""

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
        self._data: dict = {}
        self._small: dict | None = None     # late, rng, buffers of ``step``'s boundary
        self._boundary_due = False

    @property
    def trusted(self) -> bool:
        """Whether the live objects hold a completed step (no update was interrupted)."""
        return not self.in_update

    def after_update(self, step: int, *, rng_now: bool) -> None:
        """``ckpt.step`` finished step ``step``'s update: keep the data iterators' positions;
        the rest at the boundary (``rng_now``: no hooked fetch comes first, take the RNG now)."""
        self.step = step
        self._data = {k: copy.deepcopy(st.capture(self.state[k])) for k in self.data_keys}
        self._small = {"rng": st.rng_state()} if rng_now else {}   # copies: the generators move on
        self._boundary_due = True

    def at_boundary(self) -> None:
        """The instant between iterations (the first after :meth:`after_update`): keep the
        schedulers, plain values, RNG and module buffers as they are now."""
        if not self._boundary_due:
            return
        self._boundary_due = False
        # Copies, not flattened yet (that costs more than all of this and is needed only at a save).
        small = self._small if self._small is not None else {}
        small["late"] = copy.deepcopy({k: st.capture(self.state[k]) for k in self.late_keys})
        if "rng" not in small:
            small["rng"] = st.rng_state()
        small["buffers"] = self._buffers()
        self._small = small

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

    def usable(self, ckpt) -> str | None:
        """Why the live objects are no checkpoint of a step (None: they are one, of :attr:`step`)."""
        if not ckpt.writer:
            return "this rank does not write checkpoints"
        if not self.trusted:
            return (f"the failure came inside step {self.step + 1}'s optimizer update: the parameters may be "
                    f"partly updated, so the live state is not a checkpoint of any step")
        if self.step == 0 or self._small is None:
            return "no step completed in this attempt"
        return None

    def content(self, ckpt) -> tuple[dict, dict]:
        """``(manifest, tensors)`` of step :attr:`step` from the live objects: what a checkpoint
        of it holds (the tensors are the live ones, not copies: valid while nothing trains them).
        Call only when :meth:`usable` says so."""
        self.at_boundary()   # the failure came before the next boundary: the state is still its own
        small = self._small
        early = {k: (self._data[k] if k in self._data else st.capture(o))
                 for k, o in self.state.items() if ckpt._kinds[k] == st.EARLY}
        skeleton, tensors = flatten(early)
        st.refresh_optimizer_groups(skeleton, self.state)
        if small.get("buffers"):
            _, kept = flatten(small["buffers"])
            tensors.update({n: t for n, t in kept.items() if n in tensors})
        rng, _ = flatten(small["rng"], inline_tensors=True)
        late, _ = flatten(small["late"], inline_tensors=True)
        if small.get("buffers") is not None:
            rng["buffers"], _ = flatten(small["buffers"], inline_tensors=True)
        rngs = [None] * ckpt.world_size
        rngs[ckpt.rank] = rng
        manifest = {"step": self.step, "epoch": ckpt._epoch(), "epoch_end": False, "world_size": ckpt.world_size,
                    "skeleton": skeleton, "late": late, "rng": rng, "rngs": rngs,
                    "lineage": ckpt._lineage, "live": {"rank": ckpt.rank}}
        return manifest, tensors

    def save(self, ckpt, *, timeout_s: float, durable: bool = False) -> tuple[int | None, str]:
        """Write step :attr:`step` from the live objects through ``ckpt``'s backend (no store,
        no collective; ``durable``: to all its tiers, else a backend with ``submit_live`` writes
        its fastest only); blocks until it committed or ``timeout_s`` passed. Returns ``(step,
        why)``: the step written, or None and the reason nothing was."""
        why = self.usable(ckpt)
        if why is not None:
            return None, why
        if self.floor >= self.step:
            return None, f"step {self.step} is on storage already"
        t0 = time.perf_counter()
        manifest, tensors = self.content(ckpt)
        snap = Snapshotter(n_shards=len(ckpt.storages), shared=ckpt.backend.needs_shared_memory)
        try:
            snap.start(tensors, mode="cpu")
            snap.wait_copied()
            layout, host = snap.arenas(0)
            shards = shard_jobs(list(enumerate(layout)), host, count=len(layout), roots=len(ckpt.storages))
            job = PersistJob(step=self.step, manifest=manifest, shards=shards, keep=ckpt.config.keep,
                             arenas=[a.buf for a in host], io=ckpt.config.persist.io)
            live = getattr(ckpt.backend, "submit_live", None)
            info = (live(job, durable=durable) if live is not None else ckpt.backend.submit(job)).wait(timeout_s)
        finally:
            snap.close()
        self.floor = info.step
        ckpt._latest = max(ckpt._latest or 0, info.step)
        log.warning("rank %d wrote the live state of step %d after the group failed (%.3f s, %d bytes)",
                    ckpt.rank, info.step, time.perf_counter() - t0, info.bytes)
        return info.step, "written"
