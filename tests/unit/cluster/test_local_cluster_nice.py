"""``local_cluster._nice_this_thread``: how a simulated node's start gets Ray's worker niceness.

Real: Linux threads and their nice values (each case runs in a thread of its own, so the test
process keeps its niceness). Faked: the platform name (macOS cannot run here) and a failing
``setpriority`` (monkeypatched), to check what happens where the niceness cannot be set.
"""

from __future__ import annotations

import logging
import os
import sys
import threading

import pytest

from cfdist.cluster import local_cluster


def _in_thread(fn):
    out = {}

    def run():
        try:
            out["value"] = fn()
        except BaseException as e:  # noqa: BLE001 - re-raised in the test's thread
            out["error"] = e

    t = threading.Thread(target=run)
    t.start()
    t.join(30)
    assert not t.is_alive(), "the thread did not finish within 30 s"
    if "error" in out:
        raise out["error"]
    return out["value"]


def _own_nice() -> int:
    return os.getpriority(os.PRIO_PROCESS, threading.get_native_id())


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="per-thread nice values are Linux's")
def test_raises_only_the_calling_threads_niceness_and_never_lowers_it():
    main = _own_nice()
    start = min(max(main, 10), 16)   # room for +3 below the cap of 19

    def case():
        if _own_nice() < start:
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), start)
        local_cluster._nice_this_thread(start + 3)
        raised = _own_nice()
        local_cluster._nice_this_thread(start)   # lower: left as it is
        return raised, _own_nice()

    assert _in_thread(case) == (start + 3, start + 3)
    assert _own_nice() == main


def test_other_platforms_leave_the_niceness_to_ray(monkeypatch, caplog):
    calls = []
    monkeypatch.setattr(local_cluster.sys, "platform", "darwin")
    monkeypatch.setattr(local_cluster.os, "setpriority", lambda *a: calls.append(a))
    with caplog.at_level(logging.INFO, logger=local_cluster.__name__):
        _in_thread(lambda: local_cluster._nice_this_thread(15))
    assert calls == []
    assert "per-thread nice is Linux's" in caplog.text


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="per-thread nice values are Linux's")
def test_a_niceness_that_cannot_be_set_is_logged_and_the_node_still_starts(monkeypatch, caplog):
    def refuse(*a):
        raise PermissionError(1, "Operation not permitted")

    monkeypatch.setattr(local_cluster.os, "setpriority", refuse)
    with caplog.at_level(logging.WARNING, logger=local_cluster.__name__):
        _in_thread(lambda: local_cluster._nice_this_thread(19))
    assert "could not start a simulated node at nice 19" in caplog.text
