"""When a SIGKILLed rank's death becomes visible: to a peer's socket and to a PID watcher.

::

    python bench/bench_kill_visibility.py --reps 8

A child process like a rank (torch imported, ``--mb`` MB of tensors touched, several threads)
holds one end of a socket pair; the parent SIGKILLs it and times (a) the socket's EOF, what
gloo's connections and Ray's raylet see, (b) its ``pidfd`` turning readable, what a watcher of
the ranks' PIDs (``os.pidfd_open`` + poll) would see, and (c) the process seen exiting in
``/proc`` (:func:`cfdist.cluster.nodes.exited` with ``exiting=True``: the kernel's "exiting"
flag, or its main thread already a zombie), what cfdist's exit watch looks at. (a) and (b) come
once the kernel has torn the process down (its memory first, then its files and sockets); (c)
comes as the teardown starts. Linux only.
"""

from __future__ import annotations

import argparse
import os
import select
import signal
import socket
import statistics
import subprocess
import sys
import time

from cfdist.cluster.nodes import exited

CHILD = r"""
import socket, sys, threading, time, torch
s = socket.socket(fileno=int(sys.argv[1]))
x = torch.ones(int(sys.argv[2]) * 2**20 // 4)
torch.set_num_threads(2)
torch.mm(torch.ones(256, 256), torch.ones(256, 256))   # torch's worker threads, as in a rank
threading.Thread(target=time.sleep, args=(600,), daemon=True).start()   # and one of its own
print("ready", flush=True)
time.sleep(600)
"""


def once(mb: int) -> tuple[float, float, float]:
    """Seconds from SIGKILL to (socket EOF, pidfd readable, exiting in ``/proc``)."""
    a, b = socket.socketpair()
    p = subprocess.Popen([sys.executable, "-c", CHILD, str(b.fileno()), str(mb)], pass_fds=[b.fileno()],
                         stdout=subprocess.PIPE, text=True)
    b.close()
    try:
        if p.stdout.readline().strip() != "ready":
            raise RuntimeError("the child did not start")
        fd = os.pidfd_open(p.pid)
        poll = select.poll()
        poll.register(fd, select.POLLIN)
        poll.register(a.fileno(), select.POLLIN)
        t0 = time.perf_counter()
        os.kill(p.pid, signal.SIGKILL)
        got: dict[int, float] = {}
        exiting = None
        while len(got) < 2:
            events = poll.poll(0 if exiting is None else 10_000)
            if exiting is None and exited([p.pid], exiting=True):
                exiting = time.perf_counter() - t0
            if not events and exiting is not None and time.perf_counter() - t0 > 10:
                raise TimeoutError(f"the killed child was not seen gone in 10 s (seen: {got})")
            for f, _ in events:
                got[f] = time.perf_counter() - t0
                poll.unregister(f)
        os.close(fd)
        return got[a.fileno()], got[fd], exiting if exiting is not None else got[fd]
    finally:
        p.kill()
        p.wait()
        a.close()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--reps", type=int, default=8)
    ap.add_argument("--mb", type=int, default=300, help="MB of tensors the child touches")
    a = ap.parse_args(argv)
    res = [once(a.mb) for _ in range(a.reps)]
    for name, xs in (("socket EOF", [r[0] for r in res]), ("pidfd readable", [r[1] for r in res]),
                     ("exiting in /proc", [r[2] for r in res])):
        print(f"{name:15s} median {1000 * statistics.median(xs):6.1f} ms   all: "
              + " ".join(f"{1000 * x:.1f}" for x in xs))
    print(f"load average {os.getloadavg()[0]:.1f}, nice {os.nice(0)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
