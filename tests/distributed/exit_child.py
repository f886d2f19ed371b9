"""A process left in the state that made ranks abort at exit, then ended one of three ways.

The state: a 2-rank gloo group inside this one process (two ``ProcessGroupGloo`` on a
``HashStore``) whose last all-reduce's future has a Python callback (as a DDP comm hook's
``.then`` has) still running on gloo's worker thread, handing the GIL back and taking it again.
Once the interpreter's shutdown begins, Python ends that thread inside gloo's C++ when it asks
for the GIL, and the C++ runtime aborts ("terminate called without an active exception"):
what the flaky 3-rank test's ranks did now and then, here every time.

Usage: ``python exit_child.py {plain|exit_process|ends_process} LOG_FILE``. Before ending it
writes ``out-unterminated`` to stdout (no newline: only a flush delivers it), logs ``log-line``
to LOG_FILE, and registers an ``atexit`` hook that prints ``atexit-ran``.
"""

from __future__ import annotations

import atexit
import logging
import sys
import threading
import time
from datetime import timedelta

import torch
import torch.distributed as dist

from cfdist.cluster.exits import ends_process, exit_process

_keep: list = []


def _leave_a_callback_on_gloo_thread() -> None:
    store = dist.HashStore()
    pgs = {}
    peer = threading.Thread(target=lambda: pgs.setdefault(1, dist.ProcessGroupGloo(store, 1, 2, timedelta(seconds=30))))
    peer.start()
    pgs[0] = dist.ProcessGroupGloo(store, 0, 2, timedelta(seconds=30))
    peer.join()
    entered = threading.Event()

    def callback(fut):   # runs on gloo's worker thread until the process ends
        entered.set()
        while True:
            time.sleep(0.01)   # hands the GIL back; asking for it again is what aborts

    _keep.append((pgs, pgs[0].allreduce([torch.ones(4)]).get_future().then(callback)))
    pgs[1].allreduce([torch.ones(4)]).wait()   # completes rank 0's all-reduce: its callback starts
    if not entered.wait(60):
        raise TimeoutError("the all-reduce's callback did not start on gloo's thread within 60 s")


@ends_process
def _entry() -> None:
    """A process's entry function that returns normally."""


def main(how: str, log_file: str) -> None:
    logging.basicConfig(filename=log_file, level=logging.INFO)
    atexit.register(lambda: print("atexit-ran", flush=True))
    _leave_a_callback_on_gloo_thread()
    sys.stdout.write("out-unterminated")
    logging.getLogger("exit_child").info("log-line")
    if how == "exit_process":
        exit_process(0)
    elif how == "ends_process":
        _entry()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
