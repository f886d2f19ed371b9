"""``Quantize``: Check-N-Run's per-row quantization of embedding tables (lossy, opt-in).

Each row (dimension 0; a tensor is seen as ``(rows, -1)``) is mapped to ``2**bits`` evenly
spaced levels between a per-row ``lo`` and ``lo + scale * (2**bits - 1)``, stored as float32,
codes packed ``8 / bits`` to a byte. Overhead: 8 bytes per row.

``method="uniform"``: ``lo`` and the top are the row's min and max. Error bound, per element:
``|x - x'| <= scale / 2`` with ``scale = (max - min) / (2**bits - 1)`` of its row (plus
float32 rounding of ``lo + q * scale``, below 1e-6 relative; bf16/fp16 tensors also round the
result to their dtype).

``method="adaptive"``: Check-N-Run's greedy range search: starting from ``[min, max]``, shrink
whichever end lowers the row's squared error most, in ``SEARCH_STEPS`` steps of
``SEARCH_FRACTION`` of the range, and keep the best range seen. Values outside the range clip.
Bound: each row's root-mean-square error is at most the uniform method's for that row (the
full range is a candidate), which itself is at most ``scale / 2``.

``bits="auto"``: the width follows the expected number of restores ``R = run_s / MTBF``
(Check-N-Run §5: quantization noise enters the model once per restore): ``R <= FEW_RESTORES``
gives 4 bits, more gives 8. The MTBF is the one ``cfdist.Auto`` uses (given, or estimated from
this run's restarts); with no MTBF or no ``run_s`` the expected number of restores is unknown
and 8 bits are used. The choice is logged with its inputs and recorded in the manifest.

Tensors with a non-finite value are written unquantized (a warning names them).
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass, replace
from typing import ClassVar

import numpy as np
import torch

from cfdist.checkpoint.codecs.base import FLOATS, Codec, _patterns, as_float, from_float, matches, register
from cfdist.checkpoint.format import CheckpointError

log = logging.getLogger("cfdist.codecs")

FEW_RESTORES = 3.0
SEARCH_STEPS = 12
SEARCH_FRACTION = 0.03
METHODS = ("uniform", "adaptive")


def auto_bits(*, mtbf_s: float | None, run_s: float | None) -> tuple[int, str]:
    """(bits, reason) for ``bits="auto"``. Pure."""
    if not mtbf_s or not run_s:
        return 8, f"bits=8 because the expected number of restores is unknown (MTBF={mtbf_s}, run_s={run_s})"
    r = run_s / mtbf_s
    bits = 4 if r <= FEW_RESTORES else 8
    return bits, (f"bits={bits} because expected restores R={r:.3g} = run {run_s:.4g}s / MTBF {mtbf_s:.4g}s "
                  f"{'<=' if bits == 4 else '>'} {FEW_RESTORES:g}")


def pack(q: np.ndarray, bits: int) -> np.ndarray:
    q = q.ravel().astype(np.uint8)
    if bits == 8:
        return q
    per = 8 // bits
    q = np.concatenate([q, np.zeros((-len(q)) % per, dtype=np.uint8)]).reshape(-1, per)
    out = np.zeros(len(q), dtype=np.uint8)
    for j in range(per):
        out |= q[:, j] << (bits * j)
    return out


def unpack(b: np.ndarray, bits: int, n: int) -> np.ndarray:
    if bits == 8:
        return b[:n]
    per = 8 // bits
    mask = (1 << bits) - 1
    return np.stack([(b >> (bits * j)) & mask for j in range(per)], axis=1).ravel()[:n]


def _quantize(x: np.ndarray, lo: np.ndarray, scale: np.ndarray, levels: int) -> np.ndarray:
    inv = np.where(scale > 0, 1 / np.where(scale > 0, scale, 1), 0).astype(np.float32)   # constant row: 0
    y = x - lo[:, None]
    y *= inv[:, None]
    np.rint(y, out=y)
    np.clip(y, 0, levels, out=y)
    return y.astype(np.uint8)


def _dequantize(q: np.ndarray, lo: np.ndarray, scale: np.ndarray) -> np.ndarray:
    return lo[:, None] + q.astype(np.float32) * scale[:, None]


def _row_sse(x, lo, scale, levels):
    return ((_dequantize(_quantize(x, lo, scale, levels), lo, scale) - x) ** 2).sum(axis=1)


def row_ranges(x: np.ndarray, bits: int, method: str) -> tuple[np.ndarray, np.ndarray]:
    """Per-row ``(lo, scale)`` (float32) for a 2-D float32 array."""
    levels = (1 << bits) - 1
    lo, hi = x.min(axis=1), x.max(axis=1)
    scale = ((hi - lo) / levels).astype(np.float32)
    if method == "uniform":
        return lo.astype(np.float32), scale
    best_lo, best_hi = lo.copy(), hi.copy()
    best = _row_sse(x, lo, scale, levels)
    cur_lo, cur_hi = lo.copy(), hi.copy()
    step = (hi - lo) * SEARCH_FRACTION
    for _ in range(SEARCH_STEPS):
        a_lo, b_hi = cur_lo + step, cur_hi - step
        e_a = _row_sse(x, a_lo, ((cur_hi - a_lo) / levels).astype(np.float32), levels)
        e_b = _row_sse(x, cur_lo, ((b_hi - cur_lo) / levels).astype(np.float32), levels)
        take_a = e_a <= e_b
        cur_lo = np.where(take_a, a_lo, cur_lo)
        cur_hi = np.where(take_a, cur_hi, b_hi)
        e = np.minimum(e_a, e_b)
        better = e < best
        best = np.where(better, e, best)
        best_lo = np.where(better, cur_lo, best_lo)
        best_hi = np.where(better, cur_hi, best_hi)
    return best_lo.astype(np.float32), ((best_hi - best_lo) / levels).astype(np.float32)


@register
@dataclass(frozen=True)
class Quantize(Codec):
    """Per-row quantization of the selected floating-point tensors to ``bits`` bits."""

    bits: int | str = 8
    """8, 4 or 2, or ``"auto"`` (from the expected number of restores; see the module doc)."""
    match: str | tuple[str, ...] | None = None
    """Glob(s) on tensor names; None selects every floating-point tensor with two or more
    dimensions. Quantize embedding tables (``"*embedding*"``), not optimizer moments."""
    method: str = "uniform"
    """``"uniform"`` (row min..max) or ``"adaptive"`` (Check-N-Run's greedy range search)."""
    run_s: float | None = None
    """For ``bits="auto"``: how long the run is expected to last, in seconds."""

    kind: ClassVar[str] = "value"
    name: ClassVar[str] = "quantize"
    lossy: ClassVar[bool] = True
    work: ClassVar[float] = 4.0   # float32 values (2x a bf16 input), their scaled copy, the codes

    def __post_init__(self):
        if self.bits not in (8, 4, 2, "auto") or isinstance(self.bits, bool):
            raise ValueError(f"Quantize(bits={self.bits!r}): bits must be 8, 4, 2 or 'auto'")
        if self.method not in METHODS:
            raise ValueError(f"Quantize(method={self.method!r}): must be one of {METHODS}")
        if self.run_s is not None and not (isinstance(self.run_s, (int, float)) and self.run_s > 0):
            raise ValueError(f"Quantize(run_s={self.run_s!r}) must be seconds > 0 or None")
        object.__setattr__(self, "_pats", _patterns(self.match))

    def resolve(self, *, mtbf_s: float | None) -> "Quantize":
        """This codec with ``bits="auto"`` replaced by the chosen width (logged)."""
        if self.bits != "auto":
            return self
        bits, why = auto_bits(mtbf_s=mtbf_s, run_s=self.run_s)
        log.info("Quantize(bits='auto'): %s", why)
        return replace(self, bits=bits)

    def selects(self, name, dtype, shape) -> bool:
        return dtype in FLOATS and len(shape) >= 2 and matches(self._pats, name)

    def encode(self, name: str, parts: dict, dtype: torch.dtype) -> tuple[dict, dict | None]:
        if self.bits == "auto":
            raise RuntimeError("Quantize(bits='auto') must be resolved by the Checkpointer before encoding")
        raw = parts["data"]
        if raw.size == 0:   # no rows (an increment where none changed): nothing to quantize
            return parts, None
        k = raw.shape[0]
        x = as_float(raw, dtype).reshape(k, -1).astype(np.float32, copy=False)
        if x.size == 0:
            return parts, None
        if not np.isfinite(x).all():
            log.warning("Quantize: tensor %r holds non-finite values; written unquantized", name)
            return parts, None
        lo, scale = row_ranges(x, self.bits, self.method)
        q = _quantize(x, lo, scale, (1 << self.bits) - 1)
        out = {k2: v for k2, v in parts.items() if k2 != "data"}
        out.update(q=pack(q, self.bits), lo=lo, scale=scale)
        return out, {"name": self.name, "bits": self.bits, "method": self.method,
                     "rows_shape": list(raw.shape)}

    @staticmethod
    def decode(parts: dict, meta: dict, ctx) -> dict:
        shape = tuple(meta["rows_shape"])
        bits = meta["bits"]
        k = shape[0]
        n = math.prod(shape)
        lo, scale, q = parts.get("lo"), parts.get("scale"), parts.get("q")
        if bits not in (8, 4, 2) or lo is None or scale is None or q is None or lo.shape != (k,) \
                or scale.shape != (k,) or len(q) * (8 // bits) < n:
            raise CheckpointError(f"{ctx.where}: tensor {ctx.name!r}: quantized parts do not fit {shape}")
        codes = unpack(q, bits, n).reshape(k, -1) if k else np.zeros((0, 0), np.uint8)
        x = _dequantize(codes, lo, scale).reshape(shape)
        out = {k2: v for k2, v in parts.items() if k2 not in ("q", "lo", "scale")}
        out["data"] = from_float(x, ctx.dtype)
        return out


def per_row_bound(x: np.ndarray, bits: int) -> np.ndarray:
    """The uniform method's per-element error bound for each row of a 2-D float array."""
    return (x.max(axis=1) - x.min(axis=1)) / ((1 << bits) - 1) / 2



