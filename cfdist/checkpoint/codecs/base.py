"""The codec contract, the parts of an encoded tensor, and dtype helpers.

A codec turns one tensor of a snapshot into smaller *parts* (named numpy arrays) and back.
There are three kinds, and every tensor goes through at most one of each, in this order
whatever the order of the ``codecs=[...]`` list:

1. a **chain** codec (:class:`~.incremental.Incremental`, :class:`~.lcdelta.LCDelta`): encodes
   against an earlier checkpoint of the same storage (the first one in the list that selects
   the tensor wins);
2. a **value** codec (:class:`~.quantize.Quantize`): per-row quantization of ``parts["data"]``
   (skipped for tensors that ``LCDelta`` already quantizes);
3. a **bytes** codec (:class:`~.zstd.Zstd`): lossless compression of the serialized parts.

Encoding is ``encode(name, parts, ctx) -> (parts, meta)``; ``meta`` (JSON) goes into the
manifest, so decoding needs no codec object: ``decode(parts, meta, ctx) -> parts`` is a class
method looked up by ``meta["name"]`` in :data:`REGISTRY`.

``parts["data"]`` is the tensor as a numpy array of its shape in its *raw* numpy dtype
(:func:`raw_np_dtype`: bf16 as uint16, float8 as uint8), so lossless codecs compare and copy
bits, never values.
"""

from __future__ import annotations

import dataclasses
import fnmatch
import math
from dataclasses import dataclass
from typing import ClassVar

import numpy as np
import torch

from cfdist.checkpoint.format import CheckpointError

_RAW = {
    torch.float64: np.float64, torch.float32: np.float32, torch.float16: np.float16,
    torch.bfloat16: np.uint16, torch.int64: np.int64, torch.int32: np.int32, torch.int16: np.int16,
    torch.int8: np.int8, torch.uint8: np.uint8, torch.bool: np.bool_, torch.float8_e4m3fn: np.uint8,
    torch.float8_e5m2: np.uint8, torch.complex64: np.complex64,
}
FLOATS = (torch.float64, torch.float32, torch.float16, torch.bfloat16)

# numpy dtypes a manifest may name for a part (never "O": loading never runs code).
_PART_DTYPES = {"|u1", "|i1", "|b1", "<u2", "<i2", "<u4", "<i4", "<u8", "<i8", "<f2", "<f4", "<f8", "<c8"}


def raw_np_dtype(dtype: torch.dtype) -> np.dtype:
    return np.dtype(_RAW[dtype])


def as_float(arr: np.ndarray, dtype: torch.dtype) -> np.ndarray:
    """Values of a raw array as float32 (float64 stays float64) for lossy arithmetic."""
    if dtype == torch.bfloat16:
        return torch.from_numpy(np.ascontiguousarray(arr).view(np.int16)).view(torch.bfloat16).float().numpy()
    if dtype == torch.float64:
        return arr
    return arr.astype(np.float32, copy=False)


def from_float(x: np.ndarray, dtype: torch.dtype) -> np.ndarray:
    """Inverse of :func:`as_float`: round to ``dtype`` and return its raw array."""
    if dtype == torch.bfloat16:
        return torch.from_numpy(np.ascontiguousarray(x, dtype=np.float32)).to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16)
    return x.astype(raw_np_dtype(dtype), copy=False)


def _patterns(match) -> tuple[str, ...] | None:
    if match is None:
        return None
    pats = (match,) if isinstance(match, str) else tuple(match)
    if not pats or not all(isinstance(p, str) and p for p in pats):
        raise ValueError(f"match must be a glob string or a list of them (e.g. '*embedding*'), got {match!r}")
    return pats


def matches(pats: tuple[str, ...] | None, name: str) -> bool:
    return pats is None or any(fnmatch.fnmatchcase(name, p) for p in pats)


class Codec:
    """Base of every codec. Subclasses are frozen dataclasses (their fields are the parameters)."""

    kind: ClassVar[str]
    """``"chain"``, ``"value"`` or ``"bytes"`` (the stage it runs in)."""
    name: ClassVar[str]
    lossy: ClassVar[bool]
    work: ClassVar[float] = 2.0
    """Host memory its ``encode`` holds at its peak, beside its input, per byte of input
    (temporaries and output). Under a host-memory budget the persist encodes the snapshot
    chunk by chunk, and the budget sets this much aside per chunk being encoded
    (:func:`cfdist.checkpoint.codecs.pipeline.encode_work`)."""

    def selects(self, name: str, dtype: torch.dtype, shape: tuple[int, ...]) -> bool:
        raise NotImplementedError

    def params(self) -> dict:
        """JSON-able parameters, recorded in the manifest."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}


REGISTRY: dict[str, type[Codec]] = {}


def register(cls):
    REGISTRY[cls.name] = cls
    return cls


# ---- parts <-> one blob ---------------------------------------------------------------------------

def pack_parts(parts: dict[str, np.ndarray]) -> tuple[list, list]:
    """``(layout, buffers)``: each part 8-byte aligned, back to back. Layout is JSON."""
    layout, bufs, off = [], [], 0
    for k, a in parts.items():
        a = np.ascontiguousarray(a)
        pad = (-off) % 8
        if pad:
            bufs.append(b"\0" * pad)
            off += pad
        layout.append([k, a.dtype.str, list(a.shape), off, a.nbytes])
        bufs.append(memoryview(a).cast("B") if a.nbytes else b"")
        off += a.nbytes
    return layout, bufs


def unpack_parts(blob, layout: list, *, where: str) -> dict[str, np.ndarray]:
    """Views into ``blob`` per ``layout``; refuses dtypes outside a numeric allowlist."""
    out = {}
    try:
        for k, dt, shape, off, nb in layout:
            if dt not in _PART_DTYPES:
                raise CheckpointError(f"{where}: part {k!r} has dtype {dt!r}, which cfdist never writes")
            d = np.dtype(dt)
            if nb != math.prod(shape) * d.itemsize or off < 0 or off + nb > len(blob):
                raise CheckpointError(f"{where}: part {k!r} ({shape}, {dt}) does not fit at byte {off} "
                                      f"of a {len(blob)}-byte payload")
            out[k] = np.frombuffer(blob, dtype=d, count=math.prod(shape), offset=off).reshape(shape)
    except (TypeError, ValueError) as e:
        raise CheckpointError(f"{where}: malformed parts layout ({e})") from None
    return out


@dataclass(frozen=True, slots=True)
class DecodeContext:
    """What a decoder may ask for: the tensor's logical dtype and shape, and (chain codecs)
    the same tensor decoded from an earlier step of the same storage."""

    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    where: str
    load_ref: object
    """``load_ref(step, ckpt_id) -> raw numpy array`` of this tensor at that step."""
