"""Adaptive rate tuning (CheckFreq §4.5): keep the measured overhead within the budget.

Pure: the :class:`Tuner` sees :class:`~cfdist.policy.base.StepMeasurement` s (durations the
checkpointer measured) and the current ``k``, and proposes a new ``k`` with its reasons. No
clocks, no I/O; table-tested.

Windows. The overhead of the checkpoint taken at step ``c`` shows up in the steps after it (the
snapshot stall at the next gate) and at the next checkpoint (waiting for ``c``'s persist), so a
window is a run of whole intervals ``(c_j, c_j+1]`` between checkpointed steps, closed once it
spans at least ``window_steps`` steps. Its overhead is ``sum(iter_s) / (n Ti) - 1`` with ``Ti``
the iteration time without checkpointing, and ``C = extra time / checkpoints`` is what one
checkpoint really costs on the critical path. Of that, ``W`` (the stall reported at the
checkpoint steps) is the wait for the previous persist, which a longer interval removes, and
``C0 = C - W`` is the cost every checkpoint keeps.

Decisions, with hysteresis so ``k`` does not oscillate:

* overhead > ``raise_above * p``: a measured persist wait raises ``k`` at once to where the
  persist fits (``k + ceil(W / Ti)``); the rest of the cost raises it to
  ``ceil(C0 / (lower_target p Ti))`` once ``raise_patience`` windows in a row were over budget
  (with the smallest ``C0`` of them: a burst of load on the machine is not a checkpoint cost);
* overhead < ``lower_below * p`` (and no persist wait) for ``lower_patience`` windows in a row:
  lower ``k`` to reach ``lower_target * p`` with the worst ``C0`` of those windows, never below
  the interval that still hides the persist (``k_persist`` from the latest measured snapshot and
  persist times), nor the MTBF optimum, nor to an interval at which a persist wait was seen
  (unless persists got 20% faster since);
* the first interval after a change is discarded (it mixes the old and the new ``k``);
* with a known MTBF the budget does not bind (:mod:`cfdist.policy.freq`): every window moves
  ``k`` to Young/Daly's optimum with the measured ``C0`` (above the persist bound, and at or
  above an interval that was seen to wait for a persist) when it differs by more than 10%.

``Ti`` is re-measured from quiet steps (no checkpoint in the step, no stall, no persist in
flight): the mean of a window's quiet steps replaces it when there are at least 5 (the mean, so
that load spikes unrelated to checkpointing are part of the baseline, not of the overhead).
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass, field

from cfdist.policy import freq
from cfdist.policy.base import StepMeasurement


@dataclass(frozen=True, kw_only=True, slots=True)
class TunerConfig:
    """Knobs of adaptive rate tuning. Defaults follow CheckFreq's behaviour with hysteresis."""

    window_steps: int = 50
    """A window closes at the first checkpoint after this many steps (whole intervals)."""
    raise_above: float = 1.0
    """Raise k when a window's overhead exceeds ``raise_above * p``."""
    raise_patience: int = 2
    """Windows over budget in a row before a raise not explained by a persist wait."""
    lower_below: float = 0.5
    """Lower k only when overhead stays below ``lower_below * p`` ..."""
    lower_patience: int = 3
    """... for this many consecutive windows."""
    lower_target: float = 0.75
    """When lowering, aim at ``lower_target * p`` (below ``raise_above`` so it does not bounce)."""
    max_factor: float = 8.0
    """One change multiplies or divides k by at most this."""
    k_max: int = 1_000_000
    """Never propose more iterations than this between checkpoints."""
    ema: float = 0.5
    """Weight of the newest sample in the running snapshot and persist times (0 < ema <= 1);
    a persist slower than the running value replaces it at once (be quick to back off)."""

    def __post_init__(self):
        if not (isinstance(self.window_steps, int) and self.window_steps >= 1):
            raise ValueError(f"TunerConfig.window_steps must be an int >= 1, got {self.window_steps!r}")
        if not (0 < self.lower_below < self.lower_target < self.raise_above):
            raise ValueError(
                "TunerConfig needs 0 < lower_below < lower_target < raise_above (hysteresis band), "
                f"got lower_below={self.lower_below} lower_target={self.lower_target} "
                f"raise_above={self.raise_above}"
            )
        if not (isinstance(self.raise_patience, int) and self.raise_patience >= 1):
            raise ValueError(f"TunerConfig.raise_patience must be an int >= 1, got {self.raise_patience!r}")
        if not (isinstance(self.lower_patience, int) and self.lower_patience >= 1):
            raise ValueError(f"TunerConfig.lower_patience must be an int >= 1, got {self.lower_patience!r}")
        if not self.max_factor > 1:
            raise ValueError(f"TunerConfig.max_factor must be > 1, got {self.max_factor!r}")
        if not (isinstance(self.k_max, int) and self.k_max >= 1):
            raise ValueError(f"TunerConfig.k_max must be an int >= 1, got {self.k_max!r}")
        if not (0 < self.ema <= 1):
            raise ValueError(f"TunerConfig.ema must be in (0, 1], got {self.ema!r}")


@dataclass(frozen=True, kw_only=True, slots=True)
class Change:
    """One change of k, with the numbers that caused it (for logs and ``Checkpointer.stats``)."""

    step: int
    """Step of the measurement that closed the deciding window."""
    k_old: int
    k_new: int
    reason: str
    """``k=37 because overhead=9.1% > p=3.5% over 120 steps: Ti=0.21s C=0.7s Ts=1.9s ...``."""
    inputs: dict = field(default_factory=dict)
    """The numbers in the reason, machine-readable."""

    def to_dict(self) -> dict:
        return {"step": self.step, "k_old": self.k_old, "k_new": self.k_new,
                "reason": self.reason, "inputs": dict(self.inputs)}


class Tuner:
    """Proposes k from measured overhead. Call :meth:`observe` once per step, in step order.

    Not thread-safe; lives on the rank whose measurements decide (rank 0).
    """

    def __init__(
        self, config: TunerConfig, *, p: float, profile: freq.Profile, k: int, mode: str,
        mtbf_s: float | None = None, headroom: float = 0.05, buffers: int = 1, mtbf_assumed: bool = False,
    ):
        if not (isinstance(k, int) and k >= 1):
            raise ValueError(f"Tuner needs a starting k >= 1, got {k!r}")
        if mode not in ("cpu", "gpu"):
            raise ValueError(f"Tuner mode must be 'cpu' or 'gpu', got {mode!r}")
        freq._check_p(p)
        self.config = config
        self.p = p
        self.k = k
        self.mode = mode
        self.mtbf_s = mtbf_s
        self.mtbf_assumed = mtbf_assumed
        """``mtbf_s`` is an assumption (see :func:`cfdist.policy.freq.decide`): the floor also
        keeps the measured overhead within the budget."""
        self.buffers = buffers
        self.Ti = profile.Ti
        self.Tw = profile.Tw
        self.Ts = profile.Ts
        self.Tsnap = profile.Tg if mode == "gpu" and profile.Tg is not None else profile.Tc
        self.To_meas: float | None = None
        """Measured cost per checkpoint beyond waiting for a persist (EMA over windows)."""
        self.last_overhead: float | None = None
        """Overhead of the last closed window (fraction), None before the first."""
        self._seen_ckpt = False
        self._skip = 0
        self._reset_window()
        self._interval: list[StepMeasurement] = []
        self._low_streak: list[float] = []
        self._high_streak: list[float] = []
        self._persist_pending = False
        self._after_ckpt = False
        self._wait_seen: tuple[int, float] | None = None  # (k, Ts) when a persist wait was seen

    # ---- derived numbers ---------------------------------------------------------------------
    @property
    def To_model(self) -> float:
        if self.mode == "gpu":
            return self.Tsnap
        return freq.cpu_overhead(Ti=self.Ti, Tw=self.Tw, Tc=self.Tsnap)

    def k_floor(self) -> int:
        """The smallest k the tuner may lower to: hides the persist, and the MTBF optimum
        (Young/Daly with the measured cost per checkpoint once there is one)."""
        kp = freq.k_persist(Ti=self.Ti, Tsnap=self.Tsnap, Ts=self.Ts, To=self.To_model, buffers=self.buffers)
        if self.mtbf_s is not None:
            to = max(self.To_model, self.To_meas or 0.0)
            kp = freq.k_young(Ti=self.Ti, To=to, latency_s=self.Tsnap + self.Ts,
                              mtbf_s=self.mtbf_s, k_lo=kp + freq.QUIET_STEPS)
            if self.mtbf_assumed:
                kp = max(kp, freq.k_budget(Ti=self.Ti, To=to, p=self.p))
        return min(kp, self.config.k_max)

    def lost_work_s(self) -> float:
        return freq.lost_work_s(k=self.k, Ti=self.Ti, latency_s=self.Tsnap + self.Ts)

    # ---- feeding -----------------------------------------------------------------------------
    def _reset_window(self) -> None:
        self._n = 0
        self._sum = 0.0
        self._ckpts = 0
        self._wait = 0.0
        self._quiet: list[float] = []

    def observe(self, m: StepMeasurement) -> Change | None:
        """Account one step; return a :class:`Change` when a closed window calls for one."""
        quiet = self.is_quiet(m)
        a = self.config.ema
        if m.persist_s is not None:
            self.Ts = max(m.persist_s, a * m.persist_s + (1 - a) * self.Ts)
            self._persist_pending = False
        if m.snapshot_s is not None and (m.snapshot_device in (None, self.mode)):
            self.Tsnap = a * m.snapshot_s + (1 - a) * self.Tsnap
        self._after_ckpt = m.checkpointed
        if m.checkpointed:
            self._persist_pending = True

        if not self._seen_ckpt:  # steps before the first checkpoint hold no whole interval
            self._seen_ckpt = m.checkpointed
            return None
        self._interval.append((m.iter_s, quiet))
        if not m.checkpointed:
            return None
        steps, self._interval = self._interval, []
        if self._skip:
            self._skip -= 1
            return None
        self._n += len(steps)
        self._sum += sum(t for t, _ in steps)
        self._ckpts += 1
        self._wait += m.stall_s  # at a checkpoint step: waiting for the previous persist
        self._quiet.extend(t for t, q in steps if q)
        if self._n < self.config.window_steps:
            return None
        return self._close_window(m.step)

    def is_quiet(self, m: StepMeasurement) -> bool:
        """Whether ``m`` ran free of checkpoint work: not a checkpoint step, not the step after
        one (its gate waits for the snapshot), no stall, and no persist in flight before it."""
        return (not m.checkpointed and m.stall_s == 0 and not self._after_ckpt
                and not self._persist_pending)

    # ---- decisions ---------------------------------------------------------------------------
    def _k_for(self, C0: float, target: float) -> int:
        """Smallest k at or above the floor whose overhead ``(C0 + wait(k)) / (k Ti)`` meets
        ``target``; above the floor the wait is 0, so it is ``ceil(C0 / (target Ti))``."""
        return max(self.k_floor(), freq._ceil(C0 / (target * self.Ti)), 1)

    def _toward_young(self, k: int, k_fit: int, W: float, overhead: float,
                      fresh: bool, n: int) -> tuple[int | None, str]:
        """With a known MTBF: ``k`` follows Young/Daly's optimum with the measured cost per
        checkpoint (:meth:`k_floor`), not the budget; a persist wait still raises it at once to
        where the persist fits, and it is never lowered back to an interval where one was seen
        (unless persists got 20% faster), nor lowered by a window too busy to re-measure ``Ti``
        (fewer than 5 quiet steps): such a window doubles ``k`` instead, since the cost it
        measures is against a stale ``Ti``. 10% slack, so noise does not nudge ``k``."""
        cfg = self.config
        want = self.k_floor()
        if W > 0:
            want = max(want, k_fit)
        if not fresh and want <= k:
            # no step of the window was free of checkpoint work: the interval is too short to
            # measure what a checkpoint costs; double it until it is not
            want = 2 * k
        if self._wait_seen is not None:
            kw, ts = self._wait_seen
            if self.Ts < 0.8 * ts:
                self._wait_seen = None
            else:
                want = max(want, kw)
        if abs(want - k) <= 0.1 * k or (want < k and not fresh):
            return None, ""   # lowered only on a cost measured against a fresh Ti
        k_new = min(max(want, math.floor(k / cfg.max_factor), 1), math.ceil(k * cfg.max_factor), cfg.k_max)
        cost = f"C0={self.To_meas:.3g}s" if self.To_meas is not None else "C0 not measured yet"
        why = (f"Young/Daly's k={want} for MTBF={self.mtbf_s:.4g}s with the measured cost per checkpoint "
               f"{cost} (overhead={overhead * 100:.2f}%)" if fresh else
               f"k={want}: fewer than 5 steps of {n} free of checkpoint work, too few to re-measure Ti "
               f"(MTBF={self.mtbf_s:.4g}s)")
        return (k_new if k_new != k else None), why

    def _close_window(self, step: int) -> Change | None:
        cfg = self.config
        fresh = len(self._quiet) >= 5
        if fresh:
            self.Ti = statistics.fmean(self._quiet)
        n, total, c, wait = self._n, self._sum, self._ckpts, self._wait
        self._reset_window()
        extra = total - n * self.Ti
        overhead = extra / (n * self.Ti)
        self.last_overhead = overhead
        C = max(extra, 0.0) / c
        W = min(wait / c, C)
        k_fit = self.k + freq._ceil(W / self.Ti) if W > 0 else 0  # the persist would have fitted
        if k_fit and (self._wait_seen is None or k_fit >= self._wait_seen[0]):
            self._wait_seen = (k_fit, self.Ts)
        # what one checkpoint costs beyond waiting for its predecessor's persist
        C0 = C - W
        if fresh:   # against a stale Ti, C0 is off by that Ti's error
            self.To_meas = C0 if self.To_meas is None else cfg.ema * C0 + (1 - cfg.ema) * self.To_meas
        p = self.p
        inputs = {"overhead": overhead, "p": p, "steps": n, "checkpoints": c, "Ti": self.Ti,
                  "C": C, "W": W, "C0": C0, "Tsnap": self.Tsnap, "Ts": self.Ts, "mode": self.mode,
                  "k_floor": self.k_floor()}
        if self.mtbf_s is not None:
            inputs["mtbf_s"] = self.mtbf_s
        k = self.k
        target = cfg.lower_target * p
        if self.mtbf_s is not None:
            k_new, why = self._toward_young(k, k_fit, W, overhead, fresh, n)
            if k_new is None:
                return None
        elif overhead > cfg.raise_above * p:
            self._low_streak = []
            self._high_streak.append(C0)
            want = max(k_fit, self.k_floor()) if W > 0 else 0
            if len(self._high_streak) >= cfg.raise_patience:
                want = max(want, self._k_for(min(self._high_streak), target))
            if want <= k:
                return None  # over budget once, not explained by a persist wait: confirm first
            self._high_streak = []
            k_new = min(max(want, k + 1), math.ceil(k * cfg.max_factor), cfg.k_max)
            why = f"overhead={overhead * 100:.2f}% > {cfg.raise_above * p * 100:.3g}%"
        elif self.k_floor() > k * 1.1:
            # in budget, but the floor rose (slower persist, or the MTBF optimum with the
            # measured cost): 10% slack so noise in Ts does not nudge k every window
            self._low_streak, self._high_streak = [], []
            k_new = min(self.k_floor(), math.ceil(k * cfg.max_factor), cfg.k_max)
            why = f"k_floor={self.k_floor()} > k={k} (overhead={overhead * 100:.2f}%)"
        elif overhead < cfg.lower_below * p and W == 0:
            self._high_streak = []
            self._low_streak.append(C0)
            if len(self._low_streak) < cfg.lower_patience:
                return None
            worst = max(self._low_streak)
            self._low_streak = []
            k_new = max(self._k_for(worst, target), math.floor(k / cfg.max_factor), 1)
            if self._wait_seen is not None:
                kw, ts = self._wait_seen
                if self.Ts < 0.8 * ts:
                    self._wait_seen = None  # persists got clearly faster: that interval may do now
                else:
                    k_new = max(k_new, kw)
            if k_new >= k:
                return None
            why = (f"overhead < {cfg.lower_below * p * 100:.3g}% for {cfg.lower_patience} windows "
                   f"(last {overhead * 100:.2f}%, worst C0={worst:.3g}s)")
            inputs["C0"] = worst
        else:
            self._low_streak, self._high_streak = [], []
            return None
        if k_new == k:
            return None
        self.k = k_new
        self._skip = 1
        self._interval = []
        mt = f" MTBF={self.mtbf_s:.4g}s" if self.mtbf_s is not None else ""
        reason = (f"k={k_new} because {why} over {n} steps: Ti={self.Ti:.3g}s C={C:.3g}s W={W:.3g}s "
                  f"T{'g' if self.mode == 'gpu' else 'c'}={self.Tsnap:.3g}s Ts={self.Ts:.3g}s "
                  f"p={p * 100:.3g}%{mt}")
        return Change(step=step, k_old=k, k_new=k_new, reason=reason, inputs=inputs)
