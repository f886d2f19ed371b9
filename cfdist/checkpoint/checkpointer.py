"""``cfdist.Checkpointer``: the public two-phase checkpointer (CheckFreq, FAST'21).

::

    ckpt = cfdist.Checkpointer({"model": model, "optim": opt, "sched": sched, "data": loader},
                               storage="file:///mnt/ssd/run1", policy=cfdist.Every(50))
    start = ckpt.restore()                 # step of the checkpoint loaded, or None
    for batch in loader:
        loss_fn(model(batch)).backward()
        ckpt.step(opt)                     # replaces opt.step()
        sched.step()
    ckpt.close()

Call every method from the training thread. In a torch.distributed job every rank builds one
with the same arguments and calls ``step``, ``save`` and ``restore`` at the same steps; only the
writer rank (rank 0 by default) copies and persists tensors -- or, with ``writers="all"``, every
rank its own slice of them, rank 0 committing (:mod:`cfdist.checkpoint.slices`) -- and no rank
issues a collective on the training group: ranks agree on checkpoint steps, restore steps, RNG
states and finished slices through the c10d Store (:mod:`cfdist.checkpoint.agreement`).
"""

from __future__ import annotations

import concurrent.futures as cf
import hashlib
import json
import logging
import math
import threading
import time
import uuid
import warnings

import torch

from cfdist.checkpoint import agreement, discovery, latest as newest, peer, retention, roots, slices, state as st
from cfdist.checkpoint.codecs.pipeline import encode_work, resolve_codecs, validate_codecs
from cfdist.checkpoint.flatten import flatten, unflatten
from cfdist.checkpoint.live import LiveState
from cfdist.checkpoint.format import CheckpointError, step_dir
from cfdist.checkpoint.persist import PersistBackend, PersistJob, ProcessBackend, ThreadBackend, shard_jobs
from cfdist.checkpoint.pipeline import PersistPipeline
from cfdist.checkpoint.slice_commit import SliceCommit
from cfdist.checkpoint.options import (
    CheckpointerConfig, GroupOptions, LoadOptions, PersistOptions, from_legacy,
)
from cfdist.checkpoint.snapshot import Snapshotter
from cfdist.policy.base import StepMeasurement, as_policy
from cfdist.storage import open_storages
from cfdist.storage.direct import resolve as resolve_io
from cfdist.storage.redact import redact

log = logging.getLogger("cfdist.checkpointer")

HISTORY = "history.json"

_LIVE_SETTLE_S = 2.0
"""How long ``save_live`` gives a checkpoint in flight to commit before writing the live state."""
_LIVE_PEER_S = 0.2
"""... and how long one that waits for other ranks (after the group failed) before it is given up."""


def _default_policy():
    try:
        from cfdist.policy.auto import Auto
    except ImportError:  # pragma: no cover - Auto ships with cfdist.policy
        from cfdist.policy.base import Every
        return Every(50)
    return Auto()


def _legacy_writer(writer: bool, writers):
    """``writers`` given the deprecated ``writer=`` (a bool): it becomes ``writers=writer``
    unless ``writers`` says otherwise (a ValueError), or asks for slices (then ``writer`` must
    agree with the rank's slice role: :meth:`Checkpointer._slice_plan` checks it)."""
    warnings.warn(f"Checkpointer(writer=...) is deprecated: pass writers={writer} (this rank writes the full "
                  f"state, or nothing)", DeprecationWarning, stacklevel=3)
    if writers == "node":
        return writer
    if isinstance(writers, bool) and writers != writer:
        raise ValueError(f"writer={writer} contradicts writers={writers}; pass writers= only")
    return writers


class _Handle:
    """Returned by :meth:`Checkpointer.save`: ``wait()`` blocks until that checkpoint committed."""

    def __init__(self, ckpt: "Checkpointer", step: int):
        self._ckpt, self.step = ckpt, step

    def done(self) -> bool:
        return self._ckpt.latest_step is not None and self._ckpt.latest_step >= self.step

    def wait(self) -> int:
        self._ckpt.wait()
        return self.step


class Checkpointer:
    """Two-phase, iteration-level checkpointing of a training state.

    Args:
        state: ``{name: object}``; objects with ``state_dict()``/``load_state_dict()``
            (modules, optimizers, schedulers, cfdist data loaders), tensors, or plain values.
        storage: an fsspec URL, or a list of URLs to stripe each checkpoint over (several disks).
        policy: when to checkpoint (``cfdist.Every(k)``, ``cfdist.EveryEpoch()``,
            ``cfdist.Auto()``); default ``cfdist.Auto()``.
        keep: newest committed checkpoints to keep (default 2).
        keep_epoch_ends: also keep the N most recent epoch-end checkpoints (default 0).
        writers: who persists: ``"node"`` (default: rank 0 writes the full state),
            ``True``/``False`` (this rank writes the full state / nothing; e.g.
            ``local_rank == 0`` for a copy on each node's disk), ``"all"`` (every rank writes a
            byte-balanced slice, rank 0 commits once all are durable) or an int N (ranks
            0..N-1 do); see :class:`CheckpointerConfig`.
        buffers: sets of snapshot buffers; 2 lets snapshot i+1 start while persist i still
            writes (double buffering, 2 x the state in host memory).
        host_memory: a budget for the snapshots' host memory, bytes or a fraction of the state
            (default None: ``buffers`` full copies); snapshots then stream through a bounded
            pool of chunks into the persist (:mod:`cfdist.checkpoint.chunks`); with codecs the
            persist encodes them chunk by chunk (framed shards), and chain codecs' references
            are kept beside the budget (:attr:`reference_bytes`).
        codecs: ``cfdist.codecs`` objects that make checkpoints smaller (``Incremental``,
            ``Quantize``, ``LCDelta``, ``Zstd``); they run in the persist path. Default: none,
            the plain safetensors format.
        restore_from: further storages (URL or list of URLs each) that ``restore`` searches,
            e.g. an in-memory tier before and a shared tier after the node-local one.
        storage_options: passed to fsspec (credentials, endpoint_url, ...).
        persist: :class:`~cfdist.PersistOptions` (backend, ``timeout_s`` for a hung persist,
            file I/O mode).
        load: :class:`~cfdist.LoadOptions` (checksums, retries of storage errors on restore).
        group: :class:`~cfdist.GroupOptions` (rank, world size, the store ranks agree through,
            agreement window and timeout); defaults from torch.distributed.

    The flat keywords of earlier versions (``persist_timeout_s=``, ``backend=``, ``io=``,
    ``verify=``, ``read_retry=``, ``rank=``, ``world_size=``, ``store=``, ``lookahead=``,
    ``agree_timeout_s=``, ``writer=``) still work, with a ``DeprecationWarning`` naming the new
    spelling.

    A checkpoint of step i is the state at the end of iteration i. Parameters and optimizer
    state are copied while iteration i+1 runs (its update waits for the copy: the gate); what a
    forward mutates in place (module buffers such as BatchNorm statistics, and bare tensors in
    ``state``) is copied before ``step`` returns.
    """

    Config = CheckpointerConfig

    def __init__(self, state: dict, storage, policy=None, *, keep: int = 2, keep_epoch_ends: int = 0,
                 writers: str | int | bool = "node", buffers: int = 1, host_memory: int | float | None = None,
                 codecs=None, restore_from=None,
                 storage_options: dict | None = None, persist: PersistOptions | None = None,
                 load: LoadOptions | None = None, group: GroupOptions | None = None, **deprecated):
        writer = deprecated.pop("writer", None)
        groups = from_legacy({"persist": persist, "load": load, "group": group}, deprecated)
        if writer is not None:
            writers = _legacy_writer(bool(writer), writers)
        self.config = CheckpointerConfig(keep=keep, keep_epoch_ends=keep_epoch_ends, writers=writers, buffers=buffers,
                                         host_memory=host_memory,
                                         persist=groups["persist"] or PersistOptions(),
                                         load=groups["load"] or LoadOptions(), group=groups["group"] or GroupOptions())
        persist, grp = self.config.persist, self.config.group
        self.state = state
        self._kinds = st.classify(state)
        self.storages = open_storages(storage, **(storage_options or {}))
        self.tiers = [self.storages] + [open_storages(s, **(storage_options or {})) for s in (restore_from or [])]
        dist = torch.distributed.is_available() and torch.distributed.is_initialized()
        self.rank = grp.rank if grp.rank is not None else (torch.distributed.get_rank() if dist else 0)
        self.world_size = (grp.world_size if grp.world_size is not None
                           else (torch.distributed.get_world_size() if dist else 1))
        self._slicer = self._slice_plan(writer, codecs)
        if self._slicer is not None:
            self.writer = self.rank < self._slicer.writers
        elif isinstance(self.config.writers, bool):
            self.writer = self.config.writers
        else:
            self.writer = self.rank == 0
        self.policy = policy if policy is not None else _default_policy()
        self._policy = as_policy(self.policy)   # every hook of cfdist.policy.Policy; TypeError if not a policy
        if isinstance(persist.backend, str):
            # the filesystem's own options: storage_options plus any credentials taken from the URL
            self.backend: PersistBackend = (ProcessBackend(self.storages, dict(self.storages[0].fs.storage_options))
                                            if persist.backend == "process" else ThreadBackend(self.storages))
        else:
            self.backend = persist.backend
        self._channel, self._rngx = self._agreement_channel(grp.store), None
        self._freq = agreement.Frequency(self._channel, rank=self.rank, lookahead=grp.lookahead)
        # The one process that commits, sweeps and keeps the run's files (history, profile).
        self._commits = commits = self.writer and self.rank == 0 if self._slicer is not None else self.writer
        if self._channel is not None:
            self._rngx = agreement.RngExchange(self._channel, writer=commits)
        # One owner per persist, from the snapshot hand-off to the commit: ordering, every
        # rank's RNG, the sliced commit and the write are its stages; its handles can always
        # be given up (PersistOptions.timeout_s), on any world size, writers and buffers.
        self._pipeline = PersistPipeline(
            self.backend, rng=self._rngx if commits else None,
            slices=SliceCommit(self._channel, index=self.rank, writers=self._slicer.writers)
            if self._slicer is not None and self.writer else None)
        self._restores = 0
        if host_memory is not None and not getattr(self.backend, "streams", False):
            raise ValueError(f"host_memory= streams snapshots into the writer; the {type(self.backend).__name__} "
                             f"reads whole snapshots (cfdist.fit's node actors do, for their memory tier): use "
                             f"PersistOptions(backend='thread') (the default) or 'process' with a host-memory "
                             f"budget")
        if host_memory is not None and codecs and not getattr(self.backend, "streams_codecs", False):
            raise ValueError(f"host_memory= with codecs needs a backend that encodes the snapshot as it streams; the "
                             f"{type(self.backend).__name__} does not (cfdist.fit's node actors write the local tier "
                             f"from the memory tier's files, which would hold encoded frames): drop host_memory= or "
                             f"codecs= there, or use PersistOptions(backend='thread' or 'process')")
        # Codecs under a budget encode the snapshot chunk by chunk as it streams (framed shards,
        # :mod:`cfdist.checkpoint.format`); the budget sets aside what the encoding holds.
        codec_work = encode_work(validate_codecs(codecs)) if host_memory is not None and self.writer else 0.0
        self._snap = Snapshotter(n_shards=len(self.storages), shared=self.backend.needs_shared_memory,
                                 buffers=self.config.buffers, host_memory=host_memory,
                                 whole_bytes=st.mutable_in_forward_bytes(state) if self.writer and host_memory else 0,
                                 keeps_hung_writers=getattr(self.backend, "keeps_hung_writers", False),
                                 codec_work=codec_work)
        if host_memory is not None:   # the budgeted gate waits for chunks that only persists give back
            self._snap.on_wait = self._expire_inflight
        if self.writer and persist.io == "direct":   # asked for explicitly: refuse where it cannot be had
            for st_ in self.storages:
                if not st_.is_local:
                    raise ValueError(f"io='direct' needs local file:// roots; {st_.url} is written through "
                                     f"fsspec: use io='auto'")
                resolve_io("direct", st_.path())
        if commits:
            discovery.sweep(self.storages)   # refuses a reordered list or an empty root 0 first
        else:
            roots.check(self.storages, create=False)
        self._step = 0
        self._lock = threading.Lock()
        self._pending: dict | None = None      # snapshot taken, small state not yet captured
        self._ready: dict | None = None        # fully captured, waiting for the copy to finish
        self._inflight: list = []             # (Pending persist, arena set) in step order
        self._snapped_step: int | None = None  # step of the latest snapshot taken
        self._error: BaseException | None = None
        self._last_return: float | None = None
        self._persist_done: tuple[float, int, int] | None = None
        self._stats = dict(checkpoints=0, errors=0, stall_s=0.0, snapshot_s=0.0, snapshots=0, files_reused=0,
                           persist_s=0.0, bytes=0, last_error=None, bytes_logical=0, bytes_written=0,
                           persist_waits=0, persist_wait_s=0.0, io=None)
        # This run's lineage (retention deletes only its ancestors); restore() replaces it.
        self._lineage = retention.job_lineage(self._channel)   # one per job: every writer's copies match
        self._rolled_back: dict[int, str] = {}   # step -> why restore rolled back past it
        latest = discovery.find_latest([self.storages], retry=self.config.load.read_retry)
        self._latest: int | None = None
        self.latest_step = latest.step if latest else None
        self._hooks = []
        self._fetch_hooked = False   # a data iterator calls _on_boundary before each fetch
        for k, obj in state.items():
            if isinstance(obj, torch.nn.Module):
                self._hooks.append(obj.register_forward_pre_hook(self._boundary_hook))
            elif hasattr(obj, "register_before_next_hook"):
                self._hooks.append(obj.register_before_next_hook(self._boundary_hook))
                self._fetch_hooked = True
        self._copies_reported = 0
        # Every rank keeps it (a non-writer survivor keeps it in process for the next group: ``keep_live``)
        self._live = LiveState(state, self._kinds) if grp.live else None
        self._bind_policy()
        self.codecs = resolve_codecs(codecs, mtbf_s=self._policy.mtbf_s, history=self._read_json(HISTORY))
        self._codec_session = uuid.uuid4().hex
        self._chains = [c for c in self.codecs if c.kind == "chain"] if host_memory is not None and self.writer else []
        self._ref_layout: tuple | None = None
        self.reference_bytes = 0
        """Host memory chain codecs (``Incremental``, ``LCDelta``) keep *outside* ``host_memory``:
        one copy of the tensors they select, as their reference (``LCDelta``: up to twice that
        while a persist runs). Counted when the Checkpointer is built and at each snapshot (an
        optimizer's state appears after its first step); 0 without chain codecs or a budget."""
        if self._chains:
            _, tensors = flatten({k: st.capture(o) for k, o in state.items() if self._kinds[k] == st.EARLY})
            self._count_references(tensors)
            log.info("host_memory=%r bounds the snapshots; the chain codecs' references are kept beside it: %d "
                     "bytes now (one copy of the tensors %s select%s)", host_memory, self.reference_bytes,
                     " and ".join(type(c).__name__ for c in self._chains), "" if len(self._chains) > 1 else "s")

    def _count_references(self, tensors: dict) -> None:
        """:attr:`reference_bytes` for a snapshot of ``tensors`` (recounted for a new layout only)."""
        layout = tuple((n, t.dtype, tuple(t.shape)) for n, t in tensors.items())
        if layout != self._ref_layout:
            self._ref_layout = layout
            self.reference_bytes = sum(math.prod(s) * d.itemsize for n, d, s in layout
                                       if any(c.selects(n, d, s) for c in self._chains))

    def _slice_plan(self, writer: bool | None, codecs) -> "slices.Slicer | None":
        """The sliced-persist plan of this rank (``writers="all"`` or N >= 2), or None (one writer)."""
        w = self.config.writers
        if w == "node" or isinstance(w, bool):
            return None
        n = self.world_size if w == "all" else w
        if n > self.world_size:
            raise ValueError(f"writers={w!r} but the job has world_size={self.world_size} rank(s): at most "
                             f"{self.world_size} can write a slice; pass writers='all' or an int <= {self.world_size}")
        if writer is not None and bool(writer) != (self.rank < n):
            raise ValueError(f"writer={writer!r} contradicts writers={w!r} on rank {self.rank}: with writers='all' "
                             f"or N, ranks 0..{n - 1} write a slice each and the others none; pass writers= only "
                             f"(writer= is deprecated)")
        if n == 1:
            return None
        if codecs:
            raise ValueError(f"writers={w!r} cannot be combined with codecs={codecs!r} yet: codecs encode whole "
                             f"tensors against per-writer references; use writers='node' with codecs")
        return slices.Slicer(self.rank if self.rank < n else 0, n)

    def _agreement_channel(self, store):
        """This Checkpointer's namespace in the store ranks agree through (None: one process)."""
        if self.world_size == 1:
            return None
        store = store if store is not None else agreement.default_store()
        if store is None:
            raise ValueError(
                f"world_size={self.world_size} but torch.distributed is not initialised and no store= "
                f"was given: ranks agree on checkpoint steps, RNG states and the step to restore through "
                f"a c10d Store. Fix: call torch.distributed.init_process_group() before building the "
                f"Checkpointer, or pass store= (e.g. a torch.distributed.TCPStore every rank reaches)")
        return agreement.Channel(store, rank=self.rank, world_size=self.world_size,
                                 timeout_s=self.config.group.agree_timeout_s)

    # ---- policy wiring -------------------------------------------------------------------------
    def _bind_policy(self) -> None:
        from cfdist.policy import base as pb

        if not self._policy.binds:   # Every, EveryEpoch: no file read, no store exchange
            return

        nbytes, layout = 0, []
        for k, obj in self.state.items():
            if self._kinds[k] == st.EARLY:
                _, ts = flatten(st.capture(obj), k)
                nbytes += sum(t.numel() * t.element_size() for t in ts.values())
                layout += [(n, str(t.dtype), list(t.shape)) for n, t in ts.items()]
        signature = hashlib.sha256(json.dumps(layout).encode()).hexdigest()[:16]
        loader = self._loader()
        device = "cuda" if any(isinstance(o, torch.nn.Module) and any(p.is_cuda for p in o.parameters())
                               for o in self.state.values()) else "cpu"
        # rank 0's files decide for every rank: each rank reads its own storages[0] (a node's
        # local tier, a memory tier a preemption emptied), and ranks that bound their policies
        # to different profiles or histories took checkpoints at different steps, then waited
        # for each other's RNG states for ever
        shared = self._from_rank0("history", lambda: {"history": self._read_json(HISTORY), "now": time.time()})
        hist, self._bound_at = shared["history"] or {}, shared["now"]
        ctx = pb.PolicyContext(
            rank=self.rank, world_size=self.world_size, state_bytes=nbytes, device=device,
            batch_size=getattr(loader, "batch_size", None),
            iters_per_epoch=len(loader) if loader is not None and hasattr(loader, "__len__") else None,
            # restarts from a survivor's live state rolled nothing back: not the failures an
            # interval answers to (with live recovery, those that take every replica)
            cached_profile=None, failure_times_s=[r["time"] for r in hist.get("restarts", []) if not r.get("live")],
            now_s=self._bound_at, started_s=hist.get("started"), state_signature=signature,
            buffers=self.config.buffers, live_recovery=self.config.group.live and self.world_size > 1,
        )
        self._profile_name = f"profile-{pb.profile_key(ctx)}.json"
        cached = self._from_rank0("profile", lambda: self._read_json(self._profile_name))
        if cached is not None:
            ctx = pb.PolicyContext(**{**{f: getattr(ctx, f) for f in ctx.__dataclass_fields__}, "cached_profile": cached})
        self._policy.bind(ctx)

    def _from_rank0(self, what: str, read):
        """``read()`` on rank 0, and the same (JSON) value on every other rank, through the
        agreement channel; ``read()`` itself in one process."""
        if self._channel is None:
            return read()
        if self.rank == 0:
            value = read()
            self._channel.set(f"bind/{what}", json.dumps(value).encode())
            return value
        raw, = self._channel.get_all([f"bind/{what}"], what=f"rank 0's {what} file (the policy's inputs)",
                                     fix="every rank must build its Checkpointer (rank 0 may have died or stalled)")
        return json.loads(raw)

    def _read_json(self, rel: str) -> dict | None:
        try:
            return json.loads(self.storages[0].read_bytes(rel))
        except (FileNotFoundError, OSError, ValueError):
            return None

    def _save_profile(self) -> None:
        prof = self._policy.profile_to_save()
        if prof is not None and self._commits and getattr(self, "_profile_name", None):
            try:
                self.storages[0].write_atomic(self._profile_name, json.dumps(prof).encode())
            except OSError as e:
                log.warning("could not cache the policy profile in %s: %s", self.storages[0].url, e)

    # ---- the training-loop API -----------------------------------------------------------------
    def _loader(self):
        for k, obj in self.state.items():
            if st.is_data_iterator(obj):
                return obj
        return None

    def _epoch(self) -> int | None:
        loader = self._loader()
        return getattr(loader, "epoch", None) if loader is not None else None

    def _epoch_end(self) -> bool:
        loader = self._loader()
        fn = getattr(loader, "at_epoch_end", None)
        return bool(fn()) if fn else False

    @property
    def step_count(self) -> int:
        """Optimizer steps done (restored from the checkpoint by ``restore``)."""
        return self._step

    @property
    def latest_step(self) -> int | None:
        """The newest committed step (None: none), the same on every rank.

        The committing rank knows it from its own persists (after they are collected, at the
        next ``step``/``save``/``wait``) and restores; it publishes it through the store, where
        every other rank reads it (one round trip per read; :mod:`cfdist.checkpoint.latest`).
        A writer that does not commit (``writers="all"``/N) knows a step committed once its own
        persist of it returned (the sliced commit's outcome), possibly before the committing
        rank collected and published it: it reads the newer of the two. Training thread."""
        if self._commits or self._channel is None:
            return self._latest
        published = newest.read(self._channel, self._latest)
        if self.writer and self._latest is not None and (published is None or self._latest > published):
            return self._latest
        return published

    @latest_step.setter
    def latest_step(self, step: int | None) -> None:
        self._set_latest(step, newer_only=True)

    def _set_latest(self, step: int | None, *, newer_only: bool) -> None:
        self._latest = step
        if self._commits and self._channel is not None:
            newest.publish(self._channel, step, newer_only=newer_only)

    def step(self, optimizer=None, closure=None, *, scaler=None):
        """Replaces ``optimizer.step()`` (or ``scaler.step(optimizer); scaler.update()``): gate,
        step, count, maybe snapshot. Call once per optimizer update (with gradient accumulation:
        on the update steps only), from the training thread.

        Blocks while the previous snapshot's copy is unfinished (the gate); at a checkpoint
        step, also while the previous checkpoint's persist is still in flight (its buffers are
        about to be reused), and while module buffers are copied. These waits are the stall.
        ``scaler``: a ``torch.amp.GradScaler``; its ``step(optimizer)`` and ``update()`` run
        inside the gate. Put it in the state dict to checkpoint it.
        Returns what ``optimizer.step`` (or ``scaler.step``) returned.
        """
        if scaler is not None and closure is not None:
            raise ValueError("ckpt.step(optimizer, closure, scaler=...): a GradScaler does not support "
                             "an optimizer closure; call the closure yourself before ckpt.step")
        if scaler is not None and optimizer is None:
            raise ValueError("ckpt.step(scaler=...) needs the optimizer the scaler steps: ckpt.step(opt, scaler=scaler)")
        t_enter = time.perf_counter()
        self._on_boundary()
        if not self._hooks:   # no hooked fetch or forward saw the boundary: this is it
            self._halt_point()
        self._harvest()
        self._halt_point()   # a halt announced during this step does not wait for the gate
        stall, self._gate_stall = self._snap.wait_copied() + self._gate_stall, 0.0
        t0 = time.perf_counter()
        out = None
        live = self._live
        if live is not None:
            with live.lock:   # a halt on another thread sees the update under way, or it does not run
                self._halt_point()
                live.in_update = True   # stays set if the update raises: the state is torn
                live.own_updates = optimizer is not None
        else:
            self._halt_point()   # a halt announced during this step: its update does not run
        if scaler is not None:
            out = scaler.step(optimizer)
            scaler.update()
        elif optimizer is not None:
            out = optimizer.step(closure) if closure is not None else optimizer.step()
        update_s = time.perf_counter() - t0
        self._step += 1
        if live is not None:
            with live.lock:
                live.in_update = False
                live.after_update(self._step, rng_now=not self._fetch_hooked, epoch=self._epoch())
        epoch_end = self._epoch_end()
        took = self._agreed_decision(epoch_end)
        if took:
            stall += self._begin(epoch_end)
        elif self._prefault_due:
            self._prefault_arenas()
        self._prefault_due = False
        now = time.perf_counter()
        iter_s = now - self._last_return if self._last_return is not None else now - t_enter
        self._last_return = now
        self._stats["stall_s"] += stall
        pd, self._persist_done = self._persist_done, None
        snapshot_s = None
        if self._snap.copies != self._copies_reported:  # a copy finished since the last report
            self._copies_reported = self._snap.copies
            snapshot_s = self._snap.last_copy_s
            if self._snap.host_memory is not None:
                self._stats["snapshot_s"] += snapshot_s or 0.0
        self._policy.observe(StepMeasurement(
            step=self._step, iter_s=iter_s, stall_s=stall, update_s=update_s,
            snapshot_s=snapshot_s, snapshot_device=self._snap.last_device,
            persist_s=pd[0] if pd else None, persist_bytes=pd[1] if pd else None,
            persist_step=pd[2] if pd else None, checkpointed=took,
        ))
        self._save_profile()
        return out

    def _agreed_decision(self, epoch_end: bool) -> bool:
        """Whether this step is a checkpoint step: the same answer on every rank."""
        k, save_now = self._freq.at_step(self._step, self._policy.proposal)
        if k and k != self._agreed_k:
            self._agreed_k = k
            self._policy.agreed(k, self._step)
        return bool(self._policy.should_checkpoint(self._step, epoch_end=epoch_end)) or save_now

    _gate_stall = 0.0

    def gate(self) -> float:
        """Block until the in-flight snapshot's copy finished; returns the seconds waited.

        For loops whose optimizer update does not go through :meth:`step` (framework callbacks:
        Lightning's ``on_before_optimizer_step``): call right before the update, then
        ``step()`` without an optimizer right after it. The wait counts as the next step's stall.
        """
        s = self._snap.wait_copied()
        self._gate_stall += s
        return s

    def boundary(self) -> None:
        """Mark the instant between iterations now: the small state (schedulers, plain values,
        RNG) of a snapshot just begun is captured here instead of at the next fetch or forward.
        For loops that fetch or run forward where the checkpointer cannot see it (framework
        callbacks); call after the scheduler step, before the next batch is fetched."""
        self._on_boundary()
        self._halt_point()

    _agreed_k = 0

    def request_save(self) -> None:
        """Checkpoint soon, at a step every rank agrees on (a preemption notice, SIGTERM).

        Unlike :meth:`save`, one rank is enough, at any step: in a multi-rank job the request
        goes through the store and every rank checkpoints the same step, within
        ``2 * lookahead`` steps; in one process, at the next ``step``. Training thread.
        """
        self._freq.request_save()

    def save(self, block: bool = False) -> _Handle:
        """Checkpoint now (end of run), between two training steps.

        In a multi-rank job call it on every rank at the same step (the writers need every
        rank's RNG state of that step); for a notice that reaches one rank use
        :meth:`request_save`. ``block=True`` returns once it committed; otherwise ``wait()``
        the returned handle.
        """
        self._on_boundary()
        self._harvest()
        self._snap.wait_copied()
        # Not again for a step already snapshotted or restored (its persist may still be in
        # flight): a second persist of the same step would have to replace the first's commit.
        if self._snapped_step != self._step:
            self._begin(self._epoch_end())
        self._on_boundary()
        h = _Handle(self, self._step)
        if block:
            h.wait()
        return h

    def save_live(self, timeout_s: float = 30.0, durable: bool = False) -> int | None:
        """After the group failed (a peer died: a collective raised), write the live state of
        the last completed step, without any collective or the store; returns that step, or
        None when nothing was written (the reason is logged).

        Needs ``group=cfdist.GroupOptions(live=True)`` (``cfdist.fit`` sets it) and a writer
        rank. Nothing is written when the step is committed already, when no step completed, or
        when the failure came inside the optimizer update (the parameters may be partly
        updated: ``ckpt.step``'s ``optimizer.step()`` raised). The checkpoint holds this rank's
        RNG states; the other ranks resume with derived ones (:mod:`cfdist.checkpoint.live`).
        A persist of this Checkpointer still in flight is given up to ``timeout_s`` to commit
        first. ``durable`` (every node is about to be taken: only what reaches disk counts): to
        the backend's durable tiers (a node actor's local disk, not its memory tier), and
        nothing older is waited for: the snapshot not yet submitted is dropped and the
        persists in flight are given up, except one of the same step at its write or
        committing (see :meth:`_settle_superseded`; the live state supersedes an older step, and
        a persist of the same step may wait for the RNG states of a rank that died with the
        notice, while the live state holds this rank's). Raises what the write raised (its own
        timeout included). Training thread, after the loop was left."""
        if not self.writer:
            log.info("rank %d writes no checkpoints: no live state to save", self.rank)
            return None
        if self._live is None:
            raise RuntimeError("save_live() needs the live state kept at every step: build the Checkpointer "
                               "with group=cfdist.GroupOptions(live=True)")
        deadline = time.monotonic() + min(timeout_s, _LIVE_SETTLE_S)
        if durable:
            self._settle_superseded(deadline)
        else:
            self._settle_inflight(deadline)
        if self._latest is not None and self._live.floor < self._latest:
            self._live.floor = self._latest
        step, why = self._live.save(self, timeout_s=timeout_s, durable=durable)
        if step is None:
            log.info("rank %d: no live state written (%s)", self.rank, why)
        return step

    def _settle_superseded(self, deadline: float) -> None:
        """Before a durable live save (every node is about to be taken: only what reaches disk
        before the kill counts), clear the way for the live state of the last completed step
        ``n`` without waiting for anything older. The snapshot not submitted yet is dropped:
        its persist would first wait for every rank's RNG states through the job's store, which
        lives in rank 0's process (the noticed rank may be killed; that wait cost 0.2 s of a
        0.16 s grace). The persists in flight are given up, except one of step ``n`` already at
        its backend's write (its commit is the live save's, and it is further along): that one
        is waited for, until ``deadline``. One that cannot be given up any more (committing)
        is waited for only if it holds step ``n``; an older one is left to its backend, whose
        writer takes the live job after it (a node actor cuts its disk write short:
        :meth:`~cfdist.cluster.node_actor.NodeCheckpointer.persist`)."""
        n = self._live.step
        with self._lock:   # the snapshot thread may be submitting it right now
            dropped, self._ready = self._ready, None
        if dropped is not None:
            log.info("rank %d: the snapshot of step %d is not persisted; the live state of step %d is written "
                     "instead", self.rank, dropped["step"], n)
        wait = []
        for p, _ in list(self._inflight):
            if p.done():
                continue
            if p.step >= n and p.stage == "write":
                wait.append(p)
            elif p.abandon():
                log.info("rank %d: the persist of step %d is given up for the live state of step %d",
                         self.rank, p.step, n)
            elif p.step >= n:   # committing: that is the step the live save would write
                wait.append(p)
        for p in wait:
            try:
                info = p.wait(max(0.0, deadline - time.monotonic()))
            except Exception:  # noqa: BLE001 - its own error (or timeout), recorded by _harvest
                continue
            self._live.floor = max(self._live.floor, info.step)   # _harvest collects in step order only
        self._harvest(publish=False)

    def _yield_to_live(self, n: int) -> bool:
        """On a halt's notice thread (:meth:`LiveState.halt`), for step ``n`` whose regular
        snapshot was taken: whether the live state of ``n`` may be sent now, with no other
        commit of ``n`` to race with. True when nothing of ``n`` is committed or on its way to
        a commit: its snapshot not yet handed to its persist is dropped, and a persist of it
        that has not reached its backend's write is given up (it waits for the other ranks'
        RNG states through the job's store: a noticed rank may be killed, and that wait held
        the live save until the survivor's collective failed, after the kill). False when a
        persist of ``n`` is writing, committing or committed: that one writes the step (and
        :meth:`_settle_superseded` waits for it)."""
        if (self._latest or 0) >= n:
            return False
        with self._lock:   # the snapshot thread may be submitting it right now
            if self._ready is not None and self._ready["step"] == n:
                self._ready = None
                log.info("rank %d: the snapshot of step %d is not persisted; its live state is written instead",
                         self.rank, n)
            mine = [p for p, _ in self._inflight if p.step == n]
        for p in mine:
            if p.done():
                try:
                    p.wait(0)
                except Exception:  # noqa: BLE001 - failed or given up (its error is _harvest's): no commit
                    continue
                return False       # committed
            elif p.stage == "write" or not p.abandon():
                return False       # writing, or its commit was claimed: it writes the step
            else:
                log.info("rank %d: the persist of step %d is given up for its live state", self.rank, n)
        return True

    def _settle_inflight(self, deadline: float) -> None:
        """Give the snapshot copy and the persists in flight until ``deadline`` to finish,
        and collect them. A persist still waiting for other ranks (their RNG states, their
        slices) after ``_LIVE_PEER_S`` is given up: the group failed, the rank it waits for may
        be dead, and the live state replaces it (a live peer sends its part as it finishes its
        step, long before its collective fails)."""
        fut = self._snap_host_future
        try:
            if fut is not None:
                fut.result(timeout=max(0.0, deadline - time.monotonic()))
            self._try_submit()
            peers_by = min(deadline, time.monotonic() + _LIVE_PEER_S)
            for p, _ in list(self._inflight):
                try:
                    p.wait(max(0.0, peers_by - time.monotonic()))
                except cf.TimeoutError:
                    if p.waits_for_peers and p.abandon():
                        log.info("rank %d: the persist of step %d still waited for other ranks (%s) %.1f s after "
                                 "the group failed: given up for the live state", self.rank, p.step, p.stage,
                                 _LIVE_PEER_S)
                except Exception:  # noqa: BLE001 - its own error, recorded by _harvest
                    pass
            for p, _ in list(self._inflight):
                if not p.done():   # an ended one's error is _harvest's
                    p.wait(max(0.0, deadline - time.monotonic()))
        except Exception as e:  # noqa: BLE001 - that persist's own error is recorded by _harvest
            log.info("rank %d: a checkpoint in flight did not finish before the live save (%s)", self.rank,
                     type(e).__name__)
        self._harvest(publish=False)

    def wait(self) -> None:
        """Block until the last snapshot committed; re-raise a background failure (once)."""
        self._on_boundary()
        self._snap.wait_copied()
        if self._snap_host_future is not None:
            self._snap_host_future.result()
        self._try_submit()
        self._wait_inflight()
        self._harvest()
        err, self._error = self._error, None
        if err is not None:
            raise err

    def close(self) -> None:
        """Wait for the last persist to commit, then release buffers and threads."""
        if getattr(self, "_closed", False):
            return
        try:
            self.wait()
            self._save_profile()
            if self._commits:
                _drop_reuse_pools(self.storages)   # a finished run leaves its checkpoints only
        finally:
            self._closed = True
            for h in self._hooks:
                h.remove()
            if self._live is not None:
                self._live.discard()
            self._snap.close()
            self._pipeline.close()

    def abandon(self) -> None:
        """Drop this Checkpointer without waiting for its persist: its training attempt failed
        (a peer rank died) and the process is reused for the next one. Removes the hooks, lets
        the snapshot copy in progress finish, frees the arenas and threads; a persist in flight
        is left to its backend (a node actor refuses a replaced attempt's persist). Call on the
        training thread after the loop was left; never raises for the failed attempt's errors."""
        if getattr(self, "_closed", False):
            return
        self._closed = True
        for h in self._hooks:
            h.remove()
        if self._live is not None:
            self._live.discard()
        self._snap.cancel()   # a budgeted copy whose persist will never run stops at its next chunk
        self._snap.close()
        self._pipeline.detach()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    @property
    def stats(self) -> dict:
        s = self._stats
        n = max(s["checkpoints"], 1)
        out = {
            "steps": self._step, "checkpoints": s["checkpoints"], "k": self._policy.k,
            "mode": self._policy.mode, "latest_step": self.latest_step,
            "mean_stall_s": s["stall_s"] / max(s["snapshots"], 1),
            "mean_snapshot_s": s["snapshot_s"] / max(s["snapshots"], 1),
            "mean_persist_s": s["persist_s"] / n, "bytes": s["bytes"], "errors": s["errors"],
            "last_error": s["last_error"], "total_stall_s": s["stall_s"],
            "agreement": self._freq.describe(), "agreement_reads": self._freq.reads,
            "agreement_wait_s": self._channel.waited_s if self._channel is not None else 0.0,
            "bytes_logical": s["bytes_logical"], "bytes_written": s["bytes_written"],
            "buffers": self.config.buffers, "arena_bytes": self._snap.arena_bytes,
            "persist_waits": s["persist_waits"], "persist_wait_s": s["persist_wait_s"],
            "inflight": sum(1 for p, _ in self._inflight if not p.done()), "io": s["io"],
            "files_reused": s["files_reused"],
        }
        pool = self._snap.pool
        if self.config.host_memory is not None:
            out.update(host_memory=self.config.host_memory, chunk_bytes=pool.chunk_bytes if pool else None,
                       chunk_waits=pool.waits if pool else 0, chunks_retired=pool.retired if pool else 0,
                       reference_bytes=self.reference_bytes)
        out.update({k: v for k, v in self._policy.stats().items() if k not in ("checkpoints", "errors", "bytes")})
        return out

    # ---- phase 1 and the boundary --------------------------------------------------------------
    _snap_host_future = None
    _buffers_warned = False

    def _begin(self, epoch_end: bool) -> float:
        """Start a snapshot of the current step; returns the seconds the training thread spent in
        it, all of them stall: waiting for a persist to free a buffer set, capturing and
        flattening the state, starting the copy (milliseconds on models of hundreds of tensors:
        what a benchmark timing the step from the outside sees, and what ``Auto`` must weigh)."""
        t0 = time.perf_counter()
        if self._snap_host_future is not None:
            self._snap_host_future.result()
        self._try_submit()
        slot = self._free_arenas()   # waits only while every arena set is held by a persist
        self._harvest()
        skeleton, tensors = self._capture_early()
        if self._chains:
            self._count_references(tensors)
        self._pending = {"step": self._step, "epoch": self._epoch(), "epoch_end": epoch_end,
                         "skeleton": skeleton, "slot": slot}
        if not self._fetch_hooked:
            # The next forward comes after the next fetch, which may draw from the RNG
            # (augmentation); in the ordinary loop nothing else draws before it.
            self._pending["rng"], _ = flatten(st.rng_state(), inline_tensors=True)
        if self._rngx is not None:   # this rank's BatchNorm statistics, encoded before the next forward
            own = st.rank_buffers(self.state)
            if own is not None:
                self._pending["buffers"], _ = flatten(own, inline_tensors=True)
            elif not self._buffers_warned:
                self._buffers_warned = True
                log.warning("rank %d's module buffers exceed %d bytes: they do not travel with its RNG states, "
                            "and after a restore every rank holds the writer's (DDP's broadcast_buffers makes "
                            "them equal at the next forward anyway)", self.rank, st.RANK_BUFFERS_MAX_BYTES)
        self._stats["snapshots"] += 1
        self._snapped_step = self._step
        if self.writer:
            mode = self._policy.mode
            self._snap.select(slot)
            tensors, first = self._written(tensors)
            self._snap.start(tensors, mode=mode if mode in ("cpu", "gpu") else "cpu", first=first)
            self._pending["tensors"] = tensors
            if self._snap.host_memory is None:   # budgeted: streamed, submitted at the boundary
                self._snap_host_future = self._snap._pool.submit(self._snap.stage_to_host)
                self._snap_host_future.add_done_callback(lambda f: self._try_submit())
        return time.perf_counter() - t0

    def _capture_early(self) -> tuple:
        """``(skeleton, tensors)`` of the state captured at the boundary (everything but the
        small state captured later): live references, nothing copied."""
        early = {k: st.capture(o) for k, o in self.state.items() if self._kinds[k] == st.EARLY}
        return flatten(early)

    def _written(self, tensors: dict) -> tuple[dict, set]:
        """Of the captured ``tensors``, those this writer snapshots (its slice under
        ``writers=``), and which of them the next forward mutates (copied before ``step``
        returns)."""
        first = st.mutable_in_forward(self.state, tensors)
        if self._slicer is not None:   # this rank's slice only: whole tensors and pieces
            tensors, first = self._slicer.select(tensors, first)
        return tensors, first

    _prefault_due = True

    def _prefault_arenas(self) -> None:
        """After the first step of this checkpointer that is not a checkpoint (the optimizer's
        state exists by then, so the layout is the one its snapshots will have): the arenas of
        the first snapshot are made and written now, on an idle helper thread
        (:meth:`Snapshotter.prefault`), not by that snapshot on the training thread. A process
        that restarts training (a recovery, a spare taking a rank's role) otherwise pays a page
        fault per page at its first checkpoint."""
        if not self.writer or self._snap.host_memory is not None:
            return
        _, tensors = self._capture_early()
        self._snap.prefault(self._written(tensors)[0])

    def _free_arenas(self) -> int:
        """An arena set no persist reads (the one to snapshot into), waiting for the oldest
        persist while every set is held; counted in ``stats`` (``persist_waits``)."""
        b = self.config.buffers
        with self._lock:
            busy = [s for p, s in self._inflight if not p.done()]
        if len(busy) >= b:
            t0 = time.perf_counter()
            self._stats["persist_waits"] += 1
            self._wait_inflight(keep=b - 1)
            self._stats["persist_wait_s"] += time.perf_counter() - t0
            with self._lock:
                busy = [s for p, s in self._inflight if not p.done()]
        return min(set(range(b)) - set(busy))

    def _boundary_hook(self, *args, **kwargs) -> None:
        """The modules' forward pre-hook and the data iterators' before-next hook: the
        boundary, then :meth:`_halt_point`."""
        self._on_boundary()
        self._halt_point()

    def _halt_point(self) -> None:
        """Between two iterations, right after the boundary (the next hooked fetch or forward,
        or ``step`` when nothing is hooked), and in ``step`` right before the update: where a
        subclass may stop training by raising (``cfdist.fit`` does for a preemption notice
        that names every node). Raised before the update, the state is still the last
        completed step's (its boundary copies are in the live state). A no-op here."""

    def _halt_announced(self, *, durable: bool) -> int | None:
        """Another thread set the flag :meth:`_halt_point` raises on (``cfdist.fit``: a notice
        that names every node): a writer that keeps the live state and is between a step's
        boundary and the next update writes that step now, from this thread, while the training
        thread runs on to the halt (:meth:`LiveState.halt`; ``save_live`` then waits for it).
        Returns the step whose write began, or None (the training thread's ``save_live``
        writes, as without this)."""
        if self._live is None or not self.writer or getattr(self, "_closed", False):
            return None
        return self._live.halt(self, durable=durable)

    def _on_boundary(self, *args, **kwargs) -> None:
        """The instant between iterations: capture schedulers, plain values and RNG."""
        if self._live is not None:
            self._live.at_boundary()
        p = self._pending
        if p is None:
            return
        self._pending = None
        late = {k: st.capture(o) for k, o in self.state.items() if self._kinds[k] == st.LATE}
        p["late"], _ = flatten(late, inline_tensors=True)
        st.refresh_optimizer_groups(p["skeleton"], self.state)   # lr after sched.step()
        if "rng" not in p:
            p["rng"], _ = flatten(st.rng_state(), inline_tensors=True)
        if "buffers" in p:   # travels with this rank's RNG to the writers (rngs[rank] in the manifest)
            p["rng"] = {**p["rng"], "buffers": p.pop("buffers")}
        if self._rngx is not None:   # every writer's checkpoint holds every rank's RNG
            self._rngx.publish(p["step"], p["rng"])
        if self.writer:
            with self._lock:
                self._ready = p
            self._try_submit()

    def _try_submit(self) -> None:
        """Submit the captured snapshot once its copy reached host memory (under a budget: at
        the boundary, while it streams: the persist writes the windows as they are copied).

        Runs on the training thread and on the snapshot thread (when the copy finishes). Taking
        ``_ready`` and recording ``_inflight`` is one locked step: otherwise the training thread
        could see neither, start the next copy into arenas a persist is still reading, and
        drop that persist's handle (lost count, lost error).
        """
        streamed = self._snap.host_memory is not None
        with self._lock:
            p, fut = self._ready, self._snap_host_future
            if p is None or (not streamed and (fut is None or not fut.done())):
                return
            self._ready = None
            if not streamed and fut.exception() is not None:
                self._record_error(fut.exception(), p["step"])
                return
            if not streamed:   # a budgeted copy is counted when the gate collects it
                self._stats["snapshot_s"] += self._snap.last_copy_s or 0.0
            layout, host = self._snap.arenas(p["slot"])
            indexed = list(enumerate(layout))
            count = len(layout)
            manifest = {"epoch": p["epoch"], "epoch_end": p["epoch_end"], "world_size": self.world_size,
                        "skeleton": p["skeleton"], "late": p["late"], "rng": p["rng"], "lineage": self._lineage}
            if self._slicer is not None:   # shard j of writer w is shard w*R + j, on root j
                indexed = slices.global_shards(self.rank, layout, self._slicer.writers)
                count = len(layout) * self._slicer.writers
                manifest.update(slicing={"writers": self._slicer.writers, "align": slices.ALIGN},
                                split=self._slicer.split)
            shards = shard_jobs(indexed, host, count=count, roots=len(self.storages))
            job = PersistJob(step=p["step"], manifest=manifest, shards=shards, keep=self.config.keep,
                             keep_epoch_ends=self.config.keep_epoch_ends,
                             arenas=None if streamed else [a.buf for a in host], streams=host if streamed else None,
                             codecs=self.codecs, io=self.config.persist.io,
                             codec_session=self._codec_session, rolled_back=dict(self._rolled_back) or None)
            # non-blocking by the backend protocol
            self._inflight.append((self._pipeline.submit(job), p["slot"]))

    def _record_error(self, e: BaseException, step: int) -> None:
        self._stats["errors"] += 1
        self._stats["last_error"] = redact(f"{type(e).__name__}: {e}")
        self._error = e
        log.error("persisting step %d to %s failed: %s; training continues, the previous checkpoint "
                  "(step %s) stays, the next checkpoint will be attempted", step, self.storages[0].url,
                  redact(e), self._latest)

    def _wait_inflight(self, keep: int = 0) -> None:
        """Block until at most ``keep`` persists still run: the oldest finished or, past
        ``PersistOptions.timeout_s``, were given up. Their errors are not raised here: :meth:`_harvest`
        records them. An interrupt (``KeyboardInterrupt``, ``SystemExit`` from a SIGTERM
        handler) propagates and leaves ``_inflight`` as it was, so the next snapshot waits for
        that persist again before it copies into the arenas the persist may still read.
        """
        t = self.config.persist.timeout_s
        while True:
            with self._lock:
                running = [p for p, _ in self._inflight if not p.done()]
            if len(running) <= keep:
                return
            p = running[0]
            if t is not None:
                while not p.done():
                    left = t - (time.monotonic() - p.submitted)
                    if left <= 0:
                        if self._expire_inflight():
                            break
                        left = None   # past its commit point: wait it out
                    try:
                        p.wait(left)
                    except Exception:  # noqa: BLE001 - the persist's own error is recorded by _harvest
                        pass
                continue
            try:
                p.wait()
            except Exception:  # noqa: BLE001 - recorded by _harvest
                pass

    def _expire_inflight(self) -> bool:
        """Give up the persists that ran past ``PersistOptions.timeout_s``; True if one was."""
        t = self.config.persist.timeout_s
        if t is None:
            return False
        expired = False
        for p, slot in list(self._inflight):
            err = p.expire(t, self.storages[0].url)
            if err is None:
                continue
            with self._lock:
                self._inflight = [x for x in self._inflight if x[0] is not p]
            self._snap.retire_host_arenas(slot)   # the hung writer may still read them
            self._record_error(err, p.step)
            expired = True
        return expired

    def _harvest(self, *, publish: bool = True) -> None:
        """Collect the finished persists, in step order (non-blocking); give up the ones past
        ``PersistOptions.timeout_s``. ``publish=False``: their steps are not published to the
        job's store (after the group failed, see :meth:`_collect`)."""
        self._expire_inflight()
        with self._lock:   # the snapshot thread may be recording the next persist
            done = []
            while self._inflight and self._inflight[0][0].done():
                done.append(self._inflight.pop(0)[0])
        for p in done:
            self._collect(p, publish=publish)

    def _collect(self, p, *, publish: bool = True) -> None:
        """Account a finished persist; its step becomes :attr:`latest_step`, published to the
        job's store unless ``publish`` is False: a live save after the group failed touches no
        store (it may live in the process of the rank that died, and finding that out took
        ~90 ms of a preemption notice's grace)."""
        try:
            info = p.wait()
        except Exception as e:  # noqa: BLE001 - re-raised by wait()
            self._record_error(e, getattr(p, "step", -1))
            return
        self._stats["io"] = getattr(info, "io", None)
        self._stats["files_reused"] += getattr(info, "reused", 0)
        try:
            if publish:
                self.latest_step = info.step
            else:
                self._latest = info.step
        except (RuntimeError, OSError) as e:   # c10d's DistNetworkError is a RuntimeError
            # The step is committed; only telling the other ranks failed: the job's store is
            # gone when the process hosting it (rank 0, under torchrun) ended first at the end
            # of a run. Failing here made this rank exit 1 after a clean run, and torchrun's
            # agents then waited for each other until their exit barrier timed out.
            log.warning("step %d is committed, but publishing it to the job's store as the newest failed "
                        "(%s: %s); the other ranks' latest_step may lag behind it", info.step,
                        type(e).__name__, e)
        self._rolled_back = {}   # recorded by that commit's retention
        self._stats["checkpoints"] += 1
        self._stats["persist_s"] += info.seconds
        self._stats["bytes"] = info.bytes
        self._stats["bytes_written"] += info.bytes
        self._stats["bytes_logical"] += info.bytes_logical if info.bytes_logical is not None else info.bytes
        self._persist_done = (info.seconds, info.bytes, info.step)
        if not getattr(self, "_start_recorded", False):
            self._start_recorded = True
            self._record_start()
        self._save_profile()

    # ---- restore -------------------------------------------------------------------------------
    def restore(self, step: int | None = None) -> int | None:
        """Load the newest committed checkpoint that verifies into the live objects.

        Searches ``storage`` and ``restore_from`` (ties go to the earlier tier). A checkpoint
        whose content is bad (checksum, truncation, malformed manifest) is skipped with a
        warning naming the file and checksums; the first commit afterwards moves it aside to
        ``rejected/`` (never deleted). A storage error (``OSError``) is retried per
        ``read_retry`` and then raised as ``StorageUnavailable`` naming the URL and the step:
        it never makes restore fall back. A checkpoint that does not fit the live objects
        raises ``CheckpointError`` listing the differences. ``step``: that step, also from
        ``rejected/`` when no tier has it live; newer ones are moved aside by the first commit.
        Returns the restored step (the number of optimizer steps done), or None if there is
        no checkpoint at all. Call before training, on every rank: ranks agree (through the
        store, once) on the newest step some rank can load; ranks whose storage lacks it (or
        holds a corrupted copy) receive it from that rank over the default group
        (:mod:`cfdist.checkpoint.peer`), and all restore it. If no rank can load any, every rank
        raises ``CheckpointError`` naming what each holds. ``step`` (the same on every rank)
        restores that step or raises. Each rank loads its own RNG states (see
        :func:`cfdist.checkpoint.state.rank_rng_state`).
        """
        cands = discovery.candidates(self.tiers, retry=self.config.load.read_retry)
        if step is not None:
            cands = discovery.with_rejected(self.tiers, cands, step)
            if self._channel is None and not any(c.step == step for c in cands):
                raise CheckpointError(f"step {step} is not committed in any of {[t[0].url for t in self.tiers]}, "
                                      f"nor moved aside under their rejected/ folders")
        loaded: dict = {}
        rejected: list = []

        def rank_rng(c, m):
            return st.rank_rng_state(m, self.rank, where=c.storages[0].url_of(step_dir(c.step)))

        def try_load(s: int) -> str | None:
            # A storage error that outlasts the retries raises (StorageUnavailable): it must not
            # look like an unusable step, or the ranks would agree on rolling back past it.
            found, errs = discovery.load_first([c for c in cands if c.step == s], verify=self.config.load.verify,
                                               retry=self.config.load.read_retry, extra=rank_rng,
                                               on_reject=self._warn_unusable)
            rejected.extend(errs)
            if found is None:
                return "; ".join(f"step {c.step} in {c.storages[0].url}: {why}" for c, why in errs) \
                    or f"step {s} is not held here"
            st.check_compatible(self.state, found.state)
            loaded["found"] = found
            return None

        copies = []

        def fetch(s: int, src: int, need: bool) -> None:   # every rank, the same arguments
            mem = peer.broadcast_checkpoint(s, src, loaded["found"].candidate.storages if self.rank == src else None, need=need)
            if mem is not None:
                copies.append((s, mem))
                cands.insert(0, discovery.Candidate(s, len(self.tiers), mem))   # a tier of its own

        self._restores += 1
        try:
            got = agreement.agree_restore(self._channel, held=[c.step for c in cands], want=step,
                                          try_load=try_load, call=self._restores, fetch=fetch)
        finally:
            for s, mem in copies:
                peer.forget(mem, s)
        if got is None:
            return None
        found = loaded["found"]
        c = found.candidate
        extra = dict(found.extra)
        st.apply(self.state, st.with_rank_buffers(found.state, extra.pop("buffers", None)))
        st.set_rng_state(extra)
        self._step = self._snapped_step = c.step
        if self._live is not None:   # what it restored is on storage: nothing newer to save yet
            self._live.step = self._live.floor = c.step
        self._note_rollback(found, rejected, cands, asked=step is not None)
        if self._latest is None or c.tier == 0:   # a restore may roll back past newer steps
            self._set_latest(c.step if c.tier == 0 else self._latest, newer_only=False)
        live = bool(found.manifest.get("live"))
        self._record_restart(c.step, live=live)
        self._policy.restored(c.step, live=live)
        log.info("restored step %d from %s", c.step, f"tier {c.tier}" if c.tier < len(self.tiers) else
                 "a peer rank's copy")
        return c.step

    def keep_live(self) -> tuple[int, tuple[dict, dict]] | None:
        """After the group failed (a peer died: a collective raised): the live state of the last
        completed step as ``(step, (manifest, tensors))`` kept in this process, for
        :meth:`restore_live` in the next group formed around it; nothing is written, so the
        failure is reported without waiting for a save. None (the reason logged) when the live
        objects hold no step (no live state kept, no step completed, a failure inside the
        optimizer update). Any rank, writer or not: a survivor on a node whose writer died keeps
        it too. The tensors are the live ones:
        valid while nothing trains them (the training function has returned). Training thread."""
        if self._live is None:
            log.info("rank %d keeps no live state (built without group=GroupOptions(live=True))", self.rank)
            return None
        why = self._live.usable(self)
        if why is not None:
            log.info("rank %d: no live state kept (%s)", self.rank, why)
            return None
        return self._live.step, self._live.content(self)

    def restore_live(self, step: int, src: int, kept: tuple[dict, dict] | None) -> int:
        """Restore ``step`` from the process of rank ``src`` of the default group, a survivor
        of the previous group that kept its live state (:meth:`keep_live`; ``kept`` is the
        ``(manifest, tensors)`` this rank kept, or None): ``src`` loads it in process, the
        others receive it over the group (:func:`cfdist.checkpoint.peer.broadcast_state`): no
        storage round trip. Collective: every rank calls it with the same ``step`` and
        ``src``. RNG states: a rank that kept ``step`` itself (``src``, another survivor)
        resumes with its own, the others with
        :func:`~cfdist.checkpoint.state.derived_rng_state` of (run seed, rank, step), as after
        any live recovery (:mod:`cfdist.checkpoint.live`). Raises ``CheckpointError`` on every
        rank when ``src`` holds no live state of ``step`` (the next recovery then restores from
        storage) or when it does not fit the live objects. Returns ``step``."""
        own = kept if kept is not None and kept[0].get("step") == step else None
        why = ""
        if self.rank == src:
            why = ("this process kept no live state" if kept is None else
                   f"it holds step {kept[0].get('step')}, not {step}" if own is None else "")
            send = None if own is None else (dict(own[0], world_size=self.world_size), own[1])
        else:
            send = None
        # A rank that kept nothing (a replacement) receives into its own tensors in place; a
        # survivor's tensors are its kept state (a later recovery may still restore it).
        into = None
        if kept is None and self.rank != src:
            _, into = flatten({k: st.capture(o) for k, o in self.state.items() if self._kinds[k] == st.EARLY})
        manifest, tensors = peer.broadcast_state(send, src, why=why, into=into)
        where = f"the live state of step {step} from rank {src}"
        if manifest.get("step") != step:
            raise CheckpointError(f"{where}: it holds step {manifest.get('step')}")
        saved, _ = discovery.decode_state(manifest, tensors, where=where)
        rng = (unflatten(own[0]["rng"], {}) if own is not None
               else st.rank_rng_state(dict(manifest, rngs=[manifest["rng"] if r == src else None
                                                           for r in range(self.world_size)]), self.rank, where=where))
        st.check_compatible(self.state, saved)
        st.apply(self.state, st.with_rank_buffers(saved, rng.pop("buffers", None)))
        st.set_rng_state(rng)
        self._step = step   # not snapshotted: a save() now (the run's end) writes it, it is on no storage
        if self._live is not None:   # a live state of ``step`` again; not on storage (the floor stays)
            self._live.step = step
        self._lineage = retention.after_restore(manifest, step)
        self._rolled_back = {}
        self._record_restart(step, live=True)
        self._policy.restored(step, live=True)
        log.info("restored step %d from rank %d's live state", step, src)
        return step

    @staticmethod
    def _warn_unusable(c, why: str) -> None:
        warnings.warn(f"checkpoint step {c.step} in {c.storages[0].url} is unusable ({why}); "
                      f"falling back to an older one", RuntimeWarning, stacklevel=5)

    def _note_rollback(self, found: "discovery.Loaded", rejected: list, cands: list, *, asked: bool) -> None:
        """Continue the restored checkpoint's lineage; remember why newer ones of the first tier
        were passed over (the first commit moves them aside with that reason, ``retention.apply``)."""
        c = found.candidate
        self._lineage = retention.after_restore(found.manifest, c.step)
        self._rolled_back = {r.step: f"restore rejected it: {why}" for r, why in rejected
                             if r.tier == 0 and r.rejected is None and r.step > c.step}
        why = (f"restore(step={c.step}) chose an older step" if asked
               else f"the ranks agreed on the older step {c.step} (not every rank could load this one)")
        for other in cands:
            if other.tier == 0 and other.rejected is None and other.step > c.step:
                self._rolled_back.setdefault(other.step, why)

    def _record_start(self) -> None:
        """At the first commit of a run without history: when it started (the policy's MTBF
        estimate then counts the time before the first failure too)."""
        if not self._commits or self._read_json(HISTORY) is not None:
            return
        hist = {"started": getattr(self, "_bound_at", time.time()), "restarts": []}
        try:
            self.storages[0].write_atomic(HISTORY, json.dumps(hist).encode())
        except OSError as e:
            log.warning("could not record the run's start in %s: %s", self.storages[0].url, e)

    def _record_restart(self, step: int, *, live: bool = False) -> None:
        """Add a restart to the run's history; ``live``: it restored a survivor's live state
        (:mod:`cfdist.checkpoint.live`), so it rolled nothing back and ``Auto`` leaves it out of
        the failure rate its interval answers to."""
        if not self._commits:
            return
        hist = self._read_json(HISTORY) or {"restarts": []}
        hist["restarts"].append({"time": time.time(), "step": step, **({"live": True} if live else {})})
        try:
            self.storages[0].write_atomic(HISTORY, json.dumps(hist).encode())
        except OSError as e:
            log.warning("could not record the restart in %s: %s", self.storages[0].url, e)


def _drop_reuse_pools(storages) -> None:
    """Delete the roots' pools of retired checkpoint files (logged, never raised: the run's
    checkpoints are committed already; a pool left behind is emptied by the next start)."""
    for storage in storages:
        try:
            storage.drop_reuse_pool()
        except OSError as e:
            log.warning("could not empty the reuse pool of %s: %s (the next start empties it)", storage.url, e)
