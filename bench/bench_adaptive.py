"""Static vs adaptive checkpoint interval when the disk gets 5x slower mid-run (CheckFreq Table 5).

    python bench/bench_adaptive.py                     # defaults sized for a 2-core CPU machine
    python bench/bench_adaptive.py --before 400 --after 800 --rate-mb 8 --slowdown 5
    python bench/bench_adaptive.py --repeats 0         # the virtual-time table only (instant)

First a virtual-time table (``cfdist.policy.sim``: the same policies on a modelled loop with this
run's Ti, persist times and a per-checkpoint cost ``--vTo``): exact, no noise. Then the real
runs:

One process, one small MLP (about 4 MiB of state), a short sleep per step for a steady
iteration time, the real ``cfdist.Checkpointer`` writing to a ``file://`` directory through
``cfdist.testing.throttle`` at ``--rate-mb`` MB/s, cut ``--slowdown`` times after
``--before`` steps. Modes, run one after the other on the same machine:

* ``none``      no checkpointing (the baseline time of every phase);
* ``adaptive``  ``cfdist.Auto(max_overhead=--p)``: profiles, chooses k, tunes it;
* ``static``    ``cfdist.Every(k)`` with the k Auto had chosen just before the slowdown (what a
                profiled but untuned frequency keeps using).

Printed: k before and after, and the overhead before the slowdown, over all steps after it, and
over the last half after it (once tuning settled), measured two ways:

* ``vs none``: wall time against the ``none`` run of the same round over the same steps;
* ``vs own steady state``: each run's time over the sum of a rolling median of its own step times
  (51 steps), immune to load drifting between runs, blind to a uniform slowdown.

The three modes run round-robin ``--repeats`` times (``static`` uses the k of the first
``adaptive`` run); the table shows medians over the rounds. On a shared machine the ``none``
row of "own steady state" is the noise floor.
"""

from __future__ import annotations

import argparse
import logging
import shutil
import statistics
import tempfile
import time

import torch

from cfdist.checkpoint import Checkpointer
from cfdist.policy import Auto, Every, PolicyContext, TunerConfig
from cfdist.policy.sim import simulate
from cfdist.storage import open_storage
from cfdist.testing import throttle

MB = 1 << 20


class _Never:
    k, mode = None, "cpu"

    def should_checkpoint(self, step, *, epoch_end=False):
        return False

    def observe(self, m):
        pass


def _run(policy, args) -> tuple[list[float], object]:
    """Step-end times (s, from the first step) and the checkpointer's stats."""
    root = tempfile.mkdtemp(prefix="cfdist-bench-adaptive-")
    try:
        disk = throttle(open_storage(f"file://{root}"), bytes_per_s=args.rate_mb * MB)
        torch.manual_seed(0)
        layers = []
        for _ in range(args.layers):
            layers += [torch.nn.Linear(args.hidden, args.hidden), torch.nn.Tanh()]
        model = torch.nn.Sequential(*layers)
        opt = torch.optim.SGD(model.parameters(), lr=1e-4)
        x = torch.randn(8, args.hidden)
        ckpt = Checkpointer({"model": model, "opt": opt}, storage=disk, policy=policy)
        ends, t0 = [], time.perf_counter()
        for i in range(args.before + args.after):
            if i == args.before:
                disk.set_bytes_per_s(args.rate_mb * MB / args.slowdown)
            model(x).square().mean().backward()
            ckpt.step(opt)
            opt.zero_grad()
            time.sleep(args.sleep)
            ends.append(time.perf_counter() - t0)
        ckpt.close()
        return ends, ckpt
    finally:
        shutil.rmtree(root, ignore_errors=True)


def _span(ends, a, b) -> float:
    return ends[b - 1] - (ends[a - 1] if a else 0.0)


def _self_overhead(ends, a, b, half=25) -> float:
    """Time of steps [a, b) over a rolling median of the run's own step times, minus 1."""
    dt = [e - (ends[i - 1] if i else 0.0) for i, e in enumerate(ends)]
    base = [statistics.median(dt[max(i - half, 0):i + half + 1]) for i in range(a, b)]
    return sum(dt[a:b]) / sum(base) - 1


def _virtual(args, segs) -> None:
    """The Table 5 shape on the modelled loop: deterministic, seconds to run."""
    b, n = args.before, args.before + args.after
    ti = args.sleep + 0.004
    ts = args.layers * (args.hidden ** 2 + args.hidden) * 4 / (args.rate_mb * MB)
    Ts = lambda step: ts if step <= b else ts * args.slowdown  # noqa: E731
    kw = dict(Ti=ti, Tw=0.001, Tsnap=0.001, To=args.vTo, Ts=Ts)

    def run(policy):
        trace: list[float] = []
        simulate([policy], n, trace=trace, **kw)
        return trace

    auto = Auto(max_overhead=args.p, profile_steps=10, tuning=TunerConfig(window_steps=args.window))
    auto.bind(PolicyContext())
    tr_a = run(auto)
    changes = auto.stats()["changes"]
    k_static = [c for c in changes if c["step"] <= b][-1]["k_new"]
    tr_s = run(Every(k_static))
    print(f"virtual time: Ti {ti * 1000:.0f} ms, {args.vTo * 1000:.0f} ms per checkpoint, persist "
          f"{ts:.2f} s -> {ts * args.slowdown:.2f} s at step {b}, budget p = {args.p * 100:g}%")
    print(f"{'mode':<10} {'k before':>8} {'after':>5} " + " ".join(f"{s:>17}" for s in segs))
    for name, tr, kb, ka in (("static", tr_s, k_static, k_static), ("adaptive", tr_a, k_static, auto.k)):
        ov = [sum(tr[a:z]) / ((z - a) * ti) - 1 for a, z in segs.values()]
        print(f"{name:<10} {kb:>8} {ka:>5} " + " ".join(f"{o * 100:>16.1f}%" for o in ov))
    print("adaptive k changes:", ", ".join(f"{c['k_new']}@{c['step']}" for c in changes), "\n")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--before", type=int, default=200, help="steps at full disk speed")
    ap.add_argument("--after", type=int, default=400, help="steps after the slowdown")
    ap.add_argument("--warmup", type=int, default=80, help="first steps left out of 'before' (profiling)")
    ap.add_argument("--repeats", type=int, default=1, help="rounds of none/adaptive/static")
    ap.add_argument("--rate-mb", type=float, default=8.0, help="disk bandwidth before the slowdown, MB/s")
    ap.add_argument("--slowdown", type=float, default=5.0, help="the disk gets this many times slower")
    ap.add_argument("--sleep", type=float, default=0.02, help="seconds of 'compute' per step")
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--p", type=float, default=0.035, help="Auto's overhead budget")
    ap.add_argument("--window", type=int, default=20, help="Auto's tuning window (steps)")
    ap.add_argument("--vTo", type=float, default=0.04,
                    help="virtual table: seconds each checkpoint costs the training loop")
    args = ap.parse_args()
    logging.basicConfig(level=logging.WARNING)

    b, n = args.before, args.before + args.after
    half = b + args.after // 2
    segs = {"before": (args.warmup, b), "after": (b, n), "after, last half": (half, n)}

    _virtual(args, segs)
    if args.repeats < 1:
        return
    runs: dict[str, list] = {"none": [], "static": [], "adaptive": []}
    k_static = first = None
    for rnd in range(args.repeats):
        runs["none"].append(_run(_Never(), args)[0])
        auto = Auto(max_overhead=args.p, profile_steps=10, tuning=TunerConfig(window_steps=args.window))
        ends_a, ck_a = _run(auto, args)
        runs["adaptive"].append(ends_a)
        if first is None:
            first = ck_a.stats
            k_static = [c for c in first["changes"] if c["step"] <= b][-1]["k_new"]
        runs["static"].append(_run(Every(k_static), args)[0])
        print(f"round {rnd + 1}/{args.repeats}: adaptive k {first['k'] if rnd == 0 else ck_a.stats['k']}",
              flush=True)

    base = runs["none"][0]
    ti = _span(base, args.warmup, b) / (b - args.warmup)
    prof = first["profile"]
    print(f"\nreal runs: state {prof['m'] / MB:.1f} MiB, Ti {ti * 1000:.1f} ms, disk {args.rate_mb:g} -> "
          f"{args.rate_mb / args.slowdown:g} MB/s at step {b} (persist {prof['Ts']:.2f} s -> "
          f"~{prof['Ts'] * args.slowdown:.2f} s), budget p = {args.p * 100:g}%, "
          f"median of {args.repeats} rounds\n")
    head = " ".join(f"{s:>17}" for s in segs)
    print(f"{'':<20} {'overhead vs none (wall)':^53} | {'overhead vs own steady state':^53}")
    print(f"{'mode':<10} {'k before':>4} {'after':>4} {head} | {head}")
    kinfo = {"none": ("-", "-"), "static": (k_static, k_static), "adaptive": (k_static, first["k"])}
    for name, ends_list in runs.items():
        wall = [statistics.median(_span(e, *segs[s]) / _span(nb, *segs[s]) - 1
                                  for e, nb in zip(ends_list, runs["none"])) for s in segs]
        own = [statistics.median(_self_overhead(e, *segs[s]) for e in ends_list) for s in segs]
        kb, ka = kinfo[name]
        print(f"{name:<10} {kb:>8} {ka:>5} " + " ".join(f"{o * 100:>16.1f}%" for o in wall)
              + " | " + " ".join(f"{o * 100:>16.1f}%" for o in own))
    changes = first["changes"]
    print("\nadaptive k changes (first round):")
    for c in changes:
        print(f"  step {c['step']:>5}: {c['reason']}")


if __name__ == "__main__":
    main()
