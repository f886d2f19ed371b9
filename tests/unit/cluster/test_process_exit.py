"""``cfdist.cluster.nodes.exited`` and ``process_namespace``: how the driver sees a rank's
process exit in ``/proc`` (before Ray reports it), on real processes of this machine."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

from cfdist.cluster.nodes import exited, process_namespace

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
