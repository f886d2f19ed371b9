"""``stderr_to_file`` takes the whole process's stderr, the file descriptor included.

Real: a child interpreter; writes to file descriptor 2 as C++ makes them (``os.write``), through
``sys.stderr`` and through cfdist's logger. The point: after the call every one of them is in
the log file and none reaches the process's original stderr (what Ray forwards to the console).
"""

from __future__ import annotations

import subprocess
import sys

CHILD = """
import logging, os, sys
from cfdist.cluster.proc_log import stderr_to_file
print("before", file=sys.stderr, flush=True)
path = stderr_to_file(sys.argv[1], "rank-worker")
os.write(2, b"[W socket.cpp:1] c10d like C++ writes it\\n")
print("python-stderr", file=sys.stderr, flush=True)
logging.getLogger("cfdist.worker").info("a cfdist record")
print(path)
"""


def test_every_write_to_stderr_lands_in_the_file_and_none_on_the_original(tmp_path):
    p = subprocess.run([sys.executable, "-c", CHILD, str(tmp_path / "logs")], capture_output=True, text=True,
                       timeout=120)
    assert p.returncode == 0, p.stderr
    assert p.stderr == "before\n"
    path = p.stdout.strip()
    assert path.startswith(str(tmp_path / "logs" / "rank-worker-")) and path.endswith(".log")
    text = open(path).read()
    assert "c10d like C++ writes it" in text and "python-stderr" in text
    assert "INFO cfdist.worker: a cfdist record" in text


def test_no_log_dir_changes_nothing():
    code = "from cfdist.cluster.proc_log import stderr_to_file; import sys; print(stderr_to_file(None, 'x'))"
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert p.stdout.strip() == "None" and p.returncode == 0
