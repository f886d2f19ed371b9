"""``cfdist.lightning.CheckpointCallback`` in real Lightning fits that are killed and restarted.

Real: Lightning 2.x ``Trainer.fit`` in child processes (``lightning_child.py``), on CPU, one
process or ``strategy="ddp"`` with 2 gloo processes; SIGKILL to the whole process group at
random instants (seeded), SIGTERM as a preemption notice, checkpoints on local disk, Lightning's
own ``ModelCheckpoint`` alongside. Nothing is faked.
The point: after any number of kills, re-running the same ``fit`` ends with parameters
``torch.equal`` to the uninterrupted fit's, and every step after a restore trains on the same
samples as the uninterrupted fit (exactly-once data, mid-epoch positions included).
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

pytest.importorskip("lightning.pytorch")

import cfdist  # noqa: E402

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[2]
CHILD = HERE / "lightning_child.py"
STEPS = 20          # lightning_child: 40 samples, batch 4, 2 epochs (per rank: 10 or 5 steps an epoch)


def _env():
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    env.setdefault("GLOO_SOCKET_IFNAME", "lo")
    env.pop("MASTER_PORT", None)      # Lightning picks a free one
    return env


def _start(storage, out, args) -> subprocess.Popen:
    log = open(Path(out) / "child.log", "ab")
    return subprocess.Popen([sys.executable, str(CHILD), storage, str(out), *args], cwd=REPO, env=_env(),
                            stdout=log, stderr=log, start_new_session=True)


def _lines(out, rank=0) -> list[dict]:
    p = Path(out) / f"progress-{rank}.jsonl"
    return [json.loads(x) for x in p.read_text().splitlines() if x.strip()] if p.exists() else []


def _finish(p: subprocess.Popen, out, timeout=240) -> None:
    try:
        rc = p.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(p.pid, signal.SIGKILL)
        raise
    assert rc == 0, f"fit failed ({rc}):\n{(Path(out) / 'child.log').read_text()[-4000:]}"


def _interrupt(p: subprocess.Popen, out, new_steps: int, sig, rng) -> None:
    """Send ``sig`` once the child finished ``new_steps`` more batches (or at once if it ends)."""
    before = len(_lines(out))
    deadline = time.monotonic() + 240
    while len(_lines(out)) < before + new_steps and p.poll() is None and time.monotonic() < deadline:
        time.sleep(0.01)
    time.sleep(rng.uniform(0, 0.04))
    if p.poll() is None:
        if sig == signal.SIGKILL:
            os.killpg(p.pid, signal.SIGKILL)      # every rank, at once
        else:
            p.send_signal(sig)
    p.wait(timeout=120)


def _by_step(out, ranks) -> dict:
    """{(rank, step): sample ids} of the last attempt that trained each step."""
    got = {}
    for r in range(ranks):
        for x in _lines(out, r):
            got[(r, x["step"])] = x["ids"]
    return got


def _reference(tmp_path, args, name="ref"):
    out = tmp_path / name
    out.mkdir()
    _finish(_start(f"file://{out}/ck", out, args), out)
    return out


def _assert_same(out, ref, ranks):
    want, got = torch.load(ref / "final.pt"), torch.load(out / "final.pt")
    assert set(got) == set(want) and all(torch.equal(got[k], want[k]) for k in want)
    assert _by_step(out, ranks) == _by_step(ref, ranks)
    for r in range(ranks):                   # exactly once per epoch, the samples of all ranks
        steps = sorted(s for (q, s) in _by_step(ref, ranks) if q == r)
        assert steps == list(range(1, STEPS // ranks + 1))
    half = STEPS // ranks // 2
    epoch0 = sorted(i for (r, s), ids in _by_step(out, ranks).items() if s <= half for i in ids)
    assert epoch0 == list(range(40))


def _killed_run(tmp_path, args, signals, seed):
    rng = random.Random(seed)
    out = tmp_path / "run"
    out.mkdir()
    storage = f"file://{out}/ck"
    for sig in signals:
        _interrupt(_start(storage, out, args), out, rng.randint(2, 6), sig, rng)
    _finish(_start(storage, out, args), out)
    return out, storage


def test_killed_fit_ends_bit_identical_and_sigterm_commits_the_step(tmp_path):
    """One process, cfdist.ResumableLoader, dropout on: SIGTERM, then SIGKILL at a random instant."""
    ref = _reference(tmp_path, ["--model-checkpoint"])
    # Lightning's own ModelCheckpoint ran alongside and wrote its files, ours are there too.
    assert sorted(os.listdir(ref / "lightning-ckpts")) == [f"epoch={e}-step={s}.ckpt" for e, s in
                                                           ((0, 10), (0, 5), (1, 15), (1, 20))]
    assert [c["step"] for c in cfdist.list_checkpoints(f"file://{ref}/ck")] == [15, 18]

    rng = random.Random(11)
    out = tmp_path / "run"
    out.mkdir()
    storage = f"file://{out}/ck"
    p = _start(storage, out, [])
    _interrupt(p, out, rng.randint(4, 7), signal.SIGTERM, rng)
    last = _lines(out)[-1]["step"]
    assert last < STEPS and not (out / "final.pt").exists()      # Lightning stopped the fit
    # the notice checkpointed the step in progress, even off the Every(3) grid
    assert cfdist.list_checkpoints(storage)[-1]["step"] == last
    p = _start(storage, out, [])
    _interrupt(p, out, rng.randint(2, 6), signal.SIGKILL, rng)
    assert {x["pid"] for x in _lines(out)} >= {p.pid}
    _finish(_start(storage, out, []), out)
    assert len({x["pid"] for x in _lines(out)}) == 3
    steps = [x["step"] for x in _lines(out)]
    assert steps[steps.index(last) + 1] == last + 1     # resumed right after the SIGTERM's step
    _assert_same(out, ref, 1)


@pytest.mark.heavy
def test_killed_fit_with_a_torchdata_stateful_dataloader(tmp_path):
    pytest.importorskip("torchdata.stateful_dataloader")
    args = ["--loader", "stateful"]
    ref = _reference(tmp_path, args)
    out, _ = _killed_run(tmp_path, args, [signal.SIGKILL], seed=5)
    assert len({x["pid"] for x in _lines(out)}) == 2
    _assert_same(out, ref, 1)


def test_killed_ddp_fit_ends_bit_identical(tmp_path):
    """strategy="ddp", 2 CPU processes (Lightning launches rank 1), the group SIGKILLed."""
    ref = _reference(tmp_path, ["--ddp"])
    out, storage = _killed_run(tmp_path, ["--ddp"], [signal.SIGKILL], seed=7)
    assert len({x["pid"] for x in _lines(out, 1)}) == 2
    _assert_same(out, ref, 2)


@pytest.mark.heavy
@pytest.mark.parametrize("args", [[], ["--ddp"], ["--loader", "stateful"]], ids=["single", "ddp", "stateful"])
def test_killed_many_times(tmp_path, args):
    ref = _reference(tmp_path, args)
    out, _ = _killed_run(tmp_path, args, [signal.SIGKILL] * 5, seed=23)
    _assert_same(out, ref, 2 if "--ddp" in args else 1)
