"""Agreement between ranks through the c10d Store, out of band of the training process group.

Every ``torch.distributed`` job has a key-value Store (the one ``init_process_group`` rendezvoused
on). Ranks that must agree on something the training loop does not already synchronise use it,
never a collective on the training group and never the gradients (invariant 4):

* :class:`Frequency` -- which steps are checkpoint steps. Rank 0 alone measures and decides
  ``k``; it publishes its decision for the steps ``[first + (j+1)L, first + (j+2)L)`` (window
  ``j+1``, ``L`` = ``lookahead``) when it reaches the first step of window ``j``; every other rank
  reads window ``j``'s value when it reaches that window's first step. The value was set at
  least ``L`` steps earlier, so in a job whose ranks move in step (any data-parallel job) the
  read never waits: one ``wait`` + ``get`` round trip per ``L`` steps. A decision takes effect
  ``L`` to ``2L`` steps after rank 0 made it, at the same step on every rank, rank 0 included.
  Save requests (:meth:`Frequency.request_save`, any rank) travel the same way.
* :class:`RngExchange` -- each rank's RNG states at a checkpoint step, for the writers: every
  rank sets ``rng/<step>/<rank>`` at the boundary instant; each writer collects all of them as
  the first stage of its persist pipeline (:mod:`cfdist.checkpoint.pipeline`); the last writer
  to read a step's keys deletes them.
* :func:`agree_restore` -- once per start: every rank publishes which committed steps it can list,
  every rank tries the newest step any of them holds, they exchange the outcome, ranks that lack
  it (or hold a corrupted copy) get it from a rank that loaded it (:mod:`cfdist.checkpoint.peer`,
  over the default group, at restore only), and all restore the same step or all raise the same
  :class:`~cfdist.checkpoint.format.CheckpointError` naming what each rank holds.

Calling rules. Every rank builds the same Checkpointers in the same order (keys are namespaced
per Checkpointer by a per-rank counter in the store, ``cfdist/<n>/...``) and calls ``step``,
``save`` and ``restore`` at the same steps. Ranks may run apart by up to ``L`` steps without
waiting, and by up to :data:`KEEP_WINDOWS` windows before a read finds its key deleted. Every
wait has a timeout (``agree_timeout_s``) and then raises :class:`AgreementError` naming this rank,
the keys and the ranks that did not publish. Store clients are thread-safe (c10d's TCPStore,
FileStore and HashStore serialise their operations), so the RNG collector thread and the
training thread share one. Without torch.distributed (one process) no store is needed:
:class:`Frequency` hands rank 0's value over at once.
"""

from __future__ import annotations

import json
import logging
import time
from typing import Callable

from cfdist.checkpoint.format import CheckpointError

log = logging.getLogger("cfdist.agreement")

KEEP_WINDOWS = 64
"""Rank 0 deletes a window's key this many windows after publishing it."""


class AgreementError(RuntimeError):
    """Ranks could not agree through the store in time (a rank died, stalled or skipped a call)."""


def default_store():
    """The default process group's Store, or None when torch.distributed is not initialised."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return None
    return dist.distributed_c10d._get_default_store()


class Channel:
    """One Checkpointer's namespace in a Store: ``cfdist/<n>/<key>``, waits with clear errors.

    ``n`` counts the Checkpointers this rank built on this store (one ``add`` at construction),
    so the n-th Checkpointer of every rank shares a namespace. Thread-safe.
    """

    def __init__(self, store, *, rank: int, world_size: int, timeout_s: float):
        self.store, self.rank, self.world_size, self.timeout_s = store, rank, world_size, timeout_s
        n = store.add(f"cfdist/checkpointers/{rank}", 1)
        self.prefix = f"cfdist/{n}/"
        self.waited_s = 0.0

    def key(self, rel: str) -> str:
        return self.prefix + rel

    def set(self, rel: str, value: bytes) -> None:
        self.store.set(self.key(rel), value)

    def add(self, rel: str, n: int) -> int:
        return self.store.add(self.key(rel), n)

    def delete(self, rels) -> None:
        for rel in rels:
            self.store.delete_key(self.key(rel))

    def compare_set(self, rel: str, expected: str, desired: str) -> bytes:
        """Set ``rel`` to ``desired`` if unset (``expected == ""``) or equal to ``expected``;
        the value it holds afterwards. Atomic in the store."""
        return self.store.compare_set(self.key(rel), expected, desired)

    def peek(self, rel: str) -> bytes | None:
        """The value of ``rel`` now, or None when unset (never waits)."""
        k = self.key(rel)
        return self.store.get(k) if self.store.check([k]) else None

    def get_all(self, rels: list[str], *, what: str, fix: str,
                interrupt: Callable[[], None] | None = None) -> list[bytes]:
        """Wait (up to the timeout) for every key, then read them; ``AgreementError`` names
        the keys still missing, what they were for and how to fix it. ``interrupt()`` is
        called between polls and may raise to stop waiting (a persist given up)."""
        keys = [self.key(r) for r in rels]
        t0 = time.perf_counter()
        pause, why = _POLL_FIRST_S, "timed out"
        try:
            # Polled with check(), never a blocking store.wait(): one Store client serves every
            # thread of the process (the training thread's agreement, the RNG exchange and the
            # sliced commit on background threads), and a client waiting holds its connection:
            # another thread's add() would wait behind it while the rank it waits for waits in a
            # collective for this one (seen: a 9 s stall until the next failure broke it).
            while not self.store.check(keys):
                if time.perf_counter() - t0 >= self.timeout_s:
                    break
                if interrupt is not None:
                    interrupt()
                time.sleep(pause)
                pause = min(pause * 2, _POLL_MAX_S)
            else:
                return [self.store.get(k) for k in keys]
        except RuntimeError as e:   # DistStoreError: the store went away
            why = f"{type(e).__name__}: {str(e).strip()[:200]}"
        finally:
            self.waited_s += time.perf_counter() - t0
        missing = [k for k in keys if not _present(self.store, k)]
        raise AgreementError(
            f"rank {self.rank} waited {self.timeout_s:g} s for {what} and did not get "
            f"{', '.join(missing) or ', '.join(keys)} ({why}); {fix}")


_POLL_FIRST_S, _POLL_MAX_S = 0.0002, 0.005
"""How often a waiting rank checks the Store: from 0.2 ms, doubling to 5 ms (a check is one
round trip on loopback, ~10-50 us)."""


def _present(store, key: str) -> bool:
    try:
        return bool(store.check([key]))
    except RuntimeError:
        return False


class Frequency:
    """Which steps are checkpoint steps, the same on every rank (see the module docstring).

    Call :meth:`at_step` once per ``ckpt.step``, on every rank, on the training thread, before
    the policy's ``should_checkpoint(step)``. ``channel=None`` (one process): rank 0's proposal
    and save requests apply at once.
    """

    def __init__(self, channel: Channel | None, *, rank: int = 0, lookahead: int = 8):
        self.ch, self.rank, self.L = channel, rank, lookahead
        self._first: int | None = None
        self._current: dict = {"k": 0, "save": None}
        self._next: dict | None = None          # rank 0: what it published for the next window
        self._requested = False
        self._requests_seen = 0
        self.reads = 0

    def describe(self) -> str:
        if self.ch is None:
            return "local: one process, rank 0's k applies at once"
        return (f"c10d store: rank 0 publishes k every {self.L} steps, in force {self.L}-{2 * self.L} "
                f"steps after it decided; no collective on the training group")

    def request_save(self) -> None:
        """Ask for a checkpoint at a step every rank agrees on (<= 2L steps away). Training thread."""
        if self.ch is not None and self.rank != 0 and not self._requested:
            self.ch.add("save_requests", 1)   # rank 0 reads the counter at its next window
        self._requested = True

    def at_step(self, step: int, proposal: Callable[[], int]) -> tuple[int, bool]:
        """``(k, save_now)`` in force at ``step``: the agreed k (0: none yet) and whether a
        requested save falls on this step."""
        if self.ch is None:
            save, self._requested = self._requested, False
            return int(proposal() or 0), save
        if self._first is None:
            self._first = step
        rel = step - self._first
        if rel % self.L == 0:
            j = rel // self.L
            if self.rank == 0:
                self._current = self._next or {"k": 0, "save": None}
                self._next = self._publish(j + 1, proposal)
            elif j >= 1:
                raw, = self.ch.get_all([f"k/{j}"], what=f"rank 0's checkpoint interval for steps from {step}",
                                       fix="rank 0 may have died or stalled, or ranks call ckpt.step() "
                                           "a different number of times")
                self._current = json.loads(raw)
                self.reads += 1
        return int(self._current["k"]), self._current["save"] == step

    def _publish(self, j: int, proposal) -> dict:
        n = self.ch.add("save_requests", 0)
        save = None
        if self._requested or n > self._requests_seen:
            save, self._requested, self._requests_seen = self._first + j * self.L, False, n
        value = {"k": int(proposal() or 0), "save": save}
        self.ch.set(f"k/{j}", json.dumps(value).encode())
        if j > KEEP_WINDOWS:
            self.ch.delete([f"k/{j - KEEP_WINDOWS}"])
        return value


class RngExchange:
    """Every rank's RNG states at a checkpoint step, handed to the writers through the store."""

    def __init__(self, channel: Channel, *, writer: bool):
        self.ch = channel
        self.ch.add("writers", int(writer))

    def publish(self, step: int, rng: dict) -> None:
        """This rank's RNG (flattened, JSON-able) at the boundary of ``step``. Training thread."""
        self.ch.set(f"rng/{step}/{self.ch.rank}", json.dumps(rng).encode())

    def collect(self, step: int, own: dict, interrupt: Callable[[], None] | None = None) -> list[dict]:
        """Every rank's RNG at ``step`` (``own`` for this rank), in rank order. Blocking: call
        from a background thread (the persist pipeline's first stage); ``interrupt`` as for
        :meth:`Channel.get_all`. The last writer to collect a step deletes its keys."""
        ranks = [r for r in range(self.ch.world_size) if r != self.ch.rank]
        raws = self.ch.get_all([f"rng/{step}/{r}" for r in ranks], what=f"the RNG states of step {step}",
                               fix="every rank must take the same checkpoints: call ckpt.save() on "
                                   "every rank at the same step, or ckpt.request_save() on any rank",
                               interrupt=interrupt)
        out = dict(zip(ranks, (json.loads(r) for r in raws)))
        out[self.ch.rank] = own
        if self.ch.add(f"rng/{step}/read", 1) >= self.ch.add("writers", 0):
            self.ch.delete([f"rng/{step}/{r}" for r in range(self.ch.world_size)] + [f"rng/{step}/read"])
        return [out[r] for r in range(self.ch.world_size)]


def agree_restore(channel: Channel | None, *, held: list[int], want: int | None,
                  try_load: Callable[[int], str | None], call: int,
                  fetch: Callable[[int, int, bool], None] | None = None) -> int | None:
    """The step every rank restores (None: none anywhere, all start fresh), or CheckpointError.

    ``held``: the committed steps this rank lists; ``try_load(step)`` loads and verifies one
    (keeping it to apply) and returns None or why it is unusable (an older step may do), or
    raises ``CheckpointError`` when no step can do (it does not fit the live objects), or an
    ``OSError`` when its storage stays down (the step may be intact: nothing is rolled back past
    it); every rank then raises, naming this one. ``fetch(step, src, need)``: a collective every
    rank calls that copies ``step`` from rank ``src`` to the ranks with ``need`` (after which their ``try_load``
    finds it); ``call``: this Checkpointer's restore count (a fresh namespace per call).

    Every rank calls it once per ``restore``, with the same ``want``. Candidates are the steps
    any rank holds (only ``want`` when given), newest first. Every rank tries each; when some
    loaded it and others could not, those get it from the lowest such rank (``fetch``) and try
    again. A step is restored only when every rank loaded it; every rank sees the same outcomes,
    so all restore the same step or all raise.
    """
    me = 0 if channel is None else channel.rank
    mine = sorted(set(held), reverse=True)
    if channel is None:
        views = {0: mine}
    else:
        channel.set(f"restore/{call}/held/{me}", json.dumps(mine).encode())
        raws = channel.get_all([f"restore/{call}/held/{r}" for r in range(channel.world_size)],
                               what="every rank's list of checkpoints to restore",
                               fix="call ckpt.restore() on every rank")
        views = {r: json.loads(v) for r, v in enumerate(raws)}
    union = sorted(set().union(*(set(v) for v in views.values())), reverse=True)
    rejected: dict[int, dict] = {}
    for i, step in enumerate(s for s in union if want is None or s == want):
        bad = _try_everywhere(channel, f"restore/{call}/try/{i}", step, try_load)
        if bad and fetch is not None and channel is not None and len(bad) < channel.world_size:
            src = min(r for r in range(channel.world_size) if r not in bad)
            log.warning("step %d: ranks %s get it from rank %d (%s)", step, sorted(bad), src,
                        "; ".join(f"rank {r}: {w}" for r, w in sorted(bad.items())))
            fetch(step, src, me in bad)
            again = _try_everywhere(channel, f"restore/{call}/peer/{i}", step,
                                    try_load if me in bad else (lambda s: None))
            bad = {r: f"{bad[r]}; its copy from rank {src}: {w}" for r, w in again.items()}
        if not bad:
            return step
        rejected[step] = bad
        log.warning("step %d is unusable on rank(s) %s; every rank tries an older one", step,
                    ", ".join(f"{r} ({w})" for r, w in sorted(bad.items())))
    if want is None and not union:
        return None
    lines = [f"rank {r} holds {v or 'nothing'}" for r, v in sorted(views.items())]
    lines += [f"step {s} failed on rank {r}: {w}" for s, bad in rejected.items() for r, w in sorted(bad.items())]
    what = f"step {want}" if want is not None else "a checkpoint"
    if channel is None:
        raise CheckpointError(f"no usable checkpoint ({what} wanted):\n  " + "\n  ".join(lines))
    raise CheckpointError(
        f"no usable checkpoint that every rank can load ({what} wanted); no rank trains, since "
        f"ranks on different states would diverge:\n  " + "\n  ".join(lines) + "\nFix: restore from "
        "a storage that holds an intact copy (restore_from=), or start afresh in an empty storage")


def _try_everywhere(channel: Channel | None, key: str, step: int, try_load) -> dict[int, str]:
    """Every rank's ``try_load(step)``; returns ``{rank: why}`` for the ranks that failed."""
    hard = None
    try:
        mine = [try_load(step), False]
    except (CheckpointError, OSError) as e:   # OSError: storage still down after the retries
        hard, mine = e, [str(e), True]
    if channel is None:
        if hard is not None:
            raise hard
        outcome = {0: mine}
    else:
        channel.set(f"{key}/{channel.rank}", json.dumps(mine).encode())
        if hard is not None:
            raise hard
        raws = channel.get_all([f"{key}/{r}" for r in range(channel.world_size)],
                               what=f"every rank's outcome of loading step {step}",
                               fix="a rank may have died while loading")
        outcome = {r: json.loads(v) for r, v in enumerate(raws)}
        for r, (why, is_hard) in sorted(outcome.items()):
            if is_hard:
                raise CheckpointError(f"rank {r} cannot restore step {step}, so no rank does: {why}")
    return {r: why for r, (why, _) in outcome.items() if why is not None}
