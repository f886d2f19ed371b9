"""What a busy process beside training costs its steps, at each CPU priority a preparation can take.

::

    python bench/bench_prepare_priority.py                 # 150 steps per case, 2 busy processes
    python bench/bench_prepare_priority.py --steps 300 --busy 4

Two rank-like processes run at Ray's worker niceness (15) the shape of a DDP step whose compute
happens elsewhere (a GPU, or the experiment's ``step_s`` sleep): 3 ms of CPU work, four message
round trips with the other rank (an all-reduce's), then 40 ms of sleep. Beside them, ``--busy``
processes burn CPU the way a warm spare's or a standby's imports do, in turn:

- ``none``: nothing beside the ranks (the step time to compare with);
- ``nice 15``: at the ranks' priority (what every Ray worker's start is, without
  :mod:`cfdist.cluster.niceness`);
- ``nice 19``: the lowest nice value (what a process gets from ``RAY_worker_niceness=19``);
- ``SCHED_IDLE``: the policy that runs only on a core no other task wants (what cfdist's
  preparations use where they may return from it).

Printed: each case's median and mean step, and the excess over ``none`` measured in the same
run. On the 2-core development machine (Linux 6.18, EEVDF): nice 15 added 4.3 ms per 44-ms step,
nice 19 2.3 ms, ``SCHED_IDLE`` nothing; even at 19 a busy task keeps the core until its slice
ends when a rank wakes. Results also go to ``bench/results/prepare_priority.json``.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import socket
import statistics
import sys
import time

RANK_NICE = 15


def _busy(case: str, stop) -> None:
    if case == "idle":
        os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
    else:
        os.setpriority(os.PRIO_PROCESS, 0, int(case))
    x = 0
    while not stop.is_set():
        for i in range(100_000):
            x += i


def _spin(seconds: float) -> None:
    t = time.perf_counter()
    while time.perf_counter() - t < seconds:
        pass


def _rank(sock, steps: int, out, lead: bool) -> None:
    os.setpriority(os.PRIO_PROCESS, 0, RANK_NICE)
    gaps, t = [], time.perf_counter()
    for _ in range(steps):
        _spin(0.003)
        for _ in range(4):
            if lead:
                sock.send(b"x")
                sock.recv(1)
            else:
                sock.recv(1)
                sock.send(b"x")
        time.sleep(0.040)
        now = time.perf_counter()
        gaps.append(now - t)
        t = now
    out.put(gaps)


def run_case(case: str, *, steps: int, busy: int) -> list[float]:
    """Step times of one rank (the first 5 dropped) with ``busy`` processes at ``case`` beside."""
    stop = mp.Event()
    hogs = [] if case == "none" else [mp.Process(target=_busy, args=(case, stop), daemon=True) for _ in range(busy)]
    for h in hogs:
        h.start()
    a, b = socket.socketpair()
    q = mp.Queue()
    ranks = [mp.Process(target=_rank, args=(a, steps, q, True)), mp.Process(target=_rank, args=(b, steps, q, False))]
    try:
        for r in ranks:
            r.start()
        gaps = q.get(timeout=steps * 1.0 + 60)
        q.get(timeout=60)
    finally:
        stop.set()
        for p in ranks + hogs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
    return gaps[5:]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=150, help="steps per case (default %(default)s)")
    ap.add_argument("--busy", type=int, default=os.cpu_count() or 2,
                    help="busy processes beside the ranks (default: one per CPU, %(default)s)")
    ap.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results",
                                                  "prepare_priority.json"))
    args = ap.parse_args(argv)
    if not sys.platform.startswith("linux"):
        print("per-thread nice values and SCHED_IDLE are Linux's: nothing to measure here")
        return 1
    names = {"none": "none", "15": "nice 15", "19": "nice 19", "idle": "SCHED_IDLE"}
    rows = {}
    for case in ("none", "15", "19", "idle"):
        g = run_case(case, steps=args.steps, busy=args.busy)
        rows[names[case]] = {"median_ms": statistics.median(g) * 1e3, "mean_ms": statistics.fmean(g) * 1e3}
    base = rows["none"]["median_ms"]
    print(f"{args.busy} busy process(es) beside 2 rank-like processes at nice {RANK_NICE}, {args.steps} steps each:")
    print(f"{'beside':12s} {'median ms':>10s} {'mean ms':>9s} {'excess ms':>10s}")
    for name, r in rows.items():
        r["excess_ms"] = r["median_ms"] - base
        print(f"{name:12s} {r['median_ms']:10.2f} {r['mean_ms']:9.2f} {r['excess_ms']:+10.2f}")
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump({"steps": args.steps, "busy": args.busy, "rank_nice": RANK_NICE, "cases": rows}, f, indent=2)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
