"""``LCDelta``: LC-Checkpoint's lossy delta compression of dense tensors (Chen et al., 2020).

Per selected tensor (float32/float64, every dimension count), against the reference:

1. **delta** ``d = x - ref``, where ``ref`` is the tensor *as the previous checkpoint decodes*
   (not as it was trained): the encoder replays the decoder, so errors never accumulate along
   the chain. Every ``full_every``-th checkpoint is full (raw, or zstd'd after it);
2. **exponent-based quantization**: each ``d`` falls in the bucket of its binary exponent
   ``e = floor(log2 |d|)``; **priority promotion**: buckets are handed out from the largest
   exponent down, so the ``M = 2**bits - 1`` largest exponent classes present keep a bucket
   and everything smaller (``|d| < 2**e_low``) becomes 0. A bucket is represented by the mean
   magnitude of its members, with the element's sign: symbol ``0`` (zero) or ``2j-1``/``2j``
   (``+``/``-`` bucket ``j``), ``2M + 1`` symbols;
3. **Huffman coding** of the symbols (canonical code, :mod:`.huffman`): most deltas are tiny
   and share a few symbols, so they cost one or two bits.

Error bound, per element: ``|x - x'| < 2**e_low`` where the delta was dropped, and
``|x - x'| < 2**e <= |d|`` where it kept bucket ``e`` (the value and its representative lie in
``[2**e, 2**(e+1))``), i.e. ``|x - x'| < max(2**e_low, |d|)``; ``e_low = e_max - M + 1`` with
``e_max`` the exponent of the largest ``|d|``. The restored value is always within one step's
quantization error of the true one, however long the chain. ``bits=3`` gives 7 exponent classes
(15 symbols).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import numpy as np
import torch

from cfdist.checkpoint.codecs import huffman
from cfdist.checkpoint.codecs.base import Codec, _patterns, matches, register
from cfdist.checkpoint.format import CheckpointError


def exp_quantize(d: np.ndarray, bits: int) -> tuple[np.ndarray, np.ndarray, int]:
    """``(symbols uint8, bucket representatives, e_low)`` of a 1-D delta array."""
    m = (1 << bits) - 1
    a = np.abs(d)
    _, ex = np.frexp(a)          # a = f * 2**ex, f in [0.5, 1): floor(log2 a) = ex - 1
    e = ex.astype(np.int32) - 1
    nz = a > 0
    e_max = int(e[nz].max()) if nz.any() else 0
    e_low = e_max - m + 1
    bucket = np.where(nz & (e >= e_low), e - e_low + 1, 0).astype(np.int64)
    sums = np.bincount(bucket, weights=a, minlength=m + 1)
    cnts = np.bincount(bucket, minlength=m + 1)
    reps = np.where(cnts > 0, sums / np.maximum(cnts, 1), 0).astype(d.dtype)
    reps[0] = 0
    sym = np.where(bucket > 0, 2 * bucket - 1 + (d < 0), 0).astype(np.uint8)
    return sym, reps, e_low


def dequantize(sym: np.ndarray, reps: np.ndarray) -> np.ndarray:
    bucket = (sym.astype(np.int64) + 1) // 2
    sign = np.where(sym % 2 == 0, -1, 1).astype(reps.dtype)
    return reps[bucket] * sign


@register
@dataclass(frozen=True)
class LCDelta(Codec):
    """LC-Checkpoint delta + exponent quantization + Huffman coding of dense float tensors."""

    bits: int = 3
    """Exponent classes kept: ``2**bits - 1`` (1..6); LC-Checkpoint's default is 3."""
    full_every: int | None = 10
    """A full checkpoint every this many (None: only the first). Restores read the chain."""
    match: str | tuple[str, ...] | None = None
    """Glob(s) on tensor names; None selects every float32/float64 tensor."""

    kind: ClassVar[str] = "chain"
    name: ClassVar[str] = "lcdelta"
    lossy: ClassVar[bool] = True
    consecutive: ClassVar[bool] = True

    def __post_init__(self):
        if not (isinstance(self.bits, int) and not isinstance(self.bits, bool) and 1 <= self.bits <= 6):
            raise ValueError(f"LCDelta(bits={self.bits!r}): bits must be an int in 1..6 (3 in LC-Checkpoint)")
        if self.full_every is not None and not (isinstance(self.full_every, int) and self.full_every >= 1):
            raise ValueError(f"LCDelta(full_every={self.full_every!r}): must be an int >= 1 or None")
        object.__setattr__(self, "_pats", _patterns(self.match))

    def selects(self, name, dtype, shape) -> bool:
        return dtype in (torch.float32, torch.float64) and matches(self._pats, name)

    def encode(self, name: str, parts: dict, plan) -> tuple[dict, dict | None]:
        x = parts["data"]
        ref = plan.reference(name, x)
        if ref is None or not (np.isfinite(x).all() and np.isfinite(ref).all()):
            plan.remember(name, x)
            return parts, None
        d = (x - ref).ravel()
        sym, reps, e_low = exp_quantize(d, self.bits)
        new_ref = ref + dequantize(sym, reps).reshape(x.shape)
        plan.after_commit(lambda refs: refs.__setitem__(name, new_ref))
        lens, payload, offs, block = huffman.encode(sym, 2 * len(reps) - 1)
        meta = {"name": self.name, "ref": plan.ref[0], "ref_id": plan.ref[1], "bits": self.bits,
                "n": int(x.size), "block": block, "e_low": e_low}
        return {"code": payload, "lens": lens, "offsets": offs, "reps": reps}, meta

    @staticmethod
    def decode(parts: dict, meta: dict, ctx) -> dict:
        ref = ctx.load_ref(meta["ref"], meta["ref_id"])
        try:
            sym = huffman.decode(parts["code"], parts["lens"], parts["offsets"], meta["n"], meta["block"])
        except (KeyError, ValueError, IndexError) as e:
            raise CheckpointError(f"{ctx.where}: tensor {ctx.name!r}: LC delta does not decode ({e})") from None
        reps = parts["reps"]
        if meta["n"] != ref.size or sym.max(initial=0) >= 2 * len(reps) - 1 or reps.dtype != ref.dtype:
            raise CheckpointError(f"{ctx.where}: tensor {ctx.name!r}: LC delta does not fit its reference")
        return {"data": ref + dequantize(sym, reps).reshape(ref.shape)}


def error_bound(d: np.ndarray, e_low: int) -> np.ndarray:
    """Per-element strict upper bound on ``|x - x'|`` for deltas ``d`` (see the module doc)."""
    return np.maximum(np.ldexp(1.0, e_low), np.abs(d))
