"""Preparations at the lowest CPU priority: a process started ahead yields to the ranks.

A warm spare's or a standby checkpoint actor's start is seconds of CPU (Ray's worker, torch, the
first DDP's ~800 modules), and it runs beside the training: on a crowded host a rank that wakes
for its next step finds the cores taken and its step comes a few milliseconds late, step after
step, until the preparation is done (measured on 2 cores: 2-9 ms per 44-ms step for seconds).

A lower nice value is not enough: Ray's workers run at nice 15 (``RAY_worker_niceness``), and
even at nice 19 a preparation keeps the core it runs on until its time slice ends (Linux's
EEVDF scheduler lets the running task reach its slice before a waking one preempts it), several
times per step. ``bench/bench_prepare_priority.py`` on a 2-core machine: two busy processes
beside two rank-like processes (each step: 3 ms of work, four message round trips, 40 ms of
sleep) add 4.3 ms per step at nice 15, 2.3 ms at 19, and nothing under ``SCHED_IDLE``, the
policy that runs only on a core nobody else wants.

So a preparation runs:

- **from its process's start at nice 19, and under ``SCHED_IDLE`` where it may return**
  (:func:`prepared_options`: Ray's ``runtime_env`` starts the worker so, through ``chrt --idle``
  where the node has it: Ray's own start and the actor's imports, ~2.4 CPU-seconds of a
  standby's 2.5, included; without ``chrt``, :func:`background` from its constructor on);
- **a started spare's warm-up under ``SCHED_IDLE``** on a helper thread
  (:func:`run_at_background`; any process may lower a thread that then ends);
- **back at the workers' priority for its role** (:func:`foreground`): a spare that becomes a
  rank, a standby that becomes the node's checkpoint actor. Returning needs the right to (root,
  ``CAP_SYS_NICE`` or ``RLIMIT_NICE`` high enough); :func:`can_renice` probes it. The driver
  starts a spare at 19 only on a node whose checkpoint actor found it allowed (a rank stuck at
  19 would lose its core to any worker at 15); a standby becomes the node's checkpoint actor
  (background persists) at 19 where it is not.

The price: a preparation under ``SCHED_IDLE`` gets only what the ranks and every other
process leave. Where the ranks sleep part of each step (a GPU's compute, the experiment's
``step_s``) that is plenty: a node preempted every 5 s, no notice, cost 0.38-0.41 s per failure
with every preparation idle and no recovery waited for a spare (2026-12-07; an earlier attempt
without the preparation queue had spares still starting at half the restarts). A preparation a
recovery waits for (``RayBackend._take_spares``) starts like any worker. In a job that keeps
every core busy, an idle one waits for the ranks to pause: the next recovery at the latest,
which then waits for the rest of it, as for a spare still warming up.

Linux only (a thread's nice value and policy are its own there); elsewhere nothing changes.
"""

from __future__ import annotations

import logging
import os
import shlex
import shutil
import sys
import threading

from cfdist.checkpoint.idle import LINUX as _LINUX, LOWEST_NICE, idle_thread

log = logging.getLogger("cfdist.niceness")

PREPARE_NICE = LOWEST_NICE
"""The nice value of a preparation (the lowest priority)."""


def _tid_nice(tid: int) -> int:
    return os.getpriority(os.PRIO_PROCESS, tid)


def current() -> int:
    """This thread's nice value (0 off Linux)."""
    return _tid_nice(0) if _LINUX else 0


def prepared_options(node: dict | None = None) -> dict:
    """Ray actor options that start the actor's process at :data:`PREPARE_NICE` (merged with
    the job's ``runtime_env``: Ray merges ``env_vars``). ``node``: what the node's checkpoint
    actor reported (:func:`node_facts`); where it may return from ``SCHED_IDLE`` (``renice``)
    and has ``chrt``, the process runs under ``SCHED_IDLE`` from its start too (Ray's
    ``py_executable``: ``chrt --idle 0 <the node's python>``; not where the job's own
    ``runtime_env`` picks the interpreter or a container). Off Linux: none."""
    if not _LINUX:
        return {}
    env: dict = {"env_vars": {"RAY_worker_niceness": str(PREPARE_NICE)}}
    node = node or {}
    if node.get("renice") and node.get("chrt") and node.get("python") and _may_set_executable():
        env["py_executable"] = f"{shlex.quote(node['chrt'])} --idle 0 {shlex.quote(node['python'])}"
    return {"runtime_env": env}


def node_facts() -> dict:
    """What :func:`prepared_options` needs to know of this node (asked in a worker there):
    ``python`` (this interpreter: Ray's on this node) and ``chrt`` (its path, or None)."""
    return {"python": sys.executable, "chrt": shutil.which("chrt") if _LINUX else None}


_OWN_EXECUTABLE = ("py_executable", "container", "image_uri")


def _may_set_executable() -> bool:
    """Whether a prepared actor may name its interpreter: this Ray knows ``py_executable`` and
    the job's ``runtime_env`` does not set one (nor a container, whose interpreter is its own)."""
    try:
        import ray
        from ray.runtime_env import RuntimeEnv

        if "py_executable" not in RuntimeEnv.known_fields:
            return False
        job = ray.get_runtime_context().runtime_env if ray.is_initialized() else {}
        return not any(job.get(k) for k in _OWN_EXECUTABLE)
    except Exception as e:  # noqa: BLE001 - an optimisation: start the process as Ray would
        log.debug("cannot tell whether a prepared actor may name its interpreter: %s", e)
        return False


def on_thread(fn, *args, name: str = "cfdist-background"):
    """Run ``fn(*args)`` on a new thread (its nice value and policy its own); return its value
    or raise its exception."""
    out: dict = {}

    def body():
        try:
            out["value"] = fn(*args)
        except BaseException as e:  # noqa: BLE001 - handed to the caller, who re-raises it
            out["error"] = e

    t = threading.Thread(target=body, name=name, daemon=True)
    t.start()
    t.join()
    if "error" in out:
        raise out["error"]
    return out["value"]


def run_at_background(fn, *args):
    """``fn(*args)`` on a helper thread under ``SCHED_IDLE`` (threads it starts inherit it): the
    calling thread's priority is untouched. Returns ``fn``'s value; its exception propagates."""
    if not _LINUX:
        return fn(*args)

    def lowered():
        try:
            idle_thread()
        except OSError as e:   # lowering oneself is always allowed; should it fail, run anyway
            log.debug("could not lower the warm-up's priority: %s", e)
        return fn(*args)

    return on_thread(lowered)


def background() -> None:
    """Every thread of this process under ``SCHED_IDLE`` (a prepared process, from its
    constructor on); call it only where :func:`can_renice` allows the way back."""
    if not _LINUX:
        return
    for tid in _tids():
        try:
            idle_thread(tid)
        except ProcessLookupError:   # the thread ended meanwhile
            continue
        except OSError as e:
            log.debug("could not lower thread %d: %s", tid, e)


def _tids() -> list[int]:
    try:
        return [int(t) for t in os.listdir("/proc/self/task")]
    except OSError:
        return [threading.get_native_id()]


def can_renice(to: int) -> bool:
    """Whether a thread of this process lowered to nice 19 and ``SCHED_IDLE`` may return to
    nice ``to`` and the normal policy (probed on a helper thread, which ends)."""
    if not _LINUX:
        return False

    def probe():
        os.setpriority(os.PRIO_PROCESS, 0, max(PREPARE_NICE, to))
        try:
            os.setpriority(os.PRIO_PROCESS, 0, to)
            os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
            os.sched_setscheduler(0, os.SCHED_OTHER, os.sched_param(0))
            return True
        except PermissionError:
            return False

    try:
        return on_thread(probe)
    except (OSError, AttributeError) as e:
        log.debug("could not probe the right to renice: %s", e)
        return False


def foreground(to: int) -> bool:
    """Every thread of this process back to the normal policy, and those above nice ``to`` to
    ``to`` (Ray's threads that run below it are left there). Returns False where the OS refuses
    (the process then stays as it was; the refusal is logged once per process)."""
    if not _LINUX:
        return False
    for tid in _tids():
        try:
            if os.sched_getscheduler(tid) == os.SCHED_IDLE:
                os.sched_setscheduler(tid, os.SCHED_OTHER, os.sched_param(0))
            if _tid_nice(tid) > to:
                os.setpriority(os.PRIO_PROCESS, tid, to)
        except ProcessLookupError:   # the thread ended meanwhile
            continue
        except PermissionError as e:
            _refused(to, e)
            return False
    return True


_warned = False


def _refused(to: int, e: OSError) -> None:
    global _warned
    if not _warned:
        _warned = True
        log.info("process %d stays at nice %d: returning to %d is not allowed here (%s); it runs at the "
                 "lowest priority", os.getpid(), current(), to, e)
