"""The raylet probe that finds a lost node in milliseconds (``cfdist.cluster.nodes.unreachable``).

Real: TCP sockets on 127.0.0.1 (a listening one stands for a live raylet, whose kernel accepts
connections however busy the process is; a closed port for a node whose raylet died). The
point: a live endpoint is not reported, a dead one is, and a listener that never accepts (a
full backlog is still a live process) is not mistaken for a dead node.
"""

from __future__ import annotations

import socket

from cfdist.cluster.nodes import unreachable


def _listener(backlog: int = 8) -> socket.socket:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    s.listen(backlog)
    return s


def test_a_closed_port_is_gone_and_a_listening_one_is_not():
    alive = _listener()
    dead = _listener()
    dead_port = dead.getsockname()[1]
    dead.close()   # the raylet died: its port refuses
    try:
        got = unreachable({"alive": alive.getsockname(), "dead": ("127.0.0.1", dead_port)}, timeout_s=0.5)
    finally:
        alive.close()
    assert got == {"dead"}


def test_a_busy_raylet_that_never_calls_accept_is_alive():
    busy = _listener(backlog=64)   # nobody calls accept(): the kernel still completes the handshake
    try:
        assert unreachable({f"n{i}": busy.getsockname() for i in range(4)}, timeout_s=0.5) == set()
    finally:
        busy.close()


def test_no_nodes_no_probe():
    assert unreachable({}) == set()
