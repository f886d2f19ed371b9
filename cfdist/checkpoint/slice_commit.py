"""The sliced commit: how the writers' slices of one step become one committed checkpoint.

``writers="all"`` or N (:mod:`cfdist.checkpoint.slices` plans who writes which bytes). Every
writer runs :meth:`SliceCommit.run` for each checkpoint step, as a stage of its persist pipeline
(:class:`cfdist.checkpoint.pipeline.PersistPipeline`), on the pipeline's thread:

1. **plan / go.** Writer 0 (which swept the roots when its Checkpointer started) makes room for
   the step (a stale step directory of that number is moved aside or removed), then publishes
   ``slices/<step>/go`` with a staging tag. Only then does any writer write.
2. **slice durable.** Every writer writes its shard files (one per root: striping and slicing
   together) into the shared staging directory ``step-XXXXXXXXX.tmp-<tag>`` of each root (on
   object stores: the final prefix) and fsyncs them; writers 1..N-1 publish their part of the
   manifest (``slices/<step>/<w>``: files, roots, tensor entries), or the error that stopped them.
3. **commit once.** Writer 0 writes its own slice, waits for every other part, claims the
   step's *fate* (below), checks every file is in place and commits: the manifest, naming each
   file's writer, is the last write, as for one writer
   (:func:`cfdist.checkpoint.persist.write_checkpoint`).
4. **outcome.** Writer 0 publishes ``slices/<step>/outcome``; the other writers wait for it, so
   ``wait()`` and ``latest_step`` mean "committed" on every writer.

**Give up.** Any writer may give a step up (its ``persist_timeout_s`` ran out, or it failed):
:class:`Fate` is a one-time decision kept in the transport (``compare_set``), ``"commit"`` by
writer 0 right before its commit point or ``"abandon"`` by whoever gives up first. Whichever
comes first wins on every rank: a step one writer gave up can never be committed by writer 0,
and a writer whose give-up lost waits for the commit, which is imminent. Every wait of the
protocol is interrupted (``check``) as soon as the step was given up anywhere.

The protocol is written once, against :class:`Transport` (a few key-value calls). The c10d Store
of the training job is one transport (:class:`cfdist.checkpoint.agreement.Channel`: the writer
ranks of a Checkpointer with ``writers="all"``/N); Ray's key-value store is the other
(:class:`cfdist.cluster.kv.RayKV`: the node actors of a ``cfdist.fit`` run uploading a
shared-tier checkpoint in slices).

Every writer must see the same storage roots (writer 0 checks each file is in its staging
directory before committing). A writer that dies mid-write never publishes its part: writer 0's
wait times out (``agree_timeout_s``), nothing is committed, the previous checkpoint stays, and the
staging directory is swept at the next start.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import time
import uuid
from typing import Callable, Protocol

from cfdist.checkpoint.persist import CommitInfo, PersistJob
from cfdist.checkpoint.slices import SliceError

log = logging.getLogger("cfdist.slices")


class Transport(Protocol):
    """What the protocol needs from a key-value service every writer reaches. Thread-safe."""

    rank: int

    def set(self, rel: str, value: bytes) -> None: ...

    def get_all(self, rels: list[str], *, what: str, fix: str,
                interrupt: Callable[[], None] | None = None) -> list[bytes]:
        """Wait (bounded, with an error naming what is missing) for every key, then read them;
        ``interrupt()`` is called while waiting and may raise to stop the wait."""

    def delete(self, rels) -> None: ...

    def compare_set(self, rel: str, expected: str, desired: str) -> bytes:
        """Set ``rel`` to ``desired`` if it is unset (``expected == ""``) or equals ``expected``;
        returns the value it holds afterwards."""

    def peek(self, rel: str) -> bytes | None:
        """The value of ``rel`` now, or None when unset (never waits)."""


class Fate:
    """One sliced step's decision across ranks: writer 0 commits it, or a writer gives it up.

    :meth:`claim` (writer 0, right before its commit point) and :meth:`abandon` (any writer,
    on timeout) race through one ``compare_set``; the first wins everywhere, and each call is
    idempotent for its own side.
    """

    COMMIT, ABANDON = b"commit", b"abandon"
    _RECHECK_S = 0.05
    """How often :meth:`abandoned` asks the transport (it is called from wait loops)."""

    def __init__(self, transport: Transport, step: int):
        self._t, self.key = transport, f"slices/{step}/fate"
        self._seen: bytes | None = None
        self._asked = 0.0

    def claim(self) -> bool:
        self._seen = self._t.compare_set(self.key, "", self.COMMIT.decode())
        return self._seen == self.COMMIT

    def abandon(self) -> bool:
        self._seen = self._t.compare_set(self.key, "", self.ABANDON.decode())
        return self._seen == self.ABANDON

    def abandoned(self) -> bool:
        """Whether some writer gave the step up (asks the transport at most every 50 ms)."""
        if self._seen is None and time.monotonic() - self._asked >= self._RECHECK_S:
            self._asked = time.monotonic()
            self._seen = self._t.peek(self.key)
        return self._seen == self.ABANDON


class SliceCommit:
    """The protocol for one writer (``index`` of ``writers``); see the module docstring.

    Built once per Checkpointer on every writer rank; :meth:`run` is called by the persist
    pipeline, one step at a time, in step order.
    """

    def __init__(self, transport: Transport, *, index: int, writers: int, tag: str | None = None):
        self.t, self.index, self.writers = transport, index, writers
        self.tag = tag or uuid.uuid4().hex[:8]
        """Writer 0: the staging tag it hands out with each go."""
        self.committed_bytes = 0
        """Writer 0: the bytes of every slice of the step it committed last."""
        self._settled: list[int] = []   # writer 0: steps whose outcome every writer has read by now

    def fate(self, step: int) -> Fate:
        return Fate(self.t, step)

    def fail(self, step: int, why: str) -> None:
        """A writer that cannot even start its slice of ``step`` says so (writer 0 then does not
        commit the step; it does not wait for it either)."""
        self._report(step, {"error": f"writer {self.index} failed: {why}"})

    def forget(self, step: int) -> None:
        """Writer 0, once every writer has the outcome of ``step``: drop its last keys."""
        self.t.delete([f"slices/{step}/outcome", f"slices/{step}/fate"])

    def run(self, job: PersistJob, write: Callable[[PersistJob], CommitInfo], fate: Fate,
            check: Callable[[], None], on_go: Callable[[], None] = lambda: None) -> CommitInfo:
        """This writer's part of step ``job.step``: write its slice, then report it (writers
        1..N-1) or collect every slice and commit (writer 0). ``write(job)`` runs one write on
        the backend and returns its CommitInfo; ``check()`` raises once the step was given up;
        ``on_go()`` is called when the writers may write (writer 0 made room for the step: its
        own writer is up). Raises :class:`SliceError` when the step was not committed."""
        t = [time.perf_counter()]
        job.staging_tag = self._go(job, write, check)
        on_go()
        t.append(time.perf_counter())
        try:
            mine = write(dataclasses.replace(job, commit=False, writer=self.index, clear=False))
        except BaseException as e:
            self._report(job.step, {"error": f"writer {self.index} failed: {type(e).__name__}: {e}"})
            raise
        t.append(time.perf_counter())
        if self.index != 0:
            self._report(job.step, mine.slice)
            raw, = self.t.get_all([f"slices/{job.step}/outcome"], what=f"rank 0's commit of step {job.step}",
                                  fix="rank 0 may have died; the step is not committed, the previous "
                                      "checkpoint stays", interrupt=check)
            out = json.loads(raw)
            if "error" in out:
                raise SliceError(f"step {job.step} was not committed: {out['error']}")
            return mine
        return self._commit(job, mine, write, fate, check, t)

    def _go(self, job: PersistJob, write, check) -> str:
        """The step's staging tag, once writer 0 made room for the step (writer 0: does it)."""
        step = job.step
        if self.index == 0:
            try:
                write(dataclasses.replace(job, shards=[], arenas=[], commit=False))
            except BaseException as e:
                self._report(step, {"error": f"rank 0 could not prepare step {step}: {type(e).__name__}: {e}"})
                self.t.set(f"slices/{step}/go", json.dumps({"error": "see outcome"}).encode())
                raise
            self.t.set(f"slices/{step}/go", json.dumps({"tag": self.tag}).encode())
            return self.tag
        raw, = self.t.get_all([f"slices/{step}/go"], what=f"rank 0's go for writing step {step}",
                              fix="rank 0 may have died or stalled, or it was built with another writers=",
                              interrupt=check)
        go = json.loads(raw)
        if "tag" not in go:
            raise SliceError(f"step {step} is not written: rank 0 could not prepare it")
        return go["tag"]

    def _report(self, step: int, part: dict) -> None:
        self.t.set(f"slices/{step}/{self.index}" if self.index != 0 else f"slices/{step}/outcome",
                   json.dumps(part).encode())

    def _commit(self, job: PersistJob, mine: CommitInfo, write, fate: Fate, check, t: list) -> CommitInfo:
        step = job.step
        others = [f"slices/{step}/{w}" for w in range(1, self.writers)]
        try:
            parts = [json.loads(r) for r in self.t.get_all(
                others, what=f"the other writers' slices of step {step}",
                fix="a writer rank died or stalled while writing; the step is not committed, the "
                    "previous checkpoint stays (raise GroupOptions.agree_timeout_s if the storage is just slow)",
                interrupt=check)]
            bad = [p["error"] for p in parts if "error" in p]
            if bad:
                raise SliceError(f"step {step} is not committed: " + "; ".join(bad))
            t.append(time.perf_counter())
            if not fate.claim():
                raise SliceError(f"step {step} is not committed: a writer gave it up (PersistOptions.timeout_s) "
                                 f"before rank 0 could commit it")
            info = write(dataclasses.replace(job, shards=[], arenas=[], commit=True, clear=False,
                                             slices=[mine.slice] + parts))
        except BaseException as e:
            self._report(step, {"error": f"{type(e).__name__}: {e}"})
            self._settle(step, committed=False)
            raise
        finally:
            self.t.delete(others + [f"slices/{step}/go"])   # every writer read its go before its slice
        self._report(step, {"ok": True})
        self._settle(step, committed=True)
        self.committed_bytes = info.bytes
        t.append(time.perf_counter())
        log.debug("step %d committed by %d writers: go %.3fs, own slice %.3fs (%d bytes), others %.3fs, "
                  "commit %.3fs", step, self.writers, t[1] - t[0], t[2] - t[1], mine.bytes, t[3] - t[2], t[4] - t[3])
        return dataclasses.replace(info, bytes=mine.bytes, bytes_logical=mine.bytes_logical)

    def _settle(self, step: int, *, committed: bool) -> None:
        """Drop the outcome and fate keys of earlier steps once a later step committed: every
        writer read them before it wrote the step just committed."""
        if committed:
            for s in self._settled:
                self.t.delete([f"slices/{s}/outcome", f"slices/{s}/fate"])
            self._settled = []
        self._settled.append(step)
