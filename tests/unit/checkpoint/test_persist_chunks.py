"""The shard writer's chunk stream: bytes in order, each tensor's xxh3 right over many chunks."""

from __future__ import annotations

import numpy as np
import torch
import xxhash

from cfdist.checkpoint import persist
from cfdist.checkpoint.format import TensorEntry


def test_chunks_and_checksums_over_many_chunks(monkeypatch):
    monkeypatch.setattr(persist, "_CHUNK", 1000)   # tensors of several chunks, one of a partial chunk
    rng = np.random.default_rng(0)
    arena = rng.integers(0, 256, size=10_000, dtype=np.uint8)
    entries = [TensorEntry("a", 0, torch.float32, (1000,), 0, 4000),
               TensorEntry("b", 0, torch.uint8, (3500,), 4000, 3500),
               TensorEntry("c", 0, torch.uint8, (2500,), 7500, 2500)]
    sums: dict = {}
    out = b"".join(bytes(c) for c in persist._shard_chunks(b"HDR", arena, entries, sums))
    assert out == b"HDR" + arena.tobytes()
    for e in entries:
        assert sums[e.name] == xxhash.xxh3_64(arena[e.offset:e.offset + e.nbytes].tobytes()).hexdigest()
