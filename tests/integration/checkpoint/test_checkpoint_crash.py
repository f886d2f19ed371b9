"""Crash consistency (invariant 1): SIGKILL at any instant leaves the newest commit loadable."""

from __future__ import annotations

import random
import time

import cfdist
from cfdist.checkpoint.format import MANIFEST, TMP_MARK, parse_step_dir

KILLS = 22
K = 2


def committed(root) -> list[int]:
    if not root.exists():
        return []
    return sorted(s for p in root.iterdir() if (s := parse_step_dir(p.name)) is not None and (p / MANIFEST).exists())


def staging(root) -> list[str]:
    return sorted(p.name for p in root.iterdir() if TMP_MARK in p.name) if root.exists() else []


def test_sigkill_at_random_instants_always_restores_the_newest_commit(children, tmp_path):
    """22 training processes are SIGKILLed at seeded random instants; each next one restores.

    Real: the training processes (a 1M-parameter MLP under Adam, about 12 MB per checkpoint,
    ``Every(2)``, the default thread persist backend), ``file://`` storage in tmp_path with its
    fsyncs and renames, SIGKILL, and each new process's ``Checkpointer`` (its start-up sweep and
    its checksum-verified ``restore``). About half the kills wait until a ``.tmp-`` staging
    directory exists, so they land while a checkpoint is being written.
    Faked: nothing on the write path; the kill instants are seeded, and processes are forked from
    a warm server instead of started cold (same code, no 2 s torch import per run).
    The point: after every kill the next process restores exactly the newest step committed at
    the kill (verified independently with ``cfdist.load``; Adam's step count equals it, so no
    step is mixed), with no warning or exception, finds no staging leftovers after start, and
    keeps training and committing; a last run finishes cleanly with a new commit.
    """
    root = tmp_path / "ckpt"
    out = tmp_path / "out"
    out.mkdir()
    url = f"file://{root}"
    rng = random.Random(20210223)
    expected = None           # newest committed step when the previous process died
    mid_write = 0             # kills that left a staging directory behind
    restored = []
    for run in range(KILLS):
        pid = children.start("crash", url=url, k=K, out=str(out), run=run)
        rep = children.report(out / f"restore-{run}.json", pid)
        assert rep["restored"] == expected, f"run {run}: restored {rep['restored']}, newest commit was {expected}"
        assert rep["warnings"] == [], f"run {run}: restore warned: {rep['warnings']}"
        assert rep["leftovers_after_start"] == [], f"run {run}: not swept: {rep['leftovers_after_start']}"
        if expected is not None:
            assert rep["adam_steps"] == [expected]
        restored.append(rep["restored"])

        if rng.random() < 0.5:    # kill while a checkpoint is being written
            deadline = time.monotonic() + 10
            while not staging(root) and time.monotonic() < deadline:
                time.sleep(0.001)
            time.sleep(rng.uniform(0.0, 0.02))
        else:                     # anywhere: in a step, a snapshot, a write, a retention delete
            time.sleep(rng.uniform(0.0, 0.6))
        assert children.kill(pid) == -9, f"run {run} ended by itself; see {out}"
        mid_write += bool(staging(root))

        steps = committed(root)
        expected = steps[-1] if steps else None
        if expected is not None:
            ck = cfdist.load(url, step=expected)          # verifies every checksum
            adam = ck["state"]["optim"]["state"]
            assert {int(s["step"].item()) for s in adam.values()} == {expected}

    pid = children.start("crash", url=url, k=K, out=str(out), run=KILLS, steps=3 * K)
    rep = children.report(out / f"restore-{KILLS}.json", pid)
    assert rep["restored"] == expected and rep["warnings"] == [] and rep["leftovers_after_start"] == []
    done = children.report(out / f"done-{KILLS}.json", pid)
    assert children.wait(pid, timeout=60) == 0
    start = expected or 0
    assert done["step"] == start + 3 * K
    assert done["stats"]["errors"] == 0
    assert committed(root)[-1] == start + 3 * K
    assert staging(root) == []

    assert mid_write >= 5, f"only {mid_write} of {KILLS} kills landed while a checkpoint was being written"
    assert len({r for r in restored if r}) >= 5, f"training made too little progress across kills: {restored}"
