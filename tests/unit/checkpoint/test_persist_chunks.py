"""The shard writer's chunk stream: bytes in order, each tensor's xxh3 right over many chunks."""

from __future__ import annotations

import numpy as np
import pytest
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


def _entries():
    return [TensorEntry("a", 0, torch.float32, (1000,), 0, 4000),
            TensorEntry("b", 0, torch.uint8, (3500,), 4000, 3500),
            TensorEntry("c", 0, torch.uint8, (2500,), 7500, 2500)]


def test_checksums_on_the_hashing_thread_in_several_updates(monkeypatch):
    """The hashing thread's steps cut tensors anywhere: the sums are those of the whole tensors."""
    monkeypatch.setattr(persist, "_CHUNK", 1000)
    monkeypatch.setattr(persist, "_HASH_STEP", 700)
    arena = np.random.default_rng(1).integers(0, 256, size=10_000, dtype=np.uint8)
    sums: dict = {}
    out = b"".join(bytes(c) for c in persist._shard_chunks(b"", arena, _entries(), sums))
    assert out == arena.tobytes()
    assert sums == {e.name: xxhash.xxh3_64(arena[e.offset:e.offset + e.nbytes].tobytes()).hexdigest()
                    for e in _entries()}


def test_a_write_that_fails_midway_stops_the_hashing_thread(monkeypatch):
    """The writer gives up after one window (a storage error): the hashing thread is gone when the
    stream is closed (it must not read the arena after the persist ends) and no sums are given."""
    import threading

    monkeypatch.setattr(persist, "_CHUNK", 1000)
    monkeypatch.setattr(persist, "_HASH_STEP", 100)
    arena = np.zeros(10_000, dtype=np.uint8)
    sums: dict = {}
    gen = persist._shard_chunks(b"H", arena, _entries(), sums)
    next(gen), next(gen)
    gen.close()
    assert not [t for t in threading.enumerate() if t.name == "cfdist-xxh3"]
    assert sums == {}


def test_an_error_on_the_hashing_thread_reaches_the_writer(monkeypatch):
    class Boom(RuntimeError):
        pass

    class BadHash:
        def update(self, _):
            raise Boom("hash failed")

    monkeypatch.setattr(persist.xxhash, "xxh3_64", BadHash)
    arena = np.zeros(10_000, dtype=np.uint8)
    with pytest.raises(Boom, match="hash failed"):
        for _ in persist._shard_chunks(b"", arena, _entries(), {}):
            pass
