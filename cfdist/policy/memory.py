"""``MemoryEvery``: a two-tier decision - a memory snapshot every ``every`` steps, disk at the
wrapped policy's steps (Gemini-style per-iteration in-memory checkpoints).

A crashed worker then loses at most ``every`` iterations (the node's memory tier survives it),
while disk and shared storage are written only as often as the wrapped policy (``Auto``'s k)
finds worth its cost. Pure: :meth:`should_checkpoint` is a decision from the step number and the
wrapped policy's; :meth:`to_disk` answers for a step it decided. Every attribute it does not
define is the wrapped policy's: every hook of :class:`~cfdist.policy.base.Policy` but the two it
decides (``k``, ``mode``, ``bind``, ``proposal``, ``agreed``, ...) and any other attribute, so the
Checkpointer sees the wrapped policy; :meth:`observe` hands it only what its own (disk)
checkpoints cost.
"""

from __future__ import annotations

import dataclasses

from cfdist.policy.base import PolicyBase, PolicyContext, StepMeasurement, as_policy


class MemoryEvery(PolicyBase):
    """``MemoryEvery(Auto(), every=1)``; used by ``cfdist.fit(tiers=cfdist.TierOptions(memory_every=...))``."""

    def __init__(self, policy, every: int = 1):
        if not isinstance(every, int) or isinstance(every, bool) or every < 1:
            raise ValueError(f"memory_every must be an int >= 1 (steps between memory snapshots), got {every!r}")
        if isinstance(policy, MemoryEvery):
            policy = policy.policy
        self.policy = policy
        self.every = every
        self._disk: set[int] = set()

    def should_checkpoint(self, step: int, *, epoch_end: bool = False) -> bool:
        """True every ``every`` steps and at the wrapped policy's steps (called once per step)."""
        disk = bool(self.policy.should_checkpoint(step, epoch_end=epoch_end))
        if disk:
            self._disk.add(step)
            if len(self._disk) > 64:
                self._disk.discard(min(self._disk))
        return disk or step % self.every == 0

    def observe(self, m: StepMeasurement) -> None:
        """Hand the wrapped policy what its own checkpoints cost: a memory-only step is an
        ordinary step to it (no snapshot, no stall of its own: the memory snapshots' cost is
        part of every iteration, ``Ti``), and only persists of its steps report ``Ts``. Without
        this, ``Auto`` would find no clean step to profile and never choose its ``k``."""
        if m.step not in self._disk:
            m = dataclasses.replace(m, checkpointed=False, stall_s=0.0, snapshot_s=None, snapshot_device=None)
        if m.persist_s is not None and m.persist_step is not None and m.persist_step not in self._disk:
            m = dataclasses.replace(m, persist_s=None, persist_bytes=None, persist_step=None)
        self.policy.observe(m)

    def to_disk(self, step: int) -> bool:
        """Whether ``step``'s checkpoint also goes to disk (the wrapped policy chose it)."""
        return step in self._disk

    # ---- the wrapped policy's hooks (PolicyBase's defaults when it lacks them) ------------------
    k = property(lambda self: as_policy(self.policy).k)
    mode = property(lambda self: as_policy(self.policy).mode)
    mtbf_s = property(lambda self: as_policy(self.policy).mtbf_s)
    binds = property(lambda self: as_policy(self.policy).binds)

    def bind(self, ctx: PolicyContext) -> None:
        as_policy(self.policy).bind(ctx)

    def proposal(self) -> int:
        return as_policy(self.policy).proposal()

    def agreed(self, k: int, step: int) -> None:
        as_policy(self.policy).agreed(k, step)

    def profile_to_save(self) -> dict | None:
        return as_policy(self.policy).profile_to_save()

    def stats(self) -> dict:
        return as_policy(self.policy).stats()

    def __getattr__(self, name):
        if name in ("policy", "every", "_disk"):   # not set yet (unpickling): no recursion
            raise AttributeError(name)
        return getattr(self.policy, name)

    def __repr__(self) -> str:
        return f"MemoryEvery({self.policy!r}, every={self.every})"
