"""Nested state <-> (JSON skeleton, flat dict of tensors). No pickle, ever.

A state dict of a model, an optimizer or a scheduler is a tree of dicts, lists and tuples whose
leaves are tensors and plain values. ``flatten`` walks it once and returns:

* ``skeleton``: a JSON-able tree where every tensor is replaced by ``{"__t__": name}`` and every
  value JSON cannot hold exactly is tagged (``__tuple__``, ``__items__`` for non-str keys,
  ``__float__`` for nan/inf, ``__bytes__``, ``__ndarray__``, ``__small__`` for small tensors
  inlined as base64, ``__dtype__``);
* ``tensors``: ``{name: tensor}`` in walk order, names are ``/``-joined key paths.

``unflatten(skeleton, tensors)`` rebuilds the tree. Anything else (arbitrary objects, lambdas,
classes) raises ``TypeError`` with the path where it was found: checkpoints never carry code.
"""

from __future__ import annotations

import base64
import math
from typing import Any, Callable

import numpy as np
import torch

_DTYPES = {str(d): d for d in (
    torch.float64, torch.float32, torch.float16, torch.bfloat16, torch.int64, torch.int32,
    torch.int16, torch.int8, torch.uint8, torch.bool, torch.complex64, torch.complex128,
    torch.float8_e4m3fn, torch.float8_e5m2,
)}


def _key(k: Any) -> str:
    return str(k).replace("/", "%2F")


def flatten(obj: Any, prefix: str = "", *, inline_tensors: bool = False,
            tensors: dict[str, torch.Tensor] | None = None) -> tuple[Any, dict[str, torch.Tensor]]:
    """Split ``obj`` into a JSON skeleton and a flat ``{name: tensor}`` dict.

    ``inline_tensors=True`` stores tensors inside the skeleton (base64 of their bytes): for small
    state captured between iterations (RNG, scheduler), never for model weights.
    """
    out: dict[str, torch.Tensor] = {} if tensors is None else tensors
    return _walk(obj, prefix, out, inline_tensors), out


_PLAIN = frozenset({int, str, bool, type(None)})
"""Leaf types returned as they are, matched exactly (subclasses, e.g. ``numpy.str_``, take the
general path): the fast path of :func:`_walk`. A flatten runs on the training thread at every
checkpoint step, and Python's RNG state alone is a tuple of 625 ints."""


def _walk(obj: Any, path: str, out: dict, inline: bool) -> Any:
    t = type(obj)
    if t in _PLAIN:
        return obj
    if t is float:
        return obj if math.isfinite(obj) else {"__float__": repr(obj)}
    if (t is list or t is tuple) and all(type(v) in _PLAIN for v in obj):
        return {"__tuple__": list(obj)} if t is tuple else list(obj)   # a run of plain values: no walk
    if isinstance(obj, torch.Tensor):
        if inline:
            return {"__small__": _tensor_to_b64(obj)}
        name = path or "tensor"
        if name in out:
            raise ValueError(f"two tensors flatten to the same name {name!r}; rename a key")
        out[name] = obj.detach()
        return {"__t__": name}
    if isinstance(obj, np.ndarray):
        if obj.dtype.kind not in "biufc":
            raise TypeError(f"state at {path or '<root>'!r} is a numpy array of dtype {obj.dtype}; "
                            f"only numeric arrays can be checkpointed")
        a = np.ascontiguousarray(obj)
        return {"__ndarray__": {"dtype": a.dtype.str, "shape": list(a.shape),
                                "b64": base64.b64encode(a.tobytes()).decode()}}
    if isinstance(obj, np.generic):
        return _walk(obj.item(), path, out, inline)
    if obj is None or isinstance(obj, (bool, int, str)):
        return obj
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else {"__float__": repr(obj)}
    if isinstance(obj, bytes):
        return {"__bytes__": base64.b64encode(obj).decode()}
    if isinstance(obj, torch.dtype):
        return {"__dtype__": str(obj)}
    if isinstance(obj, torch.Size):
        return {"__tuple__": list(obj)}
    if isinstance(obj, dict):
        if all(isinstance(k, str) for k in obj):
            if any(k.startswith("__") and k.endswith("__") for k in obj):
                return {"__items__": [[k, _walk(v, f"{path}/{_key(k)}" if path else _key(k), out, inline)]
                                      for k, v in obj.items()]}
            return {k: _walk(v, f"{path}/{_key(k)}" if path else _key(k), out, inline) for k, v in obj.items()}
        items = []
        for k, v in obj.items():
            if not isinstance(k, (str, int, float, bool)) and k is not None:
                raise TypeError(f"state at {path or '<root>'!r} has a key of type {type(k).__name__} "
                                f"({k!r}); only str/int/float/bool keys can be checkpointed")
            items.append([k, _walk(v, f"{path}/{_key(k)}" if path else _key(k), out, inline)])
        return {"__items__": items}
    if isinstance(obj, (list, tuple)):
        vals = [_walk(v, f"{path}/{i}" if path else str(i), out, inline) for i, v in enumerate(obj)]
        return {"__tuple__": vals} if isinstance(obj, tuple) else vals
    raise TypeError(
        f"state at {path or '<root>'!r} holds a {type(obj).__module__}.{type(obj).__qualname__}, "
        f"which cannot be checkpointed without pickle; convert it to tensors or plain values "
        f"(dict/list/tuple/int/float/str/bool/None) in its state_dict()"
    )


def unflatten(skel: Any, tensors: dict[str, torch.Tensor] | Callable[[str], torch.Tensor]) -> Any:
    """Rebuild the tree ``flatten`` split. ``tensors`` maps names to tensors (or is a lookup)."""
    get = tensors if callable(tensors) else tensors.__getitem__
    return _build(skel, get)


def _build(s: Any, get: Callable[[str], torch.Tensor]) -> Any:
    if isinstance(s, list):
        return [_build(v, get) for v in s]
    if not isinstance(s, dict):
        return s
    if len(s) == 1:
        (tag, val), = s.items()
        if tag == "__t__":
            return get(val)
        if tag == "__tuple__":
            return tuple(_build(v, get) for v in val)
        if tag == "__items__":
            return {k: _build(v, get) for k, v in val}
        if tag == "__float__":
            return float(val)
        if tag == "__bytes__":
            return base64.b64decode(val)
        if tag == "__dtype__":
            if val not in _DTYPES:
                raise ValueError(f"unknown dtype {val!r} in checkpoint skeleton")
            return _DTYPES[val]
        if tag == "__small__":
            return _b64_to_tensor(val)
        if tag == "__ndarray__":
            dt = np.dtype(val["dtype"])
            if dt.kind not in "biufc":
                raise ValueError(f"refusing numpy dtype {val['dtype']!r} in checkpoint skeleton")
            return np.frombuffer(base64.b64decode(val["b64"]), dtype=dt).reshape(val["shape"]).copy()
    return {k: _build(v, get) for k, v in s.items()}


def _tensor_to_b64(t: torch.Tensor) -> dict:
    t = t.detach().cpu().contiguous()
    raw = t.reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b""   # 0-dim too
    return {"dtype": str(t.dtype), "shape": list(t.shape), "b64": base64.b64encode(raw).decode()}


def _b64_to_tensor(d: dict) -> torch.Tensor:
    dtype = _DTYPES.get(d["dtype"])
    if dtype is None:
        raise ValueError(f"unknown dtype {d['dtype']!r} in checkpoint skeleton")
    raw = bytearray(base64.b64decode(d["b64"]))
    shape = [int(x) for x in d["shape"]]
    if any(x < 0 for x in shape) or math.prod(shape) * dtype.itemsize != len(raw):
        # checked before any allocation: a forged shape must not allocate terabytes
        raise ValueError(f"inline tensor of shape {shape} and dtype {dtype} does not match its {len(raw)} bytes")
    if not raw:
        return torch.empty(shape, dtype=dtype)
    return torch.frombuffer(raw, dtype=torch.uint8).view(dtype).reshape(shape).clone()
