"""Bit-exact resume on CPU (invariant 6): a run SIGKILLed and restarted N times ends bit-identical."""

from __future__ import annotations

import random

import pytest
import torch

TOTAL = 30       # 5 epochs of 6 batches
K = 3            # Every(3): epoch ends (6, 12, ...) are checkpoint steps too


def deaths(seed: int, n: int = 6) -> list[list]:
    """``n`` increasing ``[step, phase]`` kill points, one in each n-th of the run;
    ``mid``: after backward, ``post``: right after ``ckpt.step``."""
    rng = random.Random(seed)
    cuts = [2 + j * (TOTAL - 2) // n for j in range(n + 1)]
    return [[rng.randrange(a, b), rng.choice(["mid", "post"])] for a, b in zip(cuts, cuts[1:])]


def assert_same_training_state(got: dict, want: dict) -> None:
    for name, t in want["model"].items():
        assert torch.equal(got["model"][name], t), f"parameter {name} differs"
    assert got["optim"]["param_groups"] == want["optim"]["param_groups"]
    assert got["optim"]["state"].keys() == want["optim"]["state"].keys()
    for i, s in want["optim"]["state"].items():
        for key, t in s.items():
            assert torch.equal(got["optim"]["state"][i][key], t), f"optimizer state {i}.{key} differs"
    assert got["sched"] == want["sched"]
    assert got["data"] == want["data"]
    assert torch.equal(got["rng"], want["rng"])


@pytest.mark.parametrize("loader", ["own", "resumable"])
def test_killed_and_restarted_run_ends_bit_identical(children, tmp_path, loader):
    """A deterministic run killed 6 times ends with the uninterrupted run's exact state.

    Real: training processes with ``torch.use_deterministic_algorithms(True)``, dropout (the RNG
    matters), Adam, an ``ExponentialLR`` stepped after ``ckpt.step(opt)`` (the learning rate
    changes at every step, checkpointed ones included), batches augmented with noise from the
    global torch RNG while they are fetched, ``Every(3)`` to ``file://`` storage, SIGKILL (sent by
    the process to itself after a backward or right after ``ckpt.step``, while a snapshot or
    persist may be in flight), and restarts that ``restore()``. Data: ``own`` is a minimal
    ``state_dict``/``load_state_dict``/``__iter__`` iterator; ``resumable`` is
    ``cfdist.data.ResumableLoader`` over a dataset whose ``__getitem__`` augments.
    Faked: nothing; the reference is the same program with a plain ``opt.step()`` and no cfdist.
    The point: parameters, optimizer state (``torch.equal``), param groups (lr), scheduler state,
    data position and RNG state at the end equal the uninterrupted run's.
    """
    out = tmp_path / "out"
    out.mkdir()
    common = dict(total=TOTAL, k=K, seed=7, loader=loader, out=str(out))
    pid = children.start("bitexact", url=None, run="ref", **common)
    assert children.wait(pid, timeout=120) == 0, (out / "error-ref.txt").read_text()

    url = f"file://{tmp_path / 'ckpt'}"
    restored = []
    for run, die in enumerate(deaths(11)):
        pid = children.start("bitexact", url=url, run=run, die=die, **common)
        code = children.wait(pid, timeout=120)
        assert code == -9, f"run {run} (die at {die}) ended with {code}: {(out / f'error-{run}.txt').read_text()}"
        restored.append(children.report(out / f"restore-{run}.json", pid)["restored"])
    pid = children.start("bitexact", url=url, run="last", **common)
    assert children.wait(pid, timeout=120) == 0, (out / "error-last.txt").read_text()
    restored.append(children.report(out / "restore-last.json", pid)["restored"])

    assert len({r for r in restored if r}) >= 3, f"too few distinct resumes: {restored}"
    want = torch.load(out / "final-ref.pt", weights_only=True)
    got = torch.load(out / "final-last.pt", weights_only=True)
    assert_same_training_state(got, want)
