"""The on-storage format's pure checks: manifest paths, safetensors headers, shard layout."""

from __future__ import annotations

import io

import pytest
import safetensors.torch
import torch

from cfdist.checkpoint.format import (
    FORMAT, CheckpointError, parse_safetensors_header, safetensors_header, validate_manifest,
)
from cfdist.checkpoint.snapshot import plan_layout


def manifest(file: str = "shard-00000-of-00001.safetensors", root=0) -> dict:
    return {"format": FORMAT, "step": 3, "skeleton": {}, "shards": [{"file": file, "root": root, "bytes": 8}],
            "tensors": {"w": {"shard": 0, "dtype": "F32", "shape": [2], "offset": 0, "nbytes": 8}}}


def test_a_valid_manifest_passes():
    assert validate_manifest(manifest(), where="m")["step"] == 3


@pytest.mark.parametrize("name", [
    "../../x", "/etc/passwd", "..", "./shard-00000-of-00001.safetensors", "sub/shard-00000-of-00001.safetensors",
    "..\\shard-00000-of-00001.safetensors", "shard-00000-of-00001.safetensors/../../x", "MANIFEST.json",
    "shard-0-of-1.safetensors", "", None, 7,
])
def test_a_shard_name_that_could_leave_the_step_directory_is_refused(name):
    with pytest.raises(CheckpointError, match="unsafe or unexpected shard file"):
        validate_manifest(manifest(file=name), where="m")


@pytest.mark.parametrize("change, why", [
    (lambda m: m.update(format="other/9"), "unknown checkpoint format"),
    (lambda m: m.pop("tensors"), "lacks 'tensors'"),
    (lambda m: m.update(shards=[]), "no shards"),
    (lambda m: m["shards"][0].update(root=-1), "invalid root"),
    (lambda m: m["tensors"]["w"].update(shard=5), "shard that does not exist"),
    (lambda m: m["tensors"]["w"].update(dtype="PICKLE"), "unknown dtype"),
    (lambda m: m["tensors"]["w"].update(nbytes=7), "inconsistent shape"),
    (lambda m: m["tensors"]["w"].update(shape=[3]), "inconsistent shape"),
    (lambda m: m["tensors"]["w"].update(shape=[-2]), "inconsistent shape"),
    (lambda m: m["tensors"]["w"].update(offset=-8), "inconsistent shape"),
    (lambda m: m["tensors"]["w"].update(offset="0"), "inconsistent shape"),
])
def test_a_malformed_manifest_is_refused_with_the_reason(change, why):
    m = manifest()
    change(m)
    with pytest.raises(CheckpointError, match=why):
        validate_manifest(m, where="m")


def test_shard_bytes_are_a_plain_safetensors_file():
    """Header + arena bytes, as persist writes them, load with ``safetensors.torch.load``."""
    tensors = {"a": torch.arange(6, dtype=torch.float32).reshape(2, 3), "b": torch.tensor([1, 2], dtype=torch.int16),
               "c": torch.ones(3, dtype=torch.float64), "d": torch.zeros(0)}
    (entries,) = plan_layout(tensors, 1)
    data = bytearray(sum(e.nbytes for e in entries))
    for e in entries:
        data[e.offset:e.offset + e.nbytes] = tensors[e.name].numpy().tobytes()
    raw = safetensors_header(entries, {"step": "3"}) + bytes(data)
    loaded = safetensors.torch.load(raw)
    assert loaded.keys() == tensors.keys()
    for k, t in tensors.items():
        assert torch.equal(loaded[k], t)
    start, hdr = parse_safetensors_header(raw, where="x")
    assert start % 8 == 0 and hdr["__metadata__"] == {"step": "3"}


@pytest.mark.parametrize("zipfile", [True, False])
def test_a_pickle_is_not_taken_for_a_safetensors_header(zipfile):
    buf = io.BytesIO()
    torch.save({"w": torch.ones(2)}, buf, _use_new_zipfile_serialization=zipfile)
    with pytest.raises(CheckpointError, match="not a safetensors file"):
        parse_safetensors_header(buf.getvalue(), where="shard")


@pytest.mark.parametrize("head", [b"", b"\x05\x00", b"\x04\x00\x00\x00\x00\x00\x00\x00[1] ",
                                  b"\x04\x00\x00\x00\x00\x00\x00\x00\xff\xfe\xfd\xfc"])
def test_garbage_headers_are_refused(head):
    with pytest.raises(CheckpointError, match="not a safetensors file"):
        parse_safetensors_header(head, where="shard")


def test_layout_is_pure_balanced_and_aligned():
    tensors = {f"t{i}": torch.zeros(n, dtype=dt) for i, (n, dt) in
               enumerate([(100, torch.float32), (7, torch.float16), (50, torch.float64), (3, torch.int8), (64, torch.float32)])}
    a, b = plan_layout(tensors, 2), plan_layout({k: torch.ones_like(t) for k, t in tensors.items()}, 2)
    assert a == b    # names, dtypes and shapes decide; values do not
    assert sorted(e.name for s in a for e in s) == sorted(tensors)
    loads = [sum(e.nbytes for e in s) for s in a]
    assert max(loads) - min(loads) <= max(t.numel() * t.element_size() for t in tensors.values())
    for s in a:
        for e in s:
            assert e.offset % tensors[e.name].element_size() == 0
        assert all(x.offset + x.nbytes <= y.offset for x, y in zip(s, s[1:]))
