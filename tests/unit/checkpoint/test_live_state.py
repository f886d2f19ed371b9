"""The live state of the last completed step, written after the training group failed.

Real: the Checkpointer (thread backend), files under a tmp ``file://`` directory, a model with
BatchNorm and dropout, an SGD optimizer with momentum, a StepLR scheduler, a ResumableLoader,
and noise drawn from torch, numpy and python every step. Faked: the peer's death (the loop
raises where a collective would: after step 6's forward, whose fetch, dropout and BatchNorm
update already happened; or inside the optimizer update).

The points: ``save_live`` writes the last completed step (5) without a collective, nothing newer
on storage than the policy's checkpoints before it; a restore from it continues bit for bit
like the uninterrupted run (parameters, BatchNorm statistics, optimizer, scheduler, data
position, RNG); a failure inside the update writes nothing; a step already on storage is not
written again; without ``GroupOptions(live=True)`` it says what to change.
"""

from __future__ import annotations

import random
import threading

import numpy as np
import pytest
import torch

import cfdist
from cfdist.checkpoint.format import step_dir

STEPS, FAIL_AT = 10, 6


class Boom(RuntimeError):
    """Stands for the collective's error (gloo: 'Connection reset by peer')."""


def _objects(url, *, live=True, every=100, cls=cfdist.Checkpointer):
    torch.manual_seed(0)
    np.random.seed(1)
    random.seed(2)
    model = torch.nn.Sequential(torch.nn.Linear(4, 16), torch.nn.BatchNorm1d(16), torch.nn.Dropout(0.3),
                                torch.nn.Linear(16, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=3, gamma=0.5)
    data = torch.arange(200, dtype=torch.float32).reshape(50, 4)
    loader = cfdist.ResumableLoader(data, 4, seed=3, rank=0, world_size=1)
    ckpt = cls({"model": model, "opt": opt, "sched": sched, "data": loader}, url,
               cfdist.Every(every), group=cfdist.GroupOptions(live=live))
    return model, opt, sched, loader, ckpt


def _train(objs, until, *, fail_at=None, fail_in_update=False):
    """Train to step ``until``; at step ``fail_at`` raise after the forward (or in the update)."""
    model, opt, sched, loader, ckpt = objs
    it = iter(loader)
    while ckpt.step_count < until:
        x = next(it) / 100.0
        noise = torch.randn(4, 1) + float(np.random.randn()) + random.random()
        loss = (model(x) - noise).square().mean()
        if fail_at is not None and ckpt.step_count + 1 == fail_at and not fail_in_update:
            raise Boom("the peer died in step 6's backward")
        loss.backward()
        if fail_at is not None and ckpt.step_count + 1 == fail_at:
            def torn_step():
                with torch.no_grad():
                    next(iter(model.parameters())).add_(1.0)   # one tensor updated, then the error
                raise Boom("the peer died in the update")
            opt.step = torn_step
        ckpt.step(opt)
        opt.zero_grad()
        sched.step()


def _fingerprint(objs):
    model, opt, sched, loader, ckpt = objs
    return {"model": {k: v.clone() for k, v in model.state_dict().items()},
            "momentum": [opt.state[p]["momentum_buffer"].clone() for p in model.parameters()],
            "lr": sched.get_last_lr(), "data": loader.state_dict(), "torch_rng": torch.get_rng_state().clone(),
            "np": np.random.get_state()[1].copy(), "py": random.getstate()}


def _same(a, b):
    for k in a["model"]:
        assert torch.equal(a["model"][k], b["model"][k]), k
    for x, y in zip(a["momentum"], b["momentum"]):
        assert torch.equal(x, y)
    assert a["lr"] == b["lr"] and a["data"] == b["data"] and torch.equal(a["torch_rng"], b["torch_rng"])
    assert (a["np"] == b["np"]).all() and a["py"] == b["py"]


def test_the_live_state_of_the_last_step_resumes_bit_for_bit(tmp_path):
    ref = _objects(f"file://{tmp_path}/ref")
    _train(ref, STEPS)
    want = _fingerprint(ref)
    ref[-1].close()

    url = f"file://{tmp_path}/run"
    run = _objects(url, every=4)
    with pytest.raises(Boom):
        _train(run, STEPS, fail_at=FAIL_AT)
    ckpt = run[-1]
    assert ckpt.step_count == FAIL_AT - 1 and ckpt.save_live(timeout_s=30) == FAIL_AT - 1
    ckpt.abandon()
    assert (tmp_path / "run" / step_dir(FAIL_AT - 1)).is_dir()

    again = _objects(url, every=4)
    assert again[-1].restore() == FAIL_AT - 1
    _train(again, STEPS)
    _same(_fingerprint(again), want)
    again[-1].close()


def test_a_failure_inside_the_update_writes_nothing(tmp_path, caplog):
    run = _objects(f"file://{tmp_path}/run")
    with pytest.raises(Boom):
        _train(run, STEPS, fail_at=FAIL_AT, fail_in_update=True)
    with caplog.at_level("INFO", logger="cfdist.checkpointer"):
        assert run[-1].save_live(timeout_s=30) is None
    assert "inside step 6's optimizer update" in caplog.text
    run[-1].abandon()
    assert not (tmp_path / "run" / step_dir(FAIL_AT - 1)).exists()


def test_a_step_on_storage_already_is_not_written_again(tmp_path, caplog):
    url = f"file://{tmp_path}/run"
    run = _objects(url, every=5)     # step 5 is a regular checkpoint
    with pytest.raises(Boom):
        _train(run, STEPS, fail_at=FAIL_AT)
    with caplog.at_level("INFO", logger="cfdist.checkpointer"):
        assert run[-1].save_live(timeout_s=30) is None
    assert "step 5 is on storage already" in caplog.text
    run[-1].abandon()


class Halted(RuntimeError):
    """Stands for ``cfdist.fit``'s PreemptionHalt."""


class _Halting(cfdist.Checkpointer):
    """The halt as ``cfdist.fit``'s checkpointer has it (cfdist/cluster/context.py): a flag another
    thread sets (there: the worker actor's notice thread) that the halt point raises on."""

    halt = None

    def _halt_point(self):
        if self.halt is not None and self.halt.is_set():
            raise Halted(f"halted after step {self.step_count}")


def _announce(ckpt):
    """The notice on another thread, as the worker actor delivers it: set the flag, then let the
    checkpointer begin the early save; returns what ``_halt_announced`` returned."""
    import threading

    out = {}

    def notice():
        ckpt.halt.set()
        out["step"] = ckpt._halt_announced(durable=True)

    t = threading.Thread(target=notice)
    t.start()
    t.join(60)
    assert not t.is_alive() and "step" in out, "the notice thread did not return"
    return out["step"]


def _reference(tmp_path):
    """The uninterrupted run's fingerprint."""
    ref = _objects(f"file://{tmp_path}/ref")
    _train(ref, STEPS)
    ref[-1].close()
    return _fingerprint(ref)


def _halting_run(url, *, every, until):
    """A run whose Checkpointer halts as ``cfdist.fit``'s does, trained to step ``until``."""
    import threading

    run = _objects(url, every=every, cls=_Halting)
    run[-1].halt = threading.Event()
    _train(run, until)
    return run


def _up_to_the_update(run):
    """The next step as ``_train`` does it, up to its update (fetch, forward, backward); returns
    the data iterator."""
    model, _, _, loader, _ = run
    it = iter(loader)
    x = next(it) / 100.0
    noise = torch.randn(4, 1) + float(np.random.randn()) + random.random()
    (model(x) - noise).square().mean().backward()
    return it


def _resumes_bit_for_bit(url, step, want, *, every):
    again = _objects(url, every=every)
    assert again[-1].restore() == step
    _train(again, STEPS)
    _same(_fingerprint(again), want)
    again[-1].close()


def test_a_halt_mid_step_writes_the_last_completed_step_at_once_and_skips_the_update(tmp_path, caplog):
    """The notice arrives during step 6, after its fetch, forward (dropout, BatchNorm update)
    and backward, before its update. The notice thread writes step 5 right away (not at the
    halt); the training thread's ``ckpt.step`` raises before the update, so nothing of step 6
    is applied; ``save_live`` returns the notice thread's job of step 5 without a second write;
    a restore from it continues bit for bit like the uninterrupted run, with data exactly once."""
    want = _reference(tmp_path)

    url = f"file://{tmp_path}/run"
    model, opt, sched, loader, ckpt = run = _halting_run(url, every=4, until=FAIL_AT - 1)
    _up_to_the_update(run)                                  # step 6 up to its update
    before = {k: v.clone() for k, v in model.state_dict().items() if "running" not in k}
    with caplog.at_level("INFO", logger="cfdist.checkpointer"):
        assert _announce(ckpt) == FAIL_AT - 1
        with pytest.raises(Halted, match="after step 5"):
            ckpt.step(opt)
        assert ckpt.step_count == FAIL_AT - 1
        for k, v in before.items():
            assert torch.equal(model.state_dict()[k], v), f"step 6's update ran on {k}"
        assert ckpt.save_live(timeout_s=30, durable=True) == FAIL_AT - 1
    assert "the halt found step 5 complete" in caplog.text and "and sent at once" in caplog.text
    assert caplog.text.count("wrote the live state of step 5") == 1
    ckpt.abandon()

    _resumes_bit_for_bit(url, FAIL_AT - 1, want, every=4)


def test_a_halt_during_the_update_writes_the_step_it_completes(tmp_path, caplog):
    """The notice arrives inside step 6's ``optimizer.step()``: the update runs to its end, no
    early save begins (the parameters are changing), and the rank halts at the next boundary
    (step 7's fetch) holding step 6, which ``save_live`` writes; the run resumes from 6 bit for
    bit."""
    want = _reference(tmp_path)

    url = f"file://{tmp_path}/run"
    model, opt, sched, loader, ckpt = run = _halting_run(url, every=4, until=FAIL_AT - 1)
    real_step, seen = opt.step, {}

    def step_with_notice(*a, **kw):
        seen["announced"] = _announce(ckpt)   # the notice lands in the middle of the update
        return real_step(*a, **kw)

    opt.step = step_with_notice
    with caplog.at_level("INFO", logger="cfdist.checkpointer"), pytest.raises(Halted, match="after step 6"):
        _train(run, STEPS)
    opt.step = real_step
    assert seen == {"announced": None} and ckpt.step_count == FAIL_AT
    assert ckpt.save_live(timeout_s=30, durable=True) == FAIL_AT
    assert "the halt found" not in caplog.text
    ckpt.abandon()

    _resumes_bit_for_bit(url, FAIL_AT, want, every=4)


def test_a_halt_after_the_update_copies_at_once_and_sends_the_step_at_its_boundary(tmp_path, caplog):
    """The notice arrives after step 6's update, before its scheduler step: the notice thread
    copies the parameters and optimizer state of step 6 at once, but the job waits for the
    step's boundary (the scheduler's state and the lr the next step uses); the rank halts at
    step 7's fetch, and the checkpoint holds step 6 with the scheduler stepped: the run resumes
    bit for bit."""
    want = _reference(tmp_path)

    url = f"file://{tmp_path}/run"
    model, opt, sched, loader, ckpt = run = _halting_run(url, every=4, until=FAIL_AT - 1)
    it = _up_to_the_update(run)                             # step 6, as _train does it
    ckpt.step(opt)
    opt.zero_grad()
    with caplog.at_level("INFO", logger="cfdist.checkpointer"):
        assert _announce(ckpt) == FAIL_AT                     # before step 6's scheduler step
        sched.step()
        with pytest.raises(Halted, match="after step 6"):
            next(it)                                          # step 7's fetch: the boundary, then the halt
        assert ckpt.step_count == FAIL_AT
        assert ckpt.save_live(timeout_s=30, durable=True) == FAIL_AT
    assert "it is sent when the rank halts" in caplog.text
    ckpt.abandon()

    _resumes_bit_for_bit(url, FAIL_AT, want, every=4)


def test_a_halt_right_after_a_checkpoint_step_copies_at_once_but_lets_that_checkpoint_settle_first(tmp_path, caplog):
    """Step 5 is a regular checkpoint (``Every(5)``) and the notice arrives during step 6, before
    its update. The notice thread copies step 5 at once, and sends it only if the regular
    persist of step 5 can be given up before its write (two commits of one step must not race);
    otherwise ``save_live`` settles that persist first. Either way the step is on storage once,
    and the run resumes from it bit for bit."""
    from cfdist.checkpoint.discovery import committed_steps
    from cfdist.storage import open_storage

    want = _reference(tmp_path)

    url = f"file://{tmp_path}/run"
    model, opt, sched, loader, ckpt = run = _halting_run(url, every=5, until=FAIL_AT - 1)
    _up_to_the_update(run)
    with caplog.at_level("INFO", logger="cfdist.checkpointer"):
        assert _announce(ckpt) == FAIL_AT - 1
        with pytest.raises(Halted, match="after step 5"):
            ckpt.step(opt)
        written = ckpt.save_live(timeout_s=30, durable=True)
    sent_at_once = "and sent at once" in caplog.text
    assert sent_at_once or "it is sent when the rank halts" in caplog.text
    if sent_at_once:   # nothing else of step 5 could commit any more
        assert ("the persist of step 5 is given up for its live state" in caplog.text
                or "the snapshot of step 5 is not persisted" in caplog.text), caplog.text
    assert written in (None, FAIL_AT - 1)
    if written is None:
        assert "step 5 is on storage already" in caplog.text
    ckpt.abandon()
    assert FAIL_AT - 1 in committed_steps(open_storage(url))

    _resumes_bit_for_bit(url, FAIL_AT - 1, want, every=5)


def _hold_copies(ckpt):
    """Hold the snapshot copy thread of ``ckpt`` at its next copy until ``go`` is set; returns
    ``(go, held)``, ``held`` set once a copy is held."""
    go, held = threading.Event(), threading.Event()
    copy = ckpt._snap._do_copy

    def held_copy(pairs, stream):
        held.set()
        assert go.wait(60), "the test never let the copy go"
        return copy(pairs, stream)

    ckpt._snap._do_copy = held_copy
    return go, held


def test_a_halt_gives_up_a_checkpoint_of_the_same_step_not_yet_persisting_and_sends_at_once(tmp_path, caplog):
    """Step 5 is a regular checkpoint whose copy into its arenas is still running (held here)
    when the notice arrives during step 6: its persist has not started (under ``cfdist.fit`` it
    would first wait for every rank's RNG states through the job's store, and a noticed rank
    may be killed). The notice thread drops that snapshot and sends its own copy of step 5 at
    once; the rank halts before step 6's update without waiting for the held copy; step 5 is
    committed once (the held snapshot never is), and the run resumes from it bit for bit."""
    import logging

    from cfdist.checkpoint.discovery import committed_steps
    from cfdist.storage import open_storage

    want = _reference(tmp_path)
    url = f"file://{tmp_path}/run"
    model, opt, sched, loader, ckpt = run = _halting_run(url, every=5, until=FAIL_AT - 2)
    go, held = _hold_copies(ckpt)   # step 5's snapshot copy, held until the test says go
    try:
        _train(run, FAIL_AT - 1)
        assert held.wait(30), "step 5's copy never started"
        _up_to_the_update(run)
        with caplog.at_level(logging.INFO, logger="cfdist.checkpointer"):
            assert _announce(ckpt) == FAIL_AT - 1
            with pytest.raises(Halted, match="after step 5"):
                ckpt.step(opt)
            assert ckpt.save_live(timeout_s=30, durable=True) == FAIL_AT - 1
        assert "and sent at once" in caplog.text
        assert "the snapshot of step 5 is not persisted; its live state is written instead" in caplog.text
    finally:
        go.set()
    ckpt.abandon()
    assert committed_steps(open_storage(url)) == [FAIL_AT - 1]
    _resumes_bit_for_bit(url, FAIL_AT - 1, want, every=5)


def test_a_halt_that_reaches_a_rank_whose_live_save_began_writes_nothing(tmp_path, caplog):
    """The group failed in step 6's forward before any halt (a noticed peer was killed at its
    notice): the rank keeps step 5 in process (``keep_live``), and then, the driver holding the
    notice, writes it durably (``save_live(durable=True)``, from another thread than training;
    its copy is held here). The halt reaches the rank while that save runs: it must not start
    a second write of step 5 (two commits of one step racing for one directory). Step 5 is
    written once and the run resumes from it bit for bit."""
    import logging

    from cfdist.checkpoint.discovery import committed_steps
    from cfdist.storage import open_storage

    want = _reference(tmp_path)
    url = f"file://{tmp_path}/run"
    model, opt, sched, loader, ckpt = run = _halting_run(url, every=100, until=FAIL_AT - 1)
    with pytest.raises(Boom):
        _train(run, STEPS, fail_at=FAIL_AT)
    kept = ckpt.keep_live()
    assert kept is not None and kept[0] == FAIL_AT - 1
    go, held, copies = threading.Event(), threading.Event(), []
    copy = ckpt._live._copy

    def held_copy(*a, **kw):
        copies.append(threading.current_thread().name)
        if len(copies) == 1:   # the save's copy: held until the halt came and went
            held.set()
            assert go.wait(60), "the test never let the copy go"
        return copy(*a, **kw)

    ckpt._live._copy = held_copy
    out = {}
    saver = threading.Thread(target=lambda: out.update(step=ckpt.save_live(timeout_s=30, durable=True)),
                             name="driver-request")
    with caplog.at_level(logging.INFO, logger="cfdist.checkpointer"):
        saver.start()
        try:
            assert held.wait(30), "the live save never began its copy"
            announced = _announce(ckpt)
        finally:
            go.set()
        saver.join(60)
    assert not saver.is_alive() and out == {"step": FAIL_AT - 1}, out
    assert announced is None and copies == ["driver-request"], (announced, copies)
    assert caplog.text.count("wrote the live state of step 5") == 1
    ckpt.abandon()
    assert committed_steps(open_storage(url)) == [FAIL_AT - 1]
    _resumes_bit_for_bit(url, FAIL_AT - 1, want, every=100)


def test_save_live_without_the_live_option_says_what_to_change(tmp_path):
    run = _objects(f"file://{tmp_path}/run", live=False)
    _train(run, 2)
    with pytest.raises(RuntimeError, match=r"GroupOptions\(live=True\)"):
        run[-1].save_live()
    run[-1].close()


def test_a_restart_from_the_live_state_is_not_a_failure_autos_interval_answers_to(tmp_path):
    """The history records the restart as live; ``Auto`` estimates its MTBF from the restarts
    that rolled back only (with live recovery: the failures that took every replica)."""
    import json

    url = f"file://{tmp_path}/run"
    run = _objects(url, every=4)
    with pytest.raises(Boom):
        _train(run, STEPS, fail_at=FAIL_AT)
    assert run[-1].save_live(timeout_s=30) == FAIL_AT - 1
    run[-1].abandon()
    again = _objects(url, every=4)
    assert again[-1].restore() == FAIL_AT - 1
    again[-1].close()
    restarts = json.load(open(tmp_path / "run" / "history.json"))["restarts"]
    assert restarts[-1]["step"] == FAIL_AT - 1 and restarts[-1]["live"] is True

    model, opt, sched, loader, _ = _objects(f"file://{tmp_path}/other")
    auto = cfdist.Auto()
    ckpt = cfdist.Checkpointer({"model": model, "opt": opt, "sched": sched, "data": loader}, url, auto,
                               group=cfdist.GroupOptions(live=True))
    assert auto.ctx.failure_times_s == [], auto.ctx.failure_times_s
    # bind cannot know yet how this start restores: it counts it as a failure ...
    assert auto.mtbf_source == "history" and auto.mtbf_s is not None
    ckpt.close()
    # ... and a restore from the live state takes it back: no failure that rolled back is left
    model, opt, sched, loader, _ = _objects(f"file://{tmp_path}/other2")
    auto = cfdist.Auto()
    ckpt = cfdist.Checkpointer({"model": model, "opt": opt, "sched": sched, "data": loader}, url, auto,
                               group=cfdist.GroupOptions(live=True))
    assert ckpt.restore() == FAIL_AT - 1
    assert auto.mtbf_s is None and auto.mtbf_source is None, (auto.mtbf_s, auto.mtbf_source)
    ckpt.close()


def test_a_durable_live_save_gives_up_an_older_persist_in_flight_instead_of_waiting(tmp_path, caplog):
    """Step 4's persist hangs in its shard write (``cfdist.testing.hang``); the loop fails in
    step 6. ``save_live(durable=True)`` (every node is about to be taken) gives step 4 up instead
    of waiting for it (a plain ``save_live`` gives a persist in flight up to 2 s to commit first)
    and writes step 5 while step 4's write is still blocked; step 4 never commits, also once
    its write was released and has ended."""
    import logging
    import time

    from cfdist.checkpoint.discovery import committed_steps
    from cfdist.storage import open_storage
    from cfdist.testing import hang

    url = f"file://{tmp_path}/run"
    st = hang(open_storage(url))
    run = _objects(st, every=4)
    st.arm(hang_after_bytes=0, only="shard")
    with pytest.raises(Boom):
        _train(run, STEPS, fail_at=FAIL_AT)
    ckpt = run[-1]
    assert st.entered.wait(30), "step 4's shard write never started"
    st.arm(hang_after_bytes=None)   # later writes pass; step 4's stays blocked
    try:
        with caplog.at_level(logging.INFO, logger="cfdist.checkpointer"):
            assert ckpt.save_live(timeout_s=30, durable=True) == FAIL_AT - 1
        assert st.hung == 1, "step 4's write is no longer blocked: the save could have waited for it"
        assert "the persist of step 4 is given up for the live state of step 5" in caplog.text
    finally:
        st.release()
        ckpt.abandon()
    deadline = time.monotonic() + 30
    while st.hung and time.monotonic() < deadline:
        time.sleep(0.01)
    assert st.hung == 0, "step 4's released write did not end within 30 s"
    assert committed_steps(open_storage(url)) == [FAIL_AT - 1]


def test_a_live_save_collects_a_finished_persist_without_the_store_whose_host_died(tmp_path, caplog):
    """Two ranks (two Checkpointers on two threads, each its own root, as two nodes' writers)
    agree through a real TCPStore, whose server then goes away as when the rank hosting it is
    killed after a preemption notice. Rank 1's checkpoint of step 2 has committed but is not
    collected yet: its live save collects it without publishing it to the gone store (on the
    old code: a DistNetworkError after a round trip, and the warning below, inside the grace
    period of the notice), and knows the step is on storage."""
    import gc
    import logging
    import threading
    import time

    import torch.distributed as dist

    from cfdist.checkpoint.discovery import committed_steps
    from cfdist.storage import open_storage

    server = dist.TCPStore("127.0.0.1", 0, 2, True, wait_for_workers=False)
    clients = [dist.TCPStore("127.0.0.1", server.port, 2, False) for _ in range(2)]
    out, errors = {}, []

    def rank(r):
        try:
            torch.manual_seed(r)
            model = torch.nn.Linear(4, 2)
            opt = torch.optim.SGD(model.parameters(), lr=0.1)
            ck = cfdist.Checkpointer({"model": model, "opt": opt}, f"file://{tmp_path}/r{r}", cfdist.Every(2),
                                     writers=True, group=cfdist.GroupOptions(rank=r, world_size=2, store=clients[r],
                                                                             live=True, agree_timeout_s=30))
            for _ in range(2):
                model(torch.ones(3, 4)).sum().backward()
                ck.step(opt)
                opt.zero_grad()
            ck._on_boundary()   # the next iteration's boundary: step 2's RNG states go out
            out[r] = ck
        except BaseException as e:  # noqa: BLE001 - re-raised on the test's thread
            errors.append(e)

    threads = [threading.Thread(target=rank, args=(r,)) for r in (0, 1)]
    [t.start() for t in threads]
    [t.join(timeout=60) for t in threads]
    assert not errors, errors
    ck1 = out[1]
    root1 = open_storage(f"file://{tmp_path}/r1")
    deadline = time.monotonic() + 60
    while committed_steps(root1) != [2]:
        assert time.monotonic() < deadline, "rank 1's checkpoint of step 2 never committed within 60 s"
        time.sleep(0.01)
    del server   # the store's host is gone
    gc.collect()
    with caplog.at_level(logging.INFO, logger="cfdist"):
        assert ck1.save_live(timeout_s=10) is None   # step 2 is on storage already: nothing to write
    assert "publishing it to the job's store" not in caplog.text, caplog.text
    assert "step 2 is on storage already" in caplog.text, caplog.text
    assert ck1.latest_step == 2
    for ck in out.values():
        ck.abandon()


def test_a_durable_live_save_drops_the_snapshot_not_yet_handed_to_its_persist(tmp_path, monkeypatch, caplog):
    """Step 2 is a checkpoint step, and its copy into the arenas is still running (held here)
    when the loop fails in step 3: its persist has not started. ``save_live(durable=True)``
    (every node is about to be taken) does not wait for that copy to hand the snapshot to its
    persist (under ``cfdist.fit`` that persist would first wait for every rank's RNG states
    through the job's store, in the process of a rank the notice may have killed): it drops
    the snapshot and writes step 2 from the live state while the copy is still held. Once the
    copy ends, nothing else commits. (The old code waited for the copy, up to
    ``_LIVE_SETTLE_S``, raised here so that such a wait shows.)"""
    import concurrent.futures as cf
    import logging

    from cfdist.checkpoint import checkpointer
    from cfdist.checkpoint.discovery import committed_steps
    from cfdist.checkpoint.reader import read_manifest
    from cfdist.storage import open_storage

    monkeypatch.setattr(checkpointer, "_LIVE_SETTLE_S", 3600.0)
    url = f"file://{tmp_path}/run"
    run = _objects(url, every=2)
    ckpt = run[-1]
    go, held = _hold_copies(ckpt)   # step 2's snapshot copy, held until the test says go
    with pytest.raises(Boom):
        _train(run, STEPS, fail_at=3)
    assert held.wait(30), "step 2's copy never started"
    try:
        with caplog.at_level(logging.INFO, logger="cfdist.checkpointer"):
            saved = cf.ThreadPoolExecutor(1).submit(ckpt.save_live, timeout_s=600, durable=True)
            try:
                assert saved.result(timeout=30) == 2
            except cf.TimeoutError:
                pytest.fail("save_live waited for step 2's copy (still held) instead of writing the live state")
        assert "the snapshot of step 2 is not persisted" in caplog.text
    finally:
        go.set()
    ckpt.abandon()
    st = open_storage(url)
    assert committed_steps(st) == [2] and read_manifest([st], 2).get("live"), "step 2 is not the live state's"
