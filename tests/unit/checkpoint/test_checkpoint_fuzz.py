"""Untrusted checkpoints, fuzzed: forged manifests and tensor files give a clear CheckpointError.

Property tests over the real reading path (``tests/fuzz_targets.py``, shared with
``bench/fuzz.py``, which runs the same targets for millions of cases): a few thousand cases in
all, derandomized so CI is reproducible. Plus the specific attacks by name: deep nesting, huge
headers, huge shapes, sizes that disagree with dtype x shape.
"""

from __future__ import annotations

import json
import struct

import pytest
import torch
from hypothesis import HealthCheck, given, settings, strategies as st

from cfdist.checkpoint import discovery
from cfdist.checkpoint.format import MANIFEST, CheckpointError, parse_safetensors_header, seal_manifest, step_dir
from tests import fuzz_targets as ft

CI = settings(max_examples=400, deadline=None, database=None, derandomize=True,
              suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
CHEAP = settings(CI, max_examples=800)   # 2,400 cases in all


@CHEAP
@given(ft.MANIFEST_BYTES)
def test_fuzz_manifest_bytes(raw):
    ft.manifest_bytes(raw)


@CI
@given(ft.mutated_manifest(), st.booleans())
def test_fuzz_manifest_structure(m, seal):
    ft.manifest_object(m, seal=seal)


@CI
@given(ft.mutated_manifest(sliced=True))
def test_fuzz_sliced_manifest_split(m):
    ft.sliced_manifest_object(m)


def test_the_valid_sliced_checkpoint_reads_and_joins_its_pieces():
    m, shard = ft.sliced_checkpoint()
    ft._put(seal_manifest(m), shard)
    got = discovery.read_tensors([ft.storage()], ft.STEP, discovery.read_manifest([ft.storage()], ft.STEP))
    assert set(got) == {"model/w"}   # its two pieces, joined
    assert torch.equal(got["model/w"], torch.arange(6, dtype=torch.float32).reshape(2, 3))


@CHEAP
@given(ft.SHARD_BYTES)
def test_fuzz_shard_bytes(shard):
    ft.shard_bytes(shard)


@CI
@given(ft.forged_header(), st.booleans())
def test_fuzz_safetensors_header(hdr_data, sync):
    ft.header_object(*hdr_data, sync_manifest=sync)


def _refused(manifest: dict | None = None, shard: bytes | None = None, raw_manifest: bytes | None = None) -> str:
    m, s = ft.valid_checkpoint()
    ft._put(raw_manifest if raw_manifest is not None else seal_manifest(manifest if manifest is not None else m),
            shard if shard is not None else s)
    sts = [ft.storage()]
    with pytest.raises(CheckpointError) as ei:
        man = discovery.read_manifest(sts, ft.STEP)
        discovery.decode_state(man, discovery.read_tensors(sts, ft.STEP, man), where="t")
    return str(ei.value)


def test_the_valid_checkpoint_reads():
    m, s = ft.valid_checkpoint()
    ft._put(seal_manifest(m), s)
    man = discovery.read_manifest([ft.storage()], ft.STEP)
    state, _ = discovery.decode_state(man, discovery.read_tensors([ft.storage()], ft.STEP, man), where="t")
    assert state["model"]["w"].tolist() == [[0, 1, 2], [3, 4, 5]] and state["n"] == 3


@pytest.mark.parametrize("depth", [10_000, 200_000])
def test_deeply_nested_json_is_refused_not_a_recursion_crash(depth):
    assert "nests too deeply" in _refused(raw_manifest=b"[" * depth + b"]" * depth)
    m, _ = ft.valid_checkpoint()
    raw = json.dumps(m).encode().replace(b'"n": 3', b'"n": ' + b"[" * depth + b"]" * depth)
    assert "nests too deeply" in _refused(raw_manifest=raw)
    _, s = ft.valid_checkpoint()
    hdr = b"[" * depth + b"]" * depth
    assert "nests too deeply" in _refused(shard=struct.pack("<Q", len(hdr)) + hdr)


@pytest.mark.parametrize("n", [2 ** 63, 2 ** 64 - 1, (100 << 20) + 1, 10 ** 9])
def test_a_huge_header_length_is_refused_before_reading_it(n):
    _, s = ft.valid_checkpoint()
    assert "not a safetensors file" in _refused(shard=struct.pack("<Q", n) + s[8:])


@pytest.mark.parametrize("shape, nbytes", [([2 ** 40, 2 ** 40], 2 ** 82), ([2 ** 62, 4], 2 ** 66), ([10 ** 6] * 3, 4 * 10 ** 18)])
def test_a_huge_shape_is_refused_before_any_allocation(shape, nbytes):
    """A forged shape whose size fits no file: refused by size checks, so nothing is allocated."""
    m, _ = ft.valid_checkpoint()
    m["tensors"]["model/w"].update(shape=shape, nbytes=nbytes)
    msg = _refused(m)
    assert "inconsistent shape" in msg or "does not match the manifest" in msg, msg
    m, _ = ft.valid_checkpoint()
    m["skeleton"]["x"] = {"__small__": {"dtype": "torch.float32", "shape": [10 ** 7, 10 ** 7], "b64": ""}}
    assert "skeleton is malformed" in _refused(m)


@pytest.mark.parametrize("shape", [[2 ** 62, 2 ** 62, 0], [0, 2 ** 63 - 1, 2]])
def test_an_empty_tensor_with_overflowing_dims_is_refused(shape):
    """Found by bench/fuzz.py: zero elements, but torch's size arithmetic overflowed (RuntimeError)."""
    m, _ = ft.valid_checkpoint()
    m["tensors"]["model/e"].update(shape=shape, nbytes=0)
    assert "inconsistent shape" in _refused(m)


@pytest.mark.parametrize("field, value", [("nbytes", 20), ("shape", [2, 2]), ("dtype", "F64"), ("offset", 10 ** 6)])
def test_sizes_that_disagree_with_dtype_times_shape_are_refused(field, value):
    m, _ = ft.valid_checkpoint()
    m["tensors"]["model/w"][field] = value
    msg = _refused(m)
    assert "model/w" in msg and ("inconsistent" in msg or "does not match" in msg or "truncated" in msg), msg


def test_a_header_entry_whose_range_disagrees_with_its_dtype_and_shape_is_refused():
    hdr = {"t": {"dtype": "F32", "shape": [4], "data_offsets": [0, 8]}}
    raw = json.dumps(hdr).encode()
    with pytest.raises(CheckpointError, match=r"entry 't' is malformed"):
        parse_safetensors_header(struct.pack("<Q", len(raw)) + raw + bytes(16), where="f")


def test_a_manifest_that_is_a_directory_is_refused():
    st = ft.storage()
    st.remove(step_dir(ft.STEP))
    st.makedirs(f"{step_dir(ft.STEP)}/{MANIFEST}")
    with pytest.raises((CheckpointError, IsADirectoryError, FileNotFoundError)):
        discovery.read_manifest([st], ft.STEP)
    st.remove(step_dir(ft.STEP))
