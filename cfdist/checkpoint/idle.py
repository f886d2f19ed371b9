"""Thread priority primitives of work done ahead of need (used by the cluster layer too).

Work done ahead of need (a spare's warm-up, a standby's start, snapshot arenas made before the
first snapshot) runs on threads under ``SCHED_IDLE``: they get a core only when nothing else
wants it, so a training thread that wakes never waits for them (see
:mod:`cfdist.cluster.niceness` for the measurements). Lowering one's own thread needs no
privilege. Linux only; elsewhere nothing changes.
"""

from __future__ import annotations

import logging
import os
import sys

log = logging.getLogger("cfdist.idle")

LOWEST_NICE = 19
"""The nice value a thread gets where ``SCHED_IDLE`` is refused."""

LINUX = sys.platform.startswith("linux")


def idle_thread(tid: int = 0) -> None:
    """Thread ``tid`` (0: the calling one) under ``SCHED_IDLE``; at nice :data:`LOWEST_NICE`
    where that is refused. Raises ``OSError`` when neither is allowed (another's thread)."""
    try:
        os.sched_setscheduler(tid, os.SCHED_IDLE, os.sched_param(0))
    except (OSError, AttributeError) as e:
        log.debug("no SCHED_IDLE for thread %s (%s): nice %d instead", tid, e, LOWEST_NICE)
        os.setpriority(os.PRIO_PROCESS, tid, LOWEST_NICE)
