"""``launch/torchrun_train.py`` as a two-node ``torchrun`` job on this machine, killed and restarted.

Real: two ``torchrun`` agents (``--nnodes=2 --nproc-per-node=1``, c10d rendezvous on 127.0.0.1),
one gloo worker each, each "node" with its own local checkpoint directory (as two machines'
local disks), torchrun's ``--max-restarts`` restarting the group after a worker is SIGKILLed,
and the whole job (both agents and workers) SIGKILLed and launched again. Faked: the two
machines (two process trees on one host, two directories on one disk).
The point: every start, both nodes restore the same step; every step trains on the same
samples as the uninterrupted job (exactly-once); the parameters end ``torch.equal`` to it.
"""

from __future__ import annotations

import json
import os
import random
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[2]
SCRIPT = REPO / "launch" / "torchrun_train.py"
STEPS = 24                  # 512 samples, batch 32 on 2 ranks: 8 steps an epoch, 3 epochs


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _job(tmp: Path, out: Path, *, max_restarts: int, sleep: float) -> list[subprocess.Popen]:
    """Start the two agents of one job; node i checkpoints into tmp/node<i>."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    env["GLOO_SOCKET_IFNAME"] = "lo"
    # torchrun's shared rendezvous TCPStore keeps the first round's keys across --max-restarts,
    # and the restarted workers can read a dead peer's address (pytorch#135712, #167288):
    # the workaround the launcher's docstring gives to users.
    env["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] = "1"
    port, agents = _port(), []
    for node in (0, 1):
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes=2", "--nproc-per-node=1",
               f"--max-restarts={max_restarts}", "--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{port}",
               f"--rdzv-id=job-{port}", f"--rdzv-conf=is_host={int(node == 0)},join_timeout=60", "--monitor-interval=0.2",
               str(SCRIPT), "--local-storage", f"file://{tmp}/node{node}", "--steps", str(STEPS), "--every", "4",
               "--record", str(out), "--step-sleep", str(sleep)]
        env["PYTHONFAULTHANDLER"] = "1"   # a worker killed by a signal leaves its stacks in the log
        log = open(out / f"agent{node}.log", "ab")
        agents.append(subprocess.Popen(cmd, cwd=REPO, env=env, stdout=log, stderr=log, start_new_session=True))
    return agents


def _wait(agents, out, timeout=150) -> None:
    """Both agents exit 0 within ``timeout`` (a job takes 15-40 s here; under pytest's own
    300 s limit, so that a hang fails with the agents' logs, not with pytest's stack dump)."""
    deadline = time.monotonic() + timeout
    for a in agents:
        try:
            rc = a.wait(timeout=max(1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            _dump_stacks(agents)
            _kill(agents)
            raise AssertionError(f"the torchrun job did not finish within {timeout} s:\n" + _logs(out)) from None
        assert rc == 0, f"agent failed ({rc}):\n" + _logs(out)


def _dump_stacks(agents) -> None:
    """SIGABRT every worker (faulthandler writes its Python stacks into its agent's log)."""
    workers = [p for a in agents for p in _tree(a.pid) if p != a.pid]
    for p in workers:
        try:
            os.kill(p, signal.SIGABRT)
        except ProcessLookupError:
            pass
    deadline = time.monotonic() + 5
    while any(Path(f"/proc/{p}").exists() and "Z" not in _state(p) for p in workers) and time.monotonic() < deadline:
        time.sleep(0.05)


def _logs(out: Path) -> str:
    return "\n".join(f"--- agent{i}.log\n" + (out / f"agent{i}.log").read_text()[-3000:] for i in (0, 1))


def _tree(pid: int) -> list[int]:
    """``pid`` and all its descendants (Linux /proc)."""
    out = [pid]
    for task in Path(f"/proc/{pid}/task").glob("*"):
        try:
            kids = (task / "children").read_text().split()
        except OSError:
            continue
        for k in kids:
            out += _tree(int(k))
    return out


def _kill(agents) -> None:
    """SIGKILL both agents and their workers at once (torchrun starts workers in sessions of
    their own: the agents' process groups do not hold them)."""
    pids = [p for a in agents for p in _tree(a.pid)]
    for p in pids:
        try:
            os.kill(p, signal.SIGKILL)
        except ProcessLookupError:
            pass
    for a in agents:
        a.wait(timeout=60)
    deadline = time.monotonic() + 60
    while any(Path(f"/proc/{p}").exists() and "Z" not in _state(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.05)


def _state(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return "Z"


def _records(out: Path, rank: int) -> list[dict]:
    p = out / f"rank{rank}.jsonl"
    return [json.loads(x) for x in p.read_text().splitlines() if x.strip()] if p.exists() else []


def _steps_done(out, rank) -> int:
    return len([r for r in _records(out, rank) if "step" in r])


def _wait_steps(out, rank, n, agents, timeout=300) -> None:
    deadline = time.monotonic() + timeout
    while _steps_done(out, rank) < n:
        if time.monotonic() > deadline or all(a.poll() is not None for a in agents):
            raise AssertionError(f"rank {rank} did not reach {n} steps:\n" + _logs(out))
        time.sleep(0.02)


def _starts(out, rank) -> int:
    return len([r for r in _records(out, rank) if "restored" in r])


def _by_step(out) -> dict:
    got = {}
    for rank in (0, 1):
        for r in _records(out, rank):
            if "step" in r:
                got[(rank, r["step"])] = r["xs"]
    return got


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("torchrun-ref")
    out = tmp / "out"
    out.mkdir()
    _wait(_job(tmp, out, max_restarts=0, sleep=0.0), out)
    return out


def _run_killed(tmp: Path, rng: random.Random, worker_kills: int, job_kills: int) -> Path:
    out = tmp / "out"
    out.mkdir()
    started: list = []
    try:
        return _kill_and_restart(tmp, out, rng, worker_kills, job_kills, started)
    except BaseException:
        _kill(started)                # no worker outlives a failed test
        raise


def _kill_and_restart(tmp, out, rng, worker_kills, job_kills, started) -> Path:
    for _ in range(job_kills):       # the whole job dies (both machines lost), then is launched again
        agents = _job(tmp, out, max_restarts=0, sleep=0.05)
        started[:] = agents
        _wait_steps(out, 0, _steps_done(out, 0) + rng.randint(3, 8), agents)
        time.sleep(rng.uniform(0, 0.05))
        _kill(agents)
    agents = _job(tmp, out, max_restarts=worker_kills, sleep=0.05)
    started[:] = agents
    for _ in range(worker_kills):    # one worker dies; torchrun restarts the group on both nodes
        rank = rng.randint(0, 1)
        _wait_steps(out, rank, _steps_done(out, rank) + rng.randint(3, 8), agents)
        time.sleep(rng.uniform(0, 0.05))
        starts = _starts(out, rank)
        os.kill(_records(out, rank)[-1]["pid"], signal.SIGKILL)
        deadline = time.monotonic() + 240   # the restarted group is up before the next kill
        while _starts(out, rank) == starts and all(a.poll() is None for a in agents):
            if time.monotonic() > deadline:
                raise AssertionError("the group did not restart in 240 s:\n" + _logs(out))
            time.sleep(0.05)
    _wait(agents, out)
    return out


def _assert_like_reference(out: Path, ref: Path, starts: int) -> None:
    restored = [[r["restored"] for r in _records(out, rank) if "restored" in r] for rank in (0, 1)]
    assert len(restored[0]) == starts and restored[0] == restored[1], f"ranks restored {restored}"
    assert _by_step(out) == _by_step(ref)
    want, got = torch.load(ref / "final.pt"), torch.load(out / "final.pt")
    assert set(got) == set(want) and all(torch.equal(got[k], want[k]) for k in want)


def test_two_node_torchrun_job_killed_and_restarted(tmp_path, reference):
    """A worker SIGKILLed; torchrun (--max-restarts) restarts the group on both nodes. The
    survivor writes its live state (``--live``, the default) as its collective fails: the
    restart resumes from the last step it completed, not from the last checkpoint (every 4)."""
    out = _run_killed(tmp_path, random.Random(3), worker_kills=1, job_kills=0)
    _assert_like_reference(out, reference, starts=2)
    saved = [r["live_saved"] for rank in (0, 1) for r in _records(out, rank) if "live_saved" in r]
    restored = [r["restored"] for r in _records(out, 0) if "restored" in r]
    assert len(saved) == 1 and restored[-1] == saved[0], (saved, restored)
    # exactly once per epoch across both nodes: the reference sees all 512 samples each epoch
    xs = sorted(x for (rank, step), v in _by_step(reference).items() if step <= 8 for x in v)
    assert len(xs) == 512


@pytest.mark.heavy
@pytest.mark.parametrize("seed", [1, 2])
def test_two_node_torchrun_job_killed_many_times(tmp_path, reference, seed):
    """The whole job (agents and workers on both nodes) SIGKILLed and launched again, twice,
    then two workers killed and restarted by torchrun."""
    out = _run_killed(tmp_path, random.Random(seed), worker_kills=2, job_kills=2)
    _assert_like_reference(out, reference, starts=5)


def test_launcher_warns_about_the_shared_rendezvous_store(monkeypatch, caplog):
    """torchrun --max-restarts with the shared store (the default) gets the workaround named."""
    sys.path.insert(0, str(REPO / "launch"))
    try:
        from torchrun_train import warn_shared_store
    finally:
        sys.path.remove(str(REPO / "launch"))
    monkeypatch.setenv("TORCHELASTIC_USE_AGENT_STORE", "True")
    monkeypatch.setenv("TORCHELASTIC_MAX_RESTARTS", "3")
    with caplog.at_level("WARNING", logger="cfdist.launch"):
        assert warn_shared_store()
    assert "TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1" in caplog.text
    monkeypatch.setenv("TORCHELASTIC_USE_AGENT_STORE", "False")     # what the variable gives
    assert not warn_shared_store()
    monkeypatch.setenv("TORCHELASTIC_USE_AGENT_STORE", "True")
    monkeypatch.setenv("TORCHELASTIC_MAX_RESTARTS", "0")            # no restarts: no stale keys
    assert not warn_shared_store()
