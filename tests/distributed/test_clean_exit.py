"""Processes cfdist starts end without racing torch's C++ threads (``cfdist.cluster.exits``).

Real: child interpreters with a real gloo group whose last all-reduce's Python callback still
runs on gloo's worker thread when the process ends (``exit_child.py``: the state in which the
3-rank DDP test's ranks sometimes died with SIGABRT after writing their results); ``mp``
processes for the launcher's view. Faked: nothing. The points: ended the plain way, that
process aborts (torch 2.13's bug, reproduced every time); ended through ``exit_process`` or an
``ends_process`` entry function it exits 0 with stdout and its log flushed and no ``atexit``
hook run (the interpreter's shutdown, where the race is, never starts); an entry function's
exception still reaches the launcher.
"""

from __future__ import annotations

import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch.multiprocessing as mp

from cfdist.cluster.exits import ends_process

CHILD = Path(__file__).with_name("exit_child.py")


def _start(how: str, tmp_path: Path) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, str(CHILD), how, str(tmp_path / f"{how}.log")],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


@pytest.mark.timeout(300)
def test_exit_process_ends_cleanly_where_a_plain_exit_aborts(tmp_path):
    children = {how: _start(how, tmp_path) for how in ("plain", "exit_process", "ends_process")}
    done = {how: (*p.communicate(timeout=240), p.returncode) for how, p in children.items()}

    out, err, code = done["plain"]
    assert code == -signal.SIGABRT and "terminate called without an active exception" in err, (
        f"a plain exit no longer aborts (exit code {code}, stderr {err[-500:]!r}): torch may have fixed "
        f"its gloo teardown, and cfdist.cluster.exits may no longer be needed")
    for how in ("exit_process", "ends_process"):
        out, err, code = done[how]
        assert code == 0, f"{how}: exit code {code}, stderr {err[-2000:]!r}"
        assert out == "out-unterminated", f"{how}: stdout not flushed, or atexit hooks ran: {out!r}"
        assert "terminate called" not in err
        assert "log-line" in (tmp_path / f"{how}.log").read_text(), f"{how}: the log was not flushed"


@ends_process
def _raises(rank: int) -> None:
    raise ValueError(f"rank {rank} failed on purpose")


def test_an_entry_functions_error_still_reaches_the_launcher():
    with pytest.raises(mp.ProcessRaisedException, match="rank 0 failed on purpose"):
        mp.start_processes(_raises, nprocs=1, start_method="fork")
