"""``cfdist.cluster.nodes.exited`` and ``process_namespace``: how the driver sees a rank's
process exit in ``/proc`` (before Ray reports it), on real processes of this machine."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

from cfdist.cluster.nodes import exited, own_namespace, power_off, process_namespace

pytestmark = pytest.mark.skipif(not os.path.isdir("/proc/self/ns"), reason="needs Linux /proc")


def _wait_for(cond, what: str, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"{what} did not happen within {timeout_s}s")
        time.sleep(0.002)


def test_a_child_process_shares_the_namespace_and_another_boot_id_would_not():
    """A child reports the same namespace as this process (the driver and a rank of a
    one-machine run); the value names the boot and the pid namespace."""
    here = process_namespace()
    assert here is not None and here.count(":") >= 1
    child = subprocess.run([sys.executable, "-c", "from cfdist.cluster.nodes import process_namespace as p; "
                            "print(p())"], capture_output=True, text=True, check=True)
    assert child.stdout.strip() == here
    boot, ino = here.rsplit(":", 1)
    assert ino == str(os.stat("/proc/self/ns/pid").st_ino) and len(boot) >= 32


def test_a_killed_process_counts_as_exited_before_and_after_it_is_reaped():
    """SIGKILL a live child: it is alive before; right after the kill it is a zombie (its
    parent, this test, has not reaped it: its sockets are closed already), which counts as
    exited; once reaped it is gone, which counts too. This process never does."""
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        assert exited([child.pid]) == set()
        os.kill(child.pid, signal.SIGKILL)
        _wait_for(lambda: exited([child.pid]) == {child.pid}, "the killed child counted as exited")
        with open(f"/proc/{child.pid}/stat") as f:   # not reaped yet: a zombie, still in /proc
            assert f.read().rsplit(")", 1)[1].split()[0] in ("Z", "X")
    finally:
        child.kill()
        child.wait()
    assert exited([child.pid]) == {child.pid}
    assert exited([os.getpid(), child.pid]) == {child.pid}


def test_the_init_process_counts_as_alive():
    """pid 1 (init, or a container's first process) lives: it is not taken for an exited one."""
    assert exited([1]) == set()


_BIG = r"""
import socket, sys, time
s = socket.socket(fileno=int(sys.argv[1]))
x = bytearray(int(sys.argv[2]) * 2**20)   # touched: freeing it is the teardown's long part
print("ready", flush=True)
time.sleep(600)
"""


def test_a_process_being_torn_down_counts_as_exiting_before_its_sockets_close():
    """A child holding 1.5 GB and one end of a socket pair is SIGKILLed: the kernel frees its
    memory before it closes its files, so its peer sees the socket's end only tens of
    milliseconds later (what a rank's gloo peer waits for). ``exited(exiting=True)`` (the
    driver's exit watch: the kernel's exiting flag) reports it while the socket is still open;
    once it is closed, and the process a zombie, both spellings report it. The child is one
    thread: its main thread is the one that frees the memory, so it is no zombie before (in a
    threaded process another thread may free it while the main one already is)."""
    import select
    import socket

    a, b = socket.socketpair()
    child = subprocess.Popen([sys.executable, "-c", _BIG, str(b.fileno()), "1536"], pass_fds=[b.fileno()],
                             stdout=subprocess.PIPE, text=True)
    b.close()
    try:
        assert child.stdout.readline().strip() == "ready", "the child did not start"
        assert exited([child.pid], exiting=True) == set()
        os.kill(child.pid, signal.SIGKILL)
        _wait_for(lambda: exited([child.pid], exiting=True) == {child.pid}, "the killed child seen exiting")
        readable, _, _ = select.select([a], [], [], 0)
        assert not readable, "the socket closed before the watch saw the process exit"
        readable, _, _ = select.select([a], [], [], 30)
        assert readable and a.recv(1) == b"", "the killed child's socket did not close within 30 s"
        _wait_for(lambda: exited([child.pid]) == {child.pid}, "the torn-down child counted as exited")
    finally:
        child.kill()
        child.wait()
        a.close()


def test_power_off_kills_a_process_of_this_namespace_at_once_and_nothing_elsewhere():
    """``power_off`` (the failure injector's kill of a simulated node's processes) SIGKILLs a
    process that reported this namespace; one that reported another namespace (another
    machine, where the pid names some other process) or no pid is left alone."""
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        assert not power_off(child.pid, "another-boot:4026531836")
        assert not power_off(None, own_namespace())
        assert exited([child.pid], exiting=True) == set()
        assert power_off(child.pid, own_namespace())
        assert child.wait(timeout=30) == -signal.SIGKILL
    finally:
        child.kill()
        child.wait()
