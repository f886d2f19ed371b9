"""A transport for the sliced-commit protocol over Ray: the cluster's key-value store (GCS).

:class:`~cfdist.checkpoint.slice_commit.SliceCommit` is written once, against a few key-value
calls (:class:`~cfdist.checkpoint.slice_commit.Transport`). Inside a training job the c10d Store
carries them; between the node actors of a ``cfdist.fit`` run (a shared-tier upload in slices)
this module does, through Ray's internal key-value store, which every worker and actor of the
cluster reaches without handles or extra actors.

Keys live in a namespace of their own per upload (``cfdist-slices/<run>/<step>/<tag>``) and are
deleted by the protocol; a failed upload leaves a few small keys, removed with the cluster.
"""

from __future__ import annotations

import time
from typing import Callable

from ray.experimental import internal_kv

from cfdist.checkpoint.agreement import AgreementError

_POLL_FIRST_S, _POLL_MAX_S = 0.002, 0.05
"""How often a waiting writer asks the GCS: from 2 ms, doubling to 50 ms (one RPC each)."""


class RayKV:
    """One sliced upload's keys in Ray's key-value store. Thread-safe; any Ray process.

    ``rank``: this writer's index (named in errors); ``timeout_s``: how long :meth:`get_all`
    waits before raising ``AgreementError`` naming the missing keys.
    """

    def __init__(self, namespace: str, *, rank: int, timeout_s: float):
        self.namespace, self.rank, self.timeout_s = namespace, rank, timeout_s

    def set(self, rel: str, value: bytes) -> None:
        internal_kv._internal_kv_put(rel, value, overwrite=True, namespace=self.namespace)

    def peek(self, rel: str) -> bytes | None:
        return internal_kv._internal_kv_get(rel, namespace=self.namespace)

    def delete(self, rels) -> None:
        for rel in rels:
            internal_kv._internal_kv_del(rel, namespace=self.namespace)

    def compare_set(self, rel: str, expected: str, desired: str) -> bytes:
        if expected != "":
            raise ValueError("RayKV.compare_set sets only unset keys (expected='')")
        internal_kv._internal_kv_put(rel, desired.encode(), overwrite=False, namespace=self.namespace)
        return self.peek(rel)

    def get_all(self, rels: list[str], *, what: str, fix: str,
                interrupt: Callable[[], None] | None = None) -> list[bytes]:
        t0, pause = time.monotonic(), _POLL_FIRST_S
        while True:
            got = [self.peek(r) for r in rels]
            if all(v is not None for v in got):
                return got
            if time.monotonic() - t0 >= self.timeout_s:
                missing = [r for r, v in zip(rels, got) if v is None]
                raise AgreementError(f"writer {self.rank} waited {self.timeout_s:g} s for {what} and did not get "
                                     f"{', '.join(missing)} (namespace {self.namespace}); {fix}")
            if interrupt is not None:
                interrupt()
            time.sleep(pause)
            pause = min(pause * 2, _POLL_MAX_S)
