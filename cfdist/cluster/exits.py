"""End a process cfdist owns without letting Python's shutdown race torch's C++ threads.

Why: with torch 2.13, a process that used a gloo group can die with SIGABRT ("terminate called
without an active exception") after its work is done. DDP (and a comm hook's futures) keep the
group alive after ``destroy_process_group()``; a gloo worker thread that drops the last
reference to the final all-reduce's tensor after Python's finalization began must take the GIL,
is ended by the interpreter mid-C++, and the C++ runtime aborts. It reproduces without cfdist,
about one run in three on a loaded machine.

How: once the process's own work and cleanup are done, flush what Python buffers (stdout,
stderr, ``logging``'s handlers) and leave with ``os._exit(code)``: no finalization, no C++
static destructors, nothing left to race. Use it at the end of every process cfdist starts
(rank workers, test children, ``launch/`` scripts):

* :func:`exit_process` where the code knows it is done (``exit_process(0)``);
* :func:`ends_process` on a process's entry function (``mp.spawn``/``Process(target=...)``):
  a normal return exits 0 through :func:`exit_process`; an exception propagates unchanged, so
  the launcher (``mp.spawn``'s error file, ``multiprocessing``'s traceback) reports it.

In the cluster layer (the processes cfdist starts are its business), below the entry points and
``launch/`` that also use it; it imports only the standard library.
"""

from __future__ import annotations

import functools
import logging
import os
import sys
from typing import Callable, NoReturn, TypeVar

F = TypeVar("F", bound=Callable)


def exit_process(code: int = 0) -> NoReturn:
    """Flush stdout, stderr and every ``logging`` handler, then ``os._exit(code)``.

    Call from any thread once the process's own cleanup is done (checkpoints closed, process
    group destroyed, files and queues closed: a ``multiprocessing.Queue`` must be ``close()``d
    and ``join_thread()``ed first, or its last items are lost). ``atexit`` handlers and
    ``finally`` blocks further up the stack do not run. Never returns.
    """
    try:
        _flush_logging()
    finally:
        for stream in (sys.stdout, sys.stderr, sys.__stdout__, sys.__stderr__):
            _flush(stream)
        os._exit(code)


def _flush_logging() -> None:
    """Flush every handler of every logger (not ``logging.shutdown()``: closing handlers would
    break a caller that replaced ``os._exit``, as tests do)."""
    loggers = [logging.getLogger()] + [lg for lg in logging.Logger.manager.loggerDict.values()
                                       if isinstance(lg, logging.Logger)]
    for lg in loggers:
        for h in lg.handlers:
            _flush(h)


def _flush(obj) -> None:
    try:
        if obj is not None:
            obj.flush()
    except (OSError, ValueError):   # closed, or a broken pipe: nothing left to save
        pass


def ends_process(fn: F) -> F:
    """Decorate a process's entry function: when it returns, the process exits 0 through
    :func:`exit_process`; when it raises, the exception propagates (the launcher reports it).

    Use at module level (``@ends_process`` above ``def _worker``) so that ``spawn`` can pickle
    it by name. Call the decorated function only as a process's target: it never returns.
    """
    @functools.wraps(fn)
    def entry(*args, **kwargs):
        fn(*args, **kwargs)
        exit_process(0)

    return entry  # type: ignore[return-value]
