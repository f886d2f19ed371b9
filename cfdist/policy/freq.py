"""Checkpoint-frequency math (CheckFreq §4, Young/Daly). Pure: numbers in, numbers out.

Symbols (seconds unless noted), as in the CheckFreq paper:

* ``Ti`` iteration time without checkpointing, ``Tw`` weight-update time (part of ``Ti``);
* ``Tg`` / ``Tc`` snapshot time into spare GPU memory / into CPU memory;
* ``Ts`` persist time (snapshot buffers -> storage, committed);
* ``m`` checkpoint bytes, ``M`` peak GPU memory of training, ``Mmax`` GPU memory in total;
* ``To`` checkpoint overhead left on the critical path per checkpoint;
* ``p`` overhead budget (fraction of training time), ``k`` iterations between checkpoints.

Rules:

* mode: snapshot to GPU when ``m`` fits in the GPU memory training leaves free (``To = Tg``:
  a device-to-device copy the next update must wait for), else to CPU memory, which overlaps the
  forward/backward of the next iteration and stalls only for what does not fit in it:
  ``To = max(Tc - (Ti - Tw), 0)``; when profiling measured the overhead around a snapshot
  (``Og``/``Oc``) and it is larger, that is ``To``;
* the next checkpoint must not start before the previous one is persisted:
  ``k >= ceil((Tsnap + Ts - To) / Ti)``; with ``b`` sets of snapshot buffers (double
  buffering, ``Checkpointer(buffers=2)``) a snapshot waits only for the persist ``b``
  checkpoints back, so that latency may span ``b`` intervals, but persists run one at a time, so
  every interval must still hold one persist: ``k >= max(ceil(Ts / Ti), ceil((Tsnap + Ts - To) / (b Ti))``;
* the overhead budget: ``To / (k * Ti) <= p``, so ``k >= kmin = ceil(To / (p * Ti))``
  (checkpoint cost = iteration time, ``p = 5%`` -> every 20 iterations);
* with a known MTBF, ``k`` minimises the expected waste rate
  ``To / (k Ti) + (k Ti / 2 + L) / MTBF`` (Young: ``k* = sqrt(2 To MTBF) / Ti``) among the ``k``
  that hide the persist with :data:`QUIET_STEPS` to spare (steps free of checkpoint work, from
  which the tuner re-measures ``Ti``: without them the cost it measures per checkpoint is
  against a stale ``Ti``); ``L = Tsnap + Ts`` is the commit latency a failure also loses. The
  budget ``p`` then no longer binds: it stands in for the unknown cost of failures, and once
  that cost is known, a ``k`` below the budget's that loses less work to failures than its
  extra checkpoints cost is the better interval (failures every 10 s, ``To`` = 35 ms,
  ``Ti`` = 46 ms: Young's 18 rather than the 3.5% budget's 22; with rare failures Young's
  ``k`` lies above the budget's and lengthens it).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, fields

QUIET_STEPS = 2
"""Steps free of checkpoint work that an interval chosen for an MTBF keeps beyond the persist bound."""

# ceil() of a ratio computed in floating point: 1 / 0.05 is 19.999999999999996 on some paths.
_EPS = 1e-9


def _ceil(x: float) -> int:
    return math.ceil(x - _EPS)


@dataclass(frozen=True, kw_only=True, slots=True)
class Profile:
    """What profiling measured on the snapshotting rank (seconds, bytes). JSON-able via to_dict."""

    Ti: float
    """Iteration time without checkpointing."""
    Tw: float
    """Weight-update (optimizer.step) time, part of Ti."""
    Tc: float
    """Snapshot time into CPU memory."""
    Ts: float
    """Persist time of one checkpoint."""
    m: int
    """Checkpoint bytes."""
    Tg: float | None = None
    """Snapshot time into GPU memory; None without a GPU."""
    M: int | None = None
    """Peak GPU memory of training (bytes); None without a GPU."""
    Mmax: int | None = None
    """Total GPU memory (bytes); None without a GPU."""
    Oc: float | None = None
    """Measured time one CPU snapshot added to the iterations around it (critical path)."""
    Og: float | None = None
    """Measured time one GPU snapshot added to the iterations around it."""

    def __post_init__(self):
        for name in ("Ti", "Tw", "Tc", "Ts", "Tg", "Oc", "Og"):
            v = getattr(self, name)
            if v is None:
                continue
            if not isinstance(v, (int, float)) or not math.isfinite(v) or v < 0:
                raise ValueError(f"Profile.{name} must be a finite duration >= 0 s, got {v!r}")
        if self.Ti <= 0:
            raise ValueError(
                f"Profile.Ti must be > 0 s (got {self.Ti!r}): profile over steps that do work"
            )
        if self.Tw > self.Ti:
            raise ValueError(f"Profile.Tw={self.Tw} exceeds Ti={self.Ti}: Tw is part of Ti")
        for name in ("m", "M", "Mmax"):
            v = getattr(self, name)
            if v is not None and (not isinstance(v, int) or isinstance(v, bool) or v < 0):
                raise ValueError(f"Profile.{name} must be a byte count (int >= 0), got {v!r}")

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "Profile":
        names = {f.name for f in fields(cls)}
        unknown = set(d) - names
        if unknown:
            raise ValueError(f"cached profile has unknown fields {sorted(unknown)}; known {sorted(names)}")
        return cls(**d)


@dataclass(frozen=True, kw_only=True, slots=True)
class Decision:
    """The chosen interval and snapshot mode, with every bound that went into it."""

    k: int
    """Iterations between checkpoints."""
    mode: str
    """Where snapshots go: ``"gpu"`` or ``"cpu"``."""
    To: float
    """Overhead per checkpoint left on the critical path (s)."""
    k_persist: int
    """Smallest k whose interval covers the snapshot + persist of the previous checkpoint."""
    k_budget: int
    """Smallest k that keeps To / (k Ti) within the budget p."""
    k_young: int | None
    """The k minimising expected waste for the MTBF (None without one)."""

    def reason(self, profile: Profile, p: float, mtbf_s: float | None = None) -> str:
        """``k=37 because Ti=0.21s Tc=0.04s Ts=1.9s To=0.04s p=3.5% [MTBF=3600s]``."""
        tg = f" Tg={profile.Tg:.3g}s" if profile.Tg is not None else ""
        mt = f" MTBF={mtbf_s:.4g}s" if mtbf_s is not None else ""
        return (
            f"k={self.k} mode={self.mode} because Ti={profile.Ti:.3g}s Tc={profile.Tc:.3g}s{tg} "
            f"Ts={profile.Ts:.3g}s To={self.To:.3g}s p={p * 100:.3g}%{mt} "
            f"(k_persist={self.k_persist} k_budget={self.k_budget} k_young={self.k_young})"
        )


def gpu_fits(m: int, M: int | None, Mmax: int | None, *, headroom: float = 0.05) -> bool:
    """Whether a snapshot of ``m`` bytes fits beside training's peak ``M`` in ``Mmax``,
    keeping ``headroom`` (fraction of ``Mmax``) free for allocator fragmentation."""
    if M is None or Mmax is None:
        return False
    return m + M <= Mmax * (1.0 - headroom)


def choose_mode(profile: Profile, *, headroom: float = 0.05) -> tuple[str, float, float]:
    """``(mode, Tsnap, To)``: GPU when the snapshot fits in free GPU memory and was measured,
    else CPU (see the module docstring for ``To``). ``To`` is the larger of the model and of
    what profiling measured around a snapshot (``Og``/``Oc``): the measurement also sees the
    costs the model leaves out (capturing the state, contention with the copy thread)."""
    if profile.Tg is not None and gpu_fits(profile.m, profile.M, profile.Mmax, headroom=headroom):
        return "gpu", profile.Tg, max(profile.Tg, profile.Og or 0.0)
    model = cpu_overhead(Ti=profile.Ti, Tw=profile.Tw, Tc=profile.Tc)
    return "cpu", profile.Tc, max(model, profile.Oc or 0.0)


def cpu_overhead(*, Ti: float, Tw: float, Tc: float) -> float:
    """A CPU snapshot overlaps the next forward/backward (``Ti - Tw``); the rest stalls."""
    return max(Tc - (Ti - Tw), 0.0)


def k_persist(*, Ti: float, Tsnap: float, Ts: float, To: float, buffers: int = 1) -> int:
    """``ceil((Tsnap + Ts - To) / Ti)``, at least 1: the interval that hides the persist.

    With ``buffers`` >= 2 sets of snapshot buffers: ``max(ceil(Ts / Ti), ceil((Tsnap + Ts -
    To) / (buffers Ti)))``: the snapshot-to-commit latency may span ``buffers`` intervals, and
    one persist (they run one at a time) must fit in each interval."""
    if not (isinstance(buffers, int) and buffers >= 1):
        raise ValueError(f"buffers must be an int >= 1, got {buffers!r}")
    if buffers == 1:
        return max(_ceil((Tsnap + Ts - To) / Ti), 1)
    return max(_ceil(Ts / Ti), _ceil((Tsnap + Ts - To) / (buffers * Ti)), 1)


def k_budget(*, Ti: float, To: float, p: float) -> int:
    """``kmin = ceil(To / (p Ti))``, at least 1: the fewest iterations per checkpoint for budget p."""
    _check_p(p)
    return max(_ceil(To / (p * Ti)), 1)


def lost_work_s(*, k: int, Ti: float, latency_s: float) -> float:
    """Expected work lost per failure: half an interval plus the commit latency (snapshot +
    persist) of the checkpoint in flight, which a failure also loses."""
    return k * Ti / 2.0 + latency_s


def waste_rate(*, k: int, Ti: float, To: float, latency_s: float, mtbf_s: float) -> float:
    """Expected fraction of time wasted: overhead ``To/(k Ti)`` + lost work per failure / MTBF."""
    return To / (k * Ti) + lost_work_s(k=k, Ti=Ti, latency_s=latency_s) / mtbf_s


def k_young(*, Ti: float, To: float, latency_s: float, mtbf_s: float, k_lo: int = 1) -> int:
    """The integer ``k >= k_lo`` minimising :func:`waste_rate` (convex in k; near Young's
    ``sqrt(2 To MTBF) / Ti``). With ``To == 0`` checkpointing is free: ``k_lo``."""
    if not (mtbf_s > 0 and math.isfinite(mtbf_s)):
        raise ValueError(f"mtbf_s must be a finite number of seconds > 0, got {mtbf_s!r}")
    x = math.sqrt(2.0 * To * mtbf_s) / Ti
    best = max(k_lo, 1)
    cands = {best, max(math.floor(x), best), max(math.ceil(x), best)}
    return min(sorted(cands), key=lambda k: waste_rate(k=k, Ti=Ti, To=To, latency_s=latency_s, mtbf_s=mtbf_s))


def decide(
    profile: Profile, *, p: float, mtbf_s: float | None = None, headroom: float = 0.05,
    To: float | None = None, k_max: int | None = None, buffers: int = 1, mtbf_assumed: bool = False,
) -> Decision:
    """The CheckFreq decision for ``profile`` under budget ``p``; with a known MTBF, Young/Daly's
    optimum above the persist bound instead (see the module docstring).

    ``To`` overrides the modelled critical-path overhead (the tuner passes what it measured).
    ``k_max`` caps the result (a cap below the bounds wins: the caller asked for it).
    ``buffers``: sets of snapshot buffers (see :func:`k_persist`).
    ``mtbf_assumed``: ``mtbf_s`` is an assumption, not a measurement (:class:`cfdist.Auto`'s
    ``replica_loss_mtbf_s``): Young/Daly's ``k`` may only lengthen the interval, the budget
    still caps the overhead (``k >= k_budget``).
    """
    _check_p(p)
    mode, tsnap, to_model = choose_mode(profile, headroom=headroom)
    to = to_model if To is None else max(To, 0.0)
    kp = k_persist(Ti=profile.Ti, Tsnap=tsnap, Ts=profile.Ts, To=to, buffers=buffers)
    kb = k_budget(Ti=profile.Ti, To=to, p=p)
    k = max(kp, kb)
    ky = None
    if mtbf_s is not None:
        ky = k_young(Ti=profile.Ti, To=to, latency_s=tsnap + profile.Ts, mtbf_s=mtbf_s, k_lo=kp + QUIET_STEPS)
        k = max(ky, kb) if mtbf_assumed else ky
    if k_max is not None:
        k = min(k, k_max)
    return Decision(k=k, mode=mode, To=to, k_persist=kp, k_budget=kb, k_young=ky)


def estimate_mtbf(restart_times_s: list[float] | tuple[float, ...], *, now_s: float,
                  started_s: float | None = None, present: bool = True) -> float | None:
    """MTBF from this run's restarts: the mean gap between consecutive restarts, counting the
    present start (``now_s``) as one, i.e. ``(now_s - first restart) / restarts recorded``.
    With ``started_s`` (when the run first started) the gap before the first restart counts
    too: ``(now_s - started_s) / (restarts recorded + 1)``, so the first restart already has an
    estimate.

    ``present=False``: the present start followed no failure that counts (a restart from a
    survivor's live state): the failures are the recorded restarts only, over the time from
    the start (or the first of them) to ``now_s``.

    Each gap holds one failure (plus its recovery, which makes the estimate conservative).
    None without a recorded restart or start (a failure, when not ``present``), or when the
    clock went backwards.
    """
    ts = sorted(float(t) for t in restart_times_s)
    failures = len(ts) + (1 if present else 0)
    if started_s is not None and (not ts or started_s <= ts[0]) and now_s > started_s:
        return (now_s - float(started_s)) / failures if failures else None
    if not ts or now_s <= ts[0]:
        return None
    failures -= 1   # the gaps start at the first restart
    return (now_s - ts[0]) / failures if failures else None


def _check_p(p: float) -> None:
    if not (isinstance(p, (int, float)) and 0 < p < 1):
        raise ValueError(f"overhead budget p must be a fraction in (0, 1), e.g. 0.035 for 3.5%; got {p!r}")
