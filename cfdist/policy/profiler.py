"""The profiling phase: which steps to snapshot, and what they measured.

Reads no clock: the checkpointer hands over measured durations in each
:class:`~cfdist.policy.base.StepMeasurement`. The only outside reading is GPU memory
(:func:`gpu_memory`, ``torch.cuda``), taken once when profiling ends.

Plan over the first ``P`` steps (``rel`` counts from 1 at the first step this process runs):

* ``rel <= warmup``: ignored (allocations, DDP's bucket rebuild);
* clean steps up to the first planned snapshot: ``Ti`` (median of ``iter_s``) and ``Tw``
  (median of ``update_s``);
* with a GPU: a GPU snapshot at ``P - 2`` (``Tg``), then a CPU snapshot at ``P`` (``Tc``);
  without one only the CPU snapshot at ``P``;
* the time a snapshot adds to its own step and the next ones (the GPU one: 2 steps, the CPU
  one: 3), beyond ``Ti`` and beyond waiting for an earlier persist, is its measured overhead
  ``Og``/``Oc`` (it includes what a model of the copy misses: capturing the state, contention);
* persists report ``Ts`` and the bytes ``m`` whenever they complete; profiling ends at the first
  step ``>= P`` by which every needed number has arrived (later when persisting is slow).

A checkpointer that reports no snapshot duration still gets a profile: the stall at the gate of
the step after a planned snapshot (what the copy cost the critical path, a lower bound of the
copy time) stands in for it, with a warning.

Every rank derives the same plan from the same ``P`` and device, so the snapshot steps agree.
"""

from __future__ import annotations

import logging
import math
import statistics

from cfdist.policy.base import StepMeasurement
from cfdist.policy.freq import Profile

log = logging.getLogger("cfdist.policy")

MIN_STEPS = 10
"""Fewer profiling steps cannot separate the warm-up from clean samples."""
MAX_STEPS = 50
WARMUP = 2


def profile_steps(iters_per_epoch: int | None) -> int:
    """``min(1% of an epoch, 50)``, at least :data:`MIN_STEPS`; 50 when the epoch is unknown."""
    if iters_per_epoch is None:
        return MAX_STEPS
    return max(min(math.ceil(iters_per_epoch / 100), MAX_STEPS), MIN_STEPS)


def gpu_memory(device: str) -> tuple[int | None, int | None]:
    """``(M, Mmax)``: peak bytes allocated by this process and total bytes on ``device``;
    ``(None, None)`` without CUDA."""
    import torch

    if not device.startswith("cuda") or not torch.cuda.is_available():
        return None, None
    dev = torch.device(device)
    idx = dev.index if dev.index is not None else torch.cuda.current_device()
    return int(torch.cuda.max_memory_allocated(idx)), int(torch.cuda.get_device_properties(idx).total_memory)


class Profiler:
    """Collects one profiling phase. Feed :meth:`observe` once per step, in order."""

    def __init__(self, *, steps: int, has_gpu: bool, state_bytes: int = 0, warmup: int = WARMUP):
        if not (isinstance(steps, int) and steps >= MIN_STEPS):
            raise ValueError(f"profiling needs at least {MIN_STEPS} steps, got {steps!r}")
        self.steps = steps
        self.has_gpu = has_gpu
        self.warmup = warmup
        self.state_bytes = state_bytes
        self.gpu_at = steps - 2 if has_gpu else None
        self.cpu_at = steps
        self._last_sample = (self.gpu_at or self.cpu_at) - 1
        self._ti: list[float] = []
        self._tw: list[float] = []
        self._tc: list[float] = []
        self._tg: list[float] = []
        self._ts: list[float] = []
        self._m: int | None = None
        self._gpu_refused = False
        self._prev_ckpt = False
        self._gate: dict[str, float] = {}
        # steps whose extra time counts as a snapshot's overhead, per device
        self._spans = {"cpu": range(self.cpu_at, self.cpu_at + 3)}
        if self.gpu_at is not None:
            self._spans["gpu"] = range(self.gpu_at, self.cpu_at)
        self._extra: dict[str, list[float]] = {d: [] for d in self._spans}

    def snapshot_at(self, rel: int) -> str | None:
        """``"gpu"``/``"cpu"`` when the plan snapshots at relative step ``rel``, else None."""
        if rel == self.gpu_at:
            return "gpu"
        if rel == self.cpu_at:
            return "cpu"
        return None

    def observe(self, rel: int, m: StepMeasurement) -> None:
        clean = not m.checkpointed and not self._prev_ckpt and m.stall_s == 0
        if self.warmup < rel <= self._last_sample and clean:
            self._ti.append(m.iter_s)
            self._tw.append(m.update_s)
        self._prev_ckpt = m.checkpointed
        for dev, span in self._spans.items():
            if rel in span:  # the snapshot step's own stall is the wait for an earlier persist
                self._extra[dev].append(m.iter_s - (m.stall_s if rel == span.start else 0.0))
        for dev, at in (("gpu", self.gpu_at), ("cpu", self.cpu_at)):
            if at is not None and rel == at + 1:
                self._gate[dev] = m.stall_s
        if m.snapshot_s is not None:
            if m.snapshot_device == "gpu":
                self._tg.append(m.snapshot_s)
            else:
                self._tc.append(m.snapshot_s)
                # the first report after the planned GPU snapshot came from the CPU: the
                # snapshotter had no spare GPU memory, so there is no Tg to wait for
                if self.gpu_at is not None and rel >= self.gpu_at and not self._tg:
                    self._gpu_refused = True
        if m.persist_s is not None:
            self._ts.append(m.persist_s)
            if m.persist_bytes is not None:
                self._m = int(m.persist_bytes)

    def missing(self, rel: int) -> list[str]:
        """What is still to come before :meth:`result` can be called (empty: done)."""
        need = []
        if rel < self.steps + 2:
            need.append(f"{self.steps + 2 - rel} more steps")
        if not self._ti:
            need.append("Ti")
        if not self._tc and "cpu" not in self._gate:
            need.append("Tc")
        if self.has_gpu and not self._gpu_refused and not self._tg and "gpu" not in self._gate:
            need.append("Tg")
        if not self._ts:
            need.append("Ts")
        return need

    def done(self, rel: int) -> bool:
        return not self.missing(rel)

    def result(self, *, M: int | None = None, Mmax: int | None = None) -> Profile:
        """The measured profile; ``M``/``Mmax`` from :func:`gpu_memory` (None without a GPU)."""
        ti = statistics.median(self._ti)
        tw = min(statistics.median(self._tw), ti)
        tc = statistics.median(self._tc) if self._tc else self._gate["cpu"]
        tg = None
        if self.has_gpu and not self._gpu_refused:
            tg = statistics.median(self._tg) if self._tg else self._gate["gpu"]
        if not self._tc or (tg is not None and not self._tg):
            log.warning("the checkpointer reported no snapshot duration during profiling; using the "
                        "gate stall after the snapshot instead (Tc=%.3gs%s)", tc,
                        f", Tg={tg:.3g}s" if tg is not None else "")
        over = {d: max(sum(xs) - len(xs) * ti, 0.0) if len(xs) == len(self._spans[d]) else None
                for d, xs in self._extra.items()}
        return Profile(
            Ti=ti, Tw=tw, Tc=tc, Ts=statistics.fmean(self._ts),
            m=self._m if self._m is not None else self.state_bytes, Tg=tg,
            M=M if tg is not None else None, Mmax=Mmax if tg is not None else None,
            Oc=over["cpu"], Og=over.get("gpu") if tg is not None else None,
        )
