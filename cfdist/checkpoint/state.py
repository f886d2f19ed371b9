"""The user's state dict: what each entry is, when it is captured, how it is restored.

Entries are captured at two instants of the same step boundary (invariant 3):

* **early** (right after ``optimizer.step()``, inside ``ckpt.step``): modules, optimizers and
  tensors (their tensors are copied by the snapshot), data iterators (their position is
  "after batch i" only before the next batch is fetched), and ``GradScaler`` objects (updated inside
  ``ckpt.step(opt, scaler)``; the next iteration's ``scaler.scale`` reads them). Of these, what
  a forward mutates in place (:func:`mutable_in_forward`) is copied before ``ckpt.step``
  returns, the rest while the next iteration runs;
* **late** (at the boundary: before the next batch is fetched, before the next forward, or at
  the next checkpointer call, whichever comes first): everything else with a ``state_dict``
  (schedulers step *after* ``ckpt.step``), plain values, the optimizers' ``param_groups``
  (a scheduler rewrites their ``lr``), and the RNG states. The RNG is captured early instead
  when no data iterator announces the next fetch (``register_before_next_hook``): the next
  forward comes after that fetch, which may already have drawn from the RNG (augmentation).

RNG states are per rank: every rank captures its own (torch CPU, CUDA when initialised, numpy,
python), the writers collect them all (``rngs`` in the manifest, one per rank) and each rank
restores its own (:func:`rank_rng_state`). So are module buffers (BatchNorm statistics: each
replica's forward updates them with its own batch): in a multi-rank job each rank's entry in
``rngs`` also holds its own (``"buffers"``, :func:`rank_buffers`), and each rank restores them
over the writer's (:func:`with_rank_buffers`). Without them a rank >= 1 would hold the writer's
statistics until DDP broadcasts rank 0's at the next forward -- for ever, when a finished job
is re-run and restores its last step.
"""

from __future__ import annotations

import copy
import random
from typing import Any

import numpy as np
import torch

from cfdist.checkpoint.flatten import flatten, unflatten
from cfdist.checkpoint.format import CheckpointError

EARLY, LATE = "early", "late"


def is_data_iterator(obj: Any) -> bool:
    return hasattr(obj, "state_dict") and hasattr(obj, "__iter__") and not isinstance(obj, torch.nn.Module)


def classify(state: dict) -> dict[str, str]:
    """``{key: "early"|"late"}``; ``TypeError`` naming the key for objects that cannot be saved."""
    if not isinstance(state, dict) or not state:
        raise TypeError("state must be a non-empty dict such as {'model': model, 'optim': optimizer}")
    kinds = {}
    for k, v in state.items():
        if not isinstance(k, str) or "/" in k or not k:
            raise TypeError(f"state key {k!r} must be a non-empty str without '/'")
        if isinstance(v, (torch.nn.Module, torch.optim.Optimizer, torch.Tensor, torch.amp.GradScaler)) \
                or is_data_iterator(v):
            kinds[k] = EARLY
        elif hasattr(v, "state_dict") and hasattr(v, "load_state_dict"):
            kinds[k] = LATE
        elif v is None or isinstance(v, (bool, int, float, str, list, tuple, dict, np.ndarray)):
            kinds[k] = LATE
        else:
            raise TypeError(
                f"state[{k!r}] is a {type(v).__name__} without state_dict()/load_state_dict(); "
                f"pass an object that has both, a tensor, or a plain value"
            )
    return kinds


def capture(obj: Any) -> Any:
    """The checkpointable value of one entry (references to live tensors, not copies)."""
    if isinstance(obj, torch.Tensor):
        return obj
    if hasattr(obj, "state_dict") and not isinstance(obj, (dict, list, tuple)):
        return obj.state_dict()
    return obj


def mutable_in_forward(state: dict, tensors: dict[str, torch.Tensor]) -> set[str]:
    """Names in ``tensors`` (a flattened early capture) of what a forward may mutate in place:
    the modules' buffers (BatchNorm statistics, EMA buffers, counters) and bare tensors in the
    state. Found by storage identity, so names under DDP or ``torch.compile`` wrappers match."""
    live = set()
    for obj in state.values():
        if isinstance(obj, torch.nn.Module):
            live.update((b.device, b.data_ptr()) for b in obj.buffers() if b.numel())
        elif isinstance(obj, torch.Tensor) and obj.numel():
            live.add((obj.device, obj.data_ptr()))
    return {n for n, t in tensors.items() if t.numel() and (t.device, t.data_ptr()) in live}


def mutable_in_forward_bytes(state: dict) -> int:
    """Bytes of what :func:`mutable_in_forward` finds, from the live objects (module buffers,
    bare tensors), without a capture."""
    ts = {}
    for obj in state.values():
        if isinstance(obj, torch.nn.Module):
            ts.update(((b.device, b.data_ptr()), b) for b in obj.buffers() if b.numel())
        elif isinstance(obj, torch.Tensor) and obj.numel():
            ts[(obj.device, obj.data_ptr())] = obj
    return sum(t.numel() * t.element_size() for t in ts.values())


RANK_BUFFERS_MAX_BYTES = 1 << 20
"""The most bytes of a rank's own module buffers that travel with its RNG states. They go
through the c10d Store (whose messages are capped at 8 MiB) and into the manifest, encoded on
the training thread at each checkpoint: BatchNorm statistics are kilobytes (ResNet-50: 0.2 MB),
while a large registered buffer (a mask, a table) is the same on every rank anyway."""


def rank_buffers(state: dict, limit: int = RANK_BUFFERS_MAX_BYTES) -> dict | None:
    """This rank's module buffers that a checkpoint holds (``{key: {state_dict name: tensor}}``,
    references to the live tensors: encode them before the next forward), or None when they
    exceed ``limit`` bytes (then every rank restores the writer's). Training thread."""
    out, total = {}, 0
    for k, obj in state.items():
        if isinstance(obj, torch.nn.Module):
            sd = obj.state_dict()
            bufs = {n: sd[n] for n, b in obj.named_buffers() if b.numel() and n in sd}
            total += sum(t.numel() * t.element_size() for t in bufs.values())
            if bufs:
                out[k] = bufs
    return out if total <= limit else None


def with_rank_buffers(saved: dict, own: dict | None) -> dict:
    """``saved`` (a checkpoint's state) with this rank's own module buffers (``own``, from
    :func:`rank_buffers` of the checkpointed step) in place of the writer's; only names the
    checkpoint holds are replaced (:func:`apply` then checks shapes as for any state)."""
    if not own:
        return saved
    out = dict(saved)
    for k, bufs in own.items():
        if isinstance(out.get(k), dict) and isinstance(bufs, dict):
            out[k] = {**out[k], **{n: t for n, t in bufs.items() if n in out[k]}}
    return out


def refresh_optimizer_groups(skeleton: dict, state: dict) -> None:
    """Re-capture every optimizer's ``param_groups`` (lr, betas, ...) into an early ``skeleton``.

    The optimizer's tensors are captured right after its step, but a scheduler stepped after
    ``ckpt.step(opt)`` then rewrites ``param_groups[i]["lr"]``; the checkpoint must hold the lr
    the next step uses, like the scheduler's own (late) state. In place; plain values only.
    """
    top = dict(skeleton["__items__"]) if set(skeleton) == {"__items__"} else skeleton
    for k, obj in state.items():
        saved = top.get(k)
        if isinstance(obj, torch.optim.Optimizer) and isinstance(saved, dict) and "param_groups" in saved:
            saved["param_groups"], _ = flatten(obj.state_dict()["param_groups"], inline_tensors=True)


def rng_state() -> dict:
    st = {"torch": torch.get_rng_state(), "python": random.getstate(), "numpy": np.random.get_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        st["cuda"] = torch.cuda.get_rng_state_all()
    return st


def set_rng_state(st: dict) -> None:
    if "torch" in st:
        torch.set_rng_state(st["torch"])
    if "python" in st:
        v = st["python"]
        random.setstate((v[0], tuple(v[1]), v[2]))
    if "numpy" in st:
        n = st["numpy"]
        np.random.set_state((n[0], np.asarray(n[1], dtype=np.uint32), int(n[2]), int(n[3]), float(n[4])))
    if "cuda" in st and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(list(st["cuda"]))
    if "cuda_seed" in st and torch.cuda.is_available():
        torch.cuda.manual_seed_all(st["cuda_seed"])


def derived_rng_state(run_seed: int, rank: int, step: int) -> dict:
    """RNG states for a rank a checkpoint has none for (an elastic resume on more ranks).

    Deterministic: every generator (torch CPU and CUDA, python, numpy modulo 2**32) is seeded
    with the first 8 bytes of ``sha256(f"cfdist-rng/{run_seed}/{rank}/{step}")`` (less its top
    bit), where ``run_seed`` is ``initial_seed()`` of rank 0's saved torch generator and ``step``
    the restored step. Different ranks, and the same rank restored at different steps, draw
    different streams.
    """
    import hashlib

    digest = hashlib.sha256(f"cfdist-rng/{run_seed}/{rank}/{step}".encode()).digest()
    seed = int.from_bytes(digest[:8], "little") >> 1
    return {"torch": torch.Generator().manual_seed(seed).get_state(), "python": random.Random(seed).getstate(),
            "numpy": np.random.RandomState(seed % 2 ** 32).get_state(), "cuda_seed": seed}


def rank_rng_state(manifest: dict, rank: int, *, where: str) -> dict:
    """The RNG states ``rank`` resumes with, from a checkpoint's manifest.

    ``rngs`` (one per saved rank): rank ``r`` gets its own, a rank beyond them, or one whose
    entry is None (a checkpoint of the live state written after the group failed holds only
    its writer's: :mod:`cfdist.checkpoint.live`), gets :func:`derived_rng_state`. A manifest with a single ``rng``: saved by one process
    (``world_size`` 1), it is rank 0's and other ranks are derived; saved by an older cfdist on
    several ranks, every rank gets it, as that version did. ``CheckpointError`` if malformed.
    """
    try:
        rngs = manifest.get("rngs")
        if rngs is None:
            one = unflatten(manifest.get("rng", {}), {})
            if rank == 0 or manifest.get("world_size", 1) > 1 or not one:
                return one
            rngs = [manifest["rng"]]
        if rank < len(rngs) and rngs[rank] is not None:
            return unflatten(rngs[rank], {})
        first = unflatten(next((r for r in rngs if r is not None), {}), {})
        seed = torch.Generator().set_state(first["torch"]).initial_seed() if "torch" in first else 0
        return derived_rng_state(seed, rank, int(manifest["step"]))
    except (KeyError, ValueError, TypeError, RuntimeError, AttributeError) as e:
        raise CheckpointError(f"{where}: the manifest's RNG states are malformed ({type(e).__name__}: {e})") from None


def _key_diffs(prefix: str, live, saved, where: str) -> list[str]:
    """Keys only one side has: missing from the checkpoint, or not in ``where`` (the live side)."""
    return ([f"{prefix}{k}: missing in the checkpoint" for k in sorted(set(live) - set(saved))]
            + [f"{prefix}{k}: in the checkpoint but not in {where}" for k in sorted(set(saved) - set(live))])


def _tensor_diffs(prefix: str, live: dict, saved: dict) -> list[str]:
    diffs = _key_diffs(prefix, live, saved, "the live object")
    for k in sorted(set(live) & set(saved)):
        a, b = live[k], saved[k]
        if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
            if tuple(a.shape) != tuple(b.shape):
                diffs.append(f"{prefix}{k}: shape {tuple(b.shape)} in the checkpoint, {tuple(a.shape)} live")
            elif a.dtype != b.dtype:
                diffs.append(f"{prefix}{k}: dtype {b.dtype} in the checkpoint, {a.dtype} live")
    return diffs


def _optim_diffs(key: str, live: dict, saved: dict) -> list[str]:
    diffs = []
    lg, sg = live.get("param_groups", []), saved.get("param_groups", [])
    if len(lg) != len(sg):
        return [f"{key}: {len(sg)} param groups in the checkpoint, {len(lg)} live"]
    for i, (a, b) in enumerate(zip(lg, sg)):
        if len(a["params"]) != len(b["params"]):
            diffs.append(f"{key}.param_groups[{i}]: {len(b['params'])} params in the checkpoint, {len(a['params'])} live")
    return diffs


def check_compatible(state: dict, saved: dict) -> None:
    """Raise ``CheckpointError`` listing every difference between live objects and a checkpoint."""
    diffs = _key_diffs("", state, saved, "the live state")
    for k in sorted(set(state) & set(saved)):
        obj, sv = state[k], saved[k]
        if isinstance(obj, torch.nn.Module):
            diffs += _tensor_diffs(f"{k}.", obj.state_dict(), sv)
        elif isinstance(obj, torch.optim.Optimizer):
            diffs += _optim_diffs(k, obj.state_dict(), sv)
        elif isinstance(obj, torch.Tensor):
            diffs += _tensor_diffs("", {k: obj}, {k: sv} if isinstance(sv, torch.Tensor) else {})
    if diffs:
        raise CheckpointError("the checkpoint does not fit the live objects:\n  " + "\n  ".join(diffs))


def _apply_one(state: dict, k: str, sv: Any) -> None:
    obj = state[k]
    try:
        if isinstance(obj, torch.Tensor):
            with torch.no_grad():
                obj.copy_(sv)
        elif isinstance(obj, torch.nn.Module):
            obj.load_state_dict(sv, strict=True)
        elif hasattr(obj, "load_state_dict") and not isinstance(obj, (dict, list, tuple)):
            obj.load_state_dict(sv)
        else:
            state[k] = sv
    except (RuntimeError, ValueError, KeyError, TypeError) as e:
        raise CheckpointError(f"loading state[{k!r}] failed: {e}") from e


def apply(state: dict, saved: dict) -> None:
    """Load ``saved[key]`` into each live object in place (plain values are replaced in ``state``).

    All or nothing: the small entries (data iterators, schedulers, plain values), which may
    still refuse a state :func:`check_compatible` cannot judge, load first and are put back if
    one refuses; modules, optimizers and tensors, already checked, load last.
    """
    heavy = (torch.nn.Module, torch.optim.Optimizer, torch.Tensor)
    small = [k for k, o in state.items() if not isinstance(o, heavy)]
    before = {k: copy.deepcopy(state[k].state_dict()) if hasattr(state[k], "load_state_dict") else state[k]
              for k in small}
    done = []
    try:
        for k in small:
            _apply_one(state, k, saved[k])
            done.append(k)
    except CheckpointError:
        for k in done:
            _apply_one(state, k, before[k])
        raise
    for k, obj in state.items():
        if isinstance(obj, heavy):
            _apply_one(state, k, saved[k])
