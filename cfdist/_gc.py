"""No cyclic garbage collection while a cfdist process imports torch: a quarter of its start-up.

Importing torch, Ray and cfdist creates some 300,000 long-lived Python objects, and every 25 %
more of them makes CPython run a full (generation 2) collection that walks them all: 20 to 180 ms
each, several per import. Measured on the 2-core development machine: a warm spare's start
spent ~0.5 CPU-seconds of its ~2.5 in such collections, a standby checkpoint actor's ~0.2 of its
~2, and the first DDP's imports (``torch._dynamo``: ~830 modules) two collections of 120-180 ms.
A preparation runs beside the training (:mod:`cfdist.cluster.niceness`), so that time is time
the ranks' steps run slower.

So a cfdist-owned process collects nothing while it imports, then **freezes** what it imported
(:func:`gc.freeze`: moved to a permanent generation that later collections do not walk) and
collects again as usual:

- a preparation's process (its actor options set :data:`ENV`; :func:`cfdist.cluster.niceness.prepared_options`)
  stops collecting at ``import cfdist``, its first cfdist code, and :func:`settle` in its
  actor's constructor freezes and resumes;
- :func:`imports` does the same around a block that imports (a spare's warm-up: the first DDP).

Frozen objects are never collected as cyclic garbage: what the imports built stays for the
process's life, as modules do anyway. A later full collection in the process walks only what it
created since: a few milliseconds instead of ~160 (a rank that was a spare no longer stalls its
group's step when one runs). This module imports nothing outside the standard library: the
package's ``__init__`` runs it first.
"""

from __future__ import annotations

import contextlib
import gc
import os

ENV = "CFDIST_PREPARATION"
"""Set (to ``"1"``) in a preparation's environment: its imports run without collections."""

_deferred = False


def defer_if_preparation() -> None:
    """Stop collecting in a preparation's process (:data:`ENV` set) until :func:`settle`. The
    variable is taken out of the environment: a process this one starts later (a data loader's
    spawned worker importing cfdist) collects as usual."""
    global _deferred
    if os.environ.pop(ENV, None) == "1" and gc.isenabled() and not _deferred:
        gc.disable()
        _deferred = True


def settle() -> bool:
    """After a preparation's imports: freeze what they built and collect again as usual.
    Returns whether collection had been deferred (False: nothing changed)."""
    global _deferred
    if not _deferred:
        return False
    _deferred = False
    gc.freeze()
    gc.enable()
    return True


@contextlib.contextmanager
def imports():
    """A block that imports many modules: no collection inside; what it built is frozen after
    (also when it raises); collection resumes if it ran before."""
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        gc.freeze()
        if was:
            gc.enable()
