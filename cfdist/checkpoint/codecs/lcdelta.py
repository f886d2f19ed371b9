"""``LCDelta``: LC-Checkpoint's lossy delta compression of dense tensors (Chen et al., 2020).

Per selected tensor (float32/float64, every dimension count), against the reference:

1. **delta** ``d = x - ref``, where ``ref`` is the tensor *as the previous checkpoint decodes*
   (not as it was trained): the encoder replays the decoder, so errors never accumulate along
   the chain. Every ``full_every``-th checkpoint is full (raw, or zstd'd after it);
2. **exponent-based quantization**: each ``d`` falls in the bucket of its binary exponent
   ``e = floor(log2 |d|)``; **priority promotion**: buckets are handed out from the largest
   exponent down, so the ``M = 2**bits - 1`` largest exponent classes present keep a bucket
   and everything smaller (``|d| < 2**e_low``) becomes 0. A bucket ``[2**e, 2**(e+1))`` is
   represented by its middle ``1.5 * 2**e``, with the element's sign: symbol ``0`` (zero) or
   ``2j-1``/``2j`` (``+``/``-`` bucket ``j``), ``2M + 1`` symbols;
3. **Huffman coding** of the symbols (canonical code, :mod:`.huffman`): most deltas are tiny
   and share a few symbols, so they cost one or two bits.

Error bound, per element: ``|x - x'| < 2**e_low`` where the delta was dropped, and
``|x - x'| <= 2**(e-1) <= |d| / 2`` where it kept bucket ``e``, i.e.
``|x - x'| <= max(2**e_low, |d| / 2)`` (plus one rounding of ``ref + d'`` in the tensor's
dtype); ``e_low = e_max - M + 1`` with ``e_max`` the exponent of the largest ``|d|``. The restored value is always within one step's
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


_EXP = {np.dtype(np.float32): (np.uint32, 23, 0xFF, 127), np.dtype(np.float64): (np.uint64, 52, 0x7FF, 1023)}


def exp_quantize(d: np.ndarray, bits: int) -> tuple[np.ndarray, np.ndarray, int]:
    """``(symbols uint8, signed representative per symbol, e_low)`` of a 1-D float delta array."""
    m = (1 << bits) - 1
    ut, mbits, emask, bias = _EXP[d.dtype]
    u = d.view(ut)
    # floor(log2 |d|) read from the exponent field (subnormals and 0 read as -bias: never kept
    # unless everything is that small, where the bucket bound still holds).
    e = ((u >> ut(mbits)) & ut(emask)).astype(np.int16) - np.int16(bias)
    nz = (u << ut(1)) != 0                                       # |d| > 0 (sign bit shifted out)
    e_max = int(e.max()) if len(e) else 0
    e_low = e_max - m + 1
    bucket = np.where(nz, np.clip(e - np.int16(e_low - 1), 0, m), 0).astype(np.uint8)
    # The middle of bucket j = [2**e, 2**(e+1)), e = e_low + j - 1: no pass over the data, and
    # half a bucket's width as the worst case (a bucket mean can be off by almost a whole one).
    reps = np.concatenate([[0.0], 1.5 * np.ldexp(1.0, np.arange(e_low, e_low + m))])
    neg = (u >> ut(mbits + (11 if d.dtype == np.float64 else 8))).astype(np.uint8)   # the sign bit
    sym = np.where(bucket > 0, 2 * bucket - 1 + neg, 0).astype(np.uint8)
    table = np.zeros(2 * m + 1, dtype=d.dtype)
    table[1::2], table[2::2] = reps[1:], -reps[1:]
    return sym, table, e_low


def dequantize(sym: np.ndarray, table: np.ndarray) -> np.ndarray:
    return table[sym]


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
    work: ClassVar[float] = 4.0   # the delta, its exponents and symbols, the Huffman code
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
        sym, reps, e_low = exp_quantize(np.ascontiguousarray(d), self.bits)
        new_ref = ref + dequantize(sym, reps).reshape(x.shape)
        plan.after_commit(lambda refs: refs.__setitem__(name, new_ref))
        lens, payload, offs, block = huffman.encode(sym, len(reps))
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
        if meta["n"] != ref.size or sym.max(initial=0) >= len(reps) or reps.dtype != ref.dtype:
            raise CheckpointError(f"{ctx.where}: tensor {ctx.name!r}: LC delta does not fit its reference")
        return {"data": ref + dequantize(sym, reps).reshape(ref.shape)}


def error_bound(d: np.ndarray, e_low: int) -> np.ndarray:
    """Per-element strict upper bound on ``|x - x'|`` for deltas ``d`` (see the module doc)."""
    return np.maximum(np.ldexp(1.0, e_low), np.abs(d) / 2)
