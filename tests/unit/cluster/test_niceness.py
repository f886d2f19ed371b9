"""``cfdist.cluster.niceness``: preparations at the lowest CPU priority, and back for a role.

Real: Linux threads and their nice values. The cases that change nice values run in a child
process (``_child``), so this test process keeps its own; the refused cases drop the child's
privileges for real (a root child turns into ``nobody`` with ``RLIMIT_NICE`` 0), where the OS
then refuses a lower nice value as it does for any unprivileged user.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import threading

import pytest

from cfdist.cluster import niceness

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="per-thread nice values are Linux's")

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))


def _child(body: str, *, unprivileged: bool = False) -> dict:
    """Run ``body`` (which sets ``out``) in a fresh Python; returns ``out`` as JSON.
    ``unprivileged``: the child first loses every right to lower a nice value."""
    drop = textwrap.dedent("""
        import resource
        resource.setrlimit(resource.RLIMIT_NICE, (0, 0))
        if os.geteuid() == 0:
            os.setgid(65534); os.setuid(65534)
    """) if unprivileged else ""
    code = "import json, os, threading\nfrom cfdist.cluster import niceness\n" + drop + textwrap.dedent(body) + \
        "\nprint(json.dumps(out))\n"
    env = {**os.environ, "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")}
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, env=env, cwd="/")
    assert p.returncode == 0, p.stderr
    return json.loads(p.stdout.strip().splitlines()[-1])


def _nice() -> int:
    return os.getpriority(os.PRIO_PROCESS, threading.get_native_id())


def _policy() -> int:
    return os.sched_getscheduler(threading.get_native_id())


def test_run_at_background_runs_on_a_helper_thread_under_sched_idle_and_leaves_the_caller_as_it_was():
    before = (_nice(), _policy())
    seen = niceness.run_at_background(lambda x: (threading.get_native_id(), _policy(), x), 7)
    assert seen[0] != threading.get_native_id()
    assert seen[1:] == (os.SCHED_IDLE, 7)
    assert (_nice(), _policy()) == before


def test_run_at_background_hands_the_functions_exception_to_the_caller():
    class Boom(Exception):
        pass

    err = Boom("in the warm-up")

    def fail():
        raise err

    with pytest.raises(Boom) as got:
        niceness.run_at_background(fail)
    assert got.value is err


def test_threads_the_background_function_starts_inherit_its_priority():
    def starts_one():
        out = {}
        t = threading.Thread(target=lambda: out.update(policy=_policy()))
        t.start()
        t.join()
        return out["policy"]

    assert niceness.run_at_background(starts_one) == os.SCHED_IDLE


def test_prepared_options_have_ray_start_the_process_at_19():
    assert niceness.prepared_options() == {"runtime_env": {"env_vars": {"RAY_worker_niceness": "19"}}}


def test_background_then_foreground_takes_every_thread_to_idle_and_back_to_the_workers_priority():
    out = _child("""
        os.setpriority(os.PRIO_PROCESS, 0, 5)   # the main thread: below the target, left there
        ready, go, done, tids = threading.Barrier(3), threading.Event(), threading.Event(), []
        def worker():
            os.setpriority(os.PRIO_PROCESS, 0, 19)   # a prepared process's threads start at 19
            tids.append(threading.get_native_id())
            ready.wait()
            done.wait()
        ts = [threading.Thread(target=worker) for _ in range(2)]
        [t.start() for t in ts]
        ready.wait()
        niceness.background()
        idle = [os.sched_getscheduler(t) == os.SCHED_IDLE for t in tids + [threading.get_native_id()]]
        ok = niceness.foreground(15)
        out = {"idle": idle, "ok": ok, "threads": [os.getpriority(os.PRIO_PROCESS, t) for t in tids],
               "policies": [os.sched_getscheduler(t) for t in tids + [threading.get_native_id()]],
               "main": os.getpriority(os.PRIO_PROCESS, 0), "can": niceness.can_renice(15)}
        done.set()
        [t.join() for t in ts]
    """) if os.geteuid() == 0 else None
    if out is None:
        pytest.skip("returning from idle needs root here (the refused case is tested unprivileged)")
    assert out == {"idle": [True, True, True], "ok": True, "threads": [15, 15], "main": 5,
                   "policies": [os.SCHED_OTHER] * 3, "can": True}


def test_where_lowering_is_refused_foreground_says_so_and_can_renice_knows_it_beforehand():
    out = _child("""
        import logging
        logging.basicConfig(level=logging.INFO)
        os.setpriority(os.PRIO_PROCESS, 0, 15)
        can = niceness.can_renice(15)
        os.setpriority(os.PRIO_PROCESS, 0, 19)
        niceness.background()
        ok = niceness.foreground(15)
        out = {"can": can, "ok": ok, "main": os.getpriority(os.PRIO_PROCESS, 0),
               "idle": os.sched_getscheduler(0) == os.SCHED_IDLE}
    """, unprivileged=True)
    assert out == {"can": False, "ok": False, "main": 19, "idle": True}


def test_can_renice_probes_on_a_helper_thread_and_changes_nothing():
    before = (_nice(), _policy())
    niceness.can_renice(before[0])
    assert (_nice(), _policy()) == before


def test_a_node_that_may_return_and_has_chrt_starts_its_preparations_idle_from_the_first_instruction():
    facts = {"renice": True, "chrt": "/usr/bin/chrt", "python": "/opt/my env/bin/python3"}
    env = niceness.prepared_options(facts)["runtime_env"]
    assert env["env_vars"] == {"RAY_worker_niceness": "19"}
    assert env["py_executable"] == "/usr/bin/chrt --idle 0 '/opt/my env/bin/python3'"
    for missing in ({**facts, "renice": False}, {**facts, "chrt": None}, {**facts, "python": None}):
        assert niceness.prepared_options(missing) == niceness.prepared_options()


def test_a_job_whose_runtime_env_picks_the_interpreter_keeps_it_for_its_preparations(monkeypatch):
    """Faked: the job's ``runtime_env`` as Ray reports it (no cluster is started for this)."""
    import ray

    facts = {"renice": True, "chrt": "/usr/bin/chrt", "python": "/usr/bin/python3"}
    for job, named in (({"env_vars": {"A": "1"}}, True), ({"image_uri": "img:1"}, False),
                       ({"py_executable": "python3 -X dev"}, False), ({"container": {"image": "x"}}, False)):
        monkeypatch.setattr(ray, "is_initialized", lambda: True)
        monkeypatch.setattr(ray, "get_runtime_context", lambda job=job: type("C", (), {"runtime_env": job})())
        assert ("py_executable" in niceness.prepared_options(facts)["runtime_env"]) is named, job


def test_node_facts_name_this_interpreter_and_chrt():
    import shutil

    assert niceness.node_facts() == {"python": sys.executable, "chrt": shutil.which("chrt")}
