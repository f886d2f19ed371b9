"""A training loop in virtual time, for trying policies without a machine. Pure: no clocks.

::

    took, t, base = simulate([cfdist.Auto()], 5000, Ti=0.1, Ts=lambda step: 0.5)
    overhead = t / base - 1

The model is the checkpointer's: each step takes ``Ti``; a checkpoint first waits for the
previous persist (one in flight; that wait is reported as the step's stall), then snapshots;
the step after a checkpoint stalls ``To`` at the gate; a persist takes ``Tsnap + Ts(step)`` and is
reported by the first step that ends after it (or by the step that waited for it). Every policy
sees what the real checkpointer would report. Used by the tests and by
``bench/bench_adaptive.py`` for noise-free figures.
"""

from __future__ import annotations

from typing import Callable, Sequence

from cfdist.policy.base import StepMeasurement


def simulate(
    policies: Sequence, steps: int, *, Ti: float = 0.1, Tw: float = 0.01, Tsnap: float = 0.02,
    To: float = 0.02, Ts: Callable[[int], float] = lambda step: 0.5, agreements: Sequence | None = None,
    writer: int = 0, start: int = 1, nbytes: int = 1000, trace: list | None = None,
) -> tuple[list[list[int]], float, float]:
    """Run ``policies`` (one per rank, same steps) for ``steps`` steps from step ``start``.

    Returns ``(checkpointed steps per rank, virtual time, time without checkpointing)``.
    Before each step every rank learns the agreed k as the checkpointer hands it over: from
    ``agreements`` (one per rank, e.g. :class:`cfdist.checkpoint.agreement.Frequency` objects
    over a shared store) when given, else rank 0's ``proposal()`` at once. Only rank ``writer``
    sees snapshot and persist times. ``trace``, when given, receives each step's duration. Raises AssertionError when the
    ranks disagree on a step.
    """
    agreed = [0] * len(policies)
    t, persist_end, inflight, snap_stall, base = 0.0, float("-inf"), None, 0.0, 0.0
    took_by_rank: list[list[int]] = [[] for _ in policies]
    for s in range(start, start + steps):
        for r, p in enumerate(policies):
            if not hasattr(p, "agreed"):
                continue
            k = agreements[r].at_step(s, p.proposal)[0] if agreements else policies[0].proposal()
            if k and k != agreed[r]:
                agreed[r] = k
                p.agreed(k, s)
        it, stall, snap_stall = Ti + snap_stall, snap_stall, 0.0
        decisions = [p.should_checkpoint(s) for p in policies]
        if len(set(decisions)) != 1:
            raise AssertionError(f"ranks disagree at step {s}: {decisions}")
        took, done = decisions[0], None
        if took:
            wait = max(0.0, persist_end - (t + it))
            it, stall = it + wait, stall + wait
            if inflight is not None:  # waited for it: harvested in this very step
                done, inflight = inflight[1], None
            persist_end = t + it + Tsnap + Ts(s)
            inflight = (persist_end, Tsnap + Ts(s))
            snap_stall = To
        t += it
        base += Ti
        if trace is not None:
            trace.append(it)
        if inflight is not None and inflight[0] <= t and done is None:
            done, inflight = inflight[1], None
        for r, p in enumerate(policies):
            me = r == writer
            p.observe(StepMeasurement(
                step=s, iter_s=it, stall_s=stall, update_s=Tw, checkpointed=took,
                snapshot_s=Tsnap if took and me else None,
                snapshot_device=p.mode if took and me else None,
                persist_s=done if me else None, persist_bytes=nbytes if done and me else None))
            if took:
                took_by_rank[r].append(s)
    return took_by_rank, t, base
