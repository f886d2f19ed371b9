"""``RankWorker.break_group``: a rank whose peer is exiting makes its own collectives fail at
once instead of waiting for the dying process's sockets to close. Two real gloo processes (no
Ray: the rank's ``join`` and ``break_group`` need none); rank 1 joins and then never takes
part again, as a dying process does until its sockets close."""

from __future__ import annotations

import multiprocessing as mp
import os
import socket
import threading
import time

import pytest

_WAIT_S = 60.0


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank(rank: int, port: int, out) -> None:
    import torch
    import torch.distributed as dist

    from cfdist.cluster.context import RankInfo
    from cfdist.cluster.worker import RankWorker

    w = RankWorker(RankInfo(rank=rank, world_size=2, local_rank=0, local_world_size=1, node_rank=rank,
                            num_nodes=2, attempt=3), use_gpu=False, timeout_s=600.0, cpus=1)
    if rank == 0:
        w._store = dist.TCPStore("127.0.0.1", port, 2, is_master=True, wait_for_workers=False)
    w.join("127.0.0.1", port)
    dist.all_reduce(torch.ones(4))   # the group works
    if rank == 1:
        time.sleep(_WAIT_S * 3)      # alive, sockets open, never in a collective again
        return
    failed = threading.Event()
    err: list = []

    def collective():
        try:
            dist.all_reduce(torch.ones(1 << 20))
        except BaseException as e:  # noqa: BLE001 - reported to the test
            err.append(f"{type(e).__name__}: {e}")
        failed.set()

    t = threading.Thread(target=collective, daemon=True)
    t.start()
    res = {"other_attempt": w.break_group(2)}
    res["blocked_after_other"] = not failed.wait(0.5)
    res["shut"] = w.break_group(3)
    res["failed"] = failed.wait(_WAIT_S)
    res["error"] = err[0] if err else None
    dist.destroy_process_group()   # what recycle() does next: the process is not aborted
    res["again"] = w.break_group(3)   # no group any more: nothing to do
    res["pid"] = os.getpid()
    out.put(res)


def test_break_group_fails_a_blocked_collective_now_and_leaves_another_attempts_group_alone():
    """Rank 0 blocks in an all-reduce that rank 1 never joins. ``break_group`` for another
    attempt does nothing (a late call after the process was recycled must not break the next
    group); for this attempt it shuts down the group's connections (not gloo's listening
    socket, whose loop would abort the process) and the all-reduce raises gloo's "Connection
    closed by peer", as when a peer's socket closes; the group is then destroyed as recycling
    does, in a process still alive."""
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=_rank, args=(r, port, out), daemon=True) for r in (0, 1)]
    for p in procs:
        p.start()
    try:
        res = out.get(timeout=_WAIT_S * 2)
    finally:
        for p in procs:
            p.kill()
            p.join(10)
    assert res["other_attempt"] == 0 and res["blocked_after_other"], res
    assert res["shut"] >= 1, res
    assert res["failed"], f"the all-reduce did not fail within {_WAIT_S} s of break_group: {res}"
    assert res["error"] and "closed by peer" in res["error"], res
    assert res["again"] == 0, res


@pytest.mark.parametrize("listening", [False, True])
def test_shutdown_sockets_leaves_listening_sockets_and_other_inodes_alone(listening):
    """``_shutdown_sockets`` shuts down a connected socket whose inode it is given, never a
    listening one, and nothing whose inode it is not given."""
    from cfdist.cluster.worker import _shutdown_sockets, _socket_inodes

    before = _socket_inodes()
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen()
    a = socket.create_connection(srv.getsockname())
    b, _ = srv.accept()
    other_a, other_b = socket.socketpair()
    try:
        mine = _socket_inodes() - before
        assert {os.fstat(s.fileno()).st_ino for s in (srv, a, b, other_a, other_b)} <= mine
        targets = {os.fstat(s.fileno()).st_ino for s in ((srv,) if listening else (a,))}
        assert _shutdown_sockets(targets) == (0 if listening else 1)
        other_a.sendall(b"x")
        assert other_b.recv(1) == b"x"   # not given: untouched
        if listening:
            c = socket.create_connection(srv.getsockname())   # still accepts
            c.close()
        else:
            b.settimeout(_WAIT_S)
            assert b.recv(1) == b""   # its peer sees the end at once
    finally:
        for s in (srv, a, b, other_a, other_b):
            s.close()
