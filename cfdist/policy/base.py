"""The policy protocol: when to checkpoint, given what was measured.

:class:`Policy` lists every hook the :class:`~cfdist.checkpoint.Checkpointer` calls, with when
and from which thread. Two are required (``should_checkpoint`` and ``observe``): any object with
those two methods is a policy, and the checkpointer gives it the defaults of :class:`PolicyBase`
for the hooks it lacks (:func:`as_policy`). The built-in policies (``Every``, ``EveryEpoch``,
``Auto``, ``MemoryEvery``) derive from :class:`PolicyBase`; a new one can too, and override what
it needs::

    class EveryHundred(cfdist.policy.PolicyBase):
        def should_checkpoint(self, step, *, epoch_end=False):
            return step % 100 == 0

        def observe(self, m):
            pass

Policies do no I/O and no collectives: what they need from storage or from other ranks comes in
through ``bind`` and ``agreed``, and what they want stored goes out through ``profile_to_save``.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
import abc
from typing import Protocol, runtime_checkable


@dataclass(kw_only=True, slots=True)
class StepMeasurement:
    """What one rank measured around one training step (seconds, bytes). Pure data."""

    step: int
    """Optimizer steps done so far (the step just finished)."""
    iter_s: float
    """Wall time from the previous ``ckpt.step()`` return to this one's (a whole iteration)."""
    stall_s: float = 0.0
    """Time this step waited at the gate for an unfinished snapshot copy."""
    update_s: float = 0.0
    """Time of ``optimizer.step()`` itself (Tw)."""
    snapshot_s: float | None = None
    """Duration of the snapshot copy started at this step, when known (Tc or Tg)."""
    snapshot_device: str | None = None
    """Where that snapshot went: ``"cpu"`` or ``"gpu"``."""
    persist_s: float | None = None
    """Duration of a persist that completed since the previous measurement (Ts)."""
    persist_bytes: int | None = None
    """Bytes written by that persist (m)."""
    persist_step: int | None = None
    """Step whose checkpoint that persist committed, when known."""
    checkpointed: bool = False
    """Whether a snapshot was taken at this step."""


@runtime_checkable
class Policy(Protocol):
    """Every hook the Checkpointer calls on its policy, all from the training thread, on every rank.

    Required: :meth:`should_checkpoint` and :meth:`observe`. The others are optional for a policy
    that does not derive from :class:`PolicyBase`; the checkpointer then uses PolicyBase's
    defaults (:func:`as_policy`). Not called concurrently: a policy need not be thread-safe.
    ``isinstance(p, Policy)`` holds for objects that have every hook (PolicyBase's subclasses).
    """

    k: int | None
    """The checkpoint interval in force (optimizer steps), or None when there is none (yet);
    read for ``Checkpointer.stats`` after any step. Default None."""
    mode: str
    """Where snapshots go: ``"cpu"``, ``"gpu"`` (spare GPU memory first) or ``"epoch"`` (taken as
    ``"cpu"``); read at each snapshot and for ``stats``. Default ``"cpu"``."""
    mtbf_s: float | None
    """The mean time between failures the policy assumes (seconds), or None; read once at the
    checkpointer's construction, after :meth:`bind`, to resolve ``Quantize(bits="auto")``.
    Default None."""
    binds: bool
    """Whether :meth:`bind` wants its context: False spares the checkpointer's construction the
    reads that make it (rank 0's ``history.json`` and cached profile, through the store on a
    multi-rank job). Default False; True for a policy that defines ``bind``."""

    def should_checkpoint(self, step: int, *, epoch_end: bool = False) -> bool:
        """Whether to checkpoint at ``step`` (1-based count of optimizer steps), asked once per
        step right after its optimizer step (``ckpt.step()``), after :meth:`agreed` for that
        step. Must return the same answer on every rank for the same step: decide from the step
        count and from numbers every rank agrees on, never from a rank-local clock. Required."""
        ...

    def observe(self, m: StepMeasurement) -> None:
        """This rank's timings of the step just finished, once per step after
        :meth:`should_checkpoint` for it (rank-local numbers: never decide from them alone; see
        :meth:`proposal`). Required."""
        ...

    def bind(self, ctx: PolicyContext) -> None:
        """What the job looks like (state size, world size, cached profile, failure history),
        once, in the checkpointer's constructor, before any step. Every rank gets the same
        context except ``rank``. Default: nothing."""
        ...

    def restored(self, step: int, *, live: bool) -> None:
        """The checkpointer restored ``step``, before any step of this start (after
        :meth:`bind`); ``live``: from a survivor's live state (the failure rolled nothing back,
        so it is not one an interval answers to; :meth:`bind`'s context counted the present
        start as one). Default: nothing."""
        ...

    def proposal(self) -> int:
        """The interval this rank would have in force (0: none yet). A policy whose interval comes
        from rank-local measurements proposes it here; the checkpointer publishes rank 0's
        proposal to every rank (:mod:`cfdist.checkpoint.agreement`) and answers with
        :meth:`agreed`. Asked at every step, before :meth:`should_checkpoint`. Default 0."""
        ...

    def agreed(self, k: int, step: int) -> None:
        """The interval every rank uses from ``should_checkpoint(step)`` on: rank 0's proposal,
        delivered at the same step on every rank (at once in one process, a few steps later
        through the c10d Store on several ranks), before :meth:`should_checkpoint` of that step.
        Called only when the agreed value changes. Default: nothing."""
        ...

    def profile_to_save(self) -> dict | None:
        """A JSON-able profile to cache on storage (``profile-{profile_key(ctx)}.json``, written
        atomically by a rank that commits), or None when there is nothing new. Asked right after
        every :meth:`observe`, after each commit this rank learns of, and at ``close()``; the next
        run's :meth:`bind` gets it as ``ctx.cached_profile``.
        Default None."""
        ...

    def stats(self) -> dict:
        """Extra entries for ``Checkpointer.stats`` (which wins on a clash with its own
        ``checkpoints``, ``errors`` and ``bytes``), read whenever ``stats`` is. Default ``{}``."""
        ...


class PolicyBase(abc.ABC):
    """Base class of the built-in policies: every hook of :class:`Policy` with a default that does
    nothing; subclasses implement :meth:`should_checkpoint` and :meth:`observe` and override the
    rest as they need. See :class:`Policy` for when each hook is called."""

    __slots__ = ()

    k: int | None = None
    mode: str = "cpu"
    mtbf_s: float | None = None
    binds: bool = False

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        if "binds" not in cls.__dict__:   # a subclass that overrides bind() wants its context
            cls.binds = cls.bind is not PolicyBase.bind

    @abc.abstractmethod
    def should_checkpoint(self, step: int, *, epoch_end: bool = False) -> bool:
        """See :meth:`Policy.should_checkpoint`."""

    @abc.abstractmethod
    def observe(self, m: StepMeasurement) -> None:
        """See :meth:`Policy.observe`."""

    def bind(self, ctx: PolicyContext) -> None:
        """See :meth:`Policy.bind`; does nothing."""

    def restored(self, step: int, *, live: bool) -> None:
        """See :meth:`Policy.restored`; does nothing."""

    def proposal(self) -> int:
        """See :meth:`Policy.proposal`; 0 (nothing to propose)."""
        return 0

    def agreed(self, k: int, step: int) -> None:
        """See :meth:`Policy.agreed`; does nothing."""

    def profile_to_save(self) -> dict | None:
        """See :meth:`Policy.profile_to_save`; None."""
        return None

    def stats(self) -> dict:
        """See :meth:`Policy.stats`; no extra entries."""
        return {}


def as_policy(policy) -> PolicyBase:
    """``policy`` with every hook of :class:`Policy`: itself when it derives from
    :class:`PolicyBase`, else a view that forwards the hooks it has and gives PolicyBase's
    defaults for the others. ``TypeError`` when it lacks a required method.

    The checkpointer calls it once, in its constructor; attribute reads (``k``, ``mode``) go to
    the user's object each time, so a policy that changes its ``k`` is seen doing so.
    """
    if isinstance(policy, PolicyBase):
        return policy
    missing = [n for n in ("should_checkpoint", "observe") if not callable(getattr(policy, n, None))]
    if missing:
        raise TypeError(f"policy must be a cfdist policy (Every, EveryEpoch, Auto, or an object with "
                        f"should_checkpoint(step, *, epoch_end) and observe(measurement)), got {policy!r}, "
                        f"which has no {' or '.join(missing)}")
    return _Forwarding(policy)


class _Forwarding(PolicyBase):
    """A duck-typed policy seen through PolicyBase: its own hooks where it has them."""

    __slots__ = ("inner",)

    def __init__(self, inner):
        self.inner = inner

    def __repr__(self) -> str:
        return repr(self.inner)

    def _hook(self, name: str):
        return getattr(self.inner, name, None)

    k = property(lambda self: getattr(self.inner, "k", None))
    mode = property(lambda self: getattr(self.inner, "mode", "cpu"))
    mtbf_s = property(lambda self: getattr(self.inner, "mtbf_s", None))
    binds = property(lambda self: getattr(self.inner, "binds", callable(getattr(self.inner, "bind", None))))

    def should_checkpoint(self, step: int, *, epoch_end: bool = False) -> bool:
        return self.inner.should_checkpoint(step, epoch_end=epoch_end)

    def observe(self, m: StepMeasurement) -> None:
        self.inner.observe(m)

    def bind(self, ctx: PolicyContext) -> None:
        if (fn := self._hook("bind")) is not None:
            fn(ctx)

    def restored(self, step: int, *, live: bool) -> None:
        if (fn := self._hook("restored")) is not None:
            fn(step, live=live)

    def proposal(self) -> int:
        return fn() if (fn := self._hook("proposal")) is not None else 0

    def agreed(self, k: int, step: int) -> None:
        if (fn := self._hook("agreed")) is not None:
            fn(k, step)

    def profile_to_save(self) -> dict | None:
        return fn() if (fn := self._hook("profile_to_save")) is not None else None

    def stats(self) -> dict:
        fn = self._hook("stats")
        return fn() if callable(fn) else {}


@dataclass(kw_only=True, slots=True)
class Every(PolicyBase):
    """Checkpoint every ``k`` optimizer steps (and at epoch ends if ``at_epoch_end``)."""

    k: int
    """Interval in optimizer steps; >= 1."""
    at_epoch_end: bool = False
    """Also checkpoint at the last step of each epoch."""
    mode: str = "cpu"

    def __init__(self, k: int, *, at_epoch_end: bool = False):
        if not isinstance(k, int) or isinstance(k, bool) or k < 1:
            raise ValueError(f"Every(k) needs an integer k >= 1, got {k!r}")
        self.k = k
        self.at_epoch_end = at_epoch_end
        self.mode = "cpu"

    def should_checkpoint(self, step: int, *, epoch_end: bool = False) -> bool:
        return step % self.k == 0 or (self.at_epoch_end and epoch_end)

    def observe(self, m: StepMeasurement) -> None:
        pass


@dataclass(kw_only=True, slots=True)
class EveryEpoch(PolicyBase):
    """Checkpoint at the end of every epoch only (the common baseline)."""

    k: int | None = None
    mode: str = "epoch"

    def should_checkpoint(self, step: int, *, epoch_end: bool = False) -> bool:
        return epoch_end

    def observe(self, m: StepMeasurement) -> None:
        pass


@dataclass(frozen=True, kw_only=True, slots=True)
class PolicyContext:
    """What the checkpointer knows about the job when it binds a policy. Pure data.

    Every rank of a job builds it from the same arguments, except ``rank`` and whatever its
    storage holds (``cached_profile``, ``failure_times_s``).
    """

    rank: int = 0
    """This process's rank in the job."""
    world_size: int = 1
    """Ranks in the job."""
    state_bytes: int = 0
    """Bytes of tensor state one checkpoint holds (model + optimizer ...)."""
    device: str = "cpu"
    """Where the model lives: ``"cpu"`` or ``"cuda"`` (``cuda*`` means GPU snapshots exist)."""
    batch_size: int | None = None
    """Per-rank batch size when the data loader tells it."""
    iters_per_epoch: int | None = None
    """Optimizer steps per epoch when the data loader tells it (sizes the profiling phase)."""
    cached_profile: dict | None = None
    """What ``profile_to_save()`` returned in an earlier run with the same ``profile_key``."""
    failure_times_s: list[float] = field(default_factory=list)
    """Wall-clock times (``time.time()``) of the restarts recorded in this run's history,
    excluding the present start."""
    now_s: float = 0.0
    """Wall-clock time of the present start (``time.time()``)."""
    started_s: float | None = None
    """Wall-clock time this run first started (its history's), None when unknown: with it
    the first restart already estimates the MTBF."""
    state_signature: str | None = None
    """Optional digest of the state's layout (names, dtypes, shapes): tells two models of the
    same size apart in :func:`profile_key`."""
    buffers: int = 1
    """Sets of snapshot buffers of the checkpointer (2: double buffering); changes the interval
    that hides a persist (:func:`cfdist.policy.freq.k_persist`), not what is measured."""
    live_recovery: bool = False
    """Whether a failure that leaves a rank running is recovered from the survivors' live state
    (``cfdist.fit``'s live recovery, more than one rank): only a failure that takes every
    replica then rolls back to a checkpoint, and the interval answers to those."""

    def __post_init__(self):
        if not (isinstance(self.world_size, int) and self.world_size >= 1):
            raise ValueError(f"PolicyContext.world_size must be an int >= 1, got {self.world_size!r}")
        if not (isinstance(self.rank, int) and 0 <= self.rank < self.world_size):
            raise ValueError(
                f"PolicyContext.rank must be in [0, world_size={self.world_size}), got {self.rank!r}"
            )
        if not (isinstance(self.state_bytes, int) and self.state_bytes >= 0):
            raise ValueError(f"PolicyContext.state_bytes must be an int >= 0, got {self.state_bytes!r}")
        if not (isinstance(self.device, str) and self.device):
            raise ValueError(f"PolicyContext.device must be a device name such as 'cpu' or 'cuda', got {self.device!r}")
        if not (isinstance(self.buffers, int) and self.buffers >= 1):
            raise ValueError(f"PolicyContext.buffers must be an int >= 1, got {self.buffers!r}")
        for name in ("batch_size", "iters_per_epoch"):
            v = getattr(self, name)
            if v is not None and not (isinstance(v, int) and v >= 1):
                raise ValueError(f"PolicyContext.{name} must be None or an int >= 1, got {v!r}")


def profile_key(ctx: PolicyContext) -> str:
    """The storage key of a cached profile: the same for every job whose profile must agree.

    Pure; depends on the state's size (and signature when given), world size, batch size and
    device, never on rank, time or history. Safe as a file name (``[A-Za-z0-9_-]``).
    """
    ident = {"state_bytes": ctx.state_bytes, "state_signature": ctx.state_signature,
             "world_size": ctx.world_size, "batch_size": ctx.batch_size, "device": ctx.device}
    digest = hashlib.sha256(json.dumps(ident, sort_keys=True).encode()).hexdigest()[:12]
    return f"{ctx.device}-w{ctx.world_size}-b{ctx.batch_size or 0}-{digest}"
