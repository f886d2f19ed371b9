"""Frames: codecs encoding a tensor window by window (under a host-memory budget) and decoding it
frame by frame. Real codecs, a real ``file://`` storage for the chain plans; no Checkpointer."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from cfdist.checkpoint.codecs import chain
from cfdist.checkpoint.codecs.base import DecodeContext
from cfdist.checkpoint.codecs.pipeline import (
    EncodeSession,
    TensorFrames,
    _decode_frames,
)
from cfdist.checkpoint.codecs.quantize import per_row_bound
from cfdist.checkpoint.format import CheckpointError, TensorEntry
from cfdist.codecs import Incremental, Quantize, Zstd
from cfdist.storage import open_storage


def _encode(session, e: TensorEntry, x: np.ndarray, cuts: list[int]):
    """``x``'s bytes cut at byte offsets ``cuts`` (as windows would cut them), framed."""
    f = TensorFrames(session, e)
    raw = x.reshape(-1).view(np.uint8)
    blob = b"".join(bytes(b) for a, z in zip([0, *cuts], [*cuts, raw.nbytes])
                    for b, _ in f.encode(a, raw[a:z]))
    return f, np.frombuffer(blob, dtype=np.uint8)


def _ctx(e, load_ref=None):
    return DecodeContext(e.name, e.dtype, tuple(e.shape), "test", load_ref)


def test_a_window_cut_gives_whole_rows_and_the_parts_of_rows_at_its_edges(tmp_path):
    session = EncodeSession(open_storage(f"file://{tmp_path}"), 1, (Zstd(),), "s")
    e = TensorEntry("t", 0, torch.float32, (10, 6), 0, 240)
    f = TensorFrames(session, e)
    assert list(f._pieces(3, 40)) == [(3, 6, (1, 3)), (6, 36, (5, 6)), (36, 40, (1, 4))]
    assert list(f._pieces(0, 60)) == [(0, 60, (10, 6))]   # the whole tensor: its own shape
    assert list(f._pieces(12, 24)) == [(12, 24, (2, 6))]


def test_quantized_and_compressed_frames_decode_within_the_row_bound(tmp_path):
    """Windows cut rows anywhere: each segment is quantized with its own range, so every element
    stays within half a level of its whole row's range."""
    rng = np.random.default_rng(0)
    x = rng.standard_normal((100, 33)).astype(np.float32)
    session = EncodeSession(open_storage(f"file://{tmp_path}"), 1, (Quantize(bits=4), Zstd()), "s")
    e = TensorEntry("emb", 0, torch.float32, x.shape, 0, x.nbytes)
    f, blob = _encode(session, e, x, [4 * 50, 4 * 1000, 4 * 2001])
    assert {tuple(fr[4]) for fr in f.frames} >= {(1, 16), (1, 17)}   # rows cut at 50 and 2001
    got = _decode_frames(blob, f.frames, _ctx(e))
    assert (np.abs(got - x) <= per_row_bound(x, 4)[:, None] * (1 + 1e-5) + 1e-6).all()
    assert {"name": "quantize"} in f.extra()["codecs"]


def test_incremental_frames_encode_against_the_same_elements_of_the_reference(tmp_path):
    """A full checkpoint's frames become the reference at its commit; the next one's frames hold
    only the rows that changed and decode bit-exact against it."""
    st = open_storage(f"file://{tmp_path}")
    rng = np.random.default_rng(1)
    x = rng.standard_normal((64, 8)).astype(np.float32)
    e = TensorEntry("emb", 0, torch.float32, x.shape, 0, x.nbytes)
    s1 = EncodeSession(st, 1, (Incremental(full_every=None),), "chain-test")
    _, blob1 = _encode(s1, e, x, [4 * 100, 4 * 300])
    (tmp_path / "step-000000001").mkdir()
    (tmp_path / "step-000000001" / "MANIFEST.json").write_text("{}")   # committed, as the plan checks
    s1.commit()
    assert np.array_equal(chain.states_for(st.url, "chain-test")["incremental"].refs["emb"], x)
    y = x.copy()
    y[[3, 40]] += 1
    s2 = EncodeSession(st, 2, (Incremental(full_every=None),), "chain-test")
    inc, blob2 = _encode(s2, e, y, [4 * 100, 4 * 300])
    assert blob2.nbytes < blob1.nbytes / 4
    got = _decode_frames(blob2, inc.frames, _ctx(e, lambda step, ckpt_id: x))
    assert np.array_equal(got, y)
    chain.forget(st.url)


def test_frames_that_do_not_tile_the_tensor_are_refused(tmp_path):
    session = EncodeSession(open_storage(f"file://{tmp_path}"), 1, (Zstd(),), "s")
    x = np.arange(64, dtype=np.float32).reshape(8, 8)
    e = TensorEntry("t", 0, torch.float32, x.shape, 0, x.nbytes)
    f, blob = _encode(session, e, x, [128])
    with pytest.raises(CheckpointError, match="does not follow element"):
        _decode_frames(blob, [f.frames[1], f.frames[0]], _ctx(e))
    with pytest.raises(CheckpointError, match="frames hold 32 of 64"):
        _decode_frames(blob, f.frames[:1], _ctx(e))
    bad = [list(f.frames[0]), f.frames[1]]
    bad[0][1] = 10 ** 9   # runs past the payload
    with pytest.raises(CheckpointError, match="does not fit"):
        _decode_frames(blob, bad, _ctx(e))
