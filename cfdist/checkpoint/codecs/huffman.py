"""Canonical Huffman coding of small-alphabet symbol arrays, vectorised with numpy.

Used by :class:`~cfdist.checkpoint.codecs.lcdelta.LCDelta` (at most 2^7 symbols). Code lengths
are limited to :data:`MAX_LEN` bits so decoding is one table lookup per symbol. The stream is
cut into blocks of ``block`` symbols whose starting bit offsets are stored, so all blocks are
decoded in lock step: ``block`` numpy iterations over ``n / block`` lanes (``block ~ sqrt(n)``).
"""

from __future__ import annotations

import heapq
import math

import numpy as np

MAX_LEN = 16
_CHUNK = 1 << 20


def code_lengths(counts: np.ndarray, limit: int = MAX_LEN) -> np.ndarray:
    """Huffman code length per symbol (0 for absent symbols), none longer than ``limit``."""
    counts = np.asarray(counts, dtype=np.int64)
    present = np.flatnonzero(counts)
    lens = np.zeros(len(counts), dtype=np.uint8)
    if len(present) == 0:
        return lens
    if len(present) == 1:
        lens[present[0]] = 1
        return lens
    c = counts.copy()
    while True:
        heap = [(int(c[s]), int(s), (int(s),)) for s in present]
        heapq.heapify(heap)
        depth = dict.fromkeys(map(int, present), 0)
        while len(heap) > 1:
            a, ia, sa = heapq.heappop(heap)
            b, ib, sb = heapq.heappop(heap)
            for s in sa + sb:
                depth[s] += 1
            heapq.heappush(heap, (a + b, min(ia, ib), sa + sb))
        if max(depth.values()) <= limit:
            break
        c = np.where(c > 0, (c >> 1) | 1, 0)   # flatten the distribution until it fits
    for s, d in depth.items():
        lens[s] = d
    return lens


def canonical_codes(lens: np.ndarray) -> np.ndarray:
    """Canonical code values for ``lens`` (shorter codes first, then by symbol)."""
    codes = np.zeros(len(lens), dtype=np.uint32)
    code, prev = 0, 0
    for s in sorted(np.flatnonzero(lens), key=lambda s: (lens[s], s)):
        code <<= int(lens[s]) - prev
        prev = int(lens[s])
        codes[s] = code
        code += 1
    return codes


def block_size(n: int) -> int:
    return 2 * max(32, math.isqrt(max(n, 1)) // 2)      # even: blocks start on a symbol pair


def encode(sym: np.ndarray, nsym: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, int]:
    """``(lens, payload, block_offsets, block)`` for a 1-D uint8 symbol array."""
    sym = np.ascontiguousarray(sym, dtype=np.uint8).ravel()
    n = len(sym)
    lens = code_lengths(np.bincount(sym, minlength=nsym))
    codes = canonical_codes(lens).astype(np.uint64)
    block = block_size(n)
    if n == 0:
        return lens, np.zeros(0, dtype=np.uint8), np.zeros(0, dtype=np.int64), block
    # Symbols are coded in pairs (at most 2 * MAX_LEN = 32 bits per pair): half the elements.
    k = len(lens)
    pair_len = (lens[:, None].astype(np.int64) + lens[None, :]).ravel()
    pair_code = ((codes[:, None] << lens[None, :].astype(np.uint64)) | codes[None, :]).ravel()
    padded = np.concatenate([sym, np.zeros(n % 2, dtype=np.uint8)])
    if n % 2:
        pair_len = pair_len.copy()
    pairs = padded[0::2].astype(np.int64) * k + padded[1::2]
    L = pair_len[pairs]
    if n % 2:   # the padding symbol contributes no bits
        L[-1] = lens[sym[-1]]
    end = np.cumsum(L)
    pos = end - L
    total = int(end[-1])
    # Codes never overlap, so each one is added into the 32-bit big-endian words it straddles
    # (bincount sums in float64: exact below 2^53).
    nw = total // 32 + 3
    words = np.zeros(nw, dtype=np.float64)
    for a in range(0, len(pairs), _CHUNK):
        Lc, Pc = L[a:a + _CHUNK].astype(np.uint64), pos[a:a + _CHUNK]
        c = pair_code[pairs[a:a + _CHUNK]]
        if n % 2 and a + _CHUNK >= len(pairs):
            c = c.copy()
            c[-1] = codes[sym[-1]]
        sh = (Pc & 31).astype(np.uint64)
        v_hi = c << (np.uint64(64) - sh - Lc)      # sh + L <= 31 + 32: fits in 64 bits
        w = Pc >> 5
        words += np.bincount(w, weights=(v_hi >> np.uint64(32)).astype(np.float64), minlength=nw)
        words += np.bincount(w + 1, weights=(v_hi & np.uint64(0xFFFFFFFF)).astype(np.float64), minlength=nw)
    payload = words.astype(np.uint64).astype(">u4").view(np.uint8)[:(total + 7) // 8].copy()
    return lens, payload, pos[::block // 2].astype(np.int64), block


def decode(payload: np.ndarray, lens: np.ndarray, offsets: np.ndarray, n: int, block: int) -> np.ndarray:
    """Inverse of :func:`encode`: ``n`` uint8 symbols."""
    if n == 0:
        return np.zeros(0, dtype=np.uint8)
    lens = np.asarray(lens, dtype=np.uint8)
    lmax = int(lens.max())
    if lmax == 0 or lmax > MAX_LEN:
        raise ValueError(f"Huffman code lengths must be in 1..{MAX_LEN}, got max {lmax}")
    codes = canonical_codes(lens)
    sym_tab = np.zeros(1 << lmax, dtype=np.uint8)
    len_tab = np.ones(1 << lmax, dtype=np.int64)
    for s in np.flatnonzero(lens):
        lo = int(codes[s]) << (lmax - int(lens[s]))
        hi = (int(codes[s]) + 1) << (lmax - int(lens[s]))
        sym_tab[lo:hi] = s
        len_tab[lo:hi] = lens[s]
    nb = -(-n // block)
    if len(offsets) != nb:
        raise ValueError(f"expected {nb} block offsets for {n} symbols, got {len(offsets)}")
    buf = np.concatenate([np.asarray(payload, dtype=np.uint8),
                          np.zeros(block * lmax // 8 + 4, dtype=np.uint8)]).astype(np.uint32)
    p = np.asarray(offsets, dtype=np.int64).copy()
    out = np.empty((nb, block), dtype=np.uint8)
    mask = (1 << lmax) - 1
    for j in range(block):
        b = p >> 3
        w = ((buf[b] << 16) | (buf[b + 1] << 8) | buf[b + 2]) >> (24 - lmax - (p & 7)).astype(np.uint32)
        w &= mask
        out[:, j] = sym_tab[w]
        p += len_tab[w]
    return out.ravel()[:n]
