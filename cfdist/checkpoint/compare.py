"""Comparing two loaded checkpoints, and exporting one state entry for use without cfdist.

Pure functions over what :func:`cfdist.load` returns (``{"step", "state", "rng", ...}``): no
storage access here, so the ``cfdist inspect --diff`` and ``cfdist export`` commands stay wiring.
"""

from __future__ import annotations

from typing import Any, Iterator

import torch

EXPORT_FORMATS = ("safetensors", "torch")
EXPORT_FILES = {"safetensors": "model.safetensors", "torch": "model.pt"}


def leaves(obj: Any, path: str = "") -> Iterator[tuple[str, Any]]:
    """``(path, value)`` for every leaf of a nested dict/list/tuple; paths are ``.``-joined keys."""
    if isinstance(obj, dict):
        for k, v in obj.items():
            yield from leaves(v, f"{path}.{k}" if path else str(k))
    elif isinstance(obj, (list, tuple)):
        for i, v in enumerate(obj):
            yield from leaves(v, f"{path}.{i}" if path else str(i))
    else:
        yield path, obj


def _tensor_delta(a: torch.Tensor, b: torch.Tensor) -> dict | None:
    """None if equal; else shape/dtype change or element count and max abs difference."""
    if tuple(a.shape) != tuple(b.shape) or a.dtype != b.dtype:
        return {"shape_a": list(a.shape), "shape_b": list(b.shape), "dtype_a": str(a.dtype), "dtype_b": str(b.dtype)}
    if torch.equal(a, b):
        return None
    if a.dtype == torch.bool or a.is_complex():
        ne = a != b
        return {"shape": list(a.shape), "dtype": str(a.dtype), "n_diff": int(ne.sum()), "max_abs_diff": None}
    # float64 holds every difference of the integer and float types cfdist stores exactly enough
    # for a report; nan != nan counts as a difference.
    d = (a.to(torch.float64) - b.to(torch.float64)).abs()
    ne = (a != b)
    return {"shape": list(a.shape), "dtype": str(a.dtype), "n_diff": int(ne.sum()),
            "max_abs_diff": float(torch.nan_to_num(d, nan=float("inf")).max())}


def diff_checkpoints(a: dict, b: dict) -> dict:
    """What differs between two checkpoints loaded with :func:`cfdist.load`.

    Returns ``{"step_a", "step_b", "tensors": {"changed": [...], "equal": n, "only_a": [...],
    "only_b": [...]}, "values": [{"path", "a", "b"}, ...]}``. ``changed`` entries hold the
    tensor's ``name``, ``shape``, ``dtype``, how many elements differ (``n_diff``) and the
    largest absolute difference, or ``shape_a``/``shape_b``/``dtype_a``/``dtype_b`` when the
    tensor changed shape or type. ``values`` lists the plain values (step counters, lr,
    iterator position, ...) that differ, RNG states included under ``rng.``. JSON-able.
    """
    la = dict(leaves({"state": a["state"], "rng": a.get("rng", {})}))
    lb = dict(leaves({"state": b["state"], "rng": b.get("rng", {})}))
    out = {"step_a": a.get("step"), "step_b": b.get("step"),
           "tensors": {"changed": [], "equal": 0, "only_a": [], "only_b": []}, "values": []}
    t = out["tensors"]
    for path in sorted(set(la) | set(lb), key=lambda p: (p.split(".")[0] == "rng", p)):
        short = path[len("state."):] if path.startswith("state.") else path
        va, vb = la.get(path, _MISSING), lb.get(path, _MISSING)
        if isinstance(va, torch.Tensor) or isinstance(vb, torch.Tensor):
            if vb is _MISSING:
                t["only_a"].append(short)
            elif va is _MISSING:
                t["only_b"].append(short)
            elif not (isinstance(va, torch.Tensor) and isinstance(vb, torch.Tensor)):
                out["values"].append({"path": short, "a": _show(va), "b": _show(vb)})
            else:
                delta = _tensor_delta(va, vb)
                if delta is None:
                    t["equal"] += 1
                else:
                    t["changed"].append({"name": short, **delta})
        elif not _same(va, vb):
            out["values"].append({"path": short, "a": _show(va), "b": _show(vb)})
    return out


_MISSING = object()


def _same(a: Any, b: Any) -> bool:
    if hasattr(a, "shape") and hasattr(b, "shape"):   # numpy arrays (RNG key)
        return a.shape == b.shape and bool((a == b).all())
    return type(a) is type(b) and a == b


def _show(v: Any) -> Any:
    if v is _MISSING:
        return "<missing>"
    if isinstance(v, torch.Tensor):
        return f"tensor{list(v.shape)} {v.dtype}"
    if hasattr(v, "shape"):
        return f"array{list(v.shape)}"
    return v if isinstance(v, (int, float, str, bool)) or v is None else repr(v)


def export_tensors(loaded: dict, key: str | None = None, *, strip_prefixes: tuple[str, ...] = ()) -> tuple[str, dict]:
    """``(key, {name: tensor})``: one state entry of a loaded checkpoint as a flat tensor dict.

    ``key=None`` takes ``"model"``, or the only entry that holds tensors. Names are the entry's
    own (a module's ``state_dict`` keys; nested state is ``.``-joined); each prefix in
    ``strip_prefixes`` (e.g. DDP's ``"module."``, ``torch.compile``'s ``"_orig_mod."``) is
    removed from the start of every name that has it. Tensors are fresh contiguous copies (no
    shared storage, as safetensors requires). ``ValueError`` naming the keys on a bad ``key``.
    """
    state = loaded["state"]
    with_tensors = [k for k, v in state.items() if any(isinstance(x, torch.Tensor) for _, x in leaves(v))]
    if key is None:
        if "model" in state:
            key = "model"
        elif len(with_tensors) == 1:
            key = with_tensors[0]
        else:
            raise ValueError(f"the checkpoint has no 'model' entry; choose one with --key (entries with "
                             f"tensors: {with_tensors})")
    if key not in state:
        raise ValueError(f"the checkpoint has no entry {key!r}; its entries are {sorted(state)} "
                         f"(with tensors: {with_tensors})")
    out: dict[str, torch.Tensor] = {}
    for name, v in leaves(state[key]):
        if not isinstance(v, torch.Tensor):
            continue
        for p in strip_prefixes:
            if name.startswith(p):
                name = name[len(p):]
        if name in out:
            raise ValueError(f"two tensors of {key!r} are named {name!r} after stripping {list(strip_prefixes)}; "
                             f"export without stripping")
        out[name] = v.detach().contiguous().clone()
    if not out:
        raise ValueError(f"state entry {key!r} holds no tensors; entries with tensors: {with_tensors}")
    return key, out


def save_export(tensors: dict[str, torch.Tensor], out_dir: str, fmt: str, metadata: dict[str, str]) -> str:
    """Write ``tensors`` to ``out_dir/model.safetensors`` (``safetensors.torch.load_file`` reads
    it) or ``out_dir/model.pt`` (``torch.load(path, weights_only=True)`` reads it). Returns the path."""
    import os

    if fmt not in EXPORT_FORMATS:
        raise ValueError(f"format must be one of {EXPORT_FORMATS}, got {fmt!r}")
    os.makedirs(out_dir, exist_ok=True)
    path = os.path.join(out_dir, EXPORT_FILES[fmt])
    tmp = path + ".tmp"
    if fmt == "safetensors":
        from safetensors.torch import save_file

        save_file(tensors, tmp, metadata={"format": "pt", **{str(k): str(v) for k, v in metadata.items()}})
    else:
        torch.save(tensors, tmp)
    os.replace(tmp, path)
    return path
