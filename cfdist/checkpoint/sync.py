"""Carry a policy's few numbers on DDP's gradient all-reduce: agreement without a collective.

Rank-local measurements decide the checkpoint interval, yet every rank must checkpoint the same
steps. :func:`attach_sync_hook` registers a DDP communication hook that does exactly what
``default_hooks.allreduce_hook`` does (divide the bucket by the world size, all-reduce with SUM)
and, on bucket 0 only, appends a short tail to the all-reduced tensor:

* one marker ``1`` from every rank (the sum must equal the world size: a sanity check);
* the policy's payload (``policy.sync_payload()``, ``policy.sync_width`` non-negative ints) as
  base-16 digits, from rank 0; every other rank contributes zeros, so the sum is rank 0's value.

Digits are integers below 16, exact in every floating dtype DDP buckets use (fp32, fp16, bf16),
and ``x + 0 + ... + 0 == x`` exactly. The gradient part of the tensor is copied back into the
bucket untouched: with two ranks the result is bit-identical to the default hook (a sum of two
numbers does not depend on order); with more ranks a reduction algorithm may add the ranks in a
different order for a longer tensor, which can change the last bit of some gradients in bucket 0
-- the same in every run, so resumed and uninterrupted runs still agree.

The tail is read after the backward, on the training thread: ``fetch()`` (handed to the policy
by ``policy.sync_attached(fetch)``) returns the tuple carried by the latest all-reduce. All
ranks read it before the same ``ckpt.step``, so they apply it at the same step number.

Calling rules: attach once per DDP model, before the first backward, on every rank, with
``world_size > 1``. DDP allows one comm hook per model: if you registered your own (or a built-in
one such as ``fp16_compress_hook``), :func:`attach_sync_hook` raises :class:`SyncHookError`;
opt out with ``cfdist.Auto(sync=False)`` or use a fixed policy (``cfdist.Every(k)``).
"""

from __future__ import annotations

import logging
import threading

import torch
import torch.distributed as dist

log = logging.getLogger("cfdist.sync")

BASE = 16
DIGITS = 8
"""Digits per carried int: values up to 16**8 - 1 (about 4.3e9)."""


class SyncHookError(RuntimeError):
    """The carrier hook could not be attached (another comm hook is there, or no DDP model)."""


def encode(values, width: int) -> list[float]:
    """``width`` ints -> ``width * DIGITS`` base-16 digits, most significant first. Pure."""
    vals = list(values)
    if len(vals) != width:
        raise ValueError(f"sync payload has {len(vals)} values, the policy declared sync_width={width}")
    out: list[float] = []
    for v in vals:
        v = int(v)
        if not 0 <= v < BASE ** DIGITS:
            raise ValueError(f"sync payload value {v} is outside [0, {BASE ** DIGITS})")
        out.extend(float((v // BASE ** (DIGITS - 1 - i)) % BASE) for i in range(DIGITS))
    return out


def decode(digits, width: int) -> tuple[int, ...]:
    """Inverse of :func:`encode` (rounds each digit: they are exact integers). Pure."""
    ds = [int(round(float(d))) for d in digits]
    if len(ds) != width * DIGITS:
        raise ValueError(f"expected {width * DIGITS} digits, got {len(ds)}")
    out = []
    for j in range(width):
        v = 0
        for d in ds[j * DIGITS:(j + 1) * DIGITS]:
            v = v * BASE + d
        out.append(v)
    return tuple(out)


class _Carrier:
    """Hook state: the policy, the staged tail of the latest all-reduce, and how to read it."""

    def __init__(self, policy, process_group, world_size: int, rank: int):
        self.policy = policy
        self.group = process_group
        self.world_size = world_size
        self.rank = rank
        self.width = int(policy.sync_width)
        self._lock = threading.Lock()
        self._tail: torch.Tensor | None = None
        self._event = None
        self._warned = False
        self.rounds = 0

    def stage(self, tail: torch.Tensor) -> None:
        """Called in the all-reduce's callback: keep the tail without waiting for the device."""
        if tail.is_cuda:
            host = torch.empty(tail.shape, dtype=tail.dtype, pin_memory=True)
            host.copy_(tail, non_blocking=True)
            ev = torch.cuda.Event()
            ev.record()
        else:
            host, ev = tail.clone(), None
        with self._lock:
            self._tail, self._event = host, ev
            self.rounds += 1

    def fetch(self) -> tuple[int, ...] | None:
        """The payload carried by the latest all-reduce, or None before the first one."""
        with self._lock:
            tail, ev = self._tail, self._event
        if tail is None:
            return None
        if ev is not None:
            ev.synchronize()
        vals = tail.float().tolist()
        if int(round(vals[0])) != self.world_size:
            if not self._warned:
                self._warned = True
                log.error("sync tail marker is %s, expected the world size %d: ranks disagree on the "
                          "bucket layout; ignoring carried values", vals[0], self.world_size)
            return None
        return decode(vals[1:], self.width)


def _carry_hook(state, bucket):
    # (no annotations: DDP checks them by identity, and this module's are strings)
    buf = bucket.buffer()
    buf.div_(state.world_size)  # first, as the default hook does (avoids fp16 overflow)
    if bucket.index() != 0:
        return (dist.all_reduce(buf, group=state.group, async_op=True).get_future()
                .then(lambda fut: fut.value()[0]))
    payload = state.policy.sync_payload() if state.rank == 0 else (0,) * state.width
    tail = torch.tensor([1.0] + encode(payload, state.width), dtype=buf.dtype, device=buf.device)
    n = buf.numel()
    joined = torch.cat([buf, tail])

    def split(fut):
        out = fut.value()[0]
        buf.copy_(out[:n])
        state.stage(out[n:])
        return buf

    return dist.all_reduce(joined, group=state.group, async_op=True).get_future().then(split)


def attach_sync_hook(ddp_model, policy) -> bool:
    """Register the carrier hook on ``ddp_model`` for ``policy``; True when attached.

    Returns False (and does nothing) when the policy has no carrier protocol (``Every``,
    ``EveryEpoch``), opted out (``Auto(sync=False)``), or the group has a single rank; returns
    True without re-registering when this policy's hook is already on the model. Raises
    :class:`SyncHookError` when the model is not DDP or already has another comm hook.
    Call on every rank, before the first backward.
    """
    if not hasattr(policy, "sync_payload") or not hasattr(policy, "sync_attached"):
        return False
    cfg = getattr(policy, "config", None)
    if cfg is not None and getattr(cfg, "sync", True) is False:
        return False
    model = getattr(ddp_model, "_orig_mod", ddp_model)  # torch.compile wrapper
    if not isinstance(model, torch.nn.parallel.DistributedDataParallel):
        raise SyncHookError(f"attach_sync_hook needs a DistributedDataParallel model, got {type(ddp_model).__name__}")
    group = model.process_group
    world = dist.get_world_size(group)
    if world <= 1:
        return False
    for hook, state in getattr(model, "_comm_hooks", []):
        if hook is _carry_hook and state.policy is policy:
            return True
    others = [getattr(h, "__qualname__", repr(h)) for h, _ in getattr(model, "_comm_hooks", [])]
    if others:
        raise SyncHookError(_conflict(others))
    carrier = _Carrier(policy, group, world, dist.get_rank(group))
    try:
        model.register_comm_hook(carrier, _carry_hook)
    except RuntimeError as e:  # a built-in hook (register_builtin_comm_hook) is already there
        raise SyncHookError(_conflict([str(e)])) from e
    policy.sync_attached(carrier.fetch)
    return True


def _conflict(others) -> str:
    return (f"the DDP model already has a communication hook ({', '.join(others)}), and DDP allows "
            f"one; cfdist.Auto carries rank 0's checkpoint interval on the gradient all-reduce "
            f"through its own hook. Fix: register no hook of your own, or pass "
            f"policy=cfdist.Auto(sync=False) (k then comes from the cached profile, fixed) or "
            f"policy=cfdist.Every(k)")
