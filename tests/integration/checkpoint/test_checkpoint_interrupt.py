"""Interrupts (Ctrl-C, a SIGTERM handler's SystemExit) propagate out of the checkpointer, and a
checkpoint interrupted while waiting for the in-flight persist never mixes two steps."""

from __future__ import annotations

import copy
import linecache
import signal
import sys
import threading
import time

import pytest
import torch

import cfdist
from cfdist.checkpoint.discovery import committed_steps
from cfdist.storage import open_storage
from cfdist.testing import StorageWrapper


class Held(StorageWrapper):
    """A storage whose writes block while it is held (a stalled disk or network mount)."""

    def __init__(self, inner):
        super().__init__(inner)
        self.free = threading.Event()
        self.free.set()

    def hold(self) -> None:
        self.free.clear()

    def release(self) -> None:
        self.free.set()

    def write_file(self, rel, chunks, *, fsync: bool = True) -> int:
        self.free.wait()
        return super().write_file(rel, chunks, fsync=fsync)


def _main_blocked_in(fn: str) -> bool:
    """Whether the main thread is blocked (innermost frame ``wait``) inside the checkpointer's
    method ``fn``."""
    f = sys._current_frames().get(threading.main_thread().ident)
    if f is None or f.f_code.co_name != "wait" or "waiter.acquire()" not in linecache.getline(
            f.f_code.co_filename, f.f_lineno):
        return False    # only inside the blocking acquire: elsewhere in Condition.wait an async
        # exception can leave the condition's lock in a state no caller can handle
    while f is not None:
        if f.f_code.co_name == fn and f.f_code.co_filename.endswith("checkpointer.py"):
            return True
        f = f.f_back
    return False


class _Watcher:
    """On a helper thread: once the main thread blocks inside ``fn``, run ``action()``. If it
    does not within ``timeout`` s, run ``on_timeout()`` (which must unblock the main thread:
    release the storage) and say so in :meth:`check`, so the test fails naming what did not
    happen instead of hanging or failing somewhere downstream."""

    def __init__(self, fn: str, action, *, on_timeout, timeout: float = 120.0):
        self.fn, self.fired, self.timed_out = fn, threading.Event(), False

        def watch():
            deadline = time.monotonic() + timeout
            while not _main_blocked_in(fn):
                if time.monotonic() > deadline:
                    self.timed_out = True
                    on_timeout()
                    return
                time.sleep(0.002)
            action()
            self.fired.set()

        self.thread = threading.Thread(target=watch, daemon=True)
        self.thread.start()

    def check(self) -> None:
        self.thread.join(timeout=5.0)
        assert not self.timed_out, f"the main thread never blocked in {self.fn} (the signal was not sent)"
        assert self.fired.is_set(), f"the watcher for {self.fn} neither fired nor timed out"


def _interrupt(main: int, sig: int, handled: threading.Event, *, timeout: float = 60.0) -> None:
    """Send ``sig`` to the main thread until its Python handler ran (``handled``).

    One signal is not enough: the main thread is seen blocked at the line of the lock's
    ``acquire`` a moment before the C call blocks; a signal landing in that moment only marks
    the handler as pending, the blocking call then starts anyway and is never interrupted, and
    the test hung until the suite's timeout (1 run in ~25 under load). A second signal
    interrupts the blocked call; signals that arrive before the handler runs are coalesced into
    one call of it, and the handlers of :func:`handled` ignore one that lands after they ran,
    so the main thread sees exactly one exception."""
    deadline = time.monotonic() + timeout
    while not handled.is_set():
        if time.monotonic() > deadline:
            raise AssertionError(f"signal {sig} sent to the main thread for {timeout:.0f} s; its handler never ran")
        signal.pthread_kill(main, sig)
        handled.wait(0.05)


@pytest.fixture
def handled():
    """Ctrl-C and a preemption handler as users write it (SIGTERM raises SystemExit), each
    recording that it ran (:func:`_interrupt` resends until it did) and raising once: the test
    sends each signal once."""
    ran = {signal.SIGINT: threading.Event(), signal.SIGTERM: threading.Event()}

    def on_int(signum, frame):
        if not ran[signal.SIGINT].is_set():
            ran[signal.SIGINT].set()
            raise KeyboardInterrupt

    def on_term(signum, frame):
        if not ran[signal.SIGTERM].is_set():
            ran[signal.SIGTERM].set()
            raise SystemExit(143)

    old = {s: signal.signal(s, h) for s, h in ((signal.SIGINT, on_int), (signal.SIGTERM, on_term))}
    yield ran
    for s, h in old.items():
        signal.signal(s, h)


def test_interrupt_in_the_wait_for_the_persist_propagates_and_mixes_nothing(memory_url, handled, request):
    """KeyboardInterrupt and SystemExit raised into the checkpointer's waits reach the caller,
    and training that continues afterwards commits only checkpoints of a single step each.

    Real: the Checkpointer with its snapshot thread and thread persist backend on ``memory://``,
    signals delivered to the main thread (SIGINT -> KeyboardInterrupt, a SIGTERM handler ->
    SystemExit) exactly while it waits for the persist in flight.
    Faked: the storage stalls (``Held``: writes block until released), so a persist is in
    flight for as long as the test needs; the signal instant is found by inspecting the main
    thread's stack.
    The point: (1) the interrupt at a checkpoint step's wait for the previous persist
    propagates; (2) the next checkpoint step waits for that same persist again instead of
    copying into the arenas it is still writing; (3) ``ckpt.wait()`` interrupted propagates and
    can be called again; (4) every committed checkpoint equals the state of its own step.
    """
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 256), torch.nn.ReLU(), torch.nn.Linear(256, 4))
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    held = Held(open_storage(memory_url))
    request.addfinalizer(held.release)   # a failing test must not leave the persist thread blocked
    ckpt = cfdist.Checkpointer({"model": model, "optim": opt}, held, cfdist.Every(2), keep=100)
    main = threading.main_thread().ident
    g = torch.Generator().manual_seed(1)
    want: dict[int, dict] = {}

    def step() -> None:
        model(torch.randn(8, 16, generator=g)).pow(2).mean().backward()
        try:
            ckpt.step(opt)
        finally:
            opt.zero_grad()
            want[ckpt.step_count] = {"model": copy.deepcopy(model.state_dict()),
                                     "optim": copy.deepcopy(opt.state_dict()["state"])}

    step()
    held.hold()
    step()                      # step 2: snapshot, its persist blocks in the storage
    step()
    w = _Watcher("_wait_inflight", lambda: _interrupt(main, signal.SIGINT, handled[signal.SIGINT]),
                 on_timeout=held.release)
    try:
        with pytest.raises(KeyboardInterrupt):
            step()              # step 4 waits for persist 2: interrupted there
    finally:
        w.check()
    assert ckpt.step_count == 4 and held.free.is_set() is False
    step()
    waited_again = []
    w = _Watcher("_wait_inflight", lambda: (waited_again.append(True), held.release()), on_timeout=held.release)
    try:
        step()                  # step 6 must wait for persist 2 again before reusing its arenas
    finally:
        w.check()
    assert waited_again == [True], "step 6 did not wait for the persist the interrupt left in flight"

    ckpt.wait()                 # persist 6 committed
    held.hold()
    step()
    step()                      # step 8: snapshot, persist blocked
    w = _Watcher("_wait_inflight", lambda: _interrupt(main, signal.SIGTERM, handled[signal.SIGTERM]),
                 on_timeout=held.release)
    try:
        with pytest.raises(SystemExit):
            ckpt.wait()
    finally:
        w.check()
    held.release()
    ckpt.wait()
    ckpt.close()

    assert committed_steps(open_storage(memory_url)) == [2, 6, 8]
    assert ckpt.stats["errors"] == 0
    for s in (2, 6, 8):
        got = cfdist.load(memory_url, step=s)["state"]
        for n, t in want[s]["model"].items():
            assert torch.equal(got["model"][n], t), f"step {s}: {n} is not the state of step {s}"
        for i, st in want[s]["optim"].items():
            for key, t in st.items():
                assert torch.equal(got["optim"]["state"][i][key], t), f"step {s}: optimizer {i}.{key}"
