"""Crash consistency (invariant 1): SIGKILL at any instant leaves the newest commit loadable."""

from __future__ import annotations

import os
import random
import signal
import sys
import time
from pathlib import Path

import pytest

import cfdist
from cfdist.checkpoint.discovery import committed_steps
from cfdist.checkpoint.format import TMP_MARK, parse_step_dir
from cfdist.storage import open_storage

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "cluster"))
from cluster_loops import N_SAMPLES, check_exactly_once  # noqa: E402 - the shared exactly-once replay

K = 2


def in_flight(st) -> list[str]:
    """Staging directories and step directories without a manifest: a write the kill interrupted."""
    done = set(committed_steps(st))
    return [n for n in st.listdir("") if TMP_MARK in n or (parse_step_dir(n) not in (None, *done))]


def _wait_steps(log: Path, steps: int, pid: int, children, timeout_s: float = 120.0) -> None:
    """Wait until the training process logged ``steps`` steps since its restore (one line each)."""
    deadline = time.monotonic() + timeout_s
    while True:
        done = sum(1 for line in log.read_text().splitlines() if '"step"' in line) if log.exists() else 0
        if done >= steps:
            return
        if time.monotonic() > deadline or children.poll(pid) is not None:
            raise AssertionError(f"training process {pid} logged {done} of {steps} steps in {timeout_s} s "
                                 f"(or died); see {log}")
        time.sleep(0.005)


def _wait_commit(st, newer_than: int | None, pid: int, children, timeout_s: float = 120.0) -> None:
    """Wait until a step newer than ``newer_than`` is committed (the run makes progress)."""
    deadline = time.monotonic() + timeout_s
    while not [s for s in committed_steps(st) if newer_than is None or s > newer_than]:
        if time.monotonic() > deadline or children.poll(pid) is not None:
            raise AssertionError(f"training process {pid} committed nothing after step {newer_than} in "
                                 f"{timeout_s} s (or died)")
        time.sleep(0.005)


def kill_restore_loop(children, out, url, *, kills: int, seed: int, options=None, hidden=1024,
                      wait_for_write=0.5, **extra) -> int:
    """``kills`` training processes, each SIGKILLed at a seeded instant, each restored by the next.

    With probability ``wait_for_write`` a kill waits until a write is in flight (a staging
    directory exists); half of the others wait until a newer step committed (so the run makes
    progress on any machine), the rest until the child logged a seeded number of steps. Asserts, for each run, what the test docstrings promise; returns how many
    kills interrupted a write. ``extra``: further arguments of the ``crash`` program
    (``host_memory``, ``buffers``, ``backend``).
    """
    st = open_storage(url, **(options or {}))
    rng = random.Random(seed)
    common = dict(url=url, k=K, out=str(out), options=options, hidden=hidden, data=N_SAMPLES, **extra)
    expected = None           # newest committed step when the previous process died
    interrupted = 0
    restored = []
    for run in range(kills):
        pid = children.start("crash", run=run, **common)
        rep = children.report(out / f"restore-{run}.json", pid)
        assert rep["restored"] == expected, f"run {run}: restored {rep['restored']}, newest commit was {expected}"
        assert rep["warnings"] == [], f"run {run}: restore warned: {rep['warnings']}"
        assert rep["leftovers_after_start"] == [], f"run {run}: not swept: {rep['leftovers_after_start']}"
        if expected is not None:
            assert rep["adam_steps"] == [expected]
        restored.append(rep["restored"])

        r = rng.random()
        if r < wait_for_write:                # kill while a checkpoint is being written
            deadline = time.monotonic() + 10
            while not in_flight(st) and time.monotonic() < deadline:
                time.sleep(0.001)
            time.sleep(rng.uniform(0.0, 0.02))
        elif r < wait_for_write + (1 - wait_for_write) / 2:   # right after a new commit
            _wait_commit(st, expected, pid, children)
            time.sleep(rng.uniform(0.0, 0.05))
        else:                                 # anywhere: a step, a snapshot, a write, a retention delete
            # at a seeded step, then a seeded instant within it: counted in steps, not seconds,
            # so a loaded machine kills as late in training as an idle one does
            _wait_steps(out / f"a{run}-r0.jsonl", rng.randint(0, 6 * K), pid, children)
            time.sleep(rng.uniform(0.0, 0.05))
        assert children.kill(pid) == -9, f"run {run} ended by itself; see {out}"
        interrupted += bool(in_flight(st))

        steps = committed_steps(st)
        expected = steps[-1] if steps else None
        if expected is not None:
            ck = cfdist.load(url, step=expected, **(options or {}))     # verifies every checksum
            adam = ck["state"]["optim"]["state"]
            assert {int(s["step"].item()) for s in adam.values()} == {expected}

    pid = children.start("crash", run=kills, steps=3 * K, **common)
    rep = children.report(out / f"restore-{kills}.json", pid)
    assert rep["restored"] == expected and rep["warnings"] == [] and rep["leftovers_after_start"] == []
    done = children.report(out / f"done-{kills}.json", pid)
    assert children.wait(pid, timeout=60) == 0
    start = expected or 0
    assert done["step"] == start + 3 * K and done["stats"]["errors"] == 0 and done["close_raised"] is None
    assert committed_steps(st)[-1] == start + 3 * K
    assert in_flight(st) == []
    assert len({r for r in restored if r}) >= kills // 5, f"training made too little progress across kills: {restored}"
    check_exactly_once(str(out), start + 3 * K)   # every sample once per epoch across all kills
    return interrupted


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
    keeps training and committing; a last run finishes cleanly with a new commit; replaying
    what each process consumed from its ``ResumableLoader``, every sample was used exactly once
    per epoch across all kills.
    """
    out = tmp_path / "out"
    out.mkdir()
    interrupted = kill_restore_loop(children, out, f"file://{tmp_path / 'ckpt'}", kills=22, seed=20210223)
    assert interrupted >= 5, f"only {interrupted} of 22 kills landed while a checkpoint was being written"


def test_sigkill_on_s3_always_restores_the_newest_commit(children, tmp_path, s3_url, s3_storage_options):
    """The same kill/restore loop on S3, where no rename exists and the manifest PUT commits.

    Real: the training processes (a smaller MLP: about 3 MB per checkpoint), s3fs against a
    real local moto S3 server, SIGKILL, sweep and verified restore. Faked: the kill instants
    (seeded random delays; the staging-directory wait does not apply, S3 writes in place).
    The point: as on disk, each restart restores exactly the newest step whose manifest was
    written, finds no uncommitted step prefix after start, and training continues.
    """
    out = tmp_path / "out"
    out.mkdir()
    # Half the kills wait for a step prefix without a manifest (a write in flight). On S3 that
    # window is one PUT wide, so whether a kill lands inside it depends on the machine's load:
    # the file:// test above asserts mid-write kills; this one asserts the restores.
    kill_restore_loop(children, out, s3_url, kills=8, seed=7, options=s3_storage_options,
                      hidden=256, wait_for_write=0.5)


def _writer_processes(pid: int) -> list[int]:
    """The spawned persist writer processes under training process ``pid`` (from /proc)."""
    out = []
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        try:
            with open(f"/proc/{d}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            with open(f"/proc/{d}/cmdline", "rb") as f:
                cmd = f.read()
        except (OSError, ValueError, IndexError):
            continue
        if ppid == pid and b"spawn_main" in cmd and b"resource_tracker" not in cmd:
            out.append(int(d))
    return out


@pytest.mark.parametrize("budget", [None, 0.1], ids=["arenas", "host_memory"])
def test_sigkill_of_the_writer_process_keeps_training_and_the_next_checkpoint_commits(children, tmp_path, budget):
    """``backend="process"``: the spawned writer process is SIGKILLed twice while it writes
    (from full arenas, or from a shared chunk pool under ``host_memory=0.1``: the chunks the
    dead writer had taken come back when its persist ends, and the copy waiting for them goes on).

    Real: the training process (forked from the warm server), its spawned writer process
    reading the snapshot from /dev/shm, ``file://`` storage, SIGKILL of the writer found in
    /proc. Faked: nothing on the write path.
    The point: the training process survives each kill (the persist counts as an error in its
    ``stats``), a new writer process takes the next checkpoint, which commits; the newest commit
    always verifies; the run finishes; a restarted process restores its last step, and every
    sample was used exactly once per epoch.
    """
    out, url = tmp_path / "out", f"file://{tmp_path / 'ckpt'}"
    out.mkdir()
    st = open_storage(url)
    steps = 60
    pid = children.start("crash", run=0, url=url, k=K, out=str(out), hidden=512, data=N_SAMPLES,
                         backend="process", steps=steps, stats_every=1, host_memory=budget)
    children.report(out / "restore-0.json", pid)
    for kill in range(2):
        deadline = time.monotonic() + 120
        while not (in_flight(st) and _writer_processes(pid)):
            assert time.monotonic() < deadline and children.poll(pid) is None, "no write in flight to interrupt"
            time.sleep(0.001)
        before = committed_steps(st)
        for w in _writer_processes(pid):
            os.kill(w, signal.SIGKILL)
        deadline = time.monotonic() + 120
        while not committed_steps(st) or committed_steps(st)[-1] <= (before or [0])[-1]:
            assert time.monotonic() < deadline, f"no checkpoint committed after killing the writer (kill {kill})"
            assert children.poll(pid) is None, "the training process died with its writer"
            time.sleep(0.01)
        newest = committed_steps(st)[-1]
        assert cfdist.load(url, step=newest)["step"] == newest
    done = children.report(out / "done-0.json", pid, timeout=300)
    assert children.wait(pid, timeout=60) == 0
    assert done["step"] == steps and done["stats"]["errors"] >= 1
    assert "terminated abruptly" in done["stats"]["last_error"]
    assert "terminated abruptly" in done["close_raised"]      # wait()/close() re-raise it once
    assert committed_steps(st)[-1] == steps
    pid = children.start("crash", run=1, url=url, k=K, out=str(out), hidden=512, data=N_SAMPLES, steps=2 * K)
    assert children.report(out / "restore-1.json", pid)["restored"] == steps
    assert children.wait(pid, timeout=60) == 0
    check_exactly_once(str(out), steps + 2 * K)
