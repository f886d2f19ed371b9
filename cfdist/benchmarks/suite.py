"""The benchmark suite: which blocks run in which mode, the machine it ran on, ``results.json``.

Modes (``cfdist bench --mode``):

* ``quick``: every method once on a ~4 MB MLP, tiny references (a smoke test, well under a minute);
* ``default``: the ~200 MB MLP with every method (3 interleaved rounds), the CNN, GPT and DLRM
  workloads (~50 MB) against every peer (2 rounds), the MLP and DLRM (~50 MB) under host-memory
  budgets of 100, 50, 25 and 10 % of the state (2 rounds), growth with state size (10, 50, 200 MB), ranks
  (1, 2, 4) and roots (1, 2, 4), ``Auto`` at a 3.5% budget (the 200 MB MLP; and a 50 MB one, also
  under ``host_memory=0.25``), disk/memory references and cold restores; about 10-15 minutes on an idle 2-core machine;
* ``full``: the same with 5 rounds everywhere.

``--big`` adds 1 GB and 2 GB MLP states (needs ~6x the state in RAM per rank pair); ``--recovery``
adds recovery time per tier from ``bench/bench_recovery.py`` (starts a local Ray cluster).
"""

from __future__ import annotations

import json
import os
import platform
import shlex
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass

from cfdist.benchmarks.methods import BUDGETS, CORE
from cfdist.benchmarks.runner import Block, run_block

SCHEMA = 1
MODES = ("quick", "default", "full")
WORKLOAD_METHODS = ["none", "torch.save", "dcp.save", "dcp.async", "dcp.async-await", "dcp.no_dist", "cfdist"]
GROWTH_METHODS = ["none", "dcp.async", "cfdist"]
BUDGET_METHODS = ["none", "cfdist"] + [f"cfdist.budget{p}" for p in BUDGETS]


@dataclass(frozen=True, kw_only=True)
class SuiteConfig:
    """What ``cfdist bench`` runs."""

    mode: str = "default"
    """``quick``, ``default`` or ``full`` (see the module docstring)."""
    big: bool = False
    """Add 1 GB and 2 GB MLP states to the size growth."""
    recovery: bool = False
    """Also measure recovery per tier (local Ray cluster, a few minutes)."""
    dir: str | None = None
    """Directory (a filesystem path) the checkpoints are written under; default: the temp dir."""
    k: int = 5
    """Checkpoint interval of the fixed-interval runs."""
    max_minutes: float | None = None
    """Start no further block after this many minutes (the ones skipped are listed in the
    results and the report); None: run every block."""
    only: tuple[str, ...] | None = None
    """Run only the blocks of these names (``main``, ``workload``, ``budget``, ``auto``,
    ``size``, ``ranks``); None: all of the mode's."""

    def __post_init__(self):
        if self.mode not in MODES:
            raise ValueError(f"mode must be one of {', '.join(MODES)}, got {self.mode!r}")
        if not isinstance(self.k, int) or self.k < 1:
            raise ValueError(f"k must be an int >= 1 (steps between checkpoints), got {self.k!r}")
        if self.only is not None:
            names = {b.name for mode in MODES for b in plan(SuiteConfig(mode=mode, big=True))}
            unknown = sorted(set(self.only) - names)
            if unknown or not self.only:
                raise ValueError(f"only= names blocks: {', '.join(sorted(names))}; got {list(self.only)!r}")
        if self.max_minutes is not None and not self.max_minutes > 0:
            raise ValueError(f"max_minutes must be > 0 (or None for no limit), got {self.max_minutes!r}")


def plan(cfg: SuiteConfig) -> list[Block]:
    """The blocks a configuration runs, in order. Pure."""
    blocks = _plan(cfg)
    return blocks if cfg.only is None else [b for b in blocks if b.name in cfg.only]


def _plan(cfg: SuiteConfig) -> list[Block]:
    k = cfg.k
    if cfg.mode == "quick":
        return [Block(name="main", workload="mlp", state_mb=4, world=2, methods=list(CORE), k=2, warmup=2,
                      steps=4, repeats=1),
                Block(name="budget", workload="mlp", state_mb=4, world=2, methods=["none", "cfdist", "cfdist.budget25"],
                      k=2, warmup=2, steps=4, repeats=1)]
    reps = 5 if cfg.mode == "full" else 3
    wreps = 5 if cfg.mode == "full" else 2
    greps = 3 if cfg.mode == "full" else 1
    win = dict(k=k, warmup=k, steps=(3 if cfg.mode == "full" else 2) * k)
    blocks = [Block(name="main", workload="mlp", state_mb=200, world=2, methods=list(CORE), repeats=reps, **win)]
    for w in ("cnn", "gpt", "dlrm"):
        blocks.append(Block(name="workload", workload=w, state_mb=50, world=2, methods=list(WORKLOAD_METHODS),
                            repeats=wreps, **win))
    for w in ("mlp", "dlrm"):   # the host-memory budget's trade-off: stall and overhead against the budget
        blocks.append(Block(name="budget", workload=w, state_mb=50, world=2, methods=list(BUDGET_METHODS),
                            repeats=wreps, **win))
    blocks.append(Block(name="auto", workload="mlp", state_mb=200, world=2, methods=["none", "cfdist.auto"],
                        k=k, warmup=12, steps=8 * k, repeats=greps + 1))
    # Auto under a host-memory budget: it profiles the streamed snapshot (chunk waits included), so
    # its k is longer; a 50 MB state keeps that k inside the window
    blocks.append(Block(name="auto", workload="mlp", state_mb=50, world=2,
                        methods=["none", "cfdist.auto", "cfdist.auto.budget25"],
                        k=k, warmup=12, steps=16 * k, repeats=greps + 1))
    for mb in (10, 50) + ((1000, 2000) if cfg.big else ()):
        blocks.append(Block(name="size", workload="mlp", state_mb=mb, world=2, methods=list(GROWTH_METHODS),
                            repeats=greps, **win))
    for world in (1, 4):
        blocks.append(Block(name="ranks", workload="mlp", state_mb=50, world=world, methods=list(GROWTH_METHODS),
                            repeats=greps, **win))
    return blocks


def machine() -> dict:
    """Where it ran: cores, memory, disk and filesystem of the checkpoint directory, versions."""
    import torch

    info = {"python": platform.python_version(), "torch": torch.__version__, "platform": platform.platform(),
            "cpu_count": os.cpu_count(), "cpu_model": None, "memory_gb": None, "filesystem": None,
            "load_avg_start": os.getloadavg() if hasattr(os, "getloadavg") else None}
    try:
        import ray

        info["ray"] = ray.__version__
    except ImportError:
        info["ray"] = None
    try:
        with open("/proc/cpuinfo") as f:
            info["cpu_model"] = next((ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")), None)
        with open("/proc/meminfo") as f:
            info["memory_gb"] = round(int(f.readline().split()[1]) / 2 ** 20, 1)
    except OSError:
        pass
    info["autogroup"] = sched_autogroup()
    return info


def sched_autogroup() -> bool | None:
    """Whether Linux groups the CPU time by session (``kernel.sched_autogroup_enabled``): then a
    ``nice`` given to other work started from another terminal or ``setsid`` does not lower its
    share against the benchmark, and "niced work beside it" competes as an equal. None where
    unknown."""
    try:
        with open("/proc/sys/kernel/sched_autogroup_enabled") as f:
            return f.read().strip() == "1"
    except OSError:
        return None


def filesystem(path: str) -> dict:
    """Filesystem type, device and size of ``path`` (from ``df``; None fields if unavailable)."""
    out = {"path": path, "type": None, "device": None, "size_gb": None}
    try:
        line = subprocess.run(["df", "-PT", path], capture_output=True, text=True, check=True,
                              timeout=10).stdout.splitlines()[-1].split()
        out.update(device=line[0], type=line[1], size_gb=round(int(line[2]) / 2 ** 20, 1))
        with open(f"/sys/class/block/{os.path.basename(line[0])}/queue/rotational") as f:
            out["rotational"] = f.read().strip() == "1"   # virtual disks often say 1 whatever backs them
    except (OSError, subprocess.SubprocessError, IndexError, ValueError):
        pass
    return out


def _recovery(log) -> dict:
    """Run ``bench/bench_recovery.py`` (a source checkout's) and return its JSON."""
    import cfdist

    repo = os.path.dirname(os.path.dirname(os.path.abspath(cfdist.__file__)))
    script = os.path.join(repo, "bench", "bench_recovery.py")
    if not os.path.exists(script):
        raise FileNotFoundError(f"--recovery runs {script}, which is not there: run cfdist bench from a source "
                                f"checkout of cfdist, or drop --recovery")
    log(f"recovery per tier: {sys.executable} {script}")
    subprocess.run([sys.executable, script], check=True, cwd=repo)
    with open(os.path.join(repo, "bench", "results", "recovery.json")) as f:
        return json.load(f)


def run(cfg: SuiteConfig, *, argv: list[str] | None = None, log=print) -> dict:
    """Run the suite; returns the results dict (what ``results.json`` holds)."""
    import warnings

    import torch

    from cfdist.benchmarks import micro

    warnings.filterwarnings("ignore", message=".*assuming the intent is to.*")   # DCP's no_dist note
    torch.set_num_threads(1)
    root = os.path.abspath(cfg.dir or tempfile.gettempdir())
    os.makedirs(root, exist_ok=True)
    t0 = time.time()
    res = {"schema": SCHEMA, "config": asdict(cfg),
           "command": "cfdist bench " + " ".join(shlex.quote(a) for a in (argv or [])),
           "started": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(t0)),
           "machine": machine(), "filesystem": filesystem(root), "blocks": []}
    quick = cfg.mode == "quick"
    mb = 4 if quick else 200
    log(f"references on {root}: raw write + fsync, O_DIRECT, memcpy, cfdist snapshot and persist ({mb} MB)")
    res["micro"] = micro.disk_and_phases(root, state_mb=mb, rounds=1 if quick else 5, log=log)
    log("cold restore: torch.load, DCP load, cfdist")
    res["restore"] = micro.restore(root, state_mb=mb, rounds=1 if quick else 3, log=log)
    res["skipped"] = []
    for b in plan(cfg):
        if cfg.max_minutes is not None and time.time() - t0 > 60 * cfg.max_minutes:
            res["skipped"].append(asdict(b))
            log(f"block {b.name} ({b.workload} {b.state_mb:g} MB, {b.world} ranks) skipped: past {cfg.max_minutes} min")
            continue
        log(f"block {b.name}: {b.workload} {b.state_mb:g} MB, {b.world} rank(s), k={b.k}, {b.steps} steps, "
            f"{b.repeats} round(s) of {', '.join(b.methods)}")
        res["blocks"].append(run_block(b, root=root, log=log))
    if cfg.recovery:
        res["recovery"] = _recovery(log)
    res["machine"]["load_avg_end"] = os.getloadavg() if hasattr(os, "getloadavg") else None
    res["seconds"] = time.time() - t0
    return res
