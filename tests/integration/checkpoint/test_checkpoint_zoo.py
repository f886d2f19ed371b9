"""Bit-exact resume on the models people train (invariant 6): each zoo model's job, SIGKILLed
as a whole (all ranks) at random instants and restarted until done, ends with the
uninterrupted run's exact parameters, buffers, optimizer, scheduler, scaler and RNG states.

Real in every test: training processes forked from the ``ckpt_child.py`` fork server (a job of
several ranks is a launcher that forks real gloo ranks into its own process group), the
Checkpointer with ``Every(k)`` on ``file://`` storage, SIGKILL of the whole process group, and
restarts that ``restore()``. Faked: nothing on the checkpoint path; the kill instants are
seeded (a random update step to reach, then a random sub-step delay), and the reference is the
same program with plain ``opt.step()`` and no cfdist. The models are in ``zoo_models.py``.
"""

from __future__ import annotations

import json
import random
import time

import pytest
import torch

TOTAL, K = 24, 3


def _progress(out, run) -> int:
    try:
        return json.loads((out / f"progress-{run}.json").read_text())["step"]
    except (FileNotFoundError, ValueError):
        return 0


def _error(out, run) -> str:
    errs = sorted(out.glob(f"error-{run}*.txt"))
    return "\n".join(e.read_text() for e in errs) or "(no error report)"


def kill_restart_until_done(children, out, model: str, *, world: int, kills: int, seed: int,
                            total: int = TOTAL, k: int = K) -> list:
    """The reference run, then jobs killed ``kills`` times at seeded instants, then one that
    finishes; returns the restored steps. Asserts every kill stopped a running job."""
    common = dict(model=model, world=world, total=total, k=k, seed=seed, out=str(out), group=world > 1)
    pid = children.start("zoo", url=None, run="ref", **common)
    assert children.wait(pid, timeout=600) == 0, _error(out, "ref")
    url = f"file://{out / 'ckpt'}"
    rng = random.Random(seed)
    restored = []
    for run in range(kills + 1):
        pid = children.start("zoo", url=url, run=run, **common)
        rep = children.report(out / f"restore-{run}.json", pid, timeout=300)
        restored.append(rep["restored"])
        if run == kills:
            assert children.wait(pid, timeout=600) == 0, _error(out, run)
            return restored
        target = rng.randrange((rep["restored"] or 0) + 1, total)   # kill once this update is done
        deadline = time.monotonic() + 300
        while _progress(out, run) < target and children.poll(pid) is None:
            assert time.monotonic() < deadline, f"run {run} made no progress to update {target}"
            time.sleep(0.002)
        time.sleep(rng.uniform(0.0, 0.01))
        code = children.kill_group(pid) if world > 1 else children.kill(pid)
        assert code == -9, f"run {run} ended with {code} before the kill at update {target}: {_error(out, run)}"


def assert_bit_identical(out, run, world: int) -> None:
    for r in range(world):
        want = torch.load(out / f"final-ref-rank{r}.pt", weights_only=False)
        got = torch.load(out / f"final-{run}-rank{r}.pt", weights_only=False)
        for name, t in want["model"].items():
            assert torch.equal(got["model"][name], t), f"rank {r}: parameter or buffer {name} differs"
        assert got["optim"]["param_groups"] == want["optim"]["param_groups"], f"rank {r}: param groups"
        assert got["optim"]["state"].keys() == want["optim"]["state"].keys()
        for i, s in want["optim"]["state"].items():
            for key, v in s.items():
                g = got["optim"]["state"][i][key]
                assert torch.equal(g, v) if isinstance(v, torch.Tensor) else g == v, f"rank {r}: optimizer {i}.{key}"
        for key in ("sched", "scaler"):
            assert got.get(key) == want.get(key), f"rank {r}: {key} differs"
        assert torch.equal(got["rng"], want["rng"]), f"rank {r}: torch RNG differs"
        assert got["python_rng"] == want["python_rng"] and (got["numpy_rng"] == want["numpy_rng"]).all(), \
            f"rank {r}: python/numpy RNG differs"


ZOO = [  # model, ranks, kills in the default run; every job but sparse runs DDP on its gloo group
    ("cnn", 3, 2),          # BatchNorm + Dropout, AdamW, OneCycleLR, an odd world size
    ("cnn", 1, 2),          # the same model on one rank
    ("transformer", 1, 2),  # dropout, AdamW, warm-up + cosine (SequentialLR)
    ("amp", 1, 2),          # fp16 autocast on the CPU, GradScaler
    ("accum", 1, 2),        # 3 micro-batches per update, no_sync between
    ("sparse", 1, 2),       # Embedding(sparse=True), SparseAdam (no DDP)
]
IDS = [f"{m}-{w}rank" for m, w, _ in ZOO]


@pytest.mark.parametrize("model, world, kills", ZOO, ids=IDS)
def test_zoo_model_killed_and_restarted_ends_bit_identical(children, tmp_path, model, world, kills):
    """Each zoo model: the whole job SIGKILLed ``kills`` times at random updates, restarted until
    done. The point: every rank's final state equals the uninterrupted run's (``torch.equal``),
    and the restarts resumed from checkpoints (training was not simply redone from scratch)."""
    restored = kill_restart_until_done(children, tmp_path, model, world=world, kills=kills, seed=5)
    assert any(restored[1:]), f"no restart resumed from a checkpoint: {restored}"
    assert_bit_identical(tmp_path, kills, world)


@pytest.mark.heavy
def test_compiled_model_killed_and_restarted_ends_bit_identical(children, tmp_path):
    """``torch.compile`` (the default inductor backend) works on this CPU build, and a compiled
    model (checkpointed through its ``_orig_mod.`` state dict keys, dropout drawn inside the
    compiled graph) resumes bit for bit. Heavy because every process compiles the model again
    (about 20 s each on a 2-core machine, three processes here), which the default run's
    budget cannot hold."""
    restored = kill_restart_until_done(children, tmp_path, "compile", world=1, kills=1, seed=5)
    assert any(restored[1:]), f"no restart resumed from a checkpoint: {restored}"
    assert_bit_identical(tmp_path, 1, 1)


LONG = [(m, w) for m, w, _ in ZOO] + [("compile", 1)]


@pytest.mark.heavy
@pytest.mark.parametrize("model, world", LONG, ids=[f"{m}-{w}rank" for m, w in LONG])
def test_zoo_model_survives_many_kills(children, tmp_path, model, world):
    """The long loop: 8 kills per model over 48 updates, checkpoints every 2."""
    restored = kill_restart_until_done(children, tmp_path, model, world=world, kills=8, seed=23, total=48, k=2)
    assert len({r for r in restored if r}) >= 3, f"too few distinct resumes: {restored}"
    assert_bit_identical(tmp_path, 8, world)
