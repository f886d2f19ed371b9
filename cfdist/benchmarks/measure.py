"""The benchmark's arithmetic, pure: outside stall, overhead statistics, noise, CPU accounting.

Every method is measured the same way, from the outside: the training loop times each
iteration's *optimizer phase* (the optimizer step plus whatever checkpoint work and waits the
method puts there) around the call. A step that takes longer than the run's median phase time
stalled training by the excess; the stall per checkpoint is the sum of those excesses over the
run divided by the checkpoints taken::

    stall = sum(max(0, phase_i - median(phase))) / checkpoints

In data parallelism a rank that stalls holds back every rank at the next all-reduce, so the
phase time of an iteration is the slowest rank's (:func:`merge_ranks`). The same figure for the
no-checkpoint run, divided by the same number of checkpoints, is the measurement's noise floor.
"""

from __future__ import annotations

import os
import resource
import statistics
import time


def merge_ranks(per_rank: list[list[float]]) -> list[float]:
    """Per-iteration phase time of the job: the slowest rank's, iteration by iteration."""
    if not per_rank:
        return []
    n = {len(p) for p in per_rank}
    if len(n) != 1:
        raise ValueError(f"ranks timed different numbers of iterations: {sorted(n)}")
    return [max(xs) for xs in zip(*per_rank)]


def outside_stall(phases: list[float], checkpoints: int) -> float:
    """Seconds of stall per checkpoint: phases' excess over their median, summed, / checkpoints."""
    if checkpoints <= 0:
        raise ValueError(f"checkpoints must be >= 1 to divide the stall by, got {checkpoints}")
    if not phases:
        raise ValueError("no phase times: the run timed no iteration")
    med = statistics.median(phases)
    return sum(max(0.0, p - med) for p in phases) / checkpoints


def spread(values: list[float]) -> dict:
    """Median with min and max (and the count): how a figure is printed, never a best-of."""
    if not values:
        return {"median": None, "min": None, "max": None, "n": 0}
    return {"median": statistics.median(values), "min": min(values), "max": max(values), "n": len(values)}


def overhead(walls: list[float], base_walls: list[float]) -> dict:
    """Wall overhead vs the baseline: each run against the baseline's median, as a spread,
    and the baseline's own noise: (max - min) / median of its runs."""
    if not base_walls:
        raise ValueError("no baseline (no-checkpoint) runs to compare against")
    base = statistics.median(base_walls)
    out = spread([w / base - 1.0 for w in walls])
    # one baseline run has no spread to show: the noise is unknown, not zero
    out["noise"] = (max(base_walls) - min(base_walls)) / base if len(base_walls) > 1 else None
    return out


def is_noisy(overhead_spread: dict) -> bool:
    """A figure is noise-bound when the baseline's own spread is as large as the figure."""
    med, noise = overhead_spread.get("median"), overhead_spread.get("noise")
    return med is not None and noise is not None and noise >= abs(med)


def ratio(a: float | None, b: float | None) -> float | None:
    if a is None or b is None or b == 0:
        return None
    return a / b


# ---- CPU accounting (thin shell over /proc and getrusage) ------------------------------------------

_TICK = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def _proc_cpu(pid: int) -> float | None:
    """utime + stime + the reaped children's, of a live process (None if it is gone)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None
    return sum(int(x) for x in fields[11:15]) / _TICK


def _descendants(pid: int) -> list[int]:
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        try:
            tasks = os.listdir(f"/proc/{p}/task")
        except OSError:
            continue
        for t in tasks:
            try:
                with open(f"/proc/{p}/task/{t}/children") as f:
                    kids = [int(c) for c in f.read().split()]
            except OSError:
                continue
            out += kids
            todo += kids
    return out


def cpu_reading() -> dict:
    """CPU seconds of this process (all threads), its reaped children, and each live descendant
    (writer processes, DCP's process executor). Difference two readings with :func:`cpu_delta`."""
    me = resource.getrusage(resource.RUSAGE_SELF)
    ch = resource.getrusage(resource.RUSAGE_CHILDREN)
    live = {}
    if os.path.isdir("/proc"):
        for d in _descendants(os.getpid()):
            c = _proc_cpu(d)
            if c is not None:
                live[d] = c
    return {"self": me.ru_utime + me.ru_stime, "reaped": ch.ru_utime + ch.ru_stime, "live": live,
            "t": time.perf_counter()}


def cpu_delta(start: dict, end: dict) -> float:
    """CPU seconds spent between two :func:`cpu_reading` calls by the process and its descendants."""
    d = (end["self"] - start["self"]) + (end["reaped"] - start["reaped"])
    for pid, c in end["live"].items():
        d += c - start["live"].get(pid, 0.0)
    for pid, c in start["live"].items():
        if pid not in end["live"]:   # reaped since: its whole life is now in "reaped"
            d -= c
    return d
