"""``import_at_low_priority``: a warm spare's imports run at nice 19 on a thread of their own,
and leave the priority of the threads that train untouched. Real: module imports, Linux's
per-thread nice values (``os.getpriority`` of the thread's id)."""

from __future__ import annotations

import os
import sys
import threading

import pytest

from cfdist.cluster.worker import import_at_low_priority

linux_threads = pytest.mark.skipif(not hasattr(threading, "get_native_id") or sys.platform != "linux",
                                   reason="per-thread nice values are Linux's")


def _thread_nice() -> int:
    return os.getpriority(os.PRIO_PROCESS, threading.get_native_id())


@linux_threads
def test_the_import_runs_at_nice_19_and_the_caller_keeps_its_priority(tmp_path, monkeypatch):
    (tmp_path / "cfdist_probe_mod.py").write_text(
        "import os, threading\n"
        "NICE = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())\n"
        "THREAD = threading.current_thread().name\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "cfdist_probe_mod", raising=False)
    before = _thread_nice()
    import_at_low_priority("cfdist_probe_mod")
    mod = sys.modules["cfdist_probe_mod"]
    assert mod.NICE == 19 and mod.THREAD == "cfdist-warm-import", (mod.NICE, mod.THREAD)
    assert _thread_nice() == before   # this thread (one that would train) is as it was
    # a thread started afterwards inherits the caller's priority, not the import's
    seen = []
    t = threading.Thread(target=lambda: seen.append(_thread_nice()))
    t.start()
    t.join()
    assert seen == [before]


def test_an_import_that_fails_raises_in_the_caller(tmp_path, monkeypatch):
    (tmp_path / "cfdist_broken_mod.py").write_text("raise ImportError('cfdist_broken_mod cannot load')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "cfdist_broken_mod", raising=False)
    with pytest.raises(ImportError, match="cannot load"):
        import_at_low_priority("cfdist_broken_mod")
    with pytest.raises(ModuleNotFoundError):
        import_at_low_priority("cfdist_no_such_module_anywhere")
