"""Fixtures of the checkpoint integration tests: a fork server for training children, small states.

``children``: a :class:`Children` client of ``ckpt_child.py`` running as a fork server, started
once per session (one torch import) and shared by the crash and bit-exact tests; children a
test leaves running are killed when it ends.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[2]


class Children:
    """Starts, polls and SIGKILLs training children forked by the ``ckpt_child.py`` server."""

    def __init__(self, log_path: Path):
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
        self.log_path = log_path
        self.live: set[int] = set()
        self._log = open(log_path, "wb")
        self.proc = subprocess.Popen([sys.executable, "-u", str(HERE / "ckpt_child.py")], cwd=REPO, env=env,
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self._log,
                                     text=True)

    def _ask(self, **cmd) -> dict:
        self.proc.stdin.write(json.dumps(cmd) + "\n")
        self.proc.stdin.flush()
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"the fork server died; its log:\n{self.log_path.read_text()[-3000:]}")
        return json.loads(line)

    def start(self, prog: str, **args) -> int:
        """Fork a child running ``prog(args)``; returns its pid (the caller may SIGKILL it)."""
        pid = self._ask(op="start", prog=prog, args=args)["pid"]
        self.live.add(pid)
        return pid

    def poll(self, pid: int) -> int | None:
        code = self._ask(op="poll", pid=pid)["code"]
        if code is not None:
            self.live.discard(pid)
        return code

    def kill_all(self) -> None:
        """SIGKILL every child still running (a failed test must not leave one training)."""
        for pid in sorted(self.live):
            self.kill(pid)

    def kill(self, pid: int) -> int:
        """SIGKILL child ``pid`` unless it already ended; returns its exit status.

        Safe against pid reuse: only the server reaps, so a child not yet seen ended by
        ``poll`` is alive or a zombie, and its pid cannot belong to another process.
        """
        code = self.poll(pid)
        if code is not None:
            return code
        os.kill(pid, signal.SIGKILL)
        return self.wait(pid, timeout=30)

    def wait(self, pid: int, timeout: float) -> int:
        """Exit status of ``pid`` (negative: killed by that signal); SIGKILL and fail after ``timeout``."""
        deadline = time.monotonic() + timeout
        while (code := self.poll(pid)) is None:
            if time.monotonic() > deadline:
                os.kill(pid, signal.SIGKILL)
                self.wait(pid, timeout=30)
                raise TimeoutError(f"child {pid} still ran after {timeout}s; killed it")
            time.sleep(0.01)
        return code

    def report(self, path: Path, pid: int, timeout: float = 60) -> dict:
        """The JSON report ``path`` once child ``pid`` wrote it; fails early if it died without it."""
        deadline = time.monotonic() + timeout
        while not path.exists():
            code = self.poll(pid)
            if code is not None and not path.exists():
                errs = sorted(path.parent.glob("error-*.txt"))
                detail = errs[-1].read_text() if errs else "(no error report)"
                raise AssertionError(f"child {pid} exited with {code} before writing {path.name}:\n{detail}")
            if time.monotonic() > deadline:
                self.kill(pid)
                raise AssertionError(f"child {pid} did not write {path.name} within {timeout}s")
            time.sleep(0.005)
        return json.loads(path.read_text())

    def close(self) -> None:
        try:
            self.kill_all()
            self.proc.stdin.close()  # the server's loop ends at EOF
            self.proc.wait(timeout=30)
        finally:
            self._log.close()


@pytest.fixture(scope="session")
def _fork_server(tmp_path_factory):
    c = Children(tmp_path_factory.mktemp("fork-server") / "server.log")
    yield c
    c.close()


@pytest.fixture
def children(_fork_server):
    """The fork server's client; children a test leaves running are killed after it."""
    yield _fork_server
    _fork_server.kill_all()


@pytest.fixture
def mlp_state():
    """A factory of a small, seeded training state: MLP (with dropout), Adam, StepLR."""

    def make(seed: int = 0, width: int = 64):
        torch.manual_seed(seed)
        model = torch.nn.Sequential(torch.nn.Linear(16, width), torch.nn.ReLU(), torch.nn.Dropout(0.1),
                                    torch.nn.Linear(width, 4))
        opt = torch.optim.Adam(model.parameters(), lr=1e-2)
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
        return model, opt, sched

    return make


@pytest.fixture
def train():
    """``train(model, opt, ckpt, n, sched=None)``: ``n`` iterations of the ordinary loop
    (forward, backward, ``ckpt.step(opt)``, ``sched.step()``) on seeded random batches."""

    def run(model, opt, ckpt, n: int, sched=None, seed: int = 0) -> None:
        g = torch.Generator().manual_seed(seed)
        for _ in range(n):
            x = torch.randn(8, 16, generator=g)
            model(x).pow(2).mean().backward()
            ckpt.step(opt)
            if sched is not None:
                sched.step()
            opt.zero_grad()

    return run


@pytest.fixture
def committed_run(tmp_path, mlp_state, train):
    """``committed_run(every, n)``: ``(url, root)`` of a ``file://`` run of ``n`` steps of the small
    MLP (``mlp_state()``, ``train``) with ``Every(every)`` and ``keep=2``: steps ``n - every`` and
    ``n`` are committed."""
    import cfdist

    def make(every: int, n: int):
        root = tmp_path / "ckpt"
        url = f"file://{root}"
        model, opt, sched = mlp_state()
        ckpt = cfdist.Checkpointer({"model": model, "optim": opt, "sched": sched}, url, cfdist.Every(every), keep=2)
        train(model, opt, ckpt, n, sched)
        ckpt.close()
        assert [c["step"] for c in cfdist.list_checkpoints(url)] == [n - every, n]
        return url, root

    return make
