"""``cfdist.testing``: fault-injecting storage, to test that your own training survives bad storage.

Not used by cfdist's product code (the layer test in ``tests/unit/test_layers.py`` keeps it so):
this is what cfdist's own tests, benchmarks and experiments use to make storage slow, full, flaky,
hung, torn, lagging or denied, published so that users can run the same checks on their training
loop. Each wrapper is a :class:`~cfdist.storage.Storage` around a real one (the bytes really land
on the backend) and can be handed to anything that takes a Storage::

    from cfdist.storage import open_storage
    from cfdist.testing import faulty, flaky

    st = faulty(open_storage("file:///tmp/ckpt"), fail_after_bytes=1 << 20)   # a disk that fills up
    ckpt = cfdist.Checkpointer(state, st, cfdist.Every(10))
    ...                                     # train: persists fail, training goes on, errors show
    st.heal()                               # the disk has room again: the next persist commits

    flaky_reads = flaky(open_storage(url), match="step-*/*", failures=2)   # two EIOs, then fine
    cfdist.Checkpointer(state, flaky_reads).restore()                      # retried, not rolled back

Wrappers nest (``throttle(faulty(st), factor=3)``), are thread-safe within one process, and are
created in the process that writes (a pickled copy lives on its own). See
:mod:`cfdist.testing.faults` for what each one alters and its switches and counters.
"""

from cfdist.testing.faults import (
    DeniedStorage, FaultyStorage, FlakyStorage, HangingStorage, LaggingStorage, StorageWrapper, ThrottledStorage,
    TornStorage, denied, faulty, flaky, hang, lagging, throttle, torn,
)

__all__ = ["StorageWrapper", "ThrottledStorage", "FaultyStorage", "FlakyStorage", "throttle", "faulty", "flaky",
           "HangingStorage", "hang", "TornStorage", "torn", "LaggingStorage", "lagging", "DeniedStorage", "denied"]
