"""The driver's JSONL event log: one record per line, ``{"t": wall_s, "event": name, ...}``.

The schema (names and keys) is the one :mod:`cfdist.chaos.metrics` reads; keep them::

    {"t": ..., "event": "start", "world_size": 4, "nodes": 2, "run": "resnet-spot"}
    {"t": ..., "event": "step", "step": 12, "loss": 0.41}
    {"t": ..., "event": "checkpoint_committed", "step": 12, "tier": "memory", "node": 0}
    {"t": ..., "event": "failure", "kind": "crash", "step": 15, "rank": 3, "node": 1}
    {"t": ..., "event": "detected"}
    {"t": ..., "event": "nodes_ready", "nodes": 2}
    {"t": ..., "event": "restarted", "world_size": 4, "reused": 4, "spare_wait_s": .., "spawn_s": .., "rendezvous_s": ..}
    {"t": ..., "event": "restored", "step": 12, "tier": "memory", "detect_s": .., "restart_s": .., "restore_s": ..}
    {"t": ..., "event": "resumed", "step": 13, "first_step_s": .., "recovery_s": ..}
    {"t": ..., "event": "end", "step": 40}

The phases of a recovery: detect (``failure`` to ``detected``), restart (``detected`` to
``restarted``; of which ``spawn_s`` starting or taking warm spare processes, ``reused`` of them
spares, and ``rendezvous_s`` the process group), restore (``restarted`` to ``restored``), first
step (``restored`` to ``resumed``); ``resumed.recovery_s`` is the failure to the first step.

Extra records (``decision``, ``notice``, ``resize``, ``schedule_started``: a failure schedule's
time 0, the first trained step) carry the controller's decisions with their
inputs; ``checkpoint_failed`` (``step``, ``errors``, ``error``) says a persist of rank 0 failed
while training went on; ``live_durable`` (``rank``, ``node``, ``step``, ``written`` or
``error``) says a survivor of a pool notice's group wrote the step it had kept in process to
its node's disk on the driver's request; readers ignore unknown events. ``t`` is ``time.time()`` and never decreases within a
log (a record stamped earlier than its predecessor is written with the predecessor's ``t``).

Thread-safety: :meth:`EventLog.emit` may be called from any driver thread.
"""

from __future__ import annotations

import json
import os
import threading
import time
from typing import Callable

from cfdist.storage.redact import redact

Listener = Callable[[dict], None]


class EventLog:
    """Appends records to a JSONL file (or only to memory with ``path=None``) and fans them out
    to listeners (the progress bar). Call from the driver process."""

    def __init__(self, path: str | None, *, clock: Callable[[], float] = time.time):
        self.path = path
        self.records: list[dict] = []
        self._clock = clock
        self._lock = threading.Lock()
        self._last_t = -float("inf")
        self._listeners: list[Listener] = []
        self._f = None
        if path:
            parent = os.path.dirname(os.path.abspath(path))
            os.makedirs(parent, exist_ok=True)
            self._f = open(path, "a", encoding="utf-8")

    def subscribe(self, listener: Listener) -> None:
        """Call ``listener(record)`` for every later record (on the emitting thread)."""
        self._listeners.append(listener)

    def emit(self, event: str, *, t: float | None = None, **fields) -> dict:
        """Write one record now (``t`` defaults to the clock) and return it."""
        with self._lock:
            t = self._clock() if t is None else t
            t = max(t, self._last_t)
            self._last_t = t
            rec = {"t": round(t, 6), "event": event,
                   **{k: redact(v) if isinstance(v, str) else v for k, v in fields.items()}}
            self.records.append(rec)
            if self._f is not None:
                self._f.write(redact(json.dumps(rec, default=str)) + "\n")   # nested values too
                self._f.flush()
        for fn in self._listeners:
            try:
                fn(rec)
            except Exception:  # noqa: BLE001 - a display bug must not stop training
                pass
        return rec

    def of(self, event: str) -> list[dict]:
        """The records of one kind written so far (tests, summaries)."""
        with self._lock:
            return [r for r in self.records if r["event"] == event]

    def close(self) -> None:
        with self._lock:
            if self._f is not None:
                self._f.close()
                self._f = None
