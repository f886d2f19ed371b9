"""``TrainContext``: what a training function running under ``cfdist.fit`` sees on its rank.

::

    def train_loop(ctx: cfdist.TrainContext) -> None:
        model = DDP(Net().to(ctx.device))                 # torch.distributed is initialised
        loader = cfdist.ResumableLoader(dataset, 32, seed=0)
        ckpt = ctx.checkpointer({"model": model, "optim": opt, "data": loader})
        ckpt.restore()                                    # the step the controller chose, or None
        for epoch in range(loader.epoch + loader.at_epoch_end(), epochs):
            for x, y in loader:
                loss = loss_fn(model(x), y); loss.backward()
                ckpt.step(opt); opt.zero_grad()
                ctx.report(loss=loss.item())

Everything here runs in the rank's worker actor, on its training thread, except
:meth:`TrainContext._notify` and :meth:`TrainContext._drain` (called by the driver through the
actor on another thread; they only touch lock-protected fields).
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import threading
import time
from dataclasses import dataclass

import torch

from cfdist.checkpoint import Checkpointer, GroupOptions, PersistOptions
from cfdist.checkpoint.options import LEGACY, from_legacy

log = logging.getLogger("cfdist.worker")

_STAGE_WAIT_S = 600.0
"""How long a rank waits for the copy of the restore step to its node (a peer's copy or a
download from shared storage: the same bound the driver had when it waited for it)."""


@dataclass(frozen=True, kw_only=True)
class RankInfo:
    """Where a rank sits in the group (sent by the driver when the worker is created)."""

    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    node_rank: int
    num_nodes: int
    attempt: int


class TrainContext:
    """Per-rank view of the run. Built by the worker actor; users receive it, never build it."""

    def __init__(self, *, info: RankInfo, device: torch.device, tiers: dict, node_actor, policy,
                 keep: int, restore_step: int | None, restore_tier: str, live: bool = False,
                 staged: list | None = None, live_source: int | None = None, kept: tuple | None = None):
        self._info = info
        self._live = live
        self.device = device
        """``torch.device`` of this rank (``cuda:0`` of its visible GPU, or ``cpu``)."""
        self._tiers = tiers
        self._node_actor = node_actor
        self._policy = policy
        self._keep = keep
        self._restore_step = restore_step
        self._restore_tier = restore_tier
        self._staged = staged
        """``[ObjectRef]`` of the copy of the restore step to this node's tiers, still running
        while the group starts (``RayBackend.stage``), or None: nothing is copied here."""
        self._stage_wait_s: float | None = None
        self._live_source = live_source
        """``restore_tier == "live"``: the rank of this group whose process holds the restore step
        (a survivor of the previous group); the others receive it from it over the group."""
        self._kept = kept
        """On a survivor that kept the restore step (that rank, another): the ``(manifest,
        tensors)`` it kept (``Checkpointer.keep_live``); its own RNG states come from there."""
        self._lock = threading.Lock()
        self._records: collections.deque = collections.deque()
        self._preempted = threading.Event()
        self._halt = threading.Event()
        self._save_requested = False
        self._step = 0
        self._errors_reported = 0
        self._ckpts: list[_FitCheckpointer] = []
        self._t_start = time.time()   # the training function starts (recovery's "setup" phase)
        self._step_t: dict[int, float] = {}                   # step -> when it finished (recent)
        self._commit_s: collections.deque = collections.deque(maxlen=5)   # step -> commit seconds
        self._seen_commit = 0

    # ---- identity ------------------------------------------------------------------------------
    rank = property(lambda self: self._info.rank, doc="Global rank (0 .. world_size-1).")
    world_size = property(lambda self: self._info.world_size, doc="Ranks in this attempt's group.")
    local_rank = property(lambda self: self._info.local_rank, doc="Rank on this node.")
    local_world_size = property(lambda self: self._info.local_world_size, doc="Ranks on this node.")
    node_rank = property(lambda self: self._info.node_rank, doc="This node's position in the group.")
    num_nodes = property(lambda self: self._info.num_nodes, doc="Nodes in this attempt's group.")
    attempt = property(lambda self: self._info.attempt, doc="0 for the first group, +1 per restart.")

    @property
    def preempted(self) -> bool:
        """True once a preemption notice for this rank's node arrived (the node will go away;
        a checkpoint is already being taken at the next step). Cheap; poll it freely."""
        return self._preempted.is_set()

    @property
    def restore_step(self) -> int | None:
        """The step the controller chose for this attempt (None: start from scratch)."""
        return self._restore_step

    # ---- the two calls a loop makes ----------------------------------------------------------------
    def checkpointer(self, state: dict, policy=None, **kwargs) -> Checkpointer:
        """A :class:`cfdist.Checkpointer` wired to this node's actor and tiers.

        Call once per rank, after building the model/optimizer/loader, before training. Local
        rank 0 of each node writes (through the node actor), every rank's RNG states included;
        other ranks only count steps. Its ``restore()`` loads the step the controller chose for
        every rank of this attempt (all ranks call it; if one cannot load that step, every rank
        raises ``CheckpointError``). Call it
        once per rank (one memory and one local tier per node and run). Extra keyword arguments
        go to the Checkpointer (``verify``, ...).
        """
        from cfdist.cluster.node_actor import ActorBackend

        if self._ckpts:
            raise RuntimeError("ctx.checkpointer() was already called on this rank: a node has one memory "
                               "and one local tier per run, so build one Checkpointer with every object "
                               "to save in its state dict")
        policy = policy if policy is not None else _fresh(self._policy)
        policy = _memory_every(policy, self._policy, memory=bool(self._tiers.get("memory")))
        node_tiers = [u for u in (self._tiers.get("memory"), self._tiers.get("local")) if u]
        # local rank 0 of each node writes, through its node actor; the user's own groups keep
        # everything else they say (a persist timeout, an agreement timeout, ...)
        if "writer" in kwargs or "writers" in kwargs:
            raise TypeError("ctx.checkpointer() decides who writes (local rank 0 of each node, through its "
                            "node actor): drop writer=/writers=")
        groups = from_legacy({g: kwargs.pop(g, None) for g in ("persist", "load", "group")},
                             {k: kwargs.pop(k) for k in list(kwargs) if k in LEGACY}, owner="ctx.checkpointer")
        persist = dataclasses.replace(groups["persist"] or PersistOptions(),
                                      backend=ActorBackend(self._node_actor, self.attempt, policy))
        group = dataclasses.replace(groups["group"] or GroupOptions(), rank=self.rank, world_size=self.world_size,
                                    live=self._live or (groups["group"] is not None and groups["group"].live))
        kwargs["load"] = groups["load"]
        ck = _FitCheckpointer(
            self, state, node_tiers[0], policy, keep=self._keep, writers=self.local_rank == 0,
            persist=persist, group=group, restore_from=node_tiers[1:], **kwargs)
        self._ckpts.append(ck)
        return ck

    def report(self, **metrics) -> None:
        """Attach metrics (plain numbers) to the current step; shown in the progress bar and
        written to the event log (rank 0's). Non-blocking; call on any rank, any time."""
        clean = {k: (v.item() if isinstance(v, torch.Tensor) else v) for k, v in metrics.items()}
        if self.rank != 0:
            return
        with self._lock:
            last = self._records[-1] if self._records else None
            if last is not None and last["type"] == "step" and last["step"] == self._step:
                last.update(clean)
            else:
                self._records.append({"type": "metrics", "step": self._step, "t": time.time(), **clean})

    # ---- hooks from the checkpointer -------------------------------------------------------------
    def _on_step(self, ck: "_FitCheckpointer") -> bool:
        """After every ``ckpt.step``: record the step; True when a save was requested (the
        checkpointer then asks for one at a step every rank agrees on)."""
        self._step = ck.step_count
        self._track_commit(ck)
        with self._lock:
            if self.rank == 0:
                rec = {"type": "step", "step": ck.step_count, "t": time.time(),
                       "stall_s": round(ck._stats["stall_s"], 6)}
                if getattr(getattr(ck, "policy", None), "phase", None) == "profiling":   # Auto's first steps
                    rec["profiling"] = True
                self._records.append(rec)
                if ck._stats["errors"] > self._errors_reported:   # a persist failed: to the event log
                    self._errors_reported = ck._stats["errors"]
                    self._records.append({"type": "checkpoint_error", "step": ck.step_count, "t": time.time(),
                                          "errors": ck._stats["errors"],
                                          "error": str(ck._stats["last_error"])[:500]})
            save, self._save_requested = self._save_requested, False
        return save

    def _track_commit(self, ck) -> None:
        """Recent commit latencies (step finished -> its checkpoint committed), measured by the
        node's writer only: on another rank ``latest_step`` is a Store read, kept off the
        per-step path (a non-writer measured nothing before either: its value never moved)."""
        if not ck.writer:
            return
        now = time.time()
        self._step_t[ck.step_count] = now
        if len(self._step_t) > 256:
            self._step_t.pop(min(self._step_t))
        done = ck.latest_step or 0
        if done > self._seen_commit and done in self._step_t:
            self._commit_s.append(now - self._step_t[done])
        self._seen_commit = max(self._seen_commit, done)

    def _latest_committed(self) -> int:
        return max([ck.latest_step or 0 for ck in self._ckpts], default=0)

    def _emergency_save(self, window_s: float) -> tuple[bool, str]:
        """SIGTERM: mark preempted; request a checkpoint at the next step (the node's writer
        takes it) if the recent commit latency fits ``window_s``. Returns ``(fits, reason)``:
        when it fits, the rank keeps training until the commit (other ranks: until the window
        ends), since the writer's checkpoint needs the collectives of the next step. Any thread."""
        from cfdist.cluster.injector import emergency_checkpoint_fits

        fits, reason = emergency_checkpoint_fits(window_s, list(self._commit_s))
        self._notify(preempted=True, save=fits)
        return fits, reason

    def _wait_staged(self) -> None:
        """Before the restore: wait for the copy of the restore step to this node (the driver
        starts it and the group at once: the copy runs while the ranks rendezvous and build their
        model). A copy that failed raises here: this attempt fails, and the next recovery
        chooses again."""
        if not self._staged:
            return
        import ray

        t0 = time.perf_counter()
        try:
            ray.get(self._staged[0], timeout=_STAGE_WAIT_S)
        except (ray.exceptions.RayError, TimeoutError) as e:
            raise RuntimeError(f"rank {self.rank}: step {self._restore_step} could not be copied to this node's "
                               f"tiers for the restore ({type(e).__name__}: {e})") from e
        finally:
            self._stage_wait_s = time.perf_counter() - t0
        self._staged = None

    def _on_restored(self, step: int | None, seconds: float) -> None:
        self._step = step or 0
        waited = {} if self._stage_wait_s is None else {"stage_wait_s": round(self._stage_wait_s, 6)}
        with self._lock:
            self._records.append({"type": "restored", "rank": self.rank, "step": step or 0,
                                  "tier": self._restore_tier if step else "none",
                                  "restore_s": round(seconds, 6), "t": time.time(),
                                  "setup_s": round(time.time() - seconds - (self._stage_wait_s or 0.0)
                                                    - self._t_start, 6), **waited})

    # ---- driver side (another thread of the worker actor) ------------------------------------------
    def _notify(self, *, preempted: bool, save: bool, halt: bool = False) -> None:
        """A preemption notice: set ``preempted`` (this node goes away); with ``save``,
        checkpoint soon, at a step every rank agrees on (``Checkpointer.request_save``: every
        node's writer then persists it, so a surviving copy covers); with ``halt`` (the notices
        name every node of the group: no replica will survive), stop before the next update or
        at the next iteration boundary (:class:`PreemptionHalt`), so that the last step
        completed is the state the node writers save (:meth:`cfdist.Checkpointer.save_live`)
        and the driver makes durable. A writer between a step's boundary and the next update
        starts that save here, on this thread, at once (``Checkpointer._halt_announced``): it
        does not wait for the training thread to reach the halt."""
        if preempted:
            self._preempted.set()
        if save:
            with self._lock:
                self._save_requested = True
        if halt:
            self._halt.set()   # first: the early save relies on no update starting after it
            for ck in list(self._ckpts):
                try:
                    ck._halt_announced(durable=True)
                except Exception as err:  # noqa: BLE001 - logged; the training thread's save_live writes instead
                    log.warning("rank %d: the live state could not be written when the halt arrived (%s: %s); "
                                "it is written when the rank halts", self.rank, type(err).__name__, err)

    def _drain(self) -> list[dict]:
        with self._lock:
            out = list(self._records)
            self._records.clear()
        return out

    def _finish(self) -> dict:
        """After the loop returned: commit a final checkpoint of every checkpointer, close them.

        Every rank calls ``save`` (the writers need every rank's RNG state of the last step);
        it does nothing where the last step was already checkpointed or restored."""
        out = {}
        for ck in self._ckpts:
            if not getattr(ck, "_closed", False):
                if ck.step_count:
                    ck.save(block=True)
                ck.close()
            out = {"final_step": ck.step_count, "latest_step": ck.latest_step,
                   "stall_s": ck._stats["stall_s"], "checkpoints": ck._stats["checkpoints"]}
        return out


class PreemptionHalt(Exception):
    """Raised under ``cfdist.fit`` on every rank once a preemption notice named every node of the
    group (a whole spot pool reclaimed), at the first of: ``ckpt.step`` right before the optimizer
    update, or the next iteration boundary (the next fetch from a hooked data iterator or forward
    of a hooked module). The node writers save the last completed step from their live state, to
    disk, and the driver makes it durable before the kill; a writer that heard the notice between
    a step's boundary and the next update already began that save when it arrived (it does not
    wait for the step in progress). The training function need not catch it (the worker does).

    What each rank holds: one that heard the notice before its update of step ``n + 1`` skips
    that update and holds step ``n`` (the data position after batch ``n``, the RNG, schedulers
    and module buffers of step ``n``'s boundary: the live state's copies, not what step
    ``n + 1``'s fetch and forward moved); one that heard it during or after that update holds
    ``n + 1`` and halts at its next boundary. The ranks learn of the halt at slightly different
    times, so both can happen in one group: no rank can complete step ``n + 2`` (its all-reduce
    needs the rank that halted), so the group's newest step is ``n`` or ``n + 1``, and the copy
    of a writer that holds the newest commits it. A non-writer that alone applied ``n + 1``
    (several ranks per node) leaves the newest step unwritten: the commit is then ``n``, one
    step older, and ``notice_commit`` counts it as not committed. A peer that has not halted by
    then waits in its next collective until the node is taken (or fails when a noticed rank is
    killed, and saves then). An update that raised leaves nothing to write (the state is torn)."""


class _FitCheckpointer(Checkpointer):
    """A Checkpointer that tells its TrainContext about steps, restores and save requests."""

    def __init__(self, ctx: TrainContext, *args, **kwargs):
        self._ctx = ctx
        super().__init__(*args, **kwargs)

    def _halt_point(self) -> None:
        # Before an update or at the boundary after one: the rank holds the step it completed
        # last; no rank completes the step after the next (see PreemptionHalt).
        if self._ctx._halt.is_set():
            raise PreemptionHalt(f"rank {self._ctx.rank} halted after step {self.step_count}: a preemption notice "
                                 f"named every node of the group; that last completed step is saved and made "
                                 f"durable before the kill")

    def step(self, optimizer=None, closure=None):
        out = super().step(optimizer, closure)
        save = self._ctx._on_step(self)
        _raise_if_node_actor_died(self._error)
        if save:
            self.request_save()   # preemption notice: every rank checkpoints the same step soon
        return out

    def restore(self, step: int | None = None) -> int | None:
        """Load the step the controller chose (``step`` overrides it); None: nothing to load."""
        ctx = self._ctx
        want = step if step is not None else ctx.restore_step
        t0 = time.perf_counter()
        if ctx._restore_tier == "live" and want is not None and want == ctx.restore_step:
            kept, ctx._kept = ctx._kept, None
            got = self.restore_live(want, ctx._live_source, kept)
        else:
            if want is not None:
                ctx._wait_staged()
                t0 = time.perf_counter()
            got = super().restore(want) if want is not None else None
        ctx._on_restored(got, time.perf_counter() - t0)
        return got


def _memory_every(policy, run_policy, *, memory: bool):
    """``policy`` under the run's ``memory_every`` (when the run has one and a memory tier)."""
    from cfdist.policy.memory import MemoryEvery

    every = run_policy.every if isinstance(run_policy, MemoryEvery) else None
    inner = policy.policy if isinstance(policy, MemoryEvery) else policy
    return MemoryEvery(inner, every) if every and memory else inner


def _raise_if_node_actor_died(err: BaseException | None) -> None:
    """A persist failed because the node's checkpoint actor died: every later checkpoint of
    this rank would fail too, so fail the rank now (the controller replaces the actor and
    restarts the group from the newest commit) instead of training on without checkpoints."""
    import ray

    if isinstance(err, ray.exceptions.RayActorError):
        raise RuntimeError(f"the node's checkpoint actor died ({type(err).__name__}); stopping this rank so "
                           f"that the run restarts from its newest committed checkpoint") from err


def _fresh(policy):
    """A private copy of the run's policy for this Checkpointer (policies keep measurements)."""
    import copy

    return copy.deepcopy(policy)
