"""Keep what a cfdist actor process writes to stderr off the driver's console, in a log file.

Ray copies each worker process's stderr into its own log file and the driver prints what lands
there. When a peer dies, torch's C++ writes pages of it per rank (gloo's and TCPStore's
"Connection reset by peer" with their ``frame #`` stack frames), and a failed task's traceback
follows. cfdist recovers from that failure and reports it as one line; the details belong in
the run's log files (``FitConfig.log_dir``, named by the result and the console's last line).
Call :func:`stderr_to_file` in the actor's constructor, inside the actor's process.
"""

from __future__ import annotations

import logging
import os
import sys

log = logging.getLogger("cfdist.proc_log")


def stderr_to_file(log_dir: str | None, name: str) -> str | None:
    """Point this process's file descriptor 2 at ``<log_dir>/<name>-<pid>.log`` (appended) and
    send cfdist's log records (INFO and up) there too; returns the path. Call once per process,
    in an actor's constructor (never in a driver or a test process: it takes the whole
    process's stderr). ``log_dir=None``, or a directory that cannot be written (a warning says
    so): nothing changes and None is returned.

    ``os.dup2`` and not ``sys.stderr = ...``: torch's C++ (c10 logging, gloo) writes to the
    descriptor, not to Python's object (which Ray opened on that descriptor).
    """
    if not log_dir:
        return None
    path = os.path.join(log_dir, f"{name}-{os.getpid()}.log")
    try:
        os.makedirs(log_dir, exist_ok=True)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    except OSError as e:
        log.warning("cannot write this process's log to %s (%s); its stderr stays Ray's", path, e)
        return None
    sys.stderr.flush()
    os.dup2(fd, 2)
    os.close(fd)
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    top = logging.getLogger("cfdist")
    top.addHandler(handler)
    top.setLevel(logging.INFO)
    return path
