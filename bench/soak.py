"""Soak: a thousand SIGKILLs at random instants, with the invariants checked after every one.

::

    python bench/soak.py --kills 20 --minutes 0            # smoke test, about a minute
    nohup nice -n 10 python bench/soak.py --kills 1000 --minutes 32 > /tmp/soak.log 2>&1 &

Not a test (it runs for half an hour); CI runs the short kill loops in
``tests/integration/checkpoint/test_checkpoint_crash.py`` and ``tests/integration/cluster``.

Three lanes run at once, each on its own storage directory:

* **rank** (the bulk): training processes (a small MLP under Adam, a ``ResumableLoader`` over
  48 indexed samples, ``Every(2)``, ``keep=2``, the thread persist backend) forked from a warm
  fork server (``tests/integration/checkpoint/ckpt_child.py``), each SIGKILLed at a random
  instant: ``rank_persist`` waits until a write is in flight (a staging directory exists) and
  kills within 0-20 ms; ``rank_step`` kills after a uniform 0-0.4 s (mid-step, mid-snapshot,
  mid-persist or mid-retention: classified by whether a write was in flight at the kill);
* **writer**: a training process with ``backend="process"``; its spawned writer process is
  SIGKILLed while it writes (``writer``); every ``--writer-rank-every`` writer kills the
  training process itself is killed too (``rank_process_backend``) and restarted;
* **node actor**: ``cfdist.fit`` on a local one-node Ray (loopback); the node's
  ``NodeCheckpointer`` process is SIGKILLed every 3-10 s (``node_actor``); the run continues
  from the newest commit on the node's disk and must finish.

After every kill: **lost** - a step committed before the kill that is gone afterwards with no
newer commit, or a restart that restores less than the newest commit; **corrupt** - the newest
commit fails ``cfdist.load`` (checksums verified) or a restart warns and falls back;
**exactly-once** - replaying what every process consumed (sample ids per step; a restart
supersedes the steps after its restored step), a sample used twice in an epoch or missing
from a finished epoch. RSS of each long-lived process (this driver, the fork servers, the Ray
GCS/raylet, the writer lane's training process, the surviving node actors) is sampled every
5 s. Results: ``bench/results/soak-<time>.json`` and ``.md``; the summary is also printed.
"""

from __future__ import annotations

import argparse
import collections
import functools
import json
import logging
import os
import random
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "bench" / "results"
sys.path[:0] = [str(REPO), str(REPO / "tests" / "integration" / "checkpoint"),
                str(REPO / "tests" / "integration" / "cluster")]

import cfdist  # noqa: E402
from cfdist.checkpoint.discovery import committed_steps  # noqa: E402
from cfdist.checkpoint.format import CheckpointError  # noqa: E402
from cfdist.storage import open_storage  # noqa: E402

from conftest import Children  # noqa: E402 - the fork server client of the checkpoint tests
from test_checkpoint_crash import _writer_processes, in_flight  # noqa: E402
import cluster_loops  # noqa: E402

N_SAMPLES = cluster_loops.N_SAMPLES
K = 2


# ---- the checks ---------------------------------------------------------------------------------

class Counters:
    def __init__(self):
        self.lock = threading.Lock()
        self.kills: collections.Counter = collections.Counter()
        self.lost = 0
        self.corrupt = 0
        self.exactly_once = 0
        self.stalls = 0
        """No commit within 180 s after a writer kill: slow, not lost (counted apart)."""
        self.restarts_checked = 0
        self.leftovers = 0
        self.problems: list[str] = []

    def bad(self, what: str, msg: str) -> None:
        with self.lock:
            setattr(self, what, getattr(self, what) + 1)
            self.problems.append(f"{what}: {msg}")
        print(f"!! {what}: {msg}", flush=True)

    def kill(self, kind: str) -> None:
        with self.lock:
            self.kills[kind] += 1

    @property
    def total(self) -> int:
        return sum(self.kills.values())


class Timeline:
    """What the run consumed, as the surviving history sees it (incremental exactly-once).

    Each attempt's log starts with the step it restored; a restart restoring step r supersedes
    every step after r that earlier attempts ran. Steps up to the newest restored step are
    final: they are checked once, as they become final, for samples used twice in an epoch and
    (for finished epochs) samples never used.
    """

    def __init__(self, n_samples: int):
        self.n = n_samples
        self.steps: dict[int, list[dict]] = {}
        self.final_upto = 0
        self.epochs: dict[int, collections.Counter] = {}

    @staticmethod
    def read(path: Path) -> tuple[int, list[dict]]:
        recs = []
        for line in path.read_text().splitlines():
            try:
                recs.append(json.loads(line))
            except ValueError:   # a line cut by SIGKILL: that step's batch was never checkpointed
                break
        return recs[0]["restored"], recs[1:]

    def add_attempt(self, restored: int, records: list[dict]) -> None:
        for s in [s for s in self.steps if s > restored]:
            del self.steps[s]
        for r in records:
            self.steps.setdefault(r["step"], []).append(r)

    def finalize(self, upto: int, counters: Counters, where: str) -> None:
        """Steps ``<= upto`` can no longer be superseded (a restart restored ``upto``): check them."""
        for s in range(self.final_upto + 1, upto + 1):
            recs = self.steps.get(s)
            if not recs:
                counters.bad("exactly_once", f"{where}: step {s} has no record of what it consumed")
                continue
            for r in recs:
                if not r.get("pad"):
                    c = self.epochs.setdefault(r["epoch"], collections.Counter())
                    for i in r["ids"]:
                        c[i] += 1
                        if c[i] == 2:
                            counters.bad("exactly_once", f"{where}: sample {i} used twice in epoch {r['epoch']}")
        self.final_upto = max(self.final_upto, upto)
        done = [e for e in self.epochs if e < max(self.epochs, default=0)]
        for e in done:
            missing = set(range(self.n)) - set(self.epochs[e])
            if missing:
                counters.bad("exactly_once", f"{where}: epoch {e} never used samples {sorted(missing)[:10]}")
            del self.epochs[e]


def check_after_kill(st, url: str, before: list[int], counters: Counters, where: str) -> int | None:
    """Committed steps lost by the kill, and the newest commit's verified load. Returns it."""
    after = committed_steps(st)
    newest = after[-1] if after else None
    for s in before:
        if s not in after and not any(t > s for t in after):
            counters.bad("lost", f"{where}: step {s} was committed before the kill and is gone ({after})")
    if newest is not None:
        try:
            cfdist.load(url, step=newest)
        except CheckpointError as e:
            counters.bad("corrupt", f"{where}: newest commit {newest} does not load: {e}")
    return newest


def check_restart(rep: dict, expected: int | None, counters: Counters, where: str) -> None:
    with counters.lock:
        counters.restarts_checked += 1
    if rep["restored"] != expected:
        counters.bad("lost", f"{where}: restored {rep['restored']}, newest commit was {expected}")
    if rep["warnings"]:
        counters.bad("corrupt", f"{where}: restore warned: {rep['warnings']}")
    if rep["leftovers_after_start"]:
        with counters.lock:
            counters.leftovers += 1


def kill_rank(children, pid: int, kind: str, st, url: str, counters: Counters, timeline: Timeline, log: Path,
              where: str) -> int | None:
    """SIGKILL training process ``pid``, check what it left, add what it consumed to the timeline;
    returns the newest commit (what the next process must restore)."""
    before = committed_steps(st)
    if children.kill(pid) != -9:
        counters.bad("lost", f"{where} ended by itself")
    counters.kill(kind)
    expected = check_after_kill(st, url, before, counters, where)
    if log.exists():
        timeline.add_attempt(*Timeline.read(log))
    return expected


# ---- lanes --------------------------------------------------------------------------------------

def _lane(root: Path, pids: dict, label: str):
    """A lane's output dir, storage URL and Storage, timeline, and its own fork server."""
    out, url = root / "out", f"file://{root / 'ckpt'}"
    out.mkdir(parents=True)
    children = Children(root / "server.log")
    pids[f"fork server ({label})"] = children.proc.pid
    return out, url, open_storage(url), Timeline(N_SAMPLES), children


def rank_lane(stop: threading.Event, counters: Counters, root: Path, seed: int, hidden: int, pids: dict,
              label: str) -> None:
    """Training processes forked from a warm server, each SIGKILLed at a random instant."""
    rng = random.Random(seed)
    out, url, st, timeline, children = _lane(root, pids, label)
    expected, run = None, 0
    try:
        while not stop.is_set():
            k = rng.choice((2, 5))   # with k=2 a write is nearly always in flight; k=5 leaves gaps
            pid = children.start("crash", run=run, url=url, k=k, keep=2, out=str(out), hidden=hidden, data=N_SAMPLES)
            rep = children.report(out / f"restore-{run}.json", pid)
            check_restart(rep, expected, counters, f"rank run {run}")
            timeline.finalize(rep["restored"] or 0, counters, f"rank run {run}")
            if rng.random() < 0.4:
                kind = "rank_persist"
                deadline = time.monotonic() + 10
                while not in_flight(st) and time.monotonic() < deadline:
                    time.sleep(0.001)
                time.sleep(rng.uniform(0.0, 0.02))
            else:
                time.sleep(rng.uniform(0.0, 0.4))
                kind = "rank_persist" if in_flight(st) else "rank_step"
            expected = kill_rank(children, pid, kind, st, url, counters, timeline, out / f"a{run}-r0.jsonl",
                                 f"rank run {run}")
            run += 1
    finally:
        children.close()


def writer_lane(stop: threading.Event, counters: Counters, root: Path, seed: int, hidden: int,
                rank_every: int, pids: dict) -> None:
    """A process-backend training process whose writer process is SIGKILLed mid-write."""
    rng = random.Random(seed)
    out, url, st, timeline, children = _lane(root, pids, "writer lane")
    expected, run = None, 0
    try:
        while not stop.is_set():
            pid = children.start("crash", run=run, url=url, k=K, keep=2, out=str(out), hidden=hidden,
                                 data=N_SAMPLES, backend="process")
            pids["training process (writer lane)"] = pid
            rep = children.report(out / f"restore-{run}.json", pid, timeout=300)
            check_restart(rep, expected, counters, f"writer run {run}")
            timeline.finalize(rep["restored"] or 0, counters, f"writer run {run}")
            for _ in range(rank_every):
                if stop.is_set():
                    break
                deadline = time.monotonic() + 120
                while not (in_flight(st) and _writer_processes(pid)) and time.monotonic() < deadline:
                    time.sleep(0.001)
                time.sleep(rng.uniform(0.0, 0.005))
                writers = _writer_processes(pid)
                if not writers:
                    counters.bad("lost", f"writer run {run}: no writer process to kill within 120 s")
                    break
                before = committed_steps(st)
                for w in writers:
                    os.kill(w, signal.SIGKILL)
                counters.kill("writer")
                check_after_kill(st, url, before, counters, f"writer run {run}")
                deadline = time.monotonic() + 180   # a new writer process must commit a newer step
                while (committed_steps(st) or [0])[-1] <= (before or [0])[-1]:
                    if time.monotonic() > deadline or children.poll(pid) is not None:
                        counters.bad("stalls", f"writer run {run}: nothing committed after the writer kill "
                                             f"(training process {'died' if children.poll(pid) is not None else 'alive'})")
                        break
                    time.sleep(0.01)
            expected = kill_rank(children, pid, "rank_process_backend", st, url, counters, timeline,
                                 out / f"a{run}-r0.jsonl", f"writer run {run}")
            run += 1
    finally:
        children.close()


def _descendants(pid: int) -> list[int]:
    kids: dict[int, list[int]] = {}
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                with open(f"/proc/{d}/stat") as f:
                    kids.setdefault(int(f.read().rsplit(")", 1)[1].split()[1]), []).append(int(d))
            except (OSError, ValueError, IndexError):
                pass
    out, todo = [], [pid]
    while todo:
        for c in kids.get(todo.pop(), []):
            out.append(c)
            todo.append(c)
    return out


def _titled(title: bytes) -> list[int]:
    out = []
    for pid in _descendants(os.getpid()):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                if title in f.read():
                    out.append(pid)
        except OSError:
            pass
    return out


def node_actor_lane(stop: threading.Event, counters: Counters, root: Path, seed: int, pids: dict) -> None:
    """``cfdist.fit`` on a local one-node Ray; the node actor is SIGKILLed every few seconds."""
    import ray

    from cfdist.api import fit

    rng = random.Random(seed)
    stop.wait(60)   # let the other lanes' fork servers import torch first: a loaded machine times Ray out
    for tries in range(1, 6):
        try:
            ray.init(address="local", include_dashboard=False, _node_ip_address="127.0.0.1", num_cpus=2,
                     logging_level=logging.ERROR, log_to_driver=False)   # workers inherit PYTHONPATH
            break
        except Exception as e:  # noqa: BLE001 - Ray's start-up timeout on an overloaded machine
            print(f"!! node actor lane: Ray did not start (try {tries}): {e}", flush=True)
            ray.shutdown()
            if tries == 5 or stop.wait(30):
                raise
    ray.cloudpickle.register_pickle_by_value(cluster_loops)
    pids["ray gcs_server"] = next(iter(_titled(b"gcs_server")), None)
    pids["ray raylet"] = next(iter(_titled(b"raylet")), None)
    run = 0
    try:
        while not stop.is_set():
            name = f"soak{run}"
            out = root / name
            out.mkdir(parents=True)
            kills: list[tuple[float, int]] = []   # (time, newest local commit right after the kill)
            local = root / "disk"
            done = threading.Event()

            def killer():
                last = -1
                while not done.is_set() and not stop.is_set():
                    if done.wait(rng.uniform(3.0, 10.0)) or stop.is_set():
                        return
                    # Only once training resumed since the previous kill (the group restarted and
                    # committed a step): on a loaded machine kills must not outpace recovery.
                    newest = (committed_steps(st) or [0])[-1] if (st := _local_storage(local, name)) else 0
                    victims = _titled(b"NodeCheckpointer")
                    if not victims or newest <= last:
                        continue
                    last = newest
                    for v in victims:
                        try:
                            os.kill(v, signal.SIGKILL)
                        except ProcessLookupError:
                            pass
                    counters.kill("node_actor")
                    st = _local_storage(local, name)
                    newest = (committed_steps(st) or [0])[-1] if st else 0
                    kills.append((time.time(), newest))
                    if st is not None and newest:
                        try:
                            cfdist.load(st.url, step=newest)
                        except CheckpointError as e:
                            counters.bad("corrupt", f"fit {name}: newest local commit {newest} does not load: {e}")

            t = threading.Thread(target=killer, daemon=True)
            t.start()
            steps = 300
            loop = functools.partial(cluster_loops.train_loop, steps=steps, out_dir=str(out), every=4,
                                     step_sleep_s=0.02)
            try:
                result = fit(loop, num_nodes=1, workers_per_node=1, storage=f"file://{local}/{{node}}",
                             policy=cfdist.Every(4), run_name=name, max_failures=10_000,
                             output=cfdist.OutputOptions(progress=False, event_log=str(out / "events.jsonl")))
                if result.final_step != steps:
                    counters.bad("lost", f"fit {name} ended at step {result.final_step}, wanted {steps}")
            except Exception as e:  # noqa: BLE001 - counted: the run must complete
                counters.bad("lost", f"fit {name} failed: {type(e).__name__}: {e}")
            finally:
                done.set()
                t.join()
            try:
                cluster_loops.check_exactly_once(str(out), steps)
            except AssertionError as e:
                counters.bad("exactly_once", f"fit {name}: {e}")
            except Exception as e:  # noqa: BLE001 - e.g. no log at all: the run never trained
                counters.bad("exactly_once", f"fit {name}: cannot replay its logs: {type(e).__name__}: {e}")
            restored = [json.loads(line) for line in open(out / "events.jsonl") if '"restored"' in line]
            restored = [r for r in restored if r.get("event") == "restored"]
            for (tk, newest), r in zip(kills, restored):
                with counters.lock:
                    counters.restarts_checked += 1
                if r["step"] < newest:
                    counters.bad("lost", f"fit {name}: restored {r['step']} after a node actor kill, newest "
                                         f"local commit was {newest}")
            shutil.rmtree(out, ignore_errors=True)
            run += 1
    finally:
        ray.shutdown()


def _local_storage(local: Path, run_name: str):
    dirs = [d for d in local.glob(f"*/{run_name}") if d.is_dir()] if local.exists() else []
    return open_storage(f"file://{dirs[0]}") if dirs else None


# ---- memory -------------------------------------------------------------------------------------

def rss_mb(pid: int) -> float | None:
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) / 1024
    except OSError:
        return None
    return None


def sample_rss(stop: threading.Event, pids: dict, series: dict, t0: float, every: float = 5.0) -> None:
    while not stop.wait(every):
        now = round(time.monotonic() - t0, 1)
        watch = dict(pids)
        watch["soak driver"] = os.getpid()
        for i, p in enumerate(sorted(_titled(b"NodeCheckpointer"))):
            watch[f"node actor #{i}"] = p
        for role, pid in watch.items():
            if pid:
                mb = rss_mb(pid)
                if mb is not None:
                    series.setdefault(role, []).append((now, pid, round(mb, 1)))


def rss_trend(samples: list) -> dict:
    """Per process (pid) of a role: first, last, max RSS and the slope (MB/min) of a least-squares
    line, after a 2-minute warm-up when the process lived over 4 minutes; the role's figures come
    from its longest-lived pid."""
    by_pid: dict[int, list] = {}
    for t, pid, mb in samples:
        by_pid.setdefault(pid, []).append((t, mb))
    pid, pts = max(by_pid.items(), key=lambda kv: kv[1][-1][0] - kv[1][0][0])
    if pts[-1][0] - pts[0][0] > 240:   # leave out the first 2 minutes: imports, first allocations
        pts = [p for p in pts if p[0] - pts[0][0] >= 120]
    ts, ms = [p[0] for p in pts], [p[1] for p in pts]
    slope = 0.0
    if len(pts) > 2 and ts[-1] > ts[0]:
        mt, mm = statistics.fmean(ts), statistics.fmean(ms)
        slope = sum((t - mt) * (m - mm) for t, m in pts) / sum((t - mt) ** 2 for t in ts) * 60
    q = max(1, len(ms) // 10)
    growth = statistics.median(ms[-q:]) - statistics.median(ms[:q])
    return {"pid": pid, "pids_seen": len(by_pid), "samples": len(pts), "span_min": round((ts[-1] - ts[0]) / 60, 1),
            "first_mb": ms[0], "last_mb": ms[-1], "max_mb": max(ms), "slope_mb_per_min": round(slope, 3),
            "growth_mb": round(growth, 1)}


# ---- main ---------------------------------------------------------------------------------------

def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--kills", type=int, default=1000, help="stop once this many kills happened ...")
    ap.add_argument("--minutes", type=float, default=30.0, help="... and at least this many minutes passed")
    ap.add_argument("--max-minutes", type=float, default=45.0, help="stop here whatever the count")
    ap.add_argument("--hidden", type=int, default=256, help="MLP width (256: about 3 MB per checkpoint)")
    ap.add_argument("--rank-lanes", type=int, default=2, help="rank lanes running side by side")
    ap.add_argument("--writer-rank-every", type=int, default=12,
                    help="writer kills per writer-lane training process before that process is killed too")
    ap.add_argument("--lanes", default="rank,writer,node_actor")
    ap.add_argument("--seed", type=int, default=20261130)
    ap.add_argument("--dir", default=None, help="working directory (default: a fresh one under /tmp, removed)")
    a = ap.parse_args()

    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    os.environ["PYTHONPATH"] = os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    work = Path(a.dir or tempfile.mkdtemp(prefix="cfdist-soak-"))
    counters, stop, pids, series = Counters(), threading.Event(), {}, {}
    t0 = time.monotonic()
    lanes = {
        **{f"rank{i}": functools.partial(rank_lane, stop, counters, work / f"rank{i}", a.seed + 10 + i, a.hidden,
                                         pids, f"rank lane {i}") for i in range(a.rank_lanes)},
        "writer": lambda: writer_lane(stop, counters, work / "writer", a.seed + 1, a.hidden,
                                      a.writer_rank_every, pids),
        "node_actor": lambda: node_actor_lane(stop, counters, work / "node_actor", a.seed + 2, pids),
    }
    errors = {}

    def guarded(name):
        try:
            lanes[name]()
        except BaseException as e:  # noqa: BLE001 - reported in the summary; the other lanes go on
            if stop.is_set() and isinstance(e, (TimeoutError, AssertionError, subprocess.TimeoutExpired)):
                print(f"lane {name}: cut short at the end ({type(e).__name__})", flush=True)
                return
            errors[name] = f"{type(e).__name__}: {e}\n{traceback.format_exc()[-2000:]}"
            print(f"!! lane {name} stopped: {errors[name]}", flush=True)

    names = [n for n in lanes if n.rstrip("0123456789") in a.lanes.split(",")]
    threads = [threading.Thread(target=guarded, args=(n,), name=n, daemon=True) for n in names]
    sampler = threading.Thread(target=sample_rss, args=(stop, pids, series, t0), daemon=True)
    sampler.start()
    for t in threads:
        t.start()
    last_print = 0.0
    try:
        while True:
            time.sleep(1)
            el = (time.monotonic() - t0) / 60
            if (counters.total >= a.kills and el >= a.minutes) or el >= a.max_minutes or not any(
                    t.is_alive() for t in threads):
                break
            if time.monotonic() - last_print > 60:
                last_print = time.monotonic()
                print(f"[{el:5.1f} min] kills {dict(counters.kills)} total {counters.total}; lost {counters.lost} "
                      f"corrupt {counters.corrupt} exactly-once {counters.exactly_once}", flush=True)
    finally:
        stop.set()
        for t in threads:
            t.join(timeout=600)
    duration = (time.monotonic() - t0) / 60
    summary = {
        "duration_min": round(duration, 2), "kills_total": counters.total, "kills": dict(counters.kills),
        "lost_commits": counters.lost, "corrupt_loads": counters.corrupt,
        "exactly_once_violations": counters.exactly_once, "stalls": counters.stalls,
        "restarts_checked": counters.restarts_checked,
        "starts_with_leftovers_swept": counters.leftovers, "problems": counters.problems[:50],
        "lane_errors": errors, "rss": {role: rss_trend(s) for role, s in series.items() if s},
        "args": vars(a), "cpus": os.cpu_count(), "load_avg": os.getloadavg(),
    }
    RESULTS.mkdir(parents=True, exist_ok=True)
    stamp = time.strftime("%Y%m%d-%H%M%S")
    (RESULTS / f"soak-{stamp}.json").write_text(json.dumps(summary, indent=2))
    md = [f"# Soak {stamp}", "",
          f"{summary['kills_total']} kills in {summary['duration_min']} min: "
          + ", ".join(f"{k} {v}" for k, v in sorted(summary["kills"].items())), "",
          "| check | count |", "|---|---|",
          f"| committed checkpoints lost | {summary['lost_commits']} |",
          f"| corrupt loads | {summary['corrupt_loads']} |",
          f"| exactly-once violations | {summary['exactly_once_violations']} |",
          f"| stalls (no commit 180 s after a writer kill) | {summary['stalls']} |",
          f"| restarts checked | {summary['restarts_checked']} |", "",
          "| process | samples | span min | first MB | last MB | max MB | slope MB/min | growth MB |",
          "|---|---|---|---|---|---|---|---|"]
    for role, r in sorted(summary["rss"].items()):
        md.append(f"| {role} | {r['samples']} | {r['span_min']} | {r['first_mb']} | {r['last_mb']} | {r['max_mb']} "
                  f"| {r['slope_mb_per_min']} | {r['growth_mb']} |")
    if summary["problems"] or errors:
        md += ["", "Problems:", *[f"- {p}" for p in summary["problems"]], *[f"- lane {k}: {v[:300]}" for k, v in errors.items()]]
    (RESULTS / f"soak-{stamp}.md").write_text("\n".join(md) + "\n")
    print("\n".join(md), flush=True)
    print(json.dumps({k: v for k, v in summary.items() if k not in ("rss", "problems", "lane_errors")}), flush=True)
    if not a.dir:
        shutil.rmtree(work, ignore_errors=True)
    bad = counters.lost + counters.corrupt + counters.exactly_once + len(errors)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
