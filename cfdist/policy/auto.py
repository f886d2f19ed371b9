"""``cfdist.Auto``: choose the checkpoint interval automatically (CheckFreq §4) and keep it right.

::

    ckpt = cfdist.Checkpointer(state, storage=url, policy=cfdist.Auto(max_overhead=0.035))

Phases, per process:

1. **profile** the first ``min(1% of an epoch, 50)`` steps (:mod:`cfdist.policy.profiler`):
   clean iterations, one GPU snapshot (when there is a GPU), one CPU snapshot, their persists;
   skipped when the storage holds a profile cached under the same :func:`profile_key`;
2. **decide** ``k`` and the snapshot mode (:func:`cfdist.policy.freq.decide`): CheckFreq's bounds,
   or, when the MTBF is known (given, or estimated from this run's start and restarts),
   Young/Daly's optimum above the persist bound; a cached profile brings the cost per
   checkpoint tuning measured in the earlier attempt (``To_meas``), which replaces profiling's;
3. **tune** ``k`` from the measured overhead (:class:`cfdist.policy.tuner.Tuner`); with an
   MTBF, toward Young/Daly's optimum with the measured cost per checkpoint.

Agreement across ranks. Only rank 0's measurements decide ``k``: :meth:`Auto.proposal` is
rank 0's current choice, and the checkpointer hands every rank the agreed value with
:meth:`Auto.agreed` (:class:`cfdist.checkpoint.agreement.Frequency`: in one process at once; on
several ranks through the c10d Store, a few steps later, at the same step on every rank, rank
0 included). The policy itself does no I/O. Until the first value arrives all ranks follow the
same profiling plan, derived from the step count. The snapshot mode stays rank-local (each
snapshotting rank knows its own memory).
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass, field

from cfdist.policy import freq, profiler
from cfdist.policy.base import PolicyBase, PolicyContext, StepMeasurement, profile_key
from cfdist.policy.tuner import Tuner, TunerConfig

log = logging.getLogger("cfdist.policy")

CACHE_VERSION = 1


@dataclass(frozen=True, kw_only=True, slots=True)
class AutoConfig:
    """Settings of :class:`Auto`."""

    max_overhead: float = 0.035
    """Budget p: the fraction of training time checkpointing may cost (0.035 = 3.5%)."""
    mtbf_s: float | None = None
    """Mean time between failures in seconds; None = estimate it from this run's restarts (or
    ignore failures when there are none yet). Restarts from a survivor's live state (live
    recovery) rolled nothing back and are left out: with live recovery the interval answers to
    the failures that take every replica; give their MTBF here if you know it."""
    replica_loss_mtbf_s: float = 3600.0
    """With live recovery (``cfdist.fit``, more than one rank) and no failure that took every
    replica seen yet (none in this run's history, no ``mtbf_s``): the MTBF assumed for such
    failures, or the run's age when that is longer. Young/Daly's interval for it may only
    lengthen the budget's, never shorten it: the overhead stays within ``max_overhead``. The
    bundled spot traces (Bamboo's AWS p3 and g4dn, GCP A100 and V100 pools, 71 h) give 5.3 h
    or more for a 2-node job and no such failure at all for 4 or more nodes; an hour is the
    cautious side of that."""
    profile_steps: int | None = None
    """Length of the profiling phase; None = ``min(1% of an epoch, 50)``, at least 10."""
    at_epoch_end: bool = True
    """Also checkpoint at the last step of every epoch (CheckFreq does)."""
    adaptive: bool = True
    """Tune k from the measured overhead after profiling (False: keep the profiled k)."""
    gpu_headroom: float = 0.05
    """Fraction of GPU memory a GPU snapshot must leave free."""
    tuning: TunerConfig = field(default_factory=TunerConfig)
    """Knobs of the adaptive tuner."""

    def __post_init__(self):
        if not (isinstance(self.max_overhead, (int, float)) and 0 < self.max_overhead < 1):
            raise ValueError(
                f"Auto(max_overhead={self.max_overhead!r}) must be a fraction in (0, 1): "
                f"0.035 allows checkpointing to cost 3.5% of training time"
            )
        if self.mtbf_s is not None and not (isinstance(self.mtbf_s, (int, float))
                                            and math.isfinite(self.mtbf_s) and self.mtbf_s > 0):
            raise ValueError(f"Auto(mtbf_s={self.mtbf_s!r}) must be seconds > 0, or None to estimate it")
        if not (isinstance(self.replica_loss_mtbf_s, (int, float)) and math.isfinite(self.replica_loss_mtbf_s)
                and self.replica_loss_mtbf_s > 0):
            raise ValueError(f"Auto(replica_loss_mtbf_s={self.replica_loss_mtbf_s!r}) must be seconds > 0")
        if self.profile_steps is not None and not (isinstance(self.profile_steps, int)
                                                   and self.profile_steps >= profiler.MIN_STEPS):
            raise ValueError(f"Auto(profile_steps={self.profile_steps!r}) must be None or an int >= "
                             f"{profiler.MIN_STEPS} (fewer cannot separate warm-up from samples)")
        if not (0 <= self.gpu_headroom < 1):
            raise ValueError(f"Auto(gpu_headroom={self.gpu_headroom!r}) must be a fraction in [0, 1)")
        if not isinstance(self.tuning, TunerConfig):
            raise TypeError(f"Auto(tuning=...) takes a TunerConfig, got {type(self.tuning).__name__}")


class Auto(PolicyBase):
    """The self-tuning checkpoint policy (the default of :class:`cfdist.Checkpointer`).

    Called by the checkpointer from the training thread: ``bind`` once, then per step
    ``agreed`` (when the agreed k changes), ``should_checkpoint`` and ``observe``; ``proposal``
    whenever the checkpointer publishes rank 0's k. Not thread-safe.
    """

    Config = AutoConfig

    def __init__(self, max_overhead: float = 0.035, mtbf_s: float | None = None, **kwargs):
        gone = sorted(set(kwargs) & {"sync", "unsynced_k"})
        if gone:
            raise TypeError(f"Auto({gone[0]}=...) no longer exists: ranks now agree on k through the "
                            f"c10d Store, with any comm hook and without DDP; remove the argument")
        self.config = AutoConfig(max_overhead=max_overhead, mtbf_s=mtbf_s, **kwargs)
        self.k: int | None = None
        self.mode: str = "cpu"
        self.ctx = PolicyContext()
        self._first: int | None = None
        self._last_ckpt = 0
        self._profiler: profiler.Profiler | None = None
        self._profile: freq.Profile | None = None
        self._decision: freq.Decision | None = None
        self._local_mode = "cpu"
        self._decided_k = 0
        self._from_cache = False
        self._tuner: Tuner | None = None
        self._proposal = 0           # rank 0's k to publish (0: none yet)
        self._why: dict[int, tuple[str, dict]] = {}   # rank 0: why each proposed k
        self._changes: list[dict] = []
        self._to_save: dict | None = None
        self._saved_to: float | None = None   # the measured cost per checkpoint last cached
        self._gpu_before_snapshot: tuple | None = None   # (M, Mmax) read before profiling's GPU snapshot
        self.mtbf_s, self.mtbf_source = self.config.mtbf_s, ("given" if self.config.mtbf_s else None)

    def __repr__(self) -> str:
        return f"Auto(max_overhead={self.config.max_overhead}, mtbf_s={self.config.mtbf_s}, k={self.k})"

    # ---- the checkpointer's hooks --------------------------------------------------------------
    def bind(self, ctx: PolicyContext) -> None:
        """Learn the job (once, before the first step). Uses ``ctx.cached_profile`` when valid."""
        if self._first is not None:
            raise RuntimeError("Auto.bind() must come before the first step; build a new Auto per Checkpointer")
        self.ctx = ctx
        if self.mtbf_s is None:
            est = freq.estimate_mtbf(ctx.failure_times_s, now_s=ctx.now_s, started_s=ctx.started_s)
            if est is not None:
                self.mtbf_s, self.mtbf_source = est, "history"
            else:
                self._assume()
        if ctx.cached_profile is not None:
            self._load_cache(ctx.cached_profile)

    def restored(self, step: int, *, live: bool) -> None:
        """A restart from a survivor's live state is not a failure the interval answers to:
        the MTBF estimated from the history at :meth:`bind` counted it; estimate again without
        it (None when no failure that counts is left), and decide again from a cached profile."""
        if not live or self.mtbf_source != "history" or self._first is not None:
            return
        ctx = self.ctx
        est = freq.estimate_mtbf(ctx.failure_times_s, now_s=ctx.now_s, started_s=ctx.started_s, present=False)
        if est == self.mtbf_s:
            return
        log.info("Auto: the restart restored a survivor's live state (step %d): MTBF %s instead of %.0f s",
                 step, "not measured" if est is None else f"{est:.0f} s", self.mtbf_s)
        self.mtbf_s, self.mtbf_source = est, ("history" if est is not None else None)
        if est is None:
            self._assume()
        if self._from_cache and ctx.cached_profile is not None:
            self._decide(from_cache=ctx.cached_profile)

    def _assume(self) -> None:
        """No MTBF given or measured: with live recovery, assume ``replica_loss_mtbf_s`` for the
        failures that take every replica (or the run's age, when longer: it saw none)."""
        ctx = self.ctx
        if not ctx.live_recovery:
            return
        age = ctx.now_s - ctx.started_s if ctx.started_s is not None else 0.0
        self.mtbf_s, self.mtbf_source = max(self.config.replica_loss_mtbf_s, age), "assumed"

    def should_checkpoint(self, step: int, *, epoch_end: bool = False) -> bool:
        """Same answer on every rank: a function of the step count and of the agreed k."""
        if self._first is None:
            self._start(step)
        if self.k is None:
            plan = self._profiler.snapshot_at(step - self._first + 1) if self._profiler else None
            if plan == "gpu":   # training's peak before the snapshot's own GPU arena exists
                self._gpu_before_snapshot = profiler.gpu_memory(self.ctx.device)
            take = plan is not None or (epoch_end and self.config.at_epoch_end)
            self.mode = plan or self._local_mode
        else:
            take = step - self._last_ckpt >= self.k or (epoch_end and self.config.at_epoch_end)
            self.mode = self._local_mode
        if take:
            self._last_ckpt = step
        return take

    def observe(self, m: StepMeasurement) -> None:
        """Account what this rank measured in step ``m.step`` (after ``should_checkpoint``)."""
        if self._profiler is not None and self._profile is None:
            rel = m.step - self._first + 1
            self._profiler.observe(rel, m)
            if self._profiler.done(rel):
                self._finish_profile(m.step)
            elif rel == 10 * self._profiler.steps and self.k is None:
                log.warning("Auto still profiling after %d steps: waiting for %s (is the checkpointer "
                            "reporting snapshot and persist times?)", rel, self._profiler.missing(rel))
        elif self._tuner is not None and self.config.adaptive:
            ch = self._tuner.observe(m)
            if ch is not None:
                self._propose(ch.k_new, ch.reason, ch.inputs)

    def profile_to_save(self) -> dict | None:
        """The profile and decision to cache, once after each change of k or of the measured
        cost per checkpoint (by more than 20%); None otherwise."""
        t = self._tuner
        if self._to_save is None and t is not None and t.To_meas is not None and self.k is not None and (
                self._saved_to is None or abs(t.To_meas - self._saved_to) > 0.2 * max(self._saved_to, 1e-6)):
            self._to_save = self._cache_dict(self.k)
        out, self._to_save = self._to_save, None
        if out is not None:
            out["To_meas"] = self._saved_to = t.To_meas if t is not None else None
        return out

    def stats(self) -> dict:
        """For ``Checkpointer.stats``: k, mode, phase, profile, changes, expected lost work."""
        lost = None
        if self.k is not None and self._profile is not None:
            ti = self._tuner.Ti if self._tuner else self._profile.Ti
            lat = (self._tuner.Tsnap + self._tuner.Ts) if self._tuner else self._latency()
            s = freq.lost_work_s(k=self.k, Ti=ti, latency_s=lat)
            lost = {"seconds": s, "iterations": s / ti}
        return {
            "k": self.k, "mode": self.mode, "phase": self.phase, "p": self.config.max_overhead,
            "profile": self._profile.to_dict() if self._profile else None,
            "profile_from_cache": self._from_cache,
            "decision": _decision_dict(self._decision),
            "changes": [dict(c) for c in self._changes],
            "expected_lost_work": lost, "mtbf_s": self.mtbf_s, "mtbf_source": self.mtbf_source,
            "overhead_last_window": self._tuner.last_overhead if self._tuner else None,
        }

    @property
    def phase(self) -> str:
        if self.k is None:
            return "profiling"
        return "tuning" if self.config.adaptive else "profiled"

    # ---- agreement (the checkpointer does the store I/O) ---------------------------------------
    def proposal(self) -> int:
        """This rank's choice of k (0 while profiling); rank 0's is the one every rank agrees on."""
        return self._proposal if self._proposes else 0

    def agreed(self, k: int, step: int) -> None:
        """The k every rank uses from ``should_checkpoint(step)`` on (the same call on every rank)."""
        if self._first is None:
            self._start(step)
        if k > 0 and k != self.k:
            if self._proposes and k in self._why:
                reason, inputs = self._why[k]
            else:
                reason, inputs = f"k={k} agreed from rank 0", {}
            self._set_k(k, step, reason, inputs)

    # ---- internals -----------------------------------------------------------------------------
    @property
    def _proposes(self) -> bool:
        return self.ctx.rank == 0

    def _start(self, step: int) -> None:
        self._first, self._last_ckpt = step, step - 1
        if self._profile is None:
            steps = self.config.profile_steps or profiler.profile_steps(self.ctx.iters_per_epoch)
            gpu = self.ctx.device.startswith("cuda")
            self._profiler = profiler.Profiler(steps=steps, has_gpu=gpu, state_bytes=self.ctx.state_bytes)

    def _set_k(self, k: int, step: int, reason: str, inputs: dict) -> None:
        old, self.k = self.k, k
        self._changes.append({"step": step, "k_old": old, "k_new": k, "reason": reason, "inputs": inputs})
        if self._profile is not None:
            self._to_save = self._cache_dict(k)

    def _propose(self, k: int, reason: str, inputs: dict) -> None:
        if not self._proposes:
            return
        self._proposal, self._why[k] = k, (reason, inputs)
        log.info("%s", reason)

    def _finish_profile(self, step: int) -> None:
        # M is training's peak without the snapshot: measured after the GPU snapshot, the peak
        # would hold the snapshot's arena too, and choosing the mode adds the snapshot again.
        M, Mmax = self._gpu_before_snapshot or profiler.gpu_memory(self.ctx.device)
        self._profile = self._profiler.result(M=M, Mmax=Mmax)
        self._decide(from_cache=None)

    def _decide(self, from_cache: dict | None) -> None:
        cfg = self.config
        # what tuning measured one checkpoint to cost (whole windows) beats profiling's few steps
        to_meas = from_cache.get("To_meas") if from_cache is not None else None
        to_meas = to_meas if isinstance(to_meas, (int, float)) and math.isfinite(to_meas) and to_meas >= 0 else None
        d = freq.decide(self._profile, p=cfg.max_overhead, mtbf_s=self.mtbf_s, To=to_meas,
                        headroom=cfg.gpu_headroom, k_max=cfg.tuning.k_max, buffers=self.ctx.buffers,
                        mtbf_assumed=self.mtbf_source == "assumed")
        self._decision, self._local_mode = d, d.mode
        k = d.k
        # a cached k holds what tuning learnt; reuse it while the budget and MTBF are the same
        if from_cache is not None and from_cache.get("p") == cfg.max_overhead \
                and from_cache.get("mtbf_s") == self.mtbf_s and isinstance(from_cache.get("k"), int) \
                and from_cache.get("buffers", 1) == self.ctx.buffers:
            k = max(from_cache["k"], 1)
        self._decided_k = k
        if self._proposes:
            self._tuner = Tuner(cfg.tuning, p=cfg.max_overhead, profile=self._profile, k=k, mode=d.mode,
                                mtbf_s=self.mtbf_s, headroom=cfg.gpu_headroom, buffers=self.ctx.buffers,
                                mtbf_assumed=self.mtbf_source == "assumed")
            self._tuner.To_meas = to_meas
            src = "cached profile" if from_cache is not None else "profile"
            reason = d.reason(self._profile, cfg.max_overhead, self.mtbf_s) + f" from {src}"
            if k != d.k:
                reason = f"k={k} (tuned in an earlier run) " + reason
            self._propose(k, reason, {"profile": self._profile.to_dict(), **_decision_dict(d)})

    def _latency(self) -> float:
        p = self._profile
        snap = p.Tg if self._local_mode == "gpu" and p.Tg is not None else p.Tc
        return snap + p.Ts

    def _cache_dict(self, k: int) -> dict:
        return {"version": CACHE_VERSION, "key": profile_key(self.ctx), "profile": self._profile.to_dict(),
                "p": self.config.max_overhead, "mtbf_s": self.mtbf_s, "k": k, "mode": self._local_mode,
                "buffers": self.ctx.buffers, "To_meas": self._tuner.To_meas if self._tuner else None}

    def _load_cache(self, d: dict) -> None:
        try:
            if d.get("version") != CACHE_VERSION:
                raise ValueError(f"version {d.get('version')!r} != {CACHE_VERSION}")
            if d.get("key") != profile_key(self.ctx):
                raise ValueError(f"key {d.get('key')!r} != {profile_key(self.ctx)!r}")
            self._profile = freq.Profile.from_dict(d["profile"])
        except (ValueError, TypeError, KeyError) as e:
            log.warning("ignoring the cached Auto profile (%s); profiling again", e)
            self._profile = None
            return
        self._from_cache = True
        self._decide(from_cache=d)


def _decision_dict(d: freq.Decision | None) -> dict | None:
    if d is None:
        return None
    return {"k": d.k, "mode": d.mode, "To": d.To, "k_persist": d.k_persist, "k_budget": d.k_budget,
            "k_young": d.k_young}
