"""Keep Ray's raw reports of the deaths cfdist causes itself off the user's terminal.

When the failure injector SIGKILLs a rank (or recovery stops a group, or a simulated node is
taken), Ray's driver prints
"(raylet) A worker died or was killed while executing a task by an unexpected system error ..."
with a page of advice about OOM killers. For a kill cfdist asked for, that reads as an error
although it is the experiment working; cfdist reports it as its own ``failure`` event instead
(event log, progress bar). Deaths of any other process are printed by Ray as before.

How: the driver's error-listener thread prints through ``ray._private.worker.print_to_stdstream``;
:func:`install` wraps it once per process with a filter that drops a raylet message naming the
``Worker PID`` of a process registered with :func:`expect_death`. Should a Ray version lack that
function, nothing is filtered (and a debug line says so). Driver process; thread-safe.
"""

from __future__ import annotations

import logging
import re
import threading

log = logging.getLogger("cfdist.quiet")

_PID = re.compile(r"Worker PID: (\d+)")
_NODE = re.compile(r"node id: ([0-9a-f]+)")
_lock = threading.Lock()
_expected: set[int] = set()
_expected_nodes: set[str] = set()
_installed = False


def expect_death(*pids: int) -> None:
    """The processes ``pids`` are about to be killed by cfdist: Ray's reports of it are dropped."""
    with _lock:
        _expected.update(int(p) for p in pids if p)
    install()


def expect_node_death(node_id: str) -> None:
    """The node ``node_id`` is about to be taken by cfdist (a simulated node's preemption): Ray's
    "node ... has been marked dead" report of it is dropped."""
    with _lock:
        _expected_nodes.add(node_id)
    install()


def is_expected(data: dict) -> bool:
    """Whether a record of Ray's driver printer is a raylet report of an expected death. Pure
    apart from the registry."""
    if data.get("pid") != "raylet":
        return False
    lines = data.get("lines") or []
    nodes = {m.group(1) for ln in lines[:1] for m in _NODE.finditer(ln)}
    if nodes and "marked dead" in lines[0]:
        with _lock:
            return nodes <= _expected_nodes
    pids = {int(m.group(1)) for ln in lines for m in _PID.finditer(ln)}
    with _lock:
        return bool(pids) and pids <= _expected and all("worker died or was killed" in ln.lower() or not ln.strip()
                                                        for ln in lines)


def install() -> None:
    """Wrap Ray's driver printer with the filter (once per process)."""
    global _installed
    with _lock:
        if _installed:
            return
        _installed = True
    try:
        from ray._private import worker as ray_worker
    except ImportError:  # pragma: no cover - Ray is a dependency
        return
    original = getattr(ray_worker, "print_to_stdstream", None)
    if original is None:
        log.debug("ray._private.worker.print_to_stdstream not found: Ray's reports of expected kills stay visible")
        return

    def print_to_stdstream(data, *args, **kwargs):
        if is_expected(data):
            log.debug("dropped Ray's report of an expected kill: %s", (data.get("lines") or [""])[0][:200])
            return None
        return original(data, *args, **kwargs)

    ray_worker.print_to_stdstream = print_to_stdstream
